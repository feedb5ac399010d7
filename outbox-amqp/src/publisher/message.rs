//! The message an event becomes: exchange, routing key, properties and headers (checked against
//! AMQP's short strings, the connection's frame size and `amqp.max_message_bytes`), and the check
//! that the exchanges events name exist, on a channel of its own.

use std::collections::{HashMap, HashSet};

use lapin::options::ExchangeDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, ExchangeKind};

use txoutbox_core::{header, Error, ErrorKind, Event};

use super::AmqpPublisher;
use crate::error::{self, map_lapin};

const MAX_SHORT_STRING: usize = 255;

/// One event ready to send.
pub(super) struct Outgoing {
    pub(super) index: usize,
    pub(super) exchange: ShortString,
    pub(super) routing_key: ShortString,
    pub(super) properties: BasicProperties,
}

/// `value` as an AMQP short string; `field` names it in the error when it is too long.
pub(super) fn short(field: &str, value: &str) -> Result<ShortString, Error> {
    ShortString::try_new(value.to_string())
        .map_err(|_| error::too_long(field, value.len(), MAX_SHORT_STRING))
}

impl AmqpPublisher {
    pub(super) fn prepare(
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
            return Err(error::headers_too_large(header_bytes, frame_max));
        }
        if body_len > self.config.max_message_bytes {
            return Err(error::oversized(body_len, self.config.max_message_bytes));
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
    pub(super) async fn check_exchanges(&self, names: HashSet<String>) -> HashMap<String, Error> {
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
                        missing.insert(name.clone(), error::exchange_missing(&name, err));
                    }
                }
            }
        }
        missing
    }
}
