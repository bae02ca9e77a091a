//! Drops per second through the deferred-free path, and latency from fence completion to
//! the Governor refund (p50/p99). Writes `target/reports/deferred_free.json`.

mod common;

use std::time::{Duration, Instant};

use crossbeam_channel::bounded;
use procmem_actors::procmem::{AllocationRequest, MemoryMechanism, MemoryRole};
use procmem_actors::{
    governor::{GovernorConfig, GovernorHandle},
    provider::{CpuProvider, CpuProviderConfig, CpuStream, DeferredStats},
    Buffer,
};
use serde_json::json;

use common::{percentile, write_report};

const BUFFERS: usize = 20_000;
const BYTES: u64 = 4096;
const LATENCY_SAMPLES: usize = 2_000;

async fn make_buffers(g: &GovernorHandle, p: &CpuProvider, n: usize) -> Vec<Buffer> {
    let h = g.register_holder("bench", 0, None).await.unwrap();
    let request = AllocationRequest::new(BYTES, MemoryRole::Workspace);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(p.allocate(g, h, &request, 0, None, 0).await.unwrap());
    }
    out
}

async fn wait_refunded(g: &GovernorHandle) {
    while g.snapshot().await.unwrap().books.leased != 0 {
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
}

const CUDA_BUFFERS: usize = 2_000;
const CUDA_BYTES: u64 = 1 << 20;

/// The same two figures on a CUDA provider: each buffer is filled by an asynchronous memset,
/// its fence is an event the provider's poller thread synchronises on. Skipped, saying why,
/// without a driver or device.
async fn cuda_section(g: &GovernorHandle) -> serde_json::Value {
    use procmem_actors::procmem::cuda::{driver_present, CudaDevice};
    use procmem_actors::provider::{CudaProvider, CudaProviderConfig};
    if !driver_present() {
        return json!({"skipped": "no CUDA driver (libcuda cannot be loaded on this machine)"});
    }
    if CudaDevice::count() == 0 {
        return json!({"skipped": "a CUDA driver is present but reports no device"});
    }
    let p = CudaProvider::spawn(CudaProviderConfig::default())
        .await
        .unwrap();
    let stream = p.stream(0).unwrap().clone();
    let h = g.register_holder("bench-cuda", 0, None).await.unwrap();
    let request = AllocationRequest::new(CUDA_BYTES, MemoryRole::Workspace);
    let fill = |b: &Buffer| {
        let v = b.view();
        // SAFETY: the buffer is passed in `uses`, so it outlives the fill's fence.
        stream
            .submit(&[b], |s| unsafe { s.memset_async(v.addr, 1, v.len) })
            .unwrap()
    };
    let mut buffers = Vec::with_capacity(CUDA_BUFFERS);
    for _ in 0..CUDA_BUFFERS {
        buffers.push(p.allocate(g, h, &request, 0, None, 0).await.unwrap());
    }
    let last = buffers.iter().map(fill).last().unwrap();
    stream.host_wait(last);
    let start = Instant::now();
    drop(buffers);
    wait_refunded(g).await;
    let end_to_end = start.elapsed();

    let stats = || {
        let q = stream.deferred_free().clone();
        async move { q.stats().await.unwrap() }
    };
    let before = stats().await.fence_to_refund_ns.len();
    for _ in 0..LATENCY_SAMPLES / 4 {
        let b = p.allocate(g, h, &request, 0, None, 0).await.unwrap();
        let gate = stream.cuda().host_gate().unwrap();
        let fence = fill(&b);
        drop(b);
        stats().await;
        gate.open();
        stream.host_wait(fence);
        wait_refunded(g).await;
    }
    let all = stats().await;
    let mut latencies = all.fence_to_refund_ns[before..].to_vec();
    latencies.sort_unstable();
    let drained = p.shutdown().await.unwrap();
    json!({
        "buffers": CUDA_BUFFERS,
        "buffer_bytes": CUDA_BYTES,
        "drops_per_s": CUDA_BUFFERS as f64 / end_to_end.as_secs_f64(),
        "latency_samples": latencies.len(),
        "fence_to_refund_p50_ns": percentile(&latencies, 0.50),
        "fence_to_refund_p99_ns": percentile(&latencies, 0.99),
        "failures": all.failures,
        "still_queued_at_shutdown": drained.still_queued,
    })
}

/// Buffers whose last kernel already finished, dropped from one thread: how long the drop
/// calls took, and how long until the last refund reached the Governor.
async fn throughput(
    g: &GovernorHandle,
    p: &CpuProvider,
    stream: &CpuStream,
) -> (Duration, Duration) {
    let buffers = make_buffers(g, p, BUFFERS).await;
    let mut last = None;
    for b in &buffers {
        last = Some(stream.submit(&[b], || {}).unwrap());
    }
    stream.host_wait(last.unwrap());
    let start = Instant::now();
    drop(buffers);
    let drop_calls = start.elapsed();
    wait_refunded(g).await;
    (drop_calls, start.elapsed())
}

/// The stream's deferred-free figures.
async fn stats(s: &CpuStream) -> DeferredStats {
    s.deferred_free().clone().stats().await.unwrap()
}

/// Latency, one at a time: a buffer is dropped while its kernel waits on a gate, the drop is
/// known to be queued, the gate opens, and the fence completion is timed to the refund
/// reaching the Governor's mailbox. With `host_waiter`, a host thread blocked on the fence
/// (woken by the same completion) competes for the two cores with the free. Returns the
/// fence-to-refund and the in-place free times, sorted.
async fn one_at_a_time(
    g: &GovernorHandle,
    p: &CpuProvider,
    stream: &CpuStream,
    host_waiter: bool,
) -> (Vec<u64>, Vec<u64>) {
    let before = stats(stream).await.fence_to_refund_ns.len();
    for _ in 0..LATENCY_SAMPLES {
        let b = make_buffers(g, p, 1).await.pop().unwrap();
        let (open, wait) = bounded::<()>(0);
        let fence = stream.submit(&[&b], move || wait.recv().unwrap()).unwrap();
        drop(b);
        stats(stream).await;
        open.send(()).unwrap();
        if host_waiter {
            stream.host_wait(fence);
        }
        wait_refunded(g).await;
    }
    let s = stats(stream).await;
    let mut l = s.fence_to_refund_ns[before..].to_vec();
    let mut f = s.free_ns[before..].to_vec();
    l.sort_unstable();
    f.sort_unstable();
    (l, f)
}

/// The floor: the mechanism's own free of the same allocation (an unmap), timed alone on
/// this thread. Fence-to-refund cannot be below it: it frees, then refunds.
fn mechanism_floor(p: &CpuProvider) -> Vec<u64> {
    let mut floor = Vec::with_capacity(LATENCY_SAMPLES);
    let request = AllocationRequest::new(BYTES, MemoryRole::Workspace);
    for _ in 0..LATENCY_SAMPLES {
        let a = p.mechanism().allocator().allocate(&request).unwrap();
        let start = Instant::now();
        a.release().unwrap();
        floor.push(start.elapsed().as_nanos() as u64);
    }
    floor.sort_unstable();
    floor
}

/// Burst: many buffers waiting behind one gate, all fences completing at once; each waits
/// for the frees queued ahead of it. Returns their fence-to-refund times, sorted, and the
/// stream's failures.
async fn burst(g: &GovernorHandle, p: &CpuProvider, stream: &CpuStream) -> (Vec<u64>, u64) {
    let buffers = make_buffers(g, p, BUFFERS / 4).await;
    let (open, wait) = bounded::<()>(0);
    let first = stream.submit(&[], move || wait.recv().unwrap()).unwrap();
    for b in &buffers {
        stream.submit(&[b], || {}).unwrap();
    }
    drop(buffers);
    let before = stats(stream).await.fence_to_refund_ns.len();
    open.send(()).unwrap();
    stream.host_wait(first);
    wait_refunded(g).await;
    let all = stats(stream).await;
    let mut burst = all.fence_to_refund_ns[before..].to_vec();
    burst.sort_unstable();
    (burst, all.failures)
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let report = rt.block_on(async {
        let (g, _) = GovernorHandle::spawn(GovernorConfig::new("bench", 1 << 40))
            .await
            .unwrap();
        let p = CpuProvider::spawn(CpuProviderConfig {
            streams: 1,
            registry: None,
            ..Default::default()
        })
        .await
        .unwrap();
        let stream = p.stream(0).unwrap().clone();
        let (drop_calls, end_to_end) = throughput(&g, &p, &stream).await;
        let (latencies, in_place_free) = one_at_a_time(&g, &p, &stream, false).await;
        let (with_waiter, _) = one_at_a_time(&g, &p, &stream, true).await;
        let floor = mechanism_floor(&p);
        let (burst, failures) = burst(&g, &p, &stream).await;
        json!({
            "buffers": BUFFERS,
            "buffer_bytes": BYTES,
            "drops_per_s": BUFFERS as f64 / end_to_end.as_secs_f64(),
            "drop_calls_per_s": BUFFERS as f64 / drop_calls.as_secs_f64(),
            "latency_samples": latencies.len(),
            "fence_to_refund_p50_ns": percentile(&latencies, 0.50),
            "fence_to_refund_p99_ns": percentile(&latencies, 0.99),
            "fence_to_refund_with_host_waiter_p50_ns": percentile(&with_waiter, 0.50),
            "fence_to_refund_with_host_waiter_p99_ns": percentile(&with_waiter, 0.99),
            "free_in_place_p50_ns": percentile(&in_place_free, 0.50),
            "free_in_place_p99_ns": percentile(&in_place_free, 0.99),
            "fence_to_refund_less_free_p50_ns": percentile(&latencies, 0.50)
                .saturating_sub(percentile(&in_place_free, 0.50)),
            "mechanism_free_p50_ns": percentile(&floor, 0.50),
            "mechanism_free_p99_ns": percentile(&floor, 0.99),
            "fence_to_refund_vs_mechanism_free_p50": percentile(&latencies, 0.50) as f64
                / percentile(&floor, 0.50).max(1) as f64,
            "burst_buffers": burst.len(),
            "burst_fence_to_refund_p50_ns": percentile(&burst, 0.50),
            "burst_fence_to_refund_p99_ns": percentile(&burst, 0.99),
            "failures": failures,
            "cuda": cuda_section(&g).await,
        })
    });
    write_report("deferred_free", &report);
}
