//! An inference server in miniature, on the host backend: a small synthetic transformer
//! whose weights live under model residency, many concurrent requests (some sharing a prompt
//! prefix) decoded with the real GQA operator over virtually contiguous KV, all under a
//! memory budget smaller than peak demand, so pressure tickets, evictions and preemptions
//! really happen. Ends with a summary of throughput and the books, ledger against OS.
//! `--model smollm2` runs a real model instead, and `--listen` serves it over HTTP.
//!
//! The server is the library's (`procmem_model::launch`, `procmem_model::http`,
//! `procmem_model::synthetic`); this binary holds its command line (`common/args.rs`) and
//! what the main job prints.
//!
//! `cargo run --release --example inference_server -- --help`

mod common;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use common::args::Args;
use procmem_actors::kv::SwapKind;
use procmem_actors::AuthorityBooks;
use procmem_model::launch::KvSlot;
use procmem_model::synthetic::{Job, JobProgress, JobReport};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            // Warnings, and the lines that say what a start found (`procmem_start`).
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("warn,procmem_start=info")),
        )
        .with_writer(std::io::stderr)
        // Colours only on a terminal: a log file or a pipe gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    // Before anything is loaded: buffers freed after the load, and a step's large ones, go
    // back to the kernel rather than staying in the heap outside the books.
    procmem_actors::procmem::host::heap::return_large_frees();
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

async fn serve(args: Args) -> Result<(), String> {
    args.validate()?;
    let Some(model) = &args.model else {
        return synthetic(&args).await;
    };
    let run = args.real_run(model)?;
    let name = run.model.model.node_name();
    let args = &args;
    common::real_model::serve(run, |budget, kv| async move {
        let builder = procmem_actors::MemoryManager::builder()
            .host_budget(budget)
            .keep_metrics(args.listen.is_some());
        let memory = args.manager(builder).await?;
        let node = args.join(&memory, false, (name, kv)).await?;
        if let Some(addr) = args.metrics_addr {
            println!("metrics on http://{addr}/metrics");
        }
        Ok((memory, node))
    })
    .await
}

/// The synthetic model's main job: sized, run with a line a second, summed up.
async fn synthetic(args: &Args) -> Result<(), String> {
    let config = args.job()?;
    let cuda = config.cuda;
    let job = Job::plan(config).map_err(|e| e.to_string())?;
    let memory = args.manager(job.builder()).await?;
    let slot = KvSlot::default();
    let name = format!("synthetic-{:?}", args.model_size).to_lowercase();
    let node = args.join(&memory, cuda, (name, slot.clone())).await?;
    let s = job.model.shape;
    println!(
        "procmem inference server: {:?} model ({} layers, {} q heads / {} kv heads, head dim {}), {} requests x {} at once",
        args.model_size, s.layers, s.q_heads, s.kv_heads, s.head_dim, args.requests, args.concurrency
    );
    let whole = (job.weights + job.peak_kv).max(1);
    println!(
        "budget {} bytes: weights {} + peak KV demand {} ({}% of peak)",
        job.budget,
        job.weights,
        job.peak_kv,
        100 * job.budget / whole
    );
    if let Some(addr) = args.metrics_addr {
        println!("metrics on http://{addr}/metrics");
    }
    let requests = args.requests;
    let opened = |kv: &procmem_actors::kv::KvStoreHandle| drop(slot.set(kv.clone()));
    let ran = job
        .run(&memory, opened, move |p| progress(p, requests))
        .await;
    let report = ran.map_err(|e| e.to_string())?;
    summary(&report);
    if args.linger > 0 {
        // The summary above is what the endpoint serves meanwhile (memtop shows it).
        println!("lingering {} s to keep serving metrics", args.linger);
        tokio::time::sleep(Duration::from_secs(args.linger)).await;
    }
    let shutdown = memory.shutdown().await.map_err(|e| e.to_string())?;
    if let Some(node) = node {
        // Everything is freed: the credit goes back to the node.
        node.leave().await;
    }
    let row = |k: &str, v: String| println!("  {k:<34} {v:>14}");
    row("deferred frees", shutdown.deferred_frees.to_string());
    let zero = if shutdown.is_zero() {
        "zero"
    } else {
        "NOT ZERO"
    };
    row("books after shutdown", zero.to_string());
    Ok(())
}

/// A line a second while the synthetic model runs: throughput, requests, the KV's books.
fn progress(p: &JobProgress, requests: usize) {
    if let Some(used) = p.driver_used {
        // The driver's own count beside the ledger: every process's use of the GPU.
        print!("[driver used {used:>11} B] ");
    }
    let secs = p.elapsed.as_secs_f64();
    println!(
        "[{secs:5.1}s] {:7.1} tok/s  waiting {:3}  finished {:3}/{requests}  preempted {:3}  committed {:>9} B  os {:>9} B  tickets {}",
        p.stats.generated as f64 / secs,
        p.waiting,
        p.stats.finished,
        p.stats.preemptions,
        p.leased,
        p.os,
        p.tickets
    );
}

/// The job's figures, then every authority's books.
fn summary(r: &JobReport) {
    println!();
    println!("summary");
    let row = |k: &str, v: String| println!("  {k:<34} {v:>14}");
    let (s, kv, c) = (&r.stats, &r.kv, &r.samples);
    let swap = match kv.swap {
        SwapKind::Disk => "disk",
        SwapKind::Host => "host tier",
    };
    let pair = |a: u64, b: u64| format!("{a} / {b}");
    for (k, v) in [
        (
            "tokens/s (generated)",
            format!("{:.1}", s.generated as f64 / r.elapsed.as_secs_f64()),
        ),
        ("tokens generated", s.generated.to_string()),
        ("prompt tokens computed", s.prefilled.to_string()),
        ("steps", s.steps.to_string()),
        ("requests finished", r.finished.to_string()),
        ("requests preempted (shed)", s.shed.to_string()),
        ("requests parked by preemption", s.preemptions.to_string()),
        (
            "sequences preempted by pressure",
            kv.preemptions.to_string(),
        ),
        ("sequences restored", s.restores.to_string()),
        (
            "prompt tokens from shared blocks",
            kv.prefix_hit_tokens.to_string(),
        ),
        (
            "host tier: blocks out / in tokens",
            pair(kv.prefix_host_writes, kv.prefix_host_hit_tokens),
        ),
        ("swap space", swap.to_string()),
        ("peak bytes swapped out", c.peak_swapped.to_string()),
        (
            "swaps that fell back to recompute",
            kv.swap_fallbacks.to_string(),
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
            pair(r.weights.offloads, r.weights.reloads),
        ),
    ] {
        row(k, v);
    }
    for (i, b) in r.books.iter().enumerate() {
        authority(b, (i == r.kv_books).then_some((c.peak_ledger, c.peak_os)));
    }
    if let Some(memory) = r.driver {
        row(
            "driver used bytes (cuMemGetInfo)",
            memory.used().to_string(),
        );
    }
    row("wall seconds", format!("{:.1}", r.elapsed.as_secs_f64()));
}

/// One authority's books; the KV's was sampled after every step (`peaks`), the others only
/// at the end.
fn authority(b: &AuthorityBooks, peaks: Option<(u64, u64)>) {
    let (s, os) = (&b.snapshot, b.os_bytes);
    let (peak_ledger, peak_os) = peaks.unwrap_or((0, 0));
    println!("  authority {}", b.name);
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
