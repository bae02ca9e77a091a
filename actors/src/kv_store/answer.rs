//! Answers that create state in the store, as owning values: an open dropped before its
//! caller read it (a timeout after the store answered, a task cancelled) closes the sequence
//! it opened, as a `Grant` dropped unread returns itself. A prepare answers a `KvStep` and a
//! credit top-up a `Lease`, which undo themselves the same way; a restore is answered again
//! by a retry (a sequence that is not preempted answers what it holds).

use procmem::kv::Incarnation;
use ractor::ActorRef;

use crate::mailbox::HolderRef;

use super::{KvStoreMsg, SeqId};

/// What opening a sequence found. The position rule a scheduler keeps: it holds
/// `cached_tokens`, fewer than a non-empty prompt's, so its first step is at that position
/// and the prompt's last token is always computed; a step at `p` leaves it holding `p + 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    /// Prompt tokens whose KV came from shared cached blocks (no need to compute them).
    pub cached_tokens: usize,
}

/// What restoring a preempted sequence did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restored {
    /// The KV was copied back; the sequence holds `tokens` again.
    Swapped {
        /// Tokens restored.
        tokens: usize,
    },
    /// The KV was dropped: the sequence holds its first `cached` tokens again (the cached
    /// prompt blocks it mapped that are still cached; fewer than `tokens`), and tokens
    /// `cached..tokens` are to be replayed to recompute the rest.
    Recompute {
        /// Tokens it held.
        tokens: usize,
        /// Tokens it holds again, from cached blocks: the replay starts there.
        cached: usize,
    },
}

/// An open's answer on its way to the caller.
pub(crate) struct OpenAnswer {
    opened: Opened,
    /// Closes that incarnation of the sequence unless the caller took the answer.
    undo: Option<(ActorRef<KvStoreMsg>, SeqId, Incarnation)>,
}

impl OpenAnswer {
    pub(super) fn new(
        opened: Opened,
        store: ActorRef<KvStoreMsg>,
        seq: SeqId,
        writer: Incarnation,
    ) -> Self {
        OpenAnswer {
            opened,
            undo: Some((store, seq, writer)),
        }
    }

    /// The caller read it: nothing to undo.
    pub(super) fn take(mut self) -> Opened {
        self.undo = None;
        self.opened
    }
}

impl Drop for OpenAnswer {
    fn drop(&mut self) {
        if let Some((store, seq, writer)) = self.undo.take() {
            let _ = store.cast(KvStoreMsg::Abandon { seq, writer });
        }
    }
}

/// Which call a caller left while it waited for room. A sequence is in at most one call
/// waiting for room (another is `Busy` or `AlreadyOpen`), so one sequence names a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Left {
    Open(SeqId),
    Step(SeqId),
    Restore(SeqId),
}

/// A call on its way: dropped before its answer came (the caller gave up while it waited for
/// room), it calls the call off, so a retry right after finds the sequence as it was instead
/// of `AlreadyOpen` or `Busy`.
pub(super) struct Waiting {
    store: Option<(HolderRef<KvStoreMsg>, Left)>,
}

impl Waiting {
    pub(super) fn new(store: HolderRef<KvStoreMsg>, call: Left) -> Self {
        Waiting {
            store: Some((store, call)),
        }
    }

    /// The answer came (a refusal too): nothing to call off.
    pub(super) fn answered(mut self) {
        self.store = None;
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some((store, call)) = self.store.take() {
            store.cast(KvStoreMsg::CallOff(call));
        }
    }
}
