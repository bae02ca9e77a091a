//! reserve → commit → release through the Governor actor from a tokio task, against the same
//! three calls on the ledger behind a `Mutex` (the floor), 64 concurrent holders, and a
//! request granted under pressure: it waits while one of 8 holder actors frees memory for it.
//! Then standing credit: a grant within credit, 64 holders taking from their own lines against
//! the ledger behind a `Mutex`, and the Governor's cost of one 32-layer decode step.
//! Writes `target/reports/governor.json`.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use procmem_actors::node::wire::{NodeMsg, NodeRequest};
use procmem_actors::node::{LinkConfig, NodeConfig, NodeHandle, NodeLink, NODE_GROUP};
use procmem_actors::procmem::ledger::{HolderId, Ledger};
use procmem_actors::procmem::MemoryRole;
use procmem_actors::{
    governor::{CreditLine, GovernorConfig, GovernorHandle, Lease, ReserveRequest},
    holder::PressureTicket,
};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde_json::json;

use common::{percentile, write_report};

const WARMUP: usize = 2_000;
const SAMPLES: usize = 20_000;
const CONCURRENT: usize = 64;
const PER_TASK: usize = 500;

async fn round_trip(
    g: &GovernorHandle,
    holder: procmem_actors::procmem::ledger::HolderId,
    await_release: bool,
) {
    let grant = g
        .reserve(ReserveRequest {
            holder,
            role: MemoryRole::KvCache,
            bytes: 4096,
            priority: 0,
            deadline: None,
        })
        .await
        .unwrap();
    let mut lease = grant.commit(4096).await.unwrap();
    if await_release {
        lease.release_all().await.unwrap();
    } else {
        // As a deferred-free actor does it: fire and forget, order kept by the mailbox.
        lease.release(4096).unwrap();
    }
}

/// Per-round-trip latencies (ns), sorted, on a runtime of `workers` threads (0 = current thread).
fn actor_latencies(workers: usize, await_release: bool) -> Vec<u64> {
    let rt = if workers == 0 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
            .unwrap()
    };
    rt.block_on(async {
        let (g, _) = GovernorHandle::spawn(GovernorConfig::new("bench", 1 << 40))
            .await
            .unwrap();
        let holder = g.register_holder("bench", 0, None).await.unwrap();
        // Measured from a spawned task, as a holder would call it.
        tokio::spawn(async move {
            for _ in 0..WARMUP {
                round_trip(&g, holder, await_release).await;
            }
            let mut samples = Vec::with_capacity(SAMPLES);
            for _ in 0..SAMPLES {
                let start = Instant::now();
                round_trip(&g, holder, await_release).await;
                samples.push(start.elapsed().as_nanos() as u64);
            }
            samples.sort_unstable();
            samples
        })
        .await
        .unwrap()
    })
}

fn mutex_round_trip_ns() -> f64 {
    let mut ledger = Ledger::new();
    let a = ledger.add_authority("bench", 1 << 40);
    let h = ledger.register_holder(a, "bench", 0).unwrap();
    let ledger = Arc::new(Mutex::new(ledger));
    let iters = 200_000;
    let start = Instant::now();
    for _ in 0..iters {
        let g = ledger
            .lock()
            .unwrap()
            .reserve(h, a, MemoryRole::KvCache, 4096)
            .unwrap();
        let l = ledger.lock().unwrap().commit(h, g.id, 4096).unwrap();
        ledger.lock().unwrap().release(h, l.id, 4096).unwrap();
    }
    start.elapsed().as_nanos() as f64 / iters as f64
}

fn concurrent_ops_per_s() -> (f64, Duration) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (g, _) = GovernorHandle::spawn(GovernorConfig::new("bench64", 1 << 40))
            .await
            .unwrap();
        let mut holders = Vec::new();
        for i in 0..CONCURRENT {
            holders.push(g.register_holder(format!("h{i}"), 0, None).await.unwrap());
        }
        let start = Instant::now();
        let tasks: Vec<_> = holders
            .into_iter()
            .map(|h| {
                let g = g.clone();
                tokio::spawn(async move {
                    for _ in 0..PER_TASK {
                        round_trip(&g, h, true).await;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let elapsed = start.elapsed();
        let snapshot = g.snapshot().await.unwrap();
        assert_eq!(snapshot.books.approved(), 0, "every byte came back");
        (
            (CONCURRENT * PER_TASK) as f64 / elapsed.as_secs_f64(),
            elapsed,
        )
    })
}

const PRESSURE_HOLDERS: usize = 8;
const PRESSURE_CHUNKS: usize = 16;
const PRESSURE_SAMPLES: usize = 5_000;
const CHUNK: u64 = 4096;

/// A holder that frees one chunk per ticket, and takes one back when asked to refill.
struct ChunkHolder;

enum ChunkMsg {
    SetId(HolderId),
    Ticket(PressureTicket),
    Refill(RpcReplyPort<bool>),
}

impl ractor::Message for ChunkMsg {}

procmem_actors::holder::holder_mailbox!(ChunkMsg::Ticket);

struct ChunkState {
    governor: GovernorHandle,
    id: Option<HolderId>,
    leases: Vec<Lease>,
}

impl Actor for ChunkHolder {
    type Msg = ChunkMsg;
    type State = ChunkState;
    type Arguments = GovernorHandle;

    async fn pre_start(
        &self,
        _: ActorRef<ChunkMsg>,
        governor: GovernorHandle,
    ) -> Result<ChunkState, ActorProcessingErr> {
        Ok(ChunkState {
            governor,
            id: None,
            leases: Vec::new(),
        })
    }

    async fn handle(
        &self,
        _: ActorRef<ChunkMsg>,
        msg: ChunkMsg,
        state: &mut ChunkState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ChunkMsg::SetId(id) => state.id = Some(id),
            ChunkMsg::Ticket(ticket) => {
                let freed = match state.leases.pop() {
                    Some(mut lease) => {
                        lease.release(CHUNK).unwrap();
                        CHUNK
                    }
                    None => 0,
                };
                ticket.report(freed, 0);
            }
            ChunkMsg::Refill(reply) => {
                let id = state.id.expect("registered");
                let got = match state.governor.reserve(request(id, None)).await {
                    Ok(grant) => {
                        state.leases.push(grant.commit(CHUNK).await.unwrap());
                        true
                    }
                    Err(_) => false,
                };
                let _ = reply.send(got);
            }
        }
        Ok(())
    }
}

fn request(holder: HolderId, deadline: Option<tokio::time::Instant>) -> ReserveRequest {
    ReserveRequest {
        holder,
        role: MemoryRole::KvCache,
        bytes: CHUNK,
        priority: 1,
        deadline,
    }
}

/// A full authority, 8 holders with 16 chunks each: a request waits, the Governor asks a
/// holder, the holder frees a chunk, the request is granted. Timed from the reserve call to
/// the grant in hand; then the requester lets go and a holder takes its chunk back.
fn pressure_grant_latencies() -> Vec<u64> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let capacity = PRESSURE_HOLDERS as u64 * PRESSURE_CHUNKS as u64 * CHUNK;
        let (g, _) = GovernorHandle::spawn(GovernorConfig::new("pressure", capacity))
            .await
            .unwrap();
        let mut holders = Vec::new();
        for i in 0..PRESSURE_HOLDERS {
            let (actor, _) = Actor::spawn(None, ChunkHolder, g.clone()).await.unwrap();
            let id = g
                .register_holder(format!("h{i}"), 0, Some(actor.get_derived()))
                .await
                .unwrap();
            // The id is known only once registered; the mailbox keeps it ahead of the refills.
            actor.cast(ChunkMsg::SetId(id)).unwrap();
            for _ in 0..PRESSURE_CHUNKS {
                assert!(ractor::call!(actor, ChunkMsg::Refill).unwrap());
            }
            holders.push(actor);
        }
        let me = g.register_holder("requester", 9, None).await.unwrap();
        let mut samples = Vec::with_capacity(PRESSURE_SAMPLES);
        for i in 0..PRESSURE_SAMPLES + WARMUP / 4 {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            let start = Instant::now();
            let grant = g.reserve(request(me, Some(deadline))).await.unwrap();
            let ns = start.elapsed().as_nanos() as u64;
            if i >= WARMUP / 4 {
                samples.push(ns);
            }
            grant
                .commit(CHUNK)
                .await
                .unwrap()
                .release_all()
                .await
                .unwrap();
            let mut refilled = false;
            for h in &holders {
                if ractor::call!(h, ChunkMsg::Refill).unwrap() {
                    refilled = true;
                    break;
                }
            }
            assert!(refilled, "a holder takes the chunk back");
        }
        let s = g.snapshot().await.unwrap();
        assert_eq!(s.books.approved(), capacity, "full again");
        samples.sort_unstable();
        samples
    })
}

/// `holders` credit lines of `chunk` bytes each, topped up once, on a Governor of a runtime
/// that stays alive with them.
fn credit_lines(
    holders: usize,
    chunk: u64,
) -> (tokio::runtime::Runtime, GovernorHandle, Vec<CreditLine>) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (g, lines) = rt.block_on(async {
        let (g, _) = GovernorHandle::spawn(GovernorConfig::new("credit", 1 << 50))
            .await
            .unwrap();
        let mut lines = Vec::new();
        for i in 0..holders {
            let h = g.register_holder(format!("c{i}"), 0, None).await.unwrap();
            let line = g.open_credit(h, MemoryRole::KvCache, chunk).await.unwrap();
            drop(line.reserve(chunk, 0, None).await.unwrap());
            lines.push(line);
        }
        (g, lines)
    });
    (rt, g, lines)
}

const CREDIT_BATCH: usize = 100;

/// Nanoseconds per grant within credit (take), over batches, sorted; the leases are dropped
/// outside the timed part.
fn credit_grant_ns() -> Vec<f64> {
    let (_rt, _g, lines) = credit_lines(1, 1 << 30);
    let line = &lines[0];
    let mut held = Vec::with_capacity(CREDIT_BATCH);
    let mut samples = Vec::with_capacity(SAMPLES / CREDIT_BATCH * 10);
    for round in 0..(SAMPLES / CREDIT_BATCH * 10 + 100) {
        let start = Instant::now();
        for _ in 0..CREDIT_BATCH {
            held.push(line.take(4096).expect("within credit"));
        }
        let ns = start.elapsed().as_nanos() as f64 / CREDIT_BATCH as f64;
        held.clear();
        if round >= 100 {
            samples.push(ns);
        }
    }
    samples.sort_by(f64::total_cmp);
    samples
}

/// Ops per second of 64 threads each doing take + release on its own credit line, and of 64
/// threads doing reserve + commit + release on one ledger behind a `Mutex`.
fn credit_vs_mutex_ops_per_s() -> (f64, f64) {
    const OPS: usize = 20_000;
    let (_rt, _g, lines) = credit_lines(CONCURRENT, 1 << 20);
    let start = Instant::now();
    std::thread::scope(|s| {
        for line in &lines {
            s.spawn(move || {
                for _ in 0..OPS {
                    drop(std::hint::black_box(
                        line.take(4096).expect("within credit"),
                    ));
                }
            });
        }
    });
    let credit = (CONCURRENT * OPS) as f64 / start.elapsed().as_secs_f64();

    let mut ledger = Ledger::new();
    let a = ledger.add_authority("bench", 1 << 50);
    let holders: Vec<_> = (0..CONCURRENT)
        .map(|i| ledger.register_holder(a, format!("m{i}"), 0).unwrap())
        .collect();
    let ledger = Mutex::new(ledger);
    let start = Instant::now();
    std::thread::scope(|s| {
        for &h in &holders {
            let ledger = &ledger;
            s.spawn(move || {
                for _ in 0..OPS / 10 {
                    let g = ledger
                        .lock()
                        .unwrap()
                        .reserve(h, a, MemoryRole::KvCache, 4096)
                        .unwrap();
                    let l = ledger.lock().unwrap().commit(h, g.id, 4096).unwrap();
                    ledger.lock().unwrap().release(h, l.id, 4096).unwrap();
                }
            });
        }
    });
    let mutex = (CONCURRENT * (OPS / 10)) as f64 / start.elapsed().as_secs_f64();
    (credit, mutex)
}

/// Nanoseconds of Governor work in one decode step of a 32-layer model: 64 K/V buffers each
/// growing by one granule, taken from the store's credit line, and given back when the
/// sequence ends (both timed). Sorted over steps.
fn step_cost_ns() -> Vec<f64> {
    const BUFFERS: usize = 64;
    const GRANULE: u64 = 2 << 20;
    let (_rt, _g, lines) = credit_lines(1, 1 << 40);
    let line = &lines[0];
    let mut held: Vec<Lease> = Vec::with_capacity(BUFFERS);
    let mut samples = Vec::with_capacity(SAMPLES / 10);
    for step in 0..(SAMPLES / 10 + 100) {
        let start = Instant::now();
        for _ in 0..BUFFERS {
            held.push(line.take(GRANULE).expect("within credit"));
        }
        held.clear();
        let ns = start.elapsed().as_nanos() as f64;
        if step >= 100 {
            samples.push(ns);
        }
    }
    samples.sort_by(f64::total_cmp);
    samples
}

fn pf(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

const NODE_PORT_ENV: &str = "PROCMEM_BENCH_NODE_PORT";
const REFILLS: usize = 2_000;

/// This bench run again as the node Governor process (until its parent kills it).
fn run_node(port: u16) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut config = NodeConfig::new("bench", port, "host", 1 << 50);
        config.rejoin_grace = Duration::ZERO;
        let _node = NodeHandle::start(config).await.unwrap();
        println!("READY");
        std::future::pending::<()>().await;
    });
}

/// Nanoseconds of a reserve that does not fit the process's capacity, so its Governor asks the
/// node Governor (another process, over loopback) for a refill of credit: the reserve's whole
/// wait, sorted. Each grant is kept, so every reserve needs a refill.
fn cross_process_refill_ns() -> (Vec<u64>, Vec<u64>) {
    use std::io::BufRead;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut node = std::process::Command::new(std::env::current_exe().unwrap())
        .env(NODE_PORT_ENV, port.to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    std::io::BufReader::new(node.stdout.take().unwrap())
        .read_line(&mut ready)
        .unwrap();
    assert_eq!(ready.trim(), "READY");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (mut samples, rpc) = rt.block_on(async {
        let (g, _) = GovernorHandle::spawn(GovernorConfig::new("host", 0))
            .await
            .unwrap();
        let mut config = LinkConfig::new(
            std::net::SocketAddr::from(([127, 0, 0, 1], port)),
            "bench",
            "bench",
        );
        config.chunk = 1 << 20;
        let link = NodeLink::join(config, g.clone()).await.unwrap();
        let samples = refills(&g).await;
        let rpc = node_rpc_ns().await;
        link.leave().await;
        (samples, rpc)
    });
    let _ = node.kill();
    let _ = node.wait();
    samples.sort_unstable();
    (samples, rpc)
}

/// Nanoseconds of each of `REFILLS` reserves of 1 MiB (after 100 of warm-up), each kept so
/// the next needs a refill from the node.
async fn refills(g: &GovernorHandle) -> Vec<u64> {
    let h = g.register_holder("bench", 0, None).await.unwrap();
    let mut held = Vec::with_capacity(REFILLS + 100);
    let mut samples = Vec::with_capacity(REFILLS);
    for i in 0..REFILLS + 100 {
        let start = Instant::now();
        let grant = g
            .reserve(ReserveRequest {
                holder: h,
                role: MemoryRole::KvCache,
                bytes: 1 << 20,
                priority: 0,
                deadline: Some(tokio::time::Instant::now() + Duration::from_secs(2)),
            })
            .await
            .unwrap();
        let ns = start.elapsed().as_nanos() as u64;
        held.push(grant.commit(1 << 20).await.unwrap());
        if i >= 100 {
            samples.push(ns);
        }
    }
    samples
}

/// The floor under a refill: a bare call through the same cluster session (the node's books),
/// sorted.
async fn node_rpc_ns() -> Vec<u64> {
    let node: ractor::ActorRef<NodeMsg> = ractor::pg::get_members(&NODE_GROUP.to_string())
        .into_iter()
        .find(|c| !c.get_id().is_local())
        .unwrap()
        .into();
    let mut rpc = Vec::with_capacity(REFILLS);
    for i in 0..REFILLS + 100 {
        let start = Instant::now();
        ractor::call!(node, |reply| NodeMsg::Call {
            request: Ok(NodeRequest::Status),
            reply
        })
        .unwrap();
        if i >= 100 {
            rpc.push(start.elapsed().as_nanos() as u64);
        }
    }
    rpc.sort_unstable();
    rpc
}

fn main() {
    if let Ok(port) = std::env::var(NODE_PORT_ENV) {
        return run_node(port.parse().unwrap());
    }
    let (refill, cluster_rpc) = cross_process_refill_ns();
    let credit_grant = credit_grant_ns();
    let (credit_ops, mutex_ops) = credit_vs_mutex_ops_per_s();
    let step = step_cost_ns();
    let multi = actor_latencies(2, true);
    let single = actor_latencies(0, true);
    let cast = actor_latencies(2, false);
    let mutex_ns = mutex_round_trip_ns();
    let (ops_per_s, elapsed) = concurrent_ops_per_s();
    let pressure = pressure_grant_latencies();
    write_report(
        "governor",
        &json!({
            "round_trip": "reserve -> commit -> release, each awaited",
            "samples": SAMPLES,
            "actor_round_trip_p50_ns": percentile(&multi, 0.50),
            "actor_round_trip_p99_ns": percentile(&multi, 0.99),
            "actor_round_trip_current_thread_p50_ns": percentile(&single, 0.50),
            "actor_round_trip_current_thread_p99_ns": percentile(&single, 0.99),
            "actor_reserve_commit_release_cast_p50_ns": percentile(&cast, 0.50),
            "actor_reserve_commit_release_cast_p99_ns": percentile(&cast, 0.99),
            "mutex_round_trip_ns": mutex_ns,
            "actor_vs_mutex_p50_ratio": percentile(&multi, 0.50) as f64 / mutex_ns,
            "concurrent_holders": CONCURRENT,
            "concurrent_round_trips": CONCURRENT * PER_TASK,
            "concurrent_elapsed_s": elapsed.as_secs_f64(),
            "concurrent_64_ops_per_s": ops_per_s,
            "pressure_grant": "a full authority, 8 holder actors: reserve waits, a ticket frees a chunk, granted",
            "pressure_holders": PRESSURE_HOLDERS,
            "pressure_samples": pressure.len(),
            "pressure_grant_p50_ns": percentile(&pressure, 0.50),
            "pressure_grant_p99_ns": percentile(&pressure, 0.99),
            "credit_grant": "CreditLine::take of 4 KiB within credit (one atomic operation), per op over batches of 100",
            "credit_grant_p50_ns": pf(&credit_grant, 0.50),
            "credit_grant_p99_ns": pf(&credit_grant, 0.99),
            "concurrent_64_credit_ops_per_s": credit_ops,
            "concurrent_64_mutex_ops_per_s": mutex_ops,
            "concurrent_64_vs_mutex_ratio": credit_ops / mutex_ops,
            "step_cost": "64 K/V buffers of a 32-layer model each grow one 2 MiB granule from credit; the leases are dropped in the timed part",
            "step_cost_32_layers_ns": pf(&step, 0.50),
            "step_cost_32_layers_p99_ns": pf(&step, 0.99),
            "cross_process_refill": "a reserve over the process's capacity: its Governor asks the node Governor (another process, ractor_cluster over loopback) for credit, then grants",
            "cross_process_refill_samples": refill.len(),
            "cross_process_refill_p50_ns": percentile(&refill, 0.50),
            "cross_process_refill_p99_ns": percentile(&refill, 0.99),
            "cluster_rpc_p50_ns": percentile(&cluster_rpc, 0.50),
            "cluster_rpc_p99_ns": percentile(&cluster_rpc, 0.99),
            "cross_process_refill_vs_cluster_rpc_p50_ratio": percentile(&refill, 0.50) as f64 / percentile(&cluster_rpc, 0.50) as f64,
        }),
    );
}
