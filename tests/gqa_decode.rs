//! The fast decode operator (split-KV across threads, a KV row read once per query group,
//! vector code) against the plain reference on random shapes and values, `f32` and `f16`.
//! Outputs are weighted averages of values in [-1, 1]; each must be within 1e-4 relative of
//! the reference's (relative to the element, and never tighter than 1e-4 absolute).

use procmem::kv::{f16, gqa_decode, gqa_decode_plain, Heads, SPLIT_TOKENS};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    tokens: usize,
    kv_heads: usize,
    group: usize,
    head_dim: usize,
    /// Scales the queries: large values make a peaked softmax, small a flat one.
    sharpness: f32,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        // Up to several splits, and the edges around one split.
        prop_oneof![
            1usize..40,
            (SPLIT_TOKENS - 2)..(SPLIT_TOKENS + 3),
            40usize..(4 * SPLIT_TOKENS + 17)
        ],
        1usize..5,
        prop_oneof![Just(1usize), Just(2), Just(3), Just(4), Just(5), Just(8)],
        // Whole vectors (the fast path) and odd head sizes (its fallback).
        prop_oneof![Just(8usize), Just(16), Just(64), Just(128), 1usize..24],
        prop_oneof![Just(0.05f32), Just(1.0), Just(6.0)],
        any::<u64>(),
    )
        .prop_map(
            |(tokens, kv_heads, group, head_dim, sharpness, seed)| Case {
                tokens,
                kv_heads,
                group,
                head_dim,
                sharpness,
                seed,
            },
        )
}

/// Deterministic values in [-1, 1] (splitmix64).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn close(fast: &[f32], plain: &[f32]) -> Result<(), TestCaseError> {
    for (i, (a, b)) in fast.iter().zip(plain).enumerate() {
        prop_assert!(
            (a - b).abs() <= 1e-4 * b.abs().max(1.0),
            "element {}: fast {} vs plain {}",
            i,
            a,
            b
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn the_fast_operator_equals_the_plain_reference(c in case()) {
        let q_heads = c.kv_heads * c.group;
        let row = c.kv_heads * c.head_dim;
        let q: Vec<f32> = values(q_heads * c.head_dim, c.seed)
            .iter()
            .map(|x| x * c.sharpness)
            .collect();
        let k = values(c.tokens * row, c.seed ^ 1);
        let v = values(c.tokens * row, c.seed ^ 2);
        let mut fast = vec![0f32; q_heads * c.head_dim];
        let mut plain = vec![0f32; q_heads * c.head_dim];
        gqa_decode(&q, &k, &v, c.tokens, Heads::new(q_heads, c.kv_heads, c.head_dim), &mut fast);
        gqa_decode_plain(&q, &k, &v, c.tokens, Heads::new(q_heads, c.kv_heads, c.head_dim), &mut plain);
        close(&fast, &plain)?;

        let k16: Vec<f16> = k.iter().map(|x| f16::from_f32(*x)).collect();
        let v16: Vec<f16> = v.iter().map(|x| f16::from_f32(*x)).collect();
        gqa_decode(&q, &k16, &v16, c.tokens, Heads::new(q_heads, c.kv_heads, c.head_dim), &mut fast);
        gqa_decode_plain(&q, &k16, &v16, c.tokens, Heads::new(q_heads, c.kv_heads, c.head_dim), &mut plain);
        close(&fast, &plain)?;
    }
}

/// The split points do not depend on the thread count: one thread and the machine's pool give
/// the same bits.
#[test]
fn the_result_does_not_depend_on_the_thread_count() {
    let (tokens, kv_heads, group, head_dim) = (5 * SPLIT_TOKENS + 3, 2, 4, 64);
    let q_heads = kv_heads * group;
    let q = values(q_heads * head_dim, 7);
    let k = values(tokens * kv_heads * head_dim, 8);
    let v = values(tokens * kv_heads * head_dim, 9);
    let mut pooled = vec![0f32; q_heads * head_dim];
    gqa_decode(
        &q,
        &k,
        &v,
        tokens,
        Heads::new(q_heads, kv_heads, head_dim),
        &mut pooled,
    );
    let single = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(|| {
            let mut out = vec![0f32; q_heads * head_dim];
            gqa_decode(
                &q,
                &k,
                &v,
                tokens,
                Heads::new(q_heads, kv_heads, head_dim),
                &mut out,
            );
            out
        });
    assert_eq!(pooled, single);
}
