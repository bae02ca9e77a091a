//! Why the store refused: every error its calls return, in one place.

use procmem::fence::StreamId;
use procmem::kv::{KvError, SeqId, TableError};
use procmem::MemoryError;

use crate::governor::GovernorError;
use crate::stream::StreamError;

/// Why the store refused; the sequence is as it was.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvStoreError {
    /// The KV memory refused.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The Governor did not grant the bytes.
    #[error(transparent)]
    Governor(#[from] GovernorError),
    /// The mechanism failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The sequence table refused: not open, already open, named twice, busy with another
    /// step, preempted, or not in a step.
    #[error(transparent)]
    Table(#[from] TableError),
    /// The store is not running.
    #[error("the KV store is not running")]
    Unavailable,
    /// The step's stream refused the kernel.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// A kernel of the step panicked before it answered.
    #[error("a kernel of the step panicked")]
    KernelFailed,
    /// A step was completed with a fence of another stream than its own: the store cannot
    /// know when that work ends. The step ended as if dropped (its token does not count).
    #[error("the fence is of {0}, not of the step's stream")]
    ForeignFence(StreamId),
    /// A step asked room for no new token of the sequence.
    #[error("a step of sequence {0} asked for no token")]
    NoTokens(SeqId),
    /// Its provider has no stream to run attention on.
    #[error("the KV store's provider refused: {0}")]
    Provider(#[from] crate::execution::ProviderError),
    /// The swap space given is the authority the KV is charged to: swapping there frees
    /// nothing.
    #[error("the swap space is the KV's own authority; swapping there frees nothing")]
    SwapAliased,
    /// The prefix cache's disk tier could not be opened (its directory is another store's,
    /// or cannot be written).
    #[error(transparent)]
    DiskTier(#[from] procmem::kv::disk_tier::DiskTierError),
    /// The prefix cache's disk tier is for KV in host memory (and a store has one tier
    /// below at most).
    #[error("a prefix disk tier is for a store in host memory")]
    DiskTierOnDevice,
    /// The prefix cache's host tier is for KV on a GPU: a copy of host memory in host
    /// memory frees nothing.
    #[error("a prefix host tier is for a store on a GPU; on the host, use a disk tier")]
    PrefixHostOnHost,
    /// The prefix cache's host tier is charged to the swap space's Governor, and the store
    /// swaps elsewhere.
    #[error("a prefix host tier needs a host-tier Governor (SwapSpace::Host)")]
    PrefixHostWithoutHostTier,
    /// The store's actor could not be started (it panicked while starting).
    #[error("the KV store could not start: {0}")]
    Start(#[source] ractor::SpawnErr),
}

impl KvStoreError {
    /// Whether the OS had no room for a mapping or its memory (`ENOMEM`, as at
    /// `vm.max_map_count`): fewer sequences mapped may pass, as under pressure.
    pub fn is_os_out_of_memory(&self) -> bool {
        match self {
            KvStoreError::Memory(e) | KvStoreError::Kv(KvError::Memory(e)) => {
                e.is_os_out_of_memory()
            }
            _ => false,
        }
    }
}
