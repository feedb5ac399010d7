#![forbid(unsafe_code)]
#![doc = include_str!("../README.md")]

pub mod admin;
mod config;
mod consumer;
mod error;
mod publisher;
#[cfg(feature = "test-utils")]
pub mod testing;

pub use config::{is_secret, KafkaConfig, DEFAULT_BROKERS, DEFAULT_TOPIC};
pub use consumer::event_id;
pub use error::{classify_code, map_kafka};
pub use publisher::{check_topic, KafkaPublisher};
