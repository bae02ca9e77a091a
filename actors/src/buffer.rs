//! Owning device buffers whose drop never frees: it hands the allocation, with the fences
//! of every stream that used it, to a deferred-free actor.

use std::sync::Arc;

use procmem::fence::{Fence, TimelineFence};
use procmem::fenced::{Fenced, RecordUse};
use procmem::{ContextId, DeviceAllocation, DeviceKey, DeviceKind, MemoryError};
use ractor::ActorRef;

use crate::charge::Charge;
use crate::deferred_free::DeferredFreeMsg;
use crate::governor::Lease;

/// An allocation made through an execution provider, with the lease that pays for it.
///
/// Dropping it never blocks and never frees: it hands its [`Fenced`] owner (the allocation,
/// the lease and the fence of every stream that used it) to its home stream's deferred-free
/// actor. The mechanism frees it once those fences complete, then the Governor is refunded.
pub struct DeviceBuffer {
    fenced: Option<Fenced<DeviceAllocation, Charge>>,
    home: ActorRef<DeferredFreeMsg>,
    context: ContextId,
    // Keeps the provider's context (its streams and mechanism) alive while this lives.
    _keep_alive: Arc<dyn Send + Sync>,
}

/// A raw view of a buffer for kernels: an address and a length on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferView {
    /// Start address (host pointer or device address).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The device the bytes are on.
    pub device: DeviceKey,
}

impl BufferView {
    /// The bytes, for a host kernel.
    ///
    /// # Safety
    /// 1. The view's buffer was passed in `uses` when the kernel reading it was submitted,
    ///    so it stays mapped until that kernel's fence completes.
    /// 2. No kernel writes these bytes concurrently.
    /// 3. The view is of host memory.
    #[allow(unsafe_code)]
    pub unsafe fn host_bytes<'a>(&self) -> &'a [u8] {
        debug_assert_eq!(self.device.kind, DeviceKind::Host);
        // SAFETY: preconditions 1 to 3.
        unsafe { std::slice::from_raw_parts(self.addr as usize as *const u8, self.len as usize) }
    }

    /// The bytes, writable, for a host kernel.
    ///
    /// # Safety
    /// As for [`BufferView::host_bytes`], and no other access to these bytes happens meanwhile.
    #[allow(unsafe_code, clippy::mut_from_ref)]
    pub unsafe fn host_bytes_mut<'a>(&self) -> &'a mut [u8] {
        debug_assert_eq!(self.device.kind, DeviceKind::Host);
        // SAFETY: preconditions of this function.
        unsafe { std::slice::from_raw_parts_mut(self.addr as usize as *mut u8, self.len as usize) }
    }
}

impl DeviceBuffer {
    pub(crate) fn new(
        allocation: DeviceAllocation,
        lease: Option<Lease>,
        home: ActorRef<DeferredFreeMsg>,
        keep_alive: Arc<dyn Send + Sync>,
    ) -> Self {
        DeviceBuffer {
            context: allocation.context(),
            fenced: Some(Fenced::new(Box::new(allocation), lease.map(Charge::from))),
            home,
            _keep_alive: keep_alive,
        }
    }

    fn fenced(&self) -> &Fenced<DeviceAllocation, Charge> {
        self.fenced.as_ref().expect("live until dropped")
    }

    fn allocation(&self) -> &DeviceAllocation {
        self.fenced().item()
    }

    /// A raw view for kernels.
    pub fn view(&self) -> BufferView {
        let a = self.allocation();
        BufferView {
            addr: a.addr(),
            len: a.bytes(),
            device: a.device(),
        }
    }

    /// Usable bytes.
    pub fn len(&self) -> u64 {
        self.allocation().bytes()
    }

    /// True for a zero-length buffer (never: allocations are at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the lease pays for.
    pub fn charged_bytes(&self) -> u64 {
        self.fenced().charged_bytes()
    }

    /// The provider context that made it.
    pub fn context(&self) -> ContextId {
        self.context
    }

    /// The underlying allocation.
    pub fn allocation_handle(&self) -> &DeviceAllocation {
        self.allocation()
    }

    /// Fences of the streams that used it (the latest per stream).
    pub fn fences(&self) -> Vec<Fence> {
        self.fenced().fences()
    }

    /// Waits on the host until every stream that used the buffer is done with it.
    pub fn host_wait_idle(&self) {
        self.fenced().wait_idle();
    }

    /// The bytes on the host, after waiting for every stream that used them.
    pub fn host_bytes(&self) -> Result<&[u8], MemoryError> {
        self.host_wait_idle();
        procmem::host::host_bytes(self.allocation())
    }

    /// The bytes on the host, writable, after waiting for every stream that used them.
    pub fn host_bytes_mut(&mut self) -> Result<&mut [u8], MemoryError> {
        self.host_wait_idle();
        let fenced = self.fenced.as_mut().expect("live until dropped");
        procmem::host::host_bytes_mut(fenced.item_mut())
    }
}

impl RecordUse for DeviceBuffer {
    fn record_use(&self, use_: TimelineFence) {
        self.fenced().record_use(use_);
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let Some(fenced) = self.fenced.take() else {
            return;
        };
        // If the queue is gone (shutdown, or its actor died) the message comes back and is
        // dropped here: a `Fenced` dropped unfreed still waits for every fence (as a waker on
        // their timelines, never on this thread) and never frees before they complete.
        let _ = self.home.cast(DeferredFreeMsg::Enqueue(fenced.into_dyn()));
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("fenced", &self.fenced)
            .finish()
    }
}
