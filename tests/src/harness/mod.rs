//! The fault-injection harness: the real `outbox` binary as a child process, a continuous writer, and
//! an independent consumer per broker, so each scenario can compare what was committed with what the
//! broker received. Each part in a module of its own, all re-exported here.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod http;
mod load;
mod postgres;
mod relay;
mod scenario;
mod server;
mod sink;
mod verdict;

pub use txoutbox_core::testkit::{free_port, FaultInjector, OwnedProcess};

pub use http::*;
pub use load::*;
pub use postgres::*;
pub use relay::*;
pub use scenario::*;
pub use server::*;
pub use sink::*;
pub use verdict::*;
