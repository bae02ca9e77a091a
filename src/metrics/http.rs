//! The HTTP front door's metrics (`procmem_model::http`): what outside clients hold.

use metrics::Unit;

use super::{latency, metric, Kind, Metric, NONE, SECONDS};

/// Connections the HTTP server holds open.
pub const HTTP_CONNECTIONS_OPEN: Metric = metric(
    "procmem_http_connections_open",
    Kind::Gauge,
    Unit::Count,
    NONE,
    "Connections the HTTP server holds open.",
);
/// Connections accepted and served.
pub const HTTP_CONNECTIONS_TOTAL: Metric = metric(
    "procmem_http_connections_total",
    Kind::Counter,
    Unit::Count,
    NONE,
    "Connections the HTTP server accepted and served.",
);
/// Connections refused at the cap.
pub const HTTP_CONNECTIONS_REFUSED_TOTAL: Metric = metric(
    "procmem_http_connections_refused_total",
    Kind::Counter,
    Unit::Count,
    NONE,
    "Connections answered 503 (or closed unanswered) at the connection cap, every open one having a request in flight.",
);
/// Connections the server closed.
pub const HTTP_CONNECTIONS_CLOSED_TOTAL: Metric = metric(
    "procmem_http_connections_closed_total",
    Kind::Counter,
    Unit::Count,
    &["why"],
    "Connections the server closed: idle (quiet past the idle timeout), displaced (the quietest, for a newcomer at the cap) or write_timeout (its client took no byte of a response for the write timeout).",
);
/// Requests cut because their caller stopped reading.
pub const HTTP_SLOW_READERS_TOTAL: Metric = metric(
    "procmem_http_slow_readers_total",
    Kind::Counter,
    Unit::Count,
    NONE,
    "Requests cut because their caller stopped reading its stream (a client's socket full): the events unread reached the stream buffer, and the sequence was closed.",
);
/// From a request's arrival to its first token.
pub const REQUEST_FIRST_TOKEN_SECONDS: Metric = latency(
    "procmem_request_first_token_seconds",
    NONE,
    "From a request's arrival at the scheduler to its first token (time to first token).",
    SECONDS,
);
/// Between two tokens of one request.
pub const REQUEST_INTER_TOKEN_SECONDS: Metric = latency(
    "procmem_request_inter_token_seconds",
    NONE,
    "Between two consecutive tokens of one request.",
    SECONDS,
);
/// From a request's arrival to its end.
pub const REQUEST_SECONDS: Metric = latency(
    "procmem_request_seconds",
    NONE,
    "From a request's arrival at the scheduler to its last token, for requests that finished.",
    SECONDS,
);
/// Bodies refused for the shared body buffer.
pub const HTTP_BODIES_REFUSED_TOTAL: Metric = metric(
    "procmem_http_bodies_refused_total",
    Kind::Counter,
    Unit::Count,
    NONE,
    "Request bodies answered 503: the shared body buffer had no room for them within a second.",
);
/// Bodies that did not arrive in time.
pub const HTTP_BODIES_TIMED_OUT_TOTAL: Metric = metric(
    "procmem_http_bodies_timed_out_total",
    Kind::Counter,
    Unit::Count,
    NONE,
    "Request bodies answered 408: not whole within the body timeout.",
);

/// The HTTP metrics, in the order of docs/metrics.md.
pub(super) const HTTP: &[Metric] = &[
    HTTP_CONNECTIONS_OPEN,
    HTTP_CONNECTIONS_TOTAL,
    HTTP_CONNECTIONS_REFUSED_TOTAL,
    HTTP_CONNECTIONS_CLOSED_TOTAL,
    HTTP_SLOW_READERS_TOTAL,
    REQUEST_FIRST_TOKEN_SECONDS,
    REQUEST_INTER_TOKEN_SECONDS,
    REQUEST_SECONDS,
    HTTP_BODIES_REFUSED_TOTAL,
    HTTP_BODIES_TIMED_OUT_TOTAL,
];
