//! The store's figures: [`KvStoreStats`] counted from the sequences, blocks and tiers, and
//! the series that mirror them (so the endpoint and `KvStoreHandle::stats` agree), published
//! at most every [`EVERY`] and once more after the last change, and again while the memory
//! figures still move (memory freed after its fences comes back with no message to the
//! store); latencies are recorded where they happen.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ::metrics::{Counter, Gauge, Histogram};
use procmem::metrics::{
    KV_AUTHORITY_USAGE_RATIO, KV_GROWTH_MAP_SECONDS, KV_LEASED_BYTES, KV_OS_RESIDENT_BYTES,
    KV_PREEMPTED_SEQUENCES, KV_PREEMPTIONS_TOTAL, KV_PREFIX_BLOCKS_EVICTED_TOTAL,
    KV_PREFIX_BLOCKS_KEPT_TOTAL, KV_PREFIX_DISK_BLOCKS, KV_PREFIX_DISK_BYTES,
    KV_PREFIX_DISK_FAILURES_TOTAL, KV_PREFIX_DISK_HIT_TOKENS_TOTAL, KV_PREFIX_DISK_REFUSED_TOTAL,
    KV_PREFIX_DISK_WRITES_TOTAL, KV_PREFIX_HIT_TOKENS_TOTAL, KV_PREFIX_HOST_BLOCKS,
    KV_PREFIX_HOST_BYTES, KV_PREFIX_HOST_FAILURES_TOTAL, KV_PREFIX_HOST_HIT_TOKENS_TOTAL,
    KV_PREFIX_HOST_REFUSED_TOTAL, KV_PREFIX_HOST_WRITES_TOTAL, KV_PREFIX_QUERY_TOKENS_TOTAL,
    KV_REPLAYED_TOKENS_TOTAL, KV_RESTORES_TOTAL, KV_RESTORE_SHARED_TOKENS_TOTAL, KV_SEQUENCES,
    KV_SWAPPED_BYTES, KV_SWAP_INS_TOTAL, KV_SWAP_IN_BYTES_TOTAL, KV_SWAP_OUTS_TOTAL,
    KV_SWAP_OUT_BYTES_TOTAL, KV_SWAP_SECONDS, KV_TOKENS,
};
use ractor::{ActorRef, RpcReplyPort};
use tokio::time::{Duration, Instant};

use super::swap::SwapKind;
use super::{KvStoreError, KvStoreMsg, KvStoreState};

/// The store's books at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvStoreStats {
    /// Sequences open now (active or preempted).
    pub sequences: usize,
    /// Of those, preempted (their KV is saved or dropped; `restore` brings them back).
    pub preempted: usize,
    /// Tokens whose K/V the active sequences hold in memory.
    pub tokens: usize,
    /// Bytes mapped for active sequences alone (their own chunks, not the shared prompt
    /// blocks they map). A sequence in a step counts as it was lent: a chunk mapped ahead
    /// while the step runs shows in `leased_bytes` at once, and here once the step is back.
    pub exclusive_bytes: u64,
    /// Shared prompt blocks in the prefix cache (complete or being filled).
    pub prefix_entries: usize,
    /// Bytes of those blocks (all layers, K and V).
    pub prefix_bytes: u64,
    /// Bytes the store's leases hold with the Governor, memory still waiting for its fences
    /// included: equals the Governor's leased bytes for this holder.
    pub leased_bytes: u64,
    /// Bytes of the store's memory the kernel reports resident (its memfd backing).
    pub os_resident_bytes: u64,
    /// Sequences preempted so far, either mode.
    pub preemptions: u64,
    /// Of those, preempted with their K/V copied out to the swap space.
    pub preempted_by_swap: u64,
    /// Of those, preempted with their K/V dropped (to be recomputed).
    pub preempted_by_recompute: u64,
    /// Prompt tokens looked up in the prefix cache at `open`, so far.
    pub prefix_query_tokens: u64,
    /// Prompt tokens whose K/V came from shared blocks at `open`, so far.
    pub prefix_hit_tokens: u64,
    /// Shared prompt blocks evicted from the prefix cache, so far.
    pub prefix_blocks_evicted: u64,
    /// Whole blocks of closed sequences (prompt and answer) left to the prefix cache by
    /// [`KvStoreHandle::close_keeping`](crate::kv::KvStoreHandle::close_keeping), so far.
    pub prefix_blocks_kept: u64,
    /// Prompt blocks the disk tier holds now.
    pub prefix_disk_blocks: usize,
    /// Bytes of those blocks.
    pub prefix_disk_bytes: u64,
    /// Block files of another identity (another model, or KV of another shape or element
    /// type) the disk tier found in its directory at open: left alone, never read as its own.
    pub prefix_disk_others: usize,
    /// Prompt tokens whose K/V came back from the disk tier at `open`, so far (counted in
    /// `prefix_hit_tokens` too).
    pub prefix_disk_hit_tokens: u64,
    /// Evicted blocks copied to the disk tier, so far.
    pub prefix_disk_writes: u64,
    /// Sequences whose prompt blocks coming from a tier below are not settled yet (the copy
    /// in still queued, or run and not yet seen by the store).
    pub copies_in: usize,
    /// Evicted blocks the frequency filter kept off the disk (dropped), so far.
    pub prefix_disk_refused: u64,
    /// Copies to or from the disk tier that failed, so far (the block was dropped, or the
    /// prompt computed).
    pub prefix_disk_failures: u64,
    /// Prompt blocks the host tier (under KV on a GPU) holds now.
    pub prefix_host_blocks: usize,
    /// Their bytes.
    pub prefix_host_bytes: u64,
    /// The host tier's bytes, charged in full from the store's start.
    pub prefix_host_capacity: u64,
    /// Prompt tokens whose blocks were copied back from the host tier (counted in
    /// `prefix_hit_tokens` too).
    pub prefix_host_hit_tokens: u64,
    /// Evicted prompt blocks copied to the host tier.
    pub prefix_host_writes: u64,
    /// Evicted prompt blocks the host tier's filter kept out (dropped instead).
    pub prefix_host_refused: u64,
    /// Host tier copies that could not be queued (the block was dropped, or recomputed).
    pub prefix_host_failures: u64,
    /// Pressure tickets answered so far.
    pub tickets: u64,
    /// Bytes freed in answer to those tickets, so far.
    pub freed_by_pressure: u64,
    /// Where swapped-out KV goes.
    pub swap: SwapKind,
    /// Bytes of KV swapped out now (in the host tier's memory or on disk).
    pub swapped_bytes: u64,
    /// Swaps that fell back to dropping the KV (recompute) because the swap space had no
    /// room or failed, so far.
    pub swap_fallbacks: u64,
    /// Sequences whose K/V was copied out to the swap space, so far.
    pub swap_outs: u64,
    /// Bytes of those copies.
    pub swap_out_bytes: u64,
    /// Sequences whose K/V was copied back, so far.
    pub swap_ins: u64,
    /// Bytes of those copies.
    pub swap_in_bytes: u64,
    /// Tokens restores mapped again from the cached blocks they shared before they were
    /// preempted, instead of copying their rows back (not counted in `swap_in_bytes`) or
    /// replaying them (not counted in `replayed_tokens`).
    pub restore_shared_tokens: u64,
    /// Restores that copied the K/V back, so far.
    pub restores_swapped: u64,
    /// Restores that handed the sequence back to be replayed (from the cached blocks it
    /// mapped again), so far.
    pub restores_recomputed: u64,
    /// Tokens those restores handed back to be recomputed.
    pub replayed_tokens: u64,
}

/// How often at most the gauges and counters are published.
pub(super) const EVERY: Duration = Duration::from_millis(100);

pub(super) struct KvMetrics {
    sequences: Gauge,
    preempted: Gauge,
    tokens: Gauge,
    leased: Gauge,
    os_resident: Gauge,
    usage: Gauge,
    swapped: Gauge,
    prefix_queries: Counter,
    prefix_hits: Counter,
    evicted: Counter,
    kept: Counter,
    /// The tier below's figures, where the store has one.
    below: Option<BelowSeries>,
    preempted_swap: Counter,
    preempted_recompute: Counter,
    swap_outs: Counter,
    swap_out_bytes: Counter,
    swap_ins: Counter,
    swap_in_bytes: Counter,
    restored_swap: Counter,
    restored_recompute: Counter,
    replayed: Counter,
    restore_shared: Counter,
    /// One sequence's growth mapped.
    pub(super) growth_map: Histogram,
    /// One sequence copied out to the swap space.
    pub(super) swap_out: Histogram,
    /// One sequence copied back.
    pub(super) swap_in: Histogram,
    /// When the series were last published.
    pub(super) last: Option<Instant>,
    /// Whether a publish is scheduled.
    pub(super) armed: bool,
    /// The leased and OS bytes last published.
    memory: Option<(u64, u64)>,
}

/// The tier below's series: a disk tier's or a host tier's (the same figures, named for it).
struct BelowSeries {
    disk: bool,
    blocks: Gauge,
    bytes: Gauge,
    /// Hit tokens, writes, refused, failures.
    counts: [Counter; 4],
}

impl BelowSeries {
    fn new(l: &[&str], disk: bool) -> Self {
        let [blocks, bytes, hits, writes, refused, failures] = match disk {
            true => [
                KV_PREFIX_DISK_BLOCKS,
                KV_PREFIX_DISK_BYTES,
                KV_PREFIX_DISK_HIT_TOKENS_TOTAL,
                KV_PREFIX_DISK_WRITES_TOTAL,
                KV_PREFIX_DISK_REFUSED_TOTAL,
                KV_PREFIX_DISK_FAILURES_TOTAL,
            ],
            false => [
                KV_PREFIX_HOST_BLOCKS,
                KV_PREFIX_HOST_BYTES,
                KV_PREFIX_HOST_HIT_TOKENS_TOTAL,
                KV_PREFIX_HOST_WRITES_TOTAL,
                KV_PREFIX_HOST_REFUSED_TOTAL,
                KV_PREFIX_HOST_FAILURES_TOTAL,
            ],
        };
        BelowSeries {
            disk,
            blocks: blocks.gauge(l),
            bytes: bytes.gauge(l),
            counts: [hits, writes, refused, failures].map(|m| m.counter(l)),
        }
    }

    fn publish(&self, s: &KvStoreStats) {
        let (blocks, bytes, counts) = match self.disk {
            true => (
                s.prefix_disk_blocks,
                s.prefix_disk_bytes,
                [
                    s.prefix_disk_hit_tokens,
                    s.prefix_disk_writes,
                    s.prefix_disk_refused,
                    s.prefix_disk_failures,
                ],
            ),
            false => (
                s.prefix_host_blocks,
                s.prefix_host_bytes,
                [
                    s.prefix_host_hit_tokens,
                    s.prefix_host_writes,
                    s.prefix_host_refused,
                    s.prefix_host_failures,
                ],
            ),
        };
        self.blocks.set(blocks as f64);
        self.bytes.set(bytes as f64);
        for (counter, n) in self.counts.iter().zip(counts) {
            counter.absolute(n);
        }
    }
}

impl KvMetrics {
    /// The series of store `store` on `authority`; `below`: whether it has a tier below, and
    /// whether that is a disk tier (else a host tier).
    pub(super) fn new(store: &str, authority: &str, below: Option<bool>) -> Self {
        let l = [store, authority];
        KvMetrics {
            sequences: KV_SEQUENCES.gauge(&l),
            preempted: KV_PREEMPTED_SEQUENCES.gauge(&l),
            tokens: KV_TOKENS.gauge(&l),
            leased: KV_LEASED_BYTES.gauge(&l),
            os_resident: KV_OS_RESIDENT_BYTES.gauge(&l),
            usage: KV_AUTHORITY_USAGE_RATIO.gauge(&l),
            swapped: KV_SWAPPED_BYTES.gauge(&l),
            prefix_queries: KV_PREFIX_QUERY_TOKENS_TOTAL.counter(&l),
            prefix_hits: KV_PREFIX_HIT_TOKENS_TOTAL.counter(&l),
            evicted: KV_PREFIX_BLOCKS_EVICTED_TOTAL.counter(&l),
            kept: KV_PREFIX_BLOCKS_KEPT_TOTAL.counter(&l),
            below: below.map(|disk| BelowSeries::new(&l, disk)),
            preempted_swap: KV_PREEMPTIONS_TOTAL.counter(&[store, authority, "swap"]),
            preempted_recompute: KV_PREEMPTIONS_TOTAL.counter(&[store, authority, "recompute"]),
            swap_outs: KV_SWAP_OUTS_TOTAL.counter(&l),
            swap_out_bytes: KV_SWAP_OUT_BYTES_TOTAL.counter(&l),
            swap_ins: KV_SWAP_INS_TOTAL.counter(&l),
            swap_in_bytes: KV_SWAP_IN_BYTES_TOTAL.counter(&l),
            restored_swap: KV_RESTORES_TOTAL.counter(&[store, authority, "swap"]),
            restored_recompute: KV_RESTORES_TOTAL.counter(&[store, authority, "recompute"]),
            replayed: KV_REPLAYED_TOKENS_TOTAL.counter(&l),
            restore_shared: KV_RESTORE_SHARED_TOKENS_TOTAL.counter(&l),
            growth_map: KV_GROWTH_MAP_SECONDS.histogram(&l),
            swap_out: KV_SWAP_SECONDS.histogram(&[store, authority, "out"]),
            swap_in: KV_SWAP_SECONDS.histogram(&[store, authority, "in"]),
            last: None,
            armed: false,
            memory: None,
        }
    }

    /// Sets every series from `s`; `capacity` is the authority's (0 when unknown). True if the
    /// memory figures moved since the last publish.
    pub(super) fn publish(&mut self, s: &KvStoreStats, capacity: u64) -> bool {
        self.last = Some(Instant::now());
        let memory = (s.leased_bytes, s.os_resident_bytes);
        let moved = self.memory != Some(memory);
        self.memory = Some(memory);
        self.sequences.set(s.sequences as f64);
        self.preempted.set(s.preempted as f64);
        self.tokens.set(s.tokens as f64);
        self.leased.set(s.leased_bytes as f64);
        self.os_resident.set(s.os_resident_bytes as f64);
        if capacity > 0 {
            self.usage.set(s.leased_bytes as f64 / capacity as f64);
        }
        self.swapped.set(s.swapped_bytes as f64);
        self.prefix_queries.absolute(s.prefix_query_tokens);
        self.prefix_hits.absolute(s.prefix_hit_tokens);
        self.evicted.absolute(s.prefix_blocks_evicted);
        self.kept.absolute(s.prefix_blocks_kept);
        if let Some(below) = &self.below {
            below.publish(s);
        }
        self.preempted_swap.absolute(s.preempted_by_swap);
        self.preempted_recompute.absolute(s.preempted_by_recompute);
        self.swap_outs.absolute(s.swap_outs);
        self.swap_out_bytes.absolute(s.swap_out_bytes);
        self.swap_ins.absolute(s.swap_ins);
        self.swap_in_bytes.absolute(s.swap_in_bytes);
        self.restored_swap.absolute(s.restores_swapped);
        self.restored_recompute.absolute(s.restores_recomputed);
        self.replayed.absolute(s.replayed_tokens);
        self.restore_shared.absolute(s.restore_shared_tokens);
        moved
    }

    /// Whether the series are due now (else a publish is scheduled for later).
    pub(super) fn due(&self, now: Instant) -> bool {
        self.last.is_none_or(|t| now.duration_since(t) >= EVERY)
    }
}

/// Times `f` into `latency`.
pub(super) fn timed<T>(latency: &Histogram, f: impl FnOnce() -> T) -> T {
    let start = std::time::Instant::now();
    let out = f();
    latency.record(start.elapsed().as_secs_f64());
    out
}

impl KvStoreState {
    /// After a message: publishes the metrics when due, else makes sure they are soon.
    pub(super) async fn changed(&mut self, myself: &ActorRef<KvStoreMsg>) {
        // Not due yet, or published with the memory still moving: once more, soon.
        let again = !self.metrics.due(tokio::time::Instant::now()) || self.publish().await;
        if again {
            self.publish_soon(myself);
        }
    }

    /// The publish scheduled by `publish_soon` is due. Memory freed after fences comes back
    /// with no message to the store: while the figures still move, it looks again.
    pub(super) async fn scheduled_publish(&mut self, myself: &ActorRef<KvStoreMsg>) {
        self.metrics.armed = false;
        if self.publish().await {
            self.publish_soon(myself);
        }
    }

    /// Answers a `Stats` message.
    pub(super) fn send_stats(&self, reply: RpcReplyPort<Result<KvStoreStats, KvStoreError>>) {
        let _ = reply.send(Ok(self.stats()));
    }

    /// Schedules one publish (none if one is scheduled already).
    pub(super) fn publish_soon(&mut self, myself: &ActorRef<KvStoreMsg>) {
        if !self.metrics.armed {
            self.metrics.armed = true;
            myself.send_after(EVERY, || KvStoreMsg::Publish);
        }
    }

    /// Publishes the metrics and the digest now; true if the store's memory moved since the
    /// last time.
    pub(super) async fn publish(&mut self) -> bool {
        self.digest.send_replace(Arc::new(self.prefix_digest()));
        let stats = self.stats();
        let capacity = match self.governor.snapshot().await {
            Ok(s) => s.books.capacity,
            Err(_) => 0,
        };
        self.metrics.publish(&stats, capacity)
    }

    pub(super) fn stats(&self) -> KvStoreStats {
        let mut stats = self.stats.clone();
        stats.preemptions = stats.preempted_by_swap + stats.preempted_by_recompute;
        // Every swap-in is a restore that copied the K/V back.
        stats.restores_swapped = stats.swap_ins;
        let held = self.sequences.held();
        stats.sequences = held.sequences;
        stats.preempted = held.preempted;
        stats.tokens = held.tokens;
        stats.exclusive_bytes = held.exclusive_bytes;
        stats.prefix_entries = self.prefixes.blocks().count();
        stats.prefix_bytes = self.prefixes.blocks().map(|(_, b, _, _)| b.bytes).sum();
        if let Some(tier) = &self.tier {
            tier.fill(&mut stats);
        }
        stats.leased_bytes = self.tally.bytes();
        stats.os_resident_bytes = self.device.resident_bytes();
        stats.swap = self.swap.kind();
        let outcomes = &self.swap_outcomes;
        stats.swap_outs = outcomes.outs.load(Ordering::Relaxed);
        stats.swap_out_bytes = outcomes.out_bytes.load(Ordering::Relaxed);
        stats.swap_fallbacks += outcomes.failed.load(Ordering::Relaxed);
        stats.swapped_bytes = self.sequences.swapped_bytes();
        stats.copies_in = self.sequences.copies_in();
        stats
    }
}
