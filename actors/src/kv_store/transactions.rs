//! What the store has in flight: each transaction waiting for its grant (an open, a
//! step's growth, a restore), and the task waiting for that grant, kept together so that
//! calling one off aborts its wait and hands back what it was for. The grant is asked off the
//! mailbox (tickets keep being answered meanwhile) and comes back as a message that finishes
//! the transaction, or fails it.

use std::collections::HashMap;

use procmem::kv::{GrowthSize, Incarnation, KvSequence, PreemptMode, TableError, Writer};
use procmem::ledger::Priority;
use procmem::MemoryRole;
use ractor::{ActorRef, RpcReplyPort};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::answer::{Left, OpenAnswer, Restored};
use super::prefix::Mapped;

use super::step::KvStep;
use super::swap::Saved;
use super::{KvStoreError, KvStoreMsg, KvStoreState, SeqId};
use crate::governor::{GovernorError, Grant, ReserveRequest};

/// One sequence of a step being prepared: its incarnation, the bytes each of its buffers
/// grows by, and the new tokens the step makes room for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Growth {
    pub(super) seq: SeqId,
    pub(super) writer: Incarnation,
    pub(super) size: GrowthSize,
    pub(super) tokens: usize,
}

/// A transaction waiting for its grant: what it does once the grant comes.
pub(super) enum Pending {
    Open {
        seq: SeqId,
        writer: Incarnation,
        priority: Priority,
        /// Its memory, reserved.
        memory: Box<KvSequence>,
        /// The cached blocks found at open, held so no ticket evicts them meanwhile.
        hits: Vec<(u64, Mapped)>,
        new_keys: Vec<u64>,
        /// How many of `new_keys`, from the first, the disk tier holds: filled from there.
        from_disk: usize,
        bytes: u64,
        reply: RpcReplyPort<Result<OpenAnswer, KvStoreError>>,
    },
    Prepare {
        /// Each sequence, its incarnation, its growth and its new tokens.
        seqs: Vec<Growth>,
        reply: RpcReplyPort<Result<KvStep, KvStoreError>>,
    },
    Restore {
        seq: SeqId,
        writer: Incarnation,
        size: GrowthSize,
        /// The tokens in the cached blocks it maps again, and all it holds.
        tokens: (usize, usize),
        saved: Saved,
        reply: RpcReplyPort<Result<Restored, KvStoreError>>,
    },
}

/// The step's batch: each sequence with its incarnation.
pub(super) fn batch_of(seqs: &[Growth]) -> Vec<Writer> {
    seqs.iter()
        .map(|g| Writer {
            seq: g.seq,
            writer: g.writer,
        })
        .collect()
}

/// Every transaction in flight, and the task waiting for each one's grant.
pub(super) struct Transactions {
    pending: HashMap<u64, Pending>,
    /// The task waiting for each pending transaction's grant, to call it off.
    reserving: HashMap<u64, AbortHandle>,
    next: u64,
}

impl Default for Transactions {
    fn default() -> Self {
        Transactions {
            pending: HashMap::new(),
            reserving: HashMap::new(),
            next: 1,
        }
    }
}

impl Transactions {
    /// A fresh number (for a transaction or a step).
    pub(super) fn next_id(&mut self) -> u64 {
        let id = self.next;
        self.next += 1;
        id
    }

    /// Records `pending`, returning its number.
    pub(super) fn begin(&mut self, pending: Pending) -> u64 {
        let txn = self.next_id();
        self.pending.insert(txn, pending);
        txn
    }

    /// Records the task waiting for `txn`'s grant.
    pub(super) fn waiting(&mut self, txn: u64, task: AbortHandle) {
        self.reserving.insert(txn, task);
    }

    /// `txn`'s grant came: the transaction, unless it was called off meanwhile.
    pub(super) fn granted(&mut self, txn: u64) -> Option<Pending> {
        self.reserving.remove(&txn);
        self.pending.remove(&txn)
    }

    /// Calls off the first transaction `theirs` picks: its wait is aborted (the request
    /// leaves the Governor's queue; a grant already on its way goes back as its handle
    /// drops). Returns it, to be failed.
    pub(super) fn call_off(&mut self, theirs: impl Fn(&Pending) -> bool) -> Option<Pending> {
        let txn = self
            .pending
            .iter()
            .find_map(|(txn, p)| theirs(p).then_some(*txn))?;
        if let Some(task) = self.reserving.remove(&txn) {
            task.abort();
        }
        self.pending.remove(&txn)
    }

    /// Calls off the step growing `seq` (incarnation `writer`), if one waits.
    pub(super) fn call_off_step_of(&mut self, seq: SeqId, writer: Incarnation) -> Option<Pending> {
        self.call_off(|p| match p {
            Pending::Prepare { seqs, .. } => {
                seqs.iter().any(|g| g.seq == seq && g.writer == writer)
            }
            _ => false,
        })
    }

    /// How many transactions are in flight.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.pending.len()
    }
}

impl KvStoreState {
    pub(super) fn begin(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        bytes: u64,
        priority: Priority,
        pending: Pending,
    ) {
        let txn = self.transactions.begin(pending);
        let governor = self.governor.clone();
        let request = ReserveRequest {
            holder: self.holder,
            role: MemoryRole::KvCache,
            bytes,
            priority,
            deadline: Some(Instant::now() + self.config.wait),
        };
        let me = myself.clone();
        // Waiting for room happens off the mailbox, so tickets keep being answered meanwhile.
        let task = tokio::spawn(async move {
            let grant = governor.reserve(request).await;
            let _ = me.cast(KvStoreMsg::Granted { txn, grant });
        });
        self.transactions.waiting(txn, task.abort_handle());
    }

    /// A step whose sequence `seq` pressure took while it waited for its grant: the wait is
    /// called off (the request leaves the Governor's queue; a grant already on its way goes
    /// back as its handle drops) and the step fails with `Preempted`, so the caller can step
    /// the others without it at once instead of waiting for room for all of them.
    /// Returns whether a step was called off.
    pub(super) fn call_off_step_of(
        &mut self,
        seq: SeqId,
        writer: Incarnation,
        mode: PreemptMode,
    ) -> bool {
        match self.transactions.call_off_step_of(seq, writer) {
            Some(pending) => {
                self.fail(
                    pending,
                    KvStoreError::Table(TableError::Preempted(seq, mode)),
                );
                true
            }
            None => false,
        }
    }

    pub(super) async fn granted(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        txn: u64,
        grant: Result<Grant, GovernorError>,
    ) {
        let Some(pending) = self.transactions.granted(txn) else {
            // Called off meanwhile: the grant, if any, goes back as it drops here.
            return;
        };
        match grant {
            Err(e) => self.fail(pending, e.into()),
            Ok(grant) => match pending {
                p @ Pending::Open { .. } => self.finish_open(myself, p, Some(grant)).await,
                p @ Pending::Prepare { .. } => self.finish_prepare(myself, p, grant).await,
                p @ Pending::Restore { .. } => self.finish_restore(p, grant).await,
            },
        }
    }

    pub(super) fn fail(&mut self, pending: Pending, error: KvStoreError) {
        match pending {
            Pending::Open {
                seq, writer, reply, ..
            } => {
                // Its claims go: no block will be made for them.
                self.forget_open(seq, writer);
                let _ = reply.send(Err(error));
            }
            Pending::Prepare { seqs, reply } => {
                self.sequences.end_growth(&batch_of(&seqs));
                let _ = reply.send(Err(error));
            }
            Pending::Restore {
                seq,
                writer,
                saved,
                reply,
                ..
            } => {
                // Preempted again, with its saved copy; the empty memory reserved for the
                // restore goes.
                if let Ok(reserved) = self.sequences.end_restore(seq, writer, false) {
                    drop(reserved);
                    if let Some(to_restore) = self.sequences.to_restore_mut(seq) {
                        to_restore.saved = Some(saved);
                    }
                }
                let _ = reply.send(Err(error));
            }
        }
    }

    /// A caller left while its call waited for room: the wait is called off and the call
    /// fails unread, leaving the sequences as they were (a call already answered is undone
    /// by its answer instead: an `OpenAnswer`, a `KvStep`).
    pub(super) fn call_off(&mut self, call: Left) {
        let called = self.transactions.call_off(|p| match (p, &call) {
            (Pending::Open { seq, .. }, Left::Open(s))
            | (Pending::Restore { seq, .. }, Left::Restore(s)) => seq == s,
            (Pending::Prepare { seqs, .. }, Left::Step(s)) => seqs.iter().any(|g| g.seq == *s),
            _ => false,
        });
        if let Some(pending) = called {
            self.fail(pending, KvStoreError::Unavailable);
        }
    }
}

#[cfg(test)]
mod tests {
    use procmem::kv::SequenceTable;

    use super::*;

    fn prepare(seq: SeqId, writer: Incarnation) -> Pending {
        let (tx, _rx) = tokio::sync::oneshot::channel();
        Pending::Prepare {
            seqs: vec![Growth {
                seq,
                writer,
                size: GrowthSize::default(),
                tokens: 1,
            }],
            reply: RpcReplyPort::from(tx),
        }
    }

    #[test]
    fn numbers_go_up_and_a_grant_takes_its_transaction() {
        let mut table = SequenceTable::<()>::new();
        let w = table.begin_open(1).unwrap();
        let mut t = Transactions::default();
        let a = t.begin(prepare(1, w));
        let b = t.next_id();
        assert!(b > a);
        assert!(t.granted(a).is_some());
        assert!(t.granted(a).is_none());
        assert_eq!(t.len(), 0);
    }

    #[tokio::test]
    async fn calling_off_aborts_the_wait() {
        let mut table = SequenceTable::<()>::new();
        let w1 = table.begin_open(1).unwrap();
        let w2 = table.begin_open(2).unwrap();
        let mut t = Transactions::default();
        let txn = t.begin(prepare(1, w1));
        let task = tokio::spawn(std::future::pending::<()>());
        t.waiting(txn, task.abort_handle());
        assert!(t.call_off_step_of(2, w2).is_none());
        assert!(t.call_off_step_of(1, w2).is_none() || w1 == w2);
        let called = t.call_off_step_of(1, w1);
        assert!(matches!(called, Some(Pending::Prepare { .. })));
        assert!(task.await.unwrap_err().is_cancelled());
        assert_eq!(t.len(), 0);
        assert!(t.granted(txn).is_none());
    }
}
