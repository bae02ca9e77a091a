//! A request's steps in the store: open (prefix lookup, shared blocks), prepare (one grant
//! for the step, map, commit, publish, then lend the memory as a step: `lending`) and restore
//! (bring a preempted sequence back).

use std::sync::Arc;

use procmem::kv::{Incarnation, KvError, PendingGrowth};
use procmem::ledger::Priority;
use procmem::{MapAccess, PhysicalBlock, SharedMapping};
use ractor::{ActorRef, RpcReplyPort};

use super::answer::{Left, OpenAnswer, Opened};
use super::metrics;
use super::prefix::{Mapped, SharedPrefix};
use super::sequences::Resident;
use super::step::KvStep;
use super::tier::Incoming;
use super::transactions::{batch_of, Pending};
use super::{KvStoreError, KvStoreMsg, KvStoreState, SeqId};
use crate::charge::Charge;
use crate::governor::Grant;

impl KvStoreState {
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
        let entry = Resident::new(memory, Charge::counted(&self.tally));
        let bytes = new_keys.len() as u64 * shape.buffers() as u64 * shape.block_bytes(g);
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
            entry: Box::new(entry),
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
            mut entry,
            hits,
            new_keys,
            from_disk,
            bytes,
            reply,
        } = pending
        else {
            return;
        };
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
            .and_then(|fresh| self.attach_prefixes(&mut entry, hits, fresh, hit_count + from_disk));
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
            .end_open(seq, writer, priority, filling, *entry);
        if let Err(entry) = opened {
            // Closed while it was being opened.
            self.prefixes.abandon(writer);
            self.retire(entry);
            let _ = reply.send(Err(KvStoreError::Unknown(seq)));
            return;
        }
        self.start_copy_in(myself, seq, (writer, from_disk), incoming);
        self.answer_open(myself, seq, writer, cached * bt, reply);
    }

    /// Puts the fresh blocks in the cache under the keys `writer` claimed: the first
    /// `from_disk` come from the disk (returned for the copy in, complete once it is seen to
    /// have filled them: `copy_in.rs`), the rest the sequence writes (returned with the token
    /// count, past the `hits` blocks found, that completes each).
    #[allow(clippy::type_complexity)]
    fn fill_claims(
        &mut self,
        writer: Incarnation,
        keys: &[u64],
        fresh: Vec<Arc<SharedPrefix>>,
        (hits, from_disk): (usize, usize),
    ) -> (Vec<(u64, usize)>, Vec<Incoming>) {
        let bt = self.config.shape.block_tokens(self.device.granularity());
        let mut filling = Vec::with_capacity(fresh.len());
        let mut incoming = Vec::with_capacity(from_disk);
        for (i, (key, prefix)) in keys.iter().zip(fresh).enumerate() {
            // Claimed at open by this writer, and only it fills a claim.
            if self
                .prefixes
                .fill(*key, writer, Arc::clone(&prefix))
                .is_err()
            {
                continue;
            }
            let prompt = self.prefixes.prompt_of(*key);
            match prompt.filter(|_| i < from_disk && incoming.len() == i) {
                Some((parent, tokens)) => incoming.push((*key, (parent, tokens.to_vec()), prefix)),
                None => filling.push((*key, (hits + i + 1) * bt)),
            }
        }
        (filling, incoming)
    }

    /// Counts the prompt's blocks with the disk tier's filter, and says how many of the
    /// claimed blocks, from the first, it holds (none without a tier).
    fn ask_tier(&mut self, hits: &[(u64, Mapped)], claimed: &[u64]) -> usize {
        let Some(tier) = self.tier.as_mut() else {
            return 0;
        };
        for key in hits.iter().map(|(k, _)| *k).chain(claimed.iter().copied()) {
            tier.record(key);
        }
        tier.leading(claimed)
    }

    /// Makes `count` new shared prompt blocks, each paid for by its part of `charge` (the
    /// open committed exactly one block's bytes per new key). On failure the blocks made so
    /// far (never written, so never resident) are dropped and their charges released as they
    /// go; what was not used stays in `charge`.
    pub(super) fn make_blocks(
        &self,
        count: usize,
        charge: &mut Charge,
    ) -> Result<Vec<Arc<SharedPrefix>>, KvStoreError> {
        let shape = self.config.shape;
        let g = self.device.granularity();
        let mapping: &dyn SharedMapping = self.device.shared.as_ref();
        let block_bytes = shape.buffers() as u64 * shape.block_bytes(g);
        let mut fresh = Vec::with_capacity(count);
        for _ in 0..count {
            let charge = charge.split(block_bytes).unwrap_or_default();
            let block =
                SharedPrefix::create(mapping, shape.buffers(), shape.block_bytes(g), charge)?;
            fresh.push(Arc::new(block));
        }
        Ok(fresh)
    }

    /// Maps the cached blocks found (read-only) and the fresh ones this sequence writes
    /// (read-write) at the start of its memory. Returns every block it maps, and the fresh.
    #[allow(clippy::type_complexity)]
    fn attach_prefixes(
        &self,
        entry: &mut Resident,
        hits: Vec<(u64, Mapped)>,
        fresh: Vec<Arc<SharedPrefix>>,
        cached: usize,
    ) -> Result<(Vec<Mapped>, Vec<Arc<SharedPrefix>>), KvStoreError> {
        let bt = self.config.shape.block_tokens(self.device.granularity());
        let hit_count = hits.len();
        let mut used: Vec<Mapped> = Vec::with_capacity(hit_count + fresh.len());
        used.extend(hits.into_iter().map(|(_, prefix)| prefix));
        let access: Vec<MapAccess> = std::iter::repeat_n(MapAccess::ReadOnly, used.len())
            .chain(std::iter::repeat_n(MapAccess::ReadWrite, fresh.len()))
            .collect();
        used.extend(fresh.iter().cloned().map(Mapped::new));
        if !used.is_empty() {
            let blocks: Vec<PhysicalBlock> =
                used.iter().flat_map(|p| p.blocks.iter().cloned()).collect();
            let mapping: &dyn SharedMapping = self.device.shared.as_ref();
            entry
                .memory
                .attach_prefix(mapping, &blocks, &access, cached * bt)?;
        }
        Ok((used, fresh))
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

    /// A caller left while its call waited for room: the wait is called off and the call
    /// fails unread, leaving the sequences as they were (a call already answered is undone
    /// by its answer instead: an `OpenAnswer`, a `KvStep`).
    pub(super) fn call_off(&mut self, call: Left) {
        let called = self.transactions.call_off(|p| match (p, &call) {
            (Pending::Open { seq, .. }, Left::Open(s))
            | (Pending::Restore { seq, .. }, Left::Restore(s)) => seq == s,
            (Pending::Prepare { seqs, .. }, Left::Step(s)) => seqs.iter().any(|(a, ..)| a == s),
            _ => false,
        });
        if let Some(pending) = called {
            self.fail(pending, KvStoreError::Unavailable);
        }
    }

    pub(super) fn prepare(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        seqs: Vec<(SeqId, usize)>,
        reply: RpcReplyPort<Result<KvStep, KvStoreError>>,
    ) {
        if let Some(&(seq, _)) = seqs.iter().find(|(_, n)| *n == 0) {
            let _ = reply.send(Err(KvStoreError::NoTokens(seq)));
            return;
        }
        let ids: Vec<SeqId> = seqs.iter().map(|(s, _)| *s).collect();
        let batch = match self.sequences.table.begin_step(&ids) {
            Ok(b) => b,
            Err(e) => {
                let _ = reply.send(Err(e.into()));
                return;
            }
        };
        // Growth mapped ahead while the last step ran is published first: what it covers
        // needs no grant and no mapping now.
        for (seq, _) in &batch {
            if let Some(r) = self.sequences.resident_mut(*seq) {
                if let Some(growth) = r.ahead.take() {
                    r.memory.publish(growth);
                }
            }
        }
        let mut plan = Vec::with_capacity(batch.len());
        let mut bytes = 0u64;
        let mut priority = 0;
        for ((seq, writer), &(_, count)) in batch.iter().zip(&seqs) {
            let Some(memory) = self.sequences.memory(*seq) else {
                let _ = reply.send(Err(KvStoreError::Unknown(*seq)));
                return;
            };
            let max = memory.shape().max_tokens;
            if memory
                .tokens()
                .checked_add(count)
                .is_none_or(|end| end > max)
            {
                let _ = reply.send(Err(KvError::Full(max).into()));
                return;
            }
            let per = memory.growth_for(count);
            bytes = bytes.saturating_add(per.saturating_mul(memory.shape().buffers() as u64));
            priority = priority.max(self.sequences.table.get(*seq).map_or(0, |r| r.priority));
            plan.push((*seq, *writer, per, count));
        }
        if bytes == 0 {
            self.lend(myself, &plan, reply);
            return;
        }
        self.sequences.table.growing(&batch);
        self.begin(
            myself,
            bytes,
            priority,
            Pending::Prepare { seqs: plan, reply },
        );
    }

    /// The grow transaction: map every sequence's growth (undoing all on any failure),
    /// commit the one charge, then publish.
    pub(super) async fn finish_prepare(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        pending: Pending,
        grant: Grant,
    ) {
        let Pending::Prepare { seqs, reply } = pending else {
            return;
        };
        let batch = batch_of(&seqs);
        // Pressure may take a newer sequence while the step waits for its grant (when every
        // holder waits for a grant, someone must give way): the step fails as a whole, its
        // grant goes back, and the caller steps the others and restores that one later.
        if let Some((taken, mode)) = self.sequences.table.preempted_in(&batch) {
            drop(grant);
            self.sequences.table.end_growth(&batch);
            let _ = reply.send(Err(KvStoreError::Preempted(taken, mode)));
            return;
        }
        let (mapped, mut failure) = self.map_batch(&seqs);
        let actual: u64 = mapped.iter().map(|(_, g)| g.bytes()).sum();
        let mut committed = Charge::counted(&self.tally);
        if failure.is_none() && actual > 0 {
            if let Err(e) = procmem::fault::hit("kv.grow.commit") {
                failure = Some(e.into());
                drop(grant);
            } else {
                match grant.commit(actual).await {
                    Ok(lease) => committed.add(lease),
                    Err(refused) => failure = Some(refused.error.into()),
                }
            }
        } else {
            drop(grant);
        }
        if failure.is_none() {
            if let Err(e) = procmem::fault::hit("kv.grow.publish") {
                failure = Some(e.into());
            }
        }
        self.settle_growth(mapped, &mut committed, failure.is_some());
        // On failure everything was unmapped above; only now does the charge go back.
        drop(committed);
        match failure {
            Some(e) => {
                self.sequences.table.end_growth(&batch);
                let _ = reply.send(Err(e));
            }
            None => self.lend(myself, &seqs, reply),
        }
    }

    /// Maps each sequence's growth (those still this incarnation), stopping at the first
    /// failure. Returns what was mapped and the failure, if any.
    #[allow(clippy::type_complexity)]
    fn map_batch(
        &mut self,
        seqs: &[(SeqId, Incarnation, u64, usize)],
    ) -> (Vec<(SeqId, PendingGrowth)>, Option<KvStoreError>) {
        let mut mapped: Vec<(SeqId, PendingGrowth)> = Vec::new();
        for (seq, writer, per, _) in seqs {
            // A sequence closed (and maybe opened again) since the prepare is not this one.
            if !self.sequences.is(*seq, *writer) {
                continue;
            }
            let Some(memory) = self.sequences.resident_mut(*seq).map(|r| &mut r.memory) else {
                continue;
            };
            if *per == 0 {
                continue;
            }
            match metrics::timed(&self.metrics.growth_map, || memory.map_growth(*per)) {
                Ok(g) => mapped.push((*seq, g)),
                Err(e) => return (mapped, Some(e.into())),
            }
        }
        (mapped, None)
    }

    /// Publishes each sequence's growth with the part of `committed` that pays for it, or,
    /// if the step `failed`, unmaps it (what stays mapped stays paid for by its sequence).
    fn settle_growth(
        &mut self,
        mapped: Vec<(SeqId, PendingGrowth)>,
        committed: &mut Charge,
        failed: bool,
    ) {
        for (seq, growth) in mapped {
            let Some(Resident { memory, charge, .. }) = self.sequences.resident_mut(seq) else {
                continue;
            };
            if failed {
                let bytes = growth.bytes();
                if memory.abandon(growth).is_err() {
                    // Not unmapped: the memory stays with the sequence, and so does what
                    // pays for it (if the commit went through), until the sequence goes.
                    if let Some(part) = committed.split(bytes) {
                        charge.absorb(part);
                    }
                }
            } else {
                // Each sequence keeps the part of the step's lease that pays for its growth.
                if let Some(part) = committed.split(growth.bytes()) {
                    charge.absorb(part);
                }
                memory.publish(growth);
            }
        }
    }
}
