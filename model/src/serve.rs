//! Serving completions: requests decoded in batches over the managed KV, greedy, with the
//! KV store's preemptions answered (a swapped sequence is restored, a dropped one replays its
//! known tokens; greedy decoding makes either give the same completion).

use std::sync::Arc;

use procmem_actors::procmem::kv::KvShape;
use procmem_actors::{
    kv::{KvStep, KvStoreConfig, KvStoreHandle, SeqId},
    residency::{ResidencyConfig, ResidencyHandle},
    MemoryManager, Reserve,
};

use crate::error::ModelError;
use crate::scheduler::{Event, GenError, GenRequest, Generation, SchedulerConfig, SchedulerHandle};
use crate::smollm::{Loaded, Smol};
use crate::step::{StepFuture, StepInput, StepModel};

/// One prompt to complete.
#[derive(Debug, Clone)]
pub struct Request {
    /// Its sequence id (unique among live ones).
    pub id: SeqId,
    /// Prompt tokens.
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_new: usize,
}

/// A finished request.
#[derive(Debug, Clone, Default)]
pub struct Completion {
    /// Its id.
    pub id: SeqId,
    /// Generated tokens.
    pub tokens: Vec<u32>,
    /// The logits each generated token was chosen from (when asked for).
    pub logits: Vec<Vec<f32>>,
    /// Prompt tokens whose KV came from shared cached blocks at its first open.
    pub cached_tokens: usize,
    /// Times pressure preempted it.
    pub preempted: u32,
}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct RunStats {
    /// Decode steps.
    pub steps: u64,
    /// Tokens generated.
    pub generated: u64,
    /// Preemptions met.
    pub preemptions: u64,
    /// Restores (swapped back, or dropped and replayed).
    pub restores: u64,
    /// Requests shed (closed and started over) because a step did not fit.
    pub shed: u64,
    /// Layers residency offloaded under pressure, and reloaded.
    pub offloads: u64,
    /// Layers reloaded.
    pub reloads: u64,
    /// Steps of a lone sequence that did not get room by their deadline and were tried again.
    pub retries: u64,
}

/// A model served over one manager's KV store and residency.
pub struct Engine {
    /// The model.
    pub model: Arc<Smol>,
    /// Its layers.
    pub weights: ResidencyHandle,
    /// Its KV.
    pub kv: KvStoreHandle,
    /// The KV's shape.
    pub shape: KvShape,
    /// Generation stops at this token.
    pub eos: Option<u32>,
    /// Tokens one step takes at most, over all its sequences: each running sequence has at
    /// least one (its decode token, or the next of its prompt), and prompts being prefilled
    /// take chunks of what is left, oldest first. 1 runs prompts one token per step.
    pub step_tokens: usize,
    /// The books' reserve for a step's activations (sized for [`STEP_TOKENS`] new tokens and
    /// [`SCRATCH_LOGIT_ROWS`] rows of logits): released with the engine.
    pub scratch: Reserve,
}

/// Rows of logits the engine's scratch reserve holds: a step's sequences (each reads its last
/// row) up to this many; [`forward_every_row`](crate::smollm::forward_every_row) over longer
/// chunks takes more than the reserve.
pub const SCRATCH_LOGIT_ROWS: usize = 16;

/// The default of [`Engine::step_tokens`]: the scheduler's.
pub use crate::scheduler::STEP_TOKENS;

impl Engine {
    /// Puts `loaded`'s layers and head under residency (offloadable: each a unit, priority 10)
    /// and opens a KV store of `kv_config` on `memory`. The configuration's shape is the
    /// model's ([`Smol::kv_shape`] in the types and length it chooses): another is refused
    /// (`ModelError::KvShape`) before anything is loaded.
    pub async fn start(
        memory: &MemoryManager,
        loaded: Loaded,
        kv_config: KvStoreConfig,
        eos: Option<u32>,
    ) -> Result<Self, ModelError> {
        let config = kv_config.shape;
        let shape = loaded
            .model
            .kv_shape(config.k_dtype, config.v_dtype, config.max_tokens);
        if shape != config {
            return Err(ModelError::KvShape {
                model: shape,
                config,
            });
        }
        let weights = memory.residency(ResidencyConfig::new("weights")).await?;
        for (layer, bytes) in loaded.layers.into_iter().enumerate() {
            weights.load(layer, bytes, false).await?;
        }
        // The embeddings, final norm and output head: one more unit, offloadable like a layer
        // (every step reads it first and last, so pressure finds it the most recently used).
        weights
            .load(loaded.model.head_unit(), loaded.head, false)
            .await?;
        // What the load read and freed goes back to the kernel: the weights are residency's now.
        procmem_actors::procmem::host::heap::trim();
        // The activations of the widest step the engine runs, in the books: the heap they come
        // from is the process's, not a holder's.
        let scratch = memory
            .reserve("step scratch", Engine::scratch_bytes(&loaded.model))
            .await?;
        let kv = memory.kv_store(kv_config).await?;
        Ok(Engine {
            model: loaded.model,
            weights,
            kv,
            shape,
            eos,
            step_tokens: STEP_TOKENS,
            scratch,
        })
    }

    /// The reserve an engine of `model` takes for a step's activations: a prompt chunk of
    /// [`STEP_TOKENS`] rows with [`SCRATCH_LOGIT_ROWS`] rows of logits
    /// ([`Smol::step_scratch_bytes`]). A budget sized by hand adds it beside the weights.
    pub fn scratch_bytes(model: &Smol) -> u64 {
        model.step_scratch_bytes(STEP_TOKENS, SCRATCH_LOGIT_ROWS)
    }

    /// Greedy completions of `requests`, at most `concurrency` running at once, through the
    /// library's scheduler ([`crate::scheduler`]): prompts in chunks of `step_tokens`, the
    /// KV store's pressure answered there. Generation stops at `max_new` tokens or after the
    /// engine's `eos`.
    pub async fn generate(
        &self,
        requests: Vec<Request>,
        concurrency: usize,
        keep_logits: bool,
    ) -> Result<(Vec<Completion>, RunStats), ModelError> {
        if let Some(r) = requests.iter().find(|r| r.prompt.is_empty()) {
            return Err(ModelError::EmptyPrompt(r.id));
        }
        let config = SchedulerConfig::new(self.shape.max_tokens)
            .step_tokens(self.step_tokens)
            .max_running(concurrency)
            .max_waiting(usize::MAX);
        let (handle, run) = SchedulerHandle::local(self, config);
        let mut streams = Vec::with_capacity(requests.len());
        for r in &requests {
            let request = GenRequest {
                prompt: r.prompt.clone(),
                max_tokens: r.max_new,
                stop_tokens: self.eos.into_iter().collect(),
                keep_logits,
                ..GenRequest::default()
            };
            streams.push((r.id, handle.submit(request).map_err(model_error)?));
        }
        // With every request in, the loop ends once they are done.
        drop(handle);
        // Every stream is read as its events come (a stream left unread falls behind and is
        // cut), each on a task of its own.
        let readers: Vec<_> = streams
            .into_iter()
            .map(|(id, stream)| tokio::spawn(read_completion(id, stream)))
            .collect();
        let collect = async {
            let mut done = Vec::with_capacity(readers.len());
            for reader in readers {
                // A reader that could not finish (its task panicked) reads as a stream cut.
                let read = reader.await.unwrap_or(Err(GenError::Stopped));
                done.push(read.map_err(model_error)?);
            }
            Ok::<_, ModelError>(done)
        };
        let (s, done) = tokio::join!(run, collect);
        let mut finished = done?;
        finished.sort_by_key(|c| c.id);
        let mut stats = RunStats {
            steps: s.steps,
            generated: s.generated,
            preemptions: s.preemptions,
            restores: s.restores,
            shed: s.shed,
            retries: s.retries,
            ..RunStats::default()
        };
        if let Ok(w) = self.weights.stats().await {
            stats.offloads = w.offloads;
            stats.reloads = w.reloads;
        }
        Ok((finished, stats))
    }
}

impl StepModel for Engine {
    fn kv(&self) -> &KvStoreHandle {
        &self.kv
    }

    fn step<'a>(&'a self, step: &'a KvStep, batch: &'a [StepInput]) -> StepFuture<'a> {
        Box::pin(crate::smollm::forward(
            &self.model,
            &self.weights,
            step,
            self.shape,
            batch,
            false,
        ))
    }
}

/// A scheduler's error as the engine's.
fn model_error(e: GenError) -> ModelError {
    match e {
        GenError::Model(m) => Arc::try_unwrap(m)
            .unwrap_or_else(|m| ModelError::Scheduler(Box::new(GenError::Model(m)))),
        GenError::NoRoom(kv) => ModelError::Prepare(kv),
        other => ModelError::Scheduler(Box::new(other)),
    }
}

/// Request `id`'s tokens (and logits, where kept) from its stream, to its end.
async fn read_completion(id: u64, mut stream: Generation) -> Result<Completion, GenError> {
    let mut c = Completion {
        id,
        ..Completion::default()
    };
    while let Some(event) = stream.next().await {
        match event {
            Event::Token { token, logits, .. } => {
                c.tokens.push(token);
                c.logits.extend(logits);
            }
            Event::Finished { figures, .. } => {
                c.cached_tokens = figures.cached_tokens;
                c.preempted = figures.preemptions;
            }
            Event::Failed(e) => return Err(e),
        }
    }
    Ok(c)
}
