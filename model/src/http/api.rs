//! The routes and their handlers: a request's body read within its bounds, checked, turned
//! into a [`GenRequest`] and queued; its events turned into a whole answer or a stream.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{FromRef, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use super::body::{Bodies, Bounded};
use super::errors::{bad, bad_field, gen_refused, refuse};
use super::text::TextOut;
use super::wire::{
    self, ChatBody, Common, CompletionBody, Content, Head, Kind, Prompt, TokenLp, Usage,
};
use super::Limits;
use crate::scheduler::{
    Event, FinishReason, GenError, GenRequest, Generation, Penalties, Sampling, SchedulerHandle,
    TokenLogprobs, MAX_TOP_LOGPROBS,
};
use crate::tokenizer::TextCodec;

/// The Prometheus text of the process's metrics, where it keeps them.
pub type MetricsText = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// Stop strings one request may give at most (as OpenAI's API).
const MAX_STOPS: usize = 4;
/// The largest penalty and bias magnitudes OpenAI's API takes.
const MAX_PENALTY: f32 = 2.0;
const MAX_BIAS: f32 = 100.0;

/// What the API serves.
pub struct Api {
    scheduler: SchedulerHandle,
    codec: Arc<TextCodec>,
    name: String,
    stop_tokens: Vec<u32>,
    default_max_tokens: usize,
    metrics: Option<MetricsText>,
    ids: AtomicU64,
    bodies: Bodies,
}

impl FromRef<Arc<Api>> for Bodies {
    fn from_ref(api: &Arc<Api>) -> Self {
        api.bodies.clone()
    }
}

impl Api {
    /// The API of `scheduler` (whose detokenizer should be `codec`'s), naming the model
    /// `name`; generation stops at `codec`'s end of sequence; a request without `max_tokens`
    /// gets at most `default_max_tokens`. Request bodies are bounded as [`Limits::default`]
    /// says until [`Api::limits`] says otherwise.
    pub fn new(
        scheduler: SchedulerHandle,
        codec: Arc<TextCodec>,
        name: impl Into<String>,
        default_max_tokens: usize,
        metrics: Option<MetricsText>,
    ) -> Self {
        let limits = Limits::default();
        Api {
            stop_tokens: codec.eos.into_iter().collect(),
            scheduler,
            codec,
            name: name.into(),
            default_max_tokens: default_max_tokens.max(1),
            metrics,
            ids: AtomicU64::new(0),
            bodies: bodies(&limits),
        }
    }

    /// Request bodies bounded by `limits` (its body size, time and shared buffer).
    pub fn limits(mut self, limits: &Limits) -> Self {
        self.bodies = bodies(limits);
        self
    }

    /// The routes.
    pub fn router(self: Arc<Self>) -> Router {
        Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .fallback(not_found)
            .with_state(self)
    }
}

fn bodies(l: &Limits) -> Bodies {
    Bodies::new(l.body_limit, l.body_timeout, l.body_buffer)
}

async fn completions(
    State(api): State<Arc<Api>>,
    body: Result<Bounded<CompletionBody>, Response>,
) -> Response {
    let body = match body {
        Ok(Bounded(b)) => b,
        Err(r) => return r,
    };
    if let Some((field, why)) = body.unsupported() {
        return bad_field(field, why);
    }
    // A text prompt is text: a control token's name in it is not that token. A prompt that
    // needs control tokens sends their ids.
    let prompt = match body.prompt {
        Prompt::Tokens(t) => t,
        Prompt::Text(s) => match api.codec.encode_text(&s) {
            Ok(t) => t,
            Err(e) => return bad(&e.to_string()),
        },
        Prompt::Texts(v) if v.len() == 1 => match api.codec.encode_text(&v[0]) {
            Ok(t) => t,
            Err(e) => return bad(&e.to_string()),
        },
        Prompt::Texts(_) => return bad("this server takes one prompt per request"),
    };
    let vocab = api.codec.vocab();
    if prompt.iter().any(|&t| t as usize >= vocab) {
        return bad(&format!("a prompt token past the vocabulary of {vocab}"));
    }
    let logprobs = match body.logprobs {
        Some(n) if n as usize > MAX_TOP_LOGPROBS => {
            return bad_field("logprobs", "logprobs takes 0 to 20")
        }
        n => n.map(|n| n as usize),
    };
    generate(&api, Kind::Completion, prompt, logprobs, body.common).await
}

/// A chat message's text: its text parts joined (other parts are not read).
fn content_text(c: Option<Content>) -> String {
    match c {
        None => String::new(),
        Some(Content::Text(t)) => t,
        Some(Content::Parts(parts)) => parts
            .into_iter()
            .filter(|p| p.kind == "text")
            .filter_map(|p| p.text)
            .collect::<Vec<_>>()
            .join(""),
    }
}

async fn chat(State(api): State<Arc<Api>>, body: Result<Bounded<ChatBody>, Response>) -> Response {
    let body = match body {
        Ok(Bounded(b)) => b,
        Err(r) => return r,
    };
    if body.messages.is_empty() {
        return bad_field("messages", "messages is empty");
    }
    if let Some((field, why)) = body.common.unsupported() {
        return bad_field(field, why);
    }
    let mut texts = Vec::with_capacity(body.messages.len());
    for m in body.messages {
        // What current clients send for system instructions.
        let role = if m.role == "developer" {
            "system".to_string()
        } else {
            m.role
        };
        if m.content.is_none() && role != "assistant" {
            return bad_field("messages", &format!("a {role} message without content"));
        }
        texts.push((role, content_text(m.content)));
    }
    let pairs: Vec<(&str, &str)> = texts
        .iter()
        .map(|(r, c)| (r.as_str(), c.as_str()))
        .collect();
    let prompt = match api.codec.chat_messages(&pairs) {
        Ok(p) => p,
        Err(e) => return bad_field("messages", &e.to_string()),
    };
    let logprobs = match (body.logprobs, body.top_logprobs) {
        (_, Some(n)) if n as usize > MAX_TOP_LOGPROBS => {
            return bad_field("top_logprobs", "top_logprobs takes 0 to 20")
        }
        (false, Some(n)) if n > 0 => {
            return bad_field("top_logprobs", "top_logprobs needs logprobs: true")
        }
        (true, n) => Some(n.unwrap_or(0) as usize),
        (false, _) => None,
    };
    generate(&api, Kind::Chat, prompt, logprobs, body.common).await
}

/// The penalties and biases of `common`, checked against OpenAI's ranges.
fn penalties(common: &Common, vocab: usize) -> Result<Penalties, Box<Response>> {
    let mut p = Penalties::default();
    for (field, value, slot) in [
        ("presence_penalty", common.presence_penalty, &mut p.presence),
        (
            "frequency_penalty",
            common.frequency_penalty,
            &mut p.frequency,
        ),
    ] {
        match value {
            Some(v) if !(-MAX_PENALTY..=MAX_PENALTY).contains(&v) => {
                return Err(Box::new(bad_field(
                    field,
                    &format!("{field} takes -2 to 2"),
                )))
            }
            Some(v) => *slot = v,
            None => {}
        }
    }
    for (token, &bias) in common.logit_bias.iter().flatten() {
        let id = token.parse::<u32>().ok().filter(|&t| (t as usize) < vocab);
        let Some(id) = id else {
            return Err(Box::new(bad_field(
                "logit_bias",
                &format!("logit_bias names {token:?}: not a token id below {vocab}"),
            )));
        };
        if !(-MAX_BIAS..=MAX_BIAS).contains(&bias) {
            return Err(Box::new(bad_field(
                "logit_bias",
                "a logit_bias value takes -100 to 100",
            )));
        }
        p.logit_bias.push((id, bias));
    }
    p.logit_bias.sort_by_key(|b| b.0);
    Ok(p)
}

/// `max_tokens` as asked (or the default), checked against the room the prompt leaves.
fn max_tokens(api: &Api, prompt: usize, common: &Common) -> Result<usize, Box<Response>> {
    let context = api.scheduler.config().context;
    if prompt >= context {
        return Err(Box::new(gen_refused(&GenError::TooLong {
            prompt,
            context,
        })));
    }
    let room = (context - prompt) as u64;
    match common.max_completion_tokens.or(common.max_tokens) {
        None => Ok(room.min(api.default_max_tokens as u64) as usize),
        Some(0) => Err(Box::new(bad_field(
            "max_tokens",
            "max_tokens must be at least 1",
        ))),
        Some(m) if m > room => Err(Box::new(refuse(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("context_length_exceeded"),
            &format!(
                "the prompt's {prompt} tokens and max_tokens {m} are more than the context of {context}"
            ),
        ))),
        Some(m) => Ok(m as usize),
    }
}

/// Checks what both endpoints share and queues the request.
async fn generate(
    api: &Arc<Api>,
    kind: Kind,
    prompt: Vec<u32>,
    logprobs: Option<usize>,
    common: Common,
) -> Response {
    let max_tokens = match max_tokens(api, prompt.len(), &common) {
        Ok(m) => m,
        Err(r) => return *r,
    };
    let penalties = match penalties(&common, api.codec.vocab()) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let stop = common.stop.map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > MAX_STOPS {
        return bad_field("stop", "at most 4 stop strings");
    }
    let id = api.ids.fetch_add(1, Ordering::Relaxed) + 1;
    let request = GenRequest {
        prompt,
        max_tokens,
        sampling: Sampling {
            temperature: common.temperature.unwrap_or(1.0),
            top_p: common.top_p.unwrap_or(1.0),
            seed: common.seed.unwrap_or_else(|| seed_for(id)),
        },
        stop_tokens: api.stop_tokens.clone(),
        stop: stop.clone(),
        keep_logits: false,
        penalties,
        logprobs,
    };
    let generation = match api.scheduler.submit(request) {
        Ok(g) => g,
        Err(e) => return gen_refused(&e),
    };
    let prefix = if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let reply = Reply {
        api: Arc::clone(api),
        head: Head {
            kind,
            id: format!("{prefix}-{id}"),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: api.name.clone(),
        },
        generation,
        tokens: Vec::new(),
        out: TextOut::new(stop),
        logprobs: logprobs.map(|_| Vec::new()),
        sent_chars: 0,
    };
    if common.stream {
        let usage = common.stream_options.is_some_and(|o| o.include_usage);
        reply.stream(usage).into_response()
    } else {
        reply.whole().await
    }
}

/// A seed for a request that gave none: differs per request and per run.
fn seed_for(id: u64) -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    now ^ id.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// One request's answer as its events come.
struct Reply {
    api: Arc<Api>,
    head: Head,
    generation: Generation,
    tokens: Vec<u32>,
    out: TextOut,
    /// Log-probabilities of tokens not yet sent, where asked for.
    logprobs: Option<Vec<TokenLp>>,
    /// Characters of the text sent so far (a completion's `text_offset`).
    sent_chars: usize,
}

/// What the next event turned into.
enum Step {
    /// Text to send, maybe none yet.
    Text(Option<String>),
    /// The end: the rest of the text, why, and the usage.
    End(Option<String>, &'static str, Usage),
    Failed(GenError),
}

impl Reply {
    fn token_lp(&self, token: u32, lp: TokenLogprobs) -> TokenLp {
        let codec = &self.api.codec;
        let text = |id| {
            let bytes = codec.token_bytes(id);
            (String::from_utf8_lossy(&bytes).into_owned(), bytes)
        };
        let (t, bytes) = text(token);
        TokenLp {
            text: t,
            bytes,
            logprob: lp.logprob,
            top: lp
                .top
                .into_iter()
                .map(|(id, l)| {
                    let (s, b) = text(id);
                    (s, b, l)
                })
                .collect(),
        }
    }

    async fn next(&mut self) -> Step {
        match self.generation.next().await {
            Some(Event::Token {
                token, logprobs, ..
            }) => {
                self.tokens.push(token);
                if let (Some(lp), true) = (logprobs, self.logprobs.is_some()) {
                    let t = self.token_lp(token, lp);
                    self.logprobs.get_or_insert_with(Vec::new).push(t);
                }
                let text = self.api.codec.decode(&self.tokens).unwrap_or_default();
                // A stop string met: the scheduler ends the request at this token too.
                Step::Text(self.out.update(text).0)
            }
            Some(Event::Finished { reason, figures }) => {
                let why = match reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                };
                let usage = Usage::new(
                    figures.prompt_tokens,
                    figures.completion_tokens,
                    figures.cached_tokens,
                );
                Step::End(self.out.finish(), why, usage)
            }
            Some(Event::Failed(e)) => Step::Failed(e),
            None => Step::Failed(GenError::Stopped),
        }
    }

    /// The log-probabilities of the tokens since the last call, as the response's field.
    fn take_logprobs(&mut self, text: Option<&str>) -> Value {
        let Some(pending) = self.logprobs.as_mut() else {
            return Value::Null;
        };
        let tokens = std::mem::take(pending);
        let v = wire::logprobs(self.head.kind, &tokens, self.sent_chars);
        self.sent_chars += text.map_or(0, |t| t.chars().count());
        v
    }

    async fn whole(mut self) -> Response {
        loop {
            match self.next().await {
                Step::Text(_) => {}
                Step::End(_, why, usage) => {
                    let text = self.out.text().to_string();
                    let logprobs = self.take_logprobs(None);
                    let body = wire::whole(&self.head, &text, logprobs, why, usage);
                    return Json(body).into_response();
                }
                Step::Failed(e) => return gen_refused(&e),
            }
        }
    }

    /// The next events of a stream: a text chunk, or the end (the rest of the text, the
    /// finish, the usage where asked, `[DONE]`); `None` after the end.
    async fn next_events(&mut self, usage_asked: bool) -> (Vec<Value>, bool) {
        loop {
            match self.next().await {
                Step::Text(None) => continue,
                Step::Text(Some(t)) => {
                    let lp = self.take_logprobs(Some(&t));
                    return (vec![wire::chunk(&self.head, Some(&t), lp, None)], false);
                }
                Step::End(rest, why, usage) => {
                    // Tokens whose text never went out (a stop token) keep their figures.
                    let lp = self.take_logprobs(rest.as_deref());
                    let events_end = match &rest {
                        Some(t) => vec![
                            wire::chunk(&self.head, Some(t), lp, None),
                            wire::chunk(&self.head, None, Value::Null, Some(why)),
                        ],
                        None => vec![wire::chunk(&self.head, None, lp, Some(why))],
                    };
                    let mut events = events_end;
                    if usage_asked {
                        events.push(wire::usage_chunk(&self.head, usage));
                    }
                    return (events, true);
                }
                Step::Failed(e) => {
                    let error = wire::error(&e.to_string(), "server_error", None, None);
                    return (vec![error], true);
                }
            }
        }
    }

    fn stream(
        self,
        usage_asked: bool,
    ) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, std::convert::Infallible>>> {
        let events = futures_util::stream::unfold(Some(self), move |state| async move {
            let mut reply = state?;
            let (values, ended) = reply.next_events(usage_asked).await;
            let mut events: Vec<_> = values.iter().map(data).collect();
            if ended {
                events.push(Ok(SseEvent::default().data("[DONE]")));
            }
            let next = (!ended).then_some(reply);
            Some((futures_util::stream::iter(events), next))
        });
        Sse::new(futures_util::StreamExt::flatten(events))
    }
}

fn data(v: &Value) -> Result<SseEvent, std::convert::Infallible> {
    Ok(SseEvent::default().data(v.to_string()))
}

async fn models(State(api): State<Arc<Api>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{ "id": api.name, "object": "model", "created": 0, "owned_by": "procmem" }],
    }))
}

async fn health(State(api): State<Arc<Api>>) -> Json<Value> {
    let (waiting, s) = api.scheduler.books();
    Json(json!({
        "status": "ok",
        "waiting": waiting,
        "finished": s.finished,
        "cancelled": s.cancelled,
        "cut": s.cut,
        "failed": s.failed,
    }))
}

async fn metrics(State(api): State<Arc<Api>>) -> Response {
    match api.metrics.as_ref().and_then(|m| m()) {
        Some(text) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response(),
        None => refuse(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            None,
            "this server keeps no metrics",
        ),
    }
}

async fn not_found() -> Response {
    refuse(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        Some("unknown_url"),
        "no such endpoint",
    )
}
