//! A process's link to its node Governor: its Governor's capacity is the credit the node
//! approved, raised only after an approval and lowered before anything is given back.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use procmem::kv::PrefixDigest;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::time::Instant;

use super::wire::{
    self, LinkMsg, LinkNotice, NodeMsg, NodeNotice, NodeReply, NodeRequest, Share, NOBODY_CAN_GIVE,
};
use super::{link_group, NODE_GROUP, TICK};
use crate::governor::GovernorHandle;
use crate::kv::KvStoreHandle;

/// What a process calls for the prompt blocks it holds (see [`LinkConfig::prefixes`]).
pub type PrefixSource = Arc<dyn Fn() -> Option<Arc<PrefixDigest>> + Send + Sync>;

/// Evicts cached blocks used at most `hits` times until `bytes` are freed, answering the bytes
/// freed: a KV store's [`shed_cold`](crate::kv::KvStoreHandle::shed_cold).
pub type ShedCold = Arc<
    dyn Fn(u64, u32) -> std::pin::Pin<Box<dyn std::future::Future<Output = u64> + Send>>
        + Send
        + Sync,
>;

/// How a process joins its node Governor.
#[derive(Clone)]
pub struct LinkConfig {
    /// The node Governor's address.
    pub node: SocketAddr,
    /// The cluster cookie.
    pub cookie: String,
    /// This process's name.
    pub name: String,
    /// How much it matters: less important processes give back first.
    pub priority: u32,
    /// Its guaranteed share of the authority (by default an equal share by weight).
    pub share: Share,
    /// The authority on the node its Governor's capacity comes from.
    pub authority: String,
    /// Credit is asked for at least this many bytes at a time.
    pub chunk: u64,
    /// How long one ask may wait at the node.
    pub wait: Duration,
    /// What the OS or driver says this process's memory of that authority holds (reported to
    /// the node); without it, the Governor's approved bytes are reported.
    pub os_bytes: Option<Arc<dyn Fn() -> u64 + Send + Sync>>,
    /// The model this process serves (reported to the node, published to routers).
    pub model: String,
    /// The prompt blocks it holds now, where it can tell (a KV store's
    /// [`prefix_digest`](crate::kv::KvStoreHandle::prefix_digest); `None` while it has no
    /// store): reported to the node, which merges them per model for routers.
    pub prefixes: Option<PrefixSource>,
    /// How it gives cached blocks of little worth when asked at or under its guarantee (a KV
    /// store's [`shed_cold`](crate::kv::KvStoreHandle::shed_cold)); without it, only credit it
    /// does not use.
    pub shed: Option<ShedCold>,
    /// The node's Unix socket, tried first for a node on loopback: over it the node learns
    /// this process's pid from the kernel (over TCP it can only watch the session).
    pub unix: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for LinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkConfig")
            .field("node", &self.node)
            .field("name", &self.name)
            .field("priority", &self.priority)
            .field("share", &self.share)
            .field("authority", &self.authority)
            .field("chunk", &self.chunk)
            .finish()
    }
}

impl LinkConfig {
    /// Joins `authority` on the node at `node`, asking 64 MiB at a time.
    pub fn new(node: SocketAddr, cookie: impl Into<String>, name: impl Into<String>) -> Self {
        LinkConfig {
            node,
            cookie: cookie.into(),
            name: name.into(),
            priority: 0,
            share: Share::default(),
            authority: "host".into(),
            chunk: 64 << 20,
            wait: Duration::from_secs(2),
            os_bytes: None,
            model: "model".into(),
            prefixes: None,
            shed: None,
            unix: node
                .ip()
                .is_loopback()
                .then(|| super::peer::socket_path(node.port())),
        }
    }

    /// Reports the prompt blocks of the KV store in `store` ([`LinkConfig::prefixes`]) and
    /// gives its cold ones when asked at or under its guarantee ([`LinkConfig::shed`]), once
    /// the store is set (it is usually made after the join, its memory coming through it):
    /// until then, nothing.
    pub fn with_store(&mut self, store: Arc<OnceLock<KvStoreHandle>>) {
        let reported = Arc::clone(&store);
        self.prefixes = Some(Arc::new(move || {
            reported.get().map(KvStoreHandle::prefix_digest)
        }));
        self.shed = Some(Arc::new(move |bytes, hits| {
            let kv = store.get().cloned();
            Box::pin(async move {
                match kv {
                    Some(kv) => kv.shed_cold(bytes, hits).await.unwrap_or(0),
                    None => 0,
                }
            })
        }));
    }
}

/// Why a process could not join its node.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The cluster could not be reached or started.
    #[error("cluster: {0}")]
    Cluster(String),
    /// The node refused.
    #[error("the node refused: {0}")]
    Refused(String),
}

/// A process's link to its node Governor.
#[derive(Debug, Clone)]
pub struct NodeLink {
    actor: ActorRef<LinkMsg>,
    server: ActorRef<ractor_cluster::NodeServerMessage>,
    token: u64,
    /// The link actor's key: a rejoin after a node restart replaces it, and the leave must
    /// carry the one in force.
    key: Arc<AtomicU64>,
}

struct LinkState {
    config: LinkConfig,
    governor: GovernorHandle,
    server: ActorRef<ractor_cluster::NodeServerMessage>,
    node: Option<ActorRef<NodeMsg>>,
    token: u64,
    /// The secret the node issued at the join (see [`NodeReply::Joined`]), shared with the
    /// `NodeLink`.
    key: Arc<AtomicU64>,
    credit: u64,
    asking: bool,
    ticket: Option<Ticket>,
    last_report: Instant,
    last_connect: Instant,
}

struct Ticket {
    id: u64,
    owed: u64,
    gave: u64,
    deadline: Instant,
}

/// The link actor.
struct Link;

async fn find_node(wait: Duration) -> Option<ActorRef<NodeMsg>> {
    let deadline = Instant::now() + wait;
    loop {
        let remote = ractor::pg::get_members(&NODE_GROUP.to_string())
            .into_iter()
            .find(|c| !c.get_id().is_local());
        if let Some(cell) = remote {
            return Some(ActorRef::from(cell));
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn call(
    node: &ActorRef<NodeMsg>,
    request: NodeRequest,
    wait: Duration,
) -> Result<NodeReply, String> {
    let bytes = node
        .call(
            |reply| NodeMsg::Call {
                request: Ok(request),
                reply,
            },
            Some(wait),
        )
        .await
        .map_err(|e| e.to_string())?;
    match bytes {
        ractor::rpc::CallResult::Success(bytes) => {
            wire::decode::<NodeReply>(&bytes).map_err(|e| e.to_string())
        }
        ractor::rpc::CallResult::Timeout => Err("timed out".into()),
        ractor::rpc::CallResult::SenderError => Err("node gone".into()),
    }
}

/// Connects to the node: over its Unix socket where there is one, else over TCP.
async fn connect(
    server: &ActorRef<ractor_cluster::NodeServerMessage>,
    config: &LinkConfig,
) -> Result<(), String> {
    if let Some(path) = config.unix.as_deref().filter(|p| p.exists()) {
        match super::peer::connect(path, server).await {
            Ok(()) => return Ok(()),
            Err(e) => tracing::debug!(%e, "node socket refused; trying TCP"),
        }
    }
    ractor_cluster::client_connect(server, config.node)
        .await
        .map_err(|e| e.to_string())
}

fn pid() -> u32 {
    std::process::id()
}

impl NodeLink {
    /// Connects to the node, joins it and makes `governor`'s capacity the credit the node
    /// holds for this process (zero at first: the first waiter asks for a chunk).
    pub async fn join(config: LinkConfig, governor: GovernorHandle) -> Result<Self, LinkError> {
        let server =
            super::local_node_server(&config.cookie, format!("{}-{}", config.name, pid())).await?;
        connect(&server, &config)
            .await
            .map_err(LinkError::Cluster)?;
        let node = find_node(Duration::from_secs(5))
            .await
            .ok_or_else(|| LinkError::Cluster("no node Governor (wrong cookie?)".into()))?;
        let token = loop {
            let t = rand_token();
            if t != 0 {
                break t;
            }
        };
        let join = NodeRequest::Join {
            token,
            key: 0,
            pid: pid(),
            name: config.name.clone(),
            priority: config.priority,
            authority: config.authority.clone(),
            held: 0,
            share: config.share,
        };
        let (credit, key) = match call(&node, join, Duration::from_secs(5)).await {
            Ok(NodeReply::Joined { credit, key }) => (credit, Arc::new(AtomicU64::new(key))),
            Ok(NodeReply::Refused { reason }) => return Err(LinkError::Refused(reason)),
            Ok(other) => return Err(LinkError::Refused(format!("{other:?}"))),
            Err(e) => return Err(LinkError::Cluster(e)),
        };
        governor
            .set_capacity(credit)
            .await
            .map_err(|e| LinkError::Cluster(e.to_string()))?;
        let state = LinkState {
            config,
            governor: governor.clone(),
            server: server.clone(),
            node: Some(node),
            token,
            key: Arc::clone(&key),
            credit,
            asking: false,
            ticket: None,
            last_report: Instant::now(),
            last_connect: Instant::now(),
        };
        let (actor, _) = Actor::spawn(None, Link, state)
            .await
            .map_err(|e| LinkError::Cluster(e.to_string()))?;
        ractor::pg::join(link_group(token), vec![actor.get_cell()]);
        let me = actor.clone();
        governor.set_upstream(Some(Arc::new(move |bytes| {
            let _ = me.cast(LinkMsg::Need(bytes));
        })));
        Ok(NodeLink {
            actor,
            server,
            token,
            key,
        })
    }

    /// This process's token on the node.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// Leaves the node: the caller has freed its memory; its credit goes back.
    pub async fn leave(self) {
        let _ = self.actor.cast(LinkMsg::Tick);
        if let Some(node) = find_node(Duration::ZERO).await {
            let _ = node.cast(NodeMsg::Cast(Ok(NodeNotice::Leave {
                token: self.token,
                key: self.key.load(Ordering::Relaxed),
            })));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.actor.stop(None);
        self.server.stop(None);
    }
}

fn rand_token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(pid());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

impl Actor for Link {
    type Msg = LinkMsg;
    type State = LinkState;
    type Arguments = LinkState;

    async fn pre_start(
        &self,
        myself: ActorRef<LinkMsg>,
        state: LinkState,
    ) -> Result<LinkState, ActorProcessingErr> {
        myself.send_interval(TICK, || LinkMsg::Tick);
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<LinkMsg>,
        msg: LinkMsg,
        state: &mut LinkState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            LinkMsg::Need(bytes) => state.need(&myself, bytes),
            LinkMsg::Asked(result) => {
                state.asking = false;
                if let Ok(NodeReply::Granted { bytes }) = result {
                    // Approved by the node first, then usable here.
                    state.credit = state.credit.saturating_add(bytes);
                    state.set_capacity().await;
                } else {
                    tracing::debug!(?result, "credit ask not granted");
                    if matches!(&result, Ok(NodeReply::Refused { reason }) if reason == NOBODY_CAN_GIVE)
                    {
                        // Nobody else could give: this process's own holders make the room.
                        state.governor.upstream_refused();
                    }
                }
            }
            LinkMsg::Notice(Ok(LinkNotice::Ticket {
                id,
                authority,
                bytes,
                deadline_ms,
                worth,
            })) if authority == state.config.authority => match worth {
                None => state.ticket(id, bytes, deadline_ms).await,
                Some(hits) => state.cold_ticket(id, bytes, hits).await,
            },
            LinkMsg::Notice(Ok(LinkNotice::Revoked { authority, bytes }))
                if authority == state.config.authority =>
            {
                state.revoked(bytes).await;
            }
            LinkMsg::Notice(other) => {
                tracing::warn!(?other, "node notice dropped");
            }
            LinkMsg::Tick => state.tick().await,
        }
        Ok(())
    }
}

impl LinkState {
    fn key(&self) -> u64 {
        self.key.load(Ordering::Relaxed)
    }

    fn owed(&self) -> u64 {
        self.ticket.as_ref().map_or(0, |t| t.owed)
    }

    async fn set_capacity(&self) {
        let capacity = self.credit.saturating_sub(self.owed());
        let _ = self.governor.set_capacity(capacity).await;
    }

    fn need(&mut self, myself: &ActorRef<LinkMsg>, bytes: u64) {
        let Some(node) = self.node.clone() else {
            return; // Cut off: grow no further until rejoined.
        };
        if self.asking || self.ticket.is_some() {
            return;
        }
        self.asking = true;
        let ask = NodeRequest::Ask {
            token: self.token,
            key: self.key(),
            authority: self.config.authority.clone(),
            bytes: bytes.max(self.config.chunk),
            at_least: bytes,
            wait_ms: self.config.wait.as_millis() as u64,
        };
        let wait = self.config.wait + Duration::from_secs(1);
        let me = myself.clone();
        tokio::spawn(async move {
            let result = call(&node, ask, wait).await;
            let _ = me.cast(LinkMsg::Asked(result));
        });
    }

    fn give(&self, bytes: u64, ticket: u64) {
        if let Some(node) = &self.node {
            let _ = node.cast(NodeMsg::Cast(Ok(NodeNotice::Give {
                token: self.token,
                key: self.key(),
                authority: self.config.authority.clone(),
                bytes,
                ticket,
            })));
        }
    }

    /// Gives back unused capacity at once; for the rest, lowers the capacity so the Governor
    /// asks the holders, and gives back as they free (on each tick) until the deadline.
    async fn ticket(&mut self, id: u64, bytes: u64, deadline_ms: u64) {
        let Some(unused) = self.unused().await else {
            return;
        };
        let now = unused.min(bytes);
        self.ticket = Some(Ticket {
            id,
            owed: bytes.min(self.credit),
            gave: 0,
            deadline: Instant::now() + Duration::from_millis(deadline_ms.min(60_000)),
        });
        // Lower first, then give: local approvals never exceed what the node approved.
        self.set_capacity().await;
        if now > 0 {
            self.settle(now);
        }
        if self.owed() == 0 {
            self.finish().await;
        }
    }

    /// The node took `bytes` back while this process did not answer (it was stopped, or
    /// starved): the credit is lower from now on, and the Governor's holders make the room
    /// (its capacity falls below what it approved, which is pressure, never a taking).
    async fn revoked(&mut self, bytes: u64) {
        tracing::warn!(
            bytes,
            credit = self.credit,
            "the node took credit back while this process did not answer"
        );
        self.credit = self.credit.saturating_sub(bytes);
        // The node took the bytes instead of waiting for this process's answer to its ticket:
        // the ticket is answered.
        self.ticket = None;
        self.set_capacity().await;
    }

    /// Credit its holders neither use nor wait for (bytes its own waiters are queued for are
    /// not unused: given back, the node would only hand them round again).
    async fn unused(&self) -> Option<u64> {
        let s = self.governor.snapshot().await.ok()?;
        let spoken_for = s.books.approved().saturating_add(s.waiting_bytes);
        Some(self.credit.saturating_sub(spoken_for))
    }

    /// A ticket at or under its guarantee: cached blocks used at most `hits` times are evicted
    /// (its hot prefixes, its sequences and its weights stay), and what it then does not use,
    /// up to `bytes`, goes back at once. Nothing is lowered: no holder is pressed.
    async fn cold_ticket(&mut self, id: u64, bytes: u64, hits: u32) {
        if self.ticket.is_some() {
            return self.give(0, id);
        }
        let unused = self.unused().await.unwrap_or(0);
        if unused < bytes {
            if let Some(shed) = &self.config.shed {
                let freed = shed(bytes - unused, hits).await;
                tracing::debug!(id, freed, hits, "cold blocks given for a node ticket");
            }
        }
        let now = self.unused().await.unwrap_or(0).min(bytes);
        // Lower first, then give: local approvals never exceed what the node approved.
        self.credit -= now;
        self.set_capacity().await;
        self.give(now, id);
    }

    fn settle(&mut self, bytes: u64) {
        let Some(t) = self.ticket.as_mut() else {
            return;
        };
        self.credit -= bytes;
        t.owed -= bytes.min(t.owed);
        t.gave += bytes;
        let id = t.id;
        self.give(bytes, id);
    }

    async fn finish(&mut self) {
        if let Some(t) = self.ticket.take() {
            if t.gave == 0 {
                // Nothing to give: say so, so the node asks the next process now.
                self.give(0, t.id);
            }
        }
        self.set_capacity().await;
    }

    async fn tick(&mut self) {
        let snapshot = self.governor.snapshot().await.ok();
        let approved = snapshot.as_ref().map_or(0, |s| s.books.approved());
        if let Some(t) = &self.ticket {
            let floor = self.credit.saturating_sub(t.owed);
            let can = self.credit.saturating_sub(approved.max(floor));
            let expired = Instant::now() >= t.deadline;
            if can > 0 {
                self.settle(can);
            }
            if self.owed() == 0 || expired {
                self.finish().await;
            }
        }
        if self
            .node
            .as_ref()
            .is_some_and(|n| n.get_status() != ractor::ActorStatus::Running)
        {
            tracing::warn!("node session lost: keeping credit, growing no further");
            self.node = None;
            self.asking = false;
        }
        if self.node.is_none() && self.last_connect.elapsed() >= Duration::from_millis(500) {
            self.last_connect = Instant::now();
            self.rejoin().await;
        }
        if self.last_report.elapsed() >= Duration::from_millis(100) {
            self.last_report = Instant::now();
            if let Some(node) = &self.node {
                let os_bytes = self.config.os_bytes.as_ref().map_or(approved, |f| f());
                let digest = self.config.prefixes.as_ref().and_then(|f| f());
                let prefixes = digest.map(|d| (&*d).into());
                let _ = node.cast(NodeMsg::Cast(Ok(NodeNotice::Report {
                    token: self.token,
                    key: self.key(),
                    authority: self.config.authority.clone(),
                    approved,
                    os_bytes,
                    model: self.config.model.clone(),
                    prefixes,
                })));
            }
        }
    }

    /// Reconnects and rejoins with the credit it holds (a restarted node adopts it, no more
    /// than it has free).
    async fn rejoin(&mut self) {
        if connect(&self.server, &self.config).await.is_err() {
            return;
        }
        let Some(node) = find_node(Duration::from_millis(300)).await else {
            return;
        };
        let join = NodeRequest::Join {
            token: self.token,
            key: self.key(),
            pid: pid(),
            name: self.config.name.clone(),
            priority: self.config.priority,
            authority: self.config.authority.clone(),
            held: self.credit,
            share: self.config.share,
        };
        if let Ok(NodeReply::Joined { credit, key }) =
            call(&node, join, Duration::from_secs(2)).await
        {
            // A restarted node knew no key and issued a new one.
            self.key.store(key, Ordering::Relaxed);
            if credit != self.credit {
                tracing::warn!(held = self.credit, credit, "rejoined with other credit");
            }
            self.credit = credit;
            self.node = Some(node);
            self.ticket = None;
            self.set_capacity().await;
            tracing::info!(credit, "rejoined the node");
        }
    }
}
