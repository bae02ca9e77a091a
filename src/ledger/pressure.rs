//! The Governor's waiting and pressure decisions, pure: who waits in which order, how many
//! bytes to ask for, and which holder to ask next. The Governor never picks a victim; it only
//! picks whom to *ask*, and each holder decides what (if anything) to free.

use std::collections::{BTreeMap, BTreeSet};

use super::{HolderId, Priority};

/// Requests waiting for room, served by priority (highest first), then by arrival.
#[derive(Debug)]
pub struct WaitQueue<T> {
    next_seq: u64,
    entries: BTreeMap<(std::cmp::Reverse<Priority>, u64), (u64, T)>,
    bytes: u64,
}

impl<T> Default for WaitQueue<T> {
    fn default() -> Self {
        WaitQueue {
            next_seq: 0,
            entries: BTreeMap::new(),
            bytes: 0,
        }
    }
}

impl<T> WaitQueue<T> {
    /// Queues `item` wanting `bytes` at `priority`; returns its ticket in the queue.
    pub fn push(&mut self, priority: Priority, bytes: u64, item: T) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.entries
            .insert((std::cmp::Reverse(priority), seq), (bytes, item));
        self.bytes += bytes;
        seq
    }

    /// The first in line: its sequence number, bytes and item.
    pub fn front(&self) -> Option<(u64, u64, &T)> {
        self.entries
            .iter()
            .next()
            .map(|((_, seq), (bytes, item))| (*seq, *bytes, item))
    }

    /// The priority of the first in line.
    pub fn front_priority(&self) -> Option<Priority> {
        self.entries.keys().next().map(|(p, _)| p.0)
    }

    /// Takes the first in line.
    pub fn pop_front(&mut self) -> Option<(u64, T)> {
        let (key, (bytes, item)) = self.entries.pop_first()?;
        self.bytes -= bytes;
        Some((key.1, item))
    }

    /// Takes the entry with sequence number `seq`, wherever it is.
    pub fn remove(&mut self, seq: u64) -> Option<T> {
        let key = *self.entries.keys().find(|(_, s)| *s == seq)?;
        let (bytes, item) = self.entries.remove(&key)?;
        self.bytes -= bytes;
        Some(item)
    }

    /// Removes every entry for which `drop_it` says yes, returning them.
    pub fn drain_where(&mut self, mut drop_it: impl FnMut(&T) -> bool) -> Vec<T> {
        let keys: Vec<_> = self
            .entries
            .iter()
            .filter(|(_, (_, item))| drop_it(item))
            .map(|(k, _)| *k)
            .collect();
        keys.into_iter()
            .filter_map(|k| self.entries.remove(&k))
            .map(|(bytes, item)| {
                self.bytes -= bytes;
                item
            })
            .collect()
    }

    /// Bytes wanted by everyone waiting.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// How many wait.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nobody waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// One round of pressure: the holders already asked and what they promised.
#[derive(Debug, Default, Clone)]
pub struct PressureRound {
    asked: BTreeSet<HolderId>,
    promised_unreleased: u64,
}

impl PressureRound {
    /// Records that `holder` was asked.
    pub fn asked(&mut self, holder: HolderId) {
        self.asked.insert(holder);
    }

    /// Records a report: bytes freed now or pending a fence will come back as releases.
    pub fn promised(&mut self, bytes: u64) {
        self.promised_unreleased = self.promised_unreleased.saturating_add(bytes);
    }

    /// Records a release: part of what was promised has arrived.
    pub fn released(&mut self, bytes: u64) {
        self.promised_unreleased = self.promised_unreleased.saturating_sub(bytes);
    }

    /// Bytes still to ask for, given the current `shortfall`: what was promised but has not
    /// been released yet is expected, so it is not asked for twice.
    pub fn still_wanted(&self, shortfall: u64) -> u64 {
        shortfall.saturating_sub(self.promised_unreleased)
    }

    /// Whom to ask next among `holders` (id, priority, approved bytes): the least important
    /// first, then the one holding the most, skipping holders already asked and those holding
    /// nothing (they have nothing accounted to give back).
    pub fn next_holder(&self, holders: &[(HolderId, Priority, u64)]) -> Option<HolderId> {
        holders
            .iter()
            .filter(|(id, _, bytes)| *bytes > 0 && !self.asked.contains(id))
            .min_by(|a, b| a.1.cmp(&b.1).then(b.2.cmp(&a.2)).then(a.0.cmp(&b.0)))
            .map(|(id, _, _)| *id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_serves_priority_then_arrival() {
        let mut q = WaitQueue::default();
        q.push(1, 10, "low-first");
        q.push(5, 20, "high");
        q.push(1, 30, "low-second");
        q.push(5, 40, "high-second");
        assert_eq!(q.bytes(), 100);
        let order: Vec<_> = std::iter::from_fn(|| q.pop_front().map(|(_, x)| x)).collect();
        assert_eq!(
            order,
            vec!["high", "high-second", "low-first", "low-second"]
        );
        assert_eq!(q.bytes(), 0);
    }

    #[test]
    fn queue_removes_by_sequence_and_predicate() {
        let mut q = WaitQueue::default();
        let a = q.push(1, 10, 'a');
        q.push(1, 20, 'b');
        q.push(1, 30, 'c');
        assert_eq!(q.remove(a), Some('a'));
        assert_eq!(q.drain_where(|x| *x == 'c'), vec!['c']);
        assert_eq!((q.len(), q.bytes()), (1, 20));
    }

    #[test]
    fn pressure_asks_least_important_biggest_first_and_never_twice() {
        let ids: Vec<HolderId> = (1..=4).map(HolderId).collect();
        let holders = vec![
            (ids[0], 5, 900),
            (ids[1], 1, 100),
            (ids[2], 1, 300),
            (ids[3], 0, 0),
        ];
        let mut round = PressureRound::default();
        let mut order = Vec::new();
        while let Some(h) = round.next_holder(&holders) {
            round.asked(h);
            order.push(h);
        }
        assert_eq!(
            order,
            vec![ids[2], ids[1], ids[0]],
            "empty holders are never asked"
        );
        round.promised(150);
        assert_eq!(round.still_wanted(200), 50);
        round.released(100);
        assert_eq!(round.still_wanted(200), 150);
    }
}
