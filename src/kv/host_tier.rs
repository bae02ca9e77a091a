//! The index of a host tier below KV on a device: which prompt blocks it holds, each in a
//! slot of one fixed arena of host memory, and which goes first when a new block needs a slot
//! (the least recently used). It holds no bytes itself: the copies into and out of the slots
//! run on the store's stream, whose order keeps a slot's reuse after the copies that read it.

use std::collections::{BTreeMap, HashMap};

/// One block held: its slot, what a hit must match, and when it was last used.
#[derive(Debug)]
struct Entry {
    slot: usize,
    parent: u64,
    tokens: Vec<u32>,
    used: u64,
}

/// Which block is in which slot of a host tier of `slots` slots; the least recently used is
/// found without a scan.
#[derive(Debug)]
pub struct HostTierIndex {
    slots: usize,
    free: Vec<usize>,
    entries: HashMap<u64, Entry>,
    /// Every key held, by when it was last used: the first is the least recently used.
    by_use: BTreeMap<u64, u64>,
    clock: u64,
}

impl HostTierIndex {
    /// An empty tier of `slots` slots.
    pub fn new(slots: usize) -> Self {
        HostTierIndex {
            slots,
            free: (0..slots).rev().collect(),
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Its slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds no block.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether it holds block `key`.
    pub fn contains(&self, key: u64) -> bool {
        self.entries.contains_key(&key)
    }

    /// The keys held, in no order.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.entries.keys().copied()
    }

    /// The block a new one would push out: none while a slot is free, else the least
    /// recently used.
    pub fn victim(&self) -> Option<u64> {
        if !self.free.is_empty() {
            return None;
        }
        self.by_use.first_key_value().map(|(_, key)| *key)
    }

    /// Takes a slot for block `key` (whose parent and tokens a hit must match): a free one,
    /// else the least recently used block's, which leaves. Returns the slot and the block
    /// pushed out; `None` where the key is held already or there are no slots.
    pub fn insert(
        &mut self,
        key: u64,
        parent: u64,
        tokens: &[u32],
    ) -> Option<(usize, Option<u64>)> {
        if self.contains(key) || self.slots == 0 {
            return None;
        }
        let pushed = self.victim();
        let slot = match pushed {
            Some(old) => {
                let e = self.entries.remove(&old).expect("the victim is held");
                self.by_use.remove(&e.used);
                e.slot
            }
            None => self
                .free
                .pop()
                .expect("a free slot, as no victim was needed"),
        };
        self.clock += 1;
        self.by_use.insert(self.clock, key);
        let entry = Entry {
            slot,
            parent,
            tokens: tokens.to_vec(),
            used: self.clock,
        };
        self.entries.insert(key, entry);
        Some((slot, pushed))
    }

    /// The slot of block `key` where it is held under this parent with these tokens (a
    /// hit: it is the most recently used from now on). A key held with other tokens (a hash
    /// collision) is a miss.
    pub fn get(&mut self, key: u64, parent: u64, tokens: &[u32]) -> Option<usize> {
        self.clock += 1;
        let e = self.entries.get_mut(&key)?;
        if e.parent != parent || e.tokens != tokens {
            return None;
        }
        self.by_use.remove(&e.used);
        e.used = self.clock;
        self.by_use.insert(e.used, key);
        Some(e.slot)
    }

    /// Lets block `key` go (its slot is free again); whether it was held.
    pub fn remove(&mut self, key: u64) -> bool {
        match self.entries.remove(&key) {
            Some(e) => {
                self.by_use.remove(&e.used);
                self.free.push(e.slot);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_tier_pushes_out_the_least_recently_used_and_reuses_its_slot() {
        let mut t = HostTierIndex::new(2);
        let (a, none) = t.insert(1, 0, &[1, 2]).unwrap();
        assert_eq!(none, None);
        let (b, _) = t.insert(2, 1, &[3, 4]).unwrap();
        assert_ne!(a, b);
        assert_eq!(t.victim(), Some(1));
        // A hit on 1 makes 2 the least recently used.
        assert_eq!(t.get(1, 0, &[1, 2]), Some(a));
        assert_eq!(t.insert(3, 2, &[5, 6]), Some((b, Some(2))));
        assert!(!t.contains(2));
        assert_eq!(t.len(), 2);
        assert_eq!(t.insert(3, 2, &[5, 6]), None, "held already");
    }

    #[test]
    fn a_hit_must_match_parent_and_tokens_and_a_removed_slot_is_free_again() {
        let mut t = HostTierIndex::new(1);
        let (slot, _) = t.insert(7, 9, &[1]).unwrap();
        assert_eq!(t.get(7, 8, &[1]), None, "another parent");
        assert_eq!(t.get(7, 9, &[2]), None, "other tokens");
        assert_eq!(t.get(7, 9, &[1]), Some(slot));
        assert!(t.remove(7));
        assert!(!t.remove(7));
        assert_eq!(t.victim(), None);
        assert_eq!(t.insert(8, 0, &[]), Some((slot, None)));
        assert_eq!(HostTierIndex::new(0).insert(1, 0, &[]), None, "no slots");
    }
}
