//! Continuous batching over the managed KV, once, for every server: requests come in through a
//! [`SchedulerHandle`], each step mixes every running sequence's next token with chunks of the
//! prompts being prefilled (a token budget per step), and each request's tokens go out on its
//! own channel as they are chosen.
//!
//! Memory decides how many run: a request is admitted when the KV store opens it (the
//! Governor grants its prompt blocks), and runs until pressure preempts it. A preempted
//! request is parked and restored oldest first before anything new is admitted (swapped back,
//! or dropped and replayed in chunks); a step that does not fit in time sheds its newest
//! request, which starts over from its known tokens; a lone request that finds no room (to
//! open, to restore or to step) is tried again for up to 5 seconds
//! ([`SchedulerConfig::lonely_for`]; holders may still be freeing) and then fails with
//! `GenError::NoRoom`, at once where the bytes it asks exceed the whole budget. A request whose caller dropped its stream is closed at the next step,
//! and its memory comes back.
//! Shutdown stops taking requests, lets those in flight finish within a grace period and
//! cancels the rest.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use procmem_actors::kv::SeqId;
use tokio::sync::mpsc;

mod policy;
mod run;
mod sample;
mod types;

pub use sample::{adjust, logprobs};
pub use sample::{argmax, sample};
pub use types::{
    Event, Figures, FinishReason, GenRequest, Penalties, Sampling, SchedulerStats, TokenLogprobs,
    MAX_TOP_LOGPROBS,
};

pub use crate::error::GenError;
use crate::step::StepModel;

/// Text of tokens, for stop strings.
pub type Detokenize = Arc<dyn Fn(&[u32]) -> String + Send + Sync>;

/// How a scheduler runs.
#[derive(Clone)]
#[non_exhaustive]
pub struct SchedulerConfig {
    /// Tokens one step takes at most, over all its sequences: each running sequence has at
    /// least one, and prompts being prefilled take chunks of what is left, oldest first.
    pub step_tokens: usize,
    /// Requests running at once at most (memory usually says fewer first).
    pub max_running: usize,
    /// Requests waiting to start at most; more are refused with [`GenError::QueueFull`].
    pub max_waiting: usize,
    /// Tokens of one sequence (prompt and completion) the KV store holds.
    pub context: usize,
    /// Text of tokens, for stop strings (without it, stop strings are refused).
    pub detokenize: Option<Detokenize>,
    /// How long, in all, a request running alone is tried again while it finds no room,
    /// before it fails: the budget cannot hold it (holders may still be freeing meanwhile: a
    /// swap's copy, a fence behind a busy stream).
    pub lonely_for: Duration,
    /// Events a request's stream holds unread at most: a caller that falls this far behind
    /// (it stopped reading) is cut with [`GenError::SlowReader`] and its sequence closed. The
    /// step never waits for a reader.
    pub stream_buffer: usize,
}

impl std::fmt::Debug for SchedulerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulerConfig")
            .field("step_tokens", &self.step_tokens)
            .field("max_running", &self.max_running)
            .field("max_waiting", &self.max_waiting)
            .field("context", &self.context)
            .field("lonely_for", &self.lonely_for)
            .field("stream_buffer", &self.stream_buffer)
            .finish()
    }
}

/// The default token budget of a step ([`SchedulerConfig::step_tokens`]).
pub const STEP_TOKENS: usize = 256;

/// The default events a request's stream holds unread ([`SchedulerConfig::stream_buffer`]).
pub const STREAM_BUFFER: usize = 256;

impl SchedulerConfig {
    /// Defaults for a context of `context` tokens: [`STEP_TOKENS`] tokens a step, 64
    /// running, 256 waiting, no detokenizer, a lone request tried again for 5 s,
    /// [`STREAM_BUFFER`] events unread.
    pub fn new(context: usize) -> Self {
        SchedulerConfig {
            step_tokens: STEP_TOKENS,
            max_running: 64,
            max_waiting: 256,
            context,
            detokenize: None,
            lonely_for: policy::LONELY_FOR,
            stream_buffer: STREAM_BUFFER,
        }
    }

    /// Events a request's stream holds unread before its caller is cut (at least 2: a
    /// token and the end).
    pub fn stream_buffer(mut self, events: usize) -> Self {
        self.stream_buffer = events.max(2);
        self
    }

    /// The token budget of a step (at least 1).
    pub fn step_tokens(mut self, n: usize) -> Self {
        self.step_tokens = n.max(1);
        self
    }

    /// Requests running at once at most (at least 1).
    pub fn max_running(mut self, n: usize) -> Self {
        self.max_running = n.max(1);
        self
    }

    /// Requests waiting at most.
    pub fn max_waiting(mut self, n: usize) -> Self {
        self.max_waiting = n;
        self
    }

    /// The detokenizer for stop strings.
    pub fn detokenize(mut self, f: Detokenize) -> Self {
        self.detokenize = Some(f);
        self
    }

    /// How long a request running alone is tried again while it finds no room.
    pub fn lonely_for(mut self, patience: Duration) -> Self {
        self.lonely_for = patience;
        self
    }
}

/// A request's stream: its tokens, then how it ended. Dropping it cancels the request.
#[derive(Debug)]
pub struct Generation {
    events: mpsc::Receiver<Event>,
}

impl Generation {
    /// The next event; `None` once the stream ended (after `Finished` or `Failed`).
    pub async fn next(&mut self) -> Option<Event> {
        self.events.recv().await
    }
}

enum Command {
    Submit(Box<run::Queued>),
    Drain(Duration),
}

/// Where requests go in; cheap to clone.
#[derive(Clone)]
pub struct SchedulerHandle {
    tx: mpsc::UnboundedSender<Command>,
    shared: Arc<Shared>,
}

/// What the loop and the handles both see.
struct Shared {
    config: SchedulerConfig,
    /// The queue's length and the counts, under one lock: a reader never sees a request
    /// gone from the queue and not yet counted where it went.
    books: Mutex<Books>,
    /// Set by [`SchedulerHandle::shutdown`] before its command is sent: a request submitted
    /// after it is refused at once, not taken by a loop that is stopping.
    stopping: std::sync::atomic::AtomicBool,
}

/// Requests waiting to start, and what the loop did so far.
#[derive(Default)]
struct Books {
    waiting: usize,
    stats: SchedulerStats,
}

impl Shared {
    fn books(&self) -> std::sync::MutexGuard<'_, Books> {
        self.books.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl SchedulerHandle {
    /// Starts a scheduler over `model` on the current tokio runtime. The task ends after
    /// [`SchedulerHandle::shutdown`], or once every handle is dropped and nothing is left.
    pub fn spawn<M: StepModel>(
        model: Arc<M>,
        config: SchedulerConfig,
    ) -> (Self, tokio::task::JoinHandle<SchedulerStats>) {
        let (handle, rx) = Self::new(config);
        let shared = Arc::clone(&handle.shared);
        let task = tokio::spawn(async move { run::Loop::new(&*model, shared, rx).run().await });
        (handle, task)
    }

    /// A handle and the loop over `model` as a future of its own, for a caller that holds
    /// the model by reference and drives both itself.
    pub fn local<'m, M: StepModel>(
        model: &'m M,
        config: SchedulerConfig,
    ) -> (Self, impl Future<Output = SchedulerStats> + 'm) {
        let (handle, rx) = Self::new(config);
        let shared = Arc::clone(&handle.shared);
        (handle, run::Loop::new(model, shared, rx).run())
    }

    fn new(config: SchedulerConfig) -> (Self, mpsc::UnboundedReceiver<Command>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            config,
            books: Mutex::new(Books::default()),
            stopping: std::sync::atomic::AtomicBool::new(false),
        });
        (SchedulerHandle { tx, shared }, rx)
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &SchedulerConfig {
        &self.shared.config
    }

    /// Queues `request`; its tokens come on the returned stream. Refused at once, with
    /// nothing queued, when it cannot be served: an empty prompt, `max_tokens` 0, a prompt
    /// that leaves no room in the context, sampling out of range, stop strings without a
    /// detokenizer, a full queue, a scheduler shutting down.
    pub fn submit(&self, request: GenRequest) -> Result<Generation, GenError> {
        let config = &self.shared.config;
        check(&request, config)?;
        if self
            .shared
            .stopping
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return Err(GenError::Stopped);
        }
        let mut books = self.shared.books();
        if books.waiting >= config.max_waiting {
            return Err(GenError::QueueFull {
                waiting: books.waiting,
            });
        }
        let (tx, rx) = mpsc::channel(config.stream_buffer.max(2));
        let queued = run::Queued {
            request,
            events: tx,
            arrived: Instant::now(),
        };
        // Counted before the loop can see it (it uncounts it under the same lock).
        books.waiting += 1;
        if self.tx.send(Command::Submit(Box::new(queued))).is_err() {
            books.waiting -= 1;
            return Err(GenError::Stopped);
        }
        Ok(Generation { events: rx })
    }

    /// Stops taking requests; those in flight have `grace` to finish, then are cancelled
    /// (their sequences closed). The spawned task ends then.
    pub fn shutdown(&self, grace: Duration) {
        self.shared
            .stopping
            .store(true, std::sync::atomic::Ordering::Release);
        let _ = self.tx.send(Command::Drain(grace));
    }

    /// Requests waiting to start.
    pub fn waiting(&self) -> usize {
        self.shared.books().waiting
    }

    /// What it did so far.
    pub fn stats(&self) -> SchedulerStats {
        self.shared.books().stats.clone()
    }

    /// Requests waiting to start and what it did so far, read at one instant: a request
    /// that left the queue is already counted where it went (finished, cancelled, ...).
    pub fn books(&self) -> (usize, SchedulerStats) {
        let b = self.shared.books();
        (b.waiting, b.stats.clone())
    }
}

fn check(r: &GenRequest, config: &SchedulerConfig) -> Result<(), GenError> {
    if r.prompt.is_empty() {
        return Err(GenError::EmptyPrompt);
    }
    if r.max_tokens == 0 {
        return Err(GenError::NoTokens);
    }
    if r.prompt.len() >= config.context {
        return Err(GenError::TooLong {
            prompt: r.prompt.len(),
            context: config.context,
        });
    }
    let s = &r.sampling;
    if !(s.temperature.is_finite() && s.temperature >= 0.0) {
        return Err(GenError::BadSampling(
            "temperature must be a number of at least 0",
        ));
    }
    if !(s.top_p > 0.0 && s.top_p <= 1.0) {
        return Err(GenError::BadSampling("top_p must lie in (0, 1]"));
    }
    if !r.stop.is_empty() && config.detokenize.is_none() {
        return Err(GenError::BadSampling("stop strings need a detokenizer"));
    }
    let p = &r.penalties;
    if !(p.presence.is_finite() && p.frequency.is_finite())
        || p.logit_bias.iter().any(|(_, b)| !b.is_finite())
    {
        return Err(GenError::BadSampling(
            "penalties and biases must be numbers",
        ));
    }
    if r.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
        return Err(GenError::BadSampling("at most 20 top log-probabilities"));
    }
    Ok(())
}

/// The sequence ids the scheduler gives its requests: its own counter.
fn next_id(counter: &mut SeqId) -> SeqId {
    *counter += 1;
    *counter
}
