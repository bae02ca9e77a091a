//! Which memory a KV store gives back under pressure, pure.
//!
//! Freeing scattered tokens frees nothing (pages stay mapped), so victims are whole units:
//! cached prefixes nobody maps any more (the least used first: a block mapped again by many
//! sequences, a system prompt, outlives a burst's one-off blocks however recent those are; the
//! least recently used among equals), then whole sequences,
//! lowest priority first and, among equals, the most recently admitted first (as vLLM does).
//! A sequence whose kernel is in flight is never chosen.
//!
//! Why the newest first: the oldest admitted sequence (of the lowest priority) is then chosen
//! only when nothing else is left, so it always makes progress and finishes, and its memory
//! goes back; a sequence restored after a preemption keeps its admission place, so it is not
//! taken again ahead of sequences admitted after it (no two sequences evict each other in
//! turn). Choosing the largest first, as this did before, threw away the most work and let
//! victims take turns for ever.

/// A cached prefix the store could drop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixCandidate<K> {
    /// Its key.
    pub key: K,
    /// Physical bytes freed if dropped.
    pub bytes: u64,
    /// When it was last used (larger is more recent).
    pub last_used: u64,
    /// How often sequences mapped it again since it was written (aged by the cache: halved
    /// now and then, so a prompt hot long ago does not stay for ever).
    pub hits: u32,
    /// Whether any sequence still maps it (then dropping it frees nothing).
    pub referenced: bool,
}

/// A sequence the store could preempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceCandidate<S> {
    /// Its id.
    pub id: S,
    /// Physical bytes it owns alone.
    pub bytes: u64,
    /// Its priority (higher is more important).
    pub priority: u32,
    /// Whether a kernel or a step uses it now.
    pub in_flight: bool,
    /// Its place in admission order (larger is more recent).
    pub admitted: u64,
}

/// One unit to free.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Victim<K, S> {
    /// Drop a cached prefix.
    Prefix(K),
    /// Preempt a sequence.
    Sequence(S),
}

/// Picks victims until `wanted` bytes are covered or nothing eligible is left.
pub fn choose_victims<K: Clone, S: Clone>(
    wanted: u64,
    prefixes: &[PrefixCandidate<K>],
    sequences: &[SequenceCandidate<S>],
) -> Vec<Victim<K, S>> {
    let mut out = Vec::new();
    let mut covered = 0u64;
    let mut free_prefixes: Vec<_> = prefixes
        .iter()
        .filter(|p| !p.referenced && p.bytes > 0)
        .collect();
    free_prefixes.sort_by_key(|p| (p.hits, p.last_used));
    for p in free_prefixes {
        if covered >= wanted {
            return out;
        }
        covered += p.bytes;
        out.push(Victim::Prefix(p.key.clone()));
    }
    let mut seqs: Vec<_> = sequences
        .iter()
        .filter(|s| !s.in_flight && s.bytes > 0)
        .collect();
    seqs.sort_by(|a, b| {
        a.priority
            .cmp(&b.priority)
            .then(b.admitted.cmp(&a.admitted))
    });
    for s in seqs {
        if covered >= wanted {
            break;
        }
        covered += s.bytes;
        out.push(Victim::Sequence(s.id.clone()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(key: u32, bytes: u64, last_used: u64, referenced: bool) -> PrefixCandidate<u32> {
        PrefixCandidate {
            key,
            bytes,
            last_used,
            hits: 0,
            referenced,
        }
    }

    fn s(id: u32, bytes: u64, priority: u32, in_flight: bool) -> SequenceCandidate<u32> {
        SequenceCandidate {
            id,
            bytes,
            priority,
            in_flight,
            // Ids are given in admission order here.
            admitted: u64::from(id),
        }
    }

    #[test]
    fn unreferenced_prefixes_first_least_recent_first() {
        let prefixes = [p(1, 100, 5, false), p(2, 100, 1, false), p(3, 500, 0, true)];
        let seqs = [s(10, 1000, 0, false)];
        assert_eq!(
            choose_victims(150, &prefixes, &seqs),
            vec![Victim::Prefix(2), Victim::Prefix(1)]
        );
        assert_eq!(
            choose_victims(250, &prefixes, &seqs),
            vec![Victim::Prefix(2), Victim::Prefix(1), Victim::Sequence(10)]
        );
    }

    /// A system prompt mapped again by many sequences outlives a burst's one-off blocks, even
    /// those older than it was last used; among blocks used alike, the least recent goes.
    #[test]
    fn a_hot_prefix_outlives_recent_one_off_blocks() {
        let hot = PrefixCandidate {
            hits: 7,
            ..p(1, 100, 1, false)
        };
        let prefixes = [hot, p(2, 100, 9, false), p(3, 100, 8, false)];
        assert_eq!(
            choose_victims::<u32, u32>(200, &prefixes, &[]),
            vec![Victim::Prefix(3), Victim::Prefix(2)]
        );
        assert_eq!(
            choose_victims::<u32, u32>(300, &prefixes, &[]).last(),
            Some(&Victim::Prefix(1)),
            "the hot block goes last"
        );
    }

    #[test]
    fn sequences_lowest_priority_first_newest_first_never_in_flight() {
        let seqs = [
            s(1, 100, 5, false),
            s(2, 300, 1, true),
            s(3, 400, 1, false),
            s(4, 200, 1, false),
        ];
        assert_eq!(
            choose_victims::<u32, u32>(500, &[], &seqs),
            vec![Victim::Sequence(4), Victim::Sequence(3)],
            "the newest of the lowest priority first, whatever its size"
        );
        let all = choose_victims::<u32, u32>(u64::MAX, &[], &seqs);
        assert!(
            !all.contains(&Victim::Sequence(2)),
            "an in-flight sequence is never a victim"
        );
        assert_eq!(all.len(), 3);
    }

    #[test]
    fn nothing_eligible_means_nothing_chosen() {
        assert!(choose_victims(100, &[p(1, 10, 0, true)], &[s(1, 10, 0, true)]).is_empty());
        assert!(choose_victims::<u32, u32>(0, &[p(1, 10, 0, false)], &[]).is_empty());
    }
}
