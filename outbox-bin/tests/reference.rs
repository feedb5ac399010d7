//! The configuration reference cannot drift from the code: the README's generated table is what
//! `outbox config --reference` prints, and the README's section table names exactly the keys of
//! the configuration, with the defaults the code has.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use common::*;

fn readme() -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .unwrap()
}

fn reference() -> String {
    let mut c = Command::new(bin());
    c.args(["config", "--reference"]).env_clear();
    check(c, "outbox config --reference")
}

/// The generated rows: key path -> default cell.
fn generated() -> BTreeMap<String, String> {
    reference()
        .lines()
        .skip(2)
        .map(|row| {
            let cells: Vec<&str> = row.split(" | ").collect();
            (
                cells[0]
                    .trim_start_matches("| ")
                    .trim_matches('`')
                    .to_string(),
                cells[2].to_string(),
            )
        })
        .collect()
}

#[test]
fn the_readme_holds_the_generated_reference() {
    let readme = readme();
    let start = "<!-- outbox config --reference: start -->\n";
    let end = "<!-- outbox config --reference: end -->";
    let from = readme.find(start).expect("the README's reference block") + start.len();
    let to = readme
        .find(end)
        .expect("the end of the README's reference block");
    assert_eq!(
        &readme[from..to],
        reference(),
        "outbox-bin/README.md's reference differs from the binary's: paste `outbox config --reference` between its markers"
    );
}

/// The section table's rows: section (`relay.retry`) -> its text.
fn section_rows(readme: &str) -> Vec<(String, String)> {
    readme
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("| `[")?;
            let (section, text) = rest.split_once("]` | ")?;
            Some((section.to_string(), text.trim_end_matches(" |").to_string()))
        })
        .collect()
}

/// The keys a row names (`key` at the top level of its text, followed by its parenthesis or a
/// separator), each with what its parenthesis says first, if anything.
fn named_keys(text: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '(' => depth += 1,
            ')' => depth -= 1,
            '`' => {
                let close = chars[i + 1..].iter().position(|c| *c == '`').unwrap() + i + 1;
                let token: String = chars[i + 1..close].iter().collect();
                let token = token
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .rsplit('.')
                    .next()
                    .unwrap()
                    .to_string();
                let after: String = chars[close + 1..].iter().collect();
                let is_key = depth == 0
                    && !token.is_empty()
                    && token
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c == '_' || c.is_ascii_digit())
                    && (after.starts_with(" (")
                        || after.starts_with(':')
                        || after.starts_with(','));
                if is_key {
                    let said = after.strip_prefix(" (").map(|p| {
                        let mut d = 0;
                        let end = p
                            .char_indices()
                            .find(|(_, c)| {
                                match c {
                                    '(' => d += 1,
                                    ')' if d == 0 => return true,
                                    ')' => d -= 1,
                                    _ => {}
                                }
                                false
                            })
                            .map_or(p.len(), |(j, _)| j);
                        p[..end].to_string()
                    });
                    // `stdout` (default): a value of the key before it, not a key.
                    if said.as_deref() != Some("default") {
                        out.push((token, said));
                    }
                }
                i = close;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// A default as a comparable text: a duration in milliseconds, a number or word as it is, a
/// backticked value without its backticks; `None` when the text states no plain value.
fn plain(text: &str) -> Option<String> {
    let text = text.trim();
    let (first, value) = if let Some(quoted) = text.strip_prefix('`') {
        let value = quoted.split('`').next().unwrap().to_string();
        (text, value)
    } else {
        let first = text.split([';', ':', ',']).next().unwrap().trim();
        (first, first.split_whitespace().next()?.to_string())
    };
    if value.contains('<') {
        return None;
    }
    if let Ok(d) = txoutbox_core::duration::parse(&value) {
        if value.chars().any(|c| c.is_ascii_alphabetic()) {
            return Some(format!("{}ms", d.as_millis()));
        }
    }
    let starts_plain = value
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_digit() || c == '[' || c == '/' || c.is_ascii_lowercase());
    if first.starts_with('`') || starts_plain && !value.chars().all(|c| c.is_ascii_alphabetic()) {
        return Some(value);
    }
    match value.as_str() {
        "true" | "false" | "unset" => Some(value),
        _ => None,
    }
}

#[test]
fn the_section_table_names_every_key_with_the_code_s_defaults() {
    let keys = generated();
    let readme = readme();
    let rows = section_rows(&readme);
    assert!(rows.len() >= 10, "{rows:?}");
    let mut named = BTreeSet::new();
    let mut problems = Vec::new();
    for (section, text) in &rows {
        for (key, said) in named_keys(text) {
            let path = format!("{section}.{key}");
            let Some(default) = keys.get(&path) else {
                problems.push(format!("`[{section}]` names `{key}`, which is not a key"));
                continue;
            };
            named.insert(path.clone());
            let (Some(said), Some(code)) = (said.as_deref().and_then(plain), plain(default)) else {
                continue;
            };
            if said != code {
                problems.push(format!(
                    "{path}: the README says {said}, the code's default is {default}"
                ));
            }
        }
    }
    for path in keys.keys() {
        // The nested section's own row names its keys.
        if !named.contains(path) {
            problems.push(format!("{path} is not in the README's section table"));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn the_checks_find_what_they_look_for() {
    let keys = named_keys("`a` (1), `b_c` (`x`; more), `d`: `e` (default), `f` or (`g` (2))");
    assert_eq!(
        keys,
        [
            ("a".to_string(), Some("1".to_string())),
            ("b_c".to_string(), Some("`x`; more".to_string())),
            ("d".to_string(), None),
        ]
    );
    assert_eq!(plain("60s: must exceed").as_deref(), Some("60000ms"));
    assert_eq!(plain("`1m`").as_deref(), Some("60000ms"));
    assert_eq!(plain("8388608 = 8 MiB").as_deref(), Some("8388608"));
    assert_eq!(plain("`text` or `json`").as_deref(), Some("text"));
    assert_eq!(
        plain("`amqp://guest:guest@127.0.0.1:5672/%2f`; `amqps://` for TLS").as_deref(),
        Some("amqp://guest:guest@127.0.0.1:5672/%2f")
    );
    assert_eq!(plain("unset: the larger").as_deref(), Some("unset"));
    assert_eq!(plain("`<schema>_<table>_slot`"), None);
    assert_eq!(plain("any librdkafka setting"), None);
}
