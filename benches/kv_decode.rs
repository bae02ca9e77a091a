//! The side-by-side that justifies the design: a GQA decode loop of an 8B-like head shape
//! (32 query heads, 8 KV heads, head dimension 128) at contexts 512, 4,096 and 16,384, with
//! these KV strategies in one run:
//!
//! - `virtual`: this project, one flat virtually contiguous buffer per layer grown in chunks;
//! - `preallocated`: a flat buffer of the maximum length (the speed limit, the memory worst case);
//! - `staging_copy`: fixed-size pages gathered into a contiguous staging buffer every step;
//! - `vec_doubling`: a contiguous `Vec` reallocated and copied when full;
//! - `step_api`: the same operator driven through the KV store actor's step API (a prepare
//!   under the Governor, each layer's write and attention as a kernel on the CPU stream over
//!   the step's memory, the step completed with its fence): what a server pays for the store;
//! - `step_api_queued`: the same, but each layer's kernel is queued on the stream without the
//!   host waiting for it, as a server queues a step's layers (and as a GPU server launches its
//!   kernels); the step's end waits for them all. The stream runs them on a rayon pool of its
//!   own (`CpuProviderConfig::threads`), so the operator's split-KV pieces fork and join inside
//!   it; `step_api_queued_on_stream_thread` is the same on a stream that runs them on its
//!   own thread, handing each parallel call to rayon's global pool and back. Beside them,
//!   `prepare_p50_ns` (what a prepare
//!   takes) and `actor_call_p50_ns` (a bare ractor call made the same way: the floor under a
//!   prepare and under a complete), and `actor_call_in_runtime_p50_ns` (the same call from a
//!   task on the runtime, as a server's scheduler makes it), and the step API's own floor:
//!   `step_host_p50_ns` (a step that runs no kernel: a prepare and a complete) and
//!   `step_empty_kernels_p50_ns` (an empty kernel per layer besides: the stream's hand-off
//!   and the fence back), each also as a share of the operator's step at each context;
//! - `step_api_growing`: the same with one granule per growth, so every step maps a new
//!   granule of every buffer, mapped ahead while the previous step runs (`map_ahead`);
//!   `step_api_growing_at_prepare` maps it at prepare instead, on the step's critical path.
//!
//! For each context the KV is first filled to `context - WINDOW` tokens, then `WINDOW` decode
//! steps (append this token's K/V, attend over everything) are timed. Bytes copied are
//! counted over the whole build-up and divided by the number of steps; peak resident bytes are
//! what each strategy holds at its worst (for `virtual`, as the kernel counts the memfd).
//!
//! Beside them, in the same interleaved rounds, a plain sum over a buffer as large as the KV
//! on the operator's worker threads: `streaming_read_gb_s`, what this machine reads memory of
//! that size at when the caches are as cold as they are for the strategies (each strategy's
//! KV evicts the others'). Every row's `kv_gb_s` is the KV bytes one step reads (every
//! layer's K and V) times its steps per second.
//! Its `cuda` section runs the CUDA decode kernels over KV on CUDA VMM, preallocated and
//! staging-copied, where a GPU exists (`benches/common/cuda_decode.rs`).
//! Each strategy's figure is the median of its rounds; each `_paired` ratio (`step_api*`
//! against `virtual`) is the median of the two's ratios within the same round, so a
//! neighbour's burst over a few rounds falls on both sides of it. `virtual_again` is the
//! operator once more in the same rounds: `virtual_again_vs_virtual_paired` is how far the
//! same code's two runs are apart on this machine, the finest difference a ratio here shows.
//! Writes `target/reports/kv_decode.json`. `PROCMEM_BENCH_CONTEXTS` (comma-separated) runs
//! only those contexts.

mod common;
#[path = "common/cuda_decode.rs"]
mod cuda_decode;

use procmem_actors::kv::StepEnd;
use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use procmem::host::HostMechanism;
use procmem::kv::{gqa_decode, Heads, KvDtype, KvSequence, KvShape};
use procmem::VirtualBacking;
use procmem_actors::{
    governor::{GovernorConfig, GovernorHandle},
    kv::{AttendItem, KvStep, KvStoreConfig, KvStoreHandle},
    provider::{CpuProvider, CpuProviderConfig},
};
use serde_json::json;

use common::{percentile, write_report};

const LAYERS: usize = 2;
const Q_HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const CONTEXTS: [usize; 3] = [512, 4096, 16384];
const WINDOW: usize = 200;
/// Interleaved rounds per context; each strategy reports the median of its rounds, and each
/// `_paired` ratio the median of the ratios of the same rounds.
const ROUNDS: usize = 20;
const PAGE_TOKENS: usize = 16;
const CHUNK_GRANULES: u64 = 64;
const TF: usize = KV_HEADS * HEAD_DIM;
const TOKEN_BYTES: u64 = (TF * 4) as u64;

trait Strategy {
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]);
    /// Finishes the token after every layer's append.
    fn advance(&mut self);
    fn attend(&mut self, layer: usize, q: &[f32], out: &mut [f32]);
    /// Bytes copied to make room (reallocations).
    fn growth_copied(&self) -> u64;
    /// Bytes copied to present a contiguous view to the operator.
    fn gather_copied(&self) -> u64;
    fn peak_resident(&self) -> u64;
    /// The median time a prepare took, where the strategy has one.
    fn prepare_p50_ns(&self) -> Option<f64> {
        None
    }
}

struct Virtual {
    host: HostMechanism,
    seq: KvSequence,
    tokens: usize,
}

impl Strategy for Virtual {
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        if layer == 0 {
            let per = self.seq.growth_for(1);
            if !per.is_empty() {
                let g = self.seq.map_growth(per).unwrap();
                self.seq.publish(g);
            }
        }
        self.seq.write(layer, self.tokens, k, v).unwrap();
    }
    fn advance(&mut self) {
        self.seq.advance().unwrap();
        self.tokens += 1;
    }
    fn attend(&mut self, layer: usize, q: &[f32], out: &mut [f32]) {
        let (k, v) = (
            self.seq.keys::<f32>(layer).unwrap(),
            self.seq.values::<f32>(layer).unwrap(),
        );
        gqa_decode(
            q,
            k,
            v,
            self.tokens,
            Heads::new(Q_HEADS, KV_HEADS, HEAD_DIM),
            out,
        );
    }
    fn growth_copied(&self) -> u64 {
        0
    }
    fn gather_copied(&self) -> u64 {
        0
    }
    fn peak_resident(&self) -> u64 {
        self.host.backing().resident_bytes().unwrap()
    }
}

/// The KV store actor driven through steps, from a plain thread (as a server's decode loop
/// would call it from its runtime).
struct StepApi {
    rt: tokio::runtime::Runtime,
    kv: KvStoreHandle,
    /// Kept so the store's Governor and provider live as long as it.
    _keep: (GovernorHandle, CpuProvider),
    step: Option<KvStep>,
    /// This token's K/V per layer, written when the layer attends (or at `advance`).
    pending: Vec<Option<Row>>,
    /// Where each layer's kernel leaves its output when the layers are queued without waiting
    /// (`step_api_queued`); `None`: each layer waits for its kernel.
    queued: Option<Arc<Mutex<Vec<f32>>>>,
    /// Nanoseconds of each prepare.
    prepares: Vec<u64>,
}

/// One token's K and V for one layer.
type Row = (Vec<f32>, Vec<f32>);

/// How [`StepApi`] drives its layers.
#[derive(Clone, Copy, PartialEq)]
enum Drive {
    /// Each layer's attention is awaited before the next.
    EachLayerWaits,
    /// The layers' kernels are queued without waiting; the stream runs them on its own pool.
    Queued,
    /// Queued, on a stream that runs them on its own thread, their parallel calls going to
    /// rayon's global pool (`CpuProviderConfig::threads` 0: how every stream ran before).
    QueuedOnStreamThread,
}

impl StepApi {
    /// A store growing `chunk_granules` granules at a time, mapping the next growth while a
    /// step runs or not.
    fn new(shape: KvShape, chunk_granules: u64, map_ahead: bool, drive: Drive) -> Self {
        let queued = drive != Drive::EachLayerWaits;
        // Queued, the store's actors run on this thread while it waits in `block_on` (a
        // runtime of its own thread), as a server's scheduler task and its store share a
        // worker: a call between them wakes no other thread. The other strategies call from
        // this thread into a runtime of one worker thread.
        let rt = if queued {
            tokio::runtime::Builder::new_current_thread()
        } else {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(1);
            b
        }
        .enable_all()
        .build()
        .unwrap();
        let (kv, keep) = rt.block_on(async {
            let (g, _) = GovernorHandle::spawn(GovernorConfig::new("host", 1 << 40))
                .await
                .unwrap();
            let mut config = CpuProviderConfig::default();
            if drive == Drive::QueuedOnStreamThread {
                config.threads = 0;
            }
            let p = CpuProvider::spawn(config).await.unwrap();
            let config = KvStoreConfig::new("kv", shape)
                .chunk_granules(chunk_granules)
                .wait(std::time::Duration::from_secs(5))
                .map_ahead(map_ahead);
            let (kv, _) = KvStoreHandle::spawn(config, g.clone(), p.clone())
                .await
                .unwrap();
            kv.open(1, Vec::new(), 0).await.unwrap();
            (kv, (g, p))
        });
        StepApi {
            rt,
            kv,
            _keep: keep,
            step: None,
            pending: vec![None; LAYERS],
            queued: queued.then(|| Arc::new(Mutex::new(vec![0f32; Q_HEADS * HEAD_DIM]))),
            prepares: Vec::new(),
        }
    }
}

impl Strategy for StepApi {
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        if self.step.is_none() {
            let start = Instant::now();
            self.step = Some(self.rt.block_on(self.kv.prepare(vec![1])).unwrap());
            self.prepares.push(start.elapsed().as_nanos() as u64);
        }
        self.pending[layer] = Some((k.to_vec(), v.to_vec()));
    }
    fn advance(&mut self) {
        let step = self.step.take().expect("a step was prepared");
        let unwritten: Vec<(usize, Row)> = self
            .pending
            .iter_mut()
            .enumerate()
            .filter_map(|(l, p)| p.take().map(|kv| (l, kv)))
            .collect();
        if !unwritten.is_empty() {
            step.submit(move |kv| {
                for (layer, (k, v)) in &unwritten {
                    kv.write(0, *layer, k, v).unwrap();
                }
            })
            .unwrap();
        }
        self.rt.block_on(step.complete(StepEnd::Submitted)).unwrap();
    }
    fn attend(&mut self, layer: usize, q: &[f32], out: &mut [f32]) {
        let (k, v) = self.pending[layer].take().expect("appended first");
        let step = self.step.as_ref().expect("a step was prepared");
        if let Some(into) = &self.queued {
            // As a server queues a step's layers: the kernel goes to the stream and the host
            // goes on; the step's end waits for all of them.
            let (q, into) = (q.to_vec(), Arc::clone(into));
            step.submit(move |kv| {
                kv.write(0, layer, &k, &v).unwrap();
                let (keys, values) = (kv.keys::<f32>(0, layer).unwrap(), kv.values(0, layer));
                let mut out = into.lock().unwrap();
                let tokens = keys.len() / TF;
                gqa_decode(
                    &q,
                    keys,
                    values.unwrap(),
                    tokens,
                    Heads::new(Q_HEADS, KV_HEADS, HEAD_DIM),
                    &mut out,
                );
            })
            .unwrap();
            return;
        }
        let item = AttendItem {
            seq: 1,
            q: q.to_vec(),
            k,
            v,
        };
        let got = self.rt.block_on(step.attend(layer, vec![item])).unwrap();
        out.copy_from_slice(&got[0]);
    }
    fn growth_copied(&self) -> u64 {
        0
    }
    fn gather_copied(&self) -> u64 {
        0
    }
    fn peak_resident(&self) -> u64 {
        // KV only grows here: what the kernel counts at the end is the peak.
        self.rt.block_on(self.kv.stats()).unwrap().os_resident_bytes
    }
    fn prepare_p50_ns(&self) -> Option<f64> {
        let mut all = self.prepares.clone();
        all.sort_unstable();
        (!all.is_empty()).then(|| percentile(&all, 0.5) as f64)
    }
}

/// The floor under a step of the step API, with nothing to compute: the median nanoseconds
/// of a step that runs no kernel (a prepare and a complete, both on this thread's runtime:
/// what the store's books cost), and of one that queues an empty kernel per layer (the same,
/// plus the stream's worker woken by the first and this thread woken by the last fence).
/// Against a step's time at a context, the second is the least by which `step_api_queued`
/// can trail the operator there.
fn step_floor_p50_ns(steps: usize) -> (f64, f64) {
    let shape = KvShape {
        layers: LAYERS,
        q_heads: Q_HEADS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        // Every step, of both kinds, adds a token.
        max_tokens: 2 * steps,
        k_dtype: KvDtype::F32,
        v_dtype: KvDtype::F32,
    };
    let api = StepApi::new(shape, CHUNK_GRANULES, true, Drive::Queued);
    let time = |kernels: usize| {
        let mut all: Vec<u64> = (0..steps)
            .map(|_| {
                let start = Instant::now();
                let step = api.rt.block_on(api.kv.prepare(vec![1])).unwrap();
                for _ in 0..kernels {
                    step.submit(|_| {}).unwrap();
                }
                api.rt.block_on(step.complete(StepEnd::Submitted)).unwrap();
                start.elapsed().as_nanos() as u64
            })
            .collect();
        all.sort_unstable();
        percentile(&all, 0.5) as f64
    };
    (time(0), time(LAYERS))
}

/// An actor that answers every call at once: a ractor call to it from outside the runtime, as
/// the strategies call the store, is the floor under a prepare and a complete.
struct Echo;

/// A call to [`Echo`].
struct Ping(ractor::RpcReplyPort<()>);

impl ractor::Message for Ping {}

impl ractor::Actor for Echo {
    type Msg = Ping;
    type State = ();
    type Arguments = ();

    async fn pre_start(
        &self,
        _: ractor::ActorRef<Self::Msg>,
        _: (),
    ) -> Result<(), ractor::ActorProcessingErr> {
        Ok(())
    }

    async fn handle(
        &self,
        _: ractor::ActorRef<Self::Msg>,
        Ping(reply): Ping,
        _: &mut (),
    ) -> Result<(), ractor::ActorProcessingErr> {
        let _ = reply.send(());
        Ok(())
    }
}

/// The median nanoseconds of a bare ractor call (to [`Echo`]) made with `block_on` from this
/// thread into a runtime of one worker, as `StepApi` calls the store; and of the same call
/// made by a task on that runtime, as a server's scheduler calls its store.
fn actor_call_p50_ns() -> (f64, f64) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (echo, _) = rt.block_on(ractor::Actor::spawn(None, Echo, ())).unwrap();
    let mut all: Vec<u64> = (0..2_000)
        .map(|_| {
            let start = Instant::now();
            rt.block_on(echo.call(Ping, None)).unwrap();
            start.elapsed().as_nanos() as u64
        })
        .collect();
    let e = echo.clone();
    let mut inside: Vec<u64> = rt
        .block_on(rt.spawn(async move {
            let mut all = Vec::with_capacity(2_000);
            for _ in 0..2_000 {
                let start = Instant::now();
                e.call(Ping, None).await.unwrap();
                all.push(start.elapsed().as_nanos() as u64);
            }
            all
        }))
        .unwrap();
    echo.stop(None);
    all.sort_unstable();
    inside.sort_unstable();
    (
        percentile(&all, 0.5) as f64,
        percentile(&inside, 0.5) as f64,
    )
}

struct Preallocated {
    kv: Vec<(Vec<f32>, Vec<f32>)>,
    tokens: usize,
}

impl Strategy for Preallocated {
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let at = self.tokens * TF;
        self.kv[layer].0[at..at + TF].copy_from_slice(k);
        self.kv[layer].1[at..at + TF].copy_from_slice(v);
    }
    fn advance(&mut self) {
        self.tokens += 1;
    }
    fn attend(&mut self, layer: usize, q: &[f32], out: &mut [f32]) {
        let (k, v) = &self.kv[layer];
        gqa_decode(
            q,
            k,
            v,
            self.tokens,
            Heads::new(Q_HEADS, KV_HEADS, HEAD_DIM),
            out,
        );
    }
    fn growth_copied(&self) -> u64 {
        0
    }
    fn gather_copied(&self) -> u64 {
        0
    }
    fn peak_resident(&self) -> u64 {
        self.kv
            .iter()
            .map(|(k, v)| (k.len() + v.len()) as u64 * 4)
            .sum()
    }
}

struct VecDoubling {
    kv: Vec<(Vec<f32>, Vec<f32>)>,
    tokens: usize,
    growth_copied: u64,
    peak: u64,
}

impl Strategy for VecDoubling {
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let (kb, vb) = &mut self.kv[layer];
        for (buf, x) in [(kb, k), (vb, v)] {
            if buf.len() + x.len() > buf.capacity() {
                // Reallocate at double the size and copy everything held so far; old and new
                // coexist meanwhile. (Done by hand: the system allocator may move large blocks
                // with mremap instead of copying, which is not the strategy measured here.)
                let mut bigger = Vec::with_capacity((buf.capacity() * 2).max(x.len() * 16));
                bigger.extend_from_slice(buf);
                self.growth_copied += buf.len() as u64 * 4;
                self.peak = self
                    .peak
                    .max((buf.capacity() + bigger.capacity()) as u64 * 4);
                *buf = bigger;
            }
            buf.extend_from_slice(x);
        }
    }
    fn advance(&mut self) {
        self.tokens += 1;
        let total: u64 = self
            .kv
            .iter()
            .map(|(k, v)| (k.capacity() + v.capacity()) as u64 * 4)
            .sum();
        self.peak = self.peak.max(total);
    }
    fn attend(&mut self, layer: usize, q: &[f32], out: &mut [f32]) {
        let (k, v) = &self.kv[layer];
        gqa_decode(
            q,
            k,
            v,
            self.tokens,
            Heads::new(Q_HEADS, KV_HEADS, HEAD_DIM),
            out,
        );
    }
    fn growth_copied(&self) -> u64 {
        self.growth_copied
    }
    fn gather_copied(&self) -> u64 {
        0
    }
    fn peak_resident(&self) -> u64 {
        self.peak
    }
}

/// One buffer's fixed-size pages.
type Pages = Vec<Vec<f32>>;

struct StagingCopy {
    pages: Vec<(Pages, Pages)>,
    staging: (Vec<f32>, Vec<f32>),
    tokens: usize,
    copied: u64,
}

impl Strategy for StagingCopy {
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let tokens = self.tokens;
        let (kp, vp) = &mut self.pages[layer];
        for (pages, x) in [(kp, k), (vp, v)] {
            if tokens % PAGE_TOKENS == 0 {
                pages.push(Vec::with_capacity(PAGE_TOKENS * TF));
            }
            pages.last_mut().unwrap().extend_from_slice(x);
        }
    }
    fn advance(&mut self) {
        self.tokens += 1;
    }
    fn attend(&mut self, layer: usize, q: &[f32], out: &mut [f32]) {
        // Gather the pages into the contiguous staging buffer the operator needs.
        let (kp, vp) = &self.pages[layer];
        for (pages, staging) in [(kp, &mut self.staging.0), (vp, &mut self.staging.1)] {
            let mut at = 0;
            for page in pages {
                staging[at..at + page.len()].copy_from_slice(page);
                at += page.len();
            }
            self.copied += at as u64 * 4;
        }
        gqa_decode(
            q,
            &self.staging.0,
            &self.staging.1,
            self.tokens,
            Heads::new(Q_HEADS, KV_HEADS, HEAD_DIM),
            out,
        );
    }
    fn growth_copied(&self) -> u64 {
        0
    }
    fn gather_copied(&self) -> u64 {
        self.copied
    }
    fn peak_resident(&self) -> u64 {
        let pages: u64 = self
            .pages
            .iter()
            .map(|(k, v)| (k.len() + v.len()) as u64 * (PAGE_TOKENS * TF * 4) as u64)
            .sum();
        pages + (self.staging.0.len() + self.staging.1.len()) as u64 * 4
    }
}

fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 2654435761 + seed * 40503) % 2001) as f32 / 1000.0) - 1.0)
        .collect()
}

fn make(name: &str, max_tokens: usize) -> Box<dyn Strategy> {
    let shape = KvShape {
        layers: LAYERS,
        q_heads: Q_HEADS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        max_tokens,
        k_dtype: KvDtype::F32,
        v_dtype: KvDtype::F32,
    };
    let filled = |n: usize| vec![0.5f32; n];
    match name {
        "step_api" => Box::new(StepApi::new(
            shape,
            CHUNK_GRANULES,
            true,
            Drive::EachLayerWaits,
        )),
        "step_api_queued" => Box::new(StepApi::new(shape, CHUNK_GRANULES, true, Drive::Queued)),
        "step_api_queued_on_stream_thread" => Box::new(StepApi::new(
            shape,
            CHUNK_GRANULES,
            true,
            Drive::QueuedOnStreamThread,
        )),
        // One granule per growth: with 4 KiB rows every step maps a new granule per buffer.
        "step_api_growing" => Box::new(StepApi::new(shape, 1, true, Drive::EachLayerWaits)),
        "step_api_growing_at_prepare" => {
            Box::new(StepApi::new(shape, 1, false, Drive::EachLayerWaits))
        }
        // `virtual_again` is the operator once more, as its own strategy in the same rounds:
        // its ratio to `virtual` is what two runs of the same code differ by here (A/A).
        "virtual" | "virtual_again" => {
            let host = HostMechanism::new().unwrap();
            let seq = KvSequence::reserve(
                host.backing() as std::sync::Arc<dyn VirtualBacking>,
                shape,
                CHUNK_GRANULES,
            )
            .unwrap();
            Box::new(Virtual {
                host,
                seq,
                tokens: 0,
            })
        }
        "preallocated" => Box::new(Preallocated {
            kv: (0..LAYERS)
                .map(|_| (filled(max_tokens * TF), filled(max_tokens * TF)))
                .collect(),
            tokens: 0,
        }),
        "vec_doubling" => Box::new(VecDoubling {
            kv: (0..LAYERS).map(|_| (Vec::new(), Vec::new())).collect(),
            tokens: 0,
            growth_copied: 0,
            peak: 0,
        }),
        _ => Box::new(StagingCopy {
            pages: (0..LAYERS).map(|_| (Vec::new(), Vec::new())).collect(),
            staging: (filled(max_tokens * TF), filled(max_tokens * TF)),
            tokens: 0,
            copied: 0,
        }),
    }
}

/// Seconds for a plain sum over `buf` on the same worker threads the operator uses (the
/// machine's rayon pool): what reading memory of this size costs, nothing more.
fn streaming_read_s(buf: &[f32]) -> f64 {
    use rayon::prelude::*;
    let start = Instant::now();
    let sum: f32 = buf
        .par_chunks(1 << 16)
        .map(|c| {
            // Eight independent sums, so the loop is bound by loads, not by an add chain.
            let mut acc = [0f32; 8];
            for x in c.chunks_exact(8) {
                for l in 0..8 {
                    acc[l] += x[l];
                }
            }
            acc.iter().sum::<f32>()
        })
        .sum();
    black_box(sum);
    start.elapsed().as_secs_f64()
}

/// The strategies, in the order every round runs them.
const NAMES: [&str; 10] = [
    "virtual",
    "virtual_again",
    "step_api",
    "step_api_queued",
    "step_api_queued_on_stream_thread",
    "step_api_growing",
    "step_api_growing_at_prepare",
    "preallocated",
    "staging_copy",
    "vec_doubling",
];

/// One token's K and V (every layer writes the same) and the query.
struct Inputs {
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
}

/// Builds every strategy up to the window (the attention before it costs the same for all;
/// growth and its copies are counted all along).
fn build_up(strategies: &mut [(&str, Box<dyn Strategy>)], context: usize, x: &Inputs) {
    for (_, s) in strategies {
        for _ in 0..context - WINDOW {
            for layer in 0..LAYERS {
                s.append(layer, &x.k, &x.v);
            }
            s.advance();
        }
    }
}

/// The window's steps, the strategies interleaved round by round so drift on a shared
/// machine hits them alike: each strategy's steps per second in every round, and beside
/// them (in the same rounds, so the caches are as cold for it) what a plain read of as many
/// bytes as the KV reaches here, in GB/s (the median of the rounds).
fn timed_rounds(
    strategies: &mut [(&str, Box<dyn Strategy>)],
    kv_bytes: u64,
    x: &Inputs,
) -> (Vec<Vec<f64>>, f64) {
    let mut out = vec![0f32; Q_HEADS * HEAD_DIM];
    let plain = vec![0.5f32; (kv_bytes / 4) as usize];
    let mut reads = Vec::new();
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); strategies.len()];
    for _ in 0..ROUNDS {
        for (i, (_, s)) in strategies.iter_mut().enumerate() {
            let start = Instant::now();
            for _ in 0..WINDOW / ROUNDS {
                for layer in 0..LAYERS {
                    s.append(layer, &x.k, &x.v);
                    s.attend(layer, &x.q, &mut out);
                    black_box(&out);
                }
                s.advance();
            }
            rates[i].push((WINDOW / ROUNDS) as f64 / start.elapsed().as_secs_f64());
        }
        reads.push(kv_bytes as f64 / streaming_read_s(&plain) / 1e9);
    }
    reads.sort_by(|a, b| a.total_cmp(b));
    (rates, reads[reads.len() / 2])
}

/// The median over rounds of `name`'s rate over the operator's in the same round, so drift
/// on a shared machine (a neighbour's burst over a few rounds) falls on both sides of it.
fn paired(rates: &[Vec<f64>], name: &str) -> f64 {
    let of = |n: &str| &rates[NAMES.iter().position(|x| *x == n).unwrap()];
    let mut r: Vec<f64> = of(name)
        .iter()
        .zip(of("virtual"))
        .map(|(a, b)| a / b)
        .collect();
    r.sort_by(|a, b| a.total_cmp(b));
    r[r.len() / 2]
}

/// One row per strategy at `context` (its median rate, bytes copied, peak resident); returns
/// each strategy's tokens per second.
fn strategy_rows(
    strategies: &[(&str, Box<dyn Strategy>)],
    (context, kv_bytes): (usize, u64),
    before: &[(u64, u64)],
    rates: &mut [Vec<f64>],
    rows: &mut Vec<serde_json::Value>,
) -> Vec<(&'static str, f64)> {
    let mut per_strategy = Vec::new();
    for (i, (name, s)) in strategies.iter().enumerate() {
        rates[i].sort_by(|a, b| a.total_cmp(b));
        let tokens_per_s = rates[i][rates[i].len() / 2];
        let (growth_before, gather_before) = before[i];
        let row = json!({
            "strategy": name,
            "context": context,
            "tokens_per_s": tokens_per_s,
            // Every step reads every layer's K and V once.
            "kv_gb_s": kv_bytes as f64 * tokens_per_s / 1e9,
            // Gathers happen every step; growth copies are amortised over every step.
            "bytes_copied_per_step": (s.gather_copied() - gather_before) / WINDOW as u64
                + s.growth_copied() / context as u64,
            "growth_copies_in_window_bytes": s.growth_copied() - growth_before,
            "peak_resident_bytes": s.peak_resident(),
            "kv_bytes": kv_bytes,
        });
        eprintln!("{row}");
        let name = NAMES[NAMES.iter().position(|n| n == name).unwrap()];
        per_strategy.push((name, tokens_per_s));
        rows.push(row);
    }
    per_strategy
}

/// One context, measured: its rows go to `rows`; returns its summary and the streaming read.
/// `steps` is the step API's floor (no kernel, an empty kernel per layer), in ns.
fn run_context(
    context: usize,
    x: &Inputs,
    steps: (Option<f64>, Option<f64>),
    rows: &mut Vec<serde_json::Value>,
) -> (serde_json::Value, f64) {
    let kv_bytes = context as u64 * TOKEN_BYTES * 2 * LAYERS as u64;
    let mut strategies: Vec<_> = NAMES.iter().map(|n| (*n, make(n, context))).collect();
    build_up(&mut strategies, context, x);
    let before: Vec<_> = strategies
        .iter()
        .map(|(_, s)| (s.growth_copied(), s.gather_copied()))
        .collect();
    let (mut rates, streaming_read) = timed_rounds(&mut strategies, kv_bytes, x);
    let [paired_step_api, paired_queued, paired_on_stream_thread, paired_again] = [
        "step_api",
        "step_api_queued",
        "step_api_queued_on_stream_thread",
        "virtual_again",
    ]
    .map(|n| paired(&rates, n));
    let per_strategy = strategy_rows(&strategies, (context, kv_bytes), &before, &mut rates, rows);
    let prepare_p50 = strategies
        .iter()
        .find(|(n, _)| *n == "step_api_queued")
        .and_then(|(_, s)| s.prepare_p50_ns());
    drop(strategies);
    let floor = actor_call_p50_ns();
    let get = |n: &str| per_strategy.iter().find(|(x, _)| *x == n).unwrap().1;
    let operator_gb_s = kv_bytes as f64 * get("virtual") / 1e9;
    let (step_host, step_empty) = steps;
    let summary = json!({
        "context": context,
        "streaming_read_gb_s": streaming_read,
        "virtual_kv_gb_s": operator_gb_s,
        "operator_vs_streaming_read": operator_gb_s / streaming_read,
        "step_api_vs_virtual": get("step_api") / get("virtual"),
        "step_api_queued_vs_virtual": get("step_api_queued") / get("virtual"),
        "step_api_queued_on_stream_thread_vs_virtual":
            get("step_api_queued_on_stream_thread") / get("virtual"),
        "step_api_vs_virtual_paired": paired_step_api,
        "step_api_queued_vs_virtual_paired": paired_queued,
        "step_api_queued_on_stream_thread_vs_virtual_paired": paired_on_stream_thread,
        // The operator against itself: how far two runs of the same code are apart here.
        "virtual_again_vs_virtual_paired": paired_again,
        "prepare_p50_ns": prepare_p50,
        "actor_call_p50_ns": floor.0,
        "actor_call_in_runtime_p50_ns": floor.1,
        // The step API's least cost (no kernel, then an empty kernel per layer) as a
        // share of the operator's step here: above 0.02, `step_api_queued` within 2% of
        // the operator is below what a stream's hand-off costs on this machine.
        "step_host_vs_operator_step": step_host.map(|ns| ns * get("virtual") / 1e9),
        "step_empty_kernels_vs_operator_step": step_empty.map(|ns| ns * get("virtual") / 1e9),
        // Every step of these grows every buffer: mapped while the previous step ran,
        // or at prepare (on the step's critical path).
        "growing_vs_step_api": get("step_api_growing") / get("step_api"),
        "growing_at_prepare_vs_step_api": get("step_api_growing_at_prepare") / get("step_api"),
        "virtual_vs_preallocated": get("virtual") / get("preallocated"),
        "virtual_vs_staging_copy": get("virtual") / get("staging_copy"),
        "virtual_vs_vec_doubling": get("virtual") / get("vec_doubling"),
    });
    eprintln!("{summary}");
    (summary, streaming_read)
}

fn main() {
    let x = Inputs {
        k: data(TF, 1),
        v: data(TF, 2),
        q: data(Q_HEADS * HEAD_DIM, 3),
    };
    let mut rows = Vec::new();
    let mut contexts = Vec::new();
    let mut last_streaming_read = None;
    // On a GPU machine the host part can be left out (scripts/gpu-check.sh does).
    // `PROCMEM_BENCH_CONTEXTS` (comma-separated) runs only those contexts.
    let host_contexts: Vec<usize> = if std::env::var_os("KV_DECODE_CUDA_ONLY").is_some() {
        Vec::new()
    } else {
        common::env_list("PROCMEM_BENCH_CONTEXTS").unwrap_or_else(|| CONTEXTS.to_vec())
    };
    // The host's figures only: a CUDA-only run leaves them out.
    let (step_host, step_empty) = match host_contexts.is_empty() {
        true => (None, None),
        false => {
            let (host, empty) = step_floor_p50_ns(2_000);
            eprintln!("a step with no kernel: {host:.0} ns; with an empty kernel per layer: {empty:.0} ns");
            (Some(host), Some(empty))
        }
    };
    for &context in &host_contexts {
        let (summary, read) = run_context(context, &x, (step_host, step_empty), &mut rows);
        last_streaming_read = Some(read);
        contexts.push(summary);
    }
    write_report(
        "kv_decode",
        &json!({
            "shape": {"layers": LAYERS, "q_heads": Q_HEADS, "kv_heads": KV_HEADS,
                      "head_dim": HEAD_DIM, "dtype": "f32"},
            "threads": rayon::current_num_threads(),
            "rounds": ROUNDS,
            "step_host_p50_ns": step_host,
            "step_empty_kernels_p50_ns": step_empty,
            "steps_per_round": WINDOW / ROUNDS,
            // At the largest context (the KV there is far beyond any cache).
            "streaming_read_gb_s": last_streaming_read,
            "contexts": contexts,
            "rows": rows,
            "cuda": cuda_decode::section(),
        }),
    );
}
