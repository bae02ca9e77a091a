//! Every metric this project emits, in one place: its name, type, unit, labels and help text.
//!
//! The call sites that record a metric and the registration that describes it to the
//! recorder (`describe_all`) both read these constants, so a name and its help text exist
//! once. Names follow Prometheus conventions: base units (`_bytes`, `_seconds`) and `_total`
//! on counters.

use metrics::Unit;

mod holders;
mod http;
pub use holders::*;
pub use http::*;

/// What kind of series a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// A value now.
    Gauge,
    /// A distribution of observations.
    Histogram,
}

impl Kind {
    /// The Prometheus type name.
    pub const fn prometheus(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One metric's description.
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    /// Its name.
    pub name: &'static str,
    /// Its kind.
    pub kind: Kind,
    /// Its unit.
    pub unit: Unit,
    /// The labels every series of it carries.
    pub labels: &'static [&'static str],
    /// What it measures.
    pub help: &'static str,
    /// A histogram's bucket upper bounds, in its unit (empty for other kinds).
    pub buckets: &'static [f64],
}

const fn metric(
    name: &'static str,
    kind: Kind,
    unit: Unit,
    labels: &'static [&'static str],
    help: &'static str,
) -> Metric {
    Metric {
        name,
        kind,
        unit,
        labels,
        help,
        buckets: &[],
    }
}

/// A latency histogram, in seconds, with buckets chosen for its range.
const fn latency(
    name: &'static str,
    labels: &'static [&'static str],
    help: &'static str,
    buckets: &'static [f64],
) -> Metric {
    Metric {
        name,
        kind: Kind::Histogram,
        unit: Unit::Seconds,
        labels,
        help,
        buckets,
    }
}

/// Buckets for what takes microseconds (a grant, a refund after a fence, a mapping call),
/// with a tail up to seconds for what waited.
pub const MICROSECONDS: &[f64] = &[
    2e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0, 10.0,
];
/// Buckets for what takes milliseconds (a swap, a weight offload or reload).
pub const MILLISECONDS: &[f64] = &[
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];
/// Buckets for what takes seconds (a client's wait for a first token, a whole answer).
pub const SECONDS: &[f64] = &[
    1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

const AUTHORITY: &[&str] = &["authority"];
const STREAM: &[&str] = &["stream"];
const BACKING: &[&str] = &["backing"];
const NODE_PROCESS: &[&str] = &["authority", "process"];
const NONE: &[&str] = &[];

/// Bytes the authority may approve.
pub const GOVERNOR_CAPACITY_BYTES: Metric = metric(
    "procmem_governor_capacity_bytes",
    Kind::Gauge,
    Unit::Bytes,
    AUTHORITY,
    "Bytes the authority may approve.",
);
/// Bytes approved: provisional plus committed.
pub const GOVERNOR_APPROVED_BYTES: Metric = metric(
    "procmem_governor_approved_bytes",
    Kind::Gauge,
    Unit::Bytes,
    AUTHORITY,
    "Bytes approved: provisional plus committed.",
);
/// Bytes granted but not yet committed.
pub const GOVERNOR_PROVISIONAL_BYTES: Metric = metric(
    "procmem_governor_provisional_bytes",
    Kind::Gauge,
    Unit::Bytes,
    AUTHORITY,
    "Bytes granted but not yet committed.",
);
/// Bytes committed to leases.
pub const GOVERNOR_COMMITTED_BYTES: Metric = metric(
    "procmem_governor_committed_bytes",
    Kind::Gauge,
    Unit::Bytes,
    AUTHORITY,
    "Bytes committed to leases.",
);
/// Requests waiting for room.
pub const GOVERNOR_WAITING_REQUESTS: Metric = metric(
    "procmem_governor_waiting_requests",
    Kind::Gauge,
    Unit::Count,
    AUTHORITY,
    "Requests waiting for room.",
);
/// Grants issued.
pub const GOVERNOR_GRANTS_TOTAL: Metric = metric(
    "procmem_governor_grants_total",
    Kind::Counter,
    Unit::Count,
    AUTHORITY,
    "Grants issued.",
);
/// Requests denied, at once or at their deadline.
pub const GOVERNOR_DENIALS_TOTAL: Metric = metric(
    "procmem_governor_denials_total",
    Kind::Counter,
    Unit::Count,
    AUTHORITY,
    "Requests denied, at once or at their deadline.",
);
/// Requests that waited for room.
pub const GOVERNOR_WAITS_TOTAL: Metric = metric(
    "procmem_governor_waits_total",
    Kind::Counter,
    Unit::Count,
    AUTHORITY,
    "Requests that waited for room.",
);
/// Pressure tickets sent to holders.
pub const GOVERNOR_PRESSURE_TICKETS_TOTAL: Metric = metric(
    "procmem_governor_pressure_tickets_total",
    Kind::Counter,
    Unit::Count,
    AUTHORITY,
    "Pressure tickets sent to holders.",
);
/// Bytes holders reported freed for pressure tickets.
pub const GOVERNOR_PRESSURE_FREED_BYTES_TOTAL: Metric = metric(
    "procmem_governor_pressure_freed_bytes_total",
    Kind::Counter,
    Unit::Bytes,
    AUTHORITY,
    "Bytes holders reported freed for pressure tickets.",
);
/// Bytes approved to children as standing credit, used or not.
pub const GOVERNOR_CREDIT_BYTES: Metric = metric(
    "procmem_governor_credit_bytes",
    Kind::Gauge,
    Unit::Bytes,
    AUTHORITY,
    "Bytes approved to children as standing credit, used or not.",
);
/// Unused credit taken back from children to make room.
pub const GOVERNOR_CREDIT_RECLAIMED_BYTES_TOTAL: Metric = metric(
    "procmem_governor_credit_reclaimed_bytes_total",
    Kind::Counter,
    Unit::Bytes,
    AUTHORITY,
    "Unused credit taken back from children to make room.",
);
/// Bytes the node Governor may approve to the processes of one authority.
pub const NODE_CAPACITY_BYTES: Metric = metric(
    "procmem_node_capacity_bytes",
    Kind::Gauge,
    Unit::Bytes,
    AUTHORITY,
    "Bytes the node Governor may approve to the processes of one authority.",
);
/// Credit the node Governor approved to processes.
pub const NODE_CREDIT_BYTES: Metric = metric(
    "procmem_node_credit_bytes",
    Kind::Gauge,
    Unit::Bytes,
    AUTHORITY,
    "Credit the node Governor approved to processes.",
);
/// Credit the node Governor approved to one process.
pub const NODE_PROCESS_CREDIT_BYTES: Metric = metric(
    "procmem_node_process_credit_bytes",
    Kind::Gauge,
    Unit::Bytes,
    NODE_PROCESS,
    "Credit the node Governor approved to one process (`process`: its name and pid, `name[pid]`).",
);
/// The share of an authority the node Governor guarantees one process.
pub const NODE_PROCESS_GUARANTEE_BYTES: Metric = metric(
    "procmem_node_process_guarantee_bytes",
    Kind::Gauge,
    Unit::Bytes,
    NODE_PROCESS,
    "The share of the authority the node Governor guarantees one process: what it gets back within one ticket round from processes over theirs.",
);
/// Credit taken back from processes that stopped answering while over their guarantee.
pub const NODE_REVOKED_BYTES_TOTAL: Metric = metric(
    "procmem_node_revoked_bytes_total",
    Kind::Counter,
    Unit::Bytes,
    NODE_PROCESS,
    "Credit the node Governor took back, without its answer, from a process over its guarantee that stopped answering while another waited under its own.",
);
/// Bytes one process last reported the OS or driver holds for it.
pub const NODE_PROCESS_OS_BYTES: Metric = metric(
    "procmem_node_process_os_bytes",
    Kind::Gauge,
    Unit::Bytes,
    NODE_PROCESS,
    "Bytes one process last reported the OS or driver holds for it.",
);
/// Pressure tickets the node Governor sent to processes.
pub const NODE_TICKETS_TOTAL: Metric = metric(
    "procmem_node_tickets_total",
    Kind::Counter,
    Unit::Count,
    AUTHORITY,
    "Pressure tickets the node Governor sent to processes.",
);
/// Frames from peers that did not decode or validate, dropped.
pub const NODE_REJECTED_FRAMES_TOTAL: Metric = metric(
    "procmem_node_rejected_frames_total",
    Kind::Counter,
    Unit::Count,
    NONE,
    "Frames from peers that did not decode or validate, dropped.",
);
/// Frames from a process already reaped: the race of an ordinary exit, not a hostile peer.
pub const NODE_LATE_FRAMES_TOTAL: Metric = metric(
    "procmem_node_late_frames_total",
    Kind::Counter,
    Unit::Count,
    NONE,
    "Frames from a process the node had already reaped (sent as it exited), dropped and not counted as rejected.",
);
/// Frames naming a process with another session's key: refused, never applied.
pub const NODE_FOREIGN_FRAMES_TOTAL: Metric = metric(
    "procmem_node_foreign_frames_total",
    Kind::Counter,
    Unit::Count,
    NONE,
    "Frames naming a process with another session's key: refused, never applied.",
);
/// Processes confirmed gone whose credit came back.
pub const NODE_REAPED_PROCESSES_TOTAL: Metric = metric(
    "procmem_node_reaped_processes_total",
    Kind::Counter,
    Unit::Count,
    NONE,
    "Processes confirmed gone whose credit came back.",
);
/// The memory the process's cgroup holds outside the host Governor's books (its working set
/// less what the Governor approved), as `--follow-machine` last measured it.
pub const HOST_OUTSIDE_BOOKS_BYTES: Metric = metric(
    "procmem_host_outside_books_bytes",
    Kind::Gauge,
    Unit::Bytes,
    NONE,
    "The cgroup's working set less what the host Governor approved, last measured.",
);
/// What the process holds resident: anonymous and file pages, and its KV backing's pages.
pub const PROCESS_RESIDENT_BYTES: Metric = metric(
    "procmem_process_resident_bytes",
    Kind::Gauge,
    Unit::Bytes,
    NONE,
    "Bytes the process holds resident: anonymous and file pages, and every page of its shared KV backing.",
);
/// What the process holds that no holder leases (heap, code, scratch, activations).
pub const PROCESS_OUTSIDE_BOOKS_BYTES: Metric = metric(
    "procmem_process_outside_books_bytes",
    Kind::Gauge,
    Unit::Bytes,
    NONE,
    "Bytes the process holds resident that no holder's lease pays for: heap, code, scratch, activations.",
);
/// What a cgroup limit keeps free for memory the Governor does not govern.
pub const HOST_RESERVE_BYTES: Metric = metric(
    "procmem_host_reserve_bytes",
    Kind::Gauge,
    Unit::Bytes,
    NONE,
    "Bytes under the cgroup limit kept for memory outside the host Governor's books.",
);
/// Times the Governor died and was restarted with the holders' books.
pub const GOVERNOR_RESTARTS_TOTAL: Metric = metric(
    "procmem_governor_restarts_total",
    Kind::Counter,
    Unit::Count,
    AUTHORITY,
    "Times the Governor died and was restarted with the holders' books.",
);
/// Physical bytes behind the authority, as the OS reports them.
pub const AUTHORITY_OS_RESIDENT_BYTES: Metric = metric(
    "procmem_authority_os_resident_bytes",
    Kind::Gauge,
    Unit::Bytes,
    AUTHORITY,
    "Physical bytes behind the authority, as the OS reports them.",
);
/// Committed bytes in the ledger minus physical bytes the OS reports.
pub const AUTHORITY_DRIFT_BYTES: Metric = metric(
    "procmem_authority_drift_bytes",
    Kind::Gauge,
    Unit::Bytes,
    AUTHORITY,
    "Committed bytes in the ledger minus physical bytes the OS reports.",
);
/// Allocations waiting for their fences, per stream.
pub const DEFERRED_FREE_QUEUE_DEPTH: Metric = metric(
    "procmem_deferred_free_queue_depth",
    Kind::Gauge,
    Unit::Count,
    STREAM,
    "Allocations waiting for their fences, per stream.",
);
/// Bytes freed after their fences, per stream.
pub const DEFERRED_FREE_BYTES_TOTAL: Metric = metric(
    "procmem_deferred_free_bytes_total",
    Kind::Counter,
    Unit::Bytes,
    STREAM,
    "Bytes freed after their fences, per stream.",
);
/// From fence completion to the Governor refund.
pub const DEFERRED_FREE_FENCE_TO_REFUND_SECONDS: Metric = latency(
    "procmem_deferred_free_fence_to_refund_seconds",
    STREAM,
    "From fence completion to the Governor refund.",
    MICROSECONDS,
);
/// Allocations whose deferred-free queue was gone, freed after their fences on their own.
pub const DEFERRED_FREE_ORPHANS_TOTAL: Metric = metric(
    "procmem_deferred_free_orphans_total",
    Kind::Counter,
    Unit::Count,
    &[],
    "Allocations whose deferred-free queue was gone, freed after their fences on their own.",
);
/// Commit (map) calls on a virtual backing.
pub const BACKING_MAP_CALLS_TOTAL: Metric = metric(
    "procmem_backing_map_calls_total",
    Kind::Counter,
    Unit::Count,
    BACKING,
    "Commit (map) calls on a virtual backing.",
);
/// Latency of commit (map) calls.
pub const BACKING_MAP_SECONDS: Metric = latency(
    "procmem_backing_map_seconds",
    BACKING,
    "Latency of commit (map) calls.",
    MICROSECONDS,
);
/// Decommit (unmap) calls on a virtual backing.
pub const BACKING_UNMAP_CALLS_TOTAL: Metric = metric(
    "procmem_backing_unmap_calls_total",
    Kind::Counter,
    Unit::Count,
    BACKING,
    "Decommit (unmap) calls on a virtual backing.",
);
/// Latency of decommit (unmap) calls.
pub const BACKING_UNMAP_SECONDS: Metric = latency(
    "procmem_backing_unmap_seconds",
    BACKING,
    "Latency of decommit (unmap) calls.",
    MICROSECONDS,
);
/// Holder actors that crashed.
pub const HOLDER_FAILURES_TOTAL: Metric = metric(
    "procmem_holder_failures_total",
    Kind::Counter,
    Unit::Count,
    &[],
    "Holder actors that crashed.",
);

/// The metrics of the books, the deferred free, the backing and the node Governor, in the
/// order the table of docs/metrics.md lists them (the holders' follow: [`all`]).
const CORE: &[Metric] = &[
    GOVERNOR_CAPACITY_BYTES,
    GOVERNOR_APPROVED_BYTES,
    GOVERNOR_PROVISIONAL_BYTES,
    GOVERNOR_COMMITTED_BYTES,
    GOVERNOR_WAITING_REQUESTS,
    GOVERNOR_GRANTS_TOTAL,
    GOVERNOR_DENIALS_TOTAL,
    GOVERNOR_WAITS_TOTAL,
    GOVERNOR_PRESSURE_TICKETS_TOTAL,
    GOVERNOR_PRESSURE_FREED_BYTES_TOTAL,
    GOVERNOR_CREDIT_BYTES,
    GOVERNOR_CREDIT_RECLAIMED_BYTES_TOTAL,
    GOVERNOR_RESTARTS_TOTAL,
    HOST_OUTSIDE_BOOKS_BYTES,
    HOST_RESERVE_BYTES,
    PROCESS_RESIDENT_BYTES,
    PROCESS_OUTSIDE_BOOKS_BYTES,
    AUTHORITY_OS_RESIDENT_BYTES,
    AUTHORITY_DRIFT_BYTES,
    DEFERRED_FREE_QUEUE_DEPTH,
    DEFERRED_FREE_BYTES_TOTAL,
    DEFERRED_FREE_FENCE_TO_REFUND_SECONDS,
    DEFERRED_FREE_ORPHANS_TOTAL,
    BACKING_MAP_CALLS_TOTAL,
    BACKING_MAP_SECONDS,
    BACKING_UNMAP_CALLS_TOTAL,
    BACKING_UNMAP_SECONDS,
    HOLDER_FAILURES_TOTAL,
    NODE_CAPACITY_BYTES,
    NODE_CREDIT_BYTES,
    NODE_PROCESS_CREDIT_BYTES,
    NODE_PROCESS_OS_BYTES,
    NODE_PROCESS_GUARANTEE_BYTES,
    NODE_REVOKED_BYTES_TOTAL,
    NODE_TICKETS_TOTAL,
    NODE_REJECTED_FRAMES_TOTAL,
    NODE_LATE_FRAMES_TOTAL,
    NODE_FOREIGN_FRAMES_TOTAL,
    NODE_REAPED_PROCESSES_TOTAL,
];

impl Metric {
    /// Its counter with these label values (in the order of [`Metric::labels`]).
    pub fn counter(&self, values: &[&str]) -> metrics::Counter {
        metrics::counter!(self.name, self.label_pairs(values))
    }

    /// Its gauge with these label values.
    pub fn gauge(&self, values: &[&str]) -> metrics::Gauge {
        metrics::gauge!(self.name, self.label_pairs(values))
    }

    /// Its histogram with these label values.
    pub fn histogram(&self, values: &[&str]) -> metrics::Histogram {
        metrics::histogram!(self.name, self.label_pairs(values))
    }

    fn label_pairs(&self, values: &[&str]) -> Vec<metrics::Label> {
        debug_assert_eq!(values.len(), self.labels.len(), "{}", self.name);
        self.labels
            .iter()
            .zip(values)
            .map(|(k, v)| metrics::Label::new(*k, v.to_string()))
            .collect()
    }

    /// Describes it to the installed recorder (its unit and help text).
    pub fn describe(&self) {
        match self.kind {
            Kind::Counter => metrics::describe_counter!(self.name, self.unit, self.help),
            Kind::Gauge => metrics::describe_gauge!(self.name, self.unit, self.help),
            Kind::Histogram => metrics::describe_histogram!(self.name, self.unit, self.help),
        }
    }
}

/// Every metric, in the order the table of docs/metrics.md lists them.
pub fn all() -> impl Iterator<Item = &'static Metric> {
    CORE.iter().chain(holders::HOLDERS).chain(http::HTTP)
}

/// Describes every metric to the installed recorder.
pub fn describe_all() {
    for m in all() {
        m.describe();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_prometheus_conventions_and_are_unique() {
        let mut names: Vec<_> = all().map(|m| m.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all().count(), "a name listed twice");
        for m in all() {
            assert!(m.name.starts_with("procmem_"), "{}", m.name);
            assert_eq!(
                m.kind == Kind::Counter,
                m.name.ends_with("_total"),
                "{}",
                m.name
            );
            match m.unit {
                Unit::Bytes => assert!(m.name.contains("_bytes"), "{}", m.name),
                Unit::Seconds => assert!(m.name.ends_with("_seconds"), "{}", m.name),
                _ => {}
            }
            assert!(m.help.ends_with('.'), "{}", m.name);
            assert_eq!(
                m.kind == Kind::Histogram,
                !m.buckets.is_empty(),
                "{}: a histogram has buckets, nothing else does",
                m.name
            );
            assert!(m.buckets.windows(2).all(|w| w[0] < w[1]), "{}", m.name);
        }
    }
}
