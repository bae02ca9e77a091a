//! Owning handles for what the Governor hands out, and the client side of its protocol.

use std::fmt;

use procmem::ledger::{
    self, AuthorityId, GrantId, HolderId, LeaseId, Ledger, LedgerError, Priority, Retired,
};
use procmem::MemoryRole;
use ractor::rpc::CallResult;
use ractor::{Actor, ActorRef, RpcReplyPort};
use tokio::task::JoinHandle;

use super::{
    Governor, GovernorConfig, GovernorError, GovernorMsg, GovernorSnapshot, ReserveRequest,
};
use crate::pressure::TicketInbox;

async fn ask<T: Send + 'static>(
    actor: &ActorRef<GovernorMsg>,
    build: impl FnOnce(RpcReplyPort<T>) -> GovernorMsg,
) -> Result<T, GovernorError> {
    match actor.call(build, None).await {
        Ok(CallResult::Success(value)) => Ok(value),
        _ => Err(GovernorError::Unavailable),
    }
}

/// A provisional grant. Commit it with the real footprint, or cancel it; dropped without
/// either, it returns itself to the Governor.
#[must_use = "a grant dropped unused is returned to the Governor"]
pub struct Grant {
    governor: ActorRef<GovernorMsg>,
    grant: Option<ledger::Grant>,
}

impl Grant {
    pub(super) fn new(governor: ActorRef<GovernorMsg>, grant: ledger::Grant) -> Self {
        Grant {
            governor,
            grant: Some(grant),
        }
    }

    fn inner(&self) -> &ledger::Grant {
        self.grant.as_ref().expect("a live grant")
    }

    /// Its identity.
    pub fn id(&self) -> GrantId {
        self.inner().id
    }

    /// Bytes approved.
    pub fn bytes(&self) -> u64 {
        self.inner().charge.bytes
    }

    /// The holder it was issued to.
    pub fn holder(&self) -> HolderId {
        self.inner().charge.holder
    }

    /// Stops this handle from returning the grant; the caller now keeps the books right.
    pub(super) fn defuse(mut self) -> ledger::Grant {
        self.grant.take().expect("a live grant")
    }

    /// Turns the grant into a lease of `actual_bytes`, the footprint really taken. If the
    /// Governor refuses (a top-up that does not fit), the grant comes back unchanged.
    pub async fn commit(self, actual_bytes: u64) -> Result<Lease, CommitRefused> {
        let (holder, grant) = (self.holder(), self.id());
        let result = ask(&self.governor, |reply| GovernorMsg::Commit {
            holder,
            grant,
            actual_bytes,
            reply,
        })
        .await;
        match result {
            Ok(Ok(lease)) => {
                // Consumed by the commit: nothing left to return.
                let _ = self.defuse();
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

    /// Returns the grant now and waits for the Governor to confirm.
    pub async fn cancel(self) -> Result<u64, GovernorError> {
        let governor = self.governor.clone();
        let grant = self.defuse();
        ask(&governor, |reply| GovernorMsg::Cancel {
            holder: grant.charge.holder,
            grant: grant.id,
            reply: Some(reply),
        })
        .await?
        .map_err(Into::into)
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        if let Some(grant) = self.grant.take() {
            let _ = self.governor.cast(GovernorMsg::Cancel {
                holder: grant.charge.holder,
                grant: grant.id,
                reply: None,
            });
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
    governor: ActorRef<GovernorMsg>,
    id: LeaseId,
    holder: HolderId,
    role: MemoryRole,
    remaining: u64,
}

impl Lease {
    pub(super) fn new(governor: ActorRef<GovernorMsg>, lease: ledger::Lease) -> Self {
        Lease {
            governor,
            id: lease.id,
            holder: lease.charge.holder,
            role: lease.charge.role,
            remaining: lease.charge.bytes,
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

    pub(super) fn defuse(mut self) -> (LeaseId, u64) {
        (self.id, std::mem::take(&mut self.remaining))
    }

    /// Drops the handle but keeps its bytes charged: the memory it paid for may still be held
    /// (its mechanism failed to free it), and the books must not say otherwise.
    pub(crate) fn keep_charged(self) {
        let (id, bytes) = self.defuse();
        tracing::warn!(%id, bytes, "lease kept charged: its memory may not have been freed");
    }

    /// Releases `bytes` whose memory was freed, without waiting (messages to the Governor
    /// keep their order). Refuses zero or more than the lease holds, changing nothing.
    pub fn release(&mut self, bytes: u64) -> Result<(), GovernorError> {
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
        self.governor
            .cast(GovernorMsg::Release {
                holder: self.holder,
                lease: self.id,
                bytes,
                reply: None,
            })
            .map_err(|_| GovernorError::Unavailable)?;
        self.remaining -= bytes;
        Ok(())
    }

    /// Releases everything and waits for the Governor to confirm.
    pub async fn release_all(self) -> Result<u64, GovernorError> {
        let governor = self.governor.clone();
        let (id, bytes) = (self.id, self.remaining);
        let holder = self.holder;
        let _ = self.defuse();
        if bytes == 0 {
            return Ok(0);
        }
        ask(&governor, |reply| GovernorMsg::Release {
            holder,
            lease: id,
            bytes,
            reply: Some(reply),
        })
        .await?
        .map(|_| bytes)
        .map_err(Into::into)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.remaining > 0 {
            let _ = self.governor.cast(GovernorMsg::Release {
                holder: self.holder,
                lease: self.id,
                bytes: self.remaining,
                reply: None,
            });
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
            .finish()
    }
}

/// A cheap, cloneable handle to one authority's Governor.
#[derive(Debug, Clone)]
pub struct GovernorHandle {
    actor: ActorRef<GovernorMsg>,
    authority: AuthorityId,
}

impl GovernorHandle {
    /// Spawns a Governor for a new authority on the current tokio runtime.
    pub async fn spawn(config: GovernorConfig) -> Result<(Self, JoinHandle<()>), ractor::SpawnErr> {
        let mut ledger = Ledger::new();
        let authority = ledger.add_authority(config.name.clone(), config.capacity);
        let (actor, join) = Actor::spawn(None, Governor, (ledger, authority, config)).await?;
        Ok((GovernorHandle { actor, authority }, join))
    }

    /// The actor, for stopping it or linking it under a supervisor.
    pub fn actor(&self) -> &ActorRef<GovernorMsg> {
        &self.actor
    }

    /// The authority it keeps the books of.
    pub fn authority(&self) -> AuthorityId {
        self.authority
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
        ask(&self.actor, |reply| GovernorMsg::RegisterHolder {
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
        ask(&self.actor, |reply| GovernorMsg::UnregisterHolder {
            holder,
            reply: Some(reply),
        })
        .await?
        .map_err(Into::into)
    }

    /// Asks for a provisional grant; waits for room until the request's deadline.
    pub async fn reserve(&self, request: ReserveRequest) -> Result<Grant, GovernorError> {
        ask(&self.actor, |reply| GovernorMsg::Reserve { request, reply }).await?
    }

    /// Sets the capacity.
    pub async fn set_capacity(&self, bytes: u64) -> Result<(), GovernorError> {
        ask(&self.actor, |reply| GovernorMsg::SetCapacity {
            bytes,
            reply: Some(reply),
        })
        .await
    }

    /// The books and the queue.
    pub async fn snapshot(&self) -> Result<GovernorSnapshot, GovernorError> {
        ask(&self.actor, |reply| GovernorMsg::Snapshot { reply }).await
    }
}
