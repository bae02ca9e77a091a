//! What both sides of the Governor share: the requests a holder makes, the mailbox they travel
//! in, the errors and snapshots that come back, and the one way a handle asks and waits.
//!
//! The mailbox's replies carry the client's owning handles (a grant, a lease, a credit line's
//! counter), which in turn reach the Governor through this mailbox; so the protocol names them
//! only as type parameters, and the client fixes them (`client::GovernorMsg`). This module
//! imports neither side.

use std::sync::Arc;

use procmem::ledger::{
    AuthoritySnapshot, Denial, GrantId, HolderId, HolderReport, LeaseId, LedgerError, Priority,
    Retired,
};
use procmem::MemoryRole;
use ractor::concurrency::OneshotReceiver;
use ractor::{MessagingErr, RpcReplyPort};
use tokio::time::Instant;

use crate::ticket::{PressureReport, TicketId, TicketInbox};

/// What a holder asks the Governor for.
#[derive(Debug, Clone)]
pub struct ReserveRequest {
    /// Who asks (registered with this Governor).
    pub holder: HolderId,
    /// What the bytes are for.
    pub role: MemoryRole,
    /// How many.
    pub bytes: u64,
    /// How much the request matters; waiters are served highest first.
    pub priority: Priority,
    /// How long it may wait for room; `None` means answer now.
    pub deadline: Option<Instant>,
}

/// Why the Governor did not grant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GovernorError {
    /// The ledger refused (denied, unknown or foreign handle, bad size).
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// The request waited until its deadline without room being made.
    #[error("deadline passed while waiting for room: {0}")]
    DeadlineExpired(Box<Denial>),
    /// The Governor actor is not running.
    #[error("the governor is not running")]
    Unavailable,
    /// The wait queue is full ({waiting} requests wait): try again later, or answer now.
    #[error("the governor's wait queue is full ({waiting} requests wait)")]
    Busy {
        /// Requests waiting.
        waiting: usize,
    },
    /// The holder was retired (or its actor died) while its request waited.
    #[error("{0} was retired while its request waited")]
    HolderRetired(HolderId),
}

/// The Governor's books plus its queue, at one moment.
#[derive(Debug, Clone)]
pub struct GovernorSnapshot {
    /// The ledger's view of the authority.
    pub books: AuthoritySnapshot,
    /// Requests waiting for room.
    pub waiting: usize,
    /// Bytes they want.
    pub waiting_bytes: u64,
    /// Pressure tickets sent so far.
    pub tickets_sent: u64,
    /// Grants issued so far.
    pub grants: u64,
    /// Requests denied so far (at once or at their deadline, and refused top-ups).
    pub denials: u64,
    /// Requests that had to wait for room.
    pub waits: u64,
    /// Bytes holders reported freed in answer to tickets.
    pub freed_by_pressure: u64,
    /// Credit the children hold unused now (part of `books.credit`).
    pub credit_unused: u64,
    /// Unused credit taken back so far to make room.
    pub credit_reclaimed: u64,
}

/// Where a Governor whose capacity is itself credit (a process under a node Governor) asks
/// for more: called with the bytes its waiters need beyond its capacity. The Governor then
/// asks its own holders only for what it holds over its capacity (the node decides who gives
/// back, through tickets that lower the capacity).
pub type Upstream = std::sync::Arc<dyn Fn(u64) + Send + Sync>;

/// What a restarted Governor is handed as its first message: each holder's report of what it
/// owns, with its ticket inbox. Only a Governor's supervisor makes one.
#[derive(Debug)]
pub(crate) struct Recovery(pub(crate) Vec<(HolderReport, Option<TicketInbox>)>);

/// The Governor's mailbox. `G`, `L` and `C` are what its replies hand out and its credit
/// lines share: the client's grant, lease and credit-line counter.
#[derive(Debug)]
pub(crate) enum GovernorMsg<G, L, C> {
    /// Registers a holder; with an inbox it receives pressure tickets and is watched, so its
    /// grants return at once if it dies.
    RegisterHolder {
        /// Name for diagnoses and metrics.
        name: String,
        /// Holder priority: less important holders are asked first under pressure.
        priority: Priority,
        /// Where its tickets go.
        inbox: Option<TicketInbox>,
        /// The new holder's identity.
        reply: RpcReplyPort<Result<HolderId, LedgerError>>,
    },
    /// Retires a holder: grants return now, leases as memory is freed.
    UnregisterHolder {
        /// Which holder.
        holder: HolderId,
        /// What was returned.
        reply: Option<RpcReplyPort<Result<Retired, LedgerError>>>,
    },
    /// Asks for a provisional grant.
    Reserve {
        /// The request.
        request: ReserveRequest,
        /// The grant, or why not.
        reply: RpcReplyPort<Result<G, GovernorError>>,
    },
    /// Turns a grant into a lease of the actual footprint.
    Commit {
        /// The grant's holder.
        holder: HolderId,
        /// The grant.
        grant: GrantId,
        /// Physical bytes really taken.
        actual_bytes: u64,
        /// The lease, or why not (the grant then stays as it was).
        reply: RpcReplyPort<Result<L, LedgerError>>,
    },
    /// Returns a grant unused.
    Cancel {
        /// The grant's holder.
        holder: HolderId,
        /// The grant.
        grant: GrantId,
        /// Bytes returned.
        reply: Option<RpcReplyPort<Result<u64, LedgerError>>>,
    },
    /// Releases leased bytes whose memory was actually freed.
    Release {
        /// The lease's holder.
        holder: HolderId,
        /// The lease.
        lease: LeaseId,
        /// Bytes freed.
        bytes: u64,
        /// Bytes left on the lease.
        reply: Option<RpcReplyPort<Result<u64, LedgerError>>>,
    },
    /// Opens a standing credit line (a lease of zero bytes) whose unused bytes are `shared`.
    OpenCredit {
        /// Its holder.
        holder: HolderId,
        /// What its bytes are for.
        role: MemoryRole,
        /// The child's unused bytes.
        shared: Arc<C>,
        /// The line's identity.
        reply: RpcReplyPort<Result<LeaseId, LedgerError>>,
    },
    /// Commits a grant into a credit line; `take` of it come back as a lease.
    TopUpCredit {
        /// The holder of both.
        holder: HolderId,
        /// The grant.
        grant: GrantId,
        /// The line.
        line: LeaseId,
        /// The line's role.
        role: MemoryRole,
        /// Bytes the caller takes at once.
        take: u64,
        /// The lease of `take` bytes.
        reply: RpcReplyPort<Result<L, LedgerError>>,
    },
    /// The child closed its line, `unused` bytes going back.
    CloseCredit {
        /// Its holder.
        holder: HolderId,
        /// The line.
        line: LeaseId,
        /// Unused bytes returned.
        unused: u64,
    },
    /// Sets the capacity; lowering it makes room by pressure, never by taking bytes.
    SetCapacity {
        /// New capacity in bytes.
        bytes: u64,
        /// Answered once the new capacity is in the books.
        reply: Option<RpcReplyPort<()>>,
    },
    /// Looks at the queue again (after the upstream changed).
    Nudge,
    /// The upstream had no room for what was asked: for a ticket's time the holders are asked
    /// for the whole shortfall, not only what is held over the capacity.
    UpstreamRefused,
    /// The books and the queue.
    Snapshot {
        /// The snapshot.
        reply: RpcReplyPort<GovernorSnapshot>,
    },
    /// A holder's answer to a ticket.
    PressureReport(PressureReport),
    /// The earliest waiter deadline passed (internal timer).
    WaiterDeadline,
    /// The first message of a restarted Governor: what the holders own (internal).
    Recover {
        /// Each holder's report and ticket inbox.
        recovery: Recovery,
    },
    /// A ticket's deadline passed (internal timer).
    TicketDeadline {
        /// The ticket.
        ticket: TicketId,
    },
}

// Local only (never sent across a cluster): with the `cluster` feature, ractor wants each
// message type to say so; without it, every type is a message.
#[cfg(feature = "cluster")]
impl<G, L, C> ractor::Message for GovernorMsg<G, L, C>
where
    G: Send + 'static,
    L: Send + 'static,
    C: Send + Sync + 'static,
{
}

impl<G, L, C> From<PressureReport> for GovernorMsg<G, L, C> {
    fn from(report: PressureReport) -> Self {
        GovernorMsg::PressureReport(report)
    }
}

impl<G, L, C> TryFrom<GovernorMsg<G, L, C>> for PressureReport {
    type Error = ();
    fn try_from(msg: GovernorMsg<G, L, C>) -> Result<Self, ()> {
        match msg {
            GovernorMsg::PressureReport(report) => Ok(report),
            _ => Err(()),
        }
    }
}

/// Sends, with `send`, the request `build` makes around a reply port, and waits for the
/// reply.
pub(crate) async fn ask<M, T: Send + 'static>(
    send: impl FnOnce(M) -> Result<(), MessagingErr<M>>,
    build: impl FnOnce(RpcReplyPort<T>) -> M,
) -> Result<T, GovernorError> {
    let (tx, rx) = ractor::concurrency::oneshot();
    answer(send(build(tx.into())), rx).await
}

/// Waits for the reply, on `rx`, to a request whose sending came out as `sent`: a Governor
/// that is not running, or drops the request, is [`GovernorError::Unavailable`].
pub(crate) async fn answer<M, T>(
    sent: Result<(), MessagingErr<M>>,
    rx: OneshotReceiver<T>,
) -> Result<T, GovernorError> {
    sent.map_err(|_| GovernorError::Unavailable)?;
    rx.await.map_err(|_| GovernorError::Unavailable)
}
