//! Who a peer on the same machine is, as the kernel says: processes reach their node over a
//! Unix socket too, and the node takes each connection's pid from `SO_PEERCRED`, which the
//! kernel gives in the node's own PID namespace. A server in a container (where its own pid is
//! 1) is then watched as the process it is; what a peer says of its pid is never used.
//!
//! ractor_cluster carries the socket as an external stream; the pid rides in the stream's peer
//! label, which the node server hands to its session events with the session's node id, so the
//! node maps the session of a process's link to that pid.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use ractor::ActorRef;
use ractor_cluster::{
    BoxRead, BoxWrite, ClusterBidiStream, NodeEventSubscription, NodeServerMessage,
};
use tokio::net::{UnixListener, UnixStream};

/// The peer label of a session the kernel identified.
const PID_LABEL: &str = "unix-pid:";

/// Where a node listening on TCP `port` listens for processes of the same machine.
pub fn socket_path(port: u16) -> PathBuf {
    std::env::temp_dir().join(format!("procmem-node-{port}.sock"))
}

/// A Unix socket connection as a cluster stream, labelled with the peer's pid where known.
pub(crate) struct UnixPeer {
    stream: UnixStream,
    label: String,
}

impl UnixPeer {
    pub(crate) fn new(stream: UnixStream, label: String) -> Self {
        UnixPeer { stream, label }
    }
}

impl ClusterBidiStream for UnixPeer {
    fn split(self: Box<Self>) -> (BoxRead, BoxWrite) {
        let (read, write) = self.stream.into_split();
        (Box::new(read), Box::new(write))
    }

    fn peer_label(&self) -> Option<String> {
        Some(self.label.clone())
    }
}

/// The kernel's pid of each session that came over the socket, by the session's node id.
pub(crate) type PeerPids = Arc<Mutex<HashMap<u64, u32>>>;

/// Whose session `node_id` is, as the kernel said; `None` for a peer it could not identify
/// (over TCP, or gone).
pub(crate) fn pid_of(pids: &PeerPids, node_id: u64) -> Option<u32> {
    pids.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&node_id)
        .copied()
}

/// Keeps [`PeerPids`] in step with the node server's sessions.
struct Sessions(PeerPids);

impl NodeEventSubscription for Sessions {
    fn node_session_opened(&self, ses: ractor_cluster::node::NodeServerSessionInformation) {
        let pid = ses
            .peer_addr
            .strip_prefix(PID_LABEL)
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(ses.node_id, pid);
        }
    }

    fn node_session_disconnected(&self, ses: ractor_cluster::node::NodeServerSessionInformation) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&ses.node_id);
    }

    fn node_session_authenticated(&self, _: ractor_cluster::node::NodeServerSessionInformation) {}
}

/// Listens at `path` and hands each connection to `server` as a session labelled with the
/// peer's pid (from `SO_PEERCRED`); returns the accepting task. A stale socket file at
/// `path` (a node that died) is replaced.
pub(crate) fn listen(
    path: &Path,
    server: ActorRef<NodeServerMessage>,
    pids: PeerPids,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    if std::os::unix::net::UnixStream::connect(path).is_err() {
        let _ = std::fs::remove_file(path);
    }
    let listener = UnixListener::bind(path)?;
    server
        .cast(NodeServerMessage::SubscribeToEvents {
            id: "procmem-peer-pids".into(),
            subscription: Box::new(Sessions(pids)),
        })
        .map_err(|_| std::io::Error::other("the node server stopped"))?;
    Ok(tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            };
            let label = match stream.peer_cred().ok().and_then(|c| c.pid()) {
                Some(pid) if pid > 0 => format!("{PID_LABEL}{pid}"),
                _ => "unix".into(),
            };
            let peer = Box::new(UnixPeer::new(stream, label));
            let opened = NodeServerMessage::ConnectionOpenedExternal {
                stream: peer,
                is_server: true,
            };
            if server.cast(opened).is_err() {
                return;
            }
        }
    }))
}

/// Connects to a node's socket at `path` through this process's node server `server`.
pub(crate) async fn connect(
    path: &Path,
    server: &ActorRef<NodeServerMessage>,
) -> Result<(), String> {
    let stream = UnixStream::connect(path)
        .await
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let peer = Box::new(UnixPeer::new(stream, "node".into()));
    ractor_cluster::client_connect_external(server, peer)
        .await
        .map_err(|e| e.to_string())
}
