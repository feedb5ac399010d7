#![forbid(unsafe_code)]
#![doc = include_str!("../README.md")]

pub mod admin;
mod config;
mod consumer;
mod error;
mod publisher;
#[cfg(feature = "test-utils")]
pub mod testing;

pub use admin::BoundQueue;
pub use config::{
    redact_url, AmqpConfig, ExchangeType, DEFAULT_EXCHANGE, DEFAULT_ROUTING_KEY, DEFAULT_URL,
};
pub use consumer::event_id;
pub use error::{classify_reply_code, map_lapin};
pub use publisher::AmqpPublisher;
