//! The owning handles the Governor hands out, [`Grant`] and [`Lease`], and the mailbox type
//! they travel in: the protocol's, with these handles in its replies.

use std::fmt;
use std::sync::Arc;

use procmem::ledger::{self, GrantId, HolderId, LeaseId, LedgerError};
use procmem::MemoryRole;
use ractor::RpcReplyPort;

use super::account::{Account, CreditShared};
use crate::governor::protocol::{self, answer, GovernorError};

/// The Governor's mailbox, its replies carrying these handles.
pub(crate) type GovernorMsg = protocol::GovernorMsg<Grant, Lease, CreditShared>;

/// A provisional grant. Commit it with the real footprint, or cancel it; dropped without
/// either, it returns itself to the Governor.
#[must_use = "a grant dropped unused is returned to the Governor"]
pub struct Grant {
    account: Arc<Account>,
    grant: Option<ledger::GrantRecord>,
}

impl Grant {
    /// Issued by the Governor of `account`; recorded there before it leaves the actor.
    pub(in crate::governor) fn new(account: Arc<Account>, grant: ledger::GrantRecord) -> Self {
        account.grant_issued(&grant);
        Grant {
            account,
            grant: Some(grant),
        }
    }

    fn inner(&self) -> &ledger::GrantRecord {
        self.grant.as_ref().expect("a live grant")
    }

    /// Its identity.
    pub fn id(&self) -> GrantId {
        self.inner().id
    }

    /// Bytes approved.
    pub fn bytes(&self) -> u64 {
        self.inner().claim.bytes
    }

    /// The holder it was issued to.
    pub fn holder(&self) -> HolderId {
        self.inner().claim.holder
    }

    /// Stops this handle from returning the grant; the caller now keeps the books right.
    pub(in crate::governor) fn defuse(mut self) -> ledger::GrantRecord {
        let grant = self.grant.take().expect("a live grant");
        let _ = self.account.grant_gone::<GovernorMsg>(grant.id, None);
        grant
    }

    /// Turns the grant into a lease of `actual_bytes`, the footprint really taken. If the
    /// Governor refuses (a top-up that does not fit), the grant comes back unchanged.
    pub async fn commit(self, actual_bytes: u64) -> Result<Lease, CommitRefused> {
        let (holder, grant) = (self.holder(), self.id());
        let result = self
            .account
            .route()
            .ask(|reply| GovernorMsg::Commit {
                holder,
                grant,
                actual_bytes,
                reply,
            })
            .await;
        match result {
            Ok(Ok(lease)) => {
                // Consumed by the commit: nothing left to return (the Governor already took
                // it out of the account and put the lease in its place).
                let mut spent = self;
                spent.grant = None;
                Ok(lease)
            }
            Ok(Err(e)) => Err(CommitRefused {
                error: e.into(),
                grant: self,
            }),
            Err(e) => Err(CommitRefused {
                error: e,
                grant: self,
            }),
        }
    }

    /// Consumed by the Governor (committed into a credit line): nothing left to return.
    pub(super) fn spent(mut self) {
        self.grant = None;
    }

    /// Returns the grant now and waits for the Governor to confirm.
    pub async fn cancel(mut self) -> Result<u64, GovernorError> {
        let grant = self.grant.take().expect("a live grant");
        let (tx, rx) = ractor::concurrency::oneshot();
        let sent = self.account.grant_gone(
            grant.id,
            Some(GovernorMsg::Cancel {
                holder: grant.claim.holder,
                grant: grant.id,
                reply: Some(tx.into()),
            }),
        );
        answer(sent, rx).await?.map_err(Into::into)
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        if let Some(grant) = self.grant.take() {
            let _ = self.account.grant_gone(
                grant.id,
                Some(GovernorMsg::Cancel {
                    holder: grant.claim.holder,
                    grant: grant.id,
                    reply: None,
                }),
            );
        }
    }
}

impl fmt::Debug for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grant").field("grant", &self.grant).finish()
    }
}

/// A commit the Governor refused; the grant is handed back as it was.
#[derive(Debug, thiserror::Error)]
#[error("commit refused: {error}")]
pub struct CommitRefused {
    /// Why.
    #[source]
    pub error: GovernorError,
    /// The grant, still provisional (dropping it returns it).
    pub grant: Grant,
}

/// A lease: committed bytes a holder pays for. Release what the memory really gave back;
/// a lease dropped while holding bytes releases them, so keep it with the memory it pays for
/// (then it goes when that memory is actually freed).
#[must_use = "a lease dropped releases its bytes"]
pub struct Lease {
    home: Home,
    id: LeaseId,
    holder: HolderId,
    role: MemoryRole,
    remaining: u64,
}

/// Where a lease's bytes go back to.
enum Home {
    /// The Governor.
    Governor(Arc<Account>),
    /// The credit line it was taken from, while that is open (then the Governor). One
    /// reference, not two: taking from credit is on the decode path.
    Credit(Arc<CreditShared>),
}

impl Home {
    fn account(&self) -> &Arc<Account> {
        match self {
            Home::Governor(account) => account,
            Home::Credit(line) => line.account(),
        }
    }

    fn share(&self) -> Home {
        match self {
            Home::Governor(account) => Home::Governor(Arc::clone(account)),
            Home::Credit(line) => Home::Credit(Arc::clone(line)),
        }
    }
}

impl Lease {
    /// Committed from `grant` by the Governor of `account`; recorded there (in the grant's
    /// place) before it leaves the actor.
    pub(in crate::governor) fn committed(
        account: Arc<Account>,
        grant: GrantId,
        lease: ledger::LeaseRecord,
    ) -> Self {
        account.grant_committed(grant, &lease);
        Lease {
            home: Home::Governor(account),
            id: lease.id,
            holder: lease.claim.holder,
            role: lease.claim.role,
            remaining: lease.claim.bytes,
        }
    }

    /// `bytes` of the credit line `line` (already counted in the account and the books).
    pub(in crate::governor) fn from_credit(
        line: LeaseId,
        holder: HolderId,
        role: MemoryRole,
        bytes: u64,
        credit: Arc<CreditShared>,
    ) -> Self {
        Lease {
            home: Home::Credit(credit),
            id: line,
            holder,
            role,
            remaining: bytes,
        }
    }

    /// Its identity.
    pub fn id(&self) -> LeaseId {
        self.id
    }

    /// The holder paying.
    pub fn holder(&self) -> HolderId {
        self.holder
    }

    /// What the bytes are for.
    pub fn role(&self) -> MemoryRole {
        self.role
    }

    /// Bytes still held.
    pub fn bytes(&self) -> u64 {
        self.remaining
    }

    /// Stops this handle from releasing; its bytes leave the account too (the caller settles
    /// them with the Governor itself).
    pub(in crate::governor) fn defuse(mut self) -> (LeaseId, u64) {
        let bytes = std::mem::take(&mut self.remaining);
        let _ = self
            .home
            .account()
            .lease_released::<GovernorMsg>(self.id, bytes, None);
        (self.id, bytes)
    }

    /// Drops the handle but keeps its bytes charged: the memory it paid for may still be held
    /// (its mechanism failed to free it), and the books must not say otherwise.
    pub(crate) fn keep_charged(mut self) {
        // The account keeps the bytes too: a restarted Governor still charges them.
        let bytes = std::mem::take(&mut self.remaining);
        tracing::warn!(id = %self.id, bytes, "lease kept charged: its memory may not have been freed");
    }

    /// Takes `bytes` off this handle: refuses zero or more than it holds, changing nothing.
    fn take(&mut self, bytes: u64) -> Result<(), GovernorError> {
        if bytes == 0 {
            return Err(LedgerError::ZeroBytes.into());
        }
        if bytes > self.remaining {
            return Err(LedgerError::ReleaseExceedsLease {
                lease: self.id,
                leased: self.remaining,
                asked: bytes,
            }
            .into());
        }
        self.remaining -= bytes;
        Ok(())
    }

    /// Releases `bytes` whose memory was freed, without waiting (messages to the Governor
    /// keep their order). Refuses zero or more than the lease holds, changing nothing.
    pub fn release(&mut self, bytes: u64) -> Result<(), GovernorError> {
        self.take(bytes)?;
        if self.back_to_credit(bytes) {
            return Ok(());
        }
        if self.send_release(bytes, None).is_err() {
            tracing::debug!(lease = %self.id, bytes, "governor down; the release is in the account");
        }
        Ok(())
    }

    /// Splits `bytes` off into a lease of their own, paid from the same charge: each part is
    /// released (or dropped) with the memory it pays for, and the Governor's lease ends when
    /// the last part does. No message: the books do not change. Refuses zero or more than this
    /// lease holds, changing nothing.
    pub fn split(&mut self, bytes: u64) -> Result<Lease, GovernorError> {
        self.take(bytes)?;
        Ok(Lease {
            home: self.home.share(),
            id: self.id,
            holder: self.holder,
            role: self.role,
            remaining: bytes,
        })
    }

    /// Releases everything and waits for the Governor to confirm.
    pub async fn release_all(mut self) -> Result<u64, GovernorError> {
        let bytes = std::mem::take(&mut self.remaining);
        if bytes == 0 || self.back_to_credit(bytes) {
            return Ok(bytes);
        }
        let (tx, rx) = ractor::concurrency::oneshot();
        let sent = self.send_release(bytes, Some(tx.into()));
        answer(sent, rx).await?.map(|_| bytes).map_err(Into::into)
    }

    /// Returns `bytes` to the credit line they came from, if it is open: no message, the
    /// books do not change (the line still holds them, unused now).
    fn back_to_credit(&self, bytes: u64) -> bool {
        match &self.home {
            Home::Credit(line) => line.give_back(bytes),
            Home::Governor(_) => false,
        }
    }

    /// Tells the Governor `bytes` came back. The account changes with the message, under the
    /// route's gate: a Governor that died and is being restarted rebuilds its books from the
    /// account, so a release it never received is still counted once.
    fn send_release(
        &self,
        bytes: u64,
        reply: Option<RpcReplyPort<Result<u64, LedgerError>>>,
    ) -> Result<(), ractor::MessagingErr<GovernorMsg>> {
        self.home.account().lease_released(
            self.id,
            bytes,
            Some(GovernorMsg::Release {
                holder: self.holder,
                lease: self.id,
                bytes,
                reply,
            }),
        )
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.remaining > 0 && !self.back_to_credit(self.remaining) {
            let _ = self.send_release(self.remaining, None);
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("id", &self.id)
            .field("holder", &self.holder)
            .field("role", &self.role)
            .field("bytes", &self.remaining)
            .field("from_credit", &matches!(self.home, Home::Credit(_)))
            .finish()
    }
}
