//! Serving completions: requests decoded in batches over the managed KV, greedy, with the
//! KV store's preemptions answered (a swapped sequence is restored, a dropped one replays its
//! known tokens; greedy decoding makes either give the same completion).

use std::collections::VecDeque;
use std::sync::Arc;

use procmem_actors::procmem::kv::KvShape;
use procmem_actors::{
    GovernorError, KvStoreConfig, KvStoreError, KvStoreHandle, MemoryManager, ResidencyConfig,
    ResidencyHandle, Restored, SeqId,
};

use crate::smollm::{argmax, forward_step, Loaded, Smol, StepInput};
use crate::ModelError;

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

/// Times in a row a lone sequence's step is tried again after its deadline passed without
/// room, before the run fails with that error (the budget cannot hold it).
const LONELY_RETRIES: u32 = 3;

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
}

/// The default of [`Engine::step_tokens`].
pub const STEP_TOKENS: usize = 256;

struct Live {
    req: Request,
    completion: Completion,
    /// Prompt and generated tokens.
    known: Vec<u32>,
    /// Tokens whose KV the store holds.
    pos: usize,
    opened: bool,
}

impl Live {
    fn done(&self, eos: Option<u32>) -> bool {
        self.completion.tokens.len() >= self.req.max_new
            || (eos.is_some() && self.completion.tokens.last().copied() == eos)
    }
}

impl Engine {
    /// Puts `loaded`'s layers under residency (offloadable: each layer a unit, priority 10)
    /// and opens a KV store of `kv_config` (its shape set from the model) on `memory`.
    pub async fn start(
        memory: &MemoryManager,
        loaded: Loaded,
        mut kv_config: KvStoreConfig,
        eos: Option<u32>,
    ) -> Result<Self, ModelError> {
        let shape = loaded
            .model
            .kv_shape(kv_config.shape.dtype, kv_config.shape.max_tokens);
        kv_config.shape = shape;
        let weights = memory
            .residency(ResidencyConfig {
                name: "weights".into(),
                priority: 10,
                wait: std::time::Duration::from_secs(5),
            })
            .await
            .map_err(|e| ModelError::Weights(e.to_string()))?;
        for (layer, bytes) in loaded.layers.into_iter().enumerate() {
            weights
                .load(layer, bytes, false)
                .await
                .map_err(|e| ModelError::Weights(e.to_string()))?;
        }
        let kv = memory
            .kv_store(kv_config)
            .await
            .map_err(|e| ModelError::Store(e.to_string()))?;
        Ok(Engine {
            model: loaded.model,
            weights,
            kv,
            shape,
            eos,
            step_tokens: STEP_TOKENS,
        })
    }

    /// The step's inputs for `active`: every sequence's next token, and as many more of the
    /// prompts still being prefilled as the step's budget has room for, first come first.
    fn plan_step(&self, active: &[Live]) -> Vec<StepInput> {
        let mut spare = self.step_tokens.saturating_sub(active.len());
        active
            .iter()
            .map(|r| {
                let left = r.known.len() - r.pos;
                let more = (left - 1).min(spare);
                spare -= more;
                StepInput {
                    seq: r.req.id,
                    tokens: r.known[r.pos..r.pos + 1 + more].to_vec(),
                    position: r.pos,
                }
            })
            .collect()
    }

    /// Greedy completions of `requests`, `concurrency` decoded at once.
    pub async fn generate(
        &self,
        requests: Vec<Request>,
        concurrency: usize,
        keep_logits: bool,
    ) -> Result<(Vec<Completion>, RunStats), ModelError> {
        if let Some(r) = requests.iter().find(|r| r.prompt.is_empty()) {
            return Err(ModelError::EmptyPrompt(r.id));
        }
        let mut waiting: VecDeque<Live> = requests
            .into_iter()
            .map(|req| Live {
                completion: Completion {
                    id: req.id,
                    ..Completion::default()
                },
                known: req.prompt.clone(),
                req,
                pos: 0,
                opened: false,
            })
            .collect();
        let mut active: Vec<Live> = Vec::new();
        let mut parked: VecDeque<Live> = VecDeque::new();
        let mut finished = Vec::new();
        let mut stats = RunStats::default();
        // Under pressure the batch shrinks (a preemption sets it to what is left running) and
        // grows back by one every 16 steps that went through: restores that preempt each
        // other in turn would otherwise make no progress.
        let most = concurrency.max(1);
        let mut limit = most;
        let mut calm = 0u32;
        // Steps of a lone sequence refused in a row.
        let mut lonely = 0u32;
        // A restore refused while others ran waits until one of them finishes: the room it
        // needs is theirs, and asking again at every step would wait out a deadline each time.
        let mut restore_blocked = false;
        while !(waiting.is_empty() && active.is_empty() && parked.is_empty()) {
            if active.is_empty() {
                restore_blocked = false;
            }
            // Preempted sequences come back first, oldest first.
            while active.len() < limit && !restore_blocked {
                let Some(mut r) = parked.pop_front() else {
                    break;
                };
                match self.kv.restore(r.req.id).await {
                    Ok(Restored::Swapped { tokens }) => r.pos = tokens,
                    Ok(Restored::Recompute { .. }) => r.pos = 0,
                    Err(KvStoreError::Unavailable) => {
                        return Err(ModelError::Store("the KV store stopped".into()))
                    }
                    Err(_) if !active.is_empty() => {
                        parked.push_front(r);
                        restore_blocked = true;
                        break;
                    }
                    Err(e) => return Err(ModelError::Store(e.to_string())),
                }
                stats.restores += 1;
                active.push(r);
            }
            while active.len() < limit && parked.is_empty() {
                let Some(mut r) = waiting.pop_front() else {
                    break;
                };
                let opened = self
                    .kv
                    .open(r.req.id, r.known.clone(), 0)
                    .await
                    .map_err(|e| ModelError::Store(e.to_string()))?;
                if !r.opened {
                    r.completion.cached_tokens = opened.cached_tokens;
                }
                r.opened = true;
                // The store's position rule (`Opened`): fewer than the prompt's tokens.
                r.pos = opened.cached_tokens;
                active.push(r);
            }
            if active.is_empty() {
                continue;
            }
            let inputs = self.plan_step(&active);
            match forward_step(&self.model, &self.weights, &self.kv, self.shape, &inputs).await {
                Ok(logits) => {
                    stats.steps += 1;
                    lonely = 0;
                    calm += 1;
                    if calm >= 16 && limit < most {
                        limit += 1;
                        calm = 0;
                    }
                    for ((r, l), input) in active.iter_mut().zip(logits).zip(&inputs) {
                        r.pos += input.tokens.len();
                        if r.pos == r.known.len() {
                            let t = argmax(&l);
                            r.known.push(t);
                            r.completion.tokens.push(t);
                            if keep_logits {
                                r.completion.logits.push(l);
                            }
                            stats.generated += 1;
                        }
                    }
                    let (done, going): (Vec<_>, Vec<_>) =
                        active.drain(..).partition(|r| r.done(self.eos));
                    active = going;
                    for r in done {
                        restore_blocked = false;
                        self.kv.close(r.req.id);
                        finished.push(r.completion);
                    }
                }
                Err(ModelError::Prepare(KvStoreError::Preempted(seq, _))) => {
                    stats.preemptions += 1;
                    limit = (active.len() - 1).max(1);
                    calm = 0;
                    if let Some(i) = active.iter().position(|r| r.req.id == seq) {
                        let mut r = active.remove(i);
                        r.completion.preempted += 1;
                        parked.push_back(r);
                    }
                }
                Err(ModelError::Prepare(KvStoreError::Governor(
                    GovernorError::DeadlineExpired(_) | GovernorError::Ledger(_),
                ))) if active.len() > 1 => {
                    // The batch does not fit: the newest request starts over later.
                    limit = (active.len() - 1).max(1);
                    calm = 0;
                    let mut r = active.pop().expect("more than one");
                    self.kv.close(r.req.id);
                    r.pos = 0;
                    stats.shed += 1;
                    waiting.push_front(r);
                }
                Err(ModelError::Prepare(KvStoreError::Governor(
                    GovernorError::DeadlineExpired(_),
                ))) if lonely < LONELY_RETRIES => {
                    // One sequence alone did not get room by its deadline: holders may still
                    // be freeing (a swap's copy, a fence), so it tries again, a few times.
                    lonely += 1;
                    stats.retries += 1;
                }
                Err(e) => return Err(e),
            }
        }
        finished.sort_by_key(|c| c.id);
        if let Ok(w) = self.weights.stats().await {
            stats.offloads = w.offloads;
            stats.reloads = w.reloads;
        }
        Ok((finished, stats))
    }
}
