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

mod handles;
mod metrics;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::time::Duration;

use procmem::ledger::{
    AuthorityId, AuthoritySnapshot, Denial, GrantId, HolderId, LeaseId, Ledger, LedgerError,
    PressureRound, Priority, Retired, WaitQueue,
};
use procmem::MemoryRole;
use ractor::{
    Actor, ActorId, ActorProcessingErr, ActorRef, MessagingErr, RpcReplyPort, SupervisionEvent,
};
use tokio::time::Instant;

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
}

/// The Governor's mailbox.
#[derive(Debug)]
pub enum GovernorMsg {
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
    /// Sets the capacity; lowering it makes room by pressure, never by taking bytes.
    SetCapacity {
        /// New capacity in bytes.
        bytes: u64,
        /// Done.
        reply: Option<RpcReplyPort<()>>,
    },
    /// The books and the queue.
    Snapshot {
        /// The snapshot.
        reply: RpcReplyPort<GovernorSnapshot>,
    },
    /// A holder's answer to a ticket.
    PressureReport(PressureReport),
    /// A waiter's deadline passed (internal timer).
    WaiterDeadline {
        /// The waiter's place in the queue.
        seq: u64,
    },
    /// A ticket's deadline passed (internal timer).
    TicketDeadline {
        /// The ticket.
        ticket: TicketId,
    },
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
}

impl GovernorConfig {
    /// A Governor for `name` with `capacity` bytes and a 50 ms ticket timeout.
    pub fn new(name: impl Into<String>, capacity: u64) -> Self {
        GovernorConfig {
            name: name.into(),
            capacity,
            ticket_timeout: Duration::from_millis(50),
        }
    }
}

/// The Governor actor.
#[derive(Debug, Default)]
pub struct Governor;

struct Waiter {
    request: ReserveRequest,
    reply: RpcReplyPort<Result<Grant, GovernorError>>,
}

/// The Governor's mutable state.
pub struct GovernorState {
    ledger: Ledger,
    authority: AuthorityId,
    ticket_timeout: Duration,
    inboxes: HashMap<HolderId, TicketInbox>,
    waiters: WaitQueue<Waiter>,
    round: Option<PressureRound>,
    outstanding: Option<TicketId>,
    next_ticket: u64,
    tickets_sent: u64,
    counts: Counts,
    metrics: GovernorMetrics,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    grants: u64,
    denials: u64,
    waits: u64,
    freed_by_pressure: u64,
}

impl Actor for Governor {
    type Msg = GovernorMsg;
    type State = GovernorState;
    type Arguments = (Ledger, AuthorityId, GovernorConfig);

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        (ledger, authority, config): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let state = GovernorState {
            ledger,
            authority,
            ticket_timeout: config.ticket_timeout,
            inboxes: HashMap::new(),
            waiters: WaitQueue::default(),
            round: None,
            outstanding: None,
            next_ticket: 1,
            tickets_sent: 0,
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
                    .register_holder(state.authority, name, priority);
                if let (Ok(holder), Some(inbox)) = (&result, inbox) {
                    myself.get_cell().monitor(inbox.get_cell());
                    state.inboxes.insert(*holder, inbox);
                }
                let _ = reply.send(result);
            }
            GovernorMsg::UnregisterHolder { holder, reply } => {
                let result = state.retire(&myself, holder);
                if let Some(reply) = reply {
                    let _ = reply.send(result);
                }
            }
            GovernorMsg::Reserve { request, reply } => state.reserve(&myself, request, reply),
            GovernorMsg::Commit {
                holder,
                grant,
                actual_bytes,
                reply,
            } => match state.ledger.commit(holder, grant, actual_bytes) {
                Ok(lease) => {
                    let lease = Lease::new(myself.clone(), lease);
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
                    if let Some(round) = &mut state.round {
                        round.released(bytes);
                    }
                }
                if let Some(reply) = reply {
                    let _ = reply.send(result);
                }
            }
            GovernorMsg::SetCapacity { bytes, reply } => {
                state
                    .ledger
                    .set_capacity(state.authority, bytes)
                    .expect("own authority");
                state.round = None;
                if let Some(reply) = reply {
                    let _ = reply.send(());
                }
            }
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
                });
            }
            GovernorMsg::PressureReport(report) => {
                let freed = report.freed_now.saturating_add(report.freed_pending_fence);
                state.metrics.freed_by_pressure.increment(freed);
                state.counts.freed_by_pressure += freed;
                // Bytes freed now were released before the report (same sender, same
                // mailbox order); only those pending a fence are still to come.
                if let Some(round) = &mut state.round {
                    round.promised(report.freed_pending_fence);
                }
                if state.outstanding == Some(report.ticket) {
                    state.outstanding = None;
                }
                tracing::debug!(
                    ticket = report.ticket.get(),
                    freed_now = report.freed_now,
                    freed_pending_fence = report.freed_pending_fence,
                    "pressure report"
                );
            }
            GovernorMsg::WaiterDeadline { seq } => {
                if let Some(waiter) = state.waiters.remove(seq) {
                    state.metrics.denials.increment(1);
                    state.counts.denials += 1;
                    let denial = state.ledger.denial(state.authority, waiter.request.bytes);
                    let _ = waiter
                        .reply
                        .send(Err(GovernorError::DeadlineExpired(Box::new(denial))));
                }
            }
            GovernorMsg::TicketDeadline { ticket } => {
                if state.outstanding == Some(ticket) {
                    state.outstanding = None;
                }
            }
        }
        state.pump(&myself);
        state.drive_pressure(&myself);
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
            state.pump(&myself);
            state.drive_pressure(&myself);
            state.publish();
        }
        Ok(())
    }
}

impl GovernorState {
    fn retire(
        &mut self,
        myself: &ActorRef<GovernorMsg>,
        holder: HolderId,
    ) -> Result<Retired, LedgerError> {
        let result = self.ledger.retire_holder(holder);
        if let Some(inbox) = self.inboxes.remove(&holder) {
            if !self.inboxes.values().any(|i| i.get_id() == inbox.get_id()) {
                myself.get_cell().unmonitor(inbox.get_cell());
            }
        }
        result
    }

    fn reserve(
        &mut self,
        myself: &ActorRef<GovernorMsg>,
        request: ReserveRequest,
        reply: RpcReplyPort<Result<Grant, GovernorError>>,
    ) {
        let _span = tracing::debug_span!(
            "reserve",
            holder = %request.holder,
            bytes = request.bytes,
            priority = request.priority
        )
        .entered();
        if let Err(e) = self
            .ledger
            .check_reserve(request.holder, self.authority, request.bytes)
        {
            let _ = reply.send(Err(e.into()));
            return;
        }
        let may_jump = self
            .waiters
            .front_priority()
            .is_none_or(|front| request.priority > front);
        if may_jump
            && self
                .ledger
                .fits(self.authority, request.bytes)
                .unwrap_or(false)
        {
            self.grant(myself, request, reply);
            return;
        }
        let (capacity, _, _) = self.ledger.totals(self.authority).expect("own authority");
        let now = Instant::now();
        let waitable = request.bytes <= capacity && request.deadline.is_some_and(|d| d > now);
        if !waitable {
            self.metrics.denials.increment(1);
            self.counts.denials += 1;
            let denial = self.ledger.denial(self.authority, request.bytes);
            let _ = reply.send(Err(LedgerError::Denied(Box::new(denial)).into()));
            return;
        }
        let deadline = request.deadline.expect("checked above");
        let seq = self
            .waiters
            .push(request.priority, request.bytes, Waiter { request, reply });
        self.metrics.waits.increment(1);
        self.counts.waits += 1;
        // A new waiter starts a fresh round: holders asked before may have more to give now.
        self.round = None;
        myself.send_after(deadline - now, move || GovernorMsg::WaiterDeadline { seq });
    }

    /// Approves and replies; if the caller is gone, the grant goes straight back.
    fn grant(
        &mut self,
        myself: &ActorRef<GovernorMsg>,
        request: ReserveRequest,
        reply: RpcReplyPort<Result<Grant, GovernorError>>,
    ) {
        match self
            .ledger
            .reserve(request.holder, self.authority, request.role, request.bytes)
        {
            Ok(grant) => {
                self.metrics.grants.increment(1);
                self.counts.grants += 1;
                let grant = Grant::new(myself.clone(), grant);
                if let Err(MessagingErr::SendErr(Ok(grant))) = reply.send(Ok(grant)) {
                    let grant = grant.defuse();
                    let _ = self.ledger.cancel(grant.charge.holder, grant.id);
                    tracing::debug!(grant = %grant.id, "reserve reply undeliverable; grant rolled back");
                }
            }
            Err(e) => {
                let _ = reply.send(Err(e.into()));
            }
        }
    }

    /// Grants waiters in order while the first in line fits; drops waiters whose caller left.
    fn pump(&mut self, myself: &ActorRef<GovernorMsg>) {
        self.waiters.drain_where(|w| w.reply.is_closed());
        while let Some((_, bytes, _)) = self.waiters.front() {
            if !self.ledger.fits(self.authority, bytes).unwrap_or(false) {
                break;
            }
            let (_, waiter) = self.waiters.pop_front().expect("front exists");
            self.grant(myself, waiter.request, waiter.reply);
        }
    }

    /// Asks the next holder for the shortfall, one ticket at a time.
    fn drive_pressure(&mut self, myself: &ActorRef<GovernorMsg>) {
        if self.outstanding.is_some() {
            return;
        }
        let (capacity, provisional, leased) =
            self.ledger.totals(self.authority).expect("own authority");
        let shortfall = (provisional + leased)
            .saturating_add(self.waiters.bytes())
            .saturating_sub(capacity);
        if shortfall == 0 {
            self.round = None;
            return;
        }
        let round = self.round.get_or_insert_with(PressureRound::default);
        let wanted = round.still_wanted(shortfall);
        if wanted == 0 {
            return;
        }
        let holders: Vec<_> = self
            .ledger
            .holders_of(self.authority)
            .into_iter()
            .filter(|(h, _, _)| self.inboxes.contains_key(h))
            .collect();
        let now = Instant::now();
        let waiter_deadline = self
            .waiters
            .front()
            .and_then(|(_, _, w)| w.request.deadline);
        let priority = self.waiters.front_priority().unwrap_or(Priority::MAX);
        let deadline = waiter_deadline.map_or(now + self.ticket_timeout, |d| {
            d.min(now + self.ticket_timeout)
        });
        let _span = tracing::debug_span!("pressure", wanted, priority).entered();
        while let Some(holder) = round.next_holder(&holders) {
            round.asked(holder);
            let id = TicketId(self.next_ticket);
            self.next_ticket += 1;
            let ticket = PressureTicket {
                id,
                authority: self.authority,
                holder,
                bytes_wanted: wanted,
                priority,
                deadline,
                governor: myself.clone(),
            };
            if self.inboxes[&holder].send_message(ticket).is_ok() {
                self.outstanding = Some(id);
                self.tickets_sent += 1;
                self.metrics.tickets.increment(1);
                tracing::debug!(%holder, ticket = id.get(), wanted, "pressure ticket sent");
                myself.send_after(deadline.saturating_duration_since(now), move || {
                    GovernorMsg::TicketDeadline { ticket: id }
                });
                return;
            }
        }
    }

    fn publish(&self) {
        let (capacity, provisional, leased) =
            self.ledger.totals(self.authority).expect("own authority");
        self.metrics
            .publish(capacity, provisional, leased, self.waiters.len());
    }
}
