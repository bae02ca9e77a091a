//! The engine's reserve for a step's activations held to what a step really takes from the
//! heap: a counting allocator around the system's measures the most the heap grows while a
//! step runs, for the widest step the engine takes (a prompt chunk of `STEP_TOKENS` rows) and
//! for a decode step of `SCRATCH_LOGIT_ROWS` sequences. What a step takes beyond the reserve
//! would be memory outside the books.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use procmem_actors::procmem::kv::KvDtype;
use procmem_actors::{kv::KvStoreConfig, MemoryManager};
use procmem_model::serve::{SCRATCH_LOGIT_ROWS, STEP_TOKENS};
use procmem_model::{forward_step, Engine, Smol, StepInput};

/// The system's allocator, counting the bytes live now and the most since the last reset.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is the system allocator's, with the same layout; the counters only
// observe.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `System.alloc`'s.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is `System.dealloc`'s.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `step`, and returns the most the heap grew while it ran.
async fn heap_growth<T>(step: impl std::future::Future<Output = T>) -> (T, usize) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = step.await;
    (out, PEAK.load(Ordering::Relaxed).saturating_sub(base))
}

/// One step of `batch` on `e`'s model, its logits dropped.
async fn step(e: &Engine, batch: Vec<StepInput>) {
    forward_step(&e.model, &e.weights, &e.kv, e.shape, &batch)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steps_heap_stays_within_the_engines_reserve() {
    let Some(path) = procmem_model::smollm2_path() else {
        eprintln!("SKIPPED: no model (run scripts/fetch-model.sh)");
        return;
    };
    let loaded = Smol::load(&path).unwrap();
    let wide = Engine::scratch_bytes(&loaded.model) as usize;
    let narrow = loaded
        .model
        .step_scratch_bytes(SCRATCH_LOGIT_ROWS, SCRATCH_LOGIT_ROWS) as usize;
    let shape = loaded
        .model
        .kv_shape(KvDtype::F16, KvDtype::F16, 2 * STEP_TOKENS);
    let memory = MemoryManager::builder().build().await.unwrap();
    let e = Engine::start(&memory, loaded, KvStoreConfig::new("kv", shape), None)
        .await
        .unwrap();
    assert_eq!(
        e.scratch.bytes() as usize,
        wide,
        "the engine reserves the widest step"
    );
    let prompt: Vec<u32> = (0..STEP_TOKENS as u32).map(|t| 100 + t * 7).collect();
    let seqs = SCRATCH_LOGIT_ROWS as u64;
    // Two sequences take a whole chunk (the first warms what is built once: thread pools,
    // the stream), the others one token each.
    let first = |seq: u64| {
        if seq <= 2 {
            prompt.clone()
        } else {
            vec![100 + seq as u32]
        }
    };
    for seq in 1..=seqs {
        e.kv.open(seq, first(seq), 0).await.unwrap();
    }
    let chunk = |seq: u64| {
        vec![StepInput {
            seq,
            tokens: first(seq),
            position: 0,
        }]
    };
    let decode = |at: usize| -> Vec<StepInput> {
        (1..=seqs)
            .map(|seq| StepInput {
                seq,
                tokens: vec![42],
                position: first(seq).len() + at,
            })
            .collect()
    };
    step(&e, chunk(2)).await;
    let ((), prefill) = heap_growth(step(&e, chunk(1))).await;
    for seq in 3..=seqs {
        step(&e, chunk(seq)).await;
    }
    step(&e, decode(0)).await;
    let ((), decoded) = heap_growth(step(&e, decode(1))).await;
    eprintln!(
        "FIGURE step_scratch: prompt chunk of {STEP_TOKENS} rows took {prefill} B of heap against a reserve of {wide} B ({:.2}x); a decode step of {seqs} sequences {decoded} B against {narrow} B ({:.2}x)",
        prefill as f64 / wide as f64,
        decoded as f64 / narrow as f64,
    );
    assert!(
        prefill <= wide,
        "a prompt chunk took {prefill} B, beyond the reserve's {wide} B"
    );
    assert!(
        decoded <= narrow,
        "a decode step took {decoded} B, beyond {narrow} B"
    );
    drop(e);
    assert!(memory.shutdown().await.unwrap().is_zero());
}
