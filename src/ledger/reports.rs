//! What the books say: a denial's reasons, snapshots, the invariants, and the books a
//! restarted Governor starts from.

use std::collections::{BTreeMap, BTreeSet};

use super::{
    AuthorityId, AuthoritySnapshot, Claim, Denial, HolderBooks, HolderId, HolderReport,
    HolderUsage, Ledger, LedgerError,
};
use crate::api::MemoryRole;

impl Ledger {
    /// Holders of `authority` by approved bytes, largest first.
    pub fn top_holders(&self, authority: AuthorityId, n: usize) -> Vec<HolderUsage> {
        let mut usage: Vec<HolderUsage> = self
            .holders
            .iter()
            .filter(|(_, b)| b.authority == authority)
            .map(|(id, b)| HolderUsage {
                holder: *id,
                name: b.name.clone(),
                provisional: b.provisional,
                leased: b.leased,
            })
            .collect();
        usage.sort_by(|a, b| b.total().cmp(&a.total()).then(a.holder.cmp(&b.holder)));
        usage.truncate(n);
        usage
    }

    /// Why `asked` bytes do not fit in `authority` now.
    /// An authority of another ledger is named as unknown with no capacity, never a panic.
    pub fn denial(&self, authority: AuthorityId, asked: u64) -> Denial {
        let (authority_name, capacity, approved) = match self.authorities.get(&authority) {
            Some(a) => (a.name.clone(), a.capacity, a.approved()),
            None => (format!("unknown authority {authority}"), 0, 0),
        };
        Denial {
            authority,
            authority_name,
            asked,
            capacity,
            approved,
            waiting: 0,
            top_holders: self.top_holders(authority, 3),
            during_commit: false,
        }
    }

    /// The books of `authority`.
    pub fn snapshot(&self, authority: AuthorityId) -> Result<AuthoritySnapshot, LedgerError> {
        let a = self.authority(authority)?;
        Ok(AuthoritySnapshot {
            id: authority,
            name: a.name.clone(),
            capacity: a.capacity,
            provisional: a.provisional,
            leased: a.leased,
            credit: self.credit_bytes(authority),
            holders: self.top_holders(authority, usize::MAX),
        })
    }

    /// Every authority's id.
    pub fn authorities(&self) -> impl Iterator<Item = AuthorityId> + '_ {
        self.authorities.keys().copied()
    }

    /// Checks the invariants from first principles: per authority and holder, provisional is
    /// the sum of its grants and leased the sum of its leases (so every approved byte belongs
    /// to exactly one grant or lease), and no live grant or lease is empty. Capacity is checked
    /// by callers that know whether it was lowered: see [`Ledger::within_capacity`].
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut by_authority: BTreeMap<AuthorityId, [u64; 2]> = BTreeMap::new();
        let mut by_holder: BTreeMap<HolderId, [u64; 2]> = BTreeMap::new();
        // Slot 0 sums grants (provisional), slot 1 leases.
        // A standing credit line may hold zero bytes; no other charge may.
        let charges = self
            .grants
            .iter()
            .map(|(id, c)| (id.to_string(), c, 0, false))
            .chain(
                self.leases
                    .iter()
                    .map(|(id, c)| (id.to_string(), c, 1, self.credit.contains(id))),
            );
        for (id, c, slot, standing) in charges {
            if c.bytes == 0 && !standing {
                return Err(format!("{id} is empty"));
            }
            by_authority.entry(c.authority).or_default()[slot] += c.bytes;
            by_holder.entry(c.holder).or_default()[slot] += c.bytes;
            let h = self
                .holders
                .get(&c.holder)
                .ok_or(format!("{id} has no holder"))?;
            if h.authority != c.authority {
                return Err(format!("{id} charged to the wrong authority"));
            }
        }
        if let Some(line) = self.credit.iter().find(|l| !self.leases.contains_key(l)) {
            return Err(format!("credit line {line} has no lease"));
        }
        for (id, a) in &self.authorities {
            let [p, l] = by_authority.get(id).copied().unwrap_or_default();
            if (a.provisional, a.leased) != (p, l) {
                return Err(format!(
                    "{id}: books say provisional {} leased {}, grants and leases sum to {p} and {l}",
                    a.provisional, a.leased
                ));
            }
        }
        for (id, h) in &self.holders {
            let [p, l] = by_holder.get(id).copied().unwrap_or_default();
            if (h.provisional, h.leased) != (p, l) {
                return Err(format!(
                    "{id}: holder books disagree with its grants and leases"
                ));
            }
            if h.retired && h.provisional != 0 {
                return Err(format!("{id} is retired but holds grants"));
            }
        }
        Ok(())
    }

    /// Fresh books for a Governor that restarts: the same identity space, authorities,
    /// capacities and tiers, and no holders; identifiers continue above `issued`, the highest
    /// raw identifier the old books handed out, so no message meant for the old books can
    /// name something in the new ones by accident.
    pub fn successor(&self, issued: u64) -> Ledger {
        let mut next = Ledger {
            holders: BTreeMap::new(),
            grants: BTreeMap::new(),
            leases: BTreeMap::new(),
            credit: BTreeSet::new(),
            ..self.clone()
        };
        for a in next.authorities.values_mut() {
            a.provisional = 0;
            a.leased = 0;
        }
        const MASK: u64 = (1 << 40) - 1;
        let floor = if issued & !MASK == self.id_base {
            issued & MASK
        } else {
            0
        };
        next.next_id = next.next_id.max(floor.saturating_add(1));
        next
    }

    /// Bytes approved to `holder` (provisional plus leased), if it is known here.
    pub fn approved_to(&self, holder: HolderId) -> Option<u64> {
        self.holders
            .get(&holder)
            .map(|h| h.provisional.saturating_add(h.leased))
    }

    /// The highest raw identifier these books have handed out.
    pub fn issued(&self) -> u64 {
        self.id_base | self.next_id.saturating_sub(1)
    }

    /// Puts back a holder with what it reports it owns (its grants and leases, with their
    /// identities): how a restarted Governor's books are rebuilt. Refused, changing nothing,
    /// for an identity of other books, one already present, or an empty or overflowing charge.
    pub fn recover_holder(
        &mut self,
        authority: AuthorityId,
        report: &HolderReport,
    ) -> Result<(), LedgerError> {
        self.authority(authority)?;
        let ours = |raw: u64| raw & !((1 << 40) - 1) == self.id_base;
        if !ours(report.holder.0) || self.holders.contains_key(&report.holder) {
            return Err(LedgerError::UnknownHolder(report.holder));
        }
        let mut provisional = 0u64;
        let mut leased = 0u64;
        for (id, _, bytes) in &report.grants {
            if !ours(id.0) || self.grants.contains_key(id) || *bytes == 0 {
                return Err(LedgerError::UnknownGrant(*id));
            }
            provisional = provisional
                .checked_add(*bytes)
                .ok_or(LedgerError::ZeroBytes)?;
        }
        for line in &report.credit_lines {
            if !report.leases.iter().any(|(id, _, _)| id == line) {
                return Err(LedgerError::UnknownLease(*line));
            }
        }
        for (id, _, bytes) in &report.leases {
            let standing = report.credit_lines.contains(id);
            if !ours(id.0) || self.leases.contains_key(id) || (*bytes == 0 && !standing) {
                return Err(LedgerError::UnknownLease(*id));
            }
            leased = leased.checked_add(*bytes).ok_or(LedgerError::ZeroBytes)?;
        }
        let books = self.authorities.get_mut(&authority).expect("checked");
        books.provisional = books
            .provisional
            .checked_add(provisional)
            .ok_or(LedgerError::ZeroBytes)?;
        books.leased = books.leased.saturating_add(leased);
        let charge = |role: MemoryRole, bytes: u64| Claim {
            holder: report.holder,
            authority,
            role,
            bytes,
        };
        for (id, role, bytes) in &report.grants {
            self.grants.insert(*id, charge(*role, *bytes));
        }
        for (id, role, bytes) in &report.leases {
            self.leases.insert(*id, charge(*role, *bytes));
        }
        self.credit.extend(report.credit_lines.iter().copied());
        self.holders.insert(
            report.holder,
            HolderBooks {
                authority,
                name: report.name.clone(),
                priority: report.priority,
                provisional,
                leased,
                retired: report.retired,
            },
        );
        let highest = report
            .grants
            .iter()
            .map(|g| g.0 .0)
            .chain(report.leases.iter().map(|l| l.0 .0))
            .chain([report.holder.0])
            .max()
            .unwrap_or(0);
        self.next_id = self.next_id.max((highest & ((1 << 40) - 1)) + 1);
        Ok(())
    }

    /// Whether `authority` has approved no more than its capacity.
    pub fn within_capacity(&self, authority: AuthorityId) -> bool {
        self.authorities
            .get(&authority)
            .is_some_and(|a| a.approved() <= a.capacity)
    }
}
