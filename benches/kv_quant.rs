//! kv_quant: what keeping KV in eight bits costs in quality, on the real model (SmolLM2-135M),
//! against KV in `f16`. Writes `target/reports/kv_quant.json`.
//!
//! Every configuration is its own engine (its own KV store, K and V each in its type), all
//! alive at once and fed the same input:
//! - **A text the model did not write** (`benches/data/kv_quant.txt`: public-domain prose,
//!   the Declaration of Independence, the Gettysburg Address and the openings of four novels),
//!   taken in chunks of 256 tokens with the logits of every position: per position the KL
//!   divergence of the next-token distribution from the `f16` run's (`KL(f16 || config)`),
//!   whether the most likely token is the same, and the perplexity of the text.
//! - **Greedy continuations** of 16 chat prompts, 64 tokens each, all 16 decoded in one batch
//!   a step: per prompt whether the continuation equals the `f16` run's (up to its first
//!   end-of-sequence token) and where it first differs.
//!
//! Configurations: `f32` (the floor: `f16` against exact), `q8_0` (K and V), `k_f16_v_q8_0`
//! and `k_q8_0_v_f16`; each row also gives its KL from `f32`, so `q8_0`'s distance from exact
//! stands beside `f16`'s own. The goal (issue 48): mean KL at most 0.002 for `q8_0` K and V.
//! `PROCMEM_QUANT_POSITIONS` caps the positions (default: the whole text). The model comes
//! from `scripts/fetch-model.sh`; without it the bench says so and writes nothing.
//!
//! Then **capacity** (`capacity`, see `kv_quant/capacity.rs`): the sequences a store holds in
//! the same bytes in `f16` and in `q8_0`, counted up to its first refusal.
//! `PROCMEM_QUANT_PARTS=capacity` (or `quality`) runs one part, keeping the other's figures
//! in the report.

#[path = "kv_quant/capacity.rs"]
mod capacity;
mod common;

use procmem_actors::procmem::kv::KvDtype;
use procmem_actors::MemoryManager;
use procmem_model::launch::builtin_prompts;
use procmem_model::{
    argmax, forward_every_row, forward_step, smollm2_path, Engine, Smol, StepInput, TextCodec,
};
use serde_json::json;

/// The configurations: the baseline (`f16`) first, exact (`f32`) second.
const CONFIGS: [(&str, KvDtype, KvDtype); 5] = [
    ("f16", KvDtype::F16, KvDtype::F16),
    ("f32", KvDtype::F32, KvDtype::F32),
    ("q8_0", KvDtype::Q8_0, KvDtype::Q8_0),
    ("k_f16_v_q8_0", KvDtype::F16, KvDtype::Q8_0),
    ("k_q8_0_v_f16", KvDtype::Q8_0, KvDtype::F16),
];

/// Eight prompts beside the main job's eight: 16 chat prompts.
const MORE_PROMPTS: [&str; 8] = [
    "Name three planets of the solar system.",
    "Explain what a prime number is.",
    "What is the boiling point of water at sea level?",
    "Write one sentence about the ocean.",
    "Who wrote Romeo and Juliet?",
    "List the days of the week.",
    "What does a bee make?",
    "Describe a bicycle in two sentences.",
];

const CHUNK: usize = 256;
const NEW_TOKENS: usize = 64;
const KL_GOAL: f64 = 0.002;

/// An engine for sequences of `max` tokens, K kept in `k` and V in `v`.
async fn engine(
    memory: &MemoryManager,
    e: (&std::path::Path, usize),
    k: KvDtype,
    v: KvDtype,
) -> Engine {
    let (path, max) = e;
    let loaded = Smol::load(path).unwrap();
    let kv = common::smol_kv_config(&loaded, max, k, v).wait(std::time::Duration::from_secs(60));
    Engine::start(memory, loaded, kv, None).await.unwrap()
}

/// Log-probabilities of `logits`, in `f64`.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|x| (*x as f64 - max).exp()).sum();
    let log_sum = sum.ln() + max;
    logits.iter().map(|x| *x as f64 - log_sum).collect()
}

/// Per configuration, over the text: KL from the baseline (`f16`) at each position, top-1
/// agreement with it, KL from exact (`f32`) and the negative log-likelihood of the next token.
#[derive(Default, Clone)]
struct TextFigures {
    kl: Vec<f64>,
    kl_exact: f64,
    same_top1: usize,
    nll: f64,
    positions: usize,
}

/// `KL(p || q)` of two log-distributions.
fn kl(p: &[f64], q: &[f64]) -> f64 {
    let sum: f64 = p.iter().zip(q).map(|(p, q)| p.exp() * (p - q)).sum();
    sum.max(0.0)
}

impl TextFigures {
    fn add(&mut self, [base, exact]: [&[f64]; 2], mine: &[f64], next: u32) {
        self.kl.push(kl(base, mine));
        self.kl_exact += kl(exact, mine);
        self.same_top1 += usize::from(argmax_f64(base) == argmax_f64(mine));
        self.nll -= mine[next as usize];
        self.positions += 1;
    }

    fn json(&self) -> serde_json::Value {
        let mut sorted = self.kl.clone();
        sorted.sort_by(f64::total_cmp);
        let n = self.positions.max(1) as f64;
        let at = |p: f64| sorted[((sorted.len() - 1) as f64 * p).round() as usize];
        json!({
            "positions": self.positions,
            "mean_kl": sorted.iter().sum::<f64>() / n,
            "p99_kl": at(0.99),
            "max_kl": at(1.0),
            "mean_kl_from_f32": self.kl_exact / n,
            "top1_agreement": self.same_top1 as f64 / n,
            "perplexity": (self.nll / n).exp(),
        })
    }
}

fn argmax_f64(x: &[f64]) -> usize {
    (0..x.len())
        .max_by(|a, b| x[*a].total_cmp(&x[*b]))
        .unwrap_or(0)
}

/// Every engine takes the text a chunk at a time (the same chunks), all rows' logits each.
async fn measure_text(engines: &[Engine], text: &[u32]) -> Vec<TextFigures> {
    let mut figures = vec![TextFigures::default(); engines.len()];
    for e in engines {
        e.kv.open(1, text.to_vec(), 0).await.unwrap();
    }
    for (c, chunk) in text.chunks(CHUNK).enumerate() {
        let input = StepInput {
            seq: 1,
            tokens: chunk.to_vec(),
            position: c * CHUNK,
        };
        let mut rows = Vec::with_capacity(engines.len());
        for e in engines {
            let batch = [input.clone()];
            let logits = forward_every_row(&e.model, &e.weights, &e.kv, e.shape, &batch);
            rows.push(logits.await.unwrap());
        }
        for j in 0..chunk.len() {
            let Some(&next) = text.get(c * CHUNK + j + 1) else {
                break;
            };
            let (base, exact) = (log_softmax(&rows[0][j]), log_softmax(&rows[1][j]));
            for (f, r) in figures.iter_mut().zip(&rows) {
                f.add([&base, &exact], &log_softmax(&r[j]), next);
            }
        }
    }
    for e in engines {
        e.kv.close(1);
    }
    figures
}

/// Each engine's greedy continuations of `prompts`, all decoded in one batch a step.
async fn greedy(e: &Engine, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let mut last = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let seq = 100 + i as u64;
        // Prompts share their system turn: what the store already holds is not computed again.
        let cached = e.kv.open(seq, p.clone(), 0).await.unwrap().cached_tokens;
        let input = StepInput {
            seq,
            tokens: p[cached..].to_vec(),
            position: cached,
        };
        let l = forward_step(&e.model, &e.weights, &e.kv, e.shape, &[input]).await;
        last.push(argmax(&l.unwrap()[0]));
    }
    let mut out: Vec<Vec<u32>> = last.iter().map(|t| vec![*t]).collect();
    for step in 1..NEW_TOKENS {
        let batch: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| StepInput::decode(100 + i as u64, out[i][step - 1], p.len() + step - 1))
            .collect();
        let logits = forward_step(&e.model, &e.weights, &e.kv, e.shape, &batch).await;
        for (o, l) in out.iter_mut().zip(logits.unwrap()) {
            o.push(argmax(&l));
        }
    }
    for i in 0..prompts.len() {
        e.kv.close(100 + i as u64);
    }
    out
}

/// A continuation up to and including its first end-of-sequence token.
fn until_eos(tokens: &[u32], eos: Option<u32>) -> &[u32] {
    match tokens.iter().position(|t| Some(*t) == eos) {
        Some(i) => &tokens[..=i],
        None => tokens,
    }
}

/// How each configuration's continuations compare with the baseline's: equal ones, and
/// where each first differs (`null` where equal).
fn compare_greedy(base: &[Vec<u32>], mine: &[Vec<u32>], eos: Option<u32>) -> serde_json::Value {
    let first_diff: Vec<Option<usize>> = base
        .iter()
        .zip(mine)
        .map(|(b, m)| {
            let (b, m) = (until_eos(b, eos), until_eos(m, eos));
            let same = b.iter().zip(m).take_while(|(x, y)| x == y).count();
            (b != m).then_some(same)
        })
        .collect();
    json!({
        "prompts": base.len(),
        "equal": first_diff.iter().filter(|d| d.is_none()).count(),
        "first_difference": first_diff,
    })
}

fn main() {
    let Some(path) = smollm2_path() else {
        println!("SKIPPED kv_quant: no SmolLM2 GGUF (run scripts/fetch-model.sh)");
        return;
    };
    let loaded = Smol::load(&path).unwrap();
    let codec = TextCodec::new(&loaded.tokenizer).unwrap();
    let eos = codec.eos;
    drop(loaded);
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/data/kv_quant.txt");
    let mut text = codec
        .encode_text(&std::fs::read_to_string(&file).unwrap())
        .unwrap();
    if let Ok(cap) = std::env::var("PROCMEM_QUANT_POSITIONS") {
        text.truncate(
            cap.parse::<usize>()
                .expect("PROCMEM_QUANT_POSITIONS: a number")
                + 1,
        );
    }
    let parts = std::env::var("PROCMEM_QUANT_PARTS").unwrap_or_default();
    let part = |name: &str| parts.is_empty() || parts.split(',').any(|p| p.trim() == name);
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/reports/kv_quant.json");
    // A run of one part keeps the other's figures from the last run.
    let mut report = std::fs::read(&out)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .filter(|r| r.is_object())
        .unwrap_or_else(|| json!({}));
    if part("quality") {
        let mut prompts = builtin_prompts(&codec, 8).unwrap();
        prompts.extend(MORE_PROMPTS.iter().map(|u| codec.chat(None, u).unwrap()));
        let capacity = report.get("capacity").cloned();
        report = run(&path, &text, &prompts, eos);
        if let Some(c) = capacity {
            report["capacity"] = c;
        }
    }
    if part("capacity") {
        let shape = Smol::load(&path)
            .unwrap()
            .model
            .kv_shape(KvDtype::F16, KvDtype::F16, 8);
        report["capacity"] = capacity::measure(shape);
    }
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    std::fs::write(&out, serde_json::to_string_pretty(&report).unwrap()).unwrap();
    println!("wrote {}", out.display());
}

/// Every configuration's engine over one memory manager; the text, then the prompts.
fn run(
    path: &std::path::Path,
    text: &[u32],
    prompts: &[Vec<u32>],
    eos: Option<u32>,
) -> serde_json::Value {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let memory = MemoryManager::builder().build().await.unwrap();
        let max = text
            .len()
            .max(prompts.iter().map(Vec::len).max().unwrap_or(0) + NEW_TOKENS)
            + 1;
        let mut engines = Vec::new();
        for (_, k, v) in CONFIGS {
            engines.push(engine(&memory, (path, max), k, v).await);
        }
        let start = std::time::Instant::now();
        let figures = measure_text(&engines, text).await;
        println!(
            "text: {} positions in {:.1?}",
            figures[0].positions,
            start.elapsed()
        );
        let mut continuations = Vec::new();
        for e in &engines {
            continuations.push(greedy(e, prompts).await);
        }
        let rows: Vec<serde_json::Value> = CONFIGS
            .iter()
            .zip(&engines)
            .zip(figures.iter().zip(&continuations))
            .map(|(((name, k, v), e), (f, c))| {
                let mut row = f.json();
                row["config"] = json!(name);
                row["k_dtype"] = json!(k.name());
                row["v_dtype"] = json!(v.name());
                row["kv_token_bytes"] = json!(e.shape.token_bytes_all());
                row["greedy"] = compare_greedy(&continuations[0], c, eos);
                row
            })
            .collect();
        print_rows(&rows);
        drop(engines);
        memory.shutdown().await.unwrap();
        let q8 = rows.iter().find(|r| r["config"] == "q8_0").unwrap();
        let met = q8["mean_kl"].as_f64().unwrap() <= KL_GOAL;
        json!({
            "baseline": "f16",
            "text": {"file": "benches/data/kv_quant.txt", "tokens": text.len()},
            "greedy": {"prompts": prompts.len(), "new_tokens": NEW_TOKENS},
            "rows": rows,
            "goal": {"q8_0_mean_kl_at_most": KL_GOAL, "met": met},
        })
    })
}

fn print_rows(rows: &[serde_json::Value]) {
    println!(
        "{:>14} {:>8} {:>9} {:>8} {:>7} {:>11} {:>7} {:>10} {:>7}",
        "config",
        "KV B/tok",
        "mean KL",
        "p99 KL",
        "max KL",
        "KL from f32",
        "top-1",
        "perplexity",
        "greedy"
    );
    for r in rows {
        let f = |k: &str| r[k].as_f64().unwrap();
        println!(
            "{:>14} {:>8} {:>9.6} {:>8.4} {:>7.3} {:>11.6} {:>6.2}% {:>10.3} {:>4}/{}",
            r["config"].as_str().unwrap(),
            r["kv_token_bytes"],
            f("mean_kl"),
            f("p99_kl"),
            f("max_kl"),
            f("mean_kl_from_f32"),
            100.0 * f("top1_agreement"),
            f("perplexity"),
            r["greedy"]["equal"],
            r["greedy"]["prompts"],
        );
    }
}
