//! Restoring a preempted sequence: its KV copied back from the swap space under a grant,
//! or handed back empty to be recomputed.

use procmem::kv::{Phase, PreemptMode};
use ractor::{ActorRef, RpcReplyPort};

use super::answer::Restored;
use super::metrics;
use super::transactions::Pending;
use super::{KvStoreError, KvStoreMsg, KvStoreState, SeqId};
use crate::charge::Charge;
use crate::governor::Grant;

impl KvStoreState {
    /// Brings a preempted sequence back: its KV copied back from the swap space under a
    /// grant, or the sequence handed back empty to be recomputed.
    pub(super) fn restore(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        seq: SeqId,
        reply: RpcReplyPort<Result<Restored, KvStoreError>>,
    ) {
        let copying = self
            .sequences
            .entries
            .get(&seq)
            .and_then(|e| e.saved.as_ref())
            .and_then(|s| s.fence)
            .filter(|f| self.stream.timeline().completed() < f.value);
        if let Some(fence) = copying {
            // Its copy out is still on the stream: the restore starts once it is done.
            self.send_after(myself, fence, KvStoreMsg::Restore { seq, reply });
            return;
        }
        let (writer, mode, tokens) = match self.sequences.table.begin_restore(seq) {
            Err(e) => {
                let _ = reply.send(Err(e.into()));
                return;
            }
            Ok(None) => {
                // Not preempted: nothing to bring back.
                let tokens = self.sequences.tokens_of(seq);
                let _ = reply.send(Ok(Restored::Swapped { tokens }));
                return;
            }
            Ok(Some(found)) => found,
        };
        let memory = match self.reserve_memory() {
            Ok(m) => m,
            Err(e) => {
                self.sequences.table.end_restore(seq, writer, false);
                let _ = reply.send(Err(e.into()));
                return;
            }
        };
        let per_buffer = memory.growth_for(tokens);
        let entry = self
            .sequences
            .entries
            .get_mut(&seq)
            .expect("a preempted sequence has an entry");
        let saved = match (mode, entry.saved.take()) {
            // (A copy out that failed left nothing to bring back.)
            (PreemptMode::Swap, Some(saved)) if tokens > 0 && saved.copied() => saved,
            _ => {
                // Nothing was kept (or nothing to keep): the sequence starts again, empty.
                entry.memory = Some(memory);
                self.sequences.table.end_restore(seq, writer, true);
                self.stats.restores_recomputed += 1;
                self.stats.replayed_tokens += tokens as u64;
                let _ = reply.send(Ok(Restored::Recompute { tokens }));
                return;
            }
        };
        entry.memory = Some(memory);
        let priority = self.sequences.table.get(seq).map_or(0, |r| r.priority);
        let bytes = per_buffer * self.config.shape.buffers() as u64;
        let pending = Pending::Restore {
            seq,
            writer,
            per_buffer,
            tokens,
            saved,
            reply,
        };
        self.begin(myself, bytes, priority, pending);
    }

    pub(super) async fn finish_restore(&mut self, pending: Pending, grant: Grant) {
        let Pending::Restore {
            seq,
            writer,
            per_buffer,
            tokens,
            saved,
            reply,
        } = pending
        else {
            return;
        };
        // The sequence the restore was for; closed meanwhile (even if its id was opened again)
        // it is gone, and the grant goes back with its saved copy.
        let ours = self
            .sequences
            .table
            .get(seq)
            .is_some_and(|r| r.writer == writer && matches!(r.phase, Phase::Restoring { .. }));
        let Some(entry) = self.sequences.entries.get_mut(&seq).filter(|_| ours) else {
            let _ = reply.send(Err(KvStoreError::Unknown(seq)));
            return;
        };
        let Some(memory) = entry.memory.as_mut() else {
            // (Not reached: a restoring sequence has the memory reserved for it.) Preempted
            // again, with its saved copy.
            entry.saved = Some(saved);
            self.sequences.table.end_restore(seq, writer, false);
            let _ = reply.send(Err(KvStoreError::Unknown(seq)));
            return;
        };
        let (growth_map, swap_in) = (&self.metrics.growth_map, &self.metrics.swap_in);
        let result: Result<(), KvStoreError> = async {
            let growth = metrics::timed(growth_map, || memory.map_growth(per_buffer))?;
            match grant.commit(growth.bytes()).await {
                Ok(lease) => entry.charge.add(lease),
                Err(refused) => {
                    memory.abandon(growth)?;
                    return Err(refused.error.into());
                }
            }
            memory.publish(growth);
            metrics::timed(swap_in, || saved.restore_into(memory))?;
            for _ in 0..tokens {
                memory.advance()?;
            }
            Ok(())
        }
        .await;
        match result {
            Ok(()) => {
                self.stats.swap_ins += 1;
                self.stats.swap_in_bytes += saved.bytes();
                // The copy and what pays for it in the swap space go before the answer.
                drop(saved);
                self.sequences.table.end_restore(seq, writer, true);
                let _ = reply.send(Ok(Restored::Swapped { tokens }));
            }
            Err(e) => {
                // Back to preempted with the saved copy; the partial memory is freed, then
                // what paid for it.
                let entry = self.sequences.entries.get_mut(&seq).expect("present above");
                entry.saved = Some(saved);
                entry.ahead = None;
                let old = entry.memory.take();
                let charge = std::mem::replace(&mut entry.charge, Charge::counted(&self.tally));
                drop(old);
                drop(charge);
                self.sequences.table.end_restore(seq, writer, false);
                let _ = reply.send(Err(e));
            }
        }
    }
}
