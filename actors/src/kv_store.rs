//! The KV page store: a holder actor owning every sequence's KV memory.
//!
//! Each sequence has a K and a V buffer per layer, virtually contiguous and backed only as far
//! as tokens exist. A step grows every sequence in the batch under **one** Governor grant
//! (reserve → map → publish → commit) and is lent to the server as a [`KvStep`]: views of
//! the flat buffers and the stream its kernels run on, until it ends with a fence. Whole
//! prompt blocks are shared between sequences read-only; under pressure the store gives back
//! whole units: unreferenced cached prefixes first (least recently used), then whole
//! sequences that have no kernel in flight, lowest priority first, swapped to host memory or
//! dropped for recomputation.
//!
//! # Map
//!
//! This file holds the configuration, the messages and the actor. The rest, by
//! what each file owns:
//!
//! | file | owns |
//! |---|---|
//! | `sequences.rs` | the open sequences (one value each: phase and what it holds), open, close; with `sequences/transitions.rs`, the only code that reaches the table (a step's plan, restores, pressure) |
//! | `lending.rs` | a step's memory from prepare to return: growth under one grant, lent, taken back |
//! | `step.rs` | [`KvStep`], what the server holds: views, submit, complete |
//! | `transactions.rs` | what waits for a grant (open, growth, restore), and the grant's arrival |
//! | `prefix.rs` | shared prompt blocks: made, mapped, filled, the digest |
//! | `eviction.rs` | a pressure ticket's answer: slack, cached blocks, whole sequences preempted |
//! | `swap.rs`, `restore.rs` | a preempted sequence's saved copy, and bringing it back |
//! | `keep.rs` | a closed sequence's blocks left to the cache |
//! | `below.rs`, `disk_tier.rs`, `host_tier.rs`, `copy_in.rs` | the tier below: blocks going down and coming back |
//! | `device.rs` | host or CUDA memory and stream, messages after fences |
//! | `handle.rs`, `answer.rs` | the server's handle and the answers that undo themselves |
//! | `metrics.rs` | the figures and their series |
//! | `error.rs` | why the store refused |
//!
//! One step: `handle.rs` sends the prepare; `copy_in.rs` (`copy_ins_first`) holds a first
//! step until its blocks from disk are in; `lending.rs` (`prepare`) has the sequences plan it
//! (`sequences/transitions.rs`, `plan_step`: the batch checked in the table, each growth
//! sized) and asks one grant, `transactions.rs` (`begin`, `granted`) waits for it off the
//! mailbox, `lending.rs` (`finish_prepare`, `lend`) maps, commits, publishes and lends the
//! memory; the server reads the views and submits its kernels through `step.rs`
//! ([`KvStep::complete`]); the step's end comes back to `lending.rs` (`step_ended`,
//! `take_back`), which takes the memory back after the store's fence. docs/architecture.md
//! traces the same step from the server's side.

use std::sync::Arc;

use procmem::fence::Fence;
use procmem::kv::{Incarnation, KvError, KvShape, PrefixCache, PrefixDigest};
use procmem::ledger::{HolderId, Priority};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::time::Duration;

use crate::charge::Tally;
use crate::governor::{GovernorError, GovernorHandle, Grant};
use crate::ticket::PressureTicket;

mod answer;
mod below;
mod copy_in;
pub use answer::{Opened, Restored};
mod device;
mod handle;
mod host_tier;
mod keep;
pub use handle::KvStoreHandle;
pub use host_tier::PrefixHost;
mod disk_tier;
mod error;
mod eviction;
mod lending;
mod metrics;
mod prefix;
mod restore;
mod sequences;
mod step;
mod swap;
mod transactions;

use crate::provider_choice::Provider;
use below::Below;
use device::KvDevice;
pub use device::KvStream;
pub use disk_tier::PrefixDisk;
pub use error::KvStoreError;
pub use metrics::KvStoreStats;
use prefix::SharedPrefix;
use sequences::Sequences;
use step::StepMemory;
pub use step::{KvStep, NewTokens, StepEnd, StepKv};
pub(crate) use swap::default_disk_dir;
use swap::Space;
pub use swap::{SwapKind, SwapSpace};
use transactions::Transactions;

pub use procmem::kv::{PreemptMode, SeqId, TableError};

/// How to start a KV store: [`KvStoreConfig::new`], then the setters of what differs from
/// the defaults (a new field never breaks a caller).
#[derive(Debug, Clone)]
#[non_exhaustive]
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
    /// Where swapped-out KV goes (`Auto`: a disk file, as the KV is in host memory).
    pub swap: SwapSpace,
    /// Map each sequence's next growth while a step runs (as vAttention does): when the
    /// token after a step's will need a new chunk, the store charges and maps it on its own
    /// task while the step's kernels run, and the next `prepare` only publishes it. It takes
    /// room only if there is some now (it never asks other holders to give way), and a chunk
    /// of slack is held one step earlier.
    pub map_ahead: bool,
    /// Where prompt blocks evicted under pressure go instead of being dropped, and where a
    /// store started later finds them (`None`: they are dropped). Host memory only: a store
    /// on a GPU refuses it.
    pub prefix_disk: Option<PrefixDisk>,
    /// Where prompt blocks evicted under pressure go on a GPU: page-locked host memory
    /// charged to the swap space's Governor ([`SwapSpace::Host`]). A store on the host
    /// refuses it (use a disk tier there).
    pub prefix_host: Option<PrefixHost>,
}

impl KvStoreConfig {
    /// A store named `name` for `shape`: priority 0, one granule a growth, preemption by
    /// swap to the default place ([`SwapSpace::Auto`]), steps waiting up to 5 s for room, no
    /// mapping ahead.
    pub fn new(name: impl Into<String>, shape: KvShape) -> Self {
        KvStoreConfig {
            name: name.into(),
            priority: 0,
            shape,
            chunk_granules: 1,
            preempt: PreemptMode::Swap,
            wait: Duration::from_secs(5),
            swap: SwapSpace::Auto,
            map_ahead: false,
            prefix_disk: None,
            prefix_host: None,
        }
    }

    /// Sets the holder priority.
    #[must_use]
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// Sets the granules mapped per growth.
    #[must_use]
    pub fn chunk_granules(mut self, granules: u64) -> Self {
        self.chunk_granules = granules;
        self
    }

    /// Sets what preemption does.
    #[must_use]
    pub fn preempt(mut self, preempt: PreemptMode) -> Self {
        self.preempt = preempt;
        self
    }

    /// Sets how long a step may wait for room.
    #[must_use]
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Sets where swapped-out KV goes.
    #[must_use]
    pub fn swap(mut self, swap: SwapSpace) -> Self {
        self.swap = swap;
        self
    }

    /// Sets whether the next growth is mapped while a step runs.
    #[must_use]
    pub fn map_ahead(mut self, map_ahead: bool) -> Self {
        self.map_ahead = map_ahead;
        self
    }

    /// Keeps evicted prompt blocks on disk (see [`PrefixDisk`]).
    #[must_use]
    pub fn prefix_disk(mut self, disk: PrefixDisk) -> Self {
        self.prefix_disk = Some(disk);
        self
    }

    /// Keeps evicted prompt blocks in host memory, for a store on a GPU (see [`PrefixHost`]).
    #[must_use]
    pub fn prefix_host(mut self, host: PrefixHost) -> Self {
        self.prefix_host = Some(host);
        self
    }
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
        reply: RpcReplyPort<Result<answer::OpenAnswer, KvStoreError>>,
    },
    /// Makes room for a number of tokens in each sequence: one grant for all of them.
    Prepare {
        /// The sequences and how many new tokens each.
        seqs: Vec<NewTokens>,
        /// Answered with the step once every sequence has room for its next token, or with
        /// why not.
        reply: RpcReplyPort<Result<KvStep, KvStoreError>>,
    },
    /// A step ended (completed, or dropped): its memory comes back after its kernels.
    StepEnded {
        /// Its number.
        step: u64,
        /// Its memory.
        memory: Arc<StepMemory>,
        /// The fence the server completed it with.
        fence: Option<Fence>,
        /// Whether its new tokens count.
        advance: bool,
        /// Answered once the memory is back.
        reply: Option<RpcReplyPort<Result<(), KvStoreError>>>,
    },
    /// The fence the store recorded after a step's kernels completed (internal).
    StepReturned(lending::Returned),
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
        /// Its token ids, to keep its whole blocks in the prefix cache (empty: keep none).
        tokens: Vec<u32>,
    },
    /// An open's answer was dropped unread: closes that incarnation, if it is still open.
    Abandon { seq: SeqId, writer: Incarnation },
    /// A caller left before its answer: the call waiting for room is called off.
    CallOff(answer::Left),
    /// A copy in from the disk tier ran (internal).
    CopySettled { seq: SeqId, writer: Incarnation },
    /// A closed sequence's blocks were copied into the cache (internal).
    Kept(keep::Keeping),
    /// Evicts cached blocks nobody maps that were used at most `worth` times, least worth
    /// first, until `bytes` are freed: what another process's burst may take from an idle
    /// one (its hot prefixes stay).
    ShedCold {
        /// Bytes wanted.
        bytes: u64,
        /// The most hits a block given up may have.
        worth: u32,
        /// Answered with the bytes freed now and after their copy to the tier below.
        reply: RpcReplyPort<Result<u64, KvStoreError>>,
    },
    /// What the store holds now, for `KvStoreHandle::stats`.
    Stats {
        /// Answered with the counters.
        reply: RpcReplyPort<Result<KvStoreStats, KvStoreError>>,
    },
    /// Panics the actor (tests of supervision and cleanup).
    #[cfg(feature = "fault-injection")]
    Crash,
    /// Publishes the store's metrics (internal, scheduled after a change).
    Publish,
    /// A grant arrived for a waiting transaction (internal).
    Granted {
        /// The transaction.
        txn: u64,
        /// The grant or why not.
        grant: Result<Grant, GovernorError>,
    },
}

#[cfg(feature = "cluster")]
impl ractor::Message for KvStoreMsg {}

crate::holder::holder_mailbox!(KvStoreMsg::Ticket);

/// The store's state.
pub(crate) struct KvStoreState {
    config: KvStoreConfig,
    /// The device the memory lives on.
    device: KvDevice,
    swap: Space,
    /// The device's stream, where every step runs.
    stream: KvStream,
    governor: GovernorHandle,
    holder: HolderId,
    /// What every charge of this store holds, those waiting for their fences included.
    tally: Tally,
    /// Every open sequence: its phase, memory, charge and the prompt blocks it maps.
    sequences: Sequences,
    prefixes: PrefixCache<Arc<SharedPrefix>>,
    /// The tier below evicted prompt blocks go to, if configured.
    tier: Option<Below>,
    /// What is in flight, waiting for grants.
    transactions: Transactions,
    /// Tickets put off until a step comes back: all the store could give was lent to it.
    after_step: Vec<(crate::ticket::PressureTicket, u32)>,
    /// The fence of the last keep kernel whose blocks have not joined the cache yet: bytes
    /// the cache will hold (and a ticket may take) once it completes.
    keeping: Option<procmem::fence::Fence>,
    clock: u64,
    stats: KvStoreStats,
    swap_outcomes: Arc<swap::SwapOutcomes>,
    metrics: metrics::KvMetrics,
    /// The blocks it holds (memory and disk), for routers: rebuilt as the metrics publish.
    digest: tokio::sync::watch::Sender<Arc<PrefixDigest>>,
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
    /// The execution provider whose mechanism backs it and whose stream its steps run on.
    pub provider: Provider,
    /// Where it publishes the digest of the blocks it holds.
    pub digest: tokio::sync::watch::Sender<Arc<PrefixDigest>>,
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
            digest,
        } = args;
        // Every startup failure is a `KvStoreError`, so `spawn` returns it as it is.
        let start = async {
            let device = KvDevice::open(provider)?;
            config
                .shape
                .validate(device.granularity())
                .map_err(KvError::from)?;
            let swap = match &config.swap {
                // On the host a copy in host memory would free nothing; on a GPU, with no
                // host-tier Governor named, the copy goes to disk as well.
                SwapSpace::Auto => Space::Disk(swap::default_disk_dir()),
                SwapSpace::Disk(dir) => Space::Disk(dir.clone()),
                SwapSpace::Host(host) if host.authority() == governor.authority() => {
                    return Err(KvStoreError::SwapAliased)
                }
                SwapSpace::Host(host) => Space::Host {
                    holder: host
                        .register_holder(format!("{}-swap", config.name), config.priority, None)
                        .await?,
                    governor: host.clone(),
                    priority: config.priority,
                },
            };
            let holder = governor
                .register_holder(
                    config.name.clone(),
                    config.priority,
                    Some(myself.get_derived()),
                )
                .await?;
            let tier = Below::open(&config, &device, &swap, governor.name()).await?;
            Ok::<_, KvStoreError>((device, holder, swap, tier))
        };
        let (device, holder, swap, tier) = start.await?;
        let block_tokens = config.shape.block_tokens(device.granularity());
        digest.send_replace(Arc::new(PrefixDigest::new(block_tokens)));
        let metrics = metrics::KvMetrics::new(
            &config.name,
            governor.name(),
            tier.as_ref().map(Below::is_disk),
        );
        Ok(KvStoreState {
            stream: device.stream.clone(),
            device,
            swap,
            governor,
            holder,
            tally: Tally::default(),
            sequences: Sequences::default(),
            prefixes: PrefixCache::default(),
            tier,
            transactions: Transactions::default(),
            after_step: Vec::new(),
            keeping: None,
            clock: 0,
            stats: KvStoreStats::default(),
            swap_outcomes: Arc::default(),
            metrics,
            digest,
            config,
        })
    }

    async fn post_stop(
        &self,
        _: ActorRef<KvStoreMsg>,
        state: &mut KvStoreState,
    ) -> Result<(), ActorProcessingErr> {
        // Its directory is free for another store once this one has stopped (its whole
        // blocks sent there first), and a stopped store holds nothing a router should send
        // it.
        state.close_tier().await;
        let block_tokens = state.digest.borrow().block_tokens();
        state
            .digest
            .send_replace(Arc::new(PrefixDigest::new(block_tokens)));
        Ok(())
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
            KvStoreMsg::Ticket(ticket) => state.answer(&myself, ticket, 0).await,
            KvStoreMsg::RecheckTicket { ticket, rechecks } => {
                state.answer(&myself, ticket, rechecks).await
            }
            KvStoreMsg::Open {
                seq,
                prompt,
                priority,
                reply,
            } => state.open(&myself, seq, prompt, priority, reply).await,
            KvStoreMsg::Prepare { seqs, reply } => {
                // A sequence's first step waits for its copy in from disk.
                if let Some((seqs, reply)) = state.copy_ins_first(&myself, (seqs, reply)) {
                    state.prepare(&myself, seqs, reply)
                }
            }
            KvStoreMsg::Abandon { seq, writer } => state.abandon(seq, writer),
            KvStoreMsg::CallOff(call) => state.call_off(call),
            KvStoreMsg::StepEnded {
                step,
                memory,
                fence,
                advance,
                reply,
            } => state.step_ended(&myself, step, memory, fence, advance, reply),
            KvStoreMsg::StepReturned(returned) => state.step_returned(&myself, returned),
            KvStoreMsg::Restore { seq, reply } => state.restore(&myself, seq, reply),
            KvStoreMsg::Close { seq, tokens } if tokens.is_empty() => state.close(seq),
            KvStoreMsg::Close { seq, tokens } => state.close_keeping(&myself, seq, tokens),
            KvStoreMsg::Kept(keeping) => state.kept(keeping),
            KvStoreMsg::CopySettled { seq, writer } => state.copy_settled(seq, writer),
            KvStoreMsg::Stats { reply } => state.send_stats(reply),
            KvStoreMsg::ShedCold {
                bytes,
                worth,
                reply,
            } => {
                let freed = state.shed_cold(bytes, worth);
                let _ = reply.send(Ok(freed));
            }
            #[cfg(feature = "fault-injection")]
            KvStoreMsg::Crash => panic!("KV store told to crash"),
            KvStoreMsg::Granted { txn, grant } => state.granted(&myself, txn, grant).await,
            KvStoreMsg::Publish => {
                state.scheduled_publish(&myself).await;
                return Ok(());
            }
        }
        state.changed(&myself).await;
        Ok(())
    }
}

impl Drop for KvStoreState {
    fn drop(&mut self) {
        // A stopped or panicking store still frees nothing early: every sequence goes through
        // the deferred-free path after its fences, and its leases follow the memory.
        for resident in self.sequences.drain() {
            self.retire(resident);
        }
    }
}
