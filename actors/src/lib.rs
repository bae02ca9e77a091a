//! The actor runtime of `procmem`, on ractor + tokio.
//!
//! An embedding server depends on this crate alone: it re-exports the contract, the
//! mechanisms and the pure policy of the root crate as [`procmem`] (the root crate itself). Start at
//! [`MemoryManager::builder`].
//!
//! - [`manager`]: the ProcessMemoryManager: authorities, providers, supervised holders,
//!   bindings, Prometheus metrics, graceful shutdown.
//! - [`governor`]: one actor per authority keeping the books, queuing requests that do not
//!   fit and sending [`PressureTicket`]s to that authority's holders.
//! - [`provider`]: the CPU execution provider: a context and streams that run work in order
//!   on their own threads, each submission returning a fence.
//! - [`cuda_provider`]: the CUDA execution provider (used where a driver is present):
//!   CUDA streams fenced by recorded events, observed from the host.
//! - [`kv_store`]: the KV page store, a holder: virtually contiguous K/V per sequence and
//!   layer, one grant per step, shared prompt blocks, whole-unit victims under pressure.
//! - [`residency`]: model-weight residency, a holder: layers in device memory, cold
//!   unpinned ones offloaded to the host tier under pressure and reloaded before use.
//! - [`deferred_free`]: one actor per stream; nothing is freed before every fence that used
//!   it has completed, and the Governor is refunded only after the mechanism freed it.
#![deny(missing_docs, unreachable_pub, unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod buffer;
pub mod charge;
pub mod cuda_provider;
pub mod deferred_free;
pub mod governor;
pub mod kv_store;
pub mod manager;
pub mod pressure;
pub mod provider;
pub mod residency;
pub mod stream;

pub use buffer::{BufferView, DeviceBuffer};
pub use charge::{Charge, Tally};
pub use cuda_provider::{
    Cuda, CudaProvider, CudaProviderConfig, CudaStreamHandle, CudaSubmitError,
};
pub use deferred_free::{
    DeferredFree, DeferredFreeMsg, DeferredStats, DrainReport, StreamRegistry,
};
pub use governor::{
    CommitRefused, GovernorConfig, GovernorError, GovernorHandle, GovernorMsg, GovernorSnapshot,
    Grant, Lease, ReserveRequest,
};
pub use kv_store::{
    AttendItem, KvStoreConfig, KvStoreError, KvStoreHandle, KvStoreStats, Opened, PreemptMode,
    Restored, SeqId,
};
pub use manager::{
    machine_memory_bytes, Authority, AuthorityReport, Capabilities, ManagerError, MemoryBinding,
    MemoryManager, MemoryManagerBuilder, ShutdownReport,
};
pub use pressure::{PressureReport, PressureTicket, TicketId, TicketInbox};
pub use procmem;
pub use provider::{
    Cpu, CpuProvider, CpuProviderConfig, Provider, ProviderError, ProviderKind, ProviderStream,
    WrongContext,
};
pub use residency::{
    Placement, ResidencyArgs, ResidencyConfig, ResidencyError, ResidencyHandle, ResidencyStats,
};
pub use stream::{CpuStream, StreamError};

/// What a failed spawn of one of this crate's actors says: the error its startup returned
/// when that is an `E` (a bad shape, a Governor that refused the holder), otherwise the spawn
/// error itself (a panic during startup), wrapped by `other`.
pub(crate) fn startup_error<E>(
    error: ractor::SpawnErr,
    other: impl FnOnce(ractor::SpawnErr) -> E,
) -> E
where
    E: std::error::Error + Send + Sync + 'static,
{
    match error {
        ractor::SpawnErr::StartupFailed(inner) => match inner.downcast::<E>() {
            Ok(e) => *e,
            Err(inner) => other(ractor::SpawnErr::StartupFailed(inner)),
        },
        e => other(e),
    }
}
