//! Quick versions of the reliability figures (the full runs are `scripts/reliability.sh`):
//! a holder killed at every message of a scripted scenario, and a stress run of 64 holders
//! under a budget twice oversubscribed with every allocation's pattern checked at free.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use procmem_actors::core::kv::KvShape;
use procmem_actors::core::{AllocationRequest, MemoryRole};
use procmem_actors::{
    AttendItem, CpuProvider, CpuProviderConfig, GovernorConfig, GovernorHandle, KvStoreConfig,
    KvStoreHandle, PreemptMode, ResidencyArgs, ResidencyConfig, ResidencyHandle,
};

fn figure(name: &str, passed: usize, total: usize) {
    let _ = writeln!(std::io::stderr(), "FIGURE {name} {passed}/{total}");
}

const SHAPE: KvShape = KvShape {
    layers: 2,
    q_heads: 4,
    kv_heads: 2,
    head_dim: 16,
    max_tokens: 128,
};

enum Msg {
    Open(u64),
    Prepare(Vec<u64>),
    Attend(usize, Vec<u64>),
    Close(u64),
}

fn script() -> Vec<Msg> {
    let mut s = vec![Msg::Open(1), Msg::Open(2)];
    for _ in 0..4 {
        s.push(Msg::Prepare(vec![1, 2]));
        s.push(Msg::Attend(0, vec![1, 2]));
        s.push(Msg::Attend(1, vec![1, 2]));
    }
    s.push(Msg::Close(1));
    s
}

/// Waits for the Governor and the kernel to agree that nothing is held.
async fn settles_to_zero(g: &GovernorHandle, p: &CpuProvider) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        let books = g.snapshot().await.unwrap().books;
        let os = p.mechanism().backing().resident_bytes().unwrap()
            + p.mechanism().host_allocator().resident_total().unwrap();
        if books.provisional == 0 && books.leased == 0 && os == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_store_killed_at_every_message_frees_everything_after_its_fences() {
    let n = script().len();
    let mut passed = 0;
    for kill_at in 0..=n {
        let (g, _) = GovernorHandle::spawn(GovernorConfig::new("host", 1 << 30))
            .await
            .unwrap();
        let p = CpuProvider::spawn(CpuProviderConfig::default())
            .await
            .unwrap();
        let config = KvStoreConfig {
            name: "kv".into(),
            priority: 0,
            shape: SHAPE,
            chunk_granules: 1,
            preempt: PreemptMode::Recompute,
            wait: Duration::from_millis(100),
        };
        let (kv, _) = KvStoreHandle::spawn(config, g.clone(), p.clone())
            .await
            .unwrap();
        let tf = SHAPE.token_floats();
        for (i, msg) in script().into_iter().enumerate() {
            if i == kill_at {
                kv.actor().kill();
                break;
            }
            let item = |s: u64| AttendItem {
                seq: s,
                q: vec![0.1; 64],
                k: vec![0.2; tf],
                v: vec![0.3; tf],
            };
            let _ = match msg {
                Msg::Open(s) => kv.open(s, vec![], 0).await.map(drop),
                Msg::Prepare(s) => kv.prepare(s).await,
                Msg::Attend(l, s) => kv
                    .attend(l, s.into_iter().map(item).collect())
                    .await
                    .map(drop),
                Msg::Close(s) => {
                    kv.close(s);
                    Ok(())
                }
            };
        }
        if kill_at == n {
            kv.actor().kill();
        }
        let ok = settles_to_zero(&g, &p).await;
        if !ok {
            let _ = writeln!(
                std::io::stderr(),
                "kv store killed at message {kill_at}: books did not settle"
            );
        }
        passed += ok as usize;
    }
    figure("actor_death_kv_store", passed, n + 1);
    assert_eq!(passed, n + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn residency_killed_at_every_message_frees_everything_after_its_fences() {
    let n = 6;
    let mut passed = 0;
    for kill_at in 0..=n {
        let (g, _) = GovernorHandle::spawn(GovernorConfig::new("host", 1 << 30))
            .await
            .unwrap();
        let p = CpuProvider::spawn(CpuProviderConfig::default())
            .await
            .unwrap();
        let args = ResidencyArgs {
            config: ResidencyConfig {
                name: "w".into(),
                priority: 1,
                wait: Duration::from_millis(100),
            },
            device: g.clone(),
            host: None,
            provider: p.clone(),
        };
        let (r, _) = ResidencyHandle::spawn(args).await.unwrap();
        for i in 0..n {
            if i == kill_at {
                r.actor().kill();
                break;
            }
            if i < 3 {
                let _ = r.load(i, vec![i as u8; 8192], false).await;
            } else {
                let _ = r.with_weights(i - 3, |w| w.len()).await;
            }
        }
        if kill_at == n {
            r.actor().kill();
        }
        passed += settles_to_zero(&g, &p).await as usize;
    }
    figure("actor_death_residency", passed, n + 1);
    assert_eq!(passed, n + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_holders_twice_oversubscribed_lose_nothing() {
    const HOLDERS: usize = 64;
    const ROUNDS: usize = 20;
    const BYTES: u64 = 64 * 1024;
    // Each holder keeps two buffers at once: demand is twice the budget.
    let budget = HOLDERS as u64 * BYTES;
    let (g, _) = GovernorHandle::spawn(GovernorConfig::new("host", budget))
        .await
        .unwrap();
    let p = CpuProvider::spawn(CpuProviderConfig {
        streams: 2,
        registry: None,
    })
    .await
    .unwrap();
    let checked = Arc::new(AtomicU64::new(0));
    let corrupt = Arc::new(AtomicU64::new(0));
    let denied = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..HOLDERS)
        .map(|h| {
            let (g, p, checked, corrupt, denied) = (
                g.clone(),
                p.clone(),
                checked.clone(),
                corrupt.clone(),
                denied.clone(),
            );
            tokio::spawn(async move {
                let holder = g.register_holder(format!("h{h}"), 0, None).await.unwrap();
                let mut held = Vec::new();
                for round in 0..ROUNDS {
                    let request = AllocationRequest::new(BYTES, MemoryRole::Workspace);
                    let deadline = Some(tokio::time::Instant::now() + Duration::from_millis(500));
                    match p
                        .allocate(&g, holder, &request, 0, deadline, round % 2)
                        .await
                    {
                        Ok(mut b) => {
                            let pattern = (h * 31 + round) as u8;
                            b.host_bytes_mut().unwrap().fill(pattern);
                            held.push((b, pattern));
                        }
                        Err(_) => {
                            denied.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    if held.len() >= 2 || round + 1 == ROUNDS {
                        // Hand the buffer to another thread, which checks it and drops it there.
                        let (b, pattern) = held.remove(0);
                        let (checked, corrupt) = (checked.clone(), corrupt.clone());
                        std::thread::spawn(move || {
                            let ok = b.host_bytes().unwrap().iter().all(|x| *x == pattern);
                            if ok {
                                checked.fetch_add(1, Ordering::Relaxed);
                            } else {
                                corrupt.fetch_add(1, Ordering::Relaxed);
                            }
                            drop(b);
                        })
                        .join()
                        .unwrap();
                    }
                }
                for (b, pattern) in held {
                    let ok = b.host_bytes().unwrap().iter().all(|x| *x == pattern);
                    (if ok { &checked } else { &corrupt }).fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .expect("no deadlock")
            .unwrap();
    }
    let settled = settles_to_zero(&g, &p).await;
    let (checked, corrupt, denied) = (
        checked.load(Ordering::Relaxed),
        corrupt.load(Ordering::Relaxed),
        denied.load(Ordering::Relaxed),
    );
    let _ = writeln!(
        std::io::stderr(),
        "stress: {checked} allocations checked, {corrupt} corrupt, {denied} denied, {:?}",
        start.elapsed()
    );
    figure("stress_64_holders", (settled && corrupt == 0) as usize, 1);
    assert_eq!(corrupt, 0, "a pattern changed before free");
    assert!(
        settled,
        "bytes were lost: the books or the OS did not return to zero"
    );
    assert!(checked > 0);
}
