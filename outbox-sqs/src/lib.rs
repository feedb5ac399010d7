#![forbid(unsafe_code)]
#![doc = include_str!("../README.md")]

pub mod admin;
mod config;
mod consumer;
mod error;
mod publisher;
#[cfg(feature = "test-utils")]
pub mod testing;

pub use config::{SqsConfig, DEFAULT_QUEUE, SQS_MAX_BYTES};
pub use consumer::event_id;
pub use error::{classify_code, map_entry_failure, map_sdk};
pub use publisher::{
    https_client, message_group_id, SqsPublisher, DELAY_HEADER, ENCODING, FOLDED_HEADERS,
    MAX_ATTRIBUTES, MAX_BATCH_ENTRIES,
};
