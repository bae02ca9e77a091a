//! Watching a cluster of node Governors: what a router needs to place requests.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::time::Instant;

use super::wire::{NodeSummary, WatchMsg};
use super::{LinkError, WATCH_GROUP};

type Latest = Arc<Mutex<BTreeMap<String, (Instant, NodeSummary)>>>;

/// The latest summary of every node Governor it is connected to.
#[derive(Debug)]
pub struct ClusterWatch {
    latest: Latest,
    actor: ActorRef<WatchMsg>,
    server: ActorRef<ractor_cluster::NodeServerMessage>,
    reconnect: tokio::task::JoinHandle<()>,
    rejected: Arc<std::sync::atomic::AtomicU64>,
}

struct Watcher;

impl Actor for Watcher {
    type Msg = WatchMsg;
    type State = (Latest, Arc<std::sync::atomic::AtomicU64>);
    type Arguments = (Latest, Arc<std::sync::atomic::AtomicU64>);

    async fn pre_start(
        &self,
        _: ActorRef<WatchMsg>,
        args: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _: ActorRef<WatchMsg>,
        msg: WatchMsg,
        (latest, rejected): &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            WatchMsg::Summary(Ok(s)) if s.node.len() <= super::wire::MAX_NAME => {
                latest
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(s.node.clone(), (Instant::now(), s));
            }
            WatchMsg::Summary(other) => {
                rejected.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(?other, "summary dropped");
            }
        }
        Ok(())
    }
}

impl ClusterWatch {
    /// Connects to the node Governors at `nodes` with `cookie` and joins [`WATCH_GROUP`];
    /// nodes that cannot be reached now are tried again every two seconds.
    pub async fn connect(nodes: Vec<SocketAddr>, cookie: &str) -> Result<Self, LinkError> {
        let server =
            super::local_node_server(cookie, format!("watch-{}", std::process::id())).await?;
        let latest: Latest = Arc::default();
        let rejected = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (actor, _) = Actor::spawn(None, Watcher, (Arc::clone(&latest), Arc::clone(&rejected)))
            .await
            .map_err(|e| LinkError::Cluster(e.to_string()))?;
        ractor::pg::join(WATCH_GROUP.into(), vec![actor.get_cell()]);
        let (s, seen) = (server.clone(), Arc::clone(&latest));
        let reconnect = tokio::spawn(async move {
            loop {
                // While a node is missing or silent, every address is tried again (one already
                // in session is refused by the cluster as a duplicate).
                let fresh = seen
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .values()
                    .filter(|(at, _)| at.elapsed() < Duration::from_secs(3))
                    .count();
                if fresh < nodes.len() {
                    for addr in &nodes {
                        let _ = ractor_cluster::client_connect(&s, *addr).await;
                    }
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        });
        Ok(ClusterWatch {
            latest,
            actor,
            server,
            reconnect,
            rejected,
        })
    }

    /// Every node's latest summary and how long ago it came, by node name.
    pub fn latest(&self) -> Vec<(NodeSummary, Duration)> {
        self.latest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|(at, s)| (s.clone(), at.elapsed()))
            .collect()
    }

    /// Summaries dropped because they did not decode.
    pub fn rejected(&self) -> u64 {
        self.rejected.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stops watching.
    pub fn stop(self) {
        self.reconnect.abort();
        self.actor.stop(None);
        self.server.stop(None);
    }
}
