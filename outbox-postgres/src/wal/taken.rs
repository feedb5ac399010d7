//! What of the slot's table-less events is dealt with already (published, or in the held table),
//! beyond the slot's confirmed position: a table-less event has no row whose absence would tell.
//! A fallback that read them from the slot, and a reading that ended before the server took its
//! last confirm, say so here; the reading that follows skips them.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::decode::{Piece, WalItem, WalTransaction};

/// The slot's transactions whose table-less events a fallback put in the held table, beyond the
/// position the slot was advanced to: by the position just past the commit (`end`) and of the
/// commit record (`commit`, which names a transaction read in parts). Kept in the fallback's mark.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Taken {
    pub(super) ends: HashMap<u64, u64>,
    /// Every transaction ending at or before this position (one a reading confirmed on its stream,
    /// which the server may not have taken before the stream ended).
    #[serde(default)]
    through: u64,
}

impl Taken {
    /// Whether the table-less events of transaction `t` (as the stream hands it over) were taken.
    pub(super) fn has(&self, t: &WalTransaction) -> bool {
        match t.piece {
            Piece::Whole => {
                (t.end_lsn != 0 && t.end_lsn <= self.through) || self.ends.contains_key(&t.end_lsn)
            }
            Piece::Part { commit_lsn } | Piece::Last { commit_lsn } => {
                commit_lsn < self.through || self.ends.values().any(|c| *c == commit_lsn)
            }
        }
    }

    /// The ids of `t`'s table-less events that were taken (the stream leaves them out).
    pub(super) fn taken_in(&self, t: &WalTransaction) -> Vec<Uuid> {
        if self.is_empty() || !self.has(t) {
            return Vec::new();
        }
        let rows: HashSet<&Uuid> = t.row_ids.iter().collect();
        t.items
            .iter()
            .filter_map(|item| match item {
                WalItem::Event(e) if !rows.contains(&e.id) => Some(e.id),
                _ => None,
            })
            .collect()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.ends.is_empty() && self.through == 0
    }

    /// Adds every transaction ending at or before `lsn`.
    pub(super) fn add_through(&mut self, lsn: u64) {
        self.through = self.through.max(lsn);
    }

    /// Adds the transaction ending at `end_lsn` (read whole: its commit record's position is not
    /// needed to find it again).
    pub(super) fn add_whole(&mut self, end_lsn: u64) {
        self.ends.entry(end_lsn).or_insert(0);
    }

    /// Adds what `other` holds.
    pub(super) fn extend(&mut self, other: Taken) {
        self.through = self.through.max(other.through);
        for (end, commit) in other.ends {
            self.ends.entry(end).or_insert(commit);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use txoutbox_core::testkit::sample_event;

    fn transaction(end_lsn: u64, piece: Piece, rows: usize, messages: usize) -> WalTransaction {
        let events: Vec<_> = (0..rows + messages)
            .map(|n| {
                let e = sample_event("a", n);
                txoutbox_core::Event {
                    id: e.id,
                    aggregate_type: e.aggregate_type,
                    aggregate_id: e.aggregate_id,
                    event_type: e.event_type,
                    payload: b"{}".to_vec(),
                    content_type: "application/json".into(),
                    headers: Default::default(),
                    destination: None,
                    created_at: Utc::now(),
                    attempts: 0,
                }
            })
            .collect();
        WalTransaction {
            end_lsn,
            commit_time: Utc::now(),
            row_ids: events[..rows].iter().map(|e| e.id).collect(),
            items: events.into_iter().map(WalItem::Event).collect(),
            piece,
        }
    }

    #[test]
    fn only_the_table_less_events_of_taken_transactions_are_left_out() {
        let mut taken = Taken::default();
        assert!(taken.is_empty());
        let t = transaction(100, Piece::Whole, 2, 3);
        assert!(taken.taken_in(&t).is_empty());
        taken.add_whole(100);
        let left_out = taken.taken_in(&t);
        assert_eq!(
            left_out.len(),
            3,
            "the three table-less events, not the rows"
        );
        assert!(left_out.iter().all(|id| !t.row_ids.contains(id)));
        assert!(taken
            .taken_in(&transaction(200, Piece::Whole, 0, 1))
            .is_empty());
    }

    #[test]
    fn a_confirmed_position_covers_every_transaction_before_it() {
        let mut taken = Taken::default();
        taken.add_through(500);
        assert!(!taken.is_empty());
        assert_eq!(
            taken.taken_in(&transaction(500, Piece::Whole, 0, 1)).len(),
            1
        );
        assert!(taken
            .taken_in(&transaction(501, Piece::Whole, 0, 1))
            .is_empty());
        let part = Piece::Part { commit_lsn: 480 };
        assert_eq!(taken.taken_in(&transaction(0, part, 0, 2)).len(), 2);
        let later = Piece::Part { commit_lsn: 600 };
        assert!(taken.taken_in(&transaction(0, later, 0, 2)).is_empty());
        // Kept in the fallback's mark as JSON, and read back the same.
        let json = serde_json::to_value(&taken).unwrap();
        assert_eq!(serde_json::from_value::<Taken>(json).unwrap(), taken);
    }
}
