//! Several server processes under one device budget: a node Governor per machine, on
//! `ractor_cluster`.
//!
//! ```text
//! node Governor (its own process)       books per authority: capacity, each process's credit
//!   └─ NodeLink (one per process)       the process Governor's capacity = its credit
//!        └─ process Governor            grants within capacity, no message to the node
//!             └─ holders                 answer the tickets the node's tickets turn into
//! ```
//!
//! A process's Governor governs its own holders as before, within a capacity that is exactly
//! the credit the node approved to that process. When its waiters need more, it asks its
//! [`Upstream`](crate::governor::Upstream), the link, which asks the node in chunks. The node
//! approves from what is free; otherwise it sends tickets to processes, least important first:
//! a process gives back unused capacity at once, then lowers its capacity so its own Governor
//! asks its holders, and gives back as they free. Local capacity is raised only after the node
//! approved and lowered before bytes are given back, so the processes' approvals never exceed
//! the node's.
//!
//! A process whose session drops keeps its credit and grows no further (it cannot ask); its
//! credit returns only once the process is confirmed gone (a pidfd, same host: the kernel and
//! the driver free a dead process's memory). A restarted node rebuilds its books from what the
//! processes say they hold when they rejoin, admitting no more than its capacity.
//!
//! Peers authenticate with the cluster cookie. Every payload is decoded and validated before it
//! reaches the books (see [`wire`]).

mod follow;
mod link;
mod peer;
mod server;
mod watch;
pub mod wire;

use std::os::fd::OwnedFd;
use std::time::Duration;

pub use link::{LinkConfig, LinkError, NodeLink, PrefixSource, ShedCold};
pub use peer::socket_path;
pub use server::{NodeConfig, NodeGovernor, NodeHandle};
pub use watch::ClusterWatch;
pub use wire::Share;

/// The process group the node Governor joins; processes find it there.
pub const NODE_GROUP: &str = "procmem.node";

/// The process group of the cluster's watchers: every node Governor publishes its summary
/// ([`wire::NodeSummary`]) to each member, twice a second.
pub const WATCH_GROUP: &str = "procmem.cluster.watch";

/// The process group of one process's link (`token` in hex).
pub fn link_group(token: u64) -> String {
    format!("procmem.link.{token:x}")
}

/// A process the node watches: a pidfd, which becomes readable when the process exits.
#[derive(Debug)]
pub(crate) struct Watched(Option<OwnedFd>);

impl Watched {
    /// Opens a pidfd for `pid`; `None` if it does not exist (or pidfds are not available).
    pub(crate) fn open(pid: u32) -> Result<Self, std::io::Error> {
        let raw = i32::try_from(pid)
            .ok()
            .and_then(rustix::process::Pid::from_raw)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        match rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty()) {
            Ok(fd) => Ok(Watched(Some(fd))),
            Err(rustix::io::Errno::NOSYS) => Ok(Watched(None)),
            Err(e) => Err(e.into()),
        }
    }

    /// Whether the process has exited (its pidfd polls readable).
    pub(crate) fn exited(&self) -> bool {
        let Some(fd) = &self.0 else {
            return false;
        };
        let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
        let zero = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
    }
}

/// This process's own cluster node server, listening on loopback only (a process that joins
/// a node, or watches nodes, needs one to connect out from), named `name`.
pub(crate) async fn local_node_server(
    cookie: &str,
    name: String,
) -> Result<ractor::ActorRef<ractor_cluster::NodeServerMessage>, LinkError> {
    let server =
        ractor_cluster::NodeServer::new(0, cookie.to_owned(), name, "localhost".into(), None, None)
            .with_listen_addr(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST))
            .with_max_inbound_frame_size(MAX_FRAME);
    ractor::Actor::spawn(None, server, ())
        .await
        .map(|(server, _)| server)
        .map_err(|e| LinkError::Cluster(e.to_string()))
}

/// The largest cluster frame any party here accepts.
pub(crate) const MAX_FRAME: u64 = 64 * 1024;

/// How often the node and the links look at their timers, sessions and pidfds.
pub(crate) const TICK: Duration = Duration::from_millis(20);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pidfd_tells_a_live_process_from_an_exited_one() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let watched = Watched::open(child.id()).unwrap();
        assert!(!watched.exited());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(watched.exited());
        assert!(Watched::open(0).is_err(), "pid 0");
        assert!(Watched::open(u32::MAX).is_err(), "past i32");
    }
}
