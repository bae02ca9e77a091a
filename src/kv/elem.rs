//! The element types KV can be kept in, and the flat layout a server's kernels see.

use bytemuck::Pod;

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
