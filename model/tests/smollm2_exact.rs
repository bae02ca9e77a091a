//! SmolLM2-135M-Instruct over the managed KV against candle-transformers' own
//! `quantized_llama` (its own KV cache, no part of this project), both with candle's
//! `CANDLE_DEQUANTIZE_ALL` on: the Q4_1 weights dequantized to f32 once, so each matmul is an
//! f32 matmul. Quantized, candle's CPU kernel rounds every activation row to 8 bits, and an
//! attention difference of 1e-7 (the order of floating-point additions, see `smollm2.rs`) can
//! flip a rounding and move a logit by tenths; in f32 it stays within 1e-3.

mod common;

use common::*;
use procmem_actors::kv::PreemptMode;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_tokens_equal_candles_own_quantized_llama() {
    // Before any matmul is made, on any thread (candle reads it once per thread).
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let Some((path, codec, prompts)) = tokenized() else {
        return;
    };
    let (mine, stats) = ours(None, PreemptMode::Swap, &prompts).await;
    let a = compare(&path, &codec, &prompts, &mine);
    for (i, at, ours, theirs) in &a.parted {
        eprintln!("prompt {i} parts at token {at}: ours top two {ours:?}, candle's {theirs:?}");
        assert!(
            ours.margin() <= 1e-3 && theirs.margin() <= 1e-3,
            "prompt {i} parts without a near-tie"
        );
    }
    let worst = a.first_step.iter().copied().fold(0f32, f32::max);
    eprintln!(
        "real_model_exact: {} of 8 prompts equal candle's {NEW_TOKENS} greedy tokens; first-step logits within {worst:e} relative; {stats:?}",
        8 - a.parted.len()
    );
    assert!(worst <= 1e-3, "first-step logits differ by {worst}");
    assert!(a.parted.len() <= 1, "{} prompts parted", a.parted.len());
    assert!(
        mine.iter().any(|c| c.cached_tokens > 0),
        "the shared system prompt was shared"
    );
}
