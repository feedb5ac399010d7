#![forbid(unsafe_code)]
#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

// Shared by the workspace's adapters and binary, not a promise to users: hidden from the docs,
// it may change in any release.
#[doc(hidden)]
pub mod cache;
// Shared by the workspace's adapters and binary, not a promise to users: hidden from the docs,
// it may change in any release.
#[doc(hidden)]
pub mod duration;
mod error;
mod event;
pub mod format;
mod policy;
mod ports;
pub mod publishers;
pub mod redact;
mod relay;
// Shared by the workspace's adapters and binary, not a promise to users: hidden from the docs,
// it may change in any release.
#[doc(hidden)]
pub mod routing;
#[cfg(any(test, feature = "test-utils"))]
pub mod testkit;
// Shared by the workspace's adapters and binary, not a promise to users: hidden from the docs,
// it may change in any release.
#[doc(hidden)]
pub mod tls;
#[cfg(feature = "opentelemetry")]
pub mod trace;

pub use error::{Error, ErrorKind, ErrorStatus, Result};
pub use event::{header, Event, NewEvent, Payload, JSON_CONTENT_TYPE};
pub use policy::{OrderingPolicy, RetryPolicy};
pub use ports::{
    Action, Batch, CallLimit, ClaimRequest, EventTypeStats, Lease, PublishOutcome, Publisher,
    Settlement, Store, StoreStats,
};
pub use redact::redact_url;
pub use relay::{
    BatchReport, FailureDecision, NoopObserver, Relay, RelayConfig, RelayObserver, RelaySummary,
    Wake, DEFAULT_MAX_BATCH_BYTES,
};
pub use tokio_util::sync::CancellationToken;
pub use uuid::Uuid;
