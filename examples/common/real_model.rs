//! The main job's `--model smollm2` (or a GGUF path): the library's launch (loading, budget,
//! KV store, `procmem_model::launch`) and server (`procmem_model::http::serve_model`), with
//! what this job prints: progress, a summary and some completions.

use std::future::Future;
use std::time::{Duration, Instant};

use procmem_actors::node::NodeLink;
use procmem_actors::{AuthorityBooks, MemoryManager};
use procmem_model::launch::{KvSlot, Launch, ModelConfig, PROMPTS};
use procmem_model::{Completion, Request, RunStats, TextCodec};

/// What the run is asked to do beyond the model's configuration.
pub struct RealRun {
    /// The model, its context, budget and KV store.
    pub model: ModelConfig,
    /// Requests (cycling through the built-in prompts).
    pub requests: usize,
    /// Tokens per completion at most.
    pub max_new: usize,
    /// Serve the OpenAI-compatible API so instead of the built-in prompts.
    pub listen: Option<procmem_model::http::ServeConfig>,
    /// When listening: offload the model's layers once no request came or ran for this long.
    pub idle_after: Option<Duration>,
}

/// Serves the built-in chat prompts (or the API, listening) and prints what happened.
/// `manager` builds the memory manager for a host budget and the node link, if any, which
/// leaves the node once the memory is freed.
pub async fn serve<F, Fut>(run: RealRun, manager: F) -> Result<(), String>
where
    F: FnOnce(u64, KvSlot) -> Fut,
    Fut: Future<Output = Result<(MemoryManager, Option<NodeLink>), String>>,
{
    let launch = Launch::load(&run.model).map_err(|e| e.to_string())?;
    let (c, s) = (&launch.loaded.model.config, launch.sizing);
    println!(
        "procmem inference server: {} ({} layers, {} q heads / {} kv heads, head dim {}, vocab {}), {} requests x {} at once",
        launch.path.display(), c.layers, c.q_heads, c.kv_heads, c.head_dim, c.vocab, run.requests, run.model.concurrency
    );
    println!("budget {} bytes: weights {} (quantized layers and head under residency, by the pages they take, and a reserve for a step's activations) + peak KV demand {}", s.budget, s.weights, s.peak_kv);
    // Bound before the node is joined: a server that cannot listen takes no credit.
    let bound = match run.listen.clone() {
        Some(listen) => Some(
            procmem_model::http::Server::bind(listen)
                .await
                .map_err(|e| e.to_string())?,
        ),
        None => None,
    };
    let slot = KvSlot::default();
    let (memory, link) = manager(s.budget, std::sync::Arc::clone(&slot)).await?;
    let served = match bound {
        Some(server) => {
            let started = launch.start(&memory).await.map_err(|e| e.to_string());
            match started {
                Ok(started) => {
                    let _ = slot.set(started.engine.kv.clone());
                    listen_until_stopped(server, started, &memory, run.idle_after).await
                }
                Err(e) => Err(e),
            }
        }
        None => builtin(launch, &memory, &slot, &run).await,
    };
    let report = memory.shutdown().await.map_err(|e| e.to_string())?;
    if let Some(link) = link {
        link.leave().await;
    }
    served?;
    if !report.is_zero() {
        return Err(format!("books after shutdown: {report:?}"));
    }
    println!("books after shutdown: zero");
    Ok(())
}

/// Serves the API until the stop signals.
async fn listen_until_stopped(
    server: procmem_model::http::Server,
    started: procmem_model::launch::Started,
    memory: &MemoryManager,
    idle_after: Option<Duration>,
) -> Result<(), String> {
    let stats = procmem_model::http::serve_bound(server, started, memory, idle_after, |addr| {
        println!(
            "listening on http://{addr} (POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, /metrics)"
        )
    })
    .await
    .map_err(|e| e.to_string())?;
    println!(
        "served {} requests: {} finished, {} cancelled, {} cut by shutdown, {} failed; {} tokens generated, {} prompt tokens computed, {} preemptions",
        stats.accepted, stats.finished, stats.cancelled, stats.cut, stats.failed,
        stats.generated, stats.prefilled, stats.preemptions
    );
    Ok(())
}

/// Completes the built-in prompts with a progress line a second, then prints the summary.
async fn builtin(
    mut launch: Launch,
    memory: &MemoryManager,
    slot: &KvSlot,
    run: &RealRun,
) -> Result<(), String> {
    let prompts = std::mem::take(&mut launch.prompts);
    let procmem_model::launch::Started { engine, codec } =
        launch.start(memory).await.map_err(|e| e.to_string())?;
    let _ = slot.set(engine.kv.clone());
    let requests: Vec<Request> = prompts
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| Request {
            id: i as u64 + 1,
            prompt,
            max_new: run.max_new,
        })
        .collect();
    let start = Instant::now();
    let progress = tokio::spawn(progress(memory.clone(), start));
    let generated = engine
        .generate(requests, run.model.concurrency, false)
        .await
        .map_err(|e| e.to_string());
    progress.abort();
    let (done, stats) = generated?;
    let elapsed = start.elapsed();
    let kv = engine.kv.stats().await.map_err(|e| e.to_string())?;
    let books = memory.books().await;
    drop(engine);
    let disk = run.model.prefix_disk.is_some();
    summary(&done, &stats, (&kv, disk), &books, elapsed);
    completions(&done, &codec)
}

/// A line a second: each authority's books.
async fn progress(memory: MemoryManager, start: Instant) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        for b in memory.books().await {
            let s = &b.snapshot;
            println!(
                "[{:>5.1}s] {}: approved {} of {} bytes, OS {} bytes, tickets {}",
                start.elapsed().as_secs_f64(),
                b.name,
                s.books.approved(),
                s.books.capacity,
                b.os_bytes.map_or("-".into(), |b| b.to_string()),
                s.tickets_sent
            );
        }
    }
}

/// The run's figures and each authority's books.
fn summary(
    done: &[Completion],
    stats: &RunStats,
    (kv, disk): (&procmem_actors::kv::KvStoreStats, bool),
    books: &[AuthorityBooks],
    elapsed: Duration,
) {
    println!();
    println!("summary");
    let row = |k: &str, v: String| println!("  {k:<34} {v:>14}");
    let cached: usize = done.iter().map(|c| c.cached_tokens).sum();
    for (k, v) in [
        (
            "tokens/s (generated)",
            format!("{:.1}", stats.generated as f64 / elapsed.as_secs_f64()),
        ),
        ("requests finished", done.len().to_string()),
        ("tokens generated", stats.generated.to_string()),
        ("decode steps", stats.steps.to_string()),
        (
            "preemptions / restores",
            format!("{} / {}", stats.preemptions, stats.restores),
        ),
        ("requests shed", stats.shed.to_string()),
        ("prompt tokens from shared blocks", cached.to_string()),
        ("prefix-cache hit tokens", kv.prefix_hit_tokens.to_string()),
        ("blocks kept at close", kv.prefix_blocks_kept.to_string()),
        (
            "store preempted: swap / recompute",
            format!("{} / {}", kv.preempted_by_swap, kv.preempted_by_recompute),
        ),
    ] {
        row(k, v);
    }
    if disk {
        row(
            "disk tier: blocks / in tokens / failed",
            format!(
                "{} / {} / {}",
                kv.prefix_disk_blocks, kv.prefix_disk_hit_tokens, kv.prefix_disk_failures
            ),
        );
    }
    for b in books {
        let s = &b.snapshot;
        println!("  authority {}", b.name);
        row("  capacity bytes", s.books.capacity.to_string());
        row("  bytes (ledger)", s.books.approved().to_string());
        row(
            "  bytes (OS)",
            b.os_bytes.map_or("-".into(), |b| b.to_string()),
        );
        row("  grants", s.grants.to_string());
        row("  pressure tickets", s.tickets_sent.to_string());
        row("  bytes freed by pressure", s.freed_by_pressure.to_string());
    }
    row("wall seconds", format!("{:.1}", elapsed.as_secs_f64()));
}

/// The first completions, one per built-in prompt.
fn completions(done: &[Completion], codec: &TextCodec) -> Result<(), String> {
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
