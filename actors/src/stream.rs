//! Streams: submitted work is observed in order by the stream's own thread; each submission
//! returns a fence, and each completion is sent to the stream's deferred-free actor. The
//! parts every kind shares are `StreamCore`; a CPU stream runs its kernels on that thread.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{unbounded, Sender};
use procmem::fence::{Fence, HostTimeline, StreamId, Timeline};
use ractor::ActorRef;

use crate::buffer::DeviceBuffer;
use crate::deferred_free::DeferredFreeMsg;

type Kernel = Box<dyn FnOnce() + Send + 'static>;

/// Why work could not be submitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// The stream was shut down; nothing was submitted.
    #[error("{0} is shut down")]
    Closed(StreamId),
}

/// What every kind of stream is made of: a timeline, a thread that observes submitted work
/// in order and completes its fences, the hand-off to that thread, and the deferred-free
/// actor completions go to. `T` is what the thread is handed per submission (a kernel to
/// run, an event to wait on).
pub(crate) struct StreamCore<T> {
    timeline: Arc<HostTimeline>,
    sender: Mutex<Option<Sender<(u64, T)>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
    deferred: ActorRef<DeferredFreeMsg>,
}

impl<T: Send + 'static> StreamCore<T> {
    /// Starts the stream's thread, named `name`: for each submission in order it calls
    /// `observe` (which returns once the work is done) and completes its fence; `observe`
    /// returning false stops the thread, leaving that fence and later ones pending.
    pub(crate) fn start(
        name: String,
        timeline: Arc<HostTimeline>,
        deferred: ActorRef<DeferredFreeMsg>,
        mut observe: impl FnMut(T) -> bool + Send + 'static,
    ) -> Self {
        let (tx, rx) = unbounded::<(u64, T)>();
        let worker = {
            let timeline = Arc::clone(&timeline);
            let deferred = deferred.clone();
            std::thread::Builder::new()
                .name(name)
                .spawn(move || {
                    for (value, item) in rx {
                        if !observe(item) {
                            return;
                        }
                        complete_fence(&timeline, &deferred, value);
                    }
                })
                .expect("spawn a stream thread")
        };
        StreamCore {
            timeline,
            sender: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(worker)),
            deferred,
        }
    }

    /// Submits: under one lock (which keeps fence values in submission order) makes the
    /// item with `prepare`, signals the next fence, records it on every buffer of `uses`,
    /// and hands the item to the thread. `Err(Err(e))`: `prepare` failed, nothing fenced.
    pub(crate) fn submit<E>(
        &self,
        uses: &[&DeviceBuffer],
        prepare: impl FnOnce() -> Result<T, E>,
    ) -> Result<Fence, Result<StreamError, E>> {
        let closed = || Ok(StreamError::Closed(self.id()));
        let guard = self.sender.lock().unwrap_or_else(|p| p.into_inner());
        let sender = guard.as_ref().ok_or_else(closed)?;
        let item = prepare().map_err(Err)?;
        let fence = self.timeline.signal_next();
        for buffer in uses {
            buffer.record_use(fence, self.timeline());
        }
        sender.send((fence.value, item)).map_err(|_| closed())?;
        Ok(fence)
    }
}

impl<T> StreamCore<T> {
    /// Its identity.
    pub(crate) fn id(&self) -> StreamId {
        self.timeline.stream()
    }

    /// Its timeline.
    pub(crate) fn timeline(&self) -> Arc<dyn Timeline> {
        self.timeline.clone()
    }

    /// The timeline itself, for debugging output.
    pub(crate) fn host_timeline(&self) -> &HostTimeline {
        &self.timeline
    }

    /// Its deferred-free actor.
    pub(crate) fn deferred_free(&self) -> &ActorRef<DeferredFreeMsg> {
        &self.deferred
    }

    /// Blocks until `fence` completes (a host wait).
    pub(crate) fn host_wait(&self, fence: Fence) {
        wait_for(self.timeline.as_ref(), fence);
    }

    /// Stops accepting work and joins the thread once everything submitted was observed.
    pub(crate) fn stop_and_join(&self) {
        self.sender.lock().unwrap_or_else(|p| p.into_inner()).take();
        let worker = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(worker) = worker {
            let _ = worker.join();
        }
    }
}

/// A handle to one CPU stream; cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct CpuStream {
    core: Arc<StreamCore<Kernel>>,
    kernel_panics: Arc<AtomicU64>,
}

impl std::fmt::Debug for CpuStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let timeline = self.core.host_timeline();
        f.debug_struct("CpuStream")
            .field("id", &self.core.id())
            .field("signalled", &timeline.signalled())
            .field("completed", &timeline.completed())
            .finish()
    }
}

impl CpuStream {
    /// Starts the stream's worker thread; completions go to `deferred`.
    pub(crate) fn start(timeline: Arc<HostTimeline>, deferred: ActorRef<DeferredFreeMsg>) -> Self {
        let kernel_panics = Arc::new(AtomicU64::new(0));
        let panics = Arc::clone(&kernel_panics);
        let name = format!("procmem-cpu-{}", timeline.stream().get());
        let core = StreamCore::start(name, timeline, deferred, move |kernel: Kernel| {
            // A kernel that panics still completes its fence: the memory it used must still
            // be freed, and the stream must go on.
            if catch_unwind(AssertUnwindSafe(kernel)).is_err() {
                panics.fetch_add(1, Ordering::Relaxed);
            }
            true
        });
        CpuStream {
            core: Arc::new(core),
            kernel_panics,
        }
    }

    /// Its identity.
    pub fn id(&self) -> StreamId {
        self.core.id()
    }

    /// Its timeline.
    pub fn timeline(&self) -> Arc<dyn Timeline> {
        self.core.timeline()
    }

    /// Its deferred-free actor.
    pub fn deferred_free(&self) -> &ActorRef<DeferredFreeMsg> {
        self.core.deferred_free()
    }

    /// Kernels that panicked so far (their fences still completed).
    pub fn kernel_panics(&self) -> u64 {
        self.kernel_panics.load(Ordering::Relaxed)
    }

    /// Queues `kernel` after everything already submitted and returns its fence. Each buffer
    /// in `uses` records the fence, so it is not freed before the kernel is done with it.
    pub fn submit(
        &self,
        uses: &[&DeviceBuffer],
        kernel: impl FnOnce() + Send + 'static,
    ) -> Result<Fence, StreamError> {
        self.core
            .submit(uses, || {
                Ok::<Kernel, std::convert::Infallible>(Box::new(kernel))
            })
            .map_err(|e| match e {
                Ok(closed) => closed,
                Err(never) => match never {},
            })
    }

    /// Blocks until `fence` completes (a host wait).
    pub fn host_wait(&self, fence: Fence) {
        self.core.host_wait(fence);
    }

    /// Stops accepting work and joins the thread once everything submitted has run.
    pub(crate) fn stop_and_join(&self) {
        self.core.stop_and_join();
    }
}

/// Marks `value` complete on `timeline` and tells the stream's deferred-free actor.
pub(crate) fn complete_fence(
    timeline: &HostTimeline,
    deferred: &ActorRef<DeferredFreeMsg>,
    value: u64,
) {
    timeline.complete(value);
    let _ = deferred.cast(DeferredFreeMsg::FenceCompleted {
        value,
        at: Instant::now(),
    });
}

/// Blocks the calling thread until `fence` completes on `timeline`.
pub(crate) fn wait_for(timeline: &dyn Timeline, fence: Fence) {
    while !timeline.wait(fence.value, std::time::Duration::from_secs(1)) {}
}
