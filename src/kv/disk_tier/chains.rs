//! Which blocks a tier keeps as chains: a prompt's blocks are only of use from its first
//! (whose parent is the root, key 0) on, so a block is dropped only once no block on disk
//! names it as its parent (a chain loses its tail before its head, and a child never outlives
//! its parent on disk through the tier's own choice), and a block no chain on disk reaches
//! is not kept across a restart.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

use super::Entry;

/// The parent of a prompt's first block.
pub(super) const ROOT: u64 = 0;

/// The keys of the blocks no chain from the root reaches (a parent not on disk, or a cycle
/// of parents a hostile index made up).
pub(super) fn unreachable(entries: &HashMap<u64, Entry>) -> Vec<u64> {
    let mut children: HashMap<u64, Vec<u64>> = HashMap::new();
    for (key, e) in entries {
        children.entry(e.parent).or_default().push(*key);
    }
    let mut reached = HashSet::new();
    let mut next = vec![ROOT];
    while let Some(parent) = next.pop() {
        for child in children.remove(&parent).unwrap_or_default() {
            if reached.insert(child) {
                next.push(child);
            }
        }
    }
    entries
        .keys()
        .filter(|k| !reached.contains(*k))
        .copied()
        .collect()
}

/// The blocks whose chain runs through `key` (its children, theirs, ...), `key` not included.
pub(super) fn after(entries: &HashMap<u64, Entry>, key: u64) -> Vec<u64> {
    let mut children: HashMap<u64, Vec<u64>> = HashMap::new();
    for (k, e) in entries {
        children.entry(e.parent).or_default().push(*k);
    }
    let (mut out, mut seen, mut next) = (Vec::new(), HashSet::from([key]), vec![key]);
    while let Some(parent) = next.pop() {
        for child in children.remove(&parent).unwrap_or_default() {
            if seen.insert(child) {
                out.push(child);
                next.push(child);
            }
        }
    }
    out
}

/// Blocks to drop until `free` bytes reach `want`, least recently used first among those no
/// block on disk names as its parent (dropping one may make its parent such a block).
/// `spare` (the parent of a block being put) is never chosen, and so neither is any block
/// before it in its chain. `None` where that cannot free enough.
pub(super) fn victims(
    entries: &HashMap<u64, Entry>,
    mut free: u64,
    want: u64,
    spare: Option<u64>,
) -> Option<Vec<u64>> {
    let mut out = Vec::new();
    if free >= want {
        return Some(out);
    }
    let mut children: HashMap<u64, usize> = HashMap::new();
    for (key, e) in entries {
        if e.parent != *key && entries.contains_key(&e.parent) {
            *children.entry(e.parent).or_default() += 1;
        }
    }
    let leaf = |key: &u64, e: &Entry| Reverse((e.last_use, *key));
    let mut leaves: BinaryHeap<_> = entries
        .iter()
        .filter(|(k, _)| !children.contains_key(*k) && Some(**k) != spare)
        .map(|(k, e)| leaf(k, e))
        .collect();
    while free < want {
        let Reverse((_, key)) = leaves.pop()?;
        let e = &entries[&key];
        free = free.saturating_add(e.bytes);
        out.push(key);
        if let Some(left) = children.get_mut(&e.parent) {
            *left -= 1;
            if *left == 0 && Some(e.parent) != spare {
                leaves.push(leaf(&e.parent, &entries[&e.parent]));
            }
        }
    }
    Some(out)
}
