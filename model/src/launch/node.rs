//! Joining the node Governor (the `cluster` feature): several servers under one budget, the
//! KV device's authority taking its capacity from the node.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use procmem_actors::kv::KvStoreHandle;
use procmem_actors::node::{LinkConfig, NodeLink, Share};
use procmem_actors::procmem::{MemoryTier, Place};
use procmem_actors::MemoryManager;

use super::LaunchError;

/// The KV store whose prompt blocks the node link reports, set once the store exists (the
/// link is made before it, with the memory manager).
pub type KvSlot = Arc<OnceLock<KvStoreHandle>>;

/// Where and as what a server joins the node.
#[derive(Debug, Clone)]
pub struct NodeJoin {
    /// The node Governor's cluster address.
    pub addr: SocketAddr,
    /// The node's cookie.
    pub cookie: String,
    /// Less important servers give back first.
    pub priority: u32,
    /// Its guaranteed share of the node's capacity.
    pub share: Share,
    /// The name the node shows for this process.
    pub name: String,
}

/// Joins the node Governor: the Governor of the KV device's authority (`cuda:0` where `cuda`,
/// else `host`) takes its capacity from the node from now on. The link reports `model` and
/// the prompt blocks of the store in `kv` once it is set.
pub async fn join_node(
    memory: &MemoryManager,
    join: &NodeJoin,
    cuda: bool,
    (model, kv): (String, KvSlot),
) -> Result<NodeLink, LaunchError> {
    let (device, tier, authority) = if cuda {
        (Place::cuda(0), MemoryTier::Device, "cuda:0")
    } else {
        (Place::HOST, MemoryTier::Host, "host")
    };
    let governor = memory
        .governor(device, tier)
        .ok_or_else(|| LaunchError::Usage("no Governor for the KV device".into()))?
        .clone();
    let mut config = LinkConfig::new(join.addr, join.cookie.clone(), join.name.clone());
    config.priority = join.priority;
    config.share = join.share;
    config.authority = authority.into();
    // The model and the prompt blocks its store holds, for routers.
    config.model = if model.is_empty() {
        "model".into()
    } else {
        model
    };
    // Asked at or under its guarantee, it gives its cold cached blocks, nothing more.
    config.with_store(kv);
    NodeLink::join(config, governor)
        .await
        .map_err(|e| LaunchError::Usage(format!("cannot join the node at {}: {e}", join.addr)))
}
