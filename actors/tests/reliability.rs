//! A stress run of 64 holders under a budget twice oversubscribed with every allocation's
//! pattern checked at free (actor death is in `actor_death.rs`, interleavings in
//! `interleavings.rs`; `scripts/reliability.sh` runs them all).

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use procmem_actors::procmem::{AllocationRequest, MemoryRole};

mod common;
use common::{figure, settles_to_zero, system};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_holders_twice_oversubscribed_lose_nothing() {
    const HOLDERS: usize = 64;
    const ROUNDS: usize = 20;
    const BYTES: u64 = 64 * 1024;
    // Each holder keeps two buffers at once: demand is twice the budget.
    let budget = HOLDERS as u64 * BYTES;
    let (g, p) = system(budget, 2).await;
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
