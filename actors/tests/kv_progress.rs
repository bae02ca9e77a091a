//! Forward progress under any budget that holds one sequence at its full length: 16 requests
//! decoded together as one batch under 1/2, 1/4 and 1/8 of their KV demand, with swap and
//! with recompute. Every request finishes, every attention output equals an unpressured run
//! (a recomputed request replays its tokens and gets the same outputs again), and the
//! preemptions and replayed steps per request are reported.
//!
//! The server loop is what an inference server does with the store's answers: a sequence
//! preempted while its step waited (`Err(Preempted)`) leaves the batch and is restored later,
//! oldest first; `Restored::Recompute` replays from the cached blocks it maps again.

use procmem_actors::kv::{StepEnd, TableError};
use std::collections::HashMap;
use std::time::{Duration, Instant};

use procmem_actors::procmem::kv::{gqa_decode, KvShape};
use procmem_actors::{
    governor::GovernorError,
    kv::{AttendItem, KvStoreError, PreemptMode, Restored},
};

mod common;

use common::{kv_config, kv_system};

const SHAPE: KvShape = common::shape(256);
const REQUESTS: u64 = 16;
/// Tokens each request decodes: two growth chunks of one page per buffer.
const TOKENS: usize = 64;

fn item(seq: u64, pos: usize, layer: usize) -> AttendItem {
    common::kv_item(&SHAPE, seq, pos, layer)
}

/// Every output of an unpressured run: (seq, pos, layer) -> attention output.
fn expected() -> HashMap<(u64, usize, usize), Vec<f32>> {
    let mut out = HashMap::new();
    for seq in 0..REQUESTS {
        for layer in 0..SHAPE.layers {
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for pos in 0..TOKENS {
                let it = item(seq, pos, layer);
                k.extend_from_slice(&it.k);
                v.extend_from_slice(&it.v);
                let mut o = vec![0f32; it.q.len()];
                gqa_decode(&it.q, &k, &v, pos + 1, SHAPE.heads(), &mut o);
                out.insert((seq, pos, layer), o);
            }
        }
    }
    out
}

#[derive(Default, Debug, Clone, Copy)]
struct Figures {
    preemptions: u64,
    replayed_steps: u64,
    restores: u64,
}

struct Request {
    pos: usize,
    parked: bool,
    done: bool,
    figures: Figures,
}

/// Bytes a request's KV takes at `tokens` tokens (whole pages per buffer).
fn tokens_bytes(tokens: usize) -> u64 {
    let per_buffer = (tokens as u64 * SHAPE.token_bytes(procmem_actors::procmem::kv::KvPart::K))
        .next_multiple_of(4096);
    per_buffer * SHAPE.buffers() as u64
}

/// One growth of every buffer of a sequence.
fn chunk_bytes() -> u64 {
    4096 * SHAPE.buffers() as u64
}

/// Bytes one request's KV takes at its full length.
fn demand_per_request() -> u64 {
    tokens_bytes(TOKENS)
}

async fn run(fraction: u64, mode: PreemptMode) -> Vec<Figures> {
    let budget = REQUESTS * demand_per_request() / fraction;
    assert!(
        budget >= demand_per_request(),
        "the budget holds one request"
    );
    let config = kv_config(SHAPE, 1, mode, Duration::from_millis(200));
    let (g, _p, kv) = kv_system(budget, config).await;
    let want = expected();
    let mut reqs: Vec<Request> = (0..REQUESTS)
        .map(|_| Request {
            pos: 0,
            parked: false,
            done: false,
            figures: Figures::default(),
        })
        .collect();
    for seq in 0..REQUESTS {
        kv.open(seq, vec![], 0).await.unwrap();
    }
    let start = Instant::now();
    let mut skip_newest = 0usize;
    let mut stepped = true;
    while reqs.iter().any(|r| !r.done) {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "1/{fraction} {mode:?}: no progress: {:?}",
            reqs.iter()
                .map(|r| (r.pos, r.parked, r.done))
                .collect::<Vec<_>>()
        );
        // Restore parked requests, oldest first, only after a step went through and while
        // there is room for them beside the batch's next growth: restoring into memory the
        // batch needs would only evict it again.
        let free = g.snapshot().await.unwrap().books.free();
        let running = reqs.iter().filter(|r| !r.parked && !r.done).count() as u64;
        let mut room = free.saturating_sub(running * chunk_bytes());
        for seq in 0..REQUESTS {
            let r = &mut reqs[seq as usize];
            if !r.parked || !(stepped || running == 0) {
                continue;
            }
            let need = tokens_bytes(r.pos);
            if need > room {
                break;
            }
            room -= need;
            match kv.restore(seq).await {
                Ok(Restored::Swapped { tokens }) => {
                    assert_eq!(tokens, r.pos, "swap brings back every token");
                    r.parked = false;
                    r.figures.restores += 1;
                }
                Ok(Restored::Recompute { tokens, cached }) => {
                    r.figures.replayed_steps += (tokens - cached) as u64;
                    r.pos = cached;
                    r.parked = false;
                    r.figures.restores += 1;
                }
                Err(KvStoreError::Governor(GovernorError::DeadlineExpired(_))) => break,
                Err(e) => panic!("restore of {seq}: {e}"),
            }
        }
        let mut batch: Vec<u64> = (0..REQUESTS)
            .filter(|s| !reqs[*s as usize].parked && !reqs[*s as usize].done)
            .collect();
        // A batch that did not fit last time steps without its newest members.
        batch.truncate(batch.len().saturating_sub(skip_newest).max(1));
        if batch.is_empty() {
            continue;
        }
        let step = match kv.prepare(batch.clone()).await {
            Ok(step) => {
                skip_newest = 0;
                stepped = true;
                step
            }
            Err(KvStoreError::Table(TableError::Preempted(seq, _))) => {
                let r = &mut reqs[seq as usize];
                r.parked = true;
                r.figures.preemptions += 1;
                stepped = false;
                continue;
            }
            // The batch does not fit (in time, or at all): step it without its newest member.
            Err(KvStoreError::Governor(
                GovernorError::DeadlineExpired(_) | GovernorError::Ledger(_),
            )) => {
                skip_newest += 1;
                stepped = false;
                continue;
            }
            Err(e) => panic!("prepare: {e}"),
        };
        for layer in 0..SHAPE.layers {
            let items = batch
                .iter()
                .map(|s| item(*s, reqs[*s as usize].pos, layer))
                .collect();
            let outs = step.attend(layer, items).await.unwrap();
            for (s, o) in batch.iter().zip(outs) {
                let pos = reqs[*s as usize].pos;
                let expect = &want[&(*s, pos, layer)];
                assert!(
                    o.len() == expect.len()
                        && o.iter()
                            .zip(expect)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "1/{fraction} {mode:?}: seq {s} pos {pos} layer {layer} differs"
                );
            }
        }
        step.complete(StepEnd::Submitted).await.unwrap();
        for s in &batch {
            let r = &mut reqs[*s as usize];
            r.pos += 1;
            if r.pos == TOKENS {
                r.done = true;
                kv.close(*s);
            }
        }
    }
    // Every byte comes back.
    let deadline = Instant::now() + Duration::from_secs(10);
    while g.snapshot().await.unwrap().books.approved() != 0 {
        assert!(Instant::now() < deadline, "books not at zero");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    reqs.iter().map(|r| r.figures).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_finishes_under_a_half_a_quarter_and_an_eighth_of_its_demand() {
    let mut finished = 0;
    let mut runs = 0;
    for mode in [PreemptMode::Swap, PreemptMode::Recompute] {
        for fraction in [2, 4, 8] {
            let figures = run(fraction, mode).await;
            runs += 1;
            finished += figures.len();
            let preemptions: Vec<u64> = figures.iter().map(|f| f.preemptions).collect();
            let replayed: Vec<u64> = figures.iter().map(|f| f.replayed_steps).collect();
            eprintln!(
                "kv_progress: 1/{fraction} of demand, {mode:?}: {REQUESTS}/{REQUESTS} finished, \
                 outputs equal; preemptions per request {preemptions:?} (total {}); replayed \
                 steps per request {replayed:?} (total {})",
                preemptions.iter().sum::<u64>(),
                replayed.iter().sum::<u64>()
            );
        }
    }
    common::figure(
        "kv_progress_requests_finished",
        finished,
        runs * REQUESTS as usize,
    );
}
