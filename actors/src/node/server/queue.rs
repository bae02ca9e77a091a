//! The node Governor's queue: waiters granted in order while the first fits, and tickets to
//! processes, least important first, for what does not. The rules are the process
//! Governor's (`procmem::ledger::admission`): one model check covers both.

use procmem::ledger::admission::{self, Front};
use std::collections::{BTreeMap, BTreeSet};

use procmem::ledger::{AuthorityId, Priority, WaitQueue};
use procmem::metrics as m;
use tokio::time::Instant;

use super::{refuse, NodeState, LIMITS};
use crate::node::wire::{LinkMsg, LinkNotice, NOBODY_CAN_GIVE};

impl NodeState {
    /// Grants waiters in order (priority, then arrival) while the first fits; one that can
    /// never fit is refused rather than left to block the rest.
    pub(super) fn pump(&mut self) {
        if Instant::now() < self.serving_from {
            return;
        }
        let aids: Vec<AuthorityId> = self.waiters.keys().copied().collect();
        for aid in aids {
            while let Some(queue) = self.waiters.get_mut(&aid) {
                let (seq, granted) = match admission::front(&self.ledger, aid, queue, LIMITS) {
                    Front::Grant(seq) => (seq, true),
                    Front::Deny(seq) => (seq, false),
                    Front::Wait | Front::Empty => break,
                };
                let bytes = queue.front().map_or(0, |(_, b, _)| b);
                let Some(w) = queue.remove(seq) else { break };
                if !granted {
                    refuse(w.reply, "larger than the node's capacity");
                    continue;
                }
                let found = self
                    .processes
                    .get(&w.token)
                    .and_then(|p| p.members.get(&aid))
                    .map(|m| (m.holder, m.line));
                match found {
                    Some((holder, line)) => self.grant(w.token, holder, aid, line, bytes, w.reply),
                    None => refuse(w.reply, "process gone"),
                }
            }
        }
    }

    /// For each authority short of room, one ticket at a time to the next process, least
    /// important first.
    pub(super) fn drive_tickets(&mut self) {
        let aids: Vec<AuthorityId> = self.authorities.values().copied().collect();
        for aid in aids {
            let shortfall = self
                .waiters
                .get(&aid)
                .map_or(0, |q| admission::shortfall(&self.ledger, aid, q));
            let round = self.rounds.entry(aid).or_default();
            if shortfall == 0 {
                round.asked.clear();
                continue;
            }
            if round.outstanding.is_some() {
                continue;
            }
            let Some((token, held)) = self.next_to_ask(aid) else {
                self.nobody_to_ask(aid);
                continue;
            };
            self.rounds
                .entry(aid)
                .or_default()
                .asked
                .insert(token, held);
            let id = self.next_ticket;
            self.next_ticket += 1;
            let timeout = self.config.ticket_timeout;
            let name = self
                .authorities
                .iter()
                .find(|(_, a)| **a == aid)
                .map(|(n, _)| n.clone())
                .unwrap_or_default();
            let link = self.processes.get(&token).and_then(|p| p.link.clone());
            let sent = link.is_some_and(|l| {
                l.cast(LinkMsg::Notice(Ok(LinkNotice::Ticket {
                    id,
                    authority: name.clone(),
                    bytes: shortfall,
                    deadline_ms: timeout.as_millis() as u64,
                })))
                .is_ok()
            });
            if sent {
                let round = self.rounds.entry(aid).or_default();
                round.outstanding = Some((id, token, Instant::now() + timeout));
                self.status.tickets += 1;
                m::NODE_TICKETS_TOTAL.counter(&[&name]).increment(1);
                tracing::debug!(token, id, shortfall, "node ticket sent");
            }
        }
    }

    /// Every process that could give was asked and gave what it could. Where no other process
    /// holds anything it could give (credit it does not use, or cached prompt blocks), only
    /// the askers' own holders can make the room: the waiters are refused now rather than at
    /// their deadline, with [`NOBODY_CAN_GIVE`], and each asker makes room among its own
    /// holders (its cache) at once. Where another could give, the waiters wait for it. Not
    /// during the rejoin grace, when asks wait for the processes to be counted.
    fn nobody_to_ask(&mut self, aid: AuthorityId) {
        if Instant::now() < self.serving_from {
            return;
        }
        let waiting = self.waiting_tokens(aid);
        let others_could_give = self.processes.iter().any(|(token, p)| {
            let Some(m) = p.members.get(&aid).filter(|_| !waiting.contains(token)) else {
                return false;
            };
            let credit = self.ledger.lease(m.line).map_or(0, |c| c.bytes);
            credit > m.approved || m.prefixes.as_ref().is_some_and(|d| d.blocks() > 0)
        });
        if others_could_give {
            return;
        }
        if let Some(queue) = self.waiters.get_mut(&aid) {
            for w in queue.drain_where(|_| true) {
                refuse(w.reply, NOBODY_CAN_GIVE);
            }
        }
    }

    /// The processes with an ask waiting for room in `aid`.
    fn waiting_tokens(&self, aid: AuthorityId) -> BTreeSet<u64> {
        self.waiters
            .get(&aid)
            .map(|q| q.items().map(|w| w.token).collect())
            .unwrap_or_default()
    }

    /// The process to ask next for room in `aid`, and what it holds (its credit and the
    /// bytes it reported approved). Each process is asked once, least important first and
    /// among equals the one holding most first; only once every process has been asked is
    /// one asked again, and only if what it holds changed since (a busy process whose usage
    /// moves all the time would otherwise be asked again and again, and an idle one holding
    /// a large cache never).
    fn next_to_ask(&self, aid: AuthorityId) -> Option<(u64, (u64, u64))> {
        let none = BTreeMap::new();
        let asked = self.rounds.get(&aid).map_or(&none, |r| &r.asked);
        // A process waiting here at least as important as the first waiter is the one the
        // room is for: asking it to give back would hand its own bytes round in a circle (it
        // counts the free bytes its ask waits for as unused).
        let front = self.waiters.get(&aid).and_then(WaitQueue::front_priority);
        let waiting = self.waiting_tokens(aid);
        let candidates: Vec<(u64, Priority, u64, (u64, u64))> = self
            .processes
            .iter()
            .filter_map(|(token, p)| {
                let m = p.members.get(&aid)?;
                let credit = self.ledger.lease(m.line).map_or(0, |c| c.bytes);
                let asker = waiting.contains(token) && front.is_some_and(|f| p.priority >= f);
                (credit > 0 && p.link.is_some() && !asker).then_some((
                    *token,
                    p.priority,
                    credit,
                    (credit, m.approved),
                ))
            })
            .collect();
        let order = |c: &&(u64, Priority, u64, (u64, u64))| (c.1, std::cmp::Reverse(c.2), c.0);
        let fresh = candidates
            .iter()
            .filter(|c| !asked.contains_key(&c.0))
            .min_by_key(order);
        fresh
            .or_else(|| {
                candidates
                    .iter()
                    .filter(|c| asked.get(&c.0) != Some(&c.3))
                    .min_by_key(order)
            })
            .map(|c| (c.0, c.3))
    }
}
