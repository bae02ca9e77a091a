//! Each process's guaranteed share of an authority, what a ticket may ask of a process
//! against it, and the credit taken back from one that stopped answering.
//!
//! A process at or under its guarantee that asks gets the room from processes over theirs:
//! a ticket may ask a process for everything above its guarantee (its holders give it up in
//! their own order: slack, cached blocks, then running sequences, swapped or recomputed), but
//! below its guarantee only for credit its holders do not use. Above the guarantees the node
//! lends what is idle, as before.

use std::collections::BTreeMap;
use std::time::Duration;

use procmem::ledger::{AuthorityId, Priority};
use procmem::metrics as m;
use tokio::time::Instant;

use super::NodeState;
use crate::node::wire::{LinkMsg, LinkNotice, Share};

/// A process silent this long (no report, give or ask: a running one reports every 100 ms)
/// is taken as stopped: what it holds above its guarantee is taken back without its answer
/// when another process waits under its own.
pub(super) const STALLED: Duration = Duration::from_secs(1);

/// What one process holds on an authority, against its guarantee.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Standing {
    /// Credit the node approved to it.
    pub(super) credit: u64,
    /// What it last reported approved to its holders.
    pub(super) approved: u64,
    /// Its guarantee now.
    pub(super) guarantee: u64,
}

impl Standing {
    /// Credit above its guarantee.
    pub(super) fn over(&self) -> u64 {
        self.credit.saturating_sub(self.guarantee)
    }

    /// What a ticket may ask of it: everything above its guarantee, and below it only credit
    /// its holders do not use.
    pub(super) fn allowance(&self) -> u64 {
        self.over().max(self.credit.saturating_sub(self.approved))
    }

    /// What it may still claim from processes over their guarantees.
    pub(super) fn entitled(&self) -> u64 {
        self.guarantee.saturating_sub(self.credit)
    }
}

/// Each process's guarantee (by token) out of `capacity`: set guarantees first, the most
/// important process first (then the first to join), each no more than what is left; the
/// processes without one divide the rest in proportion to their weights.
pub(super) fn divide(capacity: u64, shares: &[(u64, Priority, Share)]) -> BTreeMap<u64, u64> {
    let mut out = BTreeMap::new();
    let mut set: Vec<&(u64, Priority, Share)> =
        shares.iter().filter(|s| s.2.guarantee.is_some()).collect();
    set.sort_by_key(|s| (std::cmp::Reverse(s.1), s.0));
    let mut left = capacity;
    for (token, _, share) in set {
        let g = share.guarantee.unwrap_or(0).min(left);
        left -= g;
        out.insert(*token, g);
    }
    let weighted: Vec<&(u64, Priority, Share)> =
        shares.iter().filter(|s| s.2.guarantee.is_none()).collect();
    // In 128 bits: a capacity near `u64::MAX` times a weight must not wrap.
    let total: u128 = weighted.iter().map(|s| u128::from(s.2.weight.max(1))).sum();
    for (token, _, share) in weighted {
        let g = u128::from(left) * u128::from(share.weight.max(1)) / total.max(1);
        out.insert(*token, u64::try_from(g).unwrap_or(u64::MAX));
    }
    out
}

impl NodeState {
    /// Every member of `aid`, by token: its credit, what it reported approved and its
    /// guarantee out of the authority's capacity now.
    pub(super) fn standings(&self, aid: AuthorityId) -> BTreeMap<u64, Standing> {
        let capacity = self.ledger.totals(aid).map_or(0, |t| t.capacity);
        let shares: Vec<(u64, Priority, Share)> = self
            .processes
            .iter()
            .filter(|(_, p)| p.members.contains_key(&aid))
            .map(|(token, p)| (*token, p.priority, p.share))
            .collect();
        let guarantees = divide(capacity, &shares);
        self.processes
            .iter()
            .filter_map(|(token, p)| {
                let m = p.members.get(&aid)?;
                Some((
                    *token,
                    Standing {
                        credit: self.ledger.lease(m.line).map_or(0, |c| c.bytes),
                        approved: m.approved,
                        guarantee: guarantees.get(token).copied().unwrap_or(0),
                    },
                ))
            })
            .collect()
    }

    /// What the first waiter of `aid` may still claim from processes over their guarantees
    /// (zero where none waits, or where it is at its guarantee or over).
    pub(super) fn front_entitled(
        &self,
        aid: AuthorityId,
        standings: &BTreeMap<u64, Standing>,
    ) -> u64 {
        self.waiters
            .get(&aid)
            .and_then(|q| q.front())
            .and_then(|f| standings.get(&f.item.token))
            .map_or(0, Standing::entitled)
    }

    /// Takes back, without their answer, credit above their guarantees from processes that
    /// stopped answering (see [`STALLED`]), up to `wanted` bytes: a stopped process cannot
    /// give, and the guarantee of the one waiting would otherwise be none. Their memory is
    /// still theirs until they run again: the machine holds up to these bytes above the
    /// capacity meanwhile (and a stopped process's pages are the kernel's coldest), and at
    /// once they run their holders make the room ([`LinkNotice::Revoked`]). Returns the
    /// bytes taken.
    pub(super) fn revoke_stalled(&mut self, aid: AuthorityId, wanted: u64) -> u64 {
        let now = Instant::now();
        let standings = self.standings(aid);
        let authority = self.authority_name_of(aid);
        let waiting = self.waiting_tokens(aid);
        let mut taken = 0u64;
        for (token, s) in standings {
            if taken >= wanted || waiting.contains(&token) {
                continue;
            }
            let Some(p) = self.processes.get_mut(&token) else {
                continue;
            };
            if s.over() == 0 || now.duration_since(p.heard) < STALLED {
                continue;
            }
            let Some(member) = p.members.get_mut(&aid) else {
                continue;
            };
            let bytes = s.over().min(wanted - taken);
            if self
                .ledger
                .release(member.holder, member.line, bytes)
                .is_err()
            {
                continue;
            }
            member.revoked = member.revoked.saturating_add(bytes);
            taken += bytes;
            let label = p.label();
            m::NODE_REVOKED_BYTES_TOTAL
                .counter(&[&authority, &label])
                .increment(bytes);
            tracing::warn!(
                token,
                pid = p.pid,
                bytes,
                silent_ms = now.duration_since(p.heard).as_millis() as u64,
                "credit above its guarantee taken back from a process that stopped answering"
            );
            if let Some(link) = &p.link {
                let _ = link.cast(LinkMsg::Notice(Ok(LinkNotice::Revoked {
                    authority: authority.clone(),
                    bytes,
                })));
            }
            for round in self.rounds.values_mut() {
                if round.outstanding.is_some_and(|(_, t, _)| t == token) {
                    round.outstanding = None;
                }
            }
        }
        taken
    }

    /// Every member's guarantee now, by authority and token.
    pub(super) fn guarantees(&self) -> BTreeMap<(AuthorityId, u64), u64> {
        self.authorities
            .values()
            .flat_map(|aid| {
                let standings = self.standings(*aid);
                standings
                    .into_iter()
                    .map(move |(token, s)| ((*aid, token), s.guarantee))
            })
            .collect()
    }

    /// The name of authority `aid`.
    pub(super) fn authority_name_of(&self, aid: AuthorityId) -> String {
        self.authorities
            .iter()
            .find(|(_, a)| **a == aid)
            .map(|(n, _)| n.clone())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weight(weight: u32) -> Share {
        Share {
            weight,
            guarantee: None,
        }
    }

    fn set(bytes: u64) -> Share {
        Share {
            weight: 1,
            guarantee: Some(bytes),
        }
    }

    #[test]
    fn shares_by_weight_divide_the_capacity() {
        let g = divide(
            900,
            &[(1, 0, weight(1)), (2, 0, weight(1)), (3, 0, weight(1))],
        );
        assert_eq!(g.values().copied().collect::<Vec<_>>(), vec![300, 300, 300]);
        let g = divide(900, &[(1, 0, weight(2)), (2, 0, weight(1))]);
        assert_eq!((g[&1], g[&2]), (600, 300));
        // Never more than the capacity, even at the limits.
        let g = divide(u64::MAX, &[(1, 0, weight(u32::MAX)), (2, 0, weight(1))]);
        assert!(u128::from(g[&1]) + u128::from(g[&2]) <= u128::from(u64::MAX));
    }

    #[test]
    fn set_guarantees_come_first_and_in_priority_order() {
        let g = divide(
            1000,
            &[(1, 0, set(400)), (2, 0, weight(1)), (3, 0, weight(1))],
        );
        assert_eq!((g[&1], g[&2], g[&3]), (400, 300, 300));
        // Over-asked: the more important process keeps its whole guarantee.
        let g = divide(
            1000,
            &[(1, 0, set(800)), (2, 5, set(800)), (3, 0, weight(1))],
        );
        assert_eq!((g[&2], g[&1], g[&3]), (800, 200, 0));
        let g = divide(1000, &[(1, 0, set(u64::MAX))]);
        assert_eq!(g[&1], 1000);
    }

    #[test]
    fn below_its_guarantee_a_process_gives_only_what_it_does_not_use() {
        let s = |credit, approved, guarantee| Standing {
            credit,
            approved,
            guarantee,
        };
        // Under: its cache and sequences stay; unused credit may go.
        assert_eq!(s(80, 80, 100).allowance(), 0);
        assert_eq!(s(80, 50, 100).allowance(), 30);
        assert_eq!(s(80, 50, 100).entitled(), 20);
        // Over: everything above the guarantee, or what it does not use where that is more.
        assert_eq!(s(150, 150, 100).allowance(), 50);
        assert_eq!(s(150, 60, 100).allowance(), 90);
        assert_eq!(s(150, 60, 100).entitled(), 0);
    }
}
