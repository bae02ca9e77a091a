//! CUDA streams and events: work is queued asynchronously on a stream, an event recorded
//! after it is the fence, and the host observes completion by synchronising on the event.

use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::Arc;

use cudarc::driver::sys;

use super::driver::{check, CudaDevice};
use crate::api::MemoryError;

/// A non-blocking CUDA stream of one device; destroyed on drop.
#[derive(Debug)]
pub struct CudaStream {
    raw: sys::CUstream,
    device: Arc<CudaDevice>,
}

// SAFETY: a CUstream is a driver handle usable from any thread with its context current;
// every method binds the context first.
unsafe impl Send for CudaStream {}
// SAFETY: as above; the driver serialises operations queued on one stream.
unsafe impl Sync for CudaStream {}

/// A host-side gate: work queued on a stream after [`CudaStream::host_gate`] waits until
/// the gate is opened (or dropped). Useful to hold a stream busy deterministically.
#[derive(Debug)]
pub struct HostGate {
    open: Option<std::sync::mpsc::Sender<()>>,
}

impl HostGate {
    /// Lets the stream go on.
    pub fn open(mut self) {
        if let Some(tx) = self.open.take() {
            let _ = tx.send(());
        }
    }
}

unsafe extern "C" fn wait_for_gate(data: *mut c_void) {
    // SAFETY: `data` is the Box leaked by `host_gate` for exactly this one call.
    let rx = unsafe { Box::from_raw(data.cast::<std::sync::mpsc::Receiver<()>>()) };
    let _ = rx.recv();
}

impl CudaStream {
    /// Creates a non-blocking stream on `device`.
    pub fn new(device: Arc<CudaDevice>) -> Result<Self, MemoryError> {
        device.bind()?;
        let mut raw = MaybeUninit::uninit();
        // SAFETY: the context is current; `raw` is a valid out-pointer.
        check("cuStreamCreate", 0, unsafe {
            sys::cuStreamCreate(
                raw.as_mut_ptr(),
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        })?;
        Ok(CudaStream {
            // SAFETY: creation succeeded, so the handle was written.
            raw: unsafe { raw.assume_init() },
            device,
        })
    }

    /// The raw handle, for queuing work on it.
    pub(crate) fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// The device.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Queues a fill of `len` bytes at `ptr` with `value`.
    ///
    /// # Safety
    /// 1. `ptr..ptr + len` is mapped writable on this device until the work completes.
    pub unsafe fn memset_async(&self, ptr: u64, value: u8, len: u64) -> Result<(), MemoryError> {
        self.device.bind()?;
        // SAFETY: precondition 1; the stream is valid.
        check("cuMemsetD8Async", len, unsafe {
            sys::cuMemsetD8Async(ptr, value, len as usize, self.raw)
        })
    }

    /// Queues a device-to-device copy.
    ///
    /// # Safety
    /// 1. Both ranges are mapped (source readable, destination writable) until the work completes.
    pub unsafe fn copy_async(&self, dst: u64, src: u64, len: u64) -> Result<(), MemoryError> {
        self.device.bind()?;
        // SAFETY: precondition 1; the stream is valid.
        check("cuMemcpyDtoDAsync", len, unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, len as usize, self.raw)
        })
    }

    /// Queues a host-side wait: later work on the stream runs only once the gate opens.
    pub fn host_gate(&self) -> Result<HostGate, MemoryError> {
        self.device.bind()?;
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let data = Box::into_raw(Box::new(rx));
        // SAFETY: `wait_for_gate` takes ownership of `data` when it runs; it calls no CUDA API.
        let launched = check("cuLaunchHostFunc", 0, unsafe {
            sys::cuLaunchHostFunc(self.raw, Some(wait_for_gate), data.cast())
        });
        if let Err(e) = launched {
            // SAFETY: the function was not queued, so `data` is still ours.
            drop(unsafe { Box::from_raw(data) });
            return Err(e);
        }
        Ok(HostGate { open: Some(tx) })
    }

    /// Records an event after everything queued so far: the fence of that work.
    pub fn record(&self) -> Result<CudaEvent, MemoryError> {
        self.device.bind()?;
        let mut raw = MaybeUninit::uninit();
        // SAFETY: the context is current; `raw` is a valid out-pointer.
        check("cuEventCreate", 0, unsafe {
            sys::cuEventCreate(
                raw.as_mut_ptr(),
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            )
        })?;
        let event = CudaEvent {
            // SAFETY: creation succeeded.
            raw: unsafe { raw.assume_init() },
            device: Arc::clone(&self.device),
        };
        // SAFETY: both handles are valid and belong to the current context.
        check("cuEventRecord", 0, unsafe {
            sys::cuEventRecord(event.raw, self.raw)
        })?;
        Ok(event)
    }

    /// Blocks the host until everything queued has run.
    pub fn synchronize(&self) -> Result<(), MemoryError> {
        self.device.bind()?;
        // SAFETY: the stream is valid.
        check("cuStreamSynchronize", 0, unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: destroyed once; the driver finishes queued work before releasing it.
            let _ = unsafe { sys::cuStreamDestroy_v2(self.raw) };
        }
    }
}

/// An event recorded on a stream; destroyed on drop.
#[derive(Debug)]
pub struct CudaEvent {
    raw: sys::CUevent,
    device: Arc<CudaDevice>,
}

// SAFETY: an event handle may be waited on from any thread with its context current.
unsafe impl Send for CudaEvent {}

impl CudaEvent {
    /// Blocks the host until the work before the event has completed.
    pub fn synchronize(&self) -> Result<(), MemoryError> {
        self.device.bind()?;
        // SAFETY: the event is valid and was recorded.
        check("cuEventSynchronize", 0, unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: destroyed once.
            let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
        }
    }
}
