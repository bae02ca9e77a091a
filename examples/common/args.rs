//! The main job's command line, and what it makes of it: the validation of its figures,
//! the library's configurations (the real model's, the synthetic job's, the server's) from
//! its flags, and the node it joins.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use procmem_actors::kv::PreemptMode;
use procmem_actors::procmem::kv::KvDtype;
use procmem_actors::MemoryManager;
use procmem_model::launch::{
    self, join_node, Budget, Builtin, KvSlot, ModelConfig, ModelSource, NodeJoin, PrefixDiskConfig,
    Share,
};
use procmem_model::synthetic::{JobConfig, Size};

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Device {
    Host,
    Cuda,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Preempt {
    /// A preempted sequence's KV is copied out and copied back on restore.
    Swap,
    /// A preempted sequence's KV is dropped and recomputed by replaying its tokens.
    Recompute,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Dtype {
    /// 32-bit floats.
    F32,
    /// 16-bit floats, as servers usually keep KV.
    F16,
    /// Eight bits a value in blocks of 32 with an f16 scale (llama.cpp's q8_0): 0.53x the
    /// bytes of f16. The head dimension must be a multiple of 32.
    #[value(name = "q8_0")]
    Q8_0,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ModelSize {
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
pub struct Args {
    /// Requests to serve.
    #[arg(long, default_value_t = 48)]
    pub requests: usize,
    /// Requests decoded at once.
    #[arg(long, default_value_t = 12)]
    pub concurrency: usize,
    /// Memory budget of the host authority: bytes (or with KiB/MiB/GiB), or the weights plus
    /// a fraction of the peak KV demand (`0.125x`); `auto` is `0.5x`.
    #[arg(long, default_value = "auto")]
    pub budget: String,
    /// What happens to a sequence preempted under pressure.
    #[arg(long, value_enum, default_value_t = Preempt::Swap)]
    pub preempt: Preempt,
    /// Model size.
    #[arg(long, value_enum, default_value_t = ModelSize::Small)]
    pub model_size: ModelSize,
    /// Element type of the KV cache (K and V both, unless one of the next two says).
    #[arg(long, value_enum, default_value_t = Dtype::F32)]
    pub kv_dtype: Dtype,
    /// Element type of K alone (llama.cpp's -ctk).
    #[arg(long, value_enum)]
    pub kv_dtype_k: Option<Dtype>,
    /// Element type of V alone (llama.cpp's -ctv).
    #[arg(long, value_enum)]
    pub kv_dtype_v: Option<Dtype>,
    /// Prompt length in tokens (half the requests share its first three quarters).
    #[arg(long, default_value_t = 64)]
    pub prompt_len: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 48)]
    pub max_new_tokens: usize,
    /// Seed of the synthetic weights and prompts.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Serve Prometheus metrics here (e.g. 127.0.0.1:9464); off unless given.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Keep serving metrics this many seconds after the workload.
    #[arg(long, default_value_t = 0)]
    pub linger: u64,
    /// Execution device.
    #[arg(long, value_enum, default_value_t = Device::Host)]
    pub device: Device,
    /// Serve a real model instead of the synthetic one: `smollm2` (fetched by
    /// `scripts/fetch-model.sh`) or a llama-architecture GGUF path. Its requests cycle through
    /// built-in chat prompts, half sharing one system prompt; `--max-new-tokens` bounds each
    /// completion, `--budget` as for the synthetic model (fractions are of peak KV on top of
    /// the weights).
    #[arg(long)]
    pub model: Option<String>,
    /// Join the node Governor at this address (several servers, one budget; see
    /// `examples/node_governor.rs`): the budget of the KV device's authority is then credit
    /// from the node, asked for as it is needed, instead of `--budget`.
    #[arg(long)]
    pub node: Option<SocketAddr>,
    /// The node's cookie.
    #[arg(long, default_value = "procmem")]
    pub node_cookie: String,
    /// The host budget follows the machine: its cgroup's limits and memory pressure (PSI).
    #[arg(long)]
    pub follow_machine: bool,
    /// This server's priority on the node: less important servers give back first.
    #[arg(long, default_value_t = 0)]
    pub node_priority: u32,
    /// This server's weight on the node: the servers without `--node-guarantee` are
    /// guaranteed the rest of the node's capacity in proportion to their weights.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub node_weight: u32,
    /// The share of the node's capacity guaranteed to this server (e.g. `200MiB`), instead of
    /// one by weight: while it holds less, it gets room back within one ticket round from
    /// servers over theirs.
    #[arg(long, value_parser = parse_bytes)]
    pub node_guarantee: Option<u64>,
    /// With `--model`: serve the OpenAI-compatible API here (e.g. 127.0.0.1:8080) until
    /// Ctrl-C or SIGTERM, instead of the built-in prompts. `--concurrency` bounds the
    /// requests running at once, `--max-new-tokens` is the default `max_tokens`.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Tokens each sequence holds at most with `--model` (prompt and completion); 512
    /// for the built-in prompts, 2048 when listening, unless given.
    #[arg(long)]
    pub context: Option<usize>,
    /// Requests waiting to start at most when listening; more are answered 429.
    #[arg(long, default_value_t = 64)]
    pub max_waiting: usize,
    /// Seconds requests in flight have to finish after Ctrl-C or SIGTERM when listening.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace: u64,
    /// Request bodies over this many bytes are answered 413 when listening.
    #[arg(long, default_value = "1MiB")]
    pub body_limit: String,
    /// Bytes of request bodies read at once over all connections when listening; a body
    /// that finds no room within a second is answered 503.
    #[arg(long, default_value = "32MiB")]
    pub body_buffer: String,
    /// Seconds a connection has to send a request's whole head, from when it starts waiting
    /// for one, when listening.
    #[arg(long, default_value_t = 10.0)]
    pub header_timeout: f64,
    /// Seconds a request's body has to arrive whole after its head when listening (408).
    #[arg(long, default_value_t = 30.0)]
    pub body_timeout: f64,
    /// Seconds a connection with no request in flight may stay quiet when listening.
    #[arg(long, default_value_t = 5.0)]
    pub idle_timeout: f64,
    /// Seconds a response may wait for a client that takes none of its bytes (it stopped
    /// reading) before its connection is closed, when listening.
    #[arg(long, default_value_t = 30.0)]
    pub write_timeout: f64,
    /// Bytes of unsent response the kernel holds for one connection when listening
    /// (SO_SNDBUF): what a client that stops reading pins beside its 64 unread events.
    #[arg(long, default_value = "64KiB")]
    pub send_buffer: String,
    /// Connections open at once when listening; at the cap the quietest idle one makes way,
    /// or the newcomer gets 503. Default: what RLIMIT_NOFILE leaves after the descriptors
    /// open at start and 128 more for the model, the KV tiers and the node link.
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// With `--model` and `--listen`: once no request has come or run for this many seconds,
    /// offload the model's layers (to disk on the host) so their memory can go to others
    /// (the node's other servers, the KV); the next request brings them back. Off unless given.
    #[arg(long)]
    pub idle_after: Option<f64>,
    /// With `--model`: keep prompt blocks evicted under pressure in this directory instead
    /// of dropping them, and find them there after a restart (one server per directory).
    #[arg(long)]
    pub prefix_disk: Option<PathBuf>,
    /// Bytes the prefix disk tier keeps at most.
    #[arg(long, default_value = "1GiB")]
    pub prefix_disk_bytes: String,
    /// Times a prompt block must have been asked for before it may go to disk.
    #[arg(long, default_value_t = 2)]
    pub prefix_disk_min_hits: u8,
    /// With `--device cuda`: keep prompt blocks evicted from the device in this much
    /// page-locked host memory (charged to the host budget) instead of dropping them.
    #[arg(long)]
    pub prefix_host_bytes: Option<String>,
}

/// Requests one run may serve.
const MAX_REQUESTS: usize = 1_000_000;
/// Requests decoded at once.
const MAX_CONCURRENCY: usize = 65_536;
/// Tokens of a prompt, and tokens generated per request.
const MAX_TOKENS: usize = 1 << 20;

impl Args {
    /// The types K and V are kept in: `--kv-dtype`, where `--kv-dtype-k`/`-v` do not say.
    pub fn kv_dtypes(&self) -> (KvDtype, KvDtype) {
        let or_both = |d: Option<Dtype>| kv_dtype(d.unwrap_or(self.kv_dtype));
        (or_both(self.kv_dtype_k), or_both(self.kv_dtype_v))
    }

    /// Refuses figures that are zero, or so large that a size derived from them could
    /// overflow or an allocation made up front be immodest: a usage error, never a panic.
    pub fn validate(&self) -> Result<(), String> {
        if self.requests == 0
            || self.concurrency == 0
            || self.max_new_tokens == 0
            || self.prompt_len == 0
        {
            return Err(
                "--requests, --concurrency, --prompt-len and --max-new-tokens must be at least 1"
                    .into(),
            );
        }
        for (flag, value, max) in [
            ("--requests", self.requests, MAX_REQUESTS),
            ("--concurrency", self.concurrency, MAX_CONCURRENCY),
            ("--prompt-len", self.prompt_len, MAX_TOKENS),
            ("--max-new-tokens", self.max_new_tokens, MAX_TOKENS),
        ] {
            if value > max {
                return Err(format!("{flag} {value} is too large (at most {max})"));
            }
        }
        if self.model.is_some() && matches!(self.device, Device::Cuda) {
            return Err(
                "--model runs on the host backend only (its kernels are candle's CPU ones)".into(),
            );
        }
        Ok(())
    }

    /// The real model's configuration and the run's (`--model`).
    pub fn real_run(&self, model: &str) -> Result<super::real_model::RealRun, String> {
        let listening = self.listen.is_some();
        // A server's requests may each fill the context: all of them fit at `auto`.
        let budget = Budget::parse(&self.budget, if listening { 1.0 } else { 0.5 })
            .map_err(|e| e.to_string())?;
        let context = self.context.unwrap_or(if listening { 2048 } else { 512 });
        if !(16..=8192).contains(&context) {
            return Err(format!("--context {context}: between 16 and 8192"));
        }
        let source = ModelSource::parse(model);
        let listen = match self.listen {
            Some(addr) => Some(serve_config(self, addr, &source, context)?),
            None => None,
        };
        if self.idle_after.is_some() && listen.is_none() {
            return Err("--idle-after: only a server (--listen) sleeps when idle".into());
        }
        let (requests, max_new) = (self.requests.min(4096), self.max_new_tokens.min(256));
        let concurrency = self.concurrency.min(64).min(requests);
        let mut config = ModelConfig::new(source, context, concurrency);
        config.budget = budget;
        (config.k_dtype, config.v_dtype) = self.kv_dtypes();
        config.preempt = preempt_mode(self.preempt);
        config.builtin = listen.is_none().then_some(Builtin { requests, max_new });
        config.prefix_disk = match &self.prefix_disk {
            Some(dir) => Some(PrefixDiskConfig {
                dir: dir.clone(),
                capacity: parse_bytes(&self.prefix_disk_bytes)?,
                min_hits: self.prefix_disk_min_hits,
            }),
            None => None,
        };
        let idle_after = self
            .idle_after
            .map(|s| seconds("idle-after", s))
            .transpose()?;
        Ok(super::real_model::RealRun {
            model: config,
            requests,
            max_new,
            listen,
            idle_after,
        })
    }

    /// The synthetic model's job (no `--model`).
    pub fn job(&self) -> Result<JobConfig, String> {
        let prefix_host = self
            .prefix_host_bytes
            .as_deref()
            .map(parse_bytes)
            .transpose()?;
        Ok(JobConfig {
            size: match self.model_size {
                ModelSize::Small => Size::Small,
                ModelSize::Medium => Size::Medium,
                ModelSize::Large => Size::Large,
            },
            k_dtype: self.kv_dtypes().0,
            v_dtype: self.kv_dtypes().1,
            requests: self.requests,
            concurrency: self.concurrency,
            prompt_len: self.prompt_len,
            max_new: self.max_new_tokens,
            seed: self.seed,
            preempt: preempt_mode(self.preempt),
            cuda: matches!(self.device, Device::Cuda),
            prefix_host,
            budget: Budget::parse(&self.budget, 0.5).map_err(|e| e.to_string())?,
        })
    }

    /// Builds the memory manager both models run on: `builder`'s budgets, with the metrics
    /// endpoint and machine following the flags ask for.
    pub async fn manager(
        &self,
        mut builder: procmem_actors::MemoryManagerBuilder,
    ) -> Result<MemoryManager, String> {
        if let Some(addr) = self.metrics_addr {
            builder = builder.metrics_addr(addr);
        }
        builder = builder.follow_machine(self.follow_machine);
        builder.build().await.map_err(|e| e.to_string())
    }

    /// Joins the node (`--node`), where asked: the KV device's authority takes its capacity
    /// from there; the link reports `model` and the blocks of the store in `kv`.
    pub async fn join(
        &self,
        memory: &MemoryManager,
        cuda: bool,
        model: (String, KvSlot),
    ) -> Result<Option<procmem_actors::node::NodeLink>, String> {
        let Some(addr) = self.node else {
            return Ok(None);
        };
        let node = node_join(self, addr);
        let link = join_node(memory, &node, cuda, model)
            .await
            .map_err(|e| e.to_string())?;
        println!(
            "joined the node Governor at {} ({}, priority {})",
            node.addr,
            if cuda { "cuda:0" } else { "host" },
            node.priority
        );
        Ok(Some(link))
    }
}

/// How this server joins the node at `addr`.
fn node_join(args: &Args, addr: SocketAddr) -> NodeJoin {
    NodeJoin {
        addr,
        cookie: args.node_cookie.clone(),
        priority: args.node_priority,
        share: Share {
            weight: args.node_weight,
            guarantee: args.node_guarantee,
        },
        name: "inference_server".into(),
    }
}

/// A byte count from a flag.
fn parse_bytes(s: &str) -> Result<u64, String> {
    launch::parse_bytes(s).map_err(|e| e.to_string())
}

pub fn kv_dtype(d: Dtype) -> KvDtype {
    match d {
        Dtype::F32 => KvDtype::F32,
        Dtype::F16 => KvDtype::F16,
        Dtype::Q8_0 => KvDtype::Q8_0,
    }
}

pub fn preempt_mode(p: Preempt) -> PreemptMode {
    match p {
        Preempt::Swap => PreemptMode::Swap,
        Preempt::Recompute => PreemptMode::Recompute,
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
pub fn serve_config(
    args: &Args,
    addr: SocketAddr,
    model: &ModelSource,
    context: usize,
) -> Result<procmem_model::http::ServeConfig, String> {
    let body_limit = parse_bytes(&args.body_limit)?.clamp(1024, 1 << 30) as usize;
    let limits = procmem_model::http::Limits {
        header_timeout: seconds("header-timeout", args.header_timeout)?,
        idle_timeout: seconds("idle-timeout", args.idle_timeout)?,
        body_timeout: seconds("body-timeout", args.body_timeout)?,
        write_timeout: seconds("write-timeout", args.write_timeout)?,
        send_buffer: parse_bytes(&args.send_buffer)?.clamp(4096, 1 << 30) as usize,
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
        model_name: model.served_name(),
        max_waiting: args.max_waiting,
        max_running: args.concurrency.min(256),
        default_max_tokens: args.max_new_tokens.min(context),
        grace: std::time::Duration::from_secs(args.shutdown_grace.min(3600)),
        limits,
    })
}
