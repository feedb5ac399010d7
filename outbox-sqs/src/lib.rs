#![forbid(unsafe_code)]
#![doc = include_str!("../README.md")]

pub mod admin;
mod config;
mod error;
mod publisher;
#[cfg(feature = "test-utils")]
pub mod testing;

pub use config::{SqsConfig, DEFAULT_QUEUE, SQS_MAX_BYTES};
pub use error::{classify_code, map_entry_failure, map_sdk};
pub use publisher::{
    event_id, https_client, message_group_id, SqsPublisher, DELAY_HEADER, ENCODING, FOLDED_HEADERS,
    MAX_ATTRIBUTES, MAX_BATCH_ENTRIES,
};
