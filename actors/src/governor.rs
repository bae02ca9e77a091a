//! The Governor: one actor per authority (physical pool), wrapping the pure
//! [`Ledger`](procmem::ledger::Ledger).
//!
//! One actor per authority rather than one for all: pools are independent, so a burst of
//! requests or a slow pressure round on one GPU never queues behind another's, and each
//! mailbox stays a simple FIFO of one pool's events. Aliased tiers (unified memory) are one
//! authority, so they share one Governor.
//!
//! A request that fits is granted at once. One that does not waits, by priority then
//! arrival, until its deadline, while the Governor asks the authority's holders, one at a
//! time, for the shortfall through [`PressureTicket`](crate::holder::PressureTicket)s; each
//! holder chooses its own victims and may free nothing. Releases let waiters in. Replies carry
//! owning handles: a [`Grant`] that is dropped returns itself, a [`Lease`] that is dropped
//! releases what it still holds, and a reply whose caller is gone is rolled back on the spot.
//!
//! The module is two sides over one protocol, its imports running one way, server → client →
//! protocol:
//! - `protocol`: what both sides share: the requests, the mailbox, the errors and snapshots,
//!   and how a handle asks and waits;
//! - `client`: the handles a holder keeps ([`GovernorHandle`], [`Grant`], [`Lease`],
//!   [`CreditLine`]) and their account of what they hold, which a restarted Governor rebuilds
//!   its books from;
//! - `server`: the Governor actor and its state, its supervisor and metrics, and the
//!   constructors that start it ([`GovernorHandle::spawn`] and its kin).

mod client;
mod protocol;
mod server;
#[cfg(test)]
mod tests;

pub use client::{CommitRefused, CreditLine, GovernorHandle, Grant, Lease, MAX_CREDIT};
pub use protocol::{GovernorError, GovernorSnapshot, ReserveRequest, Upstream};
pub use server::GovernorConfig;
