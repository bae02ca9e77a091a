//! The OpenAI API's request and response bodies, as far as this server reads and writes them.
//! Fields it does not know are ignored (clients send many: `user`, `metadata`, `store`); a
//! known field of the wrong type is a 400, and so is a field asking for what this server
//! does not do (`tools`, `response_format` other than text, `n` or `best_of` over 1, `echo`,
//! `suffix`), named in the error.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// A string or a list of strings (`stop`, a completion's `prompt`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// One.
    One(String),
    /// Many.
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// A completion's prompt: text, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A batch of one text (more are refused).
    Texts(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct StreamOptions {
    /// A last chunk with `choices: []` and the usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// What both endpoints share.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct Common {
    pub max_tokens: Option<u64>,
    /// The newer name of `max_tokens` (chat).
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub stop: Option<OneOrMany>,
    pub n: Option<u32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Token id (as a string) to a bias from -100 to 100.
    pub logit_bias: Option<HashMap<String, f32>>,
    // Asked for, not done: refused by name.
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    pub response_format: Option<Value>,
}

impl Common {
    /// The first field that asks for what this server does not do, and why.
    pub fn unsupported(&self) -> Option<(&'static str, &'static str)> {
        let given = |v: &Option<Value>| {
            v.as_ref()
                .is_some_and(|v| !(v.is_null() || v.as_array().is_some_and(Vec::is_empty)))
        };
        if self.n.is_some_and(|n| n != 1) {
            return Some((
                "n",
                "this server makes one choice per request (n must be 1)",
            ));
        }
        if given(&self.tools) || given(&self.functions) {
            return Some(("tools", "this server does not call tools"));
        }
        if given(&self.function_call) {
            return Some(("function_call", "this server does not call functions"));
        }
        let tool_choice = self.tool_choice.as_ref().and_then(Value::as_str);
        if given(&self.tool_choice) && !matches!(tool_choice, Some("none" | "auto")) {
            return Some(("tool_choice", "this server does not call tools"));
        }
        let format = self.response_format.as_ref().filter(|v| !v.is_null());
        if format.is_some_and(|f| f.get("type").and_then(Value::as_str) != Some("text")) {
            return Some((
                "response_format",
                "this server answers in text only (response_format type \"text\")",
            ));
        }
        None
    }
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionBody {
    pub prompt: Prompt,
    /// Log-probabilities of this many top tokens with each token's own (0 to 20).
    pub logprobs: Option<u32>,
    pub best_of: Option<u32>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub common: Common,
}

impl CompletionBody {
    /// The first field of a completion that asks for what this server does not do.
    pub fn unsupported(&self) -> Option<(&'static str, &'static str)> {
        if self.best_of.is_some_and(|n| n > 1) {
            return Some((
                "best_of",
                "this server makes one choice per request (best_of must be 1)",
            ));
        }
        if self.echo == Some(true) {
            return Some(("echo", "this server does not echo the prompt"));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Some(("suffix", "this server does not insert text (suffix)"));
        }
        self.common.unsupported()
    }
}

/// One chat message: its content may be null or absent on an assistant turn (one that
/// called tools, say).
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

/// A message's content: text, or parts of which only text is read.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatBody {
    pub messages: Vec<Message>,
    /// Each token's log-probability.
    #[serde(default)]
    pub logprobs: bool,
    /// And this many top tokens' (0 to 20; needs `logprobs`).
    pub top_logprobs: Option<u32>,
    #[serde(flatten)]
    pub common: Common,
}

/// One token's log-probabilities as a response carries them.
#[derive(Debug, Clone)]
pub struct TokenLp {
    /// The token's text (lossy where it holds part of a character) and bytes.
    pub text: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// The top tokens: text, bytes, log-probability.
    pub top: Vec<(String, Vec<u8>, f32)>,
}

/// A log-probability as JSON: `-9999.0` stands for minus infinity (JSON has no infinities).
fn lp_json(lp: f32) -> Value {
    json!(if lp.is_finite() { lp } else { -9999.0 })
}

/// The `logprobs` of a choice: chat's `{content: [...]}`, a completion's lists.
pub fn logprobs(kind: Kind, tokens: &[TokenLp], text_start: usize) -> Value {
    match kind {
        Kind::Chat => json!({
            "content": tokens.iter().map(|t| json!({
                "token": t.text, "logprob": lp_json(t.logprob), "bytes": t.bytes,
                "top_logprobs": t.top.iter().map(|(s, b, lp)| json!({
                    "token": s, "logprob": lp_json(*lp), "bytes": b,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "refusal": null,
        }),
        Kind::Completion => {
            let mut offset = text_start;
            let mut offsets = Vec::with_capacity(tokens.len());
            for t in tokens {
                offsets.push(offset);
                offset += t.text.chars().count();
            }
            json!({
                "tokens": tokens.iter().map(|t| t.text.as_str()).collect::<Vec<_>>(),
                "token_logprobs": tokens.iter().map(|t| lp_json(t.logprob)).collect::<Vec<_>>(),
                "top_logprobs": tokens.iter().map(|t| {
                    let mut m = serde_json::Map::new();
                    for (s, _, lp) in &t.top {
                        m.entry(s.clone()).or_insert(lp_json(*lp));
                    }
                    Value::Object(m)
                }).collect::<Vec<_>>(),
                "text_offset": offsets,
            })
        }
    }
}

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

/// The usage figures every response carries.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: CachedTokens,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct CachedTokens {
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt: usize, completion: usize, cached: usize) -> Self {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: CachedTokens {
                cached_tokens: cached,
            },
        }
    }
}

/// Who a response is: its endpoint, id, time and model.
#[derive(Debug, Clone)]
pub struct Head {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// A whole (not streamed) response.
pub fn whole(h: &Head, text: &str, logprobs: Value, finish: &str, usage: Usage) -> Value {
    let (kind, id, created, model) = (h.kind, &h.id, h.created, &h.model);
    let choice = match kind {
        Kind::Completion => json!({
            "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
        }),
        Kind::Chat => json!({
            "index": 0, "message": { "role": "assistant", "content": text, "refusal": null },
            "logprobs": logprobs, "finish_reason": finish,
        }),
    };
    json!({
        "id": id,
        "object": match kind { Kind::Completion => "text_completion", Kind::Chat => "chat.completion" },
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    })
}

/// One streamed chunk: `text` new (with its tokens' `logprobs`), `finish` on the last.
pub fn chunk(h: &Head, text: Option<&str>, logprobs: Value, finish: Option<&str>) -> Value {
    let choice = match h.kind {
        Kind::Completion => json!({
            "index": 0, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish,
        }),
        Kind::Chat => {
            let delta = match text {
                Some(t) => json!({ "role": "assistant", "content": t }),
                None => json!({}),
            };
            json!({ "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish })
        }
    };
    json!({
        "id": h.id,
        "object": stream_object(h.kind),
        "created": h.created,
        "model": h.model,
        "choices": [choice],
    })
}

/// The last chunk of a stream whose client asked for usage: no choice, the usage.
pub fn usage_chunk(h: &Head, usage: Usage) -> Value {
    json!({
        "id": h.id,
        "object": stream_object(h.kind),
        "created": h.created,
        "model": h.model,
        "choices": [],
        "usage": usage,
    })
}

fn stream_object(kind: Kind) -> &'static str {
    match kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion.chunk",
    }
}

/// The OpenAI error object, naming the field at fault where there is one.
pub fn error(message: &str, kind: &str, code: Option<&str>, param: Option<&str>) -> Value {
    json!({ "error": { "message": message, "type": kind, "param": param, "code": code } })
}
