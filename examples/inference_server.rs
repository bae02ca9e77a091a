//! An inference server in miniature, on the host backend: a small synthetic transformer
//! whose weights live under model residency, many concurrent requests (some sharing a prompt
//! prefix) decoded with the real GQA operator over virtually contiguous KV, all under a
//! memory budget smaller than peak demand, so pressure tickets, evictions and preemptions
//! really happen. Ends with a summary of throughput and the books, ledger against OS.
//!
//! `cargo run --release --example inference_server -- --help`

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use common::node::join_node;
use common::parse_bytes;
use common::synthetic::{Gpu, Model, Synthetic};
use procmem_actors::procmem::cuda::CudaDevice;
use procmem_actors::procmem::kv::shape::mapped_bytes_for;
use procmem_actors::procmem::kv::{KvDtype, KvShape};
use procmem_actors::procmem::Place;
use procmem_actors::{
    kv::{KvStoreConfig, PreemptMode, PrefixHost, SwapKind},
    residency::ResidencyConfig,
    AuthorityBooks, MemoryManager,
};
use procmem_model::scheduler::{
    Event, GenError, GenRequest, SchedulerConfig, SchedulerHandle, STEP_TOKENS,
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
    /// Bytes of request bodies read at once over all connections when listening; a body
    /// that finds no room within a second is answered 503.
    #[arg(long, default_value = "32MiB")]
    body_buffer: String,
    /// Seconds a connection has to send a request's whole head, from when it starts waiting
    /// for one, when listening.
    #[arg(long, default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds a request's body has to arrive whole after its head when listening (408).
    #[arg(long, default_value_t = 30.0)]
    body_timeout: f64,
    /// Seconds a connection with no request in flight may stay quiet when listening.
    #[arg(long, default_value_t = 5.0)]
    idle_timeout: f64,
    /// Connections open at once when listening; at the cap the quietest idle one makes way,
    /// or the newcomer gets 503. Default: what RLIMIT_NOFILE leaves after the descriptors
    /// open at start and 128 more for the model, the KV tiers and the node link.
    #[arg(long)]
    max_connections: Option<usize>,
    /// With `--model` and `--listen`: once no request has come or run for this many seconds,
    /// offload the model's layers (to disk on the host) so their memory can go to others
    /// (the node's other servers, the KV); the next request brings them back. Off unless given.
    #[arg(long)]
    idle_after: Option<f64>,
    /// With `--model`: keep prompt blocks evicted under pressure in this directory instead
    /// of dropping them, and find them there after a restart (one server per directory).
    #[arg(long)]
    prefix_disk: Option<PathBuf>,
    /// Bytes the prefix disk tier keeps at most.
    #[arg(long, default_value = "1GiB")]
    prefix_disk_bytes: String,
    /// Times a prompt block must have been asked for before it may go to disk.
    #[arg(long, default_value_t = 2)]
    prefix_disk_min_hits: u8,
    /// With `--device cuda`: keep prompt blocks evicted from the device in this much
    /// page-locked host memory (charged to the host budget) instead of dropping them.
    #[arg(long)]
    prefix_host_bytes: Option<String>,
}

/// Requests one run may serve.
const MAX_REQUESTS: usize = 1_000_000;
/// Requests decoded at once.
const MAX_CONCURRENCY: usize = 65_536;
/// Tokens of a prompt, and tokens generated per request.
const MAX_TOKENS: usize = 1 << 20;

/// The synthetic model of `size`, holding `max_tokens` per sequence.
fn synthetic_model(size: ModelSize, max_tokens: usize, dtype: Dtype) -> Model {
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
        vocab: 512,
    }
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

/// How this server joins the node at `addr`.
fn node_join(args: &Args, addr: SocketAddr) -> common::node::NodeJoin {
    common::node::NodeJoin {
        addr,
        cookie: args.node_cookie.clone(),
        priority: args.node_priority,
        name: "inference_server".into(),
    }
}

/// Seconds from a flag: a positive number, at most a day.
fn seconds(flag: &str, s: f64) -> Result<std::time::Duration, String> {
    if !(s.is_finite() && s > 0.0 && s <= 86_400.0) {
        return Err(format!("--{flag} {s}: seconds above 0, at most 86400"));
    }
    Ok(std::time::Duration::from_secs_f64(s))
}

/// How `--listen` serves, from the flags.
fn serve_config(
    args: &Args,
    addr: SocketAddr,
    model: &str,
    context: usize,
) -> Result<procmem_model::http::ServeConfig, String> {
    let body_limit = parse_bytes(&args.body_limit)?.clamp(1024, 1 << 30) as usize;
    let limits = procmem_model::http::Limits {
        header_timeout: seconds("header-timeout", args.header_timeout)?,
        idle_timeout: seconds("idle-timeout", args.idle_timeout)?,
        body_timeout: seconds("body-timeout", args.body_timeout)?,
        max_connections: match args.max_connections {
            Some(0) => return Err("--max-connections must be at least 1".into()),
            Some(n) => n,
            None => procmem_model::http::connection_cap(),
        },
        body_limit,
        body_buffer: (parse_bytes(&args.body_buffer)?.min(1 << 32) as usize).max(body_limit),
    };
    Ok(procmem_model::http::ServeConfig {
        addr,
        model_name: common::real_model::served_name(model),
        max_waiting: args.max_waiting,
        max_running: args.concurrency.min(256),
        default_max_tokens: args.max_new_tokens.min(context),
        grace: std::time::Duration::from_secs(args.shutdown_grace.min(3600)),
        limits,
    })
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
            Some(addr) => Some(serve_config(&args, addr, model, context)?),
            None => None,
        };
        if args.idle_after.is_some() && listen.is_none() {
            return Err("--idle-after: only a server (--listen) sleeps when idle".into());
        }
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
            prefix_disk: match &args.prefix_disk {
                Some(dir) => Some(common::real_model::PrefixDiskArgs {
                    dir: dir.clone(),
                    capacity: parse_bytes(&args.prefix_disk_bytes)?,
                    min_hits: args.prefix_disk_min_hits,
                }),
                None => None,
            },
            idle_after: args
                .idle_after
                .map(|s| seconds("idle-after", s))
                .transpose()?,
        };
        let args = &args;
        let name = common::real_model::model_name(model);
        return common::real_model::serve(run, |budget, kv| async move {
            let builder = MemoryManager::builder()
                .host_budget(budget)
                .keep_metrics(args.listen.is_some());
            let memory = manager(args, builder).await?;
            let node = match args.node {
                Some(addr) => {
                    Some(join_node(&memory, &node_join(args, addr), false, (name, kv)).await?)
                }
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
    let prefix_host = match &args.prefix_host_bytes {
        Some(_) if !cuda => return Err("--prefix-host-bytes is for --device cuda".into()),
        Some(b) => Some(parse_bytes(b)?),
        None => None,
    };
    if cuda && !procmem_actors::procmem::cuda::driver_present() {
        return Err(
            "--device cuda: no CUDA driver on this machine (libcuda cannot be loaded)".into(),
        );
    }
    let max_tokens = args.prompt_len + args.max_new_tokens;
    let model = synthetic_model(args.model_size, max_tokens, args.kv_dtype);
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
            .host_budget(weights_bytes + peak_kv + per_seq + prefix_host.unwrap_or(0))
            .cuda_device(0, budget)
    } else {
        MemoryManager::builder().host_budget(budget)
    };
    let memory = manager(&args, builder).await?;
    let kv_slot = common::real_model::KvSlot::default();
    let node = match args.node {
        Some(addr) => {
            let model = (
                format!("synthetic-{:?}", args.model_size).to_lowercase(),
                kv_slot.clone(),
            );
            Some(join_node(&memory, &node_join(&args, addr), cuda, model).await?)
        }
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
        .residency(ResidencyConfig::new("weights").wait(Duration::from_secs(2)))
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
    let kv_device = if cuda { Place::cuda(0) } else { Place::HOST };
    let config = KvStoreConfig::new("kv", model.shape)
        .preempt(match args.preempt {
            Preempt::Swap => PreemptMode::Swap,
            Preempt::Recompute => PreemptMode::Recompute,
        })
        .wait(Duration::from_millis(250))
        .map_ahead(true);
    let config = match prefix_host {
        Some(bytes) => config.prefix_host(PrefixHost::new(bytes)),
        None => config,
    };
    let kv = memory
        .kv_store_on(kv_device, config)
        .await
        .map_err(|e| e.to_string())?;
    let _ = kv_slot.set(kv.clone());

    let shared: Vec<u32> = (0..args.prompt_len as u32)
        .map(|i| (i * 7 + args.seed as u32) % model.vocab)
        .collect();
    let prompts: Vec<Vec<u32>> = (0..args.requests as u32)
        .map(|id| {
            let mut prompt = shared.clone();
            // Every other request keeps the shared first three quarters; the rest differ.
            let own_from = if id % 2 == 0 {
                args.prompt_len * 3 / 4
            } else {
                0
            };
            for (i, t) in prompt.iter_mut().enumerate().skip(own_from) {
                *t = ((id + 3) * 31 + i as u32 * 13) % model.vocab;
            }
            prompt
        })
        .collect();
    let kv_books = usize::from(cuda);
    let gpu = match cuda {
        // A step's rows: a token budget of prompt chunks, or one per running sequence.
        true => Some(Gpu::new(
            &memory,
            model.shape,
            STEP_TOKENS.max(args.concurrency),
        )?),
        false => None,
    };
    let synthetic = Arc::new(Synthetic {
        model,
        kv: kv.clone(),
        weights: weights.clone(),
        gpu,
        memory: memory.clone(),
        kv_books,
        samples: Default::default(),
    });
    let config = SchedulerConfig::new(max_tokens)
        .max_running(args.concurrency)
        .max_waiting(args.requests);
    let (scheduler, task) = SchedulerHandle::spawn(Arc::clone(&synthetic), config);
    let start = Instant::now();
    let mut streams = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let request = GenRequest {
            prompt,
            max_tokens: args.max_new_tokens,
            ..GenRequest::default()
        };
        let mut generation = scheduler.submit(request).map_err(|e| e.to_string())?;
        streams.push(tokio::spawn(async move {
            while let Some(event) = generation.next().await {
                match event {
                    Event::Token { .. } => {}
                    Event::Finished { figures, .. } => return Ok(figures),
                    Event::Failed(GenError::NoRoom(e)) => {
                        return Err(format!(
                            "the budget of {budget} bytes cannot hold even one sequence beside the weights: {e}"
                        ))
                    }
                    Event::Failed(e) => return Err(e.to_string()),
                }
            }
            Err("a request's stream ended without an answer".to_string())
        }));
    }
    let progress = tokio::spawn(progress(
        memory.clone(),
        scheduler.clone(),
        Arc::clone(&synthetic),
        args.requests,
    ));
    let mut finished = 0u64;
    let mut failure = None;
    for stream in streams {
        match stream.await.map_err(|e| e.to_string())? {
            Ok(_) => finished += 1,
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    progress.abort();
    scheduler.shutdown(Duration::ZERO);
    let stats = task.await.map_err(|e| e.to_string())?;
    let elapsed = start.elapsed();
    if let Some(e) = failure {
        return Err(e);
    }
    let driver = synthetic
        .gpu
        .as_ref()
        .and_then(|g| g.device.mem_info().ok());
    let c = synthetic
        .samples
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    drop(synthetic);
    let kv_stats = kv.stats().await.map_err(|e| e.to_string())?;
    let w_stats = weights.stats().await.map_err(|e| e.to_string())?;
    let books = settled_books(&memory).await;
    println!();
    println!("summary");
    let row = |k: &str, v: String| println!("  {k:<34} {v:>14}");
    let swap = match kv_stats.swap {
        SwapKind::Disk => "disk",
        SwapKind::Host => "host tier",
    };
    let tokens_per_s = stats.generated as f64 / elapsed.as_secs_f64();
    for (k, v) in [
        ("tokens/s (generated)", format!("{tokens_per_s:.1}")),
        ("tokens generated", stats.generated.to_string()),
        ("prompt tokens computed", stats.prefilled.to_string()),
        ("steps", stats.steps.to_string()),
        ("requests finished", finished.to_string()),
        ("requests preempted (shed)", stats.shed.to_string()),
        (
            "requests parked by preemption",
            stats.preemptions.to_string(),
        ),
        (
            "sequences preempted by pressure",
            kv_stats.preemptions.to_string(),
        ),
        ("sequences restored", stats.restores.to_string()),
        (
            "prompt tokens from shared blocks",
            kv_stats.prefix_hit_tokens.to_string(),
        ),
        (
            "host tier: blocks out / in tokens",
            format!(
                "{} / {}",
                kv_stats.prefix_host_writes, kv_stats.prefix_host_hit_tokens
            ),
        ),
        ("swap space", swap.to_string()),
        ("peak bytes swapped out", c.peak_swapped.to_string()),
        (
            "swaps that fell back to recompute",
            kv_stats.swap_fallbacks.to_string(),
        ),
        ("progress samples", c.taken.to_string()),
        (
            "samples with OS above ledger",
            c.os_above_ledger.to_string(),
        ),
        (
            "samples with frees in flight",
            c.ledger_above_os.to_string(),
        ),
        (
            "weight offloads / reloads",
            format!("{} / {}", w_stats.offloads, w_stats.reloads),
        ),
    ] {
        row(k, v);
    }
    for (
        i,
        AuthorityBooks {
            name,
            snapshot: s,
            os_bytes: os,
            ..
        },
    ) in books.iter().enumerate()
    {
        // The KV's authority was sampled after every step; the others only now.
        let (peak_ledger, peak_os) = match i == kv_books {
            true => (c.peak_ledger, c.peak_os),
            false => (0, 0),
        };
        println!("  authority {name}");
        let row = |k: &str, v: String| println!("    {k:<32} {v:>14}");
        row("capacity bytes", s.books.capacity.to_string());
        row(
            "peak bytes (ledger)",
            peak_ledger.max(s.books.leased).to_string(),
        );
        row("peak bytes (OS)", peak_os.max(os.unwrap_or(0)).to_string());
        row("final bytes (ledger)", s.books.leased.to_string());
        row(
            "final bytes (OS)",
            os.map_or("n/a".to_string(), |b| b.to_string()),
        );
        row("grants", s.grants.to_string());
        row("denials", s.denials.to_string());
        row("pressure tickets", s.tickets_sent.to_string());
        row("bytes freed by pressure", s.freed_by_pressure.to_string());
    }
    if let Some((free, total)) = driver {
        row(
            "driver used bytes (cuMemGetInfo)",
            (total - free).to_string(),
        );
    }
    row("wall seconds", format!("{:.1}", elapsed.as_secs_f64()));
    if args.linger > 0 {
        // The summary above is what the endpoint serves meanwhile (memtop shows it).
        println!("lingering {} s to keep serving metrics", args.linger);
        tokio::time::sleep(Duration::from_secs(args.linger)).await;
    }
    drop((kv, weights));
    let report = memory.shutdown().await.map_err(|e| e.to_string())?;
    if let Some(node) = node {
        // Everything is freed: the credit goes back to the node.
        node.leave().await;
    }
    row("deferred frees", report.deferred_frees.to_string());
    row(
        "books after shutdown",
        if report.is_zero() { "zero" } else { "NOT ZERO" }.to_string(),
    );
    Ok(())
}

/// The books once the frees of the last sequences closed have landed: memory a device is done
/// with is unmapped first and refunded after (a message to the Governor), so for a moment the
/// ledger is above what the OS holds. Waits up to 2 s for the two to agree.
async fn settled_books(memory: &MemoryManager) -> Vec<AuthorityBooks> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let books = memory.books().await;
        let agree = books
            .iter()
            .all(|b| b.os_bytes.is_none_or(|os| os == b.snapshot.books.leased));
        if agree || Instant::now() > deadline {
            return books;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A line a second while the synthetic model runs: throughput, requests, the KV's books.
async fn progress(
    memory: MemoryManager,
    scheduler: SchedulerHandle,
    synthetic: Arc<Synthetic>,
    requests: usize,
) {
    let start = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let stats = scheduler.stats();
        let books = memory.books().await;
        let Some(AuthorityBooks {
            snapshot: s,
            os_bytes: os,
            ..
        }) = books.get(synthetic.kv_books)
        else {
            continue;
        };
        if let Some(g) = &synthetic.gpu {
            // The driver's own count beside the ledger: every process's use of the GPU.
            if let Ok((free, total)) = g.device.mem_info() {
                print!("[driver used {:>11} B] ", total - free);
            }
        }
        println!(
            "[{:5.1}s] {:7.1} tok/s  waiting {:3}  finished {:3}/{}  preempted {:3}  committed {:>9} B  os {:>9} B  tickets {}",
            start.elapsed().as_secs_f64(),
            stats.generated as f64 / start.elapsed().as_secs_f64(),
            scheduler.waiting(),
            stats.finished,
            requests,
            stats.preemptions,
            s.books.leased,
            os.unwrap_or(0),
            s.tickets_sent
        );
    }
}
