//! A small bounded map for what publishers remember per destination (resolved queue URLs, exchanges
//! known to exist): any writer can name any destination, so such memory must not grow with them.

use std::collections::HashMap;
use std::hash::Hash;

/// How many destinations a publisher remembers by default.
pub const DEFAULT_DESTINATION_CACHE: usize = 1024;

/// A map of at most `capacity` entries that forgets the least recently used one to make room.
///
/// Lookups and inserts are O(1); making room is O(capacity), and happens only once more distinct
/// keys are in use than the capacity.
#[derive(Debug, Clone)]
pub struct BoundedCache<K, V> {
    capacity: usize,
    clock: u64,
    entries: HashMap<K, (V, u64)>,
}

impl<K: Hash + Eq + Clone, V: Clone> BoundedCache<K, V> {
    /// An empty cache holding at most `capacity` entries (at least one).
    pub fn new(capacity: usize) -> Self {
        BoundedCache {
            capacity: capacity.max(1),
            clock: 0,
            entries: HashMap::new(),
        }
    }

    /// The value of `key`, marking it as used.
    pub fn get(&mut self, key: &K) -> Option<V> {
        self.clock += 1;
        let now = self.clock;
        self.entries.get_mut(key).map(|(value, used)| {
            *used = now;
            value.clone()
        })
    }

    /// Remembers `value` for `key`, forgetting the least recently used entry when full.
    pub fn insert(&mut self, key: K, value: V) {
        self.clock += 1;
        if !self.entries.contains_key(&key) && self.entries.len() >= self.capacity {
            if let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone())
            {
                self.entries.remove(&oldest);
            }
        }
        self.entries.insert(key, (value, self.clock));
    }

    /// Forgets every entry for which `keep` returns false.
    pub fn retain(&mut self, mut keep: impl FnMut(&K, &V) -> bool) {
        self.entries.retain(|k, (v, _)| keep(k, v));
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The most entries held.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_at_most_its_capacity_and_forgets_the_least_recently_used() {
        let mut c = BoundedCache::new(3);
        for i in 0..3 {
            c.insert(i, i * 10);
        }
        assert_eq!(c.get(&0), Some(0), "0 is used again: 1 is now the oldest");
        c.insert(3, 30);
        assert_eq!(c.len(), 3);
        assert_eq!(c.get(&1), None, "the least recently used went");
        assert_eq!(
            (c.get(&0), c.get(&2), c.get(&3)),
            (Some(0), Some(20), Some(30))
        );
        for i in 100..10_000 {
            c.insert(i, i);
            assert!(c.len() <= 3);
        }
        c.insert(9_999, 1);
        assert_eq!(c.get(&9_999), Some(1), "an update replaces, never evicts");
        c.retain(|k, _| *k != 9_999);
        assert_eq!(c.get(&9_999), None);
        assert_eq!(BoundedCache::<u8, u8>::new(0).capacity(), 1);
    }
}
