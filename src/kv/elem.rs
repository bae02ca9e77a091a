//! The element types KV can be kept in, rows of any of them, and the flat layout a server's
//! kernels see.

use bytemuck::Pod;
use half::slice::HalfFloatSliceExt;

use super::q8_0;
use super::shape::{KvDtype, RowLayout};
use crate::api::Place;

/// A type K and V elements are stored as: `f32` or `half::f16`.
pub trait KvElement: Pod + Send + Sync + 'static {
    /// The matching element type of a shape.
    const DTYPE: KvDtype;
    /// The value as an `f32` (exact for both types).
    fn to_f32(self) -> f32;
    /// The nearest value of this type.
    fn from_f32(x: f32) -> Self;
    /// Rows kept in this type, as the operators take any type.
    fn rows(x: &[Self]) -> KvRows<'_>;
}

impl KvElement for f32 {
    const DTYPE: KvDtype = KvDtype::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    fn rows(x: &[Self]) -> KvRows<'_> {
        KvRows::F32(x)
    }
}

impl KvElement for half::f16 {
    const DTYPE: KvDtype = KvDtype::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
    fn rows(x: &[Self]) -> KvRows<'_> {
        KvRows::F16(x)
    }
}

/// KV rows as they are kept, whatever the type: what the attention operators read
/// ([`gqa_decode_rows`](super::gqa_decode_rows)) and what a step hands its kernels. K and V
/// may be of different types.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvRows<'a> {
    /// `f32` values.
    F32(&'a [f32]),
    /// `f16` values.
    F16(&'a [half::f16]),
    /// `q8_0` blocks ([`q8_0`](super::q8_0)), in rows laid out as their buffer keeps them.
    Q8_0(Q8Rows<'a>),
}

/// `q8_0` rows as a buffer keeps them ([`RowLayout`]: SmolLM2's 204-byte rows come 20 to a
/// page): values `start..start + len` counted from row 0, every row `row_values` values
/// (whole blocks). Two are equal when they hold the same blocks, wherever those lie.
#[derive(Debug, Clone, Copy)]
pub struct Q8Rows<'a> {
    bytes: &'a [u8],
    rows: RowLayout,
    row_values: usize,
    start: usize,
    len: usize,
}

impl<'a> Q8Rows<'a> {
    /// Whole blocks one after the other (`None` where `bytes` is not whole blocks).
    pub fn dense(bytes: &'a [u8]) -> Option<Self> {
        let rows = bytes.len() / q8_0::BLOCK_BYTES;
        Q8Rows::new(
            bytes,
            rows,
            q8_0::BLOCK,
            RowLayout::dense(q8_0::BLOCK_BYTES as u64),
        )
        .filter(|_| bytes.len() % q8_0::BLOCK_BYTES == 0)
    }

    /// `rows` rows of `row_values` values from the start of `bytes`, laid out as `layout`:
    /// `None` where the values are not whole blocks, the layout's rows are not their size, or
    /// `bytes` does not hold them.
    pub fn new(bytes: &'a [u8], rows: usize, row_values: usize, layout: RowLayout) -> Option<Self> {
        let row_bytes = q8_0::bytes_for(row_values)? as u64;
        let fits = layout.row_bytes == row_bytes
            && layout.group_rows >= 1
            && layout.group_bytes >= layout.group_rows.checked_mul(row_bytes)?;
        let end = layout.checked_offset(rows as u64)?;
        (fits && end <= bytes.len() as u64).then_some(Q8Rows {
            bytes,
            rows: layout,
            row_values,
            start: 0,
            len: rows.checked_mul(row_values)?,
        })
    }

    /// Values held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Values in one row (32 where made of bare blocks, [`Q8Rows::dense`]).
    pub fn row_values(&self) -> usize {
        self.row_values
    }

    /// Whether no value is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where value `v` (counted from row 0, on a block) lies in the bytes.
    #[inline]
    fn byte_of(&self, v: usize) -> usize {
        let rows = &self.rows;
        // In 32 bits where everything fits (a decode finds a row a few times a token: a
        // 32-bit division is the cheaper one).
        if let (Ok(v), Ok(rv), Ok(g)) = (
            u32::try_from(v),
            u32::try_from(self.row_values),
            u32::try_from(rows.group_rows),
        ) {
            let (row, within) = (v / rv, v % rv);
            let (group, at) = (row / g, row % g);
            return group as usize * rows.group_bytes as usize
                + at as usize * rows.row_bytes as usize
                + within as usize / q8_0::BLOCK * q8_0::BLOCK_BYTES;
        }
        let (row, within) = (v / self.row_values, v % self.row_values);
        self.rows.offset(row as u64) as usize + within / q8_0::BLOCK * q8_0::BLOCK_BYTES
    }

    /// The blocks held, a run of contiguous whole blocks at a time (a group of rows, or part
    /// of one; all of them where no group has spare bytes).
    pub fn pieces(&self) -> impl Iterator<Item = &'a [u8]> + 'a {
        let (this, end) = (*self, self.start + self.len);
        // The rows of a group lie back to back: a piece runs to the end of its group, or to
        // the end where no group has spare bytes.
        let rows = this.rows;
        let run = match rows.group_bytes == rows.group_rows * rows.row_bytes {
            true => usize::MAX,
            false => rows.group_rows as usize * this.row_values,
        };
        let mut v = self.start;
        std::iter::from_fn(move || {
            if v >= end {
                return None;
            }
            let to = match run {
                usize::MAX => end,
                run => ((v / run + 1) * run).min(end),
            };
            let at = this.byte_of(v);
            let bytes = (to - v) / q8_0::BLOCK * q8_0::BLOCK_BYTES;
            v = to;
            Some(&this.bytes[at..at + bytes])
        })
    }

    /// The bytes from the first block held to the end of the last (the spare bytes between
    /// groups included): what a prefetch touches.
    pub fn span(&self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        let last = self.start + self.len - q8_0::BLOCK;
        &self.bytes[self.byte_of(self.start)..self.byte_of(last) + q8_0::BLOCK_BYTES]
    }

    /// Values `range` of these (on block boundaries).
    ///
    /// # Panics
    /// If the range is past the values held, or cuts a block.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Self {
        let b = q8_0::BLOCK;
        assert!(
            range.start % b == 0 && range.end % b == 0,
            "q8_0 rows are cut on blocks of {b}"
        );
        assert!(
            range.start <= range.end && range.end <= self.len,
            "q8_0 values {range:?} of {}",
            self.len
        );
        Q8Rows {
            start: self.start + range.start,
            len: range.len(),
            ..*self
        }
    }

    /// Widens every value into `dst` (exactly [`Q8Rows::len`] of it).
    ///
    /// # Panics
    /// If `dst` is not that long.
    pub fn widen_into(&self, dst: &mut [f32]) {
        assert_eq!(dst.len(), self.len, "widened into as many values");
        let mut at = 0;
        for piece in self.pieces() {
            let n = q8_0::values_in(piece.len());
            q8_0::dequantize(piece, &mut dst[at..at + n]);
            at += n;
        }
    }

    /// Widens values `w..w + n` (on blocks, within one row) of each of `count` rows of these,
    /// from the row value `first × row values + w` falls in, into `dst`, row after row: one
    /// head of a run of rows, finding each row from the last.
    ///
    /// # Panics
    /// If the values are not held, cut a block or pass a row, or `dst` is not `count × n`.
    pub fn widen_rows_into(&self, first: usize, count: usize, w: usize, n: usize, dst: &mut [f32]) {
        let (b, rv) = (q8_0::BLOCK, self.row_values);
        let v = self.start + first * rv + w;
        assert!(
            w % b == 0 && n % b == 0 && v % rv + n <= rv,
            "whole blocks of one row"
        );
        assert!(first * rv + w + (count.max(1) - 1) * rv + n <= self.len || count == 0);
        assert_eq!(dst.len(), count * n, "widened into as many values");
        if count == 0 {
            return;
        }
        let len = n / b * q8_0::BLOCK_BYTES;
        for (out, at) in dst.chunks_exact_mut(n).zip(self.offsets_from(v)) {
            q8_0::dequantize(&self.bytes[at..at + len], out);
        }
    }

    /// The bytes the rows lie in (from row 0, whatever these hold of them).
    pub(crate) fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Where rows `first`, `first + 1`, ... of these start in [`Q8Rows::bytes`] (on and on:
    /// the caller takes as many as it holds); `None` where these do not start on a row (a
    /// slice from within one), so no row of them starts anywhere.
    pub(crate) fn row_offsets(&self, first: usize) -> Option<impl Iterator<Item = usize>> {
        (self.start % self.row_values == 0)
            .then(|| self.offsets_from(self.start + first * self.row_values))
    }

    /// Where value `v` lies, then the same value of each row after it: found from the last
    /// (the rows left in a group counted down, no division a row).
    fn offsets_from(&self, v: usize) -> impl Iterator<Item = usize> {
        let rows = self.rows;
        let spare = (rows.group_bytes - rows.group_rows * rows.row_bytes) as usize;
        let (g, rb) = (rows.group_rows as usize, rows.row_bytes as usize);
        let mut left = g - (v / self.row_values) % g;
        let mut at = self.byte_of(v);
        std::iter::from_fn(move || {
            let here = at;
            left -= 1;
            at += rb;
            if left == 0 {
                at += spare;
                left = g;
            }
            Some(here)
        })
    }

    /// The blocks held, one after the other.
    pub fn to_blocks(&self) -> Vec<u8> {
        self.pieces().flatten().copied().collect()
    }
}

impl PartialEq for Q8Rows<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.pieces().flatten().eq(other.pieces().flatten())
    }
}

impl<'a> KvRows<'a> {
    /// Rows of `dtype` in `bytes` (as a buffer holds them): `None` when the bytes are not
    /// whole values of that type, or not aligned for it.
    pub fn from_bytes(dtype: KvDtype, bytes: &'a [u8]) -> Option<Self> {
        match dtype {
            KvDtype::F32 => bytemuck::try_cast_slice(bytes).ok().map(KvRows::F32),
            KvDtype::F16 => bytemuck::try_cast_slice(bytes).ok().map(KvRows::F16),
            KvDtype::Q8_0 => Q8Rows::dense(bytes).map(KvRows::Q8_0),
        }
    }

    /// `rows` rows of `row_values` values of `dtype` from the start of `bytes`, laid out as
    /// `layout` (a buffer's [`KvShape::rows`](super::KvShape::rows)): `None` where the layout
    /// does not fit the type's rows (`f32` and `f16` rows are dense) or `bytes` does not hold
    /// them.
    pub fn from_layout(
        dtype: KvDtype,
        bytes: &'a [u8],
        rows: usize,
        row_values: usize,
        layout: RowLayout,
    ) -> Option<Self> {
        if dtype == KvDtype::Q8_0 {
            return Q8Rows::new(bytes, rows, row_values, layout).map(KvRows::Q8_0);
        }
        let row_bytes = dtype.row_bytes(row_values)?;
        let len = rows.checked_mul(row_bytes as usize)?;
        let fits = layout.is_dense() && layout.row_bytes == row_bytes && len <= bytes.len();
        fits.then(|| KvRows::from_bytes(dtype, &bytes[..len]))?
    }

    /// The element type.
    pub fn dtype(&self) -> KvDtype {
        match self {
            KvRows::F32(_) => KvDtype::F32,
            KvRows::F16(_) => KvDtype::F16,
            KvRows::Q8_0(_) => KvDtype::Q8_0,
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            KvRows::F32(x) => x.len(),
            KvRows::F16(x) => x.len(),
            KvRows::Q8_0(x) => x.len(),
        }
    }

    /// Whether no value is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values `range` (for `q8_0`, on block boundaries).
    ///
    /// # Panics
    /// If the range is past the rows, or cuts a `q8_0` block.
    pub fn slice(&self, range: std::ops::Range<usize>) -> KvRows<'a> {
        match *self {
            KvRows::F32(x) => KvRows::F32(&x[range]),
            KvRows::F16(x) => KvRows::F16(&x[range]),
            KvRows::Q8_0(x) => KvRows::Q8_0(x.slice(range)),
        }
    }

    /// Widens every value into `dst` (exactly [`KvRows::len`] of it): the same numbers for
    /// `f32` and `f16`, `q * d` for `q8_0`.
    ///
    /// # Panics
    /// If `dst` is not that long.
    pub fn widen_into(&self, dst: &mut [f32]) {
        assert_eq!(dst.len(), self.len(), "widened into as many values");
        match self {
            KvRows::F32(x) => dst.copy_from_slice(x),
            KvRows::F16(x) => x.convert_to_f32_slice(dst),
            KvRows::Q8_0(x) => x.widen_into(dst),
        }
    }

    /// Every value widened to `f32`.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.len()];
        self.widen_into(&mut out);
        out
    }
}

/// Writes `src` into `dst` as `dtype` keeps it: copied as `f32`, rounded to `f16`, or
/// quantized to `q8_0` blocks. `dst` is exactly [`KvDtype::row_bytes`] of `src`.
///
/// # Panics
/// If `dst` is not that size (or, for `q8_0`, `src` is not whole blocks).
pub fn narrow_into(dtype: KvDtype, src: &[f32], dst: &mut [u8]) {
    assert_eq!(
        dtype.row_bytes(src.len()),
        Some(dst.len() as u64),
        "{} values of {dtype} take the destination's bytes",
        src.len()
    );
    match dtype {
        KvDtype::F32 => dst.copy_from_slice(bytemuck::cast_slice(src)),
        KvDtype::F16 => match bytemuck::try_cast_slice_mut::<u8, half::f16>(dst) {
            Ok(halves) => halves.convert_from_f32_slice(src),
            Err(_) => {
                for (d, x) in dst.chunks_exact_mut(2).zip(src) {
                    d.copy_from_slice(&half::f16::from_f32(*x).to_le_bytes());
                }
            }
        },
        KvDtype::Q8_0 => q8_0::quantize(src, dst),
    }
}

/// Where one layer's K (or V) of one sequence lies, as a kernel reads it: `tokens` rows from
/// `addr`, position-major, each row `kv_heads` heads of `head_dim` elements (head `h` at
/// `h * head_stride` into the row). Rows come in groups of `group_rows`, `group_stride` bytes
/// apart, row after row within a group: row `t` at `addr + (t / group_rows) * group_stride +
/// (t % group_rows) * token_stride` ([`RowLayout`]; every `f32` and `f16` view is dense:
/// `group_rows` 1, `group_stride` = `token_stride`). The address is in `place` (a host
/// address, or a CUDA device pointer), contiguous for every token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvView {
    /// The first element's address in `place`.
    pub addr: u64,
    /// Rows readable from `addr`: the tokens held, and the one a step writes.
    pub tokens: usize,
    /// The element type.
    pub dtype: KvDtype,
    /// Bytes from one token's row to the next within a group.
    pub token_stride: u64,
    /// Bytes from one KV head to the next within a row.
    pub head_stride: u64,
    /// Rows in one group.
    pub group_rows: u64,
    /// Bytes from one group of rows to the next.
    pub group_stride: u64,
    /// Where the memory is.
    pub place: Place,
}

impl KvView {
    /// How its rows lie.
    pub fn rows(&self) -> RowLayout {
        RowLayout {
            row_bytes: self.token_stride,
            group_rows: self.group_rows,
            group_bytes: self.group_stride,
        }
    }

    /// Bytes from `addr` a kernel may touch: every row of the view.
    pub fn bytes(&self) -> u64 {
        self.rows().offset(self.tokens as u64)
    }

    /// The address of row `pos` (the step writes its new token at `tokens - 1`).
    pub fn row_addr(&self, pos: usize) -> Option<u64> {
        (pos < self.tokens).then(|| self.addr + self.rows().offset(pos as u64))
    }
}

/// One layer's K and V views.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerViews {
    /// The keys.
    pub k: KvView,
    /// The values.
    pub v: KvView,
}
