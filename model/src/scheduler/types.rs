//! What a caller hands the scheduler and what it gets back.

use std::time::Duration;

use crate::error::GenError;

/// How the next token is chosen from the logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 is greedy (the largest logit, the first on a tie); above, the logits are divided by
    /// it before the softmax.
    pub temperature: f32,
    /// Nucleus sampling: only the most likely tokens whose probabilities sum to at least this
    /// are kept (1 keeps all).
    pub top_p: f32,
    /// The generator's seed: the same seed, prompt and settings give the same tokens.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// What changes the logits before a token is chosen (OpenAI's `presence_penalty`,
/// `frequency_penalty` and `logit_bias`). The default changes nothing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Penalties {
    /// Subtracted once from the logit of every token the completion has produced so far.
    pub presence: f32,
    /// Subtracted from a token's logit once for each time the completion produced it.
    pub frequency: f32,
    /// Added to the logits of these tokens.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Penalties {
    /// Whether it changes nothing.
    pub fn is_none(&self) -> bool {
        self.presence == 0.0 && self.frequency == 0.0 && self.logit_bias.is_empty()
    }
}

/// A chosen token's log-probability and the most likely alternatives', from the model's own
/// distribution (a log-softmax of its logits, before temperature, penalties or bias).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token's.
    pub logprob: f32,
    /// The most likely tokens and theirs, most likely first (as many as asked).
    pub top: Vec<(u32, f32)>,
}

/// Alternatives a request may ask log-probabilities of, at most, per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One completion to generate.
#[derive(Debug, Clone, Default)]
pub struct GenRequest {
    /// Prompt tokens (at least one).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at least one).
    pub max_tokens: usize,
    /// How tokens are chosen.
    pub sampling: Sampling,
    /// Generation stops after any of these tokens (the model's end of turn, say).
    pub stop_tokens: Vec<u32>,
    /// Generation stops once the completion's text contains any of these (needs the
    /// scheduler's detokenizer).
    pub stop: Vec<String>,
    /// Keep the logits each token was chosen from in its event.
    pub keep_logits: bool,
    /// Penalties and biases applied to the logits before each choice.
    pub penalties: Penalties,
    /// Send each token's log-probability with this many alternatives' (at most
    /// [`MAX_TOP_LOGPROBS`]) in its event.
    pub logprobs: Option<usize>,
}

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It reached its `max_tokens`, or the context's end.
    Length,
    /// A stop token or stop string.
    Stop,
}

/// Per-request figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Figures {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Prompt tokens it never computed: whose KV came from shared cached blocks at its first
    /// open and was never computed again (a preemption that maps fewer back, or a copy in
    /// from disk that fails its check, lowers it to what it holds then).
    pub cached_tokens: usize,
    /// Times pressure preempted it (or its step did not fit and it started over).
    pub preemptions: u32,
    /// From submission to its first step.
    pub queued: Duration,
    /// From submission to its first token.
    pub first_token: Option<Duration>,
    /// Between consecutive tokens.
    pub inter_token: Vec<Duration>,
}

/// What a request's stream carries: tokens as they are chosen, then one end.
#[derive(Debug)]
pub enum Event {
    /// The next token.
    Token {
        /// Its id.
        token: u32,
        /// The logits it was chosen from, where asked for.
        logits: Option<Vec<f32>>,
        /// Its log-probability and the top alternatives', where asked for.
        logprobs: Option<TokenLogprobs>,
    },
    /// The completion ended.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Its figures.
        figures: Figures,
    },
    /// The completion failed; nothing more comes.
    Failed(GenError),
}

/// What the scheduler did, over its whole run.
#[derive(Debug, Clone, Default)]
pub struct SchedulerStats {
    /// Steps run.
    pub steps: u64,
    /// Tokens generated.
    pub generated: u64,
    /// Prompt tokens computed (after prefix hits; replays included).
    pub prefilled: u64,
    /// Preemptions met.
    pub preemptions: u64,
    /// Restores (swapped back, or dropped and replayed).
    pub restores: u64,
    /// Requests shed (closed and started over) because a step did not fit.
    pub shed: u64,
    /// Tries of a lone sequence (to open, restore or step it) that did not get memory by
    /// their deadline and were made again.
    pub retries: u64,
    /// Requests the scheduler took (each ends counted once: finished, cancelled, cut or
    /// failed).
    pub accepted: u64,
    /// Requests whose caller went away before the end (a queued one before it started), or
    /// stopped reading its stream (`slow_readers`).
    pub cancelled: u64,
    /// Of `cancelled`, those cut because their caller fell
    /// [`SchedulerConfig::stream_buffer`](super::SchedulerConfig::stream_buffer) events
    /// behind.
    pub slow_readers: u64,
    /// Requests finished.
    pub finished: u64,
    /// Requests cut by shutdown: still queued or running when the grace period ended, or
    /// submitted after shutdown began.
    pub cut: u64,
    /// Requests that failed (no room even alone, or the model's error).
    pub failed: u64,
    /// Times admission passed over a waiting request for prompt blocks a running request was
    /// still writing (it then maps them instead of computing its own copy).
    pub passed_over: u64,
}
