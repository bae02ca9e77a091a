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
        // Plain loops, not `array::from_fn`: its closures were not inlined into this function
        // (its target features are not theirs), and the registers went to the stack.
        let mut kv = [_mm256_setzero_ps(); R];
        for (kv, k) in kv.iter_mut().zip(&ks) {
            // SAFETY: `c + LANES <= hd`, the length of every key row (checked above); an
            // unaligned load.
            *kv = unsafe { _mm256_loadu_ps(k[c..c + LANES].as_ptr()) };
        }
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

/// Outputs of `M` query heads (`out`, `hd` apart) at the `W` vectors from column `c`, with
/// each token `t < count` of a tile added in turn: `ps[j][t]` times its value row (`vals`
/// from `t × vstride`), fused into lane `l` of every vector, token after token.
pub(super) struct ValueColumns<'a, const M: usize> {
    pub out: &'a mut [f32],
    pub hd: usize,
    pub c: usize,
    pub vals: &'a [f32],
    pub vstride: usize,
    pub count: usize,
    pub ps: [&'a [f32]; M],
}

impl<const M: usize> ValueColumns<'_, M> {
    /// Checks every index the loops take, once.
    fn check<const W: usize>(&self) {
        let end = self.c + W * LANES;
        assert!(
            end <= self.hd
                && self.out.len() >= M * self.hd
                && self.ps.iter().all(|p| p.len() >= self.count)
                && (self.count == 0 || self.vals.len() >= (self.count - 1) * self.vstride + end),
            "a value tile within its rows and outputs"
        );
    }
}

/// [`ValueColumns`] added in: in vector registers where the crate is built for AVX2 and FMA
/// (the compiler kept a tile of three heads' outputs in scalars on the stack), else the plain
/// loop; the same operations lane by lane, so the same bits.
#[inline(always)]
pub(super) fn value_columns<const M: usize, const W: usize, const FMA: bool>(
    cols: ValueColumns<'_, M>,
) {
    cols.check::<W>();
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    if FMA {
        // SAFETY: the crate is compiled with AVX2 and FMA on (see `key_lanes`); the indices
        // were checked above.
        return unsafe { value_columns_avx2::<M, W>(cols) };
    }
    value_columns_portable::<M, W, FMA>(cols)
}

/// [`value_columns`] in AVX2 + FMA registers.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `cols` passed [`ValueColumns::check`] for `W`.
#[cfg(all(
    target_arch = "x86_64",
    any(test, all(target_feature = "avx2", target_feature = "fma"))
))]
#[target_feature(enable = "avx2,fma")]
unsafe fn value_columns_avx2<const M: usize, const W: usize>(cols: ValueColumns<'_, M>) {
    let ValueColumns {
        out,
        hd,
        c,
        vals,
        vstride,
        count,
        ps,
    } = cols;
    let at = |j: usize, w: usize| j * hd + c + w * LANES;
    // Plain loops, not `array::from_fn` (see `key_lanes_avx2`).
    let mut o = [[_mm256_setzero_ps(); W]; M];
    for (j, o) in o.iter_mut().enumerate() {
        for (w, o) in o.iter_mut().enumerate() {
            // SAFETY: `at(j, w) + LANES <= M * hd <= out.len()` (checked); an unaligned load.
            *o = unsafe { _mm256_loadu_ps(out.as_ptr().add(at(j, w))) };
        }
    }
    for t in 0..count {
        // SAFETY: `t * vstride + c + W * LANES <= vals.len()` for `t < count` (checked).
        let row = unsafe { vals.as_ptr().add(t * vstride + c) };
        let mut v = [_mm256_setzero_ps(); W];
        for (w, v) in v.iter_mut().enumerate() {
            // SAFETY: within the row's `W` vectors (above); an unaligned load.
            *v = unsafe { _mm256_loadu_ps(row.add(w * LANES)) };
        }
        for (j, o) in o.iter_mut().enumerate() {
            // SAFETY: `t < count <= ps[j].len()` (checked).
            let p = _mm256_set1_ps(unsafe { *ps[j].get_unchecked(t) });
            for (o, v) in o.iter_mut().zip(&v) {
                *o = _mm256_fmadd_ps(p, *v, *o);
            }
        }
    }
    for (j, o) in o.iter().enumerate() {
        for (w, o) in o.iter().enumerate() {
            // SAFETY: as the loads from `out`; an unaligned store.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(at(j, w)), *o) };
        }
    }
}

/// [`value_columns`] as a plain loop, for any CPU.
#[inline(always)]
fn value_columns_portable<const M: usize, const W: usize, const FMA: bool>(
    cols: ValueColumns<'_, M>,
) {
    let ValueColumns {
        out,
        hd,
        c,
        vals,
        vstride,
        count,
        ps,
    } = cols;
    let mut o = [[[0f32; LANES]; W]; M];
    for (j, o) in o.iter_mut().enumerate() {
        for (w, o) in o.iter_mut().enumerate() {
            o.copy_from_slice(&out[j * hd + c + w * LANES..][..LANES]);
        }
    }
    for t in 0..count {
        let row = &vals[t * vstride + c..][..W * LANES];
        let v: [&[f32; LANES]; W] =
            std::array::from_fn(|w| row[w * LANES..][..LANES].try_into().expect("one vector"));
        for (j, o) in o.iter_mut().enumerate() {
            let p = ps[j][t];
            for (w, o) in o.iter_mut().enumerate() {
                for l in 0..LANES {
                    o[l] = madd::<FMA>(p, v[w][l], o[l]);
                }
            }
        }
    }
    for (j, o) in o.iter().enumerate() {
        for (w, o) in o.iter().enumerate() {
            out[j * hd + c + w * LANES..][..LANES].copy_from_slice(o);
        }
    }
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
    /// The vector value tile gives the portable loop's bits, for every tile shape.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_value_tile_gives_the_portable_bits() {
        if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
            println!("SKIPPED: no AVX2 and FMA on this CPU");
            return;
        }
        fn check<const M: usize, const W: usize>(hd: usize, count: usize) {
            let vstride = 3 * hd;
            let vals: Vec<f32> = (0..count * vstride)
                .map(|i| (i as f32 * 0.37).sin())
                .collect();
            let ps: Vec<Vec<f32>> = (0..M)
                .map(|j| {
                    (0..count)
                        .map(|t| ((t + 7 * j) as f32 * 0.13).cos())
                        .collect()
                })
                .collect();
            let start: Vec<f32> = (0..M * hd).map(|i| i as f32 * 0.01).collect();
            for c in (0..hd).step_by(W * LANES).filter(|c| c + W * LANES <= hd) {
                let (mut fast, mut plain) = (start.clone(), start.clone());
                let cols = |out| ValueColumns {
                    out,
                    hd,
                    c,
                    vals: &vals[hd..],
                    vstride,
                    count,
                    ps: std::array::from_fn(|j| ps[j].as_slice()),
                };
                let f = cols(&mut fast);
                f.check::<W>();
                // SAFETY: the CPU has AVX2 and FMA (checked above); the columns are checked.
                unsafe { value_columns_avx2::<M, W>(f) };
                value_columns_portable::<M, W, true>(cols(&mut plain));
                assert_eq!(fast, plain, "M {M} W {W} head {hd} column {c}");
            }
        }
        for (hd, count) in [(8, 1), (64, 40), (128, 7)] {
            check::<1, 1>(hd, count);
            check::<1, 2>(hd, count);
            check::<2, 1>(hd, count);
            check::<3, 1>(hd, count);
            check::<3, 2>(hd, count);
            check::<4, 2>(hd, count);
        }
    }
}
