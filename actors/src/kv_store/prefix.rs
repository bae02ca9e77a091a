//! Shared prompt blocks: each whole prompt block is made once and mapped read-only by every
//! sequence whose prompt starts the same way. A block keeps an explicit count of the
//! sequences that map it (its sharers), kept by [`Mapped`]: one is taken where a sequence
//! shares the block and given back where it releases it. Eviction (`eviction.rs`) decides
//! what may go from these counts.
//!
//! Here too the store's work on blocks at an open: making fresh ones from the open's charge,
//! mapping found and fresh ones at the start of a sequence, putting fresh ones in the cache
//! under the keys the sequence claimed, asking the tier below which it holds; and the digest
//! of whole blocks a router reads.

use std::ops::Deref;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use procmem::kv::{BlockState, Filling, Incarnation, KvPart, KvSequence, KvShape, PrefixDigest};
use procmem::{MapAccess, MemoryError, PhysicalBlock, SharedMapping};

use super::{KvStoreError, KvStoreState};
use crate::charge::Charge;

/// A whole prompt block with what names it to a tier below: its key, its parent's key and
/// its tokens (checked against the tier's copy), and its memory. A copy in fills `block`
/// from the tier; a flush at stop writes it there.
pub(super) struct KeyedBlock {
    pub(super) key: u64,
    pub(super) parent: u64,
    pub(super) tokens: Vec<u32>,
    pub(super) block: Arc<SharedPrefix>,
}

/// One whole prompt block, shared by every sequence whose prompt starts the same way. Its
/// lease bytes go back only when the last sequence mapping it has been freed.
pub(super) struct SharedPrefix {
    pub(super) blocks: Vec<PhysicalBlock>,
    pub(super) bytes: u64,
    /// How many sequences map it (each through a [`Mapped`]).
    sharers: AtomicUsize,
    /// Released as it drops, after the blocks (see `Drop`).
    _charge: Charge,
}

impl SharedPrefix {
    /// A new block, mapped by nobody yet, paid for by `charge`.
    pub(super) fn new(blocks: Vec<PhysicalBlock>, bytes: u64, charge: Charge) -> Self {
        SharedPrefix {
            blocks,
            bytes,
            sharers: AtomicUsize::new(0),
            _charge: charge,
        }
    }

    /// A new block of `shape`: a physical block per buffer, of that buffer's block bytes on
    /// `granularity` (K and V may differ), made by `mapping`, mapped by nobody yet, paid for
    /// by `charge` (released if making fails).
    pub(super) fn create(
        mapping: &dyn SharedMapping,
        shape: &KvShape,
        granularity: u64,
        charge: Charge,
    ) -> Result<Self, MemoryError> {
        let blocks = (0..shape.buffers())
            .map(|b| mapping.create_block(shape.block_bytes(KvPart::of_buffer(b), granularity)))
            .collect::<Result<_, _>>()?;
        Ok(Self::new(
            blocks,
            shape.block_bytes_all(granularity),
            charge,
        ))
    }

    /// How many sequences map it now (an open holding it to map it included).
    pub(super) fn sharers(&self) -> usize {
        self.sharers.load(Ordering::Acquire)
    }
}

impl Drop for SharedPrefix {
    fn drop(&mut self) {
        // The blocks go first; the charge (a field) drops after this, once they are freed.
        self.blocks.clear();
    }
}

/// One sequence's share of a block: counted among its sharers while it lives.
pub(super) struct Mapped(Arc<SharedPrefix>);

impl Mapped {
    /// Shares `block`: one more sharer.
    pub(super) fn new(block: Arc<SharedPrefix>) -> Self {
        block.sharers.fetch_add(1, Ordering::AcqRel);
        Mapped(block)
    }
}

impl Deref for Mapped {
    type Target = SharedPrefix;

    fn deref(&self) -> &SharedPrefix {
        &self.0
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // Released: one sharer less (the block itself goes with its last reference).
        self.0.sharers.fetch_sub(1, Ordering::AcqRel);
    }
}

impl KvStoreState {
    /// The keys of the whole prompt blocks it holds, in memory and on disk.
    pub(super) fn prefix_digest(&self) -> PrefixDigest {
        let g = self.device.granularity();
        let mut digest = PrefixDigest::new(self.config.shape.block_tokens(g));
        let complete = self.prefixes.states();
        let in_memory = complete
            .filter(|(_, s)| *s == BlockState::Complete)
            .map(|(k, _)| k);
        match &self.tier {
            Some(tier) => tier.digest_into(&mut digest, in_memory),
            None => in_memory.for_each(|key| digest.insert(key)),
        }
        digest
    }

    /// Puts the fresh blocks in the cache under the keys `writer` claimed: the first
    /// `from_disk` come from the disk (returned for the copy in, complete once it is seen to
    /// have filled them: `copy_in.rs`), the rest the sequence writes (returned with the token
    /// count, past the `hits` blocks found, that completes each).
    pub(super) fn fill_claims(
        &mut self,
        writer: Incarnation,
        keys: &[u64],
        fresh: Vec<Arc<SharedPrefix>>,
        (hits, from_disk): (usize, usize),
    ) -> (Vec<Filling>, Vec<KeyedBlock>) {
        let bt = self.config.shape.block_tokens(self.device.granularity());
        let mut filling = Vec::with_capacity(fresh.len());
        let mut incoming = Vec::with_capacity(from_disk);
        for (i, (key, prefix)) in keys.iter().zip(fresh).enumerate() {
            // Claimed at open by this writer, and only it fills a claim.
            if self
                .prefixes
                .fill(*key, writer, Arc::clone(&prefix))
                .is_err()
            {
                continue;
            }
            let prompt = self.prefixes.prompt_of(*key);
            match prompt.filter(|_| i < from_disk && incoming.len() == i) {
                Some((parent, tokens)) => incoming.push(KeyedBlock {
                    key: *key,
                    parent,
                    tokens: tokens.to_vec(),
                    block: prefix,
                }),
                None => filling.push(Filling {
                    key: *key,
                    end: (hits + i + 1) * bt,
                }),
            }
        }
        (filling, incoming)
    }

    /// Counts the prompt's blocks with the disk tier's filter, and says how many of the
    /// claimed blocks, from the first, it holds (none without a tier).
    pub(super) fn ask_tier(&mut self, hits: &[(u64, Mapped)], claimed: &[u64]) -> usize {
        let Some(tier) = self.tier.as_mut() else {
            return 0;
        };
        for key in hits.iter().map(|(k, _)| *k).chain(claimed.iter().copied()) {
            tier.record(key);
        }
        tier.leading(claimed)
    }

    /// Makes `count` new shared prompt blocks, each paid for by its part of `charge` (the
    /// open committed exactly one block's bytes per new key). On failure the blocks made so
    /// far (never written, so never resident) are dropped and their charges released as they
    /// go; what was not used stays in `charge`.
    pub(super) fn make_blocks(
        &self,
        count: usize,
        charge: &mut Charge,
    ) -> Result<Vec<Arc<SharedPrefix>>, KvStoreError> {
        let shape = self.config.shape;
        let g = self.device.granularity();
        let mapping: &dyn SharedMapping = self.device.shared.as_ref();
        let block_bytes = shape.block_bytes_all(g);
        let mut fresh = Vec::with_capacity(count);
        for _ in 0..count {
            let charge = charge.split(block_bytes).unwrap_or_default();
            let block = SharedPrefix::create(mapping, &shape, g, charge)?;
            fresh.push(Arc::new(block));
        }
        Ok(fresh)
    }

    /// Maps the cached blocks found (read-only) and the fresh ones this sequence writes
    /// (read-write) at the start of its memory. Returns every block it maps, and the fresh.
    pub(super) fn attach_prefixes(
        &self,
        memory: &mut KvSequence,
        hits: Vec<(u64, Mapped)>,
        fresh: Vec<Arc<SharedPrefix>>,
        cached: usize,
    ) -> Result<(Vec<Mapped>, Vec<Arc<SharedPrefix>>), KvStoreError> {
        let bt = self.config.shape.block_tokens(self.device.granularity());
        let hit_count = hits.len();
        let mut used: Vec<Mapped> = Vec::with_capacity(hit_count + fresh.len());
        used.extend(hits.into_iter().map(|(_, prefix)| prefix));
        let access: Vec<MapAccess> = std::iter::repeat_n(MapAccess::ReadOnly, used.len())
            .chain(std::iter::repeat_n(MapAccess::ReadWrite, fresh.len()))
            .collect();
        used.extend(fresh.iter().cloned().map(Mapped::new));
        if !used.is_empty() {
            let blocks: Vec<PhysicalBlock> =
                used.iter().flat_map(|p| p.blocks.iter().cloned()).collect();
            let mapping: &dyn SharedMapping = self.device.shared.as_ref();
            memory.attach_prefix(mapping, &blocks, &access, cached * bt)?;
        }
        Ok((used, fresh))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sharers_are_counted_where_shared_and_released() {
        let block = Arc::new(SharedPrefix::new(Vec::new(), 64, Charge::default()));
        assert_eq!(block.sharers(), 0);
        let a = Mapped::new(Arc::clone(&block));
        let b = Mapped::new(Arc::clone(&block));
        assert_eq!(block.sharers(), 2);
        assert_eq!(a.bytes, 64);
        drop(a);
        assert_eq!(block.sharers(), 1);
        // Moving a share (as a step lends it) changes nothing.
        let moved = vec![b];
        assert_eq!(block.sharers(), 1);
        drop(moved);
        assert_eq!(block.sharers(), 0);
    }
}
