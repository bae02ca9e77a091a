//! An OpenAI-compatible HTTP API over the scheduler (cargo feature `http`, on axum):
//! `POST /v1/completions` and `POST /v1/chat/completions` (the model's chat template), whole
//! or streamed as server-sent events ending with `data: [DONE]`; `GET /v1/models`,
//! `GET /health` and `GET /metrics`. Every response carries its usage figures, with the
//! prompt tokens that came from the prefix cache (`prompt_tokens_details.cached_tokens`).
//!
//! Bad input gets the OpenAI error object and its status, never a panic: a body that is not
//! JSON or has a known field of the wrong type, `max_tokens` 0 or past the context, a prompt
//! that fills the context (400), a body over the size limit (413), a full queue (429 with
//! `Retry-After`), a server shutting down (503). A client that goes away mid-request drops
//! its stream, which cancels the request: its sequence is closed and its memory comes back.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

mod text;
mod wire;

use crate::scheduler::{
    Event, FinishReason, GenError, GenRequest, Generation, Sampling, SchedulerHandle,
};
use crate::TextCodec;
use text::TextOut;
use wire::{ChatBody, Common, CompletionBody, Content, Kind, Prompt, Usage};

/// The Prometheus text of the process's metrics, where it keeps them.
pub type MetricsText = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// Stop strings one request may give at most (as OpenAI's API).
const MAX_STOPS: usize = 4;

/// What the API serves.
pub struct Api {
    scheduler: SchedulerHandle,
    codec: Arc<TextCodec>,
    name: String,
    stop_tokens: Vec<u32>,
    default_max_tokens: usize,
    metrics: Option<MetricsText>,
    ids: AtomicU64,
}

impl Api {
    /// The API of `scheduler` (whose detokenizer should be `codec`'s), naming the model
    /// `name`; generation stops at `codec`'s end of sequence; a request without `max_tokens`
    /// gets at most `default_max_tokens`.
    pub fn new(
        scheduler: SchedulerHandle,
        codec: Arc<TextCodec>,
        name: impl Into<String>,
        default_max_tokens: usize,
        metrics: Option<MetricsText>,
    ) -> Self {
        Api {
            stop_tokens: codec.eos.into_iter().collect(),
            scheduler,
            codec,
            name: name.into(),
            default_max_tokens: default_max_tokens.max(1),
            metrics,
            ids: AtomicU64::new(0),
        }
    }

    /// The routes, with request bodies limited to `body_limit` bytes.
    pub fn router(self: Arc<Self>, body_limit: usize) -> Router {
        Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .fallback(not_found)
            .layer(DefaultBodyLimit::max(body_limit))
            .with_state(self)
    }
}

/// An OpenAI error response.
fn refuse(status: StatusCode, kind: &str, code: Option<&str>, message: &str) -> Response {
    let mut r = (status, Json(wire::error(message, kind, code))).into_response();
    if matches!(
        status,
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
    ) {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

fn bad(message: &str) -> Response {
    refuse(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        None,
        message,
    )
}

fn rejected(r: JsonRejection) -> Response {
    let status = r.status();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        return refuse(
            status,
            "invalid_request_error",
            Some("request_too_large"),
            "the request body is over the size limit",
        );
    }
    // Not JSON, the wrong content type, or a field of the wrong type: the client's mistake.
    let status = if status == StatusCode::UNSUPPORTED_MEDIA_TYPE {
        status
    } else {
        StatusCode::BAD_REQUEST
    };
    refuse(status, "invalid_request_error", None, &r.body_text())
}

fn gen_refused(e: &GenError) -> Response {
    let text = e.to_string();
    match e {
        GenError::QueueFull { .. } => refuse(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            Some("queue_full"),
            &text,
        ),
        GenError::Stopped | GenError::Cancelled => refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some("shutting_down"),
            &text,
        ),
        GenError::TooLong { .. } => refuse(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("context_length_exceeded"),
            &text,
        ),
        GenError::EmptyPrompt | GenError::NoTokens | GenError::BadSampling(_) => bad(&text),
        GenError::NoRoom(_) => refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some("no_memory"),
            &text,
        ),
        _ => refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            None,
            &text,
        ),
    }
}

async fn completions(
    State(api): State<Arc<Api>>,
    body: Result<Json<CompletionBody>, JsonRejection>,
) -> Response {
    let Json(body) = match body {
        Ok(b) => b,
        Err(r) => return rejected(r),
    };
    let prompt = match body.prompt {
        Prompt::Tokens(t) => t,
        Prompt::Text(s) => match api.codec.encode(&s) {
            Ok(t) => t,
            Err(e) => return bad(&e.to_string()),
        },
        Prompt::Texts(v) if v.len() == 1 => match api.codec.encode(&v[0]) {
            Ok(t) => t,
            Err(e) => return bad(&e.to_string()),
        },
        Prompt::Texts(_) => return bad("this server takes one prompt per request"),
    };
    let vocab = api.codec.vocab();
    if prompt.iter().any(|&t| t as usize >= vocab) {
        return bad(&format!("a prompt token past the vocabulary of {vocab}"));
    }
    generate(&api, Kind::Completion, prompt, body.common).await
}

async fn chat(
    State(api): State<Arc<Api>>,
    body: Result<Json<ChatBody>, JsonRejection>,
) -> Response {
    let Json(body) = match body {
        Ok(b) => b,
        Err(r) => return rejected(r),
    };
    if body.messages.is_empty() {
        return bad("messages is empty");
    }
    let texts: Vec<(String, String)> = body
        .messages
        .into_iter()
        .map(|m| {
            let content = match m.content {
                Content::Text(t) => t,
                Content::Parts(parts) => parts
                    .into_iter()
                    .filter(|p| p.kind == "text")
                    .filter_map(|p| p.text)
                    .collect::<Vec<_>>()
                    .join(""),
            };
            (m.role, content)
        })
        .collect();
    let pairs: Vec<(&str, &str)> = texts
        .iter()
        .map(|(r, c)| (r.as_str(), c.as_str()))
        .collect();
    let prompt = match api.codec.chat_messages(&pairs) {
        Ok(p) => p,
        Err(e) => return bad(&e.to_string()),
    };
    generate(&api, Kind::Chat, prompt, body.common).await
}

/// Checks what both endpoints share and queues the request.
async fn generate(api: &Arc<Api>, kind: Kind, prompt: Vec<u32>, common: Common) -> Response {
    if common.n.is_some_and(|n| n != 1) {
        return bad("this server makes one choice per request (n must be 1)");
    }
    let context = api.scheduler.config().context;
    if prompt.len() >= context {
        return gen_refused(&GenError::TooLong {
            prompt: prompt.len(),
            context,
        });
    }
    let room = (context - prompt.len()) as u64;
    let max_tokens = match common.max_completion_tokens.or(common.max_tokens) {
        None => room.min(api.default_max_tokens as u64),
        Some(0) => return bad("max_tokens must be at least 1"),
        Some(m) if m > room => {
            return refuse(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("context_length_exceeded"),
                &format!(
                "the prompt's {} tokens and max_tokens {m} are more than the context of {context}",
                prompt.len()
            ),
            )
        }
        Some(m) => m,
    } as usize;
    let stop = common.stop.map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > MAX_STOPS {
        return bad("at most 4 stop strings");
    }
    let id = api.ids.fetch_add(1, Ordering::Relaxed) + 1;
    let sampling = Sampling {
        temperature: common.temperature.unwrap_or(1.0),
        top_p: common.top_p.unwrap_or(1.0),
        seed: common.seed.unwrap_or_else(|| seed_for(id)),
    };
    let request = GenRequest {
        prompt,
        max_tokens,
        sampling,
        stop_tokens: api.stop_tokens.clone(),
        stop: stop.clone(),
        keep_logits: false,
    };
    let generation = match api.scheduler.submit(request) {
        Ok(g) => g,
        Err(e) => return gen_refused(&e),
    };
    let reply = Reply {
        api: Arc::clone(api),
        kind,
        id: format!(
            "{}-{id}",
            if kind == Kind::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            }
        ),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        generation,
        tokens: Vec::new(),
        out: TextOut::new(stop),
    };
    if common.stream {
        reply.stream().into_response()
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
    kind: Kind,
    id: String,
    created: u64,
    generation: Generation,
    tokens: Vec<u32>,
    out: TextOut,
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
    async fn next(&mut self) -> Step {
        match self.generation.next().await {
            Some(Event::Token { token, .. }) => {
                self.tokens.push(token);
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

    async fn whole(mut self) -> Response {
        loop {
            match self.next().await {
                Step::Text(_) => {}
                Step::End(_, why, usage) => {
                    let api = &self.api;
                    let body = wire::whole(
                        self.kind,
                        &self.id,
                        self.created,
                        &api.name,
                        self.out.text(),
                        why,
                        usage,
                    );
                    return Json(body).into_response();
                }
                Step::Failed(e) => return gen_refused(&e),
            }
        }
    }

    fn stream(
        self,
    ) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, std::convert::Infallible>>> {
        let events = futures_util::stream::unfold(Some(self), |state| async move {
            let mut reply = state?;
            loop {
                let (kind, id, created) = (reply.kind, reply.id.clone(), reply.created);
                let name = reply.api.name.clone();
                let chunk = match reply.next().await {
                    Step::Text(None) => continue,
                    Step::Text(Some(t)) => {
                        wire::chunk(kind, &id, created, &name, Some(&t), None, None)
                    }
                    Step::End(rest, why, usage) => {
                        // The rest of the text, then the end with the usage, then [DONE].
                        let mut events = Vec::new();
                        if let Some(t) = rest {
                            events.push(data(wire::chunk(
                                kind,
                                &id,
                                created,
                                &name,
                                Some(&t),
                                None,
                                None,
                            )));
                        }
                        events.push(data(wire::chunk(
                            kind,
                            &id,
                            created,
                            &name,
                            None,
                            Some(why),
                            Some(usage),
                        )));
                        events.push(Ok(SseEvent::default().data("[DONE]")));
                        return Some((futures_util::stream::iter(events), None));
                    }
                    Step::Failed(e) => {
                        let error = wire::error(&e.to_string(), "server_error", None);
                        let events = vec![data(error), Ok(SseEvent::default().data("[DONE]"))];
                        return Some((futures_util::stream::iter(events), None));
                    }
                };
                return Some((futures_util::stream::iter(vec![data(chunk)]), Some(reply)));
            }
        });
        Sse::new(futures_util::StreamExt::flatten(events))
    }
}

fn data(v: Value) -> Result<SseEvent, std::convert::Infallible> {
    Ok(SseEvent::default().data(v.to_string()))
}

async fn models(State(api): State<Arc<Api>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{ "id": api.name, "object": "model", "created": 0, "owned_by": "procmem" }],
    }))
}

async fn health(State(api): State<Arc<Api>>) -> Json<Value> {
    let s = api.scheduler.stats();
    Json(json!({
        "status": "ok",
        "waiting": api.scheduler.waiting(),
        "finished": s.finished,
        "cancelled": s.cancelled,
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
