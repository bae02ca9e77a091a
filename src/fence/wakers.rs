//! A stream's queue of items waiting for points on its timeline (the timeline's wakers).

use std::collections::BTreeMap;

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
