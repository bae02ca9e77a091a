//! Seeded interleavings: for each seed, holders on their own tasks allocate, fill, submit
//! kernels on either of two streams, hand buffers to each other and drop them, with waits,
//! yields and kernel lengths drawn from the seed; a checker samples the books and the kernel
//! throughout. Invariants, at every sample and every step:
//! - the Governor never approves more than its capacity;
//! - no byte is mapped but not charged: the kernel's resident bytes never exceed the bytes
//!   the Governor has approved (checked on samples with no grant in between, where it is exact);
//! - no two live buffers overlap;
//! - every kernel finds its buffers' patterns intact (nothing freed or reused under it);
//! - each seed finishes in bounded time, and the books and the kernel return to zero.
//!
//! `PROCMEM_SEEDS=N` runs N seeds (default 12; `scripts/reliability.sh` runs more).

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use procmem_actors::procmem::fenced::RecordUse;
use procmem_actors::procmem::{AllocationRequest, MemoryRole};
use procmem_actors::{governor::GovernorHandle, provider::CpuProvider, Buffer};
use tokio::sync::mpsc;

mod common;
use common::{figure, os_bytes, system};

const HOLDERS: usize = 6;
const OPS: usize = 60;
const CAPACITY: u64 = 1 << 20;

/// splitmix64: a small, well-mixed generator, so each seed replays the same choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Default)]
struct Findings {
    violations: Mutex<Vec<String>>,
    samples: AtomicU64,
    exact_samples: AtomicU64,
    kernels: AtomicU64,
    corrupt: AtomicU64,
    allocations: AtomicU64,
    denied: AtomicU64,
    handed_over: AtomicU64,
}

impl Findings {
    fn violation(&self, what: String) {
        self.violations.lock().unwrap().push(what);
    }
}

/// Live (not yet dropped) buffers by address: a new one must overlap none of them.
#[derive(Default)]
struct Live(Mutex<BTreeMap<u64, u64>>);

impl Live {
    fn insert(&self, addr: u64, len: u64, findings: &Findings) {
        let mut live = self.0.lock().unwrap();
        let before = live.range(..=addr).next_back();
        let after = live.range(addr..).next();
        if before.is_some_and(|(a, l)| a + l > addr) || after.is_some_and(|(a, _)| *a < addr + len)
        {
            findings.violation(format!("buffer {addr:#x}+{len} overlaps a live buffer"));
        }
        live.insert(addr, len);
    }

    fn remove(&self, addr: u64) {
        self.0.lock().unwrap().remove(&addr);
    }
}

struct Held {
    buffer: Buffer,
    pattern: u8,
}

/// What every holder task of one seed shares: the Governor and provider, the live buffers
/// and the findings.
#[derive(Clone)]
struct World {
    seed: u64,
    g: GovernorHandle,
    p: CpuProvider,
    live: Arc<Live>,
    findings: Arc<Findings>,
}

/// Holder `index`: buffers arrive in `inbox` and are handed on to `next`.
async fn holder(
    index: usize,
    world: World,
    mut inbox: mpsc::UnboundedReceiver<Held>,
    next: mpsc::UnboundedSender<Held>,
) {
    let World {
        seed,
        g,
        p,
        live,
        findings,
    } = world;
    let mut rng = Rng(seed.wrapping_mul(1_000_003) ^ index as u64);
    let me = g
        .register_holder(format!("h{index}"), rng.below(3) as u32, None)
        .await
        .unwrap();
    let mut held: Vec<Held> = Vec::new();
    let drop_held = |h: Held, live: &Live| {
        live.remove(h.buffer.view().addr);
        drop(h.buffer);
    };
    for op in 0..OPS {
        while let Ok(h) = inbox.try_recv() {
            held.push(h);
        }
        match rng.below(100) {
            0..=34 => {
                let bytes = 1 + rng.below(128 << 10);
                let request = AllocationRequest::new(bytes, MemoryRole::Workspace);
                let deadline = match rng.below(3) {
                    0 => None,
                    _ => Some(tokio::time::Instant::now() + Duration::from_millis(rng.below(30))),
                };
                let home = rng.below(2) as usize;
                match p.allocate(&g, me, &request, 0, deadline, home).await {
                    Ok(mut buffer) => {
                        findings.allocations.fetch_add(1, Ordering::Relaxed);
                        let view = buffer.view();
                        live.insert(view.addr, view.len, &findings);
                        let pattern = (index * 37 + op) as u8 | 1;
                        buffer.host_bytes_mut().unwrap().fill(pattern);
                        held.push(Held { buffer, pattern });
                    }
                    Err(_) => {
                        findings.denied.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            35..=59 if !held.is_empty() => {
                let stream = p.stream(rng.below(2) as usize).unwrap().clone();
                let first = rng.below(held.len() as u64) as usize;
                let second = rng.below(held.len() as u64) as usize;
                let mut picked = vec![first];
                if second != first {
                    picked.push(second);
                }
                let views: Vec<_> = picked
                    .iter()
                    .map(|i| (held[*i].buffer.view(), held[*i].pattern))
                    .collect();
                let uses: Vec<&dyn RecordUse> = picked
                    .iter()
                    .map(|i| &held[*i].buffer as &dyn RecordUse)
                    .collect();
                let spin = Duration::from_micros(rng.below(300));
                let findings = findings.clone();
                stream
                    .submit(&uses, move || {
                        let start = std::time::Instant::now();
                        while start.elapsed() < spin {
                            std::hint::spin_loop();
                        }
                        for (view, pattern) in views {
                            // SAFETY: every view's buffer is in `uses`, so it stays mapped
                            // until this kernel's fence; nothing writes it meanwhile.
                            #[allow(unsafe_code)]
                            let bytes = unsafe { common::read_by_address(&view) };
                            if bytes.iter().any(|b| *b != pattern) {
                                findings.corrupt.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        findings.kernels.fetch_add(1, Ordering::Relaxed);
                    })
                    .unwrap();
            }
            60..=79 if !held.is_empty() => {
                let i = rng.below(held.len() as u64) as usize;
                drop_held(held.swap_remove(i), &live);
            }
            80..=89 if !held.is_empty() => {
                let i = rng.below(held.len() as u64) as usize;
                // A holder that already finished hands it back: drop it here.
                if let Err(mpsc::error::SendError(h)) = next.send(held.swap_remove(i)) {
                    drop_held(h, &live);
                } else {
                    findings.handed_over.fetch_add(1, Ordering::Relaxed);
                }
            }
            _ => match rng.below(3) {
                0 => tokio::task::yield_now().await,
                _ => tokio::time::sleep(Duration::from_micros(rng.below(2000))).await,
            },
        }
    }
    inbox.close();
    while let Ok(h) = inbox.try_recv() {
        held.push(h);
    }
    for h in held {
        drop_held(h, &live);
    }
}

/// Samples the books and the kernel until `stop`.
async fn checker(
    g: GovernorHandle,
    p: CpuProvider,
    findings: Arc<Findings>,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::Acquire) {
        let Ok(first) = g.snapshot().await else {
            findings.violation("the Governor stopped answering".into());
            return;
        };
        let os = os_bytes(&p);
        let Ok(last) = g.snapshot().await else {
            findings.violation("the Governor stopped answering".into());
            return;
        };
        findings.samples.fetch_add(1, Ordering::Relaxed);
        for s in [&first, &last] {
            if s.books.approved() > s.books.capacity {
                findings.violation(format!(
                    "approved {} > capacity {}",
                    s.books.approved(),
                    s.books.capacity
                ));
            }
        }
        // With no grant between the two snapshots, the charged bytes only fell after the
        // first one, and memory is freed before it is refunded: the kernel's bytes in
        // between can be no more than the first snapshot's.
        if first.grants == last.grants {
            findings.exact_samples.fetch_add(1, Ordering::Relaxed);
            if os > first.books.approved() {
                findings.violation(format!(
                    "mapped but not charged: kernel {os} > approved {}",
                    first.books.approved()
                ));
            }
        }
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
}

async fn run_seed(seed: u64) -> (bool, Arc<Findings>) {
    let (g, p) = system(CAPACITY, 2).await;
    let findings = Arc::new(Findings::default());
    let live = Arc::new(Live::default());
    let stop = Arc::new(AtomicBool::new(false));
    let check = tokio::spawn(checker(
        g.clone(),
        p.clone(),
        findings.clone(),
        stop.clone(),
    ));
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..HOLDERS).map(|_| mpsc::unbounded_channel()).unzip();
    let tasks: Vec<_> = receivers
        .into_iter()
        .enumerate()
        .map(|(i, inbox)| {
            let next = senders[(i + 1) % HOLDERS].clone();
            let world = World {
                seed,
                g: g.clone(),
                p: p.clone(),
                live: live.clone(),
                findings: findings.clone(),
            };
            tokio::spawn(holder(i, world, inbox, next))
        })
        .collect();
    drop(senders);
    let mut finished = true;
    for t in tasks {
        match tokio::time::timeout(Duration::from_secs(60), t).await {
            Ok(r) => r.unwrap(),
            Err(_) => {
                findings.violation(format!("seed {seed}: a holder did not finish in 60 s"));
                finished = false;
            }
        }
    }
    let start = std::time::Instant::now();
    let mut settled = false;
    while start.elapsed() < Duration::from_secs(10) {
        let books = g.snapshot().await.unwrap().books;
        if books.approved() == 0 && os_bytes(&p) == 0 {
            settled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    stop.store(true, Ordering::Release);
    check.await.unwrap();
    if !settled {
        findings.violation(format!(
            "seed {seed}: books or kernel did not return to zero"
        ));
    }
    let report = p.shutdown().await.unwrap();
    if report.still_queued != 0 {
        findings.violation(format!(
            "seed {seed}: {} frees still queued",
            report.still_queued
        ));
    }
    let clean = finished
        && settled
        && findings.violations.lock().unwrap().is_empty()
        && findings.corrupt.load(Ordering::Relaxed) == 0;
    (clean, findings)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_interleavings_keep_every_invariant() {
    let seeds: u64 = std::env::var("PROCMEM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    let mut passed = 0;
    let (mut samples, mut exact, mut kernels, mut allocations, mut denied, mut handed) =
        (0, 0, 0, 0, 0, 0);
    for seed in 0..seeds {
        let (clean, f) = run_seed(seed).await;
        for v in f.violations.lock().unwrap().iter() {
            let _ = writeln!(std::io::stderr(), "seed {seed}: {v}");
        }
        let corrupt = f.corrupt.load(Ordering::Relaxed);
        if corrupt > 0 {
            let _ = writeln!(
                std::io::stderr(),
                "seed {seed}: {corrupt} kernels saw corrupt bytes"
            );
        }
        passed += clean as u64;
        samples += f.samples.load(Ordering::Relaxed);
        exact += f.exact_samples.load(Ordering::Relaxed);
        kernels += f.kernels.load(Ordering::Relaxed);
        allocations += f.allocations.load(Ordering::Relaxed);
        denied += f.denied.load(Ordering::Relaxed);
        handed += f.handed_over.load(Ordering::Relaxed);
    }
    let _ = writeln!(
        std::io::stderr(),
        "interleavings: {seeds} seeds, {allocations} allocations ({denied} denied), \
         {kernels} kernels checked, {handed} hand-overs, {samples} samples ({exact} exact)"
    );
    figure("seeded_interleavings", passed as usize, seeds as usize);
    assert_eq!(passed, seeds);
    assert!(
        allocations > 0 && kernels > 0 && exact > 0,
        "the seeds exercised nothing"
    );
}
