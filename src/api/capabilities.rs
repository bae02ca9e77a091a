//! The capability traits. `Allocator` is required of every mechanism; `VirtualBacking`
//! and `SharedMapping` are optional and reached through explicit queries that return `None`
//! where the mechanism cannot do the job. Nothing here has a default body that pretends.

use std::ops::Range;

use super::allocation::{Allocation, AllocationRequest};
use super::error::{FreeError, MemoryError};
use super::ids::{ContextId, MechanismId, Place};
use super::virtual_allocation::{
    CommitResult, DecommitResult, MapAccess, PhysicalBlock, VirtualAllocation, VirtualRequest,
};

/// When an allocator takes physical memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitModel {
    /// Every byte is taken at `allocate`: charge the full footprint before allocating.
    Eager,
    /// Bytes are taken as they are committed later.
    OnDemand,
}

/// Ordinary allocate/free: the one capability every mechanism has.
pub trait Allocator: Send + Sync {
    /// The mechanism this allocator belongs to.
    fn mechanism(&self) -> MechanismId;
    /// Where it allocates.
    fn place(&self) -> Place;
    /// The provider context its allocations belong to.
    fn context(&self) -> ContextId;
    /// When physical memory is taken.
    fn commit_model(&self) -> CommitModel;
    /// The physical bytes `request` would take: what a charge for it must cover.
    fn footprint(&self, request: &AllocationRequest) -> Result<u64, MemoryError>;
    /// Allocates; on success the footprint is physically taken (for an eager allocator).
    fn allocate(&self, request: &AllocationRequest) -> Result<Allocation, MemoryError>;
    /// Frees an allocation this allocator made, returning the bytes freed. An allocation from
    /// another mechanism or context is refused and handed back untouched.
    fn free(&self, allocation: Allocation) -> Result<u64, FreeError>;
    /// Physical bytes of `allocation` present now, as the OS or driver reports them.
    fn resident_bytes(&self, allocation: &Allocation) -> Result<u64, MemoryError>;

    /// Copies bytes `offset..offset + dst.len()` of `allocation` (one of this allocator's)
    /// into `dst`, and returns once they are there. On a device the copy does not wait for
    /// work queued on the allocation's streams: order it after their fences. Unsupported
    /// unless the mechanism provides it (the host and CUDA ones do).
    fn read(
        &self,
        allocation: &Allocation,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), MemoryError> {
        let _ = (allocation, offset, dst);
        Err(MemoryError::Unsupported {
            capability: "copying out of an allocation",
            reason: "this allocator has no copies",
        })
    }

    /// Copies `src` to bytes `offset..offset + src.len()` of `allocation` and returns once it
    /// is there; as [`Allocator::read`] on ordering and support.
    fn write(
        &self,
        allocation: &mut Allocation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), MemoryError> {
        let _ = (allocation, offset, src);
        Err(MemoryError::Unsupported {
            capability: "copying into an allocation",
            reason: "this allocator has no copies",
        })
    }
}

/// The bytes `offset..offset + len` a copy touches, refused where the end overflows.
pub(crate) fn copy_span(offset: u64, len: usize) -> Result<Range<u64>, MemoryError> {
    let end = offset
        .checked_add(len as u64)
        .ok_or(MemoryError::SizeOverflow { what: "copy range" })?;
    Ok(offset..end)
}

/// The byte range `offset..offset + len` of `allocation`, checked to lie within it.
pub(crate) fn copy_range(
    allocation: &Allocation,
    offset: u64,
    len: usize,
) -> Result<std::ops::Range<usize>, MemoryError> {
    let Range { end, .. } = copy_span(offset, len)?;
    if end > allocation.bytes() {
        return Err(MemoryError::OutOfReservation {
            range: offset..end,
            reserved: allocation.bytes(),
        });
    }
    Ok(offset as usize..end as usize)
}

/// Address/backing separation: reserve a range once, then install and remove physical memory
/// behind parts of it. The base address never moves.
pub trait VirtualBacking: Send + Sync {
    /// The mechanism this backing belongs to.
    fn mechanism(&self) -> MechanismId;
    /// Where it maps.
    fn place(&self) -> Place;
    /// Minimum mapping unit in bytes, as the OS or driver reports it.
    fn granularity(&self) -> u64;
    /// Reserves address space with nothing behind it.
    fn reserve(&self, request: &VirtualRequest) -> Result<VirtualAllocation, MemoryError>;
    /// Installs exclusively owned physical memory behind `range` (granule-aligned, all of it
    /// reserved). On error nothing of `range` stays mapped.
    fn commit_range(
        &self,
        allocation: &mut VirtualAllocation,
        range: Range<u64>,
    ) -> Result<CommitResult, MemoryError>;
    /// Removes the backing of `range` (every granule backed; shared blocks whole), keeping the
    /// addresses reserved so nothing else can take them.
    fn decommit_range(
        &self,
        allocation: &mut VirtualAllocation,
        range: Range<u64>,
    ) -> Result<DecommitResult, MemoryError>;
    /// Exclusively committed physical bytes of `allocation`, as the OS or driver reports them.
    fn committed_bytes(&self, allocation: &VirtualAllocation) -> Result<u64, MemoryError>;

    /// Copies bytes `offset..offset + dst.len()` of `allocation` (every granule backed) into
    /// `dst`, and returns once they are there. On a device the copy does not wait for work
    /// queued on other streams: order it after their fences. Unsupported unless the backing
    /// provides it (the host and CUDA ones do).
    fn read_range(
        &self,
        allocation: &VirtualAllocation,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), MemoryError> {
        let _ = (allocation, offset, dst);
        Err(MemoryError::Unsupported {
            capability: "copying out of a reservation",
            reason: "this backing has no copies",
        })
    }

    /// Copies `src` to bytes `offset..offset + src.len()` of `allocation` (every granule
    /// writable), and returns once it is there; as [`VirtualBacking::read_range`] on ordering
    /// and support.
    fn write_range(
        &self,
        allocation: &mut VirtualAllocation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), MemoryError> {
        let _ = (allocation, offset, src);
        Err(MemoryError::Unsupported {
            capability: "copying into a reservation",
            reason: "this backing has no copies",
        })
    }
}

/// One physical block at several addresses: shared prompt prefixes.
pub trait SharedMapping: Send + Sync {
    /// The mechanism this capability belongs to.
    fn mechanism(&self) -> MechanismId;
    /// Creates a physically committed block of `bytes` (a whole number of granules).
    fn create_block(&self, bytes: u64) -> Result<PhysicalBlock, MemoryError>;
    /// Maps `block` into `allocation` at `offset` (granule-aligned, reserved) with `access`.
    /// The mapping holds a reference to the block until it is decommitted or the reservation goes.
    fn map_block(
        &self,
        allocation: &mut VirtualAllocation,
        offset: u64,
        block: &PhysicalBlock,
        access: MapAccess,
    ) -> Result<(), MemoryError>;
    /// Physical bytes of `block` present now, as the OS or driver reports them.
    fn block_resident_bytes(&self, block: &PhysicalBlock) -> Result<u64, MemoryError>;
    /// Bytes privately copied on write inside `allocation` (not part of any block).
    fn private_copy_bytes(&self, allocation: &VirtualAllocation) -> Result<u64, MemoryError>;
    /// Copies `block`'s bytes into `dst` (exactly the block's length), wherever it is mapped
    /// or if it is mapped nowhere: what a tier below needs to keep an evicted block.
    fn read_block(&self, _block: &PhysicalBlock, _dst: &mut [u8]) -> Result<(), MemoryError> {
        Err(MemoryError::Unsupported {
            capability: "block copy",
            reason: "this mechanism copies blocks only through a mapping",
        })
    }
    /// Fills `block` with `src` (exactly the block's length): a block brought back from a tier
    /// below. No mapping of the block may be in use by a kernel meanwhile.
    fn write_block(&self, _block: &PhysicalBlock, _src: &[u8]) -> Result<(), MemoryError> {
        Err(MemoryError::Unsupported {
            capability: "block copy",
            reason: "this mechanism copies blocks only through a mapping",
        })
    }
}

/// A mechanism: one place's allocator plus whatever optional capabilities it really has.
///
/// The queries borrow from the mechanism itself, so they always answer for its current state,
/// never for a snapshot taken earlier.
pub trait MemoryMechanism: Send + Sync {
    /// Its identity; every handle it creates carries it.
    fn id(&self) -> MechanismId;
    /// Where its memory lives.
    fn place(&self) -> Place;
    /// Ordinary allocation (required).
    fn allocator(&self) -> &dyn Allocator;
    /// On-demand mapping, where supported.
    fn virtual_backing(&self) -> Option<&dyn VirtualBacking>;
    /// Shared physical blocks, where supported.
    fn shared_mapping(&self) -> Option<&dyn SharedMapping>;
}
