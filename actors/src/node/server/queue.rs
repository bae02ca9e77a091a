//! The node Governor's queue: waiters granted in order while the first fits, and tickets to
//! processes, least important first, for what does not. The rules are the process
//! Governor's (`procmem::ledger::admission`): one model check covers both.

use procmem::ledger::admission::{self, Front};
use std::collections::{BTreeMap, BTreeSet};

use procmem::ledger::{AuthorityId, Priority, WaitQueue};
use procmem::metrics as m;
use tokio::time::Instant;

use super::{refuse, NodeState, LIMITS};
use crate::node::wire::{LinkMsg, LinkNotice, COLD_HITS, NOBODY_CAN_GIVE};

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
                let bytes = queue.front().map_or(0, |f| f.bytes);
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
    /// important first, for no more than it may be asked (see [`super::share`]). Where the
    /// first waiter is under its guarantee, credit above theirs is first taken back from
    /// processes that stopped answering.
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
            let entitled = self.front_entitled(aid, &self.standings(aid));
            let serving = Instant::now() >= self.serving_from;
            if serving && entitled > 0 && self.revoke_stalled(aid, shortfall.min(entitled)) > 0 {
                self.pump();
                continue;
            }
            let round = self.rounds.entry(aid).or_default();
            if round.outstanding.is_some() {
                continue;
            }
            let Some(Candidate {
                token,
                held,
                allowance,
                over,
                ..
            }) = self.next_to_ask(aid)
            else {
                self.nobody_to_ask(aid);
                continue;
            };
            let id = self.next_ticket;
            self.rounds
                .entry(aid)
                .or_default()
                .asked
                .insert(token, (held, id));
            self.next_ticket += 1;
            let timeout = self.config.ticket_timeout;
            let name = self.authority_name_of(aid);
            let link = self.processes.get(&token).and_then(|p| p.link.clone());
            let sent = link.is_some_and(|l| {
                l.cast(LinkMsg::Notice(Ok(LinkNotice::Ticket {
                    id,
                    authority: name.clone(),
                    bytes: shortfall.min(allowance),
                    worth: (!over).then_some(COLD_HITS),
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
    /// holds anything it may still be asked for (credit above its guarantee, or credit it does
    /// not use: one at or under its guarantee gave its cold blocks when asked), only the
    /// askers' own holders can make the room: the waiters are refused now rather than at their
    /// deadline, with [`NOBODY_CAN_GIVE`], and each asker makes room among its own holders
    /// (its cache) at once. Where another could give, the waiters wait for it. Not
    /// during the rejoin grace, when asks wait for the processes to be counted.
    fn nobody_to_ask(&mut self, aid: AuthorityId) {
        if Instant::now() < self.serving_from {
            return;
        }
        let waiting = self.waiting_tokens(aid);
        // A process at or under its guarantee gave its cold blocks when asked, at once: what
        // cache it still holds is worth keeping.
        let others_could_give = self
            .standings(aid)
            .iter()
            .any(|(token, s)| !waiting.contains(token) && s.allowance() > 0);
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
    pub(super) fn waiting_tokens(&self, aid: AuthorityId) -> BTreeSet<u64> {
        self.waiters
            .get(&aid)
            .map(|q| q.items().map(|w| w.token).collect())
            .unwrap_or_default()
    }

    /// The process to ask next for room in `aid`, what it holds (its credit and the bytes it
    /// reported approved) and the most it may be asked for. Each process is asked once,
    /// least important first, among equals one over its guarantee first and then the one that
    /// may give most; only once every process has been asked is one asked again, and only if
    /// what it holds changed since, the one asked longest ago first (a busy process whose
    /// usage moves all the time would otherwise be asked again and again, and an idle one
    /// holding a large cache never). A process that may be asked for nothing (at or under its
    /// guarantee, using all its credit and reporting no cached block) is not asked.
    fn next_to_ask(&self, aid: AuthorityId) -> Option<Candidate> {
        let none = BTreeMap::new();
        let asked = self.rounds.get(&aid).map_or(&none, |r| &r.asked);
        // A process waiting here at least as important as the first waiter is the one the
        // room is for: asking it to give back would hand its own bytes round in a circle (it
        // counts the free bytes its ask waits for as unused).
        let front = self.waiters.get(&aid).and_then(WaitQueue::front_priority);
        let waiting = self.waiting_tokens(aid);
        let standings = self.standings(aid);
        let candidates: Vec<Candidate> = self
            .processes
            .iter()
            .filter_map(|(token, p)| {
                let s = standings.get(token)?;
                let asker = waiting.contains(token) && front.is_some_and(|f| p.priority >= f);
                // At or under its guarantee: its unused credit, and cached blocks of little
                // worth where it reported some (it says what, when asked).
                let cached = p
                    .members
                    .get(&aid)?
                    .prefixes
                    .as_ref()
                    .is_some_and(|d| d.blocks() > 0);
                let allowance = match s.over() {
                    0 if cached => u64::MAX,
                    _ => s.allowance(),
                };
                (allowance > 0 && p.link.is_some() && !asker).then_some(Candidate {
                    token: *token,
                    priority: p.priority,
                    over: s.over() > 0,
                    allowance,
                    held: (s.credit, s.approved),
                })
            })
            .collect();
        let order = |c: &&Candidate| (c.priority, !c.over, std::cmp::Reverse(c.allowance), c.token);
        let fresh = candidates
            .iter()
            .filter(|c| !asked.contains_key(&c.token))
            .min_by_key(order);
        fresh
            .or_else(|| {
                candidates
                    .iter()
                    .filter_map(|c| {
                        let (held, ticket) = asked.get(&c.token)?;
                        (*held != c.held).then_some((*ticket, c))
                    })
                    .min_by_key(|(ticket, c)| (*ticket, order(c)))
                    .map(|(_, c)| c)
            })
            .copied()
    }
}

/// A process the node may ask for room.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    token: u64,
    priority: Priority,
    /// Over its guarantee.
    over: bool,
    /// The most it may be asked for.
    allowance: u64,
    /// Its credit and the bytes it reported approved.
    held: (u64, u64),
}
