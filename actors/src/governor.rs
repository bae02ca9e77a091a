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
//! time, for the shortfall through [`PressureTicket`]s; each holder chooses its own victims
//! and may free nothing. Releases let waiters in. Replies carry owning handles: a [`Grant`]
//! that is dropped returns itself, a [`Lease`] that is dropped releases what it still holds,
//! and a reply whose caller is gone is rolled back on the spot.

mod address;
mod credit;
mod handles;
mod metrics;
mod state;
mod supervisor;
#[cfg(test)]
mod tests;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use procmem::ledger::admission::{self, Admission, AdmissionLimits, Ask, Front, Refusal};
use procmem::ledger::{
    AuthorityId, AuthoritySnapshot, Denial, GrantId, HolderId, LeaseId, Ledger, LedgerError,
    PressureRound, Priority, Retired, WaitQueue,
};
use procmem::MemoryRole;
use ractor::{
    Actor, ActorId, ActorProcessingErr, ActorRef, MessagingErr, RpcReplyPort, SupervisionEvent,
};
use tokio::time::Instant;

use address::Address;
pub(crate) use address::Recovery;
pub use address::Upstream;
pub use credit::{CreditLine, MAX_CREDIT};
pub use handles::{CommitRefused, GovernorHandle, Grant, Lease};

use crate::pressure::{PressureReport, PressureTicket, TicketId, TicketInbox};
use metrics::GovernorMetrics;

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

/// The Governor's mailbox.
#[derive(Debug)]
pub(crate) enum GovernorMsg {
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
        reply: RpcReplyPort<Result<Grant, GovernorError>>,
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
        reply: RpcReplyPort<Result<Lease, LedgerError>>,
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
        shared: Arc<credit::CreditShared>,
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
        reply: RpcReplyPort<Result<Lease, LedgerError>>,
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
impl ractor::Message for GovernorMsg {}

impl From<PressureReport> for GovernorMsg {
    fn from(report: PressureReport) -> Self {
        GovernorMsg::PressureReport(report)
    }
}

impl TryFrom<GovernorMsg> for PressureReport {
    type Error = ();
    fn try_from(msg: GovernorMsg) -> Result<Self, ()> {
        match msg {
            GovernorMsg::PressureReport(report) => Ok(report),
            _ => Err(()),
        }
    }
}

/// How to start a Governor.
#[derive(Debug, Clone)]
pub struct GovernorConfig {
    /// The authority's name (metrics label, diagnoses).
    pub name: String,
    /// Bytes it may approve.
    pub capacity: u64,
    /// How long one holder gets to answer a ticket before the next one is asked.
    pub ticket_timeout: Duration,
    /// Requests that may wait at once; more are refused with [`GovernorError::Busy`].
    pub max_waiters: usize,
}

impl GovernorConfig {
    /// A Governor for `name` with `capacity` bytes and a 50 ms ticket timeout.
    pub fn new(name: impl Into<String>, capacity: u64) -> Self {
        GovernorConfig {
            name: name.into(),
            capacity,
            ticket_timeout: Duration::from_millis(50),
            max_waiters: AdmissionLimits::default().max_waiters,
        }
    }
}

/// The Governor actor.
#[derive(Debug, Default)]
pub(crate) struct Governor;

type Timer = tokio::task::JoinHandle<Result<(), MessagingErr<GovernorMsg>>>;

struct Waiter {
    request: ReserveRequest,
    deadline: Instant,
    reply: RpcReplyPort<Result<Grant, GovernorError>>,
}

/// The Governor's mutable state.
pub(crate) struct GovernorState {
    ledger: Ledger,
    address: Arc<Address>,
    authority: AuthorityId,
    ticket_timeout: Duration,
    inboxes: HashMap<HolderId, TicketInbox>,
    waiters: WaitQueue<Waiter>,
    limits: AdmissionLimits,
    // Every waiter's deadline, earliest first, and the one timer set for the earliest.
    deadlines: BTreeSet<(Instant, u64)>,
    deadline_timer: Option<(Instant, Timer)>,
    // Whom was asked, and what each holder promised and has not released yet. The promises
    // outlive a round: bytes still on their way are never asked for again.
    round: PressureRound,
    outstanding: Option<(TicketId, Timer)>,
    next_ticket: u64,
    tickets_sent: u64,
    // What was last asked of the upstream, and when to ask again if still short.
    upstream_asked: (u64, Instant),
    counts: Counts,
    metrics: GovernorMetrics,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    grants: u64,
    denials: u64,
    waits: u64,
    freed_by_pressure: u64,
    credit_reclaimed: u64,
}

impl Actor for Governor {
    type Msg = GovernorMsg;
    type State = GovernorState;
    type Arguments = (Ledger, AuthorityId, GovernorConfig, Arc<Address>);

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        (ledger, authority, config, address): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let state = GovernorState {
            ledger,
            address,
            authority,
            ticket_timeout: config.ticket_timeout,
            inboxes: HashMap::new(),
            waiters: WaitQueue::default(),
            limits: AdmissionLimits {
                max_waiters: config.max_waiters,
                elastic: false,
            },
            deadlines: BTreeSet::new(),
            deadline_timer: None,
            round: PressureRound::default(),
            outstanding: None,
            next_ticket: 1,
            tickets_sent: 0,
            upstream_asked: (0, Instant::now()),
            counts: Counts::default(),
            metrics: GovernorMetrics::new(&config.name),
        };
        state.publish();
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        procmem::fault::panic_point("governor.handle");
        match message {
            GovernorMsg::RegisterHolder {
                name,
                priority,
                inbox,
                reply,
            } => {
                let result = state
                    .ledger
                    .register_holder(state.authority, name.clone(), priority);
                if let Ok(holder) = &result {
                    state
                        .address
                        .holder_registered(*holder, &name, priority, inbox.clone());
                    state.metrics.sync_holders(&state.ledger, state.authority);
                }
                if let (Ok(holder), Some(inbox)) = (&result, inbox) {
                    myself.get_cell().monitor(inbox.get_cell());
                    state.inboxes.insert(*holder, inbox);
                    // A new holder may have something to give.
                    state.round.changed();
                }
                let _ = reply.send(result);
            }
            GovernorMsg::UnregisterHolder { holder, reply } => {
                let result = state.retire(&myself, holder);
                if let Some(reply) = reply {
                    let _ = reply.send(result);
                }
            }
            GovernorMsg::Reserve { request, reply } => state.reserve(request, reply),
            GovernorMsg::Commit {
                holder,
                grant,
                actual_bytes,
                reply,
            } => match state.ledger.commit(holder, grant, actual_bytes) {
                Ok(lease) => {
                    // The grant leaves the account as the lease enters it: a restart in between
                    // must not count both.
                    let lease = Lease::committed(Arc::clone(&state.address), grant, lease);
                    if let Err(MessagingErr::SendErr(Ok(lease))) = reply.send(Ok(lease)) {
                        // The caller is gone: nobody owns the lease, so it goes back whole.
                        let (id, bytes) = lease.defuse();
                        let _ = state.ledger.release(holder, id, bytes);
                        tracing::debug!(%id, bytes, "commit reply undeliverable; lease rolled back");
                    }
                }
                Err(e) => {
                    if matches!(e, LedgerError::Denied(_)) {
                        state.metrics.denials.increment(1);
                        state.counts.denials += 1;
                    }
                    let _ = reply.send(Err(e));
                }
            },
            GovernorMsg::Cancel {
                holder,
                grant,
                reply,
            } => {
                let result = state.ledger.cancel(holder, grant);
                if let Some(reply) = reply {
                    let _ = reply.send(result);
                }
            }
            GovernorMsg::Release {
                holder,
                lease,
                bytes,
                reply,
            } => {
                let result = state.ledger.release(holder, lease, bytes);
                if result.is_ok() {
                    state.round.released(holder, bytes);
                    // Holders that had nothing to give may have some now.
                    state.round.changed();
                }
                if let Some(reply) = reply {
                    let _ = reply.send(result);
                }
            }
            GovernorMsg::OpenCredit {
                holder,
                role,
                shared,
                reply,
            } => state.open_credit(holder, role, shared, reply),
            GovernorMsg::TopUpCredit {
                holder,
                grant,
                line,
                role,
                take,
                reply,
            } => state.top_up_credit(holder, grant, line, role, take, reply),
            GovernorMsg::CloseCredit {
                holder,
                line,
                unused,
            } => state.close_credit(holder, line, unused),
            GovernorMsg::SetCapacity { bytes, reply } => {
                state
                    .ledger
                    .set_capacity(state.authority, bytes)
                    .expect("own authority");
                // A restarted Governor must start from this capacity, not the first one.
                state.address.capacity_set(bytes);
                state.round.changed();
                if let Some(reply) = reply {
                    let _ = reply.send(());
                }
            }
            GovernorMsg::Nudge => state.round.changed(),
            GovernorMsg::Snapshot { reply } => {
                let _ = reply.send(GovernorSnapshot {
                    books: state
                        .ledger
                        .snapshot(state.authority)
                        .expect("own authority"),
                    waiting: state.waiters.len(),
                    waiting_bytes: state.waiters.bytes(),
                    tickets_sent: state.tickets_sent,
                    grants: state.counts.grants,
                    denials: state.counts.denials,
                    waits: state.counts.waits,
                    freed_by_pressure: state.counts.freed_by_pressure,
                    credit_unused: state.credit_unused(),
                    credit_reclaimed: state.counts.credit_reclaimed,
                });
            }
            GovernorMsg::PressureReport(report) => {
                let freed = report.freed_now.saturating_add(report.freed_pending_fence);
                state.metrics.freed(report.holder, freed);
                state.counts.freed_by_pressure =
                    state.counts.freed_by_pressure.saturating_add(freed);
                // Bytes freed now were released before the report (same sender, same
                // mailbox order); only those pending a fence are still to come.
                // A promise counts only up to what the holder still holds here, and only until
                // a ticket's time has passed again (a timer then looks again): its release may
                // have come before this report, or never come.
                let held = state.ledger.approved_to(report.holder).unwrap_or(0);
                let promise = report.freed_pending_fence.min(held);
                if promise > 0 {
                    let until = Instant::now() + state.ticket_timeout;
                    state
                        .round
                        .promised(report.holder, promise, until.into_std());
                    let ticket = report.ticket;
                    myself.send_after(state.ticket_timeout, move || GovernorMsg::TicketDeadline {
                        ticket,
                    });
                }
                if state
                    .outstanding
                    .as_ref()
                    .is_some_and(|(t, _)| *t == report.ticket)
                {
                    if let Some((_, timer)) = state.outstanding.take() {
                        timer.abort();
                    }
                }
                tracing::debug!(
                    ticket = report.ticket.get(),
                    freed_now = report.freed_now,
                    freed_pending_fence = report.freed_pending_fence,
                    "pressure report"
                );
            }
            GovernorMsg::Recover { recovery } => state.recover(&myself, recovery),
            GovernorMsg::WaiterDeadline => {
                state.deadline_timer = None;
                state.expire_waiters(Instant::now());
            }
            GovernorMsg::TicketDeadline { ticket } => {
                if state
                    .outstanding
                    .as_ref()
                    .is_some_and(|(t, _)| *t == ticket)
                {
                    state.outstanding = None;
                }
            }
        }
        state.pump();
        state.drive_pressure(&myself);
        state.arm_deadline_timer(&myself);
        state.publish();
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // A watched holder died: its grants return now; its leases come back as the memory
        // they pay for is actually freed. The Governor itself keeps running.
        let dead: Option<ActorId> = match &event {
            SupervisionEvent::ActorTerminated(cell, _, _)
            | SupervisionEvent::ActorFailed(cell, _) => Some(cell.get_id()),
            _ => None,
        };
        if let Some(dead) = dead {
            let holders: Vec<HolderId> = state
                .inboxes
                .iter()
                .filter(|(_, inbox)| inbox.get_id() == dead)
                .map(|(h, _)| *h)
                .collect();
            for holder in holders {
                let _ = state.retire(&myself, holder);
                tracing::info!(%holder, "holder actor died; its grants were returned");
            }
            state.pump();
            state.drive_pressure(&myself);
            state.arm_deadline_timer(&myself);
            state.publish();
        }
        Ok(())
    }
}
