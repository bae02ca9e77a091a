//! A step's memory, from the prepare to its return: every sequence of the batch grown under
//! one grant (map, commit, publish, all undone on any failure), the views computed before
//! anything moves, the memory lent to the server as a [`KvStep`](super::KvStep), the store's
//! own fence after everything the step's stream took, and each sequence's memory back (its
//! new tokens counted if the step was completed) once that fence completes.

use std::sync::Arc;

use procmem::fence::{Fence, StreamId};
use procmem::kv::{KvError, LayerViews, PendingGrowth, TableError};
use procmem::MemoryRole;
use ractor::{ActorRef, RpcReplyPort};
use tokio::time::Duration;

use super::sequences::Resident;
use super::step::{KvStep, NewTokens, StepMemory, StepSeq};
use super::transactions::{batch_of, Growth, Pending};
use super::{metrics, KvStoreError, KvStoreMsg, KvStoreState, SeqId};
use crate::charge::Charge;
use crate::governor::{Grant, ReserveRequest};

/// A step's memory on its way back to the store, after the store's fence.
pub(crate) struct Returned {
    /// The step's number.
    pub(super) step: u64,
    pub(super) memory: Arc<StepMemory>,
    /// The store's fence after the step's kernels.
    pub(super) marker: Option<Fence>,
    /// Whether its new tokens count.
    pub(super) advance: bool,
    /// The server's fence, where it was of another stream.
    pub(super) foreign: Option<StreamId>,
    /// Answered once the memory is back.
    pub(super) reply: Option<RpcReplyPort<Result<(), KvStoreError>>>,
}

impl KvStoreState {
    /// Lends the memory of `plan` (each [`Growth`] grown, its sequence still that
    /// incarnation unless closed meanwhile) to the caller as a step. A
    /// caller that gave up drops the step, which ends it: its sequences come back idle after
    /// the store's fence.
    pub(super) fn lend(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        plan: &[Growth],
        reply: RpcReplyPort<Result<KvStep, KvStoreError>>,
    ) {
        let batch = batch_of(plan);
        let batch = &batch[..];
        if let Some(seq) = plan
            .iter()
            .find(|g| !self.sequences.is(g.seq, g.writer))
            .map(|g| g.seq)
        {
            // Closed while its grant was on its way: the step is refused as a whole.
            self.sequences.end_growth(batch);
            let _ = reply.send(Err(KvStoreError::Table(TableError::Unknown(seq))));
            return;
        }
        // Where each sequence's K and V lie, before anything moves: the growth made room for
        // the new tokens' rows, so this cannot fail; if it did, nothing is lent.
        let views = match self.step_views(plan) {
            Ok(v) => v,
            Err(e) => {
                self.sequences.end_growth(batch);
                let _ = reply.send(Err(e.into()));
                return;
            }
        };
        let (lent, ahead) = self.take_lent(plan);
        let id = self.transactions.next_id();
        let step = KvStep::new(
            id,
            myself.clone(),
            self.config.shape,
            lent,
            views,
            self.stream.clone(),
        );
        if !ahead.is_empty() {
            self.map_ahead(step.memory_weak(), ahead);
        }
        // A caller that gave up drops the step here, which ends it (nothing counts).
        let _ = reply.send(Ok(step));
    }

    /// Where each sequence of `plan` has its K and V, each layer, with its new tokens.
    fn step_views(&self, plan: &[Growth]) -> Result<Vec<Vec<LayerViews>>, KvError> {
        plan.iter()
            .map(
                |&Growth {
                     seq, tokens: count, ..
                 }| {
                    let memory = self.sequences.memory(seq).expect("a grown sequence");
                    (0..self.config.shape.layers)
                        .map(|l| memory.views(l, memory.tokens() + count))
                        .collect()
                },
            )
            .collect()
    }

    /// Takes the memory of each sequence of `plan` to lend it. Returns it, and the growth to
    /// map ahead while the step runs (for the one token after the step's).
    fn take_lent(&mut self, plan: &[Growth]) -> (Vec<StepSeq>, Vec<Growth>) {
        let mut lent = Vec::with_capacity(plan.len());
        let mut ahead = Vec::new();
        for &Growth {
            seq,
            writer,
            tokens: count,
            ..
        } in plan
        {
            let Resident {
                memory,
                prefixes,
                charge,
                ahead: mapped_ahead,
                ..
            } = self
                .sequences
                .lend(seq, writer)
                .expect("a grown sequence has its memory");
            // The token after this step's needs a new chunk: map it while the step runs.
            let per = memory.growth_for(count + 1);
            let room = memory.tokens() + count < memory.shape().max_tokens;
            if self.config.map_ahead && !per.is_empty() && room {
                ahead.push(Growth {
                    seq,
                    writer,
                    size: per,
                    tokens: 1,
                });
            }
            lent.push(StepSeq {
                seq,
                writer,
                count,
                memory,
                prefixes,
                charge,
                ahead: mapped_ahead,
            });
        }
        (lent, ahead)
    }

    /// Maps the next growth of `seqs` while their step runs, on a task of its own: for each,
    /// a grant of room there is now (no holder is asked to give way for it), committed, then
    /// the mapping under the step's memory (off the async threads: a host kernel may hold
    /// it). A step back in the store by then takes nothing (the lease goes back).
    fn map_ahead(&self, memory: std::sync::Weak<StepMemory>, seqs: Vec<Growth>) {
        let governor = self.governor.clone();
        let holder = self.holder;
        let priority = self.config.priority;
        let latency = self.metrics.growth_map.clone();
        tokio::spawn(async move {
            for Growth {
                seq,
                writer,
                size: per,
                ..
            } in seqs
            {
                let bytes = per.bytes();
                // Only where there is room now: a request refused would count as a denial
                // in the books and metrics, and nobody asked for this.
                match governor.snapshot().await {
                    Ok(s) if s.books.free() >= bytes => {}
                    _ => continue,
                }
                let request = ReserveRequest {
                    holder,
                    role: MemoryRole::KvCache,
                    bytes,
                    priority,
                    deadline: None,
                };
                let Ok(grant) = governor.reserve(request).await else {
                    continue;
                };
                let Ok(lease) = grant.commit(bytes).await else {
                    continue;
                };
                let (memory, latency) = (memory.clone(), latency.clone());
                let _ = tokio::task::spawn_blocking(move || {
                    if let Some(memory) = memory.upgrade() {
                        memory.map_ahead(seq, writer, per, lease, &latency);
                    }
                })
                .await;
            }
        });
    }

    /// A step ended: the store records its own fence after everything submitted on the
    /// stream so far (every kernel of the step among them) and takes the memory back when it
    /// completes.
    pub(super) fn step_ended(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        step: u64,
        memory: Arc<StepMemory>,
        fence: Option<Fence>,
        advance: bool,
        reply: Option<RpcReplyPort<Result<(), KvStoreError>>>,
    ) {
        let foreign = fence.map(|f| f.stream).filter(|s| *s != self.stream.id());
        let done =
            fence.filter(|f| foreign.is_none() && self.stream.timeline().completed() >= f.value);
        let marker = match done {
            // The server's fence has completed and no kernel of the step holds its memory any
            // more (a kernel's share goes before its fence completes): no fence of the
            // store's own is needed, and the memory comes back with the next message.
            Some(fence) if Arc::strong_count(&memory) == 1 => fence,
            // The store's own fence after everything submitted so far (every kernel of the
            // step among them); on a stream that takes no more work, the last value it
            // issued (what was queued still runs).
            _ => self
                .stream
                .mark()
                .unwrap_or_else(|| self.stream.last_issued()),
        };
        // Sent back once `marker` completes. A store gone by then drops the message: the
        // memory's last share then frees it after the stream's queued work.
        let returned = Returned {
            step,
            memory,
            marker: Some(marker),
            advance,
            foreign,
            reply,
        };
        self.send_after(myself, marker, KvStoreMsg::StepReturned(returned));
    }

    /// The store's fence after a step completed: each sequence takes its memory back (and
    /// counts its new token if the step was completed); one closed meanwhile is freed.
    pub(super) fn step_returned(&mut self, myself: &ActorRef<KvStoreMsg>, returned: Returned) {
        let seqs = match returned.memory.take() {
            Ok(seqs) => seqs,
            Err(memory) => {
                // The task mapping ahead holds it for a moment (a kernel's share goes before
                // its fence completes, and none can be submitted after the end): look again
                // a little later rather than free anything under it.
                tracing::debug!(
                    step = returned.step,
                    "step memory still shared after its fence"
                );
                let again = KvStoreMsg::StepReturned(Returned { memory, ..returned });
                let me = myself.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    let _ = me.cast(again);
                });
                return;
            }
        };
        let Returned {
            marker,
            advance,
            foreign,
            reply,
            ..
        } = returned;
        let advance = advance && foreign.is_none();
        for lent in seqs {
            self.take_back(lent, marker, advance);
        }
        // Tickets put off for a step: its sequences are back and free to go. The recheck is
        // queued before the reply below, so before the caller's next prepare.
        for (ticket, rechecks) in std::mem::take(&mut self.after_step) {
            let rechecks = rechecks + 1;
            let _ = myself.cast(KvStoreMsg::RecheckTicket { ticket, rechecks });
        }
        if let Some(reply) = reply {
            let _ = reply.send(match foreign {
                Some(stream) => Err(KvStoreError::ForeignFence(stream)),
                None => Ok(()),
            });
        }
    }

    /// A sequence back from a step: it takes its memory back (with its new tokens if
    /// `advance`); one closed while the step had it (maybe opened again) is freed now.
    fn take_back(&mut self, lent: StepSeq, marker: Option<Fence>, advance: bool) {
        let StepSeq {
            seq,
            writer,
            mut memory,
            prefixes,
            charge,
            ahead,
            count,
        } = lent;
        if advance && self.sequences.is_stepping(seq, writer) {
            let _ = memory.advance_by(count);
        }
        let tokens = memory.tokens();
        let back = Resident {
            memory,
            prefixes,
            charge,
            last_fence: marker,
            ahead,
            copy_in: None,
        };
        match self.sequences.end_step(seq, writer, tokens, back) {
            Ok(done) => {
                for key in done {
                    // Only the block this sequence filled; nobody else's under the key.
                    self.prefixes.complete(key, writer);
                }
            }
            // Closed while the step had it (maybe opened again): freed after its fence.
            Err((_, memory)) => self.retire(memory),
        }
    }

    pub(super) fn prepare(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        seqs: Vec<NewTokens>,
        reply: RpcReplyPort<Result<KvStep, KvStoreError>>,
    ) {
        let plan = match self.sequences.plan_step(&seqs) {
            Ok(plan) => plan,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        if plan.bytes == 0 {
            self.lend(myself, &plan.growth, reply);
            return;
        }
        self.sequences.growing(&batch_of(&plan.growth));
        self.begin(
            myself,
            plan.bytes,
            plan.priority,
            Pending::Prepare {
                seqs: plan.growth,
                reply,
            },
        );
    }

    /// The grow transaction: map every sequence's growth (undoing all on any failure),
    /// commit the one charge, then publish.
    pub(super) async fn finish_prepare(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        pending: Pending,
        grant: Grant,
    ) {
        let Pending::Prepare { seqs, reply } = pending else {
            return;
        };
        let batch = batch_of(&seqs);
        // Pressure may take a newer sequence while the step waits for its grant (when every
        // holder waits for a grant, someone must give way): the step fails as a whole, its
        // grant goes back, and the caller steps the others and restores that one later.
        if let Some((taken, mode)) = self.sequences.preempted_in(&batch) {
            drop(grant);
            self.sequences.end_growth(&batch);
            let _ = reply.send(Err(KvStoreError::Table(TableError::Preempted(taken, mode))));
            return;
        }
        let (mapped, mut failure) = self.map_batch(&seqs);
        let actual: u64 = mapped.iter().map(|(_, g)| g.bytes()).sum();
        let mut committed = Charge::counted(&self.tally);
        if failure.is_none() && actual > 0 {
            if let Err(e) = procmem::fault::hit("kv.grow.commit") {
                failure = Some(e.into());
                drop(grant);
            } else {
                match grant.commit(actual).await {
                    Ok(lease) => committed.add(lease),
                    Err(refused) => failure = Some(refused.error.into()),
                }
            }
        } else {
            drop(grant);
        }
        if failure.is_none() {
            if let Err(e) = procmem::fault::hit("kv.grow.publish") {
                failure = Some(e.into());
            }
        }
        self.settle_growth(mapped, &mut committed, failure.is_some());
        // On failure everything was unmapped above; only now does the charge go back.
        drop(committed);
        match failure {
            Some(e) => {
                self.sequences.end_growth(&batch);
                let _ = reply.send(Err(e));
            }
            None => self.lend(myself, &seqs, reply),
        }
    }

    /// Maps each sequence's growth (those still this incarnation), stopping at the first
    /// failure. Returns what was mapped and the failure, if any.
    fn map_batch(
        &mut self,
        seqs: &[Growth],
    ) -> (Vec<(SeqId, PendingGrowth)>, Option<KvStoreError>) {
        let mut mapped: Vec<(SeqId, PendingGrowth)> = Vec::new();
        for Growth {
            seq,
            writer,
            size: per,
            ..
        } in seqs
        {
            // A sequence closed (and maybe opened again) since the prepare is not this one.
            if !self.sequences.is(*seq, *writer) {
                continue;
            }
            let Some(memory) = self.sequences.resident_mut(*seq).map(|r| &mut r.memory) else {
                continue;
            };
            if per.is_empty() {
                continue;
            }
            match metrics::timed(&self.metrics.growth_map, || memory.map_growth(*per)) {
                Ok(g) => mapped.push((*seq, g)),
                Err(e) => return (mapped, Some(e.into())),
            }
        }
        (mapped, None)
    }

    /// Publishes each sequence's growth with the part of `committed` that pays for it, or,
    /// if the step `failed`, unmaps it (what stays mapped stays paid for by its sequence).
    fn settle_growth(
        &mut self,
        mapped: Vec<(SeqId, PendingGrowth)>,
        committed: &mut Charge,
        failed: bool,
    ) {
        for (seq, growth) in mapped {
            let Some(Resident { memory, charge, .. }) = self.sequences.resident_mut(seq) else {
                continue;
            };
            if failed {
                let bytes = growth.bytes();
                if memory.abandon(growth).is_err() {
                    // Not unmapped: the memory stays with the sequence, and so does what
                    // pays for it (if the commit went through), until the sequence goes.
                    if let Some(part) = committed.split(bytes) {
                        charge.absorb(part);
                    }
                }
            } else {
                // Each sequence keeps the part of the step's lease that pays for its growth.
                if let Some(part) = committed.split(growth.bytes()) {
                    charge.absorb(part);
                }
                memory.publish(growth);
            }
        }
    }
}
