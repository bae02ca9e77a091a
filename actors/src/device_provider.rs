//! The execution provider a holder runs on, whichever kind it is: what the KV store and model
//! residency take to live on the host or on a GPU.

use procmem::ledger::{HolderId, Priority};
use procmem::{AllocationRequest, DeviceAllocator, DeviceMemoryMechanism};
use tokio::time::Instant;

use crate::buffer::DeviceBuffer;
use crate::cuda_provider::CudaProvider;
use crate::governor::GovernorHandle;
use crate::provider::{CpuProvider, ProviderError};

/// The execution provider a holder's memory comes from (the KV store's, model residency's):
/// the host's or a CUDA device's.
#[derive(Debug, Clone)]
pub enum DeviceProvider {
    /// Host memory; kernels are closures on the provider's CPU stream.
    Host(CpuProvider),
    /// GPU memory; the server launches its kernels on the provider's CUDA stream.
    Cuda(CudaProvider),
}

impl From<CpuProvider> for DeviceProvider {
    fn from(p: CpuProvider) -> Self {
        DeviceProvider::Host(p)
    }
}

impl From<CudaProvider> for DeviceProvider {
    fn from(p: CudaProvider) -> Self {
        DeviceProvider::Cuda(p)
    }
}

impl DeviceProvider {
    /// Allocates `request` on the device, charged to `holder` with `governor`.
    pub(crate) async fn allocate(
        &self,
        governor: &GovernorHandle,
        holder: HolderId,
        request: &AllocationRequest,
        priority: Priority,
        deadline: Option<Instant>,
    ) -> Result<DeviceBuffer, ProviderError> {
        match self {
            DeviceProvider::Host(p) => {
                p.allocate(governor, holder, request, priority, deadline, 0)
                    .await
            }
            DeviceProvider::Cuda(p) => {
                p.allocate(governor, holder, request, priority, deadline, 0)
                    .await
            }
        }
    }

    /// The device's allocator (its copies reach allocations on any device).
    pub(crate) fn allocator(&self) -> &dyn DeviceAllocator {
        match self {
            DeviceProvider::Host(p) => p.mechanism().allocator(),
            DeviceProvider::Cuda(p) => p.mechanism().allocator(),
        }
    }
}
