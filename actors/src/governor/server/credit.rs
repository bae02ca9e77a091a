//! The Governor's side of standing credit (see `CreditLine`): opening, topping up and closing
//! lines, and taking unused credit back before any holder is asked to evict.

use std::sync::Arc;

use procmem::ledger::{GrantId, HolderId, LeaseId, LedgerError};
use procmem::MemoryRole;
use ractor::{MessagingErr, RpcReplyPort};

use super::state::GovernorState;
use crate::governor::client::{CreditShared, GovernorMsg, Lease};

impl GovernorState {
    /// Opens a credit line; it is closed again at once if its caller left.
    pub(super) fn open_credit(
        &mut self,
        holder: HolderId,
        role: MemoryRole,
        shared: Arc<CreditShared>,
        reply: RpcReplyPort<Result<LeaseId, LedgerError>>,
    ) {
        let line = match self.ledger.open_credit(holder, role) {
            Ok(line) => line,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        self.account.credit_opened(&line, &shared);
        if reply.send(Ok(line.id)).is_err() {
            self.close_line(holder, line.id, shared.close());
        }
    }

    /// Commits a grant into a credit line and hands `take` bytes of it back as a lease.
    pub(super) fn top_up_credit(
        &mut self,
        holder: HolderId,
        grant: GrantId,
        line: LeaseId,
        role: MemoryRole,
        take: u64,
        reply: RpcReplyPort<Result<Lease, LedgerError>>,
    ) {
        let Some(shared) = self.account.credit_line(line) else {
            let _ = reply.send(Err(LedgerError::NotCredit(line)));
            return;
        };
        let bytes = match self.ledger.grant(grant) {
            Some(c) if c.bytes < take => {
                let _ = reply.send(Err(LedgerError::ReleaseExceedsLease {
                    lease: line,
                    leased: c.bytes,
                    asked: take,
                }));
                return;
            }
            Some(c) => c.bytes,
            None => {
                let _ = reply.send(Err(LedgerError::UnknownGrant(grant)));
                return;
            }
        };
        let total = match self.ledger.commit_into(holder, grant, line) {
            Ok(total) => total,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        self.account.credit_topped_up(grant, line, total);
        let rest = bytes - take;
        if rest > 0 && !shared.give_back(rest) {
            // The line closed meanwhile (or is full): what the child did not ask for goes back.
            self.release_line_bytes(holder, line, rest);
        }
        let lease = Lease::from_credit(line, holder, role, take, shared);
        if let Err(MessagingErr::SendErr(Ok(lease))) = reply.send(Ok(lease)) {
            // Dropped here: its bytes go back to the line (or to the books if it closed).
            drop(lease);
        }
    }

    /// Releases `bytes` of a line in the books and the account (the Governor itself acts).
    fn release_line_bytes(&mut self, holder: HolderId, line: LeaseId, bytes: u64) {
        if bytes == 0 {
            return;
        }
        match self.ledger.release(holder, line, bytes) {
            Ok(_) => {
                let _ = self
                    .account
                    .lease_released::<GovernorMsg>(line, bytes, None);
                self.round.changed();
            }
            Err(e) => tracing::error!(%line, bytes, %e, "credit release refused"),
        }
    }

    /// The line was closed by its child, with `unused` bytes going back.
    pub(super) fn close_credit(&mut self, holder: HolderId, line: LeaseId, unused: u64) {
        if unused > 0 {
            if let Err(e) = self.ledger.release(holder, line, unused) {
                tracing::error!(%line, unused, %e, "credit close refused");
            }
            self.round.changed();
        }
        if let Err(e) = self.ledger.close_credit(holder, line) {
            tracing::debug!(%line, %e, "credit line already closed");
        }
    }

    /// Closes a line from the Governor's side (its child is gone).
    fn close_line(&mut self, holder: HolderId, line: LeaseId, unused: u64) {
        let _ = self
            .account
            .credit_closed::<GovernorMsg>(line, unused, None);
        self.close_credit(holder, line, unused);
    }

    /// Closes every credit line of a retired holder: unused bytes return now.
    pub(super) fn close_lines_of(&mut self, holder: HolderId) {
        for (line, h, shared) in self.account.credit_lines() {
            if h == holder {
                self.close_line(holder, line, shared.close());
            }
        }
    }

    /// Takes back up to `wanted` unused credit, least important holders first; returns the
    /// bytes taken. No message: the children's counters shrink and the books with them.
    pub(super) fn reclaim_credit(&mut self, wanted: u64) -> u64 {
        let mut lines = self.account.credit_lines();
        lines.sort_by_key(|(line, holder, _)| {
            let priority = self.ledger.holder(*holder).map_or(0, |r| r.priority);
            (priority, *line)
        });
        let mut got = 0u64;
        for (line, holder, shared) in lines {
            if got >= wanted {
                break;
            }
            let taken = shared.take_up_to(wanted - got);
            if taken > 0 {
                self.release_line_bytes(holder, line, taken);
                got += taken;
            }
        }
        if got > 0 {
            self.counts.credit_reclaimed = self.counts.credit_reclaimed.saturating_add(got);
            self.metrics.credit_reclaimed.increment(got);
            tracing::debug!(got, wanted, "unused credit taken back");
        }
        got
    }

    /// Unused credit of every open line.
    pub(super) fn credit_unused(&self) -> u64 {
        self.account
            .credit_lines()
            .iter()
            .map(|(_, _, s)| s.unused())
            .fold(0u64, u64::saturating_add)
    }
}
