//! The scheduler's loop: intake, cancellations, restores, admission, one step, its answers.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use procmem_actors::governor::GovernorError;
use procmem_actors::kv::{Restored, SeqId};
use procmem_actors::procmem::kv::prompt_keys;
use procmem_actors::procmem::metrics::{
    HTTP_SLOW_READERS_TOTAL, REQUEST_FIRST_TOKEN_SECONDS, REQUEST_INTER_TOKEN_SECONDS,
    REQUEST_SECONDS,
};
use rand::rngs::StdRng;
use rand::SeedableRng;
use tokio::sync::mpsc;

use super::policy::{store_refusal, Action, Failure, Policy};
use super::{
    adjust, logprobs, next_id, sample, Command, Event, Figures, FinishReason, GenError, GenRequest,
    SchedulerStats, Shared,
};
use crate::error::ModelError;
use crate::step::{self, StepInput, StepModel};

/// Waiting requests admission looks at, at most, for one that need not wait for another's
/// prompt blocks.
const DEFER_SCAN: usize = 64;
/// Times admission passes over one request, at most, for another's prompt blocks.
const MAX_PASSES: u32 = 64;

/// The requests' latency histograms, looked up once for the loop's whole run.
struct Latency {
    first_token: metrics::Histogram,
    inter_token: metrics::Histogram,
    request: metrics::Histogram,
}

impl Latency {
    fn new() -> Self {
        Latency {
            first_token: REQUEST_FIRST_TOKEN_SECONDS.histogram(&[]),
            inter_token: REQUEST_INTER_TOKEN_SECONDS.histogram(&[]),
            request: REQUEST_SECONDS.histogram(&[]),
        }
    }
}

/// A request as submitted.
pub(super) struct Queued {
    pub(super) request: GenRequest,
    pub(super) events: mpsc::Sender<Event>,
    pub(super) arrived: Instant,
}

/// A request the loop holds: waiting, running or parked.
struct Live {
    id: SeqId,
    q: Queued,
    /// Prompt and generated tokens.
    known: Vec<u32>,
    generated: Vec<u32>,
    /// Tokens whose KV the store holds.
    pos: usize,
    opened: bool,
    /// The prefix cache's keys of the whole blocks of `known` as it was queued (a waiting
    /// request's prompt; what a running one opened with).
    keys: Vec<u64>,
    /// Running: the end of the prompt blocks it writes into the cache (what it opened with);
    /// 0 once restored, as a restored sequence writes no block for others.
    writes_to: usize,
    /// Times admission passed over it while it waited for another's prompt blocks.
    passed: u32,
    rng: StdRng,
    figures: Figures,
    last: Option<Instant>,
}

impl Live {
    fn gone(&self) -> bool {
        self.q.events.is_closed()
    }

    /// Sends `event`; the stream always has room for the last one (a token is sent only
    /// where one more place stays free, see [`Live::behind`]).
    fn send(&self, event: Event) {
        let _ = self.q.events.try_send(event);
    }

    /// Times a token made `now`: its first token's wait, or the gap since the last one
    /// (in its figures and in the latency histograms).
    fn token_made(&mut self, now: Instant, latency: &Latency) {
        match self.last {
            None => {
                let first = now - self.q.arrived;
                self.figures.first_token = Some(first);
                latency.first_token.record(first.as_secs_f64());
            }
            Some(last) => {
                self.figures.inter_token.push(now - last);
                latency.inter_token.record((now - last).as_secs_f64());
            }
        }
        self.last = Some(now);
    }

    /// Whether its caller has fallen the configured `stream_buffer` events behind: only
    /// the place kept for the end is left.
    fn behind(&self) -> bool {
        self.q.events.capacity() <= 1
    }
}

pub(super) struct Loop<'m, M: ?Sized> {
    model: &'m M,
    shared: Arc<Shared>,
    rx: mpsc::UnboundedReceiver<Command>,
    waiting: VecDeque<Live>,
    running: Vec<Live>,
    parked: VecDeque<Live>,
    next: SeqId,
    /// Set by a shutdown: when in-flight requests are cancelled.
    deadline: Option<Instant>,
    /// Every handle is gone.
    closed: bool,
    /// What it decides by: whether restores and admission wait, a lone request's patience.
    policy: Policy,
    /// Tokens in one of the KV store's prompt blocks.
    block: usize,
    latency: Latency,
}

impl<'m, M: StepModel + ?Sized> Loop<'m, M> {
    pub(super) fn new(
        model: &'m M,
        shared: Arc<Shared>,
        rx: mpsc::UnboundedReceiver<Command>,
    ) -> Self {
        let policy = Policy::new(shared.config.lonely_for);
        Loop {
            model,
            shared,
            rx,
            waiting: VecDeque::new(),
            running: Vec::new(),
            parked: VecDeque::new(),
            next: 0,
            deadline: None,
            closed: false,
            policy,
            block: model.kv().prefix_digest().block_tokens(),
            latency: Latency::new(),
        }
    }

    pub(super) async fn run(mut self) -> SchedulerStats {
        while self.intake().await {
            self.drop_cancelled();
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                self.cancel_all();
                break;
            }
            self.restore_parked().await;
            self.admit().await;
            if !self.running.is_empty() {
                self.step().await;
            }
        }
        self.cancel_all();
        self.shared.books().stats.clone()
    }

    fn idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.parked.is_empty()
    }

    /// Takes what was submitted; with nothing to do, waits for it. False when the loop ends.
    async fn intake(&mut self) -> bool {
        if self.idle() {
            if self.deadline.is_some() || self.closed {
                return false;
            }
            match self.rx.recv().await {
                Some(cmd) => self.command(cmd),
                None => {
                    self.closed = true;
                    return false;
                }
            }
        }
        loop {
            match self.rx.try_recv() {
                Ok(cmd) => self.command(cmd),
                Err(mpsc::error::TryRecvError::Empty) => return true,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    self.closed = true;
                    return !self.idle();
                }
            }
        }
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Drain(grace) => {
                let at = Instant::now() + grace;
                self.deadline = Some(self.deadline.map_or(at, |d| d.min(at)));
            }
            Command::Submit(q) => {
                let mut books = self.shared.books();
                books.stats.accepted += 1;
                if self.deadline.is_some() {
                    books.waiting -= 1;
                    books.stats.cut += 1;
                    let _ = q.events.try_send(Event::Failed(GenError::Stopped));
                    return;
                }
                drop(books);
                let id = next_id(&mut self.next);
                let figures = Figures {
                    prompt_tokens: q.request.prompt.len(),
                    ..Figures::default()
                };
                self.waiting.push_back(Live {
                    id,
                    known: q.request.prompt.clone(),
                    generated: Vec::new(),
                    pos: 0,
                    opened: false,
                    keys: prompt_keys(&q.request.prompt, self.block),
                    writes_to: 0,
                    passed: 0,
                    rng: StdRng::seed_from_u64(q.request.sampling.seed),
                    figures,
                    last: None,
                    q: *q,
                });
            }
        }
    }

    /// Requests whose caller dropped the stream: closed, their memory back.
    fn drop_cancelled(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|r| !r.gone());
        let left = before - self.waiting.len();
        let mut gone = left as u64;
        let kv = self.model.kv();
        for r in self.running.iter().chain(&self.parked).filter(|r| r.gone()) {
            kv.close(r.id);
            gone += 1;
        }
        self.running.retain(|r| !r.gone());
        self.parked.retain(|r| !r.gone());
        if gone > 0 {
            self.policy.cancelled();
            let mut books = self.shared.books();
            books.waiting -= left;
            books.stats.cancelled += gone;
        }
    }

    /// The end of the grace period: every request left is cut (one whose caller had gone
    /// already counts as cancelled).
    fn cancel_all(&mut self) {
        let queued = self.waiting.len();
        let kv = self.model.kv();
        let (mut cut, mut gone) = (0, 0);
        let left = self.running.drain(..).chain(self.parked.drain(..));
        for r in left.chain(self.waiting.drain(..)) {
            if r.opened {
                kv.close(r.id);
            }
            if r.gone() {
                gone += 1;
            } else {
                cut += 1;
            }
            r.send(Event::Failed(GenError::Cancelled));
        }
        let mut books = self.shared.books();
        books.waiting -= queued;
        books.stats.cut += cut;
        books.stats.cancelled += gone;
    }

    /// Fails `r` with `e`, closing its sequence.
    fn fail(&self, r: Live, e: GenError) {
        self.model.kv().close(r.id);
        self.shared.books().stats.failed += 1;
        r.send(Event::Failed(e));
    }

    /// Preempted requests come back first, oldest first: once one of those still running
    /// has finished since the last preemption (or none runs), so a restore does not take the
    /// room a preemption just made and get preempted again, round and round.
    async fn restore_parked(&mut self) {
        let most = self.shared.config.max_running;
        while self.policy.may_restore(self.running.len(), most) {
            let Some(mut r) = self.parked.pop_front() else {
                break;
            };
            match self.model.kv().restore(r.id).await {
                Ok(Restored::Swapped { tokens }) => r.pos = tokens,
                Ok(Restored::Recompute { cached, .. }) => {
                    // Tokens past `cached` are computed again (a copy from disk that failed
                    // brings back fewer than the open promised): they were not served from
                    // the cache after all.
                    r.pos = cached;
                    r.figures.cached_tokens = r.figures.cached_tokens.min(cached);
                }
                Err(_) if !self.running.is_empty() => {
                    self.parked.push_front(r);
                    self.policy.restore_refused();
                    break;
                }
                Err(e) => {
                    if self.wait_alone(r.id, store_refusal(&e)).await {
                        self.parked.push_front(r);
                        break;
                    }
                    self.fail(r, GenError::NoRoom(e));
                    continue;
                }
            }
            self.policy.got_room(r.id);
            self.shared.books().stats.restores += 1;
            // A restored sequence writes no prompt block for others to wait for.
            r.writes_to = 0;
            self.running.push(r);
        }
    }

    /// Whether `r` should wait for a running request that is still prefilling whole prompt
    /// blocks `r`'s prompt starts with: opened now, `r` would compute its own copy of them
    /// (the store shares a block once it is written); a few steps later it maps the other's.
    /// Not for a block ending at `r`'s last token (the store's position rule: that token is
    /// always computed), nor more than [`MAX_PASSES`] times.
    fn waits_for_shared(&self, r: &Live) -> bool {
        let block = self.block;
        block > 0
            && r.passed < MAX_PASSES
            && self.running.iter().any(|s| {
                // The block `s` is writing now; the keys are chained, so equal keys mean
                // equal prompts up to its end (a collision costs a short wait, no more).
                let i = s.pos / block;
                let end = (i + 1) * block;
                end <= s.writes_to
                    && end < r.known.len()
                    && r.keys.get(i).is_some_and(|k| s.keys.get(i) == Some(k))
            })
    }

    /// The first waiting request to admit, oldest first, and where it was in the queue;
    /// those that wait for a running request's prompt blocks are passed over (of the first
    /// [`DEFER_SCAN`] at most).
    fn next_waiting(&mut self) -> Option<(usize, Live)> {
        let scan = self.waiting.len().min(DEFER_SCAN);
        let at = (0..scan).find(|&i| !self.waits_for_shared(&self.waiting[i]));
        let passed = at.unwrap_or(scan);
        for r in self.waiting.iter_mut().take(passed) {
            r.passed += 1;
        }
        self.shared.books().stats.passed_over += passed as u64;
        let at = at?;
        Some((at, self.waiting.remove(at)?))
    }

    /// New requests start while nothing is parked and no pressure holds admission: the KV
    /// store's open (its grant for the prompt's blocks) decides whether there is room.
    async fn admit(&mut self) {
        let config = &self.shared.config;
        let most = config.max_running.min(config.step_tokens);
        while self
            .policy
            .may_admit(self.running.len(), self.parked.len(), most)
        {
            let Some((at, mut r)) = self.next_waiting() else {
                break;
            };
            if r.gone() {
                // Its caller left while it waited: it never starts.
                if r.opened {
                    self.model.kv().close(r.id);
                }
                let mut books = self.shared.books();
                books.waiting -= 1;
                books.stats.cancelled += 1;
                continue;
            }
            match self.model.kv().open(r.id, r.known.clone(), 0).await {
                Ok(opened) => {
                    self.policy.got_room(r.id);
                    if !r.opened {
                        r.figures.cached_tokens = opened.cached_tokens;
                        r.figures.queued = r.q.arrived.elapsed();
                    } else {
                        // Started over: tokens past what it maps now are computed again.
                        r.figures.cached_tokens = r.figures.cached_tokens.min(opened.cached_tokens);
                    }
                    r.opened = true;
                    r.writes_to = r.known.len();
                    // The store's position rule (`Opened`): fewer than the prompt's tokens.
                    r.pos = opened.cached_tokens;
                    self.shared.books().waiting -= 1;
                    self.running.push(r);
                }
                Err(_) if !self.running.is_empty() => {
                    // Back where it was, ahead of those passed over for it.
                    self.waiting.insert(at, r);
                    self.policy.open_refused();
                    break;
                }
                Err(e) => {
                    if self.wait_alone(r.id, store_refusal(&e)).await {
                        self.waiting.insert(at, r);
                        break;
                    }
                    let mut books = self.shared.books();
                    books.waiting -= 1;
                    books.stats.failed += 1;
                    r.send(Event::Failed(GenError::NoRoom(e)));
                }
            }
        }
    }

    /// The step's inputs: every running sequence's next token, and as many more of the
    /// prompts still being prefilled as the budget has room for, first come first.
    fn plan(&self) -> Vec<StepInput> {
        let mut spare = self
            .shared
            .config
            .step_tokens
            .saturating_sub(self.running.len());
        self.running
            .iter()
            .map(|r| {
                let left = r.known.len() - r.pos;
                let more = (left - 1).min(spare);
                spare -= more;
                StepInput {
                    seq: r.id,
                    tokens: r.known[r.pos..r.pos + 1 + more].to_vec(),
                    position: r.pos,
                }
            })
            .collect()
    }

    async fn step(&mut self) {
        let inputs = self.plan();
        let e = match step::run(self.model, &inputs).await {
            Ok(logits) => return self.stepped(&inputs, logits),
            Err(e) => e,
        };
        let lone = match &self.running[..] {
            [alone] => Some(alone.id),
            _ => None,
        };
        let failure = Failure::of(&e);
        match (self.policy).failed_step(failure, self.running.len(), lone, Instant::now()) {
            Action::Park(seq) => {
                self.shared.books().stats.preemptions += 1;
                if let Some(i) = self.running.iter().position(|r| r.id == seq) {
                    let mut r = self.running.remove(i);
                    r.figures.preemptions += 1;
                    self.parked.push_back(r);
                }
            }
            Action::ShedNewest => self.shed_newest(),
            // A step given up midway (a layer's weights not back in time) hands its sequences
            // back after its kernels' fence; until then they are busy.
            Action::Again(pause) => tokio::time::sleep(pause).await,
            Action::RetryAlone(pause) => {
                self.shared.books().stats.retries += 1;
                tokio::time::sleep(pause).await;
            }
            Action::FailAll => self.fail_running(e),
        }
    }

    /// The batch does not fit (its KV, or a layer's weights brought back for it): the newest
    /// request starts over later from the tokens it knows (what it streamed already is not
    /// sent again). Its whole blocks stay cached: it opens again from those.
    fn shed_newest(&mut self) {
        let Some(mut r) = self.running.pop() else {
            return;
        };
        self.model.kv().close_keeping(r.id, r.known.clone());
        r.pos = 0;
        r.writes_to = 0;
        r.passed = 0;
        r.keys = prompt_keys(&r.known, self.block);
        r.figures.preemptions += 1;
        let mut books = self.shared.books();
        books.stats.shed += 1;
        books.waiting += 1;
        self.waiting.push_front(r);
    }

    /// The step's requests cannot go on: each fails with what happened (a lone request the
    /// memory cannot hold, with the store's refusal).
    fn fail_running(&mut self, e: ModelError) {
        let mut running = std::mem::take(&mut self.running);
        tracing::warn!(requests = running.len(), error = %e, "a step failed");
        let e = match e {
            ModelError::Prepare(kv) if running.len() == 1 => {
                let r = running.pop().expect("one");
                return self.fail(r, GenError::NoRoom(kv));
            }
            other => Arc::new(other),
        };
        for r in running {
            self.fail(r, GenError::Model(Arc::clone(&e)));
        }
    }

    /// Whether `seq`, alone (nothing else running) and refused memory with `g`, is tried
    /// again rather than failed ([`Policy::retry_alone`]); the pause before the next try is
    /// taken here.
    async fn wait_alone(&mut self, seq: SeqId, g: Option<&GovernorError>) -> bool {
        let Some(pause) = self.policy.retry_alone(seq, g, Instant::now()) else {
            return false;
        };
        self.shared.books().stats.retries += 1;
        tokio::time::sleep(pause).await;
        true
    }

    fn stepped(&mut self, inputs: &[StepInput], logits: Vec<Vec<f32>>) {
        self.policy.stepped();
        let detok = self.shared.config.detokenize.clone();
        let context = self.shared.config.context;
        let mut stats = SchedulerStats::default();
        let mut ended = Vec::new();
        for (i, (l, input)) in logits.into_iter().zip(inputs).enumerate() {
            let r = &mut self.running[i];
            r.pos += input.tokens.len();
            if r.pos < r.known.len() {
                stats.prefilled += input.tokens.len() as u64;
                continue;
            }
            stats.prefilled += input.tokens.len() as u64 - 1;
            if r.behind() {
                // Its caller stopped reading: the token is not made, the request is cut.
                ended.push((i, None));
                continue;
            }
            r.token_made(Instant::now(), &self.latency);
            let request = &r.q.request;
            let t = if request.penalties.is_none() {
                sample(&l, &request.sampling, &mut r.rng)
            } else {
                let mut adjusted = l.clone();
                adjust(&mut adjusted, &request.penalties, &r.generated);
                sample(&adjusted, &request.sampling, &mut r.rng)
            };
            let lp = request.logprobs.map(|top| logprobs(&l, t, top));
            r.known.push(t);
            r.generated.push(t);
            r.figures.completion_tokens += 1;
            stats.generated += 1;
            let logits = request.keep_logits.then_some(l);
            r.send(Event::Token {
                token: t,
                logits,
                logprobs: lp,
            });
            let stopped = request.stop_tokens.contains(&t)
                || detok.as_ref().is_some_and(|d| {
                    let text = d(&r.generated);
                    request
                        .stop
                        .iter()
                        .any(|s| !s.is_empty() && text.contains(s))
                });
            let reason = if stopped {
                Some(FinishReason::Stop)
            } else if r.generated.len() >= request.max_tokens || r.known.len() >= context {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                ended.push((i, Some(reason)));
            }
        }
        self.end(ended, &mut stats);
        let mut books = self.shared.books();
        let total = &mut books.stats;
        total.steps += 1;
        total.generated += stats.generated;
        total.prefilled += stats.prefilled;
        total.finished += stats.finished;
        total.cancelled += stats.cancelled;
        total.slow_readers += stats.slow_readers;
    }

    /// The requests `ended` in a step, by their place in `running` (ascending): finished
    /// (`Some(reason)`) or cut because their caller stopped reading (`None`). Each leaves
    /// `running` and its sequence closes; a finished one's whole blocks stay cached.
    fn end(&mut self, ended: Vec<(usize, Option<FinishReason>)>, stats: &mut SchedulerStats) {
        for (i, reason) in ended.into_iter().rev() {
            let r = self.running.remove(i);
            match reason {
                Some(reason) => {
                    // A chat's next turn sends this answer back: its whole blocks stay cached.
                    self.model.kv().close_keeping(r.id, r.known.clone());
                    let took = r.q.arrived.elapsed();
                    self.latency.request.record(took.as_secs_f64());
                    r.send(Event::Finished {
                        reason,
                        figures: r.figures.clone(),
                    });
                    stats.finished += 1;
                }
                None => {
                    self.model.kv().close(r.id);
                    let behind = self.shared.config.stream_buffer;
                    tracing::info!(seq = r.id, behind, "a caller stopped reading: cut");
                    HTTP_SLOW_READERS_TOTAL.counter(&[]).increment(1);
                    r.send(Event::Failed(GenError::SlowReader { behind }));
                    stats.cancelled += 1;
                    stats.slow_readers += 1;
                }
            }
            self.policy.finished();
        }
    }
}
