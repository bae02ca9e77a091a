//! Page-locked host memory and block views: what a host tier below device KV needs. A copy
//! between device memory and page-locked host memory runs on a stream in its order, without
//! the calling thread waiting (from pageable memory the driver would make it wait); a view
//! maps physical blocks made elsewhere at one device address, so one copy moves them all.

use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::sys;

use super::driver::{check, AddressRange, CudaAccess, CudaBlock, CudaDevice};
use super::stream::{CudaEvent, CudaStream};
use crate::api::{MemoryError, PhysicalBlock};

/// Page-locked host memory from `cuMemHostAlloc`; freed on drop (no work queued on any stream
/// may still use it then).
#[derive(Debug)]
pub struct PinnedHost {
    ptr: *mut u8,
    len: usize,
    device: Arc<CudaDevice>,
}

// SAFETY: the memory is a plain host allocation owned by this value; the driver lets any
// thread free it with the context bound, which `Drop` does.
unsafe impl Send for PinnedHost {}
// SAFETY: shared access reads or writes its bytes only through copies queued on streams
// (`fill_from`, `write_to`), which the driver carries out.
unsafe impl Sync for PinnedHost {}

impl PinnedHost {
    /// `len` bytes (at least one) of page-locked host memory for `device`'s copies.
    pub fn new(device: &Arc<CudaDevice>, len: usize) -> Result<Self, MemoryError> {
        device.bind()?;
        let mut ptr = std::ptr::null_mut();
        // SAFETY: the out-pointer is valid; flags 0 is a plain page-locked allocation.
        check("cuMemHostAlloc", len as u64, unsafe {
            sys::cuMemHostAlloc(&mut ptr, len.max(1), 0)
        })?;
        Ok(PinnedHost {
            ptr: ptr.cast(),
            len,
            device: Arc::clone(device),
        })
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The host address of byte `at`, if `at..at + len` lies inside it.
    fn span(&self, at: usize, len: usize) -> Result<*mut u8, MemoryError> {
        match at.checked_add(len) {
            // SAFETY: `at` is inside the allocation (checked), so the offset stays in it.
            Some(end) if end <= self.len => Ok(unsafe { self.ptr.add(at) }),
            _ => Err(MemoryError::OutOfReservation {
                range: at as u64..(at as u64).saturating_add(len as u64),
                reserved: self.len as u64,
            }),
        }
    }

    /// Queues, on `stream`, a copy of every block `view` maps into this memory from byte
    /// `at`: a block going down to a host tier. What it returns holds the view and this
    /// memory until the copy has run (dropped sooner, it waits for the copy).
    ///
    /// Two copies queued on one stream into or out of one span run in their order; on two
    /// streams the caller orders them.
    pub fn fill_from(
        self: &Arc<Self>,
        stream: &CudaStream,
        at: usize,
        view: BlockView,
    ) -> Result<InFlightCopy, MemoryError> {
        self.copy(stream, at, view, true)
    }

    /// Queues, on `stream`, a copy of this memory from byte `at` into every block `view`
    /// maps: a block coming back from a host tier. Held as for [`PinnedHost::fill_from`].
    pub fn write_to(
        self: &Arc<Self>,
        stream: &CudaStream,
        at: usize,
        view: BlockView,
    ) -> Result<InFlightCopy, MemoryError> {
        self.copy(stream, at, view, false)
    }

    fn copy(
        self: &Arc<Self>,
        stream: &CudaStream,
        at: usize,
        view: BlockView,
        to_host: bool,
    ) -> Result<InFlightCopy, MemoryError> {
        let len = usize::try_from(view.len()).map_err(|_| MemoryError::SizeOverflow {
            what: "a block view's length",
        })?;
        // SAFETY: the view maps its blocks read-write, and it and this memory are held by
        // the returned copy until its event completes; each call checks that the span lies
        // inside this memory.
        unsafe {
            match to_host {
                true => stream.copy_to_host_async(self, at, view.ptr(), len)?,
                false => stream.copy_to_device_async(view.ptr(), self, at, len)?,
            }
        };
        InFlightCopy::after(stream, view, Arc::clone(self))
    }
}

/// A copy between page-locked host memory and a block view, queued on a stream: it holds
/// both until the copy has run. Dropped before then, it waits for the copy first.
#[derive(Debug)]
pub struct InFlightCopy {
    event: CudaEvent,
    /// The view and the memory: released only once the event is seen complete.
    held: ManuallyDrop<(BlockView, Arc<PinnedHost>)>,
}

impl InFlightCopy {
    fn after(
        stream: &CudaStream,
        view: BlockView,
        host: Arc<PinnedHost>,
    ) -> Result<Self, MemoryError> {
        match stream.record() {
            Ok(event) => Ok(InFlightCopy {
                event,
                held: ManuallyDrop::new((view, host)),
            }),
            Err(e) => {
                // No event to wait on: the stream's queued work is waited for instead. Where
                // that fails too, the view and the memory are kept (leaked), never released
                // while the copy may still run.
                if stream.synchronize().is_err() {
                    std::mem::forget((view, host));
                }
                Err(e)
            }
        }
    }
}

impl Drop for InFlightCopy {
    fn drop(&mut self) {
        // A copy not seen to finish (a failed device) keeps what it uses: leaked rather than
        // unmapped or freed under it.
        if self.event.synchronize().is_ok() {
            // SAFETY: taken once, here, and `held` is not used after.
            drop(unsafe { ManuallyDrop::take(&mut self.held) });
        }
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: the pointer came from cuMemHostAlloc and is freed once, here; its
            // owner waited for every copy using it.
            let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
        }
    }
}

impl CudaStream {
    /// Queues a copy of `len` device bytes at `src` into `host` from byte `at`.
    ///
    /// # Safety
    /// 1. `src..src + len` is mapped readable on this device until the work completes.
    /// 2. `host` lives, and nothing else writes or reads that span, until the work completes.
    unsafe fn copy_to_host_async(
        &self,
        host: &PinnedHost,
        at: usize,
        src: u64,
        len: usize,
    ) -> Result<(), MemoryError> {
        let dst = host.span(at, len)?;
        self.device().bind()?;
        // SAFETY: preconditions 1 and 2; the host span is inside page-locked memory.
        check("cuMemcpyDtoHAsync", len as u64, unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.raw())
        })
    }

    /// Queues a copy of `len` bytes of `host` from byte `at` to device address `dst`.
    ///
    /// # Safety
    /// 1. `dst..dst + len` is mapped writable on this device until the work completes.
    /// 2. `host` lives, and nothing writes that span, until the work completes.
    unsafe fn copy_to_device_async(
        &self,
        dst: u64,
        host: &PinnedHost,
        at: usize,
        len: usize,
    ) -> Result<(), MemoryError> {
        let src = host.span(at, len)?;
        self.device().bind()?;
        // SAFETY: preconditions 1 and 2; the host span is inside page-locked memory.
        check("cuMemcpyHtoDAsync", len as u64, unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.raw())
        })
    }
}

/// Physical blocks made by a [`CudaVmmBacking`](super::CudaVmmBacking) mapped one after
/// another at one device address, read-write, whatever else maps them: one copy moves them
/// all. Dropped, it unmaps them and frees the address range (no work may use it then).
#[derive(Debug)]
pub struct BlockView {
    range: AddressRange,
    /// The blocks, in order: held alive while mapped here.
    blocks: Vec<PhysicalBlock>,
}

impl BlockView {
    /// Maps `blocks` (each made by a CUDA backing on `device`: see
    /// [`CudaVmmBacking::view`](super::CudaVmmBacking::view)) in order.
    pub(crate) fn new(
        device: &Arc<CudaDevice>,
        blocks: &[PhysicalBlock],
    ) -> Result<Self, MemoryError> {
        let total = blocks.iter().try_fold(0u64, |sum, b| {
            sum.checked_add(b.bytes()).ok_or(MemoryError::SizeOverflow {
                what: "a block view's length",
            })
        })?;
        let granularity = device.granularity()?;
        let range = device.reserve(total.max(granularity), granularity)?;
        let mut view = BlockView {
            range,
            blocks: Vec::with_capacity(blocks.len()),
        };
        let mut at = view.range.ptr();
        for block in blocks {
            let inner = block.inner::<CudaBlock>().ok_or(MemoryError::Unsupported {
                capability: "a CUDA block view",
                reason: "the block was not made by a CUDA backing",
            })?;
            // SAFETY: `at..at + size` lies inside the fresh range, where nothing is mapped yet
            // (each block after the last); a failure leaves the earlier ones for `Drop`.
            unsafe { device.map(at, &inner.handle, CudaAccess::ReadWrite)? };
            view.blocks.push(block.clone());
            at += block.bytes();
        }
        Ok(view)
    }

    /// The device address of the first block.
    pub fn ptr(&self) -> u64 {
        self.range.ptr()
    }

    /// The bytes of every block together.
    pub fn len(&self) -> u64 {
        self.blocks.iter().map(PhysicalBlock::bytes).sum()
    }

    /// Whether it maps nothing.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

impl Drop for BlockView {
    fn drop(&mut self) {
        let device = Arc::clone(self.range.device());
        let mut at = self.range.ptr();
        for block in &self.blocks {
            // SAFETY: each block was mapped here by `new`; the view's owner drops it only once
            // no work uses it (after the fence of the copies through it).
            let _ = unsafe { device.unmap(at, block.bytes()) };
            at += block.bytes();
        }
    }
}
