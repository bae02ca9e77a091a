//! The decode operator's key tiles: one or two tokens' key rows of one KV head multiplied by
//! a tile of its query heads, the products summed lane by lane in registers and reduced in a
//! fixed order.

use super::simd::{key_lanes, LANES};
use super::TILE;

/// One or two tokens' key rows: `f32` (kept so, or widened), one after the other; or `q8_0`
/// rows read where they lie (`at`: where each starts in `bytes`).
#[derive(Clone, Copy)]
pub(super) enum Keys<'a> {
    F32(&'a [f32]),
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    Q8 {
        bytes: &'a [u8],
        at: [usize; 2],
    },
}

/// KV head `g` (`hd` values) of [`Keys`] whose rows are `stride` values each.
#[derive(Clone, Copy)]
pub(super) struct KeyHead<'a> {
    pub keys: Keys<'a>,
    pub g: usize,
    pub hd: usize,
    pub stride: usize,
}

/// A tile's results padded to the largest tile.
#[inline(always)]
pub(super) fn pad<const M: usize, const R: usize>(x: [[f32; R]; M]) -> [[f32; 2]; TILE] {
    let mut out = [[0f32; 2]; TILE];
    for (o, x) in out.iter_mut().zip(x) {
        o[..R].copy_from_slice(&x);
    }
    out
}

/// The dot products of `M` query heads (`qs`, one after the other) with `R` key rows of one
/// KV head: each key vector loaded serves every head, each query vector every row, and the
/// `M × R` accumulators stay in registers.
#[inline(always)]
pub(super) fn key_tile<const M: usize, const R: usize, const FMA: bool>(
    qs: &[f32],
    k: KeyHead<'_>,
) -> [[f32; R]; M] {
    let KeyHead {
        keys,
        g,
        hd,
        stride,
    } = k;
    let acc = match keys {
        Keys::F32(rows) => key_lanes::<M, R, FMA>(
            qs,
            std::array::from_fn(|i| &rows[i * stride + g * hd..][..hd]),
        ),
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma"
        ))]
        Keys::Q8 { bytes, at } => {
            let head = hd / crate::kv::q8_0::BLOCK * crate::kv::q8_0::BLOCK_BYTES;
            let ks = std::array::from_fn(|i| &bytes[at[i] + g * head..][..head]);
            super::q8::key_lanes::<M, R>(qs, ks, hd)
        }
    };
    // Reduce the accumulators four at a time (pairwise adds across them, as `vhaddps` does),
    // the rest one by one.
    let mut flat = [[0f32; LANES]; TILE * 2];
    for (j, a) in acc.iter().enumerate() {
        for (i, a) in a.iter().enumerate() {
            flat[j * R + i] = *a;
        }
    }
    let mut sums = [0f32; TILE * 2];
    let whole = (M * R) / 4 * 4;
    for q in (0..whole).step_by(4) {
        sums[q..q + 4].copy_from_slice(&reduce4(
            &flat[q],
            &flat[q + 1],
            &flat[q + 2],
            &flat[q + 3],
        ));
    }
    for x in whole..M * R {
        sums[x] = hsum(flat[x]);
    }
    std::array::from_fn(|j| std::array::from_fn(|i| sums[j * R + i]))
}

/// Lanes summed pairwise, two vectors into one (the `vhaddps` pattern).
#[inline(always)]
fn hadd(a: &[f32; LANES], b: &[f32; LANES]) -> [f32; LANES] {
    [
        a[0] + a[1],
        a[2] + a[3],
        b[0] + b[1],
        b[2] + b[3],
        a[4] + a[5],
        a[6] + a[7],
        b[4] + b[5],
        b[6] + b[7],
    ]
}

/// The sums of four vectors' lanes.
#[inline(always)]
fn reduce4(a: &[f32; LANES], b: &[f32; LANES], c: &[f32; LANES], d: &[f32; LANES]) -> [f32; 4] {
    let x = hadd(&hadd(a, b), &hadd(c, d));
    [x[0] + x[4], x[1] + x[5], x[2] + x[6], x[3] + x[7]]
}

/// The sum of a vector's lanes, pairwise in a fixed order.
#[inline(always)]
fn hsum(mut s: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            s[i] += s[i + width];
        }
        width /= 2;
    }
    s[0]
}
