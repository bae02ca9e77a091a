//! The thin safe layer over the CUDA driver calls this crate uses, virtual memory management
//! above all. Every entry point checks for the driver library first: without it, a call into
//! `cudarc::driver::sys` would panic, so each returns [`MemoryError::NoCudaDriver`] instead.

use std::mem::MaybeUninit;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;

use crate::api::MemoryError;

/// Whether the CUDA driver library can be loaded on this machine (checked once).
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries to open the library by name; it calls nothing in it.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

pub(crate) fn require_driver(api: &'static str) -> Result<(), MemoryError> {
    if driver_present() {
        Ok(())
    } else {
        Err(MemoryError::NoCudaDriver { api })
    }
}

pub(crate) fn check(
    op: &'static str,
    bytes: u64,
    result: sys::CUresult,
) -> Result<(), MemoryError> {
    match result {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(MemoryError::OutOfMemory { op, bytes }),
        other => Err(MemoryError::Driver {
            op,
            code: format!("{other:?}"),
        }),
    }
}

/// How a mapping may be accessed from its device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaAccess {
    /// Read and write.
    ReadWrite,
    /// Read only: a kernel write faults.
    ReadOnly,
}

/// A device's memory as its driver reports it ([`CudaDevice::mem_info`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes free, for every process.
    pub free: u64,
    /// Bytes on the device.
    pub total: u64,
}

impl DeviceMemory {
    /// Bytes in use by every process.
    pub fn used(&self) -> u64 {
        self.total.saturating_sub(self.free)
    }
}

/// One CUDA device with its primary context retained for as long as this lives.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: u32,
    device: sys::CUdevice,
    context: sys::CUcontext,
}

// SAFETY: a CUdevice is an integer and a CUcontext a handle the driver lets any thread make
// current; every call made through this type binds the context on the calling thread first.
unsafe impl Send for CudaDevice {}
// SAFETY: as above; the driver API is thread-safe for these calls.
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    /// Opens device `ordinal`, retaining its primary context.
    pub fn open(ordinal: u32) -> Result<Arc<Self>, MemoryError> {
        require_driver("cuInit")?;
        // SAFETY: the driver library is present (checked above); cuInit(0) has no preconditions.
        check("cuInit", 0, unsafe { sys::cuInit(0) })?;
        let mut device = MaybeUninit::uninit();
        // SAFETY: `device` is a valid out-pointer; an invalid ordinal is reported as an error.
        check("cuDeviceGet", 0, unsafe {
            sys::cuDeviceGet(device.as_mut_ptr(), ordinal as i32)
        })?;
        // SAFETY: cuDeviceGet succeeded, so it wrote the handle.
        let device = unsafe { device.assume_init() };
        let mut context = MaybeUninit::uninit();
        // SAFETY: `device` is a valid handle and `context` a valid out-pointer.
        check("cuDevicePrimaryCtxRetain", 0, unsafe {
            sys::cuDevicePrimaryCtxRetain(context.as_mut_ptr(), device)
        })?;
        Ok(Arc::new(CudaDevice {
            ordinal,
            device,
            // SAFETY: retain succeeded, so it wrote the context.
            context: unsafe { context.assume_init() },
        }))
    }

    /// Number of CUDA devices (zero without a driver).
    pub fn count() -> u32 {
        if !driver_present() {
            return 0;
        }
        let mut n = 0;
        // SAFETY: the driver is present; `n` is a valid out-pointer.
        let ok = unsafe { sys::cuInit(0) } == sys::CUresult::CUDA_SUCCESS
            && unsafe { sys::cuDeviceGetCount(&mut n) } == sys::CUresult::CUDA_SUCCESS;
        if ok {
            n.max(0) as u32
        } else {
            0
        }
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Whether the device is integrated: its memory is the host's (unified memory), so host
    /// and device tiers must share one authority.
    pub fn is_integrated(&self) -> Result<bool, MemoryError> {
        let mut value = 0;
        // SAFETY: the device handle is valid and the out-pointer is valid.
        check("cuDeviceGetAttribute", 0, unsafe {
            sys::cuDeviceGetAttribute(
                &mut value,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED,
                self.device,
            )
        })?;
        Ok(value != 0)
    }

    /// Makes the context current on the calling thread.
    pub fn bind(&self) -> Result<(), MemoryError> {
        // SAFETY: the context is retained for as long as `self` lives.
        check("cuCtxSetCurrent", 0, unsafe {
            sys::cuCtxSetCurrent(self.context)
        })
    }

    fn allocation_prop(&self) -> sys::CUmemAllocationProp {
        // SAFETY: the struct is plain data for which all-zero is a valid (empty) value.
        let mut prop: sys::CUmemAllocationProp = unsafe { MaybeUninit::zeroed().assume_init() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = self.ordinal as i32;
        prop
    }

    /// The minimum mapping granularity, as the driver reports it.
    pub fn granularity(&self) -> Result<u64, MemoryError> {
        self.bind()?;
        let prop = self.allocation_prop();
        let mut granularity = 0usize;
        // SAFETY: `prop` describes device memory on this device; the out-pointer is valid.
        check("cuMemGetAllocationGranularity", 0, unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        Ok(granularity as u64)
    }

    /// The device's free and total memory, as the driver reports it.
    pub fn mem_info(&self) -> Result<DeviceMemory, MemoryError> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both out-pointers are valid; the context is current.
        check("cuMemGetInfo", 0, unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok(DeviceMemory {
            free: free as u64,
            total: total as u64,
        })
    }

    /// Reserves `size` bytes of device address space aligned to `alignment`.
    pub fn reserve(
        self: &Arc<Self>,
        size: u64,
        alignment: u64,
    ) -> Result<AddressRange, MemoryError> {
        self.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the out-pointer is valid; size and alignment are plain values the driver checks.
        check("cuMemAddressReserve", size, unsafe {
            sys::cuMemAddressReserve(&mut ptr, size as usize, alignment as usize, 0, 0)
        })?;
        Ok(AddressRange {
            ptr,
            size,
            device: Arc::clone(self),
        })
    }

    /// Creates a physical allocation of `size` bytes (a multiple of the granularity).
    pub fn create_handle(self: &Arc<Self>, size: u64) -> Result<PhysicalHandle, MemoryError> {
        self.bind()?;
        let prop = self.allocation_prop();
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `prop` is valid for this device and the out-pointer is valid.
        check("cuMemCreate", size, unsafe {
            sys::cuMemCreate(&mut handle, size as usize, &prop, 0)
        })?;
        Ok(PhysicalHandle {
            handle,
            size,
            device: Arc::clone(self),
        })
    }

    /// Maps `handle` at `ptr` and grants this device `access` to it.
    ///
    /// # Safety
    /// 1. `ptr..ptr + handle.size()` lies inside an [`AddressRange`] of this device and has
    ///    nothing mapped there.
    pub unsafe fn map(
        &self,
        ptr: u64,
        handle: &PhysicalHandle,
        access: CudaAccess,
    ) -> Result<(), MemoryError> {
        self.bind()?;
        // SAFETY: precondition 1.
        unsafe { self.map_without_access(ptr, handle)? };
        // SAFETY: the range was just mapped.
        let access = unsafe { self.set_access(ptr, handle.size, access) };
        if access.is_err() {
            // SAFETY: the range was mapped by the call above and nothing used it yet.
            let _ = unsafe { self.unmap(ptr, handle.size) };
        }
        access
    }

    /// Maps `handle` at `ptr` without granting any access yet (see [`CudaDevice::set_access`]):
    /// a growth maps each granule, then grants access to the whole chunk in one call.
    ///
    /// # Safety
    /// 1. `ptr..ptr + handle.size()` lies inside an [`AddressRange`] of this device and has
    ///    nothing mapped there.
    pub unsafe fn map_without_access(
        &self,
        ptr: u64,
        handle: &PhysicalHandle,
    ) -> Result<(), MemoryError> {
        self.bind()?;
        // SAFETY: precondition 1; the handle is alive for the duration of the call.
        check("cuMemMap", handle.size, unsafe {
            sys::cuMemMap(ptr, handle.size as usize, 0, handle.handle, 0)
        })
    }

    /// Grants this device `access` to `ptr..ptr + size`, which may span several mappings:
    /// one `cuMemSetAccess` for a whole chunk instead of one per granule.
    ///
    /// # Safety
    /// 1. Every byte of the range is mapped (by [`CudaDevice::map_without_access`] or
    ///    [`CudaDevice::map`]) on this device.
    pub unsafe fn set_access(
        &self,
        ptr: u64,
        size: u64,
        access: CudaAccess,
    ) -> Result<(), MemoryError> {
        self.bind()?;
        let desc = sys::CUmemAccessDesc {
            location: self.allocation_prop().location,
            flags: match access {
                CudaAccess::ReadWrite => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                CudaAccess::ReadOnly => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
            },
        };
        // SAFETY: precondition 1; `desc` is one valid descriptor.
        check("cuMemSetAccess", size, unsafe {
            sys::cuMemSetAccess(ptr, size as usize, &desc, 1)
        })
    }

    /// Unmaps `ptr..ptr + size`.
    ///
    /// # Safety
    /// 1. The range is exactly one earlier mapping (or several whole ones) of this device.
    /// 2. No work still pending on any stream uses it.
    pub unsafe fn unmap(&self, ptr: u64, size: u64) -> Result<(), MemoryError> {
        self.bind()?;
        // SAFETY: preconditions 1 and 2.
        check("cuMemUnmap", size, unsafe {
            sys::cuMemUnmap(ptr, size as usize)
        })
    }

    /// Copies host bytes to device memory, and returns once they are there.
    ///
    /// `cuMemcpyHtoD` from pageable memory may return once the bytes are staged, before they
    /// reach `dst`; and it runs on the legacy stream, which the providers' non-blocking
    /// streams are not ordered with. So the legacy stream is synchronized after it: work
    /// queued afterwards on any stream sees the bytes.
    ///
    /// # Safety
    /// 1. `dst..dst + src.len()` is mapped writable on this device.
    pub unsafe fn copy_to_device(&self, dst: u64, src: &[u8]) -> Result<(), MemoryError> {
        self.bind()?;
        // SAFETY: precondition 1; `src` is a valid host slice.
        check("cuMemcpyHtoD", src.len() as u64, unsafe {
            sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len())
        })?;
        // `CU_STREAM_LEGACY` is the handle 0x1 (cuda.h), valid wherever a stream is.
        let legacy = 0x1 as sys::CUstream;
        // SAFETY: the context is current; the legacy stream always exists in it.
        check("cuStreamSynchronize(CU_STREAM_LEGACY)", 0, unsafe {
            sys::cuStreamSynchronize(legacy)
        })
    }

    /// Copies device memory to host bytes (synchronously).
    ///
    /// # Safety
    /// 1. `src..src + dst.len()` is mapped readable on this device.
    pub unsafe fn copy_to_host(&self, dst: &mut [u8], src: u64) -> Result<(), MemoryError> {
        self.bind()?;
        // SAFETY: precondition 1; `dst` is a valid, writable host slice.
        check("cuMemcpyDtoH", dst.len() as u64, unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())
        })
    }

    /// Allocates `size` bytes the ordinary way (`cuMemAlloc`).
    pub fn alloc(&self, size: u64) -> Result<u64, MemoryError> {
        self.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the out-pointer is valid; the context is current.
        check("cuMemAlloc", size, unsafe {
            sys::cuMemAlloc_v2(&mut ptr, size as usize)
        })?;
        Ok(ptr)
    }

    /// Frees what [`CudaDevice::alloc`] returned.
    ///
    /// # Safety
    /// 1. `ptr` came from `alloc` on this device and is freed once.
    /// 2. No work still pending on any stream uses it.
    pub unsafe fn free(&self, ptr: u64) -> Result<(), MemoryError> {
        self.bind()?;
        // SAFETY: preconditions 1 and 2.
        check("cuMemFree", 0, unsafe { sys::cuMemFree_v2(ptr) })
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open`; every handle using the context held an Arc
        // to this device, so none is left.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

/// Reserved device address space; freed on drop (everything mapped in it must be unmapped first).
#[derive(Debug)]
pub struct AddressRange {
    ptr: u64,
    size: u64,
    device: Arc<CudaDevice>,
}

impl AddressRange {
    /// The first device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its length.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The device it belongs to.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }
}

impl Drop for AddressRange {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: the range came from cuMemAddressReserve and its owner unmapped everything
            // it mapped before dropping it.
            let _ = unsafe { sys::cuMemAddressFree(self.ptr, self.size as usize) };
        }
    }
}

/// What a CUDA backing's [`PhysicalBlock`](crate::api::PhysicalBlock) holds: its handle.
pub(super) struct CudaBlock {
    pub(super) handle: PhysicalHandle,
}

/// A physical allocation; released on drop (the driver keeps it alive while still mapped).
#[derive(Debug)]
pub struct PhysicalHandle {
    handle: sys::CUmemGenericAllocationHandle,
    size: u64,
    device: Arc<CudaDevice>,
}

impl PhysicalHandle {
    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for PhysicalHandle {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: the handle came from cuMemCreate and is released once, here.
            let _ = unsafe { sys::cuMemRelease(self.handle) };
        }
    }
}
