//! The prefix cache's disk tier through the store: a prompt block evicted under pressure goes
//! to disk (once asked for twice) and comes back on the next open of that prompt with the very
//! same K/V; a store started again over the same directory finds it; another model never
//! does; a one-off prompt never reaches the disk; a second store on the directory is refused;
//! a disk that fails drops the block and the books stay right.

use std::time::Duration;

use procmem_actors::procmem::kv::disk_tier::DiskTierError;
use procmem_actors::procmem::kv::{prompt_keys, KvShape};
use procmem_actors::{
    governor::GovernorHandle,
    kv::{
        KvStep, KvStoreConfig, KvStoreError, KvStoreHandle, KvStoreStats, NewTokens, PreemptMode,
        PrefixDisk, PrefixHost, Restored, StepEnd, TableError,
    },
    provider::CpuProvider,
};

mod common;

const SHAPE: KvShape = common::shape(512);
use common::PAGE;
const CAPACITY: u64 = 1 << 20;

/// Fault points and the disk are shared by the tests here: they take turns.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn bt() -> usize {
    SHAPE.block_tokens(PAGE)
}

/// Three whole blocks and five tokens more.
fn prompt(salt: u32) -> Vec<u32> {
    (0..(3 * bt() + 5) as u32).map(|t| t * 3 + salt).collect()
}

fn config(dir: &std::path::Path, model: u64) -> KvStoreConfig {
    common::kv_config(SHAPE, 2, PreemptMode::Swap, Duration::from_millis(500))
        .prefix_disk(PrefixDisk::new(dir, model, 256 * 1024))
}

/// Opens `seq` with `prompt`, computes what is not cached and one token more; returns what
/// was cached and the last token's attention output, every layer. A copy in from disk that
/// falls short makes the first step fail with `Preempted`: the sequence is restored empty
/// and computed from its start, as a scheduler does (what was cached is then 0).
async fn run(kv: &KvStoreHandle, seq: u64, prompt: &[u32]) -> (usize, Vec<Vec<f32>>) {
    let opened = kv.open(seq, prompt.to_vec(), 0).await.unwrap();
    let mut last = Vec::new();
    let mut from = opened.cached_tokens;
    let mut pos = from;
    while pos <= prompt.len() {
        let step = match kv.prepare(vec![seq]).await {
            Ok(step) => step,
            Err(KvStoreError::Table(TableError::Preempted(s, PreemptMode::Recompute)))
                if s == seq && pos == from =>
            {
                let restored = kv.restore(seq).await.unwrap();
                assert_eq!(
                    restored,
                    Restored::Recompute {
                        tokens: from,
                        cached: 0
                    }
                );
                (from, pos) = (0, 0);
                continue;
            }
            Err(e) => panic!("step of {seq} at {pos}: {e}"),
        };
        last = attend_at(step, seq, pos).await;
        pos += 1;
    }
    kv.close(seq);
    (from, last)
}

/// Writes position `pos` of `seq` in `step`, attends over every row up to it and completes
/// the step: the attention output, every layer.
async fn attend_at(step: KvStep, seq: u64, pos: usize) -> Vec<Vec<f32>> {
    let mut last = Vec::new();
    for layer in 0..SHAPE.layers {
        // The K/V of a prompt position depends on the position alone (as a model's would on
        // the token), so every sequence of one prompt writes the same rows.
        let mut item = common::kv_item(&SHAPE, 1, pos, layer);
        item.seq = seq;
        last.push(step.attend(layer, vec![item]).await.unwrap().remove(0));
    }
    step.complete(StepEnd::Submitted).await.unwrap();
    last
}

/// Pressure from a more important holder that needs the whole budget: the store lets its
/// cached blocks go. Returns once the holder has its room (then gives it back).
async fn squeeze(g: &GovernorHandle) {
    let grant = common::another_holder_asks(g.clone(), CAPACITY, Duration::from_secs(5))
        .await
        .expect("the store gave way");
    drop(grant);
}

/// Waits (up to 10 s) for the store's figures to satisfy `ok`.
async fn until(kv: &KvStoreHandle, ok: impl Fn(&KvStoreStats) -> bool) -> KvStoreStats {
    let start = std::time::Instant::now();
    loop {
        let s = kv.stats().await.unwrap();
        if ok(&s) {
            return s;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{s:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (up to 10 s) for the store's digest to hold every whole block of `prompt`, and
/// checks it holds none of a prompt nobody sent.
async fn digest_holds(kv: &KvStoreHandle, prompt: &[u32]) {
    let keys = prompt_keys(prompt, bt());
    let start = std::time::Instant::now();
    loop {
        // A message to the store: it publishes its digest with its metrics.
        let _ = kv.stats().await.unwrap();
        let digest = kv.prefix_digest();
        if digest.leading(&keys) == keys.len() {
            assert_eq!(digest.block_tokens(), bt());
            assert_eq!(digest.leading(&prompt_keys(&self::prompt(99), bt())), 0);
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{digest:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn store(g: &GovernorHandle, p: &CpuProvider, config: KvStoreConfig) -> KvStoreHandle {
    KvStoreHandle::spawn(config, g.clone(), p.clone())
        .await
        .unwrap()
        .0
}

/// A fresh directory, a host Governor of `CAPACITY` with a CPU provider, and a store of model 1
/// keeping its evicted prompt blocks in that directory.
async fn fixture() -> (
    tempfile::TempDir,
    GovernorHandle,
    CpuProvider,
    KvStoreHandle,
) {
    let dir = tempfile::tempdir().unwrap();
    let (g, p) = common::system(CAPACITY, 1).await;
    let kv = store(&g, &p, config(dir.path(), 1)).await;
    (dir, g, p, kv)
}

async fn stop(kv: KvStoreHandle) {
    kv.actor().stop_and_wait(None, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_prompt_comes_back_from_disk_with_the_same_kv_and_after_a_restart() {
    let _serial = SERIAL.lock().await;
    let (dir, g, p, kv) = fixture().await;
    let prompt = prompt(0);
    let (cached, _) = run(&kv, 1, &prompt).await;
    assert_eq!(cached, 0);
    // The second ask: shared from memory, and now frequent enough for the disk.
    let (cached, from_memory) = run(&kv, 2, &prompt).await;
    assert_eq!(cached, 3 * bt());
    squeeze(&g).await;
    let s = until(&kv, |s| s.prefix_disk_blocks == 3 && s.prefix_entries == 0).await;
    assert_eq!(
        (s.prefix_disk_writes, s.prefix_disk_failures),
        (3, 0),
        "{s:?}"
    );
    // What the store tells its node for routers holds the blocks on disk too.
    digest_holds(&kv, &prompt).await;
    // Back from disk: the same cached length and bit for bit the same attention.
    let (cached, from_disk) = run(&kv, 3, &prompt).await;
    assert_eq!(cached, 3 * bt());
    assert_eq!(from_disk, from_memory);
    let s = common::settled(&g, &kv).await;
    assert_eq!(s.prefix_disk_hit_tokens, 3 * bt() as u64);
    // A store started again over the directory finds the blocks.
    squeeze(&g).await;
    until(&kv, |s| s.prefix_entries == 0).await;
    stop(kv).await;
    let kv = store(&g, &p, config(dir.path(), 1)).await;
    assert_eq!(kv.stats().await.unwrap().prefix_disk_blocks, 3);
    digest_holds(&kv, &prompt).await;
    let (cached, after_restart) = run(&kv, 4, &prompt).await;
    assert_eq!(cached, 3 * bt());
    assert_eq!(after_restart, from_memory);
    stop(kv).await;
    // Another model's store over the same directory finds nothing of it.
    let other = store(&g, &p, config(dir.path(), 2)).await;
    let (cached, _) = run(&other, 5, &prompt).await;
    assert_eq!(cached, 0);
    stop(other).await;
    // Every store stopped: their memory goes back after its fences.
    books_at_zero(&g).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_stopped_leaves_its_hot_blocks_on_disk_for_the_next() {
    let _serial = SERIAL.lock().await;
    let (dir, g, p, kv) = fixture().await;
    // Asked for twice (frequent enough for the disk), and once (not), never pressed out.
    let (hot, once) = (prompt(0), prompt(5));
    run(&kv, 1, &hot).await;
    let (_, from_memory) = run(&kv, 2, &hot).await;
    run(&kv, 3, &once).await;
    let s = common::settled(&g, &kv).await;
    assert_eq!((s.prefix_entries, s.prefix_disk_blocks), (6, 0), "{s:?}");
    stop(kv).await;
    books_at_zero(&g).await;
    // Started again: the hot prompt's blocks are on disk, the one-off's are not.
    let kv = store(&g, &p, config(dir.path(), 1)).await;
    assert_eq!(kv.stats().await.unwrap().prefix_disk_blocks, 3);
    let (cached, after_restart) = run(&kv, 4, &hot).await;
    assert_eq!(cached, 3 * bt());
    assert_eq!(after_restart, from_memory, "the same K/V, bit for bit");
    assert_eq!(run(&kv, 5, &once).await.0, 0);
    stop(kv).await;
    books_at_zero(&g).await;
}

/// Runs `prompt` twice (the second ask shares its blocks and lets them into the disk tier),
/// then pushes its blocks out of memory: only the disk holds them. Returns the attention of
/// its last position over the blocks in memory.
async fn to_disk(g: &GovernorHandle, kv: &KvStoreHandle, prompt: &[u32]) -> Vec<Vec<f32>> {
    run(kv, 1, prompt).await;
    let (_, from_memory) = run(kv, 2, prompt).await;
    squeeze(g).await;
    until(kv, |s| s.prefix_disk_blocks == 3 && s.prefix_entries == 0).await;
    from_memory
}

/// Alters every block file in the tier's directory in its K/V bytes (its size and name
/// unchanged).
fn alter_every_block(dir: &std::path::Path) {
    for file in std::fs::read_dir(dir.join("blocks")).unwrap() {
        let path = file.unwrap().path();
        let mut raw = std::fs::read(&path).unwrap();
        let mid = raw.len() / 2;
        raw[mid] ^= 0x40;
        std::fs::write(&path, raw).unwrap();
    }
}

/// The store's books at zero once every store on `g` stopped (memory goes after its fences).
async fn books_at_zero(g: &GovernorHandle) {
    let start = std::time::Instant::now();
    while g.snapshot().await.unwrap().books.leased != 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the books never went to zero"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A sequence closed while its copy in waits on the stream, and its id opened again at once
/// with the same prompt: the new incarnation gets a copy of its own and the same K/V; the old
/// one's memory goes after its kernel, and the books come back to zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_and_reopen_while_the_copy_in_waits_gets_the_same_kv() {
    let _serial = SERIAL.lock().await;
    let (_dir, g, p, kv) = fixture().await;
    let prompt = prompt(11);
    let from_memory = to_disk(&g, &kv, &prompt).await;
    let open_gate = common::hold_stream(&p);
    let opened = kv.open(3, prompt.clone(), 0).await.unwrap();
    assert_eq!(opened.cached_tokens, 3 * bt());
    kv.close(3);
    let again = kv.open(3, prompt.clone(), 0).await.unwrap();
    assert_eq!(
        again.cached_tokens,
        3 * bt(),
        "claimed again, from disk again"
    );
    drop(open_gate);
    // Once the copy has run, another sequence shares its blocks, before seq 3 takes a step.
    let start = std::time::Instant::now();
    loop {
        let shared = kv.open(5, prompt.clone(), 0).await.unwrap().cached_tokens;
        kv.close(5);
        if shared == 3 * bt() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "never shared: {shared}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut last = Vec::new();
    for pos in 3 * bt()..=prompt.len() {
        last = attend_at(kv.prepare(vec![3]).await.unwrap(), 3, pos).await;
    }
    assert_eq!(last, from_memory);
    kv.close(3);
    let s = until(&kv, |s| s.sequences == 0).await;
    assert_eq!(s.prefix_disk_failures, 0, "{s:?}");
    stop(kv).await;
    books_at_zero(&g).await;
}

/// Pressure on a sequence whose copy in waits on the stream and then falls short (its blocks
/// altered on disk): the store waits for the copy (the sequence's last kernel), then preempts
/// the sequence by recompute, never by swap (its K/V never came). Its step fails with
/// `Preempted(_, Recompute)`, and the sequence computed again from its start gets the same
/// K/V.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pressure_on_a_sequence_whose_copy_in_falls_short_recomputes_it() {
    let _serial = SERIAL.lock().await;
    let (dir, g, p, kv) = fixture().await;
    let prompt = prompt(13);
    let from_memory = to_disk(&g, &kv, &prompt).await;
    alter_every_block(dir.path());
    let open_gate = common::hold_stream(&p);
    let opened = kv.open(3, prompt.clone(), 0).await.unwrap();
    assert_eq!(opened.cached_tokens, 3 * bt());
    // The whole budget asked for. The sequence's last kernel is the copy, still behind the
    // gate: the store puts the ticket off until it has run, then preempts the sequence, whose
    // copy fell short.
    let pressure = tokio::spawn({
        let g = g.clone();
        async move { squeeze(&g).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        kv.stats().await.unwrap().preempted,
        0,
        "not before its copy ran"
    );
    drop(open_gate);
    pressure.await.unwrap();
    let s = kv.stats().await.unwrap();
    assert_eq!(
        (s.preempted_by_swap, s.preempted_by_recompute),
        (0, 1),
        "{s:?}"
    );
    // Its first step meets the preemption: restored empty, computed from the start.
    let err = kv.prepare(vec![3]).await.err();
    assert!(
        matches!(
            err,
            Some(KvStoreError::Table(TableError::Preempted(
                3,
                PreemptMode::Recompute
            )))
        ),
        "{err:?}"
    );
    let restored = kv.restore(3).await.unwrap();
    assert_eq!(
        restored,
        Restored::Recompute {
            tokens: 3 * bt(),
            cached: 0
        }
    );
    let mut last = Vec::new();
    for pos in 0..=prompt.len() {
        last = attend_at(kv.prepare(vec![3]).await.unwrap(), 3, pos).await;
    }
    assert_eq!(last, from_memory);
    kv.close(3);
    stop(kv).await;
    books_at_zero(&g).await;
}

/// The copy in is a kernel on the store's stream: the open is answered while it waits there,
/// the store answers other calls meanwhile, and the sequence's first step is lent only once
/// the copy is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_open_does_not_wait_for_the_copy_in_and_the_first_step_does() {
    let _serial = SERIAL.lock().await;
    let (_dir, g, p, kv) = fixture().await;
    let prompt = prompt(7);
    let from_memory = to_disk(&g, &kv, &prompt).await;
    let open_gate = common::hold_stream(&p);
    let opened = tokio::time::timeout(Duration::from_secs(5), kv.open(3, prompt.clone(), 0))
        .await
        .expect("the open is answered while its copy in waits on the stream")
        .unwrap();
    assert_eq!(opened.cached_tokens, 3 * bt());
    kv.stats().await.expect("the store answers meanwhile");
    // A step the store refuses anyway is refused at once, not put behind the copy.
    let refused = |r: Result<KvStep, KvStoreError>| r.err().map(|e| e.to_string());
    let quick = Duration::from_secs(2);
    let zero = tokio::time::timeout(
        quick,
        kv.prepare_tokens(vec![NewTokens { seq: 3, count: 0 }]),
    )
    .await;
    assert!(
        matches!(zero, Ok(Err(KvStoreError::NoTokens(3)))),
        "{:?}",
        zero.map(refused)
    );
    let twice = tokio::time::timeout(quick, kv.prepare(vec![3, 3])).await;
    assert!(matches!(twice, Ok(Err(_))), "{:?}", twice.map(refused));
    let first = tokio::spawn({
        let kv = kv.clone();
        async move { kv.prepare(vec![3]).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!first.is_finished(), "the first step waits for the copy in");
    open_gate.send(()).unwrap();
    let step = tokio::time::timeout(Duration::from_secs(5), first)
        .await
        .expect("lent once the copy is done")
        .unwrap()
        .unwrap();
    let mut last = attend_at(step, 3, 3 * bt()).await;
    for pos in 3 * bt() + 1..=prompt.len() {
        last = attend_at(kv.prepare(vec![3]).await.unwrap(), 3, pos).await;
    }
    assert_eq!(
        last, from_memory,
        "the same attention over the blocks from disk"
    );
    kv.close(3);
    let s = until(&kv, |s| s.prefix_disk_hit_tokens >= 3 * bt() as u64).await;
    assert_eq!(s.prefix_disk_failures, 0, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_off_prompt_never_reaches_the_disk() {
    let _serial = SERIAL.lock().await;
    let (_dir, g, _p, kv) = fixture().await;
    run(&kv, 1, &prompt(7)).await;
    squeeze(&g).await;
    let s = until(&kv, |s| s.prefix_entries == 0).await;
    assert_eq!(s.prefix_disk_blocks, 0, "{s:?}");
    assert_eq!(s.prefix_disk_refused, 3, "{s:?}");
    common::settled(&g, &kv).await;
    until(&kv, |s| s.leased_bytes == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_store_on_one_directory_is_refused() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let (g, p) = common::system(CAPACITY, 1).await;
    let first = store(&g, &p, config(dir.path(), 1)).await;
    let mut second = config(dir.path(), 1);
    second.name = "kv2".into();
    let refused = KvStoreHandle::spawn(second, g.clone(), p.clone()).await;
    assert!(
        matches!(
            refused,
            Err(KvStoreError::DiskTier(DiskTierError::Locked(_)))
        ),
        "{:?}",
        refused.map(|_| ())
    );
    stop(first).await;
}

#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_that_fails_drops_the_block_and_the_books_stay_right() {
    let _serial = SERIAL.lock().await;
    let (_dir, g, _p, kv) = fixture().await;
    let prompt = prompt(3);
    run(&kv, 1, &prompt).await;
    let (_, from_memory) = run(&kv, 2, &prompt).await;
    // The first block's copy out fails: it is dropped; the other two reach the disk.
    procmem_actors::procmem::fault::arm("disk_tier.write", 0);
    squeeze(&g).await;
    let s = until(&kv, |s| {
        s.prefix_entries == 0 && s.prefix_disk_writes + s.prefix_disk_failures == 3
    })
    .await;
    assert!(!procmem_actors::procmem::fault::disarm(), "the fault fired");
    assert_eq!(
        (s.prefix_disk_failures, s.prefix_disk_blocks),
        (1, 2),
        "{s:?}"
    );
    // The prompt still decodes the same: the lost block is computed again.
    let (cached, again) = run(&kv, 3, &prompt).await;
    assert!(
        cached < 3 * bt(),
        "the chain breaks at the lost block: {cached}"
    );
    assert_eq!(again, from_memory);
    // What the store holds is its cache alone, and the Governor and the OS agree.
    common::settled(&g, &kv).await;
    until(&kv, |s| {
        s.leased_bytes == s.prefix_bytes && s.sequences == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_altered_on_disk_is_computed_again_never_used() {
    let _serial = SERIAL.lock().await;
    let (dir, g, _p, kv) = fixture().await;
    let prompt = prompt(5);
    let from_memory = to_disk(&g, &kv, &prompt).await;
    alter_every_block(dir.path());
    // The open counts the blocks as cached; the copy in finds the first altered, and the
    // sequence's first step fails with `Preempted`: it is computed from its start.
    let (cached, again) = run(&kv, 3, &prompt).await;
    assert_eq!(cached, 0, "no altered block is used");
    assert_eq!(again, from_memory, "the prompt is computed again, the same");
    let s = until(&kv, |s| s.prefix_disk_failures == 1).await;
    assert_eq!(s.prefix_disk_hit_tokens, 0, "{s:?}");
    assert_eq!(s.preempted_by_recompute, 1, "{s:?}");
    // The altered block left the disk, and the two after it in its chain with it (no prompt
    // reaches them without it): the next open of the prompt promises nothing from disk.
    let s = common::settled(&g, &kv).await;
    assert_eq!(s.prefix_disk_blocks, 0, "{s:?}");
}

/// A store that crashes is started again at once over its directory, as a supervisor does:
/// the lock the crashed one held goes with its state, and the new store finds the blocks.
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_restarted_after_a_crash_finds_its_directory_and_its_blocks() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let (g, p) = common::system(CAPACITY, 1).await;
    let (kv, join) = KvStoreHandle::spawn(config(dir.path(), 1), g.clone(), p.clone())
        .await
        .unwrap();
    let prompt = prompt(9);
    let from_memory = to_disk(&g, &kv, &prompt).await;
    // Started again at once: the crashed store may still hold the lock for a moment.
    kv.crash();
    let kv = store(&g, &p, config(dir.path(), 1)).await;
    join.await.unwrap();
    let (cached, again) = run(&kv, 3, &prompt).await;
    assert_eq!(cached, 3 * bt());
    assert_eq!(again, from_memory);
    stop(kv).await;
}

/// A host tier is for KV on a GPU (a copy of host memory in host memory frees nothing): a
/// store in host memory refuses it at start, and holds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_in_host_memory_refuses_a_host_tier() {
    let (g, p) = common::system(CAPACITY, 1).await;
    let host_tier = common::kv_config(SHAPE, 2, PreemptMode::Swap, Duration::from_millis(500))
        .prefix_host(PrefixHost::new(1 << 20));
    let refused = KvStoreHandle::spawn(host_tier, g.clone(), p.clone()).await;
    assert!(
        matches!(refused, Err(KvStoreError::PrefixHostOnHost)),
        "{:?}",
        refused.err()
    );
    // With a disk tier as well: the host tier is still what is refused.
    let dir = tempfile::tempdir().unwrap();
    let both = config(dir.path(), 1).prefix_host(PrefixHost::new(1 << 20));
    let refused = KvStoreHandle::spawn(both, g.clone(), p.clone()).await;
    assert!(
        matches!(refused, Err(KvStoreError::PrefixHostOnHost)),
        "{:?}",
        refused.err()
    );
    assert_eq!(g.snapshot().await.unwrap().books.leased, 0);
}

/// Idle sequences whose memory is mostly shared prompt blocks (the one that wrote them and
/// one that maps them), under pressure that needs the whole budget: the store gives way
/// within the ask's deadline (their swap copies run, then the blocks they alone held go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sequences_of_shared_blocks_give_way_to_pressure() {
    let _serial = SERIAL.lock().await;
    let (g, p) = common::system(CAPACITY, 1).await;
    let config = common::kv_config(SHAPE, 2, PreemptMode::Swap, Duration::from_millis(500));
    let kv = store(&g, &p, config).await;
    let prompt: Vec<u32> = (0..(3 * bt()) as u32).collect();
    for seq in [1, 2] {
        let from = kv.open(seq, prompt.clone(), 0).await.unwrap().cached_tokens;
        for pos in from..prompt.len() {
            let step = kv.prepare(vec![seq]).await.unwrap();
            attend_at(step, seq, pos).await;
        }
    }
    gives_way(&g, &kv, "idle shared sequences").await;
}

/// A more important holder asks for the whole budget with a 5 s deadline: the store must
/// make room in time.
async fn gives_way(g: &GovernorHandle, kv: &KvStoreHandle, what: &str) {
    let started = std::time::Instant::now();
    let grant = common::another_holder_asks(g.clone(), CAPACITY, Duration::from_secs(5)).await;
    assert!(
        grant.is_ok(),
        "no room after {:?}: {:?}",
        started.elapsed(),
        kv.stats().await
    );
    eprintln!("{what} gave way in {:?}", started.elapsed());
}

/// A sequence whose blocks came back from disk and settled, idle before its first step,
/// under pressure that needs the whole budget: the store gives way within the ask's deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_filled_from_disk_gives_way_to_pressure_before_its_first_step() {
    let _serial = SERIAL.lock().await;
    let (_dir, g, _p, kv) = fixture().await;
    let prompt = prompt(13);
    to_disk(&g, &kv, &prompt).await;
    assert_eq!(
        kv.open(3, prompt.clone(), 0).await.unwrap().cached_tokens,
        3 * bt()
    );
    // The copy has run (its blocks counted as filled from disk), and settled meanwhile.
    until(&kv, |s| {
        s.prefix_disk_hit_tokens >= 3 * bt() as u64 && s.copies_in == 0
    })
    .await;
    // Its memory is the three blocks, mapped by it alone: taking it by swap must let them
    // go too (they stayed cached, and the ask got nothing in 5 s, before 2026-12-04).
    gives_way(&g, &kv, "a sequence filled from disk").await;
}
