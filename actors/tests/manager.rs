//! The ProcessMemoryManager: a few lines to start, bindings that always charge, holders that
//! may crash without taking the system down, shutdown that reports the books at zero, and
//! bad input refused with a clear error.

mod common;

use procmem_actors::kv::StepEnd;
use std::time::Duration;

use procmem_actors::procmem::kv::KvShape;
use procmem_actors::procmem::{AllocationRequest, MemoryError, MemoryRole, MemoryTier, Place};
use procmem_actors::{
    kv::{AttendItem, KvStoreConfig},
    provider::ProviderError,
    Buffer, ManagerError, MemoryBinding, MemoryManager,
};

const SHAPE: KvShape = common::shape(256);

fn kv_config() -> KvStoreConfig {
    KvStoreConfig::new("kv", SHAPE).wait(Duration::from_millis(200))
}

fn item(seq: u64) -> AttendItem {
    let tf = SHAPE.token_elems();
    AttendItem {
        seq,
        q: vec![0.5; SHAPE.q_heads * SHAPE.head_dim],
        k: vec![0.25; tf],
        v: vec![1.0; tf],
    }
}

async fn decode(kv: &procmem_actors::kv::KvStoreHandle, seq: u64, steps: usize) {
    for _ in 0..steps {
        let step = kv.prepare(vec![seq]).await.unwrap();
        for layer in 0..SHAPE.layers {
            step.attend(layer, vec![item(seq)]).await.unwrap();
        }
        step.complete(StepEnd::Submitted).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_use_and_shut_down_with_the_books_at_zero() {
    let memory = MemoryManager::builder()
        .host_budget(256 << 20)
        .build()
        .await
        .unwrap();
    let caps = memory.capabilities(Place::HOST).unwrap();
    assert!(caps.virtual_backing && caps.shared_mapping);
    let kv = memory.kv_store(kv_config()).await.unwrap();
    kv.open(1, vec![], 0).await.unwrap();
    decode(&kv, 1, 40).await;
    let binding = memory.binding(Place::HOST, MemoryTier::Host).unwrap();
    let holder = binding
        .governor()
        .register_holder("scratch", 0, None)
        .await
        .unwrap();
    let buffer = binding
        .allocate(
            holder,
            &AllocationRequest::new(1 << 20, MemoryRole::Workspace),
            0,
            None,
        )
        .await
        .unwrap();
    let books = memory.books().await;
    let (host, os) = (&books[0].snapshot, &books[0].os_bytes);
    assert!(host.books.leased >= (1 << 20) + kv.stats().await.unwrap().exclusive_bytes);
    assert_eq!(
        Some(host.books.leased),
        *os,
        "the ledger equals what the OS reports"
    );
    drop(buffer);
    let report = memory.shutdown().await.unwrap();
    assert!(report.is_zero(), "{report}");
    assert!(report.deferred_frees >= 1);
    // After shutdown nothing new is admitted.
    assert!(matches!(
        memory.kv_store(kv_config()).await,
        Err(ManagerError::ShuttingDown)
    ));
    let late = binding
        .allocate(
            holder,
            &AllocationRequest::new(4096, MemoryRole::Workspace),
            0,
            None,
        )
        .await;
    assert!(matches!(late, Err(ManagerError::ShuttingDown)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_holder_does_not_take_the_system_down() {
    let memory = MemoryManager::builder()
        .host_budget(256 << 20)
        .build()
        .await
        .unwrap();
    let kv = memory.kv_store(kv_config()).await.unwrap();
    kv.open(1, vec![], 0).await.unwrap();
    decode(&kv, 1, 20).await;
    let store = kv.actor();
    kv.crash();
    store.wait(Some(Duration::from_secs(10))).await.unwrap();
    assert!(kv.stats().await.is_err(), "the crashed store is gone");
    // The rest goes on: a new store works, and the crashed one's bytes came back.
    let again = memory.kv_store(kv_config()).await.unwrap();
    again.open(7, vec![], 0).await.unwrap();
    decode(&again, 7, 10).await;
    // The crashed store's memory goes back through its deferred frees, on their own actor:
    // it may still be on its way when the new store has stepped.
    let start = std::time::Instant::now();
    loop {
        let leased = memory.books().await[0].snapshot.books.leased;
        let live = again.stats().await.unwrap().leased_bytes;
        if leased == live {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "only the live store holds bytes: {leased} leased, the live store {live}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let report = memory.shutdown().await.unwrap();
    assert!(report.is_zero(), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configuration_is_refused_with_a_clear_error() {
    let zero = MemoryManager::builder()
        .host_budget(0)
        .build()
        .await
        .unwrap_err();
    assert!(matches!(zero, ManagerError::InvalidBudget { .. }), "{zero}");
    assert!(zero.to_string().contains("zero"), "{zero}");
    let huge = MemoryManager::builder()
        .host_budget(u64::MAX / 2)
        .build()
        .await
        .unwrap_err();
    assert!(matches!(huge, ManagerError::InvalidBudget { .. }), "{huge}");
    assert!(huge.to_string().contains("machine has"), "{huge}");
    if !procmem_actors::procmem::cuda::driver_present() {
        let cuda = MemoryManager::builder()
            .host_budget(1 << 20)
            .cuda_device(0, 1 << 30)
            .build()
            .await
            .unwrap_err();
        assert!(
            matches!(
                cuda,
                ManagerError::Provider(ProviderError::Memory(MemoryError::NoCudaDriver { .. }))
            ),
            "{cuda}"
        );
    }
    let memory = MemoryManager::builder()
        .host_budget(1 << 20)
        .build()
        .await
        .unwrap();
    let unknown = memory
        .binding(Place::cuda(3), MemoryTier::Device)
        .unwrap_err();
    assert!(
        matches!(unknown, ManagerError::UnknownPlace(..)),
        "{unknown}"
    );
    assert!(matches!(
        memory.capabilities(Place::cuda(3)),
        Err(ManagerError::UnknownPlace(..))
    ));
    let in_use = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = in_use.local_addr().unwrap();
    let taken = MemoryManager::builder()
        .host_budget(1 << 20)
        .metrics_addr(addr)
        .build()
        .await
        .unwrap_err();
    assert!(matches!(taken, ManagerError::Metrics { .. }), "{taken}");
    memory.shutdown().await.unwrap();
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "FIGURE bad_input_manager 6/6");
}

/// A manager with `streams` host streams and one 1 MiB buffer allocated through its binding.
async fn manager_with_a_buffer(streams: usize) -> (MemoryManager, MemoryBinding, Buffer) {
    let memory = MemoryManager::builder()
        .host_budget(64 << 20)
        .streams(streams)
        .build()
        .await
        .unwrap();
    let binding = memory.binding(Place::HOST, MemoryTier::Host).unwrap();
    let holder = binding
        .governor()
        .register_holder("scratch", 0, None)
        .await
        .unwrap();
    let request = AllocationRequest::new(1 << 20, MemoryRole::Workspace);
    let buffer = binding.allocate(holder, &request, 0, None).await.unwrap();
    (memory, binding, buffer)
}

/// A Governor that dies is restarted with its books (the manager supervises it), and a
/// deferred-free queue that died is not hidden by shutdown: the report counts it. The memory
/// still comes back to the kernel after its fence, and its refund reaches the new Governor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_governor_is_restarted_and_a_lost_queue_is_reported() {
    let (memory, binding, buffer) = manager_with_a_buffer(2).await;
    let stream = memory.host_provider().stream(0).unwrap().clone();
    let (open, gate) = crossbeam_channel::bounded::<()>(1);
    let fence = stream
        .submit(&[&buffer], move || {
            let _ = gate.recv();
        })
        .unwrap();
    stream.deferred_free().actor().kill();
    let dead = binding.governor().actor().get_id();
    binding.governor().actor().kill();
    drop(buffer);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let os = |m: &MemoryManager| {
        let mech = m.host_provider().mechanism();
        mech.host_allocator().resident_total().unwrap() + mech.backing().resident_bytes().unwrap()
    };
    assert!(os(&memory) >= 1 << 20, "freed while its kernel waits");
    assert_ne!(binding.governor().actor().get_id(), dead, "restarted");
    let books = binding.governor().snapshot().await.unwrap().books;
    assert_eq!(
        books.leased,
        os(&memory),
        "the restarted books equal the OS"
    );
    drop(open);
    stream.host_wait(fence);
    let report = memory.shutdown().await.unwrap();
    assert!(report.lost_authorities.is_empty(), "{report}");
    assert_eq!(report.lost_queues, 1, "{report}");
    assert_eq!(os(&memory), 0);
}

/// A provider actor that died cannot drain its queues: shutdown still reports (naming it)
/// instead of stopping at the first error, and the memory still comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_reports_a_dead_provider() {
    let (memory, binding, buffer) = manager_with_a_buffer(1).await;
    memory.host_provider().actor().kill();
    drop(buffer);
    let err = memory.shutdown().await.unwrap_err();
    let ManagerError::BooksNotZero(report) = &err else {
        panic!("{err}");
    };
    assert_eq!(report.lost_providers, vec!["host".to_string()], "{err}");
    let governor = binding.governor();
    let start = std::time::Instant::now();
    while governor.snapshot().await.unwrap().books.approved() != 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "never refunded");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Defect 6 of issue 11: `shutdown()` left the Governors, the providers and the metrics
/// exporter running. After a clean shutdown each is stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_shutdown_stops_governors_providers_and_the_exporter() {
    let (memory, binding, buffer) = manager_with_a_buffer(1).await;
    drop(buffer);
    let provider = memory.host_provider().actor().clone();
    memory.shutdown().await.unwrap();
    let governor = binding.governor();
    let start = std::time::Instant::now();
    loop {
        let stopped = provider.get_status() == ractor::ActorStatus::Stopped;
        if governor.snapshot().await.is_err() && stopped {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "still running");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
