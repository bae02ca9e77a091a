//! The store's bookkeeping: grants obtained off the mailbox, retiring a sequence's memory
//! to the deferred-free path, answering pressure tickets with whole units, preemption and
//! the counters.

use std::sync::atomic::Ordering;
use tracing::Instrument;

use super::*;

/// What one preemption did.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Taken {
    /// Bytes freed.
    pub(super) freed: u64,
    /// A step the sequence was waiting in was called off.
    pub(super) called_off_step: bool,
    /// Bytes freed once a copy out on the stream has run.
    pub(super) pending: u64,
}

/// A preempted sequence's memory on its way out: the memory is freed, then what paid for it
/// (fields drop in this order); a swap's copy kernel drops it once the rows are out.
struct CopyOut {
    memory: SeqMemory,
    _charge: Charge,
}

impl KvStoreState {
    /// Whether a kernel that used `entry` may still be running.
    fn fence_pending(&self, entry: &SeqEntry) -> bool {
        entry
            .last_fence
            .is_some_and(|f| self.stream.timeline().completed() < f.value)
    }

    /// Closes `seq`: its blocks not yet written leave the cache, its memory goes after its
    /// fences. An open on its way is forgotten (it finds the id closed when it ends).
    pub(super) fn close(&mut self, seq: SeqId) {
        if let Some(record) = self.table.close(seq) {
            self.prefixes.abandon(record.writer);
        }
        if let Some(entry) = self.seqs.remove(&seq) {
            self.retire(entry);
        }
    }

    /// An open that failed: its claims go and the id is free again.
    pub(super) fn forget_open(&mut self, seq: SeqId, writer: Writer) {
        self.prefixes.abandon(writer);
        self.table.end_open(seq, writer, 0, None);
    }

    /// A new sequence's memory: a reservation per buffer on the device, nothing mapped.
    pub(super) fn reserve_memory(&self) -> Result<KvSequence, KvError> {
        KvSequence::reserve(
            self.device.backing.clone(),
            self.config.shape,
            self.config.chunk_granules,
        )
    }

    /// Sends a sequence's memory to the deferred-free queue with its last fence.
    pub(super) fn retire(&mut self, entry: SeqEntry) {
        let SeqEntry {
            memory,
            charge,
            prefixes,
            last_fence,
            ..
        } = entry;
        let Some(seq) = memory else {
            return;
        };
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
        let txn = self.next_txn;
        self.next_txn += 1;
        self.pending.insert(txn, pending);
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
        self.reserving.insert(txn, task.abort_handle());
    }

    /// A step whose sequence `seq` pressure took while it waited for its grant: the wait is
    /// called off (the request leaves the Governor's queue; a grant already on its way goes
    /// back as its handle drops) and the step fails with `Preempted`, so the caller can step
    /// the others without it at once instead of waiting for room for all of them.
    /// Returns whether a step was called off.
    fn call_off_step_of(&mut self, seq: SeqId, writer: Writer, mode: PreemptMode) -> bool {
        let txn = self.pending.iter().find_map(|(txn, p)| match p {
            Pending::Prepare { seqs, .. }
                if seqs.iter().any(|(s, w, ..)| *s == seq && *w == writer) =>
            {
                Some(*txn)
            }
            _ => None,
        });
        let Some(txn) = txn else { return false };
        if let Some(task) = self.reserving.remove(&txn) {
            task.abort();
        }
        match self.pending.remove(&txn) {
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
        self.reserving.remove(&txn);
        let Some(pending) = self.pending.remove(&txn) else {
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
                self.table.end_growth(&batch_of(&seqs), false);
                let _ = reply.send(Err(error));
            }
            Pending::Restore {
                seq,
                writer,
                saved,
                reply,
                ..
            } => {
                let ours = self.table.end_restore(seq, writer, false);
                if let Some(e) = self.seqs.get_mut(&seq).filter(|_| ours) {
                    // Preempted again, with its saved copy; the empty memory reserved for the
                    // restore goes.
                    e.saved = Some(saved);
                    e.memory = None;
                }
                let _ = reply.send(Err(error));
            }
        }
    }

    /// Whether only a kernel still on the stream keeps `entry` from being a victim: it will be
    /// free to go as soon as that kernel's fence completes.
    pub(super) fn waits_only_for_its_fence(&self, seq: SeqId, entry: &SeqEntry) -> bool {
        self.table.evictable(seq) && entry.memory.is_some() && self.fence_pending(entry)
    }

    /// Answers a pressure ticket with whole units: unreferenced cached prefixes, then whole
    /// sequences with no kernel in flight. Everything chosen is freed now (nothing chosen is
    /// in use by the device), so the report has nothing pending a fence. `rechecks`: how many
    /// times this ticket was already put off.
    pub(super) async fn answer(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        ticket: PressureTicket,
        rechecks: u32,
    ) {
        let span = tracing::debug_span!(
            "pressure_ticket",
            ticket = ticket.id.get(),
            wanted = ticket.bytes_wanted
        );
        self.answer_in(myself, ticket, rechecks)
            .instrument(span)
            .await
    }

    /// Unmaps growth mapped ahead and not published yet (slack no kernel uses) until `wanted`
    /// bytes are freed, releasing what paid for it after the unmap. Returns the bytes freed.
    fn drop_ahead(&mut self, wanted: u64) -> u64 {
        let mut freed = 0;
        for entry in self.seqs.values_mut() {
            if freed >= wanted {
                break;
            }
            let (Some(memory), Some(growth)) = (entry.memory.as_mut(), entry.ahead.take()) else {
                continue;
            };
            let bytes = growth.bytes();
            // A tail that fails to unmap stays mapped, and stays paid for by the sequence.
            if memory.abandon(growth).is_ok() {
                drop(entry.charge.split(bytes));
                freed += bytes;
            }
        }
        freed
    }

    async fn answer_in(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        ticket: PressureTicket,
        rechecks: u32,
    ) {
        // Growth mapped ahead goes first: it is slack, and taking it costs no sequence.
        let slack = self.drop_ahead(ticket.bytes_wanted);
        if slack >= ticket.bytes_wanted {
            ticket.report(slack, 0);
            return;
        }
        let prefixes: Vec<PrefixCandidate<u64>> = self
            .prefixes
            .blocks()
            .map(|(key, block, last_used, _)| PrefixCandidate {
                key,
                bytes: block.bytes,
                last_used,
                // Only the cache holds it: nobody maps it (its writer included).
                referenced: Arc::strong_count(block) > 1,
            })
            .collect();
        let sequences: Vec<SequenceCandidate<SeqId>> = self
            .table
            .iter()
            .filter_map(|(id, r)| {
                let e = self.seqs.get(&id)?;
                let memory = e.memory.as_ref()?;
                // Taking it frees its own memory and lets go of the prompt blocks only it maps
                // (the cache's reference and its own: a block out of the cache has only the
                // mapper that kept it), which are then evicted like any unreferenced block. A
                // sequence that maps only shared blocks still gives way this way.
                let sole_blocks: u64 = e
                    .prefixes
                    .iter()
                    .filter(|p| Arc::strong_count(p) <= 2)
                    .map(|p| p.bytes)
                    .sum();
                Some(SequenceCandidate {
                    id,
                    bytes: memory.exclusive_bytes() + sole_blocks,
                    priority: r.priority,
                    in_flight: !self.table.evictable(id) || self.fence_pending(e),
                    admitted: r.admitted,
                })
            })
            .collect();
        let available: u64 = prefixes
            .iter()
            .filter(|p| !p.referenced)
            .map(|p| p.bytes)
            .chain(sequences.iter().filter(|s| !s.in_flight).map(|s| s.bytes))
            .sum();
        let soon_free = self
            .seqs
            .iter()
            .filter(|(id, e)| self.waits_only_for_its_fence(**id, e))
            .filter_map(|(_, e)| e.last_fence)
            .min_by_key(|f| f.value);
        if let Some(fence) = soon_free.filter(|_| {
            available == 0
                && slack == 0
                && rechecks < TICKET_RECHECKS
                && tokio::time::Instant::now() < ticket.deadline
        }) {
            // Nothing can go now, but a sequence whose last kernel is finishing can go once
            // its fence completes: its completion wakes the store to look again (a few times
            // at most) rather than answer "nothing" and not be asked again in this round.
            // Nothing polls. (The Governor has one ticket out at a time and moves on at the
            // ticket's deadline.)
            let me = myself.clone();
            self.stream.timeline().on_complete(
                fence.value,
                Box::new(move |_| {
                    let _ = me.cast(KvStoreMsg::RecheckTicket {
                        ticket,
                        rechecks: rechecks + 1,
                    });
                }),
            );
            return;
        }
        let (mut freed, mut pending) = (slack, 0);
        // Every eligible unit in the policy's order; stop once enough is really freed (a unit
        // whose free fails frees nothing and the next one is taken).
        for victim in choose_victims(u64::MAX, &prefixes, &sequences) {
            if freed + pending >= ticket.bytes_wanted {
                break;
            }
            match victim {
                Victim::Prefix(key) => {
                    if procmem::fault::hit("kv.evict").is_err() {
                        continue;
                    }
                    if let Some(block) = self.prefixes.remove(key) {
                        freed += block.bytes;
                        self.stats.prefix_blocks_evicted += 1;
                    }
                }
                Victim::Sequence(id) => {
                    let taken = self.preempt(id).await;
                    freed += taken.freed;
                    pending += taken.pending;
                    if taken.called_off_step {
                        // A step of this store was called off: what the ticket wanted may
                        // have been for it. Stop here; if others still lack room the
                        // Governor asks again.
                        break;
                    }
                }
            }
        }
        // Blocks the preempted sequences were the last to map are unreferenced now.
        if freed + pending < ticket.bytes_wanted {
            let mut loose: Vec<(u64, u64, u64)> = self
                .prefixes
                .blocks()
                .filter(|(_, b, _, _)| Arc::strong_count(b) == 1)
                .map(|(key, b, last_used, _)| (last_used, key, b.bytes))
                .collect();
            loose.sort_unstable();
            for (_, key, _) in loose {
                if freed + pending >= ticket.bytes_wanted {
                    break;
                }
                if let Some(block) = self.prefixes.remove(key) {
                    freed += block.bytes;
                    self.stats.prefix_blocks_evicted += 1;
                }
            }
        }
        self.stats.tickets += 1;
        self.stats.freed_by_pressure += freed + pending;
        tracing::debug!(
            wanted = ticket.bytes_wanted,
            freed,
            pending,
            "KV store answered a pressure ticket"
        );
        ticket.report(freed, pending);
    }

    /// Preempts a sequence that has no kernel in flight: its KV is copied out to the swap
    /// space by a kernel on the stream that then frees the memory (swap), or dropped and its
    /// memory freed now (recompute, or a swap space without room). Returns the bytes freed
    /// now, those freed after the copy's fence, and whether a step it was waiting in was
    /// called off.
    pub(super) async fn preempt(&mut self, id: SeqId) -> Taken {
        let span = tracing::debug_span!("eviction", seq = id, mode = ?self.config.preempt);
        self.preempt_in(id).instrument(span).await
    }

    async fn preempt_in(&mut self, id: SeqId) -> Taken {
        if procmem::fault::hit("kv.evict").is_err() {
            return Taken::default();
        }
        let Some(memory) = self.seqs.get(&id).and_then(|e| e.memory.as_ref()) else {
            return Taken::default();
        };
        if !self.table.evictable(id) {
            return Taken::default();
        }
        let tokens = memory.tokens();
        // On a GPU the copy out is a device-to-host copy made here, so the sequence's last
        // kernel must have finished first (on the host the copy is a kernel queued after it).
        let fence = self.seqs.get(&id).and_then(|e| e.last_fence);
        let idle = match fence {
            Some(f) if !self.device.is_host() => self.device.wait(f, self.config.wait).await,
            _ => true,
        };
        let Some(memory) = self.seqs.get(&id).and_then(|e| e.memory.as_ref()) else {
            return Taken::default();
        };
        // Room for the copy is found first (the sequence is idle: nothing writes it
        // meanwhile); a swap space without room makes this a recompute.
        let saved = match self.config.preempt {
            PreemptMode::Swap if tokens > 0 && idle => {
                let saved = Saved::reserve(&self.swap, self.device.host(), memory, tokens).await;
                if saved.is_none() {
                    self.stats.swap_fallbacks += 1;
                }
                saved
            }
            _ => None,
        };
        let mut mode = match (self.config.preempt, &saved) {
            (PreemptMode::Swap, Some(_)) => PreemptMode::Swap,
            _ => PreemptMode::Recompute,
        };
        let was_growing = self
            .table
            .get(id)
            .is_some_and(|r| r.phase == Phase::Growing);
        let Some(writer) = self.table.preempt(id, mode, tokens) else {
            return Taken::default();
        };
        let called_off_step = was_growing && self.call_off_step_of(id, writer, mode);
        let entry = self.seqs.get_mut(&id).expect("checked above");
        let memory = entry.memory.take().expect("checked above");
        // Growth mapped ahead is part of this memory, and goes with it.
        entry.ahead = None;
        let prefixes = std::mem::take(&mut entry.prefixes);
        let bytes = memory.exclusive_bytes();
        let charge = std::mem::replace(&mut entry.charge, Charge::counted(&self.tally));
        // Dropped, it unmaps the memory and then gives back what paid for it.
        let out = CopyOut {
            memory: SeqMemory {
                seq: memory,
                prefixes,
            },
            _charge: charge,
        };
        let (mut freed, mut pending) = (0, 0);
        match saved {
            Some(saved) if !self.device.is_host() => {
                // The sequence's kernels have finished: the rows are copied out now, and the
                // memory goes after the stream's queued work (nothing of it uses this memory).
                saved.copy(
                    self.metrics.swap_out.clone(),
                    Arc::clone(&self.swap_outcomes),
                )(&out.memory.seq);
                if saved.copied() {
                    entry.saved = Some(saved);
                } else {
                    // Nothing kept (the copy counted its failure): the restore recomputes.
                    mode = PreemptMode::Recompute;
                }
                self.stream.after_queued(move || drop(out));
                pending = bytes;
            }
            Some(mut saved) => {
                // The copy out is a kernel on the stream, which frees the memory once the
                // rows are out.
                let copy = saved.copy(
                    self.metrics.swap_out.clone(),
                    Arc::clone(&self.swap_outcomes),
                );
                match self.stream.submit_host(move || {
                    copy(&out.memory.seq);
                    drop(out);
                }) {
                    Ok(fence) => {
                        // Counted by the copy once its bytes are written.
                        saved.fence = Some(fence);
                        entry.last_fence = Some(fence);
                        pending = bytes;
                    }
                    // A closed stream ran nothing: the kernel (and the memory, then its
                    // charge) is gone already, and the restore will recompute.
                    Err(_) => freed = bytes,
                }
                entry.saved = Some(saved);
            }
            None if idle => {
                // Nothing to copy and not in flight: freed here and now.
                drop(out);
                freed = bytes;
            }
            None => {
                // Its last kernel was not seen to finish: freed after the stream's queued work.
                self.stream.after_queued(move || drop(out));
                pending = bytes;
            }
        }
        // The blocks it had not finished writing leave the cache with it.
        self.prefixes.abandon(writer);
        match mode {
            PreemptMode::Swap => self.stats.preempted_by_swap += 1,
            PreemptMode::Recompute => self.stats.preempted_by_recompute += 1,
        }
        Taken {
            freed,
            called_off_step,
            pending,
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

    /// Schedules one publish (none if one is scheduled already).
    pub(super) fn publish_soon(&mut self, myself: &ActorRef<KvStoreMsg>) {
        if !self.metrics.armed {
            self.metrics.armed = true;
            myself.send_after(metrics::EVERY, || KvStoreMsg::Publish);
        }
    }

    /// Publishes the metrics now; true if the store's memory moved since the last time.
    pub(super) async fn publish(&mut self) -> bool {
        let stats = self.stats();
        let capacity = match self.governor.snapshot().await {
            Ok(s) => s.books.capacity,
            Err(_) => 0,
        };
        self.metrics.publish(&stats, capacity)
    }

    pub(super) fn stats(&self) -> KvStoreStats {
        let mut stats = self.stats.clone();
        stats.preemptions = stats.preempted_by_swap + stats.preempted_by_recompute;
        // Every swap-in is a restore that copied the K/V back.
        stats.restores_swapped = stats.swap_ins;
        stats.sequences = self.table.len();
        for (id, r) in self.table.iter() {
            if matches!(r.phase, Phase::Preempted { .. }) {
                stats.preempted += 1;
            } else if let Some(e) = self.seqs.get(&id) {
                let (tokens, bytes) = match (&e.memory, e.away) {
                    (Some(m), _) => (m.tokens(), m.exclusive_bytes()),
                    (None, Some(away)) => away,
                    (None, None) => (0, 0),
                };
                stats.tokens += tokens;
                stats.exclusive_bytes += bytes;
            }
        }
        stats.prefix_entries = self.prefixes.blocks().count();
        stats.prefix_bytes = self.prefixes.blocks().map(|(_, b, _, _)| b.bytes).sum();
        stats.leased_bytes = self.tally.bytes();
        stats.os_resident_bytes = self.device.resident_bytes();
        stats.swap = self.swap.kind();
        let outcomes = &self.swap_outcomes;
        stats.swap_outs = outcomes.outs.load(Ordering::Relaxed);
        stats.swap_out_bytes = outcomes.out_bytes.load(Ordering::Relaxed);
        stats.swap_fallbacks += outcomes.failed.load(Ordering::Relaxed);
        stats.swapped_bytes = self
            .seqs
            .values()
            .filter_map(|e| e.saved.as_ref())
            .filter(|s| s.copied())
            .map(Saved::bytes)
            .sum();
        stats
    }
}
