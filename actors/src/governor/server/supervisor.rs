//! A Governor that dies is restarted with its books: the supervisor spawns a successor over
//! the same identity space and hands it, as its first message, what the holders' grants and
//! leases say they hold (see `Account`).

use std::sync::Arc;

use procmem::ledger::{AuthorityId, Ledger};
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};

use super::actor::Governor;
use super::config::GovernorConfig;
use crate::governor::client::{Account, GovernorMsg};

/// Supervises one authority's Governor.
pub(crate) struct GovernorSupervisor;

pub(crate) struct SupervisorState {
    template: Ledger,
    authority: AuthorityId,
    config: GovernorConfig,
    account: Arc<Account>,
    restarts: u64,
}

impl Actor for GovernorSupervisor {
    type Msg = ();
    type State = SupervisorState;
    type Arguments = (Ledger, AuthorityId, GovernorConfig, Arc<Account>);

    async fn pre_start(
        &self,
        myself: ActorRef<()>,
        (template, authority, config, account): Self::Arguments,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        let (actor, _) = Actor::spawn_linked(
            None,
            Governor,
            (
                template.clone(),
                authority,
                config.clone(),
                Arc::clone(&account),
            ),
            myself.get_cell(),
        )
        .await?;
        account.route().set(actor);
        Ok(SupervisorState {
            template,
            authority,
            config,
            account,
            restarts: 0,
        })
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<()>,
        event: SupervisionEvent,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let why = match &event {
            SupervisionEvent::ActorFailed(_, reason) => reason.to_string(),
            SupervisionEvent::ActorTerminated(_, _, reason) => {
                reason.clone().unwrap_or_else(|| "stopped".into())
            }
            _ => return Ok(()),
        };
        if state.account.is_stopping() {
            myself.stop(None);
            return Ok(());
        }
        let mut books = state.template.successor(state.account.issued());
        if let Some(capacity) = state.account.capacity() {
            books
                .set_capacity(state.authority, capacity)
                .map_err(|e| format!("cannot restore the capacity: {e}"))?;
        }
        let (next, _) = Actor::spawn_linked(
            None,
            Governor,
            (
                books,
                state.authority,
                state.config.clone(),
                Arc::clone(&state.account),
            ),
            myself.get_cell(),
        )
        .await?;
        let installed = state
            .account
            .restart(next, |recovery| GovernorMsg::Recover { recovery })
            .map_err(|e| format!("cannot hand the restarted governor its books: {e}"))?;
        if !installed {
            // Stopped on purpose while the successor started.
            myself.stop(None);
            return Ok(());
        }
        state.restarts += 1;
        procmem::metrics::GOVERNOR_RESTARTS_TOTAL
            .counter(&[&state.config.name])
            .increment(1);
        tracing::warn!(authority = %state.config.name, restarts = state.restarts, %why, "governor died; restarted with the holders' books");
        Ok(())
    }
}
