//! Kept sets: the partitions that filled a recent ordered batch, offered to later claims once its
//! lease has ended, so that a claim can take them again as they are (no window to read, no walk).
//! The lease offers a set ([`keep`]); the ordered claim takes one back (`take_kept`).

use std::sync::{Arc, Mutex};

/// How many sets of partitions a store keeps for later claims: one per batch in flight of the
/// default relay, and some.
pub(super) const KEPT_SETS: usize = 4;

/// How many times a kept set is taken again before its partitions are chosen afresh from the oldest
/// events (it serves that many batches after the one it was chosen for): partitions outside every
/// kept set wait for a choice at most about that many batches of each batch in flight.
pub(super) const KEPT_USES: u32 = 8;

/// A store's kept sets of partitions (see [`KEPT_SETS`]).
pub(super) type KeptSets = Arc<Mutex<Vec<Kept>>>;

/// A set of partitions that filled a batch, kept for a later claim.
#[derive(Debug, Clone)]
pub(crate) struct Kept {
    pub(super) parts: Vec<i32>,
    pub(super) uses: u32,
    /// Chosen by a sharing claim (see `claim::ordered::SHARE_CLAIMS`): taken again only by sharing
    /// claims, and a set chosen for one event per aggregate only by claims that are not.
    pub(super) shared: bool,
}

/// Offers `set` to later claims once its batch's lease has ended (its partitions are free again),
/// unless it has served [`KEPT_USES`] claims.
pub(super) fn keep(kept: &Mutex<Vec<Kept>>, set: Kept) {
    if set.uses >= KEPT_USES || set.parts.is_empty() {
        return;
    }
    if let Ok(mut kept) = kept.lock() {
        kept.insert(0, set);
        kept.truncate(KEPT_SETS);
    }
}
