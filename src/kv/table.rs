//! The KV store's sequences, pure: one phase per sequence, the transitions a store may make,
//! and which sequences pressure may take. The store's actor asks and applies; the memory
//! itself lives beside this table.
//!
//! A sequence is identified by the caller's id, but each opening is an [`Incarnation`], never
//! reused: work that outlives a close (a grant still on its way for a prepare or a restore)
//! names its incarnation and finds nothing when the id was closed, even if it was opened again
//! meanwhile.

use std::collections::{HashMap, HashSet};

use super::prefix::Incarnation;

/// A sequence's id, chosen by the caller.
pub type SeqId = u64;

/// What happens to a sequence chosen as a victim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptMode {
    /// Copy its KV out first; restoring copies it back.
    Swap,
    /// Drop its KV; the caller recomputes it by replaying the tokens.
    Recompute,
}

/// Where one sequence is. Exactly one at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Its memory is in place and no step uses it.
    Idle,
    /// A prepare's grant is on its way.
    Growing,
    /// Between a prepare that succeeded and the end of its step (completed or dropped, and
    /// the kernels it submitted done): the server's kernels use it.
    Stepping,
    /// Pressure took its memory; `tokens` were saved (swap) or dropped (recompute).
    Preempted {
        /// How.
        mode: PreemptMode,
        /// Tokens it held.
        tokens: usize,
    },
    /// A restore's grant is on its way.
    Restoring {
        /// How it was preempted.
        mode: PreemptMode,
        /// Tokens it held.
        tokens: usize,
    },
}

/// Why the table refused; nothing changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    /// No open sequence with that id.
    #[error("sequence {0} is not open")]
    Unknown(SeqId),
    /// The id is open, or being opened.
    #[error("sequence {0} is already open")]
    AlreadyOpen(SeqId),
    /// One batch named the sequence twice.
    #[error("sequence {0} is named twice in one batch")]
    Duplicate(SeqId),
    /// A step or a restore is already on its way for it.
    #[error("sequence {0} is busy with another step")]
    Busy(SeqId),
    /// Pressure took it; restore it first.
    #[error("sequence {0} was preempted ({1:?}); restore it first")]
    Preempted(SeqId, PreemptMode),
    /// It is not between a prepare and its last layer.
    #[error("sequence {0} is not in a step: prepare it first")]
    NotInStep(SeqId),
}

/// One sequence's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqRecord {
    /// The incarnation now open (the writer of its prefix blocks).
    pub writer: Incarnation,
    /// How much it matters (higher is more important).
    pub priority: u32,
    /// Where it is.
    pub phase: Phase,
    /// Its place in admission order (later admissions have larger numbers).
    pub admitted: u64,
    /// Prefix blocks it is writing: (key, token count that completes the block).
    pub filling: Vec<(u64, usize)>,
}

/// Every sequence of a store.
#[derive(Debug, Default, Clone)]
pub struct SequenceTable {
    seqs: HashMap<SeqId, SeqRecord>,
    opening: HashMap<SeqId, Incarnation>,
    next_writer: Incarnation,
    next_admission: u64,
}

/// The first id named twice in `batch`.
pub fn first_duplicate(batch: &[SeqId]) -> Option<SeqId> {
    let mut seen = HashSet::with_capacity(batch.len());
    batch.iter().copied().find(|s| !seen.insert(*s))
}

impl SequenceTable {
    /// An empty table.
    pub fn new() -> Self {
        SequenceTable {
            next_writer: 1,
            ..Self::default()
        }
    }

    /// The record of `seq`.
    pub fn get(&self, seq: SeqId) -> Option<&SeqRecord> {
        self.seqs.get(&seq)
    }

    /// Every open sequence.
    pub fn iter(&self) -> impl Iterator<Item = (SeqId, &SeqRecord)> + '_ {
        self.seqs.iter().map(|(s, r)| (*s, r))
    }

    /// Sequences open (being opened excluded).
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// True when no sequence is open.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Starts opening `seq`: its incarnation. Refused if the id is open or being opened.
    pub fn begin_open(&mut self, seq: SeqId) -> Result<Incarnation, TableError> {
        if self.seqs.contains_key(&seq) || self.opening.contains_key(&seq) {
            return Err(TableError::AlreadyOpen(seq));
        }
        let writer = self.next_writer;
        self.next_writer += 1;
        self.opening.insert(seq, writer);
        Ok(writer)
    }

    /// A fresh incarnation for a writer that is no open sequence (blocks a closed sequence
    /// leaves to the cache): never one a sequence has or will have.
    pub fn new_writer(&mut self) -> Incarnation {
        let writer = self.next_writer.max(1);
        self.next_writer = writer + 1;
        writer
    }

    /// Ends opening `seq` as `writer`: with `Some(filling)` it is open and idle, writing those
    /// prefix blocks; with `None` (its open failed, or its caller left) it is forgotten.
    /// `false` if that open was not on its way (closed meanwhile).
    pub fn end_open(
        &mut self,
        seq: SeqId,
        writer: Incarnation,
        priority: u32,
        filling: Option<Vec<(u64, usize)>>,
    ) -> bool {
        if self.opening.get(&seq) != Some(&writer) {
            return false;
        }
        self.opening.remove(&seq);
        if let Some(filling) = filling {
            let admitted = self.next_admission;
            self.next_admission += 1;
            self.seqs.insert(
                seq,
                SeqRecord {
                    writer,
                    priority,
                    phase: Phase::Idle,
                    admitted,
                    filling,
                },
            );
        }
        true
    }

    fn usable(&self, seq: SeqId) -> Result<&SeqRecord, TableError> {
        let r = self.seqs.get(&seq).ok_or(TableError::Unknown(seq))?;
        match r.phase {
            Phase::Preempted { mode, .. } => Err(TableError::Preempted(seq, mode)),
            Phase::Growing | Phase::Restoring { .. } => Err(TableError::Busy(seq)),
            Phase::Idle | Phase::Stepping => Ok(r),
        }
    }

    /// Starts a step for `batch`: every sequence must be open, idle (not in a step already),
    /// and named once. Refused as a whole, changing nothing.
    /// Returns each sequence's incarnation; mark them with [`SequenceTable::growing`] if a
    /// grant must be waited for.
    pub fn begin_step(&self, batch: &[SeqId]) -> Result<Vec<(SeqId, Incarnation)>, TableError> {
        if let Some(twice) = first_duplicate(batch) {
            return Err(TableError::Duplicate(twice));
        }
        batch
            .iter()
            .map(|s| match self.usable(*s) {
                Ok(r) if r.phase == Phase::Stepping => Err(TableError::Busy(*s)),
                Ok(r) => Ok((*s, r.writer)),
                Err(e) => Err(e),
            })
            .collect()
    }

    /// The step's sequences wait for their grant.
    pub fn growing(&mut self, batch: &[(SeqId, Incarnation)]) {
        self.set_phase(batch, Phase::Growing);
    }

    /// The step's grant and growth are done: `stepping` when the server now uses the
    /// sequences (the prepare succeeded and its caller got the answer), otherwise back to
    /// idle. Sequences closed meanwhile are skipped.
    pub fn end_growth(&mut self, batch: &[(SeqId, Incarnation)], stepping: bool) {
        let phase = if stepping {
            Phase::Stepping
        } else {
            Phase::Idle
        };
        self.set_phase(batch, phase);
    }

    fn set_phase(&mut self, batch: &[(SeqId, Incarnation)], phase: Phase) {
        for (seq, writer) in batch {
            if let Some(r) = self.seqs.get_mut(seq).filter(|r| r.writer == *writer) {
                // A sequence preempted while its step waited stays preempted.
                if matches!(r.phase, Phase::Idle | Phase::Growing | Phase::Stepping) {
                    r.phase = phase;
                }
            }
        }
    }

    /// The first sequence of `batch` that pressure took while the step waited for its grant
    /// (the step then fails as a whole), with how it was preempted.
    pub fn preempted_in(&self, batch: &[(SeqId, Incarnation)]) -> Option<(SeqId, PreemptMode)> {
        batch.iter().find_map(|(seq, writer)| {
            let r = self.seqs.get(seq).filter(|r| r.writer == *writer)?;
            match r.phase {
                Phase::Preempted { mode, .. } => Some((*seq, mode)),
                _ => None,
            }
        })
    }

    /// The step of `seq` as `writer` ended (completed or dropped) and its memory is back: it
    /// is idle again and holds `tokens`. Returns the prefix blocks it has now written
    /// completely (to mark complete). Refused, changing nothing, if that incarnation is gone
    /// (`Unknown`: closed meanwhile) or not in a step.
    pub fn end_step(
        &mut self,
        seq: SeqId,
        writer: Incarnation,
        tokens: usize,
    ) -> Result<Vec<u64>, TableError> {
        let r = self.usable(seq)?;
        if r.writer != writer {
            return Err(TableError::Unknown(seq));
        }
        if r.phase != Phase::Stepping {
            return Err(TableError::NotInStep(seq));
        }
        let r = self.seqs.get_mut(&seq).expect("usable");
        r.phase = Phase::Idle;
        let done = r
            .filling
            .iter()
            .filter(|(_, end)| *end <= tokens)
            .map(|(k, _)| *k)
            .collect();
        r.filling.retain(|(_, end)| *end > tokens);
        Ok(done)
    }

    /// Whether pressure may take `seq` now. While a sequence of this store waits for a
    /// grant (its step's or its restore's), only sequences admitted after the oldest such
    /// waiter may go, idle or themselves only waiting for their step's grant: a store never
    /// evicts an older sequence for a newer one's sake, so the oldest always progresses and
    /// nothing is evicted in circles, and when every holder waits for a grant the newest
    /// gives way (giving way to its own step would help nobody). With no waiter here (the
    /// pressure is another holder's), any idle sequence may go. Never one in a step or a
    /// restore. The store adds that no kernel of its may still be running.
    pub fn evictable(&self, seq: SeqId) -> bool {
        let Some(r) = self.seqs.get(&seq) else {
            return false;
        };
        let oldest_waiter = self
            .seqs
            .values()
            .filter(|o| matches!(o.phase, Phase::Growing | Phase::Restoring { .. }))
            .map(|o| o.admitted)
            .min();
        match (r.phase, oldest_waiter) {
            (Phase::Idle, None) => true,
            (Phase::Idle | Phase::Growing, Some(w)) => r.admitted > w,
            _ => false,
        }
    }

    /// Pressure took `seq` (evictable) holding `tokens`: it is preempted, and the prefix
    /// blocks it was writing will never be finished by it (a step whose grant then lands
    /// fails with `Preempted`). Returns its incarnation (to abandon those blocks), or `None`
    /// if it was not evictable.
    pub fn preempt(&mut self, seq: SeqId, mode: PreemptMode, tokens: usize) -> Option<Incarnation> {
        if !self.evictable(seq) {
            return None;
        }
        let r = self.seqs.get_mut(&seq)?;
        r.phase = Phase::Preempted { mode, tokens };
        r.filling.clear();
        Some(r.writer)
    }

    /// `seq` (idle) lost its K/V for a reason other than pressure (a copy in from a slower
    /// tier that fell short): it is preempted to be recomputed, whatever the admission order,
    /// and the prefix blocks it was writing will never be finished by it. Returns its
    /// incarnation, or `None` if it is not idle.
    pub fn lose(&mut self, seq: SeqId, tokens: usize) -> Option<Incarnation> {
        let r = self.seqs.get_mut(&seq)?;
        if r.phase != Phase::Idle {
            return None;
        }
        r.phase = Phase::Preempted {
            mode: PreemptMode::Recompute,
            tokens,
        };
        r.filling.clear();
        Some(r.writer)
    }

    /// Starts restoring `seq`: its incarnation, how it was preempted and the tokens it held.
    /// A sequence that is not preempted needs no restore (`Ok(None)`).
    pub fn begin_restore(
        &mut self,
        seq: SeqId,
    ) -> Result<Option<(Incarnation, PreemptMode, usize)>, TableError> {
        let r = self.seqs.get_mut(&seq).ok_or(TableError::Unknown(seq))?;
        match r.phase {
            Phase::Preempted { mode, tokens } => {
                r.phase = Phase::Restoring { mode, tokens };
                Ok(Some((r.writer, mode, tokens)))
            }
            Phase::Growing | Phase::Restoring { .. } => Err(TableError::Busy(seq)),
            Phase::Idle | Phase::Stepping => Ok(None),
        }
    }

    /// The restore of `seq` as `writer` ended: `restored` puts it back to idle, otherwise it
    /// is preempted as before. `false` if that incarnation is gone (closed meanwhile).
    pub fn end_restore(&mut self, seq: SeqId, writer: Incarnation, restored: bool) -> bool {
        let Some(r) = self.seqs.get_mut(&seq).filter(|r| r.writer == writer) else {
            return false;
        };
        let Phase::Restoring { mode, tokens } = r.phase else {
            return false;
        };
        r.phase = if restored {
            Phase::Idle
        } else {
            Phase::Preempted { mode, tokens }
        };
        true
    }

    /// Closes `seq` (an open on its way is forgotten too): its record, to free its memory.
    pub fn close(&mut self, seq: SeqId) -> Option<SeqRecord> {
        self.opening.remove(&seq);
        self.seqs.remove(&seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_names_each_sequence_once_and_only_open_idle_ones() {
        let mut t = SequenceTable::new();
        let w1 = t.begin_open(1).unwrap();
        assert_eq!(t.begin_open(1), Err(TableError::AlreadyOpen(1)));
        assert!(t.end_open(1, w1, 0, Some(vec![])));
        assert_eq!(t.begin_step(&[1, 1]), Err(TableError::Duplicate(1)));
        assert_eq!(t.begin_step(&[1, 2]), Err(TableError::Unknown(2)));
        let batch = t.begin_step(&[1]).unwrap();
        t.growing(&batch);
        assert_eq!(t.begin_step(&[1]), Err(TableError::Busy(1)));
        assert!(
            !t.evictable(1),
            "the oldest sequence waiting for its grant never gives way to itself"
        );
        t.end_growth(&batch, true);
        assert_eq!(
            t.begin_step(&[1]),
            Err(TableError::Busy(1)),
            "one step at a time"
        );
        assert!(!t.evictable(1), "a stepping sequence is never a victim");
        assert_eq!(t.end_step(1, w1 + 1, 1), Err(TableError::Unknown(1)));
        assert_eq!(t.end_step(1, w1, 1), Ok(vec![]));
        assert_eq!(t.end_step(1, w1, 1), Err(TableError::NotInStep(1)));
        assert!(t.evictable(1));
    }

    #[test]
    fn a_newer_sequence_waiting_for_its_grant_gives_way_to_an_older_one() {
        let mut t = SequenceTable::new();
        for seq in [1, 2] {
            let w = t.begin_open(seq).unwrap();
            t.end_open(seq, w, 0, Some(vec![]));
        }
        let batch = t.begin_step(&[1, 2]).unwrap();
        t.growing(&batch);
        assert!(!t.evictable(1), "the oldest waiter keeps its place");
        assert!(t.evictable(2), "the newer waiter may give way");
        let w2 = t.get(2).unwrap().writer;
        assert_eq!(t.preempt(2, PreemptMode::Swap, 3), Some(w2));
        assert_eq!(t.preempt(1, PreemptMode::Swap, 3), None);
        assert_eq!(t.preempted_in(&batch), Some((2, PreemptMode::Swap)));
        t.end_growth(&batch, false);
        assert!(matches!(t.get(2).unwrap().phase, Phase::Preempted { .. }));
        assert_eq!(t.get(1).unwrap().phase, Phase::Idle);
    }

    #[test]
    fn work_for_a_closed_incarnation_finds_nothing_after_a_reopen() {
        let mut t = SequenceTable::new();
        let old = t.begin_open(7).unwrap();
        t.end_open(7, old, 0, Some(vec![]));
        assert_eq!(t.preempt(7, PreemptMode::Swap, 40), Some(old));
        assert_eq!(t.begin_restore(7), Ok(Some((old, PreemptMode::Swap, 40))));
        t.close(7);
        let new = t.begin_open(7).unwrap();
        assert_ne!(new, old, "incarnations are never reused");
        t.end_open(7, new, 0, Some(vec![]));
        assert!(
            !t.end_restore(7, old, true),
            "the old restore finds nothing"
        );
        assert_eq!(t.get(7).unwrap().phase, Phase::Idle);
        // An open that was closed before it ended is forgotten.
        let w = t.begin_open(8).unwrap();
        t.close(8);
        assert!(!t.end_open(8, w, 0, Some(vec![])));
        assert!(t.get(8).is_none());
    }

    #[test]
    fn a_step_completes_only_the_blocks_its_tokens_reach() {
        let mut t = SequenceTable::new();
        let w = t.begin_open(1).unwrap();
        t.end_open(1, w, 0, Some(vec![(10, 4), (11, 8)]));
        let b = t.begin_step(&[1]).unwrap();
        t.end_growth(&b, true);
        assert_eq!(t.end_step(1, w, 3), Ok(vec![]));
        t.end_growth(&b, true);
        assert_eq!(t.end_step(1, w, 4), Ok(vec![10]));
        assert_eq!(t.get(1).unwrap().filling, vec![(11, 8)]);
        assert_eq!(t.preempt(1, PreemptMode::Recompute, 4), Some(w));
        assert!(
            t.get(1).unwrap().filling.is_empty(),
            "a victim finishes no block"
        );
    }
}
