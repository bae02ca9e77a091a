//! Quantized projections read where the weights live: candle's own `k_quants::matmul` over
//! a layer's bytes in its residency unit, with no copy into a candle tensor each step.
//!
//! `QMatMul` owns its blocks, so building one per step would copy every layer's weights on
//! every token (the whole model, about 80 MB for SmolLM2-135M). Here the managed bytes are
//! viewed as candle's block type instead, once checked for size and alignment; the kernel is
//! candle's, so the results are those of `QMatMul` on the same weights. Where candle is told
//! to dequantize everything (`CANDLE_DEQUANTIZE_ALL`, which the exact comparison against
//! candle's model sets) or the tensor is not block-quantized, `QMatMul` is built as before.

use std::sync::OnceLock;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::k_quants::{
    self, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1,
    BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1, GgmlType,
};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

mod q4_1;
mod q8_0;

use crate::error::{ModelError, StepFault};
use crate::gguf::TensorSlot;

/// Whether candle is told to dequantize every weight (then `QMatMul` does, and so do we).
fn dequantize_all() -> bool {
    static ALL: OnceLock<bool> = OnceLock::new();
    // Read as candle reads it: set, not empty and not "0".
    *ALL.get_or_init(|| {
        std::env::var("CANDLE_DEQUANTIZE_ALL").is_ok_and(|v| !v.is_empty() && v != "0")
    })
}

/// `bytes` as candle's blocks of type `T`, if they are exactly a whole number of them at
/// `T`'s alignment.
fn blocks<T: GgmlType>(bytes: &[u8]) -> Option<&[T]> {
    let size = std::mem::size_of::<T>();
    if size == 0
        || bytes.len() % size != 0
        || (bytes.as_ptr() as usize) % std::mem::align_of::<T>() != 0
    {
        return None;
    }
    // SAFETY: the pointer is aligned for `T` and the length is a whole number of `T`s (both
    // checked above), within one live, initialized `&[u8]` whose lifetime the result keeps.
    // Every `T` passed here is one of candle's `#[repr(C)]` GGML block types, plain arrays
    // and scalars of `u8`, `i8`, `i16`, `f16` and `f32`: every bit pattern is a valid value,
    // and nothing is written through the result.
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) })
}

/// Whether `lhs` holds `m x k` values and `weights` `n` rows of `k` values in blocks of
/// `QK` values of `block_bytes` each, `k` a multiple of `QK` above zero: what the kernels
/// below need before they index anything.
fn sizes_agree<const QK: usize>(
    (m, k, n): (usize, usize, usize),
    lhs: &[f32],
    weights: &[u8],
    block_bytes: usize,
) -> bool {
    k > 0
        && k % QK == 0
        && m.checked_mul(k) == Some(lhs.len())
        && (k / QK)
            .checked_mul(block_bytes)
            .and_then(|row| n.checked_mul(row))
            == Some(weights.len())
}

fn run<T: GgmlType>(
    bytes: &[u8],
    (m, k, n): (usize, usize, usize),
    lhs: &[f32],
) -> Option<Result<Vec<f32>, ModelError>> {
    let rhs = blocks::<T>(bytes)?;
    if k % T::BLCK_SIZE != 0 || rhs.len() != n * (k / T::BLCK_SIZE) || lhs.len() != m * k {
        return None;
    }
    if m <= 1 || T::DIRECT_COPY {
        let mut dst = vec![0f32; m * n];
        return Some(
            k_quants::matmul((m, k, n), lhs, rhs, &mut dst)
                .map(|()| dst)
                .map_err(ModelError::Compute),
        );
    }
    Some(Ok(rows_inner::<T>((m, k, n), lhs, rhs)))
}

/// Output columns per task of [`rows_inner`]: 256 rows of a 576-wide `Q8_0` weight are about
/// 150 KiB, read from memory once and then from the core's cache for every row of `lhs`.
const COLUMN_TILE: usize = 256;

/// `[m, n]`, row-major, from tasks that each fill up to `tile` whole output columns: `fill`
/// gets the first column's index and those columns' sums column-major (`m` a column, the
/// last task's part-full). The kernels here compute that way (each task owns whole columns,
/// so no two write the same cache line), and the result is laid out row-major once at the
/// end.
fn by_column_tiles(
    (m, n): (usize, usize),
    tile: usize,
    fill: impl Fn(usize, &mut [f32]) + Sync,
) -> Vec<f32> {
    use rayon::prelude::*;
    let mut by_col = vec![0f32; n * m];
    by_col
        .par_chunks_mut(tile * m.max(1))
        .enumerate()
        .for_each(|(t, cols)| fill(t * tile, cols));
    let mut out = vec![0f32; m * n];
    for (c, col) in by_col.chunks(m.max(1)).enumerate() {
        for (r, &v) in col.iter().enumerate().take(m) {
            out[r * n + c] = v;
        }
    }
    out
}

/// `k_quants::matmul`'s result, element for element, with its loops turned round. candle
/// takes one row of `lhs` at a time and, for each, streams the whole weight matrix (a
/// parallel call per row): `m` rows read it `m` times. Here each task takes a tile of the
/// weight's rows (output columns) and dots each with every row of `lhs` while it is in cache,
/// so the weights are read once. Every output is the same call candle makes
/// (`T::vec_dot` of the same weight blocks and the same quantized row, quantized by the same
/// `from_float`), so the bits are candle's.
fn rows_inner<T: GgmlType>((m, k, n): (usize, usize, usize), lhs: &[f32], rhs: &[T]) -> Vec<f32> {
    let kb = k / T::BLCK_SIZE;
    let mut quantized = vec![T::VecDotType::zeros(); m * kb];
    for (row, out) in quantized.chunks_mut(kb.max(1)).enumerate().take(m) {
        T::VecDotType::from_float(&lhs[row * k..(row + 1) * k], out);
    }
    by_column_tiles((m, n), COLUMN_TILE, |first, out| {
        for (j, col) in out.chunks_mut(m).enumerate() {
            let weights = &rhs[(first + j) * kb..(first + j + 1) * kb];
            for (row, v) in col.iter_mut().enumerate() {
                *v = T::vec_dot(k, weights, &quantized[row * kb..(row + 1) * kb]);
            }
        }
    })
}

/// `x · Wᵀ` for `x` of `[rows, k]` and the weight in `slot` of `bytes` (`[n, k]`, GGML
/// quantized): `[rows, n]`.
pub(crate) fn project(bytes: &[u8], slot: &TensorSlot, x: &Tensor) -> Result<Tensor, ModelError> {
    let weights = &bytes[slot.offset..slot.offset + slot.len];
    let direct = match (dequantize_all(), slot.dims.as_slice()) {
        (false, &[n, k]) => {
            let (m, xk) = x.dims2().map_err(ModelError::Compute)?;
            if xk != k {
                return Err(StepFault::Mismatch {
                    what: "columns of a projection's input against its weight's",
                    got: xk,
                    expected: k,
                }
                .into());
            }
            let lhs = x
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(ModelError::Compute)?;
            let mkn = (m, k, n);
            let out = match slot.dtype {
                GgmlDType::Q4_0 => run::<BlockQ4_0>(weights, mkn, &lhs),
                GgmlDType::Q4_1 => match q4_1::matmul(m, k, n, &lhs, weights) {
                    Some(v) => Some(Ok(v)),
                    None => run::<BlockQ4_1>(weights, mkn, &lhs),
                },
                GgmlDType::Q5_0 => run::<BlockQ5_0>(weights, mkn, &lhs),
                GgmlDType::Q5_1 => run::<BlockQ5_1>(weights, mkn, &lhs),
                GgmlDType::Q8_0 => match q8_0::matmul(m, k, n, &lhs, weights) {
                    Some(v) => Some(Ok(v)),
                    None => run::<BlockQ8_0>(weights, mkn, &lhs),
                },
                GgmlDType::Q8_1 => run::<BlockQ8_1>(weights, mkn, &lhs),
                GgmlDType::Q2K => run::<BlockQ2K>(weights, mkn, &lhs),
                GgmlDType::Q3K => run::<BlockQ3K>(weights, mkn, &lhs),
                GgmlDType::Q4K => run::<BlockQ4K>(weights, mkn, &lhs),
                GgmlDType::Q5K => run::<BlockQ5K>(weights, mkn, &lhs),
                GgmlDType::Q6K => run::<BlockQ6K>(weights, mkn, &lhs),
                GgmlDType::Q8K => run::<BlockQ8K>(weights, mkn, &lhs),
                GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => None,
            };
            out.map(|r| {
                r.and_then(|v| {
                    Tensor::from_vec(v, (m, n), &Device::Cpu).map_err(ModelError::Compute)
                })
            })
        }
        _ => None,
    };
    match direct {
        Some(result) => result,
        None => matmul(bytes, slot)?.forward(x).map_err(ModelError::Compute),
    }
}

fn qtensor(bytes: &[u8], slot: &TensorSlot) -> Result<QTensor, ModelError> {
    Ok(qtensor_from_ggml(
        slot.dtype,
        &bytes[slot.offset..slot.offset + slot.len],
        slot.dims.clone(),
        &Device::Cpu,
    )?)
}

/// Whether [`project`] reads the tensor in `slot` in place: a block-quantized matrix, and
/// candle not told to dequantize everything. Otherwise it builds candle's `QMatMul` from a
/// copy on each call, which a weight every step uses (the output head) should do once.
pub(crate) fn reads_in_place(slot: &TensorSlot) -> bool {
    let dense = matches!(
        slot.dtype,
        GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16
    );
    !dequantize_all() && !dense && slot.dims.len() == 2
}

/// Rows `ids` of the `[rows, columns]` tensor in `slot` of `bytes`, each dequantized alone
/// (as llama.cpp's `get_rows`): `[ids, columns]`. Only the rows asked for become `f32`, so a
/// lookup table stays as small as its file. Each row's values are those a whole-tensor
/// dequantization gives it (the same blocks through the same code). An id past the last row
/// is refused.
pub(crate) fn rows(bytes: &[u8], slot: &TensorSlot, ids: &[u32]) -> Result<Tensor, ModelError> {
    let &[count, columns] = slot.dims.as_slice() else {
        return Err(StepFault::Mismatch {
            what: "dimensions of a lookup table",
            got: slot.dims.len(),
            expected: 2,
        }
        .into());
    };
    let block = slot.dtype.block_size();
    let row_bytes = (columns / block.max(1)) * slot.dtype.type_size();
    if columns % block.max(1) != 0 || count.checked_mul(row_bytes) != Some(slot.len) {
        return Err(StepFault::Mismatch {
            what: "bytes of a lookup table against its rows",
            got: slot.len,
            expected: count.saturating_mul(row_bytes),
        }
        .into());
    }
    let table = &bytes[slot.offset..slot.offset + slot.len];
    let mut out = Vec::with_capacity(ids.len().saturating_mul(columns));
    for &id in ids {
        let id = id as usize;
        if id >= count {
            return Err(StepFault::Mismatch {
                what: "a token id against the vocabulary's size",
                got: id,
                expected: count,
            }
            .into());
        }
        let row = &table[id * row_bytes..(id + 1) * row_bytes];
        let values = qtensor_from_ggml(slot.dtype, row, vec![columns], &Device::Cpu)
            .and_then(|q| q.dequantize(&Device::Cpu))
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(ModelError::Compute)?;
        out.extend_from_slice(&values);
    }
    Tensor::from_vec(out, (ids.len(), columns), &Device::Cpu).map_err(ModelError::Compute)
}

/// The tensor in `slot` of `bytes`, dequantized.
pub(crate) fn dense(bytes: &[u8], slot: &TensorSlot) -> Result<Tensor, ModelError> {
    Ok(qtensor(bytes, slot)?.dequantize(&Device::Cpu)?)
}

/// candle's `QMatMul` over a copy of the tensor in `slot` of `bytes`.
pub(crate) fn matmul(bytes: &[u8], slot: &TensorSlot) -> Result<QMatMul, ModelError> {
    Ok(QMatMul::from_qtensor(qtensor(bytes, slot)?)?)
}

/// What the kernels here are held to in their tests: candle's own `k_quants::matmul`.
#[cfg(test)]
pub(crate) mod reference {
    use candle_core::quantized::k_quants::{self, GgmlType};

    /// `n` values in [-1, 1], the same for the same seed.
    pub(crate) fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 20_001) as f32 / 10_000.0 - 1.0
            })
            .collect()
    }

    /// Each value's bits, to compare results exactly.
    pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// An `n x k` weight quantized as `T` (values in [-3, 3]), `m x k` activations (in
    /// [-5, 5]), and candle's product of them.
    pub(crate) struct Product<T> {
        pub(crate) blocks: Vec<T>,
        pub(crate) lhs: Vec<f32>,
        pub(crate) want: Vec<f32>,
    }

    impl<T: GgmlType> Product<T> {
        pub(crate) fn new((m, k, n): (usize, usize, usize), seed: u64) -> Self {
            let w: Vec<f32> = data(n * k, seed).iter().map(|v| v * 3.0).collect();
            let lhs: Vec<f32> = data(m * k, seed + 1).iter().map(|v| v * 5.0).collect();
            let mut blocks = vec![T::zeros(); n * k / T::BLCK_SIZE];
            T::from_float(&w, &mut blocks);
            let mut want = vec![0f32; m * n];
            k_quants::matmul((m, k, n), &lhs, &blocks, &mut want).unwrap();
            Product { blocks, lhs, want }
        }

        /// The weight's blocks as the bytes a GGUF holds.
        pub(crate) fn bytes(&self) -> &[u8] {
            let len = std::mem::size_of_val(self.blocks.as_slice());
            // SAFETY: candle's block types are `#[repr(C)]` without padding (candle asserts
            // their sizes); the slice is live for the borrow and only read.
            unsafe { std::slice::from_raw_parts(self.blocks.as_ptr().cast::<u8>(), len) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::reference::{bits, Product};
    use super::*;

    /// `rows_inner` against candle's `k_quants::matmul` on the same blocks, bit for bit, for
    /// several block types, row counts and a column count that leaves a part tile.
    fn same_bits<T: GgmlType>(k: usize) {
        let n = 2 * COLUMN_TILE + 37;
        for m in [2, 3, 8, 33] {
            let p = Product::<T>::new((m, k, n), m as u64);
            let got = rows_inner::<T>((m, k, n), &p.lhs, &p.blocks);
            assert_eq!(bits(&got), bits(&p.want), "{:?}, {m} rows", T::DTYPE);
        }
    }

    #[test]
    fn rows_inner_gives_candles_bits() {
        same_bits::<BlockQ8_0>(576);
        same_bits::<BlockQ4_0>(576);
        same_bits::<BlockQ5_1>(576);
        same_bits::<BlockQ6K>(512);
        same_bits::<BlockQ4K>(256);
    }
}
