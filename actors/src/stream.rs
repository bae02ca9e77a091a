//! Streams: submitted work is observed in order by the stream's own thread; each submission
//! returns a fence, and the thread completes each fence on the stream's timeline, which wakes
//! whatever waits for it (deferred frees among them). The parts every kind shares are
//! `StreamCore`; a CPU stream runs its kernels on that thread.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Sender};
use procmem::fence::{Fence, HostTimeline, StreamId, Timeline, TimelineFence};

use procmem::fenced::RecordUse;
use procmem::{Place, PlaceKind};

use crate::buffer::Buffer;
use crate::deferred_free::DeferredQueue;

type Kernel = Box<dyn FnOnce() + Send + 'static>;

/// Waits, without blocking the thread, until `value` of `timeline` completes, at most
/// `limit`: false if it did not (a stream that failed never completes its values).
pub(crate) async fn completed_within(
    timeline: &dyn Timeline,
    value: u64,
    limit: std::time::Duration,
) -> bool {
    matches!(
        tokio::time::timeout(limit, completed(timeline, value)).await,
        Ok(true)
    )
}

/// Waits, without blocking the thread, until `value` of `timeline` completes: false if the
/// timeline dropped the waiter without completing it.
async fn completed(timeline: &dyn Timeline, value: u64) -> bool {
    if timeline.completed() >= value {
        return true;
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    timeline.on_complete(
        value,
        Box::new(move |_| {
            let _ = tx.send(());
        }),
    );
    rx.await.is_ok()
}

/// Waits, without blocking the thread, until `fence` (of any stream, any provider) has
/// completed: what async code awaits where work on another stream must be done first. False
/// if its timeline dropped the waiter without completing it.
pub async fn fence_completed(fence: &TimelineFence) -> bool {
    completed(fence.timeline().as_ref(), fence.fence().value).await
}

/// Why work could not be submitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// The stream was shut down, or failed (a device error); nothing was submitted.
    #[error("{0} is shut down")]
    Closed(StreamId),
    /// A host kernel was asked to read a buffer on a device; nothing was submitted.
    #[error("a host kernel cannot read memory on {0:?}")]
    NotHost(Place),
}

type Slot<T> = Mutex<Option<Sender<(u64, T)>>>;
type Hand<T> = Arc<Slot<T>>;

/// What every kind of stream is made of: a timeline, a thread that observes submitted work
/// in order and completes its fences, and the hand-off to that thread. `T` is what the thread
/// is handed per submission (a kernel to run, an event to wait on).
pub(crate) struct StreamCore<T> {
    timeline: Arc<HostTimeline>,
    sender: Hand<T>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl<T: Send + 'static> StreamCore<T> {
    /// Starts the stream's thread, named `name`: for each submission in order it calls
    /// `observe` (which returns once the work is done) and completes its fence. With
    /// `workers` > 0, `observe` runs on a worker of a rayon pool of that many threads that
    /// belongs to this stream alone (see [`worker_pool`]); with 0, on the thread itself. `observe`
    /// returning false (the device failed) closes the stream: later submissions are refused
    /// before anything is queued, and that fence and any queued after it stay pending, so the
    /// memory they used is kept rather than freed early.
    pub(crate) fn start(
        name: String,
        timeline: Arc<HostTimeline>,
        workers: usize,
        mut observe: impl FnMut(T) -> bool + Send + 'static,
    ) -> Self {
        let (tx, rx) = unbounded::<(u64, T)>();
        let sender: Hand<T> = Arc::new(Mutex::new(Some(tx)));
        let worker = {
            let timeline = Arc::clone(&timeline);
            let thread_name = name.clone();
            // Weak: the thread must not keep its own channel open once the stream is dropped.
            let sender = Arc::downgrade(&sender);
            std::thread::Builder::new()
                .name(name)
                .spawn(move || {
                    // However the thread ends (a failed observation, a panic, no pool), the
                    // stream is closed with it, so no submission records a fence nobody will
                    // complete.
                    let _close = CloseOnExit(sender);
                    let drain = move || {
                        for (value, item) in rx {
                            if !observe(item) {
                                return;
                            }
                            timeline.complete(value);
                        }
                    };
                    match worker_pool(&thread_name, workers) {
                        // The loop runs on one of the pool's workers, so the parallel work of
                        // what it observes (a kernel's rayon calls) forks and joins inside the
                        // pool, with no hand-off to another thread and back.
                        Some(pool) => pool.install(drain),
                        None => drain(),
                    }
                })
                .expect("spawn a stream thread")
        };
        StreamCore {
            timeline,
            sender,
            worker: Mutex::new(Some(worker)),
        }
    }

    /// Submits: under one lock (which keeps fence values in submission order) makes the
    /// item with `prepare`, signals the next fence, records it on everything in `uses`, and
    /// hands the item to the thread. A closed stream refuses before `prepare` runs.
    /// `Err(Err(e))`: `prepare` failed, nothing fenced.
    pub(crate) fn submit<U: RecordUse + ?Sized, E>(
        &self,
        uses: &[&U],
        prepare: impl FnOnce() -> Result<T, E>,
    ) -> Result<Fence, Result<StreamError, E>> {
        let closed = || Ok(StreamError::Closed(self.id()));
        let guard = self.sender.lock().unwrap_or_else(|p| p.into_inner());
        let sender = guard.as_ref().ok_or_else(closed)?;
        let item = prepare().map_err(Err)?;
        let fence = self.timeline.signal_next();
        let timeline: Arc<dyn Timeline> = self.timeline.clone();
        for buffer in uses {
            if let Some(use_) = TimelineFence::new(fence, Arc::clone(&timeline)) {
                buffer.record_use(use_);
            }
        }
        // The thread holds the receiver until it closes the sender under this lock, so the
        // hand-off cannot fail while the sender is there.
        sender.send((fence.value, item)).map_err(|_| closed())?;
        Ok(fence)
    }
}

/// A rayon pool of `workers` threads for one stream (`None` for 0, or where the threads
/// cannot be started: the stream then observes on its own thread). Its own pool, not
/// rayon's global one: a kernel's parallel calls made from a worker of the pool fork and join
/// inside it, and while a worker waits in a join it only takes up work of the same kernel. On
/// a shared pool a worker waiting in one stream's join could take up another stream's kernel
/// and run it nested inside the first, under whatever lock the first holds.
fn worker_pool(name: &str, workers: usize) -> Option<rayon::ThreadPool> {
    if workers == 0 {
        return None;
    }
    let prefix = name.to_owned();
    rayon::ThreadPoolBuilder::new()
        .num_threads(workers)
        .thread_name(move |i| format!("{prefix}-w{i}"))
        .build()
        .inspect_err(|error| {
            tracing::warn!(%error, stream = name, "no worker pool; kernels run on the stream thread");
        })
        .ok()
}

/// The worker threads a CPU stream gets unless told: one per CPU this process may use.
pub(crate) fn default_stream_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Closes a stream's hand-off when its thread ends.
struct CloseOnExit<T>(std::sync::Weak<Slot<T>>);

impl<T> Drop for CloseOnExit<T> {
    fn drop(&mut self) {
        if let Some(sender) = self.0.upgrade() {
            sender.lock().unwrap_or_else(|p| p.into_inner()).take();
        }
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

    /// True once it stopped accepting work (shut down or failed).
    #[cfg(test)]
    pub(crate) fn is_closed(&self) -> bool {
        self.sender
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    /// Blocks until `fence` completes (a host wait).
    pub(crate) fn host_wait(&self, fence: Fence) {
        self.timeline.wait_until_complete(fence.value);
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
    deferred: DeferredQueue,
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
    /// Starts the stream's thread; `deferred` is the deferred-free actor of its buffers. Its
    /// kernels run on a rayon pool of `threads` workers of its own (on the stream's thread,
    /// their parallel calls going to rayon's global pool, for 0).
    pub(crate) fn start(
        timeline: Arc<HostTimeline>,
        deferred: DeferredQueue,
        threads: usize,
    ) -> Self {
        let kernel_panics = Arc::new(AtomicU64::new(0));
        let panics = Arc::clone(&kernel_panics);
        let name = format!("procmem-cpu-{}", timeline.stream().get());
        let core = StreamCore::start(name, timeline, threads, move |kernel: Kernel| {
            // A kernel that panics still completes its fence: the memory it used must still
            // be freed, and the stream must go on.
            if catch_unwind(AssertUnwindSafe(kernel)).is_err() {
                panics.fetch_add(1, Ordering::Relaxed);
            }
            true
        });
        CpuStream {
            core: Arc::new(core),
            deferred,
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

    /// The fence of the last submission so far: once it completes, everything submitted
    /// before now has run (also after the stream closed: what was queued still runs).
    pub(crate) fn last_issued(&self) -> Fence {
        Fence {
            stream: self.id(),
            value: self.core.host_timeline().signalled(),
        }
    }

    /// Its deferred-free actor.
    pub fn deferred_free(&self) -> &DeferredQueue {
        &self.deferred
    }

    /// Kernels that panicked so far (their fences still completed).
    pub fn kernel_panics(&self) -> u64 {
        self.kernel_panics.load(Ordering::Relaxed)
    }

    /// Queues `kernel` after everything already submitted and returns its fence. Each buffer
    /// in `uses` (a `Buffer`, or anything that records uses) records the fence, so it is
    /// not freed before the kernel is done with it.
    pub fn submit(
        &self,
        uses: &[&dyn RecordUse],
        kernel: impl FnOnce() + Send + 'static,
    ) -> Result<Fence, StreamError> {
        self.core
            .submit::<dyn RecordUse, _>(uses, || {
                Ok::<Kernel, std::convert::Infallible>(Box::new(kernel))
            })
            .map_err(|e| match e {
                Ok(closed) => closed,
                Err(never) => match never {},
            })
    }

    /// Queues a host kernel that reads `reads` and returns its fence: the kernel is handed
    /// their bytes, in order, for as long as it runs. Each buffer records the fence (so it is
    /// not freed before the kernel is done) and lends the kernel a share of its allocation,
    /// dropped as the kernel returns, before its fence completes. The slices cannot outlive
    /// the call. Refused, with nothing queued, if a buffer is not host memory.
    ///
    /// ```
    /// # use procmem_actors::{Buffer, provider::CpuStream};
    /// fn copy_out(stream: &CpuStream, buf: &Buffer) {
    ///     let (tx, _rx) = std::sync::mpsc::channel::<Vec<u8>>();
    ///     let _ = stream.submit_reading(&[buf], move |bytes| {
    ///         let _ = tx.send(bytes[0].to_vec());
    ///     });
    /// }
    /// ```
    /// The slices cannot leave the kernel (this does not compile):
    /// ```compile_fail
    /// # use procmem_actors::{Buffer, provider::CpuStream};
    /// fn smuggle(stream: &CpuStream, buf: &Buffer) {
    ///     let (tx, _rx) = std::sync::mpsc::channel::<&'static [u8]>();
    ///     let _ = stream.submit_reading(&[buf], move |bytes| {
    ///         let _ = tx.send(bytes[0]);
    ///     });
    /// }
    /// ```
    pub fn submit_reading(
        &self,
        reads: &[&Buffer],
        kernel: impl FnOnce(&[&[u8]]) + Send + 'static,
    ) -> Result<Fence, StreamError> {
        if let Some(b) = reads
            .iter()
            .find(|b| b.view().place.kind != PlaceKind::Host)
        {
            return Err(StreamError::NotHost(b.view().place));
        }
        let shares: Vec<_> = reads.iter().map(|b| b.share()).collect();
        let uses: Vec<&dyn RecordUse> = reads.iter().map(|b| *b as &dyn RecordUse).collect();
        self.submit(&uses, move || {
            let bytes: Vec<&[u8]> = shares
                .iter()
                .filter_map(|a| procmem::host::allocation_bytes(a).ok())
                .collect();
            kernel(&bytes);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    struct Probe(Mutex<Vec<Fence>>);

    impl RecordUse for Probe {
        fn record_use(&self, use_: TimelineFence) {
            self.0.lock().unwrap().push(use_.fence());
        }
    }

    /// Defect (issue 11, 4): after the device failed an event, `submit` queued the work,
    /// recorded a fence that could never complete on every buffer (which then leaked for
    /// good) and only then said `Closed`. Now a failed stream refuses before queuing anything.
    #[test]
    fn a_failed_stream_refuses_before_queuing_or_fencing() {
        let timeline = Arc::new(HostTimeline::new(StreamId::fresh()));
        let core = StreamCore::start("test-failing".into(), Arc::clone(&timeline), 0, |ok| ok);
        let probe = Probe(Mutex::new(Vec::new()));
        let ok = core
            .submit::<_, ()>(&[&probe], || Ok(true))
            .expect("a healthy stream accepts");
        core.host_wait(ok);
        let failed = core.submit::<_, ()>(&[&probe], || Ok(false)).unwrap();
        while !core.is_closed() {
            std::thread::yield_now();
        }
        assert!(
            timeline.completed() < failed.value,
            "the failed fence stays pending"
        );
        let prepared = AtomicBool::new(false);
        let refused = core.submit::<_, ()>(&[&probe], || {
            prepared.store(true, Ordering::SeqCst);
            Ok(true)
        });
        assert_eq!(refused, Err(Ok(StreamError::Closed(timeline.stream()))));
        assert!(!prepared.load(Ordering::SeqCst), "no work was queued");
        assert_eq!(
            *probe.0.lock().unwrap(),
            vec![ok, failed],
            "no fence was recorded for the refused submission"
        );
        core.stop_and_join();
    }
}
