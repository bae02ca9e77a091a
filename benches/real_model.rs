//! real_model: SmolLM2-135M decoding over this project's managed KV against candle's own
//! models with their own KV caches: same GGUF, same prompt, same run, at several contexts.
//! Writes `target/reports/real_model.json`: `rows` of `path`, `context`, `tokens_per_s`
//! (decode only, after the prompt is in), `peak_kv_bytes`, `kv_token_bytes` (the tokens' own
//! K/V bytes), and `ratios` (procmem over each candle path, per context).
//!
//! The paths, all alive at once and stepped in turn (procmem, then each candle model, one
//! token each, then again), so a noisy machine slows them alike; each path's tokens/s is its
//! new tokens over the sum of its own step times:
//! - `procmem`: this project's engine (the KV store's step API, the decode operator over the
//!   flat KV, weights under residency), KV in `f32` as candle keeps it; `procmem_f16` and
//!   `procmem_q8_0` the same engine with its KV in `f16` and in `q8_0` (the `ratios` give
//!   `q8_0_over_f16_tokens_per_s` and `q8_0_over_f16_peak_kv`);
//! - `candle`: candle-transformers' `quantized_llama`. It keeps RoPE tables for 4,096
//!   positions (`MAX_SEQ_LEN`), so a longer context is reported as not run for it;
//! - `candle_mistral`: candle-transformers' `quantized_mistral`, the same architecture with
//!   RoPE tables as long as its config says and the same concatenating KV cache, loaded from
//!   the same GGUF's quantized tensors under Hugging Face names, each head's query and key rows
//!   put back in the order its half-split RoPE pairs (the GGUF's are interleaved for
//!   llama.cpp's). It runs at every context; where `quantized_llama` runs too its tokens are
//!   checked against it.
//!
//! The `prefill` rows take one prompt of `PROCMEM_BENCH_PREFILL` tokens (default 2,000) into
//! the managed KV twice in one engine: one token per step (the old way: a grant, a step and a
//! forward per token), and in steps of `PROCMEM_BENCH_CHUNK` tokens (default 256); the
//! figures are seconds, prompt tokens/s and `prefill_speedup` (one over the other), and the
//! two runs' next-token logits are checked equal. candle's `quantized_llama` taking the same
//! prompt in one masked forward is the outside reference (`candle_whole_prompt`).
//!
//! `PROCMEM_BENCH_CONTEXTS` (comma-separated, default `256,2048,8192`; empty for the prefill
//! rows alone) and
//! `PROCMEM_BENCH_TOKENS` (new tokens timed per context, default 32) change the run. The
//! model comes from `scripts/fetch-model.sh`; without it the bench says so and writes nothing.

mod common;

use std::borrow::Cow;
use std::time::Instant;

use candle_core::quantized::{gguf_file, QStorage, QTensor};
use candle_core::{Device, Tensor};
use candle_transformers::models::mistral::Config as MistralConfig;
use candle_transformers::models::quantized_llama::{ModelWeights, MAX_SEQ_LEN};
use candle_transformers::models::quantized_mistral::Model as Mistral;
use candle_transformers::quantized_var_builder::VarBuilder;
use procmem_actors::procmem::kv::KvDtype;
use procmem_actors::MemoryManager;
use procmem_model::{argmax, forward_step, smollm2_path, Engine, Smol, StepInput, TextCodec};
use serde_json::json;

const TEXT: &str = "The history of computing memory is a history of trade-offs between speed, \
    size and cost. Registers are fastest and smallest; caches hold what was used recently; main \
    memory holds the working set; disks hold everything else. An inference server adds one more \
    layer: the key and value cache of every sequence it serves, which grows with each token. ";

#[derive(Default)]
struct Measured {
    /// Time in decode steps, summed.
    busy: std::time::Duration,
    peak_kv_bytes: u64,
    tokens: Vec<u32>,
}

impl Measured {
    fn tokens_per_s(&self) -> f64 {
        self.tokens.len() as f64 / self.busy.as_secs_f64()
    }

    /// Times one step and keeps its greedy token.
    fn step(&mut self, f: impl FnOnce() -> Vec<f32>) {
        let start = Instant::now();
        let logits = f();
        self.busy += start.elapsed();
        self.tokens.push(argmax(&logits));
    }
}

/// A prompt of exactly `context` tokens: a chat turn whose user text is `TEXT` repeated.
fn prompt(codec: &TextCodec, context: usize) -> Vec<u32> {
    let head = codec
        .chat(
            Some("You are a concise assistant."),
            "Summarize the following text.",
        )
        .unwrap();
    let body = codec.encode(TEXT).unwrap();
    let mut p = head;
    while p.len() < context {
        p.extend_from_slice(&body);
    }
    p.truncate(context);
    p
}

/// The GGUF's tensors under the names candle's `quantized_mistral` loads, as a GGUF in
/// memory: the same quantized bytes, with each head's query and key rows moved from
/// llama.cpp's interleaved order (`[head][pair][2]`) back to the half-split order
/// (`[head][2][pair]`) that a non-interleaved RoPE pairs. A row is a whole number of
/// quantized blocks (blocks run along the input dimension), so rows move as bytes.
fn mistral_gguf(path: &std::path::Path, q_heads: usize, kv_heads: usize) -> Vec<u8> {
    let mut file = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let unpermute = |t: QTensor, heads: usize| -> QTensor {
        let (rows, cols) = t.shape().dims2().unwrap();
        let bytes = t.data().unwrap().into_owned();
        let row = bytes.len() / rows;
        let head_dim = rows / heads;
        let half = head_dim / 2;
        let mut out = Vec::with_capacity(bytes.len());
        for h in 0..heads {
            for two in 0..2 {
                for i in 0..half {
                    let from = h * head_dim + 2 * i + two;
                    out.extend_from_slice(&bytes[from * row..(from + 1) * row]);
                }
            }
        }
        // Borrowed: candle 0.9.2's `from_data` reads an owned buffer after dropping it.
        let storage = QStorage::from_data(Cow::Borrowed(&out), &Device::Cpu, t.dtype()).unwrap();
        QTensor::new(storage, (rows, cols)).unwrap()
    };
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let t = content.tensor(&mut file, name, &Device::Cpu).unwrap();
        let hf = |rest: &str| -> String {
            let (layer, what) = rest.split_once('.').unwrap();
            let what = match what {
                "attn_norm.weight" => "input_layernorm.weight",
                "ffn_norm.weight" => "post_attention_layernorm.weight",
                "attn_q.weight" => "self_attn.q_proj.weight",
                "attn_k.weight" => "self_attn.k_proj.weight",
                "attn_v.weight" => "self_attn.v_proj.weight",
                "attn_output.weight" => "self_attn.o_proj.weight",
                "ffn_gate.weight" => "mlp.gate_proj.weight",
                "ffn_up.weight" => "mlp.up_proj.weight",
                "ffn_down.weight" => "mlp.down_proj.weight",
                other => panic!("unexpected tensor blk.{layer}.{other}"),
            };
            format!("model.layers.{layer}.{what}")
        };
        match name.as_str() {
            "token_embd.weight" => {
                // Tied: the output projection is the embedding, as quantized_llama reads it
                // when the GGUF has no `output.weight`.
                if !content.tensor_infos.contains_key("output.weight") {
                    let copy = QTensor::new(
                        QStorage::from_data(t.data().unwrap(), &Device::Cpu, t.dtype()).unwrap(),
                        t.shape().clone(),
                    )
                    .unwrap();
                    tensors.push(("lm_head.weight".into(), copy));
                }
                tensors.push(("model.embed_tokens.weight".into(), t));
            }
            "output.weight" => tensors.push(("lm_head.weight".into(), t)),
            "output_norm.weight" => tensors.push(("model.norm.weight".into(), t)),
            n if n.ends_with(".attn_q.weight") => {
                tensors.push((hf(&n["blk.".len()..]), unpermute(t, q_heads)))
            }
            n if n.ends_with(".attn_k.weight") => {
                tensors.push((hf(&n["blk.".len()..]), unpermute(t, kv_heads)))
            }
            n if n.starts_with("blk.") => tensors.push((hf(&n["blk.".len()..]), t)),
            other => panic!("unexpected tensor {other}"),
        }
    }
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut out = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut out, &[], &refs).unwrap();
    out.into_inner()
}

/// candle-transformers' `quantized_mistral` over [`mistral_gguf`]'s tensors, with RoPE
/// tables for `positions`.
fn candle_mistral_model(
    gguf: &[u8],
    config: &procmem_model::gguf::Config,
    positions: usize,
) -> Mistral {
    let vb = VarBuilder::from_gguf_buffer(gguf, &Device::Cpu).unwrap();
    let (intermediate_size, _) = vb
        .get_no_shape("model.layers.0.mlp.up_proj.weight")
        .unwrap()
        .shape()
        .dims2()
        .unwrap();
    let cfg = MistralConfig {
        vocab_size: config.vocab,
        hidden_size: config.hidden,
        intermediate_size,
        num_hidden_layers: config.layers,
        num_attention_heads: config.q_heads,
        head_dim: Some(config.head_dim),
        num_key_value_heads: config.kv_heads,
        hidden_act: candle_nn::Activation::Silu,
        max_position_embeddings: positions,
        rms_norm_eps: f64::from(config.rms_eps),
        rope_theta: f64::from(config.rope_base),
        sliding_window: None,
        use_flash_attn: false,
    };
    Mistral::new(&cfg, vb).unwrap()
}

/// How many leading tokens two runs share.
fn same_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// One forward of a candle model over `tokens` from position `pos`: the last row's logits.
fn candle_logits<M>(
    model: &mut M,
    forward: fn(&mut M, &Tensor, usize) -> candle_core::Result<Tensor>,
    tokens: &[u32],
    pos: usize,
) -> Vec<f32> {
    let input = Tensor::new(tokens, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    forward(model, &input, pos)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// One context: the three paths set up, their prompts in (untimed), then `new` tokens each,
/// stepped in turn. Returns procmem, `quantized_llama` (where it runs) and `quantized_mistral`.
/// The KV types procmem decodes over at each context, each its own engine stepped in turn
/// with the others: `f32` (the `procmem` row, as candle keeps its caches), `f16` and `q8_0`
/// (K and V both).
const OURS: [(&str, KvDtype); 3] = [
    ("procmem", KvDtype::F32),
    ("procmem_f16", KvDtype::F16),
    ("procmem_q8_0", KvDtype::Q8_0),
];

/// An engine over `memory` for prompts up to `max_tokens`: KV in `dtype`, growth mapped ahead.
async fn engine(
    path: &std::path::Path,
    memory: &MemoryManager,
    max_tokens: usize,
    dtype: KvDtype,
) -> Engine {
    let loaded = Smol::load(path).unwrap();
    let kv = common::smol_kv_config(&loaded, max_tokens, dtype, dtype)
        .wait(std::time::Duration::from_secs(30))
        .map_ahead(true);
    Engine::start(memory, loaded, kv, None).await.unwrap()
}

/// Takes `prompt` into the open sequence `seq` in steps of at most `chunk` tokens; returns
/// the time it took and the logits of the token after it.
async fn prefill(
    e: &Engine,
    seq: u64,
    prompt: &[u32],
    chunk: usize,
) -> (std::time::Duration, Vec<f32>) {
    let start = Instant::now();
    let mut logits = Vec::new();
    for (i, part) in prompt.chunks(chunk.max(1)).enumerate() {
        let input = StepInput {
            seq,
            tokens: part.to_vec(),
            position: i * chunk.max(1),
        };
        logits = forward_step(&e.model, &e.weights, &e.kv, e.shape, &[input])
            .await
            .unwrap()
            .remove(0);
    }
    (start.elapsed(), logits)
}

/// The `prefill` rows: `prompt` taken a token a step and in steps of `chunk`, in one engine
/// (two sequences opened before either is written, so neither finds the other's blocks),
/// and candle's `quantized_llama` taking it in one forward.
fn measure_prefill(path: &std::path::Path, prompt: &[u32], chunk: usize) -> serde_json::Value {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (one, chunked, same) = rt.block_on(async {
        let memory = MemoryManager::builder().build().await.unwrap();
        let e = engine(path, &memory, prompt.len() + 1, KvDtype::F32).await;
        e.kv.open(1, prompt.to_vec(), 0).await.unwrap();
        e.kv.open(2, prompt.to_vec(), 0).await.unwrap();
        let (one, a) = prefill(&e, 1, prompt, 1).await;
        let (chunked, b) = prefill(&e, 2, prompt, chunk).await;
        let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
        drop(e);
        memory.shutdown().await.unwrap();
        (one, chunked, same)
    });
    let candle = (prompt.len() <= MAX_SEQ_LEN).then(|| {
        let mut file = std::fs::File::open(path).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        let mut model = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
        let start = Instant::now();
        candle_logits(&mut model, ModelWeights::forward, prompt, 0);
        start.elapsed()
    });
    let n = prompt.len() as f64;
    let speedup = one.as_secs_f64() / chunked.as_secs_f64();
    println!(
        "{:>8} {:>26} {:>10} {:>14}",
        "prompt", "path", "seconds", "prompt tok/s"
    );
    let mut rows = vec![
        ("procmem_one_token_a_step", 1, one),
        ("procmem_chunks", chunk, chunked),
    ];
    if let Some(c) = candle {
        rows.push(("candle_whole_prompt", prompt.len(), c));
    }
    let rows: Vec<serde_json::Value> = rows
        .into_iter()
        .map(|(path, step, t)| {
            let s = t.as_secs_f64();
            println!("{:>8} {path:>26} {s:>10.2} {:>14.1}", prompt.len(), n / s);
            json!({ "path": path, "prompt_tokens": prompt.len(), "tokens_a_step": step,
                    "seconds": s, "tokens_per_s": n / s })
        })
        .collect();
    println!("prefill_speedup {speedup:.2}x (chunks of {chunk} over a token a step); next-token logits equal: {same}");
    assert!(same, "chunked prefill changed the next token's logits");
    json!({ "rows": rows, "prefill_speedup": speedup, "same_logits": same })
}

/// candle's `quantized_llama` with `prompt` taken at once (its fastest way), and its first
/// token; `None` where the prompt and `new` tokens pass its RoPE tables.
fn candle_llama(
    path: &std::path::Path,
    prompt: &[u32],
    new: usize,
) -> Option<(ModelWeights, Measured)> {
    (prompt.len() + new <= MAX_SEQ_LEN).then(|| {
        let mut file = std::fs::File::open(path).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        let mut model = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
        let l = candle_logits(&mut model, ModelWeights::forward, prompt, 0);
        let m = Measured {
            tokens: vec![argmax(&l)],
            ..Measured::default()
        };
        (model, m)
    })
}

/// candle's caches are one K and one V tensor per layer, concatenated anew each step: at the
/// end every layer holds all `total` tokens, and while the last layer's new tensor is built
/// its old one is alive too.
fn candle_peak_kv(total: usize, layers: usize, token_bytes: u64) -> u64 {
    let (total, layers) = (total as u64, layers as u64);
    total * token_bytes + (total - 1) * token_bytes / layers
}

fn measure(
    path: &std::path::Path,
    mistral: &[u8],
    config: &procmem_model::gguf::Config,
    prompt: &[u32],
    new: usize,
    token_bytes: u64,
) -> (Vec<Measured>, Option<Measured>, Measured) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let max_tokens = prompt.len() + new + 1;
        let memory = MemoryManager::builder().build().await.unwrap();
        // The prompt goes in chunks of the engine's step budget (the `prefill` rows compare
        // that with a token a step). candle's models take theirs at once (their fastest
        // way); `quantized_mistral` in masked chunks of 512 (its attention matrix stays
        // small).
        let mut ours = Vec::new();
        for (_, dtype) in OURS {
            let e = engine(path, &memory, max_tokens, dtype).await;
            e.kv.open(1, prompt.to_vec(), 0).await.unwrap();
            let (_, logits) = prefill(&e, 1, prompt, e.step_tokens).await;
            let m = Measured {
                tokens: vec![argmax(&logits)],
                ..Measured::default()
            };
            ours.push((e, m));
        }
        let mut llama = candle_llama(path, prompt, new);
        let mut mist_model = candle_mistral_model(mistral, config, max_tokens);
        let mut logits = Vec::new();
        for (i, chunk) in prompt.chunks(512).enumerate() {
            logits = candle_logits(&mut mist_model, Mistral::forward, chunk, i * 512);
        }
        let mut mist = Measured {
            tokens: vec![argmax(&logits)],
            ..Measured::default()
        };
        for i in 0..new {
            let pos = prompt.len() + i;
            for (e, m) in &mut ours {
                let start = Instant::now();
                let batch = [StepInput::decode(1, m.tokens[i], pos)];
                let step = forward_step(&e.model, &e.weights, &e.kv, e.shape, &batch);
                let l = step.await.unwrap().remove(0);
                m.busy += start.elapsed();
                m.tokens.push(argmax(&l));
            }
            if let Some((model, m)) = &mut llama {
                let t = m.tokens[i];
                m.step(|| candle_logits(model, ModelWeights::forward, &[t], pos));
            }
            let t = mist.tokens[i];
            mist.step(|| candle_logits(&mut mist_model, Mistral::forward, &[t], pos));
        }
        let mut mine = Vec::new();
        for (e, mut m) in ours {
            // The sequence only grows: its memory at the end is its peak.
            m.peak_kv_bytes = e.kv.stats().await.unwrap().leased_bytes;
            e.kv.close(1);
            mine.push(m);
        }
        memory.shutdown().await.unwrap();
        let theirs = candle_peak_kv(prompt.len() + new, config.layers, token_bytes);
        let mut llama = llama.map(|(_, m)| m);
        for m in mine.iter_mut().chain(llama.as_mut()).chain(Some(&mut mist)) {
            // The token after the last timed step was never fed back.
            m.tokens.truncate(new);
        }
        if let Some(m) = &mut llama {
            m.peak_kv_bytes = theirs;
        }
        mist.peak_kv_bytes = theirs;
        (mine, llama, mist)
    })
}

fn main() {
    let Some(path) = smollm2_path() else {
        println!("SKIPPED real_model: no SmolLM2 GGUF (run scripts/fetch-model.sh)");
        return;
    };
    let contexts =
        common::env_list("PROCMEM_BENCH_CONTEXTS").unwrap_or_else(|| vec![256, 2048, 8192]);
    let new: usize = std::env::var("PROCMEM_BENCH_TOKENS")
        .ok()
        .map(|v| v.parse().expect("PROCMEM_BENCH_TOKENS: a number"))
        .unwrap_or(32);
    let loaded = Smol::load(&path).unwrap();
    let codec = TextCodec::new(&loaded.tokenizer).unwrap();
    let c = loaded.model.config.clone();
    // f32 K and V, every layer: what every cache keeps per token.
    let token_bytes = (c.layers * 2 * c.kv_heads * c.head_dim * 4) as u64;
    drop(loaded);
    let mistral = mistral_gguf(&path, c.q_heads, c.kv_heads);
    let mut rows = Vec::new();
    let mut ratios = Vec::new();
    println!(
        "{:>8} {:>15} {:>10} {:>14} {:>14}",
        "context", "path", "tokens/s", "peak KV B", "tokens' KV B"
    );
    for &context in &contexts {
        let p = prompt(&codec, context);
        let kv_token_bytes = (context + new) as u64 * token_bytes;
        let (mine, llama, mist) = measure(&path, &mistral, &c, &p, new, token_bytes);
        let mut ratio = record(
            context,
            new,
            kv_token_bytes,
            (&mine[0], llama.as_ref(), &mist),
            &mut rows,
        );
        record_types(context, kv_token_bytes, &mine, &mut rows, &mut ratio);
        ratios.push(ratio);
    }
    let prefill_tokens: usize = std::env::var("PROCMEM_BENCH_PREFILL")
        .ok()
        .map(|v| v.parse().expect("PROCMEM_BENCH_PREFILL: a number"))
        .unwrap_or(2000);
    let chunk: usize = std::env::var("PROCMEM_BENCH_CHUNK")
        .ok()
        .map(|v| v.parse().expect("PROCMEM_BENCH_CHUNK: a number"))
        .unwrap_or(procmem_model::serve::STEP_TOKENS);
    let prefill = measure_prefill(&path, &prompt(&codec, prefill_tokens), chunk);
    let report = json!({
        "new_tokens": new, "rows": rows, "ratios": ratios, "prefill": prefill,
    });
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/reports");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("real_model.json");
    std::fs::write(&file, serde_json::to_string_pretty(&report).unwrap()).unwrap();
    println!("wrote {}", file.display());
}

/// One context's rows (procmem, candle's `quantized_llama` where it ran, candle's mistral),
/// printed and added to `rows`; returns the context's ratios.
fn record(
    context: usize,
    new: usize,
    kv_token_bytes: u64,
    (mine, llama, mist): (&Measured, Option<&Measured>, &Measured),
    rows: &mut Vec<serde_json::Value>,
) -> serde_json::Value {
    let row = |rows: &mut Vec<serde_json::Value>, path: &str, m: &Measured, note: String| {
        println!(
            "{context:>8} {path:>15} {:>10.2} {:>14} {kv_token_bytes:>14}   {note}",
            m.tokens_per_s(),
            m.peak_kv_bytes
        );
        rows.push(json!({
            "path": path, "context": context, "tokens_per_s": m.tokens_per_s(),
            "peak_kv_bytes": m.peak_kv_bytes, "kv_token_bytes": kv_token_bytes,
        }));
    };
    row(rows, "procmem", mine, String::new());
    let mut ratio = json!({ "context": context });
    match llama {
        Some(theirs) => {
            let r = mine.tokens_per_s() / theirs.tokens_per_s();
            let same = same_prefix(&mine.tokens, &theirs.tokens);
            row(
                rows,
                "candle",
                theirs,
                format!("ratio {r:.2}; procmem's first {same}/{new} tokens equal these"),
            );
            rows.last_mut().unwrap()["same_tokens_as_procmem"] = json!(same);
            ratio["tokens_per_s_ratio"] = json!(r);
        }
        None => {
            println!(
                "{context:>8} {:>15} {:>10}   (quantized_llama keeps {MAX_SEQ_LEN} positions)",
                "candle", "not run"
            );
            rows.push(json!({
                "path": "candle", "context": context, "tokens_per_s": null,
                "peak_kv_bytes": null, "kv_token_bytes": kv_token_bytes,
                "not_run": format!("quantized_llama keeps RoPE tables for {MAX_SEQ_LEN} positions"),
            }));
        }
    }
    let r = mine.tokens_per_s() / mist.tokens_per_s();
    let same = same_prefix(&mine.tokens, &mist.tokens);
    let same_llama = llama.map(|l| same_prefix(&l.tokens, &mist.tokens));
    let mut note = format!("ratio {r:.2}; procmem's first {same}/{new} tokens equal these");
    if let Some(n) = same_llama {
        note += &format!(", quantized_llama's first {n}/{new}");
    }
    row(rows, "candle_mistral", mist, note);
    let last = rows.last_mut().unwrap();
    last["same_tokens_as_procmem"] = json!(same);
    if let Some(n) = same_llama {
        last["same_tokens_as_candle"] = json!(n);
    }
    ratio["tokens_per_s_ratio_mistral"] = json!(r);
    ratio
}

/// The rows of procmem's other KV types (after `procmem`'s own, `f32`): each's tokens/s and
/// peak KV, and the `q8_0` over `f16` ratio of tokens/s into `ratio`.
fn record_types(
    context: usize,
    kv_token_bytes: u64,
    mine: &[Measured],
    rows: &mut Vec<serde_json::Value>,
    ratio: &mut serde_json::Value,
) {
    for ((path, dtype), m) in OURS.iter().zip(mine).skip(1) {
        let same = same_prefix(&mine[0].tokens, &m.tokens);
        println!(
            "{context:>8} {path:>15} {:>10.2} {:>14} {kv_token_bytes:>14}   KV in {dtype}; {same}/{} tokens equal f32's",
            m.tokens_per_s(),
            m.peak_kv_bytes,
            m.tokens.len()
        );
        rows.push(json!({
            "path": path, "context": context, "tokens_per_s": m.tokens_per_s(),
            "peak_kv_bytes": m.peak_kv_bytes, "kv_token_bytes": kv_token_bytes,
            "kv_dtype": dtype.name(), "same_tokens_as_procmem": same,
        }));
    }
    let r = mine[2].tokens_per_s() / mine[1].tokens_per_s();
    println!("{context:>8} {:>15} {r:>10.3}", "q8_0 / f16");
    ratio["q8_0_over_f16_tokens_per_s"] = json!(r);
    ratio["q8_0_over_f16_peak_kv"] =
        json!(mine[2].peak_kv_bytes as f64 / mine[1].peak_kv_bytes.max(1) as f64);
}
