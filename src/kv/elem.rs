//! The element types KV can be kept in, rows of any of them, and the flat layout a server's
//! kernels see.

use bytemuck::Pod;
use half::slice::HalfFloatSliceExt;

use super::q8_0;
use super::shape::KvDtype;
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
    /// `q8_0` blocks ([`q8_0`](super::q8_0)), whole blocks only.
    Q8_0(&'a [u8]),
}

impl<'a> KvRows<'a> {
    /// Rows of `dtype` in `bytes` (as a buffer holds them): `None` when the bytes are not
    /// whole values of that type, or not aligned for it.
    pub fn from_bytes(dtype: KvDtype, bytes: &'a [u8]) -> Option<Self> {
        match dtype {
            KvDtype::F32 => bytemuck::try_cast_slice(bytes).ok().map(KvRows::F32),
            KvDtype::F16 => bytemuck::try_cast_slice(bytes).ok().map(KvRows::F16),
            KvDtype::Q8_0 => (bytes.len() % q8_0::BLOCK_BYTES == 0).then_some(KvRows::Q8_0(bytes)),
        }
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
            KvRows::Q8_0(x) => q8_0::values_in(x.len()),
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
            KvRows::Q8_0(x) => {
                let b = q8_0::BLOCK;
                assert!(
                    range.start % b == 0 && range.end % b == 0,
                    "q8_0 rows are cut on blocks of {b}"
                );
                let bytes = |v: usize| v / b * q8_0::BLOCK_BYTES;
                KvRows::Q8_0(&x[bytes(range.start)..bytes(range.end)])
            }
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
            KvRows::Q8_0(x) => q8_0::dequantize(x, dst),
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
/// `addr`, position-major (row `t` at `addr + t * token_stride`), each row `kv_heads` heads of
/// `head_dim` elements (head `h` at `h * head_stride` into the row). The address is in
/// `place` (a host address, or a CUDA device pointer), contiguous for every token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvView {
    /// The first element's address in `place`.
    pub addr: u64,
    /// Rows readable from `addr`: the tokens held, and the one a step writes.
    pub tokens: usize,
    /// The element type.
    pub dtype: KvDtype,
    /// Bytes from one token's row to the next.
    pub token_stride: u64,
    /// Bytes from one KV head to the next within a row.
    pub head_stride: u64,
    /// Where the memory is.
    pub place: Place,
}

impl KvView {
    /// Bytes from `addr` a kernel may touch: every row of the view.
    pub fn bytes(&self) -> u64 {
        self.tokens as u64 * self.token_stride
    }

    /// The address of row `pos` (the step writes its new token at `tokens - 1`).
    pub fn row_addr(&self, pos: usize) -> Option<u64> {
        (pos < self.tokens).then(|| self.addr + pos as u64 * self.token_stride)
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
