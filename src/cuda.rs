//! CUDA mechanisms over cudarc's driver API (dynamically loaded). Compiled always; usable only
//! where [`driver_present`] says the driver library exists. Without it, every entry point
//! returns [`MemoryError::NoCudaDriver`].

mod allocator;
mod backing;
mod driver;
mod kernels;
mod pinned;
mod stream;

use std::sync::Arc;

pub use allocator::CudaAllocator;
pub use backing::CudaVmmBacking;
pub use driver::{
    driver_present, AddressRange, CudaAccess, CudaDevice, DeviceMemory, PhysicalHandle,
};
pub use kernels::{DecodeKernels, DecodeLaunch, CUDA_MAX_HEAD_DIM, CUDA_SPLIT_TOKENS, DECODE_PTX};
pub use pinned::{BlockView, InFlightCopy, PinnedHost};
pub use stream::{CudaEvent, CudaStream, HostGate};

use crate::api::{
    Allocator, ContextId, MechanismId, MemoryError, MemoryMechanism, Place, SharedMapping,
    VirtualBacking,
};

/// One CUDA device as a mechanism: eager `cuMemAlloc` allocations, VMM on-demand mapping and
/// shared physical blocks (read-write or read-only; never copy-on-write).
pub struct CudaMechanism {
    id: MechanismId,
    context: ContextId,
    device: Arc<CudaDevice>,
    allocator: CudaAllocator,
    backing: Arc<CudaVmmBacking>,
}

impl CudaMechanism {
    /// Opens device `ordinal` with `prefill` physical handles pooled ahead of growth.
    pub fn new(ordinal: u32, prefill: usize) -> Result<Self, MemoryError> {
        let device = CudaDevice::open(ordinal)?;
        let id = MechanismId::fresh();
        let context = ContextId::fresh();
        Ok(CudaMechanism {
            id,
            context,
            allocator: CudaAllocator::new(id, context, Arc::clone(&device))?,
            backing: Arc::new(CudaVmmBacking::new(
                id,
                Arc::clone(&device),
                prefill,
                prefill.max(64),
            )?),
            device,
        })
    }

    /// The device.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// The provider context its allocations belong to.
    pub fn context(&self) -> ContextId {
        self.context
    }

    /// The VMM backing as a shareable handle.
    pub fn backing(&self) -> Arc<CudaVmmBacking> {
        Arc::clone(&self.backing)
    }
}

impl CudaMechanism {
    /// Bytes the driver holds for this mechanism: VMM handles mapped (the pool's unmapped
    /// spares aside) plus eager allocations not yet freed.
    pub fn driver_bytes(&self) -> u64 {
        self.backing.mapped_bytes() + self.allocator.live_bytes()
    }
}

impl MemoryMechanism for CudaMechanism {
    fn id(&self) -> MechanismId {
        self.id
    }

    fn place(&self) -> Place {
        Place::cuda(self.device.ordinal())
    }

    fn allocator(&self) -> &dyn Allocator {
        &self.allocator
    }

    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        Some(self.backing.as_ref())
    }

    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        Some(self.backing.as_ref())
    }
}
