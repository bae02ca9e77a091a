//! The server side of the Governor: the actor, its state and what it does with each message,
//! its supervisor, its metrics, and the constructors of [`GovernorHandle`](super::GovernorHandle)
//! that start one.
//!
//! It builds on the client (whose handles it hands out) and the protocol; neither builds on
//! it. Inside, `config` and `metrics` are below `state`, which declares the state; `queue`
//! (admission and the wait queue), `pressure` and `credit` each add to it; `actor` applies the
//! messages to it, `supervisor` restarts the actor, and `spawn` starts either.

mod actor;
mod config;
mod credit;
mod metrics;
mod queue;
mod reclaim;
mod spawn;
mod state;
mod supervisor;

pub use config::GovernorConfig;
