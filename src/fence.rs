//! Fences: host-observable points on a stream's timeline.
//!
//! Every stream owns a `u64` timeline. Submitting work signals the next value; the value
//! completes when that work (and everything before it on the stream) has finished. The host
//! can read the completed value at any time and wait for a value to complete.

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

/// Identity of one device stream (a CPU worker thread, a CUDA stream).
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
}

/// A timeline driven from the host: the stream's worker completes values in order.
#[derive(Debug)]
pub struct HostTimeline {
    stream: StreamId,
    signalled: AtomicU64,
    completed: AtomicU64,
    lock: Mutex<()>,
    changed: Condvar,
}

impl HostTimeline {
    /// A fresh timeline at zero for `stream`.
    pub fn new(stream: StreamId) -> Self {
        HostTimeline {
            stream,
            signalled: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            lock: Mutex::new(()),
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

    /// Marks `value` complete (values complete in order; a lower value never lowers it).
    pub fn complete(&self, value: u64) {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.completed.fetch_max(value, Ordering::AcqRel);
        self.changed.notify_all();
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
        let mut guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
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
