//! Every sequence the store has open, one value each in the pure [`SequenceTable`]: its
//! phase carries what is valid in it, the store's [`Resident`] memory (with its charge and
//! the prompt blocks it maps) while it is in place, its [`ToRestore`] saved copy while it is
//! preempted. The table's transitions move them.
//!
//! Here too the store's side of a sequence's life outside its steps: open (a prefix lookup,
//! the blocks it shares and the ones it claims to write, one grant for those), the answer
//! that closes it if nobody reads it, and close, which retires its memory to the
//! deferred-free path after its fences.

use procmem::fence::{Fence, TimelineFence};
use procmem::kv::{
    Incarnation, KvError, KvSequence, Lent, PendingGrowth, SeqData, SeqState, Sequence,
    SequenceTable, TableError,
};
use procmem::ledger::Priority;
use procmem::MemoryError;
use ractor::{ActorRef, RpcReplyPort};

use super::answer::{OpenAnswer, Opened};
use super::disk_tier::CopyIn;
use super::prefix::Mapped;
use super::swap::Saved;
use super::transactions::Pending;
use super::{KvStoreError, KvStoreMsg, KvStoreState, SeqId};
use crate::charge::Charge;
use crate::deferred_free::{DeferredRelease, PendingFree};
use crate::governor::Grant;

mod transitions;

/// A sequence's memory on its way out: freed by its mechanism after its fences; its charge
/// (the refund of its [`PendingFree`]) goes back after that.
pub(super) struct SeqMemory {
    pub(super) seq: KvSequence,
    pub(super) prefixes: Vec<Mapped>,
}

impl DeferredRelease for SeqMemory {
    fn release(self: Box<Self>) -> Result<u64, MemoryError> {
        let SeqMemory { seq, prefixes } = *self;
        let bytes = seq.exclusive_bytes();
        drop(seq);
        drop(prefixes);
        Ok(bytes)
    }
}

/// A sequence's memory and what comes with it, while it is in place (idle, growing, or
/// restoring into it). A step takes it whole, and gives it back. Dropped, the memory is
/// unmapped first, then the blocks it mapped, then what paid for it (the fields' order).
pub(super) struct Resident {
    pub(super) memory: KvSequence,
    pub(super) prefixes: Vec<Mapped>,
    /// Pays for the sequence's own memory (not the shared prefixes it maps).
    pub(super) charge: Charge,
    /// The last kernel that used the memory.
    pub(super) last_fence: Option<Fence>,
    /// Growth mapped ahead (and paid for by `charge`), published at the next prepare.
    pub(super) ahead: Option<PendingGrowth>,
    /// Its prompt blocks coming from the disk tier, until its first step.
    pub(super) copy_in: Option<CopyIn>,
}

impl Resident {
    /// A new sequence's: `memory` reserved, nothing mapped, paid for by `charge`.
    pub(super) fn new(memory: KvSequence, charge: Charge) -> Self {
        Resident {
            memory,
            prefixes: Vec::new(),
            charge,
            last_fence: None,
            ahead: None,
            copy_in: None,
        }
    }

    /// What it holds, as a step that takes it counts it.
    pub(super) fn lent(&self) -> Lent {
        Lent {
            tokens: self.memory.tokens(),
            bytes: self.memory.exclusive_bytes(),
        }
    }
}

/// One cached block a preempted sequence mapped: its key and the tokens it held (a restore
/// maps it again if it is still cached with those tokens, as a lookup checks).
pub(super) type RemapBlock = (u64, Vec<u32>);

/// What a preempted sequence keeps to come back.
#[derive(Default)]
pub(super) struct ToRestore {
    /// Its KV copied out, where it was preempted by swap.
    pub(super) saved: Option<Saved>,
    /// The cached blocks it mapped, from its first.
    pub(super) remap: Vec<RemapBlock>,
}

/// The store's payloads in the [`SequenceTable`].
pub(super) struct StoreSeq;

impl SeqData for StoreSeq {
    type Resident = Resident;
    type ToRestore = ToRestore;
}

/// What the open sequences hold, for the stats.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Held {
    /// Sequences open (active or preempted).
    pub(super) sequences: usize,
    /// Of those, preempted.
    pub(super) preempted: usize,
    /// Tokens the active ones hold.
    pub(super) tokens: usize,
    /// Their own bytes.
    pub(super) exclusive_bytes: u64,
}

/// Every open sequence: one value each, its phase with what it holds there.
#[derive(Default)]
pub(super) struct Sequences {
    /// Reached only here and in `transitions.rs`.
    table: SequenceTable<StoreSeq>,
}

impl Sequences {
    /// The memory of `seq`, if it is open and has it now.
    pub(super) fn memory(&self, seq: SeqId) -> Option<&KvSequence> {
        self.resident(seq).map(|r| &r.memory)
    }

    /// What `seq` has in place, if it is open and has it now.
    pub(super) fn resident(&self, seq: SeqId) -> Option<&Resident> {
        self.table.get(seq).and_then(Sequence::resident)
    }

    /// The same, to change in place.
    pub(super) fn resident_mut(&mut self, seq: SeqId) -> Option<&mut Resident> {
        self.table.get_mut(seq).and_then(Sequence::resident_mut)
    }

    /// What `seq` keeps while preempted or restoring, to change in place.
    pub(super) fn to_restore_mut(&mut self, seq: SeqId) -> Option<&mut ToRestore> {
        self.table.get_mut(seq).and_then(Sequence::to_restore_mut)
    }

    /// Whether `seq` is open as incarnation `writer`.
    pub(super) fn is(&self, seq: SeqId, writer: Incarnation) -> bool {
        self.table.get(seq).is_some_and(|r| r.writer == writer)
    }

    /// Whether `seq` is open as incarnation `writer`, in a step.
    pub(super) fn is_stepping(&self, seq: SeqId, writer: Incarnation) -> bool {
        self.table
            .get(seq)
            .is_some_and(|r| r.writer == writer && r.state().is_stepping())
    }

    /// The tokens `seq` holds (0 if it is not open or preempted; one whose step is out
    /// holds those it had when lent).
    pub(super) fn tokens_of(&self, seq: SeqId) -> usize {
        self.table.get(seq).map_or(0, |s| held(s).0)
    }

    /// Closes `seq`: returns the incarnation closed and the memory it held, which the
    /// caller retires (what a preempted one kept goes now).
    pub(super) fn close(&mut self, seq: SeqId) -> (Option<Incarnation>, Option<Resident>) {
        match self.table.close(seq) {
            Some(s) => (Some(s.writer), into_resident(s)),
            None => (None, None),
        }
    }

    /// Takes the memory of every sequence (the store is going away).
    pub(super) fn drain(&mut self) -> Vec<Resident> {
        self.table
            .drain()
            .into_iter()
            .filter_map(into_resident)
            .collect()
    }

    /// Counts what the sequences hold.
    pub(super) fn held(&self) -> Held {
        let mut held = Held {
            sequences: self.table.len(),
            ..Held::default()
        };
        for (_, s) in self.table.iter() {
            if s.state().preempted().is_some() {
                held.preempted += 1;
            } else {
                let (tokens, bytes) = self::held(s);
                held.tokens += tokens;
                held.exclusive_bytes += bytes;
            }
        }
        held
    }

    /// Sequences whose copy in from a tier below is not settled.
    pub(super) fn copies_in(&self) -> usize {
        self.table
            .iter()
            .filter(|(_, s)| s.resident().is_some_and(|r| r.copy_in.is_some()))
            .count()
    }

    /// Bytes of KV copied out for the preempted sequences.
    pub(super) fn swapped_bytes(&self) -> u64 {
        self.table
            .iter()
            .filter_map(|(_, s)| s.to_restore()?.saved.as_ref())
            .filter(|s| s.copied())
            .map(Saved::bytes)
            .sum()
    }
}

/// A sequence's tokens and exclusive bytes, as the stats count them.
fn held(s: &Sequence<StoreSeq>) -> (usize, u64) {
    match (s.resident(), s.lent()) {
        (Some(r), _) => (r.memory.tokens(), r.memory.exclusive_bytes()),
        (None, Some(lent)) => (lent.tokens, lent.bytes),
        (None, None) => (0, 0),
    }
}

/// The memory a closed sequence held, if it held any.
fn into_resident(s: Sequence<StoreSeq>) -> Option<Resident> {
    match s.into_state() {
        SeqState::Idle(r) | SeqState::Growing(r) => Some(r),
        SeqState::Restoring { resident, .. } => resident,
        SeqState::Stepping(_) | SeqState::Preempted { .. } => None,
    }
}

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

    pub(super) async fn open(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        seq: SeqId,
        prompt: Vec<u32>,
        priority: Priority,
        reply: RpcReplyPort<Result<OpenAnswer, KvStoreError>>,
    ) {
        let shape = self.config.shape;
        let g = self.device.granularity();
        let bt = shape.block_tokens(g);
        // A prompt that cannot fit is refused before it claims anything.
        if prompt.len() > shape.max_tokens {
            let _ = reply.send(Err(KvError::Full(shape.max_tokens).into()));
            return;
        }
        // A refused id reserves nothing.
        let writer = match self.sequences.table.begin_open(seq) {
            Ok(w) => w,
            Err(e) => {
                let _ = reply.send(Err(e.into()));
                return;
            }
        };
        let memory = match self.reserve_memory() {
            Ok(s) => s,
            Err(e) => {
                self.sequences.table.forget_open(seq, writer);
                let _ = reply.send(Err(e.into()));
                return;
            }
        };
        // Complete blocks with the same tokens are shared; the blocks after them that nobody
        // has are claimed for this sequence to write now, before its grant, so a second open
        // of the same prompt meanwhile shares nothing from them on instead of making them
        // again.
        let lookup = self.prefixes.lookup(&prompt, bt, writer, self.clock);
        self.stats.prefix_query_tokens += prompt.len() as u64;
        let new_keys = lookup.claimed;
        let bytes = new_keys.len() as u64 * shape.block_bytes_all(g);
        // Each block found is shared by the sequence from now on: held so no ticket evicts
        // it while the open waits for its grant.
        let mut hits: Vec<(u64, Mapped)> = lookup
            .hits
            .into_iter()
            .map(|(key, block)| (key, Mapped::new(block)))
            .collect();
        // The blocks claimed that the disk tier holds are filled from there, not computed.
        let mut from_disk = self.ask_tier(&hits, &new_keys);
        // The position rule (see `Opened`): a prompt's last token is always computed, so a
        // prompt whose every block is cached shares all but its last block.
        if !prompt.is_empty() && (hits.len() + from_disk) * bt >= prompt.len() {
            if from_disk > 0 {
                from_disk -= 1;
            } else {
                hits.pop();
            }
        }
        let pending = Pending::Open {
            seq,
            writer,
            priority,
            memory: Box::new(memory),
            hits,
            new_keys,
            from_disk,
            bytes,
            reply,
        };
        if bytes == 0 {
            self.finish_open(myself, pending, None).await;
        } else {
            self.begin(myself, bytes, priority, pending);
        }
    }

    pub(super) async fn finish_open(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        pending: Pending,
        grant: Option<Grant>,
    ) {
        let Pending::Open {
            seq,
            writer,
            priority,
            memory,
            hits,
            new_keys,
            from_disk,
            bytes,
            reply,
        } = pending
        else {
            return;
        };
        let mut entry = Resident::new(*memory, Charge::counted(&self.tally));
        let mut charge = Charge::counted(&self.tally);
        if let Some(grant) = grant {
            match grant.commit(bytes).await {
                Ok(lease) => charge.add(lease),
                Err(refused) => {
                    self.forget_open(seq, writer);
                    let _ = reply.send(Err(refused.error.into()));
                    return;
                }
            }
        }
        let hit_count = hits.len();
        // The blocks the disk holds count as cached: they are made and mapped as the blocks
        // the sequence claims to write are, and filled by the copy in queued below, before
        // any step of the sequence.
        let shared = self
            .make_blocks(new_keys.len(), &mut charge)
            .and_then(|fresh| {
                self.attach_prefixes(&mut entry.memory, hits, fresh, hit_count + from_disk)
            });
        let (used, fresh) = match shared {
            Ok(shared) => shared,
            Err(e) => {
                self.forget_open(seq, writer);
                let _ = reply.send(Err(e));
                return;
            }
        };
        let bt = self.config.shape.block_tokens(self.device.granularity());
        let (filling, incoming) =
            self.fill_claims(writer, &new_keys, fresh, (hit_count, from_disk));
        let cached = hit_count + from_disk;
        entry.prefixes = used;
        let opened = self
            .sequences
            .table
            .end_open(seq, writer, priority, filling, entry);
        if let Err(entry) = opened {
            // Closed while it was being opened.
            self.prefixes.abandon(writer);
            self.retire(entry);
            let _ = reply.send(Err(KvStoreError::Table(TableError::Unknown(seq))));
            return;
        }
        self.start_copy_in(myself, seq, (writer, from_disk), incoming);
        self.answer_open(myself, seq, writer, cached * bt, reply);
    }

    /// Answers an open that found `cached` tokens. An answer its caller never reads closes
    /// the sequence (`Abandon`); one whose caller is gone already closes it here and now.
    fn answer_open(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        seq: SeqId,
        writer: Incarnation,
        cached: usize,
        reply: RpcReplyPort<Result<OpenAnswer, KvStoreError>>,
    ) {
        let opened = Opened {
            cached_tokens: cached,
        };
        let answer = OpenAnswer::new(opened, myself.clone(), seq, writer);
        match reply.send(Ok(answer)) {
            Ok(()) => self.stats.prefix_hit_tokens += cached as u64,
            Err(ractor::MessagingErr::SendErr(Ok(answer))) => {
                answer.take();
                self.close(seq);
            }
            Err(_) => {}
        }
    }

    /// An open's answer was dropped unread: closes that incarnation, if it is still open.
    pub(super) fn abandon(&mut self, seq: SeqId, writer: Incarnation) {
        if self.sequences.is(seq, writer) {
            self.close(seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use procmem::kv::PreemptMode;

    use super::*;
    use crate::charge::Tally;

    fn opened(s: &mut Sequences, seq: SeqId) -> Incarnation {
        let writer = s.table.begin_open(seq).unwrap();
        let tally = Tally::default();
        let shape = procmem::kv::KvShape {
            layers: 1,
            q_heads: 1,
            kv_heads: 1,
            head_dim: 4,
            max_tokens: 64,
            k_dtype: procmem::kv::KvDtype::F32,
            v_dtype: procmem::kv::KvDtype::F32,
        };
        let backing = procmem::host::HostMechanism::new().unwrap().backing();
        let memory = KvSequence::reserve(backing, shape, 1).unwrap();
        let resident = Resident::new(memory, Charge::counted(&tally));
        assert!(s
            .table
            .end_open(seq, writer, 1, Vec::new(), resident)
            .is_ok());
        writer
    }

    #[test]
    fn a_sequence_opens_and_closes_as_one() {
        let mut s = Sequences::default();
        let w = opened(&mut s, 7);
        assert!(s.is(7, w));
        assert!(s.is(7, w) && s.is_idle(7));
        assert_eq!(s.held().sequences, 1);
        let (writer, memory) = s.close(7);
        assert_eq!(writer, Some(w));
        assert!(memory.is_some());
        assert!(!s.is(7, w));
        assert_eq!(s.held(), Held::default());
        assert_eq!(s.close(7).0, None);
    }

    #[test]
    fn a_preempted_sequence_counts_as_preempted() {
        let mut s = Sequences::default();
        opened(&mut s, 1);
        let w2 = opened(&mut s, 2);
        let lent = s.table.lend(2, w2, |_| Lent {
            tokens: 5,
            bytes: 100,
        });
        assert!(lent.is_some());
        assert!(s.table.preempt(1, PreemptMode::Recompute, 0).is_some());
        let held = s.held();
        assert_eq!(held.sequences, 2);
        assert_eq!(held.preempted, 1);
        assert_eq!((held.tokens, held.exclusive_bytes), (5, 100));
        assert_eq!(s.tokens_of(2), 5);
        assert_eq!(s.tokens_of(3), 0);
        assert!(s.memory(1).is_none());
        assert_eq!(s.swapped_bytes(), 0);
        assert_eq!(s.drain().len(), 0, "neither has its memory here");
    }
}
