//! Pressure: when waiters are short of room, unused credit is taken back first, then the
//! upstream (if any) is asked for what is beyond the capacity, then the holders, one ticket at
//! a time, for the rest; and what they answer.

use procmem::ledger::admission;
use procmem::ledger::{Priority, Totals};
use ractor::ActorRef;
use tokio::time::Instant;

use super::state::GovernorState;
use crate::governor::client::GovernorMsg;
use crate::governor::protocol::Upstream;
use crate::ticket::{PressureReport, PressureTicket, TicketId};

impl GovernorState {
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
        if let Some(upstream) = self.account.route().upstream() {
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
            .filter(|h| self.inboxes.contains_key(&h.holder))
            .collect();
        let now = Instant::now();
        let waiter_deadline = self.waiters.front().and_then(|f| f.item.request.deadline);
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

    /// With an upstream, what waiters need beyond the capacity is asked of it (again after a
    /// ticket's time if still short); only bytes held over the capacity are asked of the
    /// holders. Returns that. Where the upstream just refused (nobody else could give), the
    /// holders are asked for the whole shortfall: this process's own cache makes the room.
    fn ask_upstream(&mut self, upstream: &Upstream, shortfall: u64) -> u64 {
        let now = Instant::now();
        if now < self.upstream_dry_until {
            return shortfall;
        }
        let Totals {
            capacity,
            provisional,
            leased,
        } = self.ledger.totals(self.authority).unwrap_or_default();
        let over = provisional.saturating_add(leased).saturating_sub(capacity);
        let need = shortfall.saturating_sub(over);
        if need > 0 && (need != self.upstream_asked.0 || now >= self.upstream_asked.1) {
            self.upstream_asked = (need, now + self.ticket_timeout);
            upstream(need);
        } else if need == 0 {
            self.upstream_asked.0 = 0;
        }
        over
    }

    /// The upstream had no room: for a ticket's time the holders make it.
    pub(super) fn upstream_refused(&mut self) {
        self.upstream_dry_until = Instant::now() + self.ticket_timeout;
        self.upstream_asked.0 = 0;
        self.round.changed();
    }

    /// A holder's answer to a ticket.
    pub(super) fn pressure_report(
        &mut self,
        myself: &ActorRef<GovernorMsg>,
        report: PressureReport,
    ) {
        let freed = report.freed_now.saturating_add(report.freed_pending_fence);
        self.metrics.freed(report.holder, freed);
        self.counts.freed_by_pressure = self.counts.freed_by_pressure.saturating_add(freed);
        // Bytes freed now were released before the report (same sender, same mailbox order);
        // only those pending a fence are still to come. A promise counts only up to what the
        // holder still holds here, and only until a ticket's time has passed again (a timer
        // then looks again): its release may have come before this report, or never come.
        let held = self.ledger.approved_to(report.holder).unwrap_or(0);
        let promise = report.freed_pending_fence.min(held);
        if promise > 0 {
            let until = Instant::now() + self.ticket_timeout;
            self.round
                .promised(report.holder, promise, until.into_std());
            let ticket = report.ticket;
            myself.send_after(self.ticket_timeout, move || GovernorMsg::TicketDeadline {
                ticket,
            });
        }
        if self
            .outstanding
            .as_ref()
            .is_some_and(|(t, _)| *t == report.ticket)
        {
            if let Some((_, timer)) = self.outstanding.take() {
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

    /// A ticket's deadline passed: if it is the one outstanding, the next holder may be asked.
    pub(super) fn ticket_deadline(&mut self, ticket: TicketId) {
        if self.outstanding.as_ref().is_some_and(|(t, _)| *t == ticket) {
            self.outstanding = None;
        }
    }
}
