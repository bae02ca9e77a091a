//! The decode operator's value tiles: a chunk of one KV head's value rows added into the
//! outputs of a tile of its query heads, each row weighted by each head's probability.

use super::simd::{self, LANES};

/// One KV head's value rows for a chunk of tokens: `f32` (kept so, or widened), rows `vstride`
/// apart; or `q8_0` rows where they lie (see `q8`), read in place.
#[derive(Clone, Copy)]
pub(super) enum Vals<'a> {
    F32 {
        vals: &'a [f32],
        vstride: usize,
    },
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    Q8 {
        /// Where each token's row starts in the buffer's bytes.
        rows: super::q8::RowStarts<'a>,
        /// Bytes from a row's start to the head's blocks.
        head: usize,
    },
}

/// `count` tokens' values of one KV head and the query heads' probabilities for them
/// (`ps[j * n + token]` for the tile's `j`-th head).
#[derive(Clone, Copy)]
pub(super) struct Tile<'a> {
    pub vals: Vals<'a>,
    pub count: usize,
    pub ps: &'a [f32],
    pub n: usize,
}

/// Adds a tile's values into the outputs of `M` query heads (`out`, one after the other),
/// each token weighted by its head's probability. The outputs of two vectors of every head
/// stay in registers across all the tokens.
#[inline(always)]
pub(super) fn value_tile<const M: usize, const FMA: bool>(
    out: &mut [f32],
    hd: usize,
    tile: Tile<'_>,
) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    if M <= 3 && matches!(tile.vals, Vals::Q8 { .. }) {
        // A whole block (four vectors) at a time: its scale read once a token. Up to 12
        // accumulators, with the value vector, the scale and a weight: 15 of 16 registers.
        // (`f16` and `f32` rows gained nothing from it: 253 against 246 us at 2,048 tokens.)
        for c in (0..hd).step_by(super::super::q8_0::BLOCK) {
            value_columns::<M, 4, FMA>(out, hd, c, tile);
        }
        return;
    }
    let mut c = 0;
    while c < hd {
        // Two vectors at a time, one where a single one is left.
        let width = if hd - c >= 2 * LANES { 2 } else { 1 };
        if width == 2 {
            value_columns::<M, 2, FMA>(out, hd, c, tile);
        } else {
            value_columns::<M, 1, FMA>(out, hd, c, tile);
        }
        c += width * LANES;
    }
}

/// [`value_tile`] for the `W` vectors of every head's output from column `c`.
#[inline(always)]
fn value_columns<const M: usize, const W: usize, const FMA: bool>(
    out: &mut [f32],
    hd: usize,
    c: usize,
    tile: Tile<'_>,
) {
    let Tile { vals, count, ps, n } = tile;
    let ps: [&[f32]; M] = std::array::from_fn(|j| &ps[j * n..][..count]);
    match vals {
        Vals::F32 { vals, vstride } => simd::value_columns::<M, W, FMA>(simd::ValueColumns {
            out,
            hd,
            c,
            vals,
            vstride,
            count,
            ps,
        }),
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma"
        ))]
        Vals::Q8 { rows, head } => super::q8::ValueColumns {
            out,
            hd,
            c,
            rows,
            head,
            count,
            ps,
        }
        .add::<W>(),
    }
}
