//! Helpers shared by the actors' tests: the small attention shape the KV store's tests use,
//! the Governor's figures, and waits for an event rather than for a time.
#![allow(dead_code)]

use std::io::Write;
use std::time::{Duration, Instant};

use procmem_actors::procmem::kv::{KvDtype, KvShape};
use procmem_actors::procmem::MemoryRole;
use procmem_actors::{
    governor::{GovernorConfig, GovernorError, GovernorHandle, Grant, ReserveRequest},
    kv::{KvStoreConfig, KvStoreHandle, PreemptMode},
    provider::{CpuProvider, CpuProviderConfig},
};

/// The host page the KV store's tests assume.
pub const PAGE: u64 = 4096;

/// The small attention shape the KV store's tests share: 2 layers, 4 query heads over 2 KV
/// heads, head dimension 16, f32, each sequence holding at most `max_tokens`.
pub const fn shape(max_tokens: usize) -> KvShape {
    KvShape {
        layers: 2,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 16,
        max_tokens,
        k_dtype: KvDtype::F32,
        v_dtype: KvDtype::F32,
    }
}

/// Bytes the Governor `g` has leased out.
pub async fn leased(g: &GovernorHandle) -> u64 {
    g.snapshot().await.unwrap().books.leased
}

/// Waits (up to 10 s) until `n` requests wait for room at `g`: the event a test orders its
/// next move after, rather than a sleep.
pub async fn until_waiting(g: &GovernorHandle, n: usize) {
    let start = Instant::now();
    while g.snapshot().await.unwrap().waiting < n {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{n} requests never waited for room"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A host Governor of `capacity` bytes and a CPU provider with `streams` streams.
pub async fn system(capacity: u64, streams: usize) -> (GovernorHandle, CpuProvider) {
    let (g, _) = GovernorHandle::spawn(GovernorConfig::new("host", capacity))
        .await
        .unwrap();
    let p = CpuProvider::spawn(CpuProviderConfig {
        streams,
        registry: None,
        ..Default::default()
    })
    .await
    .unwrap();
    (g, p)
}

/// Waits (up to 10 s) until the store's books, the Governor's and the kernel's agree;
/// returns the store's figures then.
pub async fn settled(g: &GovernorHandle, kv: &KvStoreHandle) -> procmem_actors::kv::KvStoreStats {
    let start = Instant::now();
    loop {
        let s = kv.stats().await.unwrap();
        let ledger = g.snapshot().await.unwrap().books.leased;
        if s.leased_bytes == ledger && ledger == s.os_resident_bytes {
            return s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "ledger {ledger} vs store {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A KV store configuration named "kv" at priority 0, swapping to the default space.
pub fn kv_config(
    shape: KvShape,
    chunk_granules: u64,
    preempt: PreemptMode,
    wait: Duration,
) -> KvStoreConfig {
    KvStoreConfig::new("kv", shape)
        .chunk_granules(chunk_granules)
        .preempt(preempt)
        .wait(wait)
}

/// A host Governor of `capacity` bytes, a CPU provider with one stream, and a KV store of
/// `config` over them.
pub async fn kv_system(
    capacity: u64,
    config: KvStoreConfig,
) -> (GovernorHandle, CpuProvider, KvStoreHandle) {
    let (g, p) = system(capacity, 1).await;
    let (kv, _) = KvStoreHandle::spawn(config, g.clone(), p.clone())
        .await
        .unwrap();
    (g, p, kv)
}

/// Another, more important holder ("other", priority 9) asks `g` for `bytes` of workspace
/// and waits up to `wait`: the pressure a KV store under test must answer.
pub async fn another_holder_asks(
    g: GovernorHandle,
    bytes: u64,
    wait: Duration,
) -> Result<Grant, GovernorError> {
    let other = g.register_holder("other", 9, None).await?;
    g.reserve(ReserveRequest {
        holder: other,
        role: MemoryRole::Workspace,
        bytes,
        priority: 9,
        deadline: Some(tokio::time::Instant::now() + wait),
    })
    .await
}

/// Prints a figure line that `scripts/reliability.sh` collects into its table.
pub fn figure(name: &str, passed: usize, total: usize) {
    let _ = writeln!(std::io::stderr(), "FIGURE {name} {passed}/{total}");
}

/// Bytes the kernel reports for the provider's mechanism: eager allocations and virtual
/// buffers.
pub fn os_bytes(p: &CpuProvider) -> u64 {
    p.mechanism().host_allocator().resident_total().unwrap()
        + p.mechanism().backing().resident_bytes().unwrap()
}

/// Waits (up to 10 s) for the kernel, and the Governor's books where it still lives, to come
/// back to zero. A dead Governor's books went with it: then only the kernel is asked.
pub async fn settles_to_zero(g: &GovernorHandle, p: &CpuProvider) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        let books = match g.snapshot().await {
            Ok(s) => s.books.approved() == 0,
            Err(_) => true,
        };
        if books && os_bytes(p) == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}

/// Lets the messages still in flight land: waits `settle`, and while a panic point is armed
/// and has not fired, up to 5 s more (a loaded machine may deliver the message it waits for
/// late; a run that never reaches it stops waiting then).
#[cfg(feature = "fault-injection")]
pub async fn let_messages_land(settle: Duration) {
    tokio::time::sleep(settle).await;
    let start = Instant::now();
    while procmem_actors::procmem::fault::pending() && start.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Whether `addr` lies in any mapping of this process (`/proc/self/maps`).
pub fn is_mapped(addr: u64) -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .any(|l| {
            let span = l.split_whitespace().next().unwrap();
            let (a, b) = span.split_once('-').unwrap();
            let (a, b) = (
                u64::from_str_radix(a, 16).unwrap(),
                u64::from_str_radix(b, 16).unwrap(),
            );
            a <= addr && addr < b
        })
}

/// Reads a buffer by its address, as a device kernel does: no share of the allocation keeps
/// it mapped, only the fence protocol these tests check (a buffer freed before its fence
/// faults here, or reads another buffer's bytes).
///
/// # Safety
/// The view's buffer was in the kernel's `uses`, and nothing writes it meanwhile.
pub unsafe fn read_by_address<'a>(view: &procmem_actors::provider::BufferView) -> &'a [u8] {
    // SAFETY: the caller's preconditions.
    unsafe { std::slice::from_raw_parts(view.addr as usize as *const u8, view.len as usize) }
}

/// Deterministic floats for (sequence, position, layer, which): replaying a sequence gives
/// the very same K/V, as a real model would.
pub fn kv_floats(seed: u64, pos: usize, layer: usize, which: u64, n: usize) -> Vec<f32> {
    let mut x = seed
        ^ ((pos as u64) << 20)
        ^ ((layer as u64) << 40)
        ^ (which << 56)
        ^ 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// One token's attention input for `seq` at `pos` and `layer` of `shape`.
pub fn kv_item(
    shape: &procmem_actors::procmem::kv::KvShape,
    seq: u64,
    pos: usize,
    layer: usize,
) -> procmem_actors::kv::AttendItem {
    let tf = shape.token_elems();
    procmem_actors::kv::AttendItem {
        seq,
        q: kv_floats(seq, pos, layer, 0, shape.q_heads * shape.head_dim),
        k: kv_floats(seq, pos, layer, 1, tf),
        v: kv_floats(seq, pos, layer, 2, tf),
    }
}

/// Holds the store's stream with a kernel of the test's until the returned gate opens (a send,
/// or a drop): everything queued after it waits.
pub fn hold_stream(p: &CpuProvider) -> std::sync::mpsc::Sender<()> {
    let (open_gate, gate) = std::sync::mpsc::channel::<()>();
    p.stream(0)
        .unwrap()
        .submit(&[], move || {
            let _ = gate.recv();
        })
        .unwrap();
    open_gate
}
