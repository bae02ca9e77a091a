//! Request bodies, bounded: one body in bytes and in time, all bodies being read at once in
//! bytes. A `Content-Length` over the limit is refused before a byte of the body is read;
//! the bytes a body will take are set aside from a budget shared by every connection before
//! it is read (a body without a length sets aside the whole limit), and given back as soon as
//! it is parsed.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRef, FromRequest, Request};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use axum::Json;
use http_body_util::{BodyExt, Limited};
use procmem_actors::procmem::metrics::{HTTP_BODIES_REFUSED_TOTAL, HTTP_BODIES_TIMED_OUT_TOTAL};
use serde::de::DeserializeOwned;
use tokio::sync::Semaphore;

use super::errors::{refuse, rejected, too_large};

/// How long a request waits for room in the shared body budget before it gets `503`.
const BUDGET_WAIT: Duration = Duration::from_secs(1);

/// The bounds on request bodies the API applies (cheap to clone: the budget is shared).
#[derive(Clone)]
pub(super) struct Bodies {
    limit: usize,
    timeout: Duration,
    budget: Arc<Semaphore>,
    total: usize,
}

impl Bodies {
    /// `limit` bytes a body, `timeout` to read it, `total` bytes of bodies at once.
    pub(super) fn new(limit: usize, timeout: Duration, total: usize) -> Self {
        // A semaphore counts at most `u32::MAX` permits a call, and one body must fit.
        let total = total.clamp(limit.max(1), u32::MAX as usize);
        Bodies {
            limit,
            timeout,
            budget: Arc::new(Semaphore::new(total)),
            total,
        }
    }
}

/// Whether the content type is JSON (`application/json`, `application/*+json`).
fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let mime = value.split(';').next().unwrap_or("").trim();
    let Some((kind, sub)) = mime.split_once('/') else {
        return false;
    };
    kind.eq_ignore_ascii_case("application")
        && (sub.eq_ignore_ascii_case("json") || sub.to_ascii_lowercase().ends_with("+json"))
}

/// A JSON body read within the bounds of [`Bodies`]; its refusals are OpenAI error objects.
pub(super) struct Bounded<T>(pub(super) T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Bounded<T>
where
    Bodies: FromRef<S>,
{
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        let b = Bodies::from_ref(state);
        if !is_json(req.headers()) {
            return Err(refuse(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request_error",
                None,
                "expected a request with `content-type: application/json`",
            ));
        }
        let declared = match req.headers().get(header::CONTENT_LENGTH) {
            None => None,
            Some(v) => match v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok()) {
                Some(n) => Some(n),
                None => {
                    return Err(refuse(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        None,
                        "a content-length that is not a number",
                    ))
                }
            },
        };
        if declared.is_some_and(|n| n > b.limit as u64) {
            return Err(too_large());
        }
        let want = declared.map_or(b.limit, |n| n as usize).clamp(1, b.total) as u32;
        let permit =
            match tokio::time::timeout(BUDGET_WAIT, Arc::clone(&b.budget).acquire_many_owned(want))
                .await
            {
                Ok(Ok(p)) => p,
                _ => {
                    HTTP_BODIES_REFUSED_TOTAL.counter(&[]).increment(1);
                    return Err(refuse(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "server_error",
                        Some("server_busy"),
                        "too many request bodies are being read: try again",
                    ));
                }
            };
        let body = Limited::new(req.into_body(), b.limit);
        let bytes = match tokio::time::timeout(b.timeout, body.collect()).await {
            Ok(Ok(collected)) => collected.to_bytes(),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => return Err(too_large()),
            Ok(Err(e)) => {
                return Err(refuse(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    None,
                    &format!("the request body could not be read: {e}"),
                ))
            }
            Err(_) => {
                HTTP_BODIES_TIMED_OUT_TOTAL.counter(&[]).increment(1);
                return Err(refuse(
                    StatusCode::REQUEST_TIMEOUT,
                    "invalid_request_error",
                    Some("request_timeout"),
                    "the request body did not arrive in time",
                ));
            }
        };
        let parsed = Json::<T>::from_bytes(&bytes).map_err(rejected);
        drop(bytes);
        drop(permit);
        parsed.map(|Json(v)| Bounded(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_content_types_are_recognised() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, v.parse().unwrap());
            is_json(&h)
        };
        assert!(with("application/json"));
        assert!(with("Application/JSON; charset=utf-8"));
        assert!(with("application/cloudevents+json"));
        assert!(!with("text/json"));
        assert!(!with("application/jsonx"));
        assert!(!is_json(&HeaderMap::new()));
    }
}
