//! The configuration reference (`outbox config --reference`), generated from the code's own
//! definitions: the keys are the fields the configuration's types accept (read from their
//! deserializers), the defaults are `Config::default()` as the binary prints it, the types are what
//! each key's deserializer takes, and the environment names follow the loader's rule
//! (`OUTBOX_<SECTION>__<KEY>`).

use serde_json::{json, Value};

use super::Config;

/// One key of the reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    /// Its path, such as `relay.retry.max_attempts`.
    pub path: Vec<String>,
    /// What it takes: `boolean`, `integer`, `number`, `duration`, `string`, `list of strings`,
    /// `table`, or `` one of `a`, `b` ``.
    pub kind: String,
    /// Its default as the binary prints it (`None`: unset).
    pub default: Option<String>,
}

impl Key {
    /// The variable that sets it.
    pub fn env(&self) -> String {
        format!(
            "{}{}",
            super::ENV_PREFIX,
            self.path.join("__").to_ascii_uppercase()
        )
    }
}

/// Whether the configuration's deserializer takes `value` at `path` (nothing else set).
fn takes(path: &[String], value: Value) -> Result<(), String> {
    let mut root = value;
    for part in path.iter().rev() {
        root = json!({ part.as_str(): root });
    }
    serde_path_to_error::deserialize::<_, Config>(&root)
        .map(|_| ())
        .map_err(|e| e.inner().to_string())
}

/// The fields the table at `path` accepts, from its deserializer's answer to an unknown one.
fn fields(path: &[String]) -> Vec<String> {
    let probe = "(no such key)";
    let mut at = path.to_vec();
    at.push(probe.to_string());
    let message = takes(&at, json!(0)).err().unwrap_or_default();
    one_of(&message)
}

/// The names in serde's "expected one of `a`, `b`" (or "expected `a`").
fn one_of(message: &str) -> Vec<String> {
    let Some((_, list)) = message.split_once("expected ") else {
        return Vec::new();
    };
    list.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// What the key at `path` takes, from what its deserializer accepts.
fn kind(path: &[String]) -> Option<String> {
    let ok = |v: Value| takes(path, v).is_ok();
    if ok(json!(true)) {
        return Some("boolean".into());
    }
    if ok(json!(7)) {
        return Some(if ok(json!(1.5)) { "number" } else { "integer" }.into());
    }
    if ok(json!(1.5)) {
        return Some("number".into());
    }
    if ok(json!("1s")) && !ok(json!("no-unit-here")) {
        return Some("duration".into());
    }
    if ok(json!(["x"])) {
        return Some("list of strings".into());
    }
    if ok(json!({ "x": "y" })) && !ok(json!("x")) {
        return Some("table".into());
    }
    let refused = takes(path, json!("(no such value)")).err();
    match refused {
        None => Some("string".into()),
        Some(message) if message.contains("unknown variant") => {
            let variants = one_of(&message);
            Some(format!(
                "one of {}",
                variants
                    .iter()
                    .map(|v| format!("`{v}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        }
        // A text the deserializer checks (an address, a template): a string, as its default.
        Some(_) => None,
    }
}

/// Every key of the configuration, in the order of its sections and fields.
pub fn keys() -> Vec<Key> {
    let defaults = toml::Value::try_from(Config::default()).unwrap_or(toml::Value::Boolean(false));
    let mut out = Vec::new();
    walk(&[], &defaults, &mut out);
    out
}

fn walk(path: &[String], defaults: &toml::Value, out: &mut Vec<Key>) {
    for field in fields(path) {
        let mut at = path.to_vec();
        at.push(field.clone());
        let default = defaults.get(&field);
        // A section of an adapter this build leaves out takes anything: not listed.
        if path.is_empty() && fields(&at).is_empty() {
            continue;
        }
        // A section of its own (not a table of free names, such as librdkafka's properties).
        if let Some(table @ toml::Value::Table(_)) = default {
            if !fields(&at).is_empty() {
                walk(&at, table, out);
                continue;
            }
        }
        let kind = kind(&at).or_else(|| {
            default.map(|d| match d {
                toml::Value::String(_) => "string".into(),
                other => other.type_str().into(),
            })
        });
        // A key no value is accepted for (an old name, refused naming the new one) is not one.
        let Some(kind) = kind else { continue };
        out.push(Key {
            path: at,
            kind,
            default: default.map(shown),
        });
    }
}

fn shown(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => format!("`{s}`"),
        toml::Value::Array(a) if a.is_empty() => "`[]`".into(),
        toml::Value::Table(t) if t.is_empty() => "empty".into(),
        other => format!("`{other}`"),
    }
}

/// The reference as a Markdown table: key, type, default, environment variable.
pub fn markdown() -> String {
    let mut s = String::from("| key | type | default | environment |\n|---|---|---|---|\n");
    for k in keys() {
        let mut env = format!("`{}`", k.env());
        if k.path == ["database", "url"] {
            env.push_str(", `DATABASE_URL`");
        }
        if k.kind == "table" {
            env = format!("`{}__<NAME>` (`__` for each `.`)", k.env());
        }
        s.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            k.path.join("."),
            k.kind,
            k.default.as_deref().unwrap_or("unset"),
            env
        ));
    }
    s
}

// The reference of a build with every adapter (the one the README holds).
#[cfg(all(test, feature = "amqp", feature = "kafka", feature = "sqs"))]
mod tests {
    use super::*;

    fn key(path: &str) -> Key {
        keys()
            .into_iter()
            .find(|k| k.path.join(".") == path)
            .unwrap_or_else(|| panic!("no key {path}"))
    }

    #[test]
    fn every_section_is_read_from_its_deserializer() {
        let sections: Vec<String> = fields(&[]);
        for s in [
            "database",
            "relay",
            "publisher",
            "amqp",
            "kafka",
            "sqs",
            "http",
            "log",
            "wal",
        ] {
            assert!(sections.contains(&s.to_string()), "{sections:?}");
            assert!(!fields(&[s.to_string()]).is_empty(), "{s}");
        }
    }

    #[test]
    fn types_defaults_and_names_come_from_the_definitions() {
        let k = key("relay.retry.max_attempts");
        assert_eq!(
            (k.kind.as_str(), k.default.as_deref()),
            ("integer", Some("`10`"))
        );
        assert_eq!(k.env(), "OUTBOX_RELAY__RETRY__MAX_ATTEMPTS");
        assert_eq!(key("relay.poll_interval").kind, "duration");
        assert_eq!(key("relay.retry.jitter").kind, "number");
        assert_eq!(key("database.notify").kind, "boolean");
        assert_eq!(key("amqp.allowed_destinations").kind, "list of strings");
        assert_eq!(key("kafka.properties").kind, "table");
        // Unset by default, and still listed with what it takes.
        let k = key("database.keep_processed_for");
        assert_eq!((k.kind.as_str(), k.default), ("duration", None));
        assert_eq!(key("sqs.endpoint_url").kind, "string");
        assert!(key("relay.ordering").kind.contains("`unordered`"));
        assert_eq!(key("log.format").kind, "one of `text`, `json`");
        // The old name, refused naming the new one, is not a key.
        assert!(!keys()
            .iter()
            .any(|k| k.path.join(".") == "kafka.message_max_bytes"));
    }
}
