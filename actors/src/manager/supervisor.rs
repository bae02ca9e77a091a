//! The holders' supervisor: a holder that crashes is reported and counted, never fatal; its
//! memory is freed after its fences by the deferred-free path.

use procmem::metrics;
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};

/// Supervises holders: a crash is logged and counted; the system goes on.
pub(crate) struct HolderSupervisor;

impl Actor for HolderSupervisor {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<()>, _: ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<()>,
        event: SupervisionEvent,
        _: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        if let SupervisionEvent::ActorFailed(who, reason) = event {
            tracing::error!(actor = ?who.get_id(), %reason, "holder crashed; its memory is freed after its fences");
            metrics::HOLDER_FAILURES_TOTAL.counter(&[]).increment(1);
        }
        Ok(())
    }
}
