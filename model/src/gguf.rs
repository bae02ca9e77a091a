//! Reading a llama-architecture GGUF: the hyper-parameters, the tokenizer's vocabulary and
//! merges, and each layer's quantized tensors as raw bytes (a residency unit each).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;

use crate::ModelError;

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

/// An open GGUF.
pub struct Gguf {
    file: File,
    content: Content,
}

fn md<'a>(content: &'a Content, key: &str) -> Result<&'a Value, ModelError> {
    content
        .metadata
        .get(key)
        .ok_or_else(|| ModelError::Format(format!("no {key} in the GGUF metadata")))
}

fn num(content: &Content, key: &str) -> Result<usize, ModelError> {
    let v = md(content, key)?;
    v.to_u32()
        .map(|n| n as usize)
        .or_else(|_| v.to_u64().map(|n| n as usize))
        .map_err(|e| ModelError::Format(format!("{key}: {e}")))
}

impl Gguf {
    /// Opens and checks a GGUF file of the llama architecture.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let mut file =
            File::open(path).map_err(|e| ModelError::Format(format!("{}: {e}", path.display())))?;
        let content = Content::read(&mut file).map_err(|e| ModelError::Format(e.to_string()))?;
        let arch = md(&content, "general.architecture")?
            .to_string()
            .map_err(|e| ModelError::Format(e.to_string()))?;
        if arch != "llama" {
            return Err(ModelError::Format(format!(
                "architecture {arch:?}: only llama is supported"
            )));
        }
        Ok(Gguf { file, content })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> Result<Config, ModelError> {
        let c = &self.content;
        let hidden = num(c, "llama.embedding_length")?;
        let q_heads = num(c, "llama.attention.head_count")?;
        let kv_heads = num(c, "llama.attention.head_count_kv")?;
        if q_heads == 0 || kv_heads == 0 || q_heads % kv_heads != 0 || hidden % q_heads != 0 {
            return Err(ModelError::Format("inconsistent head counts".into()));
        }
        let vocab = match md(c, "llama.vocab_size") {
            Ok(_) => num(c, "llama.vocab_size")?,
            Err(_) => md(c, "tokenizer.ggml.tokens")?
                .to_vec()
                .map_err(|e| ModelError::Format(e.to_string()))?
                .len(),
        };
        let f = |key: &str, default: f32| {
            md(c, key)
                .ok()
                .and_then(|v| v.to_f32().ok())
                .unwrap_or(default)
        };
        Ok(Config {
            layers: num(c, "llama.block_count")?,
            hidden,
            q_heads,
            kv_heads,
            head_dim: hidden / q_heads,
            context: num(c, "llama.context_length")?,
            rms_eps: f("llama.attention.layer_norm_rms_epsilon", 1e-5),
            rope_base: f("llama.rope.freq_base", 10_000.0),
            vocab,
        })
    }

    /// The tokenizer's vocabulary and merges.
    pub fn tokenizer(&self) -> Result<TokenizerData, ModelError> {
        let c = &self.content;
        let strings = |key: &str| -> Result<Vec<String>, ModelError> {
            md(c, key)?
                .to_vec()
                .map_err(|e| ModelError::Format(e.to_string()))?
                .iter()
                .map(|v| {
                    v.to_string()
                        .cloned()
                        .map_err(|e| ModelError::Format(e.to_string()))
                })
                .collect()
        };
        let id = |key: &str| md(c, key).ok().and_then(|v| v.to_u32().ok());
        Ok(TokenizerData {
            tokens: strings("tokenizer.ggml.tokens")?,
            merges: strings("tokenizer.ggml.merges")?,
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
        })
    }

    /// A tensor's raw bytes, dtype and dimensions.
    pub fn raw(&mut self, name: &str) -> Result<(Vec<u8>, GgmlDType, Vec<usize>), ModelError> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| ModelError::Format(format!("no tensor {name}")))?;
        let elems = info.shape.elem_count();
        let block = info.ggml_dtype.block_size();
        if elems % block != 0 {
            return Err(ModelError::Format(format!("{name}: partial block")));
        }
        let len = elems / block * info.ggml_dtype.type_size();
        let mut bytes = vec![0u8; len];
        self.file
            .seek(SeekFrom::Start(
                self.content.tensor_data_offset + info.offset,
            ))
            .and_then(|_| self.file.read_exact(&mut bytes))
            .map_err(|e| ModelError::Format(format!("{name}: {e}")))?;
        Ok((bytes, info.ggml_dtype, info.shape.dims().to_vec()))
    }

    /// Whether the file holds a tensor of that name.
    pub fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Layer `layer`'s tensors packed into one buffer (each starting on a 64-byte boundary),
    /// with where each lies.
    pub fn layer(&mut self, layer: usize) -> Result<(Vec<u8>, Vec<TensorSlot>), ModelError> {
        let mut bytes = Vec::new();
        let mut slots = Vec::with_capacity(LAYER_TENSORS.len());
        for t in LAYER_TENSORS {
            let (raw, dtype, dims) = self.raw(&format!("blk.{layer}.{t}.weight"))?;
            // K and V follow Q, and up follows gate, with no padding where they have the same
            // type and row length: the rows of each group are then one matrix (see
            // [`fused`]). A whole number of rows keeps the next one aligned for its type.
            let continues = matches!(t, "attn_k" | "attn_v" | "ffn_up")
                && slots.last().is_some_and(|p: &TensorSlot| {
                    p.dtype == dtype && p.dims.len() == 2 && p.dims.get(1) == dims.get(1)
                });
            if !continues {
                bytes.resize(bytes.len().next_multiple_of(64), 0);
            }
            slots.push(TensorSlot {
                offset: bytes.len(),
                len: raw.len(),
                dtype,
                dims,
            });
            bytes.extend_from_slice(&raw);
        }
        Ok((bytes, slots))
    }
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
