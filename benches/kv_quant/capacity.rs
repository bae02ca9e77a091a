//! How many sequences a KV store holds in the same bytes, `f16` against `q8_0`, free of any
//! scheduling policy: a store of SmolLM2's shape under a budget opens sequences one at a
//! time, each filled with `tokens` rows (distinct prompts, nothing shared, the rows written
//! and quantized as a step writes them), until it refuses one or preempts an older one to
//! make room. The sequences it holds then, the bytes its ledger leased and the bytes the
//! process really holds for them (`os_resident_bytes`).
//!
//! The budget is the KV share of the serving bench's `0.25x` f16 row (issue 48 names that
//! row): 32 conversations of at most 1,280 tokens need 943,718,400 bytes of f16 KV at once; a
//! quarter is 235,929,600 (the row's 302,530,560 less the 66,600,960 of the weights).
//! `PROCMEM_QUANT_CAPACITY_BYTES` sets another.

use std::time::Duration;

use procmem_actors::kv::{KvStoreConfig, NewTokens, StepEnd};
use procmem_actors::procmem::kv::{KvDtype, KvShape};
use procmem_actors::MemoryManager;
use procmem_model::launch::CHUNK_GRANULES;
use serde_json::{json, Value};

/// The host's page: the store's granule.
const PAGE: u64 = 4096;

/// The KV share of the serving bench's `0.25x` f16 row.
const BYTES: u64 = 235_929_600;

/// Lengths of the sequences held: the serving workload's conversations reach 1,280 tokens.
const TOKENS: [usize; 4] = [256, 512, 1_280, 2_048];

/// What one store held: sequences, the ledger's bytes, the OS's.
struct Held {
    sequences: usize,
    leased: u64,
    os: u64,
}

/// Sequences of `tokens` rows that a store of `shape` holds in `bytes`.
async fn held_in(shape: KvShape, bytes: u64, tokens: usize) -> Held {
    let memory = MemoryManager::builder()
        .host_budget(bytes)
        .build()
        .await
        .unwrap();
    // The server's growth step; a grant that finds no room is refused after a short wait
    // (no other holder here could give any back).
    let config = KvStoreConfig::new("kv", shape)
        .chunk_granules(CHUNK_GRANULES)
        .wait(Duration::from_millis(200));
    let kv = memory.kv_store(config).await.unwrap();
    let mut sequences = 0usize;
    loop {
        let seq = sequences as u64;
        // Token ids of its own: no block is another sequence's.
        let prompt: Vec<u32> = (0..tokens as u32)
            .map(|t| {
                t.wrapping_mul(31)
                    .wrapping_add((seq as u32).wrapping_mul(7_919))
            })
            .collect();
        if kv.open(seq, prompt, 0).await.is_err() {
            break;
        }
        let Ok(step) = kv
            .prepare_tokens(vec![NewTokens { seq, count: tokens }])
            .await
        else {
            break;
        };
        step.submit(move |kv| {
            let elems = shape.token_elems() * tokens;
            let rows: Vec<f32> = (0..elems)
                .map(|i| ((i % 97) as f32 - 48.0) / 16.0)
                .collect();
            for layer in 0..shape.layers {
                kv.write_rows_f32(0, layer, 0, &rows, &rows).unwrap();
            }
        })
        .unwrap();
        step.complete(StepEnd::Submitted).await.unwrap();
        sequences += 1;
        // The store makes room for a newcomer by preempting an older sequence: the first
        // one preempted is as much a refusal as a refused grant.
        if kv.stats().await.unwrap().preemptions > 0 {
            break;
        }
    }
    let s = kv.stats().await.unwrap();
    drop(kv);
    memory.shutdown().await.unwrap();
    Held {
        sequences: s.sequences - s.preempted,
        leased: s.leased_bytes,
        os: s.os_resident_bytes,
    }
}

/// Per length, `f16` and `q8_0` (K and V) side by side in the same bytes.
pub fn measure(f16: KvShape) -> Value {
    let bytes = std::env::var("PROCMEM_QUANT_CAPACITY_BYTES")
        .ok()
        .map(|b| b.parse().expect("PROCMEM_QUANT_CAPACITY_BYTES: bytes"))
        .unwrap_or(BYTES);
    let q8 = f16.with_dtype(KvDtype::Q8_0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!("capacity: sequences held in {bytes} bytes until the store refuses one");
    let rows: Vec<Value> = TOKENS
        .iter()
        .map(|&tokens| {
            let (a, b) = rt.block_on(async {
                let f16 = KvShape { max_tokens: tokens, ..f16 };
                let q8 = KvShape { max_tokens: tokens, ..q8 };
                (held_in(f16, bytes, tokens).await, held_in(q8, bytes, tokens).await)
            });
            let ratio = b.sequences as f64 / a.sequences.max(1) as f64;
            // What the bytes allow: a sequence maps its rows a growth step at a time.
            let chunk = PAGE * CHUNK_GRANULES;
            let mapped = [f16.mapped_bytes(tokens, chunk), q8.mapped_bytes(tokens, chunk)];
            println!(
                "  {tokens:>5} tokens: f16 {:>3} (leased {:>9}, os {:>9})  q8_0 {:>3} (leased {:>9}, os {:>9})  {ratio:.3}x",
                a.sequences, a.leased, a.os, b.sequences, b.leased, b.os
            );
            json!({
                "tokens": tokens,
                "held": [a.sequences, b.sequences],
                "q8_0_over_f16": ratio,
                "mapped_bytes_per_sequence": mapped,
                "bytes_allow": [bytes / mapped[0], bytes / mapped[1]],
                "leased_bytes": [a.leased, b.leased],
                "os_resident_bytes": [a.os, b.os],
            })
        })
        .collect();
    let token_bytes = |s: &KvShape| s.token_bytes_all() as f64;
    json!({
        "budget_bytes": bytes,
        "configs": ["f16", "q8_0"],
        "rows": rows,
        // A token's bytes in f16 over q8_0's (the spare bytes of grouped pages not counted).
        "token_bytes_ratio": token_bytes(&f16) / token_bytes(&q8),
    })
}
