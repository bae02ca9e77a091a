//! The Governor's state, and what it does with the messages that keep its books: holders
//! coming and going (and a restart's recovery), commits, cancels, releases, the capacity, a
//! snapshot. Admission and the wait queue, pressure, and credit lines are in their own modules.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use procmem::ledger::admission::AdmissionLimits;
use procmem::ledger::{
    AuthorityId, GrantId, HolderId, LeaseId, Ledger, LedgerError, PressureRound, Priority, Retired,
    Totals, WaitQueue,
};
use ractor::{ActorRef, MessagingErr, RpcReplyPort};
use tokio::time::Instant;

use super::config::GovernorConfig;
use super::metrics::GovernorMetrics;
use crate::governor::client::{Account, GovernorMsg, Grant, Lease};
use crate::governor::protocol::{GovernorError, GovernorSnapshot, Recovery, ReserveRequest};
use crate::ticket::{TicketId, TicketInbox};

/// A timer that sends the Governor a message.
pub(super) type Timer = tokio::task::JoinHandle<Result<(), MessagingErr<GovernorMsg>>>;

/// A request waiting for room.
pub(super) struct Waiter {
    pub(super) request: ReserveRequest,
    pub(super) deadline: Instant,
    pub(super) reply: RpcReplyPort<Result<Grant, GovernorError>>,
}

/// The Governor's mutable state.
pub(crate) struct GovernorState {
    pub(super) ledger: Ledger,
    pub(super) account: Arc<Account>,
    pub(super) authority: AuthorityId,
    pub(super) ticket_timeout: Duration,
    pub(super) inboxes: HashMap<HolderId, TicketInbox>,
    pub(super) waiters: WaitQueue<Waiter>,
    pub(super) limits: AdmissionLimits,
    // Every waiter's deadline, earliest first, and the one timer set for the earliest.
    pub(super) deadlines: BTreeSet<(Instant, u64)>,
    pub(super) deadline_timer: Option<(Instant, Timer)>,
    // Whom was asked, and what each holder promised and has not released yet. The promises
    // outlive a round: bytes still on their way are never asked for again.
    pub(super) round: PressureRound,
    pub(super) outstanding: Option<(TicketId, Timer)>,
    pub(super) next_ticket: u64,
    pub(super) tickets_sent: u64,
    // What was last asked of the upstream, and when to ask again if still short.
    pub(super) upstream_asked: (u64, Instant),
    // Until when the upstream is taken to have no room (it refused an ask).
    pub(super) upstream_dry_until: Instant,
    pub(super) counts: Counts,
    pub(super) metrics: GovernorMetrics,
}

/// What the Governor counted so far (its snapshot's counters).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Counts {
    pub(super) grants: u64,
    pub(super) denials: u64,
    pub(super) waits: u64,
    pub(super) freed_by_pressure: u64,
    pub(super) credit_reclaimed: u64,
}

impl GovernorState {
    /// A Governor's state over `ledger`, keeping the books of `authority`; its handles hold
    /// what `account` records.
    pub(super) fn new(
        ledger: Ledger,
        authority: AuthorityId,
        config: &GovernorConfig,
        account: Arc<Account>,
    ) -> Self {
        GovernorState {
            ledger,
            account,
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
            upstream_dry_until: Instant::now(),
            counts: Counts::default(),
            metrics: GovernorMetrics::new(&config.name),
        }
    }

    /// After any message: grants whom it can, asks for what is still missing, keeps the
    /// deadline timer and the metrics current.
    pub(super) fn settle(&mut self, myself: &ActorRef<GovernorMsg>) {
        self.pump();
        self.drive_pressure(myself);
        self.arm_deadline_timer(myself);
        self.publish();
    }

    /// Registers a holder; with an inbox, it is watched and receives tickets.
    pub(super) fn register_holder(
        &mut self,
        myself: &ActorRef<GovernorMsg>,
        name: String,
        priority: Priority,
        inbox: Option<TicketInbox>,
        reply: RpcReplyPort<Result<HolderId, LedgerError>>,
    ) {
        let result = self
            .ledger
            .register_holder(self.authority, name.clone(), priority);
        if let Ok(holder) = &result {
            self.account
                .holder_registered(*holder, &name, priority, inbox.clone());
            self.metrics.sync_holders(&self.ledger, self.authority);
        }
        if let (Ok(holder), Some(inbox)) = (&result, inbox) {
            myself.get_cell().monitor(inbox.get_cell());
            self.inboxes.insert(*holder, inbox);
            // A new holder may have something to give.
            self.round.changed();
        }
        let _ = reply.send(result);
    }

    pub(super) fn retire(
        &mut self,
        myself: &ActorRef<GovernorMsg>,
        holder: HolderId,
    ) -> Result<Retired, LedgerError> {
        // Its credit lines close: unused bytes return now, used ones as they are released.
        self.close_lines_of(holder);
        let result = self.ledger.retire_holder(holder);
        if result.is_ok() {
            self.account.holder_retired(holder);
            self.round.forget(holder);
            self.metrics.sync_holders(&self.ledger, self.authority);
        }
        // Its waiting requests can never be granted: answer them now rather than let them
        // hold the queue until their deadlines.
        let gone = self.waiters.drain_where(|w| w.request.holder == holder);
        if !gone.is_empty() {
            self.forget_stale_deadlines();
        }
        for waiter in gone {
            let _ = waiter.reply.send(Err(GovernorError::HolderRetired(holder)));
        }
        if let Some(inbox) = self.inboxes.remove(&holder) {
            if !self.inboxes.values().any(|i| i.get_id() == inbox.get_id()) {
                myself.get_cell().unmonitor(inbox.get_cell());
            }
        }
        result
    }

    /// A watched holder actor died: its grants return now; its leases come back as the
    /// memory they pay for is actually freed.
    pub(super) fn holder_died(&mut self, myself: &ActorRef<GovernorMsg>, dead: ractor::ActorId) {
        let holders: Vec<HolderId> = self
            .inboxes
            .iter()
            .filter(|(_, inbox)| inbox.get_id() == dead)
            .map(|(h, _)| *h)
            .collect();
        for holder in holders {
            let _ = self.retire(myself, holder);
            tracing::info!(%holder, "holder actor died; its grants were returned");
        }
    }

    /// Rebuilds the books of a restarted Governor from what the holders own, re-watches the
    /// holders that are alive and retires those that died meanwhile.
    pub(super) fn recover(&mut self, myself: &ActorRef<GovernorMsg>, recovery: Recovery) {
        let mut refused = 0usize;
        let mut dead = Vec::new();
        for (report, inbox) in recovery.0 {
            if let Err(error) = self.ledger.recover_holder(self.authority, &report) {
                refused += 1;
                tracing::error!(holder = %report.holder, %error, "a holder's report was refused");
                continue;
            }
            if let Some(inbox) = inbox {
                // Watch first, then look: a holder that stops after this is reported by the
                // monitor, one already stopping or stopped is retired now.
                myself.get_cell().monitor(inbox.get_cell());
                if inbox.get_status() == ractor::ActorStatus::Running {
                    self.inboxes.insert(report.holder, inbox);
                } else {
                    myself.get_cell().unmonitor(inbox.get_cell());
                    dead.push(report.holder);
                }
            }
        }
        for holder in dead {
            let _ = self.retire(myself, holder);
        }
        self.metrics.sync_holders(&self.ledger, self.authority);
        let Totals {
            provisional,
            leased,
            ..
        } = self.ledger.totals(self.authority).unwrap_or_default();
        match self.ledger.check_invariants() {
            Ok(()) => tracing::info!(
                provisional,
                leased,
                refused,
                "books rebuilt from the holders"
            ),
            Err(e) => tracing::error!(%e, "rebuilt books are inconsistent"),
        }
    }

    /// Turns a grant into a lease; if the caller is gone, the lease goes back whole.
    pub(super) fn commit(
        &mut self,
        holder: HolderId,
        grant: GrantId,
        actual_bytes: u64,
        reply: RpcReplyPort<Result<Lease, LedgerError>>,
    ) {
        match self.ledger.commit(holder, grant, actual_bytes) {
            Ok(lease) => {
                // The grant leaves the account as the lease enters it: a restart in between
                // must not count both.
                let lease = Lease::committed(Arc::clone(&self.account), grant, lease);
                if let Err(MessagingErr::SendErr(Ok(lease))) = reply.send(Ok(lease)) {
                    // The caller is gone: nobody owns the lease, so it goes back whole.
                    let (id, bytes) = lease.defuse();
                    let _ = self.ledger.release(holder, id, bytes);
                    tracing::debug!(%id, bytes, "commit reply undeliverable; lease rolled back");
                }
            }
            Err(e) => {
                if matches!(e, LedgerError::Denied(_)) {
                    self.metrics.denials.increment(1);
                    self.counts.denials += 1;
                }
                let _ = reply.send(Err(e));
            }
        }
    }

    /// Returns a grant unused.
    pub(super) fn cancel(
        &mut self,
        holder: HolderId,
        grant: GrantId,
        reply: Option<RpcReplyPort<Result<u64, LedgerError>>>,
    ) {
        let result = self.ledger.cancel(holder, grant);
        if let Some(reply) = reply {
            let _ = reply.send(result);
        }
    }

    /// Releases leased bytes whose memory was freed.
    pub(super) fn release(
        &mut self,
        holder: HolderId,
        lease: LeaseId,
        bytes: u64,
        reply: Option<RpcReplyPort<Result<u64, LedgerError>>>,
    ) {
        let result = self.ledger.release(holder, lease, bytes);
        if result.is_ok() {
            self.round.released(holder, bytes);
            // Holders that had nothing to give may have some now.
            self.round.changed();
        }
        if let Some(reply) = reply {
            let _ = reply.send(result);
        }
    }

    /// Sets the capacity; lowering it makes room by pressure, never by taking bytes.
    pub(super) fn set_capacity(&mut self, bytes: u64, reply: Option<RpcReplyPort<()>>) {
        self.ledger
            .set_capacity(self.authority, bytes)
            .expect("own authority");
        // A restarted Governor must start from this capacity, not the first one.
        self.account.capacity_set(bytes);
        self.round.changed();
        if let Some(reply) = reply {
            let _ = reply.send(());
        }
    }

    /// The books and the queue.
    pub(super) fn snapshot(&self) -> GovernorSnapshot {
        GovernorSnapshot {
            books: self.ledger.snapshot(self.authority).expect("own authority"),
            waiting: self.waiters.len(),
            waiting_bytes: self.waiters.bytes(),
            tickets_sent: self.tickets_sent,
            grants: self.counts.grants,
            denials: self.counts.denials,
            waits: self.counts.waits,
            freed_by_pressure: self.counts.freed_by_pressure,
            credit_unused: self.credit_unused(),
            credit_reclaimed: self.counts.credit_reclaimed,
        }
    }

    pub(super) fn publish(&self) {
        let Totals {
            capacity,
            provisional,
            leased,
        } = self.ledger.totals(self.authority).expect("own authority");
        let credit = self.ledger.credit_bytes(self.authority);
        self.metrics
            .publish(capacity, provisional, leased, credit, self.waiters.len());
        self.metrics.publish_holders(&self.ledger);
    }
}
