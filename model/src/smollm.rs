//! The llama-architecture forward pass: candle for the weights' math (embeddings, RMSNorm,
//! RoPE, quantized projections, SwiGLU), this project for the KV and the attention. Each
//! decode step: per layer, the projections run inside the layer's residency unit (its
//! quantized tensors, reloaded if they were offloaded), the new K/V are written into the KV
//! store's flat buffers and the decode operator reads them there, on the step's stream.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use procmem_actors::procmem::fence::TimelineFence;
use procmem_actors::procmem::kv::{gqa_causal_rows, KvDtype, KvShape};
use procmem_actors::{
    kv::{KvStep, KvStoreHandle, SeqId, StepKv},
    provider::fence_completed,
    residency::ResidencyHandle,
};

use crate::gguf::{Config, Gguf, TensorSlot, TokenizerData};
use crate::quant::{dense, project, Weight};
pub use crate::scheduler::StepInput;
use crate::{ModelError, StepFault};

/// What stays outside the residency units: the embeddings (dequantized, as a lookup table),
/// the final norm, the output head, and the RoPE tables.
pub struct Smol {
    /// The hyper-parameters.
    pub config: Config,
    embed: Tensor,
    norm: Tensor,
    output: Weight,
    slots: Vec<Vec<TensorSlot>>,
    /// Per layer, Q/K/V and gate/up as one matrix each, where they are packed as one.
    fused: Vec<[Option<TensorSlot>; 2]>,
    cos: Tensor,
    sin: Tensor,
}

/// A model as loaded: the shared part, each layer's packed bytes (for residency), the
/// tokenizer's data.
pub struct Loaded {
    /// The model.
    pub model: Arc<Smol>,
    /// Layer `i`'s quantized tensors, packed.
    pub layers: Vec<Vec<u8>>,
    /// Vocabulary and merges.
    pub tokenizer: TokenizerData,
}

/// `cos`/`sin` of `position × θ_i`, `θ_i = base^(-2i/d)`, for every position up to `max`.
fn rope_tables(head_dim: usize, base: f32, max: usize) -> Result<(Tensor, Tensor), ModelError> {
    let theta: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    let theta =
        Tensor::from_vec(theta, (1, head_dim / 2), &Device::Cpu).map_err(ModelError::Compute)?;
    let positions = Tensor::arange(0u32, max as u32, &Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.reshape((max, 1)))
        .map_err(ModelError::Compute)?;
    let angles = positions.matmul(&theta).map_err(ModelError::Compute)?;
    Ok((
        angles.cos().map_err(ModelError::Compute)?,
        angles.sin().map_err(ModelError::Compute)?,
    ))
}

impl Smol {
    /// Loads a llama GGUF (SmolLM2 and the like).
    pub fn load(path: &Path, max_tokens: usize) -> Result<Loaded, ModelError> {
        let mut gguf = Gguf::open(path)?;
        let config = gguf.config()?;
        let tokenizer = gguf.tokenizer()?;
        let (embed_raw, embed_dtype, embed_dims) = gguf.raw("token_embd.weight")?;
        let slot = |len, dtype: GgmlDType, dims: Vec<usize>| TensorSlot {
            offset: 0,
            len,
            dtype,
            dims,
        };
        let embed_slot = slot(embed_raw.len(), embed_dtype, embed_dims);
        let embed = dense(&embed_raw, &embed_slot)?;
        let (norm_raw, nd, ndims) = gguf.raw("output_norm.weight")?;
        let norm = dense(&norm_raw, &slot(norm_raw.len(), nd, ndims))?;
        // A tied head reads the embedding's quantized rows.
        let output = if gguf.has("output.weight") {
            let (raw, d, dims) = gguf.raw("output.weight")?;
            let at = slot(raw.len(), d, dims);
            Weight::new(raw, at)?
        } else {
            Weight::new(embed_raw, embed_slot)?
        };
        let mut layers = Vec::with_capacity(config.layers);
        let mut slots = Vec::with_capacity(config.layers);
        let mut fused = Vec::with_capacity(config.layers);
        for layer in 0..config.layers {
            let (bytes, s) = gguf.layer(layer)?;
            layers.push(bytes);
            fused.push([crate::gguf::fused(&s[1..4]), crate::gguf::fused(&s[6..8])]);
            slots.push(s);
        }
        let (cos, sin) = rope_tables(config.head_dim, config.rope_base, max_tokens.max(1))?;
        Ok(Loaded {
            model: Arc::new(Smol {
                config,
                embed,
                norm,
                output,
                slots,
                fused,
                cos,
                sin,
            }),
            layers,
            tokenizer,
        })
    }

    /// The KV shape of this model for `max_tokens`, K kept in `k_dtype` and V in `v_dtype`.
    pub fn kv_shape(&self, k_dtype: KvDtype, v_dtype: KvDtype, max_tokens: usize) -> KvShape {
        KvShape {
            layers: self.config.layers,
            q_heads: self.config.q_heads,
            kv_heads: self.config.kv_heads,
            head_dim: self.config.head_dim,
            max_tokens,
            k_dtype,
            v_dtype,
        }
    }

    /// The residual stream of `tokens`, one row each: `[tokens, hidden]`.
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor, ModelError> {
        let ids = Tensor::new(tokens, &Device::Cpu).map_err(ModelError::Compute)?;
        self.embed
            .index_select(&ids, 0)
            .map_err(ModelError::Compute)
    }

    fn rms(&self, x: &Tensor, w: &Tensor) -> Result<Tensor, ModelError> {
        candle_nn::ops::rms_norm(x, w, self.config.rms_eps).map_err(ModelError::Compute)
    }

    /// Interleaved RoPE (the GGUF's Q/K rows are permuted for it) of rows `[rows, heads ×
    /// hd]` at `positions`, one tensor operation for all of them (each element's arithmetic
    /// is the one a row alone gets). Returns the rows flat, row-major.
    fn rope(
        &self,
        rows: &Tensor,
        heads: usize,
        positions: &Tensor,
    ) -> Result<Vec<f32>, ModelError> {
        let hd = self.config.head_dim;
        let n = rows.dim(0).map_err(ModelError::Compute)?;
        let cos = self
            .cos
            .index_select(positions, 0)
            .map_err(ModelError::Compute)?;
        let sin = self
            .sin
            .index_select(positions, 0)
            .map_err(ModelError::Compute)?;
        let x = rows
            .contiguous()
            .and_then(|t| t.reshape((n, heads, hd)))
            .and_then(|t| t.transpose(0, 1))
            .and_then(|t| t.contiguous())
            .and_then(|t| t.unsqueeze(0))
            .map_err(ModelError::Compute)?;
        candle_nn::rotary_emb::rope_i(&x, &cos, &sin)
            .and_then(|t| t.squeeze(0))
            .and_then(|t| t.transpose(0, 1))
            .and_then(|t| t.contiguous())
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(ModelError::Compute)
    }

    /// Layer `layer`'s attention inputs for the rows of `x` at `positions`, RoPE applied to
    /// the queries and keys. `bytes` are the layer's packed tensors.
    pub fn qkv(
        &self,
        layer: usize,
        bytes: &[u8],
        x: &Tensor,
        positions: &[usize],
    ) -> Result<Qkv, ModelError> {
        let s = &self.slots[layer];
        let h = self.rms(x, &dense(bytes, &s[0])?)?;
        let (q, k, v) = match &self.fused[layer][0] {
            Some(qkv) => {
                let all = project(bytes, qkv, &h)?;
                let (nq, nk, nv) = (s[1].dims[0], s[2].dims[0], s[3].dims[0]);
                let part = |from, n| all.narrow(1, from, n).map_err(ModelError::Compute);
                (part(0, nq)?, part(nq, nk)?, part(nq + nk, nv)?)
            }
            None => (
                project(bytes, &s[1], &h)?,
                project(bytes, &s[2], &h)?,
                project(bytes, &s[3], &h)?,
            ),
        };
        let c = &self.config;
        let at: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let at = Tensor::new(at.as_slice(), &Device::Cpu).map_err(ModelError::Compute)?;
        Ok(Qkv {
            q: self.rope(&q, c.q_heads, &at)?,
            k: self.rope(&k, c.kv_heads, &at)?,
            v: v.contiguous()
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(ModelError::Compute)?,
        })
    }

    /// The rest of layer `layer`: the attention's output projection and residual, then the
    /// SwiGLU feed-forward and its residual. `attended` holds the attention's output rows,
    /// flat. Returns the new residual stream.
    pub fn finish_layer(
        &self,
        layer: usize,
        bytes: &[u8],
        x: &Tensor,
        attended: Vec<f32>,
    ) -> Result<Tensor, ModelError> {
        let s = &self.slots[layer];
        let rows = attended.len() / self.config.hidden.max(1);
        let a = Tensor::from_vec(attended, (rows, self.config.hidden), &Device::Cpu)
            .map_err(ModelError::Compute)?;
        let x = (project(bytes, &s[4], &a)? + x).map_err(ModelError::Compute)?;
        let h = self.rms(&x, &dense(bytes, &s[5])?)?;
        let (gate, up) = match &self.fused[layer][1] {
            Some(gate_up) => {
                let both = project(bytes, gate_up, &h)?;
                let (ng, nu) = (s[6].dims[0], s[7].dims[0]);
                let part = |from, n| both.narrow(1, from, n).map_err(ModelError::Compute);
                (part(0, ng)?, part(ng, nu)?)
            }
            None => (project(bytes, &s[6], &h)?, project(bytes, &s[7], &h)?),
        };
        let act = (candle_nn::ops::silu(&gate).map_err(ModelError::Compute)? * up)
            .map_err(ModelError::Compute)?;
        let down = project(bytes, &s[8], &act)?;
        (down + x).map_err(ModelError::Compute)
    }

    /// Logits of each row of the final residual stream: `[rows][vocab]`.
    pub fn logits(&self, x: &Tensor) -> Result<Vec<Vec<f32>>, ModelError> {
        let h = self.rms(x, &self.norm)?;
        self.output
            .forward(&h)?
            .to_dtype(DType::F32)
            .and_then(|l| l.to_vec2::<f32>())
            .map_err(ModelError::Compute)
    }
}

/// The two largest logits, largest first.
pub fn top2(logits: &[f32]) -> (f32, f32) {
    let mut v = logits.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    (v[0], v.get(1).copied().unwrap_or(f32::NEG_INFINITY))
}

/// The rows a layer's attention takes, flat and row-major: each row's query
/// (`q_heads × head_dim`), key and value (`kv_heads × head_dim` each), RoPE applied.
#[derive(Debug, Clone, Default)]
pub struct Qkv {
    /// Queries.
    pub q: Vec<f32>,
    /// Keys.
    pub k: Vec<f32>,
    /// Values.
    pub v: Vec<f32>,
}

/// Writes each sequence's new K/V rows into the step's memory and runs the causal operator
/// over them: the step's `i`-th sequence takes the next [`StepKv::count`] rows of `qkv`.
/// Returns the attention's output rows, flat, in the same order.
fn attend_rows(
    kv: &mut StepKv<'_>,
    shape: KvShape,
    layer: usize,
    qkv: &Qkv,
) -> Result<Vec<f32>, ModelError> {
    let (qw, kw) = (shape.q_heads * shape.head_dim, shape.token_elems());
    let rows = qkv.q.len() / qw.max(1);
    let counted: usize = (0..kv.len()).filter_map(|i| kv.count(i)).sum();
    if rows != counted || qkv.k.len() != rows * kw || qkv.v.len() != rows * kw {
        return Err(StepFault::Mismatch {
            what: "attention rows for the step's new tokens",
            got: rows,
            expected: counted,
        }
        .into());
    }
    let mut out = vec![0f32; qkv.q.len()];
    let mut first = 0;
    for i in 0..kv.len() {
        let (start, n) = (kv.position(i).unwrap_or(0), kv.count(i).unwrap_or(0));
        let (k, v) = (
            &qkv.k[first * kw..(first + n) * kw],
            &qkv.v[first * kw..(first + n) * kw],
        );
        // Rounded or quantized into the type the store keeps, then read back as kept.
        kv.write_rows_f32(i, layer, 0, k, v)?;
        let (keys, values) = kv.rows(i, layer)?;
        gqa_causal_rows(
            &qkv.q[first * qw..(first + n) * qw],
            keys,
            values,
            start,
            shape.heads(),
            &mut out[first * qw..(first + n) * qw],
        );
        first += n;
    }
    Ok(out)
}

/// Writes each new token's K/V into the step's flat buffers and runs the causal operator over
/// every row so far, on the step's stream (the server's own kernel over the managed KV).
/// `qkv` holds one (query, key, value) per new token: the step's sequences in order, each
/// sequence's tokens in position order. Returns each token's output, in the same order.
pub async fn attend(
    step: &KvStep,
    shape: KvShape,
    layer: usize,
    qkv: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)>,
) -> Result<Vec<Vec<f32>>, ModelError> {
    let width = shape.q_heads * shape.head_dim;
    let mut flat = Qkv::default();
    for (q, k, v) in qkv {
        flat.q.extend(q);
        flat.k.extend(k);
        flat.v.extend(v);
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    step.submit(move |kv| {
        let _ = tx.send(attend_rows(kv, shape, layer, &flat));
    })?;
    let out = rx.await.map_err(|_| StepFault::KernelDropped)??;
    Ok(out.chunks(width.max(1)).map(<[f32]>::to_vec).collect())
}

/// What a step's kernels hand one another on the stream: the residual stream, then each
/// layer's attention inputs and outputs, and at the end the logits. The first error stops the
/// rest; `stages` counts the kernels that ran to the end (one that panicked leaves it short).
struct Flow {
    x: Option<Tensor>,
    qkv: Qkv,
    attended: Vec<f32>,
    logits: Vec<Vec<f32>>,
    stages: usize,
    error: Option<ModelError>,
}

/// Runs one kernel's part of the step over the flow, unless an earlier one failed.
fn stage(flow: &Mutex<Flow>, f: impl FnOnce(&mut Flow) -> Result<(), ModelError>) {
    let mut flow = flow.lock().unwrap_or_else(PoisonError::into_inner);
    if flow.error.is_some() {
        return;
    }
    match f(&mut flow) {
        Ok(()) => flow.stages += 1,
        Err(e) => flow.error = Some(e),
    }
}

/// One decode step of `batch` (`(sequence, token, position)`): [`forward_step`] with one
/// token per sequence. Returns each row's logits.
pub async fn decode_step(
    model: &Arc<Smol>,
    weights: &ResidencyHandle,
    kv: &KvStoreHandle,
    shape: KvShape,
    batch: &[(SeqId, u32, usize)],
) -> Result<Vec<Vec<f32>>, ModelError> {
    let inputs: Vec<StepInput> = batch
        .iter()
        .map(|&(seq, token, position)| StepInput {
            seq,
            tokens: vec![token],
            position,
        })
        .collect();
    forward_step(model, weights, kv, shape, &inputs).await
}

/// One step of `batch`: each sequence's new tokens (a prompt's chunk, or one decode token)
/// go through every layer over the managed KV, in one grant and one pass, attention causal
/// within each sequence. Returns, per sequence, the logits of its last new token. The
/// sequences must be open in `kv`, each at its `position`.
///
/// The whole step is queued before any of it is awaited: per layer, the projections over the
/// layer's weights (residency reloads them first if they were offloaded, and keeps them until
/// their kernel's fence), the attention over the step's KV, then the rest of the layer, each a
/// kernel on the host stream, handing its output to the next through the step's flow. Where
/// the weights' stream is the KV's (one provider for both, as the engine builds them) the
/// stream's order is the only wait; otherwise each kernel waits for the one before it on the
/// other stream. The output head (the final norm and the logits of each sequence's last row)
/// is one more kernel after the last layer. The caller waits once, for it: its thread (a
/// worker of the server's runtime) computes nothing.
///
/// Each `position` must be the number of tokens the store holds for its sequence
/// ([`ModelError::Position`] otherwise). A caller that gives up on the step (drops this
/// future) before it commits leaves the sequence as it was; one that gives up while it
/// commits (awaiting the store's answer) may find the tokens counted, which the position
/// check of the next step then reports.
pub async fn forward_step(
    model: &Arc<Smol>,
    weights: &ResidencyHandle,
    kv: &KvStoreHandle,
    shape: KvShape,
    batch: &[StepInput],
) -> Result<Vec<Vec<f32>>, ModelError> {
    forward(model, weights, kv, shape, batch, false).await
}

/// [`forward_step`] returning the logits of every new token, in order (the batch's sequences
/// in turn, each's tokens in position order): what a perplexity or a comparison of two KV
/// types over a text reads, a chunk of the text at a time.
pub async fn forward_every_row(
    model: &Arc<Smol>,
    weights: &ResidencyHandle,
    kv: &KvStoreHandle,
    shape: KvShape,
    batch: &[StepInput],
) -> Result<Vec<Vec<f32>>, ModelError> {
    forward(model, weights, kv, shape, batch, true).await
}

async fn forward(
    model: &Arc<Smol>,
    weights: &ResidencyHandle,
    kv: &KvStoreHandle,
    shape: KvShape,
    batch: &[StepInput],
    every_row: bool,
) -> Result<Vec<Vec<f32>>, ModelError> {
    // Dropping a step that fails counts nothing.
    let step = crate::scheduler::prepare(kv, batch).await?;
    let tokens: Vec<u32> = batch
        .iter()
        .flat_map(|b| b.tokens.iter().copied())
        .collect();
    let positions: Arc<[usize]> = batch
        .iter()
        .flat_map(|b| b.position..b.position + b.tokens.len())
        .collect();
    let flow = Arc::new(Mutex::new(Flow {
        x: Some(model.embed(&tokens)?),
        qkv: Qkv::default(),
        attended: Vec::new(),
        logits: Vec::new(),
        stages: 0,
        error: None,
    }));
    let last = queue_layers(model, weights, &step, shape, &flow, &positions).await?;
    // The output head runs on the stream too (its matmul is the step's largest), after the
    // last layer: by the stream's order where the weights' stream is the step's, else once
    // that layer's fence completed. The caller's thread only waits.
    if let Some(last) = last.filter(|l| l.fence().stream != step.stream().id()) {
        fence_completed(&last).await;
    }
    // Only each sequence's last row is read (unless every row is asked for).
    let rows: Option<Vec<u32>> = (!every_row && tokens.len() != batch.len()).then(|| {
        batch
            .iter()
            .scan(0u32, |end, b| {
                *end += b.tokens.len() as u32;
                Some(*end - 1)
            })
            .collect()
    });
    let (m, f) = (Arc::clone(model), Arc::clone(&flow));
    // On the step's stream itself, not through `KvStep::submit`: the head reads no KV, so it
    // does not hold the step's memory (the store maps the next growth meanwhile). A CUDA
    // step answers `NotHost`, as every kernel above does.
    let head = step.stream().submit_host(move || {
        stage(&f, |flow| {
            let x = flow.x.take().ok_or_else(lost_stream)?;
            let x = match rows {
                Some(rows) => {
                    let at =
                        Tensor::new(rows.as_slice(), &Device::Cpu).map_err(ModelError::Compute)?;
                    x.index_select(&at, 0).map_err(ModelError::Compute)?
                }
                None => x,
            };
            flow.logits = m.logits(&x)?;
            Ok(())
        })
    })?;
    let on_stream = TimelineFence::new(head, step.stream().timeline()).ok_or_else(lost_stream)?;
    fence_completed(&on_stream).await;
    let logits = {
        let mut flow = flow.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(e) = flow.error.take() {
            return Err(e);
        }
        if flow.stages != 3 * model.config.layers + 1 {
            return Err(StepFault::KernelPanicked.into());
        }
        std::mem::take(&mut flow.logits)
    };
    step.complete(head).await.map_err(ModelError::Store)?;
    Ok(logits)
}

fn lost_stream() -> ModelError {
    StepFault::KernelPanicked.into()
}

/// Queues every layer's three kernels of `step` (projections, attention, the rest); returns
/// the last one's residency fence.
async fn queue_layers(
    model: &Arc<Smol>,
    weights: &ResidencyHandle,
    step: &KvStep,
    shape: KvShape,
    flow: &Arc<Mutex<Flow>>,
    positions: &Arc<[usize]>,
) -> Result<Option<TimelineFence>, ModelError> {
    let kv_stream = step.stream().id();
    let mut last = None;
    for layer in 0..model.config.layers {
        // A kernel already failed: queue nothing more (no reload for a step that is lost).
        if flow
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .error
            .is_some()
        {
            break;
        }
        let (m, f, pos) = (Arc::clone(model), Arc::clone(flow), Arc::clone(positions));
        let projected = weights
            .submit_with_weights(layer, move |w| {
                stage(&f, |flow| {
                    let x = flow.x.as_ref().ok_or_else(lost_stream)?;
                    flow.qkv = m.qkv(layer, w, x, &pos)?;
                    Ok(())
                })
            })
            .await?;
        let apart = projected.fence().stream != kv_stream;
        if apart {
            fence_completed(&projected).await;
        }
        let f = Arc::clone(flow);
        let fence = step.submit(move |kv| {
            stage(&f, |flow| {
                let qkv = std::mem::take(&mut flow.qkv);
                flow.attended = attend_rows(kv, shape, layer, &qkv)?;
                Ok(())
            })
        })?;
        if apart {
            let attended = TimelineFence::new(fence, step.stream().timeline())
                .ok_or(StepFault::ForeignFence)?;
            fence_completed(&attended).await;
        }
        let (m, f) = (Arc::clone(model), Arc::clone(flow));
        let finished = weights
            .submit_with_weights(layer, move |w| {
                stage(&f, |flow| {
                    let x = flow.x.take().ok_or_else(lost_stream)?;
                    let attended = std::mem::take(&mut flow.attended);
                    flow.x = Some(m.finish_layer(layer, w, &x, attended)?);
                    Ok(())
                })
            })
            .await?;
        last = Some(finished);
    }
    Ok(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One product over Q/K/V (and over gate/up) packed as one matrix gives each output row
    /// exactly the bits of that row's own product: fusing changes the number of calls, not
    /// the arithmetic.
    #[test]
    fn fused_projections_equal_the_separate_ones_bit_for_bit() {
        let Some(path) = crate::smollm2_path() else {
            eprintln!("SKIPPED: no model (run scripts/fetch-model.sh)");
            return;
        };
        let loaded = Smol::load(&path, 16).unwrap();
        let m = &loaded.model;
        for layer in [0, m.config.layers / 2, m.config.layers - 1] {
            let (bytes, s) = (&loaded.layers[layer], &m.slots[layer]);
            let x = m.embed(&[1, 500, 30_000]).unwrap();
            for (group, parts) in [(0, &s[1..4]), (1, &s[6..8])] {
                let whole = m.fused[layer][group]
                    .as_ref()
                    .expect("SmolLM2's Q/K/V and gate/up are packed as one matrix each");
                let all = project(bytes, whole, &x).unwrap().to_vec2::<f32>().unwrap();
                let each: Vec<Vec<Vec<f32>>> = parts
                    .iter()
                    .map(|p| project(bytes, p, &x).unwrap().to_vec2::<f32>().unwrap())
                    .collect();
                for (row, got) in all.iter().enumerate() {
                    let want: Vec<u32> = each
                        .iter()
                        .flat_map(|p| p[row].iter().map(|v| v.to_bits()))
                        .collect();
                    let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "layer {layer}, group {group}, row {row}");
                }
            }
        }
    }
}
