//! What the manager says went wrong, and its books at shutdown.

use std::net::SocketAddr;

use procmem::Place;

use crate::execution::ProviderError;
use crate::kv_store::KvStoreError;
use crate::residency::ResidencyError;

/// Why the manager could not start, bind or shut down cleanly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManagerError {
    /// A budget that cannot work: zero, or more memory than the machine has.
    #[error("invalid budget for {what}: {bytes} bytes ({why})")]
    InvalidBudget {
        /// Which budget.
        what: &'static str,
        /// The value given.
        bytes: u64,
        /// Why it was refused.
        why: String,
    },
    /// A place this build or machine does not have.
    #[error("unknown place {0}: this manager has host{1}")]
    UnknownPlace(Place, &'static str),
    /// The metrics endpoint could not be started (address in use, not local, ...).
    #[error("cannot serve metrics on {addr}: {why}")]
    Metrics {
        /// The address asked for.
        addr: SocketAddr,
        /// Why not.
        why: String,
    },
    /// An execution provider failed to start or stop.
    #[error(transparent)]
    Provider(#[from] ProviderError),
    /// A KV store failed to start.
    #[error(transparent)]
    KvStore(#[from] KvStoreError),
    /// Model residency failed to start.
    #[error(transparent)]
    Residency(#[from] ResidencyError),
    /// A named reserve could not be leased (no room by its deadline, or the Governor down).
    #[error("the reserve could not be leased: {0}")]
    Reserve(#[source] crate::governor::GovernorError),
    /// The manager is shutting down and admits nothing new.
    #[error("the memory manager is shutting down")]
    ShuttingDown,
    /// After shutdown some authority still has bytes on its books.
    #[error("books not at zero after shutdown: {0}")]
    BooksNotZero(ShutdownReport),
    /// The topology refused: a (place, tier) paid for by two authorities.
    #[error("the memory topology is inconsistent: {0}")]
    Topology(#[from] procmem::ledger::LedgerError),
    /// An actor of the manager's own (a Governor, its supervisor, the holders' supervisor)
    /// failed to start.
    #[error("the memory manager's {what} failed to start: {source}")]
    Spawn {
        /// Which actor.
        what: &'static str,
        /// Why.
        #[source]
        source: ractor::SpawnErr,
    },
}

/// One authority's books at shutdown.
#[derive(Debug, Clone)]
pub struct AuthorityReport {
    /// The authority's name.
    pub name: String,
    /// Bytes still provisional.
    pub provisional: u64,
    /// Bytes still leased.
    pub leased: u64,
}

/// The books after shutdown.
#[derive(Debug, Clone, Default)]
pub struct ShutdownReport {
    /// Per authority.
    pub authorities: Vec<AuthorityReport>,
    /// Allocations the deferred-free queues freed over their life.
    pub deferred_frees: u64,
    /// Authorities whose Governor had died: their books are lost, so they cannot be zero.
    pub lost_authorities: Vec<String>,
    /// Deferred-free queues whose actor had died; what they held was freed after its fences
    /// by threads of its own.
    pub lost_queues: u64,
    /// Execution providers whose actor had died, so their queues could not be drained.
    pub lost_providers: Vec<String>,
}

impl ShutdownReport {
    /// Every authority reachable and at zero.
    pub fn is_zero(&self) -> bool {
        self.lost_authorities.is_empty()
            && self.lost_providers.is_empty()
            && self
                .authorities
                .iter()
                .all(|a| a.provisional == 0 && a.leased == 0)
    }
}

impl std::fmt::Display for ShutdownReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for a in &self.authorities {
            write!(
                f,
                "{}: {} provisional, {} leased; ",
                a.name, a.provisional, a.leased
            )?;
        }
        for name in &self.lost_authorities {
            write!(f, "{name}: governor gone, books lost; ")?;
        }
        for name in &self.lost_providers {
            write!(f, "{name} provider gone, queues not drained; ")?;
        }
        if self.lost_queues > 0 {
            write!(f, "{} deferred-free queues lost; ", self.lost_queues)?;
        }
        write!(f, "{} deferred frees", self.deferred_frees)
    }
}
