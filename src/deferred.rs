//! Deferred-free decisions, pure: when may an allocation used on several streams be freed,
//! and which fence it still waits for.

use std::collections::BTreeMap;

use crate::fence::{Fence, StreamId};

/// Where an allocation waiting to be freed should go next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Every fence that used it has completed: free it now.
    FreeNow,
    /// This fence is still pending: wait on its stream.
    WaitOn(Fence),
}

/// Decides the route for an allocation last used at `fences`, given each stream's completed
/// value (`Fenced` reads it from the timeline stored with each fence, never from a registry).
/// The first pending fence is returned; once it completes the allocation is routed again, so
/// it is freed only after *every* fence has completed.
pub fn route(
    fences: impl IntoIterator<Item = Fence>,
    completed: impl Fn(StreamId) -> u64,
) -> Route {
    fences
        .into_iter()
        .find(|f| completed(f.stream) < f.value)
        .map_or(Route::FreeNow, Route::WaitOn)
}

/// One stream's queue of items waiting for values on its timeline, released in fence order
/// (then arrival order).
#[derive(Debug)]
pub struct FenceQueue<T> {
    next_seq: u64,
    entries: BTreeMap<(u64, u64), T>,
}

impl<T> Default for FenceQueue<T> {
    fn default() -> Self {
        FenceQueue {
            next_seq: 0,
            entries: BTreeMap::new(),
        }
    }
}

impl<T> FenceQueue<T> {
    /// Queues `item` until `value` completes.
    pub fn push(&mut self, value: u64, item: T) {
        self.entries.insert((value, self.next_seq), item);
        self.next_seq = self.next_seq.wrapping_add(1);
    }

    /// Takes every item whose value is at or below `completed`, in order.
    pub fn pop_ready(&mut self, completed: u64) -> Vec<T> {
        let Some(first_pending) = completed.checked_add(1) else {
            return self.drain_all();
        };
        let pending = self.entries.split_off(&(first_pending, 0));
        std::mem::replace(&mut self.entries, pending)
            .into_values()
            .collect()
    }

    /// Takes everything, in order (a stream shutting down after its last fence).
    pub fn drain_all(&mut self) -> Vec<T> {
        std::mem::take(&mut self.entries).into_values().collect()
    }

    /// Items waiting.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frees_only_after_every_stream_completes() {
        let (a, b) = (StreamId::fresh(), StreamId::fresh());
        let fences = [
            Fence {
                stream: a,
                value: 3,
            },
            Fence {
                stream: b,
                value: 7,
            },
        ];
        let done = |ca: u64, cb: u64| move |s: StreamId| if s == a { ca } else { cb };
        assert_eq!(route(fences, done(2, 7)), Route::WaitOn(fences[0]));
        assert_eq!(route(fences, done(3, 6)), Route::WaitOn(fences[1]));
        assert_eq!(route(fences, done(3, 7)), Route::FreeNow);
        assert_eq!(route([], done(0, 0)), Route::FreeNow);
    }

    #[test]
    fn queue_releases_in_fence_order() {
        let mut q = FenceQueue::default();
        q.push(5, "e");
        q.push(2, "b");
        q.push(2, "c");
        q.push(1, "a");
        assert_eq!(q.pop_ready(0), Vec::<&str>::new());
        assert_eq!(q.pop_ready(2), vec!["a", "b", "c"]);
        assert_eq!(q.len(), 1);
        assert_eq!(q.drain_all(), vec!["e"]);
    }

    /// Defect (issue 11, 2): `pop_ready(u64::MAX)` computed `completed + 1` and panicked.
    #[test]
    fn queue_pops_everything_at_the_end_of_the_timeline() {
        let mut q = FenceQueue::default();
        q.push(u64::MAX, "last");
        q.push(3, "early");
        assert_eq!(q.pop_ready(u64::MAX - 1), vec!["early"]);
        assert_eq!(q.pop_ready(u64::MAX), vec!["last"]);
        assert!(q.is_empty());
    }
}
