//! Standing credit: bytes approved to a child (a holder of this process, or a process under a
//! node Governor) in advance, which the child hands out to itself without asking.
//!
//! In the books a credit line is a lease the child opened at zero bytes and tops up by
//! committing grants into it. Its bytes count as leased like any other: the child's used and
//! unused parts together never exceed what was approved to it, and capacity bounds them as it
//! bounds every approval. Releases take bytes off it as off any lease (the Governor takes
//! unused credit back that way); at zero it stays open until the child closes it.

use super::{Claim, GrantId, HolderId, LeaseId, LeaseRecord, Ledger, LedgerError, MemoryRole};
use crate::ledger::{presented_by, AuthorityId};

impl Ledger {
    /// Opens a standing credit line for `holder`: a lease of zero bytes for `role`, to be
    /// topped up with [`Ledger::commit_into`].
    pub fn open_credit(
        &mut self,
        holder: HolderId,
        role: MemoryRole,
    ) -> Result<LeaseRecord, LedgerError> {
        let authority = self.live_holder(holder)?.authority;
        let id = LeaseId(self.fresh());
        let claim = Claim {
            holder,
            authority,
            role,
            bytes: 0,
        };
        self.leases.insert(id, claim.clone());
        self.credit.insert(id);
        Ok(LeaseRecord { id, claim })
    }

    /// Commits `grant` whole into the credit line `line`; returns the line's new size. Both
    /// must be `holder`'s; the line must be open. A refused commit changes nothing.
    pub fn commit_into(
        &mut self,
        holder: HolderId,
        grant: GrantId,
        line: LeaseId,
    ) -> Result<u64, LedgerError> {
        let charge = self.owned_grant(holder, grant)?.clone();
        // Cannot overflow: both are parts of what the authority approved, a `u64`.
        let total = self.credit_line(holder, line)?.bytes + charge.bytes;
        self.grant_to_leased(grant, &charge, charge.bytes);
        self.leases.get_mut(&line).expect("checked").bytes = total;
        Ok(total)
    }

    /// Closes the credit line: from now on it is an ordinary lease, gone when its last byte is
    /// released (now, if it holds none). Returns the bytes it still holds.
    pub fn close_credit(&mut self, holder: HolderId, line: LeaseId) -> Result<u64, LedgerError> {
        let bytes = self.credit_line(holder, line)?.bytes;
        self.credit.remove(&line);
        if bytes == 0 {
            self.leases.remove(&line);
            self.forget_if_done(holder);
        }
        Ok(bytes)
    }

    /// The open credit line `line` of `holder`.
    fn credit_line(&self, holder: HolderId, line: LeaseId) -> Result<&Claim, LedgerError> {
        if !self.credit.contains(&line) {
            return Err(LedgerError::NotCredit(line));
        }
        let claim = self
            .leases
            .get(&line)
            .ok_or(LedgerError::UnknownLease(line))?;
        presented_by(claim, holder)
    }

    /// Whether `line` is an open credit line.
    pub fn is_credit(&self, line: LeaseId) -> bool {
        self.credit.contains(&line)
    }

    /// Bytes of `authority` held as standing credit (used by the children or not).
    pub fn credit_bytes(&self, authority: AuthorityId) -> u64 {
        self.credit
            .iter()
            .filter_map(|l| self.leases.get(l))
            .filter(|c| c.authority == authority)
            .map(|c| c.bytes)
            .sum()
    }
}
