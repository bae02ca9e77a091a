//! Every sequence the store has open: its phase, incarnation and priority (the
//! [`SequenceTable`]) together with its memory, charge, saved copy and the prompt blocks it
//! maps (its [`SeqEntry`]). The two change together: a sequence is opened, closed and
//! counted here as one.

use std::collections::HashMap;

use procmem::fence::Fence;
use procmem::kv::{Incarnation, KvSequence, PendingGrowth, Phase, SequenceTable};
use procmem::MemoryError;

use super::prefix::Mapped;
use super::swap::Saved;
use super::tier::CopyIn;
use super::SeqId;
use crate::charge::Charge;
use crate::deferred_free::DeferredRelease;

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

/// A sequence's memory; its phase, incarnation, priority and the blocks it writes are in
/// the [`SequenceTable`] beside it in [`Sequences`].
pub(super) struct SeqEntry {
    /// Its KV memory; `None` while it is preempted.
    pub(super) memory: Option<KvSequence>,
    /// Its KV copied out while it is preempted by swap.
    pub(super) saved: Option<Saved>,
    /// Pays for the sequence's own memory (not the shared prefixes it maps).
    pub(super) charge: Charge,
    pub(super) prefixes: Vec<Mapped>,
    pub(super) last_fence: Option<Fence>,
    /// While a step has its memory: the tokens and bytes it held when lent (for the stats).
    pub(super) away: Option<(usize, u64)>,
    /// Growth mapped ahead (and paid for by `charge`), published at the next prepare.
    pub(super) ahead: Option<PendingGrowth>,
    /// Its prompt blocks coming from the disk tier, until its first step.
    pub(super) copy_in: Option<CopyIn>,
    /// While it is preempted: the cached blocks it mapped, from its first, each by its key
    /// and tokens (a restore maps those still cached again instead of copying their rows
    /// back, checking the tokens as a lookup does).
    pub(super) remap: Vec<(u64, Vec<u32>)>,
}

impl SeqEntry {
    /// A new sequence's entry: `memory` reserved, nothing mapped, paid for by `charge`.
    pub(super) fn new(memory: Option<KvSequence>, charge: Charge) -> Self {
        SeqEntry {
            memory,
            saved: None,
            charge,
            prefixes: Vec::new(),
            last_fence: None,
            away: None,
            ahead: None,
            copy_in: None,
            remap: Vec::new(),
        }
    }

    /// The tokens it holds (one whose step is out holds those it had when lent).
    pub(super) fn tokens(&self) -> usize {
        self.memory
            .as_ref()
            .map_or_else(|| self.away.map_or(0, |a| a.0), KvSequence::tokens)
    }

    /// Its tokens and exclusive bytes, as the stats count them.
    fn held(&self) -> (usize, u64) {
        match (&self.memory, self.away) {
            (Some(m), _) => (m.tokens(), m.exclusive_bytes()),
            (None, Some(away)) => away,
            (None, None) => (0, 0),
        }
    }
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

/// Every open sequence: its record in the table and its entry, kept together.
#[derive(Default)]
pub(super) struct Sequences {
    /// Every sequence's phase and bookkeeping.
    pub(super) table: SequenceTable,
    /// Every sequence's memory.
    pub(super) entries: HashMap<SeqId, SeqEntry>,
}

impl Sequences {
    /// The memory of `seq`, if it is open and has it now.
    pub(super) fn memory(&self, seq: SeqId) -> Option<&KvSequence> {
        self.entries.get(&seq).and_then(|e| e.memory.as_ref())
    }

    /// Whether `seq` is open as incarnation `writer`.
    pub(super) fn is(&self, seq: SeqId, writer: Incarnation) -> bool {
        self.table.get(seq).is_some_and(|r| r.writer == writer)
    }

    /// Whether `seq` is open as incarnation `writer` in `phase`.
    pub(super) fn is_in(&self, seq: SeqId, writer: Incarnation, phase: Phase) -> bool {
        self.table
            .get(seq)
            .is_some_and(|r| r.writer == writer && r.phase == phase)
    }

    /// The tokens `seq` holds (0 if it is not open).
    pub(super) fn tokens_of(&self, seq: SeqId) -> usize {
        self.entries.get(&seq).map_or(0, SeqEntry::tokens)
    }

    /// Closes `seq`: its record and its entry go together. Returns the incarnation closed
    /// and the entry, whose memory the caller retires.
    pub(super) fn close(&mut self, seq: SeqId) -> (Option<Incarnation>, Option<SeqEntry>) {
        let writer = self.table.close(seq).map(|r| r.writer);
        (writer, self.entries.remove(&seq))
    }

    /// Takes every entry (the store is going away).
    pub(super) fn drain(&mut self) -> Vec<SeqEntry> {
        self.entries.drain().map(|(_, e)| e).collect()
    }

    /// Counts what the sequences hold.
    pub(super) fn held(&self) -> Held {
        let mut held = Held {
            sequences: self.table.len(),
            ..Held::default()
        };
        for (id, r) in self.table.iter() {
            if matches!(r.phase, Phase::Preempted { .. }) {
                held.preempted += 1;
            } else if let Some(e) = self.entries.get(&id) {
                let (tokens, bytes) = e.held();
                held.tokens += tokens;
                held.exclusive_bytes += bytes;
            }
        }
        held
    }

    /// Bytes of KV copied out for the preempted sequences.
    pub(super) fn swapped_bytes(&self) -> u64 {
        self.entries
            .values()
            .filter_map(|e| e.saved.as_ref())
            .filter(|s| s.copied())
            .map(Saved::bytes)
            .sum()
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
        assert!(s.table.end_open(seq, writer, 1, Some(Vec::new())));
        s.entries
            .insert(seq, SeqEntry::new(None, Charge::counted(&tally)));
        writer
    }

    #[test]
    fn a_sequence_opens_and_closes_as_one() {
        let mut s = Sequences::default();
        let w = opened(&mut s, 7);
        assert!(s.is(7, w));
        assert!(s.is_in(7, w, Phase::Idle));
        assert_eq!(s.held().sequences, 1);
        let (writer, entry) = s.close(7);
        assert_eq!(writer, Some(w));
        assert!(entry.is_some());
        assert!(!s.is(7, w));
        assert_eq!(s.held(), Held::default());
        assert_eq!(s.close(7).0, None);
    }

    #[test]
    fn a_preempted_sequence_counts_as_preempted() {
        let mut s = Sequences::default();
        opened(&mut s, 1);
        opened(&mut s, 2);
        s.entries.get_mut(&2).unwrap().away = Some((5, 100));
        assert!(s.table.preempt(1, PreemptMode::Recompute, 0).is_some());
        let held = s.held();
        assert_eq!(held.sequences, 2);
        assert_eq!(held.preempted, 1);
        assert_eq!((held.tokens, held.exclusive_bytes), (5, 100));
        assert_eq!(s.tokens_of(2), 5);
        assert_eq!(s.tokens_of(3), 0);
        assert!(s.memory(1).is_none());
        assert_eq!(s.swapped_bytes(), 0);
        assert_eq!(s.drain().len(), 2);
    }
}
