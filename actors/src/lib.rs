//! The actor runtime of `procmem`, on ractor + tokio.
//!
//! An embedding server depends on this crate alone: it re-exports the root crate (the
//! contract, the mechanisms and the pure policy) as [`procmem`]. Start at
//! [`MemoryManager::builder`].
//!
//! What a server uses:
//! - handles to spawn and call: [`MemoryManager`] (authorities, providers, supervised
//!   holders, bindings, Prometheus metrics, shutdown), [`GovernorHandle`] (one Governor per
//!   authority keeps the books), [`CpuProvider`] and [`CudaProvider`] (execution providers:
//!   a context and streams, each submission returning a fence), [`KvStoreHandle`] (the KV
//!   page store) and [`ResidencyHandle`] (model-weight residency), the two holders;
//! - the Grant/Lease protocol: [`Grant`], [`Lease`], [`CommitRefused`], and [`Charge`] to keep
//!   leases with the memory they pay for;
//! - buffers: [`DeviceBuffer`] (dropping one never frees before every fence that used it has
//!   completed; the Governor is refunded after the mechanism freed it) and
//!   [`procmem::fenced::Fenced`], the one owner of memory that outlives a fence;
//! - the holder protocol: [`PressureTicket`], [`PressureReport`] and the [`TicketInbox`] a
//!   holder registers;
//! - configs, errors and reports.
//!
//! Nothing else can reach an actor: its messages are private to this crate, so no caller can
//! go around the protocol (forge a release, answer for the Governor, wake a waiter). Each of
//! these does not compile:
//! ```compile_fail
//! # async fn forge(g: procmem_actors::GovernorHandle, lease: &procmem_actors::Lease) {
//! use procmem_actors::governor::GovernorMsg;
//! let release = GovernorMsg::Release { holder: lease.holder(), lease: lease.id(), bytes: 1, reply: None };
//! g.actor().send_message(release).unwrap();
//! # }
//! ```
//! ```compile_fail
//! # fn wake(g: procmem_actors::GovernorHandle) {
//! g.actor().send_message(procmem_actors::governor::GovernorMsg::WaiterDeadline).unwrap();
//! # }
//! ```
//! ```compile_fail
//! # fn expire(g: procmem_actors::GovernorHandle, ticket: procmem_actors::TicketId) {
//! let msg = procmem_actors::governor::GovernorMsg::TicketDeadline { ticket };
//! g.actor().send_message(msg).unwrap();
//! # }
//! ```
//! ```compile_fail
//! # fn recheck(kv: procmem_actors::KvStoreHandle, ticket: procmem_actors::PressureTicket) {
//! let msg = procmem_actors::kv_store::KvStoreMsg::RecheckTicket { ticket, rechecks: 0 };
//! kv.actor().send_message(msg).unwrap();
//! # }
//! ```
//! ```compile_fail
//! # fn granted(kv: procmem_actors::KvStoreHandle) {
//! let msg = procmem_actors::kv_store::KvStoreMsg::Granted { txn: 1, grant: Err(procmem_actors::GovernorError::Unavailable) };
//! kv.actor().send_message(msg).unwrap();
//! # }
//! ```
//! ```compile_fail
//! # fn crash(kv: procmem_actors::KvStoreHandle) {
//! kv.actor().send_message(procmem_actors::kv_store::KvStoreMsg::Crash).unwrap();
//! # }
//! ```
//! The handles give out only what supervises an actor (an `ActorCell`, to watch, stop or kill
//! it), which compiles:
//! ```
//! # fn watch(g: procmem_actors::GovernorHandle, kv: procmem_actors::KvStoreHandle) {
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
mod device_provider;
mod governor;
mod holder;
mod kv_store;
pub mod machine;
mod manager;
#[cfg(feature = "cluster")]
pub mod node;
mod pressure;
mod provider;
mod residency;
mod stream;

pub use buffer::{BufferView, DeviceBuffer};
pub use charge::{Charge, Tally};
pub use cuda_provider::{
    Cuda, CudaProvider, CudaProviderConfig, CudaStreamHandle, CudaSubmitError,
};
pub use deferred_free::{DeferredQueue, DeferredStats, DrainReport, StreamRegistry};
pub use device_provider::DeviceProvider;
pub use governor::{
    CommitRefused, CreditLine, GovernorConfig, GovernorError, GovernorHandle, GovernorSnapshot,
    Grant, Lease, ReserveRequest, Upstream, MAX_CREDIT,
};
pub use kv_store::{
    AttendItem, KvStep, KvStoreConfig, KvStoreError, KvStoreHandle, KvStoreStats, KvStream, Opened,
    PreemptMode, Restored, SeqId, StepKv, SwapKind, SwapSpace,
};
pub use manager::{
    Authority, AuthorityBooks, AuthorityReport, Capabilities, ManagerError, MemoryBinding,
    MemoryManager, MemoryManagerBuilder, ShutdownReport,
};
pub use pressure::{PressureReport, PressureTicket, TicketId, TicketInbox};
pub use procmem;
pub use provider::{
    Cpu, CpuProvider, CpuProviderConfig, OpenedDevice, Provider, ProviderError, ProviderKind,
    ProviderStream, WrongContext,
};
pub use residency::{
    Placement, ResidencyArgs, ResidencyConfig, ResidencyError, ResidencyHandle, ResidencyStats,
};
pub use stream::{fence_completed, CpuStream, StreamError};

// The README's embedding example compiles and runs as a doctest of this crate.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

// So does the embedding guide's whole request (docs/embedding.md).
#[cfg(doctest)]
#[doc = include_str!("../../docs/embedding.md")]
pub struct EmbeddingGuide;
