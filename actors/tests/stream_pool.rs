//! Each CPU stream runs its kernels on a rayon pool of its own: a kernel's parallel calls
//! fork and join inside that pool (no hand-off to rayon's global pool and back), no two
//! streams share a worker, a panic inside a parallel call is one kernel's failure, and the
//! pool's threads go when the provider stops.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use procmem_actors::provider::{CpuProvider, CpuProviderConfig, CpuStream};
use rayon::prelude::*;

async fn provider(streams: usize, threads: usize) -> CpuProvider {
    CpuProvider::spawn(CpuProviderConfig {
        streams,
        threads,
        registry: None,
    })
    .await
    .unwrap()
}

/// What a kernel saw of where it ran: its thread's name, its index in a rayon pool, that
/// pool's size, and the names of the threads that did its parallel work.
#[derive(Debug, Default, Clone)]
struct Seen {
    thread: String,
    index: Option<usize>,
    pool: usize,
    workers: BTreeSet<String>,
}

fn thread_name() -> String {
    std::thread::current().name().unwrap_or("").to_owned()
}

/// Runs a kernel with a parallel call on `stream` and returns what it saw.
async fn seen_by_a_kernel(stream: &CpuStream) -> Seen {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let into = Arc::clone(&seen);
    let fence = stream
        .submit(&[], move || {
            let workers = Mutex::new(BTreeSet::new());
            (0..64).into_par_iter().for_each(|_| {
                std::thread::sleep(Duration::from_micros(200));
                workers.lock().unwrap().insert(thread_name());
            });
            *into.lock().unwrap() = Seen {
                thread: thread_name(),
                index: rayon::current_thread_index(),
                pool: rayon::current_num_threads(),
                workers: workers.into_inner().unwrap(),
            };
        })
        .unwrap();
    let s = stream.clone();
    tokio::task::spawn_blocking(move || s.host_wait(fence))
        .await
        .unwrap();
    let seen = seen.lock().unwrap().clone();
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_streams_kernels_and_their_parallel_calls_run_on_its_own_pool() {
    let p = provider(2, 3).await;
    let mut prefixes = Vec::new();
    for i in 0..2 {
        let stream = p.stream(i).unwrap();
        let prefix = format!("procmem-cpu-{}-w", stream.id().get());
        let seen = seen_by_a_kernel(stream).await;
        assert!(seen.thread.starts_with(&prefix), "{seen:?}");
        assert!(seen.index.is_some(), "the kernel runs on a pool worker");
        assert_eq!(
            seen.pool, 3,
            "the pool is the stream's, of the threads asked"
        );
        assert!(
            seen.workers.iter().all(|w| w.starts_with(&prefix)),
            "every piece of the parallel call ran in the stream's pool: {seen:?}"
        );
        prefixes.push(prefix);
    }
    assert_ne!(prefixes[0], prefixes[1], "no two streams share a pool");
    p.shutdown().await.unwrap();

    // Threads 0: the kernel runs on the stream's own thread, outside any pool.
    let p = provider(1, 0).await;
    let stream = p.stream(0).unwrap();
    let seen = seen_by_a_kernel(stream).await;
    assert_eq!(seen.thread, format!("procmem-cpu-{}", stream.id().get()));
    assert_eq!(seen.index, None);
    p.shutdown().await.unwrap();
}

/// Two streams' kernels take one lock and hold it across a parallel call. On one pool shared
/// by the streams, a worker waiting in one kernel's join could take up the other stream's
/// kernel and block on the lock its own stack holds; with a pool per stream every kernel
/// finishes, in order, and the sums are right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernels_holding_one_lock_across_parallel_calls_on_two_streams_all_finish() {
    let p = provider(2, 2).await;
    let lock = Arc::new(Mutex::new(Vec::new()));
    let mut last = Vec::new();
    for round in 0..40u64 {
        for i in 0..2 {
            let lock = Arc::clone(&lock);
            let fence = p
                .stream(i)
                .unwrap()
                .submit(&[], move || {
                    let mut done = lock.lock().unwrap();
                    let sum: u64 = (0..20_000u64).into_par_iter().map(|x| x * round).sum();
                    done.push((i, round, sum));
                })
                .unwrap();
            if round == 39 {
                last.push((p.stream(i).unwrap().clone(), fence));
            }
        }
    }
    let waited = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::task::spawn_blocking(move || {
            for (stream, fence) in last {
                stream.host_wait(fence);
            }
        }),
    )
    .await;
    assert!(waited.is_ok(), "every kernel finished");
    let done = lock.lock().unwrap().clone();
    assert_eq!(done.len(), 80);
    for i in 0..2 {
        let rounds: Vec<u64> = done
            .iter()
            .filter(|d| d.0 == i)
            .map(|&(_, round, sum)| {
                assert_eq!(sum, round * (20_000 * 19_999 / 2));
                round
            })
            .collect();
        assert_eq!(rounds, (0..40).collect::<Vec<_>>(), "each stream in order");
    }
    p.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_inside_a_parallel_call_fails_that_kernel_alone() {
    let p = provider(1, 2).await;
    let stream = p.stream(0).unwrap().clone();
    stream
        .submit(&[], || {
            (0..1_000).into_par_iter().for_each(|i| {
                if i == 517 {
                    panic!("a piece of a parallel kernel fails");
                }
            });
        })
        .unwrap();
    let seen = seen_by_a_kernel(&stream).await;
    assert_eq!(stream.kernel_panics(), 1);
    assert!(
        seen.index.is_some(),
        "the stream goes on in its pool: {seen:?}"
    );
    p.shutdown().await.unwrap();
}

/// The threads of this process whose name the kernel keeps as `comm` (15 bytes of it).
fn threads_named(name: &str) -> usize {
    let comm: String = name.chars().take(15).collect();
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.trim_end() == comm)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_provider_leaves_no_pool_threads() {
    let p = provider(1, 3).await;
    let stream = p.stream(0).unwrap().clone();
    let name = format!("procmem-cpu-{}-w0", stream.id().get());
    seen_by_a_kernel(&stream).await;
    assert!(threads_named(&name) >= 1, "the pool is there while it runs");
    p.shutdown().await.unwrap();
    drop(stream);
    let start = Instant::now();
    while threads_named(&name) > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{name}: the pool's threads are still there"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A count of streams or of threads per stream like `usize::MAX`, or a product of the two past
/// the bound, is refused, typed, before any thread starts (it used to start threads until the
/// OS refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_of_threads_or_streams_beyond_the_bound_are_refused() {
    use procmem_actors::procmem::MemoryError;
    use procmem_actors::provider::{ProviderError, MAX_STREAMS, MAX_THREADS};
    for (streams, threads) in [
        (1, usize::MAX),
        (usize::MAX, 1),
        (usize::MAX, usize::MAX),
        (MAX_STREAMS + 1, 0),
        (1, MAX_STREAMS + 1),
        // Each within its own bound, a million threads in all.
        (MAX_STREAMS, MAX_STREAMS),
        (MAX_THREADS / 4, 4),
    ] {
        let refused = CpuProvider::spawn(CpuProviderConfig {
            streams,
            threads,
            registry: None,
        })
        .await;
        assert!(
            matches!(
                refused,
                Err(ProviderError::Memory(MemoryError::Unsupported { .. }))
            ),
            "streams {streams}, threads {threads}: {:?}",
            refused.err()
        );
    }
    // At the bound's edge for streams with no pool threads, a provider starts.
    let p = provider(2, 0).await;
    p.shutdown().await.unwrap();
}
