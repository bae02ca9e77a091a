//! Owning device buffers whose drop never frees: it hands the allocation, with the fences
//! of every stream that used it, to a deferred-free actor.

use std::sync::Arc;

use procmem::fence::{Fence, TimelineFence};
use procmem::fenced::{Fenced, RecordUse, Release};
use procmem::{Allocation, ContextId, MemoryError, Place};

use crate::charge::Charge;
use crate::deferred_free::DeferredQueue;
use crate::governor::Lease;

/// An allocation made through an execution provider, with the lease that pays for it.
///
/// Dropping it never blocks and never frees: it hands its [`Fenced`] owner (the allocation,
/// the lease and the fence of every stream that used it) to its home stream's deferred-free
/// actor. The mechanism frees it once those fences complete, then the Governor is refunded.
pub struct Buffer {
    fenced: Option<Fenced<Shared, Charge>>,
    home: DeferredQueue,
    context: ContextId,
    // Keeps the provider's context (its streams and mechanism) alive while this lives.
    _keep_alive: Arc<dyn Send + Sync>,
}

/// The allocation, shared only with host kernels reading it while they run (see
/// [`CpuStream::submit_reading`](crate::provider::CpuStream::submit_reading)): a kernel's share
/// is dropped before its fence completes, so by the time the deferred free runs the share is
/// the only one. The bytes a kernel reads come from `procmem::host::allocation_bytes`, the one
/// constructor of host slices, on a share that keeps the mapping alive.
pub(crate) struct Shared(pub(crate) Arc<Allocation>);

impl Release for Shared {
    fn release(self: Box<Self>) -> Result<u64, MemoryError> {
        match Arc::try_unwrap(self.0) {
            Ok(allocation) => allocation.release(),
            // Cannot happen through this crate's API (a kernel's share goes before its fence
            // completes). Were it to, the last share frees the memory as it drops; the charge
            // is kept rather than refunded for memory still mapped.
            Err(_) => Err(MemoryError::InUse { op: "freed" }),
        }
    }
}

/// A raw view of a buffer for device kernels: an address and a length in one place. Host
/// kernels read through [`CpuStream::submit_reading`](crate::provider::CpuStream::submit_reading)
/// instead, which hands them slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferView {
    /// Start address (host pointer or device address).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Where the bytes are.
    pub place: Place,
}

impl Buffer {
    pub(crate) fn new(
        allocation: Allocation,
        lease: Option<Lease>,
        home: DeferredQueue,
        keep_alive: Arc<dyn Send + Sync>,
    ) -> Self {
        Buffer {
            context: allocation.context(),
            fenced: Some(Fenced::new(
                Box::new(Shared(Arc::new(allocation))),
                lease.map(Charge::from),
            )),
            home,
            _keep_alive: keep_alive,
        }
    }

    fn fenced(&self) -> &Fenced<Shared, Charge> {
        self.fenced.as_ref().expect("live until dropped")
    }

    fn allocation(&self) -> &Allocation {
        &self.fenced().item().0
    }

    /// A share of the allocation for a host kernel that reads it (dropped before its fence
    /// completes).
    pub(crate) fn share(&self) -> Arc<Allocation> {
        Arc::clone(&self.fenced().item().0)
    }

    /// A raw view for kernels.
    pub fn view(&self) -> BufferView {
        let a = self.allocation();
        BufferView {
            addr: a.addr(),
            len: a.bytes(),
            place: a.place(),
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
    pub fn allocation_handle(&self) -> &Allocation {
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
        procmem::host::allocation_bytes(self.allocation())
    }

    /// The bytes on the host, writable, after waiting for every stream that used them.
    pub fn host_bytes_mut(&mut self) -> Result<&mut [u8], MemoryError> {
        self.host_wait_idle();
        let fenced = self.fenced.as_mut().expect("live until dropped");
        // Every kernel that read it is done (its fence completed), so no share is left.
        let allocation =
            Arc::get_mut(&mut fenced.item_mut().0).ok_or(MemoryError::InUse { op: "written" })?;
        procmem::host::allocation_bytes_mut(allocation)
    }
}

impl Buffer {
    /// Runs `f` on the allocation, writable: refused while a host kernel holds a share of it.
    /// Work queued on streams is not waited for; order it with the buffer's fences.
    pub(crate) fn write_with<T>(
        &mut self,
        f: impl FnOnce(&mut Allocation) -> Result<T, MemoryError>,
    ) -> Result<T, MemoryError> {
        let fenced = self.fenced.as_mut().expect("live until dropped");
        let allocation =
            Arc::get_mut(&mut fenced.item_mut().0).ok_or(MemoryError::InUse { op: "written" })?;
        f(allocation)
    }
}

impl RecordUse for Buffer {
    fn record_use(&self, use_: TimelineFence) {
        self.fenced().record_use(use_);
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let Some(fenced) = self.fenced.take() else {
            return;
        };
        // If the queue is gone (shutdown, or its actor died) the message comes back and is
        // dropped here: a `Fenced` dropped unfreed still waits for every fence (as a waker on
        // their timelines, never on this thread) and never frees before they complete.
        self.home.enqueue(fenced.into_dyn());
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("fenced", &self.fenced)
            .finish()
    }
}
