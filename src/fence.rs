//! Fences: host-observable points on a stream's timeline.
//!
//! Every stream owns a `u64` timeline. Submitting work signals the next value; the value
//! completes when that work (and everything before it on the stream) has finished. The host
//! can read the completed value at any time, wait for a value to complete, or ask to be
//! woken when it does: a [`Waker`] runs on the thread that completes the value, so nothing
//! that waits on a fence has to poll.

mod wakers;

pub use wakers::FenceQueue;

use std::fmt;
use std::time::{Duration, Instant};

// Under `--cfg procmem_loom` the timeline's synchronisation is loom's, so its model tests
// explore every interleaving of completers and waiters.
#[cfg(procmem_loom)]
use loom::sync::{
    atomic::{AtomicU64, Ordering},
    Condvar, Mutex,
};
#[cfg(not(procmem_loom))]
use std::sync::{
    atomic::{AtomicU64, Ordering},
    Condvar, Mutex,
};

/// Identity of one stream (a CPU worker thread, a CUDA stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(u64);

impl StreamId {
    /// A process-unique fresh identity.
    pub fn fresh() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        StreamId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }

    /// The raw number, for logs and metric labels.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream#{}", self.0)
    }
}

/// A point on one stream's timeline: complete once the stream's completed value reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fence {
    /// The stream.
    pub stream: StreamId,
    /// The value on its timeline.
    pub value: u64,
}

/// Called once when the value it waits for completes, with the moment of completion. It runs
/// on the completing thread (a stream's worker, a CUDA event thread), so it must be short
/// and must never block on that stream.
pub type Waker = Box<dyn FnOnce(Instant) + Send + 'static>;

/// A stream's timeline as the host sees it.
pub trait Timeline: Send + Sync {
    /// The stream it belongs to.
    fn stream(&self) -> StreamId;
    /// The highest value signalled (submitted) so far.
    fn signalled(&self) -> u64;
    /// The highest value completed so far: every fence at or below it is done.
    fn completed(&self) -> u64;
    /// Blocks the calling thread until `value` completes or `timeout` passes; true if complete.
    fn wait(&self, value: u64, timeout: Duration) -> bool;
    /// Blocks the calling thread until `value` completes, however long that takes.
    fn wait_until_complete(&self, value: u64) {
        while !self.wait(value, Duration::from_secs(1)) {}
    }
    /// Calls `waker` once `value` completes: at once, on this thread, if it already has.
    /// A value that never completes (a stream that failed) keeps its waker forever, so what
    /// waits is leaked rather than released early.
    fn on_complete(&self, value: u64, waker: Waker);
}

/// A fence together with the timeline it belongs to: deciding whether it is complete, waiting
/// for it, or being woken by it never asks a registry, whichever provider made the stream.
#[derive(Clone)]
pub struct TimelineFence {
    fence: Fence,
    timeline: std::sync::Arc<dyn Timeline>,
}

impl TimelineFence {
    /// `fence` on `timeline`; `None` if the fence belongs to another stream.
    pub fn new(fence: Fence, timeline: std::sync::Arc<dyn Timeline>) -> Option<Self> {
        (timeline.stream() == fence.stream).then_some(TimelineFence { fence, timeline })
    }

    /// The fence.
    pub fn fence(&self) -> Fence {
        self.fence
    }

    /// Its timeline.
    pub fn timeline(&self) -> &std::sync::Arc<dyn Timeline> {
        &self.timeline
    }

    /// True once the stream's completed value reached it.
    pub fn is_complete(&self) -> bool {
        self.timeline.completed() >= self.fence.value
    }

    /// Blocks until it completes or `timeout` passes; true if complete.
    pub fn wait(&self, timeout: Duration) -> bool {
        self.timeline.wait(self.fence.value, timeout)
    }

    /// Blocks until it completes, however long that takes.
    pub fn wait_until_complete(&self) {
        self.timeline.wait_until_complete(self.fence.value);
    }

    /// Calls `waker` once it completes (at once if it has).
    pub fn on_complete(&self, waker: Waker) {
        self.timeline.on_complete(self.fence.value, waker);
    }
}

impl fmt::Debug for TimelineFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TimelineFence")
            .field("fence", &self.fence)
            .field("completed", &self.timeline.completed())
            .finish()
    }
}

/// A timeline driven from the host: the stream's worker completes values in order.
pub struct HostTimeline {
    stream: StreamId,
    signalled: AtomicU64,
    completed: AtomicU64,
    wakers: Mutex<FenceQueue<Waker>>,
    changed: Condvar,
    panicked_wakers: AtomicU64,
}

impl HostTimeline {
    /// A fresh timeline at zero for `stream`.
    pub fn new(stream: StreamId) -> Self {
        HostTimeline {
            stream,
            signalled: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            wakers: Mutex::new(FenceQueue::default()),
            panicked_wakers: AtomicU64::new(0),
            changed: Condvar::new(),
        }
    }

    /// Signals the next value. Callers that must keep submission order serialise this with
    /// their hand-off to the worker.
    pub fn signal_next(&self) -> Fence {
        let value = self.signalled.fetch_add(1, Ordering::AcqRel) + 1;
        Fence {
            stream: self.stream,
            value,
        }
    }

    /// The last value signalled (0 before the first).
    pub fn signalled(&self) -> u64 {
        self.signalled.load(Ordering::Acquire)
    }

    /// Marks `value` complete (values complete in order; a lower value never lowers it),
    /// wakes every thread waiting for it, then runs the wakers of every value now complete,
    /// on this thread, outside the lock (a waker may ask to be woken again).
    pub fn complete(&self, value: u64) {
        let at = Instant::now();
        let ready = {
            let mut wakers = self.wakers.lock().unwrap_or_else(|p| p.into_inner());
            let completed = self.completed.fetch_max(value, Ordering::AcqRel).max(value);
            self.changed.notify_all();
            wakers.pop_ready(completed)
        };
        for waker in ready {
            // One waker that panics must not drop the others (their memory would never be
            // freed) nor take the completing thread down.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| waker(at))).is_err() {
                self.panicked_wakers.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Wakers that panicked (the ones after them still ran).
    pub fn panicked_wakers(&self) -> u64 {
        self.panicked_wakers.load(Ordering::Relaxed)
    }

    /// Wakers waiting for values not yet complete.
    pub fn pending_wakers(&self) -> usize {
        self.wakers.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl fmt::Debug for HostTimeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostTimeline")
            .field("stream", &self.stream)
            .field("signalled", &self.signalled())
            .field("completed", &self.completed())
            .finish()
    }
}

impl Timeline for HostTimeline {
    fn stream(&self) -> StreamId {
        self.stream
    }

    fn signalled(&self) -> u64 {
        self.signalled.load(Ordering::Acquire)
    }

    fn completed(&self) -> u64 {
        self.completed.load(Ordering::Acquire)
    }

    fn wait(&self, value: u64, timeout: Duration) -> bool {
        let deadline = Instant::now().checked_add(timeout);
        let mut guard = self.wakers.lock().unwrap_or_else(|p| p.into_inner());
        // `complete` raises the value and notifies under the lock held here between the
        // check and the wait, so no completion can slip between them.
        while self.completed() < value {
            let left = deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                return false;
            }
            guard = self
                .changed
                .wait_timeout(guard, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    fn on_complete(&self, value: u64, waker: Waker) {
        {
            let mut wakers = self.wakers.lock().unwrap_or_else(|p| p.into_inner());
            // `complete` raises the value under this lock before taking the ready wakers, so a
            // waker queued here is either seen by that call or runs below.
            if self.completed() < value {
                wakers.push(value, waker);
                return;
            }
        }
        waker(Instant::now());
    }
}

#[cfg(all(test, not(procmem_loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn values_complete_in_order_and_waiters_wake() {
        let t = Arc::new(HostTimeline::new(StreamId::fresh()));
        let f1 = t.signal_next();
        let f2 = t.signal_next();
        assert_eq!(
            (f1.value, f2.value, t.signalled(), t.completed()),
            (1, 2, 2, 0)
        );
        assert!(!t.wait(1, Duration::from_millis(1)));
        let worker = {
            let t = Arc::clone(&t);
            std::thread::spawn(move || {
                t.complete(1);
                t.complete(2);
            })
        };
        assert!(t.wait(2, Duration::from_secs(10)));
        worker.join().unwrap();
        t.complete(1);
        assert_eq!(t.completed(), 2, "completion never goes backwards");
    }

    #[test]
    fn wakers_run_once_in_value_order_on_the_completing_thread() {
        let t = Arc::new(HostTimeline::new(StreamId::fresh()));
        let log = Arc::new(Mutex::new(Vec::new()));
        let push = |tag: &'static str| {
            let log = Arc::clone(&log);
            Box::new(move |_: Instant| log.lock().unwrap().push(tag)) as Waker
        };
        t.on_complete(2, push("two"));
        t.on_complete(1, push("one"));
        t.on_complete(u64::MAX, push("never"));
        t.on_complete(0, push("zero-now"));
        assert_eq!(*log.lock().unwrap(), vec!["zero-now"]);
        t.complete(1);
        t.complete(3);
        t.complete(2);
        assert_eq!(*log.lock().unwrap(), vec!["zero-now", "one", "two"]);
        assert_eq!(t.pending_wakers(), 1, "u64::MAX is still waited for");
        t.complete(u64::MAX);
        assert_eq!(t.pending_wakers(), 0);
        assert_eq!(log.lock().unwrap().last(), Some(&"never"));
    }

    /// Review finding: a panicking waker dropped the wakers after it and could take the
    /// stream's thread down.
    #[test]
    fn a_panicking_waker_does_not_stop_the_others() {
        let t = HostTimeline::new(StreamId::fresh());
        let hits = Arc::new(AtomicU64::new(0));
        t.on_complete(1, Box::new(|_| panic!("a waker that panics")));
        let h = Arc::clone(&hits);
        t.on_complete(
            1,
            Box::new(move |_| {
                h.fetch_add(1, Ordering::SeqCst);
            }),
        );
        t.complete(1);
        assert_eq!((hits.load(Ordering::SeqCst), t.panicked_wakers()), (1, 1));
    }

    #[test]
    fn a_waker_may_wait_again_on_its_own_timeline() {
        let t = Arc::new(HostTimeline::new(StreamId::fresh()));
        let hits = Arc::new(AtomicU64::new(0));
        let (t2, h2) = (Arc::clone(&t), Arc::clone(&hits));
        t.on_complete(
            1,
            Box::new(move |_| {
                h2.fetch_add(1, Ordering::SeqCst);
                let h3 = Arc::clone(&h2);
                t2.on_complete(
                    2,
                    Box::new(move |_| {
                        h3.fetch_add(10, Ordering::SeqCst);
                    }),
                );
            }),
        );
        t.complete(1);
        assert_eq!(hits.load(Ordering::SeqCst), 1);
        t.complete(2);
        assert_eq!(hits.load(Ordering::SeqCst), 11);
    }

    #[test]
    fn a_timeline_fence_refuses_another_streams_timeline() {
        let (a, b) = (
            Arc::new(HostTimeline::new(StreamId::fresh())),
            Arc::new(HostTimeline::new(StreamId::fresh())),
        );
        let f = a.signal_next();
        assert!(TimelineFence::new(f, b).is_none());
        let tf = TimelineFence::new(f, a.clone()).unwrap();
        assert!(!tf.is_complete());
        a.complete(f.value);
        assert!(tf.is_complete());
    }
}

/// Every interleaving of completers and waiters, explored by loom: no wake-up is lost, values
/// never go backwards, and concurrent submissions get distinct values.
#[cfg(all(test, procmem_loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    const FOREVER: Duration = Duration::from_secs(3600);

    #[test]
    fn loom_a_waiter_always_wakes_for_its_value() {
        loom::model(|| {
            let t = Arc::new(HostTimeline::new(StreamId::fresh()));
            let (f1, f2) = (t.signal_next(), t.signal_next());
            let worker = {
                let t = Arc::clone(&t);
                thread::spawn(move || {
                    t.complete(f1.value);
                    t.complete(f2.value);
                })
            };
            assert!(t.wait(f2.value, FOREVER));
            assert!(t.completed() >= f2.value);
            worker.join().unwrap();
        });
    }

    #[test]
    fn loom_two_waiters_wake_when_a_later_value_completes_first() {
        loom::model(|| {
            let t = Arc::new(HostTimeline::new(StreamId::fresh()));
            let (f1, f2) = (t.signal_next(), t.signal_next());
            let waiter = {
                let t = Arc::clone(&t);
                thread::spawn(move || assert!(t.wait(f1.value, FOREVER)))
            };
            let completer = {
                let t = Arc::clone(&t);
                thread::spawn(move || {
                    t.complete(f2.value);
                    t.complete(f1.value);
                })
            };
            assert!(t.wait(f2.value, FOREVER));
            waiter.join().unwrap();
            completer.join().unwrap();
            assert_eq!(
                t.completed(),
                f2.value,
                "a lower completion never lowers it"
            );
        });
    }

    #[test]
    fn loom_a_waker_set_while_its_value_completes_runs_exactly_once() {
        loom::model(|| {
            let t = Arc::new(HostTimeline::new(StreamId::fresh()));
            let f = t.signal_next();
            let hits = Arc::new(AtomicU64::new(0));
            let completer = {
                let t = Arc::clone(&t);
                thread::spawn(move || t.complete(f.value))
            };
            let h = Arc::clone(&hits);
            t.on_complete(
                f.value,
                Box::new(move |_| {
                    h.fetch_add(1, Ordering::SeqCst);
                }),
            );
            completer.join().unwrap();
            assert_eq!(hits.load(Ordering::SeqCst), 1, "never lost, never twice");
        });
    }

    #[test]
    fn loom_concurrent_submissions_get_distinct_values() {
        loom::model(|| {
            let t = Arc::new(HostTimeline::new(StreamId::fresh()));
            let other = {
                let t = Arc::clone(&t);
                thread::spawn(move || t.signal_next().value)
            };
            let mine = t.signal_next().value;
            let theirs = other.join().unwrap();
            assert_ne!(mine, theirs);
            assert_eq!(mine.max(theirs), 2);
            assert_eq!(t.signalled(), 2);
        });
    }
}
