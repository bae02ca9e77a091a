//! One deferred-free actor per device stream: allocations wait here until every fence that
//! used them has completed; then the mechanism that created them frees them, and only then
//! is the Governor refunded with the bytes actually freed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use ::metrics::{Counter, Gauge, Histogram};
use procmem::fence::{Fence, StreamId, Timeline, TimelineFence};
use procmem::fenced::{Fenced, Gate, Released};
use procmem::metrics;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::charge::Charge;

pub(crate) use procmem::fenced::Release as DeferredRelease;

/// Memory waiting for its fences, with the lease that pays for it: one [`Fenced`] owner of
/// the item, its refund and the fence of every stream that used it, each fence with its own
/// timeline. Dropped before a deferred-free actor took it (its actor died, or the message
/// carrying it was never handled), it still frees only after every fence, woken by the last
/// completion.
pub(crate) type PendingFree = Fenced<dyn DeferredRelease, Charge>;

/// A stream's deferred-free queue: where the buffers it used go when dropped. Opaque: only
/// this crate sends it anything; a caller can ask for its counters.
#[derive(Clone, Debug)]
pub struct DeferredQueue(pub(crate) ActorRef<DeferredFreeMsg>);

impl DeferredQueue {
    /// Its counters now, or `None` if its actor has stopped.
    pub async fn stats(&self) -> Option<DeferredStats> {
        ractor::call!(self.0, |reply| DeferredFreeMsg::Stats { reply }).ok()
    }

    /// Its actor, to supervise, stop or kill it (it takes no message from outside).
    pub fn actor(&self) -> ractor::ActorCell {
        self.0.get_cell()
    }

    /// Hands `pending` to the queue; if its actor is gone the message is dropped, and a
    /// dropped `PendingFree` still frees only after its fences.
    pub(crate) fn enqueue(&self, pending: PendingFree) {
        let _ = self.0.cast(DeferredFreeMsg::Enqueue(pending));
    }
}

/// Every stream's timeline and deferred-free queue, for looking streams up. It decides
/// nothing about freeing: each fence carries its own timeline.
#[derive(Clone, Default)]
pub struct StreamRegistry {
    inner: Arc<RwLock<HashMap<StreamId, StreamEntry>>>,
}

type StreamEntry = (Arc<dyn Timeline>, DeferredQueue);

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
    pub(crate) fn register(&self, timeline: Arc<dyn Timeline>, queue: DeferredQueue) {
        self.inner
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(timeline.stream(), (timeline, queue));
    }

    /// The timeline of `stream`.
    pub fn timeline(&self, stream: StreamId) -> Option<Arc<dyn Timeline>> {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&stream)
            .map(|(t, _)| Arc::clone(t))
    }

    /// The deferred-free actor of `stream`.
    pub fn queue(&self, stream: StreamId) -> Option<DeferredQueue> {
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
    /// Allocations it took that waited on a fence of another stream (another provider's
    /// too), woken by that stream's completion.
    pub forwarded: u64,
    /// Allocations it took that still wait for a fence that has not completed.
    pub still_queued: u64,
    /// Queues whose actor had died before the drain: what they held is freed after its
    /// fences, not counted above.
    pub lost_queues: u64,
}

impl DrainReport {
    /// Adds another stream's report to this one.
    pub fn add(&mut self, other: DrainReport) {
        self.freed = self.freed.saturating_add(other.freed);
        self.freed_bytes = self.freed_bytes.saturating_add(other.freed_bytes);
        self.forwarded = self.forwarded.saturating_add(other.forwarded);
        self.still_queued = self.still_queued.saturating_add(other.still_queued);
        self.lost_queues = self.lost_queues.saturating_add(other.lost_queues);
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
    /// For the same frees, nanoseconds the mechanism's own free took (an unmap on the host),
    /// measured where it ran: the part of `fence_to_refund_ns` that is the OS's, not ours.
    pub free_ns: Vec<u64>,
}

/// The deferred-free actor's mailbox.
#[derive(Debug)]
pub(crate) enum DeferredFreeMsg {
    /// An allocation whose last owner let go.
    Enqueue(PendingFree),
    /// The stream has stopped: report what was freed and what still waits.
    Drain {
        /// What was done.
        reply: RpcReplyPort<DrainReport>,
    },
    /// What waits and what was freed, for `DeferredQueue::stats`.
    Stats {
        /// Answered with the counters.
        reply: RpcReplyPort<DeferredStats>,
    },
}

#[cfg(feature = "cluster")]
impl ractor::Message for DeferredFreeMsg {}

/// The deferred-free actor of one stream.
///
/// It takes each allocation whose owner let go and hangs it on the timeline of the first
/// fence it still waits for, whichever stream or provider that is; each completion wakes the
/// next wait, and the last frees it through its own mechanism on the completing thread, then
/// refunds the lease. Nothing polls and nothing asks a registry.
#[derive(Debug, Default)]
pub(crate) struct DeferredFree;

/// What the actor and the wakers it sets share: counters and metric handles.
struct Shared {
    stream: StreamId,
    queued: AtomicU64,
    freed: AtomicU64,
    freed_bytes: AtomicU64,
    failures: AtomicU64,
    forwarded: AtomicU64,
    latencies: Mutex<Vec<(u64, u64)>>,
    depth: Gauge,
    freed_bytes_total: Counter,
    latency: Histogram,
}

impl Shared {
    fn released(&self, released: Released) {
        match released.outcome {
            Ok(freed) => {
                self.freed.fetch_add(1, Ordering::Relaxed);
                self.freed_bytes.fetch_add(freed, Ordering::Relaxed);
                self.freed_bytes_total.increment(freed);
                if let Some(at) = released.fence_done_at {
                    let ns = u64::try_from(at.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    self.latency.record(ns as f64 * 1e-9);
                    let mut samples = self.latencies.lock().unwrap_or_else(|p| p.into_inner());
                    if samples.len() < LATENCY_SAMPLES {
                        let free = u64::try_from(released.free_took.as_nanos()).unwrap_or(u64::MAX);
                        samples.push((ns, free));
                    }
                }
                tracing::trace!(stream = %self.stream, freed, "deferred free");
            }
            Err(error) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(stream = %self.stream, %error, "mechanism failed to free; lease kept");
            }
        }
        let left = self.queued.fetch_sub(1, Ordering::AcqRel).saturating_sub(1);
        self.depth.set(left as f64);
    }
}

/// A deferred-free actor's state: its stream's timeline (for the fault gate's retries) and
/// what it shares with the wakers it sets.
pub(crate) struct DeferredFreeState {
    timeline: Arc<dyn Timeline>,
    shared: Arc<Shared>,
}

const LATENCY_SAMPLES: usize = 1 << 17;

impl Actor for DeferredFree {
    type Msg = DeferredFreeMsg;
    type State = DeferredFreeState;
    type Arguments = Arc<dyn Timeline>;

    async fn pre_start(
        &self,
        _: ActorRef<DeferredFreeMsg>,
        timeline: Arc<dyn Timeline>,
    ) -> Result<DeferredFreeState, ActorProcessingErr> {
        let stream = timeline.stream();
        let label = stream.get().to_string();
        Ok(DeferredFreeState {
            timeline,
            shared: Arc::new(Shared {
                stream,
                queued: AtomicU64::new(0),
                freed: AtomicU64::new(0),
                freed_bytes: AtomicU64::new(0),
                failures: AtomicU64::new(0),
                forwarded: AtomicU64::new(0),
                latencies: Mutex::new(Vec::new()),
                depth: metrics::DEFERRED_FREE_QUEUE_DEPTH.gauge(&[&label]),
                freed_bytes_total: metrics::DEFERRED_FREE_BYTES_TOTAL.counter(&[&label]),
                latency: metrics::DEFERRED_FREE_FENCE_TO_REFUND_SECONDS.histogram(&[&label]),
            }),
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
            DeferredFreeMsg::Enqueue(pending) => state.enqueue(pending),
            DeferredFreeMsg::Drain { reply } => {
                let s = &state.shared;
                let _ = reply.send(DrainReport {
                    freed: s.freed.load(Ordering::Acquire),
                    freed_bytes: s.freed_bytes.load(Ordering::Acquire),
                    forwarded: s.forwarded.load(Ordering::Acquire),
                    still_queued: s.queued.load(Ordering::Acquire),
                    lost_queues: 0,
                });
            }
            DeferredFreeMsg::Stats { reply } => {
                let s = &state.shared;
                let (fence_to_refund_ns, free_ns) = s
                    .latencies
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .copied()
                    .unzip();
                let _ = reply.send(DeferredStats {
                    queued: usize::try_from(s.queued.load(Ordering::Acquire)).unwrap_or(usize::MAX),
                    freed: s.freed.load(Ordering::Acquire),
                    freed_bytes: s.freed_bytes.load(Ordering::Acquire),
                    failures: s.failures.load(Ordering::Acquire),
                    fence_to_refund_ns,
                    free_ns,
                });
            }
        }
        Ok(())
    }
}

impl DeferredFreeState {
    fn enqueue(&mut self, pending: PendingFree) {
        let _span = tracing::debug_span!("deferred_free", stream = %self.shared.stream, fences = pending.fences().len()).entered();
        let queued = self.shared.queued.fetch_add(1, Ordering::AcqRel) + 1;
        self.shared.depth.set(queued as f64);
        if pending
            .first_pending()
            .is_some_and(|p| p.fence().stream != self.shared.stream)
        {
            self.shared.forwarded.fetch_add(1, Ordering::Relaxed);
        }
        let shared = Arc::clone(&self.shared);
        // Fault points exist only in test builds: no gate to box on the free path otherwise.
        let gate = cfg!(feature = "fault-injection").then(|| self.fault_gate());
        pending.release_when_idle(gate, move |released| shared.released(released));
    }

    /// Under fault injection, a free that fails at `deferred.release` waits for this stream's
    /// next completion and is tried again.
    fn fault_gate(&self) -> Gate {
        let timeline = Arc::clone(&self.timeline);
        Box::new(move || {
            procmem::fault::hit("deferred.release").err()?;
            let retry = Fence {
                stream: timeline.stream(),
                value: timeline.completed().saturating_add(1),
            };
            TimelineFence::new(retry, Arc::clone(&timeline))
        })
    }
}
