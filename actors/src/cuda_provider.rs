//! The CUDA execution provider: a device context, CUDA streams whose work is fenced by
//! recorded events, a host thread per stream that observes each event in order and sends its
//! completion to that stream's deferred-free actor.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Sender};
use procmem::cuda::{CudaEvent, CudaMechanism, CudaStream};
use procmem::fence::{Fence, HostTimeline, StreamId, Timeline};
use procmem::ledger::{HolderId, Priority};
use procmem::{AllocationRequest, ContextId, DeviceMemoryMechanism, MemoryError};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tokio::time::Instant;

use crate::buffer::DeviceBuffer;
use crate::deferred_free::{DeferredFree, DeferredFreeMsg, DrainReport, StreamRegistry};
use crate::governor::GovernorHandle;
use crate::provider::{
    charged_allocation, drain, free_in_context, stop_if_a_queue_failed, ProviderError, WrongContext,
};
use crate::stream::{close_and_join, complete_fence, wait_for, StreamError};

struct StreamInner {
    id: StreamId,
    stream: CudaStream,
    timeline: Arc<HostTimeline>,
    submit: Mutex<Option<Sender<(u64, CudaEvent)>>>,
    poller: Mutex<Option<JoinHandle<()>>>,
    deferred: ActorRef<DeferredFreeMsg>,
}

/// One CUDA stream of a provider; cheap to clone.
#[derive(Clone)]
pub struct CudaStreamHandle {
    inner: Arc<StreamInner>,
}

impl std::fmt::Debug for CudaStreamHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStreamHandle")
            .field("id", &self.inner.id)
            .field("completed", &self.inner.timeline.completed())
            .finish()
    }
}

impl CudaStreamHandle {
    fn start(id: StreamId, stream: CudaStream, deferred: ActorRef<DeferredFreeMsg>) -> Self {
        let timeline = Arc::new(HostTimeline::new(id));
        let (tx, rx) = unbounded::<(u64, CudaEvent)>();
        let poller = {
            let timeline = Arc::clone(&timeline);
            let deferred = deferred.clone();
            std::thread::Builder::new()
                .name(format!("procmem-cuda-{}", id.get()))
                .spawn(move || {
                    for (value, event) in rx {
                        // An event that cannot be observed leaves its fence pending: memory
                        // the work used is then never freed, rather than freed too early.
                        match event.synchronize() {
                            Ok(()) => complete_fence(&timeline, &deferred, value),
                            Err(error) => {
                                tracing::error!(%error, value, "CUDA event failed; fence left pending");
                                return;
                            }
                        }
                    }
                })
                .expect("spawn a CUDA poller thread")
        };
        CudaStreamHandle {
            inner: Arc::new(StreamInner {
                id,
                stream,
                timeline,
                submit: Mutex::new(Some(tx)),
                poller: Mutex::new(Some(poller)),
                deferred,
            }),
        }
    }

    /// Its identity.
    pub fn id(&self) -> StreamId {
        self.inner.id
    }

    /// Its timeline.
    pub fn timeline(&self) -> Arc<dyn Timeline> {
        self.inner.timeline.clone()
    }

    /// Its deferred-free actor.
    pub fn deferred_free(&self) -> &ActorRef<DeferredFreeMsg> {
        &self.inner.deferred
    }

    /// Queues `work` on the CUDA stream, records an event after it, and returns that fence.
    /// Every buffer in `uses` records the fence.
    pub fn submit(
        &self,
        uses: &[&DeviceBuffer],
        work: impl FnOnce(&CudaStream) -> Result<(), MemoryError>,
    ) -> Result<Fence, CudaSubmitError> {
        let guard = self.inner.submit.lock().unwrap_or_else(|p| p.into_inner());
        let sender = guard
            .as_ref()
            .ok_or(CudaSubmitError::Stream(StreamError::Closed(self.inner.id)))?;
        work(&self.inner.stream).map_err(CudaSubmitError::Work)?;
        let event = self.inner.stream.record().map_err(CudaSubmitError::Work)?;
        let fence = self.inner.timeline.signal_next();
        for buffer in uses {
            buffer.record_use(fence, self.timeline());
        }
        sender
            .send((fence.value, event))
            .map_err(|_| CudaSubmitError::Stream(StreamError::Closed(self.inner.id)))?;
        Ok(fence)
    }

    /// Blocks until `fence` completes.
    pub fn host_wait(&self, fence: Fence) {
        wait_for(self.inner.timeline.as_ref(), fence);
    }

    /// The raw stream, for queuing work outside `submit` (it is then not fenced).
    pub fn cuda(&self) -> &CudaStream {
        &self.inner.stream
    }

    fn stop_and_join(&self) {
        close_and_join(&self.inner.submit, &self.inner.poller);
    }
}

/// Why CUDA work could not be submitted.
#[derive(Debug, thiserror::Error)]
pub enum CudaSubmitError {
    /// The stream is shut down.
    #[error(transparent)]
    Stream(StreamError),
    /// Queuing the work or recording its event failed; nothing was fenced.
    #[error(transparent)]
    Work(MemoryError),
}

/// The CUDA provider's context: device, mechanism and streams.
pub struct CudaContext {
    id: ContextId,
    mechanism: CudaMechanism,
    streams: Vec<CudaStreamHandle>,
    registry: StreamRegistry,
}

/// How to start a CUDA provider.
#[derive(Debug, Clone)]
pub struct CudaProviderConfig {
    /// Device ordinal.
    pub ordinal: u32,
    /// Number of streams.
    pub streams: usize,
    /// Physical handles created ahead of growth.
    pub prefill_handles: usize,
    /// Registry to join; a fresh one if `None`.
    pub registry: Option<StreamRegistry>,
}

impl Default for CudaProviderConfig {
    fn default() -> Self {
        CudaProviderConfig {
            ordinal: 0,
            streams: 1,
            prefill_handles: 16,
            registry: None,
        }
    }
}

/// The CUDA provider actor's mailbox.
pub enum CudaProviderMsg {
    /// The context.
    Context {
        /// The context.
        reply: RpcReplyPort<Arc<CudaContext>>,
    },
    /// Stop streams after their queued work; drain every deferred-free queue.
    Shutdown {
        /// What the drains freed.
        reply: RpcReplyPort<DrainReport>,
    },
}

/// The CUDA execution provider actor.
#[derive(Debug, Default)]
pub struct CudaExecutionProvider;

impl Actor for CudaExecutionProvider {
    type Msg = CudaProviderMsg;
    type State = Arc<CudaContext>;
    type Arguments = CudaProviderConfig;

    async fn pre_start(
        &self,
        myself: ActorRef<CudaProviderMsg>,
        config: CudaProviderConfig,
    ) -> Result<Arc<CudaContext>, ActorProcessingErr> {
        let mechanism = CudaMechanism::new(config.ordinal, config.prefill_handles)?;
        let id = mechanism.context();
        let registry = config.registry.unwrap_or_default();
        let mut streams = Vec::new();
        for _ in 0..config.streams.max(1) {
            let cuda = CudaStream::new(Arc::clone(mechanism.device()))?;
            let stream_id = StreamId::fresh();
            let (deferred, _) = Actor::spawn_linked(
                None,
                DeferredFree,
                (stream_id, id, registry.clone()),
                myself.get_cell(),
            )
            .await?;
            let handle = CudaStreamHandle::start(stream_id, cuda, deferred.clone());
            registry.register(handle.timeline(), deferred);
            streams.push(handle);
        }
        Ok(Arc::new(CudaContext {
            id,
            mechanism,
            streams,
            registry,
        }))
    }

    async fn handle(
        &self,
        _: ActorRef<CudaProviderMsg>,
        msg: CudaProviderMsg,
        context: &mut Arc<CudaContext>,
    ) -> Result<(), ActorProcessingErr> {
        procmem::fault::panic_point("provider.handle");
        match msg {
            CudaProviderMsg::Context { reply } => {
                let _ = reply.send(context.clone());
            }
            CudaProviderMsg::Shutdown { reply } => {
                let mut total = DrainReport::default();
                for stream in &context.streams {
                    let s = stream.clone();
                    tokio::task::spawn_blocking(move || s.stop_and_join()).await?;
                    total.add(drain(stream.deferred_free()).await);
                }
                let _ = reply.send(total);
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<CudaProviderMsg>,
        event: SupervisionEvent,
        _: &mut Arc<CudaContext>,
    ) -> Result<(), ActorProcessingErr> {
        stop_if_a_queue_failed(&myself.get_cell(), event);
        Ok(())
    }
}

/// A handle to a CUDA execution provider; cheap to clone.
#[derive(Clone)]
pub struct CudaProvider {
    actor: ActorRef<CudaProviderMsg>,
    context: Arc<CudaContext>,
}

impl std::fmt::Debug for CudaProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaProvider")
            .field("context", &self.context.id)
            .field("streams", &self.context.streams)
            .finish()
    }
}

impl CudaProvider {
    /// Starts a provider on device `config.ordinal`. Without a CUDA driver this returns
    /// `ProviderError::Memory(MemoryError::NoCudaDriver { .. })` and starts nothing.
    pub async fn spawn(config: CudaProviderConfig) -> Result<Self, ProviderError> {
        procmem::cuda::CudaDevice::open(config.ordinal)?;
        let (actor, _) = Actor::spawn(None, CudaExecutionProvider, config)
            .await
            .map_err(|_| ProviderError::Unavailable)?;
        let context = ractor::call!(actor, |r| CudaProviderMsg::Context { reply: r })
            .map_err(|_| ProviderError::Unavailable)?;
        Ok(CudaProvider { actor, context })
    }

    /// The provider actor (for supervision and tests).
    pub fn actor(&self) -> &ActorRef<CudaProviderMsg> {
        &self.actor
    }

    /// Its context.
    pub fn context(&self) -> ContextId {
        self.context.id
    }

    /// The CUDA mechanism.
    pub fn mechanism(&self) -> &CudaMechanism {
        &self.context.mechanism
    }

    /// The registry of its streams.
    pub fn registry(&self) -> &StreamRegistry {
        &self.context.registry
    }

    /// Stream `index`.
    pub fn stream(&self, index: usize) -> Result<&CudaStreamHandle, ProviderError> {
        self.context
            .streams
            .get(index)
            .ok_or(ProviderError::NoSuchStream(
                index,
                self.context.streams.len(),
            ))
    }

    /// Allocates device memory for `holder`, charged in full before allocating.
    pub async fn allocate(
        &self,
        governor: &GovernorHandle,
        holder: HolderId,
        request: &AllocationRequest,
        priority: Priority,
        deadline: Option<Instant>,
        home: usize,
    ) -> Result<DeviceBuffer, ProviderError> {
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
        Ok(DeviceBuffer::new(
            allocation,
            Some(lease),
            stream.deferred_free().clone(),
            self.context.clone(),
        ))
    }

    /// Frees through this provider; a buffer of another context is refused and handed back.
    pub fn free(&self, buffer: DeviceBuffer) -> Result<(), Box<WrongContext>> {
        free_in_context(self.context.id, buffer)
    }

    /// Stops every stream after its queued work and drains every deferred-free queue.
    pub async fn shutdown(&self) -> Result<DrainReport, ProviderError> {
        ractor::call!(self.actor, |r| CudaProviderMsg::Shutdown { reply: r })
            .map_err(|_| ProviderError::Unavailable)
    }
}
