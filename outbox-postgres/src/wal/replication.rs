//! The slot's replication session: a replication connection (`replication=database`, the
//! `pg_walstream` crate's transport) on which this module pins the output settings and then runs
//! `START_REPLICATION` itself.
//!
//! Two things a database's or role's defaults would otherwise change are fixed here:
//! - **Column text.** pgoutput writes each column with the walsender session's output functions:
//!   `DateStyle`, `TimeZone`, `bytea_output`, `IntervalStyle` and `extra_float_digits` change what
//!   a row looks like. The session sets [`OUTPUT_SETTINGS`] with SQL before the stream starts (a
//!   database-mode replication connection runs SQL), the same values the SQL peek pins.
//! - **No `CREATE_REPLICATION_SLOT`.** The crate's own stream sends one at every start and reads
//!   "already exists" from the English text of the error: under `lc_messages` in another language
//!   it never started, and a missing slot would be created at the current position, skipping the
//!   events in between. The slot is made by `outbox wal setup` only; a missing one fails the start.

use std::time::{Duration, Instant};

use bytes::Buf;
use pg_walstream::{parse_keepalive_message, CancellationToken, PgReplicationConnection};
use pg_walstream::{ReplicationError, XLogRecPtr};

use super::conninfo::ReplicationTarget;
use super::decode::PROTO_VERSION;
use txoutbox_core::{Error, ErrorKind};

/// The output settings every reading session of the slot runs with (name, value): columns come as
/// the decoder reads them whatever the database's or role's defaults.
pub(crate) const OUTPUT_SETTINGS: [(&str, &str); 5] = [
    ("DateStyle", "ISO, YMD"),
    ("IntervalStyle", "postgres"),
    ("TimeZone", "UTC"),
    ("bytea_output", "hex"),
    ("extra_float_digits", "3"),
];

/// A change as the server sent it: where it starts, and its pgoutput bytes.
pub(super) struct Change {
    pub(super) wal_start: u64,
    pub(super) data: bytes::Bytes,
}

/// A replication session streaming one slot's pgoutput from its confirmed position.
pub(super) struct Replication {
    conn: PgReplicationConnection,
    /// The end of the WAL the server has sent (changes and keepalives).
    received: XLogRecPtr,
    /// The position reported as flushed and applied: everything before it is settled.
    confirmed: XLogRecPtr,
    /// What was last reported, and when.
    reported: XLogRecPtr,
    reported_at: Instant,
    /// How often the confirmed position is reported while changes flow.
    report_every: Duration,
}

impl Replication {
    /// Connects to `target`, pins [`OUTPUT_SETTINGS`] (and the pool's `application_name`) and
    /// starts streaming `slot` through `publication` from the slot's confirmed position.
    ///
    /// # Errors
    /// The server's error (a missing slot: SQLSTATE 42704; a slot another session streams: 55006).
    pub(super) fn start(
        target: &ReplicationTarget,
        slot: &str,
        publication: &str,
        report_every: Duration,
    ) -> Result<Replication, ReplicationError> {
        let mut conn = PgReplicationConnection::connect(target.conninfo())?;
        conn.exec(&pin_settings_sql(target.application_name()))?;
        let publications = format!("\"{}\"", publication.replace('"', "\"\""));
        conn.start_replication(
            slot,
            0,
            &[
                ("proto_version", PROTO_VERSION),
                ("publication_names", &publications),
                ("messages", "on"),
            ],
        )?;
        Ok(Replication {
            conn,
            received: 0,
            confirmed: 0,
            reported: 0,
            reported_at: Instant::now(),
            report_every,
        })
    }

    /// The next change, answering keepalives meanwhile and reporting the confirmed position when
    /// it moved and `report_every` passed.
    ///
    /// # Errors
    /// A cancelled error when `cancel` fires; the connection's error otherwise.
    pub(super) async fn next(
        &mut self,
        cancel: &CancellationToken,
    ) -> Result<Change, ReplicationError> {
        loop {
            if self.confirmed != self.reported && self.reported_at.elapsed() >= self.report_every {
                self.report().await?;
            }
            let data = self.conn.get_copy_data_async(cancel).await?;
            match data.first() {
                Some(b'w') if data.len() >= 25 => {
                    let mut header = &data[1..25];
                    let wal_start = header.get_u64();
                    let wal_end = header.get_u64();
                    self.received = self.received.max(wal_end);
                    return Ok(Change {
                        wal_start,
                        data: data.slice(25..),
                    });
                }
                Some(b'w') => {
                    return Err(ReplicationError::protocol(
                        "a WAL data message shorter than its header".to_string(),
                    ))
                }
                Some(b'k') => {
                    let keepalive = parse_keepalive_message(&data)?;
                    self.received = self.received.max(keepalive.wal_end);
                    if keepalive.reply_requested {
                        self.report().await?;
                    }
                }
                _ => {}
            }
        }
    }

    /// The end of the WAL the server has sent.
    pub(super) fn received(&self) -> XLogRecPtr {
        self.received
    }

    /// Everything before `lsn` is settled: it is reported (at the next report) as flushed and
    /// applied, never beyond what was received, never back.
    pub(super) fn confirm(&mut self, lsn: XLogRecPtr) {
        self.confirmed = self.confirmed.max(lsn.min(self.received));
    }

    /// Reports the received and confirmed positions now (a standby status update).
    ///
    /// # Errors
    /// The connection's error.
    pub(super) async fn report(&mut self) -> Result<(), ReplicationError> {
        self.reported_at = Instant::now();
        if self.received == 0 {
            return Ok(());
        }
        self.conn
            .send_standby_status_update(self.received, self.confirmed, self.confirmed, false)
            .await?;
        self.reported = self.confirmed;
        Ok(())
    }
}

/// Opens a replication connection to `target`, asks the server who it is (`IDENTIFY_SYSTEM`) and
/// closes it: the relay's role may open one, with the pool's settings.
///
/// # Errors
/// The connection's or the server's error.
pub(super) fn probe(target: &ReplicationTarget) -> Result<(), ReplicationError> {
    let mut conn = PgReplicationConnection::connect(target.conninfo())?;
    conn.identify_system()?;
    Ok(())
}

/// The SQL that pins [`OUTPUT_SETTINGS`] for a session, and the pool's `application_name` (the
/// replication session then shows in `pg_stat_activity` as the pool's sessions do).
fn pin_settings_sql(application_name: Option<&str>) -> String {
    let name = application_name.map(|n| ("application_name", n));
    OUTPUT_SETTINGS
        .iter()
        .copied()
        .chain(name)
        .map(|(name, value)| {
            // An escape string constant reads the same whatever standard_conforming_strings is.
            let escaped = value.replace('\\', "\\\\").replace('\'', "\\'");
            format!("SET {name} = E'{escaped}'")
        })
        .collect::<Vec<_>>()
        .join("; ")
}

impl ReplicationTarget {
    /// Opens a replication connection with these settings and asks the server who it is
    /// (`IDENTIFY_SYSTEM`), then closes it.
    ///
    /// # Errors
    /// Why it does not open, naming where it tried to connect.
    pub(crate) async fn probe(&self) -> Result<(), Error> {
        let target = self.clone();
        let answer = tokio::task::spawn_blocking(move || probe(&target))
            .await
            .map_err(|e| {
                Error::new(
                    ErrorKind::Connection,
                    format!("the replication probe did not finish: {e}"),
                )
            })?;
        answer.map_err(|e| {
            Error::new(
                ErrorKind::Connection,
                format!(
                    "the WAL source's replication connection to {} does not open: {e}",
                    self.shown
                ),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pinned_settings_are_one_statement_each() {
        assert_eq!(
            pin_settings_sql(None),
            "SET DateStyle = E'ISO, YMD'; SET IntervalStyle = E'postgres'; SET TimeZone = E'UTC'; \
             SET bytea_output = E'hex'; SET extra_float_digits = E'3'"
        );
        assert!(pin_settings_sql(Some("it's a\\b"))
            .ends_with("; SET application_name = E'it\\'s a\\\\b'"));
    }
}
