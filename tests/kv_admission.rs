//! The disk tier's admission filter against an exact reference: every key's count, saturated
//! and aged the way the sketch's counters are. The sketch may over-estimate (keys sharing a
//! counter in every row) but never under-estimate, so a block asked for `min_hits` times is
//! always admitted; where a key has a counter of its own in some row the estimate is exact, so
//! a one-off with a counter of its own is always refused.

use std::collections::{HashMap, HashSet};

use procmem::kv::frequency::{Admission, AdmissionFilter, FrequencySketch, MAX_COUNT, ROWS};
use proptest::prelude::*;

/// Exact counts with the sketch's saturation and halving.
#[derive(Default)]
struct Reference {
    counts: HashMap<u64, u8>,
}

impl Reference {
    fn record(&mut self, key: u64) {
        let c = self.counts.entry(key).or_default();
        *c = (*c + 1).min(MAX_COUNT);
    }

    fn halve(&mut self) {
        for c in self.counts.values_mut() {
            *c /= 2;
        }
    }

    fn count(&self, key: u64) -> u8 {
        self.counts.get(&key).copied().unwrap_or(0)
    }
}

/// Whether `key` has a counter no other recorded key uses, in some row.
fn has_own_counter(sketch: &FrequencySketch, key: u64, keys: &HashSet<u64>) -> bool {
    (0..ROWS).any(|row| {
        let slot = sketch.slot(key, row);
        keys.iter()
            .filter(|k| **k != key)
            .all(|k| sketch.slot(*k, row) != slot)
    })
}

fn keys() -> impl Strategy<Value = Vec<u64>> {
    // A small hot set (many repeats, counters shared often) mixed with arbitrary keys.
    prop::collection::vec(prop_oneof![0u64..48, any::<u64>()], 0..1500)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn the_sketch_never_under_counts_and_is_exact_on_a_counter_of_its_own(
        stream in keys(),
        capacity in 0usize..64,
    ) {
        let mut sketch = FrequencySketch::new(capacity);
        let mut reference = Reference::default();
        let mut seen = HashSet::new();
        for key in &stream {
            seen.insert(*key);
            reference.record(*key);
            if sketch.record(*key) {
                reference.halve();
            }
        }
        for key in &seen {
            let (estimate, truth) = (sketch.estimate(*key), reference.count(*key));
            prop_assert!(estimate >= truth, "key {key}: estimate {estimate} < truth {truth}");
            if has_own_counter(&sketch, *key, &seen) {
                prop_assert_eq!(estimate, truth, "key {} has a counter of its own", key);
            }
        }
    }

    #[test]
    fn a_block_asked_for_enough_is_admitted_and_a_private_one_off_is_not(
        stream in keys(),
        min_hits in 1u8..5,
    ) {
        let mut filter = AdmissionFilter::new(1024, min_hits);
        let mut reference = Reference::default();
        let mut seen = HashSet::new();
        let mut probe = FrequencySketch::new(1024);
        for key in &stream {
            seen.insert(*key);
            filter.record(*key);
            reference.record(*key);
            if probe.record(*key) {
                reference.halve();
            }
        }
        let mut refused = 0;
        for key in &seen {
            let truth = reference.count(*key);
            let verdict = filter.admit(*key, None);
            if truth >= min_hits {
                prop_assert_eq!(verdict, Admission::Admit, "key {} asked for {} times", key, truth);
            } else if has_own_counter(filter.sketch(), *key, &seen) {
                prop_assert_eq!(verdict, Admission::TooRare, "key {} asked for {} times", key, truth);
            }
            if verdict != Admission::Admit {
                refused += 1;
            }
        }
        prop_assert_eq!(filter.refused(), refused);
    }

    #[test]
    fn a_full_tier_admits_only_ahead_of_a_colder_victim(
        stream in keys(),
        candidate in 0u64..48,
        victim in 0u64..48,
    ) {
        let mut filter = AdmissionFilter::new(1024, 2);
        for key in &stream {
            filter.record(*key);
        }
        let (fc, fv) = (filter.frequency(candidate), filter.frequency(victim));
        let verdict = filter.admit(candidate, Some(victim));
        let expected = if fc < 2 {
            Admission::TooRare
        } else if fv >= fc {
            Admission::ColderThanVictim
        } else {
            Admission::Admit
        };
        prop_assert_eq!(verdict, expected);
    }
}
