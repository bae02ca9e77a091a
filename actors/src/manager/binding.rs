//! Bindings: a place, its tier, the Governor that pays and the provider that allocates,
//! reached through the one [`Provider`] choice whatever the kind, so no path exists per kind.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use procmem::ledger::{AuthorityId, HolderId, Priority};
use procmem::{AllocationRequest, CommitModel, MemoryMechanism, MemoryTier, Place};
use tokio::time::Instant;

use super::ManagerError;
use crate::buffer::Buffer;
use crate::governor::GovernorHandle;
use crate::provider_choice::Provider;

/// What a place's mechanism can do, as negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Address/backing separation (growth by mapping).
    pub virtual_backing: bool,
    /// One physical block at several addresses.
    pub shared_mapping: bool,
    /// When ordinary allocations take memory.
    pub commit_model: CommitModel,
}

impl Capabilities {
    /// Asked of `mechanism` now.
    pub(crate) fn of(mechanism: &dyn MemoryMechanism) -> Self {
        Capabilities {
            virtual_backing: mechanism.virtual_backing().is_some(),
            shared_mapping: mechanism.shared_mapping().is_some(),
            commit_model: mechanism.allocator().commit_model(),
        }
    }
}

/// Ties a place, its mechanism, its provider context and its authority together.
#[derive(Debug, Clone)]
pub struct MemoryBinding {
    pub(super) place: Place,
    pub(super) tier: MemoryTier,
    pub(super) governor: GovernorHandle,
    pub(super) provider: Provider,
    pub(super) admitting: Arc<AtomicBool>,
}

impl MemoryBinding {
    /// Where it allocates.
    pub fn place(&self) -> Place {
        self.place
    }

    /// The tier it pays for there.
    pub fn tier(&self) -> MemoryTier {
        self.tier
    }

    /// The authority that pays.
    pub fn authority(&self) -> AuthorityId {
        self.governor.authority()
    }

    /// The Governor that pays.
    pub fn governor(&self) -> &GovernorHandle {
        &self.governor
    }

    /// What the mechanism can do.
    pub fn capabilities(&self) -> Capabilities {
        Capabilities::of(self.provider.mechanism())
    }

    /// Allocates for `holder`, charged before anything is taken. Refused once the manager
    /// is shutting down.
    pub async fn allocate(
        &self,
        holder: HolderId,
        request: &AllocationRequest,
        priority: Priority,
        deadline: Option<Instant>,
    ) -> Result<Buffer, ManagerError> {
        if !self.admitting.load(Ordering::Acquire) {
            return Err(ManagerError::ShuttingDown);
        }
        let buffer = self
            .provider
            .allocate(&self.governor, holder, request, priority, deadline)
            .await?;
        Ok(buffer)
    }
}
