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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_utils::CachePadded;

use procmem::ledger::{HolderId, LeaseId, LedgerError, Priority};
use procmem::MemoryRole;
use ractor::RpcReplyPort;
use tokio::time::Instant;

use super::address::Address;
use super::handles::{ask, CommitRefused};
use super::{GovernorError, GovernorHandle, GovernorMsg, GovernorState, Grant, Lease};
use super::{MessagingErr, ReserveRequest};

/// Set once the line is closed: from then on, bytes given back go to the Governor.
const CLOSED: u64 = 1 << 63;
/// The most one line may hold unused (the counter keeps its top bit for `CLOSED`).
pub const MAX_CREDIT: u64 = CLOSED - 1;

/// A child's unused credit, shared by the child's leases and the Governor. On a cache line
/// of its own: holders taking from their own lines never contend.
pub(crate) struct CreditShared {
    state: CachePadded<AtomicU64>,
    /// The Governor bytes go back to once the line is closed. (The Governor's account keeps
    /// a weak reference to this, so there is no cycle.)
    address: Arc<Address>,
}

impl std::fmt::Debug for CreditShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CreditShared")
            .field("unused", &self.unused())
            .finish()
    }
}

impl CreditShared {
    pub(super) fn new(address: Arc<Address>) -> Self {
        CreditShared {
            state: CachePadded::new(AtomicU64::new(0)),
            address,
        }
    }

    pub(super) fn address(&self) -> &Arc<Address> {
        &self.address
    }

    /// Takes exactly `bytes` if the line is open and holds that many unused.
    fn take(&self, bytes: u64) -> bool {
        self.state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                (v & CLOSED == 0 && v >= bytes).then(|| v - bytes)
            })
            .is_ok()
    }

    /// Takes up to `max` unused bytes of an open line; returns how many.
    fn take_up_to(&self, max: u64) -> u64 {
        match self
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                (v & CLOSED == 0 && v > 0 && max > 0).then(|| v - v.min(max))
            }) {
            Ok(before) => before.min(max),
            Err(_) => 0,
        }
    }

    /// Puts `bytes` back as unused, if the line is open (and they fit the counter).
    pub(super) fn give_back(&self, bytes: u64) -> bool {
        self.state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                if v & CLOSED != 0 {
                    return None;
                }
                v.checked_add(bytes).filter(|t| *t <= MAX_CREDIT)
            })
            .is_ok()
    }

    /// Closes the line; returns the unused bytes it held (zero if it was closed already).
    fn close(&self) -> u64 {
        let before = self.state.fetch_or(CLOSED, Ordering::AcqRel);
        if before & CLOSED != 0 {
            0
        } else {
            before
        }
    }

    /// Unused bytes now (zero once closed).
    fn unused(&self) -> u64 {
        let v = self.state.load(Ordering::Acquire);
        if v & CLOSED != 0 {
            0
        } else {
            v
        }
    }
}

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
        let shared = Arc::new(CreditShared::new(Arc::clone(&self.address)));
        let line = ask(&self.address, |reply| GovernorMsg::OpenCredit {
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
        let result = ask(&self.governor.address, |reply| GovernorMsg::TopUpCredit {
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
            .address
            .credit_closed(self.line, unused, Some(msg))
            .is_err()
        {
            tracing::debug!(line = %self.line, unused, "governor down; the close is in the account");
        }
    }
}

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
        self.address.credit_opened(&line, &shared);
        if reply.send(Ok(line.id)).is_err() {
            self.close_line(holder, line.id, shared.close());
        }
    }

    /// Commits a grant into a credit line and hands `take` bytes of it back as a lease.
    pub(super) fn top_up_credit(
        &mut self,
        holder: HolderId,
        grant: procmem::ledger::GrantId,
        line: LeaseId,
        role: MemoryRole,
        take: u64,
        reply: RpcReplyPort<Result<Lease, LedgerError>>,
    ) {
        let Some(shared) = self.address.credit_line(line) else {
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
        self.address.credit_topped_up(grant, line, total);
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
                let _ = self.address.lease_released(line, bytes, None);
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
        let _ = self.address.credit_closed(line, unused, None);
        self.close_credit(holder, line, unused);
    }

    /// Closes every credit line of a retired holder: unused bytes return now.
    pub(super) fn close_lines_of(&mut self, holder: HolderId) {
        for (line, h, shared) in self.address.credit_lines() {
            if h == holder {
                self.close_line(holder, line, shared.close());
            }
        }
    }

    /// Takes back up to `wanted` unused credit, least important holders first; returns the
    /// bytes taken. No message: the children's counters shrink and the books with them.
    pub(super) fn reclaim_credit(&mut self, wanted: u64) -> u64 {
        let mut lines = self.address.credit_lines();
        lines.sort_by_key(|(line, holder, _)| {
            let priority = self.ledger.holder(*holder).map_or(0, |(_, _, p)| p);
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
        self.address
            .credit_lines()
            .iter()
            .map(|(_, _, s)| s.unused())
            .fold(0u64, u64::saturating_add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counter_refuses_what_it_cannot_do_and_changes_nothing() {
        let c = CreditShared::new(Arc::new(Address::new()));
        assert!(!c.take(1), "empty");
        assert!(c.give_back(100));
        assert!(!c.take(101), "more than unused");
        assert!(c.take(40));
        assert_eq!(c.unused(), 60);
        assert!(!c.give_back(u64::MAX), "past the counter");
        assert!(
            !c.give_back(MAX_CREDIT),
            "60 + MAX_CREDIT overflows the counter"
        );
        assert_eq!(c.unused(), 60);
        assert_eq!(c.take_up_to(0), 0);
        assert_eq!(c.take_up_to(u64::MAX), 60);
        assert_eq!(c.take_up_to(u64::MAX), 0, "nothing left");
        assert!(c.give_back(10));
        assert_eq!(c.close(), 10);
        assert_eq!(c.close(), 0, "closed twice returns nothing twice");
        assert!(!c.give_back(5), "a closed line takes nothing back");
        assert_eq!(c.take_up_to(5), 0);
    }
}
