//! The llama-architecture forward pass: candle for the weights' math (embeddings, RMSNorm,
//! RoPE, quantized projections, SwiGLU), this project for the KV and the attention. Each
//! decode step: per layer, the projections run inside the layer's residency unit (its
//! quantized tensors, reloaded if they were offloaded), the new K/V are written into the KV
//! store's flat buffers and the decode operator reads them there, on the step's stream.

use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Module, Tensor};
use procmem_actors::procmem::fence::TimelineFence;
use procmem_actors::procmem::kv::{gqa_causal_rows, KvDtype, KvShape};
use procmem_actors::{
    kv::{KvStep, KvStoreHandle, StepEnd, StepKv},
    provider::fence_completed,
    residency::ResidencyHandle,
};

use crate::error::{ModelError, StepFault};
use crate::gguf::{Config, Gguf, HeadSlots, TensorSlot, TokenizerData};
use crate::quant::{dense, project, rows};
use crate::step::{self, StepInput, StepOutput};

/// The model's shape and where its tensors lie; the tensors themselves are residency's (every
/// layer a unit, and one more unit, the head, for the embeddings, the final norm and the output
/// head), so every byte of the weights is in the books. What stays here is a few kilobytes: the
/// hyper-parameters, the slots and the RoPE frequencies (the angles are computed per step for
/// its positions, never tabled for the whole context).
pub struct Smol {
    /// The hyper-parameters.
    pub config: Config,
    head: HeadSlots,
    slots: Vec<Vec<TensorSlot>>,
    /// Per layer, Q/K/V and gate/up as one matrix each, where they are packed as one.
    fused: Vec<[Option<TensorSlot>; 2]>,
    /// `θ_i = base^(-2i/d)`.
    theta: Vec<f32>,
    /// candle's own product for an output head that is not block-quantized, or when candle is
    /// told to dequantize everything (the exact comparison against candle's model): built once,
    /// outside the books, since candle's dense product cannot read the head in place.
    candle_head: OnceLock<QMatMul>,
}

/// A model as loaded: the shared part, each residency unit's packed bytes, the tokenizer's
/// data.
pub struct Loaded {
    /// The model.
    pub model: Arc<Smol>,
    /// Layer `i`'s quantized tensors, packed.
    pub layers: Vec<Vec<u8>>,
    /// The head unit's tensors ([`Smol::head_unit`]), packed: the embeddings as the file
    /// holds them (quantized), the final norm, an untied output head.
    pub head: Vec<u8>,
    /// Vocabulary and merges.
    pub tokenizer: TokenizerData,
}

impl Smol {
    /// Loads a llama GGUF (SmolLM2 and the like).
    pub fn load(path: &Path) -> Result<Loaded, ModelError> {
        let mut gguf = Gguf::open(path)?;
        let config = gguf.config()?;
        let tokenizer = gguf.tokenizer()?;
        let (head_bytes, head) = gguf.head()?;
        let mut layers = Vec::with_capacity(config.layers);
        let mut slots = Vec::with_capacity(config.layers);
        let mut fused = Vec::with_capacity(config.layers);
        for layer in 0..config.layers {
            let (bytes, s) = gguf.layer(layer)?;
            layers.push(bytes);
            fused.push([crate::gguf::fused(&s[1..4]), crate::gguf::fused(&s[6..8])]);
            slots.push(s);
        }
        let hd = config.head_dim;
        let theta = (0..hd / 2)
            .map(|i| 1.0 / config.rope_base.powf((2 * i) as f32 / hd as f32))
            .collect();
        Ok(Loaded {
            model: Arc::new(Smol {
                config,
                head,
                slots,
                fused,
                theta,
                candle_head: OnceLock::new(),
            }),
            layers,
            head: head_bytes,
            tokenizer,
        })
    }

    /// The bytes a step of `rows` new tokens takes beside the weights and the KV, at most: its
    /// activations and scratch (`f32`), with `logit_rows` rows of logits. Per row, the tensors
    /// alive at once at the step's widest point: the feed-forward's gate and up product in its
    /// two layouts (`4 × ffn`), the residual stream and its copies (`6 × hidden`), the
    /// attention's rows (`2 × (q + k + v)`); per row of logits, the head's product in its two
    /// layouts and the copy handed back (`3 × vocab`). Measured on SmolLM2
    /// (`model/tests/step_scratch.rs`): a 256-row chunk takes about 0.5 of it, a decode step of
    /// 16 sequences about 0.65.
    pub fn step_scratch_bytes(&self, rows: usize, logit_rows: usize) -> u64 {
        let c = &self.config;
        let ffn = self
            .slots
            .first()
            .and_then(|s| s.get(6))
            .and_then(|gate| gate.dims.first().copied())
            .unwrap_or(4 * c.hidden);
        let attention = (c.q_heads + 2 * c.kv_heads) * c.head_dim;
        let per_row = 4 * ffn + 6 * c.hidden + 2 * attention;
        let floats = (rows as u64)
            .saturating_mul(per_row as u64)
            .saturating_add((logit_rows as u64).saturating_mul(3 * c.vocab as u64));
        floats.saturating_mul(4)
    }

    /// The residency unit of the head ([`Loaded::head`]): the one after the last layer.
    pub fn head_unit(&self) -> usize {
        self.config.layers
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

    /// The residual stream of `tokens`, one row each: `[tokens, hidden]`, from the head
    /// unit's bytes `head` (only these rows are dequantized). A token past the vocabulary is
    /// refused.
    pub fn embed(&self, head: &[u8], tokens: &[u32]) -> Result<Tensor, ModelError> {
        rows(head, &self.head.embed, tokens)
    }

    /// `cos` and `sin` of `position × θ_i` for each of `positions`: `[positions, head_dim/2]`.
    fn rope_angles(&self, positions: &[usize]) -> Result<(Tensor, Tensor), ModelError> {
        let half = self.theta.len();
        let angles: Vec<f32> = positions
            .iter()
            .flat_map(|&p| self.theta.iter().map(move |t| p as u32 as f32 * t))
            .collect();
        let angles = Tensor::from_vec(angles, (positions.len(), half), &Device::Cpu)
            .map_err(ModelError::Compute)?;
        Ok((
            angles.cos().map_err(ModelError::Compute)?,
            angles.sin().map_err(ModelError::Compute)?,
        ))
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
        (cos, sin): &(Tensor, Tensor),
    ) -> Result<Vec<f32>, ModelError> {
        let hd = self.config.head_dim;
        let n = rows.dim(0).map_err(ModelError::Compute)?;
        let x = rows
            .contiguous()
            .and_then(|t| t.reshape((n, heads, hd)))
            .and_then(|t| t.transpose(0, 1))
            .and_then(|t| t.contiguous())
            .and_then(|t| t.unsqueeze(0))
            .map_err(ModelError::Compute)?;
        candle_nn::rotary_emb::rope_i(&x, cos, sin)
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
        let at = self.rope_angles(positions)?;
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

    /// Logits of each row of the final residual stream: `[rows][vocab]`, from the head
    /// unit's bytes `head`.
    pub fn logits(&self, head: &[u8], x: &Tensor) -> Result<Vec<Vec<f32>>, ModelError> {
        let h = self.rms(x, &dense(head, &self.head.norm)?)?;
        let out = &self.head.output;
        let logits = if crate::quant::reads_in_place(out) {
            project(head, out, &h)?
        } else {
            let m = match self.candle_head.get() {
                Some(m) => m,
                None => {
                    let m = crate::quant::matmul(head, out)?;
                    self.candle_head.get_or_init(|| m)
                }
            };
            m.forward(&h).map_err(ModelError::Compute)?
        };
        logits
            .to_dtype(DType::F32)
            .and_then(|l| l.to_vec2::<f32>())
            .map_err(ModelError::Compute)
    }
}

/// The two largest logits of a row ([`top2`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TopTwo {
    /// The largest.
    pub first: f32,
    /// The next (negative infinity in a row of one).
    pub second: f32,
}

impl TopTwo {
    /// How far the largest is ahead of the next.
    pub fn margin(&self) -> f32 {
        self.first - self.second
    }
}

/// The two largest logits in IEEE total order, largest first (negative infinity where the
/// row has fewer than two).
pub fn top2(logits: &[f32]) -> TopTwo {
    let above = |l: f32, than: Option<f32>| than.is_none_or(|t| l.total_cmp(&t).is_gt());
    let (mut first, mut second) = (None, None);
    for &l in logits {
        if above(l, first) {
            second = first;
            first = Some(l);
        } else if above(l, second) {
            second = Some(l);
        }
    }
    TopTwo {
        first: first.unwrap_or(f32::NEG_INFINITY),
        second: second.unwrap_or(f32::NEG_INFINITY),
    }
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

impl Qkv {
    /// `rows` back to back, in order.
    pub fn concat(rows: impl IntoIterator<Item = Qkv>) -> Qkv {
        let mut flat = Qkv::default();
        for r in rows {
            flat.q.extend(r.q);
            flat.k.extend(r.k);
            flat.v.extend(r.v);
        }
        flat
    }
}

/// Where a new row of a step goes: the step's `seq`-th sequence, at `position`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepRow {
    /// The sequence's index in the step.
    pub seq: usize,
    /// The row's position in it.
    pub position: usize,
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
/// `qkv` holds the new tokens' rows: the step's sequences in order, each sequence's tokens
/// in position order. Returns each token's output, in the same order.
pub async fn attend(
    step: &KvStep,
    shape: KvShape,
    layer: usize,
    flat: Qkv,
) -> Result<Vec<Vec<f32>>, ModelError> {
    let width = shape.q_heads * shape.head_dim;
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
    whole(model, weights, kv, shape, batch, false).await
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
    whole(model, weights, kv, shape, batch, true).await
}

/// A step prepared, computed and completed, for a caller without a scheduler.
async fn whole(
    model: &Arc<Smol>,
    weights: &ResidencyHandle,
    kv: &KvStoreHandle,
    shape: KvShape,
    batch: &[StepInput],
    every_row: bool,
) -> Result<Vec<Vec<f32>>, ModelError> {
    // Dropping a step that fails counts nothing.
    let step = step::prepare(kv, batch).await?;
    let out = forward(model, weights, &step, shape, batch, every_row).await?;
    step.complete(out.end).await.map_err(ModelError::Store)?;
    Ok(out.logits)
}

/// The model's part of a step the caller prepared for `batch`: every kernel queued, the
/// logits read once the last is done, and the end that covers the step's KV writes (the
/// kernels submitted through it).
pub(crate) async fn forward(
    model: &Arc<Smol>,
    weights: &ResidencyHandle,
    step: &KvStep,
    shape: KvShape,
    batch: &[StepInput],
    every_row: bool,
) -> Result<StepOutput, ModelError> {
    let tokens: Vec<u32> = batch
        .iter()
        .flat_map(|b| b.tokens.iter().copied())
        .collect();
    let positions: Arc<[usize]> = batch
        .iter()
        .flat_map(|b| b.position..b.position + b.tokens.len())
        .collect();
    let flow = Arc::new(Mutex::new(Flow {
        x: None,
        qkv: Qkv::default(),
        attended: Vec::new(),
        logits: Vec::new(),
        stages: 0,
        error: None,
    }));
    queue_embed(model, weights, &flow, tokens.clone()).await?;
    queue_layers(model, weights, step, shape, &flow, &positions).await?;
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
    // The output head runs on the weights' stream too (its matmul is the step's largest),
    // after the last layer by that stream's order, inside the head unit. It reads no KV, so
    // it does not hold the step's memory (the store maps the next growth meanwhile). The
    // caller's thread only waits.
    let head = weights.submit_with_weights(model.head_unit(), move |w| {
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
            flow.logits = m.logits(w, &x)?;
            Ok(())
        })
    });
    fence_completed(&head.await?).await;
    let logits = {
        let mut flow = flow.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(e) = flow.error.take() {
            return Err(e);
        }
        if flow.stages != 3 * model.config.layers + 2 {
            return Err(StepFault::KernelPanicked.into());
        }
        std::mem::take(&mut flow.logits)
    };
    Ok(StepOutput {
        logits,
        end: StepEnd::Submitted,
    })
}

/// Queues the lookup of `tokens`' embeddings: their rows read in the head unit, on the
/// weights' stream, before the first layer's kernel there.
async fn queue_embed(
    model: &Arc<Smol>,
    weights: &ResidencyHandle,
    flow: &Arc<Mutex<Flow>>,
    tokens: Vec<u32>,
) -> Result<(), ModelError> {
    let (m, f) = (Arc::clone(model), Arc::clone(flow));
    weights
        .submit_with_weights(model.head_unit(), move |w| {
            stage(&f, |flow| {
                flow.x = Some(m.embed(w, &tokens)?);
                Ok(())
            })
        })
        .await?;
    Ok(())
}

fn lost_stream() -> ModelError {
    StepFault::KernelPanicked.into()
}

/// Queues every layer's three kernels of `step` (projections, attention, the rest).
async fn queue_layers(
    model: &Arc<Smol>,
    weights: &ResidencyHandle,
    step: &KvStep,
    shape: KvShape,
    flow: &Arc<Mutex<Flow>>,
    positions: &Arc<[usize]>,
) -> Result<(), ModelError> {
    let kv_stream = step.stream().id();
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
        weights
            .submit_with_weights(layer, move |w| {
                stage(&f, |flow| {
                    let x = flow.x.take().ok_or_else(lost_stream)?;
                    let attended = std::mem::take(&mut flow.attended);
                    flow.x = Some(m.finish_layer(layer, w, &x, attended)?);
                    Ok(())
                })
            })
            .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two largest in IEEE total order, as sorting the row would give them.
    #[test]
    fn top2_is_the_sorted_rows_first_two() {
        let sorted = |l: &[f32]| {
            let mut v = l.to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            (v.first().copied(), v.get(1).copied())
        };
        let rows: [&[f32]; 7] = [
            &[1.0, 3.0, 2.0],
            &[2.0, 2.0, 1.0],
            &[-0.0, 0.0],
            &[5.0],
            &[-f32::NAN, f32::NEG_INFINITY],
            &[f32::NAN, 1.0, f32::INFINITY],
            &[f32::NEG_INFINITY, -f32::NAN, -1.0],
        ];
        for row in rows {
            let top = top2(row);
            let (a, b) = sorted(row);
            let inf = f32::NEG_INFINITY;
            assert_eq!(top.first.to_bits(), a.unwrap_or(inf).to_bits(), "{row:?}");
            assert_eq!(top.second.to_bits(), b.unwrap_or(inf).to_bits(), "{row:?}");
        }
        assert_eq!(
            top2(&[]).first,
            f32::NEG_INFINITY,
            "an empty row does not panic"
        );
    }

    /// One product over Q/K/V (and over gate/up) packed as one matrix gives each output row
    /// exactly the bits of that row's own product: fusing changes the number of calls, not
    /// the arithmetic.
    #[test]
    fn fused_projections_equal_the_separate_ones_bit_for_bit() {
        let Some(path) = crate::fetch::smollm2_path() else {
            eprintln!("SKIPPED: no model (run scripts/fetch-model.sh)");
            return;
        };
        let loaded = Smol::load(&path).unwrap();
        let m = &loaded.model;
        for layer in [0, m.config.layers / 2, m.config.layers - 1] {
            let (bytes, s) = (&loaded.layers[layer], &m.slots[layer]);
            let x = m.embed(&loaded.head, &[1, 500, 30_000]).unwrap();
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

    /// A lookup dequantizes only its rows, and each row is what dequantizing the whole table
    /// gives it, bit for bit; a token past the vocabulary is refused, not read.
    #[test]
    fn embedding_rows_equal_the_whole_tables_and_an_id_past_it_is_refused() {
        let Some(path) = crate::fetch::smollm2_path() else {
            eprintln!("SKIPPED: no model (run scripts/fetch-model.sh)");
            return;
        };
        let loaded = Smol::load(&path).unwrap();
        let m = &loaded.model;
        let whole = dense(&loaded.head, &m.head.embed).unwrap();
        let ids = [0u32, 1, 500, 30_000, 49_151, 500];
        let got = m
            .embed(&loaded.head, &ids)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for (row, &id) in got.iter().zip(&ids) {
            let want = whole.get(id as usize).unwrap().to_vec1::<f32>().unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(row), bits(&want), "row {id}");
        }
        let vocab = m.head.embed.dims[0] as u32;
        for bad in [vocab, u32::MAX] {
            assert!(matches!(
                m.embed(&loaded.head, &[1, bad]),
                Err(ModelError::Step(StepFault::Mismatch { .. }))
            ));
        }
        // The table stays as the file holds it: about 30 MB quantized, not 113 MB of f32.
        assert!(loaded.head.len() < whole.elem_count() * 4 / 3);
    }

    /// RoPE's angles computed for a step's positions are the bits of the table the whole
    /// context used to keep (`positions × θ` as one matmul, then `cos`/`sin`).
    #[test]
    fn rope_angles_per_step_equal_the_whole_contexts_table() {
        let (hd, base, max) = (64usize, 100_000f32, 2048usize);
        let theta: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / hd as f32))
            .collect();
        let table = Tensor::arange(0u32, max as u32, &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.reshape((max, 1)))
            .and_then(|p| p.matmul(&Tensor::from_vec(theta.clone(), (1, hd / 2), &Device::Cpu)?))
            .unwrap();
        let none = TensorSlot {
            offset: 0,
            len: 0,
            dtype: candle_core::quantized::GgmlDType::F32,
            dims: Vec::new(),
        };
        let m = Smol {
            config: Config {
                layers: 0,
                hidden: hd,
                q_heads: 1,
                kv_heads: 1,
                head_dim: hd,
                context: max,
                rms_eps: 1e-5,
                rope_base: base,
                vocab: 0,
            },
            head: HeadSlots {
                embed: none.clone(),
                norm: none.clone(),
                output: none,
            },
            slots: Vec::new(),
            fused: Vec::new(),
            theta,
            candle_head: OnceLock::new(),
        };
        let positions = [0usize, 1, 7, 1023, 2047];
        let (cos, sin) = m.rope_angles(&positions).unwrap();
        let at = Tensor::new(&[0u32, 1, 7, 1023, 2047], &Device::Cpu).unwrap();
        for (got, want) in [(cos, table.cos().unwrap()), (sin, table.sin().unwrap())] {
            let want = want.index_select(&at, 0).unwrap();
            let bits = |t: &Tensor| {
                t.flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>()
            };
            assert_eq!(bits(&got), bits(&want));
        }
    }
}
