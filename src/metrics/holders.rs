//! What the holders do, as an operator watches it: per holder (from the Governor's books),
//! per KV store and per model residency.

use super::{latency, metric, Kind, Metric, MICROSECONDS, MILLISECONDS};
use metrics::Unit;

const HOLDER: &[&str] = &["authority", "holder"];
const STORE: &[&str] = &["store", "authority"];
const STORE_MODE: &[&str] = &["store", "authority", "mode"];
const STORE_DIRECTION: &[&str] = &["store", "authority", "direction"];
const RESIDENCY: &[&str] = &["holder", "authority"];
const RESIDENCY_PLACEMENT: &[&str] = &["holder", "authority", "placement"];

/// From a reserve call to its grant, as the caller sees it, waiting for room included.
pub const GOVERNOR_GRANT_SECONDS: Metric = latency(
    "procmem_governor_grant_seconds",
    &["authority"],
    "From a reserve call to its grant, waiting for room included.",
    MICROSECONDS,
);
/// Bytes approved to one holder (granted or leased), as the Governor's books say.
pub const HOLDER_APPROVED_BYTES: Metric = metric(
    "procmem_holder_approved_bytes",
    Kind::Gauge,
    Unit::Bytes,
    HOLDER,
    "Bytes approved to one holder (granted or leased), as the Governor's books say.",
);
/// Pressure tickets the Governor sent to one holder.
pub const HOLDER_PRESSURE_TICKETS_TOTAL: Metric = metric(
    "procmem_holder_pressure_tickets_total",
    Kind::Counter,
    Unit::Count,
    HOLDER,
    "Pressure tickets the Governor sent to one holder.",
);
/// Bytes one holder reported freed for pressure tickets.
pub const HOLDER_PRESSURE_FREED_BYTES_TOTAL: Metric = metric(
    "procmem_holder_pressure_freed_bytes_total",
    Kind::Counter,
    Unit::Bytes,
    HOLDER,
    "Bytes one holder reported freed for pressure tickets.",
);
/// Sequences open in a KV store, active or preempted.
pub const KV_SEQUENCES: Metric = metric(
    "procmem_kv_sequences",
    Kind::Gauge,
    Unit::Count,
    STORE,
    "Sequences open in a KV store, active or preempted.",
);
/// Sequences of a KV store preempted now (saved or dropped, waiting for a restore).
pub const KV_PREEMPTED_SEQUENCES: Metric = metric(
    "procmem_kv_preempted_sequences",
    Kind::Gauge,
    Unit::Count,
    STORE,
    "Sequences of a KV store preempted now (saved or dropped, waiting for a restore).",
);
/// Tokens whose K/V the active sequences of a KV store hold in memory.
pub const KV_TOKENS: Metric = metric(
    "procmem_kv_tokens",
    Kind::Gauge,
    Unit::Count,
    STORE,
    "Tokens whose K/V the active sequences of a KV store hold in memory.",
);
/// Bytes a KV store's leases hold with its Governor, memory waiting for fences included.
pub const KV_LEASED_BYTES: Metric = metric(
    "procmem_kv_leased_bytes",
    Kind::Gauge,
    Unit::Bytes,
    STORE,
    "Bytes a KV store's leases hold with its Governor, memory waiting for fences included.",
);
/// Bytes of a KV store's memory the OS or driver reports resident.
pub const KV_OS_RESIDENT_BYTES: Metric = metric(
    "procmem_kv_os_resident_bytes",
    Kind::Gauge,
    Unit::Bytes,
    STORE,
    "Bytes of a KV store's memory the OS or driver reports resident.",
);
/// A KV store's leased bytes over its authority's capacity (0 to 1).
pub const KV_AUTHORITY_USAGE_RATIO: Metric = metric(
    "procmem_kv_authority_usage_ratio",
    Kind::Gauge,
    Unit::Count,
    STORE,
    "A KV store's leased bytes over its authority's capacity (0 to 1).",
);
/// Bytes of KV a store has swapped out now (host tier or disk).
pub const KV_SWAPPED_BYTES: Metric = metric(
    "procmem_kv_swapped_bytes",
    Kind::Gauge,
    Unit::Bytes,
    STORE,
    "Bytes of KV a store has swapped out now (host tier or disk).",
);
/// Prompt tokens looked up in the prefix cache when sequences opened.
pub const KV_PREFIX_QUERY_TOKENS_TOTAL: Metric = metric(
    "procmem_kv_prefix_query_tokens_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Prompt tokens looked up in the prefix cache when sequences opened.",
);
/// Prompt tokens whose K/V came from shared cached blocks when sequences opened.
pub const KV_PREFIX_HIT_TOKENS_TOTAL: Metric = metric(
    "procmem_kv_prefix_hit_tokens_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Prompt tokens whose K/V came from shared cached blocks when sequences opened.",
);
/// Shared prompt blocks evicted from the prefix cache.
pub const KV_PREFIX_BLOCKS_EVICTED_TOTAL: Metric = metric(
    "procmem_kv_prefix_blocks_evicted_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Shared prompt blocks evicted from the prefix cache.",
);
/// Whole blocks of closed sequences (prompt and answer) left to the prefix cache.
pub const KV_PREFIX_BLOCKS_KEPT_TOTAL: Metric = metric(
    "procmem_kv_prefix_blocks_kept_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Whole blocks of closed sequences (prompt and answer) left to the prefix cache.",
);
/// Prompt blocks the prefix cache's disk tier holds now.
pub const KV_PREFIX_DISK_BLOCKS: Metric = metric(
    "procmem_kv_prefix_disk_blocks",
    Kind::Gauge,
    Unit::Count,
    STORE,
    "Prompt blocks the prefix cache's disk tier holds now.",
);
/// Bytes of prompt blocks the prefix cache's disk tier holds now.
pub const KV_PREFIX_DISK_BYTES: Metric = metric(
    "procmem_kv_prefix_disk_bytes",
    Kind::Gauge,
    Unit::Bytes,
    STORE,
    "Bytes of prompt blocks the prefix cache's disk tier holds now.",
);
/// Prompt tokens whose K/V came back from the disk tier when sequences opened.
pub const KV_PREFIX_DISK_HIT_TOKENS_TOTAL: Metric = metric(
    "procmem_kv_prefix_disk_hit_tokens_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Prompt tokens whose K/V came back from the disk tier when sequences opened.",
);
/// Evicted prompt blocks copied to the disk tier.
pub const KV_PREFIX_DISK_WRITES_TOTAL: Metric = metric(
    "procmem_kv_prefix_disk_writes_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Evicted prompt blocks copied to the disk tier.",
);
/// Evicted prompt blocks the disk tier's frequency filter kept out (dropped instead).
pub const KV_PREFIX_DISK_REFUSED_TOTAL: Metric = metric(
    "procmem_kv_prefix_disk_refused_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Evicted prompt blocks the disk tier's frequency filter kept out (dropped instead).",
);
/// Disk tier copies that failed (the block was dropped, or recomputed).
pub const KV_PREFIX_DISK_FAILURES_TOTAL: Metric = metric(
    "procmem_kv_prefix_disk_failures_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Disk tier copies that failed (the block was dropped, or recomputed).",
);
/// Latency of one prompt block's copy to or from the disk tier, by direction (out or in).
pub const KV_PREFIX_DISK_SECONDS: Metric = latency(
    "procmem_kv_prefix_disk_seconds",
    STORE_DIRECTION,
    "Latency of one prompt block's copy to or from the disk tier, by direction (out or in).",
    MILLISECONDS,
);
/// Prompt blocks the prefix cache's host tier (under KV on a GPU) holds now.
pub const KV_PREFIX_HOST_BLOCKS: Metric = metric(
    "procmem_kv_prefix_host_blocks",
    Kind::Gauge,
    Unit::Count,
    STORE,
    "Prompt blocks the prefix cache's host tier (under KV on a GPU) holds now.",
);
/// Bytes of prompt blocks the prefix cache's host tier holds now.
pub const KV_PREFIX_HOST_BYTES: Metric = metric(
    "procmem_kv_prefix_host_bytes",
    Kind::Gauge,
    Unit::Bytes,
    STORE,
    "Bytes of prompt blocks the prefix cache's host tier holds now.",
);
/// Prompt tokens whose K/V came back from the host tier when sequences opened.
pub const KV_PREFIX_HOST_HIT_TOKENS_TOTAL: Metric = metric(
    "procmem_kv_prefix_host_hit_tokens_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Prompt tokens whose K/V came back from the host tier when sequences opened.",
);
/// Evicted prompt blocks copied to the host tier.
pub const KV_PREFIX_HOST_WRITES_TOTAL: Metric = metric(
    "procmem_kv_prefix_host_writes_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Evicted prompt blocks copied to the host tier.",
);
/// Evicted prompt blocks the host tier's filter kept out (dropped instead).
pub const KV_PREFIX_HOST_REFUSED_TOTAL: Metric = metric(
    "procmem_kv_prefix_host_refused_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Evicted prompt blocks the host tier's filter kept out (dropped instead).",
);
/// Host tier copies that could not be queued (the block was dropped, or recomputed).
pub const KV_PREFIX_HOST_FAILURES_TOTAL: Metric = metric(
    "procmem_kv_prefix_host_failures_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Host tier copies that could not be queued (the block was dropped, or recomputed).",
);
/// Latency of one prompt block's copy to or from the host tier, by direction (out or in):
/// from its queuing on the store's stream to its fence.
pub const KV_PREFIX_HOST_SECONDS: Metric = latency(
    "procmem_kv_prefix_host_seconds",
    STORE_DIRECTION,
    "Latency of one prompt block's copy to or from the host tier, by direction (out or in), from its queuing to its fence.",
    MILLISECONDS,
);
/// Sequences preempted under pressure, by mode (swap or recompute).
pub const KV_PREEMPTIONS_TOTAL: Metric = metric(
    "procmem_kv_preemptions_total",
    Kind::Counter,
    Unit::Count,
    STORE_MODE,
    "Sequences preempted under pressure, by mode (swap or recompute).",
);
/// Sequences whose K/V was copied out to the swap space.
pub const KV_SWAP_OUTS_TOTAL: Metric = metric(
    "procmem_kv_swap_outs_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Sequences whose K/V was copied out to the swap space.",
);
/// Bytes of K/V copied out to the swap space.
pub const KV_SWAP_OUT_BYTES_TOTAL: Metric = metric(
    "procmem_kv_swap_out_bytes_total",
    Kind::Counter,
    Unit::Bytes,
    STORE,
    "Bytes of K/V copied out to the swap space.",
);
/// Sequences whose K/V was copied back from the swap space.
pub const KV_SWAP_INS_TOTAL: Metric = metric(
    "procmem_kv_swap_ins_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Sequences whose K/V was copied back from the swap space.",
);
/// Bytes of K/V copied back from the swap space.
pub const KV_SWAP_IN_BYTES_TOTAL: Metric = metric(
    "procmem_kv_swap_in_bytes_total",
    Kind::Counter,
    Unit::Bytes,
    STORE,
    "Bytes of K/V copied back from the swap space.",
);
/// Latency of one sequence's copy to or from the swap space, by direction (out or in).
pub const KV_SWAP_SECONDS: Metric = latency(
    "procmem_kv_swap_seconds",
    STORE_DIRECTION,
    "Latency of one sequence's copy to or from the swap space, by direction (out or in).",
    MILLISECONDS,
);
/// Preempted sequences restored, by mode (swap: copied back; recompute: to be replayed).
pub const KV_RESTORES_TOTAL: Metric = metric(
    "procmem_kv_restores_total",
    Kind::Counter,
    Unit::Count,
    STORE_MODE,
    "Preempted sequences restored, by mode (swap: copied back; recompute: to be replayed).",
);
/// Tokens handed back to be recomputed by restores of dropped sequences.
pub const KV_REPLAYED_TOKENS_TOTAL: Metric = metric(
    "procmem_kv_replayed_tokens_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Tokens handed back to be recomputed by restores of dropped sequences.",
);
/// Tokens restores mapped again from the cached prompt blocks they shared before preemption.
pub const KV_RESTORE_SHARED_TOKENS_TOTAL: Metric = metric(
    "procmem_kv_restore_shared_tokens_total",
    Kind::Counter,
    Unit::Count,
    STORE,
    "Tokens restores mapped again from the cached prompt blocks they shared before preemption.",
);
/// Latency of mapping one sequence's growth into its K/V buffers.
pub const KV_GROWTH_MAP_SECONDS: Metric = latency(
    "procmem_kv_growth_map_seconds",
    STORE,
    "Latency of mapping one sequence's growth into its K/V buffers.",
    MICROSECONDS,
);
/// Layers of a model residency, by placement (device, host or disk).
pub const RESIDENCY_LAYERS: Metric = metric(
    "procmem_residency_layers",
    Kind::Gauge,
    Unit::Count,
    RESIDENCY_PLACEMENT,
    "Layers of a model residency, by placement (device, host or disk).",
);
/// Layers offloaded to the host tier or disk under pressure.
pub const RESIDENCY_OFFLOADS_TOTAL: Metric = metric(
    "procmem_residency_offloads_total",
    Kind::Counter,
    Unit::Count,
    RESIDENCY,
    "Layers offloaded to the host tier or disk under pressure.",
);
/// Bytes of layers offloaded to the host tier or disk.
pub const RESIDENCY_OFFLOAD_BYTES_TOTAL: Metric = metric(
    "procmem_residency_offload_bytes_total",
    Kind::Counter,
    Unit::Bytes,
    RESIDENCY,
    "Bytes of layers offloaded to the host tier or disk.",
);
/// Offloaded layers reloaded into device memory before use.
pub const RESIDENCY_RELOADS_TOTAL: Metric = metric(
    "procmem_residency_reloads_total",
    Kind::Counter,
    Unit::Count,
    RESIDENCY,
    "Offloaded layers reloaded into device memory before use.",
);
/// Bytes of layers reloaded into device memory.
pub const RESIDENCY_RELOAD_BYTES_TOTAL: Metric = metric(
    "procmem_residency_reload_bytes_total",
    Kind::Counter,
    Unit::Bytes,
    RESIDENCY,
    "Bytes of layers reloaded into device memory.",
);
/// Latency of one layer's offload (room in the lower tier, then the copy out queued).
pub const RESIDENCY_OFFLOAD_SECONDS: Metric = latency(
    "procmem_residency_offload_seconds",
    RESIDENCY,
    "Latency of one layer's offload (room in the lower tier, then the copy out queued).",
    MILLISECONDS,
);
/// Latency of one layer's reload (room on the device, then the copy in).
pub const RESIDENCY_RELOAD_SECONDS: Metric = latency(
    "procmem_residency_reload_seconds",
    RESIDENCY,
    "Latency of one layer's reload (room on the device, then the copy in).",
    MILLISECONDS,
);

/// Every holder metric, in the order the table of docs/metrics.md lists them.
pub(super) const HOLDERS: &[Metric] = &[
    GOVERNOR_GRANT_SECONDS,
    HOLDER_APPROVED_BYTES,
    HOLDER_PRESSURE_TICKETS_TOTAL,
    HOLDER_PRESSURE_FREED_BYTES_TOTAL,
    KV_SEQUENCES,
    KV_PREEMPTED_SEQUENCES,
    KV_TOKENS,
    KV_LEASED_BYTES,
    KV_OS_RESIDENT_BYTES,
    KV_AUTHORITY_USAGE_RATIO,
    KV_SWAPPED_BYTES,
    KV_PREFIX_QUERY_TOKENS_TOTAL,
    KV_PREFIX_HIT_TOKENS_TOTAL,
    KV_PREFIX_BLOCKS_EVICTED_TOTAL,
    KV_PREFIX_BLOCKS_KEPT_TOTAL,
    KV_PREFIX_DISK_BLOCKS,
    KV_PREFIX_DISK_BYTES,
    KV_PREFIX_DISK_HIT_TOKENS_TOTAL,
    KV_PREFIX_DISK_WRITES_TOTAL,
    KV_PREFIX_DISK_REFUSED_TOTAL,
    KV_PREFIX_DISK_FAILURES_TOTAL,
    KV_PREFIX_DISK_SECONDS,
    KV_PREFIX_HOST_BLOCKS,
    KV_PREFIX_HOST_BYTES,
    KV_PREFIX_HOST_HIT_TOKENS_TOTAL,
    KV_PREFIX_HOST_WRITES_TOTAL,
    KV_PREFIX_HOST_REFUSED_TOTAL,
    KV_PREFIX_HOST_FAILURES_TOTAL,
    KV_PREFIX_HOST_SECONDS,
    KV_PREEMPTIONS_TOTAL,
    KV_SWAP_OUTS_TOTAL,
    KV_SWAP_OUT_BYTES_TOTAL,
    KV_SWAP_INS_TOTAL,
    KV_SWAP_IN_BYTES_TOTAL,
    KV_SWAP_SECONDS,
    KV_RESTORES_TOTAL,
    KV_REPLAYED_TOKENS_TOTAL,
    KV_RESTORE_SHARED_TOKENS_TOTAL,
    KV_GROWTH_MAP_SECONDS,
    RESIDENCY_LAYERS,
    RESIDENCY_OFFLOADS_TOTAL,
    RESIDENCY_OFFLOAD_BYTES_TOTAL,
    RESIDENCY_RELOADS_TOTAL,
    RESIDENCY_RELOAD_BYTES_TOTAL,
    RESIDENCY_OFFLOAD_SECONDS,
    RESIDENCY_RELOAD_SECONDS,
];
