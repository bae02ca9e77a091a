//! Admission and the wait queue: a request that fits is granted at once, one that does not
//! waits, by priority then arrival, until its deadline (one timer, set for the earliest).

use std::sync::Arc;

use procmem::ledger::admission::{self, Admission, AdmissionLimits, Ask, Front, Refusal};
use procmem::ledger::{Denial, LedgerError};
use ractor::{ActorRef, MessagingErr, RpcReplyPort};
use tokio::time::Instant;

use super::state::{GovernorState, Waiter};
use crate::governor::client::{GovernorMsg, Grant};
use crate::governor::protocol::{GovernorError, ReserveRequest};

impl GovernorState {
    pub(super) fn reserve(
        &mut self,
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
        // Unused credit goes back before a request is refused or made to wait for it.
        let short = self
            .ledger
            .shortfall(self.authority, request.bytes)
            .unwrap_or(0);
        if short > 0 {
            self.reclaim_credit(short);
        }
        let now = Instant::now();
        let ask = Ask {
            bytes: request.bytes,
            priority: request.priority,
            deadline: request.deadline.map(Instant::into_std),
        };
        match admission::admit(
            &self.ledger,
            self.authority,
            &self.waiters,
            ask,
            now.into_std(),
            self.limits(),
        ) {
            Admission::GrantNow => self.grant(request, reply),
            Admission::Deny(Refusal::Busy) => {
                let busy = GovernorError::Busy {
                    waiting: self.waiters.len(),
                };
                self.refuse(reply, busy);
            }
            Admission::Deny(Refusal::NoRoom | Refusal::NeverFits) => {
                let denied = LedgerError::Denied(self.denial_for(request.bytes)).into();
                self.refuse(reply, denied);
            }
            Admission::Wait => {
                let deadline = request
                    .deadline
                    .expect("only a request with a deadline waits");
                let (priority, bytes) = (request.priority, request.bytes);
                let seq = self.waiters.push(
                    priority,
                    bytes,
                    Waiter {
                        request,
                        deadline,
                        reply,
                    },
                );
                self.deadlines.insert((deadline, seq));
                self.metrics.waits.increment(1);
                self.counts.waits += 1;
                // A new waiter: holders asked before may have more to give now.
                self.round.changed();
            }
        }
    }

    /// The admission limits now: with an upstream the capacity is elastic.
    pub(super) fn limits(&self) -> AdmissionLimits {
        AdmissionLimits {
            elastic: self.account.route().has_upstream(),
            ..self.limits
        }
    }

    /// The earliest waiter deadline passed.
    pub(super) fn waiter_deadline(&mut self) {
        self.deadline_timer = None;
        self.expire_waiters(Instant::now());
    }

    /// Denies every waiter whose deadline is at or before `now`.
    pub(super) fn expire_waiters(&mut self, now: Instant) {
        while let Some(&(deadline, seq)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_first();
            if let Some(waiter) = self.waiters.remove(seq) {
                let expired = GovernorError::DeadlineExpired(self.denial_for(waiter.request.bytes));
                self.refuse(waiter.reply, expired);
            }
        }
    }

    /// Why `bytes` do not fit now: the books and the bytes still queued ahead.
    fn denial_for(&self, bytes: u64) -> Box<Denial> {
        let mut denial = self.ledger.denial(self.authority, bytes);
        denial.waiting = self.waiters.bytes();
        Box::new(denial)
    }

    /// Refuses a request (counted as a denial) with `error`.
    fn refuse(&mut self, reply: RpcReplyPort<Result<Grant, GovernorError>>, error: GovernorError) {
        self.metrics.denials.increment(1);
        self.counts.denials += 1;
        let _ = reply.send(Err(error));
    }

    /// Keeps one timer, set for the earliest waiter deadline.
    pub(super) fn arm_deadline_timer(&mut self, myself: &ActorRef<GovernorMsg>) {
        let earliest = self.deadlines.first().map(|(d, _)| *d);
        match (&self.deadline_timer, earliest) {
            (Some((at, _)), Some(e)) if *at == e => return,
            (None, None) => return,
            _ => {}
        }
        if let Some((_, timer)) = self.deadline_timer.take() {
            timer.abort();
        }
        if let Some(e) = earliest {
            let wait = e.saturating_duration_since(Instant::now());
            let timer = myself.send_after(wait, || GovernorMsg::WaiterDeadline);
            self.deadline_timer = Some((e, timer));
        }
    }

    /// Approves and replies; if the caller is gone, the grant goes straight back.
    fn grant(
        &mut self,
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
                let grant = Grant::new(Arc::clone(&self.account), grant);
                if let Err(MessagingErr::SendErr(Ok(grant))) = reply.send(Ok(grant)) {
                    let grant = grant.defuse();
                    let _ = self.ledger.cancel(grant.claim.holder, grant.id);
                    tracing::debug!(grant = %grant.id, "reserve reply undeliverable; grant rolled back");
                }
            }
            Err(e) => {
                let _ = reply.send(Err(e.into()));
            }
        }
    }

    /// Grants waiters in order while the first in line fits, and denies a first in line that
    /// can never fit (the capacity was lowered below it) instead of letting it block the
    /// queue. A grant whose caller left is rolled back by `grant`.
    pub(super) fn pump(&mut self) {
        loop {
            let limits = self.limits();
            match admission::front(&self.ledger, self.authority, &self.waiters, limits) {
                Front::Grant(seq) => {
                    let waiter = self.waiters.remove(seq).expect("front exists");
                    self.deadlines.remove(&(waiter.deadline, seq));
                    self.grant(waiter.request, waiter.reply);
                }
                Front::Deny(seq) => {
                    let waiter = self.waiters.remove(seq).expect("front exists");
                    self.deadlines.remove(&(waiter.deadline, seq));
                    let denied = LedgerError::Denied(self.denial_for(waiter.request.bytes));
                    self.refuse(waiter.reply, denied.into());
                }
                Front::Wait => {
                    // A first in line whose caller left (a holder calling off a step it no
                    // longer needs) must not hold up those behind it until its deadline.
                    let gone = self
                        .waiters
                        .front()
                        .is_some_and(|f| f.item.reply.is_closed());
                    if !gone {
                        return;
                    }
                    self.sweep_closed_waiters();
                }
                Front::Empty => return,
            }
        }
    }

    /// Forgets waiters whose caller left (they would only inflate the shortfall).
    pub(super) fn sweep_closed_waiters(&mut self) {
        if !self.waiters.drain_where(|w| w.reply.is_closed()).is_empty() {
            self.forget_stale_deadlines();
        }
    }

    pub(super) fn forget_stale_deadlines(&mut self) {
        let waiters = &self.waiters;
        self.deadlines
            .retain(|(_, seq)| waiters.get(*seq).is_some());
    }
}
