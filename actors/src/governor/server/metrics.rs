//! The Governor's metrics, registered once per authority (Prometheus naming), and those of
//! each holder as the Governor's books see it.

use std::collections::HashMap;

use ::metrics::{Counter, Gauge};
use procmem::ledger::{AuthorityId, HolderId, Ledger};
use procmem::metrics::{
    GOVERNOR_APPROVED_BYTES, GOVERNOR_CAPACITY_BYTES, GOVERNOR_COMMITTED_BYTES,
    GOVERNOR_CREDIT_BYTES, GOVERNOR_CREDIT_RECLAIMED_BYTES_TOTAL, GOVERNOR_DENIALS_TOTAL,
    GOVERNOR_GRANTS_TOTAL, GOVERNOR_PRESSURE_FREED_BYTES_TOTAL, GOVERNOR_PRESSURE_TICKETS_TOTAL,
    GOVERNOR_PROVISIONAL_BYTES, GOVERNOR_WAITING_REQUESTS, GOVERNOR_WAITS_TOTAL,
    HOLDER_APPROVED_BYTES, HOLDER_PRESSURE_FREED_BYTES_TOTAL, HOLDER_PRESSURE_TICKETS_TOTAL,
};

/// One holder's series.
struct HolderSeries {
    approved: Gauge,
    tickets: Counter,
    freed: Counter,
}

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
    tickets: Counter,
    freed_by_pressure: Counter,
    authority: String,
    holders: HashMap<HolderId, HolderSeries>,
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
            authority: authority.to_string(),
            holders: HashMap::new(),
        }
    }

    /// Follows the live holders of `authority` after one registered, retired or came back
    /// with a restart. A holder's label is its name, with `#id` where two live holders share
    /// one; a retired holder's gauge goes to zero.
    pub(super) fn sync_holders(&mut self, ledger: &Ledger, authority: AuthorityId) {
        let live = ledger.holders_of(authority);
        self.holders.retain(|id, series| {
            let keep = live.iter().any(|h| h.holder == *id);
            if !keep {
                series.approved.set(0.0);
            }
            keep
        });
        let names: Vec<(HolderId, &str)> = live
            .iter()
            .filter_map(|h| ledger.holder(h.holder).map(|r| (h.holder, r.name)))
            .collect();
        for &(holder, name) in &names {
            if self.holders.contains_key(&holder) {
                continue;
            }
            let label = if names.iter().filter(|(_, n)| *n == name).count() > 1 {
                format!("{name}#{}", holder.get())
            } else {
                name.to_string()
            };
            let labels = [self.authority.as_str(), label.as_str()];
            self.holders.insert(
                holder,
                HolderSeries {
                    approved: HOLDER_APPROVED_BYTES.gauge(&labels),
                    tickets: HOLDER_PRESSURE_TICKETS_TOTAL.counter(&labels),
                    freed: HOLDER_PRESSURE_FREED_BYTES_TOTAL.counter(&labels),
                },
            );
        }
    }

    /// A ticket went to `holder`.
    pub(super) fn ticket_sent(&self, holder: HolderId) {
        self.tickets.increment(1);
        if let Some(series) = self.holders.get(&holder) {
            series.tickets.increment(1);
        }
    }

    /// `holder` reported `bytes` freed for a ticket.
    pub(super) fn freed(&self, holder: HolderId, bytes: u64) {
        self.freed_by_pressure.increment(bytes);
        if let Some(series) = self.holders.get(&holder) {
            series.freed.increment(bytes);
        }
    }

    /// Each holder's approved bytes now.
    pub(super) fn publish_holders(&self, ledger: &Ledger) {
        for (holder, series) in &self.holders {
            series
                .approved
                .set(ledger.approved_to(*holder).unwrap_or(0) as f64);
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
