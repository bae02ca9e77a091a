//! The store's bookkeeping: grants obtained off the mailbox, retiring a sequence's memory
//! to the deferred-free path, answering pressure tickets with whole units, preemption and
//! the counters.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use procmem::fence::{Fence, TimelineFence};
use procmem::kv::{BlockState, Incarnation, KvError, KvSequence, PreemptMode, PrefixDigest};
use procmem::ledger::Priority;
use procmem::MemoryRole;
use ractor::{ActorRef, RpcReplyPort};
use tokio::time::Instant;

use super::metrics::EVERY;
use super::sequences::{Resident, SeqMemory};
use super::transactions::{batch_of, Pending};
use super::{KvStoreError, KvStoreMsg, KvStoreState, KvStoreStats, SeqId};
use crate::deferred_free::PendingFree;
use crate::governor::{GovernorError, Grant, ReserveRequest};

impl KvStoreState {
    /// Closes `seq`: its blocks not yet written leave the cache, its memory goes after its
    /// fences. An open on its way is forgotten (it finds the id closed when it ends).
    pub(super) fn close(&mut self, seq: SeqId) {
        if let Some(entry) = self.take_closed(seq) {
            self.retire(entry);
        }
    }

    /// Takes `seq` out of the store: its blocks not yet written leave the cache, and its
    /// entry (its memory, if it has one) is returned to be let go of.
    pub(super) fn take_closed(&mut self, seq: SeqId) -> Option<Resident> {
        let (writer, entry) = self.sequences.close(seq);
        if let Some(writer) = writer {
            self.prefixes.abandon(writer);
        }
        entry
    }

    /// An open that failed: its claims go and the id is free again.
    pub(super) fn forget_open(&mut self, seq: SeqId, writer: Incarnation) {
        self.prefixes.abandon(writer);
        self.sequences.table.forget_open(seq, writer);
    }

    /// A new sequence's memory: a reservation per buffer on the device, nothing mapped.
    pub(super) fn reserve_memory(&self) -> Result<KvSequence, KvError> {
        KvSequence::reserve(
            self.device.backing.clone(),
            self.config.shape,
            self.config.chunk_granules,
        )
    }

    /// Lets go of the tier below. The whole blocks still in memory go down to a disk tier
    /// first, so a store started again on its directory finds them.
    pub(super) async fn close_tier(&mut self) {
        if let Some(super::Below::Disk(tier)) = self.tier.take() {
            let blocks = self.resident_blocks();
            let mapping = Arc::clone(&self.device.shared);
            let wait = self.config.wait.max(std::time::Duration::from_secs(5));
            let flush = move || tier.flush(blocks, mapping, wait);
            let flushed = tokio::task::spawn_blocking(flush).await.unwrap_or(0);
            tracing::debug!(flushed, "prefix blocks sent to the disk tier at stop");
        }
    }

    /// The whole blocks in the cache, least recently used first, with what a tier below
    /// keys each by.
    pub(super) fn resident_blocks(&self) -> Vec<super::tier::Resident> {
        let mut whole: Vec<_> = self
            .prefixes
            .blocks()
            .filter(|(.., state)| *state == BlockState::Complete)
            .map(|(key, block, last_used, _)| (last_used, key, block))
            .collect();
        whole.sort_unstable_by_key(|(last_used, key, _)| (*last_used, *key));
        whole
            .into_iter()
            .filter_map(|(_, key, block)| {
                let (parent, tokens) = self.prefixes.prompt_of(key)?;
                Some((key, (parent, tokens.to_vec()), Arc::clone(block)))
            })
            .collect()
    }

    /// Sends a sequence's memory to the deferred-free queue with its last fence.
    pub(super) fn retire(&mut self, resident: Resident) {
        let Resident {
            memory: seq,
            charge,
            prefixes,
            last_fence,
            ..
        } = resident;
        let memory = SeqMemory { seq, prefixes };
        let pending = PendingFree::new(Box::new(memory), Some(charge));
        if let Some(use_) = last_fence.and_then(|f| TimelineFence::new(f, self.stream.timeline())) {
            pending.record_use(use_);
        }
        // If the queue is gone the message is dropped, and a dropped `PendingFree` still frees
        // only after its fence, woken by its completion.
        self.stream.deferred_free().enqueue(pending);
    }

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
                self.fail(pending, KvStoreError::Preempted(seq, mode));
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
                self.sequences.table.end_growth(&batch_of(&seqs));
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
                if let Ok(reserved) = self.sequences.table.end_restore(seq, writer, false) {
                    drop(reserved);
                    if let Some(to_restore) = self.sequences.to_restore_mut(seq) {
                        to_restore.saved = Some(saved);
                    }
                }
                let _ = reply.send(Err(error));
            }
        }
    }

    /// After a message: publishes the metrics when due, else makes sure they are soon.
    pub(super) async fn changed(&mut self, myself: &ActorRef<KvStoreMsg>) {
        // Not due yet, or published with the memory still moving: once more, soon.
        let again = !self.metrics.due(tokio::time::Instant::now()) || self.publish().await;
        if again {
            self.publish_soon(myself);
        }
    }

    /// The publish scheduled by `publish_soon` is due. Memory freed after fences comes back
    /// with no message to the store: while the figures still move, it looks again.
    pub(super) async fn scheduled_publish(&mut self, myself: &ActorRef<KvStoreMsg>) {
        self.metrics.armed = false;
        if self.publish().await {
            self.publish_soon(myself);
        }
    }

    /// Sends `msg` to the store once `fence` of its stream has completed (at once if it has).
    /// A store gone by then drops the message.
    pub(super) fn send_after(&self, myself: &ActorRef<KvStoreMsg>, fence: Fence, msg: KvStoreMsg) {
        let me = myself.clone();
        self.stream.timeline().on_complete(
            fence.value,
            Box::new(move |_| {
                let _ = me.cast(msg);
            }),
        );
    }

    /// Answers a `Stats` message.
    pub(super) fn send_stats(&self, reply: RpcReplyPort<Result<KvStoreStats, KvStoreError>>) {
        let _ = reply.send(Ok(self.stats()));
    }

    /// Schedules one publish (none if one is scheduled already).
    pub(super) fn publish_soon(&mut self, myself: &ActorRef<KvStoreMsg>) {
        if !self.metrics.armed {
            self.metrics.armed = true;
            myself.send_after(EVERY, || KvStoreMsg::Publish);
        }
    }

    /// Publishes the metrics and the digest now; true if the store's memory moved since the
    /// last time.
    pub(super) async fn publish(&mut self) -> bool {
        self.digest.send_replace(Arc::new(self.prefix_digest()));
        let stats = self.stats();
        let capacity = match self.governor.snapshot().await {
            Ok(s) => s.books.capacity,
            Err(_) => 0,
        };
        self.metrics.publish(&stats, capacity)
    }

    /// The keys of the whole prompt blocks it holds, in memory and on disk.
    fn prefix_digest(&self) -> PrefixDigest {
        let g = self.device.granularity();
        let mut digest = PrefixDigest::new(self.config.shape.block_tokens(g));
        let complete = self.prefixes.states();
        let in_memory = complete
            .filter(|(_, s)| *s == BlockState::Complete)
            .map(|(k, _)| k);
        match &self.tier {
            Some(tier) => tier.digest_into(&mut digest, in_memory),
            None => in_memory.for_each(|key| digest.insert(key)),
        }
        digest
    }

    pub(super) fn stats(&self) -> KvStoreStats {
        let mut stats = self.stats.clone();
        stats.preemptions = stats.preempted_by_swap + stats.preempted_by_recompute;
        // Every swap-in is a restore that copied the K/V back.
        stats.restores_swapped = stats.swap_ins;
        let held = self.sequences.held();
        stats.sequences = held.sequences;
        stats.preempted = held.preempted;
        stats.tokens = held.tokens;
        stats.exclusive_bytes = held.exclusive_bytes;
        stats.prefix_entries = self.prefixes.blocks().count();
        stats.prefix_bytes = self.prefixes.blocks().map(|(_, b, _, _)| b.bytes).sum();
        if let Some(tier) = &self.tier {
            tier.fill(&mut stats);
        }
        stats.leased_bytes = self.tally.bytes();
        stats.os_resident_bytes = self.device.resident_bytes();
        stats.swap = self.swap.kind();
        let outcomes = &self.swap_outcomes;
        stats.swap_outs = outcomes.outs.load(Ordering::Relaxed);
        stats.swap_out_bytes = outcomes.out_bytes.load(Ordering::Relaxed);
        stats.swap_fallbacks += outcomes.failed.load(Ordering::Relaxed);
        stats.swapped_bytes = self.sequences.swapped_bytes();
        stats
    }
}
