//! A buffer that grows without moving.

use std::ops::Range;
use std::sync::Arc;

use super::host_access::{range_bytes, range_bytes_mut};
use crate::api::capabilities::copy_span;
use crate::api::{
    CommitResult, DecommitResult, MapAccess, MemoryError, MemoryRole, PhysicalBlock, PlaceKind,
    SharedMapping, VirtualAllocation, VirtualBacking, VirtualRequest,
};

/// Memory mapped at the end of a [`VirtualBuffer`] but not yet part of its length: publish it
/// (readers then see it) or unmap it. Two phases let a caller map first and pay after, or
/// map several buffers and publish all or none.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "publish or unmap a mapped tail"]
pub struct MappedTail {
    from: u64,
    to: u64,
}

impl MappedTail {
    /// Bytes mapped.
    pub fn bytes(&self) -> u64 {
        self.to - self.from
    }
}

/// A buffer whose base address never moves: the whole capacity is reserved up front and
/// whole granules of physical memory are mapped in at the end as it grows, or taken out at
/// the end as it shrinks. A failed grow leaves no partial mapping and the old length intact.
pub struct VirtualBuffer {
    backing: Arc<dyn VirtualBacking>,
    allocation: VirtualAllocation,
    len: u64,
}

impl VirtualBuffer {
    /// Reserves `capacity` bytes (rounded up to the backing's granularity) with nothing behind them.
    pub fn new(
        backing: Arc<dyn VirtualBacking>,
        capacity: u64,
        role: MemoryRole,
    ) -> Result<Self, MemoryError> {
        let bytes = round_up(capacity, backing.granularity())?;
        let allocation = backing.reserve(&VirtualRequest { bytes, role })?;
        Ok(VirtualBuffer {
            backing,
            allocation,
            len: 0,
        })
    }

    /// The base address: the same for the buffer's whole life.
    pub fn addr(&self) -> u64 {
        self.allocation.addr()
    }

    /// Bytes currently backed, from the start.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True while nothing is backed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Reserved bytes: the most it can grow to.
    pub fn capacity(&self) -> u64 {
        self.allocation.len()
    }

    /// The mapping granularity; growth and shrinkage are multiples of it.
    pub fn granularity(&self) -> u64 {
        self.allocation.granularity()
    }

    /// The reservation behind the buffer.
    pub fn allocation(&self) -> &VirtualAllocation {
        &self.allocation
    }

    /// Maps `bytes` (a whole number of granules) more at the end.
    pub fn grow(&mut self, bytes: u64) -> Result<CommitResult, MemoryError> {
        let end = self.end_after(bytes)?;
        let result = self
            .backing
            .commit_range(&mut self.allocation, self.len..end)?;
        self.len = end;
        Ok(result)
    }

    fn end_after(&self, bytes: u64) -> Result<u64, MemoryError> {
        self.len
            .checked_add(bytes)
            .ok_or(MemoryError::SizeOverflow {
                what: "buffer length + growth",
            })
    }

    /// Maps `bytes` (a whole number of granules) at the end without changing the length: the
    /// first phase of a growth. A failure leaves nothing mapped.
    pub fn map_tail(&mut self, bytes: u64) -> Result<MappedTail, MemoryError> {
        let end = self.end_after(bytes)?;
        self.backing
            .commit_range(&mut self.allocation, self.len..end)?;
        Ok(MappedTail {
            from: self.len,
            to: end,
        })
    }

    /// Makes a mapped tail part of the buffer.
    pub fn publish(&mut self, tail: MappedTail) {
        debug_assert_eq!(tail.from, self.len, "tails publish in order");
        self.len = tail.to;
    }

    /// Unmaps a tail that will not be published.
    pub fn unmap_tail(&mut self, tail: MappedTail) -> Result<DecommitResult, MemoryError> {
        self.backing
            .decommit_range(&mut self.allocation, tail.from..tail.to)
    }

    /// Maps a shared block at the end with `access`; the length grows by the block's size.
    pub fn append_shared(
        &mut self,
        mapping: &dyn SharedMapping,
        block: &PhysicalBlock,
        access: MapAccess,
    ) -> Result<(), MemoryError> {
        let end = self.end_after(block.bytes())?;
        mapping.map_block(&mut self.allocation, self.len, block, access)?;
        self.len = end;
        Ok(())
    }

    /// Replaces the shared block mapped over `range` with private memory holding the same
    /// bytes (host buffers): copy on write. Returns the private bytes it took.
    pub fn privatize(&mut self, range: Range<u64>) -> Result<u64, MemoryError> {
        self.require_host()?;
        let saved = range_bytes(&self.allocation, range.clone())?.to_vec();
        self.backing
            .decommit_range(&mut self.allocation, range.clone())?;
        self.backing
            .commit_range(&mut self.allocation, range.clone())?;
        range_bytes_mut(&mut self.allocation, range.clone())?.copy_from_slice(&saved);
        Ok(range.end - range.start)
    }

    /// Bytes `range` of a host buffer (within its length).
    pub fn bytes(&self, range: Range<u64>) -> Result<&[u8], MemoryError> {
        self.check_within(&range)?;
        range_bytes(&self.allocation, range)
    }

    /// Bytes `range` of a host buffer, writable: refused where a shared block is mapped
    /// read-only.
    pub fn bytes_mut(&mut self, range: Range<u64>) -> Result<&mut [u8], MemoryError> {
        self.check_within(&range)?;
        range_bytes_mut(&mut self.allocation, range)
    }

    /// Copies bytes `offset..offset + dst.len()` (within its length) into `dst`, wherever it
    /// lives (a device-to-host copy on a GPU); returns once they are there.
    pub fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        self.check_within(&copy_span(offset, dst.len())?)?;
        self.backing.read_range(&self.allocation, offset, dst)
    }

    /// Copies `src` to bytes `offset..offset + src.len()` (within its length, writable),
    /// wherever it lives (a host-to-device copy on a GPU); returns once it is there.
    pub fn write_from(&mut self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        self.check_within(&copy_span(offset, src.len())?)?;
        self.backing.write_range(&mut self.allocation, offset, src)
    }

    fn check_within(&self, range: &Range<u64>) -> Result<(), MemoryError> {
        if range.start > range.end || range.end > self.len {
            return Err(MemoryError::OutOfReservation {
                range: range.clone(),
                reserved: self.len,
            });
        }
        Ok(())
    }

    /// Unmaps `bytes` (a whole number of granules) from the end and returns their physical
    /// memory; the addresses stay reserved for a later grow.
    pub fn shrink(&mut self, bytes: u64) -> Result<DecommitResult, MemoryError> {
        if bytes > self.len {
            return Err(MemoryError::ShrinkBelowZero {
                by: bytes,
                len: self.len,
            });
        }
        let start = self.len - bytes;
        let result = self
            .backing
            .decommit_range(&mut self.allocation, start..self.len)?;
        self.len = start;
        Ok(result)
    }

    /// Physical bytes behind the buffer as the OS reports them.
    pub fn resident_bytes(&self) -> Result<u64, MemoryError> {
        self.backing.committed_bytes(&self.allocation)
    }

    fn require_host(&self) -> Result<(), MemoryError> {
        match self.allocation.place().kind {
            PlaceKind::Host => Ok(()),
            _ => Err(MemoryError::Unsupported {
                capability: "host access to a virtual buffer",
                reason: "the buffer lives in device memory",
            }),
        }
    }

    /// The backed bytes, for a host buffer.
    pub fn as_slice(&self) -> Result<&[u8], MemoryError> {
        self.require_host()?;
        range_bytes(&self.allocation, 0..self.len)
    }

    /// The backed bytes, writable, for a host buffer (refused if a shared block is mapped
    /// read-only in it).
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], MemoryError> {
        self.require_host()?;
        range_bytes_mut(&mut self.allocation, 0..self.len)
    }
}

impl std::fmt::Debug for VirtualBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtualBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .finish()
    }
}

/// `bytes` rounded up to a whole number of `granularity`-sized granules (zero is refused).
pub fn round_up(bytes: u64, granularity: u64) -> Result<u64, MemoryError> {
    if bytes == 0 {
        return Err(MemoryError::ZeroSize { what: "capacity" });
    }
    bytes
        .checked_next_multiple_of(granularity)
        .ok_or(MemoryError::SizeOverflow {
            what: "rounding up to the granularity",
        })
}
