//! A CPU stream: submitted work runs in order on the stream's own thread; each submission
//! returns a fence, and each completion is sent to the stream's deferred-free actor.

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

struct Job {
    value: u64,
    kernel: Kernel,
}

/// Why work could not be submitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// The stream was shut down; nothing was submitted.
    #[error("{0} is shut down")]
    Closed(StreamId),
}

struct Inner {
    id: StreamId,
    timeline: Arc<HostTimeline>,
    sender: Mutex<Option<Sender<Job>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
    deferred: ActorRef<DeferredFreeMsg>,
    kernel_panics: Arc<AtomicU64>,
}

/// A handle to one CPU stream; cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct CpuStream {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for CpuStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuStream")
            .field("id", &self.inner.id)
            .field("signalled", &self.inner.timeline.signalled())
            .field("completed", &self.inner.timeline.completed())
            .finish()
    }
}

impl CpuStream {
    /// Starts the stream's worker thread; completions go to `deferred`.
    pub(crate) fn start(timeline: Arc<HostTimeline>, deferred: ActorRef<DeferredFreeMsg>) -> Self {
        let (tx, rx) = unbounded::<Job>();
        let id = timeline.stream();
        let kernel_panics = Arc::new(AtomicU64::new(0));
        let worker = {
            let timeline = Arc::clone(&timeline);
            let deferred = deferred.clone();
            let panics = Arc::clone(&kernel_panics);
            std::thread::Builder::new()
                .name(format!("procmem-cpu-{}", id.get()))
                .spawn(move || {
                    for job in rx {
                        // A kernel that panics still completes its fence: the memory it used
                        // must still be freed, and the stream must go on.
                        if catch_unwind(AssertUnwindSafe(job.kernel)).is_err() {
                            panics.fetch_add(1, Ordering::Relaxed);
                        }
                        complete_fence(&timeline, &deferred, job.value);
                    }
                })
                .expect("spawn a stream thread")
        };
        CpuStream {
            inner: Arc::new(Inner {
                id,
                timeline,
                sender: Mutex::new(Some(tx)),
                worker: Mutex::new(Some(worker)),
                deferred,
                kernel_panics,
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

    /// Kernels that panicked so far (their fences still completed).
    pub fn kernel_panics(&self) -> u64 {
        self.inner.kernel_panics.load(Ordering::Relaxed)
    }

    /// Queues `kernel` after everything already submitted and returns its fence. Each buffer
    /// in `uses` records the fence, so it is not freed before the kernel is done with it.
    pub fn submit(
        &self,
        uses: &[&DeviceBuffer],
        kernel: impl FnOnce() + Send + 'static,
    ) -> Result<Fence, StreamError> {
        let guard = self.inner.sender.lock().unwrap_or_else(|p| p.into_inner());
        let Some(sender) = guard.as_ref() else {
            return Err(StreamError::Closed(self.inner.id));
        };
        // Signalling and handing off under one lock keeps values in submission order.
        let fence = self.inner.timeline.signal_next();
        for buffer in uses {
            buffer.record_use(fence, self.timeline());
        }
        sender
            .send(Job {
                value: fence.value,
                kernel: Box::new(kernel),
            })
            .map_err(|_| StreamError::Closed(self.inner.id))?;
        Ok(fence)
    }

    /// Blocks until `fence` completes (a host wait).
    pub fn host_wait(&self, fence: Fence) {
        wait_for(self.inner.timeline.as_ref(), fence);
    }

    /// Stops accepting work and joins the thread once everything submitted has run.
    pub(crate) fn stop_and_join(&self) {
        close_and_join(&self.inner.sender, &self.inner.worker);
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

/// Closes a stream's hand-off (its thread then finishes what was queued) and joins the thread.
pub(crate) fn close_and_join<T>(sender: &Mutex<Option<T>>, thread: &Mutex<Option<JoinHandle<()>>>) {
    sender.lock().unwrap_or_else(|p| p.into_inner()).take();
    let thread = thread.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(thread) = thread {
        let _ = thread.join();
    }
}
