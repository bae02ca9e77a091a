//! Where a Governor's handles reach it: the Governor actor serving the authority now, behind
//! a gate that a restart swaps it under, and where that Governor asks for more capacity.
//!
//! The gate holds the actor as an untyped [`ActorCell`] (what an `ActorRef` is, its type aside):
//! the route sits below the mailbox type, whose replies name the handles that use the route.
//! Every message sent through it is the client's `GovernorMsg`, the one type a Governor takes.

use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use ractor::{ActorCell, ActorRef, Message, MessagingErr, RpcReplyPort};

use crate::governor::protocol::{self, GovernorError, Upstream};

/// The current Governor actor of one authority, and its upstream.
pub(crate) struct Route {
    /// The Governor now; read-locked by every send, write-locked only to swap it.
    gate: RwLock<Option<ActorCell>>,
    /// Told how many bytes waiters need beyond the capacity (see [`Upstream`]).
    upstream: Mutex<Option<Upstream>>,
}

/// The gate held shared: the Governor stays the same while it is held.
pub(super) type Gate<'a> = RwLockReadGuard<'a, Option<ActorCell>>;

impl Route {
    /// A route to no Governor yet: [`Route::set`] it once the actor is spawned.
    pub(super) fn new() -> Self {
        Route {
            gate: RwLock::new(None),
            upstream: Mutex::new(None),
        }
    }

    /// Sets (or clears) where the Governor asks for more capacity.
    pub(crate) fn set_upstream(&self, upstream: Option<Upstream>) {
        *self.upstream.lock().unwrap_or_else(|p| p.into_inner()) = upstream;
    }

    /// Whether the Governor has an upstream.
    pub(crate) fn has_upstream(&self) -> bool {
        self.upstream
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Where the Governor asks for more capacity, if anywhere.
    pub(crate) fn upstream(&self) -> Option<Upstream> {
        self.upstream
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The gate, held shared (sends never queue behind one another).
    pub(super) fn gate(&self) -> Gate<'_> {
        self.gate.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The gate, held exclusively (no handle sends meanwhile): only to swap the Governor.
    pub(super) fn gate_mut(&self) -> RwLockWriteGuard<'_, Option<ActorCell>> {
        self.gate.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Points the route at its first Governor.
    pub(crate) fn set<M>(&self, actor: ActorRef<M>) {
        *self.gate_mut() = Some(actor.get_cell());
    }

    /// The Governor actor now (`None` only before [`Route::set`]).
    pub(crate) fn actor(&self) -> Option<ActorCell> {
        self.gate().clone()
    }

    /// Sends `msg` to the Governor now (a request whose reply port is inside it).
    pub(crate) fn cast<M: Message>(&self, msg: M) -> Result<(), MessagingErr<M>> {
        Self::send(&self.gate(), msg)
    }

    /// Sends `msg` to the Governor behind a gate already held.
    pub(super) fn send<M: Message>(
        actor: &Option<ActorCell>,
        msg: M,
    ) -> Result<(), MessagingErr<M>> {
        match actor {
            Some(actor) => actor.send_message(msg),
            None => Err(MessagingErr::SendErr(msg)),
        }
    }

    /// Sends the request `build` makes around a reply port, and waits for the reply.
    pub(crate) async fn ask<M: Message, T: Send + 'static>(
        &self,
        build: impl FnOnce(RpcReplyPort<T>) -> M,
    ) -> Result<T, GovernorError> {
        protocol::ask(|msg| self.cast(msg), build).await
    }
}
