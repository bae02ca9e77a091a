//! `x · Wᵀ` for GGML `Q4_1` weights, bit for bit what candle's `k_quants::matmul` gives, and
//! much faster: candle 0.9 computes `Q4_1` dot products with its scalar reference code, one
//! output row at a time (a rayon split per row), so a 256-token chunk costs 256 passes over
//! every weight. Here each weight block is unpacked once and dotted with every row of the
//! chunk (AVX2 where the CPU has it), and the work is split over column tiles once per call.
//!
//! Each output is still candle's sum: the activations are quantized by candle's own
//! `BlockQ8_1::from_float`, each block's integer dot product is exact however it is added up,
//! and the float accumulation over blocks is candle's expression in candle's order; so the
//! results equal `QMatMul`'s exactly (a test below holds them to it).

use candle_core::quantized::k_quants::{BlockQ8_1, GgmlType};
use half::f16;

/// Weights and activations per block.
const QK: usize = 32;
/// Bytes of a `Q4_1` block: `d`, `m` (f16), 16 bytes of nibbles.
const W_BYTES: usize = 20;
/// Bytes of a `Q8_1` block: `d`, `s` (f16), 32 signed bytes.
const Y_BYTES: usize = 36;
/// Output columns per task.
const TILE: usize = 16;

/// One row's activations, quantized as candle does it, unpacked.
struct Rows {
    qs: Vec<[i8; QK]>,
    d: Vec<f32>,
    s: Vec<f32>,
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

fn quantize(lhs: &[f32], m: usize, k: usize) -> Rows {
    let kb = k / QK;
    let mut blocks = vec![BlockQ8_1::zeros(); m * kb];
    for (r, out) in blocks.chunks_mut(kb).enumerate() {
        BlockQ8_1::from_float(&lhs[r * k..(r + 1) * k], out);
    }
    // SAFETY: `BlockQ8_1` is `#[repr(C)]` of two `f16` and `[i8; 32]` (candle asserts its size
    // is 36, so there is no padding); the slice is live and only read as bytes.
    let bytes: &[u8] =
        unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), blocks.len() * Y_BYTES) };
    let mut rows = Rows {
        qs: Vec::with_capacity(blocks.len()),
        d: Vec::with_capacity(blocks.len() + 8),
        s: Vec::with_capacity(blocks.len() + 8),
    };
    for b in bytes.chunks_exact(Y_BYTES) {
        rows.d.push(f16_at(b, 0));
        rows.s.push(f16_at(b, 2));
        let mut qs = [0i8; QK];
        for (q, &x) in qs.iter_mut().zip(&b[4..]) {
            *q = x as i8;
        }
        rows.qs.push(qs);
    }
    // Eight more scales, so eight blocks' scales load at once from any block.
    rows.d.extend([0.0; 8]);
    rows.s.extend([0.0; 8]);
    rows
}

/// The exact integer dot product of one weight block's nibbles (low halves against
/// `y[..16]`, high halves against `y[16..]`) and one activation block.
fn dot_scalar(w: &[u8; 16], y: &[i8; QK]) -> i32 {
    let mut sum = 0i32;
    for j in 0..16 {
        sum += (w[j] & 0x0F) as i32 * y[j] as i32 + (w[j] >> 4) as i32 * y[j + 16] as i32;
    }
    sum
}

/// One column (a weight row of `kb` blocks) against every activation row into `acc`.
fn column_scalar(w: &[u8], y: &Rows, kb: usize, acc: &mut [f32]) {
    for (b, wb) in w.chunks_exact(W_BYTES).enumerate() {
        let (dx, mx) = (f16_at(wb, 0), f16_at(wb, 2));
        let nibbles: &[u8; 16] = wb[4..].try_into().expect("16 bytes");
        for (r, a) in acc.iter_mut().enumerate() {
            let i = r * kb + b;
            let sumi = dot_scalar(nibbles, &y.qs[i]);
            *a += sumi as f32 * dx * y.d[i] + mx * y.s[i];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{f16_at, Rows, W_BYTES};
    use std::arch::x86_64::*;

    /// Weight blocks unpacked at once.
    const WINDOW: usize = 64;

    /// Where [`column`] unpacks a window of weight blocks: made once per task and reused for
    /// each of its columns (zeroing 2.5 KiB for every column was 3-4% of a decode step).
    pub(super) struct Window {
        wv: [__m256i; WINDOW],
        dx: [f32; WINDOW],
        mx: [f32; WINDOW],
    }

    impl Window {
        pub(super) fn new() -> Self {
            Window {
                // SAFETY: a vector of integers: all-zero bits are a valid value.
                wv: unsafe { std::mem::zeroed() },
                dx: [0.0; WINDOW],
                mx: [0.0; WINDOW],
            }
        }
    }

    /// [`super::column_scalar`] on AVX2: the integer dot products of eight blocks at a time,
    /// reduced together, and their float terms computed lane by lane with candle's
    /// expression ([`terms`]); then eight rows' terms are transposed so that one vector add
    /// adds a block's term to eight rows' sums at once, each row's in block order. (One row
    /// at a time, each sum was a chain of dependent scalar adds: the add's latency, not the
    /// integer work, bounded the kernel.)
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn column(
        w: &[u8],
        y: &Rows,
        kb: usize,
        acc: &mut [f32],
        window: &mut Window,
    ) {
        let low = _mm_set1_epi8(0x0F);
        let Window { wv, dx, mx } = window;
        for (wi, window) in w.chunks(WINDOW * W_BYTES).enumerate() {
            let base = wi * WINDOW;
            let nb = window.len() / W_BYTES;
            for (b, wb) in window.chunks_exact(W_BYTES).enumerate() {
                dx[b] = f16_at(wb, 0);
                mx[b] = f16_at(wb, 2);
                // SAFETY: `wb[4..20]` is 16 readable bytes; an unaligned load.
                let packed = unsafe { _mm_loadu_si128(wb[4..].as_ptr().cast()) };
                let lo = _mm_and_si128(packed, low);
                let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
                // In the activations' order: 16 low halves, then 16 high halves.
                wv[b] = _mm256_set_m128i(hi, lo);
            }
            if let [a] = acc {
                // One row (a decode step): no transpose, its sum a chain of scalar adds.
                let mut sum = *a;
                for g in (0..nb).step_by(8) {
                    let cnt = (nb - g).min(8);
                    let mut t = [0f32; 8];
                    // SAFETY: as in `terms`: `g + 8 <= WINDOW`, `y` padded past its end;
                    // `t` is 8 writable floats.
                    unsafe {
                        let v = terms(&wv[g..], &dx[g..], &mx[g..], y, base + g, cnt);
                        _mm256_storeu_ps(t.as_mut_ptr(), v);
                    }
                    for term in &t[..cnt] {
                        sum += term;
                    }
                }
                *a = sum;
                continue;
            }
            for (group, accs) in acc.chunks_mut(8).enumerate() {
                let r0 = group * 8;
                // Eight rows' sums in one register, a row a lane: each lane adds its row's
                // terms one block at a time, in block order, as the scalar code does.
                let mut sums = [0f32; 8];
                sums[..accs.len()].copy_from_slice(accs);
                // SAFETY: `sums` is 8 readable floats.
                let mut sums = unsafe { _mm256_loadu_ps(sums.as_ptr()) };
                for g in (0..nb).step_by(8) {
                    let cnt = (nb - g).min(8);
                    let mut t = [_mm256_setzero_ps(); 8];
                    for (i, ti) in t.iter_mut().enumerate().take(accs.len()) {
                        let row = (r0 + i) * kb + base;
                        // SAFETY: as in `terms`: `g + 8 <= WINDOW`, `y` padded past its end.
                        *ti = unsafe { terms(&wv[g..], &dx[g..], &mx[g..], y, row + g, cnt) };
                    }
                    // Lane `i` of `c[j]` is row `i`'s term of block `g + j`.
                    let c = transpose(t);
                    for cj in &c[..cnt] {
                        sums = _mm256_add_ps(sums, *cj);
                    }
                }
                let mut out = [0f32; 8];
                // SAFETY: `out` is 8 writable floats.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sums) };
                accs.copy_from_slice(&out[..accs.len()]);
            }
        }
    }

    /// One row's float terms of blocks `at..at + cnt` (`cnt` at most 8; lanes past it are not
    /// meant to be read): candle's `sumi * dx * dy + mx * sy`, each lane rounded as the scalar
    /// code rounds it (a multiply, a multiply, a multiply, an add: no fused multiply-add).
    ///
    /// # Safety
    /// The CPU must have AVX2; `wv`, `dx`, `mx` hold 8 entries at least; `y.qs` holds `cnt`
    /// blocks from `at`, `y.d` and `y.s` 8 floats from `at`.
    #[target_feature(enable = "avx2")]
    unsafe fn terms(
        wv: &[__m256i],
        dx: &[f32],
        mx: &[f32],
        y: &Rows,
        at: usize,
        cnt: usize,
    ) -> __m256 {
        let ones = _mm256_set1_epi16(1);
        let mut p = [_mm256_setzero_si256(); 8];
        for (i, pi) in p.iter_mut().enumerate().take(cnt) {
            // SAFETY: each `[i8; 32]` is 32 readable bytes; an unaligned load.
            let yv = unsafe { _mm256_loadu_si256(y.qs[at + i].as_ptr().cast()) };
            // Nibbles (at most 15) times signed bytes, pairs into i16 (at most 2 * 15 * 128:
            // no saturation), then pairs into i32.
            *pi = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[i], yv), ones);
        }
        let s01 = _mm256_hadd_epi32(p[0], p[1]);
        let s23 = _mm256_hadd_epi32(p[2], p[3]);
        let s45 = _mm256_hadd_epi32(p[4], p[5]);
        let s67 = _mm256_hadd_epi32(p[6], p[7]);
        let s0123 = _mm256_hadd_epi32(s01, s23);
        let s4567 = _mm256_hadd_epi32(s45, s67);
        let sumi = _mm256_add_epi32(
            _mm256_permute2x128_si256(s0123, s4567, 0x20),
            _mm256_permute2x128_si256(s0123, s4567, 0x31),
        );
        // Exact as f32: at most 32 * 15 * 128 in magnitude.
        let sumi = _mm256_cvtepi32_ps(sumi);
        // SAFETY: the caller's bounds.
        unsafe {
            let scaled = _mm256_mul_ps(
                _mm256_mul_ps(sumi, _mm256_loadu_ps(dx.as_ptr())),
                _mm256_loadu_ps(y.d[at..].as_ptr()),
            );
            let offset = _mm256_mul_ps(
                _mm256_loadu_ps(mx.as_ptr()),
                _mm256_loadu_ps(y.s[at..].as_ptr()),
            );
            _mm256_add_ps(scaled, offset)
        }
    }

    /// The 8x8 transpose of eight registers of floats.
    #[target_feature(enable = "avx2")]
    fn transpose(r: [__m256; 8]) -> [__m256; 8] {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }
}

/// The columns from `first` whose sums `out` holds (`m` a column) against every row of `y`.
fn columns(weights: &[u8], first: usize, y: &Rows, kb: usize, m: usize, out: &mut [f32]) {
    let column = |c: usize| &weights[c * kb * W_BYTES..(c + 1) * kb * W_BYTES];
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        let mut window = avx2::Window::new();
        for (j, acc) in out.chunks_mut(m).enumerate() {
            // SAFETY: AVX2 was detected just above.
            unsafe { avx2::column(column(first + j), y, kb, acc, &mut window) };
        }
        return;
    }
    for (j, acc) in out.chunks_mut(m).enumerate() {
        column_scalar(column(first + j), y, kb, acc);
    }
}

/// `[m, n]` = `lhs` (`[m, k]`, f32) times the transpose of `weights` (`[n, k]` as `Q4_1`
/// blocks, `n * k / 32 * 20` bytes). `None` where the sizes do not say that.
pub(crate) fn matmul(
    m: usize,
    k: usize,
    n: usize,
    lhs: &[f32],
    weights: &[u8],
) -> Option<Vec<f32>> {
    if !super::sizes_agree::<QK>((m, k, n), lhs, weights, W_BYTES) {
        return None;
    }
    let kb = k / QK;
    let y = quantize(lhs, m, k);
    Some(super::by_column_tiles((m, n), TILE, |first, cols| {
        columns(weights, first, &y, kb, m.max(1), cols)
    }))
}

#[cfg(test)]
mod tests {
    use crate::quant::reference::{bits, Product};
    use candle_core::quantized::k_quants::BlockQ4_1;

    /// Bit for bit candle's `k_quants::matmul` on the same blocks, over odd shapes, and the
    /// scalar path the same as the vector one.
    #[test]
    fn equals_candles_matmul_bit_for_bit() {
        for (i, (m, k, n)) in [
            (1, 64, 1),
            (1, 576, 192),
            (3, 64, 17),
            (7, 576, 1536),
            (256, 128, 40),
            (5, 4096, 9),
        ]
        .into_iter()
        .enumerate()
        {
            let p = Product::<BlockQ4_1>::new((m, k, n), 7 + i as u64);
            let (bytes, want) = (p.bytes(), &p.want);
            let got = super::matmul(m, k, n, &p.lhs, bytes).unwrap();
            assert_eq!(bits(&got), bits(want), "({m}, {k}, {n})");
            let y = super::quantize(&p.lhs, m, k);
            for c in 0..n {
                let mut acc = vec![0f32; m];
                super::column_scalar(
                    &bytes[c * k / 32 * 20..(c + 1) * k / 32 * 20],
                    &y,
                    k / 32,
                    &mut acc,
                );
                for r in 0..m {
                    assert_eq!(acc[r].to_bits(), want[r * n + c].to_bits());
                }
            }
        }
        assert!(super::matmul(2, 33, 1, &[0.0; 66], &[0; 20]).is_none());
        // No columns of input: nothing to quantize a row into (this used to panic).
        assert!(super::matmul(1, 0, 1, &[], &[]).is_none());
        assert!(super::matmul(usize::MAX, 32, 1, &[], &[]).is_none());
    }
}
