//! Restoring a preempted sequence: its KV copied back from the swap space under a grant,
//! or handed back to be recomputed; either way the cached prompt blocks it mapped that are
//! still cached are mapped again rather than copied back or recomputed.

use procmem::kv::{Incarnation, KvSequence, PreemptMode, RestoreStart, TableError};
use procmem::{MapAccess, PhysicalBlock, SharedMapping};
use ractor::{ActorRef, RpcReplyPort};

use super::answer::Restored;
use super::metrics;
use super::prefix::Mapped;
use super::sequences::Resident;
use super::transactions::Pending;
use super::{KvStoreError, KvStoreMsg, KvStoreState, SeqId};
use crate::charge::Charge;
use crate::governor::Grant;

/// Where a restore's answer goes.
type RestoreReply = RpcReplyPort<Result<Restored, KvStoreError>>;

/// A restore that may start: the incarnation it is for, how the sequence was preempted, the
/// tokens it held, and where the answer goes.
struct Begun {
    writer: Incarnation,
    mode: PreemptMode,
    tokens: usize,
    reply: RestoreReply,
}

impl KvStoreState {
    /// Brings a preempted sequence back: its KV copied back from the swap space under a
    /// grant, or the sequence handed back to be recomputed (from the cached blocks it maps
    /// again).
    pub(super) fn restore(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        seq: SeqId,
        reply: RpcReplyPort<Result<Restored, KvStoreError>>,
    ) {
        let Some(Begun {
            writer,
            mode,
            tokens,
            reply,
        }) = self.begin_restore(myself, seq, reply)
        else {
            return;
        };
        let mut memory = match self.reserve_memory() {
            Ok(m) => m,
            Err(e) => {
                let _ = self.sequences.end_restore(seq, writer, false);
                let _ = reply.send(Err(e.into()));
                return;
            }
        };
        let to_restore = self
            .sequences
            .to_restore_mut(seq)
            .expect("a restoring sequence has what it needs to come back");
        // The saved copy travels with the restore; one that fails puts it back.
        let remap = std::mem::take(&mut to_restore.remap);
        let saved = to_restore.saved.take();
        // The cached blocks it mapped that are still cached are mapped again (held from now
        // on, so no ticket evicts them while a restore waits for its grant).
        let (shares, from) = self.map_cached(&mut memory, &remap, tokens);
        let mut resident = Resident::new(memory, Charge::counted(&self.tally));
        resident.prefixes = shares;
        let saved = match (mode, saved) {
            // (A copy out that failed left nothing to bring back.)
            (PreemptMode::Swap, Some(saved)) if tokens > 0 && saved.copied() => saved,
            _ => {
                // Nothing was kept (or nothing to keep): the sequence starts again from the
                // cached blocks, the rest to replay.
                self.restore_into(seq, writer, resident);
                let _ = self.sequences.end_restore(seq, writer, true);
                self.stats.restores_recomputed += 1;
                self.stats.restore_shared_tokens += from as u64;
                self.stats.replayed_tokens += (tokens - from) as u64;
                let _ = reply.send(Ok(Restored::Recompute {
                    tokens,
                    cached: from,
                }));
                return;
            }
        };
        // Only the rows after the blocks mapped again come back from the copy.
        let size = resident.memory.growth_for(tokens - from);
        self.restore_into(seq, writer, resident);
        if let Some(to_restore) = self.sequences.to_restore_mut(seq) {
            to_restore.remap = remap;
        }
        let priority = self.sequences.priority_of(seq);
        let bytes = size.bytes();
        let pending = Pending::Restore {
            seq,
            writer,
            size,
            tokens: (from, tokens),
            saved,
            reply,
        };
        self.begin(myself, bytes, priority, pending);
    }

    /// Starts restoring `seq` once its copy out has run: its incarnation, how it was
    /// preempted, the tokens it held, and the reply to answer. `None` where there is nothing
    /// to start now: the restore is put off until the copy is done, or answered (not
    /// preempted, or refused).
    fn begin_restore(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        seq: SeqId,
        reply: RestoreReply,
    ) -> Option<Begun> {
        let copying = self
            .sequences
            .copy_out_fence(seq)
            .filter(|f| self.stream.timeline().completed() < f.value);
        if let Some(fence) = copying {
            // Its copy out is still on the stream: the restore starts once it is done.
            self.send_after(myself, fence, KvStoreMsg::Restore { seq, reply });
            return None;
        }
        match self.sequences.begin_restore(seq) {
            Err(e) => {
                let _ = reply.send(Err(e.into()));
                None
            }
            Ok(None) => {
                // Not preempted: nothing to bring back.
                let tokens = self.sequences.tokens_of(seq);
                let _ = reply.send(Ok(Restored::Swapped { tokens }));
                None
            }
            Ok(Some(RestoreStart {
                writer,
                mode,
                tokens,
            })) => Some(Begun {
                writer,
                mode,
                tokens,
                reply,
            }),
        }
    }

    /// Maps the complete cached blocks under `keys`, from the first and up to the first that
    /// is not cached, at the start of the empty `memory` of a sequence of `tokens` tokens (its
    /// last token always in its own memory), each only if it holds the tokens it held when
    /// recorded, after the block before it (a key alone may collide). Returns the shares and
    /// the tokens they hold. Where the mapping fails the rows come back from the copy (or are
    /// replayed) and the shares are kept with the memory all the same: a mapping whose undo
    /// failed may still map them, and they go only after it.
    fn map_cached(
        &mut self,
        memory: &mut KvSequence,
        keys: &[(u64, Vec<u32>)],
        tokens: usize,
    ) -> (Vec<Mapped>, usize) {
        let bt = self.config.shape.block_tokens(self.device.granularity());
        let most = tokens.saturating_sub(1) / bt.max(1);
        let clock = self.clock;
        let mut parent = 0;
        let shares: Vec<Mapped> = keys
            .iter()
            .take(most)
            .map_while(|(key, block)| {
                let found = self.prefixes.get(*key, parent, block, clock);
                parent = *key;
                found
            })
            .map(Mapped::new)
            .collect();
        if shares.is_empty() {
            return (shares, 0);
        }
        let blocks: Vec<PhysicalBlock> = shares
            .iter()
            .flat_map(|p| p.blocks.iter().cloned())
            .collect();
        let access = vec![MapAccess::ReadOnly; shares.len()];
        let from = shares.len() * bt;
        let mapping: &dyn SharedMapping = self.device.shared.as_ref();
        match memory.attach_prefix(mapping, &blocks, &access, from) {
            Ok(()) => (shares, from),
            Err(e) => {
                tracing::debug!(%e, "cached blocks not mapped again at a restore");
                (shares, 0)
            }
        }
    }

    pub(super) async fn finish_restore(&mut self, pending: Pending, grant: Grant) {
        let Pending::Restore {
            seq,
            writer,
            size,
            tokens: (from, tokens),
            saved,
            reply,
        } = pending
        else {
            return;
        };
        // The sequence the restore was for; closed meanwhile (even if its id was opened again)
        // it is gone, and the grant goes back with its saved copy.
        let ours = self.sequences.is_restoring(seq, writer);
        let Some(Resident { memory, charge, .. }) =
            self.sequences.resident_mut(seq).filter(|_| ours)
        else {
            // Closed meanwhile (even if its id was opened again): the grant goes back with
            // its saved copy.
            let _ = reply.send(Err(KvStoreError::Table(TableError::Unknown(seq))));
            return;
        };
        let (growth_map, swap_in) = (&self.metrics.growth_map, &self.metrics.swap_in);
        let result: Result<u64, KvStoreError> = async {
            let growth = metrics::timed(growth_map, || memory.map_growth(size))?;
            match grant.commit(growth.bytes()).await {
                Ok(lease) => charge.add(lease),
                Err(refused) => {
                    memory.abandon(growth)?;
                    return Err(refused.error.into());
                }
            }
            memory.publish(growth);
            let copied = metrics::timed(swap_in, || saved.restore_into(memory, from))?;
            memory.advance_by(tokens - from)?;
            Ok(copied)
        }
        .await;
        match result {
            Ok(copied) => {
                self.stats.swap_ins += 1;
                self.stats.swap_in_bytes += copied;
                self.stats.restore_shared_tokens += from as u64;
                // The copy and what pays for it in the swap space go before the answer (what
                // it kept goes with the restore's end).
                drop(saved);
                let _ = self.sequences.end_restore(seq, writer, true);
                let _ = reply.send(Ok(Restored::Swapped { tokens }));
            }
            Err(e) => {
                // Back to preempted with the saved copy; the partial memory is freed, then
                // the blocks it mapped, then what paid for it (`Resident`'s order).
                let partial = self.sequences.end_restore(seq, writer, false);
                drop(partial);
                if let Some(to_restore) = self.sequences.to_restore_mut(seq) {
                    to_restore.saved = Some(saved);
                }
                let _ = reply.send(Err(e));
            }
        }
    }

    /// Puts the memory `seq` (restoring as `writer`) comes back into in place; a restore
    /// that is gone frees it after its fences.
    fn restore_into(&mut self, seq: SeqId, writer: Incarnation, resident: Resident) {
        if let Err(resident) = self.sequences.restoring_into(seq, writer, resident) {
            self.retire(resident);
        }
    }
}
