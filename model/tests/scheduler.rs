//! The library's scheduler over a toy model whose next token depends on every K row the
//! store holds (so a restore that lost or moved a row changes the answer): completions under
//! pressure equal those without, a dropped stream closes its sequence, a full queue and a
//! shutdown refuse and cancel, stop tokens, seeds and careless requests.

use procmem_actors::kv::{KvStep, StepEnd};
use std::sync::Arc;
use std::time::Duration;

use procmem_actors::procmem::kv::{KvDtype, KvShape};
use procmem_actors::{
    kv::{KvStoreConfig, KvStoreHandle, PreemptMode},
    MemoryManager,
};
use procmem_model::scheduler::{
    self, Event, FinishReason, GenError, GenRequest, Generation, Sampling, SchedulerConfig,
    SchedulerHandle,
};
use procmem_model::step::{StepFuture, StepInput, StepModel, StepOutput};
use procmem_model::{ModelError, StepFault};

const VOCAB: usize = 97;
const SHAPE: KvShape = KvShape {
    layers: 1,
    q_heads: 1,
    kv_heads: 1,
    head_dim: 8,
    max_tokens: 256,
    k_dtype: KvDtype::F32,
    v_dtype: KvDtype::F32,
};

/// Each new row's K holds its token; the logits of a sequence's last new row are one-hot at
/// the sum of every K row up to it (mod the vocabulary).
struct Toy {
    kv: KvStoreHandle,
}

impl StepModel for Toy {
    fn kv(&self) -> &KvStoreHandle {
        &self.kv
    }

    fn step<'a>(&'a self, step: &'a KvStep, batch: &'a [StepInput]) -> StepFuture<'a> {
        Box::pin(async move {
            let rows: Vec<Vec<u32>> = batch.iter().map(|b| b.tokens.clone()).collect();
            let (tx, rx) = tokio::sync::oneshot::channel();
            step.submit(move |kv| {
                let e = SHAPE.token_elems();
                let mut out = Vec::new();
                for (i, tokens) in rows.iter().enumerate() {
                    let k: Vec<f32> = tokens
                        .iter()
                        .flat_map(|&t| std::iter::repeat_n(t as f32, e))
                        .collect();
                    kv.write_rows(i, 0, 0, &k, &k).unwrap();
                    let keys = kv.keys::<f32>(i, 0).unwrap();
                    let sum: u64 = keys.iter().step_by(e).map(|&x| x as u64).sum();
                    let mut logits = vec![0f32; VOCAB];
                    logits[(sum % VOCAB as u64) as usize] = 1.0;
                    out.push(logits);
                }
                let _ = tx.send(out);
            })?;
            let logits = rx.await.map_err(|_| StepFault::KernelPanicked)?;
            Ok(StepOutput {
                logits,
                end: StepEnd::Submitted,
            })
        })
    }
}

async fn toy(budget: Option<u64>, preempt: PreemptMode) -> (MemoryManager, Arc<Toy>) {
    let mut builder = MemoryManager::builder();
    if let Some(b) = budget {
        builder = builder.host_budget(b);
    }
    let memory = builder.build().await.unwrap();
    let kv = memory
        .kv_store(
            KvStoreConfig::new("kv", SHAPE)
                .preempt(preempt)
                .wait(Duration::from_millis(500)),
        )
        .await
        .unwrap();
    (memory, Arc::new(Toy { kv }))
}

fn request(prompt_len: usize, seed: u32, max_tokens: usize) -> GenRequest {
    GenRequest {
        prompt: (0..prompt_len as u32)
            .map(|i| (i * 7 + seed) % 50)
            .collect(),
        max_tokens,
        ..GenRequest::default()
    }
}

/// Tokens until the end, and how it ended.
async fn drain(mut g: Generation) -> (Vec<u32>, Result<FinishReason, GenError>) {
    let mut tokens = Vec::new();
    while let Some(e) = g.next().await {
        match e {
            Event::Token { token, .. } => tokens.push(token),
            Event::Finished { reason, .. } => return (tokens, Ok(reason)),
            Event::Failed(e) => return (tokens, Err(e)),
        }
    }
    (tokens, Err(GenError::Stopped))
}

/// Twelve requests of growing prompts, 40 tokens each, at most 8 running: every one must
/// finish at its length. Their tokens, and the scheduler's figures.
async fn twelve<M: StepModel>(model: Arc<M>) -> (Vec<Vec<u32>>, scheduler::SchedulerStats) {
    let requests = (0..12).map(|i| request(5 + 9 * i, i as u32, 40)).collect();
    all_finish(model, requests).await
}

/// `requests` at once, 48 tokens a step and at most 8 running: every one must finish at its
/// length. Their tokens, and the scheduler's figures.
async fn all_finish<M: StepModel>(
    model: Arc<M>,
    requests: Vec<GenRequest>,
) -> (Vec<Vec<u32>>, scheduler::SchedulerStats) {
    let config = SchedulerConfig::new(SHAPE.max_tokens)
        .step_tokens(48)
        .max_running(8);
    let (handle, task) = SchedulerHandle::spawn(model, config);
    let streams: Vec<Generation> = requests
        .into_iter()
        .map(|r| handle.submit(r).unwrap())
        .collect();
    let mut out = Vec::new();
    for g in streams {
        let (tokens, end) = drain(g).await;
        assert_eq!(end.unwrap(), FinishReason::Length);
        out.push(tokens);
    }
    handle.shutdown(Duration::ZERO);
    (out, task.await.unwrap())
}

async fn run_all(budget: Option<u64>, preempt: PreemptMode) -> (Vec<Vec<u32>>, u64) {
    let (memory, model) = toy(budget, preempt).await;
    let (out, stats) = twelve(Arc::clone(&model)).await;
    assert_eq!(stats.finished, 12);
    drop(model);
    let report = memory.shutdown().await.unwrap();
    assert!(report.is_zero(), "{report:?}");
    (out, stats.preemptions + stats.shed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_under_pressure_equal_those_without() {
    let (free, none) = run_all(None, PreemptMode::Swap).await;
    assert_eq!(none, 0);
    // Room for about three of the twelve sequences at their longest.
    let per_seq = 2 * SHAPE.layers as u64 * 4096 * 2;
    for preempt in [PreemptMode::Swap, PreemptMode::Recompute] {
        let (pressed, met) = run_all(Some(3 * per_seq), preempt).await;
        eprintln!("scheduler_pressure ({preempt:?}): {met} preemptions or sheds");
        assert!(met > 0, "no pressure met under {preempt:?}");
        assert_eq!(pressed, free, "{preempt:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_stream_closes_its_sequence_and_its_memory_comes_back() {
    let (memory, model) = toy(None, PreemptMode::Swap).await;
    let (handle, task) = SchedulerHandle::spawn(Arc::clone(&model), SchedulerConfig::new(256));
    let mut g = handle.submit(request(30, 1, 200)).unwrap();
    for _ in 0..3 {
        assert!(matches!(g.next().await, Some(Event::Token { .. })));
    }
    drop(g);
    let start = std::time::Instant::now();
    loop {
        let s = model.kv.stats().await.unwrap();
        if s.sequences == 0 && handle.stats().cancelled == 1 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{s:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The scheduler goes on serving.
    let (tokens, end) = drain(handle.submit(request(10, 2, 5)).unwrap()).await;
    assert_eq!((tokens.len(), end.unwrap()), (5, FinishReason::Length));
    handle.shutdown(Duration::ZERO);
    task.await.unwrap();
    drop(model);
    assert!(memory.shutdown().await.unwrap().is_zero());
}

/// A caller that stops reading (issue 59, 4): once `stream_buffer` events wait unread, the
/// request is cut (its sequence closed, its memory back) without the step waiting for it;
/// what it reads afterwards is the tokens made, then `SlowReader`. A request read as it
/// comes, beside it, finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_stops_reading_is_cut_and_the_others_finish() {
    let (memory, model) = toy(None, PreemptMode::Swap).await;
    let config = SchedulerConfig::new(256).stream_buffer(8);
    let (handle, task) = SchedulerHandle::spawn(Arc::clone(&model), config);
    let mut unread = handle.submit(request(10, 1, 200)).unwrap();
    let read = tokio::spawn(drain(handle.submit(request(10, 2, 100)).unwrap()));
    let start = std::time::Instant::now();
    while handle.stats().slow_readers == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            handle.stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (tokens, end) = read.await.unwrap();
    assert_eq!((tokens.len(), end.unwrap()), (100, FinishReason::Length));
    // Seven tokens (the eighth place is kept for the end), then the cut.
    let mut made = 0;
    let end = loop {
        match unread.next().await {
            Some(Event::Token { .. }) => made += 1,
            Some(Event::Failed(e)) => break e,
            other => panic!("{other:?}"),
        }
    };
    assert!(matches!(end, GenError::SlowReader { behind: 8 }), "{end:?}");
    assert_eq!(made, 7);
    assert!(unread.next().await.is_none(), "the stream ended");
    let s = handle.stats();
    assert_eq!(
        (s.slow_readers, s.cancelled, s.finished),
        (1, 1, 1),
        "{s:?}"
    );
    let start = std::time::Instant::now();
    while model.kv.stats().await.unwrap().sequences > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "a sequence left open"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    handle.shutdown(Duration::ZERO);
    task.await.unwrap();
    drop(model);
    assert!(memory.shutdown().await.unwrap().is_zero());
}

#[tokio::test]
async fn a_full_queue_refuses_and_a_shutdown_cancels_what_is_left() {
    let (memory, model) = toy(None, PreemptMode::Swap).await;
    let config = SchedulerConfig::new(256).max_waiting(2).max_running(1);
    let (handle, task) = SchedulerHandle::spawn(Arc::clone(&model), config);
    // One thread: nothing runs between these, so both wait.
    let a = handle.submit(request(10, 1, 200)).unwrap();
    let b = handle.submit(request(10, 2, 200)).unwrap();
    let refused = handle.submit(request(10, 3, 200)).unwrap_err();
    assert!(
        matches!(refused, GenError::QueueFull { waiting: 2 }),
        "{refused:?}"
    );
    handle.shutdown(Duration::ZERO);
    let (_, a_end) = drain(a).await;
    let (_, b_end) = drain(b).await;
    assert!(matches!(a_end, Err(GenError::Cancelled)), "{a_end:?}");
    assert!(matches!(b_end, Err(GenError::Cancelled)), "{b_end:?}");
    let late = handle.submit(request(10, 4, 2)).unwrap_err();
    assert!(matches!(late, GenError::Stopped), "{late:?}");
    task.await.unwrap();
    assert_eq!(handle.waiting(), 0);
    drop(model);
    assert!(memory.shutdown().await.unwrap().is_zero());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_tokens_seeds_and_careless_requests() {
    let (memory, model) = toy(None, PreemptMode::Swap).await;
    let (handle, task) = SchedulerHandle::spawn(Arc::clone(&model), SchedulerConfig::new(256));
    // The toy's first token for this prompt, then a stop on it.
    let (first, _) = drain(handle.submit(request(12, 5, 1)).unwrap()).await;
    let mut stop = request(12, 5, 50);
    stop.stop_tokens = vec![first[0]];
    let (tokens, end) = drain(handle.submit(stop).unwrap()).await;
    assert_eq!((tokens, end.unwrap()), (first.clone(), FinishReason::Stop));
    // Sampling at a temperature: the same seed gives the same tokens.
    let hot = |seed| GenRequest {
        sampling: Sampling {
            temperature: 5.0,
            top_p: 0.9,
            seed,
        },
        ..request(12, 5, 20)
    };
    let (x, _) = drain(handle.submit(hot(9)).unwrap()).await;
    let (y, _) = drain(handle.submit(hot(9)).unwrap()).await;
    assert_eq!(x, y);
    // A context's end ends a request that asked for more.
    let (long, end) = drain(handle.submit(request(250, 1, usize::MAX)).unwrap()).await;
    assert_eq!((long.len(), end.unwrap()), (6, FinishReason::Length));
    for (r, want) in [
        (request(0, 1, 5), "EmptyPrompt"),
        (request(5, 1, 0), "NoTokens"),
        (request(256, 1, 5), "TooLong"),
        (request(usize::MAX >> 60, 1, 1), "none"),
        (
            GenRequest {
                sampling: Sampling {
                    temperature: f32::NAN,
                    ..Sampling::default()
                },
                ..request(5, 1, 5)
            },
            "BadSampling",
        ),
        (
            GenRequest {
                sampling: Sampling {
                    top_p: 0.0,
                    ..Sampling::default()
                },
                ..request(5, 1, 5)
            },
            "BadSampling",
        ),
        (
            GenRequest {
                stop: vec!["x".into()],
                ..request(5, 1, 5)
            },
            "BadSampling",
        ),
    ] {
        match handle.submit(r) {
            Err(e) => assert!(format!("{e:?}").contains(want), "{e:?} vs {want}"),
            Ok(g) => {
                assert_eq!(want, "none");
                drain(g).await.1.unwrap();
            }
        }
    }
    handle.shutdown(Duration::ZERO);
    task.await.unwrap();
    drop(model);
    assert!(memory.shutdown().await.unwrap().is_zero());
}

/// The toy model, with the steps named in `faults` failing with the error `fault` makes:
/// of the steps of at least `batch` sequences, counted from 0. With their KV prepared (the
/// scheduler prepares every step before the model sees it) and no kernel submitted, or with
/// `midway`, once a slow kernel is submitted (the step is then given up, and the store has
/// its sequences back only after that kernel).
struct Faulty {
    toy: Arc<Toy>,
    steps: std::sync::atomic::AtomicUsize,
    batch: usize,
    faults: std::ops::Range<usize>,
    fault: fn() -> ModelError,
    midway: bool,
}

impl StepModel for Faulty {
    fn kv(&self) -> &KvStoreHandle {
        &self.toy.kv
    }

    fn step<'a>(&'a self, step: &'a KvStep, batch: &'a [StepInput]) -> StepFuture<'a> {
        if batch.len() < self.batch {
            return self.toy.step(step, batch);
        }
        let n = self
            .steps
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.faults.contains(&n) {
            let e = (self.fault)();
            let midway = self.midway;
            return Box::pin(async move {
                if midway {
                    step.submit(|_| std::thread::sleep(Duration::from_millis(30)))?;
                }
                Err(e)
            });
        }
        self.toy.step(step, batch)
    }
}

/// A layer's weights that could not be brought back in time: what residency answers when
/// the Governor's wait for its room ran out.
fn weights_late() -> ModelError {
    ModelError::Weights(procmem_actors::residency::ResidencyError::Provider(
        procmem_actors::provider::ProviderError::Governor(
            procmem_actors::governor::GovernorError::Busy { waiting: 1 },
        ),
    ))
}

/// The toy model whose steps in `faults` (of any batch, counted from 0) find no room for a
/// layer's weights, before their first kernel or `midway`.
fn weights_late_in(toy: &Arc<Toy>, faults: std::ops::Range<usize>, midway: bool) -> Arc<Faulty> {
    Arc::new(Faulty {
        toy: Arc::clone(toy),
        steps: Default::default(),
        batch: 1,
        faults,
        fault: weights_late,
        midway,
    })
}

/// Twelve requests over the toy model whose steps 3 to 8 find no room for a layer's weights
/// (before their first kernel, or `midway`: once a kernel is submitted). Every
/// answer must equal the run without faults, and the books end at zero. The scheduler's
/// figures.
async fn weights_late_at_steps_3_to_8(midway: bool) -> scheduler::SchedulerStats {
    weights_late_at(3..9, midway).await
}

/// [`weights_late_at_steps_3_to_8`], for the steps in `faults`.
async fn weights_late_at(
    faults: std::ops::Range<usize>,
    midway: bool,
) -> scheduler::SchedulerStats {
    let (free, _) = run_all(None, PreemptMode::Swap).await;
    let (memory, toy) = toy(None, PreemptMode::Swap).await;
    let model = weights_late_in(&toy, faults, midway);
    let (out, stats) = twelve(Arc::clone(&model)).await;
    assert_eq!(out, free);
    drop((model, toy));
    assert!(memory.shutdown().await.unwrap().is_zero());
    stats
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_short_of_room_for_weights_sheds_and_every_answer_stays_right() {
    // The batch sheds its newest requests, one a step, and a lone one is tried again;
    // nothing fails.
    let stats = weights_late_at_steps_3_to_8(false).await;
    assert!(stats.shed >= 5, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_request_short_of_room_for_many_tries_still_finishes() {
    // 24 steps in a row without room: seven shed the batch down to one request, and that
    // one is tried again 17 times (the room came back late, as on a loaded machine), and
    // every answer is still right.
    let stats = weights_late_at(3..27, false).await;
    assert!(stats.retries >= 17, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_request_that_never_gets_room_fails_after_trying_a_while() {
    // Every step finds no room for a layer's weights: the lone request is tried again for a
    // while (its patience, `lonely_for`), then fails with that error, and the books end at
    // zero.
    let (memory, toy) = toy(None, PreemptMode::Swap).await;
    let model = weights_late_in(&toy, 0..usize::MAX, false);
    let config = SchedulerConfig::new(SHAPE.max_tokens)
        .max_running(1)
        .lonely_for(PATIENCE);
    let (handle, task) = SchedulerHandle::spawn(Arc::clone(&model), config);
    let (tokens, end) = drain(handle.submit(request(9, 1, 4)).unwrap()).await;
    assert!(tokens.is_empty());
    assert!(matches!(end, Err(GenError::Model(_))), "{end:?}");
    handle.shutdown(Duration::ZERO);
    let stats = task.await.unwrap();
    assert!(stats.retries > 3, "{stats:?}");
    drop((model, toy));
    assert!(memory.shutdown().await.unwrap().is_zero());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_request_cancelled_while_tried_again_leaves_no_patience_used_up() {
    // The first request finds no room and is tried again until its caller drops it. More
    // than its patience later a second request finds no room either: it gets its own tries
    // (the first one's start is not held against it) and finishes.
    let (memory, toy) = toy(None, PreemptMode::Swap).await;
    // 24 steps short of room: the first request is dropped long before it could pass them
    // (about 1 s of pauses, doubling from 2 ms to 50 ms), and the second request's own tries
    // pass what is left in about half its patience.
    let model = weights_late_in(&toy, 0..24, false);
    let config = SchedulerConfig::new(SHAPE.max_tokens)
        .max_running(1)
        .lonely_for(PATIENCE);
    let (handle, task) = SchedulerHandle::spawn(Arc::clone(&model), config);
    let first = handle.submit(request(9, 1, 4)).unwrap();
    // Dropped once it has been tried again.
    let start = std::time::Instant::now();
    while handle.stats().retries == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "never tried again"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    drop(first);
    // Past the patience the first request's start would have used up, were it kept.
    tokio::time::sleep(PATIENCE + PATIENCE / 4).await;
    let (tokens, end) = drain(handle.submit(request(9, 2, 4)).unwrap()).await;
    assert_eq!(end.unwrap(), FinishReason::Length);
    assert_eq!(tokens.len(), 4);
    handle.shutdown(Duration::ZERO);
    let stats = task.await.unwrap();
    assert_eq!(stats.cancelled, 1, "{stats:?}");
    drop((model, toy));
    assert!(memory.shutdown().await.unwrap().is_zero());
}

/// A lone request's patience in the tests that use it up: long enough for several of its
/// tries to wait for room, short of the 5 s a server gives.
const PATIENCE: Duration = Duration::from_secs(2);

/// Until the scheduler has tried a lone request again `times` times (each after a wait for
/// room the store refused by its deadline).
async fn retried(handle: &SchedulerHandle, times: u64) {
    let start = std::time::Instant::now();
    while handle.stats().retries < times {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "tried again {} times of {times}",
            handle.stats().retries
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The tokens `r` gets alone, with no budget; it must end at its length.
async fn alone_unpressured(r: GenRequest) -> Vec<u32> {
    let (memory, toy) = toy(None, PreemptMode::Swap).await;
    let config = SchedulerConfig::new(SHAPE.max_tokens);
    let (handle, task) = SchedulerHandle::spawn(Arc::clone(&toy), config);
    let (tokens, end) = drain(handle.submit(r).unwrap()).await;
    assert_eq!(end.unwrap(), FinishReason::Length);
    handle.shutdown(Duration::ZERO);
    task.await.unwrap();
    drop(toy);
    assert!(memory.shutdown().await.unwrap().is_zero());
    tokens
}

/// Another holder ("other", of `priority`, deaf to pressure) takes `bytes` of the host's
/// budget, waiting up to 5 s for them: its lease.
async fn another_takes(
    memory: &MemoryManager,
    priority: u32,
    bytes: u64,
) -> procmem_actors::governor::Lease {
    use procmem_actors::governor::ReserveRequest;
    use procmem_actors::procmem::{MemoryRole, MemoryTier, Place};
    let g = memory.governor(Place::HOST, MemoryTier::Host).unwrap();
    let other = g.register_holder("other", priority, None).await.unwrap();
    g.reserve(ReserveRequest {
        holder: other,
        role: MemoryRole::Workspace,
        bytes,
        priority,
        deadline: Some(tokio::time::Instant::now() + Duration::from_secs(5)),
    })
    .await
    .expect("room for the other holder")
    .commit(bytes)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_request_that_cannot_open_yet_waits_for_the_memory_to_come_back() {
    // Another holder, deaf to pressure, holds all but 1 KiB of the budget until the lone
    // request's opening has found no room by the store's deadline (500 ms) twice. It is tried
    // again, as a lone step is, and finishes with the answer it gives alone.
    let free = alone_unpressured(request(200, 1, 4)).await;
    let budget = 64 * 1024;
    let (memory, toy) = toy(Some(budget), PreemptMode::Swap).await;
    let held = another_takes(&memory, 0, budget - 1024).await;
    let config = SchedulerConfig::new(SHAPE.max_tokens);
    let (handle, task) = SchedulerHandle::spawn(Arc::clone(&toy), config);
    let answer = tokio::spawn(drain(handle.submit(request(200, 1, 4)).unwrap()));
    retried(&handle, 2).await;
    assert!(
        !answer.is_finished(),
        "the request ended while it had no room"
    );
    assert_eq!(held.release_all().await.unwrap(), budget - 1024);
    let (tokens, end) = answer.await.unwrap();
    assert_eq!(
        (tokens, end.map_err(|e| e.to_string())),
        (free, Ok(FinishReason::Length))
    );
    handle.shutdown(Duration::ZERO);
    let stats = task.await.unwrap();
    assert!(stats.retries >= 2, "{stats:?}");
    drop(toy);
    assert!(memory.shutdown().await.unwrap().is_zero());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_request_preempted_waits_to_be_restored_until_the_memory_comes_back() {
    // A more important holder asks for nearly the whole budget while the lone request
    // decodes, step after step: the store takes the sequence between two steps (swapped
    // out), and its restore is refused by the store's deadline (500 ms) while that holder
    // keeps the memory, until it was tried again twice. The request is restored once the
    // memory is back and ends with the answer it gives alone.
    let alone = request(9, 3, 200);
    let free = alone_unpressured(alone.clone()).await;
    let budget = 64 * 1024;
    let (memory, toy) = toy(Some(budget), PreemptMode::Swap).await;
    let (handle, task) =
        SchedulerHandle::spawn(Arc::clone(&toy), SchedulerConfig::new(SHAPE.max_tokens));
    let mut generation = handle.submit(alone).unwrap();
    let mut tokens = Vec::new();
    while tokens.len() < 3 {
        match generation.next().await {
            Some(Event::Token { token, .. }) => tokens.push(token),
            other => panic!("the request ended early: {other:?}"),
        }
    }
    // The store gives the room up.
    let held = another_takes(&memory, 9, budget - 1024).await;
    let rest = tokio::spawn(drain(generation));
    retried(&handle, 2).await;
    assert!(
        !rest.is_finished(),
        "the request ended while it had no room"
    );
    assert_eq!(held.release_all().await.unwrap(), budget - 1024);
    let (more, end) = rest.await.unwrap();
    tokens.extend(more);
    assert_eq!(
        (tokens, end.map_err(|e| e.to_string())),
        (free, Ok(FinishReason::Length))
    );
    handle.shutdown(Duration::ZERO);
    let stats = task.await.unwrap();
    assert!(stats.preemptions >= 1 && stats.retries >= 2, "{stats:?}");
    drop(toy);
    assert!(memory.shutdown().await.unwrap().is_zero());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_larger_than_the_whole_budget_fails_at_once() {
    // The Governor says the bytes asked exceed its capacity: no wait helps, so the request
    // fails with the store's refusal without being tried again.
    let (memory, toy) = toy(Some(1024), PreemptMode::Swap).await;
    let config = SchedulerConfig::new(SHAPE.max_tokens);
    let (handle, task) = SchedulerHandle::spawn(Arc::clone(&toy), config);
    let (tokens, end) = drain(handle.submit(request(9, 1, 4)).unwrap()).await;
    assert!(tokens.is_empty());
    assert!(matches!(end, Err(GenError::NoRoom(_))), "{end:?}");
    handle.shutdown(Duration::ZERO);
    let stats = task.await.unwrap();
    assert_eq!(stats.retries, 0, "{stats:?}");
    drop(toy);
    assert!(memory.shutdown().await.unwrap().is_zero());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_given_up_midway_for_weights_is_retried_once_its_sequences_are_back() {
    // The next step finds the given-up step's sequences busy until its kernel is done, and
    // waits for them instead of failing every request it holds. The steps tried again
    // meanwhile count among the faults.
    let stats = weights_late_at_steps_3_to_8(true).await;
    assert!(stats.shed >= 1, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_that_faults_fails_its_requests_with_one_error_and_the_rest_go_on() {
    let (memory, toy) = toy(None, PreemptMode::Swap).await;
    let model = Arc::new(Faulty {
        toy: Arc::clone(&toy),
        steps: Default::default(),
        midway: false,
        // The second step of all three: each has streamed a token.
        batch: 3,
        faults: 1..2,
        fault: || StepFault::KernelPanicked.into(),
    });
    let (handle, task) = SchedulerHandle::spawn(Arc::clone(&model), SchedulerConfig::new(256));
    let first: Vec<Generation> = (0..3)
        .map(|i| handle.submit(request(10, i, 20)).unwrap())
        .collect();
    let mut errors = Vec::new();
    for g in first {
        match drain(g).await {
            (tokens, Err(GenError::Model(e))) if !tokens.is_empty() => errors.push(e),
            other => panic!("{other:?}"),
        }
    }
    // One error, shared by the step's requests, naming the fault.
    assert!(errors.iter().all(|e| Arc::ptr_eq(e, &errors[0])));
    assert!(matches!(
        *errors[0],
        ModelError::Step(StepFault::KernelPanicked)
    ));
    assert_eq!(toy.kv.stats().await.unwrap().sequences, 0);
    // The scheduler goes on serving.
    let (tokens, end) = drain(handle.submit(request(10, 7, 5)).unwrap()).await;
    assert_eq!((tokens.len(), end.unwrap()), (5, FinishReason::Length));
    handle.shutdown(Duration::ZERO);
    task.await.unwrap();
    drop((model, toy));
    assert!(memory.shutdown().await.unwrap().is_zero());
}

/// Tokens and figures of a stream that must finish at its length.
async fn finish(mut g: Generation) -> (Vec<u32>, scheduler::Figures) {
    let mut tokens = Vec::new();
    while let Some(e) = g.next().await {
        match e {
            Event::Token { token, .. } => tokens.push(token),
            Event::Finished { reason, figures } => {
                assert_eq!(reason, FinishReason::Length);
                return (tokens, figures);
            }
            Event::Failed(e) => panic!("{e}"),
        }
    }
    panic!("the stream ended without an end");
}

/// Prompts of other seeds, one at a time: under the tight budget their blocks push the oldest
/// cached blocks out of memory, to the disk tier.
async fn flood(handle: &SchedulerHandle, seeds: std::ops::Range<u32>) {
    for seed in seeds {
        finish(handle.submit(request(200, seed, 20)).unwrap()).await;
    }
}

/// Waits (up to 10 s) for block `key`'s file in the disk tier's directory.
async fn on_disk(dir: &std::path::Path, key: u64) -> std::path::PathBuf {
    let suffix = format!("-{key:016x}.kv");
    let start = std::time::Instant::now();
    loop {
        let found = std::fs::read_dir(dir.join("blocks"))
            .ok()
            .and_then(|files| {
                files
                    .filter_map(Result::ok)
                    .map(|f| f.path())
                    .find(|p| p.to_string_lossy().ends_with(&suffix))
            });
        if let Some(path) = found {
            return path;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "block {key:x} never reached disk"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A prompt whose block was pushed out to disk comes back from there with the same answer;
/// pushed out again and altered on disk, the copy in falls short, the store fails the
/// request's first step with `Preempted`, and the scheduler recomputes it: the same answer
/// again, and the books at zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_back_from_disk_and_one_whose_copy_fails_answer_the_same() {
    use procmem_actors::kv::PrefixDisk;
    use procmem_actors::procmem::kv::prompt_keys;
    let dir = tempfile::tempdir().unwrap();
    let per_seq = 2 * SHAPE.layers as u64 * 4096 * 2;
    let memory = MemoryManager::builder()
        .host_budget(3 * per_seq)
        .build()
        .await
        .unwrap();
    let kv = memory
        .kv_store(
            KvStoreConfig::new("kv", SHAPE)
                .wait(Duration::from_millis(500))
                .prefix_disk(PrefixDisk::new(dir.path(), 1, 1 << 20).min_hits(1)),
        )
        .await
        .unwrap();
    let model = Arc::new(Toy { kv: kv.clone() });
    let config = SchedulerConfig::new(SHAPE.max_tokens).max_running(2);
    let (handle, task) = SchedulerHandle::spawn(model, config);
    let first = request(200, 1, 20);
    let block = SHAPE.block_tokens(4096);
    let key = prompt_keys(&first.prompt, block)[0];
    let (answer, figures) = finish(handle.submit(first.clone()).unwrap()).await;
    assert_eq!(figures.cached_tokens, 0);
    flood(&handle, 2..8).await;
    on_disk(dir.path(), key).await;
    let (again, figures) = finish(handle.submit(first.clone()).unwrap()).await;
    assert_eq!(again, answer, "from disk, the same answer");
    assert_eq!(figures.cached_tokens, block, "its block came from disk");
    // Out of memory again (six blocks of other prompts do not fit with it: the disk has its
    // file already, so nothing is copied), then altered there.
    flood(&handle, 8..14).await;
    let path = on_disk(dir.path(), key).await;
    let mut raw = std::fs::read(&path).unwrap();
    let mid = raw.len() / 2;
    raw[mid] ^= 0x40;
    std::fs::write(&path, raw).unwrap();
    let (recomputed, figures) = finish(handle.submit(first).unwrap()).await;
    assert_eq!(recomputed, answer, "recomputed, the same answer");
    let s = kv.stats().await.unwrap();
    eprintln!(
        "scheduler_copy_in: cached {} of the prompt's tokens at open, {} preemptions; store: \
         {} disk failures, {} recompute preemptions, {} tokens from disk",
        figures.cached_tokens,
        figures.preemptions,
        s.prefix_disk_failures,
        s.preempted_by_recompute,
        s.prefix_disk_hit_tokens
    );
    assert_eq!(s.prefix_disk_failures, 1, "{s:?}");
    assert!(figures.preemptions >= 1, "{figures:?}");
    // Issue 50: the block that failed its check was computed, not served from the cache.
    assert_eq!(figures.cached_tokens, 0, "{figures:?}");
    handle.shutdown(Duration::ZERO);
    task.await.unwrap();
    drop(kv);
    let report = memory.shutdown().await.unwrap();
    assert!(report.is_zero(), "{report:?}");
}

/// `requests` submitted together to a toy store without pressure, 48 tokens a step: each
/// one's tokens and figures, and the scheduler's figures; the books at zero after.
async fn together(
    requests: &[&GenRequest],
) -> (
    Vec<(Vec<u32>, scheduler::Figures)>,
    scheduler::SchedulerStats,
) {
    let (memory, model) = toy(None, PreemptMode::Swap).await;
    let config = SchedulerConfig::new(256).step_tokens(48);
    let (handle, task) = SchedulerHandle::spawn(Arc::clone(&model), config);
    let streams: Vec<Generation> = requests
        .iter()
        .map(|r| handle.submit((*r).clone()).unwrap())
        .collect();
    let mut out = Vec::new();
    for g in streams {
        out.push(finish(g).await);
    }
    handle.shutdown(Duration::ZERO);
    let stats = task.await.unwrap();
    drop(model);
    assert!(memory.shutdown().await.unwrap().is_zero());
    (out, stats)
}

/// Requests that arrive together with the same system prompt share its blocks: the second
/// waits for the first to write the block they both start with (an unrelated request is
/// admitted meanwhile), then maps it, and answers as it does alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_the_prompt_blocks_another_is_writing() {
    let block = SHAPE.block_tokens(4096);
    let first = request(200, 1, 20);
    // The first block's tokens and then tokens of its own.
    let mut second = request(200, 2, 20);
    second.prompt[..block + 5].copy_from_slice(&first.prompt[..block + 5]);
    let other = request(150, 3, 20);
    let (alone, _) = together(&[&second]).await;
    assert_eq!(alone[0].1.cached_tokens, 0);
    // A step takes 48 tokens: the first prompt's block takes three steps to write.
    let (out, stats) = together(&[&first, &second, &other]).await;
    let figures: Vec<&scheduler::Figures> = out.iter().map(|(_, f)| f).collect();
    let cached: Vec<usize> = figures.iter().map(|f| f.cached_tokens).collect();
    assert_eq!(cached, [0, block, 0], "{figures:?}");
    assert_eq!(out[1].0, alone[0].0, "sharing the block, the same answer");
    // The unrelated request did not wait for the shared block: it started first.
    assert!(figures[2].queued < figures[1].queued, "{figures:?}");
    assert!(stats.passed_over > 0, "{stats:?}");
}

/// Nothing waits for a block it could not share: two requests whose prompt is exactly one
/// block (its last token is always computed, so the block is never shared) start together,
/// as do requests that only begin alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_waits_for_a_block_it_would_not_share() {
    let block = SHAPE.block_tokens(4096);
    let whole = request(block, 1, 5);
    let mut apart = request(block + 20, 1, 5);
    apart.prompt[block - 1] += 1;
    let (out, stats) = together(&[&whole, &whole, &apart]).await;
    for (_, figures) in &out {
        assert_eq!(figures.cached_tokens, 0, "{figures:?}");
    }
    assert_eq!(stats.passed_over, 0, "{stats:?}");
}

/// Ten requests that share a 140-token system prompt (one whole block) and each add their
/// own 10 to 37 tokens, at most 8 running: their tokens, the scheduler's figures and how
/// many tokens restores mapped again from cached blocks.
async fn sharing_ten(budget: Option<u64>, preempt: PreemptMode) -> (Vec<Vec<u32>>, u64, u64) {
    let (memory, model) = toy(budget, preempt).await;
    let system = request(140, 9, 1).prompt;
    let requests = (0..10u32)
        .map(|i| {
            let mut r = request(10 + 3 * i as usize, i, 30);
            r.prompt = [system.clone(), r.prompt].concat();
            r
        })
        .collect();
    let (out, stats) = all_finish(Arc::clone(&model), requests).await;
    assert_eq!(stats.finished, 10);
    let shared = model.kv.stats().await.unwrap().restore_shared_tokens;
    drop(model);
    let report = memory.shutdown().await.unwrap();
    assert!(report.is_zero(), "{report:?}");
    (out, stats.preemptions + stats.shed, shared)
}

/// Requests sharing a system prompt, under pressure (swap and recompute): the waits for the
/// prompt's block, the preemptions and the restores that map it again leave every answer
/// as it is without pressure, and the books at zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prompts_under_pressure_answer_as_without() {
    let (free, none, _) = sharing_ten(None, PreemptMode::Swap).await;
    assert_eq!(none, 0);
    let per_seq = 2 * SHAPE.layers as u64 * 4096 * 2;
    for preempt in [PreemptMode::Swap, PreemptMode::Recompute] {
        let (pressed, met, shared) = sharing_ten(Some(3 * per_seq), preempt).await;
        eprintln!(
            "scheduler_shared_pressure ({preempt:?}): {met} preemptions or sheds, {shared} \
             tokens mapped again at restores"
        );
        assert!(met > 0, "no pressure met under {preempt:?}");
        assert!(shared > 0, "no restore mapped the system prompt again");
        assert_eq!(pressed, free, "{preempt:?}");
    }
}

/// Issue 45: twenty requests queued behind twelve running whose callers leave never start
/// (counted cancelled, the queue empty at once), and at a shutdown every request is counted
/// once: finished, cancelled, cut or failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_whose_callers_left_never_start_and_every_request_is_counted_once() {
    let (memory, model) = toy(None, PreemptMode::Swap).await;
    let config = SchedulerConfig::new(256).max_running(12).max_waiting(64);
    let (handle, task) = SchedulerHandle::spawn(Arc::clone(&model), config);
    let running: Vec<Generation> = (0..12)
        .map(|i| handle.submit(request(10, i, 240)).unwrap())
        .collect();
    let queued: Vec<Generation> = (12..32)
        .map(|i| handle.submit(request(10, i, 240)).unwrap())
        .collect();
    let start = std::time::Instant::now();
    while handle.waiting() != 20 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the twelve never started"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Callers leave a few at a time while another thread reads the books as fast as it can:
    // a request gone from the queue is counted cancelled at the same instant (CI once read
    // 0 waiting beside 17 cancelled, the queue's count and the counts were two locks).
    let watcher = handle.clone();
    let books = std::thread::spawn(move || {
        let mut reads = 0u64;
        loop {
            let (waiting, stats) = watcher.books();
            reads += 1;
            // Of the twenty, those neither waiting nor cancelled started in a place one
            // of the twelve left: never more than have finished.
            let queued_or_gone = waiting as u64 + stats.cancelled;
            assert!(
                queued_or_gone <= 20 && queued_or_gone + stats.finished >= 20,
                "{waiting} waiting, {stats:?}"
            );
            if waiting == 0 {
                return (reads, stats);
            }
        }
    });
    let mut queued = queued;
    while !queued.is_empty() {
        queued.truncate(queued.len().saturating_sub(3));
        std::thread::sleep(Duration::from_micros(200));
        tokio::task::yield_now().await;
    }
    let (reads, stats) = books.join().unwrap();
    assert!(start.elapsed() < Duration::from_secs(10), "still queued");
    assert!(reads > 1, "{reads}");
    assert_eq!(stats.finished, 0, "the twelve still run: {stats:?}");
    let mut ends = Vec::new();
    for g in running {
        ends.push(drain(g).await.1);
    }
    assert!(ends.iter().all(|e| e.is_ok()), "{ends:?}");
    // The figures are counted just after the last event is sent.
    while handle.stats().finished < 12 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            handle.stats()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let stats = handle.stats();
    // Only the twelve prompts were ever computed (each prompt's last token goes with its
    // first decode step): none of the twenty started.
    assert_eq!(stats.prefilled, 12 * 9, "{stats:?}");
    assert_eq!((stats.finished, stats.cancelled), (12, 20));

    // A shutdown with three running, two queued and one caller gone: each counted once.
    let config = SchedulerConfig::new(256).max_running(3);
    let (second, task2) = SchedulerHandle::spawn(Arc::clone(&model), config);
    let kept: Vec<Generation> = (40..45)
        .map(|i| second.submit(request(10, i, 240)).unwrap())
        .collect();
    let gone = second.submit(request(10, 46, 240)).unwrap();
    drop(gone);
    second.shutdown(Duration::ZERO);
    for g in kept {
        let (_, end) = drain(g).await;
        assert!(matches!(end, Err(GenError::Cancelled)), "{end:?}");
    }
    let late = second.submit(request(10, 47, 2));
    assert!(matches!(late, Err(GenError::Stopped)), "{late:?}");
    let s = task2.await.unwrap();
    // A request after the shutdown is refused at once, never taken by the stopping loop.
    assert_eq!(s.accepted, 6, "{s:?}");
    assert_eq!((s.cancelled, s.cut), (1, s.accepted - 1), "{s:?}");
    assert_eq!(
        s.finished + s.cancelled + s.cut + s.failed,
        s.accepted,
        "{s:?}"
    );
    drop(second);
    drop(handle);
    task.await.unwrap();
    drop(model);
    assert!(memory.shutdown().await.unwrap().is_zero());
}
