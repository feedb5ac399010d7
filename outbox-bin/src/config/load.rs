//! Loading: the TOML file, the environment's overrides laid over it (`OUTBOX_<SECTION>__<KEY>` and
//! `DATABASE_URL`, each kept as its exact text: see `source.rs`), and the typed reading that names
//! the key, the value and where it came from.

use std::path::{Path, PathBuf};

use serde_json::Value;
use serde_path_to_error::Segment;

use txoutbox_core::Error;

use super::source::Source;
use super::{Config, DEFAULT_CONFIG_FILE, ENV_PREFIX};

/// The part after `OUTBOX_` of a variable of the form `OUTBOX_<SECTION>__<KEY>`, the only form
/// that configures the binary; `None` for any other variable. Other `OUTBOX_*` variables are not
/// this binary's: Kubernetes, for one, gives every container `<SERVICE>_PORT=tcp://...` and the
/// like for each Service of its namespace, and a Service named `outbox-relay` makes them
/// `OUTBOX_RELAY_PORT`, `OUTBOX_RELAY_SERVICE_HOST`, ...
pub fn setting(name: &str) -> Option<&str> {
    name.strip_prefix(ENV_PREFIX)
        .filter(|rest| rest.contains("__"))
}

/// The `OUTBOX_*` variables of `env` that do not configure the binary (see [`setting`]), for a
/// line saying they were ignored.
pub fn ignored<'a>(env: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    env.into_iter()
        .filter(|name| name.starts_with(ENV_PREFIX) && setting(name).is_none())
        .collect()
}

/// Whether `name` has the shape of a variable Kubernetes sets for a Service of the namespace
/// (`<SERVICE>_SERVICE_HOST`, `<SERVICE>_SERVICE_PORT[_<NAME>]`, `<SERVICE>_PORT`,
/// `<SERVICE>_PORT_<N>_<PROTOCOL>[_PROTO|_PORT|_ADDR]`): an ignored variable of another shape is
/// more likely a mistyped setting (`OUTBOX_RELAY_BATCH_SIZE`), worth a warning.
pub fn service_link(name: &str) -> bool {
    if name.ends_with("_SERVICE_HOST") || name.contains("_SERVICE_PORT") || name.ends_with("_PORT")
    {
        return true;
    }
    let parts: Vec<&str> = name.split('_').collect();
    parts.windows(3).any(|w| {
        w[0] == "PORT"
            && !w[1].is_empty()
            && w[1].bytes().all(|b| b.is_ascii_digit())
            && matches!(w[2], "TCP" | "UDP" | "SCTP")
    })
}

impl Config {
    /// Loads the configuration: `path` (or `outbox.toml` when it exists and `path` is `None`), then
    /// the overrides in `env` (`OUTBOX_<SECTION>__<KEY>` and `DATABASE_URL`; other variables are
    /// ignored), then validation.
    ///
    /// # Errors
    /// A config error naming the file or variable, the key, the bad value and what is expected.
    pub fn load(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, Error> {
        let (file, origin) = match path {
            Some(p) => (read_file(p)?, Some(p.to_path_buf())),
            None if Path::new(DEFAULT_CONFIG_FILE).exists() => (
                read_file(Path::new(DEFAULT_CONFIG_FILE))?,
                Some(PathBuf::from(DEFAULT_CONFIG_FILE)),
            ),
            None => (Value::Object(Default::default()), None),
        };
        let mut root = Source::File(file);
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
            let Some(rest) = setting(&name) else {
                continue;
            };
            let path: Vec<String> = rest.split("__").map(|s| s.to_ascii_lowercase()).collect();
            if path.iter().any(|p| p.is_empty()) {
                return Err(Error::config(format!(
                    "environment variable {name}: expected OUTBOX_<SECTION>__<KEY>, such as OUTBOX_RELAY__BATCH_SIZE"
                )));
            }
            let path = kafka_property_path(&name, path)?;
            root = root.with(&path, raw);
            sources.push((path, name));
        }
        // DATABASE_URL applies unless OUTBOX_DATABASE__URL was given.
        if let Some(url) = database_url {
            let key = vec!["database".to_string(), "url".to_string()];
            if !sources.iter().any(|(p, _)| *p == key) {
                root = root.with(&key, url);
                sources.push((key, "DATABASE_URL".into()));
            }
        }
        let config = deserialize(root, &sources, origin.as_deref())?;
        config.validate()?;
        Ok(config)
    }
}

/// librdkafka's property names are dotted (`sasl.password`), and a shell cannot export a variable
/// with a dot in its name: under `OUTBOX_KAFKA__PROPERTIES__`, each further `__` is a dot
/// (`OUTBOX_KAFKA__PROPERTIES__SASL__PASSWORD` sets `sasl.password`; a name with dots works too).
/// A single underscore is refused: it would name a property librdkafka does not have
/// (`sasl_password`), save `log_level` and `enabled_events`, the settable properties spelled so.
fn kafka_property_path(name: &str, path: Vec<String>) -> Result<Vec<String>, Error> {
    if path.len() <= 2 || path[0] != "kafka" || path[1] != "properties" {
        return Ok(path);
    }
    let property = path[2..].join(".");
    if property.contains('_') && !matches!(property.as_str(), "log_level" | "enabled_events") {
        let suggested = format!(
            "OUTBOX_KAFKA__PROPERTIES__{}",
            property.replace(['_', '.'], "__").to_ascii_uppercase()
        );
        return Err(Error::config(format!(
            "environment variable {name}: librdkafka's property names have dots, not underscores; \
             write each dot as a double underscore: {suggested} sets {:?}",
            property.replace('_', ".")
        )));
    }
    Ok(vec![path[0].clone(), path[1].clone(), property])
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
    root: Source,
    sources: &[(Vec<String>, String)],
    file: Option<&Path>,
) -> Result<Config, Error> {
    serde_path_to_error::deserialize::<_, Config>(root).map_err(|err| {
        // The keys down to the error; a variable whose key is one of them (or the key itself) set
        // the value.
        let keys: Vec<String> = err
            .path()
            .iter()
            .filter_map(|segment| match segment {
                Segment::Map { key } => Some(key.clone()),
                _ => None,
            })
            .collect();
        // A variable set the value at the error, or a key below it (a key the type does not know).
        let from_env = sources
            .iter()
            .find(|(p, _)| keys.starts_with(p) || (!keys.is_empty() && p.starts_with(&keys)));
        let origin = match from_env {
            Some((_, name)) => format!(" (from {name})"),
            _ => file
                .map(|f| format!(" (in {})", f.display()))
                .unwrap_or_default(),
        };
        let path = err.path().to_string();
        let key = if path == "." || path.is_empty() {
            "configuration".to_string()
        } else {
            path
        };
        Error::config(format!("{key}{origin}: {}", err.inner()))
    })
}
