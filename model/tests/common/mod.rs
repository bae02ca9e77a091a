//! What the SmolLM2 tests share: the prompts, candle's own model as the reference, and
//! this project's engine.
#![allow(dead_code)]

use std::time::Duration;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use procmem_actors::procmem::kv::KvDtype;
use procmem_actors::{
    kv::{KvStoreConfig, PreemptMode},
    MemoryManager,
};
use procmem_model::{
    smollm2_path, top2, Completion, Engine, Loaded, Request, RunStats, Smol, TextCodec, TopTwo,
};

pub const NEW_TOKENS: usize = 64;
pub const MAX_TOKENS: usize = 512;

const SYSTEM: &str = "You are a concise assistant. Answer in one or two sentences, plainly, \
                      without lists, and never mention that you are an AI model.";

/// Eight chat prompts; half share one system prompt (the first opens it, the later ones find
/// its blocks cached).
pub fn prompts() -> Vec<(Option<&'static str>, &'static str)> {
    vec![
        (Some(SYSTEM), "What is the capital of France?"),
        (None, "Write a haiku about the sea."),
        (None, "How many legs does a spider have?"),
        (None, "Translate 'good morning' into Spanish."),
        (Some(SYSTEM), "Why is the sky blue?"),
        (Some(SYSTEM), "Name three primary colors."),
        (Some(SYSTEM), "What does a compiler do?"),
        (None, "What is 12 times 12?"),
    ]
}

/// `loaded`'s KV in `f32`, sequences of up to `MAX_TOKENS`.
pub fn kv_config(loaded: &Loaded, preempt: PreemptMode) -> KvStoreConfig {
    let shape = loaded
        .model
        .kv_shape(KvDtype::F32, KvDtype::F32, MAX_TOKENS);
    KvStoreConfig::new("kv", shape)
        .chunk_granules(3)
        .preempt(preempt)
        .wait(Duration::from_secs(5))
}

/// candle-transformers' `quantized_llama` with its own KV cache: greedy tokens, and the
/// logits each came from. The prompt goes in one token at a time, as ours does.
pub fn reference(path: &std::path::Path, prompt: &[u32]) -> (Vec<u32>, Vec<Vec<f32>>) {
    candle_greedy(path, prompt, 1)
}

/// The same model fed the prompt's first `prefill` tokens in one forward (its masked prefill;
/// its mask has no room for earlier tokens, so only the first forward may take several), then
/// one token per step: the same arithmetic in another order, which is what sets the floor of
/// how closely two correct attention paths can agree.
pub fn candle_greedy(
    path: &std::path::Path,
    prompt: &[u32],
    prefill: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut file = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut model = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    let forward = |model: &mut ModelWeights, tokens: &[u32], pos: usize| -> Vec<f32> {
        let input = Tensor::new(tokens, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        model
            .forward(&input, pos)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let prefill = prefill.clamp(1, prompt.len());
    let mut l = forward(&mut model, &prompt[..prefill], 0);
    for (pos, token) in prompt.iter().enumerate().skip(prefill) {
        l = forward(&mut model, &[*token], pos);
    }
    let mut logits = Vec::new();
    let mut tokens = Vec::new();
    for pos in prompt.len()..prompt.len() + NEW_TOKENS {
        let next = procmem_model::argmax(&l);
        tokens.push(next);
        logits.push(std::mem::take(&mut l));
        if pos + 1 < prompt.len() + NEW_TOKENS {
            l = forward(&mut model, &[next], pos);
        }
    }
    (tokens, logits)
}

/// The largest relative difference of two logit rows (floor 1 on the divisor).
pub fn logit_gap(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
        .fold(0f32, f32::max)
}

/// This project's engine over a fresh manager (`budget` bytes of host, or the default).
pub async fn ours(
    budget: Option<u64>,
    preempt: PreemptMode,
    prompts: &[Vec<u32>],
) -> (Vec<Completion>, RunStats) {
    ours_n(budget, preempt, prompts, NEW_TOKENS).await
}

/// The same, `new` tokens each.
pub async fn ours_n(
    budget: Option<u64>,
    preempt: PreemptMode,
    prompts: &[Vec<u32>],
    new: usize,
) -> (Vec<Completion>, RunStats) {
    ours_steps(
        budget,
        preempt,
        prompts,
        new,
        procmem_model::serve::STEP_TOKENS,
    )
    .await
}

/// The same, with steps of at most `step_tokens` tokens (1: prompts one token per step).
pub async fn ours_steps(
    budget: Option<u64>,
    preempt: PreemptMode,
    prompts: &[Vec<u32>],
    new: usize,
    step_tokens: usize,
) -> (Vec<Completion>, RunStats) {
    let path = smollm2_path().unwrap();
    let loaded = Smol::load(&path).unwrap();
    let mut builder = MemoryManager::builder();
    if let Some(b) = budget {
        builder = builder.host_budget(b);
    }
    let memory = builder.build().await.unwrap();
    let kv = kv_config(&loaded, preempt);
    let mut engine = Engine::start(&memory, loaded, kv, None).await.unwrap();
    engine.step_tokens = step_tokens;
    let requests = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Request {
            id: i as u64 + 1,
            prompt: p.clone(),
            max_new: new,
        })
        .collect();
    let out = engine.generate(requests, 4, true).await.unwrap();
    drop(engine);
    let report = memory.shutdown().await.unwrap();
    assert!(report.is_zero(), "books after shutdown: {report:?}");
    out
}

/// The GGUF, its tokenizer and the prompts in the chat template; `None` (said) without it.
pub fn tokenized() -> Option<(std::path::PathBuf, TextCodec, Vec<Vec<u32>>)> {
    let Some(path) = procmem_model::fetch_smollm2() else {
        eprintln!("SKIPPED: no SmolLM2 GGUF, and scripts/fetch-model.sh could not fetch it");
        return None;
    };
    let loaded = Smol::load(&path).unwrap();
    let codec = TextCodec::new(&loaded.tokenizer).unwrap();
    let prompts = prompts()
        .into_iter()
        .map(|(s, u)| codec.chat(s, u).unwrap())
        .collect();
    Some((path, codec, prompts))
}

/// Compares ours with candle's per prompt: the first step's largest relative logit
/// difference (floor 1), and where the greedy tokens part, with both sides' top two there.
pub struct Agreement {
    pub first_step: Vec<f32>,
    pub parted: Vec<Parted>,
    /// candle's own run of each prompt (one token at a time): its greedy tokens and the
    /// logits of each step.
    pub reference: Vec<(Vec<u32>, Vec<Vec<f32>>)>,
}

/// A prompt, the token where the two part, and the top two logits there (ours, candle's).
pub type Parted = (usize, usize, TopTwo, TopTwo);

pub fn compare(
    path: &std::path::Path,
    codec: &TextCodec,
    prompts: &[Vec<u32>],
    mine: &[Completion],
) -> Agreement {
    let mut first_step = Vec::new();
    let mut parted = Vec::new();
    let mut kept = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let (theirs, their_logits) = reference(path, prompt);
        let c = &mine[i];
        first_step.push(logit_gap(&c.logits[0], &their_logits[0]));
        if let Some(at) = c.tokens.iter().zip(&theirs).position(|(a, b)| a != b) {
            parted.push((i, at, top2(&c.logits[at]), top2(&their_logits[at])));
        } else {
            assert_eq!(c.tokens, theirs, "prompt {i}");
        }
        eprintln!(
            "prompt {i} ({} tokens, {} from cached blocks): {:?}",
            prompt.len(),
            c.cached_tokens,
            codec.decode(&c.tokens).unwrap()
        );
        kept.push((theirs, their_logits));
    }
    Agreement {
        first_step,
        parted,
        reference: kept,
    }
}

/// Prints a figure line that `scripts/reliability.sh` collects into its table, to stderr
/// directly: the harness keeps a passing test's `eprintln!` to itself.
pub fn figure(name: &str, passed: usize, total: usize) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "FIGURE {name} {passed}/{total}");
}
