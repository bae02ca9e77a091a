//! A node Governor's capacity following the machine: one authority of the node, whose memory
//! cgroup holds the node and its processes, under [`HostPressure`]'s policy.

use std::time::Duration;

use procmem::host::machine::PressurePolicy;

use super::NodeHandle;
use crate::machine::{Followed, HostPressure, MachineSource};

/// One authority of a node Governor, as the machine-following task sees it.
struct NodeAuthority {
    node: NodeHandle,
    authority: String,
}

impl Followed for NodeAuthority {
    /// What the node's processes last reported approved to their holders (their credit
    /// unused is not memory).
    async fn approved(&self) -> Option<u64> {
        self.node.status().await.map(|s| {
            s.processes
                .iter()
                .filter(|p| p.authority == self.authority)
                .map(|p| p.approved)
                .fold(0u64, u64::saturating_add)
        })
    }

    async fn set_capacity(&self, bytes: u64) -> bool {
        self.node.set_capacity(&self.authority, bytes).await
    }
}

impl HostPressure {
    /// [`HostPressure::spawn`] for one authority of a node Governor: `source` is the cgroup
    /// that holds the node's processes (and the node), what they hold outside the books is
    /// their working set less what they report approved, and a lowered capacity turns into
    /// the node's tickets.
    pub fn spawn_for_node(
        node: NodeHandle,
        authority: impl Into<String>,
        policy: PressurePolicy,
        source: impl MachineSource,
        interval: Duration,
    ) -> Self {
        let followed = NodeAuthority {
            node,
            authority: authority.into(),
        };
        Self::follow(followed, policy, source, interval)
    }
}
