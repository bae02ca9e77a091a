//! Defect 1 of issue 11: a buffer from provider A used by a kernel on a stream of provider B
//! (each provider with its own stream registry, as `MemoryManager::build` makes the host and
//! CUDA providers: a host staging buffer read by a CUDA copy is this case). Before the fix
//! A's deferred-free actor asked its own registry for B's stream, was told "complete"
//! (`u64::MAX`), and unmapped and refunded the buffer while B's kernel still read it; with one
//! shared registry a context assert killed the actor instead. Both arrangements are tried,
//! with the buffer dropped before and after the kernel starts, on either of A's streams.

mod common;

use common::leased;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::bounded;
use procmem_actors::procmem::{AllocationRequest, MemoryRole};
use procmem_actors::{
    governor::{GovernorConfig, GovernorHandle},
    provider::{CpuProvider, CpuProviderConfig},
};

use common::{figure, is_mapped};

const BYTES: u64 = 1 << 20;

/// One case: returns true if the buffer stayed mapped, charged and intact for the whole of
/// B's kernel and was freed and refunded after it.
async fn case(shared_registry: bool, drop_first: bool, home: usize) -> bool {
    let (g, _) = GovernorHandle::spawn(GovernorConfig::new("host", 1 << 30))
        .await
        .unwrap();
    let h = g.register_holder("staging", 0, None).await.unwrap();
    let a = CpuProvider::spawn(CpuProviderConfig {
        streams: 2,
        registry: None,
        ..Default::default()
    })
    .await
    .unwrap();
    let b = CpuProvider::spawn(CpuProviderConfig {
        streams: 1,
        registry: shared_registry.then(|| a.registry().clone()),
        ..Default::default()
    })
    .await
    .unwrap();
    let request = AllocationRequest::new(BYTES, MemoryRole::Workspace);
    let mut buf = a.allocate(&g, h, &request, 0, None, home).await.unwrap();
    buf.host_bytes_mut().unwrap().fill(0x5a);
    let view = buf.view();
    let (open_tx, open_rx) = bounded::<()>(1);
    let (started_tx, started_rx) = bounded::<()>(1);
    let intact = Arc::new(AtomicBool::new(false));
    let ok = Arc::clone(&intact);
    let fence = b
        .stream(0)
        .unwrap()
        .submit(&[&buf], move || {
            started_tx.send(()).unwrap();
            open_rx.recv().unwrap();
            // SAFETY: the buffer was passed in `uses`: it stays mapped until this fence.
            let bytes = unsafe { common::read_by_address(&view) };
            ok.store(bytes.iter().all(|x| *x == 0x5a), Ordering::SeqCst);
        })
        .unwrap();
    if !drop_first {
        started_rx.recv().unwrap();
    }
    drop(buf);
    // Give A's deferred-free actor every chance to free early.
    tokio::time::sleep(Duration::from_millis(30)).await;
    let held_while_running =
        is_mapped(view.addr) && leased(&g).await == BYTES && a.context() != b.context();
    open_tx.send(()).unwrap();
    b.stream(0).unwrap().host_wait(fence);
    let mut freed = false;
    for _ in 0..400 {
        if leased(&g).await == 0 && !is_mapped(view.addr) {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let alive = a.shutdown().await.is_ok() && b.shutdown().await.is_ok();
    let good = held_while_running && intact.load(Ordering::SeqCst) && freed && alive;
    if !good {
        eprintln!(
            "shared_registry={shared_registry} drop_first={drop_first} home={home}: \
             held={held_while_running} intact={} freed={freed} alive={alive}",
            intact.load(Ordering::SeqCst)
        );
    }
    good
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_used_on_another_providers_stream_waits_for_that_stream() {
    let mut passed = 0;
    let mut total = 0;
    for shared_registry in [false, true] {
        for drop_first in [true, false] {
            for home in [0, 1] {
                total += 1;
                passed += case(shared_registry, drop_first, home).await as usize;
            }
        }
    }
    figure("cross_provider_fence", passed, total);
    assert_eq!(passed, total);
}
