//! The node Governor's queue: waiters granted in order while they fit, and tickets to
//! processes, least important first, for what does not.

use procmem::ledger::AuthorityId;
use procmem::metrics as m;
use tokio::time::Instant;

use super::{refuse, NodeState};
use crate::node::wire::{LinkMsg, LinkNotice};

impl NodeState {
    /// Grants waiters in order (priority, then arrival) while the first fits.
    pub(super) fn pump(&mut self) {
        if Instant::now() < self.serving_from {
            return;
        }
        let aids: Vec<AuthorityId> = self.authorities.values().copied().collect();
        for aid in aids {
            loop {
                let best = self
                    .pending
                    .iter()
                    .enumerate()
                    .filter(|(_, w)| w.authority == aid)
                    .max_by_key(|(i, w)| (w.priority, std::cmp::Reverse(*i)))
                    .map(|(i, w)| (i, w.bytes));
                let Some((i, bytes)) = best else { break };
                if !self.ledger.fits(aid, bytes).unwrap_or(false) {
                    break;
                }
                let w = self.pending.remove(i);
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
            let wanted: u64 = self
                .pending
                .iter()
                .filter(|w| w.authority == aid)
                .map(|w| w.bytes)
                .fold(0u64, u64::saturating_add);
            let free = self.ledger.snapshot(aid).map_or(0, |s| s.free());
            let shortfall = wanted.saturating_sub(free);
            let round = self.rounds.entry(aid).or_default();
            if shortfall == 0 {
                round.asked.clear();
                continue;
            }
            if round.outstanding.is_some() {
                continue;
            }
            let next = self
                .processes
                .iter()
                .filter_map(|(token, p)| {
                    let m = p.members.get(&aid)?;
                    let credit = self.ledger.lease(m.line).map_or(0, |c| c.bytes);
                    (credit > 0 && p.link.is_some()).then_some((p.priority, *token))
                })
                .filter(|k| !round.asked.contains(k))
                .min();
            let Some(key) = next else { continue };
            round.asked.insert(key);
            let id = self.next_ticket;
            self.next_ticket += 1;
            let timeout = self.config.ticket_timeout;
            let name = self
                .authorities
                .iter()
                .find(|(_, a)| **a == aid)
                .map(|(n, _)| n.clone())
                .unwrap_or_default();
            let link = self.processes.get(&key.1).and_then(|p| p.link.clone());
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
                round.outstanding = Some((id, key.1, Instant::now() + timeout));
                self.status.tickets += 1;
                m::NODE_TICKETS_TOTAL.counter(&[&name]).increment(1);
                tracing::debug!(token = key.1, id, shortfall, "node ticket sent");
            }
        }
    }
}
