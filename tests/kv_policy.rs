//! The KV store's policy (`PrefixCache` and `SequenceTable`), driven the way the store's actor
//! drives it, against a reference written independently: blocks keyed by their whole token
//! prefix instead of a chained hash, sequences as plain records. 5,000 random operation
//! sequences; after every operation both agree on every answer and every state, and:
//! - no block is both cached and being written, nor written by two writers, and every block
//!   being written belongs to a live sequence that lists it;
//! - no sequence in a step or a restore is ever a victim, and while sequences wait for
//!   grants only ones admitted after the oldest waiter are (never the oldest);
//! - a block completes only when the sequence that claimed it has written its last token.

use std::collections::{BTreeMap, HashMap, VecDeque};

use procmem::kv::{
    BlockState, Filling, Incarnation, Lent, PreemptMode, PrefixCache, RestoreStart, SeqId,
    SeqState, SequenceTable, TableError, Writer,
};
use proptest::prelude::*;

const BT: usize = 2;
const SEQS: u64 = 3;

/// Three prompts sharing prefixes: 0 and 1 share their first block, 2 is its own.
fn prompt(id: u8) -> Vec<u32> {
    match id % 3 {
        0 => vec![1, 2, 3, 4, 5, 6],
        1 => vec![1, 2, 7, 8],
        _ => vec![9, 9, 9, 9, 9],
    }
}

#[derive(Debug, Clone)]
enum Op {
    Open(SeqId, u8),
    OpenDone(SeqId, bool),
    Prepare(Vec<SeqId>),
    PrepareDone(bool),
    Step(SeqId),
    Pressure(SeqId),
    Restore(SeqId),
    RestoreDone(SeqId, bool),
    Close(SeqId),
}

fn op() -> impl Strategy<Value = Op> {
    let seq = || 0..SEQS;
    prop_oneof![
        3 => (seq(), any::<u8>()).prop_map(|(s, p)| Op::Open(s, p)),
        3 => (seq(), prop::bool::weighted(0.8)).prop_map(|(s, ok)| Op::OpenDone(s, ok)),
        3 => prop::collection::vec(seq(), 1..3).prop_map(Op::Prepare),
        3 => prop::bool::weighted(0.8).prop_map(Op::PrepareDone),
        4 => seq().prop_map(Op::Step),
        1 => seq().prop_map(Op::Pressure),
        1 => seq().prop_map(Op::Restore),
        1 => (seq(), any::<bool>()).prop_map(|(s, ok)| Op::RestoreDone(s, ok)),
        2 => seq().prop_map(Op::Close),
    ]
}

/// The policy as the actor applies it.
#[derive(Default)]
struct Store {
    cache: PrefixCache<u64>,
    table: SequenceTable,
    /// Opens on their way: seq -> (writer, prompt, hits, claimed keys).
    opening: HashMap<SeqId, (Incarnation, Vec<u32>, usize, Vec<u64>)>,
    prepares: VecDeque<Vec<Writer>>,
    restores: HashMap<SeqId, Incarnation>,
    tokens: HashMap<SeqId, usize>,
    next_block: u64,
    clock: u64,
}

/// What one operation answered, in terms both sides share.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    Opened { hits: usize, claimed: usize },
    Refused(TableError),
    Done,
    Completed(usize),
    Evicted(bool),
    Restoring(bool),
    Nothing,
}

impl Store {
    fn new() -> Self {
        Store {
            table: SequenceTable::new(),
            ..Store::default()
        }
    }

    fn apply(&mut self, op: &Op) -> Answer {
        self.clock += 1;
        match op {
            Op::Open(seq, p) => match self.table.begin_open(*seq) {
                Err(e) => Answer::Refused(e),
                Ok(writer) => {
                    let prompt = prompt(*p);
                    let found = self.cache.lookup(&prompt, BT, writer, self.clock);
                    let answer = Answer::Opened {
                        hits: found.hits.len(),
                        claimed: found.claimed.len(),
                    };
                    self.opening
                        .insert(*seq, (writer, prompt, found.hits.len(), found.claimed));
                    answer
                }
            },
            Op::OpenDone(seq, ok) => {
                let Some((writer, _, hits, claimed)) = self.opening.remove(seq) else {
                    return Answer::Nothing;
                };
                if !ok {
                    self.cache.abandon(writer);
                    self.table.forget_open(*seq, writer);
                    return Answer::Done;
                }
                let mut filling = Vec::new();
                for (i, key) in claimed.iter().enumerate() {
                    self.next_block += 1;
                    if self.cache.fill(*key, writer, self.next_block).is_ok() {
                        filling.push(Filling {
                            key: *key,
                            end: (hits + i + 1) * BT,
                        });
                    }
                }
                if self.table.end_open(*seq, writer, 0, filling, ()).is_ok() {
                    self.tokens.insert(*seq, hits * BT);
                } else {
                    self.cache.abandon(writer);
                }
                Answer::Done
            }
            Op::Prepare(batch) => match self.table.begin_step(batch) {
                Err(e) => Answer::Refused(e),
                Ok(b) => {
                    self.table.growing(&b);
                    self.prepares.push_back(b);
                    Answer::Done
                }
            },
            Op::PrepareDone(ok) => match self.prepares.pop_front() {
                None => Answer::Nothing,
                Some(b) => {
                    // Granted: the step's memory is lent (each sequence still waiting);
                    // refused: they are idle again.
                    if *ok {
                        for w in &b {
                            self.table.lend(w.seq, w.writer, |_| Lent::default());
                        }
                    } else {
                        self.table.end_growth(&b);
                    }
                    Answer::Done
                }
            },
            Op::Step(seq) => {
                let writer = self.table.get(*seq).map_or(0, |r| r.writer);
                let tokens = self.tokens.get(seq).copied().unwrap_or(0) + 1;
                match self.table.end_step(*seq, writer, tokens, ()) {
                    Err((e, ())) => Answer::Refused(e),
                    Ok(done) => {
                        self.tokens.insert(*seq, tokens);
                        let completed = done
                            .into_iter()
                            .filter(|k| self.cache.complete(*k, writer))
                            .count();
                        Answer::Completed(completed)
                    }
                }
            }
            Op::Pressure(seq) => {
                let tokens = self.tokens.get(seq).copied().unwrap_or(0);
                match self.table.preempt(*seq, PreemptMode::Swap, tokens) {
                    Some((writer, ())) => {
                        self.cache.abandon(writer);
                        Answer::Evicted(true)
                    }
                    None => Answer::Evicted(false),
                }
            }
            Op::Restore(seq) => match self.table.begin_restore(*seq) {
                Err(e) => Answer::Refused(e),
                Ok(None) => Answer::Restoring(false),
                Ok(Some(RestoreStart { writer, .. })) => {
                    self.restores.insert(*seq, writer);
                    Answer::Restoring(true)
                }
            },
            Op::RestoreDone(seq, ok) => match self.restores.remove(seq) {
                None => Answer::Nothing,
                Some(writer) => {
                    // The store puts the memory in before the grant lands.
                    let _ = self.table.restoring_into(*seq, writer, ());
                    let _ = self.table.end_restore(*seq, writer, *ok);
                    Answer::Done
                }
            },
            Op::Close(seq) => {
                if let Some((writer, ..)) = self.opening.remove(seq) {
                    self.cache.abandon(writer);
                }
                if let Some(r) = self.table.close(*seq) {
                    self.cache.abandon(r.writer);
                }
                self.tokens.remove(seq);
                Answer::Done
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RefPhase {
    Idle,
    Growing,
    Stepping,
    Preempted,
    Restoring,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RefBlock {
    Claimed(u64),
    Filling(u64),
    Complete,
}

struct RefSeq {
    incarnation: u64,
    /// Admission order.
    admitted: u64,
    phase: RefPhase,
    tokens: usize,
    /// (token prefix of the block, token count that completes it)
    filling: Vec<(Vec<u32>, usize)>,
}

/// The same rules, written plainly.
#[derive(Default)]
struct Reference {
    seqs: BTreeMap<SeqId, RefSeq>,
    opening: BTreeMap<SeqId, (u64, usize, Vec<Vec<u32>>)>,
    blocks: BTreeMap<Vec<u32>, RefBlock>,
    prepares: VecDeque<Vec<(SeqId, u64)>>,
    restores: BTreeMap<SeqId, u64>,
    next: u64,
    admissions: u64,
}

impl Reference {
    /// Pressure may take a sequence (idle, or itself waiting for its step's grant) newer than
    /// some sequence waiting for a grant, or any idle one when nothing waits.
    fn may_take(&self, phase: RefPhase, admitted: u64) -> bool {
        let waiters: Vec<u64> = self
            .seqs
            .values()
            .filter(|o| matches!(o.phase, RefPhase::Growing | RefPhase::Restoring))
            .map(|o| o.admitted)
            .collect();
        match phase {
            RefPhase::Idle if waiters.is_empty() => true,
            RefPhase::Idle | RefPhase::Growing => waiters.iter().any(|w| admitted > *w),
            _ => false,
        }
    }

    fn forget_writer(&mut self, inc: u64) {
        self.blocks
            .retain(|_, b| *b != RefBlock::Claimed(inc) && *b != RefBlock::Filling(inc));
    }

    fn usable(&self, seq: SeqId) -> Result<(), TableError> {
        match self.seqs.get(&seq).map(|s| s.phase) {
            None => Err(TableError::Unknown(seq)),
            Some(RefPhase::Preempted) => Err(TableError::Preempted(seq, PreemptMode::Swap)),
            Some(RefPhase::Growing | RefPhase::Restoring) => Err(TableError::Busy(seq)),
            Some(_) => Ok(()),
        }
    }

    fn apply(&mut self, op: &Op) -> Answer {
        match op {
            Op::Open(seq, p) => {
                if self.seqs.contains_key(seq) || self.opening.contains_key(seq) {
                    return Answer::Refused(TableError::AlreadyOpen(*seq));
                }
                self.next += 1;
                let inc = self.next;
                let prompt = prompt(*p);
                let (mut hits, mut claimed) = (0, Vec::new());
                for i in 0..prompt.len() / BT {
                    let prefix = prompt[..(i + 1) * BT].to_vec();
                    match self.blocks.get(&prefix) {
                        Some(RefBlock::Complete) if claimed.is_empty() => hits += 1,
                        Some(_) => break,
                        None => {
                            self.blocks.insert(prefix.clone(), RefBlock::Claimed(inc));
                            claimed.push(prefix);
                        }
                    }
                }
                let answer = Answer::Opened {
                    hits,
                    claimed: claimed.len(),
                };
                self.opening.insert(*seq, (inc, hits, claimed));
                answer
            }
            Op::OpenDone(seq, ok) => {
                let Some((inc, hits, claimed)) = self.opening.remove(seq) else {
                    return Answer::Nothing;
                };
                if !ok {
                    self.forget_writer(inc);
                    return Answer::Done;
                }
                let mut filling = Vec::new();
                for (i, prefix) in claimed.into_iter().enumerate() {
                    self.blocks.insert(prefix.clone(), RefBlock::Filling(inc));
                    filling.push((prefix, (hits + i + 1) * BT));
                }
                self.admissions += 1;
                self.seqs.insert(
                    *seq,
                    RefSeq {
                        incarnation: inc,
                        admitted: self.admissions,
                        phase: RefPhase::Idle,
                        tokens: hits * BT,
                        filling,
                    },
                );
                Answer::Done
            }
            Op::Prepare(batch) => {
                let mut seen = Vec::new();
                for s in batch {
                    if seen.contains(s) {
                        return Answer::Refused(TableError::Duplicate(*s));
                    }
                    seen.push(*s);
                }
                for s in batch {
                    if let Err(e) = self.usable(*s) {
                        return Answer::Refused(e);
                    }
                    if self.seqs[s].phase == RefPhase::Stepping {
                        // One step at a time: its memory is with the step.
                        return Answer::Refused(TableError::Busy(*s));
                    }
                }
                let b = batch
                    .iter()
                    .map(|s| {
                        let r = self.seqs.get_mut(s).expect("usable");
                        r.phase = RefPhase::Growing;
                        (*s, r.incarnation)
                    })
                    .collect();
                self.prepares.push_back(b);
                Answer::Done
            }
            Op::PrepareDone(ok) => match self.prepares.pop_front() {
                None => Answer::Nothing,
                Some(b) => {
                    // Granted, a sequence with its memory (idle or growing) steps; refused,
                    // one still growing is idle again.
                    for (s, inc) in b {
                        let Some(r) = self.seqs.get_mut(&s).filter(|r| r.incarnation == inc) else {
                            continue;
                        };
                        r.phase = match (r.phase, *ok) {
                            (RefPhase::Idle | RefPhase::Growing, true) => RefPhase::Stepping,
                            (RefPhase::Growing, false) => RefPhase::Idle,
                            (phase, _) => phase,
                        };
                    }
                    Answer::Done
                }
            },
            Op::Step(seq) => {
                if let Err(e) = self.usable(*seq) {
                    return Answer::Refused(e);
                }
                let r = self.seqs.get_mut(seq).expect("usable");
                if r.phase != RefPhase::Stepping {
                    return Answer::Refused(TableError::NotInStep(*seq));
                }
                r.tokens += 1;
                r.phase = RefPhase::Idle;
                let tokens = r.tokens;
                let inc = r.incarnation;
                let (done, left): (Vec<_>, Vec<_>) = std::mem::take(&mut r.filling)
                    .into_iter()
                    .partition(|(_, end)| *end <= tokens);
                r.filling = left;
                let mut completed = 0;
                for (prefix, _) in done {
                    if self.blocks.get(&prefix) == Some(&RefBlock::Filling(inc)) {
                        self.blocks.insert(prefix, RefBlock::Complete);
                        completed += 1;
                    }
                }
                Answer::Completed(completed)
            }
            Op::Pressure(seq) => match self.seqs.get(seq).map(|r| (r.phase, r.admitted)) {
                Some((phase, admitted)) if self.may_take(phase, admitted) => {
                    let r = self.seqs.get_mut(seq).expect("present");
                    r.phase = RefPhase::Preempted;
                    r.filling.clear();
                    let inc = r.incarnation;
                    self.forget_writer(inc);
                    Answer::Evicted(true)
                }
                _ => Answer::Evicted(false),
            },
            Op::Restore(seq) => match self.seqs.get_mut(seq) {
                None => Answer::Refused(TableError::Unknown(*seq)),
                Some(r) => match r.phase {
                    RefPhase::Growing | RefPhase::Restoring => {
                        Answer::Refused(TableError::Busy(*seq))
                    }
                    RefPhase::Preempted => {
                        r.phase = RefPhase::Restoring;
                        self.restores.insert(*seq, r.incarnation);
                        Answer::Restoring(true)
                    }
                    RefPhase::Idle | RefPhase::Stepping => Answer::Restoring(false),
                },
            },
            Op::RestoreDone(seq, ok) => match self.restores.remove(seq) {
                None => Answer::Nothing,
                Some(inc) => {
                    if let Some(r) = self
                        .seqs
                        .get_mut(seq)
                        .filter(|r| r.incarnation == inc && r.phase == RefPhase::Restoring)
                    {
                        r.phase = if *ok {
                            RefPhase::Idle
                        } else {
                            RefPhase::Preempted
                        };
                    }
                    Answer::Done
                }
            },
            Op::Close(seq) => {
                if let Some((inc, ..)) = self.opening.remove(seq) {
                    self.forget_writer(inc);
                }
                if let Some(r) = self.seqs.remove(seq) {
                    self.forget_writer(r.incarnation);
                }
                Answer::Done
            }
        }
    }
}

fn phase_of(p: &SeqState<()>) -> RefPhase {
    match p {
        SeqState::Idle(_) => RefPhase::Idle,
        SeqState::Growing(_) => RefPhase::Growing,
        SeqState::Stepping(_) => RefPhase::Stepping,
        SeqState::Preempted { .. } => RefPhase::Preempted,
        SeqState::Restoring { .. } => RefPhase::Restoring,
    }
}

/// Both agree on every sequence and every block; the invariants hold.
fn check(store: &Store, reference: &Reference) -> Result<(), TestCaseError> {
    // Sequences: the same ids, phases and token counts.
    let ids: Vec<SeqId> = {
        let mut v: Vec<_> = store.table.iter().map(|(s, _)| s).collect();
        v.sort_unstable();
        v
    };
    prop_assert_eq!(&ids, &reference.seqs.keys().copied().collect::<Vec<_>>());
    for (seq, r) in &reference.seqs {
        let rec = store.table.get(*seq).expect("same ids");
        prop_assert_eq!(phase_of(rec.state()), r.phase, "seq {}", seq);
        if r.phase != RefPhase::Preempted && r.phase != RefPhase::Restoring {
            prop_assert_eq!(store.tokens.get(seq).copied().unwrap_or(0), r.tokens);
        }
        prop_assert_eq!(rec.filling.len(), r.filling.len(), "seq {}", seq);
        // Never a victim while a step or a restore uses it; one waiting for its grant only
        // when an older one waits too.
        let evictable = reference.may_take(r.phase, r.admitted);
        prop_assert_eq!(store.table.evictable(*seq), evictable, "seq {}", seq);
    }
    // Blocks: the same number in each state.
    let count =
        |f: &dyn Fn(BlockState) -> bool| store.cache.states().filter(|(_, s)| f(*s)).count();
    let rcount = |f: &dyn Fn(&RefBlock) -> bool| reference.blocks.values().filter(|b| f(b)).count();
    prop_assert_eq!(store.cache.len(), reference.blocks.len());
    prop_assert_eq!(
        count(&|s| s == BlockState::Complete),
        rcount(&|b| *b == RefBlock::Complete)
    );
    prop_assert_eq!(
        count(&|s| matches!(s, BlockState::Filling { .. })),
        rcount(&|b| matches!(b, RefBlock::Filling(_)))
    );
    // Every block being written belongs to exactly one live writer that lists it, and every
    // block a live sequence lists is being written by it (not cached, not someone else's).
    let live: HashMap<Incarnation, SeqId> =
        store.table.iter().map(|(s, r)| (r.writer, s)).collect();
    let opening: HashMap<Incarnation, SeqId> =
        store.opening.iter().map(|(s, (w, ..))| (*w, *s)).collect();
    for (key, state) in store.cache.states() {
        match state {
            BlockState::Filling { writer } => {
                let seq = live.get(&writer);
                prop_assert!(seq.is_some(), "block {:x} filled by a dead writer", key);
                let rec = store.table.get(*seq.unwrap()).unwrap();
                prop_assert!(rec.filling.iter().any(|f| f.key == key));
                let taken = rec.state().preempted().is_some() || rec.state().is_restoring();
                prop_assert!(!taken, "a preempted sequence writes no block");
            }
            BlockState::Claimed { writer } => {
                prop_assert!(
                    opening.contains_key(&writer),
                    "claim of a writer not opening"
                );
            }
            BlockState::Complete => {}
        }
    }
    for (_, rec) in store.table.iter() {
        for f in &rec.filling {
            prop_assert_eq!(
                store.cache.state(f.key),
                Some(BlockState::Filling { writer: rec.writer })
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 5_000, ..ProptestConfig::default() })]

    #[test]
    fn the_policy_agrees_with_the_reference_and_keeps_its_invariants(
        ops in prop::collection::vec(op(), 1..80)
    ) {
        let mut store = Store::new();
        let mut reference = Reference::default();
        for op in &ops {
            let got = store.apply(op);
            let want = reference.apply(op);
            prop_assert_eq!(&got, &want, "{:?}", op);
            check(&store, &reference)?;
        }
    }
}

/// Scripted cases the random search must not depend on finding: work for a closed
/// incarnation, and a block claimed by a pending open.
#[test]
fn scripted_cases_agree_with_the_reference() {
    let scripts = [
        // A prepare's grant that lands after close and re-open finds the new incarnation.
        vec![
            Op::Open(0, 0),
            Op::OpenDone(0, true),
            Op::Prepare(vec![0]),
            Op::Close(0),
            Op::Open(0, 2),
            Op::OpenDone(0, true),
            Op::PrepareDone(true),
            Op::Step(0),
        ],
        // Two opens of one prompt while the first is pending: the second shares nothing.
        vec![
            Op::Open(0, 0),
            Op::Open(1, 0),
            Op::OpenDone(1, true),
            Op::OpenDone(0, true),
            Op::Prepare(vec![0, 1]),
            Op::PrepareDone(true),
            Op::Step(0),
            Op::Step(1),
            Op::Open(2, 0),
        ],
        // A restore on its way when the sequence is closed and opened again.
        vec![
            Op::Open(3, 1),
            Op::OpenDone(3, true),
            Op::Pressure(3),
            Op::Restore(3),
            Op::Close(3),
            Op::Open(3, 1),
            Op::OpenDone(3, true),
            Op::RestoreDone(3, true),
            Op::Prepare(vec![3, 3]),
        ],
    ];
    for script in scripts {
        let mut store = Store::new();
        let mut reference = Reference::default();
        for op in &script {
            assert_eq!(store.apply(op), reference.apply(op), "{op:?} in {script:?}");
            check(&store, &reference).unwrap();
        }
    }
}
