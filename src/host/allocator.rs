//! The eager host allocator: ordinary anonymous memory, every page taken at allocate time.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::api::capabilities::copy_range;
use crate::api::{
    Allocation, AllocationOrigin, AllocationParts, AllocationRequest, Allocator, CommitModel,
    ContextId, FreeError, MechanismId, MemoryError, Place, PlaceKind, Refused,
};
use crate::virtual_memory::{granularity, sys};

struct Origin {
    drop_errors: Mutex<Vec<MemoryError>>,
    live: Mutex<BTreeMap<u64, u64>>,
}

impl AllocationOrigin for Origin {
    fn release(&self, addr: u64, footprint: u64) -> Result<u64, MemoryError> {
        // Held across the unmap so `resident_total` never asks about a range mid-release.
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: only `Allocation` calls this, once, for the range `allocate` mapped;
        // the handle is being consumed, so no borrow of its bytes remains.
        unsafe { sys::unmap(addr, footprint)? };
        live.remove(&addr);
        Ok(footprint)
    }

    fn record_drop_error(&self, error: MemoryError) {
        self.drop_errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(error);
    }
}

/// Ordinary host memory: `mmap(MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE)`. It is
/// [`CommitModel::Eager`]: the whole page-rounded footprint is physically taken at
/// `allocate`, so a charge must cover all of it up front.
pub struct HostAllocator {
    mechanism: MechanismId,
    context: ContextId,
    page: u64,
    origin: Arc<Origin>,
}

impl HostAllocator {
    /// An allocator belonging to `mechanism` in `context`.
    pub fn new(mechanism: MechanismId, context: ContextId) -> Self {
        HostAllocator {
            mechanism,
            context,
            page: granularity(),
            origin: Arc::new(Origin {
                drop_errors: Mutex::new(Vec::new()),
                live: Mutex::new(BTreeMap::new()),
            }),
        }
    }

    /// Physical bytes of every live allocation, as the kernel reports them (`mincore` over
    /// each range: adjacent anonymous mappings may share one smaps entry, pages do not).
    pub fn resident_total(&self) -> Result<u64, MemoryError> {
        let live = self.origin.live.lock().unwrap_or_else(|p| p.into_inner());
        let mut total = 0;
        for (addr, len) in live.iter() {
            // SAFETY: the range is a live allocation of this allocator; the lock keeps it
            // from being released meanwhile.
            total += unsafe { sys::resident_bytes(*addr, *len, self.page)? };
        }
        Ok(total)
    }

    /// Errors that happened while allocations were dropped.
    pub fn take_drop_errors(&self) -> Vec<MemoryError> {
        std::mem::take(
            &mut *self
                .origin
                .drop_errors
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        )
    }

    fn check_owner(&self, allocation: &Allocation) -> Result<(), MemoryError> {
        if allocation.mechanism() != self.mechanism {
            return Err(MemoryError::ForeignHandle {
                owner: allocation.mechanism(),
                this: self.mechanism,
            });
        }
        if allocation.context() != self.context {
            return Err(MemoryError::Unsupported {
                capability: "releasing through another context",
                reason: "an allocation is released only by the context that created it",
            });
        }
        Ok(())
    }
}

impl Allocator for HostAllocator {
    fn mechanism(&self) -> MechanismId {
        self.mechanism
    }

    fn place(&self) -> Place {
        Place::HOST
    }

    fn context(&self) -> ContextId {
        self.context
    }

    fn commit_model(&self) -> CommitModel {
        CommitModel::Eager
    }

    fn footprint(&self, request: &AllocationRequest) -> Result<u64, MemoryError> {
        request.validate(self.page)?;
        request
            .bytes
            .checked_next_multiple_of(self.page)
            .filter(|b| *b <= isize::MAX as u64)
            .ok_or(MemoryError::SizeOverflow {
                what: "allocation size rounded to pages",
            })
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<Allocation, MemoryError> {
        let footprint = self.footprint(request)?;
        let ptr = sys::map_anonymous_populated(footprint as usize)?;
        self.origin
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(ptr.as_ptr() as usize as u64, footprint);
        let parts = AllocationParts {
            addr: ptr.as_ptr() as usize as u64,
            bytes: request.bytes,
            footprint,
            role: request.role,
            device: Place::HOST,
            context: self.context,
            mechanism: self.mechanism,
            charge: request.charge,
        };
        Ok(Allocation::new(parts, self.origin.clone()))
    }

    fn free(&self, allocation: Allocation) -> Result<u64, FreeError> {
        if let Err(error) = self.check_owner(&allocation) {
            return Err(FreeError::Refused(Box::new(Refused {
                error,
                handle: allocation,
            })));
        }
        allocation.release_now().map_err(FreeError::Failed)
    }

    fn resident_bytes(&self, allocation: &Allocation) -> Result<u64, MemoryError> {
        self.check_owner(allocation)?;
        // SAFETY: the allocation is alive (borrowed) and was mapped by this allocator.
        unsafe { sys::resident_bytes(allocation.addr(), allocation.footprint(), self.page) }
    }

    fn read(
        &self,
        allocation: &Allocation,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), MemoryError> {
        self.check_owner(allocation)?;
        let range = copy_range(allocation, offset, dst.len())?;
        dst.copy_from_slice(&allocation_bytes(allocation)?[range]);
        Ok(())
    }

    fn write(
        &self,
        allocation: &mut Allocation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), MemoryError> {
        self.check_owner(allocation)?;
        let range = copy_range(allocation, offset, src.len())?;
        allocation_bytes_mut(allocation)?[range].copy_from_slice(src);
        Ok(())
    }
}

/// The bytes of a host allocation.
pub fn allocation_bytes(allocation: &Allocation) -> Result<&[u8], MemoryError> {
    require_host(allocation)?;
    // SAFETY: a host allocation maps `addr..addr + bytes` read-write until it is released,
    // which consumes the handle, so the borrow of `allocation` keeps the bytes mapped.
    Ok(unsafe { sys::slice(allocation.addr(), allocation.bytes()) })
}

/// The bytes of a host allocation, writable.
pub fn allocation_bytes_mut(allocation: &mut Allocation) -> Result<&mut [u8], MemoryError> {
    require_host(allocation)?;
    // SAFETY: as in `allocation_bytes`; `&mut` makes this the only reference.
    Ok(unsafe { sys::slice_mut(allocation.addr(), allocation.bytes()) })
}

fn require_host(allocation: &Allocation) -> Result<(), MemoryError> {
    if allocation.place().kind == PlaceKind::Host {
        Ok(())
    } else {
        Err(MemoryError::Unsupported {
            capability: "host access",
            reason: "the allocation lives in device memory",
        })
    }
}
