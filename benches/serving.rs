//! serving: a load generator against the OpenAI-compatible server, procmem's main job
//! (`--model smollm2 --listen`, f16 KV) beside llama.cpp's own `llama-server` on the same GGUF,
//! the same prompts and greedy settings. Writes `target/reports/serving.json`.
//!
//! The workload is fixed here: 32 conversations of 4 turns sharing one system prompt of about
//! 300 tokens; each turn adds a user message of 50 to 200 tokens (seeded) to the conversation
//! so far and its previous answer (up to 64 tokens, greedy); a conversation's next turn is
//! sent when its previous answer has arrived. Plus `long`: single prompts of 2,000 tokens
//! (at each concurrency of the run, 8 at most).
//!
//! - Closed loop: `concurrency` conversations in flight at once (rows at 1, 8 and 32).
//! - Open loop: conversations start at Poisson arrivals of `PROCMEM_BENCH_RATE` per second
//!   (rows only where that is set).
//!
//! procmem runs at budgets of `1x` and `0.25x` of the peak KV demand (the weights plus that
//! fraction of `concurrency` sequences of the longest conversation), each row in a fresh
//! process. llama.cpp (`scripts/llama-server.sh` builds it into `target/`) preallocates its KV
//! per slot: it gets the KV bytes procmem's `0.25x` row at the highest concurrency has, as
//! slots of the same context (`--no-kv-unified --cache-ram 0`), and the rows say how many
//! slots that bought; then the same bytes as one KV shared by as many slots as procmem runs
//! requests (`-kvu --cache-ram 0`), and that with its host prompt cache at its default size
//! (`-kvu`). Each row names its options (`llama_kv`, `llama_options`). Each row: requests
//! finished, output tokens/s, time to first token and inter-token latency p50/p99, prompt
//! tokens from cache, preemptions, peak RSS, peak KV bytes, requests held at once.
//!
//! KV in eight bits: a row per concurrency with the KV in q8_0 (K and V) in the very budget, in
//! bytes, of each f16 row under `1x` (`budget` `0.25x_f16_bytes`); `PROCMEM_BENCH_FRACTIONS`
//! (default `1,0.25`) sets the f16 rows' budgets; `kv_q8_0` in the report has
//! the requests each held in memory at once side by side (`resident_at_once`: open less
//! preempted, peak and mean, `resident_q8_0_over_f16`), and how many answers
//! differ from the f16 row's (greedy answers part where the KV's rounding changes a token).
//!
//! The prefix cache's disk tier: three more rows of the multi-turn workload at `0.25x` and
//! concurrency `PROCMEM_BENCH_TIERS` (8; 0 for none): tiers off, on over an empty directory,
//! and on again over the directory that row filled (a restart); `prefix_tiers` in the report
//! has their time to first token side by side.
//!
//! `PROCMEM_BENCH_MIN_HITS` sets the disk tier's admission filter for those rows (2: a block
//! enters once asked for twice). `PROCMEM_BENCH_PREEMPT=recompute` makes procmem's server
//! preempt by dropping a sequence's KV to compute it again, not by swapping it out.
//! `PROCMEM_BENCH_CONVERSATIONS`, `PROCMEM_BENCH_TURNS`, `PROCMEM_BENCH_CONCURRENCY`
//! (comma-separated), `PROCMEM_BENCH_LONG` (prompts of the `long` rows, 0 for none) and
//! `PROCMEM_BENCH_LLAMA=0` change the run. Without the model (fetched on first use) or the
//! llama.cpp build the bench says what it skips.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use procmem_actors::kv::PreemptMode;
use procmem_actors::procmem::kv::KvDtype;
use procmem_model::gguf::Gguf;
use procmem_model::launch::{Budget, ModelConfig, ModelSource, PrefixDiskConfig};
use procmem_model::{fetch_smollm2, TextCodec};
use serde_json::{json, Value};

#[path = "serving/child.rs"]
mod child;
#[path = "serving/client.rs"]
mod client;
#[path = "serving/servers.rs"]
mod servers;
#[path = "serving/workload.rs"]
mod workload;

use client::Answer;
use servers::{Kind, LlamaKv, Server};
use workload::{
    conversations, long_prompts, pct, workload, Answers, Workload, ANSWER_TOKENS, LONG_TOKENS,
};

/// A row's figures from its answers.
/// The requests that finished, with their conversation and turn.
fn ok_of(answers: &Answers) -> impl Iterator<Item = ((usize, usize), &Answer)> + '_ {
    answers
        .iter()
        .filter_map(|(k, a)| a.as_ref().ok().map(|a| (*k, a)))
}

fn figures(answers: &Answers, wall: Duration) -> Value {
    let ok: Vec<&Answer> = answers
        .iter()
        .filter_map(|(_, a)| a.as_ref().ok())
        .collect();
    let errors: Vec<&String> = answers
        .iter()
        .filter_map(|(_, a)| a.as_ref().err())
        .collect();
    let out: u64 = ok.iter().map(|a| a.completion_tokens).sum();
    let mut ttft: Vec<f64> = ok
        .iter()
        .filter_map(|a| a.first)
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    let mut itl: Vec<f64> = ok
        .iter()
        .flat_map(|a| a.gaps.iter().map(|d| d.as_secs_f64() * 1e3))
        .collect();
    // By turn (0 for single prompts): what the prefix cache changes is how much of each
    // turn's prompt, the conversation so far, has to be computed.
    let turns = answers.iter().map(|((_, t), _)| t + 1).max().unwrap_or(0);
    let turn = |t: usize| {
        ok_of(answers)
            .filter(move |((_, u), _)| *u == t)
            .map(|(_, a)| a)
    };
    let ttft_by_turn: Vec<f64> = (0..turns)
        .map(|t| {
            let mut v: Vec<f64> = turn(t)
                .filter_map(|a| a.first)
                .map(|d| d.as_secs_f64() * 1e3)
                .collect();
            pct(&mut v, 0.5)
        })
        .collect();
    let cached_by_turn: Vec<[u64; 2]> = (0..turns)
        .map(|t| {
            turn(t).fold([0, 0], |[c, p], a| {
                [c + a.cached_tokens, p + a.prompt_tokens]
            })
        })
        .collect();
    json!({
        "ttft_p50_ms_by_turn": ttft_by_turn,
        "prompt_tokens_cached_and_all_by_turn": cached_by_turn,
        "requests": answers.len(),
        "requests_finished": ok.len(),
        "requests_failed": errors.len(),
        "first_error": errors.first(),
        "output_tokens": out,
        "wall_s": wall.as_secs_f64(),
        "output_tokens_per_s": out as f64 / wall.as_secs_f64(),
        "ttft_p50_ms": pct(&mut ttft, 0.5),
        "ttft_p99_ms": pct(&mut ttft, 0.99),
        "itl_p50_ms": pct(&mut itl, 0.5),
        "itl_p99_ms": pct(&mut itl, 0.99),
        "prompt_tokens": ok.iter().map(|a| a.prompt_tokens).sum::<u64>(),
        "prompt_tokens_from_cache": ok.iter().map(|a| a.cached_tokens).sum::<u64>(),
    })
}

/// The run as the child process: procmem's main job on SmolLM2, listening, until SIGTERM.
fn child(spec: &str) -> ExitCode {
    let parts: Vec<&str> = spec.split(',').collect();
    let usage = || {
        eprintln!("PROCMEM_SERVING_CHILD={spec}: fraction,concurrency,context[,kv dtype,budget]");
        ExitCode::FAILURE
    };
    let (&[fraction, concurrency, context], kv) = parts.split_at(parts.len().min(3)) else {
        return usage();
    };
    let (Ok(fraction), Ok(concurrency), Ok(context)) = (
        fraction.parse::<f64>(),
        concurrency.parse::<usize>(),
        context.parse::<usize>(),
    ) else {
        return usage();
    };
    let mut config = ModelConfig::new(ModelSource::Smollm2, context, concurrency);
    config.budget = Budget::OfPeak(fraction);
    // A KV type and a budget in bytes: the q8_0 row, in the bytes of an f16 row.
    match kv {
        [] => {}
        [dtype, budget] => match (dtype.parse::<KvDtype>(), budget.parse::<u64>()) {
            (Ok(dtype), Ok(budget)) => {
                (config.k_dtype, config.v_dtype) = (dtype, dtype);
                config.budget = Budget::Bytes(budget);
            }
            _ => return usage(),
        },
        _ => return usage(),
    }
    config.preempt = preempt_mode();
    config.prefix_disk =
        std::env::var_os("PROCMEM_SERVING_PREFIX_DISK").map(|dir| PrefixDiskConfig {
            dir: dir.into(),
            capacity: 1 << 30,
            min_hits: disk_min_hits(),
        });
    child::serve(
        config,
        child::serve_config(64, ANSWER_TOKENS as usize),
        None,
    )
}

/// A number after `key` in the procmem server's budget line.
fn logged(log: &str, key: &str) -> Option<u64> {
    let at = log.find(key)? + key.len();
    log[at..].split_whitespace().next()?.parse().ok()
}

/// A row's server, driven through the workload and stopped.
struct Driven {
    answers: Answers,
    wall: Duration,
    peaks: servers::Peaks,
    rss: u64,
    preemptions: f64,
    /// Prompt tokens the prefix disk tier served.
    disk_hit_tokens: f64,
    /// Blocks the disk tier failed to write or to bring back.
    disk_failures: f64,
    log: String,
}

fn context_for(w: &Workload, workload: &str) -> usize {
    if workload == "long" {
        (LONG_TOKENS + 2 * ANSWER_TOKENS as usize).next_multiple_of(256)
    } else {
        w.context
    }
}

async fn drive(
    server: Server,
    w: &Workload,
    workload: &str,
    concurrency: usize,
    rate: Option<f64>,
) -> Result<Driven, String> {
    let (stop, watcher) = server.watch();
    let start = Instant::now();
    let answers = match workload {
        "long" => long_prompts(server.addr, w, concurrency).await,
        _ => conversations(server.addr, w, concurrency, rate).await,
    };
    let wall = start.elapsed();
    drop(stop);
    let peaks = watcher.await.unwrap_or_default();
    let preemptions = server
        .metric("procmem_kv_preemptions_total")
        .await
        .unwrap_or(0.0);
    let disk_hit_tokens = server
        .metric("procmem_kv_prefix_disk_hit_tokens_total")
        .await
        .unwrap_or(0.0);
    let disk_failures = server
        .metric("procmem_kv_prefix_disk_failures_total")
        .await
        .unwrap_or(0.0);
    let stopped = server.stop().await?;
    let (rss, log) = (stopped.rss, stopped.log);
    Ok(Driven {
        answers,
        wall,
        peaks,
        rss,
        preemptions,
        disk_hit_tokens,
        disk_failures,
        log,
    })
}

/// One procmem row: a fresh server, the workload, its figures. With `q8_0` budget bytes, KV
/// in q8_0 under that budget (`fraction` then only names the f16 row it matches).
async fn procmem_row(
    w: &Workload,
    workload: &str,
    fraction: f64,
    concurrency: usize,
    rate: Option<f64>,
    prefix_disk: Option<&std::path::Path>,
    q8_0: Option<u64>,
) -> Result<(Value, Answers), String> {
    let context = context_for(w, workload);
    // A budget under one sequence of the context serves nothing: at low concurrency a
    // fraction is raised to one sequence (`fraction_used`).
    let used = fraction.max(1.0 / concurrency.max(1) as f64);
    let server = Server::procmem(used, (concurrency, context), prefix_disk, q8_0).await?;
    let d = drive(server, w, workload, concurrency, rate).await?;
    let budget = logged(&d.log, "budget ").unwrap_or(0);
    let weights = logged(&d.log, "weights ").unwrap_or(0);
    let mut row = figures(&d.answers, d.wall);
    merge(
        &mut row,
        json!({
            "server": "procmem",
            "workload": workload,
            "budget": match q8_0 {
                Some(_) => format!("{fraction}x_f16_bytes"),
                None => format!("{fraction}x"),
            },
            "budget_bytes": budget,
            "fraction_used": used,
            "concurrency": concurrency,
            "rate_per_s": rate,
            "context": context,
            "kv_dtype": if q8_0.is_some() { "q8_0" } else { "f16" },
            "preemptions": d.preemptions,
            "prefix_disk": prefix_disk.is_some(),
            "prompt_tokens_from_disk": d.disk_hit_tokens,
            "prefix_disk_failures": d.disk_failures,
            "peak_rss_bytes": d.rss,
            "peak_outside_books_bytes": d.peaks.outside_books,
            "peak_kv_bytes": d.peaks.kv_bytes,
            "kv_budget_bytes": budget.saturating_sub(weights),
            "peak_kv_demand_bytes": logged(&d.log, "peak KV demand "),
            "held_at_once": d.peaks.held,
            "resident_at_once": d.peaks.resident,
            "resident_mean": d.peaks.resident_mean,
            "books_zero_after_shutdown": d.log.contains("books after shutdown: zero"),
            "preempt": format!("{:?}", preempt_mode()).to_lowercase(),
        }),
    );
    Ok((row, d.answers))
}

/// How procmem's server preempts: `PROCMEM_BENCH_PREEMPT=recompute`, else swap.
fn preempt_mode() -> PreemptMode {
    match std::env::var("PROCMEM_BENCH_PREEMPT").as_deref() {
        Ok("recompute") => PreemptMode::Recompute,
        _ => PreemptMode::Swap,
    }
}

/// The disk tier's admission filter in the tier rows: `PROCMEM_BENCH_MIN_HITS`, else 2.
fn disk_min_hits() -> u8 {
    std::env::var("PROCMEM_BENCH_MIN_HITS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
}

/// The multi-turn workload at 0.25x with the prefix cache's disk tier off, on over an empty
/// directory (a cold start), and on again over the directory that row filled (a restart).
async fn tier_rows(w: &Workload, concurrency: usize) -> Result<(Vec<Value>, Value), String> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/tmp/serving-prefix-disk");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut rows: Vec<Value> = Vec::new();
    let mut answers = Vec::new();
    let runs = [
        ("off", None),
        ("on", Some(dir.as_path())),
        ("on_after_restart", Some(dir.as_path())),
    ];
    for (tiers, disk) in runs {
        let (mut row, a) = procmem_row(w, "multi", 0.25, concurrency, None, disk, None).await?;
        row["tiers"] = json!(tiers);
        print_row(&row);
        rows.push(row);
        answers.push(a);
    }
    // Greedy answers do not depend on where a prompt's K/V came from: any that differ
    // from the row without tiers would be K/V brought back wrong.
    let differ = [
        differing(&answers[0], &answers[1]),
        differing(&answers[0], &answers[2]),
    ];
    let f = |i: usize, k: &str| rows[i][k].as_f64().unwrap_or(f64::NAN);
    let summary = json!({
        "concurrency": concurrency,
        "disk_min_hits": disk_min_hits(),
        "ttft_p50_ms": [f(0, "ttft_p50_ms"), f(1, "ttft_p50_ms"), f(2, "ttft_p50_ms")],
        "ttft_p99_ms": [f(0, "ttft_p99_ms"), f(1, "ttft_p99_ms"), f(2, "ttft_p99_ms")],
        "prompt_tokens_from_cache": [f(0, "prompt_tokens_from_cache"), f(1, "prompt_tokens_from_cache"), f(2, "prompt_tokens_from_cache")],
        "prompt_tokens_from_disk": [f(0, "prompt_tokens_from_disk"), f(1, "prompt_tokens_from_disk"), f(2, "prompt_tokens_from_disk")],
        "ttft_p50_off_over_on": f(0, "ttft_p50_ms") / f(1, "ttft_p50_ms"),
        "ttft_p50_cold_over_restart": f(1, "ttft_p50_ms") / f(2, "ttft_p50_ms"),
        "answers_differing_from_off": differ,
    });
    Ok((rows, summary))
}

/// llama.cpp's server as the bench runs it.
struct Llama {
    bin: PathBuf,
    gguf: PathBuf,
    /// f16 K and V of every layer, per token.
    token_bytes: u64,
}

impl Llama {
    /// One row: a fresh server of `slots` slots and `tokens` tokens of KV in all, kept as
    /// `kv` says.
    async fn row(
        &self,
        w: &Workload,
        workload: &str,
        (slots, tokens, kv): (usize, usize, LlamaKv),
        concurrency: usize,
    ) -> Result<(Value, Answers), String> {
        let context = context_for(w, workload);
        let server = Server::llama(&self.bin, &self.gguf, slots, tokens, kv).await?;
        let d = drive(server, w, workload, concurrency, None).await?;
        let kv_line = d
            .log
            .lines()
            .find(|l| l.contains("KV") && l.contains("MiB") && l.contains("size"))
            .map(str::trim);
        let mut row = figures(&d.answers, d.wall);
        merge(
            &mut row,
            json!({
                "server": "llama.cpp",
                "workload": workload,
                "concurrency": concurrency,
                "rate_per_s": null,
                "slots": slots,
                "slot_context": context,
                "kv_tokens": tokens,
                "llama_kv": kv.name(),
                "llama_options": kv.args().join(" "),
                "kv_dtype": "f16",
                "preemptions": 0,
                "peak_rss_bytes": d.rss,
                "peak_kv_bytes": tokens as u64 * self.token_bytes,
                "kv_log_line": kv_line,
                "held_at_once": d.peaks.held,
                "resident_at_once": d.peaks.resident,
                "resident_mean": d.peaks.resident_mean,
            }),
        );
        Ok((row, d.answers))
    }
}

fn merge(row: &mut Value, extra: Value) {
    if let (Some(r), Value::Object(e)) = (row.as_object_mut(), extra) {
        r.extend(e);
    }
}

/// How many answers differ between two rows of the same requests.
fn differing(a: &Answers, b: &Answers) -> usize {
    let text = |x: &Answers| -> Vec<((usize, usize), Option<String>)> {
        x.iter()
            .map(|(k, a)| (*k, a.as_ref().ok().map(|a| a.text.clone())))
            .collect()
    };
    let (a, b) = (text(a), text(b));
    if a.len() != b.len() {
        return a.len().max(b.len());
    }
    a.iter()
        .zip(&b)
        .filter(|(x, y)| x != y || x.1.is_none())
        .count()
}

fn print_row(r: &Value) {
    println!(
        "{:<9} {:<6} {:>9} c={:<3} finished {:>3}/{:<3} {:>7.1} tok/s  ttft p50 {:>8.0} ms p99 {:>8.0} ms  itl p50 {:>6.1} ms p99 {:>7.1} ms  cached {:>6}  preempt {:>4}  rss {:>5} MiB  kv {:>5} MiB  held {:>3} resident {} (mean {:.1})",
        r["server"].as_str().unwrap_or("?"),
        r["workload"].as_str().unwrap_or("?"),
        r["budget"]
            .as_str()
            .or(r["llama_kv"].as_str())
            .unwrap_or("-"),
        r["concurrency"],
        r["requests_finished"],
        r["requests"],
        r["output_tokens_per_s"].as_f64().unwrap_or(f64::NAN),
        r["ttft_p50_ms"].as_f64().unwrap_or(f64::NAN),
        r["ttft_p99_ms"].as_f64().unwrap_or(f64::NAN),
        r["itl_p50_ms"].as_f64().unwrap_or(f64::NAN),
        r["itl_p99_ms"].as_f64().unwrap_or(f64::NAN),
        r["prompt_tokens_from_cache"],
        r["preemptions"],
        r["peak_rss_bytes"].as_u64().unwrap_or(0) >> 20,
        r["peak_kv_bytes"].as_f64().unwrap_or(0.0) as u64 >> 20,
        r["held_at_once"],
        r["resident_at_once"],
        r["resident_mean"].as_f64().unwrap_or(f64::NAN),
    );
    if let Some(tiers) = r["tiers"].as_str() {
        println!(
            "          prefix disk tier {tiers}: prompt tokens from disk {}, failures {}",
            r["prompt_tokens_from_disk"], r["prefix_disk_failures"]
        );
        println!(
            "          by turn: ttft p50 ms {}, prompt tokens cached / all {}",
            r["ttft_p50_ms_by_turn"], r["prompt_tokens_cached_and_all_by_turn"]
        );
    }
}

fn main() -> ExitCode {
    if let Ok(spec) = std::env::var("PROCMEM_SERVING_CHILD") {
        return child(&spec);
    }
    if std::env::args().any(|a| a == "--list") {
        return ExitCode::SUCCESS;
    }
    let rt = tokio::runtime::Runtime::new().expect("a tokio runtime");
    match rt.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("serving: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Each row's answers, by (server, workload, budget or KV mode, concurrency).
type ByKey = std::collections::HashMap<(&'static str, &'static str, String, usize), Answers>;

/// What every row runs: the model, its workload, and the concurrencies asked.
struct Setup {
    gguf: PathBuf,
    /// f16 K and V of every layer, per token.
    token_bytes: u64,
    w: Workload,
    concurrency: Vec<usize>,
    /// Long prompts at most 8 at once: the 2,000-token prefills fill a row's time alone.
    long_concurrency: Vec<usize>,
    /// The highest concurrency.
    top: usize,
}

/// The model, the workload and `PROCMEM_BENCH_CONCURRENCY`; `None` without the model.
fn setup() -> Result<Option<Setup>, String> {
    let Some(gguf) = fetch_smollm2() else {
        return Ok(None);
    };
    let g = Gguf::open(&gguf).map_err(|e| e.to_string())?;
    let codec =
        TextCodec::new(&g.tokenizer().map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    let config = g.config().map_err(|e| e.to_string())?;
    let token_bytes = (config.layers * 2 * config.kv_heads * config.head_dim * 2) as u64;
    let w = workload(&codec);
    let concurrency: Vec<usize> = std::env::var("PROCMEM_BENCH_CONCURRENCY")
        .unwrap_or_else(|_| "1,8,32".into())
        .split(',')
        .filter_map(|c| c.trim().parse().ok())
        .filter(|&c| c > 0)
        .collect();
    let top = concurrency.iter().copied().max().unwrap_or(1);
    let long_concurrency: Vec<usize> = concurrency
        .iter()
        .map(|&c| c.min(8))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    println!(
        "serving: {} conversations x {} turns, system prompt {} tokens, context {} tokens; {} long prompts of {LONG_TOKENS}",
        w.conversations.len(),
        w.conversations.first().map_or(0, Vec::len),
        codec.encode(&w.system).map_or(0, |t| t.len()),
        w.context,
        w.long.len()
    );
    Ok(Some(Setup {
        gguf,
        token_bytes,
        w,
        concurrency,
        long_concurrency,
        top,
    }))
}

/// procmem's rows: the conversations at 1x and 0.25x, at a fixed rate where asked, the long
/// prompts, and the prefix tiers (whose summary is returned).
async fn procmem_rows(
    s: &Setup,
    rows: &mut Vec<Value>,
    by_key: &mut ByKey,
) -> Result<Value, String> {
    let w = &s.w;
    for fraction in fractions() {
        for &c in &s.concurrency {
            let (row, answers) = procmem_row(w, "multi", fraction, c, None, None, None).await?;
            print_row(&row);
            rows.push(row);
            by_key.insert(
                (Kind::Procmem.name(), "multi", fraction.to_string(), c),
                answers,
            );
        }
    }
    let rate: Option<f64> = std::env::var("PROCMEM_BENCH_RATE")
        .ok()
        .and_then(|r| r.parse().ok());
    if let Some(rate) = rate {
        let (row, _) = procmem_row(w, "multi", 1.0, s.top, Some(rate), None, None).await?;
        print_row(&row);
        rows.push(row);
    }
    if !w.long.is_empty() {
        for &c in &s.long_concurrency {
            let (row, answers) = procmem_row(w, "long", 1.0, c, None, None, None).await?;
            print_row(&row);
            rows.push(row);
            by_key.insert((Kind::Procmem.name(), "long", "1".into(), c), answers);
        }
    }
    // The prefix cache's disk tier (off, on, on after a restart) at 0.25x.
    let tiers_at: usize = std::env::var("PROCMEM_BENCH_TIERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    if tiers_at == 0 {
        println!("prefix tiers: PROCMEM_BENCH_TIERS=0: skipped");
        return Ok(json!(null));
    }
    let (tier_rows, summary) = tier_rows(w, tiers_at).await?;
    println!("prefix tiers: {summary}");
    rows.extend(tier_rows);
    Ok(summary)
}

/// The budgets of procmem's f16 rows: `PROCMEM_BENCH_FRACTIONS` (comma-separated), else
/// `1` and `0.25` of the peak KV demand.
fn fractions() -> Vec<f64> {
    std::env::var("PROCMEM_BENCH_FRACTIONS")
        .ok()
        .map(|v| v.split(',').filter_map(|f| f.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1.0, 0.25])
}

/// procmem with its KV in q8_0, in the very budget (bytes) of each f16 row under `1x`, per
/// concurrency: the requests held at once, side by side. Returns the comparison.
async fn q8_0_rows(s: &Setup, rows: &mut Vec<Value>, by_key: &mut ByKey) -> Result<Value, String> {
    let mut compared = Vec::new();
    let under: Vec<f64> = fractions().into_iter().filter(|f| *f < 1.0).collect();
    let runs = s
        .concurrency
        .iter()
        .flat_map(|c| under.iter().map(move |f| (*c, *f)));
    for (c, fraction) in runs {
        let f16 = rows
            .iter()
            .find(|r| {
                r["budget"] == format!("{fraction}x")
                    && r["concurrency"] == c
                    && r["workload"] == "multi"
                    && r["rate_per_s"].is_null()
            })
            .cloned();
        let Some((f16, bytes)) = f16.and_then(|r| r["budget_bytes"].as_u64().map(|b| (r, b)))
        else {
            continue;
        };
        let (row, answers) =
            procmem_row(&s.w, "multi", fraction, c, None, None, Some(bytes)).await?;
        print_row(&row);
        let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        let differ = by_key
            .get(&("procmem", "multi", fraction.to_string(), c))
            .map(|a| differing(a, &answers));
        compared.push(json!({
            "concurrency": c,
            "f16_budget": format!("{fraction}x"),
            "budget_bytes": bytes,
            "resident_at_once": [f(&f16, "resident_at_once"), f(&row, "resident_at_once")],
            "resident_q8_0_over_f16": f(&row, "resident_at_once") / f(&f16, "resident_at_once"),
            "resident_mean": [f(&f16, "resident_mean"), f(&row, "resident_mean")],
            "resident_mean_q8_0_over_f16": f(&row, "resident_mean") / f(&f16, "resident_mean"),
            "finished": [f16["requests_finished"].clone(), row["requests_finished"].clone()],
            "requests": row["requests"].clone(),
            "output_tokens_per_s_q8_0_over_f16": f(&row, "output_tokens_per_s") / f(&f16, "output_tokens_per_s"),
            "ttft_p50_f16_over_q8_0": f(&f16, "ttft_p50_ms") / f(&row, "ttft_p50_ms"),
            "preemptions": [f(&f16, "preemptions"), f(&row, "preemptions")],
            "answers_differing_from_f16": differ,
        }));
        rows.push(row);
        by_key.insert(
            (Kind::Procmem.name(), "multi", format!("{fraction}_q8_0"), c),
            answers,
        );
    }
    println!("kv q8_0 against f16 in the same bytes: {}", json!(compared));
    Ok(json!(compared))
}

/// llama.cpp's rows, given the KV bytes of procmem's 0.25x row at the highest concurrency:
/// a context per slot (the bytes buy `slots` of them), then one KV shared by as many slots
/// as procmem runs requests, without and with its host prompt cache; and the long prompts.
/// Returns what it was given (`null` where skipped) and the slots.
async fn llama_rows(
    s: &Setup,
    rows: &mut Vec<Value>,
    by_key: &mut ByKey,
) -> Result<(Value, usize), String> {
    let (w, top, token_bytes) = (&s.w, s.top, s.token_bytes);
    let quarter_kv = rows
        .iter()
        .find(|r| r["budget"] == "0.25x" && r["concurrency"] == top && r["workload"] == "multi")
        .and_then(|r| r["kv_budget_bytes"].as_u64())
        .unwrap_or(0);
    let slots = ((quarter_kv / token_bytes) as usize / w.context).max(1);
    let llama = Llama {
        bin: PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("target/llama.cpp/build/bin/llama-server"),
        gguf: s.gguf.clone(),
        token_bytes,
    };
    if std::env::var("PROCMEM_BENCH_LLAMA").is_ok_and(|v| v == "0") {
        println!("llama.cpp: PROCMEM_BENCH_LLAMA=0: skipped");
        return Ok((json!(null), slots));
    }
    if !llama.bin.is_file() {
        let bin = llama.bin.display();
        println!("llama.cpp: no {bin} (scripts/llama-server.sh builds it): skipped");
        return Ok((json!(null), slots));
    }
    println!(
        "llama.cpp: {quarter_kv} bytes of KV (procmem's 0.25x row at concurrency {top}) buy {slots} slots of {} tokens",
        w.context
    );
    for &c in &s.concurrency {
        let tokens = slots * w.context;
        for (kv, slots) in [
            (LlamaKv::PerSlot, slots),
            (LlamaKv::Unified, c),
            (LlamaKv::UnifiedCache, c),
        ] {
            let (row, answers) = llama.row(w, "multi", (slots, tokens, kv), c).await?;
            print_row(&row);
            rows.push(row);
            let key = match kv {
                LlamaKv::PerSlot => "-".to_string(),
                other => other.name().to_string(),
            };
            by_key.insert((Kind::Llama.name(), "multi", key, c), answers);
        }
    }
    if !w.long.is_empty() {
        for &c in &s.long_concurrency {
            let shape = (c, c * context_for(w, "long"), LlamaKv::PerSlot);
            let (row, answers) = llama.row(w, "long", shape, c).await?;
            print_row(&row);
            rows.push(row);
            by_key.insert((Kind::Llama.name(), "long", "-".into(), c), answers);
        }
    }
    let given = json!({"slots": slots, "slot_context": w.context, "kv_bytes_given": quarter_kv, "token_bytes": token_bytes});
    Ok((given, slots))
}

/// Per concurrency, how many answers at 0.25x (and llama.cpp's) differ from procmem's at 1x.
fn checks(concurrency: &[usize], by_key: &ByKey) -> Vec<Value> {
    let mut checks = Vec::new();
    for &c in concurrency {
        let (Some(full), Some(quarter)) = (
            by_key.get(&("procmem", "multi", "1".to_string(), c)),
            by_key.get(&("procmem", "multi", "0.25".to_string(), c)),
        ) else {
            continue; // PROCMEM_BENCH_FRACTIONS left one out
        };
        let differ = differing(full, quarter);
        println!(
            "concurrency {c}: answers at 0.25x differing from 1x: {differ} of {}",
            full.len()
        );
        let mut check = json!({"concurrency": c, "procmem_0.25x_answers_differing_from_1x": differ, "requests": full.len()});
        if let Some(l) = by_key.get(&("llama.cpp", "multi", "-".to_string(), c)) {
            check["llama_answers_differing_from_procmem_1x"] = json!(differing(full, l));
        }
        checks.push(check);
    }
    checks
}

/// procmem at 0.25x over llama.cpp (per slot), per concurrency.
fn ratios(rows: &[Value], concurrency: &[usize], slots: usize) -> Value {
    let find = |server: &str, budget: Option<&str>, c: usize| {
        rows.iter().find(|r| {
            r["server"] == server
                && r["workload"] == "multi"
                && r["concurrency"] == c
                && r["rate_per_s"].is_null()
                && budget.is_none_or(|b| r["budget"] == b)
        })
    };
    let mut ratios = json!({});
    for &c in concurrency {
        if let (Some(p), Some(l)) = (
            find("procmem", Some("0.25x"), c),
            find("llama.cpp", None, c),
        ) {
            let f = |k: &str| p[k].as_f64().unwrap_or(f64::NAN);
            let g = |k: &str| l[k].as_f64().unwrap_or(f64::NAN);
            ratios[format!("c{c}")] = json!({
                "ttft_p50_llama_over_procmem_0.25x": g("ttft_p50_ms") / f("ttft_p50_ms"),
                "output_tokens_per_s_procmem_0.25x_over_llama": f("output_tokens_per_s") / g("output_tokens_per_s"),
                "held_at_once_procmem_0.25x_over_llama_slots": f("held_at_once") / slots as f64,
            });
        }
    }
    ratios
}

/// Writes `serving.json`, and every row's answers to see where two runs part
/// (`serving-answers.json`).
fn write_reports(report: &Value, by_key: &ByKey) -> Result<(), String> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/reports");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let path = dir.join("serving.json");
    std::fs::write(&path, serde_json::to_string_pretty(report).unwrap())
        .map_err(|e| e.to_string())?;
    println!("wrote {}", path.display());
    let answers: serde_json::Map<String, Value> = by_key
        .iter()
        .map(|((server, workload, budget, c), a)| {
            let texts: Vec<Value> = a
                .iter()
                .map(|((conv, turn), r)| {
                    json!({"conversation": conv, "turn": turn,
                           "text": r.as_ref().map(|a| a.text.clone()).map_err(Clone::clone)})
                })
                .collect();
            (
                format!("{server}/{workload}/{budget}/{c}"),
                Value::Array(texts),
            )
        })
        .collect();
    let path = dir.join("serving-answers.json");
    std::fs::write(&path, serde_json::to_string(&answers).unwrap()).map_err(|e| e.to_string())?;
    println!("wrote {}", path.display());
    Ok(())
}

async fn run() -> Result<(), String> {
    let Some(s) = setup()? else {
        println!("serving: no SmolLM2 GGUF and it could not be fetched: skipped");
        return Ok(());
    };
    let (mut rows, mut by_key) = (Vec::new(), ByKey::new());
    let tiers = procmem_rows(&s, &mut rows, &mut by_key).await?;
    let kv_q8_0 = q8_0_rows(&s, &mut rows, &mut by_key).await?;
    let (llama, slots) = llama_rows(&s, &mut rows, &mut by_key).await?;
    let checks = checks(&s.concurrency, &by_key);
    let ratios = ratios(&rows, &s.concurrency, slots);
    println!("ratios: {ratios}");
    let w = &s.w;
    let report = json!({
        "bench": "serving",
        "model": s.gguf.file_name().map(|n| n.to_string_lossy().into_owned()),
        "workload": {
            "conversations": w.conversations.len(),
            "turns": w.conversations.first().map_or(0, Vec::len),
            "answer_tokens": ANSWER_TOKENS,
            "context": w.context,
            "long_prompts": w.long.len(),
            "long_prompt_tokens": LONG_TOKENS,
        },
        "llama": llama,
        "rows": rows,
        "checks": checks,
        "ratios": ratios,
        "prefix_tiers": tiers,
        "kv_q8_0": kv_q8_0,
    });
    write_reports(&report, &by_key)
}
