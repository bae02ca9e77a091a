//! Bindings: a device, its tier, the Governor that pays and the provider that allocates,
//! reached through one provider trait object whatever the device (the way wgpu-hal's
//! `dynamic` module wraps its backends), so no path exists per kind.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use procmem::ledger::{AuthorityId, HolderId, Priority};
use procmem::{AllocationRequest, CommitModel, DeviceKey, DeviceMemoryMechanism, MemoryTier};
use ractor::ActorCell;
use tokio::time::Instant;

use super::ManagerError;
use crate::buffer::DeviceBuffer;
use crate::deferred_free::DrainReport;
use crate::governor::GovernorHandle;
use crate::provider::{Provider, ProviderError, ProviderKind};

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the manager needs of an execution provider, whatever its kind.
pub(crate) trait DynProvider: Send + Sync + std::fmt::Debug {
    /// The device it allocates on.
    fn device(&self) -> DeviceKey;
    /// Its memory mechanism.
    fn mechanism(&self) -> &dyn DeviceMemoryMechanism;
    /// Allocates through its first stream's deferred-free queue, charged to `governor` first.
    fn allocate<'a>(
        &'a self,
        governor: &'a GovernorHandle,
        holder: HolderId,
        request: &'a AllocationRequest,
        priority: Priority,
        deadline: Option<Instant>,
    ) -> BoxFuture<'a, Result<DeviceBuffer, ProviderError>>;
    /// Stops its streams after their work and drains its queues.
    fn shutdown(&self) -> BoxFuture<'_, Result<DrainReport, ProviderError>>;
    /// Its actor, to stop it.
    fn actor(&self) -> ActorCell;
}

impl<K: ProviderKind> DynProvider for Provider<K> {
    fn device(&self) -> DeviceKey {
        self.mechanism().device()
    }

    fn mechanism(&self) -> &dyn DeviceMemoryMechanism {
        Provider::mechanism(self)
    }

    fn allocate<'a>(
        &'a self,
        governor: &'a GovernorHandle,
        holder: HolderId,
        request: &'a AllocationRequest,
        priority: Priority,
        deadline: Option<Instant>,
    ) -> BoxFuture<'a, Result<DeviceBuffer, ProviderError>> {
        Box::pin(Provider::allocate(
            self, governor, holder, request, priority, deadline, 0,
        ))
    }

    fn shutdown(&self) -> BoxFuture<'_, Result<DrainReport, ProviderError>> {
        Box::pin(Provider::shutdown(self))
    }

    fn actor(&self) -> ActorCell {
        Provider::actor(self)
    }
}

/// What a device's mechanism can do, as negotiated.
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
    pub(crate) fn of(mechanism: &dyn DeviceMemoryMechanism) -> Self {
        Capabilities {
            virtual_backing: mechanism.virtual_backing().is_some(),
            shared_mapping: mechanism.shared_mapping().is_some(),
            commit_model: mechanism.allocator().commit_model(),
        }
    }
}

/// Ties a device, its mechanism, its provider context and its authority together.
#[derive(Debug, Clone)]
pub struct MemoryBinding {
    pub(super) device: DeviceKey,
    pub(super) tier: MemoryTier,
    pub(super) governor: GovernorHandle,
    pub(super) provider: Arc<dyn DynProvider>,
    pub(super) admitting: Arc<AtomicBool>,
}

impl MemoryBinding {
    /// The device it allocates on.
    pub fn device(&self) -> DeviceKey {
        self.device
    }

    /// The tier it pays for on that device.
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
    ) -> Result<DeviceBuffer, ManagerError> {
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
