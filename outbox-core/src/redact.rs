//! Keeping secrets out of logs.

/// `url` with every secret replaced by `***`: the password of `scheme://user:password@host/path`
/// (`scheme://user:***@host/path`), and the value of every query parameter whose name says it is a
/// secret ([`is_secret_name`]: `?password=...`, `&sslpassword=...`, which libpq and sqlx accept).
///
/// The user part is read as URL parsers read it: the authority runs to the first `/`, `?` or `#`,
/// its user part to its last `@` (so a password may hold an unencoded `@` or `:`). A password holding
/// an unencoded `/`, `?` or `#` makes the URL malformed (the authority then ends inside it);
/// parsers reject or misread it and print it back in their errors, so where a password is followed
/// by another `@` past the authority, everything from the password to the last `@` of the URL is
/// hidden, even when that `@` was in the query (the host is then hidden too: safe, if less
/// helpful). Known gap: a password made of digits up to its first unencoded `/`, `?` or `#`, with no
/// `@` of its own before it, reads as a port, and is shown.
/// Text that is not a URL is returned unchanged.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    // Where the user part ends when the URL is malformed by a password holding an unencoded `/`,
    // `?` or `#`: the last `@` of the URL, past the authority.
    let last_at = rest.rfind('@').filter(|at| *at >= authority_end);
    let (shown_user, after_user) = match (authority.rfind('@'), authority.split_once(':')) {
        // A password, and another `@` past the authority: the password may hold an unencoded `/`,
        // `?` or `#` (then the host is past that `@`) or the query an `@`; which one cannot be
        // told, so everything up to the last `@` is hidden (the host shown may then be the query's).
        (Some(at), Some((user, _))) if user.len() < at && last_at.is_some() => {
            (Some(user), &rest[last_at.unwrap_or(at)..])
        }
        // user[:password]@host: a well-formed user part.
        (Some(at), _) => match authority[..at].split_once(':') {
            Some((user, _)) => (Some(user), &rest[at..]),
            None => (None, rest),
        },
        // `user:pa/ss@host`: unless the authority reads `host:port`, what follows the `:` is the
        // start of a password cut short.
        (None, Some((user, after))) => match last_at {
            Some(at) if !(is_host_name(user) && is_port(after)) => (Some(user), &rest[at..]),
            _ => (None, rest),
        },
        (None, None) => (None, rest),
    };
    match shown_user {
        Some(user) => format!("{scheme}://{user}:***{}", redact_query(after_user)),
        None => format!("{scheme}://{}", redact_query(rest)),
    }
}

/// Whether `text` is a port: digits, at least one.
fn is_port(text: &str) -> bool {
    !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit())
}

/// Whether `text` reads as a host name or IPv4 address.
fn is_host_name(text: &str) -> bool {
    !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~%".contains(&b))
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
        // An `@` in the query is not the end of a user part: the host stays, query secrets go.
        assert_eq!(
            redact_url("postgres://app@db:5432/shop?application_name=a@b&password=hunter2"),
            "postgres://app@db:5432/shop?application_name=a@b&password=***"
        );
        assert_eq!(
            redact_url("postgres://db:5432/shop?password=ab@cdefgh"),
            "postgres://db:5432/shop?password=***"
        );
        // Ambiguous (a password, and an `@` later): hidden up to the last `@`, host included.
        assert_eq!(
            redact_url("postgres://app:pw@db.internal:5432/shop?application_name=relay@prod"),
            "postgres://app:***@prod"
        );
        assert_eq!(
            redact_url("postgres://user@host/db?options=-c%20a%3Db"),
            "postgres://user@host/db?options=-c%20a%3Db"
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
            // The documented gap: digits up to the first unencoded `/`, `?` or `#` read as a port.
            let head = password.split(['/', '?', '#']).next().unwrap_or("");
            let raw_ok = !(password.contains(['/', '?', '#'])
                && !head.is_empty()
                && head.bytes().all(|b| b.is_ascii_digit()));
            // (whether the password stands raw in the user part, the URL)
            let forms = [
                (true, format!("postgres://app:{password}@db:5432/shop")),
                (
                    false,
                    format!("postgres://app:{encoded}@db:5432/shop?sslmode=require"),
                ),
                (
                    true,
                    format!("postgresql://app:{password}@db/shop?application_name=x"),
                ),
                (false, format!("postgres://app@db/shop?password={encoded}")),
                (
                    false,
                    format!("postgres://db/shop?sslmode=require&password={encoded}&x=1"),
                ),
                (
                    false,
                    format!("postgres:///shop?host=/run/postgresql&password={encoded}"),
                ),
                (
                    false,
                    format!(
                        "postgres://db/shop?password={}",
                        password.replace('&', "%26")
                    ),
                ),
                (
                    false,
                    format!(
                        "postgres://db:5432/shop?application_name=a@b&password={}",
                        password.replace('&', "%26")
                    ),
                ),
                (true, format!("amqp://relay:{password}@127.0.0.1:5672/%2f")),
                (
                    false,
                    format!("amqps://relay:{encoded}@broker/vhost?heartbeat=10"),
                ),
            ];
            for (raw, url) in forms {
                if raw && !raw_ok {
                    continue;
                }
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
