//! An idle server's sleep: once no request has come or run for a while, the model's layers go
//! to their lower tier (residency offloads them, to disk on the host), so that the node
//! Governor, or the host's other holders, can lend that memory to others. The next request
//! brings each layer back as it is used.

use std::time::Duration;

use procmem_actors::residency::ResidencyHandle;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::scheduler::{SchedulerHandle, SchedulerStats};

/// Requests accepted and not yet ended.
fn in_flight(s: &SchedulerStats) -> u64 {
    s.accepted
        .saturating_sub(s.finished + s.cancelled + s.cut + s.failed)
}

/// Offloads `weights` once `scheduler` has had nothing to do for `after`; again after each
/// later busy spell. Looks every quarter of `after` (10 ms to 1 s).
pub(super) fn sleep_when_idle(
    scheduler: SchedulerHandle,
    weights: ResidencyHandle,
    after: Duration,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let look = (after / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let (mut seen, mut since, mut asleep) = (u64::MAX, Instant::now(), false);
        loop {
            tokio::time::sleep(look).await;
            let (waiting, s) = scheduler.books();
            if s.accepted != seen || in_flight(&s) > 0 || waiting > 0 {
                (seen, since, asleep) = (s.accepted, Instant::now(), false);
                continue;
            }
            if asleep || since.elapsed() < after {
                continue;
            }
            asleep = true;
            match weights.offload_all().await {
                Ok(bytes) => tracing::info!(
                    bytes,
                    idle_s = since.elapsed().as_secs_f64(),
                    "idle: the model's layers offloaded until the next request"
                ),
                Err(e) => tracing::warn!(%e, "idle: the layers could not be offloaded"),
            }
        }
    })
}
