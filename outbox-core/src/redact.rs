//! Keeping secrets out of logs.

/// `url` with the password (if any) replaced by `***`: `scheme://user:***@host/path`.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (authority, tail) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match authority.rsplit_once('@') {
        Some((userinfo, host)) if userinfo.contains(':') => {
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{scheme}://{user}:***@{host}{tail}")
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_masked() {
        assert_eq!(
            redact_url("amqp://guest:s3cret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact_url("postgres://app:p@ss@db/shop"),
            "postgres://app:***@db/shop"
        );
        assert_eq!(
            redact_url("postgres://app@db/shop"),
            "postgres://app@db/shop"
        );
        assert_eq!(redact_url("amqp://127.0.0.1"), "amqp://127.0.0.1");
        assert_eq!(redact_url("not a url"), "not a url");
    }
}
