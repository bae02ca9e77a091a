//! Fences: host-observable points on a stream's timeline.
//!
//! Every stream owns a `u64` timeline. Submitting work signals the next value; the value
//! completes when that work (and everything before it on the stream) has finished. The host
//! can read the completed value at any time and wait for a value to complete.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// Identity of one device stream (a CPU worker thread, a CUDA stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(u64);

impl StreamId {
    /// A process-unique fresh identity.
    pub fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        StreamId(NEXT.fetch_add(1, Ordering::Relaxed))
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
        let guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let (_guard, _) = self
            .changed
            .wait_timeout_while(guard, timeout, |_| self.completed() < value)
            .unwrap_or_else(|p| p.into_inner());
        self.completed() >= value
    }
}

#[cfg(test)]
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
