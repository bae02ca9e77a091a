//! The ProcessMemoryManager: the one entry point an inference server uses.
//!
//! ```no_run
//! # async fn run() -> Result<(), procmem_actors::ManagerError> {
//! use procmem_actors::MemoryManager;
//!
//! let memory = MemoryManager::builder()
//!     .host_budget(8 << 30)
//!     .metrics_addr("127.0.0.1:9464".parse().unwrap())
//!     .build()
//!     .await?;
//! let shape = procmem_actors::procmem::kv::KvShape {
//!     layers: 32, q_heads: 32, kv_heads: 8, head_dim: 128, max_tokens: 8192,
//!     k_dtype: procmem_actors::procmem::kv::KvDtype::F16,
//!     v_dtype: procmem_actors::procmem::kv::KvDtype::F16,
//! };
//! let kv = memory
//!     .kv_store(
//!         procmem_actors::kv::KvStoreConfig::new("kv", shape)
//!             .chunk_granules(16)
//!             .wait(std::time::Duration::from_secs(1))
//!             .map_ahead(true),
//!     )
//!     .await?;
//! // ... serve requests through `kv` ...
//! let report = memory.shutdown().await?;
//! assert!(report.is_zero());
//! # Ok(()) }
//! ```
//!
//! It starts a Governor per authority (one per physical pool; host and device tiers that are
//! the same memory share one), an execution provider per device with a deferred-free actor per
//! stream, and supervises the holders it starts: a crashed holder is reported, never fatal.
//! It hands out [`MemoryBinding`]s, never a raw allocator, so every allocation made through it
//! is charged first.

mod binding;
mod builder;
mod report;
mod reserve;
mod supervisor;
mod topology;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusHandle;
use procmem::host::machine::ProcessMemory;
use procmem::metrics;
use procmem::{MemoryMechanism as _, MemoryTier, Place, PlaceKind};
use ractor::{ActorCell, ActorRef};
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub use binding::{Capabilities, MemoryBinding};
#[cfg(feature = "cluster")]
pub(crate) use builder::install_metrics;
pub use builder::MemoryManagerBuilder;
pub use report::{AuthorityReport, ManagerError, ShutdownReport};
pub use reserve::Reserve;
pub use topology::Authority;

use crate::cuda_provider::CudaProvider;
use crate::deferred_free::DrainReport;
use crate::execution::CpuProvider;
use crate::governor::{GovernorHandle, GovernorSnapshot};
use crate::kv_store::SwapSpace;
use crate::kv_store::{KvStoreConfig, KvStoreHandle};
use crate::provider_choice::Provider;
use crate::residency::{ResidencyArgs, ResidencyConfig, ResidencyHandle};
use topology::Topology;

struct Inner {
    topology: Topology,
    /// The host provider, concretely: host holders run on it.
    host: CpuProvider,
    /// The CUDA provider, where one was asked for: device holders run on it.
    cuda: Option<CudaProvider>,
    /// Every provider, the host's first.
    providers: Vec<Provider>,
    admitting: Arc<AtomicBool>,
    supervisor: ActorRef<()>,
    metrics: Option<PrometheusHandle>,
    exporter: Mutex<Option<JoinHandle<()>>>,
    holders: Mutex<Vec<ActorCell>>,
    sampler: Mutex<Option<JoinHandle<()>>>,
    /// The host capacity following the machine, where asked for.
    machine: Mutex<Option<crate::machine::HostPressure>>,
    /// Bytes the live [`Reserve`]s hold.
    reserved: Arc<std::sync::atomic::AtomicU64>,
}

/// Publishes what only the OS can tell: physical bytes per authority and their drift from the
/// ledger, and the host mechanism's resident bytes.
async fn sample(inner: std::sync::Weak<Inner>) {
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let Some(inner) = inner.upgrade() else { return };
        for a in inner.topology.authorities() {
            let (Ok(snapshot), Some(os)) = (a.governor.snapshot().await, inner.os_bytes(a)) else {
                continue;
            };
            let label = [a.name.as_str()];
            metrics::AUTHORITY_OS_RESIDENT_BYTES
                .gauge(&label)
                .set(os as f64);
            metrics::AUTHORITY_DRIFT_BYTES
                .gauge(&label)
                .set(snapshot.books.leased as f64 - os as f64);
        }
    }
}

impl Inner {
    /// Physical bytes behind an authority, read from the OS or the driver: the host
    /// mechanism's memfd pages and the resident pages of its eager allocations; for a device
    /// authority, the VMM handles mapped and the eager allocations live.
    /// `None` for an authority that pays for device bytes too (unified memory): the driver has
    /// no per-process truth for them, and counting only the host's would report every device
    /// byte as drift.
    fn os_bytes(&self, authority: &Authority) -> Option<u64> {
        if authority
            .tiers
            .iter()
            .all(|(d, _)| d.kind == PlaceKind::Host)
        {
            self.host.mechanism().resident_bytes().ok()
        } else if authority
            .tiers
            .iter()
            .all(|(d, _)| d.kind != PlaceKind::Host)
        {
            // A device authority of its own: the VMM handles mapped and the eager
            // allocations live, as the driver was asked for them (handles pooled unmapped
            // are not charged).
            Some(self.cuda.as_ref()?.mechanism().driver_bytes())
        } else {
            None
        }
    }
}

/// The process memory manager; cheap to clone.
#[derive(Clone)]
pub struct MemoryManager {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MemoryManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryManager")
            .field(
                "authorities",
                &self
                    .inner
                    .topology
                    .authorities()
                    .iter()
                    .map(|a| &a.name)
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// One authority's books ([`MemoryManager::books`]): the Governor's snapshot, and the bytes
/// the OS reports for the authority where it can say.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AuthorityBooks {
    /// The authority's name.
    pub name: String,
    /// Its Governor's books and queue.
    pub snapshot: GovernorSnapshot,
    /// What the OS says it holds (`None` where it cannot say).
    pub os_bytes: Option<u64>,
}

impl MemoryManager {
    /// A builder.
    pub fn builder() -> MemoryManagerBuilder {
        MemoryManagerBuilder::default()
    }

    /// The authorities, the host's first.
    pub fn authorities(&self) -> &[Authority] {
        self.inner.topology.authorities()
    }

    /// The Governor paying for `tier` on `place`.
    pub fn governor(&self, place: Place, tier: MemoryTier) -> Option<&GovernorHandle> {
        self.inner.topology.governor(place, tier)
    }

    /// The host execution provider.
    pub fn host_provider(&self) -> &CpuProvider {
        &self.inner.host
    }

    /// The CUDA execution provider, where the manager was built with a CUDA device.
    pub fn cuda_provider(&self) -> Option<&CudaProvider> {
        self.inner.cuda.as_ref()
    }

    fn provider(&self, place: Place) -> Result<&Provider, ManagerError> {
        self.inner
            .providers
            .iter()
            .find(|p| p.place() == place)
            .ok_or(ManagerError::UnknownPlace(place, self.place_list()))
    }

    /// What `place`'s mechanism can do, asked of the mechanism now.
    pub fn capabilities(&self, place: Place) -> Result<Capabilities, ManagerError> {
        Ok(Capabilities::of(self.provider(place)?.mechanism()))
    }

    fn place_list(&self) -> &'static str {
        if self.inner.providers.len() > 1 {
            " and one CUDA device"
        } else {
            " only"
        }
    }

    /// A binding for `tier` on `place`.
    pub fn binding(&self, place: Place, tier: MemoryTier) -> Result<MemoryBinding, ManagerError> {
        let governor = self
            .governor(place, tier)
            .ok_or(ManagerError::UnknownPlace(place, self.place_list()))?
            .clone();
        Ok(MemoryBinding {
            place,
            tier,
            governor,
            provider: self.provider(place)?.clone(),
            admitting: Arc::clone(&self.inner.admitting),
        })
    }

    fn admit(&self) -> Result<(), ManagerError> {
        if self.inner.admitting.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(ManagerError::ShuttingDown)
        }
    }

    /// Where a holder on `place` lives: the Governor of that place's authority, its
    /// provider, and the host tier's Governor where that is another authority (somewhere a
    /// copy out frees device memory).
    fn holder_home(
        &self,
        place: Place,
    ) -> Result<(GovernorHandle, Provider, Option<GovernorHandle>), ManagerError> {
        self.admit()?;
        let unknown = || ManagerError::UnknownPlace(place, self.place_list());
        let (tier, provider): (_, Provider) = if place == Place::HOST {
            (MemoryTier::Host, self.inner.host.clone().into())
        } else {
            match &self.inner.cuda {
                Some(cuda) if cuda.mechanism().place() == place => {
                    (MemoryTier::Device, cuda.clone().into())
                }
                _ => return Err(unknown()),
            }
        };
        let governor = self.governor(place, tier).ok_or_else(unknown)?.clone();
        let host = self
            .governor(Place::HOST, MemoryTier::Host)
            .expect("the host authority always exists");
        let host = (host.authority() != governor.authority()).then(|| host.clone());
        Ok((governor, provider, host))
    }

    /// Starts a KV store on the host authority, supervised by the manager.
    pub async fn kv_store(&self, config: KvStoreConfig) -> Result<KvStoreHandle, ManagerError> {
        self.kv_store_on(Place::HOST, config).await
    }

    /// Starts a KV store whose memory lives on `place` (the host, or the CUDA device the
    /// manager was built with), charged to that place's authority and supervised by the
    /// manager. On a GPU whose memory is an authority of its own, `SwapSpace::Auto` swaps to
    /// the host tier (charged to the host authority); where the device's memory is the host's
    /// (unified), to disk, as on the host.
    pub async fn kv_store_on(
        &self,
        place: Place,
        mut config: KvStoreConfig,
    ) -> Result<KvStoreHandle, ManagerError> {
        let (governor, provider, host_tier) = self.holder_home(place)?;
        if let (SwapSpace::Auto, Some(host)) = (&config.swap, host_tier) {
            config.swap = SwapSpace::Host(host);
        }
        let (kv, _) = KvStoreHandle::spawn_supervised(
            config,
            governor,
            provider,
            self.inner.supervisor.get_cell(),
        )
        .await?;
        self.inner
            .holders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(kv.actor());
        Ok(kv)
    }

    /// Starts model residency on the host authority, supervised by the manager.
    pub async fn residency(
        &self,
        config: ResidencyConfig,
    ) -> Result<ResidencyHandle, ManagerError> {
        self.residency_on(Place::HOST, config).await
    }

    /// Starts model residency whose weights live on `place`, charged to that place's
    /// authority. On a GPU whose memory is an authority of its own, offloaded layers go to
    /// the host tier (charged to the host authority); on the host, or where the device's
    /// memory is the host's, they go to an unlinked file on disk (a host copy would free
    /// nothing).
    pub async fn residency_on(
        &self,
        place: Place,
        config: ResidencyConfig,
    ) -> Result<ResidencyHandle, ManagerError> {
        let (governor, provider, host) = self.holder_home(place)?;
        let args = ResidencyArgs {
            config,
            device: governor,
            host,
            provider,
        };
        let (r, _) =
            ResidencyHandle::spawn_supervised(args, self.inner.supervisor.get_cell()).await?;
        self.inner
            .holders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(r.actor());
        Ok(r)
    }

    /// Each authority's books, beside what the OS says it holds.
    pub async fn books(&self) -> Vec<AuthorityBooks> {
        let mut out = Vec::new();
        for a in self.inner.topology.authorities() {
            if let Ok(snapshot) = a.governor.snapshot().await {
                out.push(AuthorityBooks {
                    name: a.name.clone(),
                    snapshot,
                    os_bytes: self.inner.os_bytes(a),
                });
            }
        }
        out
    }

    /// What this process holds resident beside what its books pay for, as the kernel reports
    /// both (`None` where it does not say): the part outside the books is the heap, code and
    /// scratch that no holder leases.
    pub fn process_memory(&self) -> Option<ProcessMemory> {
        let reserved = self.inner.reserved.load(Ordering::Acquire);
        Some(
            self.inner
                .host
                .mechanism()
                .process_memory()?
                .with_reserve(reserved),
        )
    }

    /// Leases `bytes` of the host budget for memory the process takes outside any mechanism
    /// (a step's activations from the heap), under a holder named `name`: the books hold it,
    /// and [`MemoryManager::process_memory`] counts it in them. Waits up to 5 s for room.
    pub async fn reserve(&self, name: &str, bytes: u64) -> Result<Reserve, ManagerError> {
        if !self.inner.admitting.load(Ordering::Acquire) {
            return Err(ManagerError::ShuttingDown);
        }
        let governor = self
            .inner
            .topology
            .governor(Place::HOST, MemoryTier::Host)
            .ok_or(ManagerError::UnknownPlace(Place::HOST, ""))?;
        Reserve::take(governor, name, bytes, &self.inner.reserved).await
    }

    /// The Prometheus text the endpoint serves, when metrics are on: the process's resident
    /// bytes and the part outside the books are read as it renders.
    pub fn metrics_text(&self) -> Option<String> {
        let handle = self.inner.metrics.as_ref()?;
        if let Some(m) = self.process_memory() {
            metrics::PROCESS_RESIDENT_BYTES
                .gauge(&[])
                .set(m.held as f64);
            metrics::PROCESS_OUTSIDE_BOOKS_BYTES
                .gauge(&[])
                .set(m.outside as f64);
        }
        Some(handle.render())
    }

    /// Stops admitting, stops the holders (their memory goes through the deferred-free
    /// queues), drains every queue, and reports the books: an error if any are not at zero.
    pub async fn shutdown(&self) -> Result<ShutdownReport, ManagerError> {
        self.inner.admitting.store(false, Ordering::Release);
        let holders =
            std::mem::take(&mut *self.inner.holders.lock().unwrap_or_else(|p| p.into_inner()));
        for cell in holders {
            let _ = cell
                .stop_and_wait(None, Some(Duration::from_secs(10)))
                .await;
        }
        // A provider whose actor died cannot drain its queues; what they held frees after its
        // fences on its own. The report names it rather than stopping here.
        let mut drained = DrainReport::default();
        let mut lost_providers = Vec::new();
        for provider in &self.inner.providers {
            match provider.shutdown().await {
                Ok(d) => drained.add(d),
                Err(_) => lost_providers.push(provider.place().to_string()),
            }
        }
        // Refunds travel as messages: give them a moment to land.
        let deadline = Instant::now() + Duration::from_secs(5);
        let report = loop {
            let mut report = ShutdownReport {
                deferred_frees: drained.freed,
                lost_queues: drained.lost_queues,
                lost_providers: lost_providers.clone(),
                ..ShutdownReport::default()
            };
            for a in self.inner.topology.authorities() {
                match a.governor.snapshot().await {
                    Ok(s) => report.authorities.push(AuthorityReport {
                        name: a.name.clone(),
                        provisional: s.books.provisional,
                        leased: s.books.leased,
                    }),
                    Err(_) => report.lost_authorities.push(a.name.clone()),
                }
            }
            if !report.lost_authorities.is_empty() || !report.lost_providers.is_empty() {
                break report;
            }
            if report.is_zero() || Instant::now() > deadline {
                break report;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        if let Some(s) = self
            .inner
            .sampler
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            s.abort();
        }
        drop(
            self.inner
                .machine
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
        if report.is_zero() {
            // Books at zero: nothing is left to refund, so nothing needs to run on. Otherwise
            // the Governors stay, so refunds still on their way land in the books.
            self.stop_actors();
        }
        if report.is_zero() {
            Ok(report)
        } else {
            Err(ManagerError::BooksNotZero(report))
        }
    }
}

impl MemoryManager {
    /// Stops what `build` started: the Governors, the providers (their streams were stopped
    /// and drained already), the holder supervisor and the metrics exporter.
    fn stop_actors(&self) {
        for a in self.inner.topology.authorities() {
            a.governor.stop();
        }
        for provider in &self.inner.providers {
            provider.actor().stop(None);
        }
        self.inner.supervisor.stop(None);
        let exporter = self
            .inner
            .exporter
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(exporter) = exporter {
            exporter.abort();
        }
    }
}
