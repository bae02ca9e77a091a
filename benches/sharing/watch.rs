//! The sharing bench's watcher: every 100 ms, what each server's ledger approves (its
//! `/metrics`), its resident set, and, where a node lends the memory, each server's credit.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use procmem_actors::node::NodeHandle;
use serde_json::{json, Value};

use super::client::{get, metric};
use super::servers::{status_kb, Server};

/// One sample, per server (in the row's order).
#[derive(Clone, Debug, Default)]
struct Sample {
    at: Duration,
    approved: Vec<u64>,
    /// Requests waiting in each server's Governor.
    waiting: Vec<u64>,
    rss: Vec<u64>,
    /// Node credit; empty without a node.
    credit: Vec<u64>,
    /// What the node lent in all.
    lent: u64,
}

/// What the watcher saw.
pub struct Seen {
    samples: Vec<Sample>,
}

/// A watcher running until [`Watcher::stop`].
pub struct Watcher {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Seen>,
}

const MIB: u64 = 1 << 20;

impl Watcher {
    /// Samples `servers` (and `node`) from now on.
    pub fn start(servers: &[Server], node: Option<NodeHandle>) -> Self {
        let addrs: Vec<SocketAddr> = servers.iter().map(|s| s.addr).collect();
        let pids: Vec<Option<u32>> = servers.iter().map(Server::pid).collect();
        let (stop, mut rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let (start, mut samples) = (Instant::now(), Vec::new());
            loop {
                let mut s = Sample {
                    at: start.elapsed(),
                    ..Sample::default()
                };
                for (addr, pid) in addrs.iter().zip(&pids) {
                    let text = get(*addr, "/metrics").await.unwrap_or_default();
                    let approved = metric(&text, "procmem_governor_approved_bytes");
                    s.approved.push(approved.unwrap_or(0.0) as u64);
                    let waiting = metric(&text, "procmem_governor_waiting_requests");
                    s.waiting.push(waiting.unwrap_or(0.0) as u64);
                    s.rss
                        .push(pid.and_then(|p| status_kb(p, "VmRSS:")).unwrap_or(0));
                }
                if let Some(status) = match &node {
                    Some(n) => n.status().await,
                    None => None,
                } {
                    s.lent = status.authorities.iter().map(|a| a.2).sum();
                    s.credit = pids
                        .iter()
                        .map(|pid| {
                            status
                                .processes
                                .iter()
                                .filter(|p| Some(p.pid) == *pid)
                                .map(|p| p.credit)
                                .sum()
                        })
                        .collect();
                }
                samples.push(s);
                tokio::select! {
                    _ = &mut rx => return Seen { samples },
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        });
        Watcher { stop, task }
    }

    /// Stops sampling; what was seen.
    pub async fn stop(self) -> Seen {
        drop(self.stop);
        self.task.await.unwrap_or(Seen {
            samples: Vec::new(),
        })
    }
}

impl Seen {
    fn most(&self, f: impl Fn(&Sample) -> u64) -> u64 {
        self.samples.iter().map(f).max().unwrap_or(0)
    }

    /// Each server's rises in credit, summed: credit that moved to it (from what another
    /// gave back, once the node is full).
    fn moved(&self) -> u64 {
        self.samples
            .windows(2)
            .map(|w| {
                w[0].credit
                    .iter()
                    .zip(&w[1].credit)
                    .map(|(a, b)| b.saturating_sub(*a))
                    .sum::<u64>()
            })
            .sum()
    }

    /// The longest any server had requests waiting in its Governor without a break, in
    /// seconds (from one sample with waiters to the first without).
    fn longest_wait(&self) -> f64 {
        let servers = self.samples.first().map_or(0, |s| s.waiting.len());
        let mut longest = Duration::ZERO;
        for i in 0..servers {
            let mut since = None;
            for s in &self.samples {
                match (s.waiting.get(i).copied().unwrap_or(0) > 0, since) {
                    (true, None) => since = Some(s.at),
                    (false, Some(from)) => {
                        longest = longest.max(s.at - from);
                        since = None;
                    }
                    _ => {}
                }
            }
        }
        longest.as_secs_f64()
    }

    /// For each phase, the credit of the server in its burst: at the phase's start, at most
    /// during it, and how long until it first held 16 MiB more than at the start.
    fn bursts(&self, starts: &[Duration]) -> Vec<Value> {
        let mut out = Vec::new();
        for (p, from) in starts.iter().enumerate() {
            let to = starts.get(p + 1).copied().unwrap_or(Duration::MAX);
            let during: Vec<&Sample> = self
                .samples
                .iter()
                .filter(|s| s.at >= *from && s.at < to && s.credit.len() > p)
                .collect();
            let Some(first) = during.first() else {
                out.push(json!(null));
                continue;
            };
            let at_start = first.credit[p];
            let most = during.iter().map(|s| s.credit[p]).max().unwrap_or(0);
            let gained = during
                .iter()
                .find(|s| s.credit[p] >= at_start + 16 * MIB)
                .map(|s| (s.at - *from).as_secs_f64() * 1e3);
            out.push(json!({
                "server": p,
                "credit_at_start_bytes": at_start,
                "credit_most_bytes": most,
                "ms_to_16mib_more": gained,
            }));
        }
        out
    }

    /// The figures, for phases that started at `starts` (from the row's start; the watcher
    /// started just before).
    pub fn json(&self, starts: &[Duration]) -> Value {
        let node = self.samples.iter().any(|s| !s.credit.is_empty());
        let approved = self.most(|s| s.approved.iter().sum());
        json!({
            "samples": self.samples.len(),
            "most_approved_at_once_bytes": approved,
            "most_lent_at_once_bytes": if node { self.most(|s| s.lent) } else { approved },
            "most_rss_at_once_bytes": self.most(|s| s.rss.iter().sum()),
            "credit_moved_bytes": self.moved(),
            "longest_wait_for_credit_s": self.longest_wait(),
            "bursts": if node { json!(self.bursts(starts)) } else { json!(null) },
            "series": self.series(),
        })
    }

    /// Per sample, seconds and each server's memory in MiB: its node credit where a node
    /// lends, else what its ledger approved; and which of the two it is.
    pub fn lines(&self) -> (Vec<(f64, Vec<f64>)>, &'static str) {
        let node = self.samples.iter().any(|s| !s.credit.is_empty());
        let mib = |b: &u64| *b as f64 / MIB as f64;
        let points = self
            .samples
            .iter()
            .filter(|s| !node || !s.credit.is_empty())
            .map(|s| {
                let v = if node { &s.credit } else { &s.approved };
                (s.at.as_secs_f64(), v.iter().map(mib).collect())
            })
            .collect();
        let unit = if node {
            "node credit per server (MiB)"
        } else {
            "approved by each server's ledger (MiB)"
        };
        (points, unit)
    }

    /// Every sample: seconds, then per server MiB approved, MiB of node credit (where a node
    /// lends) and requests waiting in its Governor.
    fn series(&self) -> Value {
        let mib = |b: &u64| (*b as f64 / MIB as f64 * 10.0).round() / 10.0;
        self.samples
            .iter()
            .map(|s| {
                let mut row = vec![json!((s.at.as_secs_f64() * 10.0).round() / 10.0)];
                row.extend(s.approved.iter().map(|b| json!(mib(b))));
                row.extend(s.credit.iter().map(|b| json!(mib(b))));
                row.extend(s.waiting.iter().map(|w| json!(w)));
                Value::Array(row)
            })
            .collect()
    }
}
