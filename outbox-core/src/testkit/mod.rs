//! Test utilities (feature `test-utils`): an in-memory store, a scriptable publisher, and the
//! conformance suites that every [`Store`] and [`Publisher`] implementation runs against itself.
//!
//! The suites are plain async functions that panic with a clear message on a contract violation; call
//! them from a `#[tokio::test]` of the adapter with a fixture that builds the adapter against its real
//! server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod fault;
mod memory;
mod proxy;
mod publisher;
pub mod publisher_suite;
pub mod store_suite;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

pub use fault::FaultInjector;
pub use memory::MemoryStore;
pub use proxy::TcpProxy;
pub use publisher::{Behavior, ScriptedPublisher};

use crate::error::{Error, ErrorKind};
use crate::event::{Event, NewEvent};
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
    /// The message's content type: AMQP's property, the `content-type` header or attribute.
    pub content_type: Option<String>,
}

/// Builds a publisher and reads back what the broker received, for the publisher conformance suite.
#[async_trait]
pub trait PublisherFixture: Send + Sync {
    /// The publisher under test, routing to a destination that this fixture consumes from.
    async fn publisher(&self) -> Arc<dyn Publisher>;
    /// Everything received so far, waiting up to `timeout` until at least `count` messages arrived.
    async fn receive(&self, count: usize, timeout: Duration) -> Vec<Received>;
}

/// What a check asks of the publisher a [`BrokerFixture`] builds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Setup {
    /// The largest message the publisher may send (the adapter's `max_message_bytes`, or its
    /// client's limit); `None`: the adapter's default.
    pub max_message_bytes: Option<usize>,
    /// Patterns of the adapter's `allowed_destinations`; empty: the default (the configured
    /// destination only).
    pub allowed_destinations: Vec<String>,
    /// How many destinations the publisher may remember, where it keeps a cache of them.
    pub destination_cache: Option<usize>,
    /// The message format (`with_format`); default the outbox's own.
    pub format: crate::format::Formatter,
}

/// A publisher a [`BrokerFixture`] built for a check.
pub struct Built {
    /// The publisher, routing to the fixture's destination by default.
    pub publisher: Arc<dyn Publisher>,
    /// How many destinations it remembers now, for a publisher that keeps a cache of them (the
    /// RabbitMQ exchanges known to exist, the SQS queue URLs); `None` when it keeps none.
    pub cached_destinations: Option<Box<dyn Fn() -> usize + Send + Sync>>,
}

impl std::fmt::Debug for Built {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Built")
            .field("publisher", &self.publisher.name())
            .field(
                "cached_destinations",
                &self.cached_destinations.as_ref().map(|c| c()),
            )
            .finish()
    }
}

/// A [`PublisherFixture`] on a real broker, with the hooks the whole publisher contract needs
/// ([`publisher_suite::run_contract`], or [`crate::publisher_contract!`] for one test per rule).
#[async_trait]
pub trait BrokerFixture: PublisherFixture {
    /// A publisher to this fixture's destination, built with `setup`.
    async fn build(&self, setup: Setup) -> Built;

    /// This fixture's destination, as an event names it in `destination`.
    fn destination(&self) -> String;

    /// A destination the broker does not have (a queue or exchange never created, a topic name the
    /// broker refuses), for which the publisher must report [`ErrorKind::DestinationNotFound`].
    fn missing_destination(&self) -> String;

    /// Events this broker refuses for their content although they fit its size limit, each with the
    /// (permanent) kind of error the publisher must report and a text its message must contain: a
    /// header name longer than AMQP allows, an SQS delay over 900 s. Empty when there is no such
    /// content.
    fn poison(&self) -> Vec<(Event, ErrorKind, &'static str)>;

    /// Another destination on the same broker, with a consumer of its own.
    async fn sibling(&self) -> Box<dyn BrokerFixture>;

    /// A broker of the fixture's own (or a path to it) that the suite may take down and bring back.
    async fn outage(&self) -> Box<dyn Outage>;

    /// How a CloudEvents consumer of this broker reads a message
    /// ([`publisher_suite::messages_in_each_format_are_read_by_a_cloudevents_library`]).
    fn cloudevents_binding(&self) -> CloudEventsBinding;

    /// Removes what the fixture created on the broker (best effort).
    async fn dispose(&self) {}
}

/// The protocol binding a CloudEvents SDK reads a broker's messages with (the decoder
/// `.tools/bin/cloudevents-decode`, the CloudEvents SDK for Python, installed by
/// `scripts/test-env.sh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloudEventsBinding {
    /// The Kafka protocol binding: `ce_` headers, `content-type`, the key.
    Kafka,
    /// The AMQP protocol binding: `cloudEvents_` application properties, the content type property.
    Amqp,
    /// Knative's RabbitMQ binding: `ce-` headers, the content type property.
    RabbitMq,
    /// The HTTP binding's names (`ce-` attributes, `content-type`), as SQS carries them; SQS bodies
    /// are text, so binary payloads travel only in structured mode.
    Sqs,
}

impl CloudEventsBinding {
    fn decoder_name(self) -> &'static str {
        match self {
            CloudEventsBinding::Kafka => "kafka",
            CloudEventsBinding::Amqp => "amqp",
            CloudEventsBinding::RabbitMq => "rabbitmq",
            CloudEventsBinding::Sqs => "http",
        }
    }

    /// Whether message bodies carry any bytes (SQS bodies are text).
    pub fn carries_binary_bodies(self) -> bool {
        self != CloudEventsBinding::Sqs
    }
}

/// What a CloudEvents SDK read from one message: `{"attributes": {...}, "data": ...}` (or
/// `"data_b64"` for bytes), or `{"error": "..."}`.
///
/// Decodes `messages` with the CloudEvents SDK for Python (`.tools/bin/cloudevents-decode`, from
/// `scripts/test-env.sh`) through `binding`, binary or structured mode chosen from the content type
/// as the SDK's consumers do.
///
/// # Panics
/// When the decoder is not installed (the message says how to install it) or does not answer.
pub fn decode_cloudevents(
    binding: CloudEventsBinding,
    messages: &[Received],
) -> Vec<serde_json::Value> {
    use std::io::Write;
    let decoder = std::env::var("CLOUDEVENTS_DECODE").map_or_else(
        |_| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../.tools/bin/cloudevents-decode")
        },
        std::path::PathBuf::from,
    );
    assert!(
        decoder.exists(),
        "the CloudEvents decoder is not installed: run `bash scripts/test-env.sh` (it installs the CloudEvents SDK for Python into .tools/), or set CLOUDEVENTS_DECODE"
    );
    let mut input = String::new();
    for m in messages {
        let request = serde_json::json!({
            "binding": binding.decoder_name(),
            "headers": m.headers,
            "key": m.aggregate_id,
            "content_type": m.content_type,
            "body_b64": crate::format::base64_for_tests(&m.payload),
        });
        input.push_str(&request.to_string());
        input.push('\n');
    }
    let mut child = std::process::Command::new(&decoder)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", decoder.display()));
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input.as_bytes())
            .unwrap_or_else(|e| panic!("cannot write to the decoder: {e}"));
    }
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("the decoder failed: {e}"));
    assert!(
        out.status.success(),
        "the decoder exited with {}",
        out.status
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("decoder output {l:?}: {e}")))
        .collect()
}

/// A broker, or the way to it, that a check takes down and brings back.
#[async_trait]
pub trait Outage: Send + Sync {
    /// A publisher through this outage's broker (or path), to a destination that exists there.
    async fn publisher(&self) -> Arc<dyn Publisher>;
    /// Makes the broker unreachable: stopped, or every connection to it cut.
    async fn stop(&self);
    /// Makes it reachable again and waits until it serves (its destination present, or created by
    /// the broker on first use).
    async fn start(&self);
}

/// Locks `m`, also when a panicking test poisoned it.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
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

/// What `read` returns once it stopped growing: read again every 250 ms until four reads in a row
/// found the same length (a quiet second), so that late arrivals are included.
pub async fn read_until_quiet<T, F, Fut>(mut read: F) -> Vec<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Vec<T>>,
{
    let mut last = read().await;
    let mut quiet = 0;
    while quiet < 4 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = read().await;
        quiet = if now.len() == last.len() {
            quiet + 1
        } else {
            0
        };
        last = now;
    }
    last
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
    Tool::new(env_var, name, what).spawn(args, stderr)
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
    let mut tool = Tool::new(env_var, name, what);
    tool.cwd = cwd.map(std::path::Path::to_path_buf);
    tool.spawn(args, stderr)
}

/// A server program of the test's own (see [`spawn_tool`]), with the working directory and
/// environment it is started with.
#[derive(Debug, Clone)]
pub struct Tool {
    env_var: String,
    name: String,
    what: String,
    /// The working directory, when not the test's.
    pub cwd: Option<std::path::PathBuf>,
    /// Variables added to the program's environment.
    pub env: Vec<(String, std::ffi::OsString)>,
}

impl Tool {
    /// The program `$<env_var>`, else `.tools/bin/<name>`; `what` names it in errors.
    pub fn new(env_var: &str, name: &str, what: &str) -> Tool {
        Tool {
            env_var: env_var.to_string(),
            name: name.to_string(),
            what: what.to_string(),
            cwd: None,
            env: Vec::new(),
        }
    }

    /// Starts it with `args`, standard output discarded and standard error going to `stderr`.
    pub fn spawn(&self, args: &[&str], stderr: std::process::Stdio) -> std::process::Child {
        let path = std::env::var_os(&self.env_var)
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("../.tools/bin")
                    .join(&self.name)
            });
        assert!(
            path.exists(),
            "this test starts {} of its own and cannot find {}: run `bash scripts/test-env.sh` \
             (it installs it under .tools/bin), or set {} to the program",
            self.what,
            path.display(),
            self.env_var
        );
        let mut command = std::process::Command::new(&path);
        if let Some(dir) = &self.cwd {
            command.current_dir(dir);
        }
        command
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(std::process::Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", path.display()))
    }
}

/// A process a test started itself: killed (even when stopped with SIGSTOP) and reaped when dropped,
/// so a failing test leaves nothing running.
#[derive(Debug)]
pub struct OwnedProcess(pub std::process::Child);

impl OwnedProcess {
    /// Its process id.
    pub fn id(&self) -> u32 {
        self.0.id()
    }

    /// Kills it now and waits for it.
    pub fn stop(mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for OwnedProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A server program of the test's own that keeps its loopback port across restarts: a broker an
/// outage check stops and starts again.
#[derive(Debug)]
pub struct OwnServer {
    port: u16,
    what: &'static str,
    process: std::sync::Mutex<Option<OwnedProcess>>,
}

impl OwnServer {
    /// Not started yet; `what` names it in messages. Its port is a free one ([`free_port`]).
    pub fn new(what: &'static str) -> OwnServer {
        OwnServer {
            port: free_port(),
            what,
            process: std::sync::Mutex::new(None),
        }
    }

    /// Its loopback port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Starts it with `spawn(port)` and waits (up to 30 s) until it accepts connections.
    pub async fn start(&self, spawn: impl FnOnce(u16) -> std::process::Child) {
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err(),
            "port {} was taken by another program meanwhile: run the test again",
            self.port
        );
        let process = OwnedProcess(spawn(self.port));
        let (port, what) = (self.port, self.what);
        tokio::task::spawn_blocking(move || wait_for_port(port, Duration::from_secs(30), what))
            .await
            .unwrap_or_else(|e| panic!("waiting for {what}: {e}"));
        *lock(&self.process) = Some(process);
    }

    /// Kills it (if it runs) and waits for it.
    pub fn stop(&self) {
        if let Some(p) = lock(&self.process).take() {
            p.stop();
        }
    }
}

/// A loopback port nothing listens on at the moment (the system picks it), for a server of the
/// test's own: never a fixed number another test or program may hold.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free loopback port: {e}"))
}

/// Waits until something accepts TCP connections on `127.0.0.1:<port>`, at most `within`; panics
/// naming `what` otherwise.
pub fn wait_for_port(port: u16, within: Duration, what: &str) {
    let deadline = std::time::Instant::now() + within;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} did not start on 127.0.0.1:{port} within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
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
