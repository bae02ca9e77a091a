//! The tier below a store's memory, where evicted prompt blocks go instead of vanishing: a
//! disk tier under KV in host memory (`disk_tier.rs`), a host tier under KV on a GPU
//! (`host_tier.rs`). The store asks this one type; each kind copies on the store's stream
//! its own way. A store that stops leaves its whole blocks to a disk tier first.

use std::sync::Arc;

use procmem::kv::{BlockState, Incarnation, PrefixDigest};
use tokio::time::Duration;

use super::device::KvDevice;
use super::disk_tier::{CopyIn, PrefixTier};
use super::host_tier::HostPrefixTier;
use super::prefix::KeyedBlock;
use super::prefix::SharedPrefix;
use super::swap::Space;
use super::{KvStoreConfig, KvStoreError, KvStoreState, KvStoreStats};

/// The tier below a store.
pub(super) enum Below {
    Disk(PrefixTier),
    Host(HostPrefixTier),
}

impl Below {
    /// Opens the store's tier below, if it has one: a disk tier (waiting up to 2 s for its
    /// directory's lock: a store restarted after a crash finds it held until the old state
    /// and the copies it had queued are gone; another running store keeps it, and this one
    /// fails then), or a host tier (charged in full now).
    pub(super) async fn open(
        config: &KvStoreConfig,
        device: &KvDevice,
        swap: &Space,
        authority: &str,
    ) -> Result<Option<Below>, KvStoreError> {
        use procmem::kv::disk_tier::DiskTierError;
        let shape = config.shape;
        let g = device.granularity();
        let block_bytes = shape.block_bytes_all(g);
        if let Some(host) = &config.prefix_host {
            // One tier below at most: the one of the other kind is refused.
            if config.prefix_disk.is_some() {
                return Err(match device.is_host() {
                    true => KvStoreError::PrefixHostOnHost,
                    false => KvStoreError::DiskTierOnDevice,
                });
            }
            let labels = [config.name.as_str(), authority];
            let tier = HostPrefixTier::open(host, device, swap, labels, block_bytes).await?;
            return Ok(Some(Below::Host(tier)));
        }
        let give_up = tokio::time::Instant::now() + Duration::from_secs(2);
        loop {
            match open_disk(config, device, authority, block_bytes) {
                Err(KvStoreError::DiskTier(DiskTierError::Locked(_)))
                    if tokio::time::Instant::now() < give_up =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                opened => return opened.map(|t| t.map(Below::Disk)),
            }
        }
    }

    /// Whether it is a disk tier (whose series the store publishes).
    pub(super) fn is_disk(&self) -> bool {
        matches!(self, Below::Disk(_))
    }

    /// A prompt block was asked for (found or not): the filter counts it.
    pub(super) fn record(&mut self, key: u64) {
        match self {
            Below::Disk(t) => t.record(key),
            Below::Host(t) => t.record(key),
        }
    }

    /// How many of `keys`, from the first, the tier holds.
    pub(super) fn leading(&self, keys: &[u64]) -> usize {
        match self {
            Below::Disk(t) => t.leading_on_disk(keys),
            Below::Host(t) => t.leading(keys),
        }
    }

    /// Takes evicted block `key` (whole, mapped by nobody) down where the filter lets it in.
    /// Returns the bytes freed now and those freed after the copy's fence.
    pub(super) fn evict(
        &mut self,
        device: &KvDevice,
        key: u64,
        prompt: (u64, Vec<u32>),
        block: Arc<SharedPrefix>,
    ) -> (u64, u64) {
        let bytes = block.bytes;
        match self {
            Below::Disk(t) => {
                if !t.admit(key, bytes) {
                    return (bytes, 0);
                }
                let copy = t.copy_out(key, prompt, block, Arc::clone(&device.shared));
                match device.stream.submit_host(copy) {
                    Ok(_) => (0, bytes),
                    // A closed stream ran nothing: the block (and its charge) went with it.
                    Err(_) => (bytes, 0),
                }
            }
            Below::Host(t) => match t.admit(key, bytes) && t.copy_out(key, prompt, block) {
                true => (0, bytes),
                false => (bytes, 0),
            },
        }
    }

    /// Queues the copy in of `blocks` (fresh, claimed by incarnation `writer`, `promised`
    /// of them counted as cached): its fence is `None` where nothing could be queued (the
    /// copy falls short).
    pub(super) fn copy_in(
        &mut self,
        device: &KvDevice,
        (writer, promised): (Incarnation, usize),
        blocks: Vec<KeyedBlock>,
    ) -> CopyIn {
        match self {
            Below::Disk(t) => {
                let mapping = Arc::clone(&device.shared);
                let (kernel, mut copy) = t.copy_in((writer, promised), blocks, mapping);
                // A stream that takes no more work ran nothing: the copy filled nothing.
                copy.fence = match copy.keys.is_empty() {
                    true => None,
                    false => device.stream.submit_host(kernel).ok(),
                };
                copy
            }
            Below::Host(t) => t.copy_in((writer, promised), blocks),
        }
    }

    /// Puts the keys it holds in `digest`, with those of `in_memory`: one counted once.
    pub(super) fn digest_into(
        &self,
        digest: &mut PrefixDigest,
        in_memory: impl Iterator<Item = u64>,
    ) {
        match self {
            Below::Disk(t) => t.digest_into(digest, in_memory),
            Below::Host(t) => t.digest_into(digest, in_memory),
        }
    }

    /// Its figures, into the store's.
    pub(super) fn fill(&self, stats: &mut KvStoreStats) {
        match self {
            Below::Disk(t) => t.fill(stats),
            Below::Host(t) => t.fill(stats),
        }
    }
}

/// Opens the store's disk tier, if it has one, and says what it found there.
fn open_disk(
    config: &KvStoreConfig,
    device: &KvDevice,
    authority: &str,
    block_bytes: u64,
) -> Result<Option<PrefixTier>, KvStoreError> {
    let Some(disk) = &config.prefix_disk else {
        return Ok(None);
    };
    if !device.is_host() {
        return Err(KvStoreError::DiskTierOnDevice);
    }
    let shape = config.shape;
    let labels = [config.name.as_str(), authority];
    let bt = shape.block_tokens(device.granularity());
    let (tier, report) = PrefixTier::open(disk, &shape, bt, block_bytes, labels)?;
    for (file, why) in &report.skipped {
        tracing::warn!(store = %config.name, file = %file.display(), why, "prefix disk tier: file skipped");
    }
    if report.skipped_count > report.skipped.len() {
        let more = report.skipped_count - report.skipped.len();
        tracing::warn!(store = %config.name, more, "prefix disk tier: more files skipped, not named");
    }
    if let Some(why) = &report.read_only {
        tracing::warn!(store = %config.name, %why, "prefix disk tier: serving what it found, keeping nothing new until a write succeeds");
    }
    // Under its own target, so a server's default filter can show it with the warnings.
    tracing::info!(
        target: "procmem_start",
        store = %config.name,
        dir = %disk.dir.display(),
        blocks = report.blocks,
        bytes = report.bytes,
        skipped = report.skipped_count,
        dropped = report.dropped,
        orphans = report.orphans,
        others = report.others,
        "prefix disk tier opened"
    );
    Ok(Some(tier))
}

impl KvStoreState {
    /// Lets go of the tier below. The whole blocks still in memory go down to a disk tier
    /// first, so a store started again on its directory finds them.
    pub(super) async fn close_tier(&mut self) {
        if let Some(super::Below::Disk(tier)) = self.tier.take() {
            let blocks = self.resident_blocks();
            let mapping = Arc::clone(&self.device.shared);
            let wait = self.config.wait.max(std::time::Duration::from_secs(5));
            let flush = move || tier.flush(blocks, mapping, wait);
            let flushed = tokio::task::spawn_blocking(flush).await.unwrap_or(0);
            tracing::debug!(flushed, "prefix blocks sent to the disk tier at stop");
        }
    }

    /// The whole blocks in the cache, least recently used first, with what a tier below
    /// keys each by.
    pub(super) fn resident_blocks(&self) -> Vec<KeyedBlock> {
        let mut whole: Vec<_> = self
            .prefixes
            .blocks()
            .filter(|(.., state)| *state == BlockState::Complete)
            .map(|(key, block, last_used, _)| (last_used, key, block))
            .collect();
        whole.sort_unstable_by_key(|(last_used, key, _)| (*last_used, *key));
        whole
            .into_iter()
            .filter_map(|(_, key, block)| {
                let (parent, tokens) = self.prefixes.prompt_of(key)?;
                Some(KeyedBlock {
                    key,
                    parent,
                    tokens: tokens.to_vec(),
                    block: Arc::clone(block),
                })
            })
            .collect()
    }
}
