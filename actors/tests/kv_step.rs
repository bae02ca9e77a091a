//! The step API as a careless or hostile server uses it: steps dropped, completed with a
//! fence of another stream, held across a close and a re-open of the same id, prepared twice,
//! kernels that panic; views that must point where the memory is; 16-bit KV end to end.

mod common;

use procmem_actors::kv::{StepEnd, TableError};
use std::time::Duration;

use common::{another_holder_asks, kv_config, kv_floats, kv_system, settled};
use procmem_actors::procmem::fence::TimelineFence;
use procmem_actors::procmem::kv::{f16, gqa_decode, Heads, KvDtype, KvShape};
use procmem_actors::procmem::Place;
use procmem_actors::{
    governor::GovernorHandle,
    kv::{KvStep, KvStoreError, KvStoreHandle, PreemptMode, Restored},
    provider::{CpuProvider, CpuProviderConfig},
};

const SHAPE: KvShape = common::shape(512);

async fn store(shape: KvShape, capacity: u64) -> (GovernorHandle, CpuProvider, KvStoreHandle) {
    let config = kv_config(shape, 2, PreemptMode::Swap, Duration::from_millis(300));
    kv_system(capacity, config).await
}

/// One whole step for `seq` at `pos` through the server's own kernel: returns each layer's
/// attention output.
async fn own_step(kv: &KvStoreHandle, seq: u64, pos: usize) -> Vec<Vec<f32>> {
    let step = kv.prepare(vec![seq]).await.unwrap();
    run_step(step, seq, pos).await
}

/// The server's kernels of one prepared step of `seq` at `pos`, then the step completed
/// (`StepEnd::Submitted`).
async fn run_step(step: KvStep, seq: u64, pos: usize) -> Vec<Vec<f32>> {
    let mut outs = Vec::new();
    for layer in 0..SHAPE.layers {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let k = kv_floats(seq, pos, layer, 1, SHAPE.token_elems());
        let v = kv_floats(seq, pos, layer, 2, SHAPE.token_elems());
        let q = kv_floats(seq, pos, layer, 0, SHAPE.q_heads * SHAPE.head_dim);
        step.submit(move |kv| {
            kv.write(0, layer, &k, &v).unwrap();
            let (keys, values) = (
                kv.keys::<f32>(0, layer).unwrap(),
                kv.values(0, layer).unwrap(),
            );
            let mut out = vec![0f32; q.len()];
            gqa_decode(&q, keys, values, pos + 1, Heads::new(4, 2, 16), &mut out);
            tx.send(out).unwrap();
        })
        .unwrap();
        outs.push(rx.await.unwrap());
    }
    step.complete(StepEnd::Submitted).await.unwrap();
    outs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn views_point_at_the_memory_the_kernel_reads() {
    let (_g, _p, kv) = store(SHAPE, 1 << 30).await;
    kv.open(1, vec![], 0).await.unwrap();
    kv.open(2, vec![], 0).await.unwrap();
    for pos in 0..5 {
        own_step(&kv, 1, pos).await;
    }
    let step = kv.prepare(vec![2, 1]).await.unwrap();
    assert_eq!(step.seqs(), &[2, 1]);
    assert_eq!(step.positions(), &[0, 5]);
    assert!(step.views(2, 0).is_none() && step.views(0, SHAPE.layers).is_none());
    let views: Vec<_> = (0..2)
        .flat_map(|i| (0..SHAPE.layers).map(move |l| (i, l)))
        .map(|(i, l)| (i, l, step.views(i, l).unwrap()))
        .collect();
    for (i, _, v) in &views {
        assert_eq!(v.k.tokens, step.positions()[*i] + 1);
        assert_eq!(v.k.dtype, KvDtype::F32);
        assert_eq!(
            v.k.token_stride,
            SHAPE.token_bytes(procmem_actors::procmem::kv::KvPart::K)
        );
        assert_eq!(v.k.head_stride, 16 * 4);
        assert_eq!(v.k.place, Place::HOST);
        assert_ne!(v.k.addr, v.v.addr);
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    step.submit(move |kv| {
        let mut seen = Vec::new();
        for (i, l, v) in &views {
            let keys = kv.keys::<f32>(*i, *l).unwrap();
            let values = kv.values::<f32>(*i, *l).unwrap();
            seen.push(
                keys.as_ptr() as u64 == v.k.addr
                    && values.as_ptr() as u64 == v.v.addr
                    && (keys.len() * 4) as u64 == v.k.bytes(),
            );
        }
        tx.send(seen).unwrap();
    })
    .unwrap();
    assert!(rx.await.unwrap().iter().all(|x| *x));
    // A write of the wrong type or length, or to a sequence not in the step, is refused.
    let (tx, rx) = tokio::sync::oneshot::channel();
    step.submit(move |kv| {
        let row = vec![0f32; SHAPE.token_elems()];
        let half = vec![f16::ZERO; SHAPE.token_elems()];
        tx.send([
            kv.write(0, 0, &half, &half).is_err(),
            kv.write(0, 0, &row[1..], &row).is_err(),
            kv.write(2, 0, &row, &row).is_err(),
            kv.write(0, SHAPE.layers, &row, &row).is_err(),
            kv.write(usize::MAX, usize::MAX, &row, &row).is_err(),
        ])
        .unwrap();
    })
    .unwrap();
    assert_eq!(rx.await.unwrap(), [true; 5]);
    drop(step);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_step_counts_nothing_and_holds_its_memory_until_its_kernels_ran() {
    let (g, p, kv) = store(SHAPE, 1 << 30).await;
    kv.open(1, vec![], 0).await.unwrap();
    for pos in 0..3 {
        own_step(&kv, 1, pos).await;
    }
    // A kernel of the step waits behind a gate; the step is dropped meanwhile, and the
    // sequence closed: nothing may be unmapped before the kernel ran.
    let (open, gate) = crossbeam_channel::bounded::<()>(0);
    let step = kv.prepare(vec![1]).await.unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    step.submit(move |kv| {
        gate.recv().unwrap();
        let keys = kv.keys::<f32>(0, 1).unwrap();
        tx.send(keys.iter().map(|x| x.to_bits() as u64).sum::<u64>())
            .unwrap();
    })
    .unwrap();
    drop(step);
    assert!(
        matches!(
            kv.prepare(vec![1]).await,
            Err(KvStoreError::Table(TableError::Busy(1)))
        ),
        "the step's memory is not back before its kernel ran"
    );
    kv.close(1);
    tokio::time::sleep(Duration::from_millis(30)).await;
    let resident = p.mechanism().backing().resident_bytes().unwrap();
    assert!(resident > 0, "nothing unmapped under a queued kernel");
    open.send(()).unwrap();
    rx.await.unwrap();
    let start = std::time::Instant::now();
    while settled(&g, &kv).await.os_resident_bytes != 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "never freed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(kv.stats().await.unwrap().sequences, 0);

    // Dropped without a kernel: the token does not count, and the sequence steps on.
    kv.open(2, vec![], 0).await.unwrap();
    own_step(&kv, 2, 0).await;
    drop(kv.prepare(vec![2]).await.unwrap());
    let mut tries = 0;
    let step = loop {
        match kv.prepare(vec![2]).await {
            Ok(step) => break step,
            Err(KvStoreError::Table(TableError::Busy(2))) if tries < 100 => tries += 1,
            Err(e) => panic!("{e}"),
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    assert_eq!(step.positions(), &[1], "the dropped step counted nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_of_another_stream_is_refused_and_counts_nothing() {
    let (_g, _p, kv) = store(SHAPE, 1 << 30).await;
    let other = CpuProvider::spawn(CpuProviderConfig::default())
        .await
        .unwrap();
    kv.open(1, vec![], 0).await.unwrap();
    own_step(&kv, 1, 0).await;
    let step = kv.prepare(vec![1]).await.unwrap();
    let foreign = other.stream(0).unwrap().submit(&[], || {}).unwrap();
    let got = step.complete(foreign).await;
    assert!(matches!(got, Err(KvStoreError::ForeignFence(_))), "{got:?}");
    let step = kv.prepare(vec![1]).await.unwrap();
    assert_eq!(step.positions(), &[1]);
    // A fence of the step's own stream that has not been reached yet is waited for.
    let (open, gate) = crossbeam_channel::bounded::<()>(0);
    let late = step
        .stream()
        .cpu()
        .unwrap()
        .submit(&[], move || gate.recv().unwrap())
        .unwrap();
    let completing = tokio::spawn(step.complete(late));
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(!completing.is_finished(), "completed before its fence");
    open.send(()).unwrap();
    completing.await.unwrap().unwrap();
    assert_eq!(kv.stats().await.unwrap().tokens, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_and_reopen_while_a_step_is_out_never_mixes_the_two() {
    let (g, _p, kv) = store(SHAPE, 1 << 30).await;
    kv.open(7, vec![], 0).await.unwrap();
    for pos in 0..4 {
        own_step(&kv, 7, pos).await;
    }
    let old = kv.prepare(vec![7]).await.unwrap();
    kv.close(7);
    kv.open(7, vec![], 0).await.unwrap();
    // The new incarnation is empty and steps on its own.
    let fresh = own_step(&kv, 7, 0).await;
    // The old step writes its memory and completes: it is freed, the new one untouched.
    let row = vec![9.0f32; SHAPE.token_elems()];
    old.submit(move |kv| {
        for layer in 0..SHAPE.layers {
            kv.write(0, layer, &row, &row).unwrap();
        }
    })
    .unwrap();
    old.complete(StepEnd::Submitted).await.unwrap();
    let s = settled(&g, &kv).await;
    assert_eq!((s.sequences, s.tokens), (1, 1));
    let again = kv.prepare(vec![7]).await.unwrap();
    assert_eq!(again.positions(), &[1]);
    let (tx, rx) = tokio::sync::oneshot::channel();
    again
        .submit(move |kv| {
            let keys = kv.keys::<f32>(0, 0).unwrap();
            tx.send(keys[..SHAPE.token_elems()].to_vec()).unwrap();
        })
        .unwrap();
    let first_row = rx.await.unwrap();
    assert_eq!(
        first_row,
        kv_floats(7, 0, 0, 1, SHAPE.token_elems()),
        "the new sequence holds its own first row"
    );
    assert!(!fresh.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_that_panics_fails_its_call_and_the_step_still_ends_cleanly() {
    let (g, _p, kv) = store(SHAPE, 1 << 30).await;
    kv.open(1, vec![], 0).await.unwrap();
    let step = kv.prepare(vec![1]).await.unwrap();
    let bad = procmem_actors::kv::AttendItem {
        seq: 1,
        q: vec![0.0; 3],
        k: vec![0.0; SHAPE.token_elems()],
        v: vec![0.0; SHAPE.token_elems()],
    };
    assert!(step.attend(0, vec![bad]).await.is_err(), "a short q");
    let stranger = procmem_actors::kv::AttendItem {
        seq: 99,
        q: vec![0.0; 64],
        k: vec![0.0; SHAPE.token_elems()],
        v: vec![0.0; SHAPE.token_elems()],
    };
    assert!(matches!(
        step.attend(0, vec![stranger]).await,
        Err(KvStoreError::Table(TableError::NotInStep(99)))
    ));
    step.submit(|_| panic!("a server's kernel fails")).unwrap();
    step.complete(StepEnd::Submitted).await.unwrap();
    let s = settled(&g, &kv).await;
    assert_eq!(s.tokens, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_bit_kv_steps_swaps_and_comes_back_bit_for_bit() {
    let shape = KvShape {
        k_dtype: KvDtype::F16,
        v_dtype: KvDtype::F16,
        ..SHAPE
    };
    let (g, _p, kv) = store(shape, 1 << 30).await;
    kv.open(1, vec![], 0).await.unwrap();
    let row = |pos: usize, layer: usize, which: u64| -> Vec<f16> {
        kv_floats(1, pos, layer, which, shape.token_elems())
            .into_iter()
            .map(f16::from_f32)
            .collect()
    };
    for pos in 0..40 {
        let step = kv.prepare(vec![1]).await.unwrap();
        assert_eq!(step.views(0, 0).unwrap().k.token_stride, 2 * 32);
        let (k0, v0, k1, v1) = (
            row(pos, 0, 1),
            row(pos, 0, 2),
            row(pos, 1, 1),
            row(pos, 1, 2),
        );
        step.submit(move |kv| {
            kv.write(0, 0, &k0, &v0).unwrap();
            kv.write(0, 1, &k1, &v1).unwrap();
        })
        .unwrap();
        step.complete(StepEnd::Submitted).await.unwrap();
    }
    let before = settled(&g, &kv).await;
    assert_eq!(before.tokens, 40);
    // Pressure swaps it out; it comes back with the same 16-bit rows.
    g.set_capacity(before.leased_bytes).await.unwrap();
    let grant = another_holder_asks(g.clone(), before.exclusive_bytes, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(kv.stats().await.unwrap().preempted, 1);
    drop(grant);
    assert_eq!(
        kv.restore(1).await.unwrap(),
        Restored::Swapped { tokens: 40 }
    );
    let step = kv.prepare(vec![1]).await.unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    step.submit(move |kv| {
        let keys = kv.keys::<f16>(0, 1).unwrap()[..40 * 32].to_vec();
        tx.send(keys).unwrap();
    })
    .unwrap();
    let keys = rx.await.unwrap();
    drop(step);
    for pos in 0..40 {
        assert_eq!(
            keys[pos * 32..(pos + 1) * 32],
            row(pos, 1, 1)[..],
            "pos {pos}"
        );
    }
}

/// Found at 1/8 of demand in the main job: two sequences whose memory was only their own
/// prompt blocks waited for one grant together, neither could be chosen (a sequence with no
/// memory of its own counted as freeing nothing), and the batch stalled until its deadline,
/// again and again. The newer one gives way now: its blocks go with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_holding_only_its_prompt_blocks_still_gives_way() {
    let (g, _p, kv) = store(SHAPE, 1 << 30).await;
    let bt = SHAPE.block_tokens(4096);
    for seq in [1u64, 2] {
        let prompt: Vec<u32> = (0..2 * bt as u32).map(|t| t + 1000 * seq as u32).collect();
        kv.open(seq, prompt, 0).await.unwrap();
    }
    for pos in 0..2 * bt {
        for seq in [1u64, 2] {
            own_step(&kv, seq, pos).await;
        }
    }
    let s = settled(&g, &kv).await;
    assert_eq!((s.exclusive_bytes, s.prefix_entries), (0, 4), "{s:?}");
    // Room for one sequence's next chunk, not two.
    let chunk = 2 * 4096 * SHAPE.buffers() as u64;
    g.set_capacity(s.leased_bytes + chunk).await.unwrap();
    let both = kv.prepare(vec![1, 2]).await;
    assert!(
        matches!(both, Err(KvStoreError::Table(TableError::Preempted(2, _)))),
        "the newer sequence gives way: {both:?}"
    );
    let step = kv.prepare(vec![1]).await.unwrap();
    assert_eq!(step.positions(), &[2 * bt]);
}

/// Found in review: with the store gone, a dropped step's memory was freed as soon as the
/// kernels submitted through `submit` had run, though a server's own kernels queued on the
/// stream (through the views) may still read it. It now waits for everything queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_outliving_its_store_keeps_its_memory_until_the_stream_ran() {
    let (g, p, kv) = store(SHAPE, 1 << 30).await;
    kv.open(1, vec![], 0).await.unwrap();
    own_step(&kv, 1, 0).await;
    let step = kv.prepare(vec![1]).await.unwrap();
    // The server's own kernel, queued directly on the step's stream behind a gate.
    let (open, gate) = crossbeam_channel::bounded::<()>(0);
    step.stream()
        .cpu()
        .unwrap()
        .submit(&[], move || gate.recv().unwrap())
        .unwrap();
    let store = kv.actor();
    store.kill();
    store.wait(Some(Duration::from_secs(10))).await.unwrap();
    drop(step);
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(
        p.mechanism().backing().resident_bytes().unwrap() > 0,
        "nothing unmapped under the queued kernel"
    );
    open.send(()).unwrap();
    let start = std::time::Instant::now();
    while p.mechanism().backing().resident_bytes().unwrap() != 0
        || g.snapshot().await.unwrap().books.leased != 0
    {
        assert!(start.elapsed() < Duration::from_secs(10), "never freed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Found in review: a step ending while its stream shuts down (queued kernels still run, new
/// work is refused) looped between ending and returning without waiting, and could overflow
/// the stack. The store now waits for the last work the stream took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_ending_while_its_stream_shuts_down_waits_for_what_was_queued() {
    let (_g, p, kv) = store(SHAPE, 1 << 30).await;
    kv.open(1, vec![], 0).await.unwrap();
    own_step(&kv, 1, 0).await;
    let step = kv.prepare(vec![1]).await.unwrap();
    let (open, gate) = crossbeam_channel::bounded::<()>(0);
    let (tx, rx) = tokio::sync::oneshot::channel();
    step.submit(move |kv| {
        gate.recv().unwrap();
        tx.send(kv.keys::<f32>(0, 0).map(|k| k.len()).unwrap_or(0))
            .unwrap();
    })
    .unwrap();
    let stopping = {
        let p = p.clone();
        tokio::spawn(async move { p.shutdown().await })
    };
    // The step ends once its stream takes no more work (an empty kernel until then).
    let stream = p.stream(0).unwrap().clone();
    let start = std::time::Instant::now();
    while stream.submit(&[], || {}).is_ok() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the stream never closed"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let ending = tokio::spawn(step.complete(StepEnd::Submitted));
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(
        !ending.is_finished(),
        "the step waits for its queued kernel"
    );
    open.send(()).unwrap();
    assert_eq!(rx.await.unwrap(), 2 * SHAPE.token_elems());
    let _ = ending.await.unwrap();
    let _ = stopping.await;
}

/// Found in review: a step whose kernels ran on another stream had no way to make the store
/// wait for them. `complete(StepEnd::After(..))` takes that stream's fence with its timeline;
/// the memory comes back (and the token counts) only after it, also when the caller gives up
/// waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_completed_after_another_streams_fence_waits_for_it() {
    let (_g, p, kv) = store(SHAPE, 1 << 30).await;
    let other = CpuProvider::spawn(CpuProviderConfig::default())
        .await
        .unwrap();
    let other_stream = other.stream(0).unwrap().clone();
    kv.open(1, vec![], 0).await.unwrap();
    own_step(&kv, 1, 0).await;
    for give_up in [false, true] {
        let step = kv.prepare(vec![1]).await.unwrap();
        let before = step.positions()[0];
        let (open, gate) = crossbeam_channel::bounded::<()>(0);
        let fence = other_stream
            .submit(&[], move || gate.recv().unwrap())
            .unwrap();
        let after = TimelineFence::new(fence, other_stream.timeline()).unwrap();
        let mut ending = Some(tokio::spawn(step.complete(after)));
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(
            !ending.as_ref().unwrap().is_finished(),
            "waits for the other stream"
        );
        if give_up {
            // The caller gives up; the step had ended already (it counts), and its memory
            // still waits for the other stream.
            let e = ending.take().unwrap();
            e.abort();
            let _ = e.await;
        }
        assert!(
            matches!(
                kv.prepare(vec![1]).await,
                Err(KvStoreError::Table(TableError::Busy(1)))
            ),
            "the memory is not back before the other stream's fence"
        );
        assert!(p.mechanism().backing().resident_bytes().unwrap() > 0);
        open.send(()).unwrap();
        if let Some(e) = ending {
            e.await.unwrap().unwrap();
        }
        let start = std::time::Instant::now();
        let step = loop {
            match kv.prepare(vec![1]).await {
                Ok(step) => break step,
                Err(KvStoreError::Table(TableError::Busy(1)))
                    if start.elapsed() < Duration::from_secs(5) =>
                {
                    tokio::time::sleep(Duration::from_millis(2)).await
                }
                Err(e) => panic!("{e}"),
            }
        };
        assert_eq!(step.positions()[0], before + 1, "the token counts");
        drop(step);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A store config growing one granule at a time and mapping ahead, with the tokens a chunk
/// holds and a chunk's bytes over every buffer.
fn mapping_ahead() -> (usize, u64, procmem_actors::kv::KvStoreConfig) {
    let page = procmem_actors::procmem::granularity();
    let mut config = kv_config(SHAPE, 1, PreemptMode::Swap, Duration::from_millis(300));
    config.map_ahead = true;
    let per_chunk = (page / SHAPE.token_bytes(procmem_actors::procmem::kv::KvPart::K)) as usize;
    (per_chunk, page * SHAPE.buffers() as u64, config)
}

/// Prepares a step of sequence 1 that fills its first chunk and waits until the second is
/// mapped (and charged) while the step is out.
async fn prepare_with_next_chunk_mapped(kv: &KvStoreHandle, chunk_bytes: u64) -> KvStep {
    let step = kv.prepare(vec![1]).await.unwrap();
    let start = std::time::Instant::now();
    while kv.stats().await.unwrap().leased_bytes < 2 * chunk_bytes {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "nothing mapped ahead"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    step
}

/// With `map_ahead`, the chunk the token after a step needs is charged and mapped while the
/// step runs: the next prepare asks the Governor for nothing, the outputs are those of a store
/// that maps at prepare, and the books agree with the kernel all along. A close while the
/// mapping is on its way leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn growth_mapped_ahead_is_published_by_the_next_prepare_without_a_grant() {
    let (per_chunk, chunk_bytes, config) = mapping_ahead();
    let (g, _p, kv) = kv_system(1 << 30, config).await;
    let (rg, _rp, reference) = store(SHAPE, 1 << 30).await;
    kv.open(1, vec![], 0).await.unwrap();
    reference.open(1, vec![], 0).await.unwrap();
    for pos in 0..per_chunk - 1 {
        assert_eq!(
            own_step(&kv, 1, pos).await,
            own_step(&reference, 1, pos).await
        );
    }
    // The step that fills the first chunk: the second is mapped while it is out.
    let step = prepare_with_next_chunk_mapped(&kv, chunk_bytes).await;
    let grants = g.snapshot().await.unwrap().grants;
    let pos = per_chunk - 1;
    assert_eq!(
        run_step(step, 1, pos).await,
        own_step(&reference, 1, pos).await
    );
    let s = settled(&g, &kv).await;
    assert_eq!(s.leased_bytes, 2 * chunk_bytes, "{s:?}");
    // The step into the new chunk publishes what was mapped: no grant, the same outputs.
    assert_eq!(
        own_step(&kv, 1, per_chunk).await,
        own_step(&reference, 1, per_chunk).await
    );
    assert_eq!(
        g.snapshot().await.unwrap().grants,
        grants,
        "the step into the new chunk needed no grant"
    );
    settled(&g, &kv).await;
    settled(&rg, &reference).await;
    // Close while the next mapping may be on its way: everything goes back.
    for pos in per_chunk + 1..2 * per_chunk {
        own_step(&kv, 1, pos).await;
    }
    let step = kv.prepare(vec![1]).await.unwrap();
    drop(step);
    kv.close(1);
    let start = std::time::Instant::now();
    while g.snapshot().await.unwrap().books.leased > 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "books not zero");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let s = settled(&g, &kv).await;
    assert_eq!((s.leased_bytes, s.os_resident_bytes), (0, 0));
}

/// Growth mapped ahead and not yet published is slack: under pressure it goes first, and no
/// sequence is preempted for the room it frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn growth_mapped_ahead_is_given_back_first_under_pressure() {
    let (per_chunk, chunk_bytes, config) = mapping_ahead();
    // Room for exactly two chunks: the one in use and the one mapped ahead.
    let (g, _p, kv) = kv_system(2 * chunk_bytes, config).await;
    kv.open(1, vec![], 0).await.unwrap();
    for pos in 0..per_chunk - 1 {
        own_step(&kv, 1, pos).await;
    }
    let step = prepare_with_next_chunk_mapped(&kv, chunk_bytes).await;
    run_step(step, 1, per_chunk - 1).await;
    // Another holder wants one chunk: the slack is unmapped and its lease released.
    let grant = another_holder_asks(g.clone(), chunk_bytes, Duration::from_secs(5))
        .await
        .expect("the slack made room");
    let s = kv.stats().await.unwrap();
    assert_eq!(s.preemptions, 0, "{s:?}");
    assert_eq!(s.leased_bytes, chunk_bytes, "{s:?}");
    drop(grant);
    // The sequence goes on: its next step maps the chunk again, at prepare.
    own_step(&kv, 1, per_chunk).await;
    let s = settled(&g, &kv).await;
    assert_eq!(s.leased_bytes, 2 * chunk_bytes, "{s:?}");
}
