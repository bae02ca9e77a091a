//! Residency's series: layer gauges and counters mirror [`ResidencyStats`] (so the endpoint
//! and `ResidencyHandle::stats` agree), set after every message; latencies are recorded where
//! each offload or reload happens.

use ::metrics::{Counter, Gauge, Histogram};
use procmem::metrics::{
    RESIDENCY_LAYERS, RESIDENCY_OFFLOADS_TOTAL, RESIDENCY_OFFLOAD_BYTES_TOTAL,
    RESIDENCY_OFFLOAD_SECONDS, RESIDENCY_RELOADS_TOTAL, RESIDENCY_RELOAD_BYTES_TOTAL,
    RESIDENCY_RELOAD_SECONDS,
};

use super::ResidencyStats;

pub(super) struct ResidencyMetrics {
    on_device: Gauge,
    on_host: Gauge,
    on_disk: Gauge,
    offloads: Counter,
    offload_bytes: Counter,
    reloads: Counter,
    reload_bytes: Counter,
    /// One layer offloaded.
    pub(super) offload: Histogram,
    /// One layer reloaded.
    pub(super) reload: Histogram,
}

impl ResidencyMetrics {
    pub(super) fn new(holder: &str, authority: &str) -> Self {
        let l = [holder, authority];
        ResidencyMetrics {
            on_device: RESIDENCY_LAYERS.gauge(&[holder, authority, "device"]),
            on_host: RESIDENCY_LAYERS.gauge(&[holder, authority, "host"]),
            on_disk: RESIDENCY_LAYERS.gauge(&[holder, authority, "disk"]),
            offloads: RESIDENCY_OFFLOADS_TOTAL.counter(&l),
            offload_bytes: RESIDENCY_OFFLOAD_BYTES_TOTAL.counter(&l),
            reloads: RESIDENCY_RELOADS_TOTAL.counter(&l),
            reload_bytes: RESIDENCY_RELOAD_BYTES_TOTAL.counter(&l),
            offload: RESIDENCY_OFFLOAD_SECONDS.histogram(&l),
            reload: RESIDENCY_RELOAD_SECONDS.histogram(&l),
        }
    }

    /// Sets every series from `s`.
    pub(super) fn publish(&self, s: &ResidencyStats) {
        self.on_device.set(s.resident_layers as f64);
        self.on_host
            .set(s.offloaded_layers.saturating_sub(s.disk_layers) as f64);
        self.on_disk.set(s.disk_layers as f64);
        self.offloads.absolute(s.offloads);
        self.offload_bytes.absolute(s.offload_bytes_total);
        self.reloads.absolute(s.reloads);
        self.reload_bytes.absolute(s.reload_bytes_total);
    }
}
