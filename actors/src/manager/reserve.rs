//! A named reserve: bytes the books hold for memory that no mechanism allocates (a step's
//! activations and scratch, which the model's tensor library takes from the heap).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use procmem::ledger::HolderId;
use procmem::ledger::Priority;
use procmem::MemoryRole;

use super::ManagerError;
use crate::governor::{GovernorHandle, Lease, ReserveRequest};

/// How long a reserve waits for room before it is refused.
const WAIT: Duration = Duration::from_secs(5);

/// Bytes the books hold for memory the process takes outside any mechanism: charged to the
/// host Governor as a lease of its own holder (named for what it pays for), counted by
/// [`MemoryManager::process_memory`](super::MemoryManager::process_memory) as in the books.
/// It does not allocate: it keeps that much of the budget from being approved to holders, so
/// what the process really holds stays within the budget. Dropped, the lease is released and
/// the holder retired.
#[derive(Debug)]
pub struct Reserve {
    name: String,
    lease: Option<Lease>,
    holder: HolderId,
    governor: GovernorHandle,
    counted: Arc<AtomicU64>,
}

impl Reserve {
    /// Registers holder `name` with `governor` and leases `bytes` for it (waiting up to 5 s
    /// for room); `counted` adds them while the reserve lives.
    pub(super) async fn take(
        governor: &GovernorHandle,
        name: &str,
        bytes: u64,
        counted: &Arc<AtomicU64>,
    ) -> Result<Reserve, ManagerError> {
        let holder = governor
            .register_holder(name, Priority::default(), None)
            .await
            .map_err(ManagerError::Reserve)?;
        let mut reserve = Reserve {
            name: name.to_string(),
            lease: None,
            holder,
            governor: governor.clone(),
            counted: Arc::clone(counted),
        };
        if bytes == 0 {
            return Ok(reserve);
        }
        let grant = governor
            .reserve(ReserveRequest {
                holder,
                role: MemoryRole::Activations,
                bytes,
                priority: Priority::default(),
                deadline: Some(Instant::now() + WAIT),
            })
            .await
            .map_err(ManagerError::Reserve)?;
        let lease = grant
            .commit(bytes)
            .await
            .map_err(|refused| ManagerError::Reserve(refused.error))?;
        counted.fetch_add(bytes, Ordering::AcqRel);
        reserve.lease = Some(lease);
        Ok(reserve)
    }

    /// What it pays for.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes it holds.
    pub fn bytes(&self) -> u64 {
        self.lease.as_ref().map_or(0, Lease::bytes)
    }
}

impl Drop for Reserve {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            self.counted.fetch_sub(lease.bytes(), Ordering::AcqRel);
            drop(lease);
        }
        // Retiring the holder is a message; without a runtime the Governor's end retires it.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (governor, holder) = (self.governor.clone(), self.holder);
            rt.spawn(async move {
                let _ = governor.unregister_holder(holder).await;
            });
        }
    }
}
