//! KV in eight bits: the `q8_0` format, as llama.cpp keeps K and V with `-ctk q8_0 -ctv q8_0`.
//!
//! Values are cut into blocks of [`BLOCK`] (32) in row order; a block is its scale `d` (an
//! IEEE `f16`, little-endian) then 32 signed bytes `q`, [`BLOCK_BYTES`] (34) bytes for 32
//! values: 8.5 bits a value, 0.53x the bytes of `f16`. A value reads back as `q * d`; the
//! block's largest magnitude is 127 steps, so the error of a value is at most half a step
//! (`amax / 254`), plus the rounding of `d` to `f16`.
//!
//! A row of `kv_heads × head_dim` values is whole blocks when `head_dim` is a multiple of 32
//! (a shape refuses `q8_0` otherwise), so a head starts on a block and rows are written and read
//! independently. Reading widens a block to `f32` exactly (`q` and `d` are both exact in
//! `f32`, and their product rounds once): the AVX2 path and the scalar path give the same bits.

/// Values in one block.
pub const BLOCK: usize = 32;

/// Bytes of one block: the `f16` scale and 32 signed bytes.
pub const BLOCK_BYTES: usize = 2 + BLOCK;

/// Bytes of `values` values kept as `q8_0`, or `None` when they are not whole blocks.
pub const fn bytes_for(values: usize) -> Option<usize> {
    if values % BLOCK == 0 {
        (values / BLOCK).checked_mul(BLOCK_BYTES)
    } else {
        None
    }
}

/// Values held by `bytes` of whole blocks (a partial block at the end is not counted).
pub const fn values_in(bytes: usize) -> usize {
    bytes / BLOCK_BYTES * BLOCK
}

/// Quantizes `src` (whole blocks) into `dst` (exactly [`bytes_for`] of it), block by block:
/// the scale is the block's largest magnitude over 127 (zero for a block of zeros), and each
/// value the nearest step, halves away from zero.
///
/// # Panics
/// If `src` is not whole blocks or `dst` is not its size.
pub fn quantize(src: &[f32], dst: &mut [u8]) {
    assert_eq!(
        bytes_for(src.len()),
        Some(dst.len()),
        "q8_0 rows are whole blocks of {BLOCK} values"
    );
    for (x, out) in src
        .chunks_exact(BLOCK)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
    {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        out[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        for (q, v) in out[2..].iter_mut().zip(x) {
            // `amax * inv` rounds to at most 127; NaN becomes 0.
            *q = ((v * inv).round().clamp(-127.0, 127.0) as i8) as u8;
        }
    }
}

/// The scale of the block at `block` (its first byte).
#[inline(always)]
pub(crate) fn scale(block: &[u8]) -> f32 {
    half::f16::from_le_bytes([block[0], block[1]]).to_f32()
}

/// Value `i` of `src` (whole blocks), widened: what a reference reads one value at a time.
///
/// # Panics
/// If `i` is past the values `src` holds.
pub fn value(src: &[u8], i: usize) -> f32 {
    let block = &src[i / BLOCK * BLOCK_BYTES..][..BLOCK_BYTES];
    f32::from(block[2 + i % BLOCK] as i8) * scale(block)
}

/// Widens `src` (whole blocks) into `dst` (32 values a block): AVX2 where the build has it,
/// a plain loop elsewhere; both give the same bits.
///
/// # Panics
/// If `src` is not whole blocks or `dst` does not hold exactly its values.
#[inline]
pub fn dequantize(src: &[u8], dst: &mut [f32]) {
    assert!(
        src.len() % BLOCK_BYTES == 0 && dst.len() == values_in(src.len()),
        "q8_0 rows are whole blocks of {BLOCK} values"
    );
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    // SAFETY: the build enables AVX2; the lengths were checked above.
    unsafe {
        dequantize_avx2(src, dst)
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
    dequantize_plain(src, dst)
}

/// The plain loop of [`dequantize`] (lengths checked by the caller).
#[cfg_attr(all(target_arch = "x86_64", target_feature = "avx2"), allow(dead_code))]
fn dequantize_plain(src: &[u8], dst: &mut [f32]) {
    for (block, out) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(BLOCK))
    {
        let d = scale(block);
        for (o, q) in out.iter_mut().zip(&block[2..]) {
            *o = f32::from(*q as i8) * d;
        }
    }
}

/// [`dequantize`] in AVX2: eight signed bytes widened to `i32`, converted and scaled per
/// vector, four vectors a block.
///
/// # Safety
/// The CPU must have AVX2; `src` whole blocks and `dst` exactly its values.
#[cfg(all(target_arch = "x86_64", any(test, target_feature = "avx2")))]
#[target_feature(enable = "avx2")]
unsafe fn dequantize_avx2(src: &[u8], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    for (block, out) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(BLOCK))
    {
        let d = _mm256_set1_ps(scale(block));
        for (c, o) in block[2..].chunks_exact(8).zip(out.chunks_exact_mut(8)) {
            // SAFETY: `c` holds 8 bytes and `o` 8 floats (chunks_exact); unaligned accesses.
            unsafe {
                let q = _mm_loadl_epi64(c.as_ptr().cast());
                let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                _mm256_storeu_ps(o.as_mut_ptr(), _mm256_mul_ps(x, d));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let r = (i as u32).wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503);
                (r as f32 / u32::MAX as f32 - 0.5) * (1 + i % 7) as f32
            })
            .collect()
    }

    #[test]
    fn a_value_reads_back_within_half_a_step() {
        let x = data(32 * 64, 3);
        let mut q = vec![0u8; bytes_for(x.len()).unwrap()];
        quantize(&x, &mut q);
        let mut back = vec![0f32; x.len()];
        dequantize(&q, &mut back);
        for (b, (xs, ys)) in x.chunks(BLOCK).zip(back.chunks(BLOCK)).enumerate() {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            // Half a step, and the scale's own f16 rounding (2^-11 relative) over 127 steps.
            let bound = amax / 254.0 + amax / 2048.0 + 1e-7;
            for (i, (a, b2)) in xs.iter().zip(ys).enumerate() {
                assert!((a - b2).abs() <= bound, "block {b} value {i}: {a} vs {b2}");
                assert_eq!(*b2, value(&q, b * BLOCK + i));
            }
        }
    }

    #[test]
    fn the_block_layout_is_the_scale_then_the_steps() {
        let mut x = [0f32; 32];
        x[0] = -2.54;
        x[5] = 1.27;
        x[6] = 0.005; // a quarter step: rounds to 0
        let mut q = [0u8; 34];
        quantize(&x, &mut q);
        assert_eq!(
            half::f16::from_le_bytes([q[0], q[1]]),
            half::f16::from_f32(0.02)
        );
        assert_eq!(q[2] as i8, -127);
        assert_eq!(q[7] as i8, 64, "1.27 / 0.02 = 63.5 rounds away from zero");
        assert_eq!(q[8], 0);
        // A block of zeros has a zero scale and reads back as zeros.
        let mut z = [1u8; 34];
        quantize(&[0.0; 32], &mut z);
        assert_eq!(z, [0u8; 34]);
    }

    #[test]
    fn the_avx2_and_plain_paths_give_the_same_bits() {
        let x = data(32 * 33, 11);
        let mut q = vec![0u8; bytes_for(x.len()).unwrap()];
        quantize(&x, &mut q);
        let mut plain = vec![0f32; x.len()];
        dequantize_plain(&q, &mut plain);
        let mut fast = vec![0f32; x.len()];
        dequantize(&q, &mut fast);
        assert_eq!(plain, fast);
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            let mut avx = vec![0f32; x.len()];
            // SAFETY: AVX2 detected; the lengths match.
            unsafe { dequantize_avx2(&q, &mut avx) };
            assert_eq!(plain, avx);
        }
    }

    #[test]
    #[should_panic(expected = "whole blocks")]
    fn a_partial_block_is_refused() {
        quantize(&[1.0; 33], &mut [0u8; 34]);
    }

    #[test]
    fn sizes() {
        assert_eq!(bytes_for(192), Some(204));
        assert_eq!(bytes_for(100), None);
        assert_eq!(values_in(204), 192);
        assert_eq!(
            bytes_for(usize::MAX / BLOCK * BLOCK),
            None,
            "overflow is refused"
        );
    }
}
