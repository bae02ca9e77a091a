//! A request's steps in the store: open (prefix lookup, shared blocks), prepare (one grant
//! for the step, map, commit, publish, then lend the memory as a step: `lending`) and restore
//! (bring a preempted sequence back).

use super::*;

impl KvStoreState {
    pub(super) async fn open(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        seq: SeqId,
        prompt: Vec<u32>,
        priority: Priority,
        reply: RpcReplyPort<Result<answer::OpenAnswer, KvStoreError>>,
    ) {
        let shape = self.config.shape;
        let g = self.device.granularity();
        let bt = shape.block_tokens(g);
        // A refused id reserves nothing.
        let writer = match self.table.begin_open(seq) {
            Ok(w) => w,
            Err(e) => {
                let _ = reply.send(Err(e.into()));
                return;
            }
        };
        let memory = match self.reserve_memory() {
            Ok(s) => s,
            Err(e) => {
                self.table.end_open(seq, writer, 0, None);
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
        let entry = SeqEntry {
            memory: Some(memory),
            saved: None,
            charge: Charge::counted(&self.tally),
            prefixes: Vec::new(),
            last_fence: None,
            away: None,
            ahead: None,
        };
        let bytes = new_keys.len() as u64 * shape.buffers() as u64 * shape.block_bytes(g);
        let mut hits = lookup.hits;
        // The position rule (see `Opened`): a prompt's last token is always computed, so a
        // prompt whose every block is cached shares all but its last block.
        if !prompt.is_empty() && hits.len() * bt >= prompt.len() {
            hits.pop();
        }
        let pending = Pending::Open {
            seq,
            writer,
            priority,
            entry: Box::new(entry),
            hits,
            new_keys,
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
            bytes,
            reply,
        } = pending
        else {
            return;
        };
        let shape = self.config.shape;
        let g = self.device.granularity();
        let bt = shape.block_tokens(g);
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
        let mapping: &dyn SharedMapping = self.device.shared.as_ref();
        let block_bytes = shape.buffers() as u64 * shape.block_bytes(g);
        let mut fresh = Vec::with_capacity(new_keys.len());
        for _ in &new_keys {
            let blocks: Result<Vec<_>, _> = (0..shape.buffers())
                .map(|_| mapping.create_block(shape.block_bytes(g)))
                .collect();
            match blocks {
                Ok(blocks) => fresh.push(Arc::new(SharedPrefix {
                    blocks,
                    bytes: block_bytes,
                    // The open committed exactly one block's bytes per new key.
                    _charge: charge.split(block_bytes).unwrap_or_default(),
                })),
                Err(e) => {
                    // The blocks made so far are dropped and their charges released as they
                    // go; what was not used yet goes back with `charge`.
                    drop(fresh);
                    self.forget_open(seq, writer);
                    let _ = reply.send(Err(e.into()));
                    return;
                }
            }
        }
        drop(charge);
        let hit_count = hits.len();
        let mut used: Vec<Arc<SharedPrefix>> = Vec::with_capacity(hit_count + fresh.len());
        for (_, prefix) in hits {
            used.push(prefix);
        }
        let access: Vec<MapAccess> = std::iter::repeat_n(MapAccess::ReadOnly, used.len())
            .chain(std::iter::repeat_n(MapAccess::ReadWrite, fresh.len()))
            .collect();
        used.extend(fresh.iter().cloned());
        if !used.is_empty() {
            let blocks: Vec<PhysicalBlock> =
                used.iter().flat_map(|p| p.blocks.iter().cloned()).collect();
            let Some(memory) = entry.memory.as_mut() else {
                unreachable!("a sequence being opened has its memory")
            };
            let attached = memory.attach_prefix(mapping, &blocks, &access, hit_count * bt);
            if let Err(e) = attached {
                drop(blocks);
                drop(used);
                drop(fresh);
                self.forget_open(seq, writer);
                let _ = reply.send(Err(e.into()));
                return;
            }
        }
        let mut filling = Vec::with_capacity(fresh.len());
        for (i, (key, prefix)) in new_keys.iter().zip(&fresh).enumerate() {
            // Claimed at open by this writer, and only it fills a claim.
            if self.prefixes.fill(*key, writer, Arc::clone(prefix)).is_ok() {
                filling.push((*key, (hit_count + i + 1) * bt));
            }
        }
        entry.prefixes = used;
        if !self.table.end_open(seq, writer, priority, Some(filling)) {
            // Closed while it was being opened.
            self.prefixes.abandon(writer);
            self.retire(*entry);
            let _ = reply.send(Err(KvStoreError::Unknown(seq)));
            return;
        }
        self.seqs.insert(seq, *entry);
        let cached = hit_count * bt;
        let opened = Opened {
            cached_tokens: cached,
        };
        // An answer its caller never reads closes the sequence (`Abandon`); one whose caller
        // is gone already closes it here and now.
        let answer = answer::OpenAnswer::new(opened, myself.clone(), seq, writer);
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
    pub(super) fn abandon(&mut self, seq: SeqId, writer: Writer) {
        if self.table.get(seq).is_some_and(|r| r.writer == writer) {
            self.close(seq);
        }
    }

    /// A caller left while its call waited for room: the wait is called off and the call
    /// fails unread, leaving the sequences as they were (a call already answered is undone
    /// by its answer instead: an `OpenAnswer`, a `KvStep`).
    pub(super) fn call_off(&mut self, call: answer::Left) {
        let txn = self.pending.iter().find_map(|(txn, p)| {
            let theirs = match (p, &call) {
                (Pending::Open { seq, .. }, answer::Left::Open(s))
                | (Pending::Restore { seq, .. }, answer::Left::Restore(s)) => seq == s,
                (Pending::Prepare { seqs, .. }, answer::Left::Step(s)) => {
                    seqs.iter().any(|(a, ..)| a == s)
                }
                _ => false,
            };
            theirs.then_some(*txn)
        });
        let Some(txn) = txn else { return };
        if let Some(task) = self.reserving.remove(&txn) {
            task.abort();
        }
        if let Some(pending) = self.pending.remove(&txn) {
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
        let batch = match self.table.begin_step(&ids) {
            Ok(b) => b,
            Err(e) => {
                let _ = reply.send(Err(e.into()));
                return;
            }
        };
        // Growth mapped ahead while the last step ran is published first: what it covers
        // needs no grant and no mapping now.
        for (seq, _) in &batch {
            if let Some(SeqEntry {
                memory: Some(memory),
                ahead,
                ..
            }) = self.seqs.get_mut(seq)
            {
                if let Some(growth) = ahead.take() {
                    memory.publish(growth);
                }
            }
        }
        let mut plan = Vec::with_capacity(batch.len());
        let mut bytes = 0u64;
        let mut priority = 0;
        for ((seq, writer), &(_, count)) in batch.iter().zip(&seqs) {
            let Some(memory) = self.seqs.get(seq).and_then(|e| e.memory.as_ref()) else {
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
            priority = priority.max(self.table.get(*seq).map_or(0, |r| r.priority));
            plan.push((*seq, *writer, per, count));
        }
        if bytes == 0 {
            self.lend(myself, &plan, reply);
            return;
        }
        self.table.growing(&batch);
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
        if let Some((taken, mode)) = self.table.preempted_in(&batch) {
            drop(grant);
            self.table.end_growth(&batch, false);
            let _ = reply.send(Err(KvStoreError::Preempted(taken, mode)));
            return;
        }
        let mut mapped: Vec<(SeqId, PendingGrowth)> = Vec::new();
        let mut failure: Option<KvStoreError> = None;
        for (seq, writer, per, _) in &seqs {
            // A sequence closed (and maybe opened again) since the prepare is not this one.
            if self.table.get(*seq).map(|r| r.writer) != Some(*writer) {
                continue;
            }
            let Some(memory) = self.seqs.get_mut(seq).and_then(|e| e.memory.as_mut()) else {
                continue;
            };
            if *per == 0 {
                continue;
            }
            match metrics::timed(&self.metrics.growth_map, || memory.map_growth(*per)) {
                Ok(g) => mapped.push((*seq, g)),
                Err(e) => {
                    failure = Some(e.into());
                    break;
                }
            }
        }
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
        for (seq, growth) in mapped {
            if let Some(SeqEntry {
                memory: Some(memory),
                charge,
                ..
            }) = self.seqs.get_mut(&seq)
            {
                if failure.is_some() {
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
        // On failure everything was unmapped above; only now does the charge go back.
        drop(committed);
        match failure {
            Some(e) => {
                self.table.end_growth(&batch, false);
                let _ = reply.send(Err(e));
            }
            None => self.lend(myself, &seqs, reply),
        }
    }

    pub(super) fn restore(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        seq: SeqId,
        reply: RpcReplyPort<Result<Restored, KvStoreError>>,
    ) {
        let shape = self.config.shape;
        let copying = self
            .seqs
            .get(&seq)
            .and_then(|e| e.saved.as_ref())
            .and_then(|s| s.fence)
            .filter(|f| self.stream.timeline().completed() < f.value);
        if let Some(fence) = copying {
            // Its copy out is still on the stream: the restore starts once it is done.
            let me = myself.clone();
            self.stream.timeline().on_complete(
                fence.value,
                Box::new(move |_| {
                    let _ = me.cast(KvStoreMsg::Restore { seq, reply });
                }),
            );
            return;
        }
        let (writer, mode, tokens) = match self.table.begin_restore(seq) {
            Err(e) => {
                let _ = reply.send(Err(e.into()));
                return;
            }
            Ok(None) => {
                // Not preempted: nothing to bring back.
                // (A sequence whose step is out holds the tokens it had when lent.)
                let tokens = self.seqs.get(&seq).map_or(0, |e| {
                    e.memory
                        .as_ref()
                        .map_or_else(|| e.away.map_or(0, |a| a.0), KvSequence::tokens)
                });
                let _ = reply.send(Ok(Restored::Swapped { tokens }));
                return;
            }
            Ok(Some(found)) => found,
        };
        let memory = match self.reserve_memory() {
            Ok(m) => m,
            Err(e) => {
                self.table.end_restore(seq, writer, false);
                let _ = reply.send(Err(e.into()));
                return;
            }
        };
        let per_buffer = memory.growth_for(tokens);
        let entry = self
            .seqs
            .get_mut(&seq)
            .expect("a preempted sequence has an entry");
        let saved = match (mode, entry.saved.take()) {
            // (A copy out that failed left nothing to bring back.)
            (PreemptMode::Swap, Some(saved)) if tokens > 0 && saved.copied() => saved,
            _ => {
                // Nothing was kept (or nothing to keep): the sequence starts again, empty.
                entry.memory = Some(memory);
                self.table.end_restore(seq, writer, true);
                self.stats.restores_recomputed += 1;
                self.stats.replayed_tokens += tokens as u64;
                let _ = reply.send(Ok(Restored::Recompute { tokens }));
                return;
            }
        };
        entry.memory = Some(memory);
        let priority = self.table.get(seq).map_or(0, |r| r.priority);
        self.begin(
            myself,
            per_buffer * shape.buffers() as u64,
            priority,
            Pending::Restore {
                seq,
                writer,
                per_buffer,
                tokens,
                saved,
                reply,
            },
        );
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
            .table
            .get(seq)
            .is_some_and(|r| r.writer == writer && matches!(r.phase, Phase::Restoring { .. }));
        let Some(entry) = self.seqs.get_mut(&seq).filter(|_| ours) else {
            let _ = reply.send(Err(KvStoreError::Unknown(seq)));
            return;
        };
        let Some(memory) = entry.memory.as_mut() else {
            // (Not reached: a restoring sequence has the memory reserved for it.) Preempted
            // again, with its saved copy.
            entry.saved = Some(saved);
            self.table.end_restore(seq, writer, false);
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
                self.table.end_restore(seq, writer, true);
                let _ = reply.send(Ok(Restored::Swapped { tokens }));
            }
            Err(e) => {
                // Back to preempted with the saved copy; the partial memory is freed, then
                // what paid for it.
                let entry = self.seqs.get_mut(&seq).expect("present above");
                entry.saved = Some(saved);
                entry.ahead = None;
                let old = entry.memory.take();
                let charge = std::mem::replace(&mut entry.charge, Charge::counted(&self.tally));
                drop(old);
                drop(charge);
                self.table.end_restore(seq, writer, false);
                let _ = reply.send(Err(e));
            }
        }
    }
}
