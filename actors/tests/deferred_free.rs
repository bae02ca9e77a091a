//! Release ordering with real streams: nothing is freed before every fence that used it has
//! completed, the mechanism frees before the Governor is refunded, and drops never block.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};
use procmem_actors::procmem::ledger::HolderId;
use procmem_actors::procmem::{AllocationRequest, MemoryRole};
use procmem_actors::{
    governor::{GovernorConfig, GovernorHandle},
    provider::{CpuProvider, CpuProviderConfig},
    Buffer,
};

mod common;

use common::is_mapped;
use common::leased;

const MIB: u64 = 1 << 20;

async fn setup(streams: usize) -> (GovernorHandle, HolderId, CpuProvider) {
    let (g, _) = GovernorHandle::spawn(GovernorConfig::new("host", 8 << 30))
        .await
        .unwrap();
    let holder = g.register_holder("test", 0, None).await.unwrap();
    let provider = CpuProvider::spawn(CpuProviderConfig {
        streams,
        registry: None,
        ..Default::default()
    })
    .await
    .unwrap();
    (g, holder, provider)
}

async fn buffer(
    g: &GovernorHandle,
    h: HolderId,
    p: &CpuProvider,
    bytes: u64,
    home: usize,
) -> Buffer {
    let request = AllocationRequest::new(bytes, MemoryRole::Workspace);
    p.allocate(g, h, &request, 0, None, home).await.unwrap()
}

fn gate() -> (Sender<()>, Receiver<()>) {
    bounded(1)
}

/// A kernel that waits for its gate, then checks every byte of the buffer still holds the
/// pattern. If the memory were unmapped first it would fault; if reused, the check fails.
fn checking_kernel(
    buf: &Buffer,
    pattern: u8,
    open: Receiver<()>,
    ok: Arc<AtomicBool>,
) -> impl FnOnce() + Send + 'static {
    let view = buf.view();
    move || {
        open.recv().unwrap();
        // SAFETY: the buffer was passed in `uses`, so it stays mapped until this kernel's fence.
        let bytes = unsafe { common::read_by_address(&view) };
        ok.store(bytes.iter().all(|b| *b == pattern), Ordering::SeqCst);
    }
}

/// Polls until the refund arrives; fails if the Governor were ever refunded while the
/// provider's memory was still mapped (refund before free), and returns how long it took.
/// "Mapped" is asked of the provider's own allocator (its live ranges, through mincore), not of
/// an address, which another test running beside this one may map again once it is free.
async fn await_refund_after_free(g: &GovernorHandle, p: &CpuProvider) -> Duration {
    let start = Instant::now();
    loop {
        // Books first, then memory: memory still mapped after a zero was read means the
        // refund came before the free (the other order could catch a free and refund landing
        // between the two reads).
        let held = leased(g).await;
        let mapped = p.mechanism().host_allocator().resident_total().unwrap() > 0;
        assert!(
            !(mapped && held == 0),
            "the Governor was refunded before the memory was freed"
        );
        if held == 0 {
            assert_eq!(p.mechanism().host_allocator().resident_total().unwrap(), 0);
            return start.elapsed();
        }
        assert!(start.elapsed() < Duration::from_secs(30), "never refunded");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_freed_before_its_fence_then_freed_then_refunded() {
    let (g, h, p) = setup(1).await;
    let mut buf = buffer(&g, h, &p, 4 * MIB, 0).await;
    buf.host_bytes_mut().unwrap().fill(0x5A);
    let addr = buf.view().addr;
    let (open, wait) = gate();
    let ok = Arc::new(AtomicBool::new(false));
    let fence = p
        .stream(0)
        .unwrap()
        .submit(&[&buf], checking_kernel(&buf, 0x5A, wait, ok.clone()))
        .unwrap();
    drop(buf);
    // The kernel is still running: the drop only queued the buffer.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(is_mapped(addr), "freed while the kernel still reads it");
    assert_eq!(
        leased(&g).await,
        4 * MIB,
        "refunded while the kernel still reads it"
    );
    let stats = p.stream(0).unwrap().deferred_free().stats().await.unwrap();
    assert_eq!((stats.queued, stats.freed), (1, 0));
    open.send(()).unwrap();
    p.stream(0).unwrap().host_wait(fence);
    await_refund_after_free(&g, &p).await;
    assert!(
        ok.load(Ordering::SeqCst),
        "the kernel saw its bytes intact until the end"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_used_on_two_streams_waits_for_both() {
    let (g, h, p) = setup(2).await;
    let mut buf = buffer(&g, h, &p, 2 * MIB, 0).await;
    buf.host_bytes_mut().unwrap().fill(7);
    let addr = buf.view().addr;
    let (open_a, wait_a) = gate();
    let (open_b, wait_b) = gate();
    let (ok_a, ok_b) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let fa = p
        .stream(0)
        .unwrap()
        .submit(&[&buf], checking_kernel(&buf, 7, wait_a, ok_a.clone()))
        .unwrap();
    let fb = p
        .stream(1)
        .unwrap()
        .submit(&[&buf], checking_kernel(&buf, 7, wait_b, ok_b.clone()))
        .unwrap();
    assert_eq!(buf.fences().len(), 2);
    drop(buf);
    open_a.send(()).unwrap();
    p.stream(0).unwrap().host_wait(fa);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        is_mapped(addr),
        "freed after one stream while the other still reads it"
    );
    assert_eq!(leased(&g).await, 2 * MIB);
    open_b.send(()).unwrap();
    p.stream(1).unwrap().host_wait(fb);
    await_refund_after_free(&g, &p).await;
    assert!(ok_a.load(Ordering::SeqCst) && ok_b.load(Ordering::SeqCst));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drops_from_many_threads_never_block_and_lose_nothing() {
    const THREADS: usize = 8;
    const PER_THREAD: usize = 50;
    let (g, h, p) = setup(2).await;
    let (open, wait) = bounded::<()>(THREADS * PER_THREAD);
    let ran = Arc::new(AtomicU64::new(0));
    let mut batches: Vec<Vec<Buffer>> = (0..THREADS).map(|_| Vec::new()).collect();
    for i in 0..THREADS * PER_THREAD {
        let buf = buffer(&g, h, &p, 64 * 1024 + i as u64, i % 2).await;
        let (wait, ran) = (wait.clone(), ran.clone());
        p.stream(i % 2)
            .unwrap()
            .submit(&[&buf], move || {
                wait.recv().unwrap();
                ran.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        batches[i % THREADS].push(buf);
    }
    let charged = leased(&g).await;
    assert!(charged >= (THREADS * PER_THREAD) as u64 * 64 * 1024);
    // Every kernel is blocked on its gate: a drop that waited for its fence would hang here.
    let droppers: Vec<_> = batches
        .into_iter()
        .map(|batch| std::thread::spawn(move || drop(batch)))
        .collect();
    for d in droppers {
        d.join().unwrap();
    }
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "no kernel ran before the drops returned"
    );
    assert_eq!(
        leased(&g).await,
        charged,
        "nothing refunded while kernels are pending"
    );
    for _ in 0..THREADS * PER_THREAD {
        open.send(()).unwrap();
    }
    let start = Instant::now();
    while leased(&g).await != 0 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "bytes lost: {} still leased",
            leased(&g).await
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut freed = 0;
    let mut freed_bytes = 0;
    for s in 0..2 {
        let stats = p.stream(s).unwrap().deferred_free().stats().await.unwrap();
        freed += stats.freed;
        freed_bytes += stats.freed_bytes;
        assert_eq!(stats.failures, 0);
    }
    assert_eq!(freed, (THREADS * PER_THREAD) as u64);
    assert_eq!(freed_bytes, charged, "every byte came back to the Governor");
    assert_eq!(p.mechanism().host_allocator().take_drop_errors().len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wrong_context_can_never_free_a_buffer() {
    let (g, h, p) = setup(1).await;
    let other = CpuProvider::spawn(CpuProviderConfig::default())
        .await
        .unwrap();
    let buf = buffer(&g, h, &p, MIB, 0).await;
    let addr = buf.view().addr;
    let refused = other.free(buf).unwrap_err();
    assert_eq!(
        (refused.owner, refused.this),
        (p.context(), other.context())
    );
    assert!(is_mapped(addr), "the refusal left the buffer alone");
    assert_eq!(leased(&g).await, MIB);
    // The mechanism level refuses too: another allocator hands a foreign allocation back.
    let foreign = other.mechanism().host_allocator();
    let own = p.mechanism().host_allocator();
    let a = procmem_actors::procmem::Allocator::allocate(
        own,
        &AllocationRequest::new(4096, MemoryRole::Other),
    )
    .unwrap();
    let back = match procmem_actors::procmem::Allocator::free(foreign, a) {
        Err(procmem_actors::procmem::FreeError::Refused(r)) => r.handle,
        other => panic!("a foreign free must be refused: {other:?}"),
    };
    assert!(procmem_actors::procmem::Allocator::free(own, back).is_ok());
    p.free(refused.buffer).unwrap();
    await_refund_after_free(&g, &p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_runs_submitted_work_then_drains_in_order() {
    let (g, h, p) = setup(1).await;
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    for i in 0..5u64 {
        let buf = buffer(&g, h, &p, MIB, 0).await;
        let order = order.clone();
        p.stream(0)
            .unwrap()
            .submit(&[&buf], move || {
                std::thread::sleep(Duration::from_millis(5));
                order.lock().unwrap().push(i);
            })
            .unwrap();
    }
    let report = p.shutdown().await.unwrap();
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
    assert_eq!(report.freed, 5);
    assert_eq!(report.freed_bytes, 5 * MIB);
    assert_eq!(report.still_queued, 0);
    let start = Instant::now();
    while leased(&g).await != 0 {
        assert!(start.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        p.stream(0).unwrap().submit(&[], || {}).is_err(),
        "a stopped stream refuses work"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_kernel_still_completes_its_fence_and_frees() {
    let (g, h, p) = setup(1).await;
    let buf = buffer(&g, h, &p, MIB, 0).await;
    let fence = p
        .stream(0)
        .unwrap()
        .submit(&[&buf], || panic!("kernel failure"))
        .unwrap();
    drop(buf);
    p.stream(0).unwrap().host_wait(fence);
    await_refund_after_free(&g, &p).await;
    assert_eq!(p.stream(0).unwrap().kernel_panics(), 1);
}

/// A host kernel reads through `submit_reading`: it is handed the bytes of every buffer it
/// reads (no `unsafe` anywhere), the buffers are not freed before its fence, a buffer cannot
/// be written while a kernel reads it, and every byte comes back once the kernel is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_kernel_reads_safe_slices_that_outlive_the_buffers_drop() {
    let (g, h, p) = setup(1).await;
    let stream = p.stream(0).unwrap().clone();
    let mut a = buffer(&g, h, &p, MIB, 0).await;
    let mut b = buffer(&g, h, &p, 2 * MIB, 0).await;
    a.host_bytes_mut().unwrap().fill(1);
    b.host_bytes_mut().unwrap().fill(2);
    let (open, wait) = gate();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = Arc::clone(&seen);
    // The same buffer twice in one batch is two reads of it.
    let fence = stream
        .submit_reading(&[&a, &b, &a], move |bytes| {
            wait.recv().unwrap();
            let sums: Vec<(usize, u64)> = bytes
                .iter()
                .map(|s| (s.len(), s.iter().map(|x| u64::from(*x)).sum()))
                .collect();
            *sink.lock().unwrap() = sums;
        })
        .unwrap();
    // While the kernel runs, the buffer cannot be written (it would race the reader): the
    // write waits for the fence, so try it from a thread and see it is still waiting.
    let writer = std::thread::spawn(move || {
        a.host_bytes_mut().unwrap().fill(9);
        a
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !writer.is_finished(),
        "a write waits for the reading kernel"
    );
    drop(b);
    assert!(
        leased(&g).await >= 3 * MIB,
        "nothing refunded while the kernel reads"
    );
    open.send(()).unwrap();
    stream.host_wait(fence);
    let a = writer.join().unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            (MIB as usize, MIB),
            (2 * MIB as usize, 4 * MIB),
            (MIB as usize, MIB)
        ]
    );
    drop(a);
    await_refund_after_free(&g, &p).await;
}
