//! The Governor actor: one per authority, applying each message to its [`GovernorState`].

use std::sync::Arc;

use procmem::ledger::{AuthorityId, Ledger};
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, SupervisionEvent};

use super::config::GovernorConfig;
use super::state::GovernorState;
use crate::governor::client::{Account, GovernorMsg};

/// The Governor actor.
#[derive(Debug, Default)]
pub(crate) struct Governor;

impl Actor for Governor {
    type Msg = GovernorMsg;
    type State = GovernorState;
    type Arguments = (Ledger, AuthorityId, GovernorConfig, Arc<Account>);

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        (ledger, authority, config, account): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let state = GovernorState::new(ledger, authority, &config, account);
        state.publish();
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        procmem::fault::panic_point("governor.handle");
        match message {
            GovernorMsg::RegisterHolder {
                name,
                priority,
                inbox,
                reply,
            } => state.register_holder(&myself, name, priority, inbox, reply),
            GovernorMsg::UnregisterHolder { holder, reply } => {
                let result = state.retire(&myself, holder);
                if let Some(reply) = reply {
                    let _ = reply.send(result);
                }
            }
            GovernorMsg::Reserve { request, reply } => state.reserve(request, reply),
            GovernorMsg::Commit {
                holder,
                grant,
                actual_bytes,
                reply,
            } => state.commit(holder, grant, actual_bytes, reply),
            GovernorMsg::Cancel {
                holder,
                grant,
                reply,
            } => state.cancel(holder, grant, reply),
            GovernorMsg::Release {
                holder,
                lease,
                bytes,
                reply,
            } => state.release(holder, lease, bytes, reply),
            GovernorMsg::OpenCredit {
                holder,
                role,
                shared,
                reply,
            } => state.open_credit(holder, role, shared, reply),
            GovernorMsg::TopUpCredit {
                holder,
                grant,
                line,
                role,
                take,
                reply,
            } => state.top_up_credit(holder, grant, line, role, take, reply),
            GovernorMsg::CloseCredit {
                holder,
                line,
                unused,
            } => state.close_credit(holder, line, unused),
            GovernorMsg::SetCapacity { bytes, reply } => state.set_capacity(bytes, reply),
            GovernorMsg::Nudge => state.round.changed(),
            GovernorMsg::UpstreamRefused => state.upstream_refused(),
            GovernorMsg::Snapshot { reply } => {
                let _ = reply.send(state.snapshot());
            }
            GovernorMsg::PressureReport(report) => state.pressure_report(&myself, report),
            GovernorMsg::Recover { recovery } => state.recover(&myself, recovery),
            GovernorMsg::WaiterDeadline => state.waiter_deadline(),
            GovernorMsg::TicketDeadline { ticket } => state.ticket_deadline(ticket),
        }
        state.settle(&myself);
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // A watched holder died: its grants return now; its leases come back as the memory
        // they pay for is actually freed. The Governor itself keeps running.
        let dead: Option<ActorId> = match &event {
            SupervisionEvent::ActorTerminated(cell, _, _)
            | SupervisionEvent::ActorFailed(cell, _) => Some(cell.get_id()),
            _ => None,
        };
        if let Some(dead) = dead {
            state.holder_died(&myself, dead);
            state.settle(&myself);
        }
        Ok(())
    }
}
