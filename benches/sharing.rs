//! sharing: three model servers, one memory. Three of procmem's servers (`--model smollm2
//! --listen`, f16 KV, 8 requests at once, 1,024 tokens of context each), each with its own
//! multi-turn workload, under one total memory M: the three servers' weights plus a part of
//! the KV the three would need at peak (each at its burst: `BURST` conversations at their
//! longest, every answer at its longest). M is swept: 1/6, 1/3 and 1/2 of that KV
//! (`PROCMEM_SHARING_KV_PARTS=6,3,2`), with `static` and `node` at each, `unbounded` once, and
//! the other rows at 1/3. Writes `target/reports/sharing.json` (the goals per M under
//! `goals.kv_1of<part>`), each row's JSON and an SVG of each server's memory over the row
//! with the phases marked (`sharing-<row>-kv1of<part>.{json,svg}`).
//!
//! The load comes in bursts that move: in each of three phases one server gets `BURST` (6)
//! conversations and the other two one each, all started at once; a phase ends when its
//! conversations have. Each server has its own system prompt of about 500 tokens, sent once
//! before the row (as a running server has seen it); each conversation three turns of 30 to
//! 60 tokens (seeded), answers greedy, up to 64 tokens.
//!
//! Rows, each with fresh processes:
//! - `static`: each server its own budget of M/3 (`--budget`);
//! - `node`: one node Governor of capacity M (run in this process, as
//!   `examples/node_governor.rs` runs it), the servers `--node`, all of priority 0;
//! - `node_priority`: the same, the first server of priority 5 (more important);
//! - `node_shrink`: `node`, the node and the servers in a memory cgroup of their own (made
//!   under the bench's, the bench moved into it) whose soft limit falls 12 s into the load to
//!   60% of M plus what the group then holds outside the books, and whose hard limit follows
//!   10 s later to just above it; the node's capacity follows the group (as
//!   `node_governor --follow-machine`). Reports the group's usage and working set against
//!   the limits, how soon the working set came under the soft limit, and OOM kills;
//! - `llama_shrink`: three llama.cpp servers (`scripts/llama-server.sh`), each the KV bytes of
//!   a static server's budget as slots of the context (`--no-kv-unified --cache-ram 0`), in
//!   the same shrink (M less what they hold outside their weights and KV);
//! - `unbounded`: each server the KV of all its 8 sequences at the full context, so nothing
//!   waits for memory: the compute floor under every row on this machine.
//!
//! Where no memory cgroup can be made, the shrinking rows say they skipped and why.
//!
//! Each row, per server and overall: requests finished and failed, time to first token p50
//! and p99 (and p99 of each server's own burst), output tokens/s, preemptions; from samples
//! every 100 ms: the most the servers' ledgers approved at once and the most the node lent at
//! once against M, the credit moved between servers (each server's rises in node credit
//! after all three started), the credit of the server in its burst at its phase's start and
//! at most during it, and the time until it first held 16 MiB more; pressure tickets (the
//! node's, and per request); peak RSS; books zero at each server's shutdown.
//!
//! `PROCMEM_SHARING_ROWS` (comma-separated: static, node, node_priority, node_shrink,
//! llama_shrink, unbounded) picks rows; the
//! static row runs first, as it sizes M, unless left out with M given as
//! `PROCMEM_SHARING_M` (bytes). `RUST_LOG` logs the node (this process) and the servers to
//! stderr; each server's output lands in `target/reports/sharing-<row>-server<i>.log`. The
//! model is fetched on first use.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use procmem_actors::machine::HostPressure;
use procmem_actors::node::{NodeConfig, NodeHandle, Share};
use procmem_actors::procmem::host::machine::PressurePolicy;
use procmem_model::gguf::Gguf;
use procmem_model::launch::{Budget, ModelConfig, ModelSource, NodeJoin};
use procmem_model::{fetch_smollm2, TextCodec};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

#[path = "serving/child.rs"]
mod child;
#[path = "serving/client.rs"]
mod client;
#[path = "sharing/plot.rs"]
mod plot;
#[path = "serving/servers.rs"]
mod servers;
#[path = "sharing/shrink.rs"]
mod shrink;
#[path = "sharing/watch.rs"]
mod watch;
#[path = "serving/workload.rs"]
mod workload;

use client::Answer;
use servers::{LlamaKv, Server};
use workload::{conversation, pct, text_of, ANSWER_TOKENS};

const SERVERS: usize = 3;
const CONCURRENCY: usize = 8;
const CONTEXT: usize = 1024;
const COOKIE: &str = "procmem-sharing";
/// Conversations per phase for the server in its burst; the others get one each.
const BURST: usize = 6;
const TURNS: usize = 3;
const SYSTEM_TOKENS: usize = 500;
/// The more important server's priority in the `node_priority` row.
const IMPORTANT: u32 = 5;
/// The tightnesses swept: M is the weights plus `1/part` of the KV the three servers need at
/// their peaks (`PROCMEM_SHARING_KV_PARTS`, comma-separated, overrides). The rows other than
/// `static`, `node` and `unbounded` run at [`DEFAULT_PART`] only.
const PARTS: [u32; 3] = [6, 3, 2];
const DEFAULT_PART: u32 = 3;

/// Each server's system prompt, and for each phase each server's conversations.
struct Plan {
    systems: Vec<String>,
    /// Tokens of the longest conversation's last turn, every answer at its longest.
    longest: usize,
    /// `phases[p][s]`: server `s`'s conversations in phase `p`, each its user turns.
    phases: Vec<Vec<Vec<Vec<String>>>>,
}

impl Plan {
    /// A server's share of M's KV, as the fraction of its 8 sequences of the context the
    /// child's budget takes: `1/part` of the KV the three need at peak, each at its burst
    /// (`BURST` conversations at their longest).
    fn fraction(&self, part: u32) -> f64 {
        let peak = (BURST * self.longest) as f64;
        peak / f64::from(part) / (CONCURRENCY * CONTEXT) as f64
    }
}

fn plan(codec: &TextCodec) -> Plan {
    let mut rng = StdRng::seed_from_u64(46);
    let systems: Vec<String> = (0..SERVERS)
        .map(|s| {
            let head = format!(
                "You are assistant number {s} of a library. Answer briefly. Reference notes:"
            );
            text_of(codec, &mut rng, &head, SYSTEM_TOKENS)
        })
        .collect();
    let phases = (0..SERVERS)
        .map(|p| {
            (0..SERVERS)
                .map(|s| {
                    let n = if s == p { BURST } else { 1 };
                    (0..n)
                        .map(|c| {
                            (0..TURNS)
                                .map(|t| {
                                    let head =
                                        format!("Phase {p}, chat {c}, turn {t}: tell me about");
                                    let len = rng.random_range(30..=60);
                                    text_of(codec, &mut rng, &head, len)
                                })
                                .collect()
                        })
                        .collect()
                })
                .collect()
        })
        .collect::<Vec<Vec<Vec<Vec<String>>>>>();
    let longest = phases
        .iter()
        .flatten()
        .enumerate()
        .flat_map(|(i, convs)| convs.iter().map(move |c| (i % SERVERS, c)))
        .map(|(s, turns)| {
            let mut msgs = vec![("system", systems[s].as_str())];
            msgs.extend(turns.iter().map(|u| ("user", u.as_str())));
            codec.chat_messages(&msgs).map_or(0, |t| t.len())
                + turns.len() * (ANSWER_TOKENS as usize + 8)
        })
        .max()
        .unwrap_or(CONTEXT);
    Plan {
        systems,
        longest,
        phases,
    }
}

/// How a row's servers get their memory.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Static,
    Node,
    NodePriority,
    /// `node`, all of it in one memory cgroup that shrinks during the load, the node's
    /// capacity following it.
    NodeShrink,
    /// Three llama.cpp servers, each slots of M/3 less the weights, in the same shrink.
    LlamaShrink,
    /// Each server the KV of all 8 sequences at the full context: nothing ever waits for
    /// memory, so its times are what the machine's compute allows (the floor of every row).
    Unbounded,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Static => "static",
            Mode::Node => "node",
            Mode::NodePriority => "node_priority",
            Mode::NodeShrink => "node_shrink",
            Mode::LlamaShrink => "llama_shrink",
            Mode::Unbounded => "unbounded",
        }
    }

    fn node(self) -> bool {
        matches!(self, Mode::Node | Mode::NodePriority | Mode::NodeShrink)
    }

    fn shrinks(self) -> bool {
        matches!(self, Mode::NodeShrink | Mode::LlamaShrink)
    }

    fn priority(self, server: usize) -> u32 {
        match (self, server) {
            (Mode::NodePriority, 0) => IMPORTANT,
            _ => 0,
        }
    }
}

/// The run as a child process: one server, `<fraction>,static` or
/// `<fraction>,node,<port>,<priority>,<name>`, listening until SIGTERM. Its budget (with
/// `static`) is the weights and `fraction` of 8 sequences of the context.
fn child(spec: &str) -> ExitCode {
    let parts: Vec<&str> = spec.split(',').collect();
    let fraction = parts.first().and_then(|f| f.parse::<f64>().ok());
    let join = match parts[1..] {
        ["node", port, priority, name] => match (port.parse::<u16>(), priority.parse()) {
            (Ok(port), Ok(priority)) => Some(Some(NodeJoin {
                addr: ([127, 0, 0, 1], port).into(),
                cookie: COOKIE.into(),
                priority,
                share: Share::default(),
                name: name.into(),
            })),
            _ => None,
        },
        ["static"] => Some(None),
        _ => None,
    };
    let (Some(fraction), Some(join)) = (fraction, join) else {
        eprintln!(
            "PROCMEM_SHARING_CHILD={spec}: <fraction>,static or <fraction>,node,<port>,<priority>,<name>"
        );
        return ExitCode::FAILURE;
    };
    let mut config = ModelConfig::new(ModelSource::Smollm2, CONTEXT, CONCURRENCY);
    config.budget = Budget::OfPeak(fraction);
    let serve = child::serve_config(CONCURRENCY, ANSWER_TOKENS as usize);
    child::serve(config, serve, join)
}

/// One request's outcome: its phase and server.
struct Done {
    phase: usize,
    server: usize,
    answer: Result<Answer, String>,
}

/// Requests finished and failed, time to first token p50/p99, output tokens/s over `wall`.
fn figures<'a>(done: impl Iterator<Item = &'a Done>, wall: Duration) -> Value {
    let (mut ok, mut failed, mut out, mut ttft) = (0, 0, 0u64, Vec::new());
    let (mut prompt, mut computed) = (0u64, 0u64);
    let mut first_error = None;
    for d in done {
        match &d.answer {
            Ok(a) => {
                ok += 1;
                out += a.completion_tokens;
                prompt += a.prompt_tokens;
                computed += a.prompt_tokens.saturating_sub(a.cached_tokens);
                ttft.extend(a.first.map(|f| f.as_secs_f64() * 1e3));
            }
            Err(e) => {
                failed += 1;
                first_error.get_or_insert_with(|| e.clone());
            }
        }
    }
    json!({
        "requests_finished": ok,
        "requests_failed": failed,
        "first_error": first_error,
        "output_tokens": out,
        "prompt_tokens": prompt,
        "prompt_tokens_computed": computed,
        "output_tokens_per_s": out as f64 / wall.as_secs_f64(),
        "ttft_p50_ms": pct(&mut ttft, 0.5),
        "ttft_p99_ms": pct(&mut ttft, 0.99),
    })
}

/// Every phase's conversations on the three servers, phase after phase; with the time each
/// phase started, from the row's start.
async fn drive(addrs: &[std::net::SocketAddr], plan: &Plan) -> (Vec<Done>, Vec<Duration>) {
    let (start, mut starts, mut all) = (Instant::now(), Vec::new(), Vec::new());
    for (p, phase) in plan.phases.iter().enumerate() {
        starts.push(start.elapsed());
        let mut tasks = Vec::new();
        for (s, convs) in phase.iter().enumerate() {
            for turns in convs {
                let (addr, system, turns) = (addrs[s], plan.systems[s].clone(), turns.clone());
                tasks.push(tokio::spawn(async move {
                    (s, conversation(addr, &system, &turns).await)
                }));
            }
        }
        for t in tasks {
            let Ok((server, answers)) = t.await else {
                continue;
            };
            all.extend(answers.into_iter().map(|answer| Done {
                phase: p,
                server,
                answer,
            }));
        }
    }
    (all, starts)
}

/// A number after `key` in a server's log.
fn logged(log: &str, key: &str) -> Option<u64> {
    let at = log.find(key)? + key.len();
    log[at..].split_whitespace().next()?.parse().ok()
}

/// The three servers of a row, started one after the other (each loads the model).
async fn start_servers(mode: Mode, port: u16, fraction: f64) -> Result<Vec<Server>, String> {
    let mut servers = Vec::new();
    for s in 0..SERVERS {
        let server = match mode {
            Mode::Static => {
                Server::this_bench(&[("PROCMEM_SHARING_CHILD", format!("{fraction},static"))])
                    .await?
            }
            Mode::Unbounded => {
                Server::this_bench(&[("PROCMEM_SHARING_CHILD", "1.0,static".into())]).await?
            }
            Mode::LlamaShrink => {
                // The KV bytes of a static server's budget (a fraction of 8 sequences of the
                // context), as slots of the context each (at least one).
                let tokens = (fraction * (CONCURRENCY * CONTEXT) as f64) as usize;
                let slots = (tokens / CONTEXT).max(1);
                let gguf = fetch_smollm2().ok_or("no SmolLM2 GGUF")?;
                Server::llama(&llama_bin(), &gguf, slots, tokens, LlamaKv::PerSlot).await?
            }
            _ => {
                // Its memory is the node's credit from its join on; the fraction only sizes
                // the budget it would have alone, which must hold one whole sequence.
                let spec = format!("1.0,node,{port},{},server{s}", mode.priority(s));
                Server::this_bench(&[("PROCMEM_SHARING_CHILD", spec)]).await?
            }
        };
        servers.push(server);
    }
    Ok(servers)
}

/// llama.cpp's server, where `scripts/llama-server.sh` builds it.
fn llama_bin() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target/llama.cpp/build/bin/llama-server")
}

/// One row: fresh servers (and node), the plan, the figures.
/// Each server has seen its system prompt once, as a running server has: a row measures
/// bursts, not a cold start.
async fn warm(addrs: &[std::net::SocketAddr], plan: &Plan) -> Result<(), String> {
    for (addr, system) in addrs.iter().zip(&plan.systems) {
        let msgs = [
            client::Msg {
                role: "system",
                content: system.clone(),
            },
            client::Msg {
                role: "user",
                content: "Hello.".into(),
            },
        ];
        client::chat(*addr, &msgs, 1).await?;
    }
    Ok(())
}

/// The node Governor of a node row, on `port` with `capacity`.
async fn node_of(mode: Mode, port: u16, capacity: u64) -> Result<Option<NodeHandle>, String> {
    if !mode.node() {
        return Ok(None);
    }
    let mut config = NodeConfig::new(COOKIE, port, "host", capacity);
    config.rejoin_grace = Duration::ZERO;
    Ok(Some(
        NodeHandle::start(config).await.map_err(|e| e.to_string())?,
    ))
}

/// Stops each server and counts its figures over the requests it answered; returns them
/// and the largest budget a server logged.
async fn stop_servers(
    mode: Mode,
    servers: Vec<servers::Server>,
    done: &[Done],
    wall: Duration,
) -> Result<(Vec<Value>, u64), String> {
    let mut per_server = Vec::new();
    let mut budget = 0;
    for (s, server) in servers.into_iter().enumerate() {
        let preemptions = server
            .metric("procmem_kv_preemptions_total")
            .await
            .unwrap_or(0.0);
        // A server the OOM killer took (a shrinking row) is counted, not a failed bench.
        let (stopped, exit) = match server.stop().await {
            Ok(stopped) => (stopped, None),
            Err(e) if mode.shrinks() => (
                servers::Stopped {
                    log: e.clone(),
                    rss: 0,
                },
                Some(e),
            ),
            Err(e) => return Err(e),
        };
        let logs = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/reports");
        let _ = std::fs::create_dir_all(&logs);
        let _ = std::fs::write(
            logs.join(format!("sharing-{}-server{s}.log", mode.name())),
            &stopped.log,
        );
        budget = budget.max(logged(&stopped.log, "budget ").unwrap_or(0));
        let mut f = figures(done.iter().filter(|d| d.server == s), wall);
        let burst = figures(done.iter().filter(|d| d.server == s && d.phase == s), wall);
        f["ttft_p99_ms_in_own_burst"] = burst["ttft_p99_ms"].clone();
        f["ttft_p50_ms_in_own_burst"] = burst["ttft_p50_ms"].clone();
        f["preemptions"] = json!(preemptions);
        f["peak_rss_bytes"] = json!(stopped.rss);
        f["priority"] = json!(mode.priority(s));
        f["books_zero_after_shutdown"] = json!(stopped.log.contains("books after shutdown: zero"));
        f["exit_error"] = json!(exit.map(|e| e.lines().next().unwrap_or("").to_string()));
        per_server.push(f);
    }
    Ok((per_server, budget))
}

/// What a row counts beside its requests: M, the node's tickets, the wall time.
#[derive(Clone, Copy)]
struct Sums {
    capacity: u64,
    tickets: u64,
    wall: Duration,
}

/// A row's figures over every request, with each server's.
fn row_figures(
    mode: Mode,
    done: &[Done],
    starts: &[Duration],
    sums: Sums,
    shrunk: Option<Value>,
    per_server: Vec<Value>,
) -> Value {
    let Sums {
        capacity,
        tickets,
        wall,
    } = sums;
    let mut all = figures(done.iter(), wall);
    let requests = done.len().max(1) as f64;
    merge(
        &mut all,
        json!({
            "row": mode.name(),
            "capacity_m_bytes": capacity,
            "shrink": shrunk,
            "wall_s": wall.as_secs_f64(),
            "ttft_p99_ms_in_burst": figures(done.iter().filter(|d| d.server == d.phase), wall)["ttft_p99_ms"],
            "preemptions": per_server.iter().map(|f| f["preemptions"].as_f64().unwrap_or(0.0)).sum::<f64>(),
            "node_tickets": tickets,
            "node_tickets_per_request": tickets as f64 / requests,
            "books_zero_after_shutdown": per_server.iter().all(|f| f["books_zero_after_shutdown"] == true),
            "phase_starts_s": starts.iter().map(Duration::as_secs_f64).collect::<Vec<_>>(),
            "servers": per_server,
        }),
    );
    all
}

async fn row(mode: Mode, plan: &Plan, capacity: u64, part: u32) -> Result<(Value, u64), String> {
    let fraction = plan.fraction(part);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    // A shrinking row runs in its own memory cgroup, made before anything of the row starts.
    let group = match mode.shrinks() {
        true => Some(shrink::Group::make(mode.name())?),
        false => None,
    };
    let node = node_of(mode, port, capacity).await?;
    // The node's capacity follows the group (as `node_governor --follow-machine` does).
    let _follow = match (&group, &node) {
        (Some(g), Some(n)) => Some(HostPressure::spawn_for_node(
            n.clone(),
            "host",
            PressurePolicy::new(capacity),
            g.source(),
            Duration::from_millis(250),
        )),
        _ => None,
    };
    let servers = start_servers(mode, port, fraction).await?;
    let addrs: Vec<_> = servers.iter().map(|s| s.addr).collect();
    warm(&addrs, plan).await?;
    let watcher = watch::Watcher::start(&servers, node.clone());
    let start = Instant::now();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let load = async {
        let driven = drive(&addrs, plan).await;
        let _ = tx.send(());
        driven
    };
    let ((done, starts), shrunk) = match &group {
        Some(g) => {
            let governed = match &node {
                Some(n) => shrink::Governed::Node(n.clone()),
                None => shrink::Governed::Fixed(capacity),
            };
            let (d, s) = tokio::join!(load, shrink::shrink(g, governed, capacity, rx));
            (d, Some(s))
        }
        None => (load.await, None),
    };
    let wall = start.elapsed();
    let seen = watcher.stop().await;
    let (per_server, budget) = stop_servers(mode, servers, &done, wall).await?;
    let tickets = match &node {
        Some(n) => {
            let t = n.status().await.map_or(0, |s| s.tickets);
            n.stop();
            t
        }
        None => 0,
    };
    let sums = Sums {
        capacity: match mode {
            Mode::Static | Mode::Unbounded => 3 * budget,
            _ => capacity,
        },
        tickets,
        wall,
    };
    let mut all = row_figures(mode, &done, &starts, sums, shrunk, per_server);
    merge(&mut all, seen.json(&starts));
    all["kv_part"] = json!(format!("1/{part}"));
    keep(mode, part, &all, &seen, &starts);
    Ok((all, budget))
}

/// Writes a row on its own (so a later row that fails loses nothing), and beside it its
/// servers' memory over time, its phases and M/3 marked.
fn keep(mode: Mode, part: u32, all: &Value, seen: &watch::Seen, starts: &[Duration]) {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/reports");
    let stem = format!("sharing-{}-kv1of{part}", mode.name());
    let _ = std::fs::write(
        dir.join(format!("{stem}.json")),
        serde_json::to_string_pretty(all).unwrap_or_default(),
    );
    let path = dir.join(format!("{stem}.svg"));
    let (points, unit) = seen.lines();
    let m = all["capacity_m_bytes"].as_f64().unwrap_or(0.0);
    let title = format!(
        "{}: M = {:.0} MB (weights + 1/{part} of peak KV)",
        mode.name(),
        m / 1e6
    );
    let phases: Vec<f64> = starts.iter().map(Duration::as_secs_f64).collect();
    let drawn = plot::draw(
        &path,
        &plot::Lines {
            title: &title,
            unit,
            points: &points,
            phases: &phases,
            mark: Some((m / 3.0 / f64::from(1 << 20), "M / 3: each server's share")),
        },
    );
    if let Err(e) = drawn {
        println!("{}: no picture: {e}", mode.name());
    }
}

fn merge(row: &mut Value, extra: Value) {
    if let (Value::Object(a), Value::Object(b)) = (row, extra) {
        a.extend(b);
    }
}

fn print_row(r: &Value) {
    println!(
        "{:<14} finished {:>3} failed {:>2}  ttft p50 {:>7.0} ms p99 {:>7.0} ms (in burst p99 {:>7.0} ms)  {:>5.1} tok/s  preemptions {:>4}  moved {:>11} B  lent at most {:>11} of {} B  tickets {} ({:.1}/request)  longest wait for credit {:.1} s",
        r["row"].as_str().unwrap_or(""),
        r["requests_finished"],
        r["requests_failed"],
        r["ttft_p50_ms"].as_f64().unwrap_or(f64::NAN),
        r["ttft_p99_ms"].as_f64().unwrap_or(f64::NAN),
        r["ttft_p99_ms_in_burst"].as_f64().unwrap_or(f64::NAN),
        r["output_tokens_per_s"].as_f64().unwrap_or(f64::NAN),
        r["preemptions"],
        r["credit_moved_bytes"],
        r["most_lent_at_once_bytes"],
        r["capacity_m_bytes"],
        r["node_tickets"],
        r["node_tickets_per_request"].as_f64().unwrap_or(0.0),
        r["longest_wait_for_credit_s"].as_f64().unwrap_or(0.0),
    );
}

fn print_shrink(r: &Value) {
    let s = &r["shrink"];
    let mb = |k: &str| s[k].as_f64().unwrap_or(f64::NAN) / 1e6;
    println!(
        "{:<14} soft limit {:.1} MB at {:.1} s (working set {:.1} MB, outside the books {:.1} MB; write {}): working set under it after {} s, usage after {} s; hard limit {:.1} MB ({}); most usage after it {:.1} MB; OOM kills {}",
        "",
        mb("soft_limit_bytes"),
        s["soft_at_s"].as_f64().unwrap_or(f64::NAN),
        mb("working_set_at_soft_bytes"),
        mb("outside_books_at_soft_bytes"),
        s["soft_write"],
        s["working_set_under_soft_after_s"],
        s["usage_under_soft_after_s"],
        mb("hard_limit_bytes"),
        s["hard_write"],
        mb("most_usage_after_hard_bytes"),
        s["oom_kills"],
    );
}

fn main() -> ExitCode {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    if let Ok(spec) = std::env::var("PROCMEM_SHARING_CHILD") {
        return child(&spec);
    }
    if std::env::args().any(|a| a == "--list") {
        return ExitCode::SUCCESS;
    }
    let rt = tokio::runtime::Runtime::new().expect("a tokio runtime");
    match rt.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sharing: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The goals for a node row at one M against the static row there and the unbounded floor
/// (issue 57: node p99 at most static's, p50 at most half of it, p99 within 1.3x of
/// unbounded's; nothing failed; books zero at every shutdown).
fn goals(node: &Value, fixed: &Value, floor: Option<&Value>) -> Value {
    let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let p99_over_floor = floor.map(|u| f(node, "ttft_p99_ms") / f(u, "ttft_p99_ms"));
    json!({
        "ttft_p99_static_over_node": f(fixed, "ttft_p99_ms") / f(node, "ttft_p99_ms"),
        "ttft_p50_static_over_node": f(fixed, "ttft_p50_ms") / f(node, "ttft_p50_ms"),
        "ttft_p99_node_over_unbounded": p99_over_floor,
        "ttft_p99_in_burst_static_over_node": f(fixed, "ttft_p99_ms_in_burst") / f(node, "ttft_p99_ms_in_burst"),
        "prompt_tokens_computed_node_over_static": f(node, "prompt_tokens_computed") / f(fixed, "prompt_tokens_computed"),
        "failed": node["requests_failed"],
        "books_zero_after_shutdown": node["books_zero_after_shutdown"],
        "never_above_m": f(node, "most_lent_at_once_bytes") <= f(node, "capacity_m_bytes"),
        "tickets_per_request": node["node_tickets_per_request"],
        "met": f(node, "ttft_p99_ms") <= f(fixed, "ttft_p99_ms")
            && 2.0 * f(node, "ttft_p50_ms") <= f(fixed, "ttft_p50_ms")
            && p99_over_floor.is_none_or(|r| r <= 1.3)
            && node["requests_failed"] == 0
            && node["books_zero_after_shutdown"] == true,
    })
}

/// The static row at `1/part` of peak KV, which sizes M (three times a server's budget);
/// left out (`PROCMEM_SHARING_ROWS` without `static`), M is `PROCMEM_SHARING_M`.
async fn static_row(plan: &Plan, part: u32, run: bool) -> Result<(Value, u64), String> {
    let given: Option<u64> = std::env::var("PROCMEM_SHARING_M")
        .ok()
        .and_then(|m| m.parse().ok());
    match given {
        Some(m) if !run => Ok((json!(null), m)),
        _ => match row(Mode::Static, plan, 0, part).await {
            Ok((fixed, budget)) => {
                print_row(&fixed);
                Ok((fixed, SERVERS as u64 * budget))
            }
            // A partition too small for one sequence of the whole context: the servers refuse
            // to start. M is what the three budgets would have been.
            Err(e) => match refused_budget(&e) {
                Some(budget) => {
                    println!(
                        "static at 1/{part}: each server refused to start: {}",
                        e.trim()
                    );
                    let refused = json!({
                        "row": "static",
                        "kv_part": format!("1/{part}"),
                        "refused": e.trim(),
                        "capacity_m_bytes": SERVERS as u64 * budget,
                    });
                    Ok((refused, SERVERS as u64 * budget))
                }
                None => Err(e),
            },
        },
    }
}

/// From a server's refusal ("the model needs W bytes of weights plus S for one sequence: more
/// than the budget of B bytes"), the budget it was given: B.
fn refused_budget(error: &str) -> Option<u64> {
    let at = error.find("more than the budget of ")? + "more than the budget of ".len();
    error[at..].split(' ').next()?.parse().ok()
}

async fn run() -> Result<(), String> {
    let Some(gguf) = fetch_smollm2() else {
        println!("sharing: no SmolLM2 GGUF and it could not be fetched: skipped");
        return Ok(());
    };
    let g = Gguf::open(&gguf).map_err(|e| e.to_string())?;
    let codec =
        TextCodec::new(&g.tokenizer().map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    let plan = plan(&codec);
    let wanted = std::env::var("PROCMEM_SHARING_ROWS")
        .unwrap_or_else(|_| "static,node,node_priority,node_shrink,llama_shrink,unbounded".into());
    println!(
        "sharing: {SERVERS} servers, {} conversations of {TURNS} turns in {} phases ({BURST} for the server in its burst, 1 for each other), system prompts {} tokens",
        plan.phases.iter().flatten().map(Vec::len).sum::<usize>(),
        plan.phases.len(),
        codec.encode(&plan.systems[0]).map_or(0, |t| t.len()),
    );
    let parts: Vec<u32> = match std::env::var("PROCMEM_SHARING_KV_PARTS") {
        Ok(v) => v
            .split(',')
            .filter_map(|p| p.trim().parse().ok())
            .filter(|p| *p > 0)
            .collect(),
        Err(_) => PARTS.to_vec(),
    };
    let wants = |mode: Mode| wanted.split(',').any(|w| w.trim() == mode.name());
    let mut rows = Vec::new();
    let mut checks = json!({});
    // The floor under every M: nothing ever waits for memory.
    let floor = match wants(Mode::Unbounded) {
        true => Some(optional_row(Mode::Unbounded, &plan, 0, DEFAULT_PART).await?),
        false => None,
    };
    let mut capacity = 0;
    for part in parts {
        let (fixed, m) = static_row(&plan, part, wants(Mode::Static)).await?;
        rows.push(fixed.clone());
        let mut at = json!({"capacity_m_bytes": m});
        for mode in [Mode::Node, Mode::NodePriority] {
            if !wants(mode) || (mode != Mode::Node && part != DEFAULT_PART) {
                continue;
            }
            let (r, _) = row(mode, &plan, m, part).await?;
            print_row(&r);
            at[mode.name()] = goals(&r, &fixed, floor.as_ref());
            rows.push(r);
        }
        if part == DEFAULT_PART {
            capacity = m;
            // The keys the report had before the sweep: the goals at the default M.
            for mode in [Mode::Node, Mode::NodePriority] {
                checks[mode.name()] = at[mode.name()].clone();
            }
            if let Some(u) = &floor {
                let p99 = |r: &Value| r["ttft_p99_ms"].as_f64().unwrap_or(f64::NAN);
                checks["ttft_p99_static_over_unbounded"] = json!(p99(&fixed) / p99(u));
            }
            for mode in [Mode::NodeShrink, Mode::LlamaShrink] {
                if wants(mode) {
                    rows.push(optional_row(mode, &plan, m, part).await?);
                }
            }
        }
        checks[format!("kv_1of{part}")] = at;
    }
    rows.extend(floor);
    println!("goals: {checks}");
    let system_tokens = codec.encode(&plan.systems[0]).map_or(0, |t| t.len());
    let report = report(&gguf, &plan, system_tokens, capacity, (rows, checks));
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/reports");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let path = dir.join("sharing.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report).unwrap())
        .map_err(|e| e.to_string())?;
    println!("wrote {}", path.display());
    Ok(())
}

/// A row that may not run here (no llama-server, no cgroup to shrink): its figures, or why
/// it was skipped.
async fn optional_row(mode: Mode, plan: &Plan, capacity: u64, part: u32) -> Result<Value, String> {
    if mode == Mode::LlamaShrink && !llama_bin().is_file() {
        println!(
            "{}: no llama-server (scripts/llama-server.sh builds it): skipped",
            mode.name()
        );
        return Ok(json!({"row": mode.name(), "skipped": "no llama-server"}));
    }
    match row(mode, plan, capacity, part).await {
        Ok((r, _)) => {
            print_row(&r);
            if mode.shrinks() {
                print_shrink(&r);
            }
            Ok(r)
        }
        Err(e) if e.starts_with("cgroup:") => {
            println!("{}: {e}: skipped", mode.name());
            Ok(json!({"row": mode.name(), "skipped": e}))
        }
        Err(e) => Err(e),
    }
}

/// The bench's report: the model, the workload, M, every row and the goals.
fn report(
    gguf: &std::path::Path,
    plan: &Plan,
    system_tokens: usize,
    capacity: u64,
    (rows, checks): (Vec<Value>, Value),
) -> Value {
    json!({
        "bench": "sharing",
        "model": gguf.file_name().map(|n| n.to_string_lossy().into_owned()),
        "workload": {
            "servers": SERVERS,
            "concurrency_per_server": CONCURRENCY,
            "context": CONTEXT,
            "burst_conversations": BURST,
            "turns": TURNS,
            "answer_tokens": ANSWER_TOKENS,
            "system_prompt_tokens": system_tokens,
            "longest_conversation_tokens": plan.longest,
            "kv_fraction_of_8_sequences_per_server": plan.fraction(DEFAULT_PART),
            "kv_dtype": "f16",
        },
        "capacity_m_bytes": capacity,
        "rows": rows,
        "goals": checks,
    })
}
