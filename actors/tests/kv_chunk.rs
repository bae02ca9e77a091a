//! Steps of many tokens: a prompt's chunk written and attended in one step, row for row the
//! same as one token per step; counts a careless server sends; prompt blocks shared while the
//! first request still prefills; a sequence preempted mid-prefill coming back; a closed
//! sequence's answer blocks left to the next turn.

mod common;

use procmem_actors::kv::{NewTokens, StepEnd, TableError};
use std::time::Duration;

use common::{another_holder_asks, kv_config, kv_floats, kv_system, settled};
use procmem_actors::procmem::kv::{gqa_causal, gqa_decode, Heads, KvError, KvShape};
use procmem_actors::{
    governor::GovernorHandle,
    kv::{KvStep, KvStoreError, KvStoreHandle, PreemptMode, Restored},
    provider::CpuProvider,
};

const SHAPE: KvShape = common::shape(512);
use common::PAGE;
const QW: usize = SHAPE.q_heads * SHAPE.head_dim;

async fn store(capacity: u64) -> (GovernorHandle, KvStoreHandle) {
    let (g, _p, kv) = store_on(capacity).await;
    (g, kv)
}

async fn store_on(capacity: u64) -> (GovernorHandle, CpuProvider, KvStoreHandle) {
    let config = kv_config(SHAPE, 2, PreemptMode::Swap, Duration::from_millis(300));
    kv_system(capacity, config).await
}

/// Rows `from..from + n` of one of `seq`'s inputs (`which`: 0 q, 1 k, 2 v) at `layer`, as a
/// model would make them: the same row whatever step it goes in.
fn rows(seq: u64, from: usize, n: usize, layer: usize, which: u64) -> Vec<f32> {
    let width = if which == 0 { QW } else { SHAPE.token_elems() };
    (from..from + n)
        .flat_map(|pos| kv_floats(seq, pos, layer, which, width))
        .collect()
}

/// Runs every layer of a step whose `i`-th sequence is `seqs[i]` (the data's seed): writes
/// its new rows in one call and attends them causally. Returns per sequence, per layer, the
/// output rows (flat), then completes the step (`StepEnd::Submitted`).
async fn chunk_step(step: KvStep, seeds: &[u64]) -> Vec<Vec<Vec<f32>>> {
    let (positions, counts) = (step.positions().to_vec(), step.counts().to_vec());
    let mut outs = vec![Vec::new(); seeds.len()];
    for layer in 0..SHAPE.layers {
        for (i, &seed) in seeds.iter().enumerate() {
            let (pos, n) = (positions[i], counts[i]);
            let (q, k, v) = (
                rows(seed, pos, n, layer, 0),
                rows(seed, pos, n, layer, 1),
                rows(seed, pos, n, layer, 2),
            );
            let (tx, rx) = tokio::sync::oneshot::channel();
            step.submit(move |kv| {
                kv.write_rows(i, layer, 0, &k, &v).unwrap();
                let (keys, values) = (kv.keys::<f32>(i, layer).unwrap(), kv.values(i, layer));
                let mut out = vec![0f32; q.len()];
                gqa_causal(
                    &q,
                    keys,
                    values.unwrap(),
                    pos,
                    Heads::new(4, 2, 16),
                    &mut out,
                );
                tx.send(out).unwrap();
            })
            .unwrap();
            outs[i].push(rx.await.unwrap());
        }
    }
    step.complete(StepEnd::Submitted).await.unwrap();
    outs
}

/// `prepare_tokens`, once a step of the same sequences dropped just before has come back
/// (a dropped step's memory returns after its fence: meanwhile the sequence is `Busy`).
async fn prepare(kv: &KvStoreHandle, batch: Vec<(u64, usize)>) -> Result<KvStep, KvStoreError> {
    let start = std::time::Instant::now();
    let batch: Vec<NewTokens> = batch
        .into_iter()
        .map(|(seq, count)| NewTokens { seq, count })
        .collect();
    loop {
        match kv.prepare_tokens(batch.clone()).await {
            Err(KvStoreError::Table(TableError::Busy(_)))
                if start.elapsed() < Duration::from_secs(5) =>
            {
                tokio::time::sleep(Duration::from_millis(2)).await
            }
            other => return other,
        }
    }
}

/// Layer `layer`'s keys of `seq` as the store holds them (through a one-token step that is
/// then dropped, counting nothing).
async fn held_keys(kv: &KvStoreHandle, seq: u64, layer: usize, tokens: usize) -> Vec<f32> {
    let step = prepare(kv, vec![(seq, 1)]).await.unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    step.submit(move |kv| {
        let keys = kv.keys::<f32>(0, layer).unwrap()[..tokens * SHAPE.token_elems()].to_vec();
        tx.send(keys).unwrap();
    })
    .unwrap();
    let keys = rx.await.unwrap();
    drop(step);
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_is_row_for_row_the_same_as_one_token_per_step() {
    let (g, kv) = store(1 << 30).await;
    // Sequence 1 takes 100 tokens in chunks of 40, 1 and 59 (a decode token in between);
    // sequence 2 the same rows one per step.
    kv.open(1, vec![7; 100], 0).await.unwrap();
    kv.open(2, vec![8; 100], 0).await.unwrap();
    let mut chunked: Vec<Vec<f32>> = vec![Vec::new(); SHAPE.layers];
    for n in [40, 1, 59] {
        let step = prepare(&kv, vec![(1, n)]).await.unwrap();
        assert_eq!(step.counts(), [n]);
        let views = step.views(0, 1).unwrap();
        assert_eq!(
            views.k.tokens,
            step.positions()[0] + n,
            "views cover the new rows"
        );
        let out = chunk_step(step, &[1]).await;
        for (layer, o) in out[0].iter().enumerate() {
            chunked[layer].extend(o);
        }
    }
    let mut single: Vec<Vec<f32>> = vec![Vec::new(); SHAPE.layers];
    for _ in 0..100 {
        let step = kv.prepare(vec![2]).await.unwrap();
        let out = chunk_step(step, &[1]).await;
        for (layer, o) in out[0].iter().enumerate() {
            single[layer].extend(o);
        }
    }
    for layer in 0..SHAPE.layers {
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&chunked[layer]), bits(&single[layer]), "layer {layer}");
        assert_eq!(
            held_keys(&kv, 1, layer, 100).await,
            held_keys(&kv, 2, layer, 100).await
        );
    }
    // Each row of a chunk saw only itself and the rows before it: row 0 of the first chunk is
    // a decode over one token.
    let mut first = vec![0f32; QW];
    let (q, k, v) = (
        rows(1, 0, 1, 0, 0),
        rows(1, 0, 1, 0, 1),
        rows(1, 0, 1, 0, 2),
    );
    gqa_decode(&q, &k, &v, 1, Heads::new(4, 2, 16), &mut first);
    assert_eq!(chunked[0][..QW], first[..]);
    let s = settled(&g, &kv).await;
    assert_eq!(s.tokens, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_mixes_a_prompt_chunk_with_decode_tokens() {
    let (_g, kv) = store(1 << 30).await;
    for seq in 1..=3 {
        kv.open(seq, vec![seq as u32; 64], 0).await.unwrap();
    }
    // Sequences 1 and 2 decode one token each; 3 takes a chunk of 30, all in one step.
    let step = prepare(&kv, vec![(1, 1), (2, 1), (3, 30)]).await.unwrap();
    assert_eq!(step.positions(), [0, 0, 0]);
    assert_eq!(step.counts(), [1, 1, 30]);
    chunk_step(step, &[1, 2, 3]).await;
    let step = prepare(&kv, vec![(3, 2), (1, 1), (2, 1)]).await.unwrap();
    assert_eq!(step.positions(), [30, 1, 1]);
    chunk_step(step, &[3, 1, 2]).await;
    assert_eq!(kv.stats().await.unwrap().tokens, 32 + 2 + 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn careless_counts_are_refused_whole_and_change_nothing() {
    let (g, kv) = store(1 << 30).await;
    kv.open(1, vec![1; 10], 0).await.unwrap();
    kv.open(2, vec![2; 10], 0).await.unwrap();
    let before = settled(&g, &kv).await;
    for (batch, want) in [
        (vec![(1, 0)], "NoTokens(1)"),
        (vec![(2, 3), (1, 0)], "NoTokens(1)"),
        (vec![(1, usize::MAX)], "Full"),
        (vec![(1, SHAPE.max_tokens + 1)], "Full"),
        (vec![(2, 4), (1, usize::MAX - 1)], "Full"),
        (vec![(1, 3), (1, 2)], "Duplicate(1)"),
        (vec![(9, 3)], "Unknown(9)"),
    ] {
        let got = prepare(&kv, batch.clone()).await.unwrap_err();
        assert!(format!("{got:?}").contains(want), "{batch:?}: {got:?}");
        let now = settled(&g, &kv).await;
        assert_eq!((now.tokens, now.leased_bytes), (0, before.leased_bytes));
    }
    // A kernel that writes past its rows, or rows of another size, is refused there.
    let step = prepare(&kv, vec![(1, 4)]).await.unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    step.submit(move |kv| {
        let e = SHAPE.token_elems();
        let past = kv.write_rows(0, 0, 2, &vec![0f32; 3 * e], &vec![0f32; 3 * e]);
        let ragged = kv.write_rows(0, 0, 0, &vec![0f32; e + 1], &vec![0f32; e + 1]);
        let uneven = kv.write_rows(0, 0, 0, &vec![0f32; 2 * e], &vec![0f32; e]);
        let far = kv.write_rows(0, 0, usize::MAX, &vec![0f32; e], &vec![0f32; e]);
        let none = kv.write_rows(1, 0, 0, &vec![0f32; e], &vec![0f32; e]);
        tx.send([past, ragged, uneven, far, none]).unwrap();
    })
    .unwrap();
    let [past, ragged, uneven, far, none] = rx.await.unwrap();
    assert!(matches!(past, Err(KvError::NotMapped(_))), "{past:?}");
    assert!(
        matches!(ragged, Err(KvError::WrongLength { .. })),
        "{ragged:?}"
    );
    assert!(
        matches!(uneven, Err(KvError::WrongLength { .. })),
        "{uneven:?}"
    );
    assert!(matches!(far, Err(KvError::NotMapped(_))), "{far:?}");
    assert!(matches!(none, Err(KvError::BadIndex(1))), "{none:?}");
    drop(step);
    // The sequence still takes a whole chunk after all that.
    let step = prepare(&kv, vec![(1, 10)]).await.unwrap();
    assert_eq!(step.positions(), [0]);
    chunk_step(step, &[1]).await;
    assert_eq!(settled(&g, &kv).await.tokens, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_blocks_are_shared_while_the_first_request_still_prefills() {
    let (g, kv) = store(1 << 30).await;
    let bt = SHAPE.block_tokens(PAGE);
    let prompt: Vec<u32> = (0..(4 * bt + 3) as u32).collect();
    assert_eq!(
        kv.open(1, prompt.clone(), 0).await.unwrap().cached_tokens,
        0
    );
    // The first chunk fills two whole blocks (and a little of the third).
    let step = prepare(&kv, vec![(1, 2 * bt + 5)]).await.unwrap();
    chunk_step(step, &[1]).await;
    // A second request with the same prompt, while the first is mid-prefill: the two
    // written blocks are its, the rest it computes.
    let second = kv.open(2, prompt.clone(), 0).await.unwrap();
    assert_eq!(second.cached_tokens, 2 * bt);
    for layer in 0..SHAPE.layers {
        assert_eq!(
            held_keys(&kv, 2, layer, 2 * bt).await,
            held_keys(&kv, 1, layer, 2 * bt).await,
            "layer {layer}"
        );
    }
    // The first finishes its prompt; a third request shares all four whole blocks.
    let step = prepare(&kv, vec![(1, prompt.len() - (2 * bt + 5))])
        .await
        .unwrap();
    chunk_step(step, &[1]).await;
    assert_eq!(kv.open(3, prompt, 0).await.unwrap().cached_tokens, 4 * bt);
    settled(&g, &kv).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_preempted_mid_prefill_comes_back_where_it_was() {
    let (g, kv) = store(1 << 30).await;
    kv.open(1, vec![5; 300], 0).await.unwrap();
    let step = prepare(&kv, vec![(1, 120)]).await.unwrap();
    chunk_step(step, &[1]).await;
    let before = settled(&g, &kv).await;
    // The rows the chunk wrote (read back only after the restore: a step lent to read them
    // now could still be out when the pressure below arrives, and a sequence in a step is
    // not a victim).
    let keys = rows(1, 0, 120, 1, 1);
    // Pressure swaps it out between two chunks.
    g.set_capacity(before.leased_bytes).await.unwrap();
    let grant = another_holder_asks(g.clone(), before.leased_bytes / 2, Duration::from_secs(2))
        .await
        .unwrap();
    let refused = prepare(&kv, vec![(1, 100)]).await.unwrap_err();
    assert!(
        matches!(refused, KvStoreError::Table(TableError::Preempted(1, _))),
        "{refused:?}"
    );
    drop(grant);
    g.set_capacity(1 << 30).await.unwrap();
    assert_eq!(
        kv.restore(1).await.unwrap(),
        Restored::Swapped { tokens: 120 }
    );
    assert_eq!(held_keys(&kv, 1, 1, 120).await, keys);
    // The prefill goes on from row 120.
    let step = prepare(&kv, vec![(1, 180)]).await.unwrap();
    assert_eq!(step.positions(), [120]);
    chunk_step(step, &[1]).await;
    assert_eq!(settled(&g, &kv).await.tokens, 300);
}

/// Prefills `prompt` into `seq` (rows of seed `seq`) in one chunk, then `decoded` tokens one
/// per step, as a server generating an answer would.
async fn prefill_and_decode(kv: &KvStoreHandle, seq: u64, prompt: &[u32], decoded: usize) {
    let cached = kv
        .open(seq, prompt.to_vec(), 0)
        .await
        .unwrap()
        .cached_tokens;
    let step = prepare(kv, vec![(seq, prompt.len() - cached)])
        .await
        .unwrap();
    chunk_step(step, &[seq]).await;
    for _ in 0..decoded {
        let step = prepare(kv, vec![(seq, 1)]).await.unwrap();
        chunk_step(step, &[seq]).await;
    }
}

/// Waits until `kept` blocks were left to the cache at close, and the books agree.
async fn kept(g: &GovernorHandle, kv: &KvStoreHandle, kept: u64) -> u64 {
    let start = std::time::Instant::now();
    loop {
        let s = settled(g, kv).await;
        if s.prefix_blocks_kept >= kept || start.elapsed() > Duration::from_secs(5) {
            return s.prefix_blocks_kept;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_sequence_leaves_its_answer_blocks_to_the_next_turn() {
    let (g, p, kv) = store_on(1 << 30).await;
    let bt = SHAPE.block_tokens(PAGE);
    // A prompt of two blocks and a bit; an answer that ends a little past block four.
    let prompt: Vec<u32> = (0..(2 * bt + 3) as u32).collect();
    let answer: Vec<u32> = (1000..1000 + (2 * bt + 5) as u32).collect();
    // Every answer token but the last is written (the last is sampled, never fed).
    prefill_and_decode(&kv, 1, &prompt, answer.len() - 1).await;
    let known: Vec<u32> = prompt.iter().chain(&answer).copied().collect();
    // While the copy waits on the stream, the kernel holds no more than the ledger: the new
    // blocks are made only once the sequence's memory is gone.
    let gate = common::hold_stream(&p);
    kv.close_keeping(1, known.clone());
    let s = kv.stats().await.unwrap();
    let ledger = g.snapshot().await.unwrap().books.leased;
    assert!(common::os_bytes(&p) <= ledger, "{s:?} against {ledger}");
    drop(gate);
    // Blocks 2 and 3 (prompt tail and answer) join the two prompt blocks already cached.
    assert_eq!(kept(&g, &kv, 2).await, 2);
    // The next turn: the conversation so far and a new message.
    let next: Vec<u32> = known.iter().chain(&[7, 8, 9]).copied().collect();
    let opened = kv.open(2, next, 0).await.unwrap();
    assert_eq!(opened.cached_tokens, 4 * bt);
    for layer in 0..SHAPE.layers {
        assert_eq!(
            held_keys(&kv, 2, layer, 4 * bt).await,
            rows(1, 0, 4 * bt, layer, 1),
            "layer {layer}: the kept rows are the first turn's"
        );
    }
    kv.close(2);
    let s = settled(&g, &kv).await;
    assert_eq!((s.sequences, s.prefix_entries), (0, 4), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn careless_closes_keep_nothing_wrong_and_the_books_stay_right() {
    let (g, kv) = store(1 << 30).await;
    let bt = SHAPE.block_tokens(PAGE);
    let prompt: Vec<u32> = (0..(bt + 1) as u32).collect();
    // Tokens that do not start with the blocks the sequence maps: nothing is kept.
    prefill_and_decode(&kv, 1, &prompt, 2 * bt).await;
    let other: Vec<u32> = (50_000..50_000 + 4 * bt as u32).collect();
    kv.close_keeping(1, other.clone());
    assert_eq!(kept(&g, &kv, 1).await, 0);
    assert_eq!(kv.open(9, other, 0).await.unwrap().cached_tokens, 0);
    kv.close(9);
    // Far more tokens than rows: only the whole blocks of its rows are kept.
    prefill_and_decode(&kv, 2, &prompt, bt).await;
    let long: Vec<u32> = prompt.iter().copied().chain(0..100_000).collect();
    kv.close_keeping(2, long.clone());
    assert_eq!(
        kept(&g, &kv, 1).await,
        1,
        "rows 0..{}: two whole blocks",
        2 * bt + 1
    );
    // A prompt longer than the shape holds is refused whole.
    assert!(matches!(
        kv.open(3, long.clone(), 0).await,
        Err(KvStoreError::Kv(KvError::Full(512)))
    ));
    let fits = long[..3 * bt].to_vec();
    assert_eq!(kv.open(3, fits, 0).await.unwrap().cached_tokens, 2 * bt);
    // In a step: closed plainly (its memory goes once the step ends), nothing kept.
    let step = prepare(&kv, vec![(3, 1)]).await.unwrap();
    kv.close_keeping(3, (0..1000).collect());
    let _ = step.complete(StepEnd::Submitted).await;
    // Unknown, twice, and with no tokens: nothing happens.
    kv.close_keeping(3, prompt.clone());
    kv.close_keeping(77, prompt.clone());
    prefill_and_decode(&kv, 4, &prompt, bt).await;
    kv.close_keeping(4, Vec::new());
    assert_eq!(kept(&g, &kv, 2).await, 1);
    // The same id opened again while its keep is on the stream: a new sequence.
    prefill_and_decode(&kv, 5, &prompt, 3 * bt).await;
    kv.close_keeping(5, prompt.iter().copied().chain(0..5000).collect());
    prefill_and_decode(&kv, 5, &prompt, 1).await;
    kv.close(5);
    let s = settled(&g, &kv).await;
    assert_eq!(s.sequences, 0, "{s:?}");
}

/// A ticket that comes while a closed sequence's blocks are being kept (the keep kernel
/// queued on the stream, its blocks not in the cache yet) waits for them, then takes them:
/// answered short at once, the Governor went to the next holder instead (on the real model
/// at `--budget 1x`, a layer of weights, which came back at once and preempted all four
/// sequences), and with nothing else released nobody asked the store again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_waits_for_the_blocks_being_kept_and_takes_them() {
    let bt = SHAPE.block_tokens(PAGE);
    let two_blocks = 2 * SHAPE.block_bytes_all(PAGE);
    let (g, p, kv) = store_on(two_blocks).await;
    // A prompt short of a block, then an answer to the end of the second block: its memory
    // is exactly the two blocks kept at close, so the keep kernel releases nothing itself.
    let prompt: Vec<u32> = (0..(bt / 2) as u32).collect();
    let answer: Vec<u32> = (1000..1000 + (2 * bt - prompt.len() + 1) as u32).collect();
    prefill_and_decode(&kv, 1, &prompt, answer.len() - 1).await;
    assert_eq!(settled(&g, &kv).await.leased_bytes, two_blocks);
    let known: Vec<u32> = prompt.iter().chain(&answer).copied().collect();
    let gate = common::hold_stream(&p);
    kv.close_keeping(1, known);
    let asked = tokio::spawn(another_holder_asks(
        g.clone(),
        two_blocks,
        Duration::from_secs(5),
    ));
    // The ticket is out while the keep waits behind the gate.
    let start = std::time::Instant::now();
    while g.snapshot().await.unwrap().tickets_sent == 0 {
        assert!(start.elapsed() < Duration::from_secs(5), "no ticket");
        tokio::task::yield_now().await;
    }
    drop(gate);
    let grant = asked.await.unwrap().expect("the kept blocks gave way");
    assert_eq!(grant.bytes(), two_blocks);
    drop(grant);
    let s = settled(&g, &kv).await;
    assert_eq!((s.prefix_blocks_kept, s.prefix_entries), (2, 0), "{s:?}");
}
