//! The CUDA execution provider: a device context, CUDA streams whose work is fenced by
//! recorded events, a host thread per stream that observes each event in order and sends its
//! completion to that stream's deferred-free actor.

use std::sync::Arc;

use procmem::cuda::{CudaEvent, CudaMechanism, CudaStream};
use procmem::fence::{Fence, HostTimeline, StreamId, Timeline};
use procmem::fenced::RecordUse;
use procmem::MemoryError;

use crate::deferred_free::{DeferredQueue, StreamRegistry};
use crate::execution::{OpenedMechanism, ProviderKind, ProviderOf};
use crate::stream::{StreamCore, StreamError};

struct StreamInner {
    core: StreamCore<CudaEvent>,
    deferred: DeferredQueue,
    stream: CudaStream,
}

/// One CUDA stream of a provider; cheap to clone.
#[derive(Clone)]
pub struct CudaStreamHandle {
    inner: Arc<StreamInner>,
}

impl std::fmt::Debug for CudaStreamHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStreamHandle")
            .field("id", &self.inner.core.id())
            .field("completed", &self.inner.core.host_timeline().completed())
            .finish()
    }
}

impl CudaStreamHandle {
    fn start(timeline: Arc<HostTimeline>, stream: CudaStream, deferred: DeferredQueue) -> Self {
        let name = format!("procmem-cuda-{}", timeline.stream().get());
        let core = StreamCore::start(name, timeline, 0, |event: CudaEvent| {
            // An event that cannot be observed leaves its fence pending: memory the work
            // used is then never freed, rather than freed too early.
            match event.synchronize() {
                Ok(()) => true,
                Err(error) => {
                    tracing::error!(%error, "CUDA event failed; fence left pending");
                    false
                }
            }
        });
        CudaStreamHandle {
            inner: Arc::new(StreamInner {
                core,
                deferred,
                stream,
            }),
        }
    }

    /// Its identity.
    pub fn id(&self) -> StreamId {
        self.inner.core.id()
    }

    /// Its timeline.
    pub fn timeline(&self) -> Arc<dyn Timeline> {
        self.inner.core.timeline()
    }

    /// Its deferred-free actor.
    pub fn deferred_free(&self) -> &DeferredQueue {
        &self.inner.deferred
    }

    /// The fence of the last work submitted (complete already if none was).
    pub(crate) fn last_issued(&self) -> Fence {
        Fence {
            stream: self.id(),
            value: self.inner.core.host_timeline().signalled(),
        }
    }

    /// Queues `work` on the CUDA stream, records an event after it, and returns that fence.
    /// Every buffer in `uses` records the fence.
    pub fn submit(
        &self,
        uses: &[&dyn RecordUse],
        work: impl FnOnce(&CudaStream) -> Result<(), MemoryError>,
    ) -> Result<Fence, CudaSubmitError> {
        let stream = &self.inner.stream;
        self.inner
            .core
            .submit::<dyn RecordUse, _>(uses, || {
                work(stream)?;
                stream.record()
            })
            .map_err(|e| match e {
                Ok(closed) => CudaSubmitError::Stream(closed),
                Err(error) => CudaSubmitError::Work(error),
            })
    }

    /// Blocks until `fence` completes.
    pub fn host_wait(&self, fence: Fence) {
        self.inner.core.host_wait(fence);
    }

    /// The raw stream, for queuing work outside `submit` (it is then not fenced).
    pub fn cuda(&self) -> &CudaStream {
        &self.inner.stream
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

/// The CUDA kind: a device's mechanism (eager and VMM), CUDA streams fenced by events.
#[derive(Debug)]
pub struct Cuda;

impl ProviderKind for Cuda {
    type Config = CudaProviderConfig;
    type Mechanism = CudaMechanism;
    type Stream = CudaStreamHandle;
    const NAME: &'static str = "CudaProvider";

    /// Without a CUDA driver this is `MemoryError::NoCudaDriver` and nothing starts.
    fn open(config: CudaProviderConfig) -> Result<OpenedMechanism<Self>, MemoryError> {
        let mechanism = CudaMechanism::new(config.ordinal, config.prefill_handles)?;
        Ok(OpenedMechanism {
            context: mechanism.context(),
            mechanism,
            streams: config.streams,
            // Its streams wait on events; the kernels run on the device.
            threads: 0,
            registry: config.registry,
        })
    }

    fn start_stream(
        mechanism: &CudaMechanism,
        timeline: Arc<HostTimeline>,
        deferred: DeferredQueue,
        _threads: usize,
    ) -> Result<CudaStreamHandle, MemoryError> {
        let cuda = CudaStream::new(Arc::clone(mechanism.device()))?;
        Ok(CudaStreamHandle::start(timeline, cuda, deferred))
    }
}

impl CudaStreamHandle {
    /// Stops accepting work and joins the event thread once everything submitted was seen.
    fn stop_and_join(&self) {
        self.inner.core.stop_and_join();
    }
}

crate::execution::provider_stream!(CudaStreamHandle);

/// The CUDA execution provider: a device's mechanism and CUDA streams.
pub type CudaProvider = ProviderOf<Cuda>;
