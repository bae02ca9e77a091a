//! Reading a llama-architecture GGUF: the hyper-parameters, the tokenizer's vocabulary and
//! merges, and each layer's quantized tensors as raw bytes (a residency unit each).
//!
//! The file is read by this module's own parser, not candle's: every count and length is
//! checked against the bytes left in the file (and a cap) before anything is allocated,
//! arrays nest at most [`MAX_NESTING`] deep, every tensor's offset and size are checked with
//! checked arithmetic against the file, and the hyper-parameters against [`Limits`], so a
//! hostile file gets a [`GgufError`], never a panic, an abort or a wrong model. Candle only
//! ever sees tensors whose bytes, type and shape have passed.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use candle_core::quantized::GgmlDType;

use crate::error::ModelError;

mod format;

pub use crate::error::{GgufError, MAX_ALIGNMENT, MAX_NESTING};
use format::{parse, Bounded, Metadata, Tensors};
pub use format::{Array, Limits, TensorInfo, Value, MAX_DIMS, MAX_STRING};

/// The model's shape, from the GGUF's metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Transformer layers.
    pub layers: usize,
    /// The residual stream's width.
    pub hidden: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Context length it was trained for.
    pub context: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// Vocabulary size.
    pub vocab: usize,
}

/// The GGPT-2 style BPE the GGUF carries.
#[derive(Debug, Clone)]
pub struct TokenizerData {
    /// Token strings, by id.
    pub tokens: Vec<String>,
    /// Merges, `"a b"`.
    pub merges: Vec<String>,
    /// Beginning of sequence.
    pub bos: Option<u32>,
    /// End of sequence.
    pub eos: Option<u32>,
}

/// Where one tensor of a layer lies in that layer's bytes.
#[derive(Debug, Clone)]
pub struct TensorSlot {
    /// Byte offset in the layer's bytes.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
    /// Quantization.
    pub dtype: GgmlDType,
    /// Dimensions (row-major, candle's order).
    pub dims: Vec<usize>,
}

/// A tensor as the file holds it ([`Gguf::raw`]).
#[derive(Debug, Clone)]
pub struct RawTensor {
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Quantization.
    pub dtype: GgmlDType,
    /// Dimensions (row-major, candle's order).
    pub dims: Vec<usize>,
}

/// Where the tensors outside the layers lie in the bytes [`Gguf::head`] packs.
#[derive(Debug, Clone)]
pub struct HeadSlots {
    /// The token embeddings, `[vocab, hidden]`.
    pub embed: TensorSlot,
    /// The final norm's weight.
    pub norm: TensorSlot,
    /// The output head, `[vocab, hidden]`: the embeddings' own slot where they are tied.
    pub output: TensorSlot,
}

/// The tensors of one layer, in the order they are packed.
pub const LAYER_TENSORS: [&str; 9] = [
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
];

/// An open GGUF whose header has passed the checks above.
pub struct Gguf {
    file: File,
    metadata: Metadata,
    tensors: Tensors,
}

fn missing(key: &str) -> GgufError {
    GgufError::Missing(key.into())
}

fn too_large(what: &str, value: usize, limit: usize) -> ModelError {
    GgufError::TooLarge {
        what: what.into(),
        value: value as u64,
        limit: limit as u64,
    }
    .into()
}

fn positive(what: &str, value: impl ToString) -> GgufError {
    GgufError::NotPositive {
        what: what.into(),
        value: value.to_string(),
    }
}

impl Gguf {
    /// Opens a GGUF file and checks its header: every count and length against the file,
    /// every tensor's bytes inside it, the architecture llama.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let io = |source| GgufError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut reader = Bounded {
            inner: BufReader::new(&file),
            pos: 0,
            len,
        };
        let (metadata, tensors) = parse(&mut reader)?;
        let gguf = Gguf {
            file,
            metadata,
            tensors,
        };
        let arch = match gguf.value("general.architecture")? {
            Value::Str(s) => s.clone(),
            _ => return Err(gguf.wrong("general.architecture", "a string")),
        };
        if arch != "llama" {
            return Err(GgufError::Architecture(arch).into());
        }
        Ok(gguf)
    }

    /// A metadata value.
    pub fn value(&self, key: &str) -> Result<&Value, GgufError> {
        self.metadata.get(key).ok_or_else(|| missing(key))
    }

    fn wrong(&self, key: &str, expected: &'static str) -> ModelError {
        GgufError::Type {
            key: key.into(),
            expected,
        }
        .into()
    }

    /// A count from the metadata, at least 1 and at most `limit`.
    fn count(&self, key: &str, limit: usize) -> Result<usize, ModelError> {
        let v = self
            .value(key)?
            .as_u64()
            .ok_or_else(|| self.wrong(key, "a non-negative integer"))?;
        if v == 0 {
            return Err(positive(key, v).into());
        }
        if v > limit as u64 {
            return Err(GgufError::TooLarge {
                what: key.into(),
                value: v,
                limit: limit as u64,
            }
            .into());
        }
        Ok(v as usize)
    }

    /// A positive, finite float from the metadata, or `default` where the key is absent.
    fn float(&self, key: &str, default: f32) -> Result<f32, ModelError> {
        let Some(v) = self.metadata.get(key) else {
            return Ok(default);
        };
        let f = v.as_f32().ok_or_else(|| self.wrong(key, "a float"))?;
        if !(f.is_finite() && f > 0.0) {
            return Err(positive(key, f).into());
        }
        Ok(f)
    }

    fn strings(&self, key: &str) -> Result<&[String], ModelError> {
        match self.value(key)? {
            Value::Array(Array::Str(v)) => Ok(v),
            _ => Err(self.wrong(key, "an array of strings")),
        }
    }

    /// The hyper-parameters, within [`Limits::default`].
    pub fn config(&self) -> Result<Config, ModelError> {
        self.config_within(Limits::default())
    }

    /// The hyper-parameters, refused outside `limits` or where they contradict each other.
    pub fn config_within(&self, limits: Limits) -> Result<Config, ModelError> {
        let hidden = self.count("llama.embedding_length", limits.hidden)?;
        let q_heads = self.count("llama.attention.head_count", limits.heads)?;
        let kv_heads = self.count("llama.attention.head_count_kv", limits.heads)?;
        if q_heads % kv_heads != 0 || hidden % q_heads != 0 {
            return Err(GgufError::Inconsistent(format!(
                "{q_heads} query heads, {kv_heads} key/value heads and width {hidden} do not divide"
            ))
            .into());
        }
        let head_dim = hidden / q_heads;
        if head_dim % 2 != 0 || head_dim > limits.head_dim {
            return Err(GgufError::Inconsistent(format!(
                "head dimension {head_dim} is odd or over {}",
                limits.head_dim
            ))
            .into());
        }
        let vocab = match self.metadata.get("llama.vocab_size") {
            Some(_) => self.count("llama.vocab_size", limits.vocab)?,
            None => self.strings("tokenizer.ggml.tokens")?.len(),
        };
        if vocab == 0 {
            return Err(positive("the vocabulary's size", 0).into());
        }
        if vocab > limits.vocab {
            return Err(too_large("the vocabulary", vocab, limits.vocab));
        }
        // Every token id the tokenizer can produce indexes the embedding's rows.
        if let Some(Value::Array(tokens)) = self.metadata.get("tokenizer.ggml.tokens") {
            if tokens.len() > vocab {
                return Err(GgufError::Inconsistent(format!(
                    "{} tokens for a vocabulary of {vocab}",
                    tokens.len()
                ))
                .into());
            }
        }
        let config = Config {
            layers: self.count("llama.block_count", limits.layers)?,
            hidden,
            q_heads,
            kv_heads,
            head_dim,
            context: self.count("llama.context_length", limits.context)?,
            rms_eps: self.float("llama.attention.layer_norm_rms_epsilon", 1e-5)?,
            rope_base: self.float("llama.rope.freq_base", 10_000.0)?,
            vocab,
        };
        self.check_tensors(&config, limits)?;
        Ok(config)
    }

    /// Every tensor the model reads is there with the shape the hyper-parameters give it.
    fn check_tensors(&self, c: &Config, limits: Limits) -> Result<(), ModelError> {
        let kv = c.kv_heads * c.head_dim;
        let ffn = match self.tensors.get("blk.0.ffn_gate.weight") {
            Some(t) => t.dims[0],
            None => return Err(missing("tensor blk.0.ffn_gate.weight").into()),
        };
        if ffn > limits.ffn {
            return Err(too_large("the feed-forward width", ffn, limits.ffn));
        }
        let expect = |name: String, dims: &[usize]| -> Result<(), ModelError> {
            let t = self
                .tensors
                .get(&name)
                .ok_or_else(|| missing(&format!("tensor {name}")))?;
            if t.dims != dims {
                return Err(GgufError::Tensor {
                    tensor: name,
                    why: format!("shape {:?}, the hyper-parameters give {dims:?}", t.dims),
                }
                .into());
            }
            Ok(())
        };
        expect("token_embd.weight".into(), &[c.vocab, c.hidden])?;
        expect("output_norm.weight".into(), &[c.hidden])?;
        if self.has("output.weight") {
            expect("output.weight".into(), &[c.vocab, c.hidden])?;
        }
        for l in 0..c.layers {
            let shapes: [&[usize]; 9] = [
                &[c.hidden],
                &[c.hidden, c.hidden],
                &[kv, c.hidden],
                &[kv, c.hidden],
                &[c.hidden, c.hidden],
                &[c.hidden],
                &[ffn, c.hidden],
                &[ffn, c.hidden],
                &[c.hidden, ffn],
            ];
            for (t, dims) in LAYER_TENSORS.iter().zip(shapes) {
                expect(format!("blk.{l}.{t}.weight"), dims)?;
            }
        }
        Ok(())
    }

    /// The tokenizer's vocabulary and merges: as many tokens as the model's vocabulary, the
    /// special ids among them.
    pub fn tokenizer(&self) -> Result<TokenizerData, ModelError> {
        let tokens = self.strings("tokenizer.ggml.tokens")?.to_vec();
        let merges = match self.metadata.get("tokenizer.ggml.merges") {
            Some(_) => self.strings("tokenizer.ggml.merges")?.to_vec(),
            None => return Err(missing("tokenizer.ggml.merges").into()),
        };
        if tokens.is_empty() {
            return Err(positive("the tokenizer's vocabulary size", 0).into());
        }
        let id = |key: &str| -> Result<Option<u32>, ModelError> {
            let Some(v) = self.metadata.get(key) else {
                return Ok(None);
            };
            match v.as_u64() {
                Some(id) if (id as usize) < tokens.len() => Ok(Some(id as u32)),
                _ => Err(GgufError::Inconsistent(format!(
                    "{key} is not a token id below {}",
                    tokens.len()
                ))
                .into()),
            }
        };
        Ok(TokenizerData {
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            tokens,
            merges,
        })
    }

    /// Tensors in the file.
    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// The names of the tensors in the file.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// A tensor's entry.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// A tensor's raw bytes, dtype and dimensions (its size was checked against the file at
    /// [`Gguf::open`]).
    pub fn raw(&mut self, name: &str) -> Result<RawTensor, ModelError> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| missing(&format!("tensor {name}")))?;
        let mut bytes = vec![0u8; info.bytes];
        self.file
            .seek(SeekFrom::Start(info.start))
            .and_then(|_| self.file.read_exact(&mut bytes))
            .map_err(|source| GgufError::Io {
                path: format!("tensor {name}"),
                source,
            })?;
        Ok(RawTensor {
            bytes,
            dtype: info.dtype,
            dims: info.dims.clone(),
        })
    }

    /// Whether the file holds a tensor of that name.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The tensors outside the layers packed into one buffer (each starting on a 64-byte
    /// boundary), as the GGUF holds them: the token embeddings (still quantized: a lookup
    /// dequantizes only the rows it reads), the final norm, and the output head where it is
    /// not tied to the embeddings.
    pub fn head(&mut self) -> Result<(Vec<u8>, HeadSlots), ModelError> {
        let mut bytes = Vec::new();
        let embed = pack(&mut bytes, self.raw("token_embd.weight")?, true);
        let norm = pack(&mut bytes, self.raw("output_norm.weight")?, true);
        let output = if self.has("output.weight") {
            pack(&mut bytes, self.raw("output.weight")?, true)
        } else {
            embed.clone()
        };
        Ok((
            bytes,
            HeadSlots {
                embed,
                norm,
                output,
            },
        ))
    }

    /// Layer `layer`'s tensors packed into one buffer (each starting on a 64-byte boundary),
    /// with where each lies.
    pub fn layer(&mut self, layer: usize) -> Result<(Vec<u8>, Vec<TensorSlot>), ModelError> {
        let mut bytes = Vec::new();
        let mut slots = Vec::with_capacity(LAYER_TENSORS.len());
        for t in LAYER_TENSORS {
            let raw = self.raw(&format!("blk.{layer}.{t}.weight"))?;
            // K and V follow Q, and up follows gate, with no padding where they have the same
            // type and row length: the rows of each group are then one matrix (see
            // [`fused`]). A whole number of rows keeps the next one aligned for its type.
            let continues = matches!(t, "attn_k" | "attn_v" | "ffn_up")
                && slots.last().is_some_and(|p: &TensorSlot| {
                    p.dtype == raw.dtype && p.dims.len() == 2 && p.dims.get(1) == raw.dims.get(1)
                });
            slots.push(pack(&mut bytes, raw, !continues));
        }
        Ok((bytes, slots))
    }
}

/// Appends tensor `raw` (its bytes, type and dimensions) to a unit's `bytes`, first on a
/// 64-byte boundary where `align`; where it lies.
fn pack(bytes: &mut Vec<u8>, raw: RawTensor, align: bool) -> TensorSlot {
    if align {
        bytes.resize(bytes.len().next_multiple_of(64), 0);
    }
    let slot = TensorSlot {
        offset: bytes.len(),
        len: raw.bytes.len(),
        dtype: raw.dtype,
        dims: raw.dims,
    };
    bytes.extend_from_slice(&raw.bytes);
    slot
}

/// `parts`, back to back in a layer's bytes with one type and one row length, as one
/// `[Σ rows, columns]` matrix: one product then serves them all. For block-quantized weights
/// (candle's `k_quants::matmul`, which the projections use) each output row is the same dot
/// product it is alone, bit for bit; f16/f32 weights, or `CANDLE_DEQUANTIZE_ALL`, go through
/// a dense matmul over the wider matrix, whose blocking may differ. `None` where they are not
/// one matrix.
pub fn fused(parts: &[TensorSlot]) -> Option<TensorSlot> {
    let first = parts.first()?;
    let &[_, columns] = first.dims.as_slice() else {
        return None;
    };
    let mut whole = TensorSlot {
        offset: first.offset,
        len: 0,
        dtype: first.dtype,
        dims: vec![0, columns],
    };
    for p in parts {
        let &[rows, k] = p.dims.as_slice() else {
            return None;
        };
        if p.dtype != whole.dtype || k != columns || p.offset != whole.offset + whole.len {
            return None;
        }
        whole.len += p.len;
        whole.dims[0] += rows;
    }
    Some(whole)
}
