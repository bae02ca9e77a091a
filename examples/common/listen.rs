//! The main job's `--listen ADDR`: the real model behind the OpenAI-compatible API
//! (`procmem_model::http`) on the same tokio runtime, until Ctrl-C or SIGTERM; then no new
//! connection is taken, requests in flight have the grace period to finish (the rest are
//! cancelled and their sequences closed), and the caller shuts the memory down.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use procmem_actors::MemoryManager;
use procmem_model::http::{Api, MetricsText};
use procmem_model::scheduler::{SchedulerConfig, SchedulerHandle, SchedulerStats};
use procmem_model::{Engine, TextCodec};

/// How the API is served.
pub struct Listen {
    /// Where.
    pub addr: SocketAddr,
    /// Requests waiting at most (more get 429).
    pub max_waiting: usize,
    /// Requests running at once at most.
    pub max_running: usize,
    /// Tokens a completion gets when the request names no `max_tokens`.
    pub default_max_tokens: usize,
    /// How long requests in flight have at shutdown.
    pub grace: Duration,
    /// Request bodies over this many bytes get 413.
    pub body_limit: usize,
}

/// Waits for Ctrl-C or SIGTERM.
async fn stop_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cannot watch SIGTERM ({e}): Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Serves `engine` until a stop signal; returns what the scheduler did. The engine is
/// dropped here, after the last request ended.
pub async fn serve_http(
    engine: Engine,
    codec: TextCodec,
    memory: &MemoryManager,
    l: &Listen,
) -> Result<SchedulerStats, String> {
    let engine = Arc::new(engine);
    let codec = Arc::new(codec);
    let detok = {
        let codec = Arc::clone(&codec);
        Arc::new(move |ids: &[u32]| codec.decode(ids).unwrap_or_default())
    };
    let config = SchedulerConfig::new(engine.shape.max_tokens)
        .step_tokens(engine.step_tokens)
        .max_running(l.max_running)
        .max_waiting(l.max_waiting)
        .detokenize(detok);
    let (scheduler, task) = SchedulerHandle::spawn(Arc::clone(&engine), config);
    let metrics: MetricsText = {
        let memory = memory.clone();
        Arc::new(move || memory.metrics_text())
    };
    let api = Arc::new(Api::new(
        scheduler.clone(),
        codec,
        "smollm2-135m-instruct",
        l.default_max_tokens,
        Some(metrics),
    ));
    let listener = tokio::net::TcpListener::bind(l.addr)
        .await
        .map_err(|e| format!("--listen {}: {e}", l.addr))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    println!(
        "listening on http://{local} (POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, /metrics)"
    );
    let grace = l.grace;
    let stop = {
        let scheduler = scheduler.clone();
        async move {
            stop_signal().await;
            println!("stopping: no new requests; {grace:?} for those in flight");
            scheduler.shutdown(grace);
        }
    };
    let server = axum::serve(listener, api.router(l.body_limit)).with_graceful_shutdown(stop);
    // Connections the scheduler's end did not close (a client idling on keep-alive) are
    // not waited for past the grace period and a little more.
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(async move {
        let result = server.await;
        let _ = done_tx.send(());
        result
    });
    let stats = task
        .await
        .map_err(|e| format!("the scheduler failed: {e}"))?;
    if tokio::time::timeout(Duration::from_secs(2), done_rx)
        .await
        .is_err()
    {
        serving.abort();
    } else if let Ok(Err(e)) = serving.await {
        return Err(format!("the HTTP server failed: {e}"));
    }
    drop(scheduler);
    drop(engine);
    Ok(stats)
}
