//! The digest a node publishes to routers, against the exact set of keys it was built from:
//! no key held is ever missed (alone, merged, or after a round trip through its frame), a
//! prompt's leading match is never shorter than the exact one, and at 1,000 keys a key not
//! held is found at most a few times in a thousand.

use std::collections::HashSet;

use procmem::kv::{prompt_keys, PrefixDigest};
use proptest::prelude::*;

fn digest_of(keys: &HashSet<u64>, block_tokens: usize) -> PrefixDigest {
    let mut d = PrefixDigest::new(block_tokens);
    for k in keys {
        d.insert(*k);
    }
    d
}

proptest! {
    #[test]
    fn no_key_held_is_missed(
        a in proptest::collection::hash_set(any::<u64>(), 0..2000),
        b in proptest::collection::hash_set(any::<u64>(), 0..2000),
    ) {
        let (da, db) = (digest_of(&a, 16), digest_of(&b, 16));
        prop_assert!(a.iter().all(|k| da.may_hold(*k)));
        let mut merged = da.clone();
        prop_assert!(merged.merge(&db));
        prop_assert!(a.iter().chain(&b).all(|k| merged.may_hold(*k)));
        prop_assert_eq!(merged.blocks(), (a.len() + b.len()) as u64);
        // Through its frame's parts and back.
        let back = PrefixDigest::from_parts(16, merged.bits().to_vec(), merged.blocks());
        prop_assert_eq!(back.as_ref(), Some(&merged));
    }

    #[test]
    fn a_prompts_leading_match_is_never_shorter_than_the_exact_one(
        prompts in proptest::collection::vec(proptest::collection::vec(0u32..8, 0..96), 1..20),
        probe in proptest::collection::vec(0u32..8, 0..96),
        block in 1usize..20,
    ) {
        let held: HashSet<u64> = prompts.iter().flat_map(|p| prompt_keys(p, block)).collect();
        let digest = digest_of(&held, block);
        let keys = prompt_keys(&probe, block);
        let exact = keys.iter().take_while(|k| held.contains(k)).count();
        prop_assert!(digest.leading(&keys) >= exact);
    }
}

#[test]
fn a_thousand_keys_give_few_false_positives() {
    // Fixed keys (a seeded generator), so the figure is the same on every run.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let held: HashSet<u64> = (0..1000).map(|_| next()).collect();
    let digest = digest_of(&held, 16);
    let probes = 100_000;
    let found = (0..probes)
        .map(|_| next())
        .filter(|k| !held.contains(k) && digest.may_hold(*k))
        .count();
    // The expected rate is (1 - e^(-4 x 1000 / 16384))^4, about 0.0022.
    eprintln!(
        "digest_false_positives: {found} of {probes} keys not held found, {:.1}% of bits set",
        digest.fill() * 100.0
    );
    assert!(found < probes / 200, "{found} of {probes} found");
    assert!(
        digest.fill() > 0.15 && digest.fill() < 0.25,
        "{}",
        digest.fill()
    );
}
