//! The prefix cache's host tier, for a store whose KV lives on a GPU: a prompt block evicted
//! under pressure is copied into a slot of page-locked host memory instead of dropped, and a
//! later open of a prompt that starts the same way copies it back instead of computing it.
//!
//! Both copies are queued on the store's CUDA stream: the copy out runs after the work queued
//! before it, and the block's device memory (with what paid for it) goes once its fence has
//! completed; the copy in runs before any step of the sequence that reads the block, and the
//! sequence's first step waits for its fence, as for the disk tier (`copy_in.rs`). The stream's
//! order is also what makes a slot safe to reuse: a copy out into a slot is queued after every
//! copy in that read the slot's last block. The arena is charged in full to the host tier's
//! Governor when the store starts (its bytes are page-locked: what the OS holds from then on),
//! and freed once the store and every copy queued through it are gone. It does not persist:
//! a restart starts it empty.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use ::metrics::Histogram;
use procmem::cuda::{BlockView, CudaVmmBacking, PinnedHost};
use procmem::fence::{Fence, Timeline};
use procmem::kv::frequency::{Admission, AdmissionFilter};
use procmem::kv::HostTierIndex;
use procmem::kv::{Incarnation, PrefixDigest};
use procmem::metrics::KV_PREFIX_HOST_SECONDS;
use procmem::MemoryRole;

use super::device::KvDevice;
use super::disk_tier::CopyIn;
use super::prefix::KeyedBlock;
use super::prefix::SharedPrefix;
use super::swap::Space;
use super::{KvStoreError, KvStoreStats};
use crate::cuda_provider::CudaStreamHandle;
use crate::governor::{Lease, ReserveRequest};
use crate::provider_choice::Provider;

/// A host tier below a store on a GPU: [`PrefixHost::new`], then the setters.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PrefixHost {
    /// The most bytes of page-locked host memory it holds blocks in (whole blocks: the
    /// remainder is not taken).
    pub capacity: u64,
    /// How many times a block must have been asked for before it may enter (1: every
    /// evicted whole block may).
    pub min_hits: u8,
}

impl PrefixHost {
    /// A tier of at most `capacity` bytes that takes every evicted whole block.
    pub fn new(capacity: u64) -> Self {
        PrefixHost {
            capacity,
            min_hits: 1,
        }
    }

    /// Sets how many asks let a block in.
    #[must_use]
    pub fn min_hits(mut self, min_hits: u8) -> Self {
        self.min_hits = min_hits;
        self
    }
}

/// The copies' directions, as indices of [`HostPrefixTier::latency`].
const OUT: usize = 0;
const IN: usize = 1;

/// The page-locked slots and what pays for them: the memory goes first, then the lease.
/// Each copy through it is held with a reference to it, and dropped before that reference:
/// the lease goes only once no copy holds the memory.
struct Arena {
    memory: Arc<PinnedHost>,
    _lease: Lease,
}

/// The host tier of one store on a GPU.
pub(super) struct HostPrefixTier {
    index: HostTierIndex,
    arena: Arc<Arena>,
    slot_bytes: u64,
    filter: AdmissionFilter,
    backing: Arc<CudaVmmBacking>,
    stream: CudaStreamHandle,
    timeline: Arc<dyn Timeline>,
    writes: u64,
    failures: u64,
    hit_tokens: u64,
    /// Queuing to fence, by direction ([`OUT`], [`IN`]).
    latency: [Histogram; 2],
}

impl HostPrefixTier {
    /// Charges and makes the tier's slots for blocks of `block_bytes`: refused on the host
    /// (a copy in host memory of host memory frees nothing) and without a host-tier Governor
    /// (the store's swap space, [`SwapSpace::Host`](super::SwapSpace::Host)).
    pub(super) async fn open(
        config: &PrefixHost,
        device: &KvDevice,
        swap: &Space,
        [name, authority]: [&str; 2],
        block_bytes: u64,
    ) -> Result<HostPrefixTier, KvStoreError> {
        let Provider::Cuda(provider) = &device.provider else {
            return Err(KvStoreError::PrefixHostOnHost);
        };
        let Space::Host {
            governor, priority, ..
        } = swap
        else {
            return Err(KvStoreError::PrefixHostWithoutHostTier);
        };
        let slots = usize::try_from(config.capacity / block_bytes.max(1))
            .unwrap_or(usize::MAX)
            .min(1 << 20);
        let bytes = slots as u64 * block_bytes;
        let holder = governor
            .register_holder(format!("{name}-prefix-host"), *priority, None)
            .await?;
        let grant = governor
            .reserve(ReserveRequest {
                holder,
                role: MemoryRole::KvCache,
                bytes: bytes.max(1),
                priority: *priority,
                deadline: None,
            })
            .await?;
        let lease = grant.commit(bytes.max(1)).await.map_err(|e| e.error)?;
        let backing = provider.mechanism().backing();
        let memory = Arc::new(PinnedHost::new(
            provider.mechanism().device(),
            usize::try_from(bytes).unwrap_or(usize::MAX),
        )?);
        let stream = device.stream.cuda().expect("a CUDA store's stream").clone();
        Ok(HostPrefixTier {
            index: HostTierIndex::new(slots),
            arena: Arc::new(Arena {
                memory,
                _lease: lease,
            }),
            slot_bytes: block_bytes,
            filter: AdmissionFilter::new(slots.saturating_mul(4), config.min_hits),
            backing,
            timeline: stream.timeline(),
            stream,
            writes: 0,
            failures: 0,
            hit_tokens: 0,
            latency: ["out", "in"].map(|d| KV_PREFIX_HOST_SECONDS.histogram(&[name, authority, d])),
        })
    }

    /// A prompt block was asked for (found or not): the filter counts it.
    pub(super) fn record(&mut self, key: u64) {
        self.filter.record(key);
    }

    /// How many of `keys`, from the first, the tier holds.
    pub(super) fn leading(&self, keys: &[u64]) -> usize {
        keys.iter().take_while(|k| self.index.contains(**k)).count()
    }

    /// Whether an evicted block may come down: asked for often enough, and more often than
    /// the block it would push out.
    pub(super) fn admit(&mut self, key: u64, bytes: u64) -> bool {
        if self.index.contains(key) || bytes != self.slot_bytes {
            return false;
        }
        let victim = self.index.victim();
        self.filter.admit(key, victim) == Admission::Admit
    }

    /// Queues the copy of `block` into a slot; its memory goes after the copy's fence.
    /// False (the block is dropped now) where the copy could not be queued.
    pub(super) fn copy_out(
        &mut self,
        key: u64,
        (parent, tokens): (u64, Vec<u32>),
        block: Arc<SharedPrefix>,
    ) -> bool {
        let Ok(view) = self.backing.view(&block.blocks) else {
            self.failures += 1;
            return false;
        };
        let Some((slot, _pushed)) = self.index.insert(key, parent, &tokens) else {
            return false;
        };
        let at = slot * self.slot_bytes as usize;
        let start = std::time::Instant::now();
        let mut copy = None;
        let queued = self.stream.submit(&[], |s| {
            copy = Some(self.arena.memory.fill_from(s, at, view)?);
            Ok(())
        });
        match (queued, copy) {
            (Ok(fence), Some(copy)) => {
                self.writes += 1;
                // The copy first, then the block's memory (and its charge), then the arena.
                self.release_after(fence, OUT, start, (copy, block));
                true
            }
            (queued, _) => {
                if let Err(e) = queued {
                    tracing::warn!(%e, "prefix host tier: copy out not queued");
                }
                self.index.remove(key);
                self.failures += 1;
                false
            }
        }
    }

    /// Queues the copies of `blocks` (fresh, written by nothing else) from their slots, in
    /// order, stopping at the first the tier does not hold with the same parent and tokens;
    /// the sequence's first step waits for the copies' fence.
    pub(super) fn copy_in(
        &mut self,
        (writer, promised): (Incarnation, usize),
        blocks: Vec<KeyedBlock>,
    ) -> CopyIn {
        let keys = blocks.iter().map(|b| b.key).collect();
        let mut copies: Vec<(usize, BlockView)> = Vec::new();
        let mut tokens = 0;
        for KeyedBlock {
            key,
            parent,
            tokens: t,
            block,
        } in &blocks
        {
            let Some(slot) = self.index.get(*key, *parent, t) else {
                break;
            };
            match self.backing.view(&block.blocks) {
                Ok(view) if view.len() == self.slot_bytes => copies.push((slot, view)),
                _ => {
                    self.failures += 1;
                    break;
                }
            }
            tokens += t.len() as u64;
        }
        let slot_bytes = self.slot_bytes as usize;
        let start = std::time::Instant::now();
        let mut held = Vec::with_capacity(copies.len());
        let queued = (!copies.is_empty()).then(|| {
            self.stream.submit(&[], |s| {
                copies.into_iter().try_for_each(|(slot, view)| {
                    held.push(self.arena.memory.write_to(s, slot * slot_bytes, view)?);
                    Ok(())
                })
            })
        });
        let (fence, filled) = match queued {
            Some(Ok(fence)) => {
                self.hit_tokens += tokens;
                let filled = held.len();
                self.release_after(fence, IN, start, held);
                (Some(fence), filled)
            }
            Some(Err(e)) => {
                // What was queued before the failure is waited for as `held` drops.
                tracing::warn!(%e, "prefix host tier: copy in not queued");
                self.failures += 1;
                (None, 0)
            }
            None => (None, 0),
        };
        CopyIn::new(
            writer,
            promised,
            keys,
            fence,
            Arc::new(AtomicUsize::new(filled)),
        )
    }

    /// Once `fence` completes: records the copies' latency from `start` (direction `OUT` or
    /// `IN`), then drops `held` (what they used), then a reference to the arena, so the arena
    /// and its lease go only after every copy through it.
    fn release_after(
        &self,
        fence: Fence,
        direction: usize,
        start: std::time::Instant,
        held: impl Send + 'static,
    ) {
        let latency = self.latency[direction].clone();
        let held = (held, Arc::clone(&self.arena));
        self.timeline.on_complete(
            fence.value,
            Box::new(move |_| {
                latency.record(start.elapsed().as_secs_f64());
                drop(held);
            }),
        );
    }

    /// Puts the keys of the blocks it holds in `digest`, with those of `in_memory`.
    pub(super) fn digest_into(
        &self,
        digest: &mut PrefixDigest,
        in_memory: impl Iterator<Item = u64>,
    ) {
        for key in in_memory
            .filter(|k| !self.index.contains(*k))
            .chain(self.index.keys())
        {
            digest.insert(key);
        }
    }

    /// Its figures, into the store's.
    pub(super) fn fill(&self, stats: &mut KvStoreStats) {
        stats.prefix_host_blocks = self.index.len();
        stats.prefix_host_bytes = self.index.len() as u64 * self.slot_bytes;
        stats.prefix_host_capacity = self.index.slots() as u64 * self.slot_bytes;
        stats.prefix_host_hit_tokens = self.hit_tokens;
        stats.prefix_host_writes = self.writes;
        stats.prefix_host_failures = self.failures;
        stats.prefix_host_refused = self.filter.refused();
    }
}
