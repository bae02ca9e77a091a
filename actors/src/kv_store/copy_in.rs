//! Prompt blocks coming back from the tier below (disk, or host memory under a GPU): the copy
//! in is queued on the store's stream as the open is answered (`below::Below::copy_in`). The
//! open counts the
//! blocks as cached at once; the sequence's first step waits for the copy's fence (its
//! prepare is sent again once the fence completes), and the fence's completion also tells the
//! store, which then lets the blocks the copy filled join the cache as whole for other
//! sequences. A copy that fell short (a block gone, altered or unreadable)
//! leaves the sequence without K/V it was promised: it is preempted to be recomputed from its
//! tokens, and the step fails with `Preempted`, as it would under pressure.

use procmem::kv::{first_duplicate, PreemptMode, TableError};
use ractor::{ActorRef, RpcReplyPort};

use super::prefix::KeyedBlock;
use super::{KvStep, KvStoreError, KvStoreMsg, KvStoreState, NewTokens, SeqId};
use procmem::kv::Incarnation;

/// A prepare, as the store's mailbox carries it.
type Prepare = (Vec<NewTokens>, RpcReplyPort<Result<KvStep, KvStoreError>>);

impl KvStoreState {
    /// Queues the copy in of `blocks` for `seq` (its incarnation `writer`, promised
    /// `promised` blocks from disk) on the stream, and keeps it with the sequence until its
    /// first step. Fewer blocks than promised (none could be claimed) make a copy that falls
    /// short.
    pub(super) fn start_copy_in(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        seq: SeqId,
        (writer, promised): (Incarnation, usize),
        blocks: Vec<KeyedBlock>,
    ) {
        let Some(tier) = self.tier.as_mut().filter(|_| promised > 0) else {
            return;
        };
        let copy = tier.copy_in(&self.device, (writer, promised), blocks);
        if let Some(fence) = copy.fence {
            // Settled as soon as it ran, so other sequences share the blocks from then on
            // (not only from the sequence's first step).
            self.send_after(myself, fence, KvStoreMsg::CopySettled { seq, writer });
        }
        if let Some(r) = self.sequences.resident_mut(seq) {
            r.last_fence = copy.fence.or(r.last_fence);
            r.copy_in = Some(copy);
        }
    }

    /// A copy in ran: the blocks it filled become complete in the cache, if the sequence is
    /// still that incarnation (one that fell short is recomputed at its first step).
    pub(super) fn copy_settled(&mut self, seq: SeqId, writer: Incarnation) {
        let ours = self
            .sequences
            .resident(seq)
            .and_then(|r| r.copy_in.as_ref())
            .is_some_and(|c| c.writer == writer);
        if ours {
            self.settle_copy_in(seq);
        }
    }

    /// Before a step: a sequence whose copy in is still on the stream makes the prepare wait
    /// for it (sent again once the copy's fence completes); one whose copy fell short is
    /// preempted to be recomputed, and the step fails with `Preempted`. Returns the prepare
    /// to go on with, if any.
    pub(super) fn copy_ins_first(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        (seqs, reply): Prepare,
    ) -> Option<Prepare> {
        // A step the store refuses anyway (no tokens, a sequence twice, one not idle) is
        // refused as it is, changing nothing: only idle sequences' copies are looked at.
        let ids: Vec<SeqId> = seqs.iter().map(|r| r.seq).collect();
        if seqs.iter().any(|r| r.count == 0) || first_duplicate(&ids).is_some() {
            return Some((seqs, reply));
        }
        if !ids.iter().all(|s| self.sequences.is_idle(*s)) {
            return Some((seqs, reply));
        }
        let timeline = self.stream.timeline();
        let running = seqs
            .iter()
            .filter_map(|r| self.sequences.resident(r.seq)?.copy_in.as_ref()?.fence)
            .find(|f| timeline.completed() < f.value);
        if let Some(fence) = running {
            self.send_after(myself, fence, KvStoreMsg::Prepare { seqs, reply });
            return None;
        }
        for &NewTokens { seq, .. } in &seqs {
            if !self.settle_copy_in(seq) {
                self.recompute(seq);
                let _ = reply.send(Err(KvStoreError::Table(TableError::Preempted(
                    seq,
                    PreemptMode::Recompute,
                ))));
                return None;
            }
        }
        Some((seqs, reply))
    }

    /// The copy in of `seq` is done: the blocks it filled join the cache as whole. False if
    /// it fell short (the sequence keeps it until it is recomputed).
    fn settle_copy_in(&mut self, seq: SeqId) -> bool {
        let Some(entry) = self.sequences.resident_mut(seq) else {
            return true;
        };
        let Some(copy) = entry.copy_in.as_mut() else {
            return true;
        };
        let filled = copy.filled();
        for key in &copy.keys[..filled.min(copy.keys.len())] {
            self.prefixes.complete(*key, copy.writer);
        }
        if filled < copy.promised {
            // The open counted every promised block as a hit; those that never came are not.
            if !copy.short_counted {
                copy.short_counted = true;
                let bt = self.config.shape.block_tokens(self.device.granularity());
                let missing = ((copy.promised - filled) * bt) as u64;
                let hits = &mut self.stats.prefix_hit_tokens;
                *hits = hits.saturating_sub(missing);
            }
            return false;
        }
        entry.copy_in = None;
        true
    }

    /// `seq` lacks K/V it was promised: preempted to be recomputed from its tokens, whatever
    /// the admission order. Its memory goes after the stream's queued work; the blocks it
    /// claimed and did not get leave the cache.
    fn recompute(&mut self, seq: SeqId) {
        let tokens = self.sequences.memory(seq).map_or(0, |m| m.tokens());
        let Some((writer, resident)) = self.sequences.lose(seq, tokens) else {
            return;
        };
        let mut mode = PreemptMode::Recompute;
        self.let_go(seq, resident, None, false, &mut mode);
        self.prefixes.abandon(writer);
        self.stats.preempted_by_recompute += 1;
    }
}
