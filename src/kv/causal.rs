//! Causal attention of a chunk of new rows over flat K/V: what a prefill step runs.
//!
//! A step that writes `rows` new tokens of one sequence after `start` held ones attends each
//! new row `j` to the first `start + j + 1` rows of the same flat buffers: the row sees its
//! own sequence up to and including itself, never a later row of the chunk. Each row is the
//! [`gqa_decode`](super::gqa_decode) of that prefix, so a chunk gives, row for row, the same bits as the same
//! tokens decoded one step at a time, and the result does not depend on how many threads run
//! it.
//!
//! The work is cut as the decode operator cuts a context: into splits of
//! [`SPLIT_TOKENS`](super::gqa::SPLIT_TOKENS) tokens, each reduced to a partial softmax, the
//! partials merged in split order. A chunk runs a split for a block of [`ROW_BLOCK`] rows at
//! once: the split's K/V rows are read (and `f16` widened) once for the block, not once per
//! row, while each row's partial is computed exactly as its own decode step computes it.
//! K and V may be of any type ([`gqa_causal_rows`]); `q8_0` rows are widened once a block.

use rayon::prelude::*;

use super::elem::{KvElement, KvRows};
use super::gqa::{gqa_decode_rows, merge, split_partial, Dims, Rows, LANES, SPLIT_TOKENS};
use super::shape::Heads;

/// Rows of a chunk that share one reading of a split's K/V.
pub const ROW_BLOCK: usize = 16;

/// About the most bytes of partial softmaxes a chunk holds at once (at least a block's rows').
const PARTIALS_BYTES: usize = 8 << 20;

/// Causal GQA of a chunk: `q` holds `rows × q_heads × head_dim` (row-major), `k` and `v` at
/// least `(start + rows) × kv_heads × head_dim` elements, and `out` receives `rows × q_heads ×
/// head_dim`. Row `j` attends to K/V rows `0..=start + j`. With no row it does nothing.
///
/// # Panics
/// As [`gqa_decode`](super::gqa_decode): if `kv_heads` does not divide `q_heads`, `q` is not whole rows, or a
/// slice is shorter than the shape says.
pub fn gqa_causal<T: KvElement>(
    q: &[f32],
    k: &[T],
    v: &[T],
    start: usize,
    heads: Heads,
    out: &mut [f32],
) {
    gqa_causal_rows(q, T::rows(k), T::rows(v), start, heads, out);
}

/// [`gqa_causal`] over rows of any type, K and V each as it is kept ([`KvRows`]).
///
/// # Panics
/// As [`gqa_causal`].
pub fn gqa_causal_rows(
    q: &[f32],
    k: KvRows<'_>,
    v: KvRows<'_>,
    start: usize,
    heads: Heads,
    out: &mut [f32],
) {
    let Heads {
        q: q_heads,
        kv: kv_heads,
        dim: head_dim,
    } = heads;
    let width = q_heads
        .checked_mul(head_dim)
        .expect("q_heads x head_dim fits a usize");
    if width == 0 || q.is_empty() {
        return;
    }
    assert!(
        q.len() % width == 0 && out.len() == q.len(),
        "q and out hold whole rows of {width} elements"
    );
    let stride = kv_heads
        .checked_mul(head_dim)
        .expect("kv_heads x head_dim fits a usize");
    let rows = q.len() / width;
    let needed = start
        .checked_add(rows)
        .and_then(|t| t.checked_mul(stride))
        .expect("the context fits a usize");
    assert!(
        k.len() >= needed && v.len() >= needed,
        "K and V hold {needed} elements at least"
    );
    if rows > 1 && head_dim % LANES == 0 {
        return blocked(q, k, v, start, heads, out);
    }
    let row = |(j, o): (usize, &mut [f32])| {
        let tokens = start + j + 1;
        let seen = tokens * stride;
        let qj = &q[j * width..(j + 1) * width];
        gqa_decode_rows(qj, k.slice(0..seen), v.slice(0..seen), tokens, heads, o);
    };
    if rows == 1 {
        row((0, out));
    } else {
        out.par_chunks_mut(width).enumerate().for_each(row);
    }
}

/// [`gqa_causal`] a group of rows at a time, each group a chunk of its own (the rows before it
/// are its context), so that the partials held at once stay near [`PARTIALS_BYTES`] however
/// long the chunk: or a block's, [`ROW_BLOCK`] rows, where one row's alone are more (16 rows
/// of 32 heads of 128 at a 64K context hold 68 MB).
fn blocked(q: &[f32], k: KvRows, v: KvRows, start: usize, heads: Heads, out: &mut [f32]) {
    let Heads {
        q: q_heads,
        dim: head_dim,
        ..
    } = heads;
    let width = q_heads * head_dim;
    let rows = q.len() / width;
    // A row's partials: one per split of the longest context, each `q_heads × (head_dim + 2)`.
    let row_bytes = (start + rows)
        .div_ceil(SPLIT_TOKENS)
        .saturating_mul(q_heads)
        .saturating_mul(head_dim + 2)
        .saturating_mul(4);
    let group = (PARTIALS_BYTES / row_bytes.max(1)).max(ROW_BLOCK) / ROW_BLOCK * ROW_BLOCK;
    let groups = q.chunks(group * width).zip(out.chunks_mut(group * width));
    for (g, (qg, og)) in groups.enumerate() {
        blocked_group(qg, k, v, start + g * group, heads, og);
    }
}

/// [`blocked`] for one group: the partial softmax of split `s` for row `j` is
/// `partials[((b * splits + s) * ROW_BLOCK + j % ROW_BLOCK) * part..]`, `b` the row's block;
/// then each row merges its own, in split order.
fn blocked_group(q: &[f32], k: KvRows, v: KvRows, start: usize, heads: Heads, out: &mut [f32]) {
    let Heads {
        q: q_heads,
        kv: kv_heads,
        dim: head_dim,
    } = heads;
    let width = q_heads * head_dim;
    let rows = q.len() / width;
    let total = start + rows;
    let dims = Dims::checked(&q[..width], k.len(), v.len(), total, heads, &out[..width]);
    let stride = kv_heads * head_dim;
    let part = dims.partial_len();
    let splits = total.div_ceil(SPLIT_TOKENS);
    let kept = Rows { k, v };
    let mut partials = vec![0f32; rows.div_ceil(ROW_BLOCK) * splits * ROW_BLOCK * part];
    let unit = |(u, chunk): (usize, &mut [f32])| {
        let (block, first) = (u / splits * ROW_BLOCK, u % splits * SPLIT_TOKENS);
        let last = (block + ROW_BLOCK).min(rows);
        // Row `j` sees tokens `..start + j + 1`: the block's last row sees the most.
        let seen = start + last;
        if first >= seen {
            return;
        }
        let (mut k_buf, mut v_buf) = (Vec::new(), Vec::new());
        let n = SPLIT_TOKENS.min(seen - first);
        let split = kept.split(first, n, stride, &mut k_buf, &mut v_buf);
        for j in block..last {
            let tokens = start + j + 1;
            if first < tokens {
                let qj = &q[j * width..][..width];
                let pj = &mut chunk[(j - block) * part..][..part];
                split_partial(qj, &split, 0, SPLIT_TOKENS.min(tokens - first), &dims, pj);
            }
        }
    };
    partials
        .par_chunks_mut(ROW_BLOCK * part)
        .enumerate()
        .for_each(unit);
    out.par_chunks_mut(width).enumerate().for_each(|(j, o)| {
        let own = (start + j + 1).div_ceil(SPLIT_TOKENS);
        let (block, at) = (j / ROW_BLOCK, j % ROW_BLOCK);
        let mut mine = Vec::with_capacity(own * part);
        for s in 0..own {
            mine.extend_from_slice(
                &partials[((block * splits + s) * ROW_BLOCK + at) * part..][..part],
            );
        }
        merge(&mine, &dims, o);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::gqa::{gqa_decode, gqa_decode_plain};
    use crate::kv::Heads;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
            .collect()
    }

    /// Each row sees only the rows before it and itself: changing a later row of K/V changes
    /// nothing earlier, and every row matches the plain reference over its own prefix.
    #[test]
    fn each_row_sees_its_prefix_and_nothing_after() {
        let (qh, kh, hd, start, rows) = (8, 2, 16, 5, 7);
        let stride = kh * hd;
        let q = data(rows * qh * hd, 1);
        let k = data((start + rows) * stride, 2);
        let v = data((start + rows) * stride, 3);
        let mut out = vec![0f32; q.len()];
        gqa_causal(&q, &k, &v, start, Heads::new(qh, kh, hd), &mut out);
        for j in 0..rows {
            let t = start + j + 1;
            let mut want = vec![0f32; qh * hd];
            let qj = &q[j * qh * hd..(j + 1) * qh * hd];
            gqa_decode_plain(
                qj,
                &k[..t * stride],
                &v[..t * stride],
                t,
                Heads::new(qh, kh, hd),
                &mut want,
            );
            let got = &out[j * qh * hd..(j + 1) * qh * hd];
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "row {j}: {a} vs {b}");
            }
        }
        // The last row's K/V changed: every earlier row keeps its bits.
        let mut k2 = k.clone();
        k2[(start + rows - 1) * stride..]
            .iter_mut()
            .for_each(|x| *x += 1.0);
        let mut out2 = vec![0f32; q.len()];
        gqa_causal(&q, &k2, &v, start, Heads::new(qh, kh, hd), &mut out2);
        let earlier = (rows - 1) * qh * hd;
        assert_eq!(out[..earlier], out2[..earlier]);
        assert_ne!(out[earlier..], out2[earlier..]);
    }

    /// Every row of a chunk gets the bits of its own decode step, over `f32` and `f16` K/V,
    /// for chunks that start anywhere, cross splits and fill blocks in part.
    #[test]
    fn a_chunk_gives_each_row_the_bits_of_its_own_decode_step() {
        fn check<T: KvElement>((qh, kh, hd): (usize, usize, usize), start: usize, rows: usize) {
            let (w, stride) = (qh * hd, kh * hd);
            let q = data(rows * w, 7);
            let kv = |seed| -> Vec<T> {
                data((start + rows) * stride, seed)
                    .into_iter()
                    .map(T::from_f32)
                    .collect()
            };
            let (k, v) = (kv(8), kv(9));
            let mut out = vec![0f32; q.len()];
            gqa_causal(&q, &k, &v, start, Heads::new(qh, kh, hd), &mut out);
            for j in 0..rows {
                let t = start + j + 1;
                let mut want = vec![0f32; w];
                let (kj, vj) = (&k[..t * stride], &v[..t * stride]);
                gqa_decode(
                    &q[j * w..][..w],
                    kj,
                    vj,
                    t,
                    Heads::new(qh, kh, hd),
                    &mut want,
                );
                assert_eq!(
                    out[j * w..][..w],
                    want[..],
                    "row {j} of {rows} from {start}"
                );
            }
        }
        // A context long enough that the chunk runs in groups of 16 rows (32 query heads of
        // 128: each row's partials over 17 splits take 283 KB, 29 rows' fill the cap).
        check::<f32>((32, 8, 128), 4_200, 40);
        for (start, rows) in [(0, 40), (250, 300), (517, 17), (0, 2), (254, 3), (255, 1)] {
            check::<f32>((9, 3, 64), start, rows);
            check::<half::f16>((9, 3, 64), start, rows);
            check::<f32>((8, 2, 16), start, rows);
        }
    }

    #[test]
    #[should_panic(expected = "K and V hold")]
    fn a_short_context_is_refused() {
        let q = vec![0f32; 2 * 4];
        let k = vec![0f32; 4];
        let mut out = vec![0f32; 8];
        gqa_causal(&q, &k, &k, 3, Heads::new(1, 1, 4), &mut out);
    }
}
