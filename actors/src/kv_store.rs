//! The KV page store: a holder actor owning every sequence's KV memory.
//!
//! Each sequence has a K and a V buffer per layer, virtually contiguous and backed only as far
//! as tokens exist. A step grows every sequence in the batch under **one** Governor grant
//! (reserve → map → publish → commit), then each layer's attention runs on the CPU stream
//! over the flat buffers. Whole prompt blocks are shared between sequences read-only; under
//! pressure the store gives back whole units: unreferenced cached prefixes first (least
//! recently used), then whole sequences that have no kernel in flight, lowest priority first,
//! swapped to host memory or dropped for recomputation.

use std::collections::HashMap;
use std::sync::Arc;

use procmem::fence::{Fence, TimelineFence};
use procmem::kv::{
    choose_victims, gqa_decode, KvError, KvSequence, KvShape, PendingGrowth, PrefixCandidate,
    SequenceCandidate, Victim,
};
use procmem::ledger::{HolderId, Priority};
use procmem::{HostBacking, MapAccess, MemoryError, MemoryRole, PhysicalBlock, SharedMapping};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::time::{Duration, Instant};

use crate::charge::{Charge, Tally};
use crate::deferred_free::{DeferredRelease, PendingFree};
use crate::governor::{GovernorError, GovernorHandle, Grant, ReserveRequest};
use crate::holder::HolderRef;
use crate::pressure::PressureTicket;
use crate::provider::CpuProvider;
use crate::stream::CpuStream;

/// A sequence's identity, chosen by the caller.
pub type SeqId = u64;

/// What happens to a sequence chosen as a victim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptMode {
    /// Copy its KV to host memory first; restoring copies it back.
    Swap,
    /// Drop its KV; the caller recomputes it by replaying the tokens.
    Recompute,
}

/// How to start a KV store.
#[derive(Debug, Clone)]
pub struct KvStoreConfig {
    /// Name (holder name in diagnoses and metrics).
    pub name: String,
    /// Holder priority: less important holders are asked first under pressure.
    pub priority: Priority,
    /// The model's attention geometry.
    pub shape: KvShape,
    /// Granules mapped per growth: fewer mapping calls, at most one chunk of slack per buffer.
    pub chunk_granules: u64,
    /// What preemption does.
    pub preempt: PreemptMode,
    /// How long a step may wait for room before it is refused.
    pub wait: Duration,
}

/// Why the store refused; the sequence is as it was.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvStoreError {
    /// The KV memory refused.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The Governor did not grant the bytes.
    #[error(transparent)]
    Governor(#[from] GovernorError),
    /// The mechanism failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// No open sequence with that id.
    #[error("sequence {0} is not open")]
    Unknown(SeqId),
    /// The id is already open.
    #[error("sequence {0} is already open")]
    AlreadyOpen(SeqId),
    /// The sequence was preempted; restore it first.
    #[error("sequence {0} was preempted ({1:?}); restore it first")]
    Preempted(SeqId, PreemptMode),
    /// The sequence has a step being prepared.
    #[error("sequence {0} is busy with another step")]
    Busy(SeqId),
    /// The store is not running.
    #[error("the KV store is not running")]
    Unavailable,
    /// Its provider has no stream to run attention on.
    #[error("the KV store's provider refused: {0}")]
    Provider(#[from] crate::provider::ProviderError),
    /// The store's actor could not be started (it panicked while starting).
    #[error("the KV store could not start: {0}")]
    Start(#[source] ractor::SpawnErr),
}

/// What opening a sequence found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    /// Prompt tokens whose KV came from shared cached blocks (no need to compute them).
    pub cached_tokens: usize,
}

/// What restoring a preempted sequence did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restored {
    /// The KV was copied back; the sequence holds `tokens` again.
    Swapped {
        /// Tokens restored.
        tokens: usize,
    },
    /// The sequence is empty again: replay its `tokens` tokens to recompute the KV.
    Recompute {
        /// Tokens to replay.
        tokens: usize,
    },
}

/// One sequence's input to a layer's attention: the query, and the new token's key and value.
#[derive(Debug, Clone)]
pub struct AttendItem {
    /// The sequence.
    pub seq: SeqId,
    /// `q_heads × head_dim` floats.
    pub q: Vec<f32>,
    /// `kv_heads × head_dim` floats.
    pub k: Vec<f32>,
    /// `kv_heads × head_dim` floats.
    pub v: Vec<f32>,
}

/// The store's books at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvStoreStats {
    /// Sequences open now (active or preempted).
    pub sequences: usize,
    /// Of those, preempted (their KV is saved or dropped; `restore` brings them back).
    pub preempted: usize,
    /// Tokens whose K/V the active sequences hold in memory.
    pub tokens: usize,
    /// Bytes mapped for active sequences alone (their own chunks, not the shared prompt
    /// blocks they map).
    pub exclusive_bytes: u64,
    /// Shared prompt blocks in the prefix cache (complete or being filled).
    pub prefix_entries: usize,
    /// Bytes of those blocks (all layers, K and V).
    pub prefix_bytes: u64,
    /// Bytes the store's leases hold with the Governor, memory still waiting for its fences
    /// included: equals the Governor's leased bytes for this holder.
    pub leased_bytes: u64,
    /// Bytes of the store's memory the kernel reports resident (its memfd backing).
    pub os_resident_bytes: u64,
    /// Sequences preempted so far, either mode.
    pub preemptions: u64,
    /// Prompt tokens whose K/V came from shared blocks at `open`, so far.
    pub prefix_hit_tokens: u64,
    /// Pressure tickets answered so far.
    pub tickets: u64,
    /// Bytes freed in answer to those tickets, so far.
    pub freed_by_pressure: u64,
}

/// How many times at most a pressure ticket is looked at again, each time the kernel a
/// sequence waits for completes, when nothing could go before.
const TICKET_RECHECKS: u32 = 4;

/// The store's mailbox.
pub(crate) enum KvStoreMsg {
    /// A Governor's pressure ticket.
    Ticket(PressureTicket),
    /// A ticket put off while the kernels holding its victims finish.
    RecheckTicket {
        /// The ticket.
        ticket: PressureTicket,
        /// Times it was put off so far.
        rechecks: u32,
    },
    /// Opens a sequence for `prompt`, mapping cached prefix blocks.
    Open {
        /// Its id.
        seq: SeqId,
        /// Prompt token ids.
        prompt: Vec<u32>,
        /// Its priority (lower is preempted first).
        priority: Priority,
        /// What was found.
        reply: RpcReplyPort<Result<Opened, KvStoreError>>,
    },
    /// Makes room for one more token in each sequence: one grant for all of them.
    Prepare {
        /// The sequences.
        seqs: Vec<SeqId>,
        /// Answered once every sequence has room for its next token, or with why not.
        reply: RpcReplyPort<Result<(), KvStoreError>>,
    },
    /// Writes each item's new K/V for `layer` and runs its attention on the stream.
    Attend {
        /// The layer.
        layer: usize,
        /// One per sequence.
        items: Vec<AttendItem>,
        /// The attention outputs (`q_heads × head_dim` each), in item order.
        reply: RpcReplyPort<Result<Vec<Vec<f32>>, KvStoreError>>,
    },
    /// Brings a preempted sequence back.
    Restore {
        /// The sequence.
        seq: SeqId,
        /// What it took.
        reply: RpcReplyPort<Result<Restored, KvStoreError>>,
    },
    /// Closes a sequence; its memory is freed after its last kernel.
    Close {
        /// The sequence.
        seq: SeqId,
    },
    /// What the store holds now, for `KvStoreHandle::stats`.
    Stats {
        /// Answered with the counters.
        reply: RpcReplyPort<Result<KvStoreStats, KvStoreError>>,
    },
    /// Panics the actor (tests of supervision and cleanup).
    #[cfg(feature = "fault-injection")]
    Crash,
    /// A grant arrived for a waiting transaction (internal).
    Granted {
        /// The transaction.
        txn: u64,
        /// The grant or why not.
        grant: Result<Grant, GovernorError>,
    },
}

crate::holder_mailbox!(KvStoreMsg::Ticket);

/// One whole prompt block, shared by every sequence whose prompt starts the same way. Its
/// lease bytes go back only when the last sequence mapping it has been freed.
struct SharedPrefix {
    blocks: Vec<PhysicalBlock>,
    bytes: u64,
    /// Released as it drops, after the blocks (see `Drop`).
    _charge: Charge,
}

impl Drop for SharedPrefix {
    fn drop(&mut self) {
        // The blocks go first; the charge (a field) drops after this, once they are freed.
        self.blocks.clear();
    }
}

/// A cache entry: the shared block and whether its writer has filled it yet.
struct CachedPrefix {
    prefix: Arc<SharedPrefix>,
    complete: bool,
    last_used: u64,
}

/// A sequence's memory on its way out: freed by its mechanism after its fences; its charge
/// (the refund of its [`PendingFree`]) goes back after that.
struct SeqMemory {
    seq: KvSequence,
    prefixes: Vec<Arc<SharedPrefix>>,
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

type SavedKv = Vec<(Vec<f32>, Vec<f32>)>;

enum SeqState {
    Active(KvSequence),
    Preempted {
        mode: PreemptMode,
        tokens: usize,
        saved: Option<SavedKv>,
    },
}

struct SeqEntry {
    state: SeqState,
    /// Pays for the sequence's own memory (not the shared prefixes it maps).
    charge: Charge,
    priority: Priority,
    prefixes: Vec<Arc<SharedPrefix>>,
    /// Blocks this sequence is filling for the cache: (key, token count that completes it).
    filling: Vec<(u64, usize)>,
    last_fence: Option<Fence>,
    /// A grant for this sequence's next token is being obtained.
    busy: bool,
    /// Between a successful prepare and the last layer's attention: the engine is using it.
    stepping: bool,
}

enum Pending {
    Open {
        seq: SeqId,
        entry: Box<SeqEntry>,
        /// The cached blocks found at open, held so no ticket evicts them meanwhile.
        hits: Vec<(u64, Arc<SharedPrefix>)>,
        new_keys: Vec<u64>,
        bytes: u64,
        reply: RpcReplyPort<Result<Opened, KvStoreError>>,
    },
    Prepare {
        seqs: Vec<(SeqId, u64)>,
        bytes: u64,
        reply: RpcReplyPort<Result<(), KvStoreError>>,
    },
    Restore {
        seq: SeqId,
        per_buffer: u64,
        tokens: usize,
        saved: SavedKv,
        reply: RpcReplyPort<Result<Restored, KvStoreError>>,
    },
}

/// The store's state.
pub(crate) struct KvStoreState {
    config: KvStoreConfig,
    backing: Arc<HostBacking>,
    stream: CpuStream,
    governor: GovernorHandle,
    holder: HolderId,
    /// What every charge of this store holds, those waiting for their fences included.
    tally: Tally,
    seqs: HashMap<SeqId, SeqEntry>,
    prefixes: HashMap<u64, CachedPrefix>,
    pending: HashMap<u64, Pending>,
    next_txn: u64,
    clock: u64,
    stats: KvStoreStats,
}

/// The KV store actor.
#[derive(Debug, Default)]
pub(crate) struct KvStore;

/// What the store needs to start.
pub(crate) struct KvStoreArgs {
    /// Its configuration.
    pub config: KvStoreConfig,
    /// The Governor of the authority its memory comes from.
    pub governor: GovernorHandle,
    /// The execution provider whose host mechanism backs it and whose stream runs attention.
    pub provider: CpuProvider,
}

fn chain_hash(prev: u64, tokens: &[u32]) -> u64 {
    // FNV-1a over the previous block's hash and this block's token ids.
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ prev.rotate_left(17);
    for t in tokens {
        for b in t.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

impl Actor for KvStore {
    type Msg = KvStoreMsg;
    type State = KvStoreState;
    type Arguments = KvStoreArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<KvStoreMsg>,
        args: KvStoreArgs,
    ) -> Result<KvStoreState, ActorProcessingErr> {
        let KvStoreArgs {
            config,
            governor,
            provider,
        } = args;
        // Every startup failure is a `KvStoreError`, so `spawn` returns it as it is.
        let start = async {
            config
                .shape
                .validate(procmem::granularity())
                .map_err(KvError::from)?;
            let stream = provider.stream(0)?.clone();
            let holder = governor
                .register_holder(
                    config.name.clone(),
                    config.priority,
                    Some(myself.get_derived()),
                )
                .await?;
            Ok::<_, KvStoreError>((stream, holder))
        };
        let (stream, holder) = start.await?;
        Ok(KvStoreState {
            backing: provider.mechanism().backing(),
            stream,
            governor,
            holder,
            tally: Tally::default(),
            seqs: HashMap::new(),
            prefixes: HashMap::new(),
            pending: HashMap::new(),
            next_txn: 1,
            clock: 0,
            stats: KvStoreStats::default(),
            config,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<KvStoreMsg>,
        msg: KvStoreMsg,
        state: &mut KvStoreState,
    ) -> Result<(), ActorProcessingErr> {
        procmem::fault::panic_point("kv.handle");
        state.clock += 1;
        match msg {
            KvStoreMsg::Ticket(ticket) => state.answer(&myself, ticket, 0),
            KvStoreMsg::RecheckTicket { ticket, rechecks } => {
                state.answer(&myself, ticket, rechecks)
            }
            KvStoreMsg::Open {
                seq,
                prompt,
                priority,
                reply,
            } => state.open(&myself, seq, prompt, priority, reply).await,
            KvStoreMsg::Prepare { seqs, reply } => state.prepare(&myself, seqs, reply),
            KvStoreMsg::Attend {
                layer,
                items,
                reply,
            } => state.attend(layer, items, reply),
            KvStoreMsg::Restore { seq, reply } => state.restore(&myself, seq, reply),
            KvStoreMsg::Close { seq } => {
                if let Some(mut entry) = state.seqs.remove(&seq) {
                    state.abandon_filling(std::mem::take(&mut entry.filling));
                    state.retire(entry);
                }
            }
            KvStoreMsg::Stats { reply } => {
                let _ = reply.send(Ok(state.stats()));
            }
            #[cfg(feature = "fault-injection")]
            KvStoreMsg::Crash => panic!("KV store told to crash"),
            KvStoreMsg::Granted { txn, grant } => state.granted(txn, grant).await,
        }
        Ok(())
    }
}

impl Drop for KvStoreState {
    fn drop(&mut self) {
        // A stopped or panicking store still frees nothing early: every sequence goes through
        // the deferred-free path after its fences, and its leases follow the memory.
        let entries: Vec<SeqEntry> = self.seqs.drain().map(|(_, e)| e).collect();
        for entry in entries {
            self.retire(entry);
        }
    }
}

impl KvStoreState {
    /// Blocks a sequence was filling for the cache will never be complete once it is gone:
    /// they leave the cache (their memory goes with the last mapping).
    fn abandon_filling(&mut self, filling: Vec<(u64, usize)>) {
        for (key, _) in filling {
            if self.prefixes.get(&key).is_some_and(|p| !p.complete) {
                self.prefixes.remove(&key);
            }
        }
    }

    fn in_flight(&self, entry: &SeqEntry) -> bool {
        entry.busy
            || entry.stepping
            || entry
                .last_fence
                .is_some_and(|f| self.stream.timeline().completed() < f.value)
    }

    /// Sends a sequence's memory to the deferred-free queue with its last fence.
    fn retire(&mut self, entry: SeqEntry) {
        let SeqEntry {
            state,
            charge,
            prefixes,
            last_fence,
            ..
        } = entry;
        let SeqState::Active(seq) = state else {
            return;
        };
        let memory = SeqMemory { seq, prefixes };
        let pending = PendingFree::new(Box::new(memory), Some(charge));
        if let Some(use_) = last_fence.and_then(|f| TimelineFence::new(f, self.stream.timeline())) {
            pending.record_use(use_);
        }
        // If the queue is gone the message is dropped, and a dropped `PendingFree` still frees
        // only after its fence, woken by its completion.
        self.stream.deferred_free().enqueue(pending);
    }

    fn begin(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        bytes: u64,
        priority: Priority,
        pending: Pending,
    ) {
        let txn = self.next_txn;
        self.next_txn += 1;
        self.pending.insert(txn, pending);
        let governor = self.governor.clone();
        let request = ReserveRequest {
            holder: self.holder,
            role: MemoryRole::KvCache,
            bytes,
            priority,
            deadline: Some(Instant::now() + self.config.wait),
        };
        let me = myself.clone();
        // Waiting for room happens off the mailbox, so tickets keep being answered meanwhile.
        tokio::spawn(async move {
            let grant = governor.reserve(request).await;
            let _ = me.cast(KvStoreMsg::Granted { txn, grant });
        });
    }

    async fn granted(&mut self, txn: u64, grant: Result<Grant, GovernorError>) {
        let Some(pending) = self.pending.remove(&txn) else {
            return;
        };
        match grant {
            Err(e) => self.fail(pending, e.into()),
            Ok(grant) => match pending {
                p @ Pending::Open { .. } => self.finish_open(p, Some(grant)).await,
                p @ Pending::Prepare { .. } => self.finish_prepare(p, grant).await,
                p @ Pending::Restore { .. } => self.finish_restore(p, grant).await,
            },
        }
    }

    fn fail(&mut self, pending: Pending, error: KvStoreError) {
        match pending {
            Pending::Open { reply, .. } => {
                let _ = reply.send(Err(error));
            }
            Pending::Prepare { seqs, reply, .. } => {
                for (seq, _) in seqs {
                    if let Some(e) = self.seqs.get_mut(&seq) {
                        e.busy = false;
                    }
                }
                let _ = reply.send(Err(error));
            }
            Pending::Restore {
                seq,
                tokens,
                saved,
                reply,
                ..
            } => {
                if let Some(e) = self.seqs.get_mut(&seq) {
                    e.busy = false;
                    e.state = SeqState::Preempted {
                        mode: PreemptMode::Swap,
                        tokens,
                        saved: Some(saved),
                    };
                }
                let _ = reply.send(Err(error));
            }
        }
    }

    async fn open(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        seq: SeqId,
        prompt: Vec<u32>,
        priority: Priority,
        reply: RpcReplyPort<Result<Opened, KvStoreError>>,
    ) {
        let opening = self
            .pending
            .values()
            .any(|p| matches!(p, Pending::Open { seq: s, .. } if *s == seq));
        if self.seqs.contains_key(&seq) || opening {
            let _ = reply.send(Err(KvStoreError::AlreadyOpen(seq)));
            return;
        }
        let shape = self.config.shape;
        let g = procmem::granularity();
        let bt = shape.block_tokens(g);
        let mut keys = Vec::new();
        let mut h = 0;
        for block in prompt.chunks_exact(bt) {
            h = chain_hash(h, block);
            keys.push(h);
        }
        let hits = keys
            .iter()
            .take_while(|k| self.prefixes.get(k).is_some_and(|p| p.complete))
            .count();
        // Blocks after the hits are created for this sequence to fill; one already being
        // filled by another sequence is shared only once complete, so stop there.
        let new_keys: Vec<u64> = keys[hits..]
            .iter()
            .take_while(|k| !self.prefixes.contains_key(k))
            .copied()
            .collect();
        let memory =
            match KvSequence::reserve(self.backing.as_ref(), shape, self.config.chunk_granules) {
                Ok(s) => s,
                Err(e) => {
                    let _ = reply.send(Err(e.into()));
                    return;
                }
            };
        let entry = SeqEntry {
            state: SeqState::Active(memory),
            charge: Charge::counted(&self.tally),
            priority,
            prefixes: Vec::new(),
            filling: Vec::new(),
            last_fence: None,
            busy: false,
            stepping: false,
        };
        let bytes = new_keys.len() as u64 * shape.buffers() as u64 * shape.block_bytes(g);
        let hits: Vec<(u64, Arc<SharedPrefix>)> = keys[..hits]
            .iter()
            .map(|k| (*k, Arc::clone(&self.prefixes[k].prefix)))
            .collect();
        let pending = Pending::Open {
            seq,
            entry: Box::new(entry),
            hits,
            new_keys,
            bytes,
            reply,
        };
        if bytes == 0 {
            self.finish_open(pending, None).await;
        } else {
            self.begin(myself, bytes, priority, pending);
        }
    }

    async fn finish_open(&mut self, pending: Pending, grant: Option<Grant>) {
        let Pending::Open {
            seq,
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
        let g = procmem::granularity();
        let bt = shape.block_tokens(g);
        let mut charge = Charge::counted(&self.tally);
        if let Some(grant) = grant {
            match grant.commit(bytes).await {
                Ok(lease) => charge.add(lease),
                Err(refused) => {
                    let _ = reply.send(Err(refused.error.into()));
                    return;
                }
            }
        }
        let mapping: &dyn SharedMapping = self.backing.as_ref();
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
                    let _ = reply.send(Err(e.into()));
                    return;
                }
            }
        }
        drop(charge);
        let hit_count = hits.len();
        let mut used: Vec<Arc<SharedPrefix>> = Vec::with_capacity(hit_count + fresh.len());
        for (key, prefix) in hits {
            if let Some(p) = self.prefixes.get_mut(&key) {
                p.last_used = self.clock;
            }
            used.push(prefix);
        }
        let access: Vec<MapAccess> = std::iter::repeat_n(MapAccess::ReadOnly, used.len())
            .chain(std::iter::repeat_n(MapAccess::ReadWrite, fresh.len()))
            .collect();
        used.extend(fresh.iter().cloned());
        if !used.is_empty() {
            let blocks: Vec<PhysicalBlock> =
                used.iter().flat_map(|p| p.blocks.iter().cloned()).collect();
            let SeqState::Active(memory) = &mut entry.state else {
                unreachable!("a new sequence is active")
            };
            let attached = memory.attach_prefix(
                self.backing.as_ref(),
                mapping,
                &blocks,
                &access,
                hit_count * bt,
            );
            if let Err(e) = attached {
                drop(blocks);
                drop(used);
                drop(fresh);
                let _ = reply.send(Err(e.into()));
                return;
            }
        }
        for (i, (key, prefix)) in new_keys.iter().zip(&fresh).enumerate() {
            self.prefixes.insert(
                *key,
                CachedPrefix {
                    prefix: Arc::clone(prefix),
                    complete: false,
                    last_used: self.clock,
                },
            );
            entry.filling.push((*key, (hit_count + i + 1) * bt));
        }
        entry.prefixes = used;
        let cached = hit_count * bt;
        self.stats.prefix_hit_tokens += cached as u64;
        self.seqs.insert(seq, *entry);
        let _ = reply.send(Ok(Opened {
            cached_tokens: cached,
        }));
    }

    fn prepare(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        seqs: Vec<SeqId>,
        reply: RpcReplyPort<Result<(), KvStoreError>>,
    ) {
        let mut plan = Vec::with_capacity(seqs.len());
        let mut bytes = 0;
        let mut priority = 0;
        for seq in &seqs {
            let Some(entry) = self.seqs.get(seq) else {
                let _ = reply.send(Err(KvStoreError::Unknown(*seq)));
                return;
            };
            if entry.busy {
                let _ = reply.send(Err(KvStoreError::Busy(*seq)));
                return;
            }
            let memory = match &entry.state {
                SeqState::Active(m) => m,
                SeqState::Preempted { mode, .. } => {
                    let _ = reply.send(Err(KvStoreError::Preempted(*seq, *mode)));
                    return;
                }
            };
            if memory.tokens() >= memory.shape().max_tokens {
                let _ = reply.send(Err(KvError::Full(memory.shape().max_tokens).into()));
                return;
            }
            let per = memory.growth_for(1);
            bytes += per * memory.shape().buffers() as u64;
            priority = priority.max(entry.priority);
            plan.push((*seq, per));
        }
        if bytes == 0 {
            for (seq, _) in &plan {
                self.seqs.get_mut(seq).expect("checked").stepping = true;
            }
            let _ = reply.send(Ok(()));
            return;
        }
        for (seq, _) in &plan {
            self.seqs.get_mut(seq).expect("checked").busy = true;
        }
        self.begin(
            myself,
            bytes,
            priority,
            Pending::Prepare {
                seqs: plan,
                bytes,
                reply,
            },
        );
    }

    /// The grow transaction: map every sequence's growth (undoing all on any failure),
    /// commit the one charge, then publish.
    async fn finish_prepare(&mut self, pending: Pending, grant: Grant) {
        let Pending::Prepare { seqs, bytes, reply } = pending else {
            return;
        };
        let backing = Arc::clone(&self.backing);
        let mut mapped: Vec<(SeqId, PendingGrowth)> = Vec::new();
        let mut failure: Option<KvStoreError> = None;
        for (seq, per) in &seqs {
            let Some(SeqEntry {
                state: SeqState::Active(memory),
                ..
            }) = self.seqs.get_mut(seq)
            else {
                continue;
            };
            if *per == 0 {
                continue;
            }
            match memory.map_growth(backing.as_ref(), *per) {
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
        let _ = bytes;
        for (seq, growth) in mapped {
            if let Some(SeqEntry {
                state: SeqState::Active(memory),
                charge,
                ..
            }) = self.seqs.get_mut(&seq)
            {
                if failure.is_some() {
                    let _ = memory.abandon(backing.as_ref(), growth);
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
        let ok = failure.is_none();
        for (seq, _) in &seqs {
            if let Some(e) = self.seqs.get_mut(seq) {
                e.busy = false;
                e.stepping = ok;
            }
        }
        let _ = reply.send(match failure {
            Some(e) => Err(e),
            None => Ok(()),
        });
    }

    #[allow(unsafe_code)]
    fn attend(
        &mut self,
        layer: usize,
        items: Vec<AttendItem>,
        reply: RpcReplyPort<Result<Vec<Vec<f32>>, KvStoreError>>,
    ) {
        let shape = self.config.shape;
        // Validate everything before writing anything.
        for item in &items {
            match self.seqs.get(&item.seq).map(|e| &e.state) {
                None => {
                    let _ = reply.send(Err(KvStoreError::Unknown(item.seq)));
                    return;
                }
                Some(SeqState::Preempted { mode, .. }) => {
                    let _ = reply.send(Err(KvStoreError::Preempted(item.seq, *mode)));
                    return;
                }
                Some(SeqState::Active(m)) => {
                    if m.tokens() + 1 > m.mapped_tokens() {
                        let _ = reply.send(Err(KvError::NotMapped(m.tokens()).into()));
                        return;
                    }
                    if item.q.len() != shape.q_heads * shape.head_dim {
                        let _ = reply.send(Err(KvError::WrongLength {
                            expected: shape.q_heads * shape.head_dim,
                            got: item.q.len(),
                        }
                        .into()));
                        return;
                    }
                }
            }
        }
        let mut work = Vec::with_capacity(items.len());
        for item in &items {
            let entry = self.seqs.get_mut(&item.seq).expect("validated");
            let SeqState::Active(memory) = &mut entry.state else {
                unreachable!("validated")
            };
            let pos = memory.tokens();
            if let Err(e) = memory.write(layer, pos, &item.k, &item.v) {
                let _ = reply.send(Err(e.into()));
                return;
            }
            let n = pos + 1;
            let (k, v) = match (memory.keys_upto(layer, n), memory.values_upto(layer, n)) {
                (Ok(k), Ok(v)) => (k.as_ptr() as usize, v.as_ptr() as usize),
                (Err(e), _) | (_, Err(e)) => {
                    let _ = reply.send(Err(e.into()));
                    return;
                }
            };
            work.push((k, v, n, item.q.clone()));
        }
        let floats = shape.token_floats();
        let kernel = move || {
            let outputs: Vec<Vec<f32>> = work
                .iter()
                .map(|(k, v, n, q)| {
                    // SAFETY: the store records this kernel's fence on every sequence before
                    // anything can free it; victims exclude sequences in flight and retired
                    // memory waits for the fence, so `n` tokens stay mapped and unwritten.
                    let (k, v) = unsafe {
                        (
                            std::slice::from_raw_parts(*k as *const f32, n * floats),
                            std::slice::from_raw_parts(*v as *const f32, n * floats),
                        )
                    };
                    let mut out = vec![0f32; q.len()];
                    gqa_decode(
                        q,
                        k,
                        v,
                        *n,
                        shape.q_heads,
                        shape.kv_heads,
                        shape.head_dim,
                        &mut out,
                    );
                    out
                })
                .collect();
            let _ = reply.send(Ok(outputs));
        };
        let fence = match self.stream.submit(&[], kernel) {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(%e, "attention kernel not submitted");
                return;
            }
        };
        let last_layer = layer + 1 == shape.layers;
        for item in &items {
            let entry = self.seqs.get_mut(&item.seq).expect("validated");
            entry.last_fence = Some(fence);
            if last_layer {
                entry.stepping = false;
                if let SeqState::Active(memory) = &mut entry.state {
                    let _ = memory.advance();
                    let tokens = memory.tokens();
                    let done: Vec<u64> = entry
                        .filling
                        .iter()
                        .filter(|(_, end)| *end <= tokens)
                        .map(|(k, _)| *k)
                        .collect();
                    entry.filling.retain(|(_, end)| *end > tokens);
                    for key in done {
                        if let Some(p) = self.prefixes.get_mut(&key) {
                            p.complete = true;
                        }
                    }
                }
            }
        }
    }

    fn restore(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        seq: SeqId,
        reply: RpcReplyPort<Result<Restored, KvStoreError>>,
    ) {
        let shape = self.config.shape;
        let Some(entry) = self.seqs.get_mut(&seq) else {
            let _ = reply.send(Err(KvStoreError::Unknown(seq)));
            return;
        };
        if let SeqState::Active(m) = &entry.state {
            let _ = reply.send(Ok(Restored::Swapped { tokens: m.tokens() }));
            return;
        }
        let memory =
            match KvSequence::reserve(self.backing.as_ref(), shape, self.config.chunk_granules) {
                Ok(m) => m,
                Err(e) => {
                    let _ = reply.send(Err(e.into()));
                    return;
                }
            };
        let per_buffer = memory.growth_for(match &entry.state {
            SeqState::Preempted { tokens, .. } => *tokens,
            SeqState::Active(_) => 0,
        });
        let SeqState::Preempted {
            mode,
            tokens,
            saved,
        } = std::mem::replace(&mut entry.state, SeqState::Active(memory))
        else {
            unreachable!("checked above")
        };
        let saved = match (mode, saved) {
            (PreemptMode::Swap, Some(saved)) if tokens > 0 => saved,
            _ => {
                let _ = reply.send(Ok(Restored::Recompute { tokens }));
                return;
            }
        };
        entry.busy = true;
        let priority = entry.priority;
        self.begin(
            myself,
            per_buffer * shape.buffers() as u64,
            priority,
            Pending::Restore {
                seq,
                per_buffer,
                tokens,
                saved,
                reply,
            },
        );
    }

    async fn finish_restore(&mut self, pending: Pending, grant: Grant) {
        let Pending::Restore {
            seq,
            per_buffer,
            tokens,
            saved,
            reply,
        } = pending
        else {
            return;
        };
        let backing = Arc::clone(&self.backing);
        let Some(entry) = self.seqs.get_mut(&seq) else {
            let _ = reply.send(Err(KvStoreError::Unknown(seq)));
            return;
        };
        let SeqState::Active(memory) = &mut entry.state else {
            unreachable!("a restoring sequence is active")
        };
        let result: Result<(), KvStoreError> = async {
            let growth = memory.map_growth(backing.as_ref(), per_buffer)?;
            match grant.commit(growth.bytes()).await {
                Ok(lease) => entry.charge.add(lease),
                Err(refused) => {
                    memory.abandon(backing.as_ref(), growth)?;
                    return Err(refused.error.into());
                }
            }
            memory.publish(growth);
            let floats = memory.token_floats();
            for pos in 0..tokens {
                for (layer, (k, v)) in saved.iter().enumerate() {
                    memory.write(
                        layer,
                        pos,
                        &k[pos * floats..(pos + 1) * floats],
                        &v[pos * floats..(pos + 1) * floats],
                    )?;
                }
                memory.advance()?;
            }
            Ok(())
        }
        .await;
        let entry = self.seqs.get_mut(&seq).expect("present above");
        entry.busy = false;
        match result {
            Ok(()) => {
                let _ = reply.send(Ok(Restored::Swapped { tokens }));
            }
            Err(e) => {
                // Back to preempted with the saved copy; the partial memory is freed.
                let old = std::mem::replace(
                    &mut entry.state,
                    SeqState::Preempted {
                        mode: PreemptMode::Swap,
                        tokens,
                        saved: Some(saved),
                    },
                );
                let charge = std::mem::replace(&mut entry.charge, Charge::counted(&self.tally));
                // The memory first, then what paid for it.
                drop(old);
                drop(charge);
                let _ = reply.send(Err(e));
            }
        }
    }

    /// Whether only a kernel still on the stream keeps `entry` from being a victim: it will be
    /// free to go as soon as that kernel's fence completes.
    fn waits_only_for_its_fence(&self, entry: &SeqEntry) -> bool {
        !entry.busy
            && !entry.stepping
            && matches!(entry.state, SeqState::Active(_))
            && entry
                .last_fence
                .is_some_and(|f| self.stream.timeline().completed() < f.value)
    }

    /// Answers a pressure ticket with whole units: unreferenced cached prefixes, then whole
    /// sequences with no kernel in flight. Everything chosen is freed now (nothing chosen is
    /// in use by the device), so the report has nothing pending a fence. `rechecks`: how many
    /// times this ticket was already put off.
    fn answer(&mut self, myself: &ActorRef<KvStoreMsg>, ticket: PressureTicket, rechecks: u32) {
        let _span = tracing::debug_span!(
            "pressure_ticket",
            ticket = ticket.id.get(),
            wanted = ticket.bytes_wanted
        )
        .entered();
        let prefixes: Vec<PrefixCandidate<u64>> = self
            .prefixes
            .iter()
            .map(|(key, p)| PrefixCandidate {
                key: *key,
                bytes: p.prefix.bytes,
                last_used: p.last_used,
                // Only the cache holds it: nobody maps it (an incomplete one lost its writer).
                referenced: Arc::strong_count(&p.prefix) > 1,
            })
            .collect();
        let sequences: Vec<SequenceCandidate<SeqId>> = self
            .seqs
            .iter()
            .filter_map(|(id, e)| match &e.state {
                SeqState::Active(m) => Some(SequenceCandidate {
                    id: *id,
                    bytes: m.exclusive_bytes(),
                    priority: e.priority,
                    in_flight: self.in_flight(e),
                }),
                SeqState::Preempted { .. } => None,
            })
            .collect();
        let available: u64 = prefixes
            .iter()
            .filter(|p| !p.referenced)
            .map(|p| p.bytes)
            .chain(sequences.iter().filter(|s| !s.in_flight).map(|s| s.bytes))
            .sum();
        let soon_free = self
            .seqs
            .values()
            .filter(|e| self.waits_only_for_its_fence(e))
            .filter_map(|e| e.last_fence)
            .min_by_key(|f| f.value);
        if let Some(fence) = soon_free.filter(|_| {
            available == 0
                && rechecks < TICKET_RECHECKS
                && tokio::time::Instant::now() < ticket.deadline
        }) {
            // Nothing can go now, but a sequence whose last kernel is finishing can go once
            // its fence completes: its completion wakes the store to look again (a few times
            // at most) rather than answer "nothing" and not be asked again in this round.
            // Nothing polls. (The Governor has one ticket out at a time and moves on at the
            // ticket's deadline.)
            let me = myself.clone();
            self.stream.timeline().on_complete(
                fence.value,
                Box::new(move |_| {
                    let _ = me.cast(KvStoreMsg::RecheckTicket {
                        ticket,
                        rechecks: rechecks + 1,
                    });
                }),
            );
            return;
        }
        let mut freed = 0;
        // Every eligible unit in the policy's order; stop once enough is really freed (a unit
        // whose free fails frees nothing and the next one is taken).
        for victim in choose_victims(u64::MAX, &prefixes, &sequences) {
            if freed >= ticket.bytes_wanted {
                break;
            }
            match victim {
                Victim::Prefix(key) => {
                    if procmem::fault::hit("kv.evict").is_err() {
                        continue;
                    }
                    if let Some(p) = self.prefixes.remove(&key) {
                        freed += p.prefix.bytes;
                    }
                }
                Victim::Sequence(id) => freed += self.preempt(id),
            }
        }
        self.stats.tickets += 1;
        self.stats.freed_by_pressure += freed;
        tracing::debug!(
            wanted = ticket.bytes_wanted,
            freed,
            "KV store answered a pressure ticket"
        );
        ticket.report(freed, 0);
    }

    /// Preempts a sequence that has no kernel in flight: its KV is saved to host memory
    /// (swap) or dropped (recompute), and its memory freed now. Returns the bytes freed.
    fn preempt(&mut self, id: SeqId) -> u64 {
        if procmem::fault::hit("kv.evict").is_err() {
            return 0;
        }
        let _span =
            tracing::debug_span!("eviction", seq = id, mode = ?self.config.preempt).entered();
        let mode = self.config.preempt;
        let Some(entry) = self.seqs.get_mut(&id) else {
            return 0;
        };
        let SeqState::Active(memory) = &entry.state else {
            return 0;
        };
        let tokens = memory.tokens();
        let saved = match mode {
            PreemptMode::Swap => Some(
                (0..memory.shape().layers)
                    .map(|l| {
                        (
                            memory.keys(l).map(<[f32]>::to_vec).unwrap_or_default(),
                            memory.values(l).map(<[f32]>::to_vec).unwrap_or_default(),
                        )
                    })
                    .collect(),
            ),
            PreemptMode::Recompute => None,
        };
        let old = std::mem::replace(
            &mut entry.state,
            SeqState::Preempted {
                mode,
                tokens,
                saved,
            },
        );
        let prefixes = std::mem::take(&mut entry.prefixes);
        let filling = std::mem::take(&mut entry.filling);
        let SeqState::Active(memory) = old else {
            unreachable!("checked above")
        };
        let freed = memory.exclusive_bytes();
        let charge = std::mem::replace(&mut entry.charge, Charge::counted(&self.tally));
        // Not in flight: no fence to wait for, so the mechanism frees it here and now, and
        // only then does what paid for it go back.
        let _ = DeferredRelease::release(Box::new(SeqMemory {
            seq: memory,
            prefixes,
        }));
        drop(charge);
        self.abandon_filling(filling);
        self.stats.preemptions += 1;
        freed
    }

    fn stats(&self) -> KvStoreStats {
        let mut stats = self.stats.clone();
        stats.sequences = self.seqs.len();
        for e in self.seqs.values() {
            match &e.state {
                SeqState::Active(m) => {
                    stats.tokens += m.tokens();
                    stats.exclusive_bytes += m.exclusive_bytes();
                }
                SeqState::Preempted { .. } => stats.preempted += 1,
            }
        }
        stats.prefix_entries = self.prefixes.len();
        stats.prefix_bytes = self.prefixes.values().map(|p| p.prefix.bytes).sum();
        stats.leased_bytes = self.tally.bytes();
        stats.os_resident_bytes = self.backing.resident_bytes().unwrap_or(0);
        stats
    }
}

/// A cheap, cloneable handle to a KV store.
#[derive(Debug, Clone)]
pub struct KvStoreHandle {
    holder: HolderRef<KvStoreMsg>,
}

impl KvStoreHandle {
    /// Starts a store registered as a holder with `governor`, backed by `provider`. A store
    /// that cannot start says why (a bad shape is `KvStoreError::Kv`).
    pub async fn spawn(
        config: KvStoreConfig,
        governor: GovernorHandle,
        provider: CpuProvider,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), KvStoreError> {
        Self::start(config, governor, provider, None).await
    }

    /// The same, supervised by `supervisor` (its failure is reported there, not fatal).
    pub async fn spawn_supervised(
        config: KvStoreConfig,
        governor: GovernorHandle,
        provider: CpuProvider,
        supervisor: ractor::ActorCell,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), KvStoreError> {
        Self::start(config, governor, provider, Some(supervisor)).await
    }

    async fn start(
        config: KvStoreConfig,
        governor: GovernorHandle,
        provider: CpuProvider,
        supervisor: Option<ractor::ActorCell>,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), KvStoreError> {
        let args = KvStoreArgs {
            config,
            governor,
            provider,
        };
        let (holder, join) =
            HolderRef::spawn(KvStore, args, supervisor, KvStoreError::Start).await?;
        Ok((KvStoreHandle { holder }, join))
    }

    /// The store's actor, to supervise, stop or kill it (it takes no message from outside).
    pub fn actor(&self) -> ractor::ActorCell {
        self.holder.cell()
    }

    /// Makes the store's actor panic at its next message (tests of supervision).
    #[cfg(feature = "fault-injection")]
    pub fn crash(&self) {
        self.holder.cast(KvStoreMsg::Crash);
    }

    async fn ask<T: Send + 'static>(
        &self,
        build: impl FnOnce(RpcReplyPort<Result<T, KvStoreError>>) -> KvStoreMsg,
    ) -> Result<T, KvStoreError> {
        self.holder.ask(build, KvStoreError::Unavailable).await
    }

    /// Opens a sequence for `prompt`; cached whole prompt blocks are mapped shared.
    pub async fn open(
        &self,
        seq: SeqId,
        prompt: Vec<u32>,
        priority: Priority,
    ) -> Result<Opened, KvStoreError> {
        self.ask(|reply| KvStoreMsg::Open {
            seq,
            prompt,
            priority,
            reply,
        })
        .await
    }

    /// Makes room for one more token in each sequence, under one grant.
    pub async fn prepare(&self, seqs: Vec<SeqId>) -> Result<(), KvStoreError> {
        self.ask(|reply| KvStoreMsg::Prepare { seqs, reply }).await
    }

    /// Writes each item's K/V for `layer` and runs attention on the stream.
    pub async fn attend(
        &self,
        layer: usize,
        items: Vec<AttendItem>,
    ) -> Result<Vec<Vec<f32>>, KvStoreError> {
        self.ask(|reply| KvStoreMsg::Attend {
            layer,
            items,
            reply,
        })
        .await
    }

    /// Brings a preempted sequence back.
    pub async fn restore(&self, seq: SeqId) -> Result<Restored, KvStoreError> {
        self.ask(|reply| KvStoreMsg::Restore { seq, reply }).await
    }

    /// Closes a sequence.
    pub fn close(&self, seq: SeqId) {
        self.holder.cast(KvStoreMsg::Close { seq });
    }

    /// What the store holds now and what it did so far (see [`KvStoreStats`]).
    pub async fn stats(&self) -> Result<KvStoreStats, KvStoreError> {
        self.ask(|reply| KvStoreMsg::Stats { reply }).await
    }
}
