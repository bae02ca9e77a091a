//! Answering a Governor's pressure ticket with whole units: growth mapped ahead first, then
//! unreferenced cached blocks and whole sequences with no kernel in flight in the order the
//! pure policy gives (`procmem::kv::victims`), each preempted sequence copied out to the swap
//! space or dropped for recomputation.

use std::collections::HashMap;
use std::sync::Arc;

use procmem::fence::Fence;
use procmem::kv::{
    choose_victims, BlockState, PreemptMode, PrefixCandidate, SequenceCandidate, Victim,
};
use ractor::ActorRef;
use tracing::Instrument;

use super::prefix::SharedPrefix;
use super::sequences::{RemapBlock, Resident, SeqMemory};
use super::swap::Saved;
use super::{KvStoreMsg, KvStoreState, SeqId, TICKET_RECHECKS};
use crate::charge::Charge;
use crate::ticket::PressureTicket;

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

/// What a ticket has got so far: bytes freed now, and bytes freed after a fence.
#[derive(Debug, Default, Clone, Copy)]
struct Got {
    freed: u64,
    pending: u64,
}

impl Got {
    fn total(self) -> u64 {
        self.freed + self.pending
    }
}

impl KvStoreState {
    /// Whether the kernel of `fence` (a sequence's last) may still be running.
    fn fence_pending(&self, fence: Option<Fence>) -> bool {
        fence.is_some_and(|f| self.stream.timeline().completed() < f.value)
    }

    /// Whether only a kernel still on the stream keeps `seq` from being a victim: it will be
    /// free to go as soon as that kernel's fence completes.
    fn waits_only_for_its_fence(&self, seq: SeqId) -> bool {
        self.sequences.evictable(seq)
            && self
                .sequences
                .resident(seq)
                .is_some_and(|r| self.fence_pending(r.last_fence))
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
        for r in self.sequences.residents_mut() {
            if freed >= wanted {
                break;
            }
            let Some(growth) = r.ahead.take() else {
                continue;
            };
            let bytes = growth.bytes();
            // A tail that fails to unmap stays mapped, and stays paid for by the sequence.
            if r.memory.abandon(growth).is_ok() {
                drop(r.charge.split(bytes));
                freed += bytes;
            }
        }
        freed
    }

    /// Every cached prefix block, and whether some sequence maps it.
    fn prefix_candidates(&self) -> Vec<PrefixCandidate<u64>> {
        self.prefixes
            .blocks()
            .map(|(key, block, last_used, _)| PrefixCandidate {
                key,
                bytes: block.bytes,
                last_used,
                hits: self.prefixes.hits(key),
                // Some sequence maps it (its writer included, or an open about to).
                referenced: block.sharers() > 0,
            })
            .collect()
    }

    /// Every sequence with its memory, what taking it frees and whether it is in flight.
    fn sequence_candidates(&self) -> Vec<SequenceCandidate<SeqId>> {
        self.sequences
            .iter()
            .filter_map(|(id, r)| {
                let e = r.resident()?;
                let memory = &e.memory;
                // Taking it frees its own memory and lets go of the prompt blocks only it maps
                // (it is their one sharer), which are then evicted like any unreferenced
                // block. A sequence that maps only shared blocks still gives way this way.
                let sole_blocks: u64 = e
                    .prefixes
                    .iter()
                    .filter(|p| p.sharers() <= 1)
                    .map(|p| p.bytes)
                    .sum();
                Some(SequenceCandidate {
                    id,
                    bytes: memory.exclusive_bytes() + sole_blocks,
                    priority: r.priority,
                    in_flight: !self.sequences.evictable(id) || self.fence_pending(e.last_fence),
                    admitted: r.admitted,
                })
            })
            .collect()
    }

    /// The earliest fence after which a sequence waiting only for its kernel can go.
    fn soon_free(&self) -> Option<Fence> {
        self.sequences
            .iter()
            .filter(|(id, _)| self.waits_only_for_its_fence(*id))
            .filter_map(|(_, s)| s.resident()?.last_fence)
            .min_by_key(|f| f.value)
    }

    /// Looks at `ticket` again once `fence` completes.
    fn recheck_after(
        &self,
        myself: &ActorRef<KvStoreMsg>,
        fence: Fence,
        ticket: PressureTicket,
        rechecks: u32,
    ) {
        let recheck = KvStoreMsg::RecheckTicket {
            ticket,
            rechecks: rechecks + 1,
        };
        self.send_after(myself, fence, recheck);
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
        let prefixes = self.prefix_candidates();
        let sequences = self.sequence_candidates();
        let available: u64 = prefixes
            .iter()
            .filter(|p| !p.referenced)
            .map(|p| p.bytes)
            .chain(sequences.iter().filter(|s| !s.in_flight).map(|s| s.bytes))
            .sum();
        // Not enough can go now, and the ticket may still be looked at again (a few times
        // at most, before its deadline) rather than answered short and not asked again in
        // this round. Nothing polls. (The Governor has one ticket out at a time and moves on
        // at the ticket's deadline.)
        let may_look_again = slack == 0
            && rechecks < TICKET_RECHECKS
            && tokio::time::Instant::now() < ticket.deadline;
        if may_look_again && available < ticket.bytes_wanted {
            if let Some(fence) = self.keeping {
                // A closed sequence's blocks are on their way into the cache (its keep kernel
                // is queued): once there they can go. Answering short now would send the
                // Governor to the next holder (a layer of weights, offloaded for this and
                // taken back at once, preempting the very sequences that make room).
                self.recheck_after(myself, fence, ticket, rechecks);
                return;
            }
        }
        if may_look_again && available == 0 {
            if let Some(fence) = self.soon_free() {
                // A sequence whose last kernel is finishing can go once its fence completes:
                // its completion wakes the store to look again.
                self.recheck_after(myself, fence, ticket, rechecks);
                return;
            }
            let mut lent = self.sequences.iter().map(|(_, r)| r);
            if lent.any(|r| r.state().is_stepping() && r.priority < ticket.priority) {
                // Everything it could give is lent to a step, and the request waiting
                // outranks some of what is lent: the store looks again once a step comes
                // back, before a next prepare can lend those sequences again. (A sequence
                // stepped back to back is otherwise never free when a ticket looks, and the
                // more important request waits out its whole deadline.) A request of no
                // higher priority gets the answer as it is now, as before.
                self.after_step.push((ticket, rechecks));
                return;
            }
        }
        let wanted = ticket.bytes_wanted;
        let mut got = Got {
            freed: slack,
            pending: 0,
        };
        self.take_victims(&prefixes, &sequences, wanted, &mut got)
            .await;
        // Blocks the preempted sequences were the last to map are unreferenced now.
        if got.total() < wanted {
            self.evict_loose(wanted, &mut got);
        }
        self.stats.tickets += 1;
        self.stats.freed_by_pressure += got.total();
        tracing::debug!(
            wanted,
            freed = got.freed,
            pending = got.pending,
            "KV store answered a pressure ticket"
        );
        ticket.report(got.freed, got.pending);
    }

    /// Takes every eligible unit in the policy's order; stops once enough is really freed (a
    /// unit whose free fails frees nothing and the next one is taken).
    async fn take_victims(
        &mut self,
        prefixes: &[PrefixCandidate<u64>],
        sequences: &[SequenceCandidate<SeqId>],
        wanted: u64,
        got: &mut Got,
    ) {
        for victim in choose_victims(u64::MAX, prefixes, sequences) {
            if got.total() >= wanted {
                break;
            }
            match victim {
                Victim::Prefix(key) => {
                    if procmem::fault::hit("kv.evict").is_err() {
                        continue;
                    }
                    let (now, later) = self.evict_prefix(key);
                    got.freed += now;
                    got.pending += later;
                }
                Victim::Sequence(id) => {
                    let taken = self.preempt(id).await;
                    got.freed += taken.freed;
                    got.pending += taken.pending;
                    if taken.called_off_step {
                        // A step of this store was called off: what the ticket wanted may
                        // have been for it. Stop here; if others still lack room the
                        // Governor asks again.
                        break;
                    }
                }
            }
        }
    }

    /// Evicts cached blocks nobody maps that were used at most `worth` times, in the policy's
    /// order, until `wanted` bytes are freed (now, or after their copy to the tier below).
    /// Returns the bytes freed.
    pub(super) fn shed_cold(&mut self, wanted: u64, worth: u32) -> u64 {
        let mut got = Got {
            freed: 0,
            pending: 0,
        };
        let mut candidates = self.prefix_candidates();
        candidates.retain(|c| c.hits <= worth);
        self.evict_candidates(&candidates, wanted, &mut got);
        self.stats.freed_by_pressure += got.total();
        got.total()
    }

    /// Evicts cached blocks nobody maps any more, in the policy's order (the least used first,
    /// the least recent among equals).
    fn evict_loose(&mut self, wanted: u64, got: &mut Got) {
        let candidates = self.prefix_candidates();
        self.evict_candidates(&candidates, wanted, got);
    }

    /// Evicts those of `candidates` nobody maps, in the policy's order, until `wanted`.
    fn evict_candidates(
        &mut self,
        candidates: &[PrefixCandidate<u64>],
        wanted: u64,
        got: &mut Got,
    ) {
        for victim in choose_victims::<u64, SeqId>(u64::MAX, candidates, &[]) {
            if got.total() >= wanted {
                break;
            }
            let Victim::Prefix(key) = victim else {
                continue;
            };
            let (now, later) = self.evict_prefix(key);
            got.freed += now;
            got.pending += later;
        }
    }

    /// Takes prompt block `key` out of the cache. A whole block nobody maps goes to the tier
    /// below first where the filter lets it in: copied on the stream, and the memory goes
    /// after the copy. Returns the bytes freed now and those freed after that copy.
    fn evict_prefix(&mut self, key: u64) -> (u64, u64) {
        self.evict_prefix_held(key, 0)
    }

    /// What preempting `id` does to the cached blocks it maps, from one look at the cache:
    /// those it alone maps (it is their one sharer), with their keys; and the complete ones,
    /// from its first up to the first that is not (a block it was still writing, or one
    /// evicted meanwhile), by key and tokens, for a restore to map again.
    fn sole_and_remap(&self, id: SeqId) -> (Vec<(u64, Arc<SharedPrefix>)>, Vec<RemapBlock>) {
        let Some(entry) = self.sequences.resident(id) else {
            return (Vec::new(), Vec::new());
        };
        let by_block: HashMap<*const SharedPrefix, (u64, &Arc<SharedPrefix>, BlockState)> = self
            .prefixes
            .blocks()
            .map(|(key, block, _, state)| (Arc::as_ptr(block), (key, block, state)))
            .collect();
        let cached: Vec<Option<&(u64, &Arc<SharedPrefix>, BlockState)>> = entry
            .prefixes
            .iter()
            .map(|p| by_block.get(&std::ptr::from_ref::<SharedPrefix>(p)))
            .collect();
        let sole = cached
            .iter()
            .flatten()
            .filter(|(_, block, _)| block.sharers() == 1)
            .map(|(key, block, _)| (*key, Arc::clone(block)))
            .collect();
        let remap = cached
            .iter()
            .map_while(|c| c.filter(|(.., state)| *state == BlockState::Complete))
            .filter_map(|(key, ..)| Some((*key, self.prefixes.prompt_of(*key)?.1.to_vec())))
            .collect();
        (sole, remap)
    }

    /// [`evict_prefix`](Self::evict_prefix) for a block that `held` shares still map until
    /// the stream's queued work has run (a preempted sequence's, held by its copy out): it
    /// goes to the tier below as an unreferenced block would. With `held` above 0, none of
    /// its bytes are freed before that work, whatever the two figures say.
    fn evict_prefix_held(&mut self, key: u64, held: usize) -> (u64, u64) {
        // What a tier below keys the block by, where there is a tier and the block is whole.
        let keep = self.tier.is_some() && self.prefixes.state(key) == Some(BlockState::Complete);
        let prompt = keep
            .then(|| self.prefixes.prompt_of(key).map(|(p, t)| (p, t.to_vec())))
            .flatten();
        let Some(block) = self.prefixes.remove(key) else {
            return (0, 0);
        };
        self.stats.prefix_blocks_evicted += 1;
        let bytes = block.bytes;
        let (Some(tier), Some(prompt)) = (self.tier.as_mut(), prompt) else {
            return (bytes, 0);
        };
        if block.sharers() > held {
            return (bytes, 0);
        }
        tier.evict(&self.device, key, prompt, block)
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
        let Some(memory) = self.sequences.memory(id) else {
            return Taken::default();
        };
        if !self.sequences.evictable(id) {
            return Taken::default();
        }
        let tokens = memory.tokens();
        // On a GPU the copy out is a device-to-host copy made here, so the sequence's last
        // kernel must have finished first (on the host the copy is a kernel queued after it).
        let fence = self.sequences.resident(id).and_then(|r| r.last_fence);
        let idle = match fence {
            Some(f) if !self.device.is_host() => self.device.wait(f, self.config.wait).await,
            _ => true,
        };
        if self.sequences.memory(id).is_none() {
            return Taken::default();
        }
        // A sequence whose copy in from disk is not settled may hold blocks that never came:
        // it is recomputed, never swapped.
        let copying = self
            .sequences
            .resident(id)
            .is_some_and(|r| r.copy_in.is_some());
        let saved = match self.config.preempt {
            PreemptMode::Swap if tokens > 0 && idle && !copying => {
                self.reserve_copy(id, tokens).await
            }
            _ => None,
        };
        let mut mode = match (self.config.preempt, &saved) {
            (PreemptMode::Swap, Some(_)) => PreemptMode::Swap,
            _ => PreemptMode::Recompute,
        };
        let was_growing = self.sequences.is_growing(id);
        let (sole, remap) = self.sole_and_remap(id);
        let Some((writer, resident)) = self.sequences.preempt(id, mode, tokens) else {
            return Taken::default();
        };
        let called_off_step = was_growing && self.call_off_step_of(id, writer, mode);
        let (freed, mut pending) = self.let_go(id, resident, saved, idle, &mut mode);
        if let Some(to_restore) = self.sequences.to_restore_mut(id) {
            to_restore.remap = remap;
        }
        // The cached blocks only it mapped were counted as what taking it frees. Where its
        // shares went with its memory at once, they are unreferenced now, and `evict_loose`
        // takes them if the ticket still needs them. Where its copy out holds them until it
        // runs, nothing would look at them again: they go now, freed after that copy.
        for (key, block) in sole {
            if block.sharers() > 0 {
                // All of it after the copy out, which still maps it.
                let (now, later) = self.evict_prefix_held(key, 1);
                pending += now + later;
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

    /// Room for the copy out of `id`'s `tokens`, found first (the sequence is idle: nothing
    /// writes it meanwhile); a swap space without room makes the preemption a recompute.
    async fn reserve_copy(&mut self, id: SeqId, tokens: usize) -> Option<Saved> {
        let memory = self.sequences.memory(id)?;
        let saved = Saved::reserve(&self.swap, self.device.host(), memory, tokens).await;
        if saved.is_none() {
            self.stats.swap_fallbacks += 1;
        }
        saved
    }

    /// Takes a preempted sequence's memory away: copied out into `saved` first if there is
    /// one (kept with the sequence `id`), then freed. Returns the bytes freed now and those
    /// freed after the stream's work; `mode` becomes `Recompute` if nothing was kept.
    pub(super) fn let_go(
        &mut self,
        id: SeqId,
        resident: Resident,
        saved: Option<Saved>,
        idle: bool,
        mode: &mut PreemptMode,
    ) -> (u64, u64) {
        let Resident {
            memory,
            prefixes,
            charge,
            ahead,
            copy_in,
            last_fence: _,
        } = resident;
        // A copy in not yet settled is the recompute's to redo (its blocks leave the cache).
        drop(copy_in);
        // Growth mapped ahead is part of this memory, and goes with it.
        drop(ahead);
        let bytes = memory.exclusive_bytes();
        // Dropped, it unmaps the memory and then gives back what paid for it.
        let out = CopyOut {
            memory: SeqMemory {
                seq: memory,
                prefixes,
            },
            _charge: charge,
        };
        let (got, kept) = self.copy_out(out, bytes, saved, idle, mode);
        if let Some(k) = self.sequences.to_restore_mut(id) {
            k.saved = kept;
        }
        got
    }

    /// Sends a preempted sequence's memory `out` (`bytes` of its own) on its way: copied out
    /// into `saved` first where there is one, then freed, now or after the stream's work.
    /// Returns the bytes freed now and later, and the copy kept (with its kernel's fence).
    fn copy_out(
        &mut self,
        out: CopyOut,
        bytes: u64,
        saved: Option<Saved>,
        idle: bool,
        mode: &mut PreemptMode,
    ) -> ((u64, u64), Option<Saved>) {
        match saved {
            Some(saved) if !self.device.is_host() => {
                // The sequence's kernels have finished: the rows are copied out now, and the
                // memory goes after the stream's queued work (nothing of it uses this memory).
                saved.copy(
                    self.metrics.swap_out.clone(),
                    Arc::clone(&self.swap_outcomes),
                )(&out.memory.seq);
                let kept = saved.copied().then_some(saved);
                if kept.is_none() {
                    // Nothing kept (the copy counted its failure): the restore recomputes.
                    *mode = PreemptMode::Recompute;
                }
                self.stream.after_queued(move || drop(out));
                ((0, bytes), kept)
            }
            Some(mut saved) => {
                // The copy out is a kernel on the stream, which frees the memory once the
                // rows are out.
                let copy = saved.copy(
                    self.metrics.swap_out.clone(),
                    Arc::clone(&self.swap_outcomes),
                );
                let submitted = self.stream.submit_host(move || {
                    copy(&out.memory.seq);
                    drop(out);
                });
                match submitted {
                    Ok(fence) => {
                        // Counted by the copy once its bytes are written.
                        saved.fence = Some(fence);
                        ((0, bytes), Some(saved))
                    }
                    // A closed stream ran nothing: the kernel (and the memory, then its
                    // charge) is gone already, and the restore will recompute.
                    Err(_) => ((bytes, 0), Some(saved)),
                }
            }
            None if idle => {
                // Nothing to copy and not in flight: freed here and now.
                drop(out);
                ((bytes, 0), None)
            }
            None => {
                // Its last kernel was not seen to finish: freed after the stream's queued work.
                self.stream.after_queued(move || drop(out));
                ((0, bytes), None)
            }
        }
    }
}
