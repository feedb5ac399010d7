//! The connection and its confirm-mode channel: opened lazily within `amqp.connect_timeout`, the
//! exchange declared or checked, reopened after a failure with exponential backoff, and dropped
//! (closed, bounded) so that the next batch reconnects.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::{ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{FieldTable, LongString};
use lapin::{Channel, Connection, ConnectionProperties, DefaultConnectionBuilder, ExchangeKind};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use txoutbox_core::Error;

use super::message::short;
use super::AmqpPublisher;
use crate::config::{redact_url, AmqpConfig, ExchangeType};
use crate::error::{self, map_lapin};

/// A connection and its confirm-mode channel.
pub(super) struct Link {
    pub(super) connection: Arc<Connection>,
    channel: Channel,
}

/// The link, when there is one, and when and how to try again when there is not.
pub(super) struct LinkState {
    pub(super) link: Option<Link>,
    pub(super) next_attempt: Option<Instant>,
    pub(super) backoff: Duration,
    pub(super) last_error: Option<Error>,
    /// Failed attempts since the last success, and when one was last logged as a warning: an
    /// outage is logged when it starts and then once a minute, not at every attempt.
    pub(super) failures: u32,
    pub(super) warned_at: Option<Instant>,
}

/// How often a lasting outage is logged again as a warning (each attempt is logged at debug).
const WARN_AGAIN_AFTER: Duration = Duration::from_secs(60);

impl LinkState {
    /// No link yet; the first attempt is made at once.
    pub(super) fn new(backoff: Duration) -> Self {
        LinkState {
            link: None,
            next_attempt: None,
            backoff,
            last_error: None,
            failures: 0,
            warned_at: None,
        }
    }

    /// Counts a failed attempt; true when it is to be logged as a warning (the first of an
    /// outage, then one a minute), false when at debug.
    fn note_failure(&mut self) -> bool {
        self.failures += 1;
        let due = self
            .warned_at
            .is_none_or(|at| at.elapsed() >= WARN_AGAIN_AFTER);
        if due {
            self.warned_at = Some(Instant::now());
        }
        due
    }

    /// Counts a success; the failed attempts it ends, if any.
    fn note_success(&mut self) -> u32 {
        self.warned_at = None;
        std::mem::take(&mut self.failures)
    }
}

/// Opens a connection to `config.url`, named `name` in the broker's connection list, and a channel
/// on it.
pub(crate) async fn connect_channel(
    config: &AmqpConfig,
    name: &str,
) -> Result<(Connection, Channel), Error> {
    let props = ConnectionProperties::default().with_connection_name(LongString::from(name));
    let tls = OwnedTLSConfig {
        identity: None,
        // Read at each connection (a renewed CA file is taken up); the settings' check read it
        // at start, so a file gone since is a connection failure, retried, not the events' fault.
        cert_chain: match &config.tls_ca_file {
            Some(path) => Some(
                txoutbox_core::tls::read_ca_file(path, "amqp.tls_ca_file").map_err(|e| {
                    Error::new(
                        txoutbox_core::ErrorKind::Connection,
                        e.message().to_string(),
                    )
                    .with_retryable(true)
                })?,
            ),
            None => None,
        },
    };
    let connected = match DefaultConnectionBuilder::new() {
        Ok(builder) => {
            builder
                .with_uri_str(config.url.clone())
                .with_properties(props)
                .with_tls_config(tls)
                .connect()
                .await
        }
        Err(e) => Err(e),
    };
    let connection = connected.map_err(|e| {
        if let Some(problem) = txoutbox_core::tls::certificate_problem(&e) {
            let host = config
                .url
                .parse::<lapin::uri::AMQPUri>()
                .map(|u| u.authority.host)
                .unwrap_or_default();
            return txoutbox_core::tls::certificate_error(
                problem,
                txoutbox_core::tls::TlsSettings {
                    server: "RabbitMQ",
                    host: &host,
                    address: "amqp.url",
                    ca: "amqp.tls_ca_file",
                },
            )
            .with_source(map_lapin("connect", e));
        }
        map_lapin("connect", e).with_context("broker", txoutbox_core::redact_url(&config.url))
    })?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| map_lapin("open channel", e))?;
    Ok((connection, channel))
}

/// Declares the configured exchange (durable) on `channel`, or only checks that it exists when
/// `amqp.declare_exchange` is false.
///
/// # Errors
/// A missing or mismatched exchange, as a retryable error saying how to fix it: an operator's fix,
/// not the events' fault, so they wait until it is fixed.
pub(crate) async fn declare_exchange(config: &AmqpConfig, channel: &Channel) -> Result<(), Error> {
    let options = ExchangeDeclareOptions {
        passive: !config.declare_exchange,
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(
            short("amqp.exchange", &config.exchange)?,
            kind_of(config.exchange_type),
            options,
            FieldTable::default(),
        )
        .await
        .map_err(|e| error::exchange_unusable(&config.exchange, map_lapin("declare exchange", e)))
}

pub(crate) fn kind_of(t: ExchangeType) -> ExchangeKind {
    match t {
        ExchangeType::Topic => ExchangeKind::Topic,
        ExchangeType::Direct => ExchangeKind::Direct,
        ExchangeType::Fanout => ExchangeKind::Fanout,
        ExchangeType::Headers => ExchangeKind::Headers,
    }
}

fn frame_max(connection: &Connection) -> usize {
    match connection.configuration().frame_max() {
        0 => usize::MAX,
        n => n as usize,
    }
}

impl AmqpPublisher {
    /// Connects now (instead of at the first publish), declaring or checking the exchange.
    ///
    /// # Errors
    /// The connection error, classified.
    pub async fn connect(&self) -> Result<(), Error> {
        self.channel().await.map(|_| ())
    }

    async fn open(&self) -> Result<Link, Error> {
        let c = &self.config;
        let connect = async {
            let (connection, channel) = connect_channel(c, "outbox relay").await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(|e| map_lapin("confirm select", e))?;
            if !c.exchange.is_empty() {
                declare_exchange(c, &channel).await?;
            }
            Ok::<Link, Error>(Link {
                connection: Arc::new(connection),
                channel,
            })
        };
        match tokio::time::timeout(c.connect_timeout, connect).await {
            Ok(r) => r,
            Err(_) => Err(error::connect_timeout(
                &redact_url(&c.url),
                c.connect_timeout,
            )),
        }
    }

    /// A live confirm-mode channel and the connection's frame size, reconnecting (with backoff)
    /// when needed.
    pub(super) async fn channel(&self) -> Result<(Channel, usize), Error> {
        let mut st = self.state.lock().await;
        if let Some(link) = &st.link {
            if link.connection.status().connected() && link.channel.status().connected() {
                return Ok((link.channel.clone(), frame_max(&link.connection)));
            }
            st.link = None;
        }
        if let Some(at) = st.next_attempt {
            if Instant::now() < at {
                let wait = at - Instant::now();
                return Err(error::unreachable(
                    &redact_url(&self.config.url),
                    wait,
                    st.last_error.as_ref(),
                ));
            }
        }
        match self.open().await {
            Ok(link) => {
                match st.note_success() {
                    0 => {
                        info!(url = %redact_url(&self.config.url), exchange = %self.config.exchange, "connected to RabbitMQ")
                    }
                    failed_attempts => {
                        info!(url = %redact_url(&self.config.url), exchange = %self.config.exchange, failed_attempts, "connected to RabbitMQ again")
                    }
                }
                let channel = (link.channel.clone(), frame_max(&link.connection));
                st.link = Some(link);
                st.next_attempt = None;
                st.backoff = self.config.reconnect_initial_backoff;
                st.last_error = None;
                Ok(channel)
            }
            Err(e) => {
                let retry_in_ms = st.backoff.as_millis() as u64;
                if st.note_failure() {
                    warn!(error = %e, retry_in_ms, failed_attempts = st.failures, "cannot connect to RabbitMQ");
                } else {
                    debug!(error = %e, retry_in_ms, failed_attempts = st.failures, "cannot connect to RabbitMQ");
                }
                st.next_attempt = Some(Instant::now() + st.backoff);
                st.backoff = (st.backoff * 2).min(self.config.reconnect_max_backoff);
                st.last_error = Some(e.clone());
                Err(e)
            }
        }
    }

    /// Drops the link after a failure so the next batch reconnects.
    pub(super) async fn reset(&self, reason: &Error) {
        let mut st = self.state.lock().await;
        if let Some(link) = st.link.take() {
            warn!(error = %reason, "dropping the RabbitMQ channel; the next batch reconnects");
            // Bounded: a broker that stopped answering must not hold the publish call (see
            // `call_limit`); dropping the connection closes its socket anyway.
            let close = link.connection.close(320, "outbox reconnect".into());
            let _ = tokio::time::timeout(Duration::from_secs(2), close).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_outage_warns_when_it_starts_then_once_a_minute() {
        let mut st = LinkState::new(Duration::from_millis(100));
        assert!(st.note_failure(), "the first failure warns");
        let mut warned = 0;
        // One attempt a second for 59 s: none warns again.
        for _ in 0..59 {
            tokio::time::advance(Duration::from_secs(1)).await;
            warned += usize::from(st.note_failure());
        }
        assert_eq!(
            warned, 0,
            "attempts within a minute of the warning are debug"
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(st.note_failure(), "a minute on, the outage is logged again");
        assert_eq!(
            st.note_success(),
            61,
            "the success reports the failed attempts"
        );
        assert!(st.note_failure(), "the next outage warns at once");
    }
}
