//! The main job's synthetic transformer, stepped by the library's scheduler: its weights live
//! under model residency, its attention runs over the managed KV (the host's GQA operator, or
//! the decode kernels of `kernels/decode.cu` on a GPU), and every step samples the books, so
//! the summary can say whether the OS ever held more than the ledger. [`Job`] sizes it under
//! a budget and runs the main job's workload; its `Gpu` runs where the KV lives on a GPU.

use std::sync::{Arc, Mutex, PoisonError};

use crate::error::{ModelError, StepFault};
use crate::smollm::{Qkv, StepRow};
use crate::step::{AfterFuture, StepFuture, StepInput, StepModel, StepOutput};
use procmem_actors::procmem::cuda::{CudaDevice, DecodeKernels, DecodeLaunch};
use procmem_actors::procmem::kv::{KvPart, KvShape};
use procmem_actors::{
    kv::{KvStep, KvStoreHandle},
    residency::ResidencyHandle,
    AuthorityBooks, MemoryManager,
};

mod job;
pub use job::{Job, JobConfig, JobProgress, JobReport, Size};

/// The synthetic model's sizes; its weights are seeded noise.
pub struct Model {
    /// The KV's shape.
    pub shape: KvShape,
    /// The residual stream's width.
    pub hidden: usize,
    /// Tokens of the vocabulary.
    pub vocab: u32,
}

impl Model {
    /// Query heads x head dimension.
    fn q_dim(&self) -> usize {
        self.shape.q_heads * self.shape.head_dim
    }

    fn kv_dim(&self) -> usize {
        self.shape.token_elems()
    }

    /// Floats of one layer's weights: Wq (q×h), Wk (kv×h), Wv (kv×h), Wo (h×q), row-major.
    pub fn layer_floats(&self) -> usize {
        2 * self.q_dim() * self.hidden + 2 * self.kv_dim() * self.hidden
    }

    /// Layer `layer`'s weights as bytes, from `seed`.
    pub fn weights(&self, layer: usize, seed: u64) -> Vec<u8> {
        let n = self.layer_floats();
        let scale = 1.0 / (self.hidden as f32).sqrt();
        let mut x = seed ^ (layer as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (0..n)
            .flat_map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let f = (((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale;
                f.to_le_bytes()
            })
            .collect()
    }

    fn embed(&self, token: u32) -> Vec<f32> {
        (0..self.hidden)
            .map(|i| ((token as f32 + 1.0) * 0.37 + i as f32 * 0.11).sin())
            .collect()
    }

    /// Each token's score: its embedding against the residual stream.
    fn logits(&self, x: &[f32]) -> Vec<f32> {
        (0..self.vocab)
            .map(|t| self.embed(t).iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    }
}

fn matvec(w: &[f32], rows: usize, x: &[f32]) -> Vec<f32> {
    let cols = x.len();
    (0..rows)
        .map(|r| dot(&w[r * cols..(r + 1) * cols], x))
        .collect()
}

/// A dot product over eight running sums, which the compiler turns into vector arithmetic (a
/// single running sum must be added in order, one element at a time).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// What the per-step samples of the books found.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    /// Samples taken (one after each step that went through, its memory back in the store).
    pub taken: u64,
    /// Samples where the OS held more than the ledger had granted: a defect.
    pub os_above_ledger: u64,
    /// Samples where the ledger was above the OS: frees in flight.
    pub ledger_above_os: u64,
    /// The most KV swapped out at once.
    pub peak_swapped: u64,
    /// The KV authority's most bytes leased, by the ledger.
    pub peak_ledger: u64,
    /// The same, by the OS.
    pub peak_os: u64,
}

/// The synthetic model over the managed KV, as the scheduler steps it.
pub struct Synthetic {
    /// Sizes and weights.
    pub model: Model,
    /// Where its sequences live.
    pub kv: KvStoreHandle,
    /// Its layers' weights.
    pub weights: ResidencyHandle,
    /// The GPU's kernels and staging, where the KV lives on one.
    pub gpu: Option<Gpu>,
    /// The books the steps sample.
    pub memory: MemoryManager,
    /// The KV's authority among `memory.books()`.
    pub kv_books: usize,
    /// What the samples found.
    pub samples: Mutex<Samples>,
}

impl StepModel for Synthetic {
    fn kv(&self) -> &KvStoreHandle {
        &self.kv
    }

    fn step<'a>(&'a self, step: &'a KvStep, batch: &'a [StepInput]) -> StepFuture<'a> {
        Box::pin(self.forward(step, batch))
    }

    fn after_step(&self) -> AfterFuture<'_> {
        Box::pin(self.sample())
    }
}

impl Synthetic {
    /// Every layer over each sequence's new tokens: projections under residency, attention
    /// over the step's KV (causal within a chunk), output projection and norm. Returns the
    /// logits of each sequence's last new token, and the fence that covers the step's writes.
    async fn forward(&self, step: &KvStep, batch: &[StepInput]) -> Result<StepOutput, ModelError> {
        let m = &self.model;
        let (h, qd, kvd) = (m.hidden, m.q_dim(), m.kv_dim());
        // Every new token's residual stream and (sequence, position), the batch's order.
        let mut xs: Vec<Vec<f32>> = batch
            .iter()
            .flat_map(|b| b.tokens.iter().map(|&t| m.embed(t)))
            .collect();
        let rows = step_rows(batch);
        for layer in 0..m.shape.layers {
            let inputs = xs.clone();
            let qkv = self
                .weights
                .with_weights(layer, move |w| {
                    // Weights are page-aligned f32s: read them in place.
                    let w: &[f32] = bytemuck::cast_slice(w);
                    let (wq, rest) = w.split_at(qd * h);
                    let (wk, rest) = rest.split_at(kvd * h);
                    let (wv, _) = rest.split_at(kvd * h);
                    inputs
                        .iter()
                        .map(|x| Qkv {
                            q: matvec(wq, qd, x),
                            k: matvec(wk, kvd, x),
                            v: matvec(wv, kvd, x),
                        })
                        .collect::<Vec<_>>()
                })
                .await?;
            let attended = match &self.gpu {
                // The driver calls wait for the device: off the runtime's async threads.
                Some(gpu) => {
                    tokio::task::block_in_place(|| gpu.attend(step, m.shape, layer, &rows, &qkv))?
                }
                None => crate::smollm::attend(step, m.shape, layer, Qkv::concat(qkv)).await?,
            };
            let inputs = std::mem::take(&mut xs);
            xs = self
                .weights
                .with_weights(layer, move |w| {
                    let w: &[f32] = bytemuck::cast_slice(w);
                    let wo = &w[qd * h + 2 * kvd * h..];
                    inputs
                        .iter()
                        .zip(&attended)
                        .map(|(x, a)| {
                            let o = matvec(wo, h, a);
                            let y: Vec<f32> = x.iter().zip(&o).map(|(x, o)| x + o).collect();
                            let norm = (y.iter().map(|v| v * v).sum::<f32>() / h as f32)
                                .sqrt()
                                .max(1e-6);
                            y.iter().map(|v| v / norm).collect::<Vec<f32>>()
                        })
                        .collect::<Vec<_>>()
                })
                .await?;
        }
        // Every layer's K/V of the new tokens is written by the kernels the last fence covers.
        let fence = match step.stream().cuda() {
            Some(stream) => stream.submit(&[], |_| Ok(()))?,
            None => step.last_fence().ok_or(StepFault::NoKernel)?,
        };
        let mut end = 0;
        let logits = batch
            .iter()
            .map(|b| {
                end += b.tokens.len();
                m.logits(&xs[end - 1])
            })
            .collect();
        Ok(StepOutput {
            logits,
            end: fence.into(),
        })
    }

    /// The books of the KV's authority after a step: ledger against OS, and the swap's peak.
    async fn sample(&self) {
        let books = self.memory.books().await;
        let swapped = self.kv.stats().await.map(|s| s.swapped_bytes).unwrap_or(0);
        let Some(AuthorityBooks {
            snapshot: s,
            os_bytes: os,
            ..
        }) = books.get(self.kv_books)
        else {
            return;
        };
        let mut c = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        c.taken += 1;
        c.peak_ledger = c.peak_ledger.max(s.books.leased);
        c.peak_os = c.peak_os.max(os.unwrap_or(0));
        c.peak_swapped = c.peak_swapped.max(swapped);
        // Memory is freed before its refund, never the other way: the OS may trail the
        // ledger while frees are in flight, but never exceed it.
        match os {
            Some(os) if *os > s.books.leased => c.os_above_ledger += 1,
            Some(os) if *os < s.books.leased => c.ledger_above_os += 1,
            _ => {}
        }
    }
}

/// Where each new token of `batch` goes, in the batch's order.
fn step_rows(batch: &[StepInput]) -> Vec<StepRow> {
    batch
        .iter()
        .enumerate()
        .flat_map(|(i, b)| {
            (0..b.tokens.len()).map(move |j| StepRow {
                seq: i,
                position: b.position + j,
            })
        })
        .collect()
}

/// The GPU side: the decode kernels (kernels/decode.cu, loaded from their PTX) and device
/// staging for the rows of a step: each row's query, new K/V and output, and one scratch for
/// partial results (the stream runs one decode at a time).
pub struct Gpu {
    /// The device.
    pub device: Arc<CudaDevice>,
    kernels: DecodeKernels,
    /// Rows staged at once.
    slots: usize,
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    partials: u64,
}

impl Gpu {
    /// Kernels and staging for `slots` rows at once on `memory`'s CUDA device.
    pub fn new(memory: &MemoryManager, shape: KvShape, slots: usize) -> Result<Gpu, ModelError> {
        let provider = memory.cuda_provider().ok_or(StepFault::NotOnDevice)?;
        let device = provider.mechanism().device().clone();
        let kernels = DecodeKernels::load(device.clone())?;
        let f32s = |n: usize| device.alloc((slots * n) as u64 * 4);
        let partials = DecodeLaunch {
            q: 0,
            k: 0,
            v: 0,
            k_dtype: shape.k_dtype,
            v_dtype: shape.v_dtype,
            k_rows: shape.rows(KvPart::K),
            v_rows: shape.rows(KvPart::V),
            tokens: shape.max_tokens as u32,
            q_heads: shape.q_heads as u32,
            kv_heads: shape.kv_heads as u32,
            head_dim: shape.head_dim as u32,
            partials: 0,
            out: 0,
        }
        .partials_bytes();
        Ok(Gpu {
            q: f32s(shape.q_heads * shape.head_dim)?,
            k: f32s(shape.token_elems())?,
            v: f32s(shape.token_elems())?,
            out: f32s(shape.q_heads * shape.head_dim)?,
            partials: device.alloc(partials)?,
            slots: slots.max(1),
            kernels,
            device,
        })
    }

    /// One layer of attention for every new row of the step, on the step's CUDA stream:
    /// `rows[r]` is where row `r` goes, `qkv[r]` its query, key and value. Each row's K/V is
    /// written into the flat buffers by the copy kernel, then the split-KV decode runs over
    /// every row up to it, read in place through the step's views: the stream runs them in
    /// order, so a chunk's row sees its own earlier rows (causal).
    pub fn attend(
        &self,
        step: &KvStep,
        shape: KvShape,
        layer: usize,
        rows: &[StepRow],
        qkv: &[Qkv],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        if rows.len() != qkv.len() {
            return Err(StepFault::Mismatch {
                what: "rows of a step against its projections",
                got: rows.len(),
                expected: qkv.len(),
            }
            .into());
        }
        let mut outs = Vec::with_capacity(qkv.len());
        // More rows than the staging holds go a slice at a time.
        for (at, part) in rows.chunks(self.slots).zip(qkv.chunks(self.slots)) {
            outs.extend(self.attend_slots(step, shape, layer, at, part)?);
        }
        Ok(outs)
    }

    /// [`Gpu::attend`] for rows that fit in the staging.
    fn attend_slots(
        &self,
        step: &KvStep,
        shape: KvShape,
        layer: usize,
        rows: &[StepRow],
        qkv: &[Qkv],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let stream = step.stream().cuda().ok_or(StepFault::NotOnDevice)?.cuda();
        let bytes = |x: &[f32]| x.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
        let (qn, rn) = (
            (shape.q_heads * shape.head_dim) as u64 * 4,
            shape.token_elems() as u64 * 4,
        );
        // The previous slice's work read the staging buffers: done before they are rewritten.
        stream.synchronize()?;
        for (i, (row, Qkv { q, k, v })) in rows.iter().zip(qkv).enumerate() {
            let (seq, pos) = (row.seq, row.position);
            let views = step
                .views(seq, layer)
                .ok_or(StepFault::NoSuchSequence(seq))?;
            let (qi, ki, vi, oi) = (
                self.q + i as u64 * qn,
                self.k + i as u64 * rn,
                self.v + i as u64 * rn,
                self.out + i as u64 * qn,
            );
            // SAFETY: each row has its own staging slot (`rows` fits in `slots`), which no
            // queued work reads until the next synchronize; the rows written are this step's
            // own (mapped read-write until its fence), and the views cover `pos + 1` rows;
            // one partials scratch serves every decode, as the stream runs them in order.
            unsafe {
                self.device.copy_to_device(qi, &bytes(q))?;
                self.device.copy_to_device(ki, &bytes(k))?;
                self.device.copy_to_device(vi, &bytes(v))?;
                let n = shape.token_elems() as u32;
                let no_row = StepFault::Mismatch {
                    what: "rows the step's views cover",
                    got: views.k.tokens,
                    expected: pos + 1,
                };
                let (k_row, v_row) = (
                    views.k.row_addr(pos).ok_or(no_row)?,
                    views.v.row_addr(pos).ok_or(no_row)?,
                );
                self.kernels
                    .write_row(stream, shape.k_dtype, k_row, ki, n)?;
                self.kernels
                    .write_row(stream, shape.v_dtype, v_row, vi, n)?;
                let launch = DecodeLaunch {
                    q: qi,
                    k: views.k.addr,
                    v: views.v.addr,
                    k_dtype: shape.k_dtype,
                    v_dtype: shape.v_dtype,
                    k_rows: views.k.rows(),
                    v_rows: views.v.rows(),
                    tokens: (pos + 1) as u32,
                    q_heads: shape.q_heads as u32,
                    kv_heads: shape.kv_heads as u32,
                    head_dim: shape.head_dim as u32,
                    partials: self.partials,
                    out: oi,
                };
                self.kernels.decode(stream, &launch)?;
            }
        }
        stream.synchronize()?;
        let mut out = vec![0u8; qkv.len() * qn as usize];
        // SAFETY: the outputs of these rows lie at the start of `out`; the stream is idle.
        unsafe { self.device.copy_to_host(&mut out, self.out)? };
        Ok(out
            .chunks_exact(qn as usize)
            .map(|o| {
                o.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            })
            .collect())
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        for p in [self.q, self.k, self.v, self.out, self.partials] {
            // SAFETY: allocated in `new`, freed once; every call synchronized its stream
            // after its last use of them.
            let _ = unsafe { self.device.free(p) };
        }
    }
}
