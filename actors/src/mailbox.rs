//! What every holder shares: a mailbox that takes [`PressureTicket`]s (so the Governor can
//! reach it through a [`TicketInbox`](crate::holder::TicketInbox)), and a handle that spawns it,
//! supervised or not, and asks it things.

use ractor::{Actor, ActorCell, ActorRef, Message, RpcReplyPort, SpawnErr};
use tokio::task::JoinHandle;

/// Lets a holder's mailbox take pressure tickets: `holder_mailbox!(MyMsg::Ticket)` makes
/// `MyMsg` from a [`PressureTicket`](crate::holder::PressureTicket) and back, which is what
/// `ActorRef::get_derived` needs to make the [`TicketInbox`](crate::holder::TicketInbox) a holder
/// registers with its Governor.
///
/// ```
/// use procmem_actors::holder::{holder_mailbox, PressureTicket};
///
/// enum MyHolderMsg {
///     Ticket(PressureTicket),
///     Other,
/// }
/// holder_mailbox!(MyHolderMsg::Ticket);
/// // With this crate's `cluster` feature (ractor's, for the node Governor), a message type
/// // must also say it is one: `impl ractor::Message for MyHolderMsg {}`. Without it, nothing.
/// ```
// Exported under `holder` (`procmem_actors::holder::holder_mailbox!`), not at the root.
#[doc(hidden)]
#[macro_export]
macro_rules! __holder_mailbox {
    ($msg:ident :: $variant:ident) => {
        impl ::core::convert::From<$crate::holder::PressureTicket> for $msg {
            fn from(ticket: $crate::holder::PressureTicket) -> Self {
                $msg::$variant(ticket)
            }
        }

        impl ::core::convert::TryFrom<$msg> for $crate::holder::PressureTicket {
            type Error = ();
            #[allow(unreachable_patterns)]
            fn try_from(msg: $msg) -> ::core::result::Result<Self, ()> {
                match msg {
                    $msg::$variant(ticket) => Ok(ticket),
                    _ => Err(()),
                }
            }
        }
    };
}

/// A running holder actor: what its public handle wraps.
pub(crate) struct HolderRef<M: Message> {
    actor: ActorRef<M>,
}

impl<M: Message> Clone for HolderRef<M> {
    fn clone(&self) -> Self {
        HolderRef {
            actor: self.actor.clone(),
        }
    }
}

impl<M: Message> std::fmt::Debug for HolderRef<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("HolderRef")
            .field(&self.actor.get_id())
            .finish()
    }
}

impl<M: Message> HolderRef<M> {
    /// Spawns `holder`, linked to `supervisor` when one is given (its failure is then
    /// reported there, not fatal). A failed start says why: the error the holder's startup
    /// returned if it is an `E`, otherwise the spawn error wrapped by `start_failed`.
    pub(crate) async fn spawn<A, E>(
        holder: A,
        args: A::Arguments,
        supervisor: Option<ActorCell>,
        start_failed: impl FnOnce(SpawnErr) -> E,
    ) -> Result<(Self, JoinHandle<()>), E>
    where
        A: Actor<Msg = M>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let spawned = match supervisor {
            Some(s) => Actor::spawn_linked(None, holder, args, s).await,
            None => Actor::spawn(None, holder, args).await,
        };
        let (actor, join) = spawned.map_err(|e| startup_error(e, start_failed))?;
        Ok((HolderRef { actor }, join))
    }

    /// Asks the holder and waits for the answer; `unavailable` if it is not running or
    /// stopped before answering.
    pub(crate) async fn ask<T: Send + 'static, E>(
        &self,
        build: impl FnOnce(RpcReplyPort<Result<T, E>>) -> M,
        unavailable: E,
    ) -> Result<T, E>
    where
        E: Send + 'static,
    {
        match self.actor.call(build, None).await {
            Ok(ractor::rpc::CallResult::Success(answer)) => answer,
            _ => Err(unavailable),
        }
    }

    /// Sends without waiting; a holder that is gone drops it.
    pub(crate) fn cast(&self, msg: M) {
        let _ = self.actor.cast(msg);
    }

    /// The actor, to watch, stop or kill it.
    pub(crate) fn cell(&self) -> ActorCell {
        self.actor.get_cell()
    }
}

/// What a failed spawn of one of this crate's actors says: the error its startup returned
/// when that is an `E` (a bad shape, a Governor that refused the holder), otherwise the spawn
/// error itself (a panic during startup), wrapped by `other`.
fn startup_error<E>(error: SpawnErr, other: impl FnOnce(SpawnErr) -> E) -> E
where
    E: std::error::Error + Send + Sync + 'static,
{
    match error {
        SpawnErr::StartupFailed(inner) => match inner.downcast::<E>() {
            Ok(e) => *e,
            Err(inner) => other(SpawnErr::StartupFailed(inner)),
        },
        e => other(e),
    }
}
