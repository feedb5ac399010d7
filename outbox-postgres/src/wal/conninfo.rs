//! The replication connection: its settings, taken from the pool's (the host, port, user,
//! password, database, TLS mode and certificate authority that sqlx resolved from the URL, the
//! libpq environment such as `PGUSER`, `PGSSLMODE`, `PGSSLROOTCERT`, and the password file), and
//! whether it opens, for readiness. What the replication client cannot do as the pool does is
//! refused when the WAL source is made, naming the setting, so that the stream never runs as
//! another role or with weaker TLS than the pool.

use std::fmt;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use sqlx::postgres::{PgConnectOptions, PgSslMode};
use sqlx::ConnectOptions;

use txoutbox_core::Error;

/// How long opening the replication connection may take.
const CONNECT_TIMEOUT_SECS: u64 = 30;

/// What a value of the replication client's URL keeps unencoded (RFC 3986's unreserved set).
const VALUE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Where the pool's settings come from, for refusals.
const POOL_SETTINGS: &str = "the pool's sessions use it (database.direct_url when set, else \
                             database.url, and the PG* environment)";

/// The replication connection of the WAL source: a `replication=database` connection string for
/// the replication client, and the `application_name` its session sets.
#[derive(Clone)]
pub(crate) struct ReplicationTarget {
    conninfo: String,
    application_name: Option<String>,
    /// Where it connects, without the password: `user@host:port/database sslmode=...`.
    pub(super) shown: String,
}

impl fmt::Debug for ReplicationTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The connection string carries the password.
        f.debug_struct("ReplicationTarget")
            .field("target", &self.shown)
            .finish_non_exhaustive()
    }
}

/// A certificate setting of the pool: a file, or PEM text given inline.
#[derive(Debug, PartialEq)]
enum Cert {
    File(String),
    Inline,
}

/// A setting of the pool's the replication connection cannot honour.
fn refuse(what: String, fix: &str) -> Result<(), Error> {
    Err(Error::config(format!(
        "the WAL source's replication connection cannot {what}, and {POOL_SETTINGS}: {fix}"
    )))
}

/// Refuses what the replication client cannot connect with: a Unix socket, startup options.
fn refuse_transport(options: &PgConnectOptions) -> Result<(), Error> {
    let host = options.get_host();
    if let Some(socket) = options.get_socket() {
        return refuse(
            format!("connect through the Unix socket {}", socket.display()),
            "give a TCP host, such as 127.0.0.1, in the URL or PGHOST",
        );
    }
    if host.starts_with('/') || host.is_empty() {
        return refuse(
            format!("connect through the Unix socket in {host:?}"),
            "give a TCP host, such as 127.0.0.1, in the URL or PGHOST",
        );
    }
    if let Some(startup) = options.get_options() {
        return refuse(
            format!("send startup options ({startup:?}, from `options` in the URL or PGOPTIONS)"),
            "set them on the role instead (ALTER ROLE ... SET ...), or remove them",
        );
    }
    Ok(())
}

/// libpq's name of `mode` (sqlx never attempts TLS under `allow`: `disable`).
fn ssl_mode_name(mode: PgSslMode) -> &'static str {
    match mode {
        PgSslMode::Disable | PgSslMode::Allow => "disable",
        PgSslMode::Prefer => "prefer",
        PgSslMode::Require => "require",
        PgSslMode::VerifyCa => "verify-ca",
        PgSslMode::VerifyFull => "verify-full",
    }
}

/// The pool's settings that have no getter, read from the URL sqlx writes for them.
///
/// The password and the certificate settings have no getter: sqlx writes them in a URL, whose user
/// and host part it cannot write for every name. Written here with a plain user and host (an IPv6
/// host, or a user name with `@` or `/`, would not parse there); only the password and the query
/// are read from it.
struct Written {
    password: Option<String>,
    query: Vec<(String, String)>,
}

impl Written {
    fn of(options: &PgConnectOptions) -> Written {
        let url = options.clone().username("u").host("h").to_url_lossy();
        Written {
            password: url
                .password()
                .map(|p| percent_decode_str(p).decode_utf8_lossy().into_owned()),
            query: url
                .query_pairs()
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect(),
        }
    }

    fn cert(&self, key: &str) -> Option<Cert> {
        self.query
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| match v.strip_prefix("file: ") {
                Some(path) => Cert::File(path.to_string()),
                None => Cert::Inline,
            })
    }

    fn password(&self) -> Option<String> {
        self.password.clone()
    }

    /// Refuses a TLS client certificate (the replication client cannot present one).
    fn refuse_client_certificate(&self, mode: PgSslMode) -> Result<(), Error> {
        // sqlx never attempts TLS under `allow`.
        let tls = !matches!(mode, PgSslMode::Disable | PgSslMode::Allow);
        for (key, variable) in [("sslcert", "PGSSLCERT"), ("sslkey", "PGSSLKEY")] {
            if tls && self.cert(key).is_some() {
                return refuse(
                    format!("present a TLS client certificate ({key} in the URL, or {variable})"),
                    "authenticate the relay's role with a password, or remove them",
                );
            }
        }
        Ok(())
    }

    /// The certificate authority's file, read (in sqlx as here) only by the verifying modes.
    fn root_cert(&self, mode: PgSslMode) -> Result<Option<String>, Error> {
        if !matches!(mode, PgSslMode::VerifyCa | PgSslMode::VerifyFull) {
            return Ok(None);
        }
        match self.cert("sslrootcert") {
            // `system` alone names the system's store to the replication client: a file of that
            // name is given as a path.
            Some(Cert::File(path)) if path == "system" => Ok(Some("./system".into())),
            Some(Cert::File(path)) => Ok(Some(path)),
            Some(Cert::Inline) => refuse(
                "use a certificate authority given as PEM text (PGSSLROOTCERT)".into(),
                "put it in a file and name the file",
            )
            .map(|()| None),
            None => Ok(None),
        }
    }
}

impl ReplicationTarget {
    /// The replication connection of a pool made with `options`.
    ///
    /// # Errors
    /// A configuration error naming what the replication client cannot do as the pool does: a
    /// Unix socket, a TLS client certificate, startup options (`options`, `PGOPTIONS`), a
    /// certificate authority given as PEM text.
    pub(crate) fn of(options: &PgConnectOptions) -> Result<ReplicationTarget, Error> {
        refuse_transport(options)?;
        let host = options.get_host();
        let user = options.get_username();
        let written = Written::of(options);
        let ssl_mode = options.get_ssl_mode();
        written.refuse_client_certificate(ssl_mode)?;
        let mode = ssl_mode_name(ssl_mode);
        let mut pairs: Vec<(&str, String)> = vec![
            (
                "host",
                host.trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_string(),
            ),
            ("port", options.get_port().to_string()),
            ("user", user.to_string()),
        ];
        if let Some(password) = written.password() {
            pairs.push(("password", password));
        }
        let database = options.get_database().unwrap_or(user);
        pairs.push(("dbname", database.to_string()));
        pairs.push(("sslmode", mode.to_string()));
        if let Some(path) = written.root_cert(ssl_mode)? {
            pairs.push(("sslrootcert", path));
        }
        pairs.push(("replication", "database".into()));
        pairs.push(("connect_timeout", CONNECT_TIMEOUT_SECS.to_string()));
        let conninfo = format!(
            "postgres://?{}",
            pairs
                .iter()
                .map(|(k, v)| format!("{k}={}", utf8_percent_encode(v, VALUE)))
                .collect::<Vec<_>>()
                .join("&")
        );
        Ok(ReplicationTarget {
            conninfo,
            application_name: options.get_application_name().map(str::to_string),
            shown: format!(
                "{user}@{host}:{}/{database} sslmode={mode}",
                options.get_port()
            ),
        })
    }

    /// The connection string for the replication client (it carries the password: never log it).
    pub(crate) fn conninfo(&self) -> &str {
        &self.conninfo
    }

    /// The `application_name` the pool's sessions carry, which the replication session sets too.
    pub(crate) fn application_name(&self) -> Option<&str> {
        self.application_name.as_deref()
    }
}

/// How long the reader's stream may fail to open before readiness reports it (a slot's walsender
/// still held for a reader that just died refuses a new one for a moment).
const FAILING_GRACE: Duration = Duration::from_secs(10);

/// How long a probe's answer stands: a success for a minute, a failure for a few seconds.
const PROBE_OK_FOR: Duration = Duration::from_secs(60);
const PROBE_FAILED_FOR: Duration = Duration::from_secs(5);

/// Whether the replication connection opens, as the reader and readiness last saw it.
#[derive(Default)]
pub(crate) struct ReplicationHealth {
    state: Mutex<HealthState>,
}

#[derive(Default)]
struct HealthState {
    /// The reader streams the slot: the connection opened.
    open: bool,
    /// Since when the reader's stream fails to open, and its last error.
    failing: Option<(Instant, Error)>,
    /// The last probe (made while the reader does not stream) and its answer.
    probed: Option<(Instant, Result<(), Error>)>,
}

impl ReplicationHealth {
    fn state(&self) -> MutexGuard<'_, HealthState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The reader's stream opened.
    pub(crate) fn opened(&self) {
        let mut st = self.state();
        st.open = true;
        st.failing = None;
    }

    /// The reader's stream is open until the guard this returns is dropped.
    pub(crate) fn streaming(&self) -> Streaming<'_> {
        Streaming(self)
    }

    /// The reader's stream failed to open with `e`.
    pub(crate) fn failed(&self, e: &Error) {
        let mut st = self.state();
        st.open = false;
        let since = st.failing.as_ref().map_or_else(Instant::now, |(at, _)| *at);
        st.failing = Some((since, e.clone()));
    }

    /// Whether the replication connection opens: yes while the reader streams; the reader's
    /// error once its stream has failed to open for [`FAILING_GRACE`] (while this relay holds the
    /// slot's reader lock, `reading`: a standby's last failure may be another relay's walsender
    /// that has gone since); otherwise (a standby, a reader not streaming yet) a connection opened
    /// now with `target`, its answer kept a while.
    ///
    /// # Errors
    /// Why the replication connection does not open.
    pub(crate) async fn ready(
        &self,
        target: &ReplicationTarget,
        reading: bool,
    ) -> Result<(), Error> {
        {
            let mut st = self.state();
            if !reading {
                st.open = false;
                st.failing = None;
            }
            if st.open {
                return Ok(());
            }
            if let Some((since, e)) = &st.failing {
                if since.elapsed() >= FAILING_GRACE {
                    return Err(e.clone());
                }
            }
            if let Some((at, answer)) = &st.probed {
                let stands = if answer.is_ok() {
                    PROBE_OK_FOR
                } else {
                    PROBE_FAILED_FOR
                };
                if at.elapsed() < stands {
                    return answer.clone();
                }
            }
        }
        let answer = target.probe().await;
        self.state().probed = Some((Instant::now(), answer.clone()));
        answer
    }
}

/// The reader's stream, open for readiness until dropped ([`ReplicationHealth::streaming`]).
pub(crate) struct Streaming<'a>(&'a ReplicationHealth);

impl Drop for Streaming<'_> {
    fn drop(&mut self) {
        self.0.state().open = false;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use txoutbox_core::ErrorKind;

    fn target(url: &str) -> Result<ReplicationTarget, Error> {
        let options: PgConnectOptions = url.parse().unwrap();
        ReplicationTarget::of(&options)
    }

    #[test]
    fn the_pools_settings_make_the_connection_string() {
        let t = target(
            "postgres://relay:p%40ss%20w%2Fd@db.example:6543/orders?sslmode=verify-full\
             &sslrootcert=/etc/ca.pem&application_name=billing",
        )
        .unwrap();
        assert_eq!(
            t.conninfo(),
            "postgres://?host=db.example&port=6543&user=relay&password=p%40ss%20w%2Fd\
             &dbname=orders&sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem\
             &replication=database&connect_timeout=30"
        );
        assert_eq!(t.application_name(), Some("billing"));
        assert_eq!(t.shown, "relay@db.example:6543/orders sslmode=verify-full");
        assert!(
            !format!("{t:?}").contains("p%40ss"),
            "Debug hides the password"
        );
    }

    #[test]
    fn the_spellings_sqlx_accepts_are_read_as_sqlx_reads_them() {
        let t = target(
            "postgres://relay@127.0.0.1/test?ssl-mode=require&ssl-root-cert=/ca.pem\
             &statement-cache-capacity=10",
        )
        .unwrap();
        // `require` verifies nothing in sqlx: the authority is not passed on.
        assert!(
            t.conninfo().contains("&sslmode=require&replication"),
            "{}",
            t.conninfo()
        );
        let t = target("postgres://relay@127.0.0.1/test?sslmode=allow").unwrap();
        assert!(
            t.conninfo().contains("sslmode=disable"),
            "allow never tries TLS in sqlx"
        );
        let t =
            target("postgres://relay@127.0.0.1/test?sslmode=verify-ca&sslrootcert=system").unwrap();
        assert!(
            t.conninfo().contains("sslrootcert=.%2Fsystem"),
            "{}",
            t.conninfo()
        );
    }

    #[test]
    fn what_the_replication_client_cannot_do_is_refused_naming_it() {
        for (url, named) in [
            (
                "postgres://relay@%2Fvar%2Frun%2Fpostgresql/test",
                "Unix socket",
            ),
            (
                "postgres://relay@127.0.0.1/test?options=-c%20work_mem%3D8MB",
                "PGOPTIONS",
            ),
            (
                "postgres://relay@127.0.0.1/test?sslmode=require&sslcert=/c.pem&sslkey=/k.pem",
                "client certificate",
            ),
        ] {
            let e = target(url).unwrap_err();
            assert_eq!(e.kind(), txoutbox_core::ErrorKind::Config, "{url}");
            assert!(
                e.message().contains(named) && e.message().contains("database.url"),
                "{url}: {}",
                e.message()
            );
        }
        // A client certificate without TLS is never sent, by either.
        assert!(target("postgres://relay@127.0.0.1/test?sslmode=disable&sslcert=/c.pem").is_ok());
    }

    /// Readiness counts the reader's stream only while it is open (the guard dropped, however the
    /// reading ended, it probes again), and a standby never reports the reader's old failure.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn readiness_counts_the_stream_only_while_it_is_open() {
        let health = ReplicationHealth::default();
        // Nothing listens on port 1 of the loopback: a probe fails at once, naming the target.
        let target = target("postgres://relay@127.0.0.1:1/x?sslmode=disable").unwrap();
        health.opened();
        let streaming = health.streaming();
        assert!(health.ready(&target, true).await.is_ok());
        drop(streaming);
        let e = health.ready(&target, true).await.unwrap_err();
        assert!(
            e.message().contains("relay@127.0.0.1:1/x"),
            "{}",
            e.message()
        );
        health.failed(&Error::new(
            ErrorKind::Connection,
            "the reader's own failure",
        ));
        let e = health.ready(&target, false).await.unwrap_err();
        assert!(
            !e.message().contains("the reader's own failure"),
            "a standby probes: {}",
            e.message()
        );
    }
}
