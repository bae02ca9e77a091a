//! The KV page store as a holder actor: decoding identical to a plain `Vec`, one grant per
//! step, rollback on denial, prefix sharing against the kernel's page count, pressure
//! answered with whole units, preemption and resumption, and a crash that frees nothing early.
#![allow(clippy::needless_range_loop)]

use procmem_actors::kv::{StepEnd, TableError};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use procmem_actors::procmem::kv::{gqa_decode, KvShape};
use procmem_actors::procmem::ledger::HolderId;
use procmem_actors::procmem::MemoryRole;
use procmem_actors::{
    governor::{GovernorConfig, GovernorError, GovernorHandle, ReserveRequest},
    kv::{AttendItem, KvStoreConfig, KvStoreError, KvStoreHandle, PreemptMode, Restored},
    provider::{CpuProvider, CpuProviderConfig},
};

mod common;

use common::{leased, until_waiting};

use common::{another_holder_asks, kv_config, kv_system, settles_to_zero};

const SHAPE: KvShape = common::shape(512);
use common::PAGE;

/// Deterministic K/V for (sequence, position, layer): replaying a sequence gives the very same
/// K/V, as a real model would.
fn item(seq: u64, pos: usize, layer: usize) -> AttendItem {
    common::kv_item(&SHAPE, seq, pos, layer)
}

/// The same decode over plain vectors.
#[derive(Default)]
struct Reference {
    kv: HashMap<(u64, usize), (Vec<f32>, Vec<f32>)>,
}

impl Reference {
    fn step(&mut self, it: &AttendItem, layer: usize) -> Vec<f32> {
        let e = self.kv.entry((it.seq, layer)).or_default();
        e.0.extend_from_slice(&it.k);
        e.1.extend_from_slice(&it.v);
        let n = e.0.len() / SHAPE.token_elems();
        let mut out = vec![0f32; it.q.len()];
        gqa_decode(&it.q, &e.0, &e.1, n, SHAPE.heads(), &mut out);
        out
    }
}

fn config(preempt: PreemptMode) -> KvStoreConfig {
    kv_config(SHAPE, 2, preempt, Duration::from_millis(300))
}

async fn setup(
    capacity: u64,
    preempt: PreemptMode,
) -> (GovernorHandle, CpuProvider, KvStoreHandle) {
    kv_system(capacity, config(preempt)).await
}

/// One decode step for `seqs` at positions `pos[i]`: prepare, then every layer.
async fn step(
    kv: &KvStoreHandle,
    seqs: &[(u64, usize)],
) -> Result<Vec<Vec<Vec<f32>>>, KvStoreError> {
    let step = kv.prepare(seqs.iter().map(|(s, _)| *s).collect()).await?;
    let mut out = Vec::new();
    for layer in 0..SHAPE.layers {
        let items = seqs.iter().map(|(s, p)| item(*s, *p, layer)).collect();
        out.push(step.attend(layer, items).await?);
    }
    step.complete(StepEnd::Submitted).await?;
    Ok(out)
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoding_through_the_store_matches_a_plain_vec_bit_for_bit() {
    let (g, _p, kv) = setup(1 << 30, PreemptMode::Swap).await;
    let mut reference = Reference::default();
    for s in [1, 2] {
        kv.open(s, vec![], 0).await.unwrap();
    }
    for pos in 0..300 {
        let out = step(&kv, &[(1, pos), (2, pos)]).await.unwrap();
        for (layer, per_seq) in out.iter().enumerate() {
            for (i, s) in [1u64, 2].iter().enumerate() {
                let expect = reference.step(&item(*s, pos, layer), layer);
                assert!(
                    same_bits(&per_seq[i], &expect),
                    "seq {s} pos {pos} layer {layer}"
                );
            }
        }
    }
    let stats = kv.stats().await.unwrap();
    assert_eq!(stats.tokens, 600);
    assert_eq!(
        stats.leased_bytes, stats.exclusive_bytes,
        "the store leases what it holds"
    );
    assert_eq!(
        stats.os_resident_bytes, stats.exclusive_bytes,
        "and the kernel agrees"
    );
    assert_eq!(
        leased(&g).await,
        stats.leased_bytes,
        "and so does the Governor"
    );
    let chunk = 2 * PAGE;
    let per_seq_tokens =
        300 * SHAPE.token_bytes(procmem_actors::procmem::kv::KvPart::K) * SHAPE.buffers() as u64;
    assert!(stats.exclusive_bytes <= 2 * (per_seq_tokens + chunk * SHAPE.buffers() as u64));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_step_leaves_the_old_view_and_the_books_unchanged() {
    let per_chunk = 2 * PAGE * SHAPE.buffers() as u64;
    let (g, _p, kv) = setup(per_chunk, PreemptMode::Swap).await;
    kv.open(1, vec![], 5).await.unwrap();
    let mut reference = Reference::default();
    let tokens_per_chunk =
        (2 * PAGE / SHAPE.token_bytes(procmem_actors::procmem::kv::KvPart::K)) as usize;
    for pos in 0..tokens_per_chunk {
        let out = step(&kv, &[(1, pos)]).await.unwrap();
        for layer in 0..SHAPE.layers {
            reference.step(&item(1, pos, layer), layer);
            let _ = &out;
        }
    }
    let before = (kv.stats().await.unwrap(), g.snapshot().await.unwrap().books);
    // The next token needs another chunk; the only holder is the store itself and its
    // one sequence is the requester, which is busy, so nothing can be freed: denied.
    let err = step(&kv, &[(1, tokens_per_chunk)]).await.unwrap_err();
    assert!(
        matches!(
            err,
            KvStoreError::Governor(GovernorError::DeadlineExpired(_))
        ),
        "{err}"
    );
    let after = (kv.stats().await.unwrap(), g.snapshot().await.unwrap().books);
    assert_eq!(before.0.exclusive_bytes, after.0.exclusive_bytes);
    assert_eq!(before.0.tokens, after.0.tokens);
    assert_eq!(
        (before.1.leased, before.1.provisional),
        (after.1.leased, after.1.provisional)
    );
    // Room appears: the same step now succeeds and matches the reference.
    g.set_capacity(4 * per_chunk).await.unwrap();
    let out = step(&kv, &[(1, tokens_per_chunk)]).await.unwrap();
    for (layer, o) in out.iter().enumerate() {
        let expect = reference.step(&item(1, tokens_per_chunk, layer), layer);
        assert!(same_bits(&o[0], &expect), "layer {layer} after the denial");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prompts_cost_only_their_unshared_part() {
    let (g, _p, kv) = setup(1 << 30, PreemptMode::Swap).await;
    let bt = SHAPE.block_tokens(PAGE);
    let prompt: Vec<u32> = (0..(3 * bt + 5) as u32).collect();
    let first = kv.open(1, prompt.clone(), 0).await.unwrap();
    assert_eq!(first.cached_tokens, 0);
    for pos in 0..prompt.len() {
        step(&kv, &[(1, pos)]).await.unwrap();
    }
    let after_first = kv.stats().await.unwrap();
    let block_bytes = 3 * SHAPE.block_bytes_all(PAGE);
    assert_eq!(after_first.prefix_bytes, block_bytes);
    assert_eq!(
        after_first.os_resident_bytes,
        block_bytes + after_first.exclusive_bytes
    );
    // The second sequence with the same prompt maps the three whole blocks: only its tail
    // (5 prompt tokens and what follows) takes new memory.
    let second = kv.open(2, prompt.clone(), 0).await.unwrap();
    assert_eq!(second.cached_tokens, 3 * bt);
    for pos in second.cached_tokens..prompt.len() {
        step(&kv, &[(2, pos)]).await.unwrap();
    }
    let after_second = kv.stats().await.unwrap();
    assert_eq!(
        after_second.prefix_bytes, block_bytes,
        "no new prefix memory"
    );
    assert_eq!(
        after_second.os_resident_bytes,
        block_bytes + after_second.exclusive_bytes
    );
    assert_eq!(
        after_second.exclusive_bytes,
        2 * after_first.exclusive_bytes,
        "the unshared tails only"
    );
    assert_eq!(leased(&g).await, after_second.leased_bytes);
    assert_eq!(after_second.prefix_hit_tokens, 3 * bt as u64);
    // The shared view is the same KV the first sequence computed: decoding continues alike.
    let a = step(&kv, &[(1, prompt.len())]).await.unwrap();
    let mut reference = Reference::default();
    for pos in 0..=prompt.len() {
        for layer in 0..SHAPE.layers {
            let out = reference.step(&item(1, pos, layer), layer);
            if pos == prompt.len() {
                assert!(same_bits(&a[layer][0], &out));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pressure_takes_whole_sequences_never_one_in_flight_and_they_resume_identically() {
    for mode in [PreemptMode::Swap, PreemptMode::Recompute] {
        let (g, p, kv) = setup(1 << 30, mode).await;
        let mut reference = Reference::default();
        let mut outputs: HashMap<(u64, usize, usize), Vec<f32>> = HashMap::new();
        for (s, prio) in [(1u64, 0), (2, 5), (3, 0)] {
            kv.open(s, vec![], prio).await.unwrap();
        }
        for pos in 0..40 {
            step(&kv, &[(1, pos), (2, pos), (3, pos)]).await.unwrap();
        }
        let held = kv.stats().await.unwrap().exclusive_bytes;
        // Hold sequence 3 in flight: its next attention queues behind a gated kernel.
        let (open, wait) = crossbeam_channel::bounded::<()>(0);
        p.stream(0)
            .unwrap()
            .submit(&[], move || wait.recv().unwrap())
            .unwrap();
        let held_step = Arc::new(kv.prepare(vec![3]).await.unwrap());
        let in_flight = {
            let step = Arc::clone(&held_step);
            tokio::spawn(async move { step.attend(0, vec![item(3, 40, 0)]).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Another holder needs almost everything: the Governor asks the store.
        g.set_capacity(held + held / 3).await.unwrap();
        let wanted = tokio::spawn(another_holder_asks(
            g.clone(),
            held / 2,
            Duration::from_secs(5),
        ));
        // A swap's copy out queues on the stream behind the gated kernel, so the grant waits
        // for the gate; the preemption itself is decided now.
        let start = std::time::Instant::now();
        let stats = loop {
            let stats = kv.stats().await.unwrap();
            if stats.preempted >= 1 || start.elapsed() > Duration::from_secs(5) {
                break stats;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        assert!(
            stats.preempted >= 1,
            "{mode:?}: a whole sequence was preempted"
        );
        assert!(
            stats.freed_by_pressure >= held / 6,
            "{mode:?}: whole units were freed"
        );
        open.send(()).unwrap();
        let grant = wanted.await.unwrap().unwrap();
        in_flight.await.unwrap().unwrap();
        held_step.attend(1, vec![item(3, 40, 1)]).await.unwrap();
        Arc::into_inner(held_step)
            .unwrap()
            .complete(StepEnd::Submitted)
            .await
            .unwrap();
        let st = kv.stats().await.unwrap();
        assert_eq!(
            st.preempted, stats.preempted,
            "the in-flight sequence 3 was never chosen"
        );
        // Sequence 1 (lowest priority, largest equal) goes first; bring it back and decode on.
        drop(grant);
        g.set_capacity(1 << 30).await.unwrap();
        for s in [1u64, 2] {
            match kv.restore(s).await.unwrap() {
                Restored::Swapped { tokens } => assert_eq!(tokens, 40),
                Restored::Recompute { tokens, cached } => {
                    assert_eq!(tokens, 40);
                    for pos in cached..tokens {
                        step(&kv, &[(s, pos)]).await.unwrap();
                    }
                }
            }
        }
        for s in [1u64, 2] {
            for pos in 0..=40 {
                for layer in 0..SHAPE.layers {
                    let out = reference.step(&item(s, pos, layer), layer);
                    outputs.insert((s, pos, layer), out);
                }
            }
            let got = step(&kv, &[(s, 40)]).await.unwrap();
            for layer in 0..SHAPE.layers {
                assert!(
                    same_bits(&got[layer][0], &outputs[&(s, 40, layer)]),
                    "{mode:?}: seq {s} resumed differently"
                );
            }
        }
        let end = kv.stats().await.unwrap();
        assert_eq!(end.leased_bytes, leased(&g).await, "{mode:?}");
        assert_eq!(
            end.os_resident_bytes,
            end.exclusive_bytes + end.prefix_bytes,
            "{mode:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_store_frees_its_memory_after_its_fences_and_the_books_follow() {
    let (g, p, kv) = setup(1 << 30, PreemptMode::Swap).await;
    let other: HolderId = g.register_holder("survivor", 0, None).await.unwrap();
    let survivor = g
        .reserve(ReserveRequest {
            holder: other,
            role: MemoryRole::Weights,
            bytes: 12345,
            priority: 0,
            deadline: None,
        })
        .await
        .unwrap()
        .commit(12345)
        .await
        .unwrap();
    kv.open(1, vec![], 0).await.unwrap();
    for pos in 0..50 {
        step(&kv, &[(1, pos)]).await.unwrap();
    }
    // Keep its last kernel in flight behind a gate, then crash the store.
    let (open, wait) = crossbeam_channel::bounded::<()>(0);
    p.stream(0)
        .unwrap()
        .submit(&[], move || wait.recv().unwrap())
        .unwrap();
    let step = Arc::new(kv.prepare(vec![1]).await.unwrap());
    let pending = {
        let step = Arc::clone(&step);
        tokio::spawn(async move { step.attend(0, vec![item(1, 50, 0)]).await })
    };
    // The step is abandoned: its memory stays held until the kernel it queued has run.
    drop(step);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let held = leased(&g).await - 12345;
    assert!(held > 0);
    kv.crash();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        leased(&g).await,
        12345 + held,
        "nothing refunded while its kernel is in flight"
    );
    open.send(()).unwrap();
    let _ = pending.await;
    let start = std::time::Instant::now();
    while leased(&g).await != 12345 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the crashed store's bytes never came back"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(
        p.mechanism().backing().resident_bytes().unwrap(),
        0,
        "its pages are gone"
    );
    drop(survivor);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_left_unfilled_by_a_closed_sequence_leave_the_cache() {
    let (g, p, kv) = setup(1 << 30, PreemptMode::Swap).await;
    let bt = SHAPE.block_tokens(PAGE);
    let prompt: Vec<u32> = (0..(3 * bt) as u32).collect();
    kv.open(1, prompt.clone(), 0).await.unwrap();
    // Fill one block and part of the next, then give up on the sequence.
    for pos in 0..bt + 2 {
        step(&kv, &[(1, pos)]).await.unwrap();
    }
    assert_eq!(kv.stats().await.unwrap().prefix_entries, 3);
    kv.close(1);
    let start = std::time::Instant::now();
    loop {
        let s = kv.stats().await.unwrap();
        let os = p.mechanism().backing().resident_bytes().unwrap();
        // The complete block stays cached (unreferenced, evictable); the two it never
        // finished are gone with their memory.
        if s.prefix_entries == 1 && os == s.prefix_bytes && leased(&g).await == os {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "unfinished blocks leaked: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A later prompt with the same start reuses only the complete block.
    let again = kv.open(2, prompt, 0).await.unwrap();
    assert_eq!(again.cached_tokens, bt);
}

/// A store that cannot start says why: a bad shape is a shape error, a Governor that is gone
/// is a Governor error, never "not running".
#[tokio::test]
async fn a_failed_start_names_its_cause() {
    let (g, _) = GovernorHandle::spawn(GovernorConfig::new("host", 1 << 30))
        .await
        .unwrap();
    let p = CpuProvider::spawn(CpuProviderConfig::default())
        .await
        .unwrap();
    let mut bad = config(PreemptMode::Swap);
    bad.shape.kv_heads = 0;
    let err = KvStoreHandle::spawn(bad, g.clone(), p.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, KvStoreError::Kv(_)), "{err:?}");
    let mut huge = config(PreemptMode::Swap);
    huge.shape.max_tokens = usize::MAX;
    let err = KvStoreHandle::spawn(huge, g.clone(), p.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, KvStoreError::Kv(_)), "{err:?}");
    let governor = g.actor();
    g.stop();
    governor.wait(Some(Duration::from_secs(10))).await.unwrap();
    let err = KvStoreHandle::spawn(config(PreemptMode::Swap), g, p)
        .await
        .unwrap_err();
    assert!(
        matches!(err, KvStoreError::Governor(GovernorError::Unavailable)),
        "{err:?}"
    );
}

/// Holds every free byte of `g` until the returned lease is dropped, so what asks next waits.
async fn hold_everything(g: &GovernorHandle) -> procmem_actors::governor::Lease {
    let holder = g.register_holder("blocker", 10, None).await.unwrap();
    let free = g.snapshot().await.unwrap().books.free();
    g.reserve(ReserveRequest {
        holder,
        role: MemoryRole::Workspace,
        bytes: free,
        priority: 10,
        deadline: None,
    })
    .await
    .unwrap()
    .commit(free)
    .await
    .unwrap()
}

/// The books and the OS agree, and the store's own count agrees with both.
async fn books_match_the_os(g: &GovernorHandle, kv: &KvStoreHandle, others: u64) {
    let start = std::time::Instant::now();
    loop {
        let s = kv.stats().await.unwrap();
        let ledger = leased(g).await - others;
        if s.os_resident_bytes == s.exclusive_bytes + s.prefix_bytes
            && s.leased_bytes == ledger
            && ledger == s.os_resident_bytes
        {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "ledger {ledger} vs store {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Defect (issue 13, 1): two opens of one prompt whose grants were both pending each created
/// the block for the same key; the second replaced the first in the cache, and the first
/// then marked the block under the key complete: a third request attended over a block
/// nobody wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_opens_of_one_prompt_never_serve_an_unwritten_block() {
    let (g, _p, kv) = setup(64 << 20, PreemptMode::Swap).await;
    let bt = SHAPE.block_tokens(PAGE);
    let prompt: Vec<u32> = (0..(2 * bt) as u32).collect();
    let blocker = hold_everything(&g).await;
    // The first open waits for room; the second comes while it waits (it claims nothing the
    // first claimed, so it needs no grant); only then does the room come.
    let (a, b) = tokio::join!(kv.open(1, prompt.clone(), 0), async {
        until_waiting(&g, 1).await;
        let b = kv.open(2, prompt.clone(), 0).await;
        drop(blocker);
        b
    });
    assert_eq!(a.unwrap().cached_tokens, 0);
    assert_eq!(b.unwrap().cached_tokens, 0);
    // Sequence 1 writes the prompt; sequence 2 writes nothing.
    for pos in 0..prompt.len() {
        step(&kv, &[(1, pos)]).await.unwrap();
    }
    // One token longer: its last token is computed, the two whole blocks before it shared.
    let longer = [prompt.clone(), vec![2 * bt as u32]].concat();
    let c = kv.open(3, longer, 0).await.unwrap();
    assert_eq!(
        c.cached_tokens,
        2 * bt,
        "the blocks sequence 1 wrote are shared"
    );
    let got = step(&kv, &[(3, 2 * bt)]).await.unwrap();
    for layer in 0..SHAPE.layers {
        let mut reference = Reference::default();
        for pos in 0..2 * bt {
            let mut it = item(1, pos, layer);
            it.seq = 3;
            reference.step(&it, layer);
        }
        let expect = reference.step(&item(3, 2 * bt, layer), layer);
        assert!(
            same_bits(&got[layer][0], &expect),
            "layer {layer}: attended over what sequence 1 wrote"
        );
    }
    books_match_the_os(&g, &kv, 0).await;
}

/// Defect (issue 13, 3): one attend batch naming a sequence twice advanced it twice (one
/// token written, two counted). Such a batch is refused and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_naming_a_sequence_twice_is_refused_and_changes_nothing() {
    let (_g, _p, kv) = setup(1 << 30, PreemptMode::Swap).await;
    kv.open(1, vec![], 0).await.unwrap();
    kv.prepare(vec![1, 1]).await.unwrap_err();
    let step = kv.prepare(vec![1]).await.unwrap();
    for layer in 0..SHAPE.layers {
        let twice = step
            .attend(layer, vec![item(1, 0, layer), item(1, 0, layer)])
            .await;
        assert!(twice.is_err(), "layer {layer}: {twice:?}");
        step.attend(layer, vec![item(1, 0, layer)]).await.unwrap();
    }
    step.complete(StepEnd::Submitted).await.unwrap();
    assert_eq!(kv.stats().await.unwrap().tokens, 1);
}

/// Defect (issue 13, 4): an open whose caller gave up stayed open and charged, and a retry got
/// `AlreadyOpen`; a prepare whose caller gave up left its sequence "stepping" for good, so it
/// was never a victim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_whose_caller_gave_up_leave_nothing_behind() {
    let (g, _p, kv) = setup(64 << 20, PreemptMode::Swap).await;
    let bt = SHAPE.block_tokens(PAGE);
    let prompt: Vec<u32> = (0..(2 * bt) as u32).collect();
    let blocker = hold_everything(&g).await;
    let gave_up = tokio::time::timeout(Duration::from_millis(20), kv.open(1, prompt.clone(), 0));
    assert!(gave_up.await.is_err(), "the open waits for room");
    // The caller's leaving reached the store before anything it sends next.
    drop(blocker);
    let retry = kv.open(1, prompt.clone(), 0).await;
    assert!(retry.is_ok(), "{retry:?}");
    // The prompt fills the two blocks it claimed; the next token needs memory of its own.
    for pos in 0..prompt.len() {
        step(&kv, &[(1, pos)]).await.unwrap();
    }
    books_match_the_os(&g, &kv, 0).await;

    // A prepare whose caller leaves while its grant waits.
    let blocker = hold_everything(&g).await;
    let gave_up = tokio::time::timeout(Duration::from_millis(20), kv.prepare(vec![1]));
    assert!(gave_up.await.is_err(), "the prepare waits for room");
    drop(blocker);
    // The wait was called off: the sequence is not in a step, its next step goes through,
    // and pressure may take it.
    step(&kv, &[(1, prompt.len())]).await.unwrap();
    let held = kv.stats().await.unwrap().exclusive_bytes;
    assert!(held > 0);
    let s = g.snapshot().await.unwrap();
    g.set_capacity(s.books.approved()).await.unwrap();
    let grant = another_holder_asks(g.clone(), held, Duration::from_secs(2)).await;
    assert!(
        grant.is_ok(),
        "the abandoned step's sequence was evicted: {grant:?}"
    );
}

/// Defect (issue 13, 2): a restore pending across a close and a re-open of the same id wrote
/// the old request's KV into the new sequence (and a failed one dropped the new sequence's
/// memory without its charge).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_pending_across_close_and_reopen_never_touches_the_new_sequence() {
    let (g, _p, kv) = setup(1 << 30, PreemptMode::Swap).await;
    kv.open(1, vec![], 0).await.unwrap();
    for pos in 0..40 {
        step(&kv, &[(1, pos)]).await.unwrap();
    }
    // Pressure preempts it (swap).
    let held = kv.stats().await.unwrap().exclusive_bytes;
    g.set_capacity(held).await.unwrap();
    let grant = another_holder_asks(g.clone(), held, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(kv.stats().await.unwrap().preempted, 1);
    // Its restore waits for room; meanwhile the id is closed and opened again.
    let restore = {
        let kv = kv.clone();
        tokio::spawn(async move { kv.restore(1).await })
    };
    until_waiting(&g, 1).await;
    kv.close(1);
    kv.open(1, vec![], 0).await.unwrap();
    drop(grant);
    g.set_capacity(1 << 30).await.unwrap();
    let old = restore.await.unwrap();
    assert!(old.is_err(), "the old request's restore ends: {old:?}");
    let s = kv.stats().await.unwrap();
    assert_eq!((s.sequences, s.preempted, s.tokens), (1, 0, 0), "{s:?}");
    // The new sequence decodes from zero like any other.
    let mut reference = Reference::default();
    for pos in 0..3 {
        let got = step(&kv, &[(1, pos)]).await.unwrap();
        for layer in 0..SHAPE.layers {
            assert!(same_bits(
                &got[layer][0],
                &reference.step(&item(1, pos, layer), layer)
            ));
        }
    }
    books_match_the_os(&g, &kv, 0).await;
}

/// The position rule (issue 27, item 5b): a prompt whose every block is cached shares all but
/// its last block, so the sequence's first step is at a position it does not hold yet and the
/// prompt's last token is computed. Before, `cached_tokens` was the whole prompt and a server
/// stepping its last token (for the logits) was refused: "holds 32 tokens: a step at
/// position 31 does not follow".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fully_cached_prompt_still_computes_its_last_token() {
    let (_g, _p, kv) = setup(1 << 30, PreemptMode::Swap).await;
    let bt = SHAPE.block_tokens(PAGE);
    let prompt: Vec<u32> = (0..(2 * bt) as u32).collect();
    kv.open(1, prompt.clone(), 0).await.unwrap();
    for pos in 0..prompt.len() {
        step(&kv, &[(1, pos)]).await.unwrap();
    }
    let second = kv.open(2, prompt.clone(), 0).await.unwrap();
    assert_eq!(second.cached_tokens, bt, "all but the last block");
    for pos in second.cached_tokens..prompt.len() {
        step(&kv, &[(2, pos)]).await.unwrap();
    }
    let empty = kv.open(3, Vec::new(), 0).await.unwrap();
    assert_eq!(empty.cached_tokens, 0);
}

/// Polls a call once (its message is sent), lets the store answer, then drops it unread. A
/// call answered within that first poll is read instead: `read` undoes it and it is tried
/// again.
async fn give_up_after_the_answer<F: std::future::Future>(
    make: impl Fn() -> F,
    read: impl Fn(F::Output),
) {
    for _ in 0..20 {
        let mut fut = std::pin::pin!(make());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match fut.as_mut().poll(&mut cx) {
            std::task::Poll::Pending => {
                tokio::time::sleep(Duration::from_millis(30)).await;
                return;
            }
            std::task::Poll::Ready(out) => read(out),
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    panic!("every call was answered within its first poll");
}

/// Polls `fut` once and drops it while it waits (what it answers, if it answers at once, is
/// dropped too).
async fn give_up_while_waiting<F: std::future::Future>(fut: F) {
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let _ = fut.as_mut().poll(&mut cx);
    tokio::time::sleep(Duration::from_millis(5)).await;
}

/// A step, tried again while the sequence is `Busy`: a step dropped unread gives its memory
/// back after its kernels, and until then the sequence is still lent.
async fn step_after_busy(kv: &KvStoreHandle, seqs: &[(u64, usize)]) {
    for _ in 0..200 {
        match step(kv, seqs).await {
            Err(KvStoreError::Table(TableError::Busy(_))) => {
                tokio::time::sleep(Duration::from_millis(5)).await
            }
            other => return assert!(other.is_ok(), "{other:?}"),
        }
    }
    panic!("still busy");
}

/// Every call that creates state, given up three ways: before it is sent (built, never
/// polled), while it waits (its grant held up), and after its answer arrived but before it was
/// read. After each, the store and the books are as if it never happened (or, for a restore,
/// as a retry finds them), and a retry works (issue 27, item 7: an open given up after its
/// answer left the sequence open and charged, and the retry answered `AlreadyOpen`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_given_up_three_ways_leaves_the_store_and_books_right() {
    let (g, p, kv) = setup(64 << 20, PreemptMode::Swap).await;
    let bt = SHAPE.block_tokens(PAGE);
    let prompt: Vec<u32> = (0..(bt + 3) as u32).collect();
    let open = |seq| kv.open(seq, prompt.clone(), 0);

    // open
    drop(open(1));
    give_up_after_the_answer(|| open(1), |_| kv.close(1)).await;
    assert_eq!(
        kv.stats().await.unwrap().sequences,
        0,
        "closed by its answer"
    );
    books_match_the_os(&g, &kv, 0).await;
    let blocker = hold_everything(&g).await;
    give_up_while_waiting(open(1)).await;
    drop(blocker);
    assert_eq!(kv.stats().await.unwrap().sequences, 0);
    books_match_the_os(&g, &kv, 0).await;
    kv.open(1, prompt.clone(), 0)
        .await
        .expect("the retry opens");

    // prepare (a step is a KvStep, which gives its memory back unread)
    drop(kv.prepare(vec![1]));
    give_up_after_the_answer(|| kv.prepare(vec![1]), drop).await;
    let blocker = hold_everything(&g).await;
    give_up_while_waiting(kv.prepare(vec![1])).await;
    drop(blocker);
    books_match_the_os(&g, &kv, 0).await;
    for pos in 0..prompt.len() {
        step_after_busy(&kv, &[(1, pos)]).await;
    }
    let held = kv.stats().await.unwrap();
    assert_eq!(held.tokens, prompt.len());

    // restore: preempted by another holder's need, then brought back
    let (capacity, exclusive) = (held.leased_bytes, held.exclusive_bytes);
    g.set_capacity(capacity).await.unwrap();
    let taken = another_holder_asks(g.clone(), exclusive, Duration::from_secs(5))
        .await
        .unwrap()
        .commit(exclusive)
        .await
        .unwrap();
    assert_eq!(kv.stats().await.unwrap().preempted, 1);
    drop(kv.restore(1));
    assert_eq!(kv.stats().await.unwrap().preempted, 1, "never sent");
    // Given up while it waits for room: it ends restored or preempted as before, with the
    // books right either way, and a retry answers which.
    give_up_while_waiting(kv.restore(1)).await;
    books_match_the_os(&g, &kv, exclusive).await;
    drop(taken);
    g.set_capacity(64 << 20).await.unwrap();
    give_up_after_the_answer(|| kv.restore(1), drop).await;
    books_match_the_os(&g, &kv, 0).await;
    let again = kv.restore(1).await.unwrap();
    assert_eq!(
        again,
        Restored::Swapped {
            tokens: prompt.len()
        },
        "a retry finds it back"
    );
    step_after_busy(&kv, &[(1, prompt.len())]).await;
    kv.close(1);
    books_match_the_os(&g, &kv, 0).await;
    // Its memory goes after its fences, then its lease: the books come back to zero.
    assert!(
        settles_to_zero(&g, &p).await,
        "{} bytes still leased",
        leased(&g).await
    );
}

/// Pressure takes the cached blocks least used first: a system prompt that four sequences
/// mapped again outlives two one-off prompts written after it (by last use alone, it would
/// have gone first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_prefix_outlives_a_bursts_one_off_blocks_under_pressure() {
    let (g, _p, kv) = setup(1 << 30, PreemptMode::Swap).await;
    let bt = SHAPE.block_tokens(PAGE);
    // One whole block and a token each: the block is cached, the last token computed.
    let prompt = |salt: u32| -> Vec<u32> { (0..=bt as u32).map(|t| t * 3 + salt).collect() };
    let run = |seq: u64, p: Vec<u32>| {
        let kv = kv.clone();
        async move {
            let opened = kv.open(seq, p.clone(), 0).await.unwrap();
            for pos in opened.cached_tokens..p.len() {
                step(&kv, &[(seq, pos)]).await.unwrap();
            }
            kv.close(seq);
            opened.cached_tokens
        }
    };
    let system = prompt(1);
    assert_eq!(run(1, system.clone()).await, 0);
    for seq in 2..6 {
        assert_eq!(
            run(seq, system.clone()).await,
            bt,
            "the system prompt is shared"
        );
    }
    // A burst's one-off prompts, used after the system prompt last was.
    assert_eq!(run(10, prompt(1000)).await, 0);
    assert_eq!(run(11, prompt(2000)).await, 0);
    let block = SHAPE.block_bytes_all(PAGE);
    assert_eq!(kv.stats().await.unwrap().prefix_bytes, 3 * block);
    // The closed sequences' own memory goes after their fences: once only the three cached
    // blocks are leased, nothing but them can make room.
    let start = std::time::Instant::now();
    while leased(&g).await != 3 * block {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the books never settled"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let _held = hold_everything(&g).await;
    let grant = another_holder_asks(g.clone(), 2 * block, Duration::from_secs(5))
        .await
        .expect("two cached blocks give way");
    drop(grant);
    assert_eq!(kv.stats().await.unwrap().prefix_bytes, block);
    drop(_held);
    assert_eq!(run(20, system.clone()).await, bt, "the hot block stayed");
    assert_eq!(run(21, prompt(1000)).await, 0, "the one-off blocks went");
}
