//! The main job on the synthetic model: sized under a budget ([`Job::plan`]), then its
//! requests (half sharing three quarters of one prompt) decoded through the scheduler, with
//! a sample of the books each second for the caller to show, and a [`JobReport`] at the end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use procmem_actors::kv::{KvStoreConfig, KvStoreStats, PreemptMode, PrefixHost};
use procmem_actors::procmem::cuda::CudaDevice;
use procmem_actors::procmem::kv::{KvDtype, KvShape};
use procmem_actors::procmem::Place;
use procmem_actors::residency::{ResidencyConfig, ResidencyHandle, ResidencyStats};
use procmem_actors::{AuthorityBooks, MemoryManager, MemoryManagerBuilder};

use super::{Gpu, Model, Samples, Synthetic};
use crate::launch::{Budget, LaunchError};
use crate::scheduler::{
    Event, GenError, GenRequest, SchedulerConfig, SchedulerHandle, SchedulerStats, STEP_TOKENS,
};

/// The synthetic model's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Size {
    /// 4 layers, 8 query heads over 2 KV heads, head dimension 32.
    Small,
    /// 8 layers, 16 query heads over 4 KV heads, head dimension 64.
    Medium,
    /// An 8B-like attention shape: 32 layers, 32 query heads over 8 KV heads, head dimension
    /// 128 (residual width 512, to keep the synthetic projections small): for a GPU.
    Large,
}

impl Model {
    /// The model of `size`, each sequence holding `max_tokens`, its K in `k_dtype` and its V
    /// in `v_dtype`.
    pub fn of(size: Size, max_tokens: usize, k_dtype: KvDtype, v_dtype: KvDtype) -> Model {
        let (layers, q_heads, kv_heads, head_dim, hidden) = match size {
            Size::Small => (4, 8, 2, 32, 8 * 32),
            Size::Medium => (8, 16, 4, 64, 16 * 64),
            Size::Large => (32, 32, 8, 128, 512),
        };
        let shape = KvShape {
            layers,
            q_heads,
            kv_heads,
            head_dim,
            max_tokens,
            k_dtype,
            v_dtype,
        };
        Model {
            shape,
            hidden,
            vocab: 512,
        }
    }
}

/// The main job's workload and memory.
#[derive(Debug, Clone)]
pub struct JobConfig {
    /// The model's size.
    pub size: Size,
    /// The element type K is kept in.
    pub k_dtype: KvDtype,
    /// The element type V is kept in.
    pub v_dtype: KvDtype,
    /// Requests to serve.
    pub requests: usize,
    /// Requests decoded at once.
    pub concurrency: usize,
    /// Prompt tokens (half the requests share the first three quarters).
    pub prompt_len: usize,
    /// Tokens generated per request.
    pub max_new: usize,
    /// Seed of the weights and prompts.
    pub seed: u64,
    /// What preemption does.
    pub preempt: PreemptMode,
    /// The KV on the first GPU (the weights and projections stay on the host).
    pub cuda: bool,
    /// With `cuda`: page-locked host bytes that keep prompt blocks evicted from the device.
    pub prefix_host: Option<u64>,
    /// The budget of the KV's authority: the weights count as its base on the host.
    pub budget: Budget,
}

/// The job sized: its model, and what it takes.
pub struct Job {
    config: JobConfig,
    /// The model.
    pub model: Model,
    /// Bytes of weights (on the host, by the pages each layer takes).
    pub weights: u64,
    /// One sequence's KV at its longest.
    pub per_seq: u64,
    /// `per_seq` for every sequence running at once.
    pub peak_kv: u64,
    /// The KV authority's budget.
    pub budget: u64,
}

/// A sample of the job, taken each second while it runs.
#[derive(Debug, Clone, Default)]
pub struct JobProgress {
    /// Since the first request.
    pub elapsed: Duration,
    /// What the scheduler did so far.
    pub stats: SchedulerStats,
    /// Requests waiting.
    pub waiting: usize,
    /// The KV authority's bytes leased, by the ledger.
    pub leased: u64,
    /// The same, by the OS.
    pub os: u64,
    /// Pressure tickets sent so far.
    pub tickets: u64,
    /// Bytes the GPU's driver says are used (every process's), where the KV is on one.
    pub driver_used: Option<u64>,
}

/// What the job did.
pub struct JobReport {
    /// Requests finished.
    pub finished: u64,
    /// From the first request to the last answer.
    pub elapsed: Duration,
    /// What the scheduler did.
    pub stats: SchedulerStats,
    /// The KV store's figures.
    pub kv: KvStoreStats,
    /// Residency's figures.
    pub weights: ResidencyStats,
    /// What the per-step samples of the books found.
    pub samples: Samples,
    /// Every authority's books, once the frees of the last sequences landed.
    pub books: Vec<AuthorityBooks>,
    /// The KV's authority among `books`.
    pub kv_books: usize,
    /// The driver's free and total bytes at the end, where the KV is on a GPU.
    pub driver: Option<procmem_actors::procmem::cuda::DeviceMemory>,
}

impl Job {
    /// Sizes `config`'s model: refused where the budget cannot hold the weights (on the
    /// host) and one sequence, or where the GPU asked for is not there.
    pub fn plan(config: JobConfig) -> Result<Job, LaunchError> {
        if config.prefix_host.is_some() && !config.cuda {
            return Err(LaunchError::Usage(
                "--prefix-host-bytes is for --device cuda".into(),
            ));
        }
        if config.cuda && !procmem_actors::procmem::cuda::driver_present() {
            return Err(LaunchError::Usage(
                "--device cuda: no CUDA driver on this machine (libcuda cannot be loaded)".into(),
            ));
        }
        let max_tokens = config.prompt_len + config.max_new;
        let model = Model::of(config.size, max_tokens, config.k_dtype, config.v_dtype);
        let host_page = procmem_actors::procmem::granularity();
        // The KV's mapping granularity: a page on the host, the driver's VMM granule on a GPU.
        let page = match config.cuda {
            true => CudaDevice::open(0)
                .and_then(|d| d.granularity())
                .map_err(|e| LaunchError::Usage(format!("--device cuda: {e}")))?,
            false => host_page,
        };
        // The weights stay on the host (the synthetic model's projections run there).
        let layer = (model.layer_floats() as u64 * 4).next_multiple_of(host_page);
        let weights = model.shape.layers as u64 * layer;
        let (shape, tokens) = (model.shape, max_tokens);
        shape
            .validate(page)
            .map_err(|e| LaunchError::Usage(format!("--kv-dtype: {e}")))?;
        let per_seq = shape.mapped_bytes(tokens, page);
        let peak_kv = per_seq * config.concurrency as u64;
        // On a GPU the budget is the device's, which holds only KV; on the host it holds both.
        let base = if config.cuda { 0 } else { weights };
        let budget = config.budget.bytes(base, peak_kv)?;
        if budget > 0 && base + per_seq > budget {
            return Err(LaunchError::TooSmall {
                weights: base,
                per_seq,
                budget,
            });
        }
        Ok(Job {
            config,
            model,
            weights,
            per_seq,
            peak_kv,
            budget,
        })
    }

    /// The memory manager the job runs on: the budget on the host, or on the GPU with the
    /// host paying for the weights and for KV swapped out of the device.
    pub fn builder(&self) -> MemoryManagerBuilder {
        match self.config.cuda {
            true => {
                let host = self.weights + self.peak_kv + self.per_seq;
                MemoryManager::builder()
                    .host_budget(host + self.config.prefix_host.unwrap_or(0))
                    .cuda_device(0, self.budget)
            }
            false => MemoryManager::builder().host_budget(self.budget),
        }
    }

    /// Loads the weights (pinned: every layer is used on every step, so under pressure the
    /// KV store gives back instead) and opens the KV store on `memory`; `opened` is told of
    /// the store (a node link reports its blocks).
    async fn start(
        &self,
        memory: &MemoryManager,
    ) -> Result<(ResidencyHandle, procmem_actors::kv::KvStoreHandle), LaunchError> {
        let failed = |e: &dyn std::fmt::Display| LaunchError::Failed(e.to_string());
        let config = ResidencyConfig::new("weights").wait(Duration::from_secs(2));
        let weights = memory.residency(config).await.map_err(|e| failed(&e))?;
        for layer in 0..self.model.shape.layers {
            let bytes = self.model.weights(layer, self.config.seed);
            weights
                .load(layer, bytes, true)
                .await
                .map_err(|e| failed(&e))?;
        }
        let place = if self.config.cuda {
            Place::cuda(0)
        } else {
            Place::HOST
        };
        let mut config = KvStoreConfig::new("kv", self.model.shape)
            .preempt(self.config.preempt)
            .wait(Duration::from_millis(250))
            .map_ahead(true);
        if let Some(bytes) = self.config.prefix_host {
            config = config.prefix_host(PrefixHost::new(bytes));
        }
        let kv = memory
            .kv_store_on(place, config)
            .await
            .map_err(|e| failed(&e))?;
        Ok((weights, kv))
    }

    /// The prompts: every other request keeps the shared first three quarters of one prompt,
    /// the rest differ from the first token.
    fn prompts(&self) -> Vec<Vec<u32>> {
        let (len, seed, vocab) = (self.config.prompt_len, self.config.seed, self.model.vocab);
        let shared: Vec<u32> = (0..len as u32)
            .map(|i| (i * 7 + seed as u32) % vocab)
            .collect();
        (0..self.config.requests as u32)
            .map(|id| {
                let mut prompt = shared.clone();
                let own_from = if id % 2 == 0 { len * 3 / 4 } else { 0 };
                for (i, t) in prompt.iter_mut().enumerate().skip(own_from) {
                    *t = ((id + 3) * 31 + i as u32 * 13) % vocab;
                }
                prompt
            })
            .collect()
    }

    /// Runs the job on `memory` (from [`Job::builder`]): `opened` is told of the KV store once
    /// it exists, `progress` is called each second. Every request must finish.
    pub async fn run(
        self,
        memory: &MemoryManager,
        opened: impl FnOnce(&procmem_actors::kv::KvStoreHandle),
        progress: impl Fn(&JobProgress) + Send + 'static,
    ) -> Result<JobReport, LaunchError> {
        let (weights, kv) = self.start(memory).await?;
        opened(&kv);
        let kv_books = usize::from(self.config.cuda);
        // A step's rows: a token budget of prompt chunks, or one per running sequence.
        let gpu = match self.config.cuda {
            true => Some(Gpu::new(
                memory,
                self.model.shape,
                STEP_TOKENS.max(self.config.concurrency),
            )?),
            false => None,
        };
        let prompts = self.prompts();
        let synthetic = Arc::new(Synthetic {
            model: self.model,
            kv: kv.clone(),
            weights: weights.clone(),
            gpu,
            memory: memory.clone(),
            kv_books,
            samples: Default::default(),
        });
        let config = SchedulerConfig::new(synthetic.model.shape.max_tokens)
            .max_running(self.config.concurrency)
            .max_waiting(self.config.requests);
        let (scheduler, task) = SchedulerHandle::spawn(Arc::clone(&synthetic), config);
        let start = Instant::now();
        let sampler = tokio::spawn(sample_each_second(
            scheduler.clone(),
            Arc::clone(&synthetic),
            start,
            progress,
        ));
        let answered = submit_all(&scheduler, prompts, self.config.max_new, self.budget).await;
        sampler.abort();
        scheduler.shutdown(Duration::ZERO);
        let stats = task.await.map_err(|e| LaunchError::Failed(e.to_string()))?;
        let elapsed = start.elapsed();
        let finished = answered?;
        let driver = synthetic
            .gpu
            .as_ref()
            .and_then(|g| g.device.mem_info().ok());
        let samples = synthetic
            .samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        drop(synthetic);
        let failed = |e: &dyn std::fmt::Display| LaunchError::Failed(e.to_string());
        let kv_stats = kv.stats().await.map_err(|e| failed(&e))?;
        let w_stats = weights.stats().await.map_err(|e| failed(&e))?;
        Ok(JobReport {
            finished,
            elapsed,
            stats,
            kv: kv_stats,
            weights: w_stats,
            samples,
            books: settled_books(memory).await,
            kv_books,
            driver,
        })
    }
}

/// Submits every prompt and waits for every answer: the requests finished, or the first
/// failure (a budget that cannot hold one sequence says so).
async fn submit_all(
    scheduler: &SchedulerHandle,
    prompts: Vec<Vec<u32>>,
    max_new: usize,
    budget: u64,
) -> Result<u64, LaunchError> {
    let mut streams = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let request = GenRequest {
            prompt,
            max_tokens: max_new,
            ..GenRequest::default()
        };
        let generation = scheduler
            .submit(request)
            .map_err(|e| LaunchError::Failed(e.to_string()))?;
        streams.push(tokio::spawn(answer(generation, budget)));
    }
    let (mut finished, mut failure) = (0, None);
    for stream in streams {
        match stream
            .await
            .map_err(|e| LaunchError::Failed(e.to_string()))?
        {
            Ok(()) => finished += 1,
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    failure.map_or(Ok(finished), |e| Err(LaunchError::Failed(e)))
}

/// Reads one request's events to its end.
async fn answer(mut generation: crate::scheduler::Generation, budget: u64) -> Result<(), String> {
    while let Some(event) = generation.next().await {
        match event {
            Event::Token { .. } => {}
            Event::Finished { .. } => return Ok(()),
            Event::Failed(GenError::NoRoom(e)) => {
                return Err(format!(
                    "the budget of {budget} bytes cannot hold even one sequence beside the weights: {e}"
                ))
            }
            Event::Failed(e) => return Err(e.to_string()),
        }
    }
    Err("a request's stream ended without an answer".to_string())
}

/// A sample of the job each second, to `progress`.
async fn sample_each_second(
    scheduler: SchedulerHandle,
    synthetic: Arc<Synthetic>,
    start: Instant,
    progress: impl Fn(&JobProgress),
) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let books = synthetic.memory.books().await;
        let Some(b) = books.get(synthetic.kv_books) else {
            continue;
        };
        let driver_used = synthetic
            .gpu
            .as_ref()
            .and_then(|g| g.device.mem_info().ok())
            .map(|m| m.used());
        let (waiting, stats) = scheduler.books();
        progress(&JobProgress {
            elapsed: start.elapsed(),
            stats,
            waiting,
            leased: b.snapshot.books.leased,
            os: b.os_bytes.unwrap_or(0),
            tickets: b.snapshot.tickets_sent,
            driver_used,
        });
    }
}

/// The books once the frees of the last sequences closed have landed: memory a device is
/// done with is unmapped first and refunded after (a message to the Governor), so for a
/// moment the ledger is above what the OS holds. Waits up to 2 s for the two to agree.
async fn settled_books(memory: &MemoryManager) -> Vec<AuthorityBooks> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let books = memory.books().await;
        let agree = books
            .iter()
            .all(|b| b.os_bytes.is_none_or(|os| os == b.snapshot.books.leased));
        if agree || Instant::now() > deadline {
            return books;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
