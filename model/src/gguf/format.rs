//! The GGUF container, read defensively: every count and length against the bytes left in
//! the file before anything is allocated, nesting bounded, every tensor's bytes inside the
//! file, each refusal a [`GgufError`].

use std::collections::HashMap;
use std::io::Read;

use candle_core::quantized::GgmlDType;

use crate::error::{GgufError, MAX_ALIGNMENT, MAX_NESTING};

/// The longest string the reader takes (a chat template is a few KiB).
pub const MAX_STRING: u64 = 16 << 20;
/// Dimensions a tensor may have (ggml's own limit).
pub const MAX_DIMS: u32 = 4;

/// A metadata array, kept typed: its memory is at most a few times the bytes it was read from.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    Str(Vec<String>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
    Array(Vec<Array>),
}

impl Array {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::Str(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Array(v) => v.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The value as an unsigned integer, where it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, where it is one.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => None,
        }
    }
}

/// One tensor's entry: where its bytes lie in the file, its type and shape.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Its type.
    pub dtype: GgmlDType,
    /// Dimensions, rows first (candle's order; the file writes them columns first).
    pub dims: Vec<usize>,
    /// Where its bytes start in the file.
    pub start: u64,
    /// Its bytes.
    pub bytes: usize,
}

/// Bounds on the hyper-parameters: what the model code and the KV store can hold. A file
/// outside them is refused before anything is sized from it.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Layers.
    pub layers: usize,
    /// The residual stream's width.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// The feed-forward's width.
    pub ffn: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Context length.
    pub context: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            layers: 1024,
            hidden: 1 << 16,
            heads: 1024,
            head_dim: 1024,
            ffn: 1 << 18,
            vocab: 1 << 22,
            context: 1 << 24,
        }
    }
}

/// A reader that knows how many bytes are left, so no length is trusted before it fits.
pub(super) struct Bounded<R> {
    pub(super) inner: R,
    pub(super) pos: u64,
    pub(super) len: u64,
}

impl<R: Read> Bounded<R> {
    fn left(&self) -> u64 {
        self.len - self.pos
    }

    /// Checks that `need` bytes of `what` are still in the file.
    fn fits(&self, what: &'static str, need: u64) -> Result<(), GgufError> {
        if need > self.left() {
            return Err(GgufError::Truncated {
                what,
                at: self.pos,
                need,
                left: self.left(),
            });
        }
        Ok(())
    }

    fn fill(&mut self, what: &'static str, buf: &mut [u8]) -> Result<(), GgufError> {
        self.fits(what, buf.len() as u64)?;
        self.inner.read_exact(buf).map_err(|source| GgufError::Io {
            path: format!("{what} at byte {}", self.pos),
            source,
        })?;
        self.pos += buf.len() as u64;
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let mut b = [0u8; N];
        self.fill(what, &mut b)?;
        Ok(b)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A count of items of at least `min_bytes` each, checked against the bytes left.
    fn count(&mut self, what: &'static str, min_bytes: u64) -> Result<usize, GgufError> {
        let n = self.u64(what)?;
        self.fits(what, n.saturating_mul(min_bytes))?;
        usize::try_from(n).map_err(|_| GgufError::TooLarge {
            what: what.into(),
            value: n,
            limit: usize::MAX as u64,
        })
    }

    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let n = self.u64(what)?;
        if n > MAX_STRING {
            return Err(GgufError::TooLarge {
                what: format!("the length of a {what}"),
                value: n,
                limit: MAX_STRING,
            });
        }
        self.fits(what, n)?;
        let mut bytes = vec![0u8; n as usize];
        self.fill(what, &mut bytes)?;
        Ok(String::from_utf8(bytes)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
    }

    /// `n` fixed-size items, each decoded from its `N` little-endian bytes.
    fn items<const N: usize, T>(
        &mut self,
        n: usize,
        decode: fn([u8; N]) -> T,
    ) -> Result<Vec<T>, GgufError> {
        self.fits("array", (n as u64).saturating_mul(N as u64))?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(decode(self.array("array element")?));
        }
        Ok(out)
    }

    fn value(&mut self, code: u32, depth: u32) -> Result<Value, GgufError> {
        let at = self.pos;
        Ok(match code {
            0 => Value::U8(self.array::<1>("u8")?[0]),
            1 => Value::I8(i8::from_le_bytes(self.array("i8")?)),
            2 => Value::U16(u16::from_le_bytes(self.array("u16")?)),
            3 => Value::I16(i16::from_le_bytes(self.array("i16")?)),
            4 => Value::U32(self.u32("u32")?),
            5 => Value::I32(i32::from_le_bytes(self.array("i32")?)),
            6 => Value::F32(f32::from_le_bytes(self.array("f32")?)),
            7 => Value::Bool(self.array::<1>("bool")?[0] != 0),
            8 => Value::Str(self.string("string")?),
            9 => Value::Array(self.array_value(depth + 1)?),
            10 => Value::U64(self.u64("u64")?),
            11 => Value::I64(i64::from_le_bytes(self.array("i64")?)),
            12 => Value::F64(f64::from_le_bytes(self.array("f64")?)),
            code => return Err(GgufError::ValueType { code, at }),
        })
    }

    fn array_value(&mut self, depth: u32) -> Result<Array, GgufError> {
        let at = self.pos;
        if depth > MAX_NESTING {
            return Err(GgufError::Nesting { at });
        }
        let code = self.u32("array type")?;
        // The least each element can take: a string its length, an array its type and count.
        let min = match code {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            9 => 12,
            code => return Err(GgufError::ValueType { code, at }),
        };
        let n = self.count("array length", min)?;
        Ok(match code {
            0 => Array::U8(self.items(n, |[b]: [u8; 1]| b)?),
            1 => Array::I8(self.items(n, i8::from_le_bytes)?),
            2 => Array::U16(self.items(n, u16::from_le_bytes)?),
            3 => Array::I16(self.items(n, i16::from_le_bytes)?),
            4 => Array::U32(self.items(n, u32::from_le_bytes)?),
            5 => Array::I32(self.items(n, i32::from_le_bytes)?),
            6 => Array::F32(self.items(n, f32::from_le_bytes)?),
            7 => Array::Bool(self.items(n, |[b]: [u8; 1]| b != 0)?),
            10 => Array::U64(self.items(n, u64::from_le_bytes)?),
            11 => Array::I64(self.items(n, i64::from_le_bytes)?),
            12 => Array::F64(self.items(n, f64::from_le_bytes)?),
            8 => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.string("string in an array")?);
                }
                Array::Str(v)
            }
            _ => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array_value(depth + 1)?);
                }
                Array::Array(v)
            }
        })
    }
}

fn dtype(code: u32) -> Option<GgmlDType> {
    Some(match code {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// The metadata, by key.
pub(super) type Metadata = HashMap<String, Value>;
/// The tensors' entries, by name.
pub(super) type Tensors = HashMap<String, TensorInfo>;

/// A tensor entry as written, before its place in the file is known.
struct RawTensor {
    name: String,
    dims: Vec<usize>,
    dtype: GgmlDType,
    offset: u64,
    bytes: usize,
}

fn tensor_entry<R: Read>(r: &mut Bounded<R>) -> Result<RawTensor, GgufError> {
    let name = r.string("tensor name")?;
    let n_dims = r.u32("tensor dimension count")?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(GgufError::Tensor {
            tensor: name,
            why: format!("{n_dims} dimensions (1 to {MAX_DIMS} are taken)"),
        });
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    let mut elems: u64 = 1;
    for _ in 0..n_dims {
        let d = r.u64("tensor dimension")?;
        if d == 0 {
            return Err(GgufError::Tensor {
                tensor: name,
                why: "a dimension is 0".into(),
            });
        }
        elems = elems
            .checked_mul(d)
            .filter(|&e| e <= r.len.saturating_mul(8))
            .ok_or_else(|| GgufError::Tensor {
                tensor: name.clone(),
                why: format!(
                    "its dimensions claim more elements than the file could hold ({d} more)"
                ),
            })?;
        dims.push(d as usize);
    }
    dims.reverse();
    let code = r.u32("tensor type")?;
    let dtype = dtype(code).ok_or_else(|| GgufError::Dtype {
        tensor: name.clone(),
        code,
    })?;
    let offset = r.u64("tensor offset")?;
    let block = dtype.block_size() as u64;
    let row = dims[dims.len() - 1] as u64;
    if row % block != 0 {
        return Err(GgufError::Tensor {
            tensor: name,
            why: format!("rows of {row} elements are not whole blocks of {block}"),
        });
    }
    let bytes = (elems / block)
        .checked_mul(dtype.type_size() as u64)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| GgufError::Tensor {
            tensor: name.clone(),
            why: "its size overflows".into(),
        })?;
    Ok(RawTensor {
        name,
        dims,
        dtype,
        offset,
        bytes,
    })
}

pub(super) fn parse<R: Read>(r: &mut Bounded<R>) -> Result<(Metadata, Tensors), GgufError> {
    let magic = r.array::<4>("magic")?;
    if &magic != b"GGUF" {
        return Err(GgufError::Magic(magic));
    }
    let version = r.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::Version(version));
    }
    // A tensor entry takes at least 8 + 4 + 8 + 4 + 8 bytes, a key-value 8 + 4 + 1.
    let tensors = r.count("tensor count", 32)?;
    let kvs = r.count("metadata count", 13)?;
    let mut metadata = HashMap::with_capacity(kvs.min(1 << 16));
    for _ in 0..kvs {
        let key = r.string("metadata key")?;
        let code = r.u32("metadata type")?;
        let value = r.value(code, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(GgufError::Duplicate(key));
        }
    }
    let mut raw = Vec::with_capacity(tensors);
    for _ in 0..tensors {
        raw.push(tensor_entry(r)?);
    }
    let alignment = match metadata.get("general.alignment") {
        None => 32,
        Some(v) => v.as_u64().ok_or(GgufError::Type {
            key: "general.alignment".into(),
            expected: "an unsigned integer",
        })?,
    };
    if alignment == 0 || !alignment.is_power_of_two() || alignment > MAX_ALIGNMENT {
        return Err(GgufError::Alignment(alignment));
    }
    let data = r.pos.next_multiple_of(alignment);
    let mut infos = HashMap::with_capacity(raw.len());
    for t in raw {
        let end = data
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.bytes as u64));
        if t.offset % alignment != 0 {
            return Err(GgufError::Tensor {
                why: format!(
                    "offset {} is not a multiple of the alignment {alignment}",
                    t.offset
                ),
                tensor: t.name,
            });
        }
        if end.is_none_or(|e| e > r.len) {
            return Err(GgufError::TensorRange {
                tensor: t.name,
                offset: t.offset,
                bytes: t.bytes as u64,
                data,
                file: r.len,
            });
        }
        let info = TensorInfo {
            dtype: t.dtype,
            dims: t.dims,
            start: data + t.offset,
            bytes: t.bytes,
        };
        if infos.insert(t.name.clone(), info).is_some() {
            return Err(GgufError::Duplicate(t.name));
        }
    }
    Ok((metadata, infos))
}
