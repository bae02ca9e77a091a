//! Owning handles for what the Governor hands out, and the client side of its protocol.

use std::fmt;
use std::sync::Arc;

use procmem::ledger::{
    self, AuthorityId, GrantId, HolderId, LeaseId, Ledger, LedgerError, Priority, Retired,
};
use procmem::MemoryRole;
use ractor::{Actor, RpcReplyPort};
use tokio::task::JoinHandle;

use super::address::Address;
use super::credit::CreditShared;
use super::{
    Governor, GovernorConfig, GovernorError, GovernorMsg, GovernorSnapshot, ReserveRequest,
};
use crate::pressure::TicketInbox;

pub(super) async fn ask<T: Send + 'static>(
    address: &Address,
    build: impl FnOnce(RpcReplyPort<T>) -> GovernorMsg,
) -> Result<T, GovernorError> {
    let (tx, rx) = ractor::concurrency::oneshot();
    answer(address.cast(build(tx.into())), rx).await
}

/// Sends a request whose reply comes on `rx`, and waits for it.
async fn answer<T>(
    sent: Result<(), ractor::MessagingErr<GovernorMsg>>,
    rx: ractor::concurrency::OneshotReceiver<T>,
) -> Result<T, GovernorError> {
    sent.map_err(|_| GovernorError::Unavailable)?;
    rx.await.map_err(|_| GovernorError::Unavailable)
}

/// A provisional grant. Commit it with the real footprint, or cancel it; dropped without
/// either, it returns itself to the Governor.
#[must_use = "a grant dropped unused is returned to the Governor"]
pub struct Grant {
    address: Arc<Address>,
    grant: Option<ledger::GrantRecord>,
}

impl Grant {
    /// Issued by the Governor at `address`; recorded there before it leaves the actor.
    pub(super) fn new(address: Arc<Address>, grant: ledger::GrantRecord) -> Self {
        address.grant_issued(&grant);
        Grant {
            address,
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
    pub(super) fn defuse(mut self) -> ledger::GrantRecord {
        let grant = self.grant.take().expect("a live grant");
        let _ = self.address.grant_gone(grant.id, None);
        grant
    }

    /// Turns the grant into a lease of `actual_bytes`, the footprint really taken. If the
    /// Governor refuses (a top-up that does not fit), the grant comes back unchanged.
    pub async fn commit(self, actual_bytes: u64) -> Result<Lease, CommitRefused> {
        let (holder, grant) = (self.holder(), self.id());
        let result = ask(&self.address, |reply| GovernorMsg::Commit {
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
        let sent = self.address.grant_gone(
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
            let _ = self.address.grant_gone(
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
    Governor(Arc<Address>),
    /// The credit line it was taken from, while that is open (then the Governor). One
    /// reference, not two: taking from credit is on the decode path.
    Credit(Arc<CreditShared>),
}

impl Home {
    fn address(&self) -> &Arc<Address> {
        match self {
            Home::Governor(address) => address,
            Home::Credit(line) => line.address(),
        }
    }

    fn share(&self) -> Home {
        match self {
            Home::Governor(address) => Home::Governor(Arc::clone(address)),
            Home::Credit(line) => Home::Credit(Arc::clone(line)),
        }
    }
}

impl Lease {
    /// Committed from `grant` by the Governor at `address`; recorded there (in the grant's
    /// place) before it leaves the actor.
    pub(super) fn committed(
        address: Arc<Address>,
        grant: GrantId,
        lease: ledger::LeaseRecord,
    ) -> Self {
        address.grant_committed(grant, &lease);
        Lease {
            home: Home::Governor(address),
            id: lease.id,
            holder: lease.claim.holder,
            role: lease.claim.role,
            remaining: lease.claim.bytes,
        }
    }

    /// `bytes` of the credit line `line` (already counted in the account and the books).
    pub(super) fn from_credit(
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

    /// Stops this handle from releasing; its bytes leave the address's account too (the
    /// caller settles them with the Governor itself).
    pub(super) fn defuse(mut self) -> (LeaseId, u64) {
        let bytes = std::mem::take(&mut self.remaining);
        let _ = self.home.address().lease_released(self.id, bytes, None);
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
    /// address's gate: a Governor that died and is being restarted rebuilds its books from the
    /// account, so a release it never received is still counted once.
    fn send_release(
        &self,
        bytes: u64,
        reply: Option<RpcReplyPort<Result<u64, LedgerError>>>,
    ) -> Result<(), ractor::MessagingErr<GovernorMsg>> {
        self.home.address().lease_released(
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

/// A cheap, cloneable handle to one authority's Governor. It reaches whichever Governor
/// actor serves the authority now: a supervised Governor that died is replaced behind it.
#[derive(Clone)]
pub struct GovernorHandle {
    pub(super) address: Arc<Address>,
    authority: AuthorityId,
    /// The authority's name (its metrics' label).
    name: Arc<str>,
    /// From a reserve call to its grant.
    grant_latency: ::metrics::Histogram,
}

impl fmt::Debug for GovernorHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GovernorHandle")
            .field("authority", &self.authority)
            .field("actor", &self.address.actor().map(|a| a.get_id()))
            .finish()
    }
}

impl GovernorHandle {
    /// Spawns a Governor for a new authority on the current tokio runtime. Unsupervised: if it
    /// dies, its books die with it (see [`GovernorHandle::spawn_supervised`]).
    pub async fn spawn(config: GovernorConfig) -> Result<(Self, JoinHandle<()>), ractor::SpawnErr> {
        let mut ledger = Ledger::new();
        let authority = ledger.add_authority(config.name.clone(), config.capacity);
        let address = Arc::new(Address::new());
        let name = config.name.clone();
        let (actor, join) = Actor::spawn(
            None,
            Governor,
            (ledger, authority, config, Arc::clone(&address)),
        )
        .await?;
        address.set(actor);
        Ok((GovernorHandle::new(address, authority, &name), join))
    }

    /// Spawns a Governor under a supervisor that restarts it when it dies (a panic or a kill):
    /// the new Governor rebuilds its books from what the holders' grants and leases say they
    /// hold, before any other message reaches it. Returns the handle and the supervisor.
    pub async fn spawn_supervised(
        config: GovernorConfig,
    ) -> Result<(Self, ractor::ActorCell), ractor::SpawnErr> {
        let mut ledger = Ledger::new();
        let authority = ledger.add_authority(config.name.clone(), config.capacity);
        Self::spawn_supervised_books(ledger, authority, config).await
    }

    /// The same, keeping the books of `authority` in `ledger` (split off a topology with
    /// [`Ledger::books_for`], so the authority's identity is the topology's).
    pub(crate) async fn spawn_supervised_books(
        ledger: Ledger,
        authority: AuthorityId,
        config: GovernorConfig,
    ) -> Result<(Self, ractor::ActorCell), ractor::SpawnErr> {
        let address = Arc::new(Address::new());
        let name = config.name.clone();
        let (supervisor, _) = Actor::spawn(
            None,
            super::supervisor::GovernorSupervisor,
            (ledger, authority, config, Arc::clone(&address)),
        )
        .await?;
        Ok((
            GovernorHandle::new(address, authority, &name),
            supervisor.get_cell(),
        ))
    }

    /// The Governor actor serving the authority now (for tests that kill it, and for
    /// supervision).
    pub fn actor(&self) -> ractor::ActorCell {
        self.address
            .actor()
            .expect("a handle exists only once its Governor was spawned")
            .get_cell()
    }

    /// Stops the Governor on purpose (its supervisor, if any, does not restart it).
    pub fn stop(&self) {
        self.address.stop();
    }

    fn new(address: Arc<Address>, authority: AuthorityId, name: &str) -> Self {
        GovernorHandle {
            address,
            authority,
            name: name.into(),
            grant_latency: procmem::metrics::GOVERNOR_GRANT_SECONDS.histogram(&[name]),
        }
    }

    /// The authority it keeps the books of.
    pub fn authority(&self) -> AuthorityId {
        self.authority
    }

    /// The authority's name, as its metrics are labelled.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Registers a holder. With an inbox, it receives pressure tickets and is watched: if
    /// its actor dies, its grants return at once.
    pub async fn register_holder(
        &self,
        name: impl Into<String>,
        priority: Priority,
        inbox: Option<TicketInbox>,
    ) -> Result<HolderId, GovernorError> {
        let name = name.into();
        ask(&self.address, |reply| GovernorMsg::RegisterHolder {
            name,
            priority,
            inbox,
            reply,
        })
        .await?
        .map_err(Into::into)
    }

    /// Retires a holder: grants return now, leases as their memory is freed.
    pub async fn unregister_holder(&self, holder: HolderId) -> Result<Retired, GovernorError> {
        ask(&self.address, |reply| GovernorMsg::UnregisterHolder {
            holder,
            reply: Some(reply),
        })
        .await?
        .map_err(Into::into)
    }

    /// Asks for a provisional grant; waits for room until the request's deadline.
    pub async fn reserve(&self, request: ReserveRequest) -> Result<Grant, GovernorError> {
        let asked = std::time::Instant::now();
        let grant = ask(&self.address, |reply| GovernorMsg::Reserve {
            request,
            reply,
        })
        .await??;
        self.grant_latency.record(asked.elapsed().as_secs_f64());
        Ok(grant)
    }

    /// Makes the capacity credit from `upstream` (a node Governor's link): waiters beyond it
    /// are asked of the upstream, not of the holders. `None` makes the Governor govern alone.
    pub fn set_upstream(&self, upstream: Option<super::Upstream>) {
        self.address.set_upstream(upstream);
        let _ = self.address.cast(GovernorMsg::Nudge);
    }

    /// Sets the capacity.
    pub async fn set_capacity(&self, bytes: u64) -> Result<(), GovernorError> {
        ask(&self.address, |reply| GovernorMsg::SetCapacity {
            bytes,
            reply: Some(reply),
        })
        .await
    }

    /// The books and the queue.
    pub async fn snapshot(&self) -> Result<GovernorSnapshot, GovernorError> {
        ask(&self.address, |reply| GovernorMsg::Snapshot { reply }).await
    }
}
