//! real_model: SmolLM2-135M decoding over this project's managed KV against candle's own
//! `quantized_llama` with its own KV cache: same GGUF, same prompt, same run, at several
//! contexts. Writes `target/reports/real_model.json`:
//! `rows` of `path` (`procmem` / `candle`), `context`, `tokens_per_s` (decode only, after the
//! prompt is in), `peak_kv_bytes`, `kv_token_bytes` (the tokens' own K/V bytes), and
//! `ratios` (procmem over candle, per context).
//!
//! `PROCMEM_BENCH_CONTEXTS` (comma-separated, default `256,2048,8192`) and
//! `PROCMEM_BENCH_TOKENS` (new tokens timed per context, default 32) change the run. The
//! model comes from `scripts/fetch-model.sh`; without it the bench says so and writes nothing.
//!
//! candle's model keeps RoPE tables for 4,096 positions (`MAX_SEQ_LEN`), so a context beyond
//! that is reported as not run for candle rather than run into a panic.

use std::time::Instant;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::{ModelWeights, MAX_SEQ_LEN};
use procmem_actors::procmem::kv::{KvDtype, KvShape};
use procmem_actors::{KvStoreConfig, MemoryManager, PreemptMode, SwapSpace};
use procmem_model::{argmax, decode_step, smollm2_path, Engine, Smol, TextCodec};
use serde_json::json;

const TEXT: &str = "The history of computing memory is a history of trade-offs between speed, \
    size and cost. Registers are fastest and smallest; caches hold what was used recently; main \
    memory holds the working set; disks hold everything else. An inference server adds one more \
    layer: the key and value cache of every sequence it serves, which grows with each token. ";

struct Measured {
    tokens_per_s: f64,
    peak_kv_bytes: u64,
    tokens: Vec<u32>,
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

fn ours(path: &std::path::Path, prompt: &[u32], new: usize) -> Measured {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let max_tokens = prompt.len() + new + 1;
        let loaded = Smol::load(path, max_tokens).unwrap();
        let memory = MemoryManager::builder().build().await.unwrap();
        let config = KvStoreConfig {
            name: "kv".into(),
            priority: 0,
            shape: KvShape {
                layers: 0,
                q_heads: 1,
                kv_heads: 1,
                head_dim: 1,
                max_tokens,
                dtype: KvDtype::F32,
            },
            chunk_granules: 16,
            preempt: PreemptMode::Swap,
            wait: std::time::Duration::from_secs(30),
            swap: SwapSpace::Auto,
            map_ahead: true,
        };
        let engine = Engine::start(&memory, loaded, config, None).await.unwrap();
        engine.kv.open(1, prompt.to_vec(), 0).await.unwrap();
        let step = |token: u32, pos: usize| {
            let e = &engine;
            async move {
                decode_step(&e.model, &e.weights, &e.kv, e.shape, &[(1, token, pos)])
                    .await
                    .unwrap()
                    .remove(0)
            }
        };
        // The prompt goes in one token a step (the store's step API grows a sequence by one
        // token); only the decode after it is timed.
        let mut logits = Vec::new();
        for (pos, &t) in prompt.iter().enumerate() {
            logits = step(t, pos).await;
        }
        let mut tokens = vec![argmax(&logits)];
        let start = Instant::now();
        for i in 0..new {
            let l = step(tokens[i], prompt.len() + i).await;
            tokens.push(argmax(&l));
        }
        let elapsed = start.elapsed().as_secs_f64();
        let stats = engine.kv.stats().await.unwrap();
        engine.kv.close(1);
        drop(engine);
        memory.shutdown().await.unwrap();
        tokens.truncate(new);
        Measured {
            tokens_per_s: new as f64 / elapsed,
            // The sequence only grows: its memory at the end is its peak.
            peak_kv_bytes: stats.leased_bytes,
            tokens,
        }
    })
}

fn candle(
    path: &std::path::Path,
    prompt: &[u32],
    new: usize,
    token_bytes: u64,
    layers: u64,
) -> Measured {
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
    // Its prompt goes in at once (its fastest way); only the decode is timed.
    let logits = forward(&mut model, prompt, 0);
    let mut tokens = vec![argmax(&logits)];
    let start = Instant::now();
    for i in 0..new {
        let l = forward(&mut model, &[tokens[i]], prompt.len() + i);
        tokens.push(argmax(&l));
    }
    let elapsed = start.elapsed().as_secs_f64();
    tokens.truncate(new);
    // Its cache is one K and one V tensor per layer, concatenated anew each step: at the end
    // every layer holds all tokens, and while the last layer's new tensor is built its old one
    // is alive too.
    let total = prompt.len() as u64 + new as u64;
    Measured {
        tokens_per_s: new as f64 / elapsed,
        peak_kv_bytes: total * token_bytes + (total - 1) * token_bytes / layers,
        tokens,
    }
}

fn main() {
    let Some(path) = smollm2_path() else {
        println!("SKIPPED real_model: no SmolLM2 GGUF (run scripts/fetch-model.sh)");
        return;
    };
    let contexts: Vec<usize> = std::env::var("PROCMEM_BENCH_CONTEXTS")
        .unwrap_or_else(|_| "256,2048,8192".into())
        .split(',')
        .map(|c| c.trim().parse().expect("PROCMEM_BENCH_CONTEXTS: numbers"))
        .collect();
    let new: usize = std::env::var("PROCMEM_BENCH_TOKENS")
        .ok()
        .map(|v| v.parse().expect("PROCMEM_BENCH_TOKENS: a number"))
        .unwrap_or(32);
    let loaded = Smol::load(&path, 8).unwrap();
    let codec = TextCodec::new(&loaded.tokenizer).unwrap();
    let c = &loaded.model.config;
    // f32 K and V, every layer: what both caches keep per token.
    let token_bytes = (c.layers * 2 * c.kv_heads * c.head_dim * 4) as u64;
    let layers = c.layers as u64;
    drop(loaded);
    let mut rows = Vec::new();
    let mut ratios = Vec::new();
    println!(
        "{:>8} {:>8} {:>12} {:>14} {:>14}",
        "context", "path", "tokens/s", "peak KV B", "tokens' KV B"
    );
    for &context in &contexts {
        let p = prompt(&codec, context);
        let kv_token_bytes = (context + new) as u64 * token_bytes;
        let mine = ours(&path, &p, new);
        println!(
            "{context:>8} {:>8} {:>12.2} {:>14} {:>14}",
            "procmem", mine.tokens_per_s, mine.peak_kv_bytes, kv_token_bytes
        );
        rows.push(json!({
            "path": "procmem", "context": context, "tokens_per_s": mine.tokens_per_s,
            "peak_kv_bytes": mine.peak_kv_bytes, "kv_token_bytes": kv_token_bytes,
        }));
        if context + new <= MAX_SEQ_LEN {
            let theirs = candle(&path, &p, new, token_bytes, layers);
            let same = mine
                .tokens
                .iter()
                .zip(&theirs.tokens)
                .take_while(|(a, b)| a == b)
                .count();
            println!(
                "{context:>8} {:>8} {:>12.2} {:>14} {:>14}   ratio {:.2}, first {same}/{new} tokens equal",
                "candle",
                theirs.tokens_per_s,
                theirs.peak_kv_bytes,
                kv_token_bytes,
                mine.tokens_per_s / theirs.tokens_per_s
            );
            rows.push(json!({
                "path": "candle", "context": context, "tokens_per_s": theirs.tokens_per_s,
                "peak_kv_bytes": theirs.peak_kv_bytes, "kv_token_bytes": kv_token_bytes,
                "same_tokens": same,
            }));
            ratios.push(json!({
                "context": context,
                "tokens_per_s_ratio": mine.tokens_per_s / theirs.tokens_per_s,
            }));
        } else {
            println!(
                "{context:>8} {:>8} {:>12}   (quantized_llama keeps {MAX_SEQ_LEN} positions)",
                "candle", "not run"
            );
            rows.push(json!({
                "path": "candle", "context": context, "tokens_per_s": null,
                "peak_kv_bytes": null, "kv_token_bytes": kv_token_bytes,
                "not_run": format!("quantized_llama keeps RoPE tables for {MAX_SEQ_LEN} positions"),
            }));
        }
    }
    let report = json!({ "new_tokens": new, "rows": rows, "ratios": ratios });
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/reports");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("real_model.json");
    std::fs::write(&file, serde_json::to_string_pretty(&report).unwrap()).unwrap();
    println!("wrote {}", file.display());
}
