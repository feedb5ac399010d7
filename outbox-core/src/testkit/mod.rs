//! Test utilities (feature `test-utils`): an in-memory store, a scriptable publisher, and the
//! conformance suites that every [`Store`] and [`Publisher`] implementation runs against itself.
//!
//! The suites are plain async functions that panic with a clear message on a contract violation; call
//! them from a `#[tokio::test]` of the adapter with a fixture that builds the adapter against its real
//! server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod memory;
mod publisher;
pub mod publisher_suite;
pub mod store_suite;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

pub use memory::MemoryStore;
pub use publisher::{Behavior, ScriptedPublisher};

use crate::error::Error;
use crate::event::NewEvent;
use crate::ports::{Publisher, Store};

/// Where an event stands in a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventStatus {
    /// Waiting to be published (maybe backing off or held back).
    Pending,
    /// Published (and kept).
    Processed,
    /// Dead-lettered.
    DeadLettered,
}

/// One event's state, as the conformance suite inspects it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventState {
    /// Where it stands.
    pub status: EventStatus,
    /// Attempts recorded.
    pub attempts: u32,
    /// Last error recorded.
    pub last_error: Option<String>,
}

/// A store the conformance suite can fill and inspect.
#[async_trait]
pub trait TestStore: Store {
    /// Commits `events` as the writer would, in order.
    async fn insert(&self, events: Vec<NewEvent>) -> Result<(), Error>;
    /// The event's state; `None` when the store no longer holds it (deleted after publishing).
    async fn state(&self, id: Uuid) -> Result<Option<EventState>, Error>;
}

/// Builds isolated stores for the store conformance suite.
#[async_trait]
pub trait StoreFixture: Send + Sync {
    /// A store over a new, empty outbox that no other call shares.
    async fn store(&self) -> Arc<dyn TestStore>;
}

/// A message as an independent consumer received it from the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// The event id, read from the broker's native field (message id, dedup id) or header.
    pub event_id: Option<Uuid>,
    /// The aggregate id, read from the key, group id or header.
    pub aggregate_id: Option<String>,
    /// The event type, read from the native type field or header.
    pub event_type: Option<String>,
    /// The body.
    pub payload: Vec<u8>,
    /// Headers or attributes.
    pub headers: BTreeMap<String, String>,
    /// Where it was received (topic, queue...).
    pub destination: String,
}

/// Builds a publisher and reads back what the broker received, for the publisher conformance suite.
#[async_trait]
pub trait PublisherFixture: Send + Sync {
    /// The publisher under test, routing to a destination that this fixture consumes from.
    async fn publisher(&self) -> Arc<dyn Publisher>;
    /// Everything received so far, waiting up to `timeout` until at least `count` messages arrived.
    async fn receive(&self, count: usize, timeout: Duration) -> Vec<Received>;
}

/// Waits until `got` holds at least `count` items or `timeout` passes, then returns a copy (for
/// consumer fixtures that collect messages in the background).
pub async fn wait_for_items<T: Clone>(
    got: &std::sync::Mutex<Vec<T>>,
    count: usize,
    timeout: Duration,
) -> Vec<T> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let items = match got.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        };
        if items.len() >= count || tokio::time::Instant::now() >= deadline {
            return items;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Starts a server program of the test's own, found as `$<env_var>` or else as `.tools/bin/<name>`
/// (where `scripts/test-env.sh` installs it), with `args`, standard output discarded and standard
/// error going to `stderr`. Panics, saying how to install it, when the program is missing.
pub fn spawn_tool(
    env_var: &str,
    name: &str,
    what: &str,
    args: &[&str],
    stderr: std::process::Stdio,
) -> std::process::Child {
    spawn_tool_in(None, env_var, name, what, args, stderr)
}

/// As [`spawn_tool`], running in `cwd` when given (for programs that take paths relative to it).
pub fn spawn_tool_in(
    cwd: Option<&std::path::Path>,
    env_var: &str,
    name: &str,
    what: &str,
    args: &[&str],
    stderr: std::process::Stdio,
) -> std::process::Child {
    let path = std::env::var_os(env_var)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../.tools/bin")
                .join(name)
        });
    assert!(
        path.exists(),
        "this test starts {what} of its own and cannot find {}: run `bash scripts/test-env.sh` \
         (it installs it under .tools/bin), or set {env_var} to the program",
        path.display()
    );
    let mut command = std::process::Command::new(&path);
    if let Some(dir) = cwd {
        command.current_dir(dir);
    }
    command
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", path.display()))
}

/// A JSON event of `aggregate` numbered `n`, with a `traceparent` header.
pub fn sample_event(aggregate: &str, n: usize) -> NewEvent {
    NewEvent::new(
        "order",
        aggregate,
        "order.updated",
        serde_json::json!({ "aggregate": aggregate, "n": n }),
    )
    .with_header(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    )
}
