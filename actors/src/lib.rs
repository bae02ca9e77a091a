//! The actor runtime of `procmem`, on ractor + tokio.
//!
//! An embedding server depends on this crate alone: it re-exports the contract, the
//! mechanisms and the pure policy of the root crate as [`core`].
//!
//! - [`governor`]: one actor per authority keeping the books, queuing requests that do not
//!   fit and sending [`PressureTicket`]s to that authority's holders.
#![deny(missing_docs, unreachable_pub, unsafe_code)]

pub mod governor;
pub mod pressure;

pub use governor::{
    CommitRefused, Governor, GovernorConfig, GovernorError, GovernorHandle, GovernorMsg,
    GovernorSnapshot, Grant, Lease, ReserveRequest,
};
pub use pressure::{PressureReport, PressureTicket, TicketId, TicketInbox};
pub use procmem as core;
