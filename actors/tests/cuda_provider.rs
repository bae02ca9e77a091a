//! The CUDA execution provider: event fences observed from the host, deferred free after
//! them. Skipped, saying so, where no CUDA driver or device exists.

mod common;

use common::leased;

use std::io::Write;
use std::time::{Duration, Instant};

use procmem_actors::procmem::cuda::{driver_present, CudaDevice};
use procmem_actors::procmem::ledger::HolderId;
use procmem_actors::procmem::{AllocationRequest, MemoryError, MemoryRole};
use procmem_actors::{
    governor::{GovernorConfig, GovernorHandle},
    provider::{CudaProvider, CudaProviderConfig, ProviderError},
};

fn skipped(test: &str, why: &str) {
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

fn have_gpu(test: &str) -> bool {
    if !driver_present() {
        skipped(
            test,
            "no CUDA driver (libcuda cannot be loaded on this machine)",
        );
        return false;
    }
    if CudaDevice::count() == 0 {
        skipped(test, "a CUDA driver is present but reports no device");
        return false;
    }
    true
}

async fn setup(streams: usize) -> (GovernorHandle, HolderId, CudaProvider) {
    let (g, _) = GovernorHandle::spawn(GovernorConfig::new("cuda:0", 64 << 30))
        .await
        .unwrap();
    let h = g.register_holder("test", 0, None).await.unwrap();
    let config = CudaProviderConfig {
        streams,
        ..CudaProviderConfig::default()
    };
    (g, h, CudaProvider::spawn(config).await.unwrap())
}

async fn freed(p: &CudaProvider, stream: usize) -> u64 {
    p.stream(stream)
        .unwrap()
        .deferred_free()
        .stats()
        .await
        .unwrap()
        .freed
}

#[tokio::test]
async fn without_a_driver_the_provider_says_so() {
    if driver_present() {
        skipped(
            "without_a_driver_the_provider_says_so",
            "a CUDA driver is present",
        );
        return;
    }
    let err = CudaProvider::spawn(CudaProviderConfig::default())
        .await
        .unwrap_err();
    assert!(
        matches!(err, ProviderError::Memory(MemoryError::NoCudaDriver { .. })),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_memory_is_freed_only_after_its_event_then_refunded() {
    if !have_gpu("cuda_memory_is_freed_only_after_its_event_then_refunded") {
        return;
    }
    const BYTES: u64 = 8 << 20;
    let (g, h, p) = setup(2).await;
    let request = AllocationRequest::new(BYTES, MemoryRole::Workspace);
    let src = p.allocate(&g, h, &request, 0, None, 0).await.unwrap();
    let dst = p.allocate(&g, h, &request, 0, None, 0).await.unwrap();
    let footprint = src.charged_bytes();
    let device = p.mechanism().device().clone();
    let pattern = vec![0xC3u8; BYTES as usize];
    // SAFETY: `src` is a live device allocation of BYTES bytes.
    unsafe { device.copy_to_device(src.view().addr, &pattern).unwrap() };
    let s0 = p.stream(0).unwrap();
    // Hold stream 0 on a host gate, then copy src -> dst behind it.
    let gate = s0.cuda().host_gate().unwrap();
    let (s, d) = (src.view(), dst.view());
    // SAFETY: both buffers are passed in `uses`, so they outlive the copy's fence.
    let fence = s0
        .submit(&[&src, &dst], |stream| unsafe {
            stream.copy_async(d.addr, s.addr, BYTES)
        })
        .unwrap();
    drop(src);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        freed(&p, 0).await,
        0,
        "freed while the copy is still queued"
    );
    assert_eq!(
        leased(&g).await,
        2 * footprint,
        "refunded while the copy is still queued"
    );
    gate.open();
    s0.host_wait(fence);
    let start = Instant::now();
    while leased(&g).await != footprint {
        assert!(start.elapsed() < Duration::from_secs(30), "never refunded");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(freed(&p, 0).await, 1);
    let mut back = vec![0u8; BYTES as usize];
    // SAFETY: `dst` is alive and the copy's fence completed.
    unsafe { device.copy_to_host(&mut back, dst.view().addr).unwrap() };
    assert!(back == pattern, "the copy read the source intact");
    drop(dst);
    let report = p.shutdown().await.unwrap();
    assert_eq!(report.still_queued, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_buffer_used_on_two_streams_waits_for_both() {
    if !have_gpu("cuda_buffer_used_on_two_streams_waits_for_both") {
        return;
    }
    let (g, h, p) = setup(2).await;
    let request = AllocationRequest::new(4 << 20, MemoryRole::Workspace);
    let buf = p.allocate(&g, h, &request, 0, None, 0).await.unwrap();
    let view = buf.view();
    let (s0, s1) = (p.stream(0).unwrap(), p.stream(1).unwrap());
    // Only stream 1 is held: the driver may run host functions of different streams on one
    // thread, so a second gate could block the first one's release.
    let gate1 = s1.cuda().host_gate().unwrap();
    // SAFETY: the buffer is in `uses` for both submissions.
    let f0 = s0
        .submit(&[&buf], |s| unsafe {
            s.memset_async(view.addr, 1, view.len)
        })
        .unwrap();
    let f1 = s1
        .submit(&[&buf], |s| unsafe {
            s.memset_async(view.addr, 2, view.len)
        })
        .unwrap();
    drop(buf);
    s0.host_wait(f0);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        freed(&p, 0).await + freed(&p, 1).await,
        0,
        "freed while stream 1 still uses it"
    );
    gate1.open();
    s1.host_wait(f1);
    let start = Instant::now();
    while leased(&g).await != 0 {
        assert!(start.elapsed() < Duration::from_secs(30), "never refunded");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A buffer queued behind a pending copy survives its deferred-free actor's death: the
/// orphaned allocation is freed by a thread of its own once the event fence completes, never
/// before, and the refund still reaches the Governor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_free_queued_when_its_deferred_free_actor_dies_waits_for_the_event() {
    if !have_gpu("cuda_free_queued_when_its_deferred_free_actor_dies_waits_for_the_event") {
        return;
    }
    const BYTES: u64 = 8 << 20;
    let (g, h, p) = setup(1).await;
    let request = AllocationRequest::new(BYTES, MemoryRole::Workspace);
    let buf = p.allocate(&g, h, &request, 0, None, 0).await.unwrap();
    let footprint = buf.charged_bytes();
    let s0 = p.stream(0).unwrap();
    let gate = s0.cuda().host_gate().unwrap();
    let view = buf.view();
    // SAFETY: the buffer is in `uses`, so it outlives the fill's fence.
    let fence = s0
        .submit(&[&buf], |s| unsafe {
            s.memset_async(view.addr, 7, view.len)
        })
        .unwrap();
    drop(buf);
    let queued = s0.deferred_free().stats().await.unwrap().queued;
    assert_eq!(queued, 1, "the buffer waits in the queue");
    s0.deferred_free().actor().kill();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        leased(&g).await,
        footprint,
        "freed (and refunded) while the fill is still queued"
    );
    gate.open();
    s0.host_wait(fence);
    let start = Instant::now();
    while leased(&g).await != 0 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the orphaned allocation was never freed"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let report = p.shutdown().await.unwrap();
    assert_eq!(report.lost_queues, 1);
}

/// The manager with a CUDA device: a device authority of its own (the H200 is discrete), a
/// binding that charges it, device memory the driver sees, and the books at zero after
/// shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_manager_binding_charges_the_device_authority() {
    use procmem_actors::procmem::{MemoryTier, Place};
    use procmem_actors::MemoryManager;
    if !have_gpu("cuda_manager_binding_charges_the_device_authority") {
        return;
    }
    const BYTES: u64 = 256 << 20;
    let memory = MemoryManager::builder()
        .host_budget(64 << 20)
        .cuda_device(0, 1 << 30)
        .build()
        .await
        .unwrap();
    let names: Vec<_> = memory
        .authorities()
        .iter()
        .map(|a| a.name.clone())
        .collect();
    assert_eq!(names.len(), 2, "host and device authorities: {names:?}");
    let binding = memory.binding(Place::cuda(0), MemoryTier::Device).unwrap();
    let caps = binding.capabilities();
    assert!(caps.virtual_backing && caps.shared_mapping, "{caps:?}");
    let holder = binding
        .governor()
        .register_holder("scratch", 0, None)
        .await
        .unwrap();
    let device = CudaDevice::open(0).unwrap();
    let free_before = device.mem_info().unwrap().free;
    let request = AllocationRequest::new(BYTES, MemoryRole::Workspace);
    let buffer = binding.allocate(holder, &request, 0, None).await.unwrap();
    let free_during = device.mem_info().unwrap().free;
    assert!(
        free_before - free_during >= BYTES,
        "the driver sees the allocation"
    );
    let books = binding.governor().snapshot().await.unwrap().books;
    assert_eq!(books.leased, buffer.charged_bytes());
    assert!(buffer.charged_bytes() >= BYTES);
    drop(buffer);
    let report = memory.shutdown().await.unwrap();
    assert!(report.is_zero(), "{report}");
}
