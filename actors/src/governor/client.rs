//! The client side of the Governor: the handles a holder keeps and calls through, and their
//! own account of what they hold.
//!
//! Its modules build on one another one way: `route` (where the Governor is) ← `account`
//! (what the handles hold, the credit lines' counters) ← `lease` (grants and leases, and the
//! mailbox type that carries them) ← `handle` ([`GovernorHandle`]) ← `credit` (credit lines,
//! opened through a handle). Only the protocol is below them; the
//! server, which starts Governors, is above.

mod account;
mod credit;
mod handle;
mod lease;
mod route;

pub use account::MAX_CREDIT;
pub(crate) use account::{Account, CreditShared};
pub use credit::CreditLine;
pub use handle::GovernorHandle;
pub(crate) use lease::GovernorMsg;
pub use lease::{CommitRefused, Grant, Lease};
