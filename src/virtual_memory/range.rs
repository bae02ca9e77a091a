//! A reserved range of virtual addresses with nothing behind it yet.

use std::ptr::NonNull;

use super::{granularity, sys};
use crate::api::{GranuleMap, MemoryError};

/// A reserved range of virtual addresses with nothing behind it yet (`PROT_NONE`,
/// `MAP_NORESERVE`). Touching it faults until something is mapped there. Dropping it unmaps
/// the whole range, whatever was mapped into it.
#[derive(Debug)]
pub struct VirtualRange {
    base: NonNull<u8>,
    len: u64,
}

// SAFETY: the range is plain address space owned by this value; the pointer is never
// dereferenced through `VirtualRange`, so moving or sharing it across threads is sound.
unsafe impl Send for VirtualRange {}
// SAFETY: as above; `&VirtualRange` only exposes the address and length.
unsafe impl Sync for VirtualRange {}

impl VirtualRange {
    /// Reserves `len` bytes, a non-zero multiple of [`granularity()`].
    pub fn reserve(len: u64) -> Result<Self, MemoryError> {
        GranuleMap::validate_len(len, granularity())?;
        let base = sys::reserve(len as usize)?;
        Ok(VirtualRange { base, len })
    }

    /// The first address of the range.
    pub fn addr(&self) -> u64 {
        self.base.as_ptr() as usize as u64
    }

    /// The range's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: a reservation is at least one granule.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Drop for VirtualRange {
    fn drop(&mut self) {
        // SAFETY: this value owns the whole range, and every borrow of memory inside it is tied
        // to the owner of this value, which is being dropped.
        let result = unsafe { sys::unmap(self.addr(), self.len) };
        debug_assert!(result.is_ok(), "munmap of a reservation failed: {result:?}");
    }
}
