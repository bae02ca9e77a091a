//! The decode operator's key tile: its dot products in AVX2 + FMA registers where the crate is
//! built for them (the default, x86-64-v3), else as a plain loop.
//!
//! The portable key loop is vectorised by the compiler only for some tile shapes: a tile of
//! three query heads (SmolLM2's group: 9 query heads over 3 KV heads) came out as scalar code
//! with its accumulators spilled to the stack, and a causal prefill spent half its time there.
//! [`key_lanes`] on AVX2 is the same loop written with the vector operations themselves: lane
//! `l` of each accumulator takes `q[c + l] * k[c + l]` fused into it, chunk after chunk, the
//! operations the portable loop does, so the sums are the same bits.

#[cfg(all(
    target_arch = "x86_64",
    any(test, all(target_feature = "avx2", target_feature = "fma"))
))]
use std::arch::x86_64::*;

/// Lanes of one vector of `f32` (AVX2).
pub(crate) const LANES: usize = 8;

/// Per query head `j` of `M` (`qs`, one head after the other) and key row `i` of `R`, the
/// eight lane sums of `q_j · k_i`: lane `l` holds the fused multiply-adds of elements `l`,
/// `l + 8`, `l + 16`, ... in that order.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
///
/// # Panics
/// If a key row's length is not a whole number of vectors, or `qs` holds fewer than `M` heads
/// of that length.
#[cfg(all(
    target_arch = "x86_64",
    any(test, all(target_feature = "avx2", target_feature = "fma"))
))]
#[target_feature(enable = "avx2,fma")]
unsafe fn key_lanes_avx2<const M: usize, const R: usize>(
    qs: &[f32],
    ks: [&[f32]; R],
) -> [[[f32; LANES]; R]; M] {
    let hd = ks[0].len();
    assert!(
        hd % LANES == 0 && ks.iter().all(|k| k.len() == hd) && qs.len() >= M * hd,
        "whole vectors of one head size"
    );
    let mut acc = [[_mm256_setzero_ps(); R]; M];
    for c in (0..hd).step_by(LANES) {
        // SAFETY: `c + LANES <= hd`, the length of every key row (checked above); unaligned
        // loads.
        let kv: [__m256; R] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(ks[i][c..c + LANES].as_ptr()) });
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: `j * hd + c + LANES <= M * hd <= qs.len()`; an unaligned load.
            let qv = unsafe { _mm256_loadu_ps(qs[j * hd + c..][..LANES].as_ptr()) };
            for (a, k) in a.iter_mut().zip(&kv) {
                *a = _mm256_fmadd_ps(qv, *k, *a);
            }
        }
    }
    let mut out = [[[0f32; LANES]; R]; M];
    for (o, a) in out.iter_mut().zip(&acc) {
        for (o, a) in o.iter_mut().zip(a) {
            // SAFETY: `o` is eight writable `f32`s; an unaligned store.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), *a) };
        }
    }
    out
}

/// The eight lane sums of each dot product of a key tile: lane `l` of `q_j · k_i` adds the
/// products of elements `l`, `l + 8`, ... in that order, fused where `FMA` is set. In vector
/// registers where the crate is built for AVX2 and FMA; a build for the baseline x86-64 takes
/// the portable loop in every version `split_partial` is compiled to.
#[inline(always)]
pub(super) fn key_lanes<const M: usize, const R: usize, const FMA: bool>(
    qs: &[f32],
    ks: [&[f32]; R],
) -> [[[f32; LANES]; R]; M] {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    if FMA {
        // SAFETY: the crate is compiled with AVX2 and FMA on (the default x86-64-v3 build;
        // see .cargo/config.toml), so every CPU that runs this code has them.
        return unsafe { key_lanes_avx2::<M, R>(qs, ks) };
    }
    key_lanes_portable::<M, R, FMA>(qs, ks)
}

/// [`key_lanes`] as a plain loop, for any CPU (the compiler vectorises some tile shapes).
#[inline(always)]
fn key_lanes_portable<const M: usize, const R: usize, const FMA: bool>(
    qs: &[f32],
    ks: [&[f32]; R],
) -> [[[f32; LANES]; R]; M] {
    let hd = ks[0].len();
    let mut acc = [[[0f32; LANES]; R]; M];
    for c in (0..hd).step_by(LANES) {
        let kv: [&[f32; LANES]; R] =
            std::array::from_fn(|i| ks[i][c..c + LANES].try_into().expect("one vector"));
        for (j, a) in acc.iter_mut().enumerate() {
            let qv: &[f32; LANES] = qs[j * hd + c..][..LANES].try_into().expect("one vector");
            for (i, a) in a.iter_mut().enumerate() {
                for l in 0..LANES {
                    a[l] = madd::<FMA>(qv[l], kv[i][l], a[l]);
                }
            }
        }
    }
    acc
}

/// `a * b + c`, fused where the code is compiled for FMA.
#[inline(always)]
pub(super) fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector key tile gives the portable loop's bits, for every tile shape.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_key_tile_gives_the_portable_bits() {
        if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
            println!("SKIPPED: no AVX2 and FMA on this CPU");
            return;
        }
        fn check<const M: usize, const R: usize>(hd: usize) {
            let qs: Vec<f32> = (0..M * hd).map(|i| (i as f32 * 0.37).sin()).collect();
            let rows: Vec<Vec<f32>> = (0..R)
                .map(|r| {
                    (0..hd)
                        .map(|i| ((i + 31 * r) as f32 * 0.91).cos())
                        .collect()
                })
                .collect();
            let ks: [&[f32]; R] = std::array::from_fn(|i| rows[i].as_slice());
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            let fast = unsafe { key_lanes_avx2::<M, R>(&qs, ks) };
            let plain = key_lanes_portable::<M, R, true>(&qs, ks);
            assert_eq!(fast, plain, "M {M} R {R} head {hd}");
        }
        for hd in [8, 64, 128] {
            check::<1, 1>(hd);
            check::<1, 2>(hd);
            check::<2, 1>(hd);
            check::<2, 2>(hd);
            check::<3, 1>(hd);
            check::<3, 2>(hd);
            check::<4, 1>(hd);
            check::<4, 2>(hd);
        }
    }
}
