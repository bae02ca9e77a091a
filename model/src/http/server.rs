//! The server as one value: the scheduler over an engine, the routes, the listen loop with
//! its limits, and the drain on the stop signals, for a binary to start with its flags.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::api::{Api, MetricsText};
use super::listen::{Limits, Listening, StopSignals};
use crate::launch::Started;
use crate::scheduler::{SchedulerConfig, SchedulerHandle, SchedulerStats};
use crate::serve::Engine;
use crate::tokenizer::TextCodec;

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Where it listens.
    pub addr: SocketAddr,
    /// The model's name in responses and `/v1/models`.
    pub model_name: String,
    /// Requests waiting at most (more get 429).
    pub max_waiting: usize,
    /// Requests running at once at most.
    pub max_running: usize,
    /// Tokens a completion gets when the request names no `max_tokens`.
    pub default_max_tokens: usize,
    /// How long requests in flight have after the first stop signal.
    pub grace: Duration,
    /// What a client may hold.
    pub limits: Limits,
}

/// Why the server could not start or ended badly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The address could not be bound.
    #[error("listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The scheduler's task panicked.
    #[error("the scheduler failed: {0}")]
    Scheduler(#[source] tokio::task::JoinError),
}

/// Events a request's stream holds for a connection that is not taking them (its socket
/// full): about 4 KiB; past them the request is cut and its sequence closed, and the write
/// timeout closes the connection.
pub const STREAM_EVENTS: usize = 64;

/// A bound server, not yet serving.
pub struct Server {
    listening: Listening,
    config: ServeConfig,
    idle_after: Option<Duration>,
}

/// The connection cap was maybe derived before the model and the KV store took descriptors:
/// no more than the descriptor limit leaves room for now.
fn clamp_connections(limits: &mut Limits) {
    let cap = super::listen::connection_cap();
    if limits.max_connections > cap {
        tracing::info!(
            asked = limits.max_connections,
            cap,
            "fewer connections than asked: the descriptor limit leaves room for these"
        );
        limits.max_connections = cap;
    }
}

impl Server {
    /// Binds `config.addr`.
    pub async fn bind(config: ServeConfig) -> Result<Self, ServeError> {
        let listening = Listening::bind(config.addr)
            .await
            .map_err(|source| ServeError::Bind {
                addr: config.addr,
                source,
            })?;
        Ok(Server {
            listening,
            config,
            idle_after: None,
        })
    }

    /// Offloads the model's layers once no request has come or run for `after` (an idle
    /// server's sleep: its memory can go to others); the next request brings them back as
    /// each is used. `None` (the default): the layers stay.
    pub fn idle_after(mut self, after: Option<Duration>) -> Self {
        self.idle_after = after;
        self
    }

    /// Where it listens (the port chosen where `:0` was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.listening.local
    }

    /// Serves `engine` until the stop signals; returns what the scheduler did, every request
    /// counted once (finished, cancelled, cut by shutdown or failed). The engine is dropped
    /// after the last request ended, before this returns.
    pub async fn run(
        self,
        engine: Engine,
        codec: TextCodec,
        metrics: Option<MetricsText>,
        mut signals: StopSignals,
    ) -> Result<SchedulerStats, ServeError> {
        let mut c = self.config;
        clamp_connections(&mut c.limits);
        let engine = Arc::new(engine);
        let codec = Arc::new(codec);
        let detok = {
            let codec = Arc::clone(&codec);
            Arc::new(move |ids: &[u32]| codec.decode(ids).unwrap_or_default())
        };
        let scheduler_config = SchedulerConfig::new(engine.shape.max_tokens)
            .step_tokens(engine.step_tokens)
            .max_running(c.max_running)
            .max_waiting(c.max_waiting)
            .stream_buffer(STREAM_EVENTS)
            .detokenize(detok);
        let (scheduler, task) = SchedulerHandle::spawn(Arc::clone(&engine), scheduler_config);
        let sleep =
            |after| super::idle::sleep_when_idle(scheduler.clone(), engine.weights.clone(), after);
        let idle = self.idle_after.map(sleep);
        let api = Api::new(
            scheduler.clone(),
            codec,
            c.model_name.clone(),
            c.default_max_tokens,
            metrics,
        )
        .limits(&c.limits);
        let (stop_tx, stop_rx) = watch::channel(false);
        let grace = c.grace;
        let drain = {
            let scheduler = scheduler.clone();
            tokio::spawn(async move {
                if signals.recv().await.is_none() {
                    return;
                }
                tracing::info!(
                    ?grace,
                    "stopping: no new requests; a second signal ends the grace at once"
                );
                scheduler.shutdown(grace);
                let _ = stop_tx.send(true);
                if signals.recv().await.is_some() {
                    tracing::warn!("second stop signal: the requests in flight are cut now");
                    scheduler.shutdown(Duration::ZERO);
                }
                // The stop stays raised until the server ends.
                std::future::pending::<()>().await;
            })
        };
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(self.listening.serve(
            Arc::new(api).router(),
            c.limits.clone(),
            stop_rx,
            async move {
                let _ = done_rx.await;
            },
        ));
        let stats = task.await;
        idle.iter().for_each(tokio::task::JoinHandle::abort);
        let _ = done_tx.send(());
        let _ = serving.await;
        drain.abort();
        drop(scheduler);
        drop(engine);
        stats.map_err(ServeError::Scheduler)
    }
}

/// Serves `engine` (started by [`Launch::start`](crate::launch::Launch::start) on `memory`)
/// until the process's stop signals: binds `config.addr`, tells `listening` where it
/// listens, and runs with `memory`'s metrics at `/metrics`. Returns what the scheduler did
/// once every request ended and the engine is gone; the caller shuts `memory` down (and
/// leaves its node) after.
pub async fn serve_model(
    started: Started,
    memory: &procmem_actors::MemoryManager,
    config: ServeConfig,
    idle_after: Option<Duration>,
    listening: impl FnOnce(SocketAddr),
) -> Result<SchedulerStats, ServeError> {
    let server = Server::bind(config).await?;
    serve_bound(server, started, memory, idle_after, listening).await
}

/// [`serve_model`] on a server already bound: a server that joins a node binds its port
/// first, so one that cannot listen (a port taken) never takes the node's credit.
pub async fn serve_bound(
    server: Server,
    Started { engine, codec }: Started,
    memory: &procmem_actors::MemoryManager,
    idle_after: Option<Duration>,
    listening: impl FnOnce(SocketAddr),
) -> Result<SchedulerStats, ServeError> {
    let server = server.idle_after(idle_after);
    listening(server.local_addr());
    let metrics: MetricsText = {
        let memory = memory.clone();
        Arc::new(move || memory.metrics_text())
    };
    let signals = super::listen::os_signals();
    server.run(engine, codec, Some(metrics), signals).await
}
