//! KV kept in eight bits through the store: K in `f16` and V in `q8_0` (llama.cpp's
//! `-ctk f16 -ctv q8_0`). A swap copies the rows out as they are kept and brings back the same
//! bytes; prompt blocks shared from memory, from the disk tier, and after a restart give the
//! very bits of the first computation; a store started over the directory with another KV type
//! finds nothing there and counts the other type's blocks.

use std::time::Duration;

use procmem_actors::kv::{
    KvStep, KvStoreConfig, KvStoreHandle, PreemptMode, PrefixDisk, Restored, StepEnd, SwapKind,
    SwapSpace,
};
use procmem_actors::procmem::kv::{KvDtype, KvPart, KvShape};
use procmem_actors::{governor::GovernorHandle, provider::CpuProvider};

mod common;

use common::{another_holder_asks, kv_config, kv_item, system, PAGE};

/// SmolLM2's heads, 3 KV heads of 64: a K row of 384 bytes (f16), a V row of 204 (q8_0, 20
/// rows to a page with 16 bytes spare); a block of 160 tokens is 15 pages of K and 8 of V.
const SHAPE: KvShape = KvShape {
    layers: 2,
    q_heads: 9,
    kv_heads: 3,
    head_dim: 64,
    max_tokens: 512,
    k_dtype: KvDtype::F16,
    v_dtype: KvDtype::Q8_0,
};

fn bt() -> usize {
    SHAPE.block_tokens(PAGE)
}

/// Writes position `pos` of `seq` in `step` (the rows of `kv_item`, as a model's would depend
/// on the position), attends over every row up to it, completes the step; the outputs, every
/// layer.
async fn attend_at(step: KvStep, seq: u64, pos: usize) -> Vec<Vec<f32>> {
    let mut last = Vec::new();
    for layer in 0..SHAPE.layers {
        let mut item = kv_item(&SHAPE, 1, pos, layer);
        item.seq = seq;
        last.push(step.attend(layer, vec![item]).await.unwrap().remove(0));
    }
    step.complete(StepEnd::Submitted).await.unwrap();
    last
}

/// Every layer's K and V bytes of `seq`, as the store keeps them, read in a step's kernel.
async fn kept_bytes(kv: &KvStoreHandle, seq: u64) -> Vec<Vec<u8>> {
    let step = kv.prepare(vec![seq]).await.unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    step.submit(move |kv| {
        let held = kv.position(0).unwrap();
        let rows = (0..SHAPE.layers)
            .flat_map(|layer| {
                let (k, v) = kv.rows(0, layer).unwrap();
                assert_eq!((k.dtype(), v.dtype()), (KvDtype::F16, KvDtype::Q8_0));
                let bytes = |part: KvPart| held * SHAPE.token_bytes(part) as usize;
                let (k, v) = (kv_bytes(k), kv_bytes(v));
                [
                    k[..bytes(KvPart::K)].to_vec(),
                    v[..bytes(KvPart::V)].to_vec(),
                ]
            })
            .collect();
        tx.send(rows).unwrap();
    })
    .unwrap();
    let rows = rx.await.unwrap();
    step.abandon();
    rows
}

fn kv_bytes(rows: procmem_actors::procmem::kv::KvRows<'_>) -> Vec<u8> {
    use procmem_actors::procmem::kv::KvRows;
    match rows {
        KvRows::F32(x) => x.iter().flat_map(|f| f.to_le_bytes()).collect(),
        KvRows::F16(x) => x.iter().flat_map(|f| f.to_le_bytes()).collect(),
        KvRows::Q8_0(x) => x.to_blocks(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swap_to_disk_brings_back_the_quantized_bytes_as_they_were() {
    let (g, p) = system(1 << 30, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let config = kv_config(SHAPE, 2, PreemptMode::Swap, Duration::from_millis(300))
        .swap(SwapSpace::Disk(dir.path().to_path_buf()));
    let (kv, _) = KvStoreHandle::spawn(config, g.clone(), p.clone())
        .await
        .unwrap();
    kv.open(1, vec![], 0).await.unwrap();
    for pos in 0..40 {
        let step = kv.prepare(vec![1]).await.unwrap();
        attend_at(step, 1, pos).await;
    }
    let before = kept_bytes(&kv, 1).await;
    // Another holder needs what the store holds: the sequence goes to the swap file.
    let held = kv.stats().await.unwrap();
    g.set_capacity(held.leased_bytes).await.unwrap();
    let squeezed = another_holder_asks(g.clone(), held.exclusive_bytes, Duration::from_secs(2))
        .await
        .unwrap()
        .commit(held.exclusive_bytes)
        .await
        .unwrap();
    let s = kv.stats().await.unwrap();
    assert_eq!((s.preempted, s.swap), (1, SwapKind::Disk));
    // The rows as kept: 40 K rows, and two pages of V rows (20 to a page) per layer.
    assert_eq!(
        s.swapped_bytes,
        2 * (40 * 384 + 2 * 4096),
        "the rows as kept"
    );
    drop(squeezed);
    g.set_capacity(1 << 30).await.unwrap();
    assert_eq!(
        kv.restore(1).await.unwrap(),
        Restored::Swapped { tokens: 40 }
    );
    assert_eq!(kept_bytes(&kv, 1).await, before, "byte for byte");
    kv.close(1);
}

fn disk_config(dir: &std::path::Path, shape: KvShape) -> KvStoreConfig {
    kv_config(shape, 2, PreemptMode::Swap, Duration::from_millis(500)).prefix_disk(PrefixDisk::new(
        dir,
        1,
        8 << 20,
    ))
}

async fn store(g: &GovernorHandle, p: &CpuProvider, config: KvStoreConfig) -> KvStoreHandle {
    KvStoreHandle::spawn(config, g.clone(), p.clone())
        .await
        .unwrap()
        .0
}

/// Opens `seq` with `prompt`, computes what is not cached and one token more, closes it;
/// what was cached and the last outputs.
async fn run(kv: &KvStoreHandle, seq: u64, prompt: &[u32]) -> (usize, Vec<Vec<f32>>) {
    let opened = kv.open(seq, prompt.to_vec(), 0).await.unwrap();
    let mut last = Vec::new();
    for pos in opened.cached_tokens..=prompt.len() {
        let step = kv.prepare(vec![seq]).await.unwrap();
        last = attend_at(step, seq, pos).await;
    }
    kv.close(seq);
    (opened.cached_tokens, last)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quantized_prompt_blocks_come_back_from_disk_and_another_type_finds_none() {
    let dir = tempfile::tempdir().unwrap();
    let (g, p) = system(64 << 20, 1).await;
    let prompt: Vec<u32> = (0..(2 * bt() + 5) as u32).collect();
    let kv = store(&g, &p, disk_config(dir.path(), SHAPE)).await;
    assert_eq!(run(&kv, 1, &prompt).await.0, 0);
    let (cached, from_memory) = run(&kv, 2, &prompt).await;
    assert_eq!(cached, 2 * bt(), "shared from memory");
    // Stopped: the hot blocks go down to disk; a store of the same types finds them.
    kv.actor().stop_and_wait(None, None).await.unwrap();
    let kv = store(&g, &p, disk_config(dir.path(), SHAPE)).await;
    let s = kv.stats().await.unwrap();
    assert_eq!((s.prefix_disk_blocks, s.prefix_disk_others), (2, 0));
    assert_eq!(
        s.prefix_disk_bytes,
        2 * SHAPE.block_bytes_all(PAGE),
        "a block is its K and V bytes as kept"
    );
    let (cached, from_disk) = run(&kv, 3, &prompt).await;
    assert_eq!(cached, 2 * bt());
    assert_eq!(from_disk, from_memory, "the same K/V, bit for bit");
    kv.actor().stop_and_wait(None, None).await.unwrap();
    // V in f16 now: another identity. Nothing is read as its own; the blocks are counted.
    let f16 = SHAPE.with_dtype(KvDtype::F16);
    let other = store(&g, &p, disk_config(dir.path(), f16)).await;
    let s = other.stats().await.unwrap();
    assert_eq!((s.prefix_disk_blocks, s.prefix_disk_others), (0, 2));
    assert_eq!(run(&other, 4, &prompt).await.0, 0);
    other.actor().stop_and_wait(None, None).await.unwrap();
}
