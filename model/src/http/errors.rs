//! Refusals as OpenAI error objects, each with its status.

use axum::extract::rejection::JsonRejection;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::wire;
use crate::scheduler::GenError;

/// An OpenAI error response; `429` and `503` say when to try again.
pub(super) fn refuse(
    status: StatusCode,
    kind: &str,
    code: Option<&str>,
    message: &str,
) -> Response {
    refuse_param(status, kind, code, None, message)
}

/// An OpenAI error response naming the request's field at fault.
pub(super) fn refuse_param(
    status: StatusCode,
    kind: &str,
    code: Option<&str>,
    param: Option<&str>,
    message: &str,
) -> Response {
    let mut r = (status, Json(wire::error(message, kind, code, param))).into_response();
    if matches!(
        status,
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
    ) {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// `400`: the client's mistake.
pub(super) fn bad(message: &str) -> Response {
    refuse(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        None,
        message,
    )
}

/// `400` naming `field`.
pub(super) fn bad_field(field: &str, message: &str) -> Response {
    refuse_param(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        None,
        Some(field),
        message,
    )
}

/// A body that is not the JSON asked for.
pub(super) fn rejected(r: JsonRejection) -> Response {
    let status = r.status();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        return too_large();
    }
    // Not JSON, the wrong content type, or a field of the wrong type: the client's mistake.
    let status = if status == StatusCode::UNSUPPORTED_MEDIA_TYPE {
        status
    } else {
        StatusCode::BAD_REQUEST
    };
    refuse(status, "invalid_request_error", None, &r.body_text())
}

/// `413`.
pub(super) fn too_large() -> Response {
    refuse(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        Some("request_too_large"),
        "the request body is over the size limit",
    )
}

/// The scheduler's refusal or failure, as the client should read it.
pub(super) fn gen_refused(e: &GenError) -> Response {
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
