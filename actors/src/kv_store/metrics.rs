//! The store's series: gauges and counters mirror [`KvStoreStats`] (so the endpoint and
//! `KvStoreHandle::stats` agree), published at most every [`EVERY`] and once more after
//! the last change, and again while the memory figures still move (memory freed after its
//! fences comes back with no message to the store); latencies are recorded where they happen.

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
use tokio::time::{Duration, Instant};

use super::KvStoreStats;

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
