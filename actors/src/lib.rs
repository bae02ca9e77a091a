//! The actor runtime of `procmem`.
//!
//! An embedding server depends on this crate alone: it re-exports the contract and the
//! mechanisms of the root crate as [`core`]. The Governor, holders, execution providers and
//! deferred-free actors land here as the runtime grows.
#![deny(missing_docs, unreachable_pub, unsafe_code)]

pub use procmem as core;
