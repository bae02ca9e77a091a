//! The table's transitions as the store's other parts ask for them: a step's, a restore's,
//! pressure's. [`Sequences`] is the only code that reaches the [`SequenceTable`]; what the
//! others need of a sequence is here, by name.

use procmem::fence::Fence;
use procmem::kv::{Incarnation, KvError, PreemptMode, SeqId, Sequence, TableError, Writer};
use procmem::ledger::Priority;

use super::{Resident, Sequences, StoreSeq};
use crate::kv_store::step::NewTokens;
use crate::kv_store::transactions::Growth;
use crate::kv_store::KvStoreError;

/// A step's growth, planned: each sequence with its incarnation, the growth its new tokens
/// need and how many they are, the bytes of all of it, and the most important sequence's
/// priority (the grant's).
pub(in crate::kv_store) struct StepPlan {
    pub(in crate::kv_store) growth: Vec<Growth>,
    pub(in crate::kv_store) bytes: u64,
    pub(in crate::kv_store) priority: Priority,
}

impl Sequences {
    /// Plans a step of `seqs`: every sequence open, idle and named once (the table's
    /// `begin_step`), each with room in its shape for its new tokens (at least one). Growth
    /// mapped ahead while the last step ran is published first: what it covers needs no grant
    /// and no mapping now, and stays published where the plan is then refused (it was mapped
    /// and paid for already). Otherwise a refusal changes nothing.
    pub(in crate::kv_store) fn plan_step(
        &mut self,
        seqs: &[NewTokens],
    ) -> Result<StepPlan, KvStoreError> {
        if let Some(empty) = seqs.iter().find(|r| r.count == 0) {
            return Err(KvStoreError::NoTokens(empty.seq));
        }
        let ids: Vec<SeqId> = seqs.iter().map(|r| r.seq).collect();
        let batch = self.table.begin_step(&ids)?;
        for w in &batch {
            if let Some(r) = self.resident_mut(w.seq) {
                if let Some(growth) = r.ahead.take() {
                    r.memory.publish(growth);
                }
            }
        }
        let mut plan = StepPlan {
            growth: Vec::with_capacity(batch.len()),
            bytes: 0,
            priority: 0,
        };
        for (&Writer { seq, writer }, rows) in batch.iter().zip(seqs) {
            let memory = self
                .memory(seq)
                .ok_or(KvStoreError::Table(TableError::Unknown(seq)))?;
            let max = memory.shape().max_tokens;
            if memory
                .tokens()
                .checked_add(rows.count)
                .is_none_or(|end| end > max)
            {
                return Err(KvError::Full(max).into());
            }
            let size = memory.growth_for(rows.count);
            plan.bytes = plan.bytes.saturating_add(size.bytes());
            plan.priority = plan.priority.max(self.priority_of(seq));
            plan.growth.push(Growth {
                seq,
                writer,
                size,
                tokens: rows.count,
            });
        }
        Ok(plan)
    }

    /// The step's idle sequences wait for their grant.
    pub(in crate::kv_store) fn growing(&mut self, batch: &[Writer]) {
        self.table.growing(batch);
    }

    /// The step's grant or growth failed, or its caller left: its sequences still waiting are
    /// idle again.
    pub(in crate::kv_store) fn end_growth(&mut self, batch: &[Writer]) {
        self.table.end_growth(batch);
    }

    /// The first sequence of `batch` pressure took while the step waited for its grant.
    pub(in crate::kv_store) fn preempted_in(
        &self,
        batch: &[Writer],
    ) -> Option<(SeqId, PreemptMode)> {
        self.table.preempted_in(batch)
    }

    /// The step of `seq` as `writer` ended with its memory back holding `tokens`: the prefix
    /// blocks it has now written whole, or why not with the memory to free.
    // The memory comes back in the error to be freed after its fences; boxing it would
    // allocate at every step's end, refused or not.
    #[allow(clippy::result_large_err)]
    pub(in crate::kv_store) fn end_step(
        &mut self,
        seq: SeqId,
        writer: Incarnation,
        tokens: usize,
        resident: Resident,
    ) -> Result<Vec<u64>, (TableError, Resident)> {
        self.table.end_step(seq, writer, tokens, resident)
    }

    /// How much `seq` matters (0 if it is not open).
    pub(in crate::kv_store) fn priority_of(&self, seq: SeqId) -> Priority {
        self.table.get(seq).map_or(0, |r| r.priority)
    }

    /// Whether `seq` is open and idle (no step, no grant on its way).
    pub(in crate::kv_store) fn is_idle(&self, seq: SeqId) -> bool {
        self.table.get(seq).is_some_and(|r| r.state().is_idle())
    }

    /// Whether `seq` is open and waiting for its step's grant.
    pub(in crate::kv_store) fn is_growing(&self, seq: SeqId) -> bool {
        self.table.get(seq).is_some_and(|r| r.state().is_growing())
    }

    /// A step takes the memory of `seq` as `writer` (growing, or idle where no grant was
    /// needed): it is stepping, holding what the memory held; `None` where it is gone.
    pub(in crate::kv_store) fn lend(
        &mut self,
        seq: SeqId,
        writer: Incarnation,
    ) -> Option<Resident> {
        self.table.lend(seq, writer, Resident::lent)
    }

    /// Whether `seq` is open as `writer` and restoring.
    pub(in crate::kv_store) fn is_restoring(&self, seq: SeqId, writer: Incarnation) -> bool {
        self.table
            .get(seq)
            .is_some_and(|r| r.writer == writer && r.state().is_restoring())
    }

    /// The fence of the copy out of preempted `seq`, where it has one.
    pub(in crate::kv_store) fn copy_out_fence(&self, seq: SeqId) -> Option<Fence> {
        self.table
            .get(seq)
            .and_then(|s| s.to_restore()?.saved.as_ref()?.fence)
    }

    /// Starts restoring `seq`; `None` where it was not preempted.
    pub(in crate::kv_store) fn begin_restore(
        &mut self,
        seq: SeqId,
    ) -> Result<Option<procmem::kv::RestoreStart>, TableError> {
        self.table.begin_restore(seq)
    }

    /// The memory `seq` as `writer` comes back into, or it back where that restore is gone.
    #[allow(clippy::result_large_err)] // As `end_step`: the memory back, to free.
    pub(in crate::kv_store) fn restoring_into(
        &mut self,
        seq: SeqId,
        writer: Incarnation,
        memory: Resident,
    ) -> Result<(), Resident> {
        self.table.restoring_into(seq, writer, memory)
    }

    /// The restore of `seq` as `writer` ended, `restored` or not.
    pub(in crate::kv_store) fn end_restore(
        &mut self,
        seq: SeqId,
        writer: Incarnation,
        restored: bool,
    ) -> Result<Option<Resident>, TableError> {
        self.table.end_restore(seq, writer, restored)
    }

    /// Whether pressure may take `seq` now.
    pub(in crate::kv_store) fn evictable(&self, seq: SeqId) -> bool {
        self.table.evictable(seq)
    }

    /// Pressure takes `seq` holding `tokens`: its incarnation and memory, or `None` where it
    /// may not go.
    pub(in crate::kv_store) fn preempt(
        &mut self,
        seq: SeqId,
        mode: PreemptMode,
        tokens: usize,
    ) -> Option<(Incarnation, Resident)> {
        self.table.preempt(seq, mode, tokens)
    }

    /// `seq` loses its memory to be recomputed (a copy in that fell short).
    pub(in crate::kv_store) fn lose(
        &mut self,
        seq: SeqId,
        tokens: usize,
    ) -> Option<(Incarnation, Resident)> {
        self.table.lose(seq, tokens)
    }

    /// A fresh incarnation (a closed sequence's blocks kept under it).
    pub(in crate::kv_store) fn new_writer(&mut self) -> Incarnation {
        self.table.new_writer()
    }

    /// Every open sequence.
    pub(in crate::kv_store) fn iter(
        &self,
    ) -> impl Iterator<Item = (SeqId, &Sequence<StoreSeq>)> + '_ {
        self.table.iter()
    }

    /// The memory of every sequence that has it in place, to change.
    pub(in crate::kv_store) fn residents_mut(
        &mut self,
    ) -> impl Iterator<Item = &mut Resident> + '_ {
        self.table.iter_mut().filter_map(|(_, s)| s.resident_mut())
    }
}
