//! The one-way notices a process sends its node: a give-back (the answer to a ticket, or
//! credit it no longer needs), a report of what it holds, a leave.

use super::NodeState;
use crate::node::wire::{HeldPrefixes, NodeNotice, WireError};
use tokio::time::Instant;

impl NodeState {
    /// Applies `notice` from its process (refused where its key is another session's).
    pub(super) fn notice(&mut self, notice: NodeNotice) {
        let sender = notice.sender();
        if self.foreign(sender.token, sender.key) {
            return;
        }
        if let Some(p) = self.processes.get_mut(&sender.token) {
            p.heard = Instant::now();
        }
        match notice {
            NodeNotice::Give {
                token,
                authority,
                bytes,
                ticket,
                ..
            } => {
                let found = self.authorities.get(&authority).and_then(|aid| {
                    let m = self.processes.get(&token)?.members.get(aid)?;
                    Some((*aid, m.holder, m.line, m.revoked))
                });
                let Some((aid, holder, line, revoked)) = found else {
                    return self.stranger(token, sender.key, "give from a stranger");
                };
                let credit = self.ledger.lease(line).map_or(0, |c| c.bytes);
                // A give sent before the process learnt some of its credit was taken back
                // may be for more than it holds now: all it holds goes.
                let bytes = if bytes > credit && revoked > 0 {
                    credit
                } else {
                    bytes
                };
                if bytes > 0 && self.ledger.release(holder, line, bytes).is_err() {
                    return self.rejected(&WireError::Invalid("give of more than its credit"));
                }
                let round = self.rounds.entry(aid).or_default();
                if round
                    .outstanding
                    .is_some_and(|(id, t, _)| id == ticket && t == token)
                {
                    round.outstanding = None;
                }
            }
            NodeNotice::Report {
                token,
                authority,
                approved,
                os_bytes,
                model,
                prefixes,
                ..
            } => {
                let member = self.authorities.get(&authority).and_then(|aid| {
                    self.processes
                        .get_mut(&token)
                        .and_then(|p| p.members.get_mut(aid))
                });
                match member {
                    Some(m) => {
                        m.approved = approved;
                        m.os_bytes = os_bytes;
                        m.model = model;
                        // Validated with the frame: a digest that does not check is refused.
                        m.prefixes = prefixes.and_then(HeldPrefixes::into_digest);
                    }
                    None => self.stranger(token, sender.key, "report from a stranger"),
                }
            }
            NodeNotice::Leave { token, .. } => {
                if self.processes.contains_key(&token) {
                    self.reap(token, "left");
                } else {
                    self.stranger(token, sender.key, "leave from a stranger");
                }
            }
        }
    }
}
