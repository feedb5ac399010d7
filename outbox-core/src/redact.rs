//! Keeping secrets out of logs.

/// `url` with every secret replaced by `***`: the password of `scheme://user:password@host/path`
/// (`scheme://user:***@host/path`), and the value of every query parameter whose name says it is a
/// secret ([`is_secret_name`]: `?password=...`, `&sslpassword=...`, which libpq and sqlx accept).
///
/// Errs on the side of hiding: the password runs from the first `:` of the user part to the *last*
/// `@` of the URL, so a password holding an unencoded `/`, `@`, `?` or `#` (which URL parsers reject
/// or misread, and print back in their errors) is hidden whole. Text that is not a URL is returned
/// unchanged.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let rest = match rest.rfind('@') {
        Some(at) => {
            let (userinfo, host_and_more) = rest.split_at(at);
            match userinfo.split_once(':') {
                Some((user, _password)) if !user.contains('/') => {
                    format!("{user}:***{host_and_more}")
                }
                _ => rest.to_string(),
            }
        }
        None => rest.to_string(),
    };
    format!("{scheme}://{}", redact_query(&rest))
}

/// `text` with the values of its secret query parameters (`name=value` pairs after the first `?`,
/// separated by `&`) replaced by `***`. A `#` does not end a secret value here: a password holding
/// an unencoded `#` is hidden whole.
fn redact_query(text: &str) -> String {
    let Some((before, query)) = text.split_once('?') else {
        return text.to_string();
    };
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if is_secret_name(&percent_decoded(name)) => format!("{name}=***"),
            _ => pair.to_string(),
        })
        .collect();
    format!("{before}?{}", pairs.join("&"))
}

/// `text` with `%XX` escapes decoded (as far as they are valid), for comparing names.
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Some(b) = text
                .get(i + 1..i + 3)
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
            {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether a setting or parameter named `name` holds a secret, by a rule rather than a list: its
/// name mentions a password, secret, token, credential, JAAS configuration or private key (`.key`,
/// `key.pem`, `keystore`), or it is a SASL setting other than the mechanism and the user name
/// (`sasl.oauthbearer.config`, `sasl.oauthbearer.client.secret`, `sasl.kerberos.keytab`...).
/// Compared without regard to case.
pub fn is_secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    const WORDS: [&str; 8] = [
        "password",
        "passwd",
        "secret",
        "token",
        "credential",
        "jaas",
        "key.pem",
        "keystore",
    ];
    const PUBLIC_SASL: [&str; 5] = [
        "sasl.mechanism",
        "sasl.mechanisms",
        "sasl.username",
        "sasl.kerberos.service.name",
        "sasl.kerberos.principal",
    ];
    WORDS.iter().any(|w| n.contains(w))
        || n.ends_with(".key")
        || n.ends_with("_key")
        || n == "key"
        || (n.starts_with("sasl.") && !PUBLIC_SASL.contains(&n.as_str()))
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

    #[test]
    fn passwords_in_the_query_and_with_unencoded_separators_are_masked() {
        assert_eq!(
            redact_url("postgres://app@db:5432/shop?password=hunter2&sslmode=require"),
            "postgres://app@db:5432/shop?password=***&sslmode=require"
        );
        assert_eq!(
            redact_url("postgres://db/shop?sslmode=require&sslpassword=k3y#x"),
            "postgres://db/shop?sslmode=require&sslpassword=***"
        );
        assert_eq!(
            redact_url("postgres://db/shop?pass%77ord=hunter2"),
            "postgres://db/shop?pass%77ord=***"
        );
        assert_eq!(
            redact_url("postgres://app:pa/ss?w#rd@db/shop"),
            "postgres://app:***@db/shop"
        );
        assert_eq!(
            redact_url("amqp://relay:p@s:s/w@rd@127.0.0.1:5672/%2f"),
            "amqp://relay:***@127.0.0.1:5672/%2f"
        );
    }

    #[test]
    fn secret_names_by_rule() {
        for secret in [
            "sasl.password",
            "SASL.PASSWORD",
            "ssl.key.password",
            "ssl.keystore.password",
            "ssl.key.pem",
            "sasl.oauthbearer.config",
            "sasl.oauthbearer.client.secret",
            "sasl.oauthbearer.extensions",
            "sasl.kerberos.keytab",
            "sasl.jaas.config",
            "password",
            "sslpassword",
            "aws_secret_access_key",
            "session_token",
        ] {
            assert!(is_secret_name(secret), "{secret}");
        }
        for public in [
            "sasl.mechanisms",
            "sasl.username",
            "security.protocol",
            "client.id",
            "ssl.ca.location",
            "ssl.endpoint.identification.algorithm",
            "sslmode",
            "application_name",
        ] {
            assert!(!is_secret_name(public), "{public}");
        }
    }

    /// For random passwords of every character a URL may carry (encoded or not), in every place the
    /// URL forms of sqlx, lapin and librdkafka take one, no byte run of the password of four or more
    /// characters survives redaction.
    #[test]
    fn no_password_survives_redaction() {
        const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&'()*+,;=:@/?#[]% ";
        let mut rng = fastrand::Rng::with_seed(0x5ec7e7);
        for case in 0..20_000 {
            let len = rng.usize(8..24);
            let password: String = (0..len)
                .map(|_| CHARS[rng.usize(..CHARS.len())] as char)
                .collect();
            let encoded: String = password
                .bytes()
                .map(|b| {
                    if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                        (b as char).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect();
            let forms = [
                format!("postgres://app:{password}@db:5432/shop"),
                format!("postgres://app:{encoded}@db:5432/shop?sslmode=require"),
                format!("postgresql://app:{password}@db/shop?application_name=x"),
                format!("postgres://app@db/shop?password={encoded}"),
                format!("postgres://db/shop?sslmode=require&password={encoded}&x=1"),
                format!("postgres:///shop?host=/run/postgresql&password={encoded}"),
                format!(
                    "postgres://db/shop?password={}",
                    password.replace('&', "%26")
                ),
                format!("amqp://relay:{password}@127.0.0.1:5672/%2f"),
                format!("amqps://relay:{encoded}@broker/vhost?heartbeat=10"),
            ];
            for url in forms {
                let shown = redact_url(&url);
                for secret in [&password, &encoded] {
                    let secret: Vec<char> = secret.chars().collect();
                    // Runs of four characters that are not also part of the URL's own text.
                    for run in secret.windows(4) {
                        let run: String = run.iter().collect();
                        let own = url.replacen(&password, "", 1).replacen(&encoded, "", 1);
                        if own.contains(&run) {
                            continue;
                        }
                        assert!(
                            !shown.contains(&run),
                            "case {case}: {url:?} shown as {shown:?} still holds {run:?}"
                        );
                    }
                }
            }
        }
    }
}
