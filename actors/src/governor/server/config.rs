//! How to start a Governor.

use std::time::Duration;

use procmem::ledger::admission::AdmissionLimits;

/// How to start a Governor.
#[derive(Debug, Clone)]
pub struct GovernorConfig {
    /// The authority's name (metrics label, diagnoses).
    pub name: String,
    /// Bytes it may approve.
    pub capacity: u64,
    /// How long one holder gets to answer a ticket before the next one is asked.
    pub ticket_timeout: Duration,
    /// Requests that may wait at once; more are refused with
    /// [`GovernorError::Busy`](crate::governor::GovernorError::Busy).
    pub max_waiters: usize,
}

impl GovernorConfig {
    /// A Governor for `name` with `capacity` bytes and a 50 ms ticket timeout.
    pub fn new(name: impl Into<String>, capacity: u64) -> Self {
        GovernorConfig {
            name: name.into(),
            capacity,
            ticket_timeout: Duration::from_millis(50),
            max_waiters: AdmissionLimits::default().max_waiters,
        }
    }
}
