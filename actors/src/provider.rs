//! The CPU execution provider: a device context (the host mechanism) and its streams, each
//! with its own deferred-free actor, supervised by the provider actor.

use std::sync::Arc;

use procmem::fence::{HostTimeline, StreamId};
use procmem::host::HostMechanism;
use procmem::ledger::{HolderId, Priority};
use procmem::{
    AllocationRequest, ContextId, DeviceAllocation, DeviceAllocator, DeviceMemoryMechanism,
    MemoryError,
};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tokio::time::Instant;

use crate::buffer::DeviceBuffer;
use crate::deferred_free::{DeferredFree, DeferredFreeMsg, DrainReport, StreamRegistry};
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
    pub buffer: DeviceBuffer,
}

/// The provider's device context: it lives as long as any buffer made through it.
pub struct CpuContext {
    id: ContextId,
    mechanism: HostMechanism,
    streams: Vec<CpuStream>,
    registry: StreamRegistry,
}

/// What [`CpuProvider`] needs to start.
#[derive(Debug, Clone)]
pub struct CpuProviderConfig {
    /// How many streams (worker threads).
    pub streams: usize,
    /// Registry to join, so buffers can be used across providers; a fresh one if `None`.
    pub registry: Option<StreamRegistry>,
}

impl Default for CpuProviderConfig {
    fn default() -> Self {
        CpuProviderConfig {
            streams: 1,
            registry: None,
        }
    }
}

/// The provider actor's mailbox.
pub enum CpuProviderMsg {
    /// The context, for handles.
    Context {
        /// The context.
        reply: RpcReplyPort<Arc<CpuContext>>,
    },
    /// Stop every stream after its submitted work, drain every deferred-free queue in order.
    Shutdown {
        /// What the drains freed.
        reply: RpcReplyPort<DrainReport>,
    },
}

impl std::fmt::Debug for CpuProviderMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CpuProviderMsg::Context { .. } => write!(f, "Context"),
            CpuProviderMsg::Shutdown { .. } => write!(f, "Shutdown"),
        }
    }
}

/// The CPU execution provider actor.
#[derive(Debug, Default)]
pub struct CpuExecutionProvider;

impl Actor for CpuExecutionProvider {
    type Msg = CpuProviderMsg;
    type State = Arc<CpuContext>;
    type Arguments = CpuProviderConfig;

    async fn pre_start(
        &self,
        myself: ActorRef<CpuProviderMsg>,
        config: CpuProviderConfig,
    ) -> Result<Arc<CpuContext>, ActorProcessingErr> {
        let mechanism = HostMechanism::new()?;
        let id = mechanism.context();
        let registry = config.registry.unwrap_or_default();
        let mut streams = Vec::with_capacity(config.streams);
        for _ in 0..config.streams.max(1) {
            let stream = StreamId::fresh();
            let timeline = Arc::new(HostTimeline::new(stream));
            let (deferred, _) = Actor::spawn_linked(
                None,
                DeferredFree,
                (stream, id, registry.clone()),
                myself.get_cell(),
            )
            .await?;
            registry.register(timeline.clone(), deferred.clone());
            streams.push(CpuStream::start(timeline, deferred));
        }
        Ok(Arc::new(CpuContext {
            id,
            mechanism,
            streams,
            registry,
        }))
    }

    async fn handle(
        &self,
        _: ActorRef<CpuProviderMsg>,
        msg: CpuProviderMsg,
        context: &mut Arc<CpuContext>,
    ) -> Result<(), ActorProcessingErr> {
        procmem::fault::panic_point("provider.handle");
        match msg {
            CpuProviderMsg::Context { reply } => {
                let _ = reply.send(context.clone());
            }
            CpuProviderMsg::Shutdown { reply } => {
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
        myself: ActorRef<CpuProviderMsg>,
        event: SupervisionEvent,
        _: &mut Arc<CpuContext>,
    ) -> Result<(), ActorProcessingErr> {
        stop_if_a_queue_failed(&myself.get_cell(), event);
        Ok(())
    }
}

/// A handle to a CPU execution provider; cheap to clone.
#[derive(Clone)]
pub struct CpuProvider {
    actor: ActorRef<CpuProviderMsg>,
    context: Arc<CpuContext>,
}

impl std::fmt::Debug for CpuProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuProvider")
            .field("context", &self.context.id)
            .field("streams", &self.context.streams)
            .finish()
    }
}

impl CpuProvider {
    /// Starts a provider with its streams and their deferred-free actors.
    pub async fn spawn(config: CpuProviderConfig) -> Result<Self, ProviderError> {
        let (actor, _) = Actor::spawn(None, CpuExecutionProvider, config)
            .await
            .map_err(|_| ProviderError::Unavailable)?;
        let context = ractor::call!(actor, |r| CpuProviderMsg::Context { reply: r })
            .map_err(|_| ProviderError::Unavailable)?;
        Ok(CpuProvider { actor, context })
    }

    /// The provider actor (for supervision and tests).
    pub fn actor(&self) -> &ActorRef<CpuProviderMsg> {
        &self.actor
    }

    /// Its context.
    pub fn context(&self) -> ContextId {
        self.context.id
    }

    /// The host mechanism it allocates with.
    pub fn mechanism(&self) -> &HostMechanism {
        &self.context.mechanism
    }

    /// The registry of its streams.
    pub fn registry(&self) -> &StreamRegistry {
        &self.context.registry
    }

    /// Stream `index`.
    pub fn stream(&self, index: usize) -> Result<&CpuStream, ProviderError> {
        self.context
            .streams
            .get(index)
            .ok_or(ProviderError::NoSuchStream(
                index,
                self.context.streams.len(),
            ))
    }

    /// Allocates `request` for `holder`: charges the full footprint first (the host
    /// allocator is eager), allocates, commits the charge at the real footprint. Any failure
    /// returns the grant. The buffer's deferred frees go through stream `home`.
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

    /// Frees a buffer through this provider: refused (and handed back) if another
    /// context made it; otherwise queued for deferred free like a drop.
    pub fn free(&self, buffer: DeviceBuffer) -> Result<(), Box<WrongContext>> {
        free_in_context(self.context.id, buffer)
    }

    /// Stops every stream after its submitted work and drains every deferred-free queue in
    /// order; buffers dropped later are freed after their fences on a thread of their own.
    pub async fn shutdown(&self) -> Result<DrainReport, ProviderError> {
        ractor::call!(self.actor, |r| CpuProviderMsg::Shutdown { reply: r })
            .map_err(|_| ProviderError::Unavailable)
    }
}

/// Charges the full footprint of `request` to `holder`, allocates, and commits the charge at
/// the real footprint. Any failure returns the grant (and frees an allocation no stream used).
pub(crate) async fn charged_allocation(
    allocator: &dyn DeviceAllocator,
    governor: &GovernorHandle,
    holder: HolderId,
    request: &AllocationRequest,
    priority: Priority,
    deadline: Option<Instant>,
) -> Result<(DeviceAllocation, Lease), ProviderError> {
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
    match grant.commit(actual).await {
        Ok(lease) => Ok((allocation, lease)),
        Err(CommitRefused { error, grant }) => {
            drop(allocation);
            drop(grant);
            Err(error.into())
        }
    }
}

/// Drops `buffer` into its deferred-free path if `context` made it; hands it back otherwise.
pub(crate) fn free_in_context(
    context: ContextId,
    buffer: DeviceBuffer,
) -> Result<(), Box<WrongContext>> {
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
pub(crate) async fn drain(queue: &ActorRef<DeferredFreeMsg>) -> DrainReport {
    match ractor::call!(queue, |r| DeferredFreeMsg::Drain { reply: r }) {
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

/// A deferred-free actor that fails would strand memory: the provider stops loudly rather
/// than run on with a stream whose frees go nowhere.
pub(crate) fn stop_if_a_queue_failed(provider: &ractor::ActorCell, event: SupervisionEvent) {
    if let SupervisionEvent::ActorFailed(who, reason) = event {
        tracing::error!(actor = ?who.get_id(), %reason, "deferred-free actor failed");
        provider.stop(Some(format!("deferred-free actor failed: {reason}")));
    }
}
