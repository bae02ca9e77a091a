//! The decode operator's tiles reading `q8_0` rows where they lie, in AVX2 + FMA registers:
//! each vector of eight values is widened, scaled and used at once, never stored as `f32` and
//! read back. A value is `q × d` (the signed byte times its block's scale, one `f32` multiply)
//! exactly as [`dequantize`](crate::kv::q8_0::dequantize) makes it, and the tile's products
//! and sums are those of the `f32` tiles in the same order: the same bits as widening the
//! rows first, in about the instructions `f16` rows take, from half their bytes.
//!
//! Only where the crate is built for AVX2 and FMA (the default x86-64-v3 build); elsewhere
//! the operator widens `q8_0` rows first, as it does `f16` rows.

use std::arch::x86_64::*;

use super::simd::LANES;
use crate::kv::q8_0::{scale, BLOCK, BLOCK_BYTES};

/// Vectors of one block.
const BLOCK_VECTORS: usize = BLOCK / LANES;

/// Block `b`'s value vector `s` (values `8s..8s + 8`), scaled by `d`.
///
/// # Safety
/// AVX2; `blocks` holds block `b` whole.
#[inline(always)]
unsafe fn values(blocks: *const u8, b: usize, s: usize, d: __m256) -> __m256 {
    // SAFETY: the caller's block holds its 32 bytes after the scale; an unaligned load of 8.
    let q = unsafe { _mm_loadl_epi64(blocks.add(b * BLOCK_BYTES + 2 + s * LANES).cast()) };
    _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d)
}

/// Per query head `j` of `M` (`qs`, one after the other, `hd` values each) and key row `i`
/// of `R` (`ks[i]`: one head's `hd / 32` blocks), the eight lane sums of `q_j · k_i`, as
/// `key_lanes` gives them over the widened rows.
///
/// # Panics
/// If `hd` is not whole blocks, a key is not `hd` values of blocks, or `qs` holds fewer than
/// `M` heads.
#[inline(always)]
pub(super) fn key_lanes<const M: usize, const R: usize>(
    qs: &[f32],
    ks: [&[u8]; R],
    hd: usize,
) -> [[[f32; LANES]; R]; M] {
    // SAFETY: this module is built only where the crate is built for AVX2 and FMA.
    unsafe { key_lanes_avx2::<M, R>(qs, ks, hd) }
}

/// [`key_lanes`] in AVX2 + FMA registers.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
unsafe fn key_lanes_avx2<const M: usize, const R: usize>(
    qs: &[f32],
    ks: [&[u8]; R],
    hd: usize,
) -> [[[f32; LANES]; R]; M] {
    let blocks = hd / BLOCK;
    assert!(
        hd % BLOCK == 0 && ks.iter().all(|k| k.len() == blocks * BLOCK_BYTES) && qs.len() >= M * hd,
        "whole blocks of one head"
    );
    let mut acc = [[_mm256_setzero_ps(); R]; M];
    for b in 0..blocks {
        // Plain loops, not `array::from_fn`: its closures were not inlined into this
        // function (its target features are not theirs), and the registers went to the stack.
        let mut d = [_mm256_setzero_ps(); R];
        for (d, k) in d.iter_mut().zip(&ks) {
            *d = _mm256_set1_ps(scale(&k[b * BLOCK_BYTES..]));
        }
        for s in 0..BLOCK_VECTORS {
            let mut kv = [_mm256_setzero_ps(); R];
            for ((kv, k), d) in kv.iter_mut().zip(&ks).zip(&d) {
                // SAFETY: block `b` of every key is whole (checked above).
                *kv = unsafe { values(k.as_ptr(), b, s, *d) };
            }
            let c = b * BLOCK + s * LANES;
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: `j * hd + c + LANES <= M * hd <= qs.len()`; an unaligned load.
                let qv = unsafe { _mm256_loadu_ps(qs.as_ptr().add(j * hd + c)) };
                for (a, k) in a.iter_mut().zip(&kv) {
                    *a = _mm256_fmadd_ps(qv, *k, *a);
                }
            }
        }
    }
    let mut out = [[[0f32; LANES]; R]; M];
    for (o, a) in out.iter_mut().zip(&acc) {
        for (o, a) in o.iter_mut().zip(a) {
            // SAFETY: eight writable `f32`s; an unaligned store.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), *a) };
        }
    }
    out
}

/// Where a chunk's rows start in `bytes`, each found to hold a whole row of `row` bytes there
/// (checked once a chunk, not once a tile).
#[derive(Clone, Copy)]
pub(super) struct RowStarts<'a> {
    bytes: &'a [u8],
    at: &'a [usize],
    row: usize,
}

impl<'a> RowStarts<'a> {
    /// # Panics
    /// If a row `row` bytes long from an `at` is not within `bytes`.
    pub(super) fn new(bytes: &'a [u8], at: &'a [usize], row: usize) -> Self {
        let within = at
            .iter()
            .fold(true, |ok, a| ok & (a.saturating_add(row) <= bytes.len()));
        assert!(within, "q8_0 rows within their bytes");
        RowStarts { bytes, at, row }
    }
}

/// A value tile of `count` tokens over `q8_0` rows (token `t`'s from `rows.at[t]`, the head's
/// blocks `head` bytes into it): the outputs of `M` query heads (`out`, `hd` apart) at the
/// `W` vectors from column `c` (within one block), each token added in turn weighted by
/// `ps[j][t]`.
pub(super) struct ValueColumns<'a, const M: usize> {
    pub out: &'a mut [f32],
    pub hd: usize,
    pub c: usize,
    pub rows: RowStarts<'a>,
    pub head: usize,
    pub count: usize,
    pub ps: [&'a [f32]; M],
}

impl<const M: usize> ValueColumns<'_, M> {
    /// Adds the tile in: the same operations as the `f32` value tile over the widened rows.
    ///
    /// # Panics
    /// If the columns pass their block or the outputs, or a token's block, a weight or an
    /// offset is missing.
    #[inline(always)]
    pub(super) fn add<const W: usize>(self) {
        let (b, within) = (self.c / BLOCK, self.c % BLOCK);
        assert!(
            within + W * LANES <= BLOCK
                && self.c + W * LANES <= self.hd
                && self.out.len() >= M * self.hd
                && self.ps.iter().all(|p| p.len() >= self.count)
                && self.count <= self.rows.at.len()
                && self.head + (b + 1) * BLOCK_BYTES <= self.rows.row,
            "a q8_0 value tile within its blocks and outputs"
        );
        // SAFETY: `add` runs only where the crate is built for AVX2 and FMA (its caller's
        // `cfg`); every index was checked above.
        unsafe { self.add_avx2::<W>(b, within / LANES) }
    }

    /// [`ValueColumns::add`] once checked: block `b`, from its vector `s`.
    ///
    /// # Safety
    /// AVX2 and FMA; the indices checked as `add` checks them.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn add_avx2<const W: usize>(self, b: usize, s: usize) {
        let at = |j: usize, w: usize| j * self.hd + self.c + w * LANES;
        let out = self.out;
        // Plain loops, not `array::from_fn` (see `key_lanes_avx2`).
        let mut o = [[_mm256_setzero_ps(); W]; M];
        for (j, o) in o.iter_mut().enumerate() {
            for (w, o) in o.iter_mut().enumerate() {
                // SAFETY: within `out` (checked); an unaligned load.
                *o = unsafe { _mm256_loadu_ps(out.as_ptr().add(at(j, w))) };
            }
        }
        for t in 0..self.count {
            let rows = self.rows;
            // SAFETY: token `t`'s row is within the bytes (`RowStarts::new`), block `b` of the
            // head within the row (checked).
            let blocks = unsafe {
                rows.bytes
                    .as_ptr()
                    .add(*rows.at.get_unchecked(t) + self.head)
            };
            // SAFETY: the block's two scale bytes are there (above).
            let scale_bytes = unsafe {
                [
                    *blocks.add(b * BLOCK_BYTES),
                    *blocks.add(b * BLOCK_BYTES + 1),
                ]
            };
            let d = _mm256_set1_ps(half::f16::from_le_bytes(scale_bytes).to_f32());
            let mut v = [_mm256_setzero_ps(); W];
            for (w, v) in v.iter_mut().enumerate() {
                // SAFETY: as above, vectors `s..s + W` of block `b`.
                *v = unsafe { values(blocks, b, s + w, d) };
            }
            for (j, o) in o.iter_mut().enumerate() {
                // SAFETY: `t < count <= ps[j].len()` (checked).
                let p = _mm256_set1_ps(unsafe { *self.ps[j].get_unchecked(t) });
                for (o, v) in o.iter_mut().zip(&v) {
                    *o = _mm256_fmadd_ps(p, *v, *o);
                }
            }
        }
        for (j, o) in o.iter().enumerate() {
            for (w, o) in o.iter().enumerate() {
                // SAFETY: as the loads; an unaligned store.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(at(j, w)), *o) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::q8_0;

    /// Rows of `n` values, quantized: the bytes and the values they widen to.
    fn rows(rows: usize, n: usize, seed: f32) -> (Vec<u8>, Vec<f32>) {
        let x: Vec<f32> = (0..rows * n)
            .map(|i| ((i as f32 + seed) * 0.77).sin() * (1 + i % 5) as f32)
            .collect();
        let mut bytes = vec![0u8; q8_0::bytes_for(rows * n).unwrap()];
        q8_0::quantize(&x, &mut bytes);
        let mut wide = vec![0f32; rows * n];
        q8_0::dequantize(&bytes, &mut wide);
        (bytes, wide)
    }

    /// Keys read in place give the lane sums of the widened rows, bit for bit.
    #[test]
    fn keys_in_place_give_the_widened_rows_bits() {
        fn check<const M: usize, const R: usize>(hd: usize) {
            let (bytes, wide) = rows(R, hd, 1.0);
            let qs: Vec<f32> = (0..M * hd).map(|i| (i as f32 * 0.31).cos()).collect();
            let head = hd / BLOCK * BLOCK_BYTES;
            let ks: [&[u8]; R] = std::array::from_fn(|i| &bytes[i * head..][..head]);
            let kw: [&[f32]; R] = std::array::from_fn(|i| &wide[i * hd..][..hd]);
            let widened = super::super::simd::key_lanes::<M, R, true>(&qs, kw);
            assert_eq!(
                key_lanes::<M, R>(&qs, ks, hd),
                widened,
                "M {M} R {R} head {hd}"
            );
        }
        for hd in [32, 64, 128] {
            check::<1, 1>(hd);
            check::<3, 2>(hd);
            check::<4, 2>(hd);
        }
    }

    /// Values read in place, rows anywhere in the bytes, give what the `f32` tile gives over
    /// the widened rows, bit for bit.
    #[test]
    fn values_in_place_give_the_widened_rows_bits() {
        let (hd, count, heads) = (64, 9, 3);
        let stride = heads * hd;
        let (bytes, wide) = rows(count, stride, 2.0);
        let row = stride / BLOCK * BLOCK_BYTES;
        // The rows in reverse order, so each is found by its offset.
        let mut kept = vec![0u8; count * row];
        let at: Vec<usize> = (0..count).map(|t| (count - 1 - t) * row).collect();
        for (t, a) in at.iter().enumerate() {
            kept[*a..*a + row].copy_from_slice(&bytes[t * row..][..row]);
        }
        let ps: Vec<Vec<f32>> = (0..3)
            .map(|j| (0..count).map(|t| ((t + j) as f32 * 0.4).cos()).collect())
            .collect();
        // Column `c` of head `g`, `W` vectors a pass: read in place against the `f32` tile.
        fn compare<const W: usize>(
            g: usize,
            c: usize,
            rows: RowStarts<'_>,
            wide: &[f32],
            ps: &[Vec<f32>],
        ) {
            let (hd, count, stride) = (64, rows.at.len(), 3 * 64);
            let start: Vec<f32> = (0..3 * hd).map(|i| i as f32 * 0.5).collect();
            let (mut fast, mut plain) = (start.clone(), start);
            ValueColumns::<3> {
                out: &mut fast,
                hd,
                c,
                rows,
                head: g * hd / BLOCK * BLOCK_BYTES,
                count,
                ps: std::array::from_fn(|j| ps[j].as_slice()),
            }
            .add::<W>();
            super::super::simd::value_columns::<3, W, true>(super::super::simd::ValueColumns {
                out: &mut plain,
                hd,
                c,
                vals: &wide[g * hd..],
                vstride: stride,
                count,
                ps: std::array::from_fn(|j| ps[j].as_slice()),
            });
            assert_eq!(fast, plain, "head {g} column {c}, {W} vectors a pass");
        }
        let rows = RowStarts::new(&kept, &at, row);
        for g in 0..heads {
            // A whole block at a time, as the operator reads three heads' values; and two
            // vectors at a time.
            for c in [0, 32] {
                compare::<4>(g, c, rows, &wide, &ps);
            }
            for c in [0, 16, 32, 48] {
                compare::<2>(g, c, rows, &wide, &ps);
            }
        }
    }

    /// A row past the bytes, or a head's block past its row, is refused before a read.
    #[test]
    #[should_panic(expected = "within their bytes")]
    fn a_row_past_the_bytes_is_refused() {
        let bytes = vec![0u8; 100];
        RowStarts::new(&bytes, &[0, 90], 34);
    }
}
