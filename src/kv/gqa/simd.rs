//! The decode operator's lane-wise pieces: a key tile's dot products and a softmax's `e^x`,
//! each in AVX2 + FMA registers where the CPU has them, else as a plain loop.
//!
//! The portable key loop is vectorised by the compiler only for some tile shapes: a tile of
//! three query heads (SmolLM2's group: 9 query heads over 3 KV heads) came out as scalar code
//! with its accumulators spilled to the stack, and a causal prefill spent half its time there.
//! [`key_lanes`] on AVX2 is the same loop written with the vector operations themselves: lane
//! `l` of each accumulator takes `q[c + l] * k[c + l]` fused into it, chunk after chunk, the
//! operations the portable loop does, so the sums are the same bits. The softmax's `e^x` went
//! through the C library one score at a time; [`exp_lanes`] takes eight.

#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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

/// `e^x` of eight lanes at once, each within 2 ulp of the exact value for `x` in `[-87, 0]`
/// (a softmax's shifted scores; below that the result is about `1e-38`, not 0). The
/// exponent is split off as `n = round(x · log2 e)`, the rest `r = x - n · ln 2` (in two parts,
/// so `r` is exact) goes through a degree-6 polynomial (Cephes' `expf` coefficients), and
/// `2^n` is built in the exponent bits.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8(x: [f32; LANES]) -> [f32; LANES] {
    // SAFETY: `x` is eight readable `f32`s; an unaligned load.
    let x = unsafe { _mm256_loadu_ps(x.as_ptr()) };
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.336_55)),
        _mm256_set1_ps(88.376_26),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let r2 = _mm256_mul_ps(r, r);
    let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
    let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    let y = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
    let mut out = [0f32; LANES];
    // SAFETY: `out` is eight writable `f32`s; an unaligned store.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), y) };
    out
}

/// `e^x` of eight lanes: in vector registers where `FMA` is set (AVX2 and FMA), else lane
/// by lane.
#[inline(always)]
pub(super) fn exp_lanes<const FMA: bool>(x: [f32; LANES]) -> [f32; LANES] {
    #[cfg(target_arch = "x86_64")]
    if FMA {
        // SAFETY: `split_partial` sets `FMA` only where the CPU has AVX2 and FMA.
        return unsafe { exp8(x) };
    }
    x.map(f32::exp)
}

/// The eight lane sums of each dot product of a key tile: lane `l` of `q_j · k_i` adds the
/// products of elements `l`, `l + 8`, ... in that order, fused where `FMA` is set.
#[inline(always)]
pub(super) fn key_lanes<const M: usize, const R: usize, const FMA: bool>(
    qs: &[f32],
    ks: [&[f32]; R],
) -> [[[f32; LANES]; R]; M] {
    #[cfg(target_arch = "x86_64")]
    if FMA {
        // SAFETY: `split_partial` sets `FMA` only where the CPU has AVX2 and FMA.
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

    /// The vector `e^x` stays within 2 ulp of the library's over a softmax's range.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_exp_is_within_two_ulp() {
        if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
            println!("SKIPPED: no AVX2 and FMA on this CPU");
            return;
        }
        let mut worst = 0u32;
        for i in 0..=870_000u32 {
            let x = -(i as f32) * 1e-4;
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            let got = unsafe { exp8([x; LANES]) }[0];
            let want = x.exp();
            assert!(got > 0.0 && got.is_finite(), "exp({x}) = {got}");
            worst = worst.max(got.to_bits().abs_diff(want.to_bits()));
        }
        assert!(worst <= 2, "{worst} ulp");
        // SAFETY: as above.
        let edges = unsafe { exp8([0.0, -1000.0, f32::MIN, -87.0, -0.5, -1e-30, 1.0, 2.0]) };
        assert_eq!(edges[0], 1.0);
        assert!(edges[1] < 1.2e-38 && edges[2] < 1.2e-38);
        assert!((edges[6] - std::f32::consts::E).abs() < 1e-6);
    }
}
