//! The prefix cache's rules, pure: which whole prompt blocks a new sequence may map, which it
//! must write, and when a block is complete.
//!
//! A prompt is cut into whole blocks; each block is keyed by a hash chained over the blocks
//! before it. A block is shared only once complete (its writer has written all its tokens).
//! A hit compares the block's tokens and its parent's key, never the hash alone, so a
//! collision (or a crafted prompt) is a miss, not another prompt's K/V. A block a sequence will
//! write is *claimed* for that writer when it is looked up, before any memory exists, so two
//! opens of one prompt whose grants are both pending cannot both create it: the second stops
//! sharing at the claimed block. Only the claiming writer fills and completes its block; a
//! writer that goes away takes its unfinished blocks out of the cache.

use std::collections::HashMap;

/// Who writes a block: one incarnation of a sequence (never reused, unlike sequence ids).
pub type Incarnation = u64;

/// The hash of a block given its parent's: FNV-1a over the parent's hash and the block's
/// token ids.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ parent.rotate_left(17);
    for t in tokens {
        for b in t.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Where a cached block is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    /// Claimed by `writer`, whose memory for it does not exist yet.
    Claimed {
        /// The writer.
        writer: Incarnation,
    },
    /// Its memory exists and `writer` is writing its tokens.
    Filling {
        /// The writer.
        writer: Incarnation,
    },
    /// Written: any sequence with the same prompt prefix may map it.
    Complete,
}

#[derive(Debug, Clone)]
struct Entry<B> {
    tokens: Vec<u32>,
    parent: u64,
    state: BlockState,
    block: Option<B>,
    last_used: u64,
    /// Times a sequence mapped it again (a lookup's hit, a restore's `get`), aged.
    hits: u32,
}

/// A block's hit count saturates here (4 bits, as TinyLFU's counters).
const MAX_HITS: u32 = 15;

/// What a lookup found for a prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup<B> {
    /// Complete blocks the sequence maps, in prompt order.
    pub hits: Vec<(u64, B)>,
    /// Keys of the blocks now claimed for the sequence to write, in prompt order, after the
    /// hits.
    pub claimed: Vec<u64>,
}

/// The prefix cache of one store. `B` is the store's handle to a block's memory.
#[derive(Debug, Clone)]
pub struct PrefixCache<B> {
    entries: HashMap<u64, Entry<B>>,
    hash: fn(u64, &[u32]) -> u64,
    /// Hits since every count was last halved.
    since_aging: u64,
}

impl<B> Default for PrefixCache<B> {
    fn default() -> Self {
        PrefixCache {
            entries: HashMap::new(),
            hash: chain_hash,
            since_aging: 0,
        }
    }
}

impl<B: Clone> PrefixCache<B> {
    /// A cache keyed by `hash` (tests force collisions with a weak one).
    pub fn with_hash(hash: fn(u64, &[u32]) -> u64) -> Self {
        PrefixCache {
            entries: HashMap::new(),
            hash,
            since_aging: 0,
        }
    }

    /// Counts a hit of the block under `key`; after as many hits as the cache holds entries
    /// (at least 64) every count is halved, so what was hot long ago cools.
    fn hit(&mut self, key: u64) {
        if let Some(e) = self.entries.get_mut(&key) {
            e.hits = (e.hits + 1).min(MAX_HITS);
        }
        self.since_aging += 1;
        if self.since_aging >= (self.entries.len() as u64).max(64) {
            self.since_aging = 0;
            for e in self.entries.values_mut() {
                e.hits /= 2;
            }
        }
    }

    /// How often sequences mapped the block under `key` again since it was written, aged (0
    /// for a key the cache does not hold).
    pub fn hits(&self, key: u64) -> u32 {
        self.entries.get(&key).map_or(0, |e| e.hits)
    }

    /// Looks `prompt` up (whole blocks of `block_tokens`): the leading complete blocks whose
    /// tokens match are hits; the blocks after them that nobody has are claimed for `writer`,
    /// up to the first block someone else has (complete with other tokens, or being written).
    /// Nothing is claimed for a zero block size.
    pub fn lookup(
        &mut self,
        prompt: &[u32],
        block_tokens: usize,
        writer: Incarnation,
        now: u64,
    ) -> Lookup<B> {
        let mut found = Lookup {
            hits: Vec::new(),
            claimed: Vec::new(),
        };
        if block_tokens == 0 {
            return found;
        }
        let mut parent = 0u64;
        let mut sharing = true;
        for tokens in prompt.chunks_exact(block_tokens) {
            let key = (self.hash)(parent, tokens);
            match self.entries.get_mut(&key) {
                Some(e) if sharing && e.state == BlockState::Complete => {
                    if e.tokens != tokens || e.parent != parent {
                        break;
                    }
                    e.last_used = now;
                    let Some(block) = e.block.clone() else { break };
                    found.hits.push((key, block));
                    self.hit(key);
                }
                // Someone else's block (being written, or another prompt's under this key):
                // share nothing from here on and claim nothing.
                Some(_) => break,
                None => {
                    sharing = false;
                    self.entries.insert(
                        key,
                        Entry {
                            tokens: tokens.to_vec(),
                            parent,
                            state: BlockState::Claimed { writer },
                            block: None,
                            last_used: now,
                            hits: 0,
                        },
                    );
                    found.claimed.push(key);
                }
            }
            parent = key;
        }
        found
    }

    /// The complete block under `key` if it holds `tokens` after the block under `parent`
    /// (0 for a prompt's first), as a lookup compares them (a key alone may collide); marked
    /// used at `now` (a sequence maps it again).
    pub fn get(&mut self, key: u64, parent: u64, tokens: &[u32], now: u64) -> Option<B> {
        let e = self.entries.get_mut(&key)?;
        if e.state != BlockState::Complete || e.parent != parent || e.tokens != tokens {
            return None;
        }
        e.last_used = now;
        let block = e.block.clone();
        self.hit(key);
        block
    }

    /// Gives a block claimed by `writer` its memory. Refused (the block is handed back) if the
    /// key is not claimed by `writer`.
    pub fn fill(&mut self, key: u64, writer: Incarnation, block: B) -> Result<(), B> {
        match self.entries.get_mut(&key) {
            Some(e) if e.state == (BlockState::Claimed { writer }) => {
                e.state = BlockState::Filling { writer };
                e.block = Some(block);
                Ok(())
            }
            _ => Err(block),
        }
    }

    /// `writer` has written every token of the block under `key`: it becomes shareable. Only
    /// the writer that filled it can complete it; anything else changes nothing (`false`).
    pub fn complete(&mut self, key: u64, writer: Incarnation) -> bool {
        match self.entries.get_mut(&key) {
            Some(e) if e.state == (BlockState::Filling { writer }) => {
                e.state = BlockState::Complete;
                true
            }
            _ => false,
        }
    }

    /// `writer` is gone (closed, preempted, or its open failed): its claims and the blocks it
    /// had not finished leave the cache. Returns the blocks removed.
    pub fn abandon(&mut self, writer: Incarnation) -> Vec<B> {
        let keys: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| match e.state {
                BlockState::Claimed { writer: w } | BlockState::Filling { writer: w } => {
                    w == writer
                }
                BlockState::Complete => false,
            })
            .map(|(k, _)| *k)
            .collect();
        keys.into_iter()
            .filter_map(|k| self.entries.remove(&k).and_then(|e| e.block))
            .collect()
    }

    /// Drops a block from the cache (an eviction); sequences mapping it keep their mapping.
    pub fn remove(&mut self, key: u64) -> Option<B> {
        self.entries.remove(&key).and_then(|e| e.block)
    }

    /// The parent key and tokens of the block under `key` (what a tier below keys it by).
    pub fn prompt_of(&self, key: u64) -> Option<(u64, &[u32])> {
        self.entries
            .get(&key)
            .map(|e| (e.parent, e.tokens.as_slice()))
    }

    /// The state of the block under `key`.
    pub fn state(&self, key: u64) -> Option<BlockState> {
        self.entries.get(&key).map(|e| e.state)
    }

    /// Blocks with memory: (key, block, last used, state).
    pub fn blocks(&self) -> impl Iterator<Item = (u64, &B, u64, BlockState)> + '_ {
        self.entries
            .iter()
            .filter_map(|(k, e)| e.block.as_ref().map(|b| (*k, b, e.last_used, e.state)))
    }

    /// Every entry's state, claims included.
    pub fn states(&self) -> impl Iterator<Item = (u64, BlockState)> + '_ {
        self.entries.iter().map(|(k, e)| (*k, e.state))
    }

    /// Entries, claims included.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is cached or claimed.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BT: usize = 4;

    fn prompt(blocks: usize, salt: u32) -> Vec<u32> {
        (0..(blocks * BT) as u32).map(|t| t * 7 + salt).collect()
    }

    /// Each sequence that maps a block again counts a hit (a lookup's or a restore's); every
    /// count is halved after as many hits as the cache holds entries (at least 64), and a
    /// count saturates at 15.
    #[test]
    fn hits_count_who_maps_a_block_again_and_age() {
        let mut c: PrefixCache<u32> = PrefixCache::default();
        let system = prompt(2, 1);
        let found = c.lookup(&system, BT, 1, 0);
        for (i, key) in found.claimed.iter().enumerate() {
            c.fill(*key, 1, i as u32).unwrap();
            assert!(c.complete(*key, 1));
        }
        let (first, second) = (found.claimed[0], found.claimed[1]);
        assert_eq!(
            (c.hits(first), c.hits(second)),
            (0, 0),
            "its writer is no hit"
        );
        for writer in 2..5 {
            assert_eq!(c.lookup(&system, BT, writer, writer).hits.len(), 2);
        }
        assert_eq!((c.hits(first), c.hits(second)), (3, 3));
        assert!(c.get(second, first, &system[BT..2 * BT], 9).is_some());
        assert_eq!(c.hits(second), 4);
        assert_eq!(c.hits(12345), 0);
        // Hits up to the aging point saturate at 15, then everything is halved.
        for _ in 0..(64 - 7) {
            c.get(first, 0, &system[..BT], 10);
        }
        assert_eq!((c.hits(first), c.hits(second)), (7, 2), "halved at 64 hits");
    }

    /// Defect (issue 13, 1): two opens of one prompt, both pending, both created the block.
    #[test]
    fn a_block_is_claimed_once_and_only_its_writer_fills_and_completes_it() {
        let mut c: PrefixCache<&str> = PrefixCache::default();
        let p = prompt(2, 0);
        let a = c.lookup(&p, BT, 1, 0);
        assert_eq!((a.hits.len(), a.claimed.len()), (0, 2));
        let b = c.lookup(&p, BT, 2, 1);
        assert_eq!(
            (b.hits.len(), b.claimed.len()),
            (0, 0),
            "claimed by 1: not shared"
        );
        assert_eq!(c.fill(a.claimed[0], 2, "b's"), Err("b's"), "not 2's claim");
        c.fill(a.claimed[0], 1, "a0").unwrap();
        c.fill(a.claimed[1], 1, "a1").unwrap();
        assert!(!c.complete(a.claimed[0], 2), "only the writer completes");
        let during = c.lookup(&p, BT, 3, 2);
        assert_eq!((during.hits.len(), during.claimed.len()), (0, 0));
        let first = &p[..BT];
        assert_eq!(
            c.get(a.claimed[0], 0, first, 2),
            None,
            "a block being written is not handed out"
        );
        assert!(c.complete(a.claimed[0], 1));
        assert_eq!(c.get(a.claimed[0], 0, first, 2), Some("a0"));
        assert_eq!(c.get(!a.claimed[0], 0, first, 2), None);
        // The key with other tokens, or after another parent, is not that block.
        assert_eq!(c.get(a.claimed[0], 0, &p[BT..], 2), None);
        assert_eq!(c.get(a.claimed[0], 7, first, 2), None);
        let half = c.lookup(&p, BT, 3, 3);
        assert_eq!(half.hits, vec![(a.claimed[0], "a0")]);
        assert!(half.claimed.is_empty(), "the next block is being written");
        assert!(c.complete(a.claimed[1], 1));
        let all = c.lookup(&p, BT, 4, 4);
        assert_eq!(all.hits.len(), 2);
    }

    /// Defect (issue 13, 5): the cache trusted the 64-bit hash; with every block hashing alike
    /// another prompt's block was served.
    #[test]
    fn a_hit_compares_the_tokens_and_the_parent_not_only_the_hash() {
        let mut c: PrefixCache<&str> = PrefixCache::with_hash(|_, _| 42);
        let p = prompt(1, 0);
        let a = c.lookup(&p, BT, 1, 0);
        c.fill(a.claimed[0], 1, "p").unwrap();
        c.complete(a.claimed[0], 1);
        let other = c.lookup(&prompt(1, 1), BT, 2, 1);
        assert!(other.hits.is_empty(), "same hash, other tokens: a miss");
        assert!(other.claimed.is_empty(), "and the key is not taken over");
        assert_eq!(c.lookup(&p, BT, 3, 2).hits, vec![(42, "p")]);
        // The same tokens after another parent are another block too.
        let mut c: PrefixCache<&str> = PrefixCache::with_hash(|parent, _| parent ^ 1);
        let two = [prompt(1, 5), prompt(1, 5)].concat();
        let first = c.lookup(&two, BT, 1, 0);
        assert_eq!(first.claimed, vec![1, 0]);
    }

    #[test]
    fn a_writer_that_goes_away_takes_its_unfinished_blocks_and_claims_with_it() {
        let mut c: PrefixCache<&str> = PrefixCache::default();
        let p = prompt(3, 0);
        let a = c.lookup(&p, BT, 1, 0);
        c.fill(a.claimed[0], 1, "a0").unwrap();
        c.complete(a.claimed[0], 1);
        c.fill(a.claimed[1], 1, "a1").unwrap();
        assert_eq!(c.abandon(1), vec!["a1"]);
        assert_eq!(c.len(), 1, "the complete block stays");
        let again = c.lookup(&p, BT, 2, 1);
        assert_eq!((again.hits.len(), again.claimed.len()), (1, 2));
        assert!(
            c.lookup(&p, 0, 3, 2).claimed.is_empty(),
            "a zero block size claims nothing"
        );
    }
}
