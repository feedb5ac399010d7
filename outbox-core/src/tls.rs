//! A server's certificate refused during the TLS handshake, told apart from other connection
//! failures so that it is reported as the configuration problem it is (a missing CA, a wrong host
//! name), with the setting to fix, instead of as a server to wait for.
//!
//! The rustls clients (sqlx, lapin, the AWS SDK) hand over the verifier's verdict as a typed
//! `rustls::Error`, found in the error's chain ([`certificate_problem`]); OpenSSL through
//! librdkafka gives only its text, read in one place ([`openssl_problem_in`]).

use crate::{Error, ErrorKind};

/// Why a server's certificate was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertificateProblem {
    /// Signed by no CA the client trusts (a private CA not configured, or the wrong one).
    UnknownIssuer,
    /// Valid, but not for the host name the client connected to.
    WrongName,
    /// Expired, or not valid yet.
    Expired,
    /// Refused, the client saying no more (OpenSSL through librdkafka): an unknown CA or a host
    /// name the certificate does not hold.
    Unverified,
}

/// The certificate problem an error (or one of its causes) reports, if any: a `rustls::Error` of
/// a refused certificate, in the chain or inside an `std::io::Error` of it (as tokio-rustls and
/// hyper-rustls wrap it).
pub fn certificate_problem(err: &(dyn std::error::Error + 'static)) -> Option<CertificateProblem> {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(p) = rustls_problem(e) {
            return Some(p);
        }
        if let Some(inner) = e
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
        {
            if let Some(p) = certificate_problem(inner) {
                return Some(p);
            }
        }
        next = e.source();
    }
    None
}

/// The problem a `rustls::Error` reports, when `e` is one about the server's certificate (an alert
/// is the server refusing the client's own certificate, in mutual TLS: not a CA or a host name to
/// set here).
fn rustls_problem(e: &(dyn std::error::Error + 'static)) -> Option<CertificateProblem> {
    use rustls::CertificateError as C;
    let rustls::Error::InvalidCertificate(c) = e.downcast_ref::<rustls::Error>()? else {
        return None;
    };
    Some(match c {
        C::UnknownIssuer => CertificateProblem::UnknownIssuer,
        C::NotValidForName | C::NotValidForNameContext { .. } => CertificateProblem::WrongName,
        C::Expired | C::ExpiredContext { .. } | C::NotValidYet | C::NotValidYetContext { .. } => {
            CertificateProblem::Expired
        }
        _ => CertificateProblem::Unverified,
    })
}

/// The certificate problem an OpenSSL message reports (librdkafka gives no more than its text).
pub fn openssl_problem_in(text: &str) -> Option<CertificateProblem> {
    let t = text.to_ascii_lowercase();
    // An alert is the server refusing the client's own certificate (mutual TLS).
    if t.contains(" alert ") || t.contains("alert certificate") {
        return None;
    }
    if t.contains("hostname mismatch") {
        Some(CertificateProblem::WrongName)
    } else if t.contains("unable to get local issuer certificate")
        || t.contains("self-signed certificate")
        || t.contains("self signed certificate")
    {
        Some(CertificateProblem::UnknownIssuer)
    } else if t.contains("certificate has expired") || t.contains("certificate is not yet valid") {
        Some(CertificateProblem::Expired)
    } else if t.contains("certificate verify failed") {
        // OpenSSL's verdict as librdkafka reports it, without the reason.
        Some(CertificateProblem::Unverified)
    } else {
        None
    }
}

/// Where a server is configured: for the error that names what to fix.
#[derive(Debug, Clone, Copy)]
pub struct TlsSettings<'a> {
    /// What the server is ("PostgreSQL", "RabbitMQ", ...).
    pub server: &'a str,
    /// The host the client connected to (empty when not known).
    pub host: &'a str,
    /// The setting that holds the server's address (`database.url`, `amqp.url`, ...).
    pub address: &'a str,
    /// How to trust a private CA (`sslrootcert=<file> in database.url`, `amqp.tls_ca_file`, ...).
    pub ca: &'a str,
}

/// The context key that marks a refused certificate ([`certificate_error`]).
const CERTIFICATE_CONTEXT: &str = "tls";

/// Whether `e` is a refused certificate ([`certificate_error`]).
pub fn is_certificate_error(e: &Error) -> bool {
    e.context_value(CERTIFICATE_CONTEXT).is_some()
}

/// The error for `problem`, naming the setting to fix. A connection error, retryable: a
/// certificate can change under a running relay (renewed, or a proxy's), and the events then
/// wait rather than dead-letter. At start it stops the relay and the commands, as a configuration
/// problem ([`is_certificate_error`]).
pub fn certificate_error(problem: CertificateProblem, s: TlsSettings<'_>) -> Error {
    let at = if s.host.is_empty() {
        String::new()
    } else {
        format!(" ({})", s.host)
    };
    let message = match problem {
        CertificateProblem::UnknownIssuer => format!(
            "{}'s certificate{at} is not signed by a CA this relay trusts: set {} to the certificate (PEM) of the CA that signed it",
            s.server, s.ca
        ),
        CertificateProblem::WrongName => format!(
            "{}'s certificate is not valid for the host name in {}{at}: connect with a name the certificate holds (its subject alternative names), or have a certificate made for this one",
            s.server, s.address
        ),
        CertificateProblem::Unverified => format!(
            "{}'s certificate{at} could not be verified: set {} to the certificate (PEM) of the CA that signed it, and connect with a host name in {} that the certificate holds",
            s.server, s.ca, s.address
        ),
        CertificateProblem::Expired => format!(
            "{}'s certificate{at} has expired or is not valid yet: renew it on the server (or check this machine's clock)",
            s.server
        ),
    };
    Error::new(ErrorKind::Connection, message)
        .with_context(CERTIFICATE_CONTEXT, "certificate refused")
        .with_retryable(true)
}

/// The PEM text of the CA certificate file `path`, the value of `setting`.
///
/// # Errors
/// A config error naming `setting` when the file cannot be read or holds no PEM certificate.
pub fn read_ca_file(path: &std::path::Path, setting: &str) -> Result<String, Error> {
    let pem = std::fs::read_to_string(path).map_err(|e| {
        Error::config(format!(
            "{setting} = {:?}: cannot read the CA certificate file ({e}); expected a readable PEM file",
            path.display()
        ))
    })?;
    let blocks = pem_certificates(&pem);
    if blocks.is_empty() || blocks.iter().any(Option::is_none) {
        return Err(Error::config(format!(
            "{setting} = {:?} holds no readable PEM certificate: expected one or more \"-----BEGIN CERTIFICATE-----\" blocks of base64 DER, each with its END line (the CA that signed the server's certificate)",
            path.display()
        )));
    }
    Ok(pem)
}

/// Each `CERTIFICATE` block of `pem`: its DER bytes, or `None` when the block is cut short or its
/// body is not base64 of a DER sequence (clients panic on such a file rather than refuse it).
fn pem_certificates(pem: &str) -> Vec<Option<Vec<u8>>> {
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let mut blocks = Vec::new();
    let mut rest = pem;
    while let Some(start) = rest.find(BEGIN) {
        let body = &rest[start + BEGIN.len()..];
        let Some(end) = body.find(END) else {
            blocks.push(None);
            break;
        };
        let text: String = body[..end].chars().filter(|c| !c.is_whitespace()).collect();
        // PEM is padded base64 (OpenSSL, which librdkafka uses, refuses it otherwise).
        let padded = !text.is_empty() && text.len().is_multiple_of(4);
        blocks.push(
            crate::format::base64_decode(&text)
                .filter(|der| padded && der.len() > 2 && der[0] == 0x30),
        );
        rest = &body[end + END.len()..];
    }
    blocks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pem_blocks_are_read_whole_or_refused() {
        let der = [0x30u8, 0x03, 0x02, 0x01, 0x01];
        let ok = "-----BEGIN CERTIFICATE-----\nMAMCAQE=\n-----END CERTIFICATE-----\n";
        assert_eq!(pem_certificates(ok), vec![Some(der.to_vec())]);
        let cut = "-----BEGIN CERTIFICATE-----\nMAMCAQE=\n";
        assert_eq!(pem_certificates(cut), vec![None]);
        let garbled = "-----BEGIN CERTIFICATE-----\nMA*CAQE=\n-----END CERTIFICATE-----\n";
        assert_eq!(pem_certificates(garbled), vec![None]);
        assert!(pem_certificates("no pem here").is_empty());
    }

    #[test]
    fn rustls_verdicts_by_type_wrapped_or_not() {
        use rustls::CertificateError as C;
        let cases = [
            (C::UnknownIssuer, CertificateProblem::UnknownIssuer),
            (C::NotValidForName, CertificateProblem::WrongName),
            (C::Expired, CertificateProblem::Expired),
            (C::NotValidYet, CertificateProblem::Expired),
            (C::BadSignature, CertificateProblem::Unverified),
        ];
        for (verdict, want) in cases {
            let bare = rustls::Error::InvalidCertificate(verdict.clone());
            assert_eq!(certificate_problem(&bare), Some(want), "{bare}");
            // As tokio-rustls hands it over, inside an io::Error, itself the cause of another.
            let io = std::io::Error::new(std::io::ErrorKind::InvalidData, bare);
            let outer = Error::new(ErrorKind::Connection, "connect").with_source(io);
            assert_eq!(certificate_problem(&outer), Some(want));
        }
        // The server refusing the client's certificate, and other failures: none.
        let alert = rustls::Error::AlertReceived(rustls::AlertDescription::UnknownCA);
        assert_eq!(certificate_problem(&alert), None);
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(certificate_problem(&refused), None);
    }

    #[test]
    fn openssl_texts() {
        let cases = [
            // The server refused the client's certificate (mutual TLS): not a CA to configure here.
            ("ssl/tls alert certificate expired", None),
            (
                "SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate could not be verified, verify that ssl.ca.location is correctly configured or root CA certificates are installed (install ca-certificates package) (after 3ms in state SSL_HANDSHAKE): unable to get local issuer certificate",
                Some(CertificateProblem::UnknownIssuer),
            ),
            (
                "ssl://localhost:9094/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate could not be verified",
                Some(CertificateProblem::Unverified),
            ),
            ("certificate verify failed: Hostname mismatch", Some(CertificateProblem::WrongName)),
            ("certificate verify failed: certificate has expired", Some(CertificateProblem::Expired)),
            ("connection refused", None),
        ];
        for (text, want) in cases {
            assert_eq!(openssl_problem_in(text), want, "{text}");
        }
    }

    #[test]
    fn the_error_names_the_setting() {
        let s = TlsSettings {
            server: "RabbitMQ",
            host: "mq.internal",
            address: "amqp.url",
            ca: "amqp.tls_ca_file",
        };
        let e = certificate_error(CertificateProblem::UnknownIssuer, s);
        assert!(is_certificate_error(&e) && e.is_retryable());
        assert!(e.to_string().contains("amqp.tls_ca_file"));
        let e = certificate_error(CertificateProblem::WrongName, s);
        assert!(e.to_string().contains("mq.internal") && e.to_string().contains("amqp.url"));
    }
}
