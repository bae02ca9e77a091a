//! The actor runtime of `procmem`, on ractor + tokio: the memory manager an inference server
//! embeds to decide whether there is room, what to evict, and when a buffer may really be
//! freed, while its attention kernels see one flat KV buffer per layer.
//!
//! An embedding server depends on this crate alone: it re-exports the root crate (the
//! contract, the mechanisms and the pure policy) as [`procmem`]. Start at
//! [`MemoryManager::builder`]. The smallest use: a budget, a KV store, one sequence grown by
//! a step, and the books back at zero (the whole life of a request, with kernels and
//! pressure, is the embedding guide's example, also run as a doctest):
//!
//! ```
//! use procmem_actors::kv::{KvStoreConfig, StepEnd};
//! use procmem_actors::procmem::kv::{KvDtype, KvShape};
//! use procmem_actors::MemoryManager;
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let memory = MemoryManager::builder().host_budget(16 << 20).build().await?;
//! let shape = KvShape {
//!     layers: 2, q_heads: 4, kv_heads: 2, head_dim: 16, max_tokens: 256,
//!     k_dtype: KvDtype::F16, v_dtype: KvDtype::F16,
//! };
//! let kv = memory.kv_store(KvStoreConfig::new("kv", shape)).await?;
//! kv.open(1, vec![1, 2, 3], 0).await?;
//! // Room for one more token of sequence 1, mapped into its flat buffers under one grant.
//! let step = kv.prepare(vec![1]).await?;
//! assert_eq!(step.views(0, 0).expect("layer 0").k.tokens, 1);
//! step.complete(StepEnd::Submitted).await?; // (the server's kernels would run here)
//! kv.close(1);
//! assert!(memory.shutdown().await?.is_zero(), "every byte came back");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! At the root is what every server touches: the [`MemoryManager`] (authorities, providers,
//! supervised holders, bindings, Prometheus metrics, shutdown), its builder, reports and
//! errors, and [`Buffer`] (dropping one never frees before every fence that used it has
//! completed; the Governor is refunded after the mechanism freed it). The rest is under a
//! module named for what a server does with it:
//! - [`kv`]: the KV page store ([`KvStoreHandle`](kv::KvStoreHandle), its config, its
//!   steps and errors);
//! - [`residency`]: model-weight residency ([`ResidencyHandle`](residency::ResidencyHandle));
//! - [`governor`]: the books of one authority and the Grant/Lease protocol
//!   ([`GovernorHandle`](governor::GovernorHandle), [`Grant`](governor::Grant),
//!   [`Lease`](governor::Lease));
//! - [`provider`]: where memory lives and work runs ([`Provider`](provider::Provider), the one
//!   choice between the host's CPU provider and a CUDA device's), streams and their fences;
//! - [`holder`]: what writing a holder of one's own takes (pressure tickets and reports, the
//!   mailbox, [`Charge`](holder::Charge));
//! - [`machine`]: the machine's memory as the OS reports it; `node` (the `cluster` feature):
//!   one budget shared by several processes.
//!
//! Nothing else can reach an actor: its messages are private to this crate, so no caller can
//! go around the protocol (forge a release, answer for the Governor, wake a waiter). Each of
//! these does not compile:
//! ```compile_fail
//! # async fn forge(g: procmem_actors::governor::GovernorHandle, lease: &procmem_actors::governor::Lease) {
//! use procmem_actors::governor::GovernorMsg;
//! let release = GovernorMsg::Release { holder: lease.holder(), lease: lease.id(), bytes: 1, reply: None };
//! g.actor().send_message(release).unwrap();
//! # }
//! ```
//! ```compile_fail
//! # fn wake(g: procmem_actors::governor::GovernorHandle) {
//! g.actor().send_message(procmem_actors::governor::GovernorMsg::WaiterDeadline).unwrap();
//! # }
//! ```
//! ```compile_fail
//! # fn expire(g: procmem_actors::governor::GovernorHandle, ticket: procmem_actors::holder::TicketId) {
//! let msg = procmem_actors::governor::GovernorMsg::TicketDeadline { ticket };
//! g.actor().send_message(msg).unwrap();
//! # }
//! ```
//! ```compile_fail
//! # fn recheck(kv: procmem_actors::kv::KvStoreHandle, ticket: procmem_actors::holder::PressureTicket) {
//! let msg = procmem_actors::kv::KvStoreMsg::RecheckTicket { ticket, rechecks: 0 };
//! kv.actor().send_message(msg).unwrap();
//! # }
//! ```
//! ```compile_fail
//! # fn granted(kv: procmem_actors::kv::KvStoreHandle) {
//! let msg = procmem_actors::kv::KvStoreMsg::Granted { txn: 1, grant: Err(procmem_actors::governor::GovernorError::Unavailable) };
//! kv.actor().send_message(msg).unwrap();
//! # }
//! ```
//! ```compile_fail
//! # fn crash(kv: procmem_actors::kv::KvStoreHandle) {
//! kv.actor().send_message(procmem_actors::kv::KvStoreMsg::Crash).unwrap();
//! # }
//! ```
//! ```compile_fail
//! # fn wake(g: procmem_actors::governor::GovernorHandle) {
//! g.actor().send_message(procmem_actors::GovernorMsg::WaiterDeadline).unwrap();
//! # }
//! ```
//! ```compile_fail
//! # fn crash(kv: procmem_actors::kv::KvStoreHandle) {
//! kv.actor().send_message(procmem_actors::KvStoreMsg::Crash).unwrap();
//! # }
//! ```
//! ```compile_fail
//! # fn crash(r: procmem_actors::residency::ResidencyHandle) {
//! let (tx, _rx) = tokio::sync::oneshot::channel();
//! let msg = procmem_actors::residency::ResidencyMsg::Load { layer: 0, weights: vec![], pinned: true, reply: tx.into() };
//! r.actor().send_message(msg).unwrap();
//! # }
//! ```
//! The handles give out only what supervises an actor (an `ActorCell`, to watch, stop or kill
//! it), which compiles:
//! ```
//! # fn watch(g: procmem_actors::governor::GovernorHandle, kv: procmem_actors::kv::KvStoreHandle) {
//! let (_governor, _store) = (g.actor().get_id(), kv.actor().get_status());
//! # }
//! ```
#![deny(missing_docs, unreachable_pub, unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]
// One convention for modules: `foo.rs` beside `foo/`, never `foo/mod.rs`.
#![deny(clippy::mod_module_files)]

mod buffer;
mod charge;
mod cuda_provider;
mod deferred_free;
mod execution;
pub mod governor;
mod kv_store;
pub mod machine;
mod mailbox;
mod manager;
#[cfg(feature = "cluster")]
pub mod node;
mod provider_choice;
pub mod residency;
mod stream;
mod ticket;

pub use buffer::Buffer;
pub use manager::{
    Authority, AuthorityBooks, AuthorityReport, Capabilities, ManagerError, MemoryBinding,
    MemoryManager, MemoryManagerBuilder, Reserve, ShutdownReport,
};
pub use procmem;

/// The KV page store: one flat buffer per layer, grown by mapping, whose sequences a step
/// prepares, lends to the kernels and gets back after their fence.
pub mod kv {
    pub use crate::kv_store::{
        AttendItem, KvStep, KvStoreConfig, KvStoreError, KvStoreHandle, KvStoreStats, KvStream,
        NewTokens, Opened, PreemptMode, PrefixDisk, PrefixHost, Restored, SeqId, StepEnd, StepKv,
        SwapKind, SwapSpace, TableError,
    };
}

/// Where memory lives and work runs: [`Provider`](provider::Provider) is the one choice (the
/// host's CPU provider or a CUDA device's); its streams fence the work submitted to them, and
/// each stream's deferred-free actor frees a buffer only after its fences.
pub mod provider {
    pub use crate::buffer::BufferView;
    pub use crate::cuda_provider::{
        CudaProvider, CudaProviderConfig, CudaStreamHandle, CudaSubmitError,
    };
    pub use crate::deferred_free::{DeferredQueue, DeferredStats, DrainReport, StreamRegistry};
    pub use crate::execution::{
        CpuProvider, CpuProviderConfig, ProviderError, WrongContext, MAX_STREAMS, MAX_THREADS,
    };
    pub use crate::provider_choice::Provider;
    pub use crate::stream::{fence_completed, CpuStream, StreamError};

    /// How the two kinds of provider share one actor and handle. A server chooses with
    /// [`Provider`] and never names these; they are here for reading and for a new kind.
    pub mod kind {
        pub use crate::cuda_provider::Cuda;
        pub use crate::execution::{
            Cpu, OpenedMechanism, ProviderKind, ProviderOf, ProviderStream,
        };
    }
}

/// Writing a holder of one's own: the pressure tickets its Governor sends, the report it
/// answers with, the mailbox it registers, and the [`Charge`](holder::Charge) that keeps a
/// lease with the memory it pays for.
pub mod holder {
    pub use crate::__holder_mailbox as holder_mailbox;
    pub use crate::charge::{Charge, Tally};
    pub use crate::ticket::{PressureReport, PressureTicket, TicketId, TicketInbox};
}

// The README's embedding example compiles and runs as a doctest of this crate.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

// So does the embedding guide's whole request (docs/embedding.md).
#[cfg(doctest)]
#[doc = include_str!("../../docs/embedding.md")]
pub struct EmbeddingGuide;
