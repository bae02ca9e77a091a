//! The Governor's metrics, registered once per authority (Prometheus naming).

use metrics::{counter, gauge, Counter, Gauge};

pub(super) struct GovernorMetrics {
    capacity: Gauge,
    approved: Gauge,
    provisional: Gauge,
    committed: Gauge,
    waiting: Gauge,
    pub(super) grants: Counter,
    pub(super) denials: Counter,
    pub(super) waits: Counter,
    pub(super) tickets: Counter,
    pub(super) freed_by_pressure: Counter,
}

impl GovernorMetrics {
    pub(super) fn new(authority: &str) -> Self {
        let label = || [("authority", authority.to_string())];
        GovernorMetrics {
            capacity: gauge!("procmem_governor_capacity_bytes", &label()),
            approved: gauge!("procmem_governor_approved_bytes", &label()),
            provisional: gauge!("procmem_governor_provisional_bytes", &label()),
            committed: gauge!("procmem_governor_committed_bytes", &label()),
            waiting: gauge!("procmem_governor_waiting_requests", &label()),
            grants: counter!("procmem_governor_grants_total", &label()),
            denials: counter!("procmem_governor_denials_total", &label()),
            waits: counter!("procmem_governor_waits_total", &label()),
            tickets: counter!("procmem_governor_pressure_tickets_total", &label()),
            freed_by_pressure: counter!("procmem_governor_pressure_freed_bytes_total", &label()),
        }
    }

    pub(super) fn publish(&self, capacity: u64, provisional: u64, leased: u64, waiting: usize) {
        self.capacity.set(capacity as f64);
        self.approved.set((provisional + leased) as f64);
        self.provisional.set(provisional as f64);
        self.committed.set(leased as f64);
        self.waiting.set(waiting as f64);
    }
}
