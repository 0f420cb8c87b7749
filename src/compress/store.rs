//! The caches of a communicator, by source: one *lineage* per (source rank, tensor) it sent,
//! known by the source and its current slot version (random when the source filled it with
//! frames, agreed when every rank filled it from an uncompressed call). A source codes its
//! shard against its own lineage of the tensor (found by its own key); a receiver finds the
//! lineage a frame was coded against by the (source, version) the frame names, whatever key it
//! would itself have inferred for the call. So ranks whose inferred keys differ (a buffer that
//! moves) never decode against the wrong state, and a source whose cache holds no copy of a
//! tensor (a miss) sends a FILL of its shard while the others still send deltas.
//!
//! Every rank holds the same lineages (its own, and a copy of every other source's: each frame
//! reaches every rank), uses them in the same calls, and evicts them by the same rule (least
//! recently used first, after each call, until the budget holds), so no rank drops a lineage
//! another still codes against.

use std::collections::{HashMap, HashSet};

use super::stats::SlotKey;
use crate::codec::CacheSlot;

/// One source's cache of one tensor.
pub(super) struct Lineage {
    pub slot: CacheSlot,
    /// The communicator's call clock when it was last used.
    pub last_use: u64,
}

#[derive(Default)]
pub(super) struct Store {
    /// By (source rank, slot version).
    lineages: HashMap<(usize, u64), Lineage>,
    /// This rank's own tensors: key -> (this rank, version) of its lineage.
    own: HashMap<SlotKey, (usize, u64)>,
    /// This rank's tensors whose own lineage the budget evicted (until they have one again).
    evicted_own: HashSet<SlotKey>,
}

impl Store {
    /// Bytes of cache memory held.
    pub fn bytes(&self) -> usize {
        self.lineages.values().map(|l| l.slot.memory_bytes()).sum()
    }

    pub fn len(&self) -> usize {
        self.lineages.len()
    }

    /// Take this rank's (`me`) lineage of the tensor `key` out, if it has one.
    pub fn take_own(&mut self, key: &SlotKey) -> Option<Lineage> {
        let at = self.own.remove(key)?;
        self.lineages.remove(&at)
    }

    /// Take source `src`'s lineage at `version` out, if this rank holds it.
    pub fn take(&mut self, src: usize, version: u64) -> Option<Lineage> {
        self.lineages.remove(&(src, version))
    }

    /// Put a lineage (back), under its slot's current version; `own` names this rank's tensor
    /// when the lineage is its own.
    pub fn put(&mut self, src: usize, lineage: Lineage, own: Option<SlotKey>) {
        let version = lineage.slot.version();
        if let Some(key) = own {
            self.own.insert(key, (src, version));
            self.evicted_own.remove(&key);
        }
        self.lineages.insert((src, version), lineage);
    }

    /// Evict least recently used lineages until at most `budget` bytes are held. Returns how
    /// many went.
    pub fn evict_to(&mut self, budget: usize) -> u64 {
        let mut bytes = self.bytes();
        let mut evicted = 0;
        while bytes > budget {
            let Some((&victim, l)) = self
                .lineages
                .iter()
                .min_by_key(|((src, version), l)| (l.last_use, *src, *version))
            else {
                break;
            };
            bytes -= l.slot.memory_bytes();
            self.lineages.remove(&victim);
            evicted += 1;
        }
        if evicted > 0 {
            let (lineages, gone) = (&self.lineages, &mut self.evicted_own);
            // This rank's tensors whose lineage went are forgotten (their next call fills),
            // and remembered as evicted (see `take_evicted`).
            self.own.retain(|key, at| {
                let kept = lineages.contains_key(at);
                if !kept {
                    gone.insert(*key);
                }
                kept
            });
        }
        evicted
    }

    /// Whether the budget evicted this rank's lineage of `key` (and it has none since); the
    /// mark is cleared.
    pub fn take_evicted(&mut self, key: &SlotKey) -> bool {
        self.evicted_own.remove(key)
    }

    /// Forget everything.
    pub fn clear(&mut self) {
        self.lineages.clear();
        self.own.clear();
        self.evicted_own.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::CacheMode;
    use crate::DType;

    fn lineage(version: u64, last_use: u64) -> Lineage {
        let mut slot = CacheSlot::with_version(DType::BF16, CacheMode::FullValue, 100, version);
        slot.fill_from(&[0u8; 200]).unwrap();
        Lineage { slot, last_use }
    }

    #[test]
    fn lineages_are_found_by_source_and_version_and_evicted_oldest_first() {
        let key = SlotKey {
            id: 7,
            inferred: false,
            count: 100,
            dtype: DType::BF16,
        };
        let mut s = Store::default();
        s.put(0, lineage(11, 1), Some(key));
        s.put(1, lineage(22, 2), None);
        s.put(1, lineage(33, 3), None);
        assert_eq!(s.bytes(), 600);
        assert!(s.take(1, 99).is_none());
        let l = s.take(1, 22).unwrap();
        s.put(1, l, None);
        // The oldest (rank 0's, used at 1) goes first; then the one used at 2.
        assert!(!s.take_evicted(&key));
        assert_eq!(s.evict_to(400), 1);
        assert!(s.take_own(&key).is_none(), "its own entry went with it");
        // Remembered as evicted by the budget, once; a new own lineage clears the mark.
        assert!(s.take_evicted(&key));
        assert!(!s.take_evicted(&key));
        s.put(0, lineage(44, 9), Some(key));
        assert_eq!(s.evict_to(400), 1);
        s.put(0, lineage(55, 10), Some(key));
        assert!(!s.take_evicted(&key), "has a lineage again");
        s.take_own(&key).unwrap();
        // Left (1, 33) used at 3 and (0, 44), which the move to (0, 55) left behind, at 9.
        assert_eq!(s.evict_to(200), 1);
        assert!(s.take(0, 44).is_some());
        assert_eq!(s.len(), 0);
    }
}
