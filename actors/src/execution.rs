//! Execution providers: a device context (a memory mechanism) and its streams, each with its
//! own deferred-free actor, supervised by the provider actor. One generic actor and handle,
//! [`ProviderOf`], serves every kind; a [`ProviderKind`] says what differs: the mechanism and
//! how a stream starts. The CPU kind is here ([`CpuProvider`]); the CUDA kind is in
//! [`CudaProvider`](crate::provider::CudaProvider).

use std::marker::PhantomData;
use std::sync::Arc;

use procmem::fence::{HostTimeline, StreamId, Timeline};
use procmem::host::HostMechanism;
use procmem::ledger::{HolderId, Priority};
use procmem::{Allocation, AllocationRequest, Allocator, ContextId, MemoryError, MemoryMechanism};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tokio::time::Instant;

use crate::buffer::Buffer;
use crate::deferred_free::{
    DeferredFree, DeferredFreeMsg, DeferredQueue, DrainReport, StreamRegistry,
};
use crate::governor::{CommitRefused, GovernorError, GovernorHandle, Lease, ReserveRequest};
use crate::stream::CpuStream;

/// Why the provider could not do what was asked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProviderError {
    /// The Governor did not grant the bytes.
    #[error(transparent)]
    Governor(#[from] GovernorError),
    /// The mechanism failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// No stream with that index.
    #[error("no stream {0}: the provider has {1}")]
    NoSuchStream(usize, usize),
    /// The provider actor is not running.
    #[error("the execution provider is not running")]
    Unavailable,
}

/// A buffer from another provider context was handed to this one; it is given back.
#[derive(Debug, thiserror::Error)]
#[error("buffer belongs to {owner}, not {this}: only its own context may free it")]
pub struct WrongContext {
    /// The context that made the buffer.
    pub owner: ContextId,
    /// The context it was handed to.
    pub this: ContextId,
    /// The buffer, untouched.
    pub buffer: Buffer,
}

/// What differs between kinds of execution provider.
pub trait ProviderKind: Send + Sync + Sized + 'static {
    /// What starting one takes.
    type Config: Send + 'static;
    /// Its memory mechanism.
    type Mechanism: MemoryMechanism + Send + Sync + 'static;
    /// One of its streams.
    type Stream: ProviderStream;
    /// Its name, for logs.
    const NAME: &'static str;

    /// Opens its mechanism (before any actor starts, so the error is typed).
    fn open(config: Self::Config) -> Result<OpenedMechanism<Self>, MemoryError>;

    /// Starts stream `id`, whose completions go to `deferred`.
    fn start_stream(
        mechanism: &Self::Mechanism,
        timeline: Arc<HostTimeline>,
        deferred: DeferredQueue,
        threads: usize,
    ) -> Result<Self::Stream, MemoryError>;
}

/// An opened mechanism, with its context and streams to start, ready for its provider actor.
pub struct OpenedMechanism<K: ProviderKind> {
    /// The mechanism.
    pub mechanism: K::Mechanism,
    /// The context its allocations belong to.
    pub context: ContextId,
    /// How many streams to start (at least one).
    pub streams: usize,
    /// Worker threads per stream for its host kernels' parallel work (0 where it runs none).
    pub threads: usize,
    /// Registry to join; a fresh one if `None`.
    pub registry: Option<StreamRegistry>,
}

mod sealed {
    /// Stopping a stream is the provider's shutdown alone.
    #[allow(unreachable_pub)]
    pub trait StreamControl {
        /// Closes the stream to new work and joins its thread after its queued work.
        fn stop_and_join(&self);
    }
}

pub(crate) use sealed::StreamControl;

/// Makes a stream type a [`ProviderStream`] from its own `timeline`, `deferred_free` and
/// `stop_and_join` methods (every kind of stream has them).
macro_rules! provider_stream {
    ($stream:ty) => {
        impl $crate::execution::StreamControl for $stream {
            fn stop_and_join(&self) {
                <$stream>::stop_and_join(self);
            }
        }

        impl $crate::execution::ProviderStream for $stream {
            fn timeline(&self) -> std::sync::Arc<dyn procmem::fence::Timeline> {
                <$stream>::timeline(self)
            }

            fn deferred_free(&self) -> &$crate::deferred_free::DeferredQueue {
                <$stream>::deferred_free(self)
            }
        }
    };
}
pub(crate) use provider_stream;

/// A stream of some provider: a timeline and the deferred-free actor its completions go to.
pub trait ProviderStream:
    sealed::StreamControl + Clone + Send + Sync + std::fmt::Debug + 'static
{
    /// Its timeline.
    fn timeline(&self) -> Arc<dyn Timeline>;
    /// Its deferred-free actor.
    fn deferred_free(&self) -> &DeferredQueue;
}

/// A provider's device context: it lives as long as any buffer made through it.
pub(crate) struct ProviderContext<K: ProviderKind> {
    id: ContextId,
    mechanism: K::Mechanism,
    streams: Vec<K::Stream>,
    registry: StreamRegistry,
}

/// A provider actor's mailbox.
pub(crate) enum ProviderMsg<K: ProviderKind> {
    /// The context, for handles.
    Context {
        /// The context.
        reply: RpcReplyPort<Arc<ProviderContext<K>>>,
    },
    /// Stop every stream after its submitted work, drain every deferred-free queue in order.
    Shutdown {
        /// What the drains freed.
        reply: RpcReplyPort<DrainReport>,
    },
}

#[cfg(feature = "cluster")]
impl<K: ProviderKind> ractor::Message for ProviderMsg<K> {}

impl<K: ProviderKind> std::fmt::Debug for ProviderMsg<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProviderMsg::Context { .. } => write!(f, "Context"),
            ProviderMsg::Shutdown { .. } => write!(f, "Shutdown"),
        }
    }
}

/// The execution provider actor of kind `K`.
pub(crate) struct ExecutionProvider<K>(PhantomData<fn() -> K>);

impl<K> Default for ExecutionProvider<K> {
    fn default() -> Self {
        ExecutionProvider(PhantomData)
    }
}

impl<K: ProviderKind> Actor for ExecutionProvider<K> {
    type Msg = ProviderMsg<K>;
    type State = Arc<ProviderContext<K>>;
    type Arguments = OpenedMechanism<K>;

    async fn pre_start(
        &self,
        myself: ActorRef<ProviderMsg<K>>,
        opened: OpenedMechanism<K>,
    ) -> Result<Self::State, ActorProcessingErr> {
        let OpenedMechanism {
            mechanism,
            context: id,
            streams: count,
            threads,
            registry,
        } = opened;
        let registry = registry.unwrap_or_default();
        let mut streams = Vec::with_capacity(count.max(1));
        for _ in 0..count.max(1) {
            let timeline = Arc::new(HostTimeline::new(StreamId::fresh()));
            let (deferred, _) = Actor::spawn_linked(
                None,
                DeferredFree,
                timeline.clone() as Arc<dyn Timeline>,
                myself.get_cell(),
            )
            .await?;
            let deferred = DeferredQueue(deferred);
            let stream = match K::start_stream(&mechanism, timeline, deferred.clone(), threads) {
                Ok(stream) => stream,
                Err(error) => {
                    deferred.0.stop(None);
                    return Err(error.into());
                }
            };
            registry.register(stream.timeline(), deferred);
            streams.push(stream);
        }
        Ok(Arc::new(ProviderContext {
            id,
            mechanism,
            streams,
            registry,
        }))
    }

    async fn handle(
        &self,
        _: ActorRef<ProviderMsg<K>>,
        msg: ProviderMsg<K>,
        context: &mut Arc<ProviderContext<K>>,
    ) -> Result<(), ActorProcessingErr> {
        procmem::fault::panic_point("provider.handle");
        match msg {
            ProviderMsg::Context { reply } => {
                let _ = reply.send(context.clone());
            }
            ProviderMsg::Shutdown { reply } => {
                let mut total = DrainReport::default();
                for stream in &context.streams {
                    let s = stream.clone();
                    tokio::task::spawn_blocking(move || StreamControl::stop_and_join(&s)).await?;
                    total.add(drain(stream.deferred_free()).await);
                }
                let _ = reply.send(total);
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<ProviderMsg<K>>,
        event: SupervisionEvent,
        _: &mut Arc<ProviderContext<K>>,
    ) -> Result<(), ActorProcessingErr> {
        if let SupervisionEvent::ActorFailed(who, reason) = event {
            // A deferred-free actor that fails would strand memory: the provider stops loudly
            // rather than run on with a stream whose frees go nowhere.
            tracing::error!(provider = K::NAME, actor = ?who.get_id(), %reason, "deferred-free actor failed");
            myself.stop(Some(format!("deferred-free actor failed: {reason}")));
        }
        Ok(())
    }
}

/// A handle to an execution provider of kind `K`; cheap to clone.
pub struct ProviderOf<K: ProviderKind> {
    actor: ActorRef<ProviderMsg<K>>,
    context: Arc<ProviderContext<K>>,
}

impl<K: ProviderKind> Clone for ProviderOf<K> {
    fn clone(&self) -> Self {
        ProviderOf {
            actor: self.actor.clone(),
            context: self.context.clone(),
        }
    }
}

impl<K: ProviderKind> std::fmt::Debug for ProviderOf<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(K::NAME)
            .field("context", &self.context.id)
            .field("streams", &self.context.streams)
            .finish()
    }
}

/// The most streams a provider starts, and the most worker threads per stream: each is a
/// thread, and a count like `usize::MAX` would start threads until the OS refused.
pub const MAX_STREAMS: usize = 1024;

/// The most threads a provider's streams start in all: each stream's own thread and its
/// pool's workers (`streams × (threads + 1)`).
pub const MAX_THREADS: usize = 4096;

impl<K: ProviderKind> ProviderOf<K> {
    /// Opens the mechanism and starts the provider with its streams and their deferred-free
    /// actors. A mechanism that cannot be opened (no CUDA driver, say) is a typed
    /// `ProviderError::Memory` and nothing starts.
    pub async fn spawn(config: K::Config) -> Result<Self, ProviderError> {
        let opened = K::open(config)?;
        let threads = opened
            .streams
            .max(1)
            .saturating_mul(opened.threads.saturating_add(1));
        if opened.streams > MAX_STREAMS || opened.threads > MAX_STREAMS || threads > MAX_THREADS {
            return Err(MemoryError::Unsupported {
                capability: "more than 1,024 streams or worker threads per stream, or more than \
                             4,096 threads in all",
                reason: "each is a thread; a count that large is a mistake, not a machine",
            }
            .into());
        }
        let (actor, _) = Actor::spawn(None, ExecutionProvider::<K>::default(), opened)
            .await
            .map_err(|_| ProviderError::Unavailable)?;
        let context = ractor::call!(actor, |r| ProviderMsg::Context { reply: r })
            .map_err(|_| ProviderError::Unavailable)?;
        Ok(ProviderOf { actor, context })
    }

    /// The provider actor (for supervision and tests).
    pub fn actor(&self) -> ractor::ActorCell {
        self.actor.get_cell()
    }

    /// Its context.
    pub fn context(&self) -> ContextId {
        self.context.id
    }

    /// The mechanism it allocates with.
    pub fn mechanism(&self) -> &K::Mechanism {
        &self.context.mechanism
    }

    /// The registry of its streams.
    pub fn registry(&self) -> &StreamRegistry {
        &self.context.registry
    }

    /// Stream `index`.
    pub fn stream(&self, index: usize) -> Result<&K::Stream, ProviderError> {
        self.context
            .streams
            .get(index)
            .ok_or(ProviderError::NoSuchStream(
                index,
                self.context.streams.len(),
            ))
    }

    /// Allocates `request` for `holder`: charges the full footprint first, allocates,
    /// commits the charge at the real footprint. Any failure returns the grant. The buffer's
    /// deferred frees go through stream `home`.
    pub async fn allocate(
        &self,
        governor: &GovernorHandle,
        holder: HolderId,
        request: &AllocationRequest,
        priority: Priority,
        deadline: Option<Instant>,
        home: usize,
    ) -> Result<Buffer, ProviderError> {
        let stream = self.stream(home)?;
        let (allocation, lease) = charged_allocation(
            self.context.mechanism.allocator(),
            governor,
            holder,
            request,
            priority,
            deadline,
        )
        .await?;
        Ok(Buffer::new(
            allocation,
            Some(lease),
            stream.deferred_free().clone(),
            self.context.clone(),
        ))
    }

    /// Frees a buffer through this provider: refused (and handed back) if another
    /// context made it; otherwise queued for deferred free like a drop.
    pub fn free(&self, buffer: Buffer) -> Result<(), Box<WrongContext>> {
        free_in_context(self.context.id, buffer)
    }

    /// Stops every stream after its submitted work and drains every deferred-free queue in
    /// order; buffers dropped later are freed after their fences on a thread of their own.
    pub async fn shutdown(&self) -> Result<DrainReport, ProviderError> {
        ractor::call!(self.actor, |r| ProviderMsg::Shutdown { reply: r })
            .map_err(|_| ProviderError::Unavailable)
    }
}

/// The CPU kind: the host mechanism, streams on worker threads.
#[derive(Debug)]
pub struct Cpu;

/// What [`CpuProvider`] needs to start.
#[derive(Debug, Clone)]
pub struct CpuProviderConfig {
    /// How many streams (each runs its kernels in order, one at a time).
    pub streams: usize,
    /// Worker threads per stream: each stream's kernels run on a rayon pool of its own of
    /// this many threads, so a kernel's parallel calls (`par_iter`, `join`) fork and join
    /// inside it. One per CPU this process may use unless set. 0: the kernels run on the
    /// stream's own thread and their parallel calls go to rayon's global pool (a hand-off to
    /// its threads and back for each call). Streams and threads are each at most
    /// [`MAX_STREAMS`], and `streams × (threads + 1)` at most [`MAX_THREADS`]; more is refused
    /// (`MemoryError::Unsupported`). Each stream's pool is its own, so several busy streams
    /// share the CPUs: a provider of many streams may want fewer threads each.
    pub threads: usize,
    /// Registry to join, so buffers can be used across providers; a fresh one if `None`.
    pub registry: Option<StreamRegistry>,
}

impl Default for CpuProviderConfig {
    fn default() -> Self {
        CpuProviderConfig {
            streams: 1,
            threads: crate::stream::default_stream_threads(),
            registry: None,
        }
    }
}

impl ProviderKind for Cpu {
    type Config = CpuProviderConfig;
    type Mechanism = HostMechanism;
    type Stream = CpuStream;
    const NAME: &'static str = "CpuProvider";

    fn open(config: CpuProviderConfig) -> Result<OpenedMechanism<Self>, MemoryError> {
        let mechanism = HostMechanism::new()?;
        Ok(OpenedMechanism {
            context: mechanism.context(),
            mechanism,
            streams: config.streams,
            threads: config.threads,
            registry: config.registry,
        })
    }

    fn start_stream(
        _: &HostMechanism,
        timeline: Arc<HostTimeline>,
        deferred: DeferredQueue,
        threads: usize,
    ) -> Result<CpuStream, MemoryError> {
        Ok(CpuStream::start(timeline, deferred, threads))
    }
}

provider_stream!(CpuStream);

/// The CPU execution provider: the host mechanism and CPU streams.
pub type CpuProvider = ProviderOf<Cpu>;

/// Charges the full footprint of `request` to `holder`, allocates, and commits the charge at
/// the real footprint. Any failure returns the grant (and frees an allocation no stream used).
pub(crate) async fn charged_allocation(
    allocator: &dyn Allocator,
    governor: &GovernorHandle,
    holder: HolderId,
    request: &AllocationRequest,
    priority: Priority,
    deadline: Option<Instant>,
) -> Result<(Allocation, Lease), ProviderError> {
    let footprint = allocator.footprint(request)?;
    let grant = governor
        .reserve(ReserveRequest {
            holder,
            role: request.role,
            bytes: footprint,
            priority,
            deadline,
        })
        .await?;
    // On error the grant drops here and returns itself.
    let allocation = allocator.allocate(request)?;
    let actual = allocation.footprint();
    // A refused commit hands the grant back. The allocation, never used by any stream, is
    // freed at once by its own mechanism, and only then does the grant return: memory is
    // never mapped without being charged, not even for a moment.
    // Were this future dropped during the commit, its locals would go in reverse order of
    // declaration. The commit future (which owns the grant) is pinned in a local, not moved
    // into the await, and `allocation` is re-bound after it: the allocation is freed before
    // the grant returns. (A plain `grant.commit(actual).await` drops the grant first.)
    let mut commit = std::pin::pin!(grant.commit(actual));
    let allocation = allocation;
    match commit.as_mut().await {
        Ok(lease) => Ok((allocation, lease)),
        Err(CommitRefused { error, grant }) => {
            drop(allocation);
            drop(grant);
            Err(error.into())
        }
    }
}

/// Drops `buffer` into its deferred-free path if `context` made it; hands it back otherwise.
pub(crate) fn free_in_context(context: ContextId, buffer: Buffer) -> Result<(), Box<WrongContext>> {
    if buffer.context() != context {
        return Err(Box::new(WrongContext {
            owner: buffer.context(),
            this: context,
            buffer,
        }));
    }
    drop(buffer);
    Ok(())
}

/// Drains one stream's deferred-free queue. A queue whose actor died is counted in
/// `lost_queues`: what it held frees after its fences on threads of its own (see
/// [`PendingFree`](crate::deferred_free::PendingFree)).
pub(crate) async fn drain(queue: &DeferredQueue) -> DrainReport {
    match ractor::call!(queue.0, |r| DeferredFreeMsg::Drain { reply: r }) {
        Ok(report) => report,
        Err(error) => {
            tracing::warn!(%error, "deferred-free queue gone at shutdown");
            DrainReport {
                lost_queues: 1,
                ..DrainReport::default()
            }
        }
    }
}
