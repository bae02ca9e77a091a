//! What a node tells a router about the prompt blocks it holds, pure: a fixed-size Bloom
//! filter of the blocks' chain keys ([`PrefixDigest`]), and the keys of a prompt
//! ([`prompt_keys`]) a router checks against it.
//!
//! **The choice.** A router wants to send a request where the longest start of its prompt is
//! cached. The exact answer is the set of every block's key, which grows with the cache
//! (thousands of blocks on a disk tier) and would not fit in a frame. A Bloom filter answers
//! "may hold" in a fixed [`PrefixDigest::BYTES`] whatever the cache holds, errs one way only
//! (a block held is always found; a block not held is, rarely, found too), and filters of
//! one model merge by a bitwise or, so a node sums its processes without knowing their keys.
//! A prompt's keys are chained (each hashes its parent's), so a router counts the *leading*
//! keys a filter may hold ([`PrefixDigest::leading`]): a false positive deep in the prompt
//! needs every key before it to be held or falsely found as well.
//!
//! At 16,384 bits and four probes, 1,000 keys give a false positive about one probe in 450,
//! and 3,000 keys about one in 14 (the property test in `tests/kv_digest.rs` checks the bound at 1,000).

use super::prefix::chain_hash;

/// A Bloom filter of prompt-block keys, with the block size the keys were cut with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixDigest {
    block_tokens: u32,
    bits: Vec<u8>,
    blocks: u64,
}

impl PrefixDigest {
    /// The filter's size in bytes.
    pub const BYTES: usize = 2048;
    /// How many bits each key sets.
    pub const PROBES: u32 = 4;
    /// The largest block size a digest describes (a frame naming a larger one is refused).
    pub const MAX_BLOCK_TOKENS: u32 = 1 << 16;

    /// An empty digest for keys cut `block_tokens` tokens at a time (clamped to
    /// 1..=[`Self::MAX_BLOCK_TOKENS`]).
    pub fn new(block_tokens: usize) -> Self {
        let block_tokens = block_tokens.clamp(1, Self::MAX_BLOCK_TOKENS as usize) as u32;
        PrefixDigest {
            block_tokens,
            bits: vec![0; Self::BYTES],
            blocks: 0,
        }
    }

    /// A digest read from a frame: `None` unless `bits` is exactly [`Self::BYTES`] long and
    /// `block_tokens` is in 1..=[`Self::MAX_BLOCK_TOKENS`].
    pub fn from_parts(block_tokens: u32, bits: Vec<u8>, blocks: u64) -> Option<Self> {
        Self::parts_fit(block_tokens, bits.len()).then_some(PrefixDigest {
            block_tokens,
            bits,
            blocks,
        })
    }

    /// Whether a frame's block size and filter length make a digest (what
    /// [`Self::from_parts`] checks, without the filter's bytes).
    pub fn parts_fit(block_tokens: u32, bits_len: usize) -> bool {
        bits_len == Self::BYTES && (1..=Self::MAX_BLOCK_TOKENS).contains(&block_tokens)
    }

    /// The block size its keys were cut with.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens as usize
    }

    /// The filter's bytes (for a frame).
    pub fn bits(&self) -> &[u8] {
        &self.bits
    }

    /// How many keys were put in (summed over merged digests; a key put twice counts twice).
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Puts `key` in.
    pub fn insert(&mut self, key: u64) {
        for bit in probes(key) {
            self.bits[bit / 8] |= 1 << (bit % 8);
        }
        self.blocks = self.blocks.saturating_add(1);
    }

    /// Whether `key` may be held: always true for a key put in, rarely true for another.
    pub fn may_hold(&self, key: u64) -> bool {
        probes(key).all(|bit| self.bits[bit / 8] & (1 << (bit % 8)) != 0)
    }

    /// How many of `keys`, from the first, it may hold: for a prompt's [`prompt_keys`], the
    /// blocks of its start a holder of this digest may have cached.
    pub fn leading(&self, keys: &[u64]) -> usize {
        keys.iter().take_while(|k| self.may_hold(**k)).count()
    }

    /// Adds `other`'s keys. False (and nothing changes) if its keys were cut with another
    /// block size: they could never match the same prompts' keys.
    pub fn merge(&mut self, other: &PrefixDigest) -> bool {
        if other.block_tokens != self.block_tokens {
            return false;
        }
        for (a, b) in self.bits.iter_mut().zip(&other.bits) {
            *a |= *b;
        }
        self.blocks = self.blocks.saturating_add(other.blocks);
        true
    }

    /// The fraction of bits set (the chance a key not held is found is about this to the
    /// fourth).
    pub fn fill(&self) -> f64 {
        let set: u32 = self.bits.iter().map(|b| b.count_ones()).sum();
        f64::from(set) / (Self::BYTES * 8) as f64
    }
}

/// The keys of `prompt`'s whole blocks of `block_tokens`, in order, as a store keys its
/// prefix cache (each chained over the blocks before it). Empty for a zero block size.
pub fn prompt_keys(prompt: &[u32], block_tokens: usize) -> Vec<u64> {
    if block_tokens == 0 {
        return Vec::new();
    }
    let mut parent = 0u64;
    prompt
        .chunks_exact(block_tokens)
        .map(|tokens| {
            parent = chain_hash(parent, tokens);
            parent
        })
        .collect()
}

/// The bits `key` sets: double hashing over two halves of a remix of the key (the keys are
/// FNV hashes already, but a remix keeps keys that differ in few bits apart).
fn probes(key: u64) -> impl Iterator<Item = usize> {
    let mut z = key.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let (h1, h2) = (z as u32, ((z >> 32) as u32) | 1);
    let bits = (PrefixDigest::BYTES * 8) as u32;
    (0..PrefixDigest::PROBES).map(move |i| (h1.wrapping_add(i.wrapping_mul(h2)) % bits) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_keys_are_the_caches_keys() {
        let prompt: Vec<u32> = (0..40).collect();
        let keys = prompt_keys(&prompt, 16);
        assert_eq!(keys.len(), 2, "the last 8 tokens make no whole block");
        assert_eq!(keys[0], chain_hash(0, &prompt[..16]));
        assert_eq!(keys[1], chain_hash(keys[0], &prompt[16..32]));
        assert!(prompt_keys(&prompt, 0).is_empty());
    }

    #[test]
    fn frames_of_the_wrong_size_or_block_are_refused() {
        assert!(PrefixDigest::from_parts(16, vec![0; PrefixDigest::BYTES], 0).is_some());
        assert!(PrefixDigest::from_parts(16, vec![0; PrefixDigest::BYTES - 1], 0).is_none());
        assert!(PrefixDigest::from_parts(0, vec![0; PrefixDigest::BYTES], 0).is_none());
        let big = PrefixDigest::MAX_BLOCK_TOKENS + 1;
        assert!(PrefixDigest::from_parts(big, vec![0; PrefixDigest::BYTES], 0).is_none());
        assert_eq!(PrefixDigest::new(usize::MAX).block_tokens(), 1 << 16);
        assert_eq!(PrefixDigest::new(0).block_tokens(), 1);
    }

    #[test]
    fn digests_of_other_block_sizes_do_not_merge() {
        let mut a = PrefixDigest::new(16);
        let mut b = PrefixDigest::new(32);
        b.insert(7);
        assert!(!a.merge(&b));
        assert!(!a.may_hold(7));
        assert_eq!(a.blocks(), 0);
    }
}
