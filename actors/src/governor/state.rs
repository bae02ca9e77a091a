//! What the Governor does with each message: admission, the wait queue and its deadlines,
//! pressure rounds, retirement and recovery. The actor (`Governor::handle`) applies these.

use super::*;

impl GovernorState {
    pub(super) fn retire(
        &mut self,
        myself: &ActorRef<GovernorMsg>,
        holder: HolderId,
    ) -> Result<Retired, LedgerError> {
        // Its credit lines close: unused bytes return now, used ones as they are released.
        self.close_lines_of(holder);
        let result = self.ledger.retire_holder(holder);
        if result.is_ok() {
            self.address.holder_retired(holder);
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
        let (_, provisional, leased) = self.ledger.totals(self.authority).unwrap_or_default();
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
                let grant = Grant::new(Arc::clone(&self.address), grant);
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
                        .is_some_and(|(_, _, w)| w.reply.is_closed());
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
    fn sweep_closed_waiters(&mut self) {
        if !self.waiters.drain_where(|w| w.reply.is_closed()).is_empty() {
            self.forget_stale_deadlines();
        }
    }

    fn forget_stale_deadlines(&mut self) {
        let waiters = &self.waiters;
        self.deadlines
            .retain(|(_, seq)| waiters.get(*seq).is_some());
    }

    /// Asks the next holder for the shortfall, one ticket at a time.
    pub(super) fn drive_pressure(&mut self, myself: &ActorRef<GovernorMsg>) {
        if self.outstanding.is_some() {
            return;
        }
        if admission::shortfall(&self.ledger, self.authority, &self.waiters) > 0 {
            self.sweep_closed_waiters();
        }
        let mut shortfall = admission::shortfall(&self.ledger, self.authority, &self.waiters);
        if shortfall > 0 && self.reclaim_credit(shortfall) > 0 {
            // Unused credit came back before any holder is asked to evict.
            self.pump();
            shortfall = admission::shortfall(&self.ledger, self.authority, &self.waiters);
        }
        if let Some(upstream) = self.address.upstream() {
            shortfall = self.ask_upstream(&upstream, shortfall);
        }
        if shortfall == 0 {
            // Room for everyone: the next shortfall starts a new round (promises stay).
            self.round.ask_again();
            return;
        }
        let round = &mut self.round;
        round.expire(Instant::now().into_std());
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
                answer_to: myself.get_derived(),
            };
            let sent = self
                .inboxes
                .get(&holder)
                .is_some_and(|inbox| inbox.send_message(ticket).is_ok());
            if sent {
                self.tickets_sent += 1;
                self.metrics.ticket_sent(holder);
                tracing::debug!(%holder, ticket = id.get(), wanted, "pressure ticket sent");
                let timer = myself.send_after(deadline.saturating_duration_since(now), move || {
                    GovernorMsg::TicketDeadline { ticket: id }
                });
                self.outstanding = Some((id, timer));
                return;
            }
        }
    }

    /// The admission limits now: with an upstream the capacity is elastic.
    fn limits(&self) -> AdmissionLimits {
        AdmissionLimits {
            elastic: self.address.has_upstream(),
            ..self.limits
        }
    }

    /// With an upstream, what waiters need beyond the capacity is asked of it (again after a
    /// ticket's time if still short); only bytes held over the capacity are asked of the
    /// holders. Returns that.
    fn ask_upstream(&mut self, upstream: &Upstream, shortfall: u64) -> u64 {
        let (capacity, provisional, leased) =
            self.ledger.totals(self.authority).unwrap_or_default();
        let over = provisional.saturating_add(leased).saturating_sub(capacity);
        let need = shortfall.saturating_sub(over);
        let now = Instant::now();
        if need > 0 && (need != self.upstream_asked.0 || now >= self.upstream_asked.1) {
            self.upstream_asked = (need, now + self.ticket_timeout);
            upstream(need);
        } else if need == 0 {
            self.upstream_asked.0 = 0;
        }
        over
    }

    pub(super) fn publish(&self) {
        let (capacity, provisional, leased) =
            self.ledger.totals(self.authority).expect("own authority");
        let credit = self.ledger.credit_bytes(self.authority);
        self.metrics
            .publish(capacity, provisional, leased, credit, self.waiters.len());
        self.metrics.publish_holders(&self.ledger);
    }
}
