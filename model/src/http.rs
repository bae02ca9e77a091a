//! An OpenAI-compatible HTTP server over the scheduler (cargo feature `http`, on axum and
//! hyper): `POST /v1/completions` and `POST /v1/chat/completions` (the model's chat
//! template), whole or streamed as server-sent events ending with `data: [DONE]`;
//! `GET /v1/models`, `GET /health` and `GET /metrics`. Every whole response carries its usage
//! figures, with the prompt tokens that came from the prefix cache
//! (`prompt_tokens_details.cached_tokens`); a stream carries them in a last chunk with
//! `choices: []` where the request asked (`stream_options.include_usage`).
//!
//! - [`Server`] is the whole server: bind, then [`Server::run`] the scheduler, the routes
//!   and the listen loop under [`Limits`] until the stop signals (the first drains within
//!   the grace period, a second ends it at once).
//! - [`Api`] is the routes alone, for an embedder with a listen loop of its own.
//!
//! Bad input gets the OpenAI error object and its status, never a panic: a body that is not
//! JSON or has a known field of the wrong type, `max_tokens` 0 or past the context, a prompt
//! that fills the context, a field asking for what this server does not do (400, naming the
//! field), a body over the size limit (413, at once where its `Content-Length` says so), a
//! body that does not arrive in time (408), a full queue (429 with `Retry-After`), a server
//! shutting down or out of room for bodies or connections (503). A client that goes away
//! mid-request drops its stream, which cancels the request: its sequence is closed and its
//! memory comes back; a queued one never starts.
//!
//! Text from a user (a message, a text prompt, a stop string) is text: a control token's
//! name written in it is encoded as its characters, so a control token comes only from the
//! chat template (design invariant 17).

mod api;
mod body;
mod errors;
mod idle;
mod listen;
mod server;
mod text;
mod wire;

pub use api::{Api, MetricsText};
pub use listen::{connection_cap, os_signals, Limits, Listening, StopSignals, FD_HEADROOM};
pub use server::{serve_bound, serve_model, ServeConfig, ServeError, Server, STREAM_EVENTS};
