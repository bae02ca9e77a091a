//! One deferred-free actor per device stream: allocations wait here until every fence that
//! used them has completed; then the mechanism that created them frees them, and only then
//! is the Governor refunded with the bytes actually freed.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram};
use procmem::deferred::{route, FenceQueue, Route};
use procmem::fence::{Fence, StreamId, Timeline};
use procmem::{ContextId, MemoryError};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::governor::Lease;

/// Something the device may still be using, freed by its own mechanism once it is not.
pub trait DeferredRelease: Send {
    /// Frees it through the mechanism that created it; returns the bytes actually freed.
    fn release(self: Box<Self>) -> Result<u64, MemoryError>;
}

impl DeferredRelease for procmem::DeviceAllocation {
    fn release(self: Box<Self>) -> Result<u64, MemoryError> {
        procmem::DeviceAllocation::release(*self)
    }
}

/// An allocation waiting for its fences, with the lease that pays for it.
///
/// A `PendingFree` that is dropped before a deferred-free actor freed it (its actor died
/// with it queued, or the message carrying it was never handled) does not free on the spot:
/// a thread of its own waits for every fence, then frees it and refunds the lease.
pub struct PendingFree {
    item: Option<Box<dyn DeferredRelease>>,
    lease: Option<Lease>,
    uses: Vec<(Fence, Arc<dyn Timeline>)>,
    pub(crate) context: ContextId,
}

impl PendingFree {
    /// `item` (created in `context`), paid for by `lease`, last used at each fence of `uses`
    /// (one per stream, with that stream's timeline).
    pub fn new(
        item: Box<dyn DeferredRelease>,
        lease: Option<Lease>,
        uses: Vec<(Fence, Arc<dyn Timeline>)>,
        context: ContextId,
    ) -> Self {
        PendingFree {
            item: Some(item),
            lease,
            uses,
            context,
        }
    }

    /// The fences it waits for.
    pub fn fences(&self) -> Vec<Fence> {
        self.uses.iter().map(|(f, _)| *f).collect()
    }

    /// Frees the item now and refunds what was freed; the caller has checked every fence.
    fn release_now(&mut self) -> Result<u64, MemoryError> {
        let Some(item) = self.item.take() else {
            return Ok(0);
        };
        match item.release() {
            Ok(freed) => {
                if let Some(mut lease) = self.lease.take() {
                    let refund = freed.min(lease.bytes());
                    if refund > 0 && lease.release(refund).is_err() {
                        tracing::warn!("governor gone; refund of {refund} bytes not delivered");
                    }
                    // Anything the lease held beyond the bytes freed goes back as it drops.
                }
                Ok(freed)
            }
            Err(error) => {
                // The books must not claim bytes came back that may not have: keep the charge.
                if let Some(lease) = self.lease.take() {
                    std::mem::forget(lease);
                }
                Err(error)
            }
        }
    }
}

impl std::fmt::Debug for PendingFree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingFree")
            .field("fences", &self.fences())
            .field("lease", &self.lease)
            .finish()
    }
}

impl PendingFree {
    fn fences_done(&self) -> bool {
        self.uses
            .iter()
            .all(|(fence, timeline)| timeline.completed() >= fence.value)
    }

    fn release_orphan(&mut self) {
        if let Err(error) = self.release_now() {
            tracing::error!(%error, "mechanism failed to free an orphaned allocation");
        }
    }
}

impl Drop for PendingFree {
    fn drop(&mut self) {
        if self.item.is_none() {
            return;
        }
        counter!("procmem_deferred_free_orphans_total").increment(1);
        if self.fences_done() {
            // Every fence is done: nothing can still use it, free it here.
            self.release_orphan();
            return;
        }
        let orphan = PendingFree {
            item: self.item.take(),
            lease: self.lease.take(),
            uses: std::mem::take(&mut self.uses),
            context: self.context,
        };
        match orphan_reaper() {
            Some(reaper) => {
                if let Err(crossbeam_channel::SendError(orphan)) = reaper.send(orphan) {
                    leak(orphan);
                }
            }
            None => leak(orphan),
        }
    }
}

/// No way to wait for its fences: leak it, still charged, rather than free it early.
fn leak(orphan: PendingFree) {
    tracing::error!("no thread to free an orphaned allocation; leaked, still charged");
    std::mem::forget(orphan);
}

/// The one thread that frees orphaned allocations once their fences complete: it holds them,
/// looks at their fences every millisecond while any wait, and sleeps on its channel when
/// none do, so a queue that died costs one thread in all, not one per allocation. `None` if
/// the thread could not be started (orphans are then leaked, still charged).
fn orphan_reaper() -> Option<&'static crossbeam_channel::Sender<PendingFree>> {
    static REAPER: std::sync::OnceLock<Option<crossbeam_channel::Sender<PendingFree>>> =
        std::sync::OnceLock::new();
    REAPER
        .get_or_init(|| {
            let (tx, rx) = crossbeam_channel::unbounded::<PendingFree>();
            let started = std::thread::Builder::new()
                .name("procmem-orphan-free".into())
                .spawn(move || {
                    let mut waiting: Vec<PendingFree> = Vec::new();
                    loop {
                        let next = if waiting.is_empty() {
                            match rx.recv() {
                                Ok(orphan) => Some(orphan),
                                Err(_) => return,
                            }
                        } else {
                            rx.recv_timeout(std::time::Duration::from_millis(1)).ok()
                        };
                        waiting.extend(next);
                        waiting.extend(rx.try_iter());
                        waiting.retain_mut(|orphan| {
                            if orphan.fences_done() {
                                orphan.release_orphan();
                                false
                            } else {
                                true
                            }
                        });
                    }
                });
            match started {
                Ok(_) => Some(tx),
                Err(error) => {
                    tracing::error!(%error, "cannot start the orphan-free thread");
                    None
                }
            }
        })
        .as_ref()
}

/// Every stream's timeline and deferred-free queue, so an allocation used on several streams
/// can be handed to whichever stream it still waits on.
#[derive(Clone, Default)]
pub struct StreamRegistry {
    inner: Arc<RwLock<HashMap<StreamId, StreamEntry>>>,
}

type StreamEntry = (Arc<dyn Timeline>, ActorRef<DeferredFreeMsg>);

impl std::fmt::Debug for StreamRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.inner.read().map(|m| m.len()).unwrap_or(0);
        f.debug_struct("StreamRegistry")
            .field("streams", &n)
            .finish()
    }
}

impl StreamRegistry {
    /// Adds a stream.
    pub fn register(&self, timeline: Arc<dyn Timeline>, queue: ActorRef<DeferredFreeMsg>) {
        self.inner
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(timeline.stream(), (timeline, queue));
    }

    /// The completed value of `stream` (a stream never registered counts as complete: it
    /// cannot have work pending).
    pub fn completed(&self, stream: StreamId) -> u64 {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&stream)
            .map_or(u64::MAX, |(t, _)| t.completed())
    }

    /// The timeline of `stream`.
    pub fn timeline(&self, stream: StreamId) -> Option<Arc<dyn Timeline>> {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&stream)
            .map(|(t, _)| Arc::clone(t))
    }

    fn queue(&self, stream: StreamId) -> Option<ActorRef<DeferredFreeMsg>> {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&stream)
            .map(|(_, q)| q.clone())
    }
}

/// The state of a stream's queue after a drain.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Allocations this queue freed over its life, the drain included.
    pub freed: u64,
    /// Bytes it freed over its life.
    pub freed_bytes: u64,
    /// Allocations the drain handed to another stream they still wait on.
    pub forwarded: u64,
    /// Allocations still waiting for a fence of this stream that never completed.
    pub still_queued: u64,
    /// Queues whose actor had died before the drain: what they held is freed after its
    /// fences by threads of its own, not counted above.
    pub lost_queues: u64,
}

impl DrainReport {
    /// Adds another stream's report to this one.
    pub fn add(&mut self, other: DrainReport) {
        self.freed += other.freed;
        self.freed_bytes += other.freed_bytes;
        self.forwarded += other.forwarded;
        self.still_queued += other.still_queued;
        self.lost_queues += other.lost_queues;
    }
}

/// Counters of one deferred-free actor.
#[derive(Debug, Clone, Default)]
pub struct DeferredStats {
    /// Allocations waiting now.
    pub queued: usize,
    /// Allocations freed so far.
    pub freed: u64,
    /// Bytes freed so far.
    pub freed_bytes: u64,
    /// Frees the mechanism failed (their leases are kept: the books must not claim bytes
    /// came back that may not have).
    pub failures: u64,
    /// Nanoseconds from fence completion to the refund reaching the Governor's mailbox, for
    /// the most recent frees that waited on a fence.
    pub fence_to_refund_ns: Vec<u64>,
}

/// The deferred-free actor's mailbox.
#[derive(Debug)]
pub enum DeferredFreeMsg {
    /// An allocation whose last owner let go.
    Enqueue(PendingFree),
    /// The stream's timeline reached `value` at `at`.
    FenceCompleted {
        /// The completed value.
        value: u64,
        /// When the stream completed it.
        at: Instant,
    },
    /// The stream has stopped and its last fence completed: free everything, in order.
    Drain {
        /// What was done.
        reply: RpcReplyPort<DrainReport>,
    },
    /// Counters.
    Stats {
        /// The counters.
        reply: RpcReplyPort<DeferredStats>,
    },
}

/// The deferred-free actor of one stream.
#[derive(Debug, Default)]
pub struct DeferredFree;

/// Its state.
pub struct DeferredFreeState {
    stream: StreamId,
    context: ContextId,
    registry: StreamRegistry,
    queue: FenceQueue<PendingFree>,
    stats: DeferredStats,
    depth: Gauge,
    freed_bytes: Counter,
    latency: Histogram,
}

const LATENCY_SAMPLES: usize = 1 << 17;

impl Actor for DeferredFree {
    type Msg = DeferredFreeMsg;
    type State = DeferredFreeState;
    type Arguments = (StreamId, ContextId, StreamRegistry);

    async fn pre_start(
        &self,
        _: ActorRef<DeferredFreeMsg>,
        (stream, context, registry): Self::Arguments,
    ) -> Result<DeferredFreeState, ActorProcessingErr> {
        let label = [("stream", stream.get().to_string())];
        Ok(DeferredFreeState {
            stream,
            context,
            registry,
            queue: FenceQueue::default(),
            stats: DeferredStats::default(),
            depth: gauge!("procmem_deferred_free_queue_depth", &label),
            freed_bytes: counter!("procmem_deferred_free_bytes_total", &label),
            latency: histogram!("procmem_deferred_free_fence_to_refund_seconds", &label),
        })
    }

    async fn handle(
        &self,
        _: ActorRef<DeferredFreeMsg>,
        msg: DeferredFreeMsg,
        state: &mut DeferredFreeState,
    ) -> Result<(), ActorProcessingErr> {
        procmem::fault::panic_point("deferred.handle");
        match msg {
            DeferredFreeMsg::Enqueue(pending) => {
                state.dispatch(pending, None);
            }
            DeferredFreeMsg::FenceCompleted { value, at } => {
                for pending in state.queue.pop_ready(value) {
                    state.dispatch(pending, Some(at));
                }
            }
            DeferredFreeMsg::Drain { reply } => {
                let mut forwarded = 0;
                let completed = state.registry.completed(state.stream);
                let mut rest = state.queue.pop_ready(completed);
                // Anything above the completed value was submitted but never ran: it can only
                // be freed once that value completes, so it stays queued.
                for pending in rest.drain(..) {
                    if state.dispatch(pending, None) == Dispatched::Forwarded {
                        forwarded += 1;
                    }
                }
                let _ = reply.send(DrainReport {
                    freed: state.stats.freed,
                    freed_bytes: state.stats.freed_bytes,
                    forwarded,
                    still_queued: state.queue.len() as u64,
                    lost_queues: 0,
                });
            }
            DeferredFreeMsg::Stats { reply } => {
                let mut stats = state.stats.clone();
                stats.queued = state.queue.len();
                let _ = reply.send(stats);
            }
        }
        state.depth.set(state.queue.len() as f64);
        Ok(())
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Dispatched {
    Freed,
    Queued,
    Forwarded,
}

impl DeferredFreeState {
    fn dispatch(&mut self, pending: PendingFree, fence_done_at: Option<Instant>) -> Dispatched {
        debug_assert_eq!(
            pending.context, self.context,
            "queued on a stream of another context"
        );
        match route(&pending.fences(), |s| self.registry.completed(s)) {
            Route::FreeNow => {
                self.free(pending, fence_done_at);
                Dispatched::Freed
            }
            Route::WaitOn(fence) if fence.stream == self.stream => {
                self.queue.push(fence.value, pending);
                Dispatched::Queued
            }
            Route::WaitOn(fence) => match self.registry.queue(fence.stream) {
                Some(other) => match other.cast(DeferredFreeMsg::Enqueue(pending)) {
                    Ok(()) => Dispatched::Forwarded,
                    Err(ractor::MessagingErr::SendErr(DeferredFreeMsg::Enqueue(pending))) => {
                        self.wait_elsewhere(pending, fence)
                    }
                    Err(_) => unreachable!("cast hands back the message it could not send"),
                },
                None => self.wait_elsewhere(pending, fence),
            },
        }
    }

    /// The other stream's queue is gone: wait for its fence on a blocking thread instead,
    /// never freeing early.
    fn wait_elsewhere(&mut self, pending: PendingFree, fence: Fence) -> Dispatched {
        let registry = self.registry.clone();
        let me = self.registry.queue(self.stream);
        std::thread::spawn(move || {
            if let Some(t) = registry.timeline(fence.stream) {
                crate::stream::wait_for(t.as_ref(), fence);
            }
            if let Some(me) = me {
                let _ = me.cast(DeferredFreeMsg::Enqueue(pending));
            }
        });
        Dispatched::Forwarded
    }

    fn free(&mut self, pending: PendingFree, fence_done_at: Option<Instant>) {
        let _span = tracing::debug_span!("deferred_free", stream = %self.stream, fences = pending.uses.len()).entered();
        if procmem::fault::hit("deferred.release").is_err() {
            // Not freed this time: back in the queue, retried at the next completion or drain.
            let completed = self.registry.completed(self.stream).min(u64::MAX - 1);
            self.queue.push(completed, pending);
            return;
        }
        let mut pending = pending;
        match pending.release_now() {
            Ok(freed) => {
                self.stats.freed += 1;
                self.stats.freed_bytes += freed;
                self.freed_bytes.increment(freed);
                if let Some(at) = fence_done_at {
                    let ns = at.elapsed().as_nanos() as u64;
                    self.latency.record(ns as f64 * 1e-9);
                    if self.stats.fence_to_refund_ns.len() < LATENCY_SAMPLES {
                        self.stats.fence_to_refund_ns.push(ns);
                    }
                }
                tracing::trace!(stream = %self.stream, freed, "deferred free");
            }
            Err(error) => {
                self.stats.failures += 1;
                tracing::error!(stream = %self.stream, %error, "mechanism failed to free; lease kept");
            }
        }
    }
}
