//! The one way to choose where a holder's memory lives and its work runs: [`Provider`], the
//! host's CPU provider or a CUDA device's. The KV store, model residency and the manager's
//! bindings all take it; the two kinds share one actor underneath
//! ([`ProviderOf`](crate::execution::ProviderOf)), which a server never has to name.

use procmem::ledger::{HolderId, Priority};
use procmem::{AllocationRequest, Allocator, MemoryMechanism, Place};
use ractor::ActorCell;
use tokio::time::Instant;

use crate::buffer::Buffer;
use crate::cuda_provider::CudaProvider;
use crate::deferred_free::DrainReport;
use crate::execution::{CpuProvider, ProviderError};
use crate::governor::GovernorHandle;

/// An execution provider, whichever kind: the host's CPU provider or a CUDA device's.
#[derive(Debug, Clone)]
pub enum Provider {
    /// Host memory; kernels are closures on the provider's CPU stream.
    Cpu(CpuProvider),
    /// GPU memory; the server launches its kernels on the provider's CUDA stream.
    Cuda(CudaProvider),
}

impl From<CpuProvider> for Provider {
    fn from(p: CpuProvider) -> Self {
        Provider::Cpu(p)
    }
}

impl From<CudaProvider> for Provider {
    fn from(p: CudaProvider) -> Self {
        Provider::Cuda(p)
    }
}

impl Provider {
    /// Where its memory lives.
    pub fn place(&self) -> Place {
        self.mechanism().place()
    }

    /// Its memory mechanism.
    pub fn mechanism(&self) -> &dyn MemoryMechanism {
        match self {
            Provider::Cpu(p) => p.mechanism(),
            Provider::Cuda(p) => p.mechanism(),
        }
    }

    /// Its actor (to watch or stop it).
    pub fn actor(&self) -> ActorCell {
        match self {
            Provider::Cpu(p) => p.actor(),
            Provider::Cuda(p) => p.actor(),
        }
    }

    /// Allocates `request` through its first stream, charged to `holder` with `governor`
    /// before anything is taken.
    pub async fn allocate(
        &self,
        governor: &GovernorHandle,
        holder: HolderId,
        request: &AllocationRequest,
        priority: Priority,
        deadline: Option<Instant>,
    ) -> Result<Buffer, ProviderError> {
        match self {
            Provider::Cpu(p) => {
                p.allocate(governor, holder, request, priority, deadline, 0)
                    .await
            }
            Provider::Cuda(p) => {
                p.allocate(governor, holder, request, priority, deadline, 0)
                    .await
            }
        }
    }

    /// Stops its streams after their submitted work and drains its deferred-free queues.
    pub async fn shutdown(&self) -> Result<DrainReport, ProviderError> {
        match self {
            Provider::Cpu(p) => p.shutdown().await,
            Provider::Cuda(p) => p.shutdown().await,
        }
    }

    /// Its allocator (whose copies reach allocations on any device).
    pub(crate) fn allocator(&self) -> &dyn Allocator {
        self.mechanism().allocator()
    }
}
