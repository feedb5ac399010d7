//! The outbox row: the columns an event is written to and read from, binding events into an
//! INSERT ([`Columns`], for the writer and the held table), and decoding a row into an [`Event`]
//! (a selected row: [`decode_event`]; the text form of a decoded WAL change: [`event_from_text`]).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{Postgres, Row};
use uuid::Uuid;

use txoutbox_core::{Error, Event, NewEvent, Payload, JSON_CONTENT_TYPE};

use crate::error::map_sqlx;

/// The aggregate types of rows that are not events but marks the WAL source keeps in its held table
/// (already processed, never claimed), as a `LIKE` pattern: `outbox cleanup` leaves them.
pub(crate) const MARK_TYPES: &str = "(wal % mark)";

/// The select list that [`decode_event`] reads: every column of an event, over the outbox table
/// aliased `e` (`SELECT {EVENT_COLUMNS} FROM <table> e WHERE ...`), the payload as bytes whatever
/// its column.
pub const EVENT_COLUMNS: &str = "e.id, e.aggregate_type, e.aggregate_id, e.event_type,
    CASE WHEN e.payload_bytes IS NOT NULL THEN e.payload_bytes ELSE convert_to(e.payload::text, 'UTF8') END AS payload,
    e.content_type, e.headers::text AS headers, e.destination, e.created_at, e.attempts";

/// The columns an INSERT of events writes, in the order [`Columns`] binds them (`$1` to `$9`).
pub(crate) const INSERT_COLUMNS: &str =
    "id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, content_type, headers, destination";

/// The arrays [`Columns::bind`] binds, typed, for `UNNEST(...)`.
pub(crate) const INSERT_ARRAYS: &str =
    "$1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bytea[], $7::text[], $8::text[], $9::text[]";

/// The values of [`INSERT_COLUMNS`] from `UNNEST(...) AS u({INSERT_COLUMNS}, ...)`.
pub(crate) const INSERT_UNNESTED: &str = "u.id, u.aggregate_type, u.aggregate_id, u.event_type, u.payload::jsonb, u.payload_bytes, u.content_type, u.headers::jsonb, u.destination";

/// The values of [`INSERT_COLUMNS`] for one event, as [`Columns::bind_one`] binds them.
pub(crate) const INSERT_VALUES: &str = "$1, $2, $3, $4, $5::jsonb, $6, $7, $8::jsonb, $9";

/// Events as the columns of an INSERT: one array per column of [`INSERT_COLUMNS`]. The payload is
/// JSON text in `payload` (`null` when it is bytes) or bytes in `payload_bytes`.
#[derive(Debug, Default)]
pub(crate) struct Columns {
    ids: Vec<Uuid>,
    aggregate_types: Vec<String>,
    aggregate_ids: Vec<String>,
    event_types: Vec<String>,
    payloads: Vec<String>,
    payload_bytes: Vec<Option<Vec<u8>>>,
    content_types: Vec<String>,
    headers: Vec<String>,
    destinations: Vec<Option<String>>,
}

/// Headers as stored: a JSON object of strings.
fn headers_json(headers: &BTreeMap<String, String>) -> String {
    serde_json::to_string(headers).unwrap_or_else(|_| "{}".into())
}

impl Columns {
    /// Room for `n` events.
    pub(crate) fn with_capacity(n: usize) -> Self {
        Columns {
            ids: Vec::with_capacity(n),
            aggregate_types: Vec::with_capacity(n),
            aggregate_ids: Vec::with_capacity(n),
            event_types: Vec::with_capacity(n),
            payloads: Vec::with_capacity(n),
            payload_bytes: Vec::with_capacity(n),
            content_types: Vec::with_capacity(n),
            headers: Vec::with_capacity(n),
            destinations: Vec::with_capacity(n),
        }
    }

    /// The ids of the events added, in order.
    pub(crate) fn into_ids(self) -> Vec<Uuid> {
        self.ids
    }

    /// Adds a new event; `check_size` (its payload's size in bytes, its id and type) may refuse it
    /// before anything of it is added.
    ///
    /// # Errors
    /// What `check_size` returns.
    pub(crate) fn push_new(
        &mut self,
        e: NewEvent,
        check_size: impl FnOnce(usize, Uuid, &str) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let content_type = e.payload.content_type().to_string();
        let (text, data) = match e.payload {
            Payload::Json(v) => (v.to_string(), None),
            Payload::Binary { data, .. } => ("null".to_string(), Some(data)),
        };
        let size = data.as_ref().map_or(text.len(), Vec::len);
        check_size(size, e.id, &e.event_type)?;
        self.ids.push(e.id);
        self.content_types.push(content_type);
        self.payloads.push(text);
        self.payload_bytes.push(data);
        self.headers.push(headers_json(&e.headers));
        self.aggregate_types.push(e.aggregate_type);
        self.aggregate_ids.push(e.aggregate_id);
        self.event_types.push(e.event_type);
        self.destinations.push(e.destination);
        Ok(())
    }

    /// Adds an event read before (the held table's rows): a JSON payload stays JSON (as the writer
    /// stores it); anything else is kept as bytes.
    pub(crate) fn push_event(&mut self, e: &Event) {
        self.ids.push(e.id);
        self.aggregate_types.push(e.aggregate_type.clone());
        self.aggregate_ids.push(e.aggregate_id.clone());
        self.event_types.push(e.event_type.clone());
        let json = e.is_json()
            && serde_json::from_slice::<&serde_json::value::RawValue>(&e.payload).is_ok();
        if json {
            self.payloads
                .push(String::from_utf8_lossy(&e.payload).into_owned());
            self.payload_bytes.push(None);
        } else {
            self.payloads.push("null".into());
            self.payload_bytes.push(Some(e.payload.clone()));
        }
        self.content_types.push(e.content_type.clone());
        self.headers.push(headers_json(&e.headers));
        self.destinations.push(e.destination.clone());
    }

    /// Binds the columns' arrays as `$1` to `$9` of `query` (see [`INSERT_ARRAYS`]).
    pub(crate) fn bind<'q>(
        &'q self,
        query: Query<'q, Postgres, PgArguments>,
    ) -> Query<'q, Postgres, PgArguments> {
        query
            .bind(&self.ids)
            .bind(&self.aggregate_types)
            .bind(&self.aggregate_ids)
            .bind(&self.event_types)
            .bind(&self.payloads)
            .bind(&self.payload_bytes)
            .bind(&self.content_types)
            .bind(&self.headers)
            .bind(&self.destinations)
    }

    /// Binds the one event added as `$1` to `$9` of `query` (see [`INSERT_VALUES`]), taking its
    /// columns (its id stays).
    pub(crate) fn bind_one<'q>(
        &mut self,
        query: Query<'q, Postgres, PgArguments>,
    ) -> Query<'q, Postgres, PgArguments> {
        query
            .bind(self.ids[0])
            .bind(self.aggregate_types.pop())
            .bind(self.aggregate_ids.pop())
            .bind(self.event_types.pop())
            .bind(self.payloads.pop())
            .bind(self.payload_bytes.pop().flatten())
            .bind(self.content_types.pop())
            .bind(self.headers.pop())
            .bind(self.destinations.pop().flatten())
    }
}

/// An [`Event`] from a row selected with [`EVENT_COLUMNS`] (for tools that read the outbox
/// themselves, such as a benchmark's reference relay).
///
/// # Errors
/// A database error naming the column when the row lacks one or holds another type.
pub fn decode_event(row: &PgRow) -> Result<Event, Error> {
    let get = |e: sqlx::Error| map_sqlx("claim", e);
    let headers_text: String = row.try_get("headers").map_err(get)?;
    let headers = parse_headers(&headers_text);
    let attempts: i32 = row.try_get("attempts").map_err(get)?;
    Ok(Event {
        id: row.try_get("id").map_err(get)?,
        aggregate_type: row.try_get("aggregate_type").map_err(get)?,
        aggregate_id: row.try_get("aggregate_id").map_err(get)?,
        event_type: row.try_get("event_type").map_err(get)?,
        payload: row.try_get("payload").map_err(get)?,
        content_type: row.try_get("content_type").map_err(get)?,
        headers,
        destination: row.try_get("destination").map_err(get)?,
        created_at: row.try_get("created_at").map_err(get)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
    })
}

/// Headers as stored: a JSON object. Non-string values (from plain-SQL writers) keep their JSON text;
/// anything that is not an object yields no headers rather than a failure.
pub(crate) fn parse_headers(text: &str) -> BTreeMap<String, String> {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect(),
        _ => BTreeMap::new(),
    }
}

/// The event of an inserted outbox row from the text form of its columns (pgoutput's, with
/// `bytea_output = hex` and ISO dates): `bytes` gives a column's text, `None` when it is null or
/// missing. A null `created_at` comes back as the default time, for the caller to fill in; what is
/// wrong with the row is the error.
pub(crate) fn event_from_text<'a>(
    bytes: impl Fn(&str) -> Option<&'a [u8]>,
) -> Result<Event, String> {
    let text = |k: &str| bytes(k).map(|b| String::from_utf8_lossy(b).into_owned());
    let required = |k: &str| text(k).ok_or_else(|| format!("the row has no {k}"));
    let id: Uuid = required("id")?
        .parse()
        .map_err(|e| format!("id is not a UUID: {e}"))?;
    let payload = match bytes("payload_bytes") {
        Some(hex) => decode_bytea(hex).ok_or("payload_bytes is not bytea hex text")?,
        None => bytes("payload").ok_or("the row has no payload")?.to_vec(),
    };
    let created_at = match text("created_at") {
        // Filled with the commit time by the caller.
        None => DateTime::<Utc>::default(),
        Some(t) => parse_timestamptz(&t)
            .ok_or_else(|| format!("created_at {t:?} is not a timestamp this relay can carry"))?,
    };
    Ok(Event {
        id,
        aggregate_type: required("aggregate_type")?,
        aggregate_id: required("aggregate_id")?,
        event_type: required("event_type")?,
        payload,
        content_type: text("content_type").unwrap_or_else(|| JSON_CONTENT_TYPE.into()),
        headers: text("headers")
            .map(|h| parse_headers(&h))
            .unwrap_or_default(),
        destination: text("destination"),
        created_at,
        attempts: 0,
    })
}

/// `\x0102...` (bytea's hex output) as bytes.
pub(crate) fn decode_bytea(text: &[u8]) -> Option<Vec<u8>> {
    let hex = text.strip_prefix(b"\\x")?;
    if hex.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    hex.chunks_exact(2)
        .map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

/// timestamptz's ISO output (`2026-12-04 10:11:12.345678+00`, any offset, historical ones with
/// seconds) as UTC; `None` for what a relay cannot carry (`infinity`, BC dates).
pub(crate) fn parse_timestamptz(text: &str) -> Option<DateTime<Utc>> {
    let i = text.rfind(['+', '-']).filter(|i| *i > 10)?;
    let (local, offset) = text.split_at(i);
    let sign = if offset.starts_with('-') { -1 } else { 1 };
    let mut parts = offset[1..].split(':').map(str::parse::<i32>);
    let hours = parts.next()?.ok()?;
    let minutes = parts.next().transpose().ok()?.unwrap_or(0);
    let seconds = parts.next().transpose().ok()?.unwrap_or(0);
    let local = chrono::NaiveDateTime::parse_from_str(local, "%Y-%m-%d %H:%M:%S%.f").ok()?;
    let offset =
        chrono::Duration::seconds(i64::from(sign * (hours * 3600 + minutes * 60 + seconds)));
    Some((local - offset).and_utc())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_parse_leniently() {
        assert_eq!(
            parse_headers(r#"{"a":"x","n":3}"#),
            BTreeMap::from([
                ("a".to_string(), "x".to_string()),
                ("n".to_string(), "3".to_string())
            ])
        );
        assert!(parse_headers("[1,2]").is_empty());
        assert!(parse_headers("not json").is_empty());
    }
}
