//! Every error of the crate: why the model could not be loaded or run, how a step's work
//! failed to hold together, why a GGUF, a tokenizer or a request was refused. Each is
//! exported where its callers meet it (`gguf::GgufError`, `tokenizer::TokenizerError`,
//! `scheduler::GenError`, the root's `ModelError` and `StepFault`).

use std::sync::Arc;

use procmem_actors::kv::KvStoreError;

/// Arrays inside arrays a GGUF may nest, at most (llama files use none).
pub const MAX_NESTING: u32 = 4;
/// The largest `general.alignment` a GGUF may ask for.
pub const MAX_ALIGNMENT: u64 = 1 << 16;

/// Why the model could not be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file is not a GGUF this loader reads, or one it refuses.
    #[error("model file: {0}")]
    Gguf(#[from] GgufError),
    /// The tokenizer's vocabulary or merges, or a text it was given, are not usable.
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
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
    Scheduler(#[source] Box<GenError>),
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

/// Why a GGUF was refused. Each names the field and the value that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS's error.
        #[source]
        source: std::io::Error,
    },
    /// Not a GGUF at all.
    #[error("not a GGUF file (magic {0:02x?})")]
    Magic([u8; 4]),
    /// A GGUF version this reader does not take (2 and 3 are read).
    #[error("GGUF version {0} is not supported (2 and 3 are)")]
    Version(u32),
    /// A field runs past the end of the file.
    #[error("{what} at byte {at} needs {need} bytes; the file has {left} left")]
    Truncated {
        /// The field.
        what: &'static str,
        /// Where it starts.
        at: u64,
        /// Bytes it claims.
        need: u64,
        /// Bytes left in the file.
        left: u64,
    },
    /// A count, length or value beyond what this loader takes.
    #[error("{what} is {value}: more than the {limit} this loader takes")]
    TooLarge {
        /// The field.
        what: String,
        /// Its value.
        value: u64,
        /// The largest taken.
        limit: u64,
    },
    /// A value that must be positive is not (a dimension, a count, an epsilon).
    #[error("{what} is {value}: it must be positive")]
    NotPositive {
        /// The field.
        what: String,
        /// Its value, as written.
        value: String,
    },
    /// Arrays nested deeper than [`MAX_NESTING`].
    #[error("arrays nested more than {MAX_NESTING} deep at byte {at}")]
    Nesting {
        /// Where the innermost began.
        at: u64,
    },
    /// A metadata value type the format does not define.
    #[error("metadata value type {code} at byte {at} is not a GGUF type")]
    ValueType {
        /// The type code.
        code: u32,
        /// Where it was read.
        at: u64,
    },
    /// A key or a tensor name given twice.
    #[error("{0:?} appears twice")]
    Duplicate(String),
    /// `general.alignment` is zero, not a power of two, or too large.
    #[error("general.alignment {0} is not a power of two up to {MAX_ALIGNMENT}")]
    Alignment(u64),
    /// A tensor type this loader does not know.
    #[error("tensor {tensor}: ggml type {code} is not supported")]
    Dtype {
        /// The tensor.
        tensor: String,
        /// Its type code.
        code: u32,
    },
    /// A tensor's shape the model cannot hold.
    #[error("tensor {tensor}: {why}")]
    Tensor {
        /// The tensor.
        tensor: String,
        /// What is wrong.
        why: String,
    },
    /// A tensor's bytes do not lie inside the file.
    #[error("tensor {tensor}: {bytes} bytes at offset {offset} past the data start {data} run past the file's {file} bytes")]
    TensorRange {
        /// The tensor.
        tensor: String,
        /// Its offset from the data section.
        offset: u64,
        /// Its size.
        bytes: u64,
        /// Where the data section starts.
        data: u64,
        /// The file's length.
        file: u64,
    },
    /// A metadata key or tensor the model needs is missing.
    #[error("no {0} in the file")]
    Missing(String),
    /// A metadata value of another type than the key needs.
    #[error("{key}: expected {expected}")]
    Type {
        /// The key.
        key: String,
        /// What it should hold.
        expected: &'static str,
    },
    /// Hyper-parameters that contradict each other or the tensors.
    #[error("{0}")]
    Inconsistent(String),
    /// Another architecture than llama.
    #[error("architecture {0:?}: only llama is supported")]
    Architecture(String),
}

/// Why the tokenizer could not be built, or could not take a text.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A merge in the GGUF is not two tokens separated by a space.
    #[error("merge {0:?} is not two tokens")]
    Merge(String),
    /// The vocabulary and merges do not make a BPE.
    #[error("BPE: {0}")]
    Build(#[source] tokenizers::Error),
    /// A text could not be encoded.
    #[error("encode: {0}")]
    Encode(#[source] tokenizers::Error),
    /// Token ids could not be decoded.
    #[error("decode: {0}")]
    Decode(#[source] tokenizers::Error),
    /// A chat message of a role the template does not know.
    #[error("a message of role {0:?}")]
    Role(String),
    /// The vocabulary lacks a control token the chat template needs.
    #[error("the vocabulary has no {0} token: no chat template")]
    NoTemplate(&'static str),
}

/// Why a request was refused or failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GenError {
    /// A request with no prompt token.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` of 0.
    #[error("max_tokens must be at least 1")]
    NoTokens,
    /// The prompt leaves no room for a token in the context.
    #[error("the prompt has {prompt} tokens: the context holds {context}")]
    TooLong {
        /// Prompt tokens.
        prompt: usize,
        /// The context per sequence.
        context: usize,
    },
    /// A sampling setting out of range.
    #[error("{0}")]
    BadSampling(&'static str),
    /// More requests wait than the scheduler takes.
    #[error("{waiting} requests are waiting already")]
    QueueFull {
        /// Requests waiting.
        waiting: usize,
    },
    /// The scheduler is shutting down or gone.
    #[error("the scheduler is not taking requests")]
    Stopped,
    /// It was still running when the shutdown's grace period ended.
    #[error("cancelled at shutdown")]
    Cancelled,
    /// Its caller stopped reading: `behind` events waited unread, and it was cut.
    #[error("cut: the caller left {behind} events unread")]
    SlowReader {
        /// Events unread when it was cut.
        behind: usize,
    },
    /// The memory could not hold it, even alone.
    #[error("no room: {0}")]
    NoRoom(#[source] KvStoreError),
    /// The model or the KV store failed: every request of the step gets the same error.
    #[error(transparent)]
    Model(Arc<ModelError>),
}
