//! Reading the slot: committed transactions, in commit order, as events.
//!
//! Two write forms reach the slot:
//! - **Rows of the outbox table** (the writer API or plain SQL `INSERT`s), decoded from pgoutput's
//!   text form of each column.
//! - **Table-less events**: `pg_logical_emit_message(true, '<prefix>', <json>)` inside the business
//!   transaction ([`MessageWriter`]; plain SQL can call it too). The message is transactional: it
//!   is decoded only if its transaction commits, in its place among the transaction's changes. Its
//!   content is a JSON object:
//!
//!   ```json
//!   {"seq": 4211,                     // optional: its place among its aggregate's rows (MessageWriter::emit)
//!    "id": "0192...",                 // optional: by default derived from the message's position
//!    "aggregate_type": "order", "aggregate_id": "42", "event_type": "order.created",
//!    "payload": {"total": 99},        // any JSON; or "payload_base64": "..." for bytes
//!    "content_type": "application/json",       // optional (JSON payloads default to it)
//!    "headers": {"traceparent": "..."},        // optional, strings
//!    "destination": "orders.v2"}               // optional
//!   ```
//!   The event's creation time is its transaction's commit time.
//!
//! A change that cannot be an event (a message that is not such an object, a non-transactional
//! message, a row missing a column) is returned as [`WalItem::Undecodable`] in its place, with what is
//! wrong, so that the reader dead-letters it rather than losing it or stopping on it.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use pg_walstream::protocol::{LogicalReplicationMessage, LogicalReplicationParser, TupleData};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use txoutbox_core::format::base64_decode;
use txoutbox_core::{Error, ErrorKind, Event, JSON_CONTENT_TYPE};

use super::slot::WalSlot;
use crate::error::map_sqlx;
use crate::row::{event_from_text, parse_headers};
use crate::writer::message::TablelessMessage;

/// The settings a peek of the slot fixes for its transaction, as `set_config` columns: pgoutput
/// writes the columns as the calling session's output functions do, so whatever the role's or
/// database's settings, the decoder reads the same text.
pub(crate) const PGOUTPUT_SETTINGS: &str = "set_config('bytea_output', 'hex', true) AS b,
    set_config('DateStyle', 'ISO, YMD', true) AS d, set_config('TimeZone', 'UTC', true) AS z";

/// The pgoutput protocol version read (1: whole transactions only, no streaming of transactions in
/// progress, so a peek never returns part of one).
pub const PROTO_VERSION: &str = "1";

/// A PostgreSQL timestamp (microseconds since 2000-01-01 UTC) as a UTC time.
pub fn postgres_time(micros: i64) -> DateTime<Utc> {
    const POSTGRES_EPOCH_SECS: i64 = 946_684_800;
    DateTime::from_timestamp_micros(micros.saturating_add(POSTGRES_EPOCH_SECS * 1_000_000))
        .unwrap_or_default()
}

/// One committed transaction's events, in the order they were written.
#[derive(Debug, Clone, PartialEq)]
pub struct WalTransaction {
    /// The position just past the transaction's commit: confirming it confirms the transaction.
    pub end_lsn: u64,
    /// When it committed.
    pub commit_time: DateTime<Utc>,
    /// Its events (and the changes that could not be events), in order.
    pub items: Vec<WalItem>,
    /// The ids of its events that are rows of the outbox table (the others are table-less).
    pub row_ids: Vec<Uuid>,
    /// Whether this is the whole transaction or a part of one too large to hold whole.
    pub piece: Piece,
}

/// Whether a [`WalTransaction`] is a whole transaction or a part of one: a transaction larger
/// than the reader holds in memory comes in parts (the changes are committed already: a slot sends
/// a transaction once it committed), each at most the part limit the decoder was given. A part
/// names its transaction by `commit_lsn`, the position of its commit record (the same on every
/// read of it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Piece {
    /// The whole transaction.
    #[default]
    Whole,
    /// Its changes so far; more parts follow. `end_lsn` is 0 (the commit is not read yet).
    Part {
        /// The position of the transaction's commit record.
        commit_lsn: u64,
    },
    /// Its last changes, after one or more parts; `end_lsn` is its commit's.
    Last {
        /// The position of the transaction's commit record.
        commit_lsn: u64,
    },
}

impl Piece {
    /// The position of the commit record of the transaction a part belongs to.
    pub fn commit_lsn(&self) -> Option<u64> {
        match self {
            Piece::Whole => None,
            Piece::Part { commit_lsn } | Piece::Last { commit_lsn } => Some(*commit_lsn),
        }
    }
}

/// A change of a transaction.
#[derive(Debug, Clone, PartialEq)]
pub enum WalItem {
    /// An event.
    Event(Event),
    /// A change that cannot be an event: its position, what is wrong, and its content as text.
    Undecodable {
        /// An id for its dead letter, the same for every read of it (derived from its position on
        /// this server's timeline).
        id: Uuid,
        /// Where it is in the WAL.
        lsn: u64,
        /// What is wrong, and how to write it right.
        error: String,
        /// The message's content or the row's columns, as text.
        raw: String,
    },
}

impl WalItem {
    /// The event, or what is wrong with the change at `lsn` and its text. An event PostgreSQL
    /// could not store in the held table is what is wrong with it.
    fn new(lsn: u64, event: Result<Event, String>, raw: impl FnOnce() -> String) -> Self {
        let event = event.and_then(|e| storable(&e).map(|()| e));
        match event {
            Ok(e) => WalItem::Event(e),
            Err(error) => WalItem::Undecodable {
                id: Uuid::nil(),
                lsn,
                error,
                raw: raw(),
            },
        }
    }
}

/// What one read of the slot returned.
#[derive(Debug, Clone, PartialEq)]
pub struct WalPeek {
    /// The committed transactions, in commit order.
    pub transactions: Vec<WalTransaction>,
    /// Whether the read stopped at its limit of changes (more may be held).
    pub cut: bool,
    /// When the read was not cut: a position the slot may be confirmed to even with no transaction
    /// of this outbox read (the server's flushed WAL position taken before the read), so that an
    /// idle outbox on a busy database does not keep WAL for ever. Transactions committing after it
    /// are still read whole.
    pub idle_lsn: Option<u64>,
}

/// Reads a slot's transactions, never consuming them: they stay in the slot until
/// [`WalReader::confirm`] moves its confirmed position past them.
#[derive(Debug, Clone)]
pub struct WalReader {
    slot: WalSlot,
}

impl WalReader {
    /// A reader of `slot` (its table's rows and the messages with its prefix).
    pub fn new(slot: WalSlot) -> Self {
        WalReader { slot }
    }

    /// The slot.
    pub fn slot(&self) -> &WalSlot {
        &self.slot
    }

    /// The committed transactions the slot holds from its confirmed position on: whole ones, at
    /// least `max_changes` changes' worth when there are that many (a transaction is never cut).
    /// A transaction with nothing of this outbox (another table's outbox's messages: messages are
    /// database-wide) comes with no items, for its position to be confirmed too.
    ///
    /// # Errors
    /// A database error (SQLSTATE 55006 when another session reads the slot at this moment); an
    /// unexpected error when the slot returns something that is not pgoutput.
    pub async fn peek(&self, pool: &PgPool, max_changes: i32) -> Result<WalPeek, Error> {
        let mut conn = pool.acquire().await.map_err(|e| map_sqlx("wal read", e))?;
        self.peek_on(&mut conn, max_changes, usize::MAX).await
    }

    /// As [`WalReader::peek`], on `conn`, and stopping after the first
    /// transaction that takes the changes read past `max_bytes` (their pgoutput bytes): the read is
    /// then cut, and the memory it holds bounded by the budget plus one transaction.
    ///
    /// # Errors
    /// As [`WalReader::peek`].
    pub async fn peek_on(
        &self,
        conn: &mut PgConnection,
        max_changes: i32,
        max_bytes: usize,
    ) -> Result<WalPeek, Error> {
        let map = |e| map_sqlx("wal read", e);
        // One statement, one round trip. The first part runs before the slot is read (the lateral
        // call depends on it): pgoutput writes the columns as the calling session's output
        // functions do, so they are fixed for this statement whatever the role's or database's
        // settings, and the flushed position is taken before the read (see `WalPeek::idle_lsn`).
        let mut rows: Vec<(i64, Vec<u8>)> = Vec::new();
        let mut over_budget = false;
        let mut origin = Origin::default();
        let mut flushed = 0i64;
        {
            let sql = format!(
                "WITH s AS MATERIALIZED (
                     SELECT $1::name AS slot, {PGOUTPUT_SETTINGS},
                            (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::bigint AS flushed,
                            (SELECT system_identifier FROM pg_control_system()) AS system,
                            (SELECT timeline_id FROM pg_control_checkpoint()) AS timeline)
                 SELECT s.flushed, s.system, s.timeline, (c.lsn - '0/0'::pg_lsn)::bigint, c.data
                 FROM s LEFT JOIN LATERAL pg_logical_slot_peek_binary_changes(
                     s.slot, NULL, $2,
                     'proto_version', $3, 'publication_names', $4, 'messages', 'true') c ON true"
            );
            let mut stream =
                sqlx::query_as::<_, (i64, i64, i32, Option<i64>, Option<Vec<u8>>)>(&sql)
                    .bind(self.slot.slot())
                    .bind(max_changes)
                    .bind(PROTO_VERSION)
                    .bind(self.slot.publication())
                    .fetch(&mut *conn);
            let mut bytes = 0usize;
            while let Some((f, system, timeline, lsn, data)) =
                stream.try_next().await.map_err(map)?
            {
                flushed = f;
                origin = Origin {
                    system: system as u64,
                    timeline: timeline as u32,
                };
                let (Some(lsn), Some(data)) = (lsn, data) else {
                    continue;
                };
                bytes = bytes.saturating_add(data.len());
                // pgoutput's commit message starts with 'C': a transaction ends here.
                let commit = data.first() == Some(&b'C');
                rows.push((lsn, data));
                if commit && bytes >= max_bytes {
                    over_budget = true;
                    break;
                }
            }
        }
        let cut = over_budget || rows.len() >= usize::try_from(max_changes).unwrap_or(0);
        Ok(WalPeek {
            transactions: self.decode_from(&rows, origin)?,
            cut,
            idle_lsn: (!cut).then(|| u64::try_from(flushed).unwrap_or(0)),
        })
    }

    /// Moves the slot's confirmed position to `end_lsn` (never back): the transactions before it are
    /// settled and are not read again.
    ///
    /// # Errors
    /// A database error.
    pub async fn confirm(&self, pool: &PgPool, end_lsn: u64) -> Result<(), Error> {
        let mut conn = pool
            .acquire()
            .await
            .map_err(|e| map_sqlx("wal confirm", e))?;
        self.confirm_on(&mut conn, end_lsn).await
    }

    /// As [`WalReader::confirm`], on `conn`.
    ///
    /// # Errors
    /// As [`WalReader::confirm`].
    pub async fn confirm_on(&self, conn: &mut PgConnection, end_lsn: u64) -> Result<(), Error> {
        let lsn = i64::try_from(end_lsn).unwrap_or(i64::MAX);
        sqlx::query(
            "SELECT pg_replication_slot_advance(s.slot_name,
                 GREATEST('0/0'::pg_lsn + $2::numeric, s.confirmed_flush_lsn))
             FROM pg_replication_slots s WHERE s.slot_name = $1",
        )
        .bind(self.slot.slot())
        .bind(lsn)
        .execute(&mut *conn)
        .await
        .map_err(|e| map_sqlx("wal confirm", e))?;
        Ok(())
    }

    /// The transactions of `changes` (position and pgoutput bytes, as a peek returns them).
    ///
    /// # Errors
    /// An unexpected error naming the position when a change is not a pgoutput message.
    pub fn decode(&self, changes: &[(i64, Vec<u8>)]) -> Result<Vec<WalTransaction>, Error> {
        self.decode_from(changes, Origin::default())
    }

    fn decode_from(
        &self,
        changes: &[(i64, Vec<u8>)],
        origin: Origin,
    ) -> Result<Vec<WalTransaction>, Error> {
        let mut decoder = Decoder::new(&self.slot, origin);
        let mut out = Vec::new();
        for (lsn, data) in changes {
            if let Some(t) = decoder.feed(u64::try_from(*lsn).unwrap_or(0), data)? {
                out.push(t);
            }
        }
        Ok(out)
    }
}

/// Decodes a slot's pgoutput messages one at a time into whole transactions, keeping what a
/// stream of them carries from one transaction to the next (relation descriptions, sent once per
/// read or replication session).
pub(crate) struct Decoder {
    slot: String,
    prefix: String,
    origin: Origin,
    parser: LogicalReplicationParser,
    relations: HashMap<u32, (String, String, Vec<String>)>,
    /// A Relation message came since the last transaction handed over.
    described: bool,
    open: Option<(DateTime<Utc>, Vec<WalItem>)>,
    row_ids: Vec<Uuid>,
    /// The payload bytes of the open transaction's items not yet handed over.
    open_bytes: usize,
    /// Whether the open transaction was handed over in parts already.
    parted: bool,
    /// The position of the open transaction's commit record (from its Begin message).
    open_commit_lsn: u64,
    /// A transaction is handed over in parts of at most this many items or payload bytes.
    part_events: usize,
    part_bytes: usize,
    /// With [`Decoder::recording`]: the `seq` of each table-less event read that has one, and the
    /// positions of the messages that could not be events (a fallback's window needs both).
    recorded: Option<Recorded>,
}

/// What a [`Decoder`] records of the table-less events it reads, for a fallback's window.
#[derive(Debug, Default)]
pub(crate) struct Recorded {
    /// The `seq` of each table-less event that carries one, by event id.
    pub(crate) seqs: HashMap<Uuid, i64>,
    /// The positions of messages that could not be events (their dead letters' ids derive from
    /// them), as opposed to rows that could not.
    pub(crate) undecodable_messages: HashSet<u64>,
}

impl Decoder {
    pub(crate) fn new(slot: &WalSlot, origin: Origin) -> Decoder {
        Decoder {
            slot: slot.slot().to_string(),
            prefix: slot.message_prefix().to_string(),
            origin,
            parser: LogicalReplicationParser::with_protocol_version(1),
            relations: HashMap::new(),
            described: false,
            open: None,
            row_ids: Vec::new(),
            open_bytes: 0,
            parted: false,
            open_commit_lsn: 0,
            part_events: usize::MAX,
            part_bytes: usize::MAX,
            recorded: None,
        }
    }

    /// Records what a fallback's window needs of the table-less events read (see [`Recorded`]).
    pub(crate) fn recording(mut self) -> Decoder {
        self.recorded = Some(Recorded::default());
        self
    }

    /// What was recorded (empty without [`Decoder::recording`]).
    pub(crate) fn take_recorded(&mut self) -> Recorded {
        self.recorded.take().unwrap_or_default()
    }

    /// The position of the commit record of the transaction read last (from its Begin message).
    pub(crate) fn commit_lsn(&self) -> u64 {
        self.open_commit_lsn
    }

    /// Hands a transaction over in parts ([`Piece::Part`], then [`Piece::Last`]) once it has
    /// `events` items or `bytes` payload bytes not handed over: the memory one transaction takes
    /// is bounded whatever its size.
    pub(crate) fn with_part_limit(mut self, events: usize, bytes: usize) -> Decoder {
        self.part_events = events.max(1);
        self.part_bytes = bytes.max(1);
        self
    }

    /// Whether a relation was described since the last call: pgoutput describes a relation before
    /// its first change in a session and again after its cache was invalidated, which a change of
    /// the publication does (the reader then looks whether the publication is still the one it
    /// started with).
    pub(crate) fn take_described(&mut self) -> bool {
        std::mem::take(&mut self.described)
    }

    /// Whether a transaction is open (begun, not yet committed).
    pub(crate) fn in_transaction(&self) -> bool {
        self.open.is_some()
    }

    /// Takes the change at `lsn`; returns the transaction it completes, if any.
    ///
    /// # Errors
    /// An unexpected error naming the position when the change is not a pgoutput message.
    pub(crate) fn feed(&mut self, lsn: u64, data: &[u8]) -> Result<Option<WalTransaction>, Error> {
        let message = self
            .parser
            .parse_wal_message(data)
            .map_err(|e| {
                Error::new(
                    ErrorKind::Unexpected,
                    format!(
                        "the slot {} returned a change at {lsn:#x} that is not pgoutput: {e}",
                        self.slot
                    ),
                )
            })?
            .message;
        match message {
            LogicalReplicationMessage::Begin {
                timestamp,
                final_lsn,
                ..
            } => self.on_begin(timestamp, final_lsn),
            LogicalReplicationMessage::Relation {
                relation_id,
                namespace,
                relation_name,
                columns,
                ..
            } => {
                let names = columns.iter().map(|c| c.name.to_string()).collect();
                self.on_relation(relation_id, &namespace, &relation_name, names);
            }
            LogicalReplicationMessage::Insert { relation_id, tuple } => {
                self.on_insert(lsn, relation_id, &tuple);
            }
            LogicalReplicationMessage::Message {
                flags,
                lsn: message_lsn,
                prefix,
                content,
            } if prefix == self.prefix => {
                if let Some(alone) = self.on_message(flags, message_lsn, &prefix, &content) {
                    return Ok(Some(alone));
                }
            }
            LogicalReplicationMessage::Commit {
                end_lsn, timestamp, ..
            } => return Ok(self.on_commit(end_lsn, timestamp)),
            _ => {}
        }
        Ok(self.part_due().then(|| self.take_part()))
    }

    /// A transaction opens: its commit record will be at `final_lsn`.
    fn on_begin(&mut self, timestamp: i64, final_lsn: u64) {
        self.open = Some((postgres_time(timestamp), Vec::new()));
        self.open_commit_lsn = final_lsn;
        self.row_ids.clear();
        self.open_bytes = 0;
        self.parted = false;
    }

    /// A table's description, which its rows' columns are read by.
    fn on_relation(&mut self, relation_id: u32, namespace: &str, name: &str, columns: Vec<String>) {
        self.described = true;
        self.relations.insert(
            relation_id,
            (namespace.to_string(), name.to_string(), columns),
        );
    }

    /// A row of the open transaction. The publication holds the outbox table only (its partitions
    /// published as it): every row it carries is an event, whatever name it comes under.
    fn on_insert(&mut self, lsn: u64, relation_id: u32, tuple: &TupleData) {
        let Some((_, items)) = self.open.as_mut() else {
            return;
        };
        match self.relations.get(&relation_id) {
            Some((_, _, names)) => {
                let item = row_event(lsn, names, tuple);
                if let WalItem::Event(e) = &item {
                    self.row_ids.push(e.id);
                }
                self.open_bytes += item_bytes(&item);
                items.push(item);
            }
            None => items.push(WalItem::Undecodable {
                id: Uuid::nil(),
                lsn,
                error: format!("a row of relation {relation_id} came before its description"),
                raw: String::new(),
            }),
        }
    }

    /// A message with the outbox's prefix: an event of the open transaction, or (not
    /// transactional: emitted even when its transaction rolls back) an undecodable one handed
    /// over alone.
    fn on_message(
        &mut self,
        flags: u8,
        lsn: u64,
        prefix: &str,
        content: &[u8],
    ) -> Option<WalTransaction> {
        let origin = self.origin;
        match self.open.as_mut() {
            Some((commit_time, items)) if flags & 1 == 1 => {
                let (item, seq) = message_event(lsn, content, *commit_time, origin);
                if let Some(r) = self.recorded.as_mut() {
                    match (&item, seq) {
                        (WalItem::Event(e), Some(seq)) => {
                            r.seqs.insert(e.id, seq);
                        }
                        (WalItem::Undecodable { .. }, _) => {
                            r.undecodable_messages.insert(lsn);
                        }
                        (WalItem::Event(_), None) => {}
                    }
                }
                self.open_bytes += item_bytes(&item);
                items.push(item);
                None
            }
            _ => {
                if let Some(r) = self.recorded.as_mut() {
                    r.undecodable_messages.insert(lsn);
                }
                Some(WalTransaction {
                end_lsn: lsn,
                commit_time: Utc::now(),
                row_ids: Vec::new(),
                piece: Piece::Whole,
                items: vec![WalItem::Undecodable {
                    id: derived_id(origin, lsn),
                    lsn,
                    error: format!(
                        "a non-transactional message with prefix {prefix:?}: emit events with pg_logical_emit_message(true, ...), so that they exist only if their transaction commits"
                    ),
                    raw: String::from_utf8_lossy(content).into_owned(),
                }],
            })
            }
        }
    }

    /// The open transaction commits: what it holds, whole or as its last part.
    fn on_commit(&mut self, end_lsn: u64, timestamp: i64) -> Option<WalTransaction> {
        let (_, mut items) = self.open.take()?;
        let commit_time = postgres_time(timestamp);
        finish(&mut items, commit_time, self.origin);
        let piece = if self.parted {
            Piece::Last {
                commit_lsn: self.open_commit_lsn,
            }
        } else {
            Piece::Whole
        };
        self.parted = false;
        self.open_bytes = 0;
        Some(WalTransaction {
            end_lsn,
            commit_time,
            items,
            row_ids: std::mem::take(&mut self.row_ids),
            piece,
        })
    }

    /// Whether the open transaction's items not handed over reached the part limit.
    fn part_due(&self) -> bool {
        self.open.as_ref().is_some_and(|(_, items)| {
            !items.is_empty()
                && (items.len() >= self.part_events || self.open_bytes >= self.part_bytes)
        })
    }

    /// The open transaction's items so far, as a part.
    fn take_part(&mut self) -> WalTransaction {
        let origin = self.origin;
        let (commit_time, items) = match self.open.as_mut() {
            Some((commit_time, items)) => (*commit_time, std::mem::take(items)),
            None => (DateTime::<Utc>::default(), Vec::new()),
        };
        let mut items = items;
        // The Begin message carries the commit time already.
        finish(&mut items, commit_time, origin);
        self.parted = true;
        self.open_bytes = 0;
        WalTransaction {
            end_lsn: 0,
            commit_time,
            items,
            row_ids: std::mem::take(&mut self.row_ids),
            piece: Piece::Part {
                commit_lsn: self.open_commit_lsn,
            },
        }
    }
}

/// Completes a transaction's items once its commit time is known: rows written without a creation
/// time take it, and changes that are not events get their ids.
fn finish(items: &mut [WalItem], commit_time: DateTime<Utc>, origin: Origin) {
    for item in items {
        match item {
            WalItem::Event(e) if e.created_at == DateTime::<Utc>::default() => {
                e.created_at = commit_time;
            }
            WalItem::Undecodable { id, lsn, .. } => {
                *id = derived_id(origin, *lsn);
            }
            WalItem::Event(_) => {}
        }
    }
}

/// The payload bytes an item holds (its content's, for a change that is not an event).
pub(crate) fn item_bytes(item: &WalItem) -> usize {
    match item {
        WalItem::Event(e) => e.payload.len(),
        WalItem::Undecodable { raw, .. } => raw.len(),
    }
}

/// The event of an inserted outbox row, from pgoutput's text form of its columns.
fn row_event(lsn: u64, names: &[String], tuple: &TupleData) -> WalItem {
    // The columns as the stream holds them (a large payload is not copied before it is decoded).
    let mut values: HashMap<&str, Option<&[u8]>> = HashMap::new();
    for (name, column) in names.iter().zip(tuple.columns.iter()) {
        let value = if column.is_null() {
            None
        } else {
            Some(column.as_bytes())
        };
        values.insert(name.as_str(), value);
    }
    let raw = || {
        let shown: BTreeMap<&str, Option<String>> = values
            .iter()
            .map(|(k, v)| (*k, v.map(|b| String::from_utf8_lossy(b).into_owned())))
            .collect();
        format!("{shown:?}")
    };
    let event = event_from_text(|k: &str| values.get(k).copied().flatten());
    WalItem::new(lsn, event, raw)
}

/// Where the WAL comes from: the server's system identifier and timeline, which with a position
/// make an id no other event of this server's history has (positions are reused after a
/// point-in-time restore, on a new timeline).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Origin {
    pub(crate) system: u64,
    pub(crate) timeline: u32,
}

/// A table-less message's fields; the payload kept as written (its exact JSON text).
type MessageFields<'a> = TablelessMessage<&'a serde_json::value::RawValue>;

/// The event a table-less message carries (see the module's documentation for the encoding), and
/// its `seq` when it has one.
fn message_event(
    lsn: u64,
    content: &[u8],
    commit_time: DateTime<Utc>,
    origin: Origin,
) -> (WalItem, Option<i64>) {
    let raw = || String::from_utf8_lossy(content).into_owned();
    let mut seq = None;
    let event = (|| -> Result<Event, String> {
        let fields: MessageFields<'_> = serde_json::from_slice(content).map_err(|e| {
            format!("the message is not a JSON object of the event's fields ({e}); expected aggregate_type, aggregate_id, event_type and payload")
        })?;
        seq = fields.seq;
        let required = |v: Option<String>, k: &str| -> Result<String, String> {
            v.filter(|s| !s.is_empty())
                .ok_or_else(|| format!("the message has no {k} (a non-empty string)"))
        };
        let id = match fields.id {
            Some(s) => s
                .parse()
                .map_err(|e| format!("id {s:?} is not a UUID: {e}"))?,
            None => derived_id(origin, lsn),
        };
        let json_payload = fields.payload.filter(|p| p.get() != "null");
        let (payload, default_type) = match (json_payload, fields.payload_base64) {
            (Some(_), Some(_)) => {
                return Err("the message has both payload and payload_base64: give one".into())
            }
            (None, Some(b64)) => (
                base64_decode(&b64).ok_or("payload_base64 is not base64")?,
                "application/octet-stream",
            ),
            (Some(json), None) => (json.get().as_bytes().to_vec(), JSON_CONTENT_TYPE),
            (None, None) => {
                return Err("the message has no payload (JSON) nor payload_base64".into())
            }
        };
        let event = Event {
            id,
            aggregate_type: required(fields.aggregate_type, "aggregate_type")?,
            aggregate_id: required(fields.aggregate_id, "aggregate_id")?,
            event_type: required(fields.event_type, "event_type")?,
            payload,
            content_type: fields.content_type.unwrap_or_else(|| default_type.into()),
            headers: fields
                .headers
                .map(|h| parse_headers(&h.to_string()))
                .unwrap_or_default(),
            destination: fields.destination,
            created_at: commit_time,
            attempts: 0,
        };
        Ok(event)
    })();
    (WalItem::new(lsn, event, raw), seq)
}

/// Whether PostgreSQL can store `e` in the held table: its text fields with no NUL character, and
/// a payload stored as `jsonb` (a JSON content type and JSON text, as the held table's insert
/// decides) with nothing `jsonb` refuses. An event it could not store would fail the insert every
/// time the reader read it.
fn storable(e: &Event) -> Result<(), String> {
    storable_text(e)?;
    if let Err(what) = storable_json(&e.payload) {
        let as_jsonb = e.is_json()
            && serde_json::from_slice::<&serde_json::value::RawValue>(&e.payload).is_ok();
        if as_jsonb {
            return Err(what);
        }
    }
    Ok(())
}

/// PostgreSQL's text cannot hold a NUL character.
fn storable_text(e: &Event) -> Result<(), String> {
    let fields = [
        ("aggregate_type", e.aggregate_type.as_str()),
        ("aggregate_id", e.aggregate_id.as_str()),
        ("event_type", e.event_type.as_str()),
        ("content_type", e.content_type.as_str()),
        ("destination", e.destination.as_deref().unwrap_or("")),
    ];
    let headers = e.headers.iter().flat_map(|(k, v)| [k.as_str(), v.as_str()]);
    for (name, value) in fields.into_iter().chain(headers.map(|h| ("a header", h))) {
        if value.contains('\0') {
            return Err(format!(
                "{name} contains a NUL character (\\u0000), which PostgreSQL's text cannot hold: remove it"
            ));
        }
    }
    Ok(())
}

/// What `jsonb` refuses in JSON that is otherwise valid: `\u0000`, and a `\uD800`-`\uDFFF` escape
/// that is not half of a surrogate pair (a lone surrogate).
fn storable_json(json: &[u8]) -> Result<(), String> {
    let hex = |at: usize| -> Option<u32> {
        let digits = json.get(at..at + 4)?;
        u32::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
    };
    let mut i = 0;
    while i < json.len() {
        if json[i] != b'\\' {
            i += 1;
            continue;
        }
        if json.get(i + 1) != Some(&b'u') {
            i += 2;
            continue;
        }
        let Some(code) = hex(i + 2) else {
            return Ok(());
        };
        let refuse = |what: &str| {
            Err(format!(
                "the payload holds {what}, which PostgreSQL's jsonb cannot store: remove it or send the payload as payload_base64"
            ))
        };
        match code {
            0 => return refuse("\\u0000"),
            0xD800..=0xDBFF => {
                let low = (json.get(i + 6) == Some(&b'\\') && json.get(i + 7) == Some(&b'u'))
                    .then(|| hex(i + 8))
                    .flatten();
                if !matches!(low, Some(0xDC00..=0xDFFF)) {
                    return refuse("a lone surrogate escape");
                }
                i += 12;
            }
            0xDC00..=0xDFFF => return refuse("a lone surrogate escape"),
            _ => i += 6,
        }
    }
    Ok(())
}

/// The id of a message written without one: the same for every read of that message (its
/// position, on this server's timeline).
fn derived_id(origin: Origin, lsn: u64) -> Uuid {
    let mut bytes = [0u8; 16];
    let system = (origin.system >> 32) as u32 ^ origin.system as u32;
    bytes[..4].copy_from_slice(&system.to_be_bytes());
    bytes[4..8].copy_from_slice(&origin.timeline.to_be_bytes());
    bytes[8..].copy_from_slice(&lsn.to_be_bytes());
    uuid::Builder::from_custom_bytes(bytes).into_uuid()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::row::{decode_bytea, parse_timestamptz};
    use crate::writer::message::MessageWriter;
    use txoutbox_core::format::base64;
    use txoutbox_core::NewEvent;

    #[test]
    fn what_postgres_cannot_store_is_refused_by_the_decoder() {
        assert!(storable_json(br#"{"a":"\u0000"}"#).is_err());
        assert!(
            storable_json(br#"{"a":"\\u0000"}"#).is_ok(),
            "an escaped backslash"
        );
        assert!(storable_json(br#"{"a":"\ud83d\ude00 \u00e9 \n"}"#).is_ok());
        assert!(storable_json(br#"{"a":"\ud83d"}"#).is_err());
        assert!(storable_json(br#"{"a":"\ud83dx"}"#).is_err());
        assert!(storable_json(br#"{"a":"\ude00"}"#).is_err());
        let here = Origin::default();
        let message = |json: &str| message_event(1, json.as_bytes(), Utc::now(), here).0;
        let refused = |json: &str| match message(json) {
            WalItem::Undecodable { error, .. } => error,
            WalItem::Event(e) => panic!("decoded {e:?} from {json}"),
        };
        assert!(refused(
            r#"{"aggregate_type":"o","aggregate_id":"a\u0000b","event_type":"e","payload":{}}"#
        )
        .contains("aggregate_id contains a NUL"));
        assert!(refused(
            r#"{"aggregate_type":"o","aggregate_id":"a","event_type":"e","payload":{"x":"\u0000"}}"#
        )
        .contains("payload_base64"));
        assert!(refused(
            r#"{"aggregate_type":"o","aggregate_id":"a","event_type":"e","payload":{},"headers":{"h":"\u0000"}}"#
        )
        .contains("a header contains a NUL"));
        assert!(matches!(
            message(
                r#"{"aggregate_type":"o","aggregate_id":"a","event_type":"e","payload":{"x":"\ud83d\ude00"}}"#
            ),
            WalItem::Event(_)
        ));
    }

    #[test]
    fn postgres_timestamps_count_from_2000() {
        assert_eq!(postgres_time(0).to_rfc3339(), "2000-01-01T00:00:00+00:00");
        assert_eq!(
            postgres_time(86_400_000_001).timestamp_micros(),
            946_771_200_000_001
        );
    }

    #[test]
    fn column_texts_decode() {
        assert_eq!(decode_bytea(b"\\x00ff10"), Some(vec![0, 255, 16]));
        assert_eq!(decode_bytea(b"\\xAbCd"), Some(vec![0xab, 0xcd]));
        assert_eq!(decode_bytea(b"00ff"), None);
        assert_eq!(decode_bytea(b"\\x0"), None);
        assert_eq!(decode_bytea(b"\\x0g"), None);
        let t = parse_timestamptz("2026-12-04 10:11:12.345678+00").unwrap();
        assert_eq!(t.to_rfc3339(), "2026-12-04T10:11:12.345678+00:00");
        let t = parse_timestamptz("2026-12-04 10:11:12+05:30").unwrap();
        assert_eq!(t.to_rfc3339(), "2026-12-04T04:41:12+00:00");
        for bytes in [&b""[..], b"f", b"fo", b"foo", b"\x00\xff\xfe\x01"] {
            assert_eq!(base64_decode(&base64(bytes)).as_deref(), Some(bytes));
        }
        let here = Origin {
            system: 42,
            timeline: 1,
        };
        assert_eq!(derived_id(here, 7), derived_id(here, 7));
        assert_ne!(derived_id(here, 7), derived_id(here, 8));
        let restored = Origin {
            system: 42,
            timeline: 2,
        };
        assert_ne!(
            derived_id(here, 7),
            derived_id(restored, 7),
            "a new timeline, new ids"
        );
        // PostgreSQL's encode(..., 'base64') breaks lines every 76 characters.
        let long: Vec<u8> = (0..200u8).collect();
        let wrapped: String = base64(&long)
            .as_bytes()
            .chunks(76)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect::<Vec<_>>()
            .join("\n");
        assert_eq!(base64_decode(&wrapped), Some(long));
        assert_eq!(base64_decode("Zm9v=Zm9v"), None, "padding only at the end");
        assert_eq!(base64_decode("Zm9vZ"), None, "no 1-character group");
        assert_eq!(base64_decode("Zg="), None, "padded groups are whole");
        let t = parse_timestamptz("1901-01-01 00:00:00-03:30:52").unwrap();
        assert_eq!(t.to_rfc3339(), "1901-01-01T03:30:52+00:00");
        assert_eq!(parse_timestamptz("infinity"), None);
    }

    #[test]
    fn a_message_payload_keeps_its_exact_text() {
        let content = br#"{"aggregate_type":"o","aggregate_id":"1","event_type":"e","payload":{"z": 12345678901234567890123.10, "a": [1, 2]}}"#;
        match message_event(1, content, Utc::now(), Origin::default()).0 {
            WalItem::Event(e) => {
                assert_eq!(
                    e.payload,
                    br#"{"z": 12345678901234567890123.10, "a": [1, 2]}"#
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_message_carries_its_seq_when_written_with_one() {
        let with =
            br#"{"seq":41,"aggregate_type":"o","aggregate_id":"1","event_type":"e","payload":{}}"#;
        let without = br#"{"aggregate_type":"o","aggregate_id":"1","event_type":"e","payload":{}}"#;
        let (item, seq) = message_event(1, with, Utc::now(), Origin::default());
        assert!(matches!(item, WalItem::Event(_)));
        assert_eq!(seq, Some(41));
        assert_eq!(
            message_event(1, without, Utc::now(), Origin::default()).1,
            None
        );
    }

    #[test]
    fn messages_name_what_is_missing() {
        let now = Utc::now();
        let bad =
            |content: &str| match message_event(1, content.as_bytes(), now, Origin::default()).0 {
                WalItem::Undecodable { error, raw, .. } => {
                    assert_eq!(raw, content);
                    error
                }
                WalItem::Event(e) => panic!("decoded {e:?}"),
            };
        assert!(bad("not json").contains("not a JSON object"));
        assert!(bad(r#"{"aggregate_type":"o","aggregate_id":"1","event_type":"e","payload":{},"payload_base64":"AA=="}"#)
            .contains("both payload and payload_base64"));
        assert!(bad("[1]").contains("not a JSON object"));
        assert!(
            bad(r#"{"aggregate_type":"o","aggregate_id":"1","payload":{}}"#).contains("event_type")
        );
        assert!(
            bad(r#"{"aggregate_type":"o","aggregate_id":"1","event_type":"e"}"#)
                .contains("no payload")
        );
        let e = NewEvent::new(
            "order",
            "42",
            "order.created",
            serde_json::json!({"total": 9}),
        )
        .with_header("traceparent", "00-1-2-01");
        match message_event(
            5,
            MessageWriter::encode(&e).as_bytes(),
            now,
            Origin::default(),
        )
        .0
        {
            WalItem::Event(got) => {
                assert_eq!(got.id, e.id);
                assert_eq!(got.payload, br#"{"total":9}"#);
                assert_eq!(
                    got.headers.get("traceparent").map(String::as_str),
                    Some("00-1-2-01")
                );
                assert_eq!(got.created_at, now);
            }
            other => panic!("{other:?}"),
        }
    }
}
