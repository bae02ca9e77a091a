//! The OpenAI API's request and response bodies, as far as this server reads and writes them.
//! Fields it does not know are ignored (clients send many); a known field of the wrong type
//! is a 400.

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
    pub stop: Option<OneOrMany>,
    pub n: Option<u32>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionBody {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub common: Common,
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Content,
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
    #[serde(flatten)]
    pub common: Common,
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

/// A whole (not streamed) response.
pub fn whole(
    kind: Kind,
    id: &str,
    created: u64,
    model: &str,
    text: &str,
    finish: &str,
    usage: Usage,
) -> Value {
    let choice = match kind {
        Kind::Completion => json!({
            "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
        }),
        Kind::Chat => json!({
            "index": 0, "message": { "role": "assistant", "content": text },
            "logprobs": null, "finish_reason": finish,
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

/// One streamed chunk: `text` new, `finish` on the last, `usage` on the last.
pub fn chunk(
    kind: Kind,
    id: &str,
    created: u64,
    model: &str,
    text: Option<&str>,
    finish: Option<&str>,
    usage: Option<Usage>,
) -> Value {
    let choice = match kind {
        Kind::Completion => json!({
            "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish,
        }),
        Kind::Chat => {
            let delta = match text {
                Some(t) => json!({ "role": "assistant", "content": t }),
                None => json!({}),
            };
            json!({ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish })
        }
    };
    let mut v = json!({
        "id": id,
        "object": match kind { Kind::Completion => "text_completion", Kind::Chat => "chat.completion.chunk" },
        "created": created,
        "model": model,
        "choices": [choice],
    });
    if let Some(u) = usage {
        v["usage"] = json!(u);
    }
    v
}

/// The OpenAI error object.
pub fn error(message: &str, kind: &str, code: Option<&str>) -> Value {
    json!({ "error": { "message": message, "type": kind, "param": null, "code": code } })
}
