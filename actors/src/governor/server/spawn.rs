//! Starting a Governor: the constructors of [`GovernorHandle`] that spawn one, defined on the
//! server side (the client only reaches a Governor that exists).

use std::sync::Arc;

use procmem::ledger::{AuthorityId, Ledger};
use ractor::Actor;
use tokio::task::JoinHandle;

use super::actor::Governor;
use super::config::GovernorConfig;
use super::supervisor::GovernorSupervisor;
use crate::governor::client::{Account, GovernorHandle};

impl GovernorHandle {
    /// Spawns a Governor for a new authority on the current tokio runtime. Unsupervised: if it
    /// dies, its books die with it (see [`GovernorHandle::spawn_supervised`]).
    pub async fn spawn(config: GovernorConfig) -> Result<(Self, JoinHandle<()>), ractor::SpawnErr> {
        let mut ledger = Ledger::new();
        let authority = ledger.add_authority(config.name.clone(), config.capacity);
        let account = Arc::new(Account::new());
        let name = config.name.clone();
        let (actor, join) = Actor::spawn(
            None,
            Governor,
            (ledger, authority, config, Arc::clone(&account)),
        )
        .await?;
        account.route().set(actor);
        Ok((GovernorHandle::new(account, authority, &name), join))
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
        let account = Arc::new(Account::new());
        let name = config.name.clone();
        let (supervisor, _) = Actor::spawn(
            None,
            GovernorSupervisor,
            (ledger, authority, config, Arc::clone(&account)),
        )
        .await?;
        Ok((
            GovernorHandle::new(account, authority, &name),
            supervisor.get_cell(),
        ))
    }
}
