//! # procmem: process memory for an inference runtime
//!
//! Four questions, four roles: *how memory is obtained* (mechanisms, here), *whether there
//! is room* (the Governor), *what to evict* (the holders), and *when freeing is safe* (the
//! execution provider and its deferred-free queues). This crate holds the contract and the
//! mechanisms, and the pure policy code: nothing here needs an async runtime, so every rule
//! can be tested synchronously. The actors live in `procmem-actors`, which re-exports this
//! crate.
//!
//! The KV cache is the reason for the virtual-memory layer: a [`VirtualBuffer`] reserves the
//! maximum length once and maps physical blocks in as tokens arrive, so the attention kernel
//! keeps one flat buffer per layer while growth costs a mapping call, never a copy.
//!
//! ```
//! # #[cfg(target_os = "linux")] {
//! use std::sync::Arc;
//! use procmem::host::HostMechanism;
//! use procmem::{MemoryRole, VirtualBuffer};
//!
//! let host = HostMechanism::new()?;
//! let mut kv = VirtualBuffer::new(host.backing(), 1 << 30, MemoryRole::KvCache)?;
//! let base = kv.addr();
//! kv.grow(kv.granularity() * 4)?;
//! kv.as_mut_slice()?[0] = 7;
//! kv.grow(kv.granularity())?;
//! assert_eq!(kv.addr(), base);
//! assert_eq!(kv.as_slice()?[0], 7);
//! assert_eq!(kv.resident_bytes()?, kv.len());
//! # }
//! # Ok::<(), procmem::MemoryError>(())
//! ```
#![deny(missing_docs, unreachable_pub, unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]
// One convention for modules: `foo.rs` beside `foo/`, never `foo/mod.rs`.
#![deny(clippy::mod_module_files)]

pub mod api;
#[allow(unsafe_code)]
pub mod cuda;
pub mod deferred;
pub mod fault;
pub mod fence;
pub mod fenced;
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
pub mod host;
pub mod kv;
pub mod ledger;
pub mod metrics;
#[allow(unsafe_code)]
pub mod virtual_memory;

pub use api::*;
pub use virtual_memory::granularity;
#[cfg(target_os = "linux")]
pub use virtual_memory::{HostBacking, VirtualBuffer, VirtualRange};
