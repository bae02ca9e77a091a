//! A small llama GGUF written from scratch, and the hostile variants of it that the loader is
//! tested against: each changes one field of the valid file (a count, a length, a type, a
//! hyper-parameter, a tensor's entry) the way a crafted or corrupted file would.
//!
//! The valid file loads, tokenizes and decodes (f32 weights from a fixed seed, a byte-level
//! vocabulary with ChatML's special tokens); every variant must be refused with an error.

use std::collections::HashMap;

/// The tiny model's shape: 2 layers, width 8, 2 query heads over 1 key/value head.
pub const LAYERS: u64 = 2;
const HIDDEN: u64 = 8;
const HEADS: u64 = 2;
const KV_HEADS: u64 = 1;
const FFN: u64 = 16;
const ALIGNMENT: u64 = 32;

/// A metadata value as written.
#[derive(Debug, Clone)]
enum Meta {
    U32(u32),
    U64(u64),
    F32(f32),
    Str(String),
    Strs(Vec<String>),
}

impl Meta {
    fn code(&self) -> u32 {
        match self {
            Meta::U32(_) => 4,
            Meta::U64(_) => 10,
            Meta::F32(_) => 6,
            Meta::Str(_) => 8,
            Meta::Strs(_) => 9,
        }
    }
}

/// The file's parts before they are laid out: metadata, then tensors (name, dimensions in
/// the file's order, ggml type, f32 values).
#[derive(Debug, Clone)]
struct Model {
    meta: Vec<(String, Meta)>,
    tensors: Vec<(String, Vec<u64>, Vec<f32>)>,
}

/// Where each field landed in the written file, by name (`kv:KEY` is the value's first byte,
/// `tensor:NAME:dims`, `:type` and `:offset` the entry's fields).
type Fields = HashMap<String, usize>;

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl Model {
    fn write(&self) -> (Vec<u8>, Fields) {
        let mut out = Vec::new();
        let mut at = Fields::new();
        at.insert("magic".into(), 0);
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        at.insert("tensor_count".into(), out.len());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        at.insert("kv_count".into(), out.len());
        out.extend_from_slice(&(self.meta.len() as u64).to_le_bytes());
        for (key, value) in &self.meta {
            at.insert(format!("key:{key}"), out.len());
            put_str(&mut out, key);
            at.insert(format!("type:{key}"), out.len());
            out.extend_from_slice(&value.code().to_le_bytes());
            at.insert(format!("kv:{key}"), out.len());
            match value {
                Meta::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
                Meta::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
                Meta::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
                Meta::Str(s) => put_str(&mut out, s),
                Meta::Strs(v) => {
                    out.extend_from_slice(&8u32.to_le_bytes());
                    at.insert(format!("count:{key}"), out.len());
                    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
                    for s in v {
                        put_str(&mut out, s);
                    }
                }
            }
        }
        let mut offset = 0u64;
        for (name, dims, values) in &self.tensors {
            at.insert(format!("tensor:{name}:name"), out.len());
            put_str(&mut out, name);
            at.insert(format!("tensor:{name}:n_dims"), out.len());
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            at.insert(format!("tensor:{name}:dims"), out.len());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            at.insert(format!("tensor:{name}:type"), out.len());
            out.extend_from_slice(&0u32.to_le_bytes());
            at.insert(format!("tensor:{name}:offset"), out.len());
            out.extend_from_slice(&offset.to_le_bytes());
            offset = (offset + values.len() as u64 * 4).next_multiple_of(ALIGNMENT);
        }
        out.resize(out.len().next_multiple_of(ALIGNMENT as usize), 0);
        at.insert("data".into(), out.len());
        for (_, _, values) in &self.tensors {
            for v in values {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.resize(out.len().next_multiple_of(ALIGNMENT as usize), 0);
        }
        (out, at)
    }

    fn set(&mut self, key: &str, value: Meta) {
        match self.meta.iter_mut().find(|(k, _)| k == key) {
            Some(kv) => kv.1 = value,
            None => self.meta.push((key.into(), value)),
        }
    }

    fn remove(&mut self, key: &str) {
        self.meta.retain(|(k, _)| k != key);
    }
}

/// GPT-2's printable stand-in for each byte, which byte-level BPE vocabularies are written in.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut extra = 0;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap_or('?')
            }
        })
        .collect()
}

fn weights(n: u64, seed: &mut u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            (*seed % 1000) as f32 / 1000.0 - 0.5
        })
        .collect()
}

fn valid_model() -> Model {
    let mut tokens: Vec<String> = byte_chars().into_iter().map(String::from).collect();
    tokens.extend(["Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"].map(String::from));
    let vocab = tokens.len() as u64;
    let meta = vec![
        ("general.architecture".into(), Meta::Str("llama".into())),
        ("general.alignment".into(), Meta::U32(ALIGNMENT as u32)),
        ("llama.block_count".into(), Meta::U32(LAYERS as u32)),
        ("llama.embedding_length".into(), Meta::U32(HIDDEN as u32)),
        ("llama.feed_forward_length".into(), Meta::U32(FFN as u32)),
        ("llama.attention.head_count".into(), Meta::U32(HEADS as u32)),
        (
            "llama.attention.head_count_kv".into(),
            Meta::U32(KV_HEADS as u32),
        ),
        ("llama.context_length".into(), Meta::U32(512)),
        ("llama.vocab_size".into(), Meta::U32(vocab as u32)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            Meta::F32(1e-5),
        ),
        ("llama.rope.freq_base".into(), Meta::F32(10_000.0)),
        ("tokenizer.ggml.model".into(), Meta::Str("gpt2".into())),
        ("tokenizer.ggml.tokens".into(), Meta::Strs(tokens)),
        (
            "tokenizer.ggml.merges".into(),
            Meta::Strs(vec!["Ġ t".into(), "h e".into()]),
        ),
        (
            "tokenizer.ggml.bos_token_id".into(),
            Meta::U32(vocab as u32 - 3),
        ),
        (
            "tokenizer.ggml.eos_token_id".into(),
            Meta::U32(vocab as u32 - 1),
        ),
    ];
    let mut seed = 0x2545_f491_4f6c_dd1d;
    let kv = KV_HEADS * HIDDEN / HEADS;
    // Dimensions in the file's order: columns first.
    let mut tensors = vec![
        ("token_embd.weight".to_string(), vec![HIDDEN, vocab]),
        ("output_norm.weight".to_string(), vec![HIDDEN]),
    ];
    for l in 0..LAYERS {
        let shapes = [
            ("attn_norm", vec![HIDDEN]),
            ("attn_q", vec![HIDDEN, HIDDEN]),
            ("attn_k", vec![HIDDEN, kv]),
            ("attn_v", vec![HIDDEN, kv]),
            ("attn_output", vec![HIDDEN, HIDDEN]),
            ("ffn_norm", vec![HIDDEN]),
            ("ffn_gate", vec![HIDDEN, FFN]),
            ("ffn_up", vec![HIDDEN, FFN]),
            ("ffn_down", vec![FFN, HIDDEN]),
        ];
        for (t, dims) in shapes {
            tensors.push((format!("blk.{l}.{t}.weight"), dims));
        }
    }
    let tensors = tensors
        .into_iter()
        .map(|(name, dims)| {
            let n = dims.iter().product();
            let values = if name.ends_with("norm.weight") {
                vec![1.0; n as usize]
            } else {
                weights(n, &mut seed)
            };
            (name, dims, values)
        })
        .collect();
    Model { meta, tensors }
}

/// The valid tiny llama GGUF.
pub fn tiny_llama() -> Vec<u8> {
    valid_model().write().0
}

fn patch(bytes: &mut [u8], at: usize, value: &[u8]) {
    bytes[at..at + value.len()].copy_from_slice(value);
}

/// Arrays nested `depth` deep under one key, the innermost empty.
fn nested(depth: usize) -> Vec<u8> {
    let mut m = valid_model();
    m.meta.push(("deep".into(), Meta::U32(0)));
    let (bytes, at) = m.write();
    let value = at["kv:deep"];
    let mut out = bytes[..at["type:deep"]].to_vec();
    out.extend_from_slice(&9u32.to_le_bytes());
    for level in 0..depth {
        out.extend_from_slice(&9u32.to_le_bytes());
        out.extend_from_slice(&u64::from(level + 1 < depth).to_le_bytes());
    }
    out.extend_from_slice(&bytes[value + 4..]);
    out
}

/// A change to the valid model's parts.
type Edit = Box<dyn Fn(&mut Model)>;

/// Every hostile variant, named: the valid file with one field changed. Each must be refused.
pub fn hostile() -> Vec<(String, Vec<u8>)> {
    let (valid, at) = valid_model().write();
    let mut out = patched_fields(&valid, &at);
    for (name, cut) in [
        ("empty_file", 0),
        ("truncated_header", at["kv:tokenizer.ggml.tokens"] + 100),
        ("truncated_data", valid.len() - 40),
    ] {
        out.push((name.into(), valid[..cut].to_vec()));
    }
    out.push(("nested_100000".into(), nested(100_000)));
    let edits = [
        model_edits(),
        attention_edits(),
        vocabulary_edits(),
        tensor_edits(),
    ];
    for (name, edit) in edits.into_iter().flatten() {
        let mut m = valid_model();
        edit(&mut m);
        out.push((name.into(), m.write().0));
    }
    out
}

/// The valid file with one field's bytes overwritten: counts, lengths, types, offsets and
/// dimensions at their limits, and versions it does not speak.
fn patched_fields(valid: &[u8], at: &Fields) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = Vec::new();
    let raw = |name: &str, field: &str, value: &[u8]| {
        let mut b = valid.to_vec();
        patch(&mut b, at[field], value);
        (name.to_string(), b)
    };
    let u64s = |v: u64| v.to_le_bytes().to_vec();
    let u32s = |v: u32| v.to_le_bytes().to_vec();
    let q = "tensor:blk.0.attn_q.weight";
    for (name, field, value) in field_limits() {
        out.push(raw(name, &field, &value));
    }
    out.push({
        let mut b = valid.to_vec();
        patch(&mut b, 4, &u32s(1));
        ("version_1".into(), b)
    });
    out.push({
        let mut b = valid.to_vec();
        patch(&mut b, 4, &u32s(99));
        ("version_99".into(), b)
    });
    // Dimensions that both overflow when multiplied and claim the maximum.
    out.push({
        let mut b = valid.to_vec();
        let d = at[&format!("{q}:dims")];
        patch(&mut b, d, &u64s(u64::MAX / 2));
        patch(&mut b, d + 8, &u64s(4));
        ("tensor_dims_product_wraps".into(), b)
    });
    out.push({
        let mut b = valid.to_vec();
        let d = at[&format!("{q}:dims")];
        patch(&mut b, d, &u64s(1 << 32));
        patch(&mut b, d + 8, &u64s(1 << 30));
        ("tensor_claims_2^62_bytes".into(), b)
    });
    out
}

/// Header and tensor-table fields set to their limits: (name, field, bytes).
fn field_limits() -> Vec<(&'static str, String, Vec<u8>)> {
    let u64s = |v: u64| v.to_le_bytes().to_vec();
    let u32s = |v: u32| v.to_le_bytes().to_vec();
    let q = "tensor:blk.0.attn_q.weight";
    let mut limits: Vec<(&'static str, String, Vec<u8>)> = vec![
        ("magic", "magic".to_string(), b"XXXX".to_vec()),
        (
            "tensor_count_max",
            "tensor_count".to_string(),
            u64s(u64::MAX),
        ),
        (
            "tensor_count_one_more",
            "tensor_count".to_string(),
            u64s(LAYERS * 9 + 3),
        ),
        ("kv_count_max", "kv_count".to_string(), u64s(u64::MAX)),
        ("kv_count_2^40", "kv_count".to_string(), u64s(1 << 40)),
        (
            "key_length_max",
            "key:general.architecture".to_string(),
            u64s(u64::MAX),
        ),
        (
            "string_length_max",
            "kv:general.architecture".to_string(),
            u64s(u64::MAX),
        ),
        (
            "string_length_1TiB",
            "kv:general.architecture".to_string(),
            u64s(1 << 40),
        ),
        (
            "value_type_unknown",
            "type:llama.block_count".to_string(),
            u32s(13),
        ),
        (
            "array_count_max",
            "count:tokenizer.ggml.tokens".to_string(),
            u64s(u64::MAX),
        ),
        (
            "array_count_2^36",
            "count:tokenizer.ggml.tokens".to_string(),
            u64s(1 << 36),
        ),
        (
            "array_type_unknown",
            "kv:tokenizer.ggml.tokens".to_string(),
            u32s(99),
        ),
        (
            "merges_count_max",
            "count:tokenizer.ggml.merges".to_string(),
            u64s(u64::MAX),
        ),
    ];
    limits.extend(tensor_limits(q, u64s, u32s));
    limits
}

/// The first tensor's fields set to their limits.
fn tensor_limits(
    q: &str,
    u64s: impl Fn(u64) -> Vec<u8>,
    u32s: impl Fn(u32) -> Vec<u8>,
) -> Vec<(&'static str, String, Vec<u8>)> {
    vec![
        ("tensor_offset_max", format!("{q}:offset"), u64s(u64::MAX)),
        (
            "tensor_offset_past_end",
            format!("{q}:offset"),
            u64s(1 << 20),
        ),
        ("tensor_offset_misaligned", format!("{q}:offset"), u64s(257)),
        ("tensor_n_dims_0", format!("{q}:n_dims"), u32s(0)),
        ("tensor_n_dims_100", format!("{q}:n_dims"), u32s(100)),
        ("tensor_dim_0", format!("{q}:dims"), u64s(0)),
        (
            "tensor_dim_u32_max",
            format!("{q}:dims"),
            u64s(u32::MAX.into()),
        ),
        ("tensor_dim_max", format!("{q}:dims"), u64s(u64::MAX)),
        ("tensor_dims_overflow", format!("{q}:dims"), u64s(1 << 62)),
        ("tensor_40GiB", format!("{q}:dims"), u64s(10 << 30)),
        ("tensor_type_unknown", format!("{q}:type"), u32s(99)),
        (
            "tensor_type_q4_0_partial_block",
            format!("{q}:type"),
            u32s(2),
        ),
        (
            "tensor_name_length_max",
            format!("{q}:name"),
            u64s(u64::MAX),
        ),
    ]
}

/// Hostile edits of the model's header: architecture, alignment, sizes.
fn model_edits() -> Vec<(&'static str, Edit)> {
    vec![
        (
            "architecture_gpt2",
            Box::new(|m| m.set("general.architecture", Meta::Str("gpt2".into()))),
        ),
        (
            "architecture_not_string",
            Box::new(|m| m.set("general.architecture", Meta::U32(1))),
        ),
        (
            "architecture_missing",
            Box::new(|m| m.remove("general.architecture")),
        ),
        (
            "alignment_0",
            Box::new(|m| m.set("general.alignment", Meta::U32(0))),
        ),
        (
            "alignment_3",
            Box::new(|m| m.set("general.alignment", Meta::U32(3))),
        ),
        (
            "alignment_u32_max",
            Box::new(|m| m.set("general.alignment", Meta::U32(u32::MAX))),
        ),
        (
            "alignment_string",
            Box::new(|m| m.set("general.alignment", Meta::Str("32".into()))),
        ),
        (
            "block_count_max",
            Box::new(|m| m.set("llama.block_count", Meta::U64(u64::MAX))),
        ),
        (
            "block_count_2^32",
            Box::new(|m| m.set("llama.block_count", Meta::U64(1 << 32))),
        ),
        (
            "block_count_0",
            Box::new(|m| m.set("llama.block_count", Meta::U32(0))),
        ),
        (
            "block_count_one_more",
            Box::new(|m| m.set("llama.block_count", Meta::U32(LAYERS as u32 + 1))),
        ),
        (
            "block_count_string",
            Box::new(|m| m.set("llama.block_count", Meta::Str("2".into()))),
        ),
        (
            "embedding_length_0",
            Box::new(|m| m.set("llama.embedding_length", Meta::U32(0))),
        ),
        (
            "embedding_length_max",
            Box::new(|m| m.set("llama.embedding_length", Meta::U64(u64::MAX))),
        ),
        (
            "embedding_length_16",
            Box::new(|m| m.set("llama.embedding_length", Meta::U32(16))),
        ),
    ]
}

/// Hostile edits of attention and position: heads, context, epsilon, rope.
fn attention_edits() -> Vec<(&'static str, Edit)> {
    vec![
        (
            "head_count_0",
            Box::new(|m| m.set("llama.attention.head_count", Meta::U32(0))),
        ),
        (
            "head_count_max",
            Box::new(|m| m.set("llama.attention.head_count", Meta::U64(u64::MAX))),
        ),
        (
            "head_count_odd_head_dim",
            Box::new(|m| m.set("llama.attention.head_count", Meta::U32(8))),
        ),
        (
            "head_count_kv_0",
            Box::new(|m| m.set("llama.attention.head_count_kv", Meta::U32(0))),
        ),
        (
            "head_count_kv_3",
            Box::new(|m| m.set("llama.attention.head_count_kv", Meta::U32(3))),
        ),
        (
            "head_count_kv_max",
            Box::new(|m| m.set("llama.attention.head_count_kv", Meta::U64(u64::MAX))),
        ),
        (
            "context_length_0",
            Box::new(|m| m.set("llama.context_length", Meta::U32(0))),
        ),
        (
            "context_length_max",
            Box::new(|m| m.set("llama.context_length", Meta::U64(u64::MAX))),
        ),
        (
            "rms_epsilon_nan",
            Box::new(|m| {
                m.set(
                    "llama.attention.layer_norm_rms_epsilon",
                    Meta::F32(f32::NAN),
                )
            }),
        ),
        (
            "rms_epsilon_negative",
            Box::new(|m| m.set("llama.attention.layer_norm_rms_epsilon", Meta::F32(-1.0))),
        ),
        (
            "rope_base_infinite",
            Box::new(|m| m.set("llama.rope.freq_base", Meta::F32(f32::INFINITY))),
        ),
    ]
}

/// Hostile edits of the vocabulary and its merges.
fn vocabulary_edits() -> Vec<(&'static str, Edit)> {
    vec![
        (
            "vocab_size_0",
            Box::new(|m| m.set("llama.vocab_size", Meta::U32(0))),
        ),
        (
            "vocab_size_max",
            Box::new(|m| m.set("llama.vocab_size", Meta::U64(u64::MAX))),
        ),
        (
            "vocabulary_empty",
            Box::new(|m| {
                m.remove("llama.vocab_size");
                m.set("tokenizer.ggml.tokens", Meta::Strs(Vec::new()));
            }),
        ),
        (
            "vocabulary_not_strings",
            Box::new(|m| m.set("tokenizer.ggml.tokens", Meta::U32(7))),
        ),
        (
            "vocabulary_missing",
            Box::new(|m| m.remove("tokenizer.ggml.tokens")),
        ),
        (
            "bos_out_of_range",
            Box::new(|m| m.set("tokenizer.ggml.bos_token_id", Meta::U32(100_000))),
        ),
        (
            "eos_max",
            Box::new(|m| m.set("tokenizer.ggml.eos_token_id", Meta::U64(u64::MAX))),
        ),
        (
            "merges_missing",
            Box::new(|m| m.remove("tokenizer.ggml.merges")),
        ),
        (
            "merge_without_space",
            Box::new(|m| m.set("tokenizer.ggml.merges", Meta::Strs(vec!["Ġt".into()]))),
        ),
        (
            "merge_of_unknown_tokens",
            Box::new(|m| m.set("tokenizer.ggml.merges", Meta::Strs(vec!["x y z".into()]))),
        ),
        (
            "duplicate_key",
            Box::new(|m| m.meta.push(("llama.block_count".into(), Meta::U32(2)))),
        ),
    ]
}

/// Hostile edits of the tensor table.
fn tensor_edits() -> Vec<(&'static str, Edit)> {
    vec![
        (
            "tensor_missing",
            Box::new(|m| m.tensors.retain(|t| t.0 != "blk.1.ffn_down.weight")),
        ),
        (
            "embedding_missing",
            Box::new(|m| m.tensors.retain(|t| t.0 != "token_embd.weight")),
        ),
        (
            "tensor_duplicate",
            Box::new(|m| {
                let t = m.tensors[3].clone();
                m.tensors.push(t);
            }),
        ),
        (
            "tensor_shape_transposed",
            Box::new(|m| {
                let t = m.tensors.iter_mut().find(|t| t.0 == "blk.0.attn_k.weight");
                if let Some(t) = t {
                    t.1.reverse();
                }
            }),
        ),
        (
            "tensor_shape_other_width",
            Box::new(|m| {
                let t = m.tensors.iter_mut().find(|t| t.0 == "blk.1.ffn_up.weight");
                if let Some(t) = t {
                    t.1 = vec![HIDDEN, FFN * 2];
                    t.2 = vec![0.0; (HIDDEN * FFN * 2) as usize];
                }
            }),
        ),
    ]
}
