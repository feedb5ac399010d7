//! The WAL source: events read from a logical replication slot of the outbox table, in commit
//! order, and published by the same relay engine as the polling source's.
//!
//! # How it works
//! - **One reader per slot.** A background task ([`WalStore::start`]) opens a connection of its own
//!   and takes a session advisory lock for the slot; other relays wait (hot standbys, trying every
//!   [`STANDBY_RETRY`]) and take over when the reader's session ends (a crash, `kill -9`, a dropped
//!   connection: PostgreSQL frees the lock with the session). Every statement of the reader
//!   (hand-overs to the held table, deletes of published rows) runs on that connection, so a reader
//!   that lost its lock lost the connection it would write with; the slot itself is streamed over a
//!   replication connection (`START_REPLICATION`, which the slot admits one at a time; the
//!   `pg_walstream` crate's transport and pgoutput parser), opened once the lock is held, and
//!   confirmed with standby status updates.
//! - **Claims.** The reader keeps the transactions it read, whole and in commit order, in memory
//!   (bounded: `wal.read_ahead` events and `wal.read_ahead_bytes`). A claim takes, per aggregate,
//!   the first unsettled event and the ready ones after it, never an aggregate another batch holds.
//! - **Failures go to the held table.** An event the relay could not publish (to retry, or a dead
//!   letter), the later events of its aggregate, and every event of an aggregate that still has
//!   events in that table, are moved to the *held table* (`wal.held_table`, an outbox table of its
//!   own), in commit order. The same relay claims from it with the polling machinery (backoff,
//!   dead letters, `outbox dead-letters`), so a failing aggregate holds back only itself and the
//!   slot moves on.
//! - **Confirms.** The slot's confirmed position moves past a transaction only once each of its
//!   events is published or in the held table (and, with `wal.delete_published`, its outbox rows
//!   deleted): a crash replays from there (at least once). A replayed event already in the held
//!   table is not moved twice; after a fallback, or a reading that ended early, a replayed row
//!   event whose row is gone (published, or moved by the fallback) is skipped (`replay`). A
//!   reading that fails first waits for the batches in flight and deletes the rows of what it
//!   published (`reader`).
//! - **A slot that cannot be streamed** (missing, invalidated, its publication without the table):
//!   the reader moves the outbox table's unpublished rows to the held table, makes the slot again
//!   with `wal.auto_recreate`, and streams again once every row written before the new slot's
//!   consistent point is moved (the `fallback` module).
//!
//! # The slot
//! The publication holds the outbox table's inserts only (`publish = 'insert'`: the relay's own
//! updates and deletes are not decoded) and is created before the slot (a slot older than its
//! publication fails to decode the changes in between). An abandoned slot keeps every WAL segment
//! from its restart position on: [`WalStatus::retained_bytes`] says how much, and `outbox wal drop`
//! removes both. [`WalReader`] reads the slot with the SQL slot functions
//! (`pg_logical_slot_peek_binary_changes`, `pg_replication_slot_advance`) over the sqlx pool, for
//! `outbox wal status` and tools: each such call decodes from the slot's restart position, too slow
//! for the relay, which streams it.
//!
//! # Where things are
//! - `setup`: what `outbox wal setup` makes; `slot`: the publication and the slot, their setup and
//!   removal; `status`: where the slot stands; `config`: the `[wal]` settings ([`WalConfig`]).
//! - `decode`: the slot's pgoutput messages as whole transactions of events; [`WalReader`].
//! - `conninfo`: the replication connection's settings and readiness; `replication`: that
//!   connection; `stream`: the replication stream.
//! - `store`: [`WalStore`] and its leases; `shared`: what the store, its leases and the reader
//!   share; `reader`: the reader task (lock, standby, reading loop, leaving a reading); `buffer`:
//!   the transactions read and each event's state; `held`: the hand-over to the held table;
//!   `mark`: the held table's marks of unfinished work; `confirm`: confirming settled
//!   transactions; `replay`: what a reading hands over again.
//! - `check`: where the slot stands (its problem, position and publication's identity);
//!   `fallback`: publishing from the outbox table while the slot cannot be streamed; `progress`:
//!   what the fallbacks count, and why they happen ([`FallbackReason`]).
//!
//! Imports between these run one way: no module imports one that imports it back.

mod buffer;
mod check;
mod config;
mod confirm;
mod conninfo;
mod decode;
mod fallback;
mod held;
mod mark;
mod progress;
mod reader;
mod replay;
mod replication;
mod setup;
mod shared;
mod slot;
mod status;
mod store;
mod stream;
mod tableless;
mod taken;

pub use crate::writer::message::{MessageWriter, DEFAULT_MESSAGE_PREFIX};
pub use config::{WalConfig, DEFAULT_RETAINED_WAL_WARNING};
pub use decode::{
    postgres_time, Piece, WalItem, WalPeek, WalReader, WalTransaction, PROTO_VERSION,
};
pub use fallback::mark_new_slot;
pub use held::{held_events_left, refuse_polling_over_held_events, UNDECODABLE_AGGREGATE_TYPE};
pub use mark::{FALLBACK_MARK_TYPE, SPILL_MARK_TYPE};
pub use progress::{FallbackProgress, FallbackReason, FALLBACK_REASONS};
pub use reader::STANDBY_RETRY;
pub use setup::{setup, Setup};
pub use shared::CLAIMS_PAUSED_AFTER;
pub use slot::{check_wal_level, held_table_exists, preflight, wal_level, WalSetup, WalSlot};
pub use status::{SlotPositions, WalStatus, STATUS_PEEK};
pub use store::{ReaderHandle, WalProgress, WalStore};
