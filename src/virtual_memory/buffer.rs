//! A buffer that grows without moving.

use std::sync::Arc;

use super::sys;
use crate::api::{
    CommitResult, DecommitResult, DeviceKind, MemoryError, MemoryRole, VirtualAllocation,
    VirtualBacking, VirtualRequest,
};

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
        let end = self
            .len
            .checked_add(bytes)
            .ok_or(MemoryError::SizeOverflow {
                what: "buffer length + growth",
            })?;
        let result = self
            .backing
            .commit_range(&mut self.allocation, self.len..end)?;
        self.len = end;
        Ok(result)
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
        match self.allocation.device().kind {
            DeviceKind::Host => Ok(()),
            _ => Err(MemoryError::Unsupported {
                capability: "host access to a virtual buffer",
                reason: "the buffer lives in device memory",
            }),
        }
    }

    /// The backed bytes, for a host buffer.
    pub fn as_slice(&self) -> Result<&[u8], MemoryError> {
        self.require_host()?;
        // SAFETY: on the host, `0..len` is committed read-write (the buffer only ever commits
        // exclusive read-write memory) and stays so while `&self` lives: changing the mapping
        // takes `&mut self`.
        Ok(unsafe { sys::slice(self.addr(), self.len) })
    }

    /// The backed bytes, writable, for a host buffer.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], MemoryError> {
        self.require_host()?;
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        Ok(unsafe { sys::slice_mut(self.addr(), self.len) })
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
