//! An inference server in miniature, on the host backend: a small synthetic transformer
//! whose weights live under model residency, many concurrent requests (some sharing a prompt
//! prefix) decoded with the real GQA operator over virtually contiguous KV, all under a
//! memory budget smaller than peak demand, so pressure tickets, evictions and preemptions
//! really happen. Ends with a summary of throughput and the books, ledger against OS.
//!
//! `cargo run --release --example inference_server -- --help`

mod common;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use common::parse_bytes;
use procmem_actors::node::{LinkConfig, NodeLink};
use procmem_actors::procmem::cuda::{CudaDevice, DecodeKernels, DecodeLaunch};
use procmem_actors::procmem::kv::shape::mapped_bytes_for;
use procmem_actors::procmem::kv::{KvDtype, KvShape};
use procmem_actors::procmem::DeviceKey;
use procmem_actors::{
    GovernorError, KvStep, KvStoreConfig, KvStoreError, KvStoreHandle, MemoryManager, PreemptMode,
    ResidencyConfig, ResidencyHandle, Restored, SwapKind, SwapSpace,
};
use tracing_subscriber::EnvFilter;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Device {
    Host,
    Cuda,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Preempt {
    /// A preempted sequence's KV is copied out and copied back on restore.
    Swap,
    /// A preempted sequence's KV is dropped and recomputed by replaying its tokens.
    Recompute,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Dtype {
    /// 32-bit floats.
    F32,
    /// 16-bit floats, as servers usually keep KV.
    F16,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModelSize {
    /// 4 layers, 8 query heads over 2 KV heads, head dimension 32.
    Small,
    /// 8 layers, 16 query heads over 4 KV heads, head dimension 64.
    Medium,
    /// An 8B-like attention shape: 32 layers, 32 query heads over 8 KV heads, head
    /// dimension 128 (residual width 512, to keep the synthetic projections small): for a GPU.
    Large,
}

/// A small inference server over procmem: budgeted KV and weights, real pressure.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Requests to serve.
    #[arg(long, default_value_t = 48)]
    requests: usize,
    /// Requests decoded at once.
    #[arg(long, default_value_t = 12)]
    concurrency: usize,
    /// Memory budget of the host authority: bytes (or with KiB/MiB/GiB), or the weights plus
    /// a fraction of the peak KV demand (`0.125x`); `auto` is `0.5x`.
    #[arg(long, default_value = "auto")]
    budget: String,
    /// What happens to a sequence preempted under pressure.
    #[arg(long, value_enum, default_value_t = Preempt::Swap)]
    preempt: Preempt,
    /// Model size.
    #[arg(long, value_enum, default_value_t = ModelSize::Small)]
    model_size: ModelSize,
    /// Element type of the KV cache.
    #[arg(long, value_enum, default_value_t = Dtype::F32)]
    kv_dtype: Dtype,
    /// Prompt length in tokens (half the requests share its first three quarters).
    #[arg(long, default_value_t = 64)]
    prompt_len: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 48)]
    max_new_tokens: usize,
    /// Seed of the synthetic weights and prompts.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Serve Prometheus metrics here (e.g. 127.0.0.1:9464); off unless given.
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,
    /// Keep serving metrics this many seconds after the workload.
    #[arg(long, default_value_t = 0)]
    linger: u64,
    /// Execution device.
    #[arg(long, value_enum, default_value_t = Device::Host)]
    device: Device,
    /// Serve a real model instead of the synthetic one: `smollm2` (fetched by
    /// `scripts/fetch-model.sh`) or a llama-architecture GGUF path. Its requests cycle through
    /// built-in chat prompts, half sharing one system prompt; `--max-new-tokens` bounds each
    /// completion, `--budget` as for the synthetic model (fractions are of peak KV on top of
    /// the weights).
    #[arg(long)]
    model: Option<String>,
    /// Join the node Governor at this address (several servers, one budget; see
    /// `examples/node_governor.rs`): the budget of the KV device's authority is then credit
    /// from the node, asked for as it is needed, instead of `--budget`.
    #[arg(long)]
    node: Option<SocketAddr>,
    /// The node's cookie.
    #[arg(long, default_value = "procmem")]
    node_cookie: String,
    /// The host budget follows the machine: its cgroup's limits and memory pressure (PSI).
    #[arg(long)]
    follow_machine: bool,
    /// This server's priority on the node: less important servers give back first.
    #[arg(long, default_value_t = 0)]
    node_priority: u32,
    /// With `--model`: serve the OpenAI-compatible API here (e.g. 127.0.0.1:8080) until
    /// Ctrl-C or SIGTERM, instead of the built-in prompts. `--concurrency` bounds the
    /// requests running at once, `--max-new-tokens` is the default `max_tokens`.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Tokens each sequence holds at most with `--model` (prompt and completion); 512
    /// for the built-in prompts, 2048 when listening, unless given.
    #[arg(long)]
    context: Option<usize>,
    /// Requests waiting to start at most when listening; more are answered 429.
    #[arg(long, default_value_t = 64)]
    max_waiting: usize,
    /// Seconds requests in flight have to finish after Ctrl-C or SIGTERM when listening.
    #[arg(long, default_value_t = 10)]
    shutdown_grace: u64,
    /// Request bodies over this many bytes are answered 413 when listening.
    #[arg(long, default_value = "1MiB")]
    body_limit: String,
}

/// Requests one run may serve.
const MAX_REQUESTS: usize = 1_000_000;
/// Requests decoded at once.
const MAX_CONCURRENCY: usize = 65_536;
/// Tokens of a prompt, and tokens generated per request.
const MAX_TOKENS: usize = 1 << 20;

struct Model {
    shape: KvShape,
    /// The residual stream's width.
    hidden: usize,
    /// Query heads x head dimension.
    q_dim: usize,
    kv_dim: usize,
    vocab: u32,
}

impl Model {
    fn new(size: ModelSize, max_tokens: usize, dtype: Dtype) -> Self {
        let (layers, q_heads, kv_heads, head_dim, hidden) = match size {
            ModelSize::Small => (4, 8, 2, 32, 8 * 32),
            ModelSize::Medium => (8, 16, 4, 64, 16 * 64),
            ModelSize::Large => (32, 32, 8, 128, 512),
        };
        let shape = KvShape {
            layers,
            q_heads,
            kv_heads,
            head_dim,
            max_tokens,
            dtype: match dtype {
                Dtype::F32 => KvDtype::F32,
                Dtype::F16 => KvDtype::F16,
            },
        };
        Model {
            shape,
            hidden,
            q_dim: q_heads * head_dim,
            kv_dim: kv_heads * head_dim,
            vocab: 512,
        }
    }

    /// Wq (q×h), Wk (kv×h), Wv (kv×h), Wo (h×q), row-major f32.
    fn layer_floats(&self) -> usize {
        2 * self.q_dim * self.hidden + 2 * self.kv_dim * self.hidden
    }

    fn weights(&self, layer: usize, seed: u64) -> Vec<u8> {
        let n = self.layer_floats();
        let scale = 1.0 / (self.hidden as f32).sqrt();
        let mut x = seed ^ (layer as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let floats: Vec<f32> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
            })
            .collect();
        floats.iter().flat_map(|f| f.to_le_bytes()).collect()
    }

    fn embed(&self, token: u32) -> Vec<f32> {
        (0..self.hidden)
            .map(|i| ((token as f32 + 1.0) * 0.37 + i as f32 * 0.11).sin())
            .collect()
    }

    fn next_token(&self, x: &[f32]) -> u32 {
        (0..self.vocab)
            .map(|t| {
                (
                    t,
                    self.embed(t).iter().zip(x).map(|(a, b)| a * b).sum::<f32>(),
                )
            })
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(t, _)| t)
            .unwrap_or(0)
    }
}

fn matvec(w: &[f32], rows: usize, x: &[f32]) -> Vec<f32> {
    let cols = x.len();
    (0..rows)
        .map(|r| {
            w[r * cols..(r + 1) * cols]
                .iter()
                .zip(x)
                .map(|(a, b)| a * b)
                .sum()
        })
        .collect()
}

struct Request {
    id: u64,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    /// Tokens whose KV the store holds.
    pos: usize,
    x: Vec<f32>,
    priority: u32,
    /// When the store admitted it (its place in the store's victim order).
    admitted: u64,
}

impl Request {
    fn token_at(&self, p: usize) -> u32 {
        if p < self.prompt.len() {
            self.prompt[p]
        } else {
            self.generated[p - self.prompt.len()]
        }
    }
    fn known(&self) -> usize {
        self.prompt.len() + self.generated.len()
    }
}

#[derive(Default)]
struct Counters {
    generated: u64,
    finished: u64,
    shed: u64,
    parked: u64,
    restores: u64,
    samples: u64,
    os_above_ledger: u64,
    ledger_above_os: u64,
    peak_swapped: u64,
    peak_ledger: u64,
    peak_os: u64,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(serve(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Builds the memory manager both models run on: `builder`'s budgets, with the metrics
/// endpoint and machine following the arguments ask for.
async fn manager(
    args: &Args,
    mut builder: procmem_actors::MemoryManagerBuilder,
) -> Result<MemoryManager, String> {
    if let Some(addr) = args.metrics_addr {
        builder = builder.metrics_addr(addr);
    }
    builder = builder.follow_machine(args.follow_machine);
    builder.build().await.map_err(|e| e.to_string())
}

/// Joins the node Governor at `addr`: the Governor of the KV device's authority takes its
/// capacity from the node from now on.
async fn join_node(
    args: &Args,
    addr: SocketAddr,
    memory: &MemoryManager,
    cuda: bool,
) -> Result<NodeLink, String> {
    let (device, tier, authority) = if cuda {
        (
            DeviceKey::cuda(0),
            procmem_actors::procmem::MemoryTier::Device,
            "cuda:0",
        )
    } else {
        (
            DeviceKey::HOST,
            procmem_actors::procmem::MemoryTier::Host,
            "host",
        )
    };
    let governor = memory
        .governor(device, tier)
        .ok_or("no Governor for the KV device")?
        .clone();
    let mut config = LinkConfig::new(addr, args.node_cookie.clone(), "inference_server");
    config.priority = args.node_priority;
    config.authority = authority.into();
    let link = NodeLink::join(config, governor)
        .await
        .map_err(|e| format!("cannot join the node at {addr}: {e}"))?;
    println!(
        "joined the node Governor at {addr} ({authority}, priority {})",
        args.node_priority
    );
    Ok(link)
}

async fn serve(args: Args) -> Result<(), String> {
    if args.requests == 0
        || args.concurrency == 0
        || args.max_new_tokens == 0
        || args.prompt_len == 0
    {
        return Err(
            "--requests, --concurrency, --prompt-len and --max-new-tokens must be at least 1"
                .into(),
        );
    }
    // Bounds that keep every size this job derives from the arguments far from overflow and
    // every allocation it makes up front modest: too large is a usage error, never a panic.
    for (flag, value, max) in [
        ("--requests", args.requests, MAX_REQUESTS),
        ("--concurrency", args.concurrency, MAX_CONCURRENCY),
        ("--prompt-len", args.prompt_len, MAX_TOKENS),
        ("--max-new-tokens", args.max_new_tokens, MAX_TOKENS),
    ] {
        if value > max {
            return Err(format!("{flag} {value} is too large (at most {max})"));
        }
    }
    if let Some(model) = &args.model {
        if matches!(args.device, Device::Cuda) {
            return Err(
                "--model runs on the host backend only (its kernels are candle's CPU ones)".into(),
            );
        }
        let (budget, fraction) = match args.budget.trim() {
            // A server's requests may each fill the context: all of them fit at `auto`.
            "auto" if args.listen.is_some() => (None, Some(1.0)),
            "auto" => (None, Some(0.5)),
            b if b.ends_with('x') => match b[..b.len() - 1].trim().parse::<f64>() {
                Ok(f) if f.is_finite() && f > 0.0 => (None, Some(f)),
                _ => {
                    return Err(format!(
                        "'{b}' is not a fraction of peak demand (try 0.25x)"
                    ))
                }
            },
            b => (Some(parse_bytes(b)?), None),
        };
        let context = args
            .context
            .unwrap_or(if args.listen.is_some() { 2048 } else { 512 });
        if !(16..=8192).contains(&context) {
            return Err(format!("--context {context}: between 16 and 8192"));
        }
        let listen = match args.listen {
            Some(addr) => Some(common::listen::Listen {
                addr,
                max_waiting: args.max_waiting,
                max_running: args.concurrency.min(256),
                default_max_tokens: args.max_new_tokens.min(context),
                grace: std::time::Duration::from_secs(args.shutdown_grace.min(3600)),
                body_limit: parse_bytes(&args.body_limit)?.clamp(1024, 1 << 30) as usize,
            }),
            None => None,
        };
        let run = common::real_model::RealRun {
            model: model.clone(),
            requests: args.requests.min(4096),
            concurrency: args.concurrency.min(64),
            max_new: args.max_new_tokens.min(256),
            budget,
            fraction,
            preempt: match args.preempt {
                Preempt::Swap => PreemptMode::Swap,
                Preempt::Recompute => PreemptMode::Recompute,
            },
            dtype: match args.kv_dtype {
                Dtype::F32 => KvDtype::F32,
                Dtype::F16 => KvDtype::F16,
            },
            context,
            listen,
        };
        let args = &args;
        return common::real_model::serve(run, |budget| async move {
            let builder = MemoryManager::builder()
                .host_budget(budget)
                .keep_metrics(args.listen.is_some());
            let memory = manager(args, builder).await?;
            let node = match args.node {
                Some(addr) => Some(join_node(args, addr, &memory, false).await?),
                None => None,
            };
            if let Some(addr) = args.metrics_addr {
                println!("metrics on http://{addr}/metrics");
            }
            Ok((memory, node))
        })
        .await;
    }
    let cuda = matches!(args.device, Device::Cuda);
    if cuda && !procmem_actors::procmem::cuda::driver_present() {
        return Err(
            "--device cuda: no CUDA driver on this machine (libcuda cannot be loaded)".into(),
        );
    }
    let max_tokens = args.prompt_len + args.max_new_tokens;
    let model = Model::new(args.model_size, max_tokens, args.kv_dtype);
    let host_page = procmem_actors::procmem::granularity();
    // The KV's mapping granularity: a page on the host, the driver's VMM granule on a GPU.
    let page = if cuda {
        CudaDevice::open(0)
            .and_then(|d| d.granularity())
            .map_err(|e| format!("--device cuda: {e}"))?
    } else {
        host_page
    };
    // The weights stay on the host (the synthetic model's projections run there).
    let weights_bytes =
        model.shape.layers as u64 * (model.layer_floats() as u64 * 4).next_multiple_of(host_page);
    // KV bytes of one sequence holding `tokens` (every buffer grows a page at a time).
    let kv_bytes = |tokens: usize| {
        model.shape.buffers() as u64
            * mapped_bytes_for(tokens, model.shape.token_bytes(), page, u64::MAX)
    };
    let per_seq = kv_bytes(max_tokens);
    let peak_kv = per_seq * args.concurrency as u64;
    // On a GPU the budget is the device's, which holds only KV; on the host it holds both.
    let base = if cuda { 0 } else { weights_bytes };
    let budget = match args.budget.trim() {
        "auto" => base + peak_kv / 2,
        b if b.ends_with('x') => {
            let f: f64 = b[..b.len() - 1]
                .trim()
                .parse()
                .map_err(|_| format!("'{b}' is not a fraction of peak demand (try 0.125x)"))?;
            if !(f.is_finite() && f > 0.0) {
                return Err(format!(
                    "'{b}' is not a fraction of peak demand (try 0.125x)"
                ));
            }
            base.saturating_add((f * peak_kv as f64) as u64)
        }
        b => parse_bytes(b)?,
    };
    if budget > 0 && base + per_seq > budget {
        return Err(format!(
            "the model needs {base} bytes of weights plus {per_seq} for one sequence: more than the budget of {budget} bytes"
        ));
    }
    let builder = if cuda {
        // The host authority pays for the weights and for KV swapped out of the device.
        MemoryManager::builder()
            .host_budget(weights_bytes + peak_kv + per_seq)
            .cuda_device(0, budget)
    } else {
        MemoryManager::builder().host_budget(budget)
    };
    let memory = manager(&args, builder).await?;
    let node = match args.node {
        Some(addr) => Some(join_node(&args, addr, &memory, cuda).await?),
        None => None,
    };
    println!(
        "procmem inference server: {:?} model ({} layers, {} q heads / {} kv heads, head dim {}), {} requests x {} at once",
        args.model_size, model.shape.layers, model.shape.q_heads, model.shape.kv_heads, model.shape.head_dim,
        args.requests, args.concurrency
    );
    println!(
        "budget {} bytes: weights {} + peak KV demand {} ({}% of peak)",
        budget,
        weights_bytes,
        peak_kv,
        (100 * budget / (weights_bytes + peak_kv).max(1))
    );
    if let Some(addr) = args.metrics_addr {
        println!("metrics on http://{addr}/metrics");
    }

    let weights = memory
        .residency(ResidencyConfig {
            name: "weights".into(),
            priority: 10,
            wait: Duration::from_secs(2),
        })
        .await
        .map_err(|e| e.to_string())?;
    // Every layer is used on every step, so the weights are pinned: under pressure the KV
    // store gives back cached prefixes and preempts sequences instead of thrashing weights.
    for layer in 0..model.shape.layers {
        weights
            .load(layer, model.weights(layer, args.seed), true)
            .await
            .map_err(|e| e.to_string())?;
    }
    let kv_device = if cuda {
        DeviceKey::cuda(0)
    } else {
        DeviceKey::HOST
    };
    let kv_tier = if cuda {
        procmem_actors::procmem::MemoryTier::Device
    } else {
        procmem_actors::procmem::MemoryTier::Host
    };
    let gpu = if cuda {
        Some(Gpu::new(&memory, model.shape, args.concurrency)?)
    } else {
        None
    };
    let kv = memory
        .kv_store_on(
            kv_device,
            KvStoreConfig {
                name: "kv".into(),
                priority: 0,
                shape: model.shape,
                chunk_granules: 1,
                preempt: match args.preempt {
                    Preempt::Swap => PreemptMode::Swap,
                    Preempt::Recompute => PreemptMode::Recompute,
                },
                wait: Duration::from_millis(250),
                swap: SwapSpace::Auto,
                map_ahead: true,
            },
        )
        .await
        .map_err(|e| e.to_string())?;

    let shared: Vec<u32> = (0..args.prompt_len as u32)
        .map(|i| (i * 7 + args.seed as u32) % model.vocab)
        .collect();
    let mut queue: VecDeque<Request> = (0..args.requests as u64)
        .map(|id| {
            let mut prompt = shared.clone();
            // Every other request keeps the shared first three quarters; the rest differ.
            let own_from = if id % 2 == 0 {
                args.prompt_len * 3 / 4
            } else {
                0
            };
            for (i, t) in prompt.iter_mut().enumerate().skip(own_from) {
                *t = ((id as u32 + 3) * 31 + i as u32 * 13) % model.vocab;
            }
            Request {
                id,
                prompt,
                generated: Vec::new(),
                pos: 0,
                x: Vec::new(),
                priority: (id % 3) as u32,
                admitted: 0,
            }
        })
        .collect();
    let mut active: Vec<Request> = Vec::new();
    // Requests preempted while their step waited: they leave the batch and are restored,
    // oldest first, once a step went through and there is room beside the batch's growth.
    let mut parked: Vec<Request> = Vec::new();
    // A parked request whose restore runs while the batch steps.
    let mut prefetch: Option<(
        Request,
        tokio::task::JoinHandle<Result<Restored, KvStoreError>>,
    )> = None;
    let mut admissions = 0u64;
    let mut last_stepped = true;
    let growth_per_seq = model.shape.buffers() as u64 * page;
    let mut c = Counters::default();
    let start = Instant::now();
    let mut last_report = Instant::now();
    let mut lonely_denials = 0;
    let mut stalls = 0usize;
    let mut idle_refusals = 0;
    // The authority the KV is charged to: the host's, or the GPU's.
    let host = memory
        .governor(kv_device, kv_tier)
        .expect("the KV's authority")
        .clone();
    let kv_books = usize::from(cuda);
    while !queue.is_empty() || !active.is_empty() || !parked.is_empty() || prefetch.is_some() {
        // Restore parked requests first, oldest first, into room the batch does not need for
        // its next step (restoring into the batch's memory would only evict it again).
        if last_stepped || active.is_empty() {
            let free = host.snapshot().await.map(|s| s.books.free()).unwrap_or(0);
            let mut room = free.saturating_sub(active.len() as u64 * growth_per_seq);
            parked.sort_by_key(|r| r.admitted);
            while let Some(r) = parked.first() {
                // Swap brings its tokens back at once; recompute grows them again by replay.
                let tokens = match args.preempt {
                    Preempt::Swap => r.pos,
                    Preempt::Recompute => r.known(),
                };
                let need = kv_bytes(tokens);
                // With nothing running, the oldest is restored whatever the room: its restore
                // makes room by pressure (cached prefixes nobody maps go first).
                if need > room && !active.is_empty() {
                    break;
                }
                room = room.saturating_sub(need);
                let mut r = parked.remove(0);
                if !active.is_empty() {
                    // Prefetch: the restore (its grant, the copy back) runs in the store while
                    // this step's kernels run on the stream; it joins the batch after the step.
                    let kv = kv.clone();
                    let id = r.id;
                    prefetch = Some((r, tokio::spawn(async move { kv.restore(id).await })));
                    break;
                }
                match kv.restore(r.id).await {
                    Ok(Restored::Swapped { tokens }) => r.pos = tokens,
                    // The KV was dropped: replay the known tokens from the start.
                    Ok(Restored::Recompute { .. }) => r.pos = 0,
                    Err(KvStoreError::Unavailable) => return Err("the KV store stopped".into()),
                    Err(e) => {
                        tracing::debug!(%e, seq = r.id, "no room to restore yet");
                        parked.insert(0, r);
                        break;
                    }
                }
                c.restores += 1;
                active.push(r);
            }
        }
        // Admit while there is room for another whole sequence, or while fewer than half the
        // slots run (then the open itself makes room: cached prefixes nobody uses are evicted).
        // Parked requests go before new ones (as vLLM does with swapped requests): admitting
        // new work while admitted work waits would only take the room it needs.
        while parked.is_empty() && prefetch.is_none() && active.len() < args.concurrency {
            let free = host.snapshot().await.map(|s| s.books.free()).unwrap_or(0);
            if active.len() >= args.concurrency / 2 && free < per_seq {
                break;
            }
            let Some(mut r) = queue.pop_front() else {
                break;
            };
            match kv.open(r.id, r.prompt.clone(), r.priority).await {
                Ok(opened) => {
                    r.pos = opened.cached_tokens;
                    admissions += 1;
                    r.admitted = admissions;
                    active.push(r);
                    idle_refusals = 0;
                }
                Err(KvStoreError::Unavailable) => return Err("the KV store stopped".into()),
                Err(e) => {
                    tracing::warn!(%e, "open refused; retrying later");
                    queue.push_front(r);
                    if active.is_empty() {
                        idle_refusals += 1;
                        if idle_refusals >= 20 {
                            return Err(format!(
                                "no request can be admitted with nothing running: {e}"
                            ));
                        }
                    }
                    break;
                }
            }
        }
        let outcome = step(
            &model,
            &kv,
            gpu.as_ref(),
            &weights,
            &mut active,
            &mut parked,
            &mut c,
            &mut queue,
        )
        .await?;
        last_stepped = matches!(outcome, Stepped::Ok);
        if let Some((mut r, restoring)) = prefetch.take() {
            let restored = match restoring.await.map_err(|e| e.to_string())? {
                Ok(Restored::Swapped { tokens }) => Some(tokens),
                Ok(Restored::Recompute { .. }) => Some(0),
                Err(KvStoreError::Unavailable) => return Err("the KV store stopped".into()),
                Err(e) => {
                    tracing::debug!(%e, seq = r.id, "no room to restore yet");
                    None
                }
            };
            match restored {
                Some(pos) => {
                    r.pos = pos;
                    c.restores += 1;
                    active.push(r);
                }
                None => parked.insert(0, r),
            }
        }
        // Restores can chase each other (restoring one preempts another idle one); if the
        // batch keeps failing to step, shed a request so the rest make progress.
        stalls = if matches!(outcome, Stepped::Ok) {
            0
        } else {
            stalls + 1
        };
        if stalls > 2 * active.len().max(1) && active.len() > 1 {
            let victim = (0..active.len())
                .min_by_key(|&i| (active[i].priority, std::cmp::Reverse(active[i].id)))
                .expect("non-empty batch");
            shed(&kv, &mut active, victim, &mut queue, &mut c);
            stalls = 0;
        }
        match outcome {
            Stepped::Ok => lonely_denials = 0,
            Stepped::Shed if active.is_empty() => {
                lonely_denials += 1;
                if lonely_denials >= 3 {
                    return Err(format!(
                        "the budget of {budget} bytes cannot hold even one sequence beside the weights"
                    ));
                }
            }
            Stepped::Shed | Stepped::Parked => {}
        }
        active.retain(|r| {
            let done = r.generated.len() >= args.max_new_tokens;
            if done {
                kv.close(r.id);
                c.finished += 1;
            }
            !done
        });
        let books = memory.books().await;
        let (_, s, os) = &books[kv_books];
        c.peak_ledger = c.peak_ledger.max(s.books.leased);
        c.peak_os = c.peak_os.max(os.unwrap_or(0));
        // Memory is freed before its refund, never the other way: the OS may trail the
        // ledger while frees are in flight, but never exceed it.
        c.samples += 1;
        match os {
            Some(os) if *os > s.books.leased => c.os_above_ledger += 1,
            Some(os) if *os < s.books.leased => c.ledger_above_os += 1,
            _ => {}
        }
        if let Ok(st) = kv.stats().await {
            c.peak_swapped = c.peak_swapped.max(st.swapped_bytes);
            if last_report.elapsed() >= Duration::from_secs(1) {
                tracing::debug!(?st, active = ?active.iter().map(|r| (r.id, r.pos)).collect::<Vec<_>>(), parked = ?parked.iter().map(|r| (r.id, r.pos)).collect::<Vec<_>>(), queued = queue.len(), "kv store");
            }
        }
        if last_report.elapsed() >= Duration::from_secs(1) {
            last_report = Instant::now();
            if let Some(g) = &gpu {
                // The driver's own count beside the ledger: every process's use of the GPU.
                if let Ok((free, total)) = g.device.mem_info() {
                    print!("[driver used {:>11} B] ", total - free);
                }
            }
            println!(
                "[{:5.1}s] {:7.1} tok/s  active {:2}  finished {:3}/{}  preempted {:3}  committed {:>9} B  os {:>9} B  tickets {}",
                start.elapsed().as_secs_f64(),
                c.generated as f64 / start.elapsed().as_secs_f64(),
                active.len(),
                c.finished,
                args.requests,
                c.shed,
                s.books.leased,
                os.unwrap_or(0),
                s.tickets_sent
            );
        }
    }
    let elapsed = start.elapsed();
    let driver = gpu.as_ref().and_then(|g| g.device.mem_info().ok());
    drop(gpu);
    let kv_stats = kv.stats().await.map_err(|e| e.to_string())?;
    let w_stats = weights.stats().await.map_err(|e| e.to_string())?;
    let books = memory.books().await;
    println!();
    println!("summary");
    println!(
        "  {:<34} {:>14.1}",
        "tokens/s (generated)",
        c.generated as f64 / elapsed.as_secs_f64()
    );
    println!("  {:<34} {:>14}", "tokens generated", c.generated);
    println!("  {:<34} {:>14}", "requests finished", c.finished);
    println!("  {:<34} {:>14}", "requests preempted (shed)", c.shed);
    println!("  {:<34} {:>14}", "requests parked by preemption", c.parked);
    println!(
        "  {:<34} {:>14}",
        "sequences preempted by pressure", kv_stats.preemptions
    );
    println!("  {:<34} {:>14}", "sequences restored", c.restores);
    println!(
        "  {:<34} {:>14}",
        "prompt tokens from shared blocks", kv_stats.prefix_hit_tokens
    );
    println!(
        "  {:<34} {:>14}",
        "swap space",
        match kv_stats.swap {
            SwapKind::Disk => "disk",
            SwapKind::Host => "host tier",
        }
    );
    println!("  {:<34} {:>14}", "peak bytes swapped out", c.peak_swapped);
    println!(
        "  {:<34} {:>14}",
        "swaps that fell back to recompute", kv_stats.swap_fallbacks
    );
    println!("  {:<34} {:>14}", "progress samples", c.samples);
    println!(
        "  {:<34} {:>14}",
        "samples with OS above ledger", c.os_above_ledger
    );
    println!(
        "  {:<34} {:>14}",
        "samples with frees in flight", c.ledger_above_os
    );
    println!(
        "  {:<34} {:>14}",
        "weight offloads / reloads",
        format!("{} / {}", w_stats.offloads, w_stats.reloads)
    );
    for (name, s, os) in &books {
        println!("  authority {name}");
        println!("    {:<32} {:>14}", "capacity bytes", s.books.capacity);
        println!(
            "    {:<32} {:>14}",
            "peak bytes (ledger)",
            c.peak_ledger.max(s.books.leased)
        );
        println!(
            "    {:<32} {:>14}",
            "peak bytes (OS)",
            c.peak_os.max(os.unwrap_or(0))
        );
        println!("    {:<32} {:>14}", "final bytes (ledger)", s.books.leased);
        println!(
            "    {:<32} {:>14}",
            "final bytes (OS)",
            os.map_or("n/a".to_string(), |b| b.to_string())
        );
        println!("    {:<32} {:>14}", "grants", s.grants);
        println!("    {:<32} {:>14}", "denials", s.denials);
        println!("    {:<32} {:>14}", "pressure tickets", s.tickets_sent);
        println!(
            "    {:<32} {:>14}",
            "bytes freed by pressure", s.freed_by_pressure
        );
    }
    if let Some((free, total)) = driver {
        println!(
            "  {:<34} {:>14}",
            "driver used bytes (cuMemGetInfo)",
            total - free
        );
    }
    println!("  {:<34} {:>14.1}", "wall seconds", elapsed.as_secs_f64());
    if args.linger > 0 {
        // The summary above is what the endpoint serves meanwhile (memtop shows it).
        println!("lingering {} s to keep serving metrics", args.linger);
        tokio::time::sleep(Duration::from_secs(args.linger)).await;
    }
    let report = memory.shutdown().await.map_err(|e| e.to_string())?;
    if let Some(node) = node {
        // Everything is freed: the credit goes back to the node.
        node.leave().await;
    }
    println!("  {:<34} {:>14}", "deferred frees", report.deferred_frees);
    println!(
        "  {:<34} {:>14}",
        "books after shutdown",
        if report.is_zero() { "zero" } else { "NOT ZERO" }
    );
    Ok(())
}

/// Preempts request `idx`: its KV is dropped and it starts over later.
fn shed(
    kv: &KvStoreHandle,
    active: &mut Vec<Request>,
    idx: usize,
    queue: &mut VecDeque<Request>,
    c: &mut Counters,
) {
    let mut r = active.remove(idx);
    kv.close(r.id);
    r.generated.clear();
    r.pos = 0;
    queue.push_back(r);
    c.shed += 1;
}

enum Stepped {
    Ok,
    Shed,
    Parked,
}

/// One decode step for every active request: room for the next token (one grant for the
/// whole batch), then every layer: projections under residency, attention in the KV store,
/// output projection. A batch that does not fit sheds its least important request.
#[allow(clippy::too_many_arguments)]
async fn step(
    model: &Model,
    kv: &KvStoreHandle,
    gpu: Option<&Gpu>,
    weights: &ResidencyHandle,
    active: &mut Vec<Request>,
    parked: &mut Vec<Request>,
    c: &mut Counters,
    queue: &mut VecDeque<Request>,
) -> Result<Stepped, String> {
    if active.is_empty() {
        return Ok(Stepped::Ok);
    }
    let group: Vec<usize> = (0..active.len()).collect();
    let ids: Vec<u64> = active.iter().map(|r| r.id).collect();
    let step = match kv.prepare(ids).await {
        Ok(step) => step,
        Err(KvStoreError::Preempted(seq, _)) => {
            // Pressure took it: the rest of the batch steps without it; it is restored later.
            let idx = active.iter().position(|r| r.id == seq).expect("active");
            parked.push(active.remove(idx));
            c.parked += 1;
            return Ok(Stepped::Parked);
        }
        Err(KvStoreError::Governor(
            GovernorError::DeadlineExpired(_) | GovernorError::Ledger(_),
        )) => {
            // The batch does not fit: shed its least important request; it starts over later.
            let victim = (0..active.len())
                .min_by_key(|&i| (active[i].priority, std::cmp::Reverse(active[i].id)))
                .expect("non-empty batch");
            shed(kv, active, victim, queue, c);
            return Ok(Stepped::Shed);
        }
        Err(e) => return Err(e.to_string()),
    };
    let group = &group[..];
    let h = model.hidden;
    let qd = model.q_dim;
    let kvd = model.kv_dim;
    for &i in group {
        let r = &mut active[i];
        r.x = model.embed(r.token_at(r.pos));
    }
    for layer in 0..model.shape.layers {
        let xs: Vec<Vec<f32>> = group.iter().map(|&i| active[i].x.clone()).collect();
        let qkv = weights
            .with_weights(layer, move |w| {
                // Weights are page-aligned f32s: read them in place.
                let w: &[f32] = bytemuck::cast_slice(w);
                let (wq, rest) = w.split_at(qd * h);
                let (wk, rest) = rest.split_at(kvd * h);
                let (wv, _) = rest.split_at(kvd * h);
                xs.iter()
                    .map(|x| (matvec(wq, qd, x), matvec(wk, kvd, x), matvec(wv, kvd, x)))
                    .collect::<Vec<_>>()
            })
            .await
            .map_err(|e| e.to_string())?;
        // The step's sequences are in `active` order: the i-th of the batch is the step's i-th.
        let attended = match gpu {
            // The driver calls wait for the device: off the runtime's async threads.
            Some(gpu) => {
                tokio::task::block_in_place(|| gpu.attend(&step, model.shape, layer, &qkv))?
            }
            None => attend(&step, model.shape, layer, qkv).await?,
        };
        let xs: Vec<Vec<f32>> = group.iter().map(|&i| active[i].x.clone()).collect();
        let next = weights
            .with_weights(layer, move |w| {
                // Weights are page-aligned f32s: read them in place.
                let w: &[f32] = bytemuck::cast_slice(w);
                let wo = &w[qd * h + 2 * kvd * h..];
                xs.iter()
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
            .await
            .map_err(|e| e.to_string())?;
        for (&i, x) in group.iter().zip(next) {
            active[i].x = x;
        }
    }
    // Every layer's K/V of the new tokens is written by the kernels the last fence covers.
    let fence = match step.stream().cuda() {
        Some(stream) => stream.submit(&[], |_| Ok(())).map_err(|e| e.to_string())?,
        None => step.last_fence().ok_or("a step with no kernel")?,
    };
    step.complete(fence).await.map_err(|e| e.to_string())?;
    for &i in group {
        let r = &mut active[i];
        if r.pos + 1 >= r.known() {
            let t = model.next_token(&r.x);
            r.generated.push(t);
            c.generated += 1;
        }
        r.pos += 1;
    }
    Ok(Stepped::Ok)
}

/// The server's own attention kernel for one layer, on the step's stream: each sequence's new
/// K/V row written into the flat buffers, the GQA decode over every row so far, in place (the
/// same kernel serves the real model: `procmem_model::smollm::attend`).
async fn attend(
    step: &KvStep,
    shape: KvShape,
    layer: usize,
    qkv: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)>,
) -> Result<Vec<Vec<f32>>, String> {
    procmem_model::smollm::attend(step, shape, layer, qkv)
        .await
        .map_err(|e| e.to_string())
}

/// The server's GPU side: the decode kernels (kernels/decode.cu, loaded from their PTX) and
/// device staging for a whole batch: each sequence's query, new K/V row and output, and one
/// scratch for partial results (the stream runs one decode at a time).
struct Gpu {
    device: Arc<CudaDevice>,
    kernels: DecodeKernels,
    /// Sequences of a batch at most.
    batch: usize,
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    partials: u64,
}

impl Gpu {
    fn new(memory: &MemoryManager, shape: KvShape, batch: usize) -> Result<Gpu, String> {
        let provider = memory.cuda_provider().ok_or("no CUDA provider")?;
        let device = provider.mechanism().device().clone();
        let kernels = DecodeKernels::load(device.clone()).map_err(|e| e.to_string())?;
        let f32s = |n: usize| {
            device
                .alloc((batch * n) as u64 * 4)
                .map_err(|e| e.to_string())
        };
        let partials = DecodeLaunch {
            q: 0,
            k: 0,
            v: 0,
            dtype: shape.dtype,
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
            partials: device.alloc(partials).map_err(|e| e.to_string())?,
            batch,
            kernels,
            device,
        })
    }

    /// One layer of attention for every sequence of the step, on the step's CUDA stream: each
    /// sequence's new K/V row written into the flat buffers by the copy kernel, then the
    /// split-KV decode over every row so far, read in place through the step's views. The
    /// whole batch is queued, then the stream is waited for once and the outputs copied back.
    fn attend(
        &self,
        step: &KvStep,
        shape: KvShape,
        layer: usize,
        qkv: &[(Vec<f32>, Vec<f32>, Vec<f32>)],
    ) -> Result<Vec<Vec<f32>>, String> {
        // A batch larger than the staging (restores may join it) goes a slice at a time.
        if qkv.len() > self.batch {
            let mut outs = Vec::with_capacity(qkv.len());
            for (n, part) in qkv.chunks(self.batch).enumerate() {
                outs.extend(self.attend_from(step, shape, layer, part, n * self.batch)?);
            }
            return Ok(outs);
        }
        self.attend_from(step, shape, layer, qkv, 0)
    }

    /// [`Gpu::attend`] for the step's sequences `first..first + qkv.len()`.
    fn attend_from(
        &self,
        step: &KvStep,
        shape: KvShape,
        layer: usize,
        qkv: &[(Vec<f32>, Vec<f32>, Vec<f32>)],
        first: usize,
    ) -> Result<Vec<Vec<f32>>, String> {
        let stream = step
            .stream()
            .cuda()
            .ok_or("the step is not on a GPU")?
            .cuda();
        let bytes = |x: &[f32]| x.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
        let err = |e: procmem_actors::procmem::MemoryError| e.to_string();
        let (qn, rn) = (
            (shape.q_heads * shape.head_dim) as u64 * 4,
            shape.token_elems() as u64 * 4,
        );
        // The previous layer's work read the staging buffers: done before they are rewritten.
        stream.synchronize().map_err(err)?;
        for (i, (q, k, v)) in qkv.iter().enumerate() {
            let views = step
                .views(first + i, layer)
                .ok_or("no such sequence in the step")?;
            let pos = step.positions()[first + i];
            let (qi, ki, vi, oi) = (
                self.q + i as u64 * qn,
                self.k + i as u64 * rn,
                self.v + i as u64 * rn,
                self.out + i as u64 * qn,
            );
            // SAFETY: each sequence has its own staging slots (allocated for `batch`), which
            // no queued work reads until the next layer's synchronize; the rows written are
            // this step's own (mapped read-write until its fence), and the views cover
            // `pos + 1` rows; one partials scratch serves every decode, as the stream runs
            // them one after the other.
            unsafe {
                self.device.copy_to_device(qi, &bytes(q)).map_err(err)?;
                self.device.copy_to_device(ki, &bytes(k)).map_err(err)?;
                self.device.copy_to_device(vi, &bytes(v)).map_err(err)?;
                let n = shape.token_elems() as u32;
                let (k_row, v_row) = (
                    views.k.row_addr(pos).ok_or("no row for the new token")?,
                    views.v.row_addr(pos).ok_or("no row for the new token")?,
                );
                self.kernels
                    .write_row(stream, shape.dtype, k_row, ki, n)
                    .map_err(err)?;
                self.kernels
                    .write_row(stream, shape.dtype, v_row, vi, n)
                    .map_err(err)?;
                let launch = DecodeLaunch {
                    q: qi,
                    k: views.k.addr,
                    v: views.v.addr,
                    dtype: shape.dtype,
                    tokens: (pos + 1) as u32,
                    q_heads: shape.q_heads as u32,
                    kv_heads: shape.kv_heads as u32,
                    head_dim: shape.head_dim as u32,
                    partials: self.partials,
                    out: oi,
                };
                self.kernels.decode(stream, &launch).map_err(err)?;
            }
        }
        stream.synchronize().map_err(err)?;
        let mut out = vec![0u8; qkv.len() * qn as usize];
        // SAFETY: the outputs of this batch lie at the start of `out`; the stream is idle.
        unsafe { self.device.copy_to_host(&mut out, self.out).map_err(err)? };
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
            // SAFETY: allocated in `new`, freed once; every step synchronized its stream
            // after its last use of them.
            let _ = unsafe { self.device.free(p) };
        }
    }
}
