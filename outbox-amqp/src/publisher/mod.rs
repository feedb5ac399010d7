//! The RabbitMQ publisher: one connection, one confirm-mode channel, batches published without
//! waiting per message, one outcome per event from its own confirm. Its parts: `connection` (the
//! link and its reconnection), `message` (what an event becomes; destination checks) and `confirm`
//! (outcomes from confirms); this module holds the publisher and its calls.

mod confirm;
mod connection;
mod message;

use std::collections::HashSet;
use std::sync::Mutex as StdMutex;
use std::task::Poll;

use async_trait::async_trait;
use futures::future::join_all;
use lapin::options::BasicPublishOptions;
use tokio::sync::Mutex;

use txoutbox_core::cache::{BoundedCache, DEFAULT_DESTINATION_CACHE};
use txoutbox_core::format::Formatter;
use txoutbox_core::publishers::{finish, Fence};
use txoutbox_core::routing::{AllowList, Template};
use txoutbox_core::{Error, Event, PublishOutcome, Publisher};

use crate::config::AmqpConfig;
use crate::error::{self, map_lapin};
use confirm::refused_as_too_large;
use connection::LinkState;
pub(crate) use connection::{connect_channel, declare_exchange};

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
            state: Mutex::new(LinkState::new(backoff)),
            known_exchanges: StdMutex::new(BoundedCache::new(DEFAULT_DESTINATION_CACHE)),
            format: Formatter::default(),
        })
    }

    /// Remembers at most `capacity` exchanges found to exist (default
    /// [`txoutbox_core::cache::DEFAULT_DESTINATION_CACHE`]); the least recently used is checked again
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
}

#[async_trait]
impl Publisher for AmqpPublisher {
    fn call_limit(&self) -> Option<txoutbox_core::CallLimit> {
        Some(self.config.call_limit())
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
        // for the whole batch at once (awaiting each write before the next publish would cost a
        // round trip through the I/O loop per message).
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
        let stalled = || error::no_confirm(self.config.confirm_timeout);
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
                    let outcome = self.confirmed(result, &events[i], &mut broken);
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
                None => return Err(error::connection_lost("the connection to RabbitMQ closed")),
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
            Err(_) => Err(error::no_answer(self.config.connect_timeout)),
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
