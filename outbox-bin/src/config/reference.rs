//! The configuration reference (`outbox config --reference`), generated from the configuration's
//! types: the keys, what each takes and its description (the field's doc comment) come from their
//! JSON schema (`schemars`), the order from the fields' order (unset keys, which the binary does
//! not print, after the others), the defaults from
//! `Config::default()` as the binary prints it, and the environment names from the loader's rule
//! (`OUTBOX_<SECTION>__<KEY>`).

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

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
    /// Its doc comment, on one line, links reduced to their text.
    pub description: String,
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

    /// The description's first sentence.
    pub fn summary(&self) -> String {
        let text = self.description.as_str();
        let end = text
            .match_indices(". ")
            .map(|(i, _)| i + 1)
            .find(|&i| !text[..i].ends_with("e.g.") && !text[..i].ends_with("i.e."))
            .unwrap_or(text.len());
        let sentence = &text[..end];
        if sentence.chars().count() <= SUMMARY_CHARS {
            return sentence.to_string();
        }
        // A long first sentence: cut at a word, the rest is in the section table above.
        let cut: String = sentence.chars().take(SUMMARY_CHARS).collect();
        let at = cut.rfind(' ').unwrap_or(cut.len());
        format!("{}…", cut[..at].trim_end_matches([',', ';', ':']))
    }
}

/// The most characters of a description the table shows.
const SUMMARY_CHARS: usize = 240;

/// The configuration's JSON schema, as it is written (the shape `outbox config` prints).
fn schema() -> Value {
    let generator = schemars::generate::SchemaSettings::default()
        .for_serialize()
        .into_generator();
    generator.into_root_schema_for::<Config>().to_value()
}

/// A JSON object's keys in the order they are written (`serde_json::Value` sorts them): the
/// order of the fields.
#[derive(Debug, Default)]
struct Written(Vec<(String, Written)>);

impl<'de> Deserialize<'de> for Written {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Keys;
        impl<'de> Visitor<'de> for Keys {
            type Value = Written;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Written, A::Error> {
                let mut keys = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Written>()? {
                    keys.push((k, v));
                }
                Ok(Written(keys))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Written, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Written::default())
            }
            fn visit_bool<E>(self, _: bool) -> Result<Written, E> {
                Ok(Written::default())
            }
            fn visit_i64<E>(self, _: i64) -> Result<Written, E> {
                Ok(Written::default())
            }
            fn visit_u64<E>(self, _: u64) -> Result<Written, E> {
                Ok(Written::default())
            }
            fn visit_f64<E>(self, _: f64) -> Result<Written, E> {
                Ok(Written::default())
            }
            fn visit_str<E>(self, _: &str) -> Result<Written, E> {
                Ok(Written::default())
            }
            fn visit_unit<E>(self) -> Result<Written, E> {
                Ok(Written::default())
            }
        }
        d.deserialize_any(Keys)
    }
}

impl Written {
    /// The keys under `key`.
    fn under(&self, key: &str) -> Option<&Written> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Where `key` stands among the written keys (those not written come after, by name).
    fn rank(&self, key: &str) -> usize {
        self.0
            .iter()
            .position(|(k, _)| k == key)
            .unwrap_or(usize::MAX)
    }
}

/// `schema` with a `$ref` to the root's `$defs` followed.
fn resolved<'a>(root: &'a Value, schema: &'a Value) -> &'a Value {
    match schema.get("$ref").and_then(Value::as_str) {
        Some(r) => r
            .strip_prefix("#/$defs/")
            .and_then(|name| root["$defs"].get(name))
            .unwrap_or(schema),
        None => schema,
    }
}

/// The schema of a value that may also be absent: the one that is not `null`.
fn present<'a>(root: &'a Value, schema: &'a Value) -> &'a Value {
    let schema = resolved(root, schema);
    if let Some(options) = schema.get("anyOf").and_then(Value::as_array) {
        if let Some(s) = options
            .iter()
            .find(|o| o.get("type").and_then(Value::as_str) != Some("null"))
        {
            return resolved(root, s);
        }
    }
    schema
}

/// What a key of `schema` takes; `None` for a table of keys of its own (a section).
fn kind(root: &Value, field: &Value) -> Option<String> {
    let schema = present(root, field);
    if field.get("format").and_then(Value::as_str) == Some("duration")
        || schema.get("format").and_then(Value::as_str) == Some("duration")
    {
        return Some("duration".into());
    }
    if let Some(variants) = schema.get("oneOf").and_then(Value::as_array) {
        // A documented variant is a `const`; undocumented ones come together in an `enum`.
        let names: Vec<String> = variants
            .iter()
            .flat_map(|v| {
                let one = v.get("const").and_then(Value::as_str).into_iter();
                let many = v
                    .get("enum")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str);
                one.chain(many)
            })
            .map(|v| format!("`{v}`"))
            .collect();
        return Some(format!("one of {}", names.join(", ")));
    }
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        let names: Vec<String> = values
            .iter()
            .filter_map(Value::as_str)
            .map(|v| format!("`{v}`"))
            .collect();
        return Some(format!("one of {}", names.join(", ")));
    }
    let types: Vec<&str> = match schema.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let of = |t: &str| types.contains(&t);
    Some(
        if of("boolean") {
            "boolean"
        } else if of("integer") {
            "integer"
        } else if of("number") {
            "number"
        } else if of("string") {
            "string"
        } else if of("array") {
            return Some(match schema["items"].get("type").and_then(Value::as_str) {
                Some("string") | None => "list of strings".into(),
                Some(other) => format!("list of {other}s"),
            });
        } else if of("object") && schema.get("properties").is_none() {
            "table"
        } else if of("object") {
            return None;
        } else {
            "string"
        }
        .into(),
    )
}

/// A doc comment on one line, Markdown links reduced to their text.
fn one_line(doc: &str) -> String {
    let joined = doc.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut out = String::with_capacity(joined.len());
    let mut rest = joined.as_str();
    // `[text](target)` -> `text`.
    while let Some(open) = rest.find('[') {
        let Some(close) = rest[open..].find("](").map(|i| open + i) else {
            break;
        };
        let Some(end) = rest[close..].find(')').map(|i| close + i) else {
            break;
        };
        out.push_str(&rest[..open]);
        out.push_str(&rest[open + 1..close]);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// Every key of the configuration, in the order of its sections and fields.
pub fn keys() -> Vec<Key> {
    let root = schema();
    let defaults = toml::Value::try_from(Config::default()).unwrap_or(toml::Value::Boolean(false));
    // The keys as Config::default() writes them; without them (a value this reader cannot take)
    // the keys come by name, and the order test says so.
    let written: Written = serde_json::to_string(&Config::default())
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default();
    let mut out = Vec::new();
    walk(&root, &root, &[], &defaults, &written, &mut out);
    out
}

fn walk(
    root: &Value,
    table: &Value,
    path: &[String],
    defaults: &toml::Value,
    written: &Written,
    out: &mut Vec<Key>,
) {
    let Some(properties) = resolved(root, table)
        .get("properties")
        .and_then(Value::as_object)
    else {
        return;
    };
    let mut fields: Vec<(&String, &Value)> = properties.iter().collect();
    fields.sort_by_key(|(name, _)| (written.rank(name), (*name).clone()));
    let empty = Written::default();
    for (name, field) in fields {
        let mut at = path.to_vec();
        at.push(name.clone());
        let default = defaults.get(name.as_str());
        let Some(kind) = kind(root, field) else {
            // A section of its own.
            walk(
                root,
                present(root, field),
                &at,
                default.unwrap_or(&toml::Value::Boolean(false)),
                written.under(name).unwrap_or(&empty),
                out,
            );
            continue;
        };
        // A section of an adapter this build leaves out takes anything: not listed.
        if path.is_empty() {
            continue;
        }
        out.push(Key {
            path: at,
            kind,
            default: default.map(shown),
            description: one_line(
                field
                    .get("description")
                    .and_then(Value::as_str)
                    .unwrap_or_default(),
            ),
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

/// The reference as a Markdown table: key, type, default, environment variable, and the first
/// sentence of the key's description.
pub fn markdown() -> String {
    let mut s = String::from(
        "| key | type | default | environment | description |\n|---|---|---|---|---|\n",
    );
    for k in keys() {
        let mut env = format!("`{}`", k.env());
        if k.path == ["database", "url"] {
            env.push_str(", `DATABASE_URL`");
        }
        if k.kind == "table" {
            env = format!("`{}__<NAME>` (`__` for each `.`)", k.env());
        }
        s.push_str(&format!(
            "| `{}` | {} | {} | {} | {} |\n",
            k.path.join("."),
            k.kind,
            k.default.as_deref().unwrap_or("unset"),
            env,
            k.summary().replace('|', "\\|")
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
    fn every_section_is_listed_in_the_order_of_its_fields() {
        let keys = keys();
        let mut sections: Vec<String> = Vec::new();
        for k in &keys {
            if sections.last() != Some(&k.path[0]) {
                sections.push(k.path[0].clone());
            }
        }
        assert_eq!(
            sections,
            [
                "database",
                "relay",
                "publisher",
                "amqp",
                "kafka",
                "sqs",
                "http",
                "log",
                "wal"
            ],
            "each section once, in Config's order"
        );
        let database: Vec<String> = keys
            .iter()
            .filter(|k| k.path[0] == "database")
            .take(3)
            .map(|k| k.path[1].clone())
            .collect();
        assert_eq!(
            database,
            ["url", "pool_size", "schema"],
            "as Config writes them"
        );
        let last = keys.iter().rfind(|k| k.path[0] == "database");
        assert_eq!(
            last.map(|k| k.path[1].as_str()),
            Some("keep_processed_for"),
            "unset keys after the others, by name"
        );
    }

    #[test]
    fn kinds_read_every_variant_and_the_items_type() {
        let root = serde_json::json!({});
        let mixed = serde_json::json!({"oneOf": [
            {"const": "a", "description": "documented"},
            {"type": "string", "enum": ["b", "c"]}
        ]});
        assert_eq!(kind(&root, &mixed).as_deref(), Some("one of `a`, `b`, `c`"));
        let numbers = serde_json::json!({"type": "array", "items": {"type": "integer"}});
        assert_eq!(kind(&root, &numbers).as_deref(), Some("list of integers"));
        let section = serde_json::json!({"type": "object", "properties": {"x": {}}});
        assert_eq!(kind(&root, &section), None, "a section of its own");
    }

    #[test]
    fn descriptions_are_the_doc_comments() {
        let k = key("relay.batch_size");
        assert_eq!(
            k.description,
            "Most events claimed and published per batch. Default 500."
        );
        assert_eq!(k.summary(), "Most events claimed and published per batch.");
        let k = key("http.liveness_timeout");
        assert!(
            k.description.contains("(Config::liveness_timeout)") || !k.description.contains("]("),
            "links reduced to their text: {}",
            k.description
        );
        assert!(
            keys().iter().all(|k| !k.description.is_empty()),
            "every key has a doc comment"
        );
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
