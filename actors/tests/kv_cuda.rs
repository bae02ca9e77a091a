//! The KV store on CUDA VMM, driven as a GPU server drives it: rows written by the copy kernel
//! on the step's CUDA stream, steps completed with the stream's fences. Growth keeps the
//! address, a cached prompt block is shared (read-only) with a second sequence, pressure swaps
//! a sequence to the host tier and a restore brings its bytes back intact (read back from the
//! device). Skipped, saying so, where no CUDA driver or device exists.

mod common;

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use procmem_actors::procmem::cuda::{driver_present, CudaDevice, DecodeKernels};
use procmem_actors::procmem::kv::{KvDtype, KvShape};
use procmem_actors::{
    governor::{GovernorConfig, GovernorHandle},
    kv::{
        KvStep, KvStoreConfig, KvStoreError, KvStoreHandle, KvStoreStats, PreemptMode, PrefixHost,
        Restored, SwapKind, SwapSpace, TableError,
    },
    provider::{CudaProvider, CudaProviderConfig},
};

use common::another_holder_asks;

const SHAPE: KvShape = KvShape {
    layers: 2,
    q_heads: 4,
    kv_heads: 2,
    head_dim: 64,
    max_tokens: 8192,
    k_dtype: KvDtype::F32,
    v_dtype: KvDtype::F32,
};

fn have_gpu(test: &str) -> bool {
    let why = if !driver_present() {
        "no CUDA driver (libcuda cannot be loaded on this machine)"
    } else if CudaDevice::count() == 0 {
        "a CUDA driver is present but reports no device"
    } else {
        return true;
    };
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
    false
}

/// Row `pos` of layer `layer`'s K (`kind` 1) or V (2): the same for every sequence of one
/// prompt, so shared and private rows can be checked alike.
fn row(pos: usize, layer: usize, kind: usize) -> Vec<f32> {
    (0..SHAPE.token_elems())
        .map(|i| ((pos * 31 + layer * 7 + kind * 3 + i) % 251) as f32 - 125.0)
        .collect()
}

fn bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|f| f.to_le_bytes()).collect()
}

/// The server's side of one step: for every sequence of the step, its new row of every layer
/// copied to the device and written into the K/V view by the copy kernel on the step's
/// stream; then the step completed with that stream's fence.
struct Server {
    device: Arc<CudaDevice>,
    kernels: DecodeKernels,
    staging: u64,
}

impl Server {
    async fn step(&self, step: KvStep) {
        let stream = step.stream().cuda().expect("a CUDA stream").clone();
        let n = SHAPE.token_elems() as u32;
        for i in 0..step.seqs().len() {
            let pos = step.positions()[i];
            for layer in 0..SHAPE.layers {
                let views = step.views(i, layer).unwrap();
                for (kind, view) in [(1, views.k), (2, views.v)] {
                    let at = view.row_addr(pos).unwrap();
                    // SAFETY: `staging` holds a row; the stream is idle (synchronized below
                    // after each launch) so nothing reads it while it is rewritten; `at` is
                    // the step's own row, mapped read-write until the step's fence.
                    unsafe {
                        self.device
                            .copy_to_device(self.staging, &bytes(&row(pos, layer, kind)))
                            .unwrap();
                        self.kernels
                            .write_row(stream.cuda(), KvDtype::F32, at, self.staging, n)
                            .unwrap();
                    }
                    stream.cuda().synchronize().unwrap();
                }
            }
        }
        let fence = stream.submit(&[], |_| Ok(())).unwrap();
        step.complete(fence).await.unwrap();
    }

    /// Every row of sequence `i` of `step` up to its position, read back from the device.
    fn check_rows(&self, step: &KvStep, i: usize) {
        let tokens = step.positions()[i];
        for layer in 0..SHAPE.layers {
            let views = step.views(i, layer).unwrap();
            for (kind, view) in [(1, views.k), (2, views.v)] {
                let mut got =
                    vec![
                        0u8;
                        tokens * SHAPE.token_bytes(procmem_actors::procmem::kv::KvPart::K) as usize
                    ];
                // SAFETY: the step holds the memory; every row below its position is mapped.
                unsafe { self.device.copy_to_host(&mut got, view.addr).unwrap() };
                for pos in 0..tokens {
                    let want = bytes(&row(pos, layer, kind));
                    let at = pos * want.len();
                    assert_eq!(
                        &got[at..at + want.len()],
                        &want[..],
                        "layer {layer} kind {kind} row {pos}"
                    );
                }
            }
        }
    }
}

/// A KV store on the GPU as the tests here use it: its device Governor holds `blocks` whole
/// blocks (a granule of every buffer each) and a granule more, it swaps to a host Governor of
/// 1 GiB, and it has a prefix host tier of `host_tier` blocks, if any; with the server's side.
struct OnGpu {
    _provider: CudaProvider,
    device: Arc<CudaDevice>,
    g_bytes: u64,
    per_block: u64,
    capacity: u64,
    g: GovernorHandle,
    host: GovernorHandle,
    kv: KvStoreHandle,
    server: Server,
}

async fn on_gpu(blocks: u64, host_tier: Option<u64>) -> OnGpu {
    let p = CudaProvider::spawn(CudaProviderConfig::default())
        .await
        .unwrap();
    let device = p.mechanism().device().clone();
    let g_bytes = device.granularity().unwrap();
    let per_block = SHAPE.buffers() as u64 * g_bytes;
    let capacity = blocks * per_block + g_bytes;
    let (g, _) = GovernorHandle::spawn(GovernorConfig::new("cuda:0", capacity))
        .await
        .unwrap();
    let (host, _) = GovernorHandle::spawn(GovernorConfig::new("host", 1 << 30))
        .await
        .unwrap();
    let config = KvStoreConfig::new("kv", SHAPE)
        .wait(Duration::from_secs(10))
        .swap(SwapSpace::Host(host.clone()));
    let config = match host_tier {
        Some(n) => config.prefix_host(PrefixHost::new(n * per_block)),
        None => config,
    };
    let (kv, _) = KvStoreHandle::spawn(config, g.clone(), p.clone())
        .await
        .unwrap();
    let server = Server {
        kernels: DecodeKernels::load(device.clone()).unwrap(),
        staging: device
            .alloc(SHAPE.token_bytes(procmem_actors::procmem::kv::KvPart::K))
            .unwrap(),
        device: device.clone(),
    };
    OnGpu {
        _provider: p,
        device,
        g_bytes,
        per_block,
        capacity,
        g,
        host,
        kv,
        server,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_kv_store_grows_shares_swaps_and_restores_with_the_bytes_intact() {
    if !have_gpu("cuda_kv_store_grows_shares_swaps_and_restores_with_the_bytes_intact") {
        return;
    }
    // The shared block, two sequences' own chunks, and a little room.
    let OnGpu {
        _provider,
        device,
        g_bytes,
        per_block: per_seq_chunk,
        capacity,
        g,
        host,
        kv,
        server,
    } = on_gpu(3, None).await;
    let block = SHAPE.block_tokens(g_bytes);
    let prompt: Vec<u32> = (0..block as u32 + 4).collect();

    // Sequence 1 writes the whole prompt; its buffers grow without moving.
    assert_eq!(
        kv.open(1, prompt.clone(), 0).await.unwrap().cached_tokens,
        0
    );
    let mut first_addr = None;
    for _ in 0..prompt.len() {
        let step = kv.prepare(vec![1]).await.unwrap();
        let addr = step.views(0, 0).unwrap().k.addr;
        assert_eq!(*first_addr.get_or_insert(addr), addr, "the buffer moved");
        server.step(step).await;
    }
    // Sequence 2 finds the first block cached and maps it (read-only) instead of writing it.
    let opened = kv.open(2, prompt.clone(), 0).await.unwrap();
    assert_eq!(opened.cached_tokens, block);
    for _ in block..prompt.len() {
        let step = kv.prepare(vec![2]).await.unwrap();
        server.step(step).await;
    }
    let step = kv.prepare(vec![1, 2]).await.unwrap();
    server.check_rows(&step, 0);
    server.check_rows(&step, 1);
    server.step(step).await;

    // Pressure: a more important holder wants one sequence's worth; one is swapped to the
    // host tier (a device-to-host copy), its device memory freed.
    let grant = another_holder_asks(g.clone(), per_seq_chunk, Duration::from_secs(10))
        .await
        .expect("the store made room");
    let stats = kv.stats().await.unwrap();
    assert!(stats.preemptions >= 1, "{stats:?}");
    assert_eq!(stats.swap, SwapKind::Host);
    assert!(
        host.snapshot().await.unwrap().books.leased > 0,
        "the copy is charged"
    );
    drop(grant);

    // Which sequence went: a step of it is refused as preempted (by swap).
    let mut victim = None;
    for seq in [1, 2] {
        match kv.prepare(vec![seq]).await {
            Err(KvStoreError::Table(TableError::Preempted(s, PreemptMode::Swap))) => {
                victim = Some(s)
            }
            Ok(step) => drop(step),
            Err(e) => panic!("sequence {seq}: {e}"),
        }
    }
    let victim = victim.expect("one sequence was swapped out");
    // Restored, it maps the prefix block again where it is still cached (the other sequence
    // maps it) and copies back only its own rows; the authority gets room for a copy of the
    // block all the same. It comes back with every row as it was.
    g.set_capacity(capacity + 2 * per_seq_chunk).await.unwrap();
    match kv.restore(victim).await.unwrap() {
        Restored::Swapped { tokens } => assert_eq!(tokens, prompt.len() + 1),
        other => panic!("restored as {other:?}"),
    }
    eprintln!(
        "kv_cuda restore: {} tokens mapped again from the cached block",
        kv.stats().await.unwrap().restore_shared_tokens
    );
    let step = kv.prepare(vec![victim]).await.unwrap();
    server.check_rows(&step, 0);
    drop(step);

    kv.close(1);
    kv.close(2);
    // The cached prefix block stays charged to the store while it is cached; the sequences'
    // own memory goes once their fences complete.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let leased = loop {
        let leased = g.snapshot().await.unwrap().books.leased;
        if leased <= per_seq_chunk || std::time::Instant::now() > deadline {
            break leased;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(leased <= per_seq_chunk, "leased {leased}");
    // SAFETY: allocated above; nothing uses it any more.
    unsafe { device.free(server.staging).unwrap() };
}

/// Model residency on the GPU: layers loaded into device memory, used by the server's own
/// device work (fenced on the CUDA stream), offloaded to the host tier under pressure and
/// reloaded with the same bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_residency_offloads_to_the_host_tier_and_reloads_the_same_bytes() {
    use procmem_actors::procmem::Place;
    use procmem_actors::{
        residency::{Placement, ResidencyConfig, ResidencyError},
        MemoryManager,
    };
    if !have_gpu("cuda_residency_offloads_to_the_host_tier_and_reloads_the_same_bytes") {
        return;
    }
    let granule = CudaDevice::open(0).unwrap().granularity().unwrap();
    let layer_bytes = granule as usize;
    // Room for four layers; the fifth request below must make room.
    let memory = MemoryManager::builder()
        .host_budget(1 << 30)
        .cuda_device(0, 4 * granule)
        .build()
        .await
        .unwrap();
    let res = memory
        .residency_on(Place::cuda(0), ResidencyConfig::new("weights").priority(5))
        .await
        .unwrap();
    let weights = |layer: usize| -> Vec<u8> {
        (0..layer_bytes)
            .map(|i| ((i * 7 + layer * 13) % 256) as u8)
            .collect()
    };
    for layer in 0..4 {
        res.load(layer, weights(layer), false).await.unwrap();
    }
    // Host closures are refused for GPU weights.
    let wrong = res.with_weights(0, |w| w.len()).await;
    assert!(
        matches!(wrong, Err(ResidencyError::WrongDevice)),
        "{wrong:?}"
    );
    let device = memory.cuda_provider().unwrap().mechanism().device().clone();
    let scratch = device.alloc(granule).unwrap();
    let stream = memory.cuda_provider().unwrap().stream(0).unwrap().clone();
    // The server's device work over a layer: a copy into its own scratch buffer.
    let read_back = |layer: usize| {
        let res = res.clone();
        let device = device.clone();
        let stream = stream.clone();
        async move {
            let fence = res
                .with_device_weights(layer, move |view, stream| {
                    // SAFETY: `view` is the layer's live device memory, kept until the fence
                    // returned here completes; `scratch` is the test's own allocation.
                    unsafe { stream.cuda().copy_async(scratch, view.addr, view.len) }
                })
                .await
                .unwrap();
            stream.host_wait(fence);
            let mut got = vec![0u8; layer_bytes];
            // SAFETY: the copy into `scratch` has completed (its fence did).
            unsafe { device.copy_to_host(&mut got, scratch).unwrap() };
            got
        }
    };
    assert_eq!(read_back(0).await, weights(0));
    // A more important holder wants two layers' worth of the device: cold layers go to the
    // host tier.
    let g = memory
        .governor(Place::cuda(0), procmem_actors::procmem::MemoryTier::Device)
        .unwrap()
        .clone();
    let grant = another_holder_asks(g, 2 * granule, Duration::from_secs(10))
        .await
        .expect("residency made room");
    let stats = res.stats().await.unwrap();
    assert!(stats.offloads >= 2, "{stats:?}");
    drop(grant);
    // Every layer reads back as loaded, reloaded where it was offloaded.
    for layer in 0..4 {
        let placement = res.placement(layer).await.unwrap();
        assert!(matches!(
            placement,
            Some(Placement::Device) | Some(Placement::Host)
        ));
        assert_eq!(read_back(layer).await, weights(layer), "layer {layer}");
    }
    assert!(res.stats().await.unwrap().reloads >= 1);
    // SAFETY: allocated above; every copy into it has completed.
    unsafe { device.free(scratch).unwrap() };
    drop(res);
    let report = memory.shutdown().await.unwrap();
    assert!(report.is_zero(), "{report:?}");
}

/// Waits until the store's figures satisfy `done`, at most 10 s.
async fn until(kv: &KvStoreHandle, what: &str, done: impl Fn(&KvStoreStats) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let stats = kv.stats().await.unwrap();
        if done(&stats) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what} never happened: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The prefix cache's host tier under KV on the GPU: a whole prompt block evicted under
/// pressure is copied to page-locked host memory (charged to the host tier's Governor from
/// the start) instead of dropped, and the next open of the prompt copies it back: the rows
/// read back from the device are the ones first written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_prefix_blocks_go_to_the_host_tier_and_come_back_with_the_same_bytes() {
    if !have_gpu("cuda_prefix_blocks_go_to_the_host_tier_and_come_back_with_the_same_bytes") {
        return;
    }
    let OnGpu {
        _provider,
        device,
        g_bytes,
        per_block,
        capacity,
        g,
        host,
        kv,
        server,
    } = on_gpu(2, Some(2)).await;
    assert_eq!(
        host.snapshot().await.unwrap().books.leased,
        2 * per_block,
        "the tier is charged in full from the start"
    );
    let block = SHAPE.block_tokens(g_bytes);
    let prompt: Vec<u32> = (0..block as u32 + 4).map(|t| t * 5 + 1).collect();
    kv.open(1, prompt.clone(), 0).await.unwrap();
    for _ in 0..prompt.len() {
        let step = kv.prepare(vec![1]).await.unwrap();
        server.step(step).await;
    }
    kv.close(1);
    until(&kv, "the prompt block cached alone", |s| {
        s.prefix_entries == 1 && s.sequences == 0
    })
    .await;

    // Pressure: a more important holder wants the whole device; the block goes down.
    let grant = another_holder_asks(g.clone(), capacity, Duration::from_secs(10))
        .await
        .expect("the store made room");
    until(&kv, "the block copied to the host tier", |s| {
        s.prefix_host_blocks == 1 && s.prefix_entries == 0 && s.prefix_host_writes == 1
    })
    .await;
    drop(grant);

    // The same prompt again: its first block comes back from the host tier.
    let opened = kv.open(3, prompt.clone(), 0).await.unwrap();
    assert_eq!(opened.cached_tokens, block);
    for _ in block..prompt.len() {
        let step = kv.prepare(vec![3]).await.unwrap();
        server.step(step).await;
    }
    let step = kv.prepare(vec![3]).await.unwrap();
    server.check_rows(&step, 0);
    drop(step);
    let stats = kv.stats().await.unwrap();
    assert_eq!(stats.prefix_host_hit_tokens, block as u64, "{stats:?}");
    assert_eq!(stats.prefix_host_failures, 0, "{stats:?}");
    kv.close(3);
    // Stopped, the store frees everything after its fences, the tier's host memory with it:
    // both books go back to zero.
    kv.actor().stop_and_wait(None, None).await.unwrap();
    for (books, name) in [(&g, "device"), (&host, "host")] {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while books.snapshot().await.unwrap().books.leased != 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the {name} books stay above zero"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    // SAFETY: allocated above; nothing uses it any more.
    unsafe { device.free(server.staging).unwrap() };
}
