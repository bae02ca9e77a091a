//! The Governor's metrics, registered once per authority (Prometheus naming).

use ::metrics::{Counter, Gauge};
use procmem::metrics::{
    GOVERNOR_APPROVED_BYTES, GOVERNOR_CAPACITY_BYTES, GOVERNOR_COMMITTED_BYTES,
    GOVERNOR_CREDIT_BYTES, GOVERNOR_CREDIT_RECLAIMED_BYTES_TOTAL, GOVERNOR_DENIALS_TOTAL,
    GOVERNOR_GRANTS_TOTAL, GOVERNOR_PRESSURE_FREED_BYTES_TOTAL, GOVERNOR_PRESSURE_TICKETS_TOTAL,
    GOVERNOR_PROVISIONAL_BYTES, GOVERNOR_WAITING_REQUESTS, GOVERNOR_WAITS_TOTAL,
};

pub(super) struct GovernorMetrics {
    capacity: Gauge,
    approved: Gauge,
    provisional: Gauge,
    committed: Gauge,
    waiting: Gauge,
    credit: Gauge,
    pub(super) credit_reclaimed: Counter,
    pub(super) grants: Counter,
    pub(super) denials: Counter,
    pub(super) waits: Counter,
    pub(super) tickets: Counter,
    pub(super) freed_by_pressure: Counter,
}

impl GovernorMetrics {
    pub(super) fn new(authority: &str) -> Self {
        let label = [authority];
        GovernorMetrics {
            capacity: GOVERNOR_CAPACITY_BYTES.gauge(&label),
            approved: GOVERNOR_APPROVED_BYTES.gauge(&label),
            provisional: GOVERNOR_PROVISIONAL_BYTES.gauge(&label),
            committed: GOVERNOR_COMMITTED_BYTES.gauge(&label),
            waiting: GOVERNOR_WAITING_REQUESTS.gauge(&label),
            credit: GOVERNOR_CREDIT_BYTES.gauge(&label),
            credit_reclaimed: GOVERNOR_CREDIT_RECLAIMED_BYTES_TOTAL.counter(&label),
            grants: GOVERNOR_GRANTS_TOTAL.counter(&label),
            denials: GOVERNOR_DENIALS_TOTAL.counter(&label),
            waits: GOVERNOR_WAITS_TOTAL.counter(&label),
            tickets: GOVERNOR_PRESSURE_TICKETS_TOTAL.counter(&label),
            freed_by_pressure: GOVERNOR_PRESSURE_FREED_BYTES_TOTAL.counter(&label),
        }
    }

    pub(super) fn publish(
        &self,
        capacity: u64,
        provisional: u64,
        leased: u64,
        credit: u64,
        waiting: usize,
    ) {
        self.credit.set(credit as f64);
        self.capacity.set(capacity as f64);
        self.approved.set((provisional + leased) as f64);
        self.provisional.set(provisional as f64);
        self.committed.set(leased as f64);
        self.waiting.set(waiting as f64);
    }
}
