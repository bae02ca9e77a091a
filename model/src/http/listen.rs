//! The listen loop and what it bounds: every connection a client can hold is counted, timed
//! and given back when the client goes (design invariant 18).
//!
//! - **Open connections** are capped ([`Limits::max_connections`], by default derived from
//!   `RLIMIT_NOFILE` less the descriptors the process already holds and a headroom for the
//!   model, the KV tiers and the node link). At the cap a new connection takes the place of
//!   the connection that has been quiet longest with no request in flight; where every
//!   connection has a request in flight it gets a quick `503` and is closed.
//! - **A request's head** must arrive whole within [`Limits::header_timeout`] of the
//!   connection starting to wait for it (hyper's header read timeout: a slow-header client
//!   is closed, and so is one that sends nothing).
//! - **A quiet connection** (no request in flight, no byte read) is closed after
//!   [`Limits::idle_timeout`] (or the header timeout, whichever comes first: hyper's timer
//!   runs while a connection waits for a head).
//! - **Request bodies** are bounded per request and as a whole (`body.rs`).
//! - **A client that stops reading**: a response write that finds its socket full for
//!   [`Limits::write_timeout`] fails and the connection closes; meanwhile the request's
//!   stream holds at most [`STREAM_EVENTS`](super::STREAM_EVENTS) events unread, past which
//!   the scheduler cuts the request and closes its sequence (the step never waits for it).
//!
//! Shutdown: the first stop signal stops taking connections and asks the scheduler to drain
//! (requests in flight have the grace period); a second ends the grace at once.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use procmem_actors::procmem::metrics::{
    HTTP_CONNECTIONS_CLOSED_TOTAL, HTTP_CONNECTIONS_OPEN, HTTP_CONNECTIONS_REFUSED_TOTAL,
    HTTP_CONNECTIONS_TOTAL,
};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

/// File descriptors kept free of connections for the rest of the process: the model file,
/// the KV store's memory files and disk tier, the node link, logs.
pub const FD_HEADROOM: usize = 128;
/// The fewest connections a derived cap allows.
const MIN_CONNECTIONS: usize = 16;
/// Connections over the cap being answered `503` at once, at most; more are closed unanswered.
const REFUSING_AT_ONCE: usize = 64;
/// How long a refused connection's `503` may take to write.
const REFUSE_WRITE: Duration = Duration::from_secs(1);
/// How long a connection over the cap waits for the one it displaced to close.
const DISPLACE_WAIT: Duration = Duration::from_secs(1);
/// How long connections still open after the scheduler ended get before they are cut.
const LAST_CONNECTIONS: Duration = Duration::from_secs(2);

/// What a client may hold, and for how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// A request's head must arrive within this of the connection waiting for it.
    pub header_timeout: Duration,
    /// A connection with no request in flight that sends nothing for this long is closed.
    pub idle_timeout: Duration,
    /// A request's body must arrive whole within this of its head.
    pub body_timeout: Duration,
    /// A connection whose socket takes no byte of a response for this long (its client
    /// stopped reading) is closed.
    pub write_timeout: Duration,
    /// Bytes of unsent response the kernel holds for one connection (`SO_SNDBUF`, which
    /// Linux doubles; without it the kernel grows a connection's buffer to megabytes for a
    /// client that reads nothing).
    pub send_buffer: usize,
    /// Connections open at once at most.
    pub max_connections: usize,
    /// One request's body in bytes at most (more gets `413`, at once where its
    /// `Content-Length` says so).
    pub body_limit: usize,
    /// Bytes of request bodies being read at once, over all connections, at most: a request
    /// that would pass it waits briefly for room, then gets `503`.
    pub body_buffer: usize,
}

impl Default for Limits {
    /// 10 s for a head, 5 s quiet, 30 s for a body, 30 s for a blocked write, 64 KiB of
    /// unsent response a connection, 1 MiB a body and 32 MiB of bodies at once, and the
    /// connection cap this process's descriptor limit allows ([`connection_cap`]).
    fn default() -> Self {
        Limits {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            send_buffer: 64 << 10,
            max_connections: connection_cap(),
            body_limit: 1 << 20,
            body_buffer: 32 << 20,
        }
    }
}

/// The connections this process can hold open: its soft `RLIMIT_NOFILE`, less the
/// descriptors open now and [`FD_HEADROOM`] (at least 16).
pub fn connection_cap() -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX)
        .min(1 << 20) as usize;
    let open = std::fs::read_dir("/proc/self/fd").map_or(64, |d| d.count());
    limit
        .saturating_sub(open)
        .saturating_sub(FD_HEADROOM)
        .max(MIN_CONNECTIONS)
}

/// Stop signals as they come: the first drains, a second ends the grace at once.
pub type StopSignals = mpsc::UnboundedReceiver<()>;

/// Ctrl-C and SIGTERM, each time one comes, for [`serve_router`]'s stop.
pub fn os_signals() -> StopSignals {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let (mut term, mut int) = match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(t), Ok(i)) => (t, i),
            (Err(e), _) | (_, Err(e)) => {
                tracing::error!(error = %e, "cannot watch SIGTERM and SIGINT: no graceful stop");
                return;
            }
        };
        loop {
            tokio::select! {
                Some(()) = term.recv() => {}
                Some(()) = int.recv() => {}
                else => return,
            }
            if tx.send(()).is_err() {
                return;
            }
        }
    });
    rx
}

/// One open connection as the table sees it: shared by its reader, its requests and the table.
struct Activity {
    /// Requests whose response has not ended.
    in_flight: AtomicUsize,
    /// Milliseconds since the table's start of the last byte read or response ended.
    last: AtomicU64,
    base: Instant,
}

impl Activity {
    fn touch(&self) {
        self.last
            .store(self.base.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// How long it has been quiet with nothing in flight (`None`: a request is in flight).
    fn quiet(&self, now_ms: u64) -> Option<u64> {
        (self.in_flight.load(Ordering::Acquire) == 0)
            .then(|| now_ms.saturating_sub(self.last.load(Ordering::Relaxed)))
    }
}

/// Counts a request in flight until its response body ends (or is dropped).
struct InFlight(Arc<Activity>);

impl InFlight {
    fn new(a: &Arc<Activity>) -> Self {
        a.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(Arc::clone(a))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

struct Entry {
    activity: Arc<Activity>,
    close: oneshot::Sender<()>,
}

/// The open connections.
struct Table {
    base: Instant,
    next: u64,
    open: HashMap<u64, Entry>,
}

impl Table {
    fn now_ms(&self) -> u64 {
        self.base.elapsed().as_millis() as u64
    }

    /// Closes the connection quiet longest with nothing in flight; false where there is none.
    fn evict_quietest(&mut self) -> bool {
        let now = self.now_ms();
        let victim = self
            .open
            .iter()
            .filter_map(|(id, e)| e.activity.quiet(now).map(|q| (q, *id)))
            .max()
            .map(|(_, id)| id);
        victim.is_some_and(|id| self.close(id, "displaced"))
    }

    /// Closes connection `id` (its task drops the socket), counted under `why`.
    fn close(&mut self, id: u64, why: &str) -> bool {
        let Some(e) = self.open.remove(&id) else {
            return false;
        };
        let _ = e.close.send(());
        HTTP_CONNECTIONS_CLOSED_TOTAL.counter(&[why]).increment(1);
        true
    }

    /// Closes every connection quiet for `idle` or longer.
    fn close_idle(&mut self, idle: Duration) {
        let now = self.now_ms();
        let idle = idle.as_millis() as u64;
        let quiet: Vec<u64> = self
            .open
            .iter()
            .filter(|(_, e)| e.activity.quiet(now).is_some_and(|q| q >= idle))
            .map(|(id, _)| *id)
            .collect();
        for id in quiet {
            self.close(id, "idle");
        }
    }
}

type Shared = Arc<Mutex<Table>>;

fn lock(t: &Shared) -> std::sync::MutexGuard<'_, Table> {
    t.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A connection's socket, noting when it last read a byte, and failing a write that has
/// been blocked for the write timeout (the client stopped reading: the connection ends).
struct Watched {
    io: TcpStream,
    activity: Arc<Activity>,
    write_timeout: Duration,
    /// Set when a write found the socket full; cleared when one goes through.
    blocked: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Watched {
    /// What a write that `polled` becomes: pending until the socket has been full for the
    /// write timeout, then `TimedOut`.
    fn timed<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.blocked = None;
            return polled;
        }
        let timeout = self.write_timeout;
        let blocked = self
            .blocked
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match blocked.as_mut().poll(cx) {
            Poll::Ready(()) => {
                HTTP_CONNECTIONS_CLOSED_TOTAL
                    .counter(&["write_timeout"])
                    .increment(1);
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client took no byte for the write timeout",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.timed(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.timed(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.timed(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The answer a connection over the cap gets before it is closed.
const OVER_CAP: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
retry-after: 1\r\nconnection: close\r\ncontent-length: 115\r\n\r\n\
{\"error\":{\"message\":\"too many open connections\",\"type\":\"server_error\",\"param\":null,\"code\":\"too_many_connections\"}}\n";

/// A bound listener: where it listens, and the loop that serves it.
pub struct Listening {
    listener: TcpListener,
    /// The address it listens on (the port chosen where `:0` was asked).
    pub local: SocketAddr,
}

/// What the listen loop hands every connection.
struct Front {
    router: Router,
    limits: Limits,
    table: Shared,
    /// One permit per open connection, held until its socket is closed: the descriptors
    /// connections hold never pass the cap, even while displaced ones are still closing.
    slots: Arc<Semaphore>,
    refusing: Arc<Semaphore>,
    stop: watch::Receiver<bool>,
}

impl Listening {
    /// Binds `addr`.
    pub async fn bind(addr: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        Ok(Listening { listener, local })
    }

    /// Serves `router` under `limits` until `stop` fires (or is dropped), then closes every
    /// connection without a request in flight at once and lets the others end their
    /// response; `finished` resolving ends those still open after [`LAST_CONNECTIONS`] more.
    pub async fn serve(
        self,
        router: Router,
        limits: Limits,
        mut stop: watch::Receiver<bool>,
        finished: impl Future<Output = ()>,
    ) {
        let cap = limits.max_connections.max(1);
        let front = Front {
            router,
            table: Arc::new(Mutex::new(Table {
                base: Instant::now(),
                next: 0,
                open: HashMap::new(),
            })),
            slots: Arc::new(Semaphore::new(cap)),
            // Refusals take descriptors too, for a moment: a few, where descriptors are few.
            refusing: Arc::new(Semaphore::new(REFUSING_AT_ONCE.min(cap / 4).max(1))),
            stop: stop.clone(),
            limits,
        };
        let mut conns = JoinSet::new();
        let tick = (front.limits.idle_timeout / 4).max(Duration::from_millis(50));
        let mut sweep = tokio::time::interval(tick);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut accept_errors = 0u64;
        loop {
            tokio::select! {
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, _)) => front.take(stream, &mut conns).await,
                    Err(e) => {
                        // Out of descriptors, most often: the connections in the backlog wait.
                        accept_errors += 1;
                        if accept_errors.is_power_of_two() {
                            let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
                            tracing::warn!(error = %e, times = accept_errors, open, "accept failed");
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                },
                _ = sweep.tick() => lock(&front.table).close_idle(front.limits.idle_timeout),
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
                _ = stop.changed() => break,
            }
            let open = lock(&front.table).open.len();
            HTTP_CONNECTIONS_OPEN.gauge(&[]).set(open as f64);
        }
        drop(self.listener);
        // Quiet connections close now; the rest end their response (each saw `stop`).
        lock(&front.table).close_idle(Duration::ZERO);
        tokio::pin!(finished);
        loop {
            tokio::select! {
                joined = conns.join_next() => if joined.is_none() { return },
                _ = &mut finished => break,
            }
        }
        let _ = tokio::time::timeout(LAST_CONNECTIONS, async {
            while conns.join_next().await.is_some() {}
        })
        .await;
        conns.abort_all();
        HTTP_CONNECTIONS_OPEN.gauge(&[]).set(0.0);
    }
}

impl Front {
    /// One accepted connection: served under the limits (at the cap in the place of the
    /// connection quiet longest, once that one has closed), or refused.
    async fn take(&self, stream: TcpStream, conns: &mut JoinSet<()>) {
        let slot = match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(slot) => Some(slot),
            Err(_) if lock(&self.table).evict_quietest() => {
                let freed = Arc::clone(&self.slots).acquire_owned();
                tokio::time::timeout(DISPLACE_WAIT, freed)
                    .await
                    .ok()
                    .and_then(Result::ok)
            }
            Err(_) => None,
        };
        match slot {
            Some(slot) => self.spawn(stream, slot, conns),
            None => {
                HTTP_CONNECTIONS_REFUSED_TOTAL.counter(&[]).increment(1);
                refuse(stream, &self.refusing);
            }
        }
    }

    /// Serves `stream` on a task of its own, holding `slot` until its socket is closed.
    fn spawn(&self, stream: TcpStream, slot: OwnedSemaphorePermit, conns: &mut JoinSet<()>) {
        let mut t = lock(&self.table);
        let activity = Arc::new(Activity {
            in_flight: AtomicUsize::new(0),
            last: AtomicU64::new(t.now_ms()),
            base: t.base,
        });
        let (close, closed) = oneshot::channel();
        t.next += 1;
        let id = t.next;
        t.open.insert(
            id,
            Entry {
                activity: Arc::clone(&activity),
                close,
            },
        );
        drop(t);
        HTTP_CONNECTIONS_TOTAL.counter(&[]).increment(1);
        // The kernel's buffer for unsent bytes stays as set (no autotuning to megabytes).
        if let Err(e) = rustix::net::sockopt::set_socket_send_buffer_size(
            &stream,
            self.limits.send_buffer.max(4096),
        ) {
            tracing::debug!(error = %e, "SO_SNDBUF not set");
        }
        let io = TokioIo::new(Watched {
            io: stream,
            activity: Arc::clone(&activity),
            write_timeout: self.limits.write_timeout,
            blocked: None,
        });
        let router = self.router.clone();
        let service =
            hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let guard = InFlight::new(&activity);
                let router = router.clone();
                async move {
                    let response = tower::ServiceExt::oneshot(router, req.map(Body::new)).await?;
                    // The request counts as in flight until its body (a stream, say) has ended.
                    Ok::<_, std::convert::Infallible>(response.map(|b| {
                        Body::new(http_body_util::BodyExt::map_frame(b, move |f| {
                            let _ = &guard;
                            f
                        }))
                    }))
                }
            });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(self.limits.header_timeout)
            .max_buf_size(64 << 10);
        let table = Arc::clone(&self.table);
        let mut stop = self.stop.clone();
        conns.spawn(async move {
            // Dropped last: the socket is closed before the slot is free.
            let _slot = slot;
            let conn = builder.serve_connection(io, service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                // Displaced or idle: nothing is in flight, the socket simply closes.
                _ = closed => {}
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            lock(&table).open.remove(&id);
        });
    }
}

/// A quick `503` to a connection over the cap, then close; closed unanswered where many are
/// being refused already. The request's first bytes are read first and the client's end is
/// waited for briefly after, so the close does not reset the connection under the answer.
fn refuse(mut stream: TcpStream, refusing: &Arc<Semaphore>) {
    use tokio::io::AsyncReadExt;
    let Ok(permit) = Arc::clone(refusing).try_acquire_owned() else {
        return;
    };
    tokio::spawn(async move {
        let _ = tokio::time::timeout(REFUSE_WRITE, async {
            let mut buf = [0u8; 4096];
            let _ = tokio::time::timeout(REFUSE_WRITE / 10, stream.read(&mut buf)).await;
            stream.write_all(OVER_CAP).await?;
            stream.shutdown().await?;
            while stream.read(&mut buf).await? > 0 {}
            Ok::<_, io::Error>(())
        })
        .await;
        drop(permit);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_says_its_length_right() {
        let text = std::str::from_utf8(OVER_CAP).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let declared: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(declared, body.len());
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
    }

    #[test]
    fn the_derived_cap_leaves_headroom_under_the_descriptor_limit() {
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        let cap = connection_cap();
        assert!(cap >= MIN_CONNECTIONS);
        if limit < (1 << 20) && limit as usize > FD_HEADROOM + MIN_CONNECTIONS + 64 {
            assert!((cap + FD_HEADROOM) as u64 <= limit, "{cap} of {limit}");
        }
    }
}
