//! Shared prompt blocks: each whole prompt block is made once and mapped read-only by every
//! sequence whose prompt starts the same way. A block keeps an explicit count of the
//! sequences that map it (its sharers), kept by [`Mapped`]: one is taken where a sequence
//! shares the block and given back where it releases it. The pressure responder decides
//! what may go from these counts.

use std::ops::Deref;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use procmem::{MemoryError, PhysicalBlock, SharedMapping};

use crate::charge::Charge;

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

    /// A new block of `buffers` physical blocks of `per_buffer` bytes each, made by
    /// `mapping`, mapped by nobody yet, paid for by `charge` (released if making fails).
    pub(super) fn create(
        mapping: &dyn SharedMapping,
        buffers: usize,
        per_buffer: u64,
        charge: Charge,
    ) -> Result<Self, MemoryError> {
        let blocks = (0..buffers)
            .map(|_| mapping.create_block(per_buffer))
            .collect::<Result<_, _>>()?;
        Ok(Self::new(blocks, per_buffer * buffers as u64, charge))
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
