//! The configuration: a TOML file (`--config`, default `outbox.toml` when present), then environment
//! overrides (`OUTBOX_<SECTION>__<KEY>`, and `DATABASE_URL`), then validation that names the key.
//!
//! Every section and key has a default, so no file is needed on a machine with a local PostgreSQL:
//! the relay then publishes JSON lines to standard output.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use outbox_core::format::{Formatter, MessageFormat, DEFAULT_CLOUDEVENTS_SOURCE};
use outbox_core::{duration, Error, RelayConfig};
use outbox_postgres::DatabaseConfig;

use crate::adapters::{self, Adapter, Bound, Configured};

pub use crate::adapters::PublisherType;

/// The file read when `--config` is not given, if it exists.
pub const DEFAULT_CONFIG_FILE: &str = "outbox.toml";
/// Prefix of environment overrides: `OUTBOX_RELAY__BATCH_SIZE=1000` sets `relay.batch_size`.
pub const ENV_PREFIX: &str = "OUTBOX_";

/// `[publisher]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PublisherSection {
    /// `stdout` (default), `amqp`, `kafka` or `sqs`; the broker's own settings are in its section
    /// ([`crate::adapters`] maps each to its adapter).
    #[serde(rename = "type")]
    pub kind: PublisherType,
    /// The shape of the messages (brokers only; [`outbox_core::format`]): `outbox` (default),
    /// `cloudevents-binary`, `cloudevents-structured` or `debezium`.
    pub format: MessageFormat,
    /// The CloudEvents `source` attribute, a template with `{aggregate_type}`, `{event_type}`,
    /// `{aggregate_id}`. Default `/outbox/{aggregate_type}`.
    pub cloudevents_source: String,
}

impl Default for PublisherSection {
    fn default() -> Self {
        PublisherSection {
            kind: PublisherType::default(),
            format: MessageFormat::default(),
            cloudevents_source: DEFAULT_CLOUDEVENTS_SOURCE.into(),
        }
    }
}

impl PublisherSection {
    /// The formatter of `format` and `cloudevents_source`.
    ///
    /// # Errors
    /// A config error naming `publisher.cloudevents_source` when the template does not parse, or
    /// `publisher.format` when the stdout publisher is asked for another format than `outbox`.
    pub fn formatter(&self) -> Result<Formatter, Error> {
        if self.kind == PublisherType::Stdout && self.format != MessageFormat::Outbox {
            return Err(Error::config(format!(
                "publisher.format = \"{}\" applies to brokers; the stdout publisher prints each event as a JSON line: remove it or choose publisher.type = \"amqp\", \"kafka\" or \"sqs\"",
                self.format
            )));
        }
        Formatter::new(
            self.format,
            "publisher.cloudevents_source",
            &self.cloudevents_source,
        )
    }
}

/// `[http]`: metrics and health endpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Serve `/metrics`, `/healthz` and `/readyz` while the relay runs. Default true.
    pub enabled: bool,
    /// Listen address. Default `127.0.0.1:9464`.
    pub listen: SocketAddr,
    /// How often the outbox is counted for the pending / age / dead-letter gauges. Default 5 s.
    #[serde(with = "duration::serde_str")]
    pub stats_interval: Duration,
    /// Time a `/readyz` probe waits for the readiness check (one check runs at a time, its result
    /// reused for 1 s). Default 2 s.
    #[serde(with = "duration::serde_str")]
    pub ready_timeout: Duration,
    /// `/healthz` answers 503 once the relay has, for this long, neither settled a batch nor found
    /// nothing to claim nor checked an unreachable broker, while the oldest pending event is older
    /// than this: a wedged relay, for the orchestrator to restart. Must exceed the relay's hold time
    /// (2 x `relay.publish_timeout` + 10 s), the longest a healthy batch may take. Default (unset):
    /// the larger of 5 min and the hold time + 1 min ([`Config::liveness_timeout`]).
    #[serde(
        default,
        with = "duration::serde_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub liveness_timeout: Option<Duration>,
    /// Distinct `event_type` label values per metric (`outbox_events_failed`,
    /// `outbox_events_pending_by_type`); further types count under `event_type="other"`, so that
    /// writers inserting ever new types cannot grow `/metrics` without bound. Default 100.
    pub max_event_type_labels: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            enabled: true,
            listen: SocketAddr::from(([127, 0, 0, 1], 9464)),
            stats_interval: Duration::from_secs(5),
            ready_timeout: Duration::from_secs(2),
            liveness_timeout: None,
            max_event_type_labels: crate::metrics::DEFAULT_MAX_EVENT_TYPE_LABELS,
        }
    }
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable text (the default).
    #[default]
    Text,
    /// One JSON object per line, fields included.
    Json,
}

/// `[log]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `text` (default) or `json`.
    pub format: LogFormat,
    /// A tracing filter: `info` (default), `debug`, `outbox_core=debug,info`... `RUST_LOG` wins.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// `[database]`.
    pub database: DatabaseConfig,
    /// `[relay]`, with `[relay.retry]`.
    pub relay: RelayConfig,
    /// `[publisher]`.
    pub publisher: PublisherSection,
    /// `[amqp]`: RabbitMQ settings, used when `publisher.type = "amqp"` (in a build without
    /// RabbitMQ support: accepted, then refused if selected).
    #[serde(skip_serializing_if = "adapters::is_unset")]
    pub amqp: adapters::amqp::Section,
    /// `[kafka]`: Kafka settings, used when `publisher.type = "kafka"` (in a build without Kafka
    /// support: accepted, then refused if selected).
    #[serde(skip_serializing_if = "adapters::is_unset")]
    pub kafka: adapters::kafka::Section,
    /// `[sqs]`: SQS settings, used when `publisher.type = "sqs"` (in a build without SQS support:
    /// accepted, then refused if selected).
    #[serde(skip_serializing_if = "adapters::is_unset")]
    pub sqs: adapters::sqs::Section,
    /// `[http]`.
    pub http: HttpConfig,
    /// `[log]`.
    pub log: LogConfig,
    /// `[wal]`: the WAL source's slot and publication (`outbox wal`).
    pub wal: outbox_postgres::wal::WalConfig,
}

/// Sets `path` (dotted) in `root` to `value`, creating tables on the way.
fn set_path(root: &mut Value, path: &[String], value: Value) {
    let mut node = root;
    for (i, key) in path.iter().enumerate() {
        if !node.is_object() {
            *node = Value::Object(Default::default());
        }
        let Some(map) = node.as_object_mut() else {
            return;
        };
        if i + 1 == path.len() {
            map.insert(key.clone(), value);
            return;
        }
        node = map
            .entry(key.clone())
            .or_insert_with(|| Value::Object(Default::default()));
    }
}

/// A typed guess for an environment value: integer, float, boolean, else text.
fn guess(raw: &str) -> Value {
    if let Ok(i) = raw.parse::<i64>() {
        return Value::from(i);
    }
    if let Ok(f) = raw.parse::<f64>() {
        if f.is_finite() {
            return Value::from(f);
        }
    }
    match raw {
        "true" => Value::Bool(true),
        "false" => Value::Bool(false),
        _ => Value::String(raw.to_string()),
    }
}

impl Config {
    /// Loads the configuration: `path` (or `outbox.toml` when it exists and `path` is `None`), then
    /// the overrides in `env` (`OUTBOX_*` and `DATABASE_URL`), then validation.
    ///
    /// # Errors
    /// A config error naming the file or variable, the key, the bad value and what is expected.
    pub fn load(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, Error> {
        let (mut root, origin) = match path {
            Some(p) => (read_file(p)?, Some(p.to_path_buf())),
            None if Path::new(DEFAULT_CONFIG_FILE).exists() => (
                read_file(Path::new(DEFAULT_CONFIG_FILE))?,
                Some(PathBuf::from(DEFAULT_CONFIG_FILE)),
            ),
            None => (Value::Object(Default::default()), None),
        };
        // Keys set from the environment, with the variable that set them.
        let mut sources: Vec<(Vec<String>, String)> = Vec::new();
        let mut env: Vec<(String, String)> = env.into_iter().collect();
        env.sort();
        let mut database_url = None;
        for (name, raw) in env {
            if name == "DATABASE_URL" {
                database_url = Some(raw);
                continue;
            }
            let Some(rest) = name.strip_prefix(ENV_PREFIX) else {
                continue;
            };
            let path: Vec<String> = rest.split("__").map(|s| s.to_ascii_lowercase()).collect();
            if path.iter().any(|p| p.is_empty()) {
                return Err(Error::config(format!(
                    "environment variable {name}: expected OUTBOX_<SECTION>__<KEY>, such as OUTBOX_RELAY__BATCH_SIZE"
                )));
            }
            set_path(&mut root, &path, guess(&raw));
            sources.push((path, name));
        }
        // DATABASE_URL applies unless OUTBOX_DATABASE__URL was given.
        if let Some(url) = database_url {
            let key = vec!["database".to_string(), "url".to_string()];
            if !sources.iter().any(|(p, _)| *p == key) {
                set_path(&mut root, &key, Value::String(url));
                sources.push((key, "DATABASE_URL".into()));
            }
        }
        let config = deserialize(root, &sources, origin.as_deref())?;
        config.validate()?;
        Ok(config)
    }

    /// The liveness timeout in force: `http.liveness_timeout`, or when unset the larger of 5 min and
    /// the relay's hold time + 1 min.
    pub fn liveness_timeout(&self) -> Duration {
        self.http.liveness_timeout.unwrap_or_else(|| {
            Duration::from_secs(300).max(self.relay.hold_for() + Duration::from_secs(60))
        })
    }

    /// Checks every section.
    ///
    /// # Errors
    /// The first problem found, naming its key.
    pub fn validate(&self) -> Result<(), Error> {
        self.database.validate()?;
        self.relay.validate()?;
        if self.http.max_event_type_labels == 0 {
            return Err(Error::config(
                "http.max_event_type_labels = 0: expected at least 1 (event types past it count as \"other\")",
            ));
        }
        if self.http.stats_interval.is_zero() || self.http.ready_timeout.is_zero() {
            return Err(Error::config(
                "http.stats_interval and http.ready_timeout must be positive durations such as 5s",
            ));
        }
        if let Some(timeout) = self.http.liveness_timeout {
            if timeout <= self.relay.hold_for() {
                return Err(Error::config(format!(
                    "http.liveness_timeout = {} does not exceed the relay's hold time, {} (2 x relay.publish_timeout + 10s): \
                     a healthy relay may take that long over a batch; raise http.liveness_timeout above it, \
                     or leave it unset (then it is the larger of 5m and the hold time + 1m)",
                    outbox_core::duration::format(timeout),
                    outbox_core::duration::format(self.relay.hold_for()),
                )));
            }
        }
        self.publisher.formatter()?;
        self.adapter(self.publisher.kind).validate()
    }

    /// Checks that `database.pool_size` holds every connection the relay uses at once
    /// ([`Config::pool_connections_needed`]). Only `outbox relay` needs it: the other subcommands
    /// (`migrate` in an init container, `status`, `cleanup`...) use one or two connections.
    ///
    /// # Errors
    /// A config error naming each user of the pool, the total and the fix.
    pub fn check_relay_pool(&self) -> Result<(), Error> {
        let needed = self.pool_connections_needed();
        if needed > self.database.pool_size {
            let mut extra = String::new();
            if self.database.notify {
                extra += " + 1 (the NOTIFY listener, database.notify = true)";
            }
            if self.database.cleans_automatically() {
                extra += " + 1 (automatic cleanup, database.keep_processed_for with database.auto_cleanup = true)";
            }
            return Err(Error::config(format!(
                "database.pool_size = {} is too small: the relay uses relay.max_in_flight = {} (one connection per batch in flight) + 1 (statistics) + 1 (readiness check){extra} = {needed} connections at once; set database.pool_size to at least {needed}, or lower relay.max_in_flight",
                self.database.pool_size, self.relay.max_in_flight
            )));
        }
        Ok(())
    }

    /// The connections the relay's pool must hold so that nothing waits for one: one per batch in
    /// flight (its claim stays open while the batch is published and settled), one for the
    /// statistics task, one for the readiness check, one for the NOTIFY listener when
    /// `database.notify` is on, and one for the automatic cleanup when it runs.
    pub fn pool_connections_needed(&self) -> u32 {
        let in_flight = u32::try_from(self.relay.max_in_flight).unwrap_or(u32::MAX);
        in_flight
            .saturating_add(2)
            .saturating_add(u32::from(self.database.notify))
            .saturating_add(u32::from(self.database.cleans_automatically()))
    }

    /// The configuration as TOML, secrets redacted (for `outbox config`).
    /// (Derived values, such as the liveness timeout when unset, are shown as they are in force.)
    pub fn to_redacted_toml(&self) -> String {
        let mut shown = self.clone();
        shown.database.url = outbox_postgres::redact_url(&shown.database.url);
        // The value in force, also when it is derived from the relay's settings.
        shown.http.liveness_timeout = Some(self.liveness_timeout());
        adapters::amqp::ADAPTER.redact(&mut shown.amqp);
        adapters::kafka::ADAPTER.redact(&mut shown.kafka);
        adapters::sqs::ADAPTER.redact(&mut shown.sqs);
        toml::to_string_pretty(&shown).unwrap_or_else(|e| format!("# cannot render: {e}"))
    }

    /// The adapter of `kind` with its section of this configuration.
    pub fn adapter(&self, kind: PublisherType) -> Box<dyn Configured + '_> {
        match kind {
            PublisherType::Stdout => Box::new(Bound::new(&adapters::stdout::ADAPTER, &())),
            PublisherType::Amqp => Box::new(Bound::new(&adapters::amqp::ADAPTER, &self.amqp)),
            PublisherType::Kafka => Box::new(Bound::new(&adapters::kafka::ADAPTER, &self.kafka)),
            PublisherType::Sqs => Box::new(Bound::new(&adapters::sqs::ADAPTER, &self.sqs)),
        }
    }
}

fn read_file(path: &Path) -> Result<Value, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::config(format!(
            "cannot read the configuration file {}: {e}",
            path.display()
        ))
    })?;
    let table: toml::Table = toml::from_str(&text).map_err(|e| {
        Error::config(format!(
            "{} is not valid TOML: {}",
            path.display(),
            e.to_string().trim_end()
        ))
    })?;
    serde_json::to_value(table)
        .map_err(|e| Error::config(format!("{}: unsupported value: {e}", path.display())))
}

fn deserialize(
    mut root: Value,
    sources: &[(Vec<String>, String)],
    file: Option<&Path>,
) -> Result<Config, Error> {
    // An environment value guessed as a number or boolean may belong to a text key (a password
    // of digits): on a type error at such a key, retry with the raw text.
    for _ in 0..=sources.len() {
        match serde_path_to_error::deserialize::<_, Config>(&root) {
            Ok(c) => return Ok(c),
            Err(err) => {
                let path = err.path().to_string();
                let keys: Vec<String> = path.split('.').map(str::to_string).collect();
                let from_env = sources.iter().find(|(p, _)| *p == keys);
                if let Some((p, _)) = from_env {
                    if let Some(v) = lookup(&root, p) {
                        // A list from the environment: comma-separated (`a.*,b`).
                        if err.inner().to_string().contains("expected a sequence") {
                            let text = match v {
                                Value::String(t) => t.clone(),
                                other => other.to_string(),
                            };
                            let items: Vec<Value> = if text.trim().is_empty() {
                                Vec::new()
                            } else {
                                text.split(',')
                                    .map(|i| Value::String(i.trim().to_string()))
                                    .collect()
                            };
                            set_path(&mut root, p, Value::Array(items));
                            continue;
                        }
                        if !v.is_string() && err.inner().to_string().contains("invalid type") {
                            let text = match v {
                                Value::Number(n) => n.to_string(),
                                Value::Bool(b) => b.to_string(),
                                other => other.to_string(),
                            };
                            set_path(&mut root, p, Value::String(text));
                            continue;
                        }
                    }
                }
                let origin = match from_env {
                    Some((_, name)) => format!(" (from {name})"),
                    _ => file
                        .map(|f| format!(" (in {})", f.display()))
                        .unwrap_or_default(),
                };
                let key = if path == "." || path.is_empty() {
                    "configuration".to_string()
                } else {
                    path
                };
                return Err(Error::config(format!("{key}{origin}: {}", err.inner())));
            }
        }
    }
    Err(Error::config("the configuration could not be read"))
}

fn lookup<'a>(root: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(root, |node, key| node.get(key))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_str(toml_text: &str, env: &[(&str, &str)]) -> Result<Config, Error> {
        let dir = std::env::temp_dir().join(format!("outbox-config-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("outbox.toml");
        std::fs::write(&path, toml_text).unwrap();
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        let r = Config::load(Some(&path), env);
        let _ = std::fs::remove_dir_all(&dir);
        r
    }

    #[test]
    fn the_liveness_timeout_follows_the_hold_time_unless_set() {
        let c = Config::load(None, Vec::new()).unwrap();
        assert_eq!(c.liveness_timeout(), Duration::from_secs(300));
        // A long publish timeout (as a Kafka delivery timeout of 300 s needs) still loads.
        let c = load_str("[relay]\npublish_timeout = \"320s\"\n", &[]).unwrap();
        assert_eq!(c.liveness_timeout(), Duration::from_secs(650 + 60));
        let e = load_str(
            "[relay]\npublish_timeout = \"320s\"\n[http]\nliveness_timeout = \"10m\"\n",
            &[],
        )
        .unwrap_err();
        assert!(
            e.message().contains("http.liveness_timeout = 10m")
                && e.message().contains("hold time, 650s"),
            "{e}"
        );
        let c = load_str("[http]\nliveness_timeout = \"20m\"\n", &[]).unwrap();
        assert_eq!(c.liveness_timeout(), Duration::from_secs(1200));
    }

    #[test]
    fn no_file_means_defaults() {
        let c = Config::load(None, Vec::new()).unwrap();
        assert_eq!(c.publisher.kind, PublisherType::Stdout);
        assert_eq!(c.relay.batch_size, 500);
        assert_eq!(c.database.table, "outbox_events");
    }

    #[test]
    fn env_overrides_the_file() {
        let c = load_str(
            "[relay]\nbatch_size = 100\n[database]\nurl = \"postgres://a@h/db\"\n",
            &[
                ("OUTBOX_RELAY__BATCH_SIZE", "250"),
                ("OUTBOX_RELAY__RETRY__MAX_ATTEMPTS", "3"),
                ("OUTBOX_RELAY__POLL_INTERVAL", "2s"),
                ("DATABASE_URL", "postgres://b@h/db"),
                ("UNRELATED", "x"),
            ],
        )
        .unwrap();
        assert_eq!(c.relay.batch_size, 250);
        assert_eq!(c.relay.retry.max_attempts, 3);
        assert_eq!(c.relay.poll_interval, Duration::from_secs(2));
        assert_eq!(c.database.url, "postgres://b@h/db");
        let c = load_str(
            "[publisher]\ntype = \"kafka\"\n",
            &[("OUTBOX_KAFKA__ALLOWED_DESTINATIONS", "audit.*, orders.v2")],
        );
        #[cfg(feature = "kafka")]
        assert_eq!(
            c.unwrap().kafka.allowed_destinations,
            vec!["audit.*".to_string(), "orders.v2".to_string()],
            "a list from the environment is comma-separated"
        );
        #[cfg(not(feature = "kafka"))]
        drop(c);
        let c = load_str(
            "",
            &[
                ("DATABASE_URL", "postgres://b@h/db"),
                ("OUTBOX_DATABASE__URL", "postgres://c@h/db"),
            ],
        )
        .unwrap();
        assert_eq!(
            c.database.url, "postgres://c@h/db",
            "OUTBOX_DATABASE__URL wins over DATABASE_URL"
        );
    }

    #[test]
    fn digits_stay_text_where_text_is_expected() {
        let c = load_str(
            "",
            &[
                ("OUTBOX_DATABASE__SCHEMA", "s123"),
                ("OUTBOX_LOG__LEVEL", "1234"),
            ],
        )
        .unwrap();
        assert_eq!(c.log.level, "1234");
    }

    #[test]
    fn errors_name_the_key_the_value_and_the_source() {
        let e = load_str("[relay]\nbatch_siz = 10\n", &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("relay") && e.contains("unknown field `batch_siz`"),
            "{e}"
        );
        let e = load_str("[relay]\nbatch_size = \"lots\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("relay.batch_size") && e.contains("invalid type"),
            "{e}"
        );
        let e = load_str("", &[("OUTBOX_RELAY__BATCH_SIZE", "lots")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("relay.batch_size (from OUTBOX_RELAY__BATCH_SIZE)"),
            "{e}"
        );
        let e = load_str("[relay]\nbatch_size = 0\n", &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("relay.batch_size = 0: expected 1 to 100000"),
            "{e}"
        );
        let e = load_str("[relay]\npoll_interval = \"soon\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("relay.poll_interval") && e.contains("not a duration"),
            "{e}"
        );
        let e = load_str("[publisher]\ntype = \"carrier-pigeon\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("publisher.type") && e.contains("unknown variant"),
            "{e}"
        );
        #[cfg(not(feature = "sqs"))]
        {
            let e = load_str("[publisher]\ntype = \"sqs\"\n", &[])
                .unwrap_err()
                .to_string();
            assert!(e.contains("built without the `sqs` feature"), "{e}");
        }
        let e = load_str(
            "[publisher]\ntype = \"sqs\"\n[sqs]\nmax_message_bytes = 1\n",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("sqs.max_message_bytes") || e.contains("built without the `sqs` feature"),
            "{e}"
        );
        let e = load_str("not toml = = 1", &[]).unwrap_err().to_string();
        assert!(e.contains("is not valid TOML"), "{e}");
        let e = Config::load(Some(Path::new("/nonexistent/outbox.toml")), Vec::new())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot read the configuration file /nonexistent/outbox.toml"),
            "{e}"
        );
        // Only the relay needs its whole pool: any other subcommand loads the same file.
        let relay_pool = |toml: &str, env: &[(&str, &str)]| {
            load_str(toml, env).and_then(|c| c.check_relay_pool().map(|()| c))
        };
        assert!(load_str(
            "[database]\npool_size = 2\n[relay]\nmax_in_flight = 4\n",
            &[]
        )
        .is_ok());
        let e = relay_pool(
            "[database]\npool_size = 2\n[relay]\nmax_in_flight = 4\n",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("database.pool_size = 2 is too small"), "{e}");
        // One formula counts every user of the pool: batches, statistics, readiness, listener.
        let ok = relay_pool(
            "[database]\npool_size = 4\n[relay]\nmax_in_flight = 2\n",
            &[],
        );
        assert!(ok.is_ok(), "{ok:?}");
        let e = relay_pool(
            "[database]\npool_size = 4\nnotify = true\n[relay]\nmax_in_flight = 2\n",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("+ 1 (the NOTIFY listener, database.notify = true) = 5 connections"),
            "{e}"
        );
        let e = relay_pool(
            "[database]\npool_size = 3\n[relay]\nmax_in_flight = 2\n",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("set database.pool_size to at least 4"), "{e}");
        // Kept rows cleaned by the relay: one more connection, named; none when cleaned by hand.
        let keep =
            "[database]\npool_size = 4\nkeep_processed_for = \"1d\"\n[relay]\nmax_in_flight = 2\n";
        let e = relay_pool(keep, &[]).unwrap_err().to_string();
        assert!(
            e.contains("+ 1 (automatic cleanup, database.keep_processed_for with database.auto_cleanup = true) = 5 connections"),
            "{e}"
        );
        let by_hand = keep.replace("[relay]", "auto_cleanup = false\n[relay]");
        assert!(relay_pool(&by_hand, &[]).is_ok());
    }

    #[test]
    fn the_message_format_is_checked() {
        let c = load_str(
            "[publisher]\ntype = \"kafka\"\nformat = \"cloudevents-structured\"\n",
            &[],
        )
        .unwrap();
        assert_eq!(
            c.publisher.formatter().unwrap().format(),
            MessageFormat::CloudeventsStructured
        );
        let e = load_str("[publisher]\ntype = \"kafka\"\nformat = \"avro\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("publisher.format") && e.contains("cloudevents-binary"),
            "{e}"
        );
        let e = load_str("", &[("OUTBOX_PUBLISHER__FORMAT", "debezium")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the stdout publisher prints each event as a JSON line"),
            "{e}"
        );
        let e = load_str(
            "[publisher]\ntype = \"sqs\"\nformat = \"cloudevents-binary\"\ncloudevents_source = \"/{tenant}\"\n",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("publisher.cloudevents_source"), "{e}");
    }

    #[test]
    fn secrets_never_show() {
        let c = load_str(
            "[database]\nurl = \"postgres://app:hunter2@db/shop\"\n",
            &[],
        )
        .unwrap();
        assert!(!format!("{c:?}").contains("hunter2"));
        assert!(!c.to_redacted_toml().contains("hunter2"));
        assert!(c.to_redacted_toml().contains("app:***@db"));
    }
}
