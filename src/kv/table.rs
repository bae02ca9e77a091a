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

/// What a store keeps with its sequences, by phase: its own types, moved by the table's
/// transitions so each phase carries exactly what is valid in it. `()` keeps nothing (the
/// policy alone, as the tests drive it).
pub trait SeqData {
    /// A sequence's memory and what comes with it while it is in place: idle, growing, and
    /// restoring once the memory it comes back into is reserved.
    type Resident;
    /// What a preempted sequence keeps to come back (a saved copy, the blocks it mapped).
    type ToRestore: Default;
}

impl SeqData for () {
    type Resident = ();
    type ToRestore = ();
}

/// What a sequence whose memory a step has held when it was lent (for the stats).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Lent {
    /// Tokens.
    pub tokens: usize,
    /// Its own bytes (not the shared prefixes it maps).
    pub bytes: u64,
}

/// Where one sequence is, with what it holds there. Exactly one at a time; the table's
/// transitions move the payloads.
pub enum SeqState<D: SeqData> {
    /// Its memory is in place and no step uses it.
    Idle(D::Resident),
    /// A prepare's grant is on its way; the memory grows when it lands.
    Growing(D::Resident),
    /// A step has its memory, from a prepare that succeeded to the end of the step
    /// (completed or dropped, and the kernels it submitted done).
    Stepping(Lent),
    /// Pressure took its memory; `tokens` were saved (swap) or dropped (recompute).
    Preempted {
        /// How.
        mode: PreemptMode,
        /// Tokens it held.
        tokens: usize,
        /// What it keeps to come back.
        to_restore: D::ToRestore,
    },
    /// A restore is on its way: its memory, once reserved, waits for the restore's grant.
    Restoring {
        /// How it was preempted.
        mode: PreemptMode,
        /// Tokens it held.
        tokens: usize,
        /// What it keeps, until the restore is done.
        to_restore: D::ToRestore,
        /// The memory it comes back into, once reserved.
        resident: Option<D::Resident>,
    },
}

impl<D: SeqData> SeqState<D> {
    /// Idle: in place, no step.
    pub fn is_idle(&self) -> bool {
        matches!(self, SeqState::Idle(_))
    }

    /// Waiting for its step's grant.
    pub fn is_growing(&self) -> bool {
        matches!(self, SeqState::Growing(_))
    }

    /// A step has its memory.
    pub fn is_stepping(&self) -> bool {
        matches!(self, SeqState::Stepping(_))
    }

    /// Preempted: how, where it is.
    pub fn preempted(&self) -> Option<PreemptMode> {
        match self {
            SeqState::Preempted { mode, .. } => Some(*mode),
            _ => None,
        }
    }

    /// A restore is on its way.
    pub fn is_restoring(&self) -> bool {
        matches!(self, SeqState::Restoring { .. })
    }

    /// Waiting for a grant: its step's, or its restore's.
    pub fn is_waiting(&self) -> bool {
        self.is_growing() || self.is_restoring()
    }
}

/// A prefix block a sequence is writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Filling {
    /// The block's key in the prefix cache.
    pub key: u64,
    /// The sequence's token count once the block is whole.
    pub end: usize,
}

/// A sequence in a step, as the table knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Writer {
    /// The sequence.
    pub seq: SeqId,
    /// Its incarnation now open.
    pub writer: Incarnation,
}

/// A restore begun: what the sequence was when pressure took it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoreStart {
    /// Its incarnation.
    pub writer: Incarnation,
    /// How it was preempted.
    pub mode: PreemptMode,
    /// The tokens it held.
    pub tokens: usize,
}

/// One open sequence: who writes it, how much it matters, and its state.
pub struct Sequence<D: SeqData = ()> {
    /// The incarnation now open (the writer of its prefix blocks).
    pub writer: Incarnation,
    /// How much it matters (higher is more important).
    pub priority: u32,
    /// Its place in admission order (later admissions have larger numbers).
    pub admitted: u64,
    /// Prefix blocks it is writing, each with the token count that completes it.
    pub filling: Vec<Filling>,
    state: SeqState<D>,
}

impl<D: SeqData> Sequence<D> {
    /// Where it is, with what it holds there.
    pub fn state(&self) -> &SeqState<D> {
        &self.state
    }

    /// Its memory, where it has it (idle, growing, restoring once reserved).
    pub fn resident(&self) -> Option<&D::Resident> {
        match &self.state {
            SeqState::Idle(r) | SeqState::Growing(r) => Some(r),
            SeqState::Restoring { resident, .. } => resident.as_ref(),
            _ => None,
        }
    }

    /// Its memory, to change in place (the phase stays).
    pub fn resident_mut(&mut self) -> Option<&mut D::Resident> {
        match &mut self.state {
            SeqState::Idle(r) | SeqState::Growing(r) => Some(r),
            SeqState::Restoring { resident, .. } => resident.as_mut(),
            _ => None,
        }
    }

    /// What it keeps while preempted or restoring.
    pub fn to_restore(&self) -> Option<&D::ToRestore> {
        match &self.state {
            SeqState::Preempted { to_restore, .. } | SeqState::Restoring { to_restore, .. } => {
                Some(to_restore)
            }
            _ => None,
        }
    }

    /// What it keeps, to change in place.
    pub fn to_restore_mut(&mut self) -> Option<&mut D::ToRestore> {
        match &mut self.state {
            SeqState::Preempted { to_restore, .. } | SeqState::Restoring { to_restore, .. } => {
                Some(to_restore)
            }
            _ => None,
        }
    }

    /// What it held when a step took its memory, while the step has it.
    pub fn lent(&self) -> Option<Lent> {
        match self.state {
            SeqState::Stepping(lent) => Some(lent),
            _ => None,
        }
    }

    /// Its state, leaving its payload behind: the table puts the next one in.
    fn take_state(&mut self) -> SeqState<D> {
        std::mem::replace(&mut self.state, SeqState::Stepping(Lent::default()))
    }

    /// Preempted holding `tokens`, keeping nothing yet; returns its memory.
    fn become_preempted(&mut self, mode: PreemptMode, tokens: usize) -> D::Resident {
        let (SeqState::Idle(r) | SeqState::Growing(r)) = self.take_state() else {
            unreachable!("checked by the caller")
        };
        self.state = SeqState::Preempted {
            mode,
            tokens,
            to_restore: D::ToRestore::default(),
        };
        self.filling.clear();
        r
    }

    /// Its state, taken whole: a closed sequence's, to free what it holds.
    pub fn into_state(self) -> SeqState<D> {
        self.state
    }
}

/// Every sequence of a store.
pub struct SequenceTable<D: SeqData = ()> {
    seqs: HashMap<SeqId, Sequence<D>>,
    opening: HashMap<SeqId, Incarnation>,
    next_writer: Incarnation,
    next_admission: u64,
}

impl<D: SeqData> Default for SequenceTable<D> {
    fn default() -> Self {
        Self::new()
    }
}

/// The first id named twice in `batch`.
pub fn first_duplicate(batch: &[SeqId]) -> Option<SeqId> {
    let mut seen = HashSet::with_capacity(batch.len());
    batch.iter().copied().find(|s| !seen.insert(*s))
}

impl<D: SeqData> SequenceTable<D> {
    /// An empty table.
    pub fn new() -> Self {
        SequenceTable {
            seqs: HashMap::new(),
            opening: HashMap::new(),
            next_writer: 1,
            next_admission: 0,
        }
    }

    /// The sequence `seq`.
    pub fn get(&self, seq: SeqId) -> Option<&Sequence<D>> {
        self.seqs.get(&seq)
    }

    /// The sequence `seq`, its payload to change in place.
    pub fn get_mut(&mut self, seq: SeqId) -> Option<&mut Sequence<D>> {
        self.seqs.get_mut(&seq)
    }

    /// Every open sequence.
    pub fn iter(&self) -> impl Iterator<Item = (SeqId, &Sequence<D>)> + '_ {
        self.seqs.iter().map(|(s, r)| (*s, r))
    }

    /// Every open sequence, its payload to change in place.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (SeqId, &mut Sequence<D>)> + '_ {
        self.seqs.iter_mut().map(|(s, r)| (*s, r))
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

    /// Ends opening `seq` as `writer`: it is open and idle with its memory, writing the
    /// `filling` prefix blocks. Refused, giving the memory back to be freed, if that open was
    /// not on its way (closed meanwhile).
    pub fn end_open(
        &mut self,
        seq: SeqId,
        writer: Incarnation,
        priority: u32,
        filling: Vec<Filling>,
        resident: D::Resident,
    ) -> Result<(), D::Resident> {
        if self.opening.get(&seq) != Some(&writer) {
            return Err(resident);
        }
        self.opening.remove(&seq);
        let admitted = self.next_admission;
        self.next_admission += 1;
        let state = SeqState::Idle(resident);
        let record = Sequence {
            writer,
            priority,
            admitted,
            filling,
            state,
        };
        self.seqs.insert(seq, record);
        Ok(())
    }

    /// The open of `seq` as `writer` failed, or its caller left: it is forgotten. `false` if
    /// that open was not on its way.
    pub fn forget_open(&mut self, seq: SeqId, writer: Incarnation) -> bool {
        if self.opening.get(&seq) != Some(&writer) {
            return false;
        }
        self.opening.remove(&seq);
        true
    }

    fn usable(&self, seq: SeqId) -> Result<&Sequence<D>, TableError> {
        let r = self.seqs.get(&seq).ok_or(TableError::Unknown(seq))?;
        match r.state() {
            SeqState::Preempted { mode, .. } => Err(TableError::Preempted(seq, *mode)),
            SeqState::Growing(_) | SeqState::Restoring { .. } => Err(TableError::Busy(seq)),
            SeqState::Idle(_) | SeqState::Stepping(_) => Ok(r),
        }
    }

    /// Starts a step for `batch`: every sequence must be open, idle (not in a step already),
    /// and named once. Refused as a whole, changing nothing.
    /// Returns each sequence's incarnation; mark them with [`SequenceTable::growing`] if a
    /// grant must be waited for.
    pub fn begin_step(&self, batch: &[SeqId]) -> Result<Vec<Writer>, TableError> {
        if let Some(twice) = first_duplicate(batch) {
            return Err(TableError::Duplicate(twice));
        }
        batch
            .iter()
            .map(|s| match self.usable(*s) {
                Ok(r) if r.state().is_stepping() => Err(TableError::Busy(*s)),
                Ok(r) => Ok(Writer {
                    seq: *s,
                    writer: r.writer,
                }),
                Err(e) => Err(e),
            })
            .collect()
    }

    /// The step's idle sequences wait for their grant.
    pub fn growing(&mut self, batch: &[Writer]) {
        for w in batch {
            let Some(r) = self.seqs.get_mut(&w.seq).filter(|r| r.writer == w.writer) else {
                continue;
            };
            if let SeqState::Idle(_) = r.state {
                let SeqState::Idle(resident) = r.take_state() else {
                    unreachable!()
                };
                r.state = SeqState::Growing(resident);
            }
        }
    }

    /// The step's grant or growth failed, or its caller left: its sequences still waiting are
    /// idle again. Sequences closed or preempted meanwhile are skipped.
    pub fn end_growth(&mut self, batch: &[Writer]) {
        for w in batch {
            let Some(r) = self.seqs.get_mut(&w.seq).filter(|r| r.writer == w.writer) else {
                continue;
            };
            if let SeqState::Growing(_) = r.state {
                let SeqState::Growing(resident) = r.take_state() else {
                    unreachable!()
                };
                r.state = SeqState::Idle(resident);
            }
        }
    }

    /// A step's memory is lent: `seq` as `writer` (growing, or idle where no grant was
    /// needed) is stepping, holding what `lent` says of its memory, which is returned to go
    /// with the step. `None`, changing nothing, if it is gone or not idle or growing.
    pub fn lend(
        &mut self,
        seq: SeqId,
        writer: Incarnation,
        lent: impl FnOnce(&D::Resident) -> Lent,
    ) -> Option<D::Resident> {
        let r = self.seqs.get_mut(&seq).filter(|r| r.writer == writer)?;
        let (SeqState::Idle(resident) | SeqState::Growing(resident)) = &r.state else {
            return None;
        };
        let lent = lent(resident);
        let (SeqState::Idle(resident) | SeqState::Growing(resident)) = r.take_state() else {
            unreachable!()
        };
        r.state = SeqState::Stepping(lent);
        Some(resident)
    }

    /// The first sequence of `batch` that pressure took while the step waited for its grant
    /// (the step then fails as a whole), with how it was preempted.
    pub fn preempted_in(&self, batch: &[Writer]) -> Option<(SeqId, PreemptMode)> {
        batch.iter().find_map(|w| {
            let r = self.seqs.get(&w.seq).filter(|r| r.writer == w.writer)?;
            r.state().preempted().map(|mode| (w.seq, mode))
        })
    }

    /// The step of `seq` as `writer` ended (completed or dropped) and its memory is back
    /// holding `tokens`: it is idle again. Returns the prefix blocks it has now written
    /// completely (to mark complete). Refused, changing nothing and giving the memory back to
    /// be freed, if that incarnation is gone (`Unknown`: closed meanwhile) or not in a step.
    pub fn end_step(
        &mut self,
        seq: SeqId,
        writer: Incarnation,
        tokens: usize,
        resident: D::Resident,
    ) -> Result<Vec<u64>, (TableError, D::Resident)> {
        let checked = match self.usable(seq) {
            Ok(r) if r.writer != writer => Err(TableError::Unknown(seq)),
            Ok(r) if !r.state().is_stepping() => Err(TableError::NotInStep(seq)),
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        };
        if let Err(e) = checked {
            return Err((e, resident));
        }
        let r = self.seqs.get_mut(&seq).expect("usable");
        r.state = SeqState::Idle(resident);
        let done = r
            .filling
            .iter()
            .filter(|f| f.end <= tokens)
            .map(|f| f.key)
            .collect();
        r.filling.retain(|f| f.end > tokens);
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
            .filter(|o| o.state().is_waiting())
            .map(|o| o.admitted)
            .min();
        match (r.state(), oldest_waiter) {
            (SeqState::Idle(_), None) => true,
            (SeqState::Idle(_) | SeqState::Growing(_), Some(w)) => r.admitted > w,
            _ => false,
        }
    }

    /// Pressure took `seq` (evictable) holding `tokens`: it is preempted, keeping nothing
    /// yet (see [`Sequence::to_restore_mut`]), and the prefix blocks it was writing will never be
    /// finished by it (a step whose grant then lands fails with `Preempted`). Returns its
    /// incarnation (to abandon those blocks) and its memory (to free or copy out), or `None`
    /// if it was not evictable.
    pub fn preempt(
        &mut self,
        seq: SeqId,
        mode: PreemptMode,
        tokens: usize,
    ) -> Option<(Incarnation, D::Resident)> {
        if !self.evictable(seq) {
            return None;
        }
        let r = self.seqs.get_mut(&seq)?;
        let resident = r.become_preempted(mode, tokens);
        Some((r.writer, resident))
    }

    /// `seq` (idle) lost its K/V for a reason other than pressure (a copy in from a slower
    /// tier that fell short): it is preempted to be recomputed, whatever the admission order,
    /// and the prefix blocks it was writing will never be finished by it. Returns its
    /// incarnation and its memory, or `None` if it is not idle.
    pub fn lose(&mut self, seq: SeqId, tokens: usize) -> Option<(Incarnation, D::Resident)> {
        let r = self.seqs.get_mut(&seq)?;
        if !r.state().is_idle() {
            return None;
        }
        let resident = r.become_preempted(PreemptMode::Recompute, tokens);
        Some((r.writer, resident))
    }

    /// Starts restoring `seq`: its incarnation, how it was preempted and the tokens it held.
    /// A sequence that is not preempted needs no restore (`Ok(None)`). Its memory goes in
    /// with [`SequenceTable::restoring_into`].
    pub fn begin_restore(&mut self, seq: SeqId) -> Result<Option<RestoreStart>, TableError> {
        let r = self.seqs.get_mut(&seq).ok_or(TableError::Unknown(seq))?;
        match r.state() {
            SeqState::Preempted { .. } => {
                let SeqState::Preempted {
                    mode,
                    tokens,
                    to_restore,
                } = r.take_state()
                else {
                    unreachable!()
                };
                r.state = SeqState::Restoring {
                    mode,
                    tokens,
                    to_restore,
                    resident: None,
                };
                Ok(Some(RestoreStart {
                    writer: r.writer,
                    mode,
                    tokens,
                }))
            }
            SeqState::Growing(_) | SeqState::Restoring { .. } => Err(TableError::Busy(seq)),
            SeqState::Idle(_) | SeqState::Stepping(_) => Ok(None),
        }
    }

    /// The memory `seq` as `writer` (restoring) comes back into. Refused, giving it back to
    /// be freed, if that restore is gone or has its memory already.
    pub fn restoring_into(
        &mut self,
        seq: SeqId,
        writer: Incarnation,
        memory: D::Resident,
    ) -> Result<(), D::Resident> {
        let Some(r) = self.seqs.get_mut(&seq).filter(|r| r.writer == writer) else {
            return Err(memory);
        };
        match &mut r.state {
            SeqState::Restoring { resident, .. } if resident.is_none() => {
                *resident = Some(memory);
                Ok(())
            }
            _ => Err(memory),
        }
    }

    /// The restore of `seq` as `writer` ended: `restored` puts it back to idle in the memory
    /// it came back into (what it kept to come back goes), otherwise, or where no memory was put in, it is
    /// preempted as before, with what it kept, and that memory is returned to be freed.
    /// `Err(Unknown)` if that incarnation's restore is gone (closed meanwhile).
    pub fn end_restore(
        &mut self,
        seq: SeqId,
        writer: Incarnation,
        restored: bool,
    ) -> Result<Option<D::Resident>, TableError> {
        let Some(r) = self.seqs.get_mut(&seq).filter(|r| r.writer == writer) else {
            return Err(TableError::Unknown(seq));
        };
        if !matches!(r.state, SeqState::Restoring { .. }) {
            return Err(TableError::Unknown(seq));
        }
        let SeqState::Restoring {
            mode,
            tokens,
            to_restore,
            resident,
        } = r.take_state()
        else {
            unreachable!()
        };
        match resident {
            Some(resident) if restored => {
                r.state = SeqState::Idle(resident);
                Ok(None)
            }
            resident => {
                r.state = SeqState::Preempted {
                    mode,
                    tokens,
                    to_restore,
                };
                Ok(resident)
            }
        }
    }

    /// Closes `seq` (an open on its way is forgotten too): the sequence, to free what it
    /// holds.
    pub fn close(&mut self, seq: SeqId) -> Option<Sequence<D>> {
        self.opening.remove(&seq);
        self.seqs.remove(&seq)
    }

    /// Takes every sequence (the store is going away).
    pub fn drain(&mut self) -> Vec<Sequence<D>> {
        self.opening.clear();
        self.seqs.drain().map(|(_, r)| r).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Memory as a token count; what a preempted one keeps as the tokens it saved.
    struct Counted;
    impl SeqData for Counted {
        type Resident = usize;
        type ToRestore = Vec<usize>;
    }

    fn open<D: SeqData>(
        t: &mut SequenceTable<D>,
        seq: SeqId,
        filling: Vec<Filling>,
        r: D::Resident,
    ) -> Incarnation {
        let w = t.begin_open(seq).unwrap();
        assert!(t.end_open(seq, w, 0, filling, r).is_ok());
        w
    }

    /// Grows, lends and ends one step of `seq`; its memory comes back holding `tokens`.
    fn step(t: &mut SequenceTable, seq: SeqId, tokens: usize) -> Result<Vec<u64>, TableError> {
        let b = t.begin_step(&[seq])?;
        t.lend(seq, b[0].writer, |_| Lent::default()).expect("idle");
        t.end_step(seq, b[0].writer, tokens, ()).map_err(|(e, _)| e)
    }

    #[test]
    fn a_step_names_each_sequence_once_and_only_open_idle_ones() {
        let mut t = SequenceTable::<()>::new();
        let w1 = t.begin_open(1).unwrap();
        assert_eq!(t.begin_open(1), Err(TableError::AlreadyOpen(1)));
        assert!(t.end_open(1, w1, 0, vec![], ()).is_ok());
        assert_eq!(t.begin_step(&[1, 1]), Err(TableError::Duplicate(1)));
        assert_eq!(t.begin_step(&[1, 2]), Err(TableError::Unknown(2)));
        let batch = t.begin_step(&[1]).unwrap();
        t.growing(&batch);
        assert_eq!(t.begin_step(&[1]), Err(TableError::Busy(1)));
        assert!(
            !t.evictable(1),
            "the oldest sequence waiting for its grant never gives way to itself"
        );
        assert!(t.lend(1, w1, |_| Lent::default()).is_some());
        assert!(t.lend(1, w1, |_| Lent::default()).is_none(), "lent once");
        assert_eq!(
            t.begin_step(&[1]),
            Err(TableError::Busy(1)),
            "one step at a time"
        );
        assert!(!t.evictable(1), "a stepping sequence is never a victim");
        assert_eq!(
            t.end_step(1, w1 + 1, 1, ()).map_err(|e| e.0),
            Err(TableError::Unknown(1))
        );
        assert_eq!(t.end_step(1, w1, 1, ()).map_err(|e| e.0), Ok(vec![]));
        assert_eq!(
            t.end_step(1, w1, 1, ()).map_err(|e| e.0),
            Err(TableError::NotInStep(1))
        );
        assert!(t.evictable(1));
    }

    #[test]
    fn each_phase_holds_exactly_its_payload_and_the_transitions_move_it() {
        let mut t = SequenceTable::<Counted>::new();
        let w = open(&mut t, 1, vec![], 5);
        assert_eq!(t.get(1).unwrap().resident(), Some(&5));
        let b = t.begin_step(&[1]).unwrap();
        t.growing(&b);
        assert_eq!(t.get(1).unwrap().resident(), Some(&5), "growing keeps it");
        let lent = t.lend(1, w, |m| Lent {
            tokens: *m,
            bytes: 50,
        });
        assert_eq!(lent, Some(5), "the step takes the memory");
        let s = t.get(1).unwrap();
        assert_eq!(
            (s.resident(), s.lent()),
            (
                None,
                Some(Lent {
                    tokens: 5,
                    bytes: 50
                })
            )
        );
        // A refused end gives the memory back to be freed.
        assert_eq!(t.end_step(1, w + 1, 6, 6), Err((TableError::Unknown(1), 6)));
        assert!(t.end_step(1, w, 6, 6).is_ok());
        assert_eq!(t.get(1).unwrap().resident(), Some(&6));
        // Preempted: the memory comes out, what it keeps starts empty and is filled in place.
        assert_eq!(t.preempt(1, PreemptMode::Swap, 6), Some((w, 6)));
        assert_eq!(t.get(1).unwrap().resident(), None);
        t.get_mut(1).unwrap().to_restore_mut().unwrap().push(6);
        assert_eq!(
            t.begin_restore(1),
            Ok(Some(RestoreStart {
                writer: w,
                mode: PreemptMode::Swap,
                tokens: 6
            }))
        );
        // A restore whose memory never went in stays preempted, keeping what it kept.
        assert_eq!(t.end_restore(1, w, true), Ok(None));
        assert_eq!(t.get(1).unwrap().to_restore(), Some(&vec![6]));
        assert!(t.begin_restore(1).unwrap().is_some());
        assert!(t.restoring_into(1, w, 7).is_ok());
        assert_eq!(t.restoring_into(1, w, 8), Err(8), "one memory per restore");
        // A failed restore gives its memory back and keeps the saved tokens.
        assert_eq!(t.end_restore(1, w, false), Ok(Some(7)));
        assert_eq!(t.get(1).unwrap().to_restore(), Some(&vec![6]));
        t.begin_restore(1).unwrap();
        t.restoring_into(1, w, 9).unwrap();
        assert_eq!(t.end_restore(1, w, true), Ok(None));
        let s = t.get(1).unwrap();
        assert_eq!((s.resident(), s.to_restore()), (Some(&9), None));
        // An open closed before it ended gives its memory back.
        let w2 = t.begin_open(2).unwrap();
        t.close(2);
        assert_eq!(t.end_open(2, w2, 0, vec![], 3), Err(3));
        let closed = t.close(1).unwrap();
        assert!(matches!(closed.into_state(), SeqState::Idle(9)));
    }

    #[test]
    fn a_newer_sequence_waiting_for_its_grant_gives_way_to_an_older_one() {
        let mut t = SequenceTable::<()>::new();
        for seq in [1, 2] {
            open(&mut t, seq, vec![], ());
        }
        let batch = t.begin_step(&[1, 2]).unwrap();
        t.growing(&batch);
        assert!(!t.evictable(1), "the oldest waiter keeps its place");
        assert!(t.evictable(2), "the newer waiter may give way");
        let w2 = t.get(2).unwrap().writer;
        assert_eq!(t.preempt(2, PreemptMode::Swap, 3), Some((w2, ())));
        assert_eq!(t.preempt(1, PreemptMode::Swap, 3), None);
        assert_eq!(t.preempted_in(&batch), Some((2, PreemptMode::Swap)));
        t.end_growth(&batch);
        assert!(t.get(2).unwrap().state().preempted().is_some());
        assert!(t.get(1).unwrap().state().is_idle());
    }

    #[test]
    fn work_for_a_closed_incarnation_finds_nothing_after_a_reopen() {
        let mut t = SequenceTable::<()>::new();
        let old = open(&mut t, 7, vec![], ());
        assert_eq!(t.preempt(7, PreemptMode::Swap, 40), Some((old, ())));
        assert_eq!(
            t.begin_restore(7),
            Ok(Some(RestoreStart {
                writer: old,
                mode: PreemptMode::Swap,
                tokens: 40
            }))
        );
        t.close(7);
        let new = t.begin_open(7).unwrap();
        assert_ne!(new, old, "incarnations are never reused");
        assert!(t.end_open(7, new, 0, vec![], ()).is_ok());
        assert_eq!(
            t.end_restore(7, old, true),
            Err(TableError::Unknown(7)),
            "the old restore finds nothing"
        );
        assert_eq!(t.restoring_into(7, old, ()), Err(()));
        assert!(t.get(7).unwrap().state().is_idle());
        // An open that was closed before it ended is forgotten.
        let w = t.begin_open(8).unwrap();
        t.close(8);
        assert!(!t.forget_open(8, w));
        assert!(t.end_open(8, w, 0, vec![], ()).is_err());
        assert!(t.get(8).is_none());
    }

    #[test]
    fn a_step_completes_only_the_blocks_its_tokens_reach() {
        let mut t = SequenceTable::<()>::new();
        let w = open(
            &mut t,
            1,
            vec![Filling { key: 10, end: 4 }, Filling { key: 11, end: 8 }],
            (),
        );
        assert_eq!(step(&mut t, 1, 3), Ok(vec![]));
        assert_eq!(step(&mut t, 1, 4), Ok(vec![10]));
        assert_eq!(t.get(1).unwrap().filling, vec![Filling { key: 11, end: 8 }]);
        assert_eq!(t.preempt(1, PreemptMode::Recompute, 4), Some((w, ())));
        assert!(
            t.get(1).unwrap().filling.is_empty(),
            "a victim finishes no block"
        );
    }
}
