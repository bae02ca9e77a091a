//! The node Governor: the books of each authority across the processes of one machine.
//!
//! Each process is a holder of the node's [`Ledger`] with one credit line per authority it
//! joined; its credit is that line's bytes. Asks are granted from what is free, in priority
//! order; what does not fit waits while tickets go to processes, least important first, one at
//! a time, each answered by a give-back (or its time running out).

use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use procmem::kv::PrefixDigest;
use procmem::ledger::admission::{self, Admission, AdmissionLimits, Ask, Refusal};
use procmem::ledger::{AuthorityId, HolderId, LeaseId, Ledger, Priority, WaitQueue};
use procmem::metrics as m;
use procmem::MemoryRole;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::time::Instant;

use super::peer::{self, PeerPids};
use super::wire::{
    encode_reply, LinkMsg, NodeMsg, NodeReply, NodeRequest, NodeStatus, Share, WireError,
};
use super::{link_group, Watched, NODE_GROUP, TICK};

mod liveness;
mod notice;
mod queue;
mod report;
mod share;

/// A process's join, as its frame said it (`NodeRequest::Join`), checked by `join`.
struct Joining {
    token: u64,
    key: u64,
    pid: u32,
    name: String,
    priority: Priority,
    authority: String,
    held: u64,
    share: Share,
}

/// The node's wait queues: bounded, and a capacity that never grows (it is the node's own).
const LIMITS: AdmissionLimits = AdmissionLimits {
    max_waiters: 4096,
    elastic: false,
};

/// How to start a node Governor.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The cluster node's name.
    pub name: String,
    /// The cookie peers must present.
    pub cookie: String,
    /// TCP port to listen on.
    pub port: u16,
    /// Address to listen on (loopback unless told otherwise).
    pub listen: IpAddr,
    /// Authorities and their capacities, in bytes ("host", "cuda:0").
    pub authorities: Vec<(String, u64)>,
    /// How long a process has to answer a ticket before the next one is asked.
    pub ticket_timeout: Duration,
    /// The longest an ask may wait.
    pub max_wait: Duration,
    /// After a start, asks wait this long before anything is approved, so the processes that
    /// held credit before a restart rejoin (and are counted) before any newcomer is served.
    pub rejoin_grace: Duration,
    /// Serve Prometheus metrics of the node's books here (off unless given).
    pub metrics: Option<std::net::SocketAddr>,
    /// Where processes of this machine connect too (a Unix socket): the kernel names each
    /// (`SO_PEERCRED`, in the node's PID namespace) and the node watches that process. `None`:
    /// TCP only.
    pub unix: Option<std::path::PathBuf>,
    /// A process the kernel did not name (it came over TCP) is watched by its session: its
    /// credit comes back once its session has been gone this long.
    pub session_grace: Duration,
}

impl NodeConfig {
    /// A node on loopback `port` with one authority.
    pub fn new(cookie: impl Into<String>, port: u16, authority: &str, capacity: u64) -> Self {
        NodeConfig {
            name: format!("procmem-node:{port}"),
            cookie: cookie.into(),
            port,
            listen: IpAddr::V4(Ipv4Addr::LOCALHOST),
            authorities: vec![(authority.into(), capacity)],
            ticket_timeout: Duration::from_millis(500),
            max_wait: Duration::from_secs(30),
            rejoin_grace: Duration::from_millis(1500),
            metrics: None,
            unix: Some(peer::socket_path(port)),
            session_grace: Duration::from_secs(2),
        }
    }
}

/// A running node Governor.
#[derive(Debug, Clone)]
pub struct NodeHandle {
    /// The Governor actor.
    pub governor: ActorRef<NodeMsg>,
    /// The cluster's node server.
    pub server: ActorRef<ractor_cluster::NodeServerMessage>,
}

impl NodeHandle {
    /// Starts the cluster node server and the node Governor, which joins [`NODE_GROUP`] (and
    /// the metrics endpoint, if asked for).
    pub async fn start(config: NodeConfig) -> Result<Self, ractor::SpawnErr> {
        if let Some(addr) = config.metrics {
            let (handle, _exporter) = crate::manager::install_metrics(Some(addr))
                .map_err(|e| ractor::SpawnErr::StartupFailed(e.to_string().into()))?;
            // The recorder is global; the handle renders it, the exporter task serves it.
            std::mem::forget(handle);
        }
        let server = ractor_cluster::NodeServer::new(
            config.port,
            config.cookie.clone(),
            config.name.clone(),
            "localhost".into(),
            None,
            None,
        )
        .with_listen_addr(config.listen)
        .with_max_inbound_frame_size(super::MAX_FRAME);
        let (server, _) = Actor::spawn(None, server, ()).await?;
        let pids = PeerPids::default();
        if let Some(path) = &config.unix {
            peer::listen(path, server.clone(), pids.clone()).map_err(|e| {
                server.stop(None);
                ractor::SpawnErr::StartupFailed(format!("{}: {e}", path.display()).into())
            })?;
        }
        let (governor, _) = Actor::spawn(None, NodeGovernor, (config, pids)).await?;
        ractor::pg::join(NODE_GROUP.into(), vec![governor.get_cell()]);
        Ok(NodeHandle { governor, server })
    }

    /// The node's books.
    pub async fn status(&self) -> Option<NodeStatus> {
        let request = NodeRequest::Status;
        let bytes = ractor::call!(self.governor, |reply| NodeMsg::Call {
            request: Ok(request),
            reply
        })
        .ok()?;
        match super::wire::decode::<NodeReply>(&bytes) {
            Ok(NodeReply::Status(s)) => Some(s),
            _ => None,
        }
    }

    /// Sets an authority's capacity. Lowered below what is lent, nothing is taken: tickets ask
    /// the processes to give back, least important first, and nothing is approved until the
    /// books are under it. False where the authority is unknown or the node has stopped.
    pub async fn set_capacity(&self, authority: &str, bytes: u64) -> bool {
        let authority = authority.to_string();
        ractor::call!(self.governor, |reply| NodeMsg::SetCapacity {
            authority,
            bytes,
            reply
        })
        .unwrap_or(false)
    }

    /// Stops the Governor and the server.
    pub fn stop(&self) {
        self.governor.stop(None);
        self.server.stop(None);
    }
}

/// How the node knows a process is gone.
enum Watch {
    /// The kernel named it (its session came over the Unix socket): its pidfd.
    Pid(Watched),
    /// Not named: its session. `lost` is since when its link has not been running.
    Session { lost: Option<Instant> },
}

/// The node Governor actor.
#[derive(Debug, Default)]
pub struct NodeGovernor;

struct Member {
    holder: HolderId,
    line: LeaseId,
    approved: u64,
    os_bytes: u64,
    model: String,
    /// The prompt blocks it last reported holding (checked when it came).
    prefixes: Option<PrefixDigest>,
    /// Credit taken back from it without its answer (see `revoke_stalled`): a give it sent
    /// before it learnt of that may be for more than its credit now.
    revoked: u64,
}

struct Process {
    /// The secret issued at its first join (see [`NodeReply::Joined`]).
    key: u64,
    pid: u32,
    name: String,
    priority: Priority,
    /// Its guaranteed share, as its join said.
    share: Share,
    /// When a frame of it last came (its link reports every 100 ms while it runs).
    heard: Instant,
    members: BTreeMap<AuthorityId, Member>,
    link: Option<ActorRef<LinkMsg>>,
    watch: Watch,
}

impl Process {
    /// Its `process` label in the node's metrics: its name and pid (two servers of one name
    /// are two series).
    fn label(&self) -> String {
        format!("{}[{}]", self.name, self.pid)
    }
}

/// A waiting ask; its bytes and priority are the queue's.
struct Pending {
    token: u64,
    deadline: Instant,
    reply: RpcReplyPort<Vec<u8>>,
}

#[derive(Default)]
struct Round {
    outstanding: Option<(u64, u64, Instant)>,
    /// The processes asked while this authority is short (by token), each with what it held
    /// when asked (its credit and the bytes it reported approved) and the ticket it was last
    /// sent: one is asked again only once every other has been asked and what it holds
    /// changed, so a process that gave nothing is not asked the same thing again, and among
    /// those the one asked longest ago first (a busy process whose usage moves all the time
    /// does not keep an idle one that gave part of what it holds from being asked again).
    asked: BTreeMap<u64, ((u64, u64), u64)>,
}

/// The node Governor's state.
pub struct NodeState {
    config: NodeConfig,
    /// The kernel's pid of each session that came over the Unix socket.
    pids: PeerPids,
    ledger: Ledger,
    authorities: BTreeMap<String, AuthorityId>,
    processes: BTreeMap<u64, Process>,
    /// Each authority's waiters, in the process Governor's pure queue and admission rules
    /// (`procmem::ledger::admission`), so the model check of those covers this one too.
    waiters: BTreeMap<AuthorityId, WaitQueue<Pending>>,
    rounds: BTreeMap<AuthorityId, Round>,
    next_ticket: u64,
    status: NodeStatus,
    /// The processes reaped last (token, key, why), newest last: a frame one of them sent as
    /// it exited, arriving after, is late rather than hostile.
    reaped: VecDeque<(u64, u64, &'static str)>,
    /// Nothing is approved before this (see [`NodeConfig::rejoin_grace`]).
    serving_from: Instant,
    last_summary: Instant,
}

impl Actor for NodeGovernor {
    type Msg = NodeMsg;
    type State = NodeState;
    type Arguments = (NodeConfig, PeerPids);

    async fn pre_start(
        &self,
        myself: ActorRef<NodeMsg>,
        (config, pids): (NodeConfig, PeerPids),
    ) -> Result<NodeState, ActorProcessingErr> {
        myself.send_interval(TICK, || NodeMsg::Tick);
        let state = NodeState::new(config, pids);
        state.publish();
        Ok(state)
    }

    async fn handle(
        &self,
        _myself: ActorRef<NodeMsg>,
        msg: NodeMsg,
        state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            NodeMsg::Call {
                request: Err(e),
                reply,
            } => {
                state.rejected(&e);
                let _ = reply.send(encode_reply(&NodeReply::Refused {
                    reason: e.to_string(),
                }));
            }
            NodeMsg::Cast(Err(e)) => state.rejected(&e),
            NodeMsg::Call {
                request: Ok(request),
                reply,
            } => state.request(request, reply),
            NodeMsg::Cast(Ok(notice)) => state.notice(notice),
            NodeMsg::Tick => state.tick(),
            NodeMsg::SetCapacity {
                authority,
                bytes,
                reply,
            } => {
                let _ = reply.send(state.set_capacity(&authority, bytes));
            }
        }
        state.pump();
        state.drive_tickets();
        state.publish();
        Ok(())
    }
}

/// A process's key: 64 random bits from the kernel, never zero (zero means "none yet").
fn new_key() -> u64 {
    let mut bytes = [0u8; 8];
    loop {
        match rustix::rand::getrandom(&mut bytes, rustix::rand::GetRandomFlags::empty()) {
            Ok(8) if bytes != [0; 8] => return u64::from_ne_bytes(bytes),
            _ => continue,
        }
    }
}

fn refuse(reply: RpcReplyPort<Vec<u8>>, reason: &str) {
    let _ = reply.send(encode_reply(&NodeReply::Refused {
        reason: reason.into(),
    }));
}

impl NodeState {
    /// The node's state at its start: its authorities at their capacities, no process.
    fn new(config: NodeConfig, pids: PeerPids) -> Self {
        let mut ledger = Ledger::new();
        let mut authorities = BTreeMap::new();
        for (name, capacity) in &config.authorities {
            authorities.insert(name.clone(), ledger.add_authority(name.clone(), *capacity));
        }
        NodeState {
            pids,
            ledger,
            authorities,
            processes: BTreeMap::new(),
            reaped: VecDeque::new(),
            waiters: BTreeMap::new(),
            rounds: BTreeMap::new(),
            next_ticket: 1,
            status: NodeStatus::default(),
            serving_from: Instant::now() + config.rejoin_grace,
            last_summary: Instant::now(),
            config,
        }
    }

    fn set_capacity(&mut self, authority: &str, bytes: u64) -> bool {
        let Some(&aid) = self.authorities.get(authority) else {
            return false;
        };
        let set = self.ledger.set_capacity(aid, bytes).is_ok();
        if set {
            tracing::info!(authority, bytes, "node capacity set");
        }
        set
    }

    fn rejected(&mut self, e: &WireError) {
        self.status.rejected_frames += 1;
        m::NODE_REJECTED_FRAMES_TOTAL.counter(&[]).increment(1);
        tracing::warn!(%e, "frame dropped");
    }

    fn request(&mut self, request: NodeRequest, reply: RpcReplyPort<Vec<u8>>) {
        match request {
            NodeRequest::Join {
                token,
                key,
                pid,
                name,
                priority,
                authority,
                held,
                share,
            } => {
                let joining = Joining {
                    token,
                    key,
                    pid,
                    name,
                    priority,
                    authority,
                    held,
                    share,
                };
                self.join(joining, reply)
            }
            NodeRequest::Ask {
                token,
                key,
                authority,
                bytes,
                at_least,
                wait_ms,
            } => {
                if self.foreign(token, key) {
                    return refuse(reply, "not this session's process");
                }
                if let Some(p) = self.processes.get_mut(&token) {
                    p.heard = Instant::now();
                }
                self.ask((token, key), &authority, (bytes, at_least), wait_ms, reply)
            }
            NodeRequest::Status => {
                let _ = reply.send(encode_reply(&NodeReply::Status(self.snapshot())));
            }
        }
    }

    /// Whether `token` names a process the node knows under another key: such a frame comes
    /// from a peer acting for another process, and is refused and counted.
    fn foreign(&mut self, token: u64, key: u64) -> bool {
        let foreign = self.processes.get(&token).is_some_and(|p| p.key != key);
        if foreign {
            self.status.foreign_frames += 1;
            m::NODE_FOREIGN_FRAMES_TOTAL.counter(&[]).increment(1);
            self.rejected(&WireError::Invalid("a frame for another session's process"));
        }
        foreign
    }

    fn join(&mut self, joining: Joining, reply: RpcReplyPort<Vec<u8>>) {
        let Joining {
            token,
            key,
            pid,
            name,
            priority,
            authority,
            held,
            share,
        } = joining;
        let authority = authority.as_str();
        let Some(&aid) = self.authorities.get(authority) else {
            return refuse(reply, "unknown authority");
        };
        if self.foreign(token, key) {
            return refuse(reply, "token of another process");
        }
        if let Some(p) = self.processes.get_mut(&token) {
            if p.pid != pid {
                self.rejected(&WireError::Invalid("token of another process"));
                return refuse(reply, "token of another process");
            }
            p.heard = Instant::now();
        } else {
            // The pid it claims is only shown: who it is comes from the kernel, once its
            // link is found (see `find_link`).
            self.processes.insert(
                token,
                Process {
                    key: new_key(),
                    pid,
                    name: name.clone(),
                    priority,
                    share,
                    heard: Instant::now(),
                    members: BTreeMap::new(),
                    link: None,
                    watch: Watch::Session { lost: None },
                },
            );
        }
        let credit = match self.member(token, aid) {
            Some(line_bytes) => line_bytes,
            None => match self.add_member(token, aid, &name, priority, held) {
                Ok(credit) => credit,
                Err(reason) => return refuse(reply, reason),
            },
        };
        self.find_link(token);
        tracing::info!(token, pid, %name, authority, credit, held, "process joined");
        let key = self.processes.get(&token).map_or(0, |p| p.key);
        if reply
            .send(encode_reply(&NodeReply::Joined { credit, key }))
            .is_err()
        {
            tracing::debug!(token, "join reply undeliverable");
        }
    }

    /// Credit of `token` on `aid`, if it joined it.
    fn member(&self, token: u64, aid: AuthorityId) -> Option<u64> {
        let m = self.processes.get(&token)?.members.get(&aid)?;
        Some(self.ledger.lease(m.line).map_or(0, |c| c.bytes))
    }

    /// Registers the process on `aid` and adopts up to `held` bytes it says it holds (no more
    /// than is free: no byte is approved twice).
    fn add_member(
        &mut self,
        token: u64,
        aid: AuthorityId,
        name: &str,
        priority: Priority,
        held: u64,
    ) -> Result<u64, &'static str> {
        let holder = self
            .ledger
            .register_holder(aid, name.to_owned(), priority)
            .map_err(|_| "cannot register")?;
        let line = self
            .ledger
            .open_credit(holder, MemoryRole::Other)
            .map_err(|_| "cannot open credit")?
            .id;
        let free = self.ledger.snapshot(aid).map_or(0, |s| s.free());
        let adopted = held.min(free);
        if adopted > 0 {
            self.approve(holder, aid, line, adopted);
        }
        if adopted < held {
            tracing::warn!(
                token,
                held,
                adopted,
                "a rejoining process holds more than is free"
            );
        }
        if let Some(p) = self.processes.get_mut(&token) {
            p.members.insert(
                aid,
                Member {
                    holder,
                    line,
                    approved: 0,
                    os_bytes: 0,
                    model: String::new(),
                    prefixes: None,
                    revoked: 0,
                },
            );
        }
        Ok(adopted)
    }

    fn approve(&mut self, holder: HolderId, aid: AuthorityId, line: LeaseId, bytes: u64) -> bool {
        match self.ledger.reserve(holder, aid, MemoryRole::Other, bytes) {
            Ok(grant) => self.ledger.commit_into(holder, grant.id, line).is_ok(),
            Err(_) => false,
        }
    }

    fn ask(
        &mut self,
        (token, key): (u64, u64),
        authority: &str,
        (chunk, bytes): (u64, u64),
        wait_ms: u64,
        reply: RpcReplyPort<Vec<u8>>,
    ) {
        let Some(&aid) = self.authorities.get(authority) else {
            return refuse(reply, "unknown authority");
        };
        let Some((holder, line, priority)) = self
            .processes
            .get(&token)
            .and_then(|p| p.members.get(&aid).map(|m| (m.holder, m.line, p.priority)))
        else {
            self.stranger(token, key, "ask from a process that did not join");
            return refuse(reply, "not joined");
        };
        let now = Instant::now();
        let wait = Duration::from_millis(wait_ms).min(self.config.max_wait);
        let ask = |bytes| Ask {
            bytes,
            priority,
            deadline: (wait_ms > 0).then(|| (now + wait).into_std()),
        };
        let queue = self.waiters.entry(aid).or_default();
        let admit = |bytes| {
            let answer =
                admission::admit(&self.ledger, aid, queue, ask(bytes), now.into_std(), LIMITS);
            match answer {
                // Until the rejoin grace ends nothing is granted: an ask that may wait, waits.
                Admission::GrantNow if now < self.serving_from => match wait_ms {
                    0 => Admission::Deny(Refusal::NoRoom),
                    _ => Admission::Wait,
                },
                other => other,
            }
        };
        // The chunk where it fits at once, else the need.
        let (bytes, answer) = match admit(chunk) {
            Admission::GrantNow => (chunk, Admission::GrantNow),
            _ => (bytes, admit(bytes)),
        };
        match answer {
            Admission::GrantNow => self.grant(token, holder, aid, line, bytes, reply),
            Admission::Deny(Refusal::NeverFits) => refuse(reply, "larger than the node's capacity"),
            Admission::Deny(Refusal::Busy) => refuse(reply, "too many asks wait"),
            Admission::Deny(Refusal::NoRoom) => refuse(reply, "no room"),
            Admission::Wait => {
                let deadline = now + wait;
                queue.push(
                    priority,
                    bytes,
                    Pending {
                        token,
                        deadline,
                        reply,
                    },
                );
            }
        }
    }

    fn grant(
        &mut self,
        token: u64,
        holder: HolderId,
        aid: AuthorityId,
        line: LeaseId,
        bytes: u64,
        reply: RpcReplyPort<Vec<u8>>,
    ) {
        if !self.approve(holder, aid, line, bytes) {
            return refuse(reply, "no room");
        }
        if reply
            .send(encode_reply(&NodeReply::Granted { bytes }))
            .is_err()
        {
            // The process never learns of it: it goes back at once.
            let _ = self.ledger.release(holder, line, bytes);
            tracing::debug!(token, bytes, "grant undeliverable; rolled back");
        }
    }
}

#[cfg(test)]
mod tests;
