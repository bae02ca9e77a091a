//! The eager CUDA allocator: `cuMemAlloc`, every byte taken at allocate time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::driver::CudaDevice;
use crate::api::capabilities::copy_range;
use crate::api::{
    Allocation, AllocationOrigin, AllocationParts, AllocationRequest, Allocator, CommitModel,
    ContextId, FreeError, MechanismId, MemoryError, Place, Refused,
};

struct Origin {
    device: Arc<CudaDevice>,
    drop_errors: Mutex<Vec<MemoryError>>,
    /// Footprint bytes allocated and not yet freed.
    live: AtomicU64,
}

impl AllocationOrigin for Origin {
    fn release(&self, addr: u64, footprint: u64) -> Result<u64, MemoryError> {
        // SAFETY: only `Allocation` calls this, once, for an address `allocate` returned;
        // device work is ordered before it by the deferred-free path.
        unsafe { self.device.free(addr)? };
        self.live.fetch_sub(footprint, Ordering::AcqRel);
        Ok(footprint)
    }

    fn record_drop_error(&self, error: MemoryError) {
        self.drop_errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(error);
    }
}

impl CudaAllocator {
    /// Footprint bytes allocated through it and not yet freed: what the driver holds for it.
    pub fn live_bytes(&self) -> u64 {
        self.origin.live.load(Ordering::Acquire)
    }

    fn own(&self, allocation: &Allocation) -> Result<(), MemoryError> {
        if allocation.mechanism() == self.mechanism {
            Ok(())
        } else {
            Err(MemoryError::Unsupported {
                capability: "copying to or from an allocation",
                reason: "the allocation belongs to another mechanism",
            })
        }
    }
}

/// Ordinary device memory through `cuMemAlloc`. Eager: the footprint is charged in full; it
/// is the request rounded up to the VMM granularity, since the driver's own pools carve
/// allocations from pages of that size and report no finer footprint.
pub struct CudaAllocator {
    mechanism: MechanismId,
    context: ContextId,
    key: Place,
    granularity: u64,
    origin: Arc<Origin>,
}

impl CudaAllocator {
    /// An allocator on `device` for mechanism `mechanism` in `context`.
    pub fn new(
        mechanism: MechanismId,
        context: ContextId,
        device: Arc<CudaDevice>,
    ) -> Result<Self, MemoryError> {
        Ok(CudaAllocator {
            mechanism,
            context,
            key: Place::cuda(device.ordinal()),
            granularity: device.granularity()?,
            origin: Arc::new(Origin {
                device,
                drop_errors: Mutex::new(Vec::new()),
                live: AtomicU64::new(0),
            }),
        })
    }
}

impl Allocator for CudaAllocator {
    fn mechanism(&self) -> MechanismId {
        self.mechanism
    }

    fn place(&self) -> Place {
        self.key
    }

    fn context(&self) -> ContextId {
        self.context
    }

    fn commit_model(&self) -> CommitModel {
        CommitModel::Eager
    }

    fn footprint(&self, request: &AllocationRequest) -> Result<u64, MemoryError> {
        request.validate(256)?;
        request
            .bytes
            .checked_next_multiple_of(self.granularity)
            .ok_or(MemoryError::SizeOverflow {
                what: "allocation size rounded to the granularity",
            })
    }

    fn allocate(&self, request: &AllocationRequest) -> Result<Allocation, MemoryError> {
        let footprint = self.footprint(request)?;
        let addr = self.origin.device.alloc(request.bytes)?;
        self.origin.live.fetch_add(footprint, Ordering::AcqRel);
        Ok(Allocation::new(
            AllocationParts {
                addr,
                bytes: request.bytes,
                footprint,
                role: request.role,
                device: self.key,
                context: self.context,
                mechanism: self.mechanism,
                charge: request.charge,
            },
            self.origin.clone(),
        ))
    }

    fn free(&self, allocation: Allocation) -> Result<u64, FreeError> {
        if allocation.mechanism() != self.mechanism || allocation.context() != self.context {
            return Err(FreeError::Refused(Box::new(Refused {
                error: MemoryError::ForeignHandle {
                    owner: allocation.mechanism(),
                    this: self.mechanism,
                },
                handle: allocation,
            })));
        }
        allocation.release().map_err(FreeError::Failed)
    }

    /// An eager CUDA allocation is resident in full for its whole life.
    fn resident_bytes(&self, allocation: &Allocation) -> Result<u64, MemoryError> {
        if allocation.mechanism() != self.mechanism {
            return Err(MemoryError::ForeignHandle {
                owner: allocation.mechanism(),
                this: self.mechanism,
            });
        }
        Ok(allocation.footprint())
    }

    fn read(
        &self,
        allocation: &Allocation,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), MemoryError> {
        self.own(allocation)?;
        let range = copy_range(allocation, offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: the allocation is one of this allocator's (checked), alive while borrowed,
        // and the range lies within it; `dst` is host memory of the range's length.
        unsafe {
            self.origin
                .device
                .copy_to_host(dst, allocation.addr() + range.start as u64)
        }
    }

    fn write(
        &self,
        allocation: &mut Allocation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), MemoryError> {
        self.own(allocation)?;
        let range = copy_range(allocation, offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: as in `read`; `&mut` makes this the only access through the handle.
        unsafe {
            self.origin
                .device
                .copy_to_device(allocation.addr() + range.start as u64, src)
        }
    }
}
