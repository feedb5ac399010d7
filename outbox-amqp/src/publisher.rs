//! The RabbitMQ publisher: one connection, one confirm-mode channel, batches published without
//! waiting per message, one outcome per event from its own confirm.

use std::collections::{HashMap, HashSet};

use outbox_core::cache::{BoundedCache, DEFAULT_DESTINATION_CACHE};
use std::sync::Mutex as StdMutex;
use std::task::Poll;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::join_all;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};
use tokio::sync::Mutex;
use tokio::time::Instant;
use tracing::{info, warn};

use outbox_core::format::Formatter;
use outbox_core::publishers::{finish, Fence};
use outbox_core::routing::{AllowList, Template};
use outbox_core::{header, Error, ErrorKind, Event, PublishOutcome, Publisher};

use crate::config::{redact_url, AmqpConfig, ExchangeType};
use crate::error::map_lapin;

const MAX_SHORT_STRING: usize = 255;

struct Link {
    connection: std::sync::Arc<Connection>,
    channel: Channel,
}

struct LinkState {
    link: Option<Link>,
    next_attempt: Option<Instant>,
    backoff: Duration,
    last_error: Option<Error>,
}

/// Publishes events to RabbitMQ with publisher confirms.
///
/// - Each event becomes one persistent message: `message_id` = event id, `type` = event type,
///   `timestamp` = creation time, `content_type`, and headers `outbox-event-id`,
///   `outbox-aggregate-type`, `outbox-aggregate-id`, `outbox-event-type`, the format's
///   ([`AmqpPublisher::with_format`]: CloudEvents attributes prefixed `amqp.cloudevents_prefix` in
///   binary mode, Debezium's `id` and `eventType`) plus every event header (`traceparent`
///   included). The body is the payload (the JSON event in CloudEvents structured mode).
/// - Exchange: [`AmqpConfig::exchange`], or the event's own destination. Routing key: the
///   [`AmqpConfig::routing_key`] template.
/// - A batch is published without waiting per message; each outcome comes from the message's confirm:
///   ack = published, nack = retryable, returned as unroutable (`mandatory`) = permanent (configurable).
/// - When the connection or channel is lost, events in flight fail retryably and the next batch
///   reconnects, with exponential backoff between attempts.
pub struct AmqpPublisher {
    config: AmqpConfig,
    routing_key: Template,
    /// Which exchanges events may name (`amqp.allowed_destinations`).
    allowed: AllowList,
    state: Mutex<LinkState>,
    /// Exchanges (event destinations) found to exist, the most recently used ones.
    known_exchanges: StdMutex<BoundedCache<String, ()>>,
    /// The message format.
    format: Formatter,
}

impl std::fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// One event ready to send.
struct Outgoing {
    index: usize,
    exchange: ShortString,
    routing_key: ShortString,
    properties: BasicProperties,
}

fn short(field: &str, value: &str) -> Result<ShortString, Error> {
    ShortString::try_new(value.to_string()).map_err(|_| {
        Error::new(
            ErrorKind::InvalidInput,
            format!(
                "{field} is {} bytes long; AMQP allows at most {MAX_SHORT_STRING}",
                value.len()
            ),
        )
        .with_context("adapter", "amqp")
    })
}

/// Opens a connection to `config.url`, named `name` in the broker's connection list, and a channel
/// on it.
pub(crate) async fn connect_channel(
    config: &AmqpConfig,
    name: &str,
) -> Result<(Connection, Channel), Error> {
    let props = ConnectionProperties::default().with_connection_name(LongString::from(name));
    let connection = Connection::connect(&config.url, props).await.map_err(|e| {
        map_lapin("connect", e).with_context("broker", outbox_core::redact_url(&config.url))
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
        .map_err(|e| {
            let base = map_lapin("declare exchange", e);
            Error::new(
                base.kind(),
                format!(
                    "exchange {:?} cannot be used: {}; create it, fix amqp.exchange, or set amqp.declare_exchange = true",
                    config.exchange,
                    base.message()
                ),
            )
            .temporary()
            .with_context("adapter", "amqp")
            .with_source(base)
        })
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

/// The limit in RabbitMQ's refusal of a message over its `max_message_size`: it closes the channel
/// with 406 PRECONDITION_FAILED, "message size N is larger than configured max size M".
/// (At RabbitMQ's hard cap the text says "max size M" without "configured".)
fn broker_size_limit(reason: &str) -> Option<usize> {
    let (_, rest) = reason.split_once("message size ")?;
    let (_, rest) = rest.split_once(" is larger than ")?;
    let (_, rest) = rest.split_once("max size ")?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Where the broker closed the channel over a message of this call larger than its
/// `max_message_size`, the events whose failure is that close: those whose body is over the limit
/// fail for good, naming it (the broker would refuse them again, whichever call they went in); the
/// others fail retryably, saying which event closed the channel (they are not at fault). Failures of
/// their own (a missing exchange, a header too long, a return, a nack) are left as they are, and so
/// is a close caused by another call on the shared channel (no event of this call over the limit).
/// Without this, the refused event and every event sent beside it would fail retryably, again and
/// again, until their attempts ran out.
fn refused_as_too_large(
    outcomes: &mut [Option<PublishOutcome>],
    events: &[Event],
    bodies: &[std::borrow::Cow<'_, [u8]>],
    configured: usize,
) {
    let limit = outcomes.iter().find_map(|o| match o {
        Some(Err(e)) => broker_size_limit(&e.to_string()),
        _ => None,
    });
    let Some(limit) = limit else { return };
    let refused: Vec<String> = (0..events.len())
        .filter(|&i| bodies[i].len() > limit)
        .map(|i| events[i].id.to_string())
        .collect();
    if refused.is_empty() {
        return;
    }
    for (i, outcome) in outcomes.iter_mut().enumerate() {
        let closed = matches!(outcome, Some(Err(e)) if broker_size_limit(&e.to_string()).is_some());
        if !closed {
            continue;
        }
        if bodies[i].len() <= limit {
            *outcome = Some(Err(Error::new(
                ErrorKind::Connection,
                format!(
                    "the channel closed before this message was confirmed: RabbitMQ refused another message \
                     of the call ({}) over its max_message_size of {limit}; to be sent again",
                    refused.join(", ")
                ),
            )
            .temporary()
            .with_context("adapter", "amqp")
            .with_context("event_id", events[i].id)));
        } else {
            *outcome = Some(Err(Error::new(
                ErrorKind::PayloadTooLarge,
                format!(
                    "the message body is {} bytes; RabbitMQ refused it over its max_message_size of {limit} \
                     (raise max_message_size in rabbitmq.conf, or write smaller events; amqp.max_message_bytes, \
                     {configured}, is checked before sending)",
                    bodies[i].len()
                ),
            )
            .permanent()
            .with_context("adapter", "amqp")
            .with_context("event_id", events[i].id)));
        }
    }
}

fn connection_lost(reason: &str) -> Error {
    Error::new(ErrorKind::Connection, reason.to_string()).with_context("adapter", "amqp")
}

impl AmqpPublisher {
    /// A publisher with `config`. Connects lazily (on the first publish or check).
    ///
    /// # Errors
    /// A config error naming the key when `config` does not validate.
    pub fn new(config: AmqpConfig) -> Result<Self, Error> {
        let routing_key = config.validate()?;
        let allowed = config.allow_list()?;
        let backoff = config.reconnect_initial_backoff;
        Ok(AmqpPublisher {
            config,
            routing_key,
            allowed,
            state: Mutex::new(LinkState {
                link: None,
                next_attempt: None,
                backoff,
                last_error: None,
            }),
            known_exchanges: StdMutex::new(BoundedCache::new(DEFAULT_DESTINATION_CACHE)),
            format: Formatter::default(),
        })
    }

    /// Remembers at most `capacity` exchanges found to exist (default
    /// [`outbox_core::cache::DEFAULT_DESTINATION_CACHE`]); the least recently used is checked again
    /// when next named.
    pub fn with_exchange_cache(self, capacity: usize) -> Self {
        AmqpPublisher {
            known_exchanges: StdMutex::new(BoundedCache::new(capacity)),
            ..self
        }
    }

    /// Sends events in `format` (CloudEvents, Debezium's conventions; default the outbox's own).
    /// CloudEvents attribute headers take the prefix `amqp.cloudevents_prefix`.
    pub fn with_format(self, format: Formatter) -> Self {
        AmqpPublisher { format, ..self }
    }

    /// How many exchanges are remembered as existing now.
    pub fn cached_exchanges(&self) -> usize {
        self.known_exchanges.lock().map_or(0, |k| k.len())
    }

    /// The settings in force.
    pub fn config(&self) -> &AmqpConfig {
        &self.config
    }

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
                connection: std::sync::Arc::new(connection),
                channel,
            })
        };
        match tokio::time::timeout(c.connect_timeout, connect).await {
            Ok(r) => r,
            Err(_) => Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "connecting to {} took longer than amqp.connect_timeout = {}",
                    redact_url(&c.url),
                    outbox_core::duration::format(c.connect_timeout)
                ),
            )
            .with_context("adapter", "amqp")),
        }
    }

    /// A live confirm-mode channel and the connection's frame size, reconnecting (with backoff)
    /// when needed.
    async fn channel(&self) -> Result<(Channel, usize), Error> {
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
                let mut e = connection_lost(&format!(
                    "RabbitMQ at {} is unreachable; next connection attempt in {} ms",
                    redact_url(&self.config.url),
                    wait.as_millis()
                ));
                if let Some(last) = &st.last_error {
                    e = e.with_source(last.clone());
                }
                return Err(e.temporary());
            }
        }
        match self.open().await {
            Ok(link) => {
                info!(url = %redact_url(&self.config.url), exchange = %self.config.exchange, "connected to RabbitMQ");
                let channel = (link.channel.clone(), frame_max(&link.connection));
                st.link = Some(link);
                st.next_attempt = None;
                st.backoff = self.config.reconnect_initial_backoff;
                st.last_error = None;
                Ok(channel)
            }
            Err(e) => {
                warn!(error = %e, retry_in_ms = st.backoff.as_millis() as u64, "cannot connect to RabbitMQ");
                st.next_attempt = Some(Instant::now() + st.backoff);
                st.backoff = (st.backoff * 2).min(self.config.reconnect_max_backoff);
                st.last_error = Some(e.clone());
                Err(e)
            }
        }
    }

    /// Drops the link after a failure so the next batch reconnects.
    async fn reset(&self, reason: &Error) {
        let mut st = self.state.lock().await;
        if let Some(link) = st.link.take() {
            warn!(error = %reason, "dropping the RabbitMQ channel; the next batch reconnects");
            // Bounded: a broker that stopped answering must not hold the publish call (see
            // `call_limit`); dropping the connection closes its socket anyway.
            let close = link.connection.close(320, "outbox reconnect".into());
            let _ = tokio::time::timeout(Duration::from_secs(2), close).await;
        }
    }

    fn prepare(
        &self,
        index: usize,
        event: &Event,
        frame_max: usize,
        body_len: usize,
    ) -> Result<Outgoing, Error> {
        self.build(index, event, frame_max, body_len)
            .map_err(|e| e.with_context("event_id", event.id))
    }

    /// `body_len`: the size of the message body (the payload, or the JSON event in CloudEvents
    /// structured mode).
    fn build(
        &self,
        index: usize,
        event: &Event,
        frame_max: usize,
        body_len: usize,
    ) -> Result<Outgoing, Error> {
        let extra = self.format.headers(event, &self.config.cloudevents_prefix);
        // The properties (headers included) travel in one content-header frame.
        let header_bytes: usize = event
            .headers
            .iter()
            .chain(extra.iter().map(|(k, v)| (k, v)))
            .map(|(k, v)| k.len() + v.len() + 6)
            .sum::<usize>()
            + event.event_type.len()
            + event.aggregate_type.len()
            + event.aggregate_id.len()
            + 256;
        if header_bytes + 512 > frame_max {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "the headers take about {header_bytes} bytes; an AMQP frame of this connection carries at most {frame_max} (move large values into the payload)"
                ),
            )
            .with_context("adapter", "amqp"));
        }
        if body_len > self.config.max_message_bytes {
            return Err(Error::new(
                ErrorKind::PayloadTooLarge,
                format!(
                    "the message body is {} bytes; amqp.max_message_bytes is {}",
                    body_len, self.config.max_message_bytes
                ),
            )
            .with_context("adapter", "amqp"));
        }
        let exchange = event
            .destination
            .clone()
            .unwrap_or_else(|| self.config.exchange.clone());
        self.allowed
            .check(&exchange)
            .map_err(|e| e.with_context("adapter", "amqp"))?;
        let exchange = short("exchange name", &exchange)?;
        let routing_key = short("routing key", &self.routing_key.render(event))?;
        let mut headers = FieldTable::default();
        let put = |headers: &mut FieldTable, k: &str, v: &str| -> Result<(), Error> {
            headers.insert(
                short("header name", k)?,
                AMQPValue::LongString(LongString::from(v.as_bytes().to_vec())),
            );
            Ok(())
        };
        for (k, v) in event
            .headers
            .iter()
            .chain(extra.iter().map(|(k, v)| (k, v)))
        {
            put(&mut headers, k, v)?;
        }
        put(&mut headers, header::EVENT_ID, &event.id.to_string())?;
        put(&mut headers, header::EVENT_TYPE, &event.event_type)?;
        put(&mut headers, header::AGGREGATE_TYPE, &event.aggregate_type)?;
        put(&mut headers, header::AGGREGATE_ID, &event.aggregate_id)?;
        let mut properties = BasicProperties::default()
            .with_message_id(short("message id", &event.id.to_string())?)
            .with_type(short("event type", &event.event_type)?)
            .with_content_type(short("content type", self.format.content_type(event))?)
            .with_timestamp(event.created_at.timestamp().max(0) as u64)
            .with_app_id("outbox".into())
            .with_headers(headers);
        if self.config.persistent {
            properties = properties.with_delivery_mode(2);
        }
        Ok(Outgoing {
            index,
            exchange,
            routing_key,
            properties,
        })
    }

    /// Checks that per-event exchanges exist (once per name), on a throw-away channel so a missing
    /// exchange closes that channel only. Returns the names that do not exist, with the error.
    async fn check_exchanges(&self, names: HashSet<String>) -> HashMap<String, Error> {
        let mut missing = HashMap::new();
        let unknown: Vec<String> = {
            let mut known = match self.known_exchanges.lock() {
                Ok(k) => k,
                Err(p) => p.into_inner(),
            };
            names
                .into_iter()
                .filter(|n| known.get(n).is_none())
                .collect()
        };
        if unknown.is_empty() {
            return missing;
        }
        let connection = {
            let st = self.state.lock().await;
            match &st.link {
                Some(l) => l.connection.clone(),
                None => return missing,
            }
        };
        for name in unknown {
            let Ok(short_name) = ShortString::try_new(name.clone()) else {
                continue;
            };
            let probe = match connection.create_channel().await {
                Ok(c) => c,
                Err(_) => return missing,
            };
            let result = probe
                .exchange_declare(
                    short_name,
                    ExchangeKind::Direct,
                    ExchangeDeclareOptions {
                        passive: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await;
            match result {
                Ok(()) => {
                    let _ = probe.close(200, "ok".into()).await;
                    if let Ok(mut k) = self.known_exchanges.lock() {
                        k.insert(name, ());
                    }
                }
                Err(e) => {
                    let err = map_lapin("check exchange", e);
                    if err.kind() == ErrorKind::DestinationNotFound {
                        missing.insert(
                            name.clone(),
                            Error::new(
                                ErrorKind::DestinationNotFound,
                                format!(
                                    "exchange {name:?} (the event's destination) does not exist"
                                ),
                            )
                            .with_context("adapter", "amqp")
                            .with_source(err),
                        );
                    }
                }
            }
        }
        missing
    }
}

#[async_trait]
impl Publisher for AmqpPublisher {
    fn call_limit(&self) -> Option<outbox_core::CallLimit> {
        // Connecting, then checking per-event exchanges, each within amqp.connect_timeout; sends and
        // confirms within amqp.confirm_timeout; the margin covers a reset's bounded close.
        let margin = Duration::from_secs(5);
        Some(outbox_core::CallLimit {
            limit: self.config.connect_timeout * 2 + self.config.confirm_timeout + margin,
            settings: format!(
                "2 x amqp.connect_timeout {} + amqp.confirm_timeout {} + {}",
                outbox_core::duration::format(self.config.connect_timeout),
                outbox_core::duration::format(self.config.confirm_timeout),
                outbox_core::duration::format(margin)
            ),
        })
    }

    async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
        let mut outcomes: Vec<Option<PublishOutcome>> = vec![None; events.len()];
        if events.is_empty() {
            return Vec::new();
        }
        let (channel, frame_max) = match self.channel().await {
            Ok(c) => c,
            Err(e) => return vec![Err(e); events.len()],
        };
        let destinations: HashSet<String> = events
            .iter()
            .filter_map(|e| e.destination.clone())
            .filter(|d| *d != self.config.exchange && self.allowed.allows(d))
            .collect();
        // Bounded by amqp.connect_timeout: on a timeout nothing is reported missing, and a missing
        // exchange then shows as a channel error of the publish itself.
        let missing = tokio::time::timeout(
            self.config.connect_timeout,
            self.check_exchanges(destinations),
        )
        .await
        .unwrap_or_default();

        // Send every message without waiting for its confirm. Each publish is polled once, in event
        // order, which hands its frames to the connection's I/O loop; the writes are then awaited
        // for the whole batch at once. (Awaiting each write before the next publish costs a round
        // trip through the I/O loop per message: BENCHMARKS.md, second machine.)
        // The bodies outlive the sends that borrow them (the payloads themselves, but in CloudEvents
        // structured mode).
        let bodies: Vec<std::borrow::Cow<'_, [u8]>> =
            events.iter().map(|e| self.format.body(e)).collect();
        let mut fence = Fence::new();
        let mut pending = Vec::with_capacity(events.len());
        let mut sending = Vec::with_capacity(events.len());
        let mut broken: Option<Error> = None;
        for (i, event) in events.iter().enumerate() {
            if let Some(e) = &broken {
                outcomes[i] = Some(Err(e.clone()));
                continue;
            }
            if fence.holds(event) {
                outcomes[i] = Some(Err(Fence::not_sent("amqp")));
                continue;
            }
            let prepared = match event.destination.as_ref().and_then(|d| missing.get(d)) {
                Some(err) => Err(err.clone().with_context("event_id", event.id)),
                None => self.prepare(i, event, frame_max, bodies[i].len()),
            };
            let out = match prepared {
                Ok(o) => o,
                Err(e) => {
                    fence.close(event);
                    outcomes[i] = Some(Err(e));
                    continue;
                }
            };
            let mut send = Box::pin(channel.basic_publish(
                out.exchange,
                out.routing_key,
                BasicPublishOptions {
                    mandatory: self.config.mandatory,
                    immediate: false,
                },
                &bodies[out.index],
                out.properties,
            ));
            match futures::poll!(send.as_mut()) {
                Poll::Ready(Ok(confirm)) => pending.push((out.index, confirm)),
                Poll::Ready(Err(e)) => {
                    let err = map_lapin("publish", e).temporary();
                    outcomes[i] = Some(Err(err.clone()));
                    broken = Some(err);
                }
                Poll::Pending => sending.push((out.index, send)),
            }
        }
        // The frames of one channel are written in the order they were handed over, so a write that
        // fails (the connection or channel closed) fails every later one as well. Writes and confirms
        // share one deadline, amqp.confirm_timeout from the first send: a broker that stops reading
        // (its socket buffer full) is a stall like one that stops confirming, and the channel is reset.
        let deadline = tokio::time::Instant::now() + self.config.confirm_timeout;
        let stalled = || {
            Error::new(
                ErrorKind::Timeout,
                format!(
                    "no publisher confirm within amqp.confirm_timeout = {}",
                    outbox_core::duration::format(self.config.confirm_timeout)
                ),
            )
            .with_context("adapter", "amqp")
        };
        let (indexes, writes): (Vec<usize>, Vec<_>) = sending.into_iter().unzip();
        match tokio::time::timeout_at(deadline, join_all(writes)).await {
            Ok(written) => {
                for (i, sent) in indexes.into_iter().zip(written) {
                    match sent {
                        Ok(confirm) => pending.push((i, confirm)),
                        Err(e) => {
                            let err = map_lapin("publish", e).temporary();
                            outcomes[i] = Some(Err(err.clone()));
                            broken.get_or_insert(err);
                        }
                    }
                }
            }
            Err(_) => {
                let e = stalled();
                for i in indexes {
                    outcomes[i] = Some(Err(e.clone()));
                }
                broken.get_or_insert(e);
            }
        }

        // Collect every confirm, concurrently, within the same deadline.
        let indexes: Vec<usize> = pending.iter().map(|(i, _)| *i).collect();
        let confirms = join_all(pending.into_iter().map(|(_, c)| c));
        match tokio::time::timeout_at(deadline, confirms).await {
            Ok(results) => {
                for (i, result) in indexes.into_iter().zip(results) {
                    let outcome = match result {
                        Ok(Confirmation::Ack(None)) => Ok(()),
                        Ok(Confirmation::Ack(Some(returned)))
                        | Ok(Confirmation::Nack(Some(returned))) => {
                            let e = Error::new(
                                ErrorKind::Unroutable,
                                format!(
                                    "returned by the broker: {} {} (exchange {:?}, routing key {:?}): no queue is bound for it",
                                    returned.reply_code,
                                    returned.reply_text,
                                    returned.delivery.exchange.as_str(),
                                    returned.delivery.routing_key.as_str()
                                ),
                            )
                            .with_context("adapter", "amqp")
                            .with_context("event_id", events[i].id);
                            Err(if self.config.unroutable_is_retryable {
                                e.temporary()
                            } else {
                                e.permanent()
                            })
                        }
                        Ok(Confirmation::Nack(None)) => Err(Error::new(
                            ErrorKind::Rejected,
                            "the broker negatively acknowledged the message (basic.nack)",
                        )
                        .with_context("adapter", "amqp")
                        .with_context("event_id", events[i].id)),
                        Ok(Confirmation::NotRequested) => Err(Error::new(
                            ErrorKind::Unexpected,
                            "the channel is not in confirm mode; the message may not have arrived",
                        )
                        .temporary()
                        .with_context("adapter", "amqp")),
                        Err(e) => {
                            // The channel or connection closed before the confirm: nobody can tell
                            // which message caused it, so every such event is retried.
                            let err = map_lapin("confirm", e).temporary();
                            broken.get_or_insert_with(|| err.clone());
                            Err(err.with_context("event_id", events[i].id))
                        }
                    };
                    outcomes[i] = Some(outcome);
                }
            }
            Err(_) => {
                let e = stalled();
                for i in indexes {
                    outcomes[i] = Some(Err(e.clone()));
                }
                broken.get_or_insert(e);
            }
        }
        if let Some(reason) = &broken {
            self.reset(reason).await;
        }
        refused_as_too_large(
            &mut outcomes,
            events,
            &bodies,
            self.config.max_message_bytes,
        );
        finish(outcomes)
    }

    /// Connects if needed, then asks the broker for a channel and closes it again: a round trip
    /// within `amqp.connect_timeout`, so that a connection the broker no longer answers on (a
    /// network cut without a reset, which lapin's status does not show until its heartbeats fail)
    /// fails the check, and is dropped for the next batch to connect again.
    async fn check(&self) -> Result<(), Error> {
        self.channel().await?;
        let connection = {
            let st = self.state.lock().await;
            match &st.link {
                Some(l) => l.connection.clone(),
                None => return Err(connection_lost("the connection to RabbitMQ closed")),
            }
        };
        let round_trip = async {
            let probe = connection
                .create_channel()
                .await
                .map_err(|e| map_lapin("check", e))?;
            probe
                .close(200, "outbox check".into())
                .await
                .map_err(|e| map_lapin("check", e))
        };
        let answered = match tokio::time::timeout(self.config.connect_timeout, round_trip).await {
            Ok(r) => r,
            Err(_) => Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "RabbitMQ did not answer on its connection within amqp.connect_timeout = {}",
                    outbox_core::duration::format(self.config.connect_timeout)
                ),
            )
            .with_context("adapter", "amqp")),
        };
        if let Err(e) = &answered {
            self.reset(e).await;
        }
        answered
    }

    fn name(&self) -> &str {
        "amqp"
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use outbox_core::{Error, ErrorKind, Event, PublishOutcome};

    use super::refused_as_too_large;

    fn ev(n: usize) -> Event {
        Event {
            id: outbox_core::Uuid::now_v7(),
            aggregate_type: "order".into(),
            aggregate_id: n.to_string(),
            event_type: "order.created".into(),
            payload: vec![b'x'; n],
            content_type: "application/json".into(),
            headers: Default::default(),
            destination: None,
            created_at: Default::default(),
            attempts: 0,
        }
    }

    fn closed() -> Error {
        Error::new(
            ErrorKind::InvalidInput,
            "broker replied 406 PRECONDITION_FAILED - message size 2000 is larger than configured max size 1000",
        )
        .temporary()
    }

    /// Only the failures the close caused change: the event over the limit fails for good, the
    /// others of the call it closed fail retryably as a connection problem; a failure of an event's
    /// own stays, and a close caused by another call (no event of this one over the limit) changes
    /// nothing.
    #[test]
    fn only_the_failures_a_size_refusal_caused_are_rewritten() {
        let events = vec![ev(10), ev(2000), ev(10), ev(10)];
        let bodies: Vec<Cow<'_, [u8]>> = events.iter().map(|e| Cow::from(&e.payload[..])).collect();
        let own = Error::new(ErrorKind::DestinationNotFound, "no exchange").permanent();
        let mut outcomes: Vec<Option<PublishOutcome>> = vec![
            Some(Ok(())),
            Some(Err(closed())),
            Some(Err(closed())),
            Some(Err(own.clone())),
        ];
        refused_as_too_large(&mut outcomes, &events, &bodies, 1 << 20);
        assert!(matches!(outcomes[0], Some(Ok(()))));
        let big = outcomes[1].clone().unwrap().unwrap_err();
        assert_eq!(big.kind(), ErrorKind::PayloadTooLarge);
        assert!(!big.is_retryable());
        let other = outcomes[2].clone().unwrap().unwrap_err();
        assert_eq!(other.kind(), ErrorKind::Connection);
        assert!(other.is_retryable());
        assert!(
            other.to_string().contains(&events[1].id.to_string()),
            "{other}"
        );
        assert_eq!(
            outcomes[3].clone().unwrap().unwrap_err().kind(),
            ErrorKind::DestinationNotFound
        );

        // Another call's message closed the shared channel: nothing here is over the limit.
        let small = vec![ev(10), ev(10)];
        let bodies: Vec<Cow<'_, [u8]>> = small.iter().map(|e| Cow::from(&e.payload[..])).collect();
        let mut outcomes: Vec<Option<PublishOutcome>> =
            vec![Some(Err(closed())), Some(Err(closed()))];
        refused_as_too_large(&mut outcomes, &small, &bodies, 1 << 20);
        for o in &outcomes {
            assert_eq!(
                o.clone().unwrap().unwrap_err().kind(),
                ErrorKind::InvalidInput
            );
        }
    }

    #[test]
    fn the_brokers_size_limit_is_read_from_its_refusal() {
        let reason = "invalid_input (temporary): broker replied 406 PRECONDITION_FAILED - message size 2097184 \
                      is larger than configured max size 1048576 during confirm [adapter=amqp]";
        assert_eq!(super::broker_size_limit(reason), Some(1_048_576));
        assert_eq!(
            super::broker_size_limit(
                "PRECONDITION_FAILED - message size 600000000 is larger than max size 536870912"
            ),
            Some(536_870_912)
        );
        assert_eq!(
            super::broker_size_limit("broker replied 406 PRECONDITION_FAILED - inequivalent arg"),
            None
        );
    }
}
