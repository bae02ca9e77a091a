//! Standing credit: bytes a Governor approved to a child in advance, which the child takes
//! for itself with one atomic operation, no message.
//!
//! A [`CreditLine`] is a lease of its holder that the Governor tops up in chunks (a grant
//! committed into it, through the ordinary admission path: it may wait and cause pressure).
//! The child's unused bytes are one atomic counter shared with the Governor:
//! [`CreditLine::take`] hands out a [`Lease`] of part of the line, and that lease, released or
//! dropped, puts its bytes back in the counter while the line is open. Nothing of this changes
//! the books: the line holds the bytes, used or not. The Governor takes unused bytes back out
//! of the counter (a release of the line) before it asks any holder to evict. Closing the line
//! returns what is unused; what the child still uses comes back as those leases are released.

use std::sync::Arc;

use procmem::ledger::{HolderId, LeaseId, LedgerError, Priority};
use procmem::MemoryRole;
use tokio::time::Instant;

use super::account::{CreditShared, MAX_CREDIT};
use super::handle::GovernorHandle;
use super::lease::{CommitRefused, GovernorMsg, Grant, Lease};
use crate::governor::protocol::{GovernorError, ReserveRequest};

/// A holder's standing credit with its Governor. Taking within it is one atomic operation;
/// [`CreditLine::reserve`] tops it up by `chunk` (or what is asked, if more) when it runs
/// short. Dropped (or [`CreditLine::close`]d), its unused bytes go back to the Governor.
pub struct CreditLine {
    governor: GovernorHandle,
    holder: HolderId,
    role: MemoryRole,
    line: LeaseId,
    shared: Arc<CreditShared>,
    chunk: u64,
}

impl std::fmt::Debug for CreditLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CreditLine")
            .field("holder", &self.holder)
            .field("line", &self.line)
            .field("unused", &self.shared.unused())
            .field("chunk", &self.chunk)
            .finish()
    }
}

impl GovernorHandle {
    /// Opens a credit line for `holder`, topped up `chunk` bytes at a time (at least what a
    /// [`CreditLine::reserve`] asks for). It starts empty: the first reserve asks the Governor.
    pub async fn open_credit(
        &self,
        holder: HolderId,
        role: MemoryRole,
        chunk: u64,
    ) -> Result<CreditLine, GovernorError> {
        if chunk == 0 {
            return Err(LedgerError::ZeroBytes.into());
        }
        let shared = Arc::new(CreditShared::new(Arc::clone(&self.account)));
        let line = self
            .account
            .route()
            .ask(|reply| GovernorMsg::OpenCredit {
                holder,
                role,
                shared: Arc::clone(&shared),
                reply,
            })
            .await??;
        Ok(CreditLine {
            governor: self.clone(),
            holder,
            role,
            line,
            shared,
            chunk: chunk.min(MAX_CREDIT),
        })
    }
}

impl CreditLine {
    /// Takes `bytes` of unused credit as a lease of this line, or `None` (changing nothing) if
    /// fewer are unused or the line is closed. One atomic operation; no message.
    pub fn take(&self, bytes: u64) -> Option<Lease> {
        if bytes == 0 || !self.shared.take(bytes) {
            return None;
        }
        Some(self.lease(bytes))
    }

    fn lease(&self, bytes: u64) -> Lease {
        Lease::from_credit(
            self.line,
            self.holder,
            self.role,
            bytes,
            Arc::clone(&self.shared),
        )
    }

    /// `bytes` from credit; when it runs short, tops the line up by at least `chunk` through
    /// the Governor (waiting for room until `deadline`, as a reserve does) and takes them from
    /// the top-up.
    pub async fn reserve(
        &self,
        bytes: u64,
        priority: Priority,
        deadline: Option<Instant>,
    ) -> Result<Lease, GovernorError> {
        if let Some(lease) = self.take(bytes) {
            return Ok(lease);
        }
        if bytes == 0 {
            return Err(LedgerError::ZeroBytes.into());
        }
        let request = ReserveRequest {
            holder: self.holder,
            role: self.role,
            bytes: bytes.max(self.chunk),
            priority,
            deadline,
        };
        let grant = self.governor.reserve(request).await?;
        if bytes > MAX_CREDIT {
            // More than a line can count: an ordinary lease, outside the line.
            return grant.commit(bytes).await.map_err(|r| r.error);
        }
        self.top_up(grant, bytes).await.map_err(|r| r.error)
    }

    /// Commits `grant` into the line; `take` of it come back as a lease, the rest is unused.
    async fn top_up(&self, grant: Grant, take: u64) -> Result<Lease, CommitRefused> {
        let (holder, id, line, role) = (self.holder, grant.id(), self.line, self.role);
        let result = self
            .governor
            .account
            .route()
            .ask(|reply| GovernorMsg::TopUpCredit {
                holder,
                grant: id,
                line,
                role,
                take,
                reply,
            })
            .await;
        match result {
            Ok(Ok(lease)) => {
                grant.spent();
                Ok(lease)
            }
            Ok(Err(e)) => Err(CommitRefused {
                error: e.into(),
                grant,
            }),
            Err(error) => Err(CommitRefused { error, grant }),
        }
    }

    /// Unused bytes now.
    pub fn unused(&self) -> u64 {
        self.shared.unused()
    }

    /// The line's identity (a lease of its holder in the Governor's books).
    pub fn id(&self) -> LeaseId {
        self.line
    }

    /// Closes the line now: its unused bytes go back to the Governor.
    pub fn close(self) {
        drop(self);
    }
}

impl Drop for CreditLine {
    fn drop(&mut self) {
        let unused = self.shared.close();
        let msg = GovernorMsg::CloseCredit {
            holder: self.holder,
            line: self.line,
            unused,
        };
        if self
            .governor
            .account
            .credit_closed(self.line, unused, Some(msg))
            .is_err()
        {
            tracing::debug!(line = %self.line, unused, "governor down; the close is in the account");
        }
    }
}
