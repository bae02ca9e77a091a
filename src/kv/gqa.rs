//! A grouped-query attention decode step over flat `past_key` / `past_value` buffers.
//!
//! The operator knows nothing of blocks or mappings: it reads `tokens × kv_heads × head_dim`
//! elements per buffer, laid out position-major, exactly as an ONNX GroupQueryAttention's
//! past inputs. The same code runs over a virtual buffer and over a `Vec`, so their outputs
//! can be compared bit for bit. K and V may be kept as `f32`, `f16` or `q8_0`, each its own
//! ([`KvRows`]; [`KvElement`] slices for the typed calls); the query and the output are
//! `f32`, and `f16` and `q8_0` rows are widened to `f32` as they are read.
//!
//! [`gqa_decode`] is built to run at the speed memory delivers the KV:
//! - **Each KV row is read once** for all the query heads that share it: a KV head's key is
//!   multiplied by its group of query heads as a small matrix (up to four at a time in
//!   registers), and its value is added into the group's outputs in the same pass.
//! - **Split-KV** (as flash-decoding): the context is cut into [`SPLIT_TOKENS`]-token pieces,
//!   each reduced on a worker thread to a partial softmax (its maximum, its sum, its weighted
//!   values), and the partials are merged in order. The pieces do not depend on the number of
//!   threads, so the result is the same bits on one thread or many.
//! - **Vector code chosen at run time:** compiled for the baseline and again for AVX2 with
//!   FMA, the version picked once by what the CPU supports (the `multiversion` crate does the
//!   detection and the dispatch). The key and value tiles are written in AVX2 + FMA
//!   intrinsics where the build has them (the compiler left a three-head tile's accumulators
//!   on the stack). `f16` rows are widened a split's rows at a time with F16C (the `half`
//!   crate's slice conversion); `q8_0` rows are read where they lie, each vector of eight
//!   values widened and scaled in registers as the tile uses it (the same bits as widening
//!   first; `gqa/q8.rs`), and widened first only in a build without AVX2.
//!
//! [`gqa_decode_plain`] is the same mathematics written as plainly as possible (one thread,
//! one element at a time, a whole-context softmax); tests hold the fast path to it.

use rayon::prelude::*;

use super::elem::{KvElement, KvRows};
use super::shape::Heads;

mod keys;
#[allow(unsafe_code)]
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod q8;
#[allow(unsafe_code)]
mod simd;
mod values;

use keys::{key_tile, pad, KeyHead, Keys};
use values::{value_tile, Tile, Vals};

/// Tokens in one split of the context. Fixed, so a context is cut the same way whatever the
/// thread count (and outputs do not change with it).
pub const SPLIT_TOKENS: usize = 256;

/// Query heads whose dot products with one key row are kept in registers together.
const TILE: usize = 4;
pub(super) use simd::LANES;
/// Tokens whose values are added into the outputs in one pass over a KV head (64 rows of a
/// 128-element head are 32 KiB: they stay in the first-level cache while each tile of query
/// heads reads them).
const CHUNK: usize = 64;

/// One decode step for one layer: `q` is `q_heads × head_dim`, `k` and `v` are
/// `tokens × kv_heads × head_dim`, `out` receives `q_heads × head_dim`. Query head `h`
/// attends with KV head `h / (q_heads / kv_heads)`; scores are scaled by `1/sqrt(head_dim)`
/// and softmax is max-subtracted. With no tokens the output is zero.
///
/// # Panics
/// If `kv_heads` does not divide `q_heads`, or a slice is shorter than the shape says.
pub fn gqa_decode<T: KvElement>(
    q: &[f32],
    k: &[T],
    v: &[T],
    tokens: usize,
    heads: Heads,
    out: &mut [f32],
) {
    gqa_decode_rows(q, T::rows(k), T::rows(v), tokens, heads, out);
}

/// [`gqa_decode`] over rows of any type ([`KvRows`]), K and V each as it is kept: `f16` and
/// `q8_0` rows are widened to `f32` a split at a time as they are read.
///
/// # Panics
/// As [`gqa_decode`] (a row count in values, for `q8_0` too).
pub fn gqa_decode_rows(
    q: &[f32],
    k: KvRows<'_>,
    v: KvRows<'_>,
    tokens: usize,
    heads: Heads,
    out: &mut [f32],
) {
    let dims = Dims::checked(q, k.len(), v.len(), tokens, heads, out);
    if tokens == 0 {
        out.fill(0.0);
        return;
    }
    if heads.dim % LANES != 0 {
        // The vector kernel works in whole vectors of a head; other shapes take the plain path.
        return match (k, v) {
            (KvRows::F32(k), KvRows::F32(v)) => gqa_decode_plain(q, k, v, tokens, heads, out),
            _ => gqa_decode_plain(q, &k.to_f32_vec(), &v.to_f32_vec(), tokens, heads, out),
        };
    }
    let rows = Rows { k, v };
    let splits = tokens.div_ceil(SPLIT_TOKENS);
    let width = dims.partial_len();
    let mut partials = vec![0f32; splits * width];
    let run = |(i, part): (usize, &mut [f32])| {
        let first = i * SPLIT_TOKENS;
        let n = SPLIT_TOKENS.min(tokens - first);
        split_partial(q, &rows, first, n, &dims, part);
    };
    if splits == 1 {
        run((0, &mut partials[..]));
    } else {
        partials.par_chunks_mut(width).enumerate().for_each(run);
    }
    merge(&partials, &dims, out);
}

/// The reference: the same step as [`gqa_decode`] written as plainly as possible (one thread,
/// every score of the context, then one softmax, then the weighted sum of values). Its
/// results differ from the fast path's only by the order of floating-point operations.
///
/// # Panics
/// As [`gqa_decode`].
pub fn gqa_decode_plain<T: KvElement>(
    q: &[f32],
    k: &[T],
    v: &[T],
    tokens: usize,
    heads: Heads,
    out: &mut [f32],
) {
    let Heads {
        q: q_heads,
        kv: kv_heads,
        dim: head_dim,
    } = heads;
    let dims = Dims::checked(
        q,
        k.len(),
        v.len(),
        tokens,
        Heads::new(q_heads, kv_heads, head_dim),
        out,
    );
    let (group, stride) = (dims.group, dims.stride);
    let mut scores = vec![0f32; tokens];
    for h in 0..q_heads {
        let qh = &q[h * head_dim..][..head_dim];
        let kv = (h / group) * head_dim;
        for (t, s) in scores.iter_mut().enumerate() {
            let kh = &k[t * stride + kv..][..head_dim];
            *s = qh.iter().zip(kh).map(|(a, b)| a * b.to_f32()).sum::<f32>() * dims.scale;
        }
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let oh = &mut out[h * head_dim..][..head_dim];
        oh.fill(0.0);
        for (t, p) in scores.iter().enumerate() {
            let vh = &v[t * stride + kv..][..head_dim];
            for (o, x) in oh.iter_mut().zip(vh) {
                *o += p / sum * x.to_f32();
            }
        }
    }
}

/// The shape of one call, checked.
pub(super) struct Dims {
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    group: usize,
    /// Elements in one token's row.
    stride: usize,
    scale: f32,
}

impl Dims {
    pub(super) fn checked(
        q: &[f32],
        k_len: usize,
        v_len: usize,
        tokens: usize,
        heads: Heads,
        out: &[f32],
    ) -> Dims {
        let Heads {
            q: q_heads,
            kv: kv_heads,
            dim: head_dim,
        } = heads;
        assert!(
            kv_heads > 0 && q_heads % kv_heads == 0,
            "kv_heads ({kv_heads}) must divide q_heads ({q_heads})"
        );
        let stride = kv_heads
            .checked_mul(head_dim)
            .expect("kv_heads x head_dim fits a usize");
        let q_len = q_heads
            .checked_mul(head_dim)
            .expect("q_heads x head_dim fits a usize");
        assert_eq!(q.len(), q_len, "q is q_heads x head_dim");
        assert_eq!(out.len(), q_len, "out is q_heads x head_dim");
        let kv_len = tokens.checked_mul(stride).expect("the KV fits a usize");
        assert!(
            k_len >= kv_len && v_len >= kv_len,
            "k and v hold `tokens` rows"
        );
        Dims {
            q_heads,
            kv_heads,
            head_dim,
            group: q_heads / kv_heads,
            stride,
            scale: 1.0 / (head_dim as f32).sqrt(),
        }
    }

    /// A split's partial result: per query head its maximum score and its sum of
    /// exponentials, then per query head its weighted sum of values.
    pub(super) fn partial_len(&self) -> usize {
        self.q_heads * (self.head_dim + 2)
    }
}

/// The KV rows of one call, K and V each in the type it is kept in.
pub(super) struct Rows<'a> {
    pub(super) k: KvRows<'a>,
    pub(super) v: KvRows<'a>,
}

/// Values `range` of `side` as `f32`: borrowed where kept as `f32`, else widened into `buf`
/// (exactly for `f16`; `q * d` for `q8_0`: the same numbers every time they are read, so a
/// split over them gives the same bits).
#[inline(always)]
fn widened<'b>(side: KvRows<'b>, range: std::ops::Range<usize>, buf: &'b mut [f32]) -> &'b [f32] {
    match side {
        KvRows::F32(x) => &x[range],
        other => {
            let dst = &mut buf[..range.len()];
            other.slice(range).widen_into(dst);
            dst
        }
    }
}

impl<'a> Rows<'a> {
    /// Whether any row must be widened before it is read.
    fn widens(&self) -> bool {
        !matches!((self.k, self.v), (KvRows::F32(_), KvRows::F32(_)))
    }

    /// Rows `first..first + n` of K and V as `f32` rows numbered from 0: borrowed where they
    /// are kept as `f32`, widened into `k_buf` and `v_buf` otherwise.
    pub(super) fn split<'b>(
        &'b self,
        first: usize,
        n: usize,
        stride: usize,
        k_buf: &'b mut Vec<f32>,
        v_buf: &'b mut Vec<f32>,
    ) -> Rows<'b> {
        let range = first * stride..(first + n) * stride;
        let side = |x: KvRows<'b>, buf: &'b mut Vec<f32>| {
            if !matches!(x, KvRows::F32(_)) {
                buf.resize(n * stride, 0.0);
            }
            KvRows::F32(widened(x, range.clone(), buf))
        };
        Rows {
            k: side(self.k, k_buf),
            v: side(self.v, v_buf),
        }
    }

    /// Rows `t..t + count` of K (`value: false`) or V as `f32`, one after the other: in
    /// place, or widened into `buf`.
    #[inline(always)]
    fn rows<'b>(
        &'b self,
        value: bool,
        t: usize,
        count: usize,
        stride: usize,
        buf: &'b mut [f32],
    ) -> &'b [f32] {
        let side = if value { self.v } else { self.k };
        match side {
            // Whole rows of a q8_0 buffer: found from the first, not sliced and searched.
            KvRows::Q8_0(x) if x.row_values() == stride => {
                let dst = &mut buf[..count * stride];
                x.widen_rows_into(t, count, 0, stride, dst);
                dst
            }
            _ => widened(side, t * stride..(t + count) * stride, buf),
        }
    }

    /// Reads one element of every cache line of V elements `from..from + len`, so
    /// the hardware's prefetchers stream them into the cache while the keys of the same rows
    /// are worked on: the value tiles, which read one head's rows a vector at a time, 4 KiB
    /// apart (a pattern no prefetcher follows across pages), then find them there. Returns
    /// the bits read, for the caller to keep (so the reads are not optimised away).
    #[inline(always)]
    fn touch_values(&self, from: usize, len: usize) -> u32 {
        match self.v {
            KvRows::F32(v) => v[from..][..len]
                .iter()
                .step_by(16)
                .fold(0u32, |a, x| a ^ x.to_bits()),
            KvRows::F16(v) => v[from..][..len]
                .iter()
                .step_by(32)
                .fold(0u32, |a, x| a ^ u32::from(x.to_bits())),
            KvRows::Q8_0(v) => v
                .slice(from..from + len)
                .span()
                .iter()
                .step_by(64)
                .fold(0u32, |a, x| a ^ u32::from(*x)),
        }
    }

    /// Where K (`value: false`) or V is `q8_0` read in place (whole rows, the AVX2 + FMA
    /// build, the `FMA` version): its bytes, with where rows `t..` start written into `at`
    /// (as many as it holds). `None` where the rows are widened first.
    #[inline(always)]
    #[allow(unused_variables)]
    fn q8_in_place<const FMA: bool>(
        &self,
        value: bool,
        t: usize,
        stride: usize,
        at: &mut [usize],
    ) -> Option<&'a [u8]> {
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma"
        ))]
        if let KvRows::Q8_0(x) = if value { self.v } else { self.k } {
            // Rows from within a row (a caller's slice) are widened, and refused there.
            let offsets = x.row_offsets(t).filter(|_| FMA && x.row_values() == stride);
            if let Some(offsets) = offsets {
                for (a, o) in at.iter_mut().zip(offsets) {
                    *a = o;
                }
                return Some(x.bytes());
            }
        }
        None
    }

    /// KV head `g` of V rows `t..t + count` as `f32`, with the distance between rows: in
    /// place (the rows' full stride), or widened into `buf` one head row after the other.
    #[inline(always)]
    fn head_rows<'b>(
        &'b self,
        t: usize,
        count: usize,
        g: usize,
        hd: usize,
        stride: usize,
        buf: &'b mut [f32],
    ) -> (&'b [f32], usize) {
        let span = (count - 1) * stride + hd;
        match self.v {
            KvRows::F32(v) => (&v[t * stride + g * hd..][..span], stride),
            KvRows::Q8_0(v) if v.row_values() == stride => {
                v.widen_rows_into(t, count, g * hd, hd, &mut buf[..count * hd]);
                (&buf[..count * hd], hd)
            }
            other => {
                for (i, dst) in buf[..count * hd].chunks_exact_mut(hd).enumerate() {
                    let at = (t + i) * stride + g * hd;
                    other.slice(at..at + hd).widen_into(dst);
                }
                (&buf[..count * hd], hd)
            }
        }
    }
}

/// One split's partial softmax: `n` tokens from `first`, written into `part` (see
/// [`Dims::partial_len`]). Compiled for the baseline and for AVX2 + FMA.
#[multiversion::multiversion(targets("x86_64+avx2+fma"))]
pub(super) fn split_partial(
    q: &[f32],
    rows: &Rows,
    first: usize,
    n: usize,
    dims: &Dims,
    part: &mut [f32],
) {
    let target = multiversion::target::selected_target!();
    if target.supports_feature_str("fma") && target.supports_feature_str("avx2") {
        match dims.head_dim {
            64 => split_body::<true, 64>(q, rows, first, n, dims, part),
            128 => split_body::<true, 128>(q, rows, first, n, dims, part),
            _ => split_body::<true, 0>(q, rows, first, n, dims, part),
        }
    } else {
        split_body::<false, 0>(q, rows, first, n, dims, part)
    }
}

#[inline(always)]
fn split_body<const FMA: bool, const HD: usize>(
    q: &[f32],
    rows: &Rows<'_>,
    first: usize,
    n: usize,
    d: &Dims,
    part: &mut [f32],
) {
    // The common head sizes are compiled as constants (loops unrolled, no bounds checks in
    // them); `HD == 0` takes the size from the shape.
    let hd = if HD > 0 { HD } else { d.head_dim };
    let (stats, acc) = part.split_at_mut(2 * d.q_heads);
    let (maxes, sums) = stats.split_at_mut(d.q_heads);
    // Scores of this split, query head major: `scores[h * n + t]`.
    let mut scores = vec![0f32; d.q_heads * n];
    // f16 rows are widened into this: two whole key rows, or a chunk of one head's values.
    let widened = if rows.widens() {
        (2 * d.stride).max(CHUNK * hd)
    } else {
        0
    };
    let mut buf = vec![0f32; widened];
    let span = Span { first, n, hd };
    split_scores::<FMA, HD>(q, rows, span, d, &mut scores, &mut buf);
    for h in 0..d.q_heads {
        let s = &mut scores[h * n..][..n];
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for x in s.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        maxes[h] = max;
        sums[h] = sum;
    }
    split_values::<FMA>(rows, span, d, &scores, acc, &mut buf);
}

/// The tokens a split covers, and the head size it runs at.
#[derive(Clone, Copy)]
struct Span {
    first: usize,
    n: usize,
    hd: usize,
}

/// A split's scores: keys two tokens at a time, each query vector loaded serving both rows.
#[inline(always)]
fn split_scores<const FMA: bool, const HD: usize>(
    q: &[f32],
    rows: &Rows<'_>,
    Span { first, n, hd }: Span,
    d: &Dims,
    scores: &mut [f32],
    buf: &mut [f32],
) {
    let (group, stride) = (d.group, d.stride);
    let mut touched = 0u32;
    let mut t = 0;
    while t < n {
        let count = 2.min(n - t);
        let mut at = [0usize; 2];
        let keys = match rows.q8_in_place::<FMA>(false, first + t, stride, &mut at[..count]) {
            #[cfg(all(
                target_arch = "x86_64",
                target_feature = "avx2",
                target_feature = "fma"
            ))]
            Some(bytes) => Keys::Q8 { bytes, at },
            _ => Keys::F32(rows.rows(false, first + t, count, stride, buf)),
        };
        // The value rows of the same tokens, every head at once (a q8_0 row is found once).
        touched ^= rows.touch_values((first + t) * stride, count * stride);
        for g in 0..d.kv_heads {
            let k = KeyHead {
                keys,
                g,
                hd,
                stride,
            };
            let mut h = g * group;
            while h < (g + 1) * group {
                let m = TILE.min((g + 1) * group - h);
                let qs = &q[h * hd..][..m * hd];
                let dots = match (m, count) {
                    (4, 2) => key_tile::<4, 2, FMA>(qs, k),
                    (4, _) => pad(key_tile::<4, 1, FMA>(qs, k)),
                    (3, 2) => pad(key_tile::<3, 2, FMA>(qs, k)),
                    (3, _) => pad(key_tile::<3, 1, FMA>(qs, k)),
                    (2, 2) => pad(key_tile::<2, 2, FMA>(qs, k)),
                    (2, _) => pad(key_tile::<2, 1, FMA>(qs, k)),
                    (_, 2) => pad(key_tile::<1, 2, FMA>(qs, k)),
                    _ => pad(key_tile::<1, 1, FMA>(qs, k)),
                };
                for (j, row) in dots.iter().take(m).enumerate() {
                    for (i, dot) in row.iter().take(count).enumerate() {
                        scores[(h + j) * n + t + i] = dot * d.scale;
                    }
                }
                h += m;
            }
        }
        t += count;
    }
    std::hint::black_box(touched);
}

/// A split's weighted values: a chunk of tokens at a time (small enough to stay in the
/// first-level cache), one KV head at a time; a tile of its query heads keeps its outputs in
/// registers across the chunk, and each value vector loaded serves the whole tile.
#[inline(always)]
fn split_values<const FMA: bool>(
    rows: &Rows<'_>,
    Span { first, n, hd }: Span,
    d: &Dims,
    scores: &[f32],
    acc: &mut [f32],
    buf: &mut [f32],
) {
    let (group, stride) = (d.group, d.stride);
    acc.fill(0.0);
    let mut t = 0;
    let mut at = [0usize; CHUNK];
    while t < n {
        let count = CHUNK.min(n - t);
        let q8 = rows.q8_in_place::<FMA>(true, first + t, stride, &mut at[..count]);
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma"
        ))]
        let (q8, head) = {
            let head = |values: usize| values / super::q8_0::BLOCK * super::q8_0::BLOCK_BYTES;
            let rows = q8.map(|bytes| q8::RowStarts::new(bytes, &at[..count], head(stride)));
            (rows, head(hd))
        };
        for g in 0..d.kv_heads {
            let vals = match q8 {
                #[cfg(all(
                    target_arch = "x86_64",
                    target_feature = "avx2",
                    target_feature = "fma"
                ))]
                Some(rows) => Vals::Q8 {
                    rows,
                    head: g * head,
                },
                _ => {
                    let (vals, vstride) = rows.head_rows(first + t, count, g, hd, stride, buf);
                    Vals::F32 { vals, vstride }
                }
            };
            let mut h = g * group;
            while h < (g + 1) * group {
                let m = TILE.min((g + 1) * group - h);
                let out = &mut acc[h * hd..(h + m) * hd];
                let tile = Tile {
                    vals,
                    count,
                    ps: &scores[h * n + t..],
                    n,
                };
                match m {
                    4 => value_tile::<4, FMA>(out, hd, tile),
                    3 => value_tile::<3, FMA>(out, hd, tile),
                    2 => value_tile::<2, FMA>(out, hd, tile),
                    _ => value_tile::<1, FMA>(out, hd, tile),
                }
                h += m;
            }
        }
        t += count;
    }
}

/// Merges the splits' partial softmaxes, in split order, into the output.
pub(super) fn merge(partials: &[f32], d: &Dims, out: &mut [f32]) {
    let width = d.partial_len();
    let hd = d.head_dim;
    for h in 0..d.q_heads {
        let max = partials
            .chunks_exact(width)
            .map(|p| p[h])
            .fold(f32::NEG_INFINITY, f32::max);
        let oh = &mut out[h * hd..][..hd];
        oh.fill(0.0);
        let mut sum = 0f32;
        for p in partials.chunks_exact(width) {
            let w = (p[h] - max).exp();
            sum += w * p[d.q_heads + h];
            let acc = &p[2 * d.q_heads + h * hd..][..hd];
            for (o, a) in oh.iter_mut().zip(acc) {
                *o += w * a;
            }
        }
        let inv = 1.0 / sum;
        for o in oh.iter_mut() {
            *o *= inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attends_to_the_matching_key() {
        // Two tokens, one KV head, two query heads grouped on it.
        let (q_heads, kv_heads, d) = (2, 1, 2);
        let k = [100.0, 0.0, 0.0, 100.0];
        let v = [1.0, 2.0, 3.0, 4.0];
        let q = [1.0, 0.0, 0.0, 1.0];
        let mut out = [0f32; 4];
        gqa_decode(&q, &k, &v, 2, Heads::new(q_heads, kv_heads, d), &mut out);
        assert!(
            (out[0] - 1.0).abs() < 1e-3 && (out[1] - 2.0).abs() < 1e-3,
            "{out:?}"
        );
        assert!(
            (out[2] - 3.0).abs() < 1e-3 && (out[3] - 4.0).abs() < 1e-3,
            "{out:?}"
        );
    }

    #[test]
    fn f16_kv_gives_the_f32_result_of_its_widened_values() {
        // Values exactly representable in f16: the two paths see the same numbers. Long
        // enough for several splits, head_dim a whole number of vectors (the fast path).
        let (q_heads, kv_heads, d, tokens) = (4, 2, 16, 3 * SPLIT_TOKENS + 5);
        let k32: Vec<f32> = (0..tokens * kv_heads * d)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
            .collect();
        let v32: Vec<f32> = (0..tokens * kv_heads * d)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0)
            .collect();
        let k16: Vec<half::f16> = k32.iter().map(|x| half::f16::from_f32(*x)).collect();
        let v16: Vec<half::f16> = v32.iter().map(|x| half::f16::from_f32(*x)).collect();
        let q: Vec<f32> = (0..q_heads * d).map(|i| (i as f32).sin()).collect();
        let (mut a, mut b) = (vec![0f32; q_heads * d], vec![0f32; q_heads * d]);
        gqa_decode(
            &q,
            &k32,
            &v32,
            tokens,
            Heads::new(q_heads, kv_heads, d),
            &mut a,
        );
        gqa_decode(
            &q,
            &k16,
            &v16,
            tokens,
            Heads::new(q_heads, kv_heads, d),
            &mut b,
        );
        assert_eq!(a, b, "same widened values, same operations");
    }

    #[test]
    fn one_token_returns_its_value() {
        let mut out = [0f32; 4];
        gqa_decode(
            &[0.3, -1.0, 2.0, 0.5],
            &[1.0, 1.0],
            &[7.0, -7.0],
            1,
            Heads::new(2, 1, 2),
            &mut out,
        );
        assert_eq!(out, [7.0, -7.0, 7.0, -7.0]);
    }

    #[test]
    fn no_tokens_give_zeros() {
        let mut out = [1f32; 16];
        gqa_decode::<f32>(&[0.5; 16], &[], &[], 0, Heads::new(2, 1, 8), &mut out);
        assert_eq!(out, [0.0; 16]);
    }

    /// `q8_0` rows sliced from within a row are refused as the widening path refuses them,
    /// not read in place from the wrong bytes.
    #[test]
    #[should_panic(expected = "whole blocks of one row")]
    fn q8_0_rows_from_within_a_row_are_refused() {
        use crate::kv::{q8_0, KvDtype, Q8Rows, RowLayout};
        let layout = RowLayout::of(KvDtype::Q8_0, q8_0::bytes_for(64).unwrap() as u64);
        let mut bytes = vec![0u8; 4096];
        let x: Vec<f32> = (0..3 * 64).map(|i| i as f32 * 0.01).collect();
        for t in 0..3 {
            let at = layout.offset(t as u64) as usize;
            q8_0::quantize(&x[t * 64..][..64], &mut bytes[at..at + 68]);
        }
        let rows = Q8Rows::new(&bytes, 3, 64, layout)
            .unwrap()
            .slice(32..3 * 64);
        let mut out = [0f32; 64];
        let q = [0.1f32; 64];
        let (k, v) = (KvRows::Q8_0(rows), KvRows::Q8_0(rows));
        gqa_decode_rows(&q, k, v, 2, Heads::new(1, 1, 64), &mut out);
    }

    #[test]
    #[should_panic(expected = "must divide")]
    fn a_group_that_does_not_divide_is_refused() {
        let mut out = [0f32; 24];
        gqa_decode::<f32>(
            &[0.0; 24],
            &[0.0; 16],
            &[0.0; 16],
            1,
            Heads::new(3, 2, 8),
            &mut out,
        );
    }
}
