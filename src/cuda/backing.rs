//! CUDA virtual memory management as a [`VirtualBacking`] and [`SharedMapping`]: a reserved
//! device address range with physical handles mapped in granule by granule.
//!
//! Creating a physical handle (`cuMemCreate`) is far slower than mapping one, so handles come
//! from a pool filled ahead of time and go back to it on decommit; growth maps, it does not
//! create. Pooled handles are physical memory too: [`CudaVmmBacking::pooled_bytes`] reports
//! them so whoever charges the mechanism can account for them.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use super::driver::{AddressRange, CudaAccess, CudaBlock, CudaDevice, PhysicalHandle};
use super::pinned::BlockView;
use crate::api::capabilities::copy_span;
use crate::api::{
    CommitResult, DecommitResult, GranuleMap, GranuleState, MapAccess, MechanismId, MemoryError,
    PhysicalBlock, Place, SharedMapping, SharedView, VirtualAllocation, VirtualBacking,
    VirtualRequest,
};
use crate::virtual_memory::{check_readable, check_writable};

/// Physical handles of one granule each, kept for reuse.
#[derive(Debug)]
struct HandlePool {
    device: Arc<CudaDevice>,
    granularity: u64,
    free: Mutex<Vec<PhysicalHandle>>,
    keep: usize,
    state: Mutex<PoolLimits>,
}

#[derive(Debug)]
struct PoolLimits {
    live: usize,
    cap: Option<usize>,
}

impl HandlePool {
    fn take(&self) -> Result<PhysicalHandle, MemoryError> {
        if let Some(h) = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(h);
        }
        let mut limits = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if limits.cap.is_some_and(|cap| limits.live >= cap) {
            return Err(MemoryError::OutOfMemory {
                op: "taking a physical handle past the backing's cap",
                bytes: self.granularity,
            });
        }
        let handle = self.device.create_handle(self.granularity)?;
        limits.live += 1;
        Ok(handle)
    }

    fn put(&self, handle: PhysicalHandle) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < self.keep {
            free.push(handle);
        } else {
            drop(free);
            drop(handle);
            self.state.lock().unwrap_or_else(|p| p.into_inner()).live -= 1;
        }
    }

    fn pooled(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// The device memory behind one reservation.
struct CudaReservation {
    range: AddressRange,
    granularity: u64,
    handles: Vec<Option<PhysicalHandle>>,
    shared: BTreeMap<u64, u64>,
    pool: Arc<HandlePool>,
}

impl Drop for CudaReservation {
    fn drop(&mut self) {
        let device = Arc::clone(self.range.device());
        for (i, slot) in self.handles.iter_mut().enumerate() {
            if let Some(handle) = slot.take() {
                // SAFETY: this granule was mapped by `commit_range`; the reservation's owner
                // dropped it, so no work may still use it (the deferred-free contract).
                let _ = unsafe {
                    device.unmap(
                        self.range.ptr() + i as u64 * self.granularity,
                        self.granularity,
                    )
                };
                self.pool.put(handle);
            }
        }
        for (offset, size) in std::mem::take(&mut self.shared) {
            // SAFETY: as above, for a shared block mapped whole by `map_block`.
            let _ = unsafe { device.unmap(self.range.ptr() + offset, size) };
        }
    }
}

/// CUDA VMM backing of one device.
#[derive(Debug)]
pub struct CudaVmmBacking {
    id: MechanismId,
    key: Place,
    granularity: u64,
    pool: Arc<HandlePool>,
}

impl CudaVmmBacking {
    /// A backing on `device` belonging to mechanism `id`, with `prefill` handles created up
    /// front and at most `keep` kept for reuse after decommit.
    pub fn new(
        id: MechanismId,
        device: Arc<CudaDevice>,
        prefill: usize,
        keep: usize,
    ) -> Result<Self, MemoryError> {
        let granularity = device.granularity()?;
        let pool = Arc::new(HandlePool {
            device: Arc::clone(&device),
            granularity,
            free: Mutex::new(Vec::new()),
            keep: keep.max(prefill),
            state: Mutex::new(PoolLimits { live: 0, cap: None }),
        });
        let mut filled = Vec::with_capacity(prefill);
        for _ in 0..prefill {
            filled.push(pool.take()?);
        }
        for h in filled {
            pool.put(h);
        }
        Ok(CudaVmmBacking {
            id,
            key: Place::cuda(device.ordinal()),
            granularity,
            pool,
        })
    }

    /// Caps the physical handles this backing may hold at once (mapped plus pooled); a
    /// commit that needs more fails with `OutOfMemory` and maps nothing.
    pub fn set_handle_cap(&self, cap: Option<usize>) {
        self.pool
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .cap = cap;
    }

    /// `blocks` (made by this backing) mapped one after another at a device address of
    /// their own, read-write: the source or destination of one copy for them all, wherever
    /// else they are mapped, or if they are mapped nowhere.
    pub fn view(&self, blocks: &[PhysicalBlock]) -> Result<BlockView, MemoryError> {
        if let Some(b) = blocks.iter().find(|b| b.mechanism() != self.id) {
            return Err(MemoryError::ForeignHandle {
                owner: b.mechanism(),
                this: self.id,
            });
        }
        BlockView::new(&self.pool.device, blocks)
    }

    /// Physical bytes held in the pool, unmapped.
    pub fn pooled_bytes(&self) -> u64 {
        self.pool.pooled() as u64 * self.granularity
    }

    /// Physical bytes mapped (or mapped as shared blocks): held in all, less the pool's
    /// unmapped spares.
    pub fn mapped_bytes(&self) -> u64 {
        self.live_bytes().saturating_sub(self.pooled_bytes())
    }

    /// Physical bytes held in all: mapped plus pooled.
    pub fn live_bytes(&self) -> u64 {
        self.pool
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .live as u64
            * self.granularity
    }

    fn check(&self, allocation: &VirtualAllocation) -> Result<(), MemoryError> {
        allocation.check_owner(self.id)?;
        allocation
            .backend::<CudaReservation>()
            .map(|_| ())
            .ok_or(MemoryError::Unsupported {
                capability: "CUDA VMM backing",
                reason: "the reservation was not made by a CUDA backing",
            })
    }
}

impl VirtualBacking for CudaVmmBacking {
    fn mechanism(&self) -> MechanismId {
        self.id
    }

    fn place(&self) -> Place {
        self.key
    }

    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn reserve(&self, request: &VirtualRequest) -> Result<VirtualAllocation, MemoryError> {
        GranuleMap::validate_len(request.bytes, self.granularity)?;
        let range = self.pool.device.reserve(request.bytes, self.granularity)?;
        let ptr = range.ptr();
        let granules = (request.bytes / self.granularity) as usize;
        let backend = CudaReservation {
            range,
            granularity: self.granularity,
            handles: (0..granules).map(|_| None).collect(),
            shared: BTreeMap::new(),
            pool: Arc::clone(&self.pool),
        };
        Ok(VirtualAllocation::new(
            ptr,
            GranuleMap::new(request.bytes, self.granularity),
            request.role,
            self.key,
            self.id,
            Box::new(backend),
        ))
    }

    fn commit_range(
        &self,
        allocation: &mut VirtualAllocation,
        range: Range<u64>,
    ) -> Result<CommitResult, MemoryError> {
        self.check(allocation)?;
        let granules = allocation.granules.validate_range(&range)?;
        allocation.granules.require_reserved(&granules)?;
        let g = self.granularity;
        let device = Arc::clone(&self.pool.device);
        let res = allocation
            .backend_mut::<CudaReservation>()
            .expect("checked");
        let base = res.range.ptr();
        let mut mapped: Vec<(usize, PhysicalHandle)> = Vec::with_capacity(granules.len());
        let rollback = |mapped: Vec<(usize, PhysicalHandle)>, pool: &HandlePool| {
            for (i, handle) in mapped {
                // SAFETY: mapped by this attempt a moment ago; nothing has used it.
                let _ = unsafe { device.unmap(base + i as u64 * g, g) };
                pool.put(handle);
            }
        };
        for i in granules.clone() {
            let handle = match self.pool.take() {
                Ok(h) => h,
                Err(e) => {
                    rollback(mapped, &self.pool);
                    return Err(e);
                }
            };
            let addr = base + i as u64 * g;
            // SAFETY: granule `i` lies inside this reservation and is only reserved (checked).
            let mapped_now = unsafe { device.map_without_access(addr, &handle) };
            if let Err(e) = mapped_now {
                self.pool.put(handle);
                rollback(mapped, &self.pool);
                return Err(e);
            }
            mapped.push((i, handle));
        }
        // One access grant for the whole chunk (the driver's cost is per call, not per
        // granule). Nothing may touch the granules before it succeeds.
        if !mapped.is_empty() {
            // SAFETY: every granule of the range was mapped just above.
            let granted = unsafe {
                device.set_access(
                    base + range.start,
                    range.end - range.start,
                    CudaAccess::ReadWrite,
                )
            };
            if let Err(e) = granted {
                rollback(mapped, &self.pool);
                return Err(e);
            }
        }
        for (i, handle) in mapped {
            res.handles[i] = Some(handle);
        }
        allocation.granules.set(granules, GranuleState::Committed);
        Ok(CommitResult {
            committed_bytes: range.end - range.start,
        })
    }

    fn decommit_range(
        &self,
        allocation: &mut VirtualAllocation,
        range: Range<u64>,
    ) -> Result<DecommitResult, MemoryError> {
        self.check(allocation)?;
        let granules = allocation.granules.validate_range(&range)?;
        allocation.granules.require_backed(&granules)?;
        let blocks = allocation.shared_blocks_within(&range)?;
        let g = self.granularity;
        let device = Arc::clone(&self.pool.device);
        let res = allocation
            .backend_mut::<CudaReservation>()
            .expect("checked");
        let base = res.range.ptr();
        let mut freed = 0;
        let mut first_error = None;
        for i in granules.clone() {
            if let Some(handle) = res.handles[i].take() {
                // SAFETY: this granule was mapped by `commit_range`; the caller guarantees no
                // pending device work uses the range (see `VirtualBacking::decommit_range`).
                if let Err(e) = unsafe { device.unmap(base + i as u64 * g, g) } {
                    first_error.get_or_insert(e);
                }
                self.pool.put(handle);
                freed += g;
            }
        }
        for offset in &blocks {
            if let Some(size) = res.shared.remove(offset) {
                // SAFETY: the block was mapped whole at `offset` by `map_block`; same contract.
                if let Err(e) = unsafe { device.unmap(base + offset, size) } {
                    first_error.get_or_insert(e);
                }
            }
        }
        for offset in blocks {
            allocation.shared.remove(&offset);
        }
        allocation.granules.set(granules, GranuleState::Reserved);
        match first_error {
            Some(e) => Err(e),
            None => Ok(DecommitResult {
                unmapped_bytes: range.end - range.start,
                freed_bytes: freed,
            }),
        }
    }

    /// Exclusively mapped physical bytes: each VMM handle is fully resident from
    /// `cuMemCreate` on, so the handles mapped here are the physical truth (the driver has
    /// no per-range residency query; `cuMemGetInfo` cross-checks device-wide).
    fn committed_bytes(&self, allocation: &VirtualAllocation) -> Result<u64, MemoryError> {
        self.check(allocation)?;
        let res = allocation.backend::<CudaReservation>().expect("checked");
        Ok(res.handles.iter().filter(|h| h.is_some()).count() as u64 * self.granularity)
    }

    fn read_range(
        &self,
        allocation: &VirtualAllocation,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), MemoryError> {
        self.check(allocation)?;
        let range = copy_span(offset, dst.len())?;
        check_readable(allocation, &range)?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: every granule of the range is mapped on this device and stays mapped while
        // `allocation` is borrowed (changing its mappings takes `&mut`); `dst` is host memory
        // of exactly the range's length.
        unsafe {
            self.pool
                .device
                .copy_to_host(dst, allocation.addr() + offset)
        }
    }

    fn write_range(
        &self,
        allocation: &mut VirtualAllocation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), MemoryError> {
        self.check(allocation)?;
        let range = copy_span(offset, src.len())?;
        check_writable(allocation, &range)?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: every granule of the range is mapped writable on this device, and `&mut`
        // keeps its mappings as they are for the call.
        unsafe {
            self.pool
                .device
                .copy_to_device(allocation.addr() + offset, src)
        }
    }
}

impl SharedMapping for CudaVmmBacking {
    fn mechanism(&self) -> MechanismId {
        self.id
    }

    fn create_block(&self, bytes: u64) -> Result<PhysicalBlock, MemoryError> {
        GranuleMap::validate_len(bytes, self.granularity)?;
        let handle = self.pool.device.create_handle(bytes)?;
        Ok(PhysicalBlock::new(
            bytes,
            self.id,
            Arc::new(CudaBlock { handle }),
        ))
    }

    fn map_block(
        &self,
        allocation: &mut VirtualAllocation,
        offset: u64,
        block: &PhysicalBlock,
        access: MapAccess,
    ) -> Result<(), MemoryError> {
        self.check(allocation)?;
        if block.mechanism() != self.id {
            return Err(MemoryError::ForeignHandle {
                owner: block.mechanism(),
                this: self.id,
            });
        }
        let access = match access {
            MapAccess::ReadWrite => CudaAccess::ReadWrite,
            MapAccess::ReadOnly => CudaAccess::ReadOnly,
            MapAccess::CopyOnWrite => {
                return Err(MemoryError::Unsupported {
                    capability: "copy-on-write mapping",
                    reason: "CUDA VMM has no copy-on-write; copy the block explicitly",
                })
            }
        };
        let inner = block.inner::<CudaBlock>().ok_or(MemoryError::Unsupported {
            capability: "CUDA shared mapping",
            reason: "the block was not made by a CUDA backing",
        })?;
        let end = offset
            .checked_add(block.bytes())
            .ok_or(MemoryError::SizeOverflow {
                what: "block offset + length",
            })?;
        let granules = allocation.granules.validate_range(&(offset..end))?;
        allocation.granules.require_reserved(&granules)?;
        let device = Arc::clone(&self.pool.device);
        let res = allocation
            .backend_mut::<CudaReservation>()
            .expect("checked");
        // SAFETY: the range lies inside this reservation and is only reserved (checked above).
        unsafe { device.map(res.range.ptr() + offset, &inner.handle, access)? };
        res.shared.insert(offset, block.bytes());
        allocation.granules.set(granules, GranuleState::Shared);
        allocation.shared.insert(
            offset,
            SharedView {
                block: block.clone(),
                access: match access {
                    CudaAccess::ReadWrite => MapAccess::ReadWrite,
                    CudaAccess::ReadOnly => MapAccess::ReadOnly,
                },
            },
        );
        Ok(())
    }

    fn block_resident_bytes(&self, block: &PhysicalBlock) -> Result<u64, MemoryError> {
        let inner = block
            .inner::<CudaBlock>()
            .ok_or(MemoryError::ForeignHandle {
                owner: block.mechanism(),
                this: self.id,
            })?;
        Ok(inner.handle.size())
    }

    /// CUDA VMM never copies on write, so no bytes are ever privately copied.
    fn private_copy_bytes(&self, allocation: &VirtualAllocation) -> Result<u64, MemoryError> {
        self.check(allocation)?;
        Ok(0)
    }
}
