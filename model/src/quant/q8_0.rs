//! `x · Wᵀ` for GGML `Q8_0` weights (SmolLM2's tied output head: 49,152 x 576), bit for bit
//! what candle's `k_quants::matmul` gives, faster where several dot products can run at once.
//!
//! candle's `Q8_0` dot product (`avx::vec_dot_q8_0_q8_0`) adds each block's term into one
//! accumulator: a chain of dependent fused multiply-adds, so one output at a time waits on
//! the add's latency more than on its integer work. Here eight outputs (two weight rows
//! against four activation rows) go through the blocks together, each its own accumulator,
//! and a weight block is loaded, its magnitude taken and its scale converted once for all
//! the rows it meets. Every output is still candle's computation: the same operations on the
//! same values in the same order (per block the sign trick, `maddubs`, `madd`, the
//! conversion to float, one fused multiply-add by `dx * dy`, then candle's horizontal sum),
//! so the bits are candle's (a test below holds them to it). Only where candle itself runs
//! that AVX2 code (built with AVX2 and FMA): elsewhere candle runs its portable loop, and so
//! does the caller.

/// Values per block.
const QK: usize = 32;
/// Bytes of a block: `d` (f16), 32 signed bytes.
const BYTES: usize = 34;
/// Rows of `lhs` below which candle's own loop is as fast or faster (measured on the head's
/// 49,152 x 576: four dot products side by side for one row ran at 0.4x candle's, eight for
/// four rows at 1.0x, for eight rows 1.4-1.7x).
const MIN_ROWS: usize = 4;

/// `[m, n]` = `lhs` (`[m, k]`, f32) times the transpose of `weights` (`[n, k]` as `Q8_0`
/// blocks, `n * k / 32 * 34` bytes). `None` where the sizes do not say that, for fewer than
/// [`MIN_ROWS`] rows, or where candle does not run its AVX2 kernel (this build lacks AVX2 or
/// FMA): the caller then runs candle's.
pub(crate) fn matmul(
    m: usize,
    k: usize,
    n: usize,
    lhs: &[f32],
    weights: &[u8],
) -> Option<Vec<f32>> {
    if m < MIN_ROWS || !super::sizes_agree::<QK>((m, k, n), lhs, weights, BYTES) {
        return None;
    }
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    return Some(avx2::matmul(m, k, n, lhs, weights));
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    None
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod avx2 {
    use super::{BYTES, QK};
    use candle_core::quantized::k_quants::{BlockQ8_0, GgmlType};
    use half::f16;
    use std::arch::x86_64::*;

    /// Output columns per task.
    const TILE: usize = 128;

    /// [`super::matmul`] once its sizes are checked.
    pub(super) fn matmul(m: usize, k: usize, n: usize, lhs: &[f32], weights: &[u8]) -> Vec<f32> {
        let kb = k / QK;
        let mut blocks = vec![BlockQ8_0::zeros(); m * kb];
        for (r, out) in blocks.chunks_mut(kb).enumerate() {
            BlockQ8_0::from_float(&lhs[r * k..(r + 1) * k], out);
        }
        // SAFETY: `BlockQ8_0` is `#[repr(C)]` of an `f16` and `[i8; 32]` (candle asserts its
        // size is 34: no padding); `blocks` lives to the end of this scope and is only read.
        let y = unsafe {
            std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), blocks.len() * BYTES)
        };
        let rows: Vec<&[u8]> = y.chunks_exact(kb * BYTES).collect();
        crate::quant::by_column_tiles((m, n), TILE, |first, out| {
            let cols: Vec<&[u8]> = (first..first + out.len() / m)
                .map(|c| &weights[c * kb * BYTES..(c + 1) * kb * BYTES])
                .collect();
            // SAFETY: this build has AVX2 and FMA (the module's `cfg`).
            unsafe { tile(&cols, &rows, kb, out) };
        })
    }

    /// A block's scale: its first two bytes, an f16.
    fn scale(block: &[u8]) -> f32 {
        f16::from_bits(u16::from_le_bytes([block[0], block[1]])).to_f32()
    }

    /// Every column of `cols` (weight rows of `kb` blocks) against every row of `rows`
    /// (quantized activations), into `out` column-major (`out[c * m + r]`): two columns
    /// against four rows at once (eight accumulators), the rows past the last four one at a
    /// time.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; every slice holds `kb` blocks.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile(cols: &[&[u8]], rows: &[&[u8]], kb: usize, out: &mut [f32]) {
        let m = rows.len();
        let whole = m - m % 4;
        for (cp, pair) in cols.chunks(2).enumerate() {
            let mut put = |i: usize, r: usize, v: f32| out[(cp * 2 + i) * m + r] = v;
            for r0 in (0..whole).step_by(4) {
                let ys = [rows[r0], rows[r0 + 1], rows[r0 + 2], rows[r0 + 3]];
                let mut store = |got: &[[f32; 4]]| {
                    for (i, col) in got.iter().enumerate() {
                        for (j, &v) in col.iter().enumerate() {
                            put(i, r0 + j, v);
                        }
                    }
                };
                match *pair {
                    // SAFETY: the caller's bounds; AVX2 and FMA as this function has.
                    [a, b] => store(&unsafe { dots::<2, 4>([a, b], ys, kb) }),
                    // SAFETY: as above.
                    _ => store(&unsafe { dots::<1, 4>([pair[0]], ys, kb) }),
                }
            }
            for (r, &y) in rows.iter().enumerate().skip(whole) {
                for (i, &w) in pair.iter().enumerate() {
                    // SAFETY: as above.
                    let [[v]] = unsafe { dots::<1, 1>([w], [y], kb) };
                    put(i, r, v);
                }
            }
        }
    }

    /// The `C x R` dot products of `ws` (weight rows) and `ys` (activation rows), each
    /// computed as candle's `vec_dot_q8_0_q8_0` computes it, side by side.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; every slice holds `kb` blocks of `BYTES`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dots<const C: usize, const R: usize>(
        ws: [&[u8]; C],
        ys: [&[u8]; R],
        kb: usize,
    ) -> [[f32; R]; C] {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); R]; C];
        for b in 0..kb {
            let at = b * BYTES;
            let dy = ys.map(|y| scale(&y[at..at + BYTES]));
            for c in 0..C {
                let w = &ws[c][at..at + BYTES];
                let dx = scale(w);
                // SAFETY: `w[2..]` is 32 readable bytes; an unaligned load.
                let bx = unsafe { _mm256_loadu_si256(w[2..].as_ptr().cast()) };
                let ax = _mm256_sign_epi8(bx, bx);
                for r in 0..R {
                    let y = &ys[r][at + 2..at + BYTES];
                    // SAFETY: as above.
                    let by = unsafe { _mm256_loadu_si256(y.as_ptr().cast()) };
                    let sy = _mm256_sign_epi8(by, bx);
                    let dot = _mm256_maddubs_epi16(ax, sy);
                    let q = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, dot));
                    let d = _mm256_set1_ps(dx * dy[r]);
                    acc[c][r] = _mm256_fmadd_ps(d, q, acc[c][r]);
                }
            }
        }
        acc.map(|row| row.map(|a| hsum(a)))
    }

    /// candle's `hsum_float_8`, the same operations in the same order.
    #[target_feature(enable = "avx2,fma")]
    fn hsum(x: __m256) -> f32 {
        let res = _mm256_extractf128_ps::<1>(x);
        let res = _mm_add_ps(res, _mm256_castps256_ps128(x));
        let res = _mm_add_ps(res, _mm_movehl_ps(res, res));
        let res = _mm_add_ss(res, _mm_movehdup_ps(res));
        _mm_cvtss_f32(res)
    }
}

#[cfg(test)]
mod tests {
    use crate::quant::reference::{bits, Product};
    use candle_core::quantized::k_quants::BlockQ8_0;

    /// Bit for bit candle's `k_quants::matmul` on the same blocks, over odd shapes: every
    /// number of rows from 4 to 11 (whole groups of four and the rows left over), column
    /// counts that leave the last pair part full, and the head's own width.
    #[test]
    fn equals_candles_matmul_bit_for_bit() {
        let mut shapes: Vec<(usize, usize, usize)> = (4..=11).map(|m| (m, 576, 263)).collect();
        shapes.extend([(4, 32, 1), (5, 64, 3), (8, 576, 1031), (33, 128, 5)]);
        for (i, (m, k, n)) in shapes.into_iter().enumerate() {
            let p = Product::<BlockQ8_0>::new((m, k, n), 11 + i as u64);
            let got = super::matmul(m, k, n, &p.lhs, p.bytes());
            if !cfg!(all(target_feature = "avx2", target_feature = "fma")) {
                // A build without AVX2 and FMA: candle runs its portable loop, and so do we.
                assert!(got.is_none());
                continue;
            }
            assert_eq!(bits(&got.unwrap()), bits(&p.want), "({m}, {k}, {n})");
        }
    }

    #[test]
    fn sizes_that_do_not_agree_are_refused() {
        assert!(super::matmul(4, 33, 1, &[0.0; 132], &[0; 34]).is_none());
        assert!(super::matmul(4, 32, 1, &[0.0; 128], &[0; 33]).is_none());
        assert!(super::matmul(4, 0, 1, &[], &[]).is_none());
        // Fewer rows than `MIN_ROWS`: candle's loop.
        assert!(super::matmul(3, 32, 1, &[0.0; 96], &[0; 34]).is_none());
        assert!(super::matmul(0, 32, 1, &[], &[0; 34]).is_none());
        assert!(super::matmul(usize::MAX, 32, 1, &[], &[]).is_none());
        assert!(super::matmul(4, 32, usize::MAX, &[0.0; 128], &[]).is_none());
    }
}
