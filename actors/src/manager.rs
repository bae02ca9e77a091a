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
//! let kv = memory.kv_store(procmem_actors::KvStoreConfig {
//!     name: "kv".into(),
//!     priority: 0,
//!     shape: procmem_actors::procmem::kv::KvShape {
//!         layers: 32, q_heads: 32, kv_heads: 8, head_dim: 128, max_tokens: 8192,
//!     },
//!     chunk_granules: 16,
//!     preempt: procmem_actors::PreemptMode::Swap,
//!     wait: std::time::Duration::from_secs(1),
//! }).await?;
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

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use procmem::ledger::{AuthorityId, HolderId, Priority};
use procmem::metrics;
use procmem::{
    AllocationRequest, CommitModel, DeviceKey, DeviceKind, DeviceMemoryMechanism, MemoryTier,
};
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::buffer::DeviceBuffer;
use crate::cuda_provider::{CudaProvider, CudaProviderConfig};
use crate::deferred_free::DrainReport;
use crate::governor::{GovernorConfig, GovernorHandle, GovernorSnapshot};
use crate::kv_store::{KvStoreConfig, KvStoreError, KvStoreHandle};
use crate::provider::{CpuProvider, CpuProviderConfig, ProviderError};
use crate::residency::{ResidencyArgs, ResidencyConfig, ResidencyError, ResidencyHandle};

/// Why the manager could not start, bind or shut down cleanly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManagerError {
    /// A budget that cannot work: zero, or more memory than the machine has.
    #[error("invalid budget for {what}: {bytes} bytes ({why})")]
    InvalidBudget {
        /// Which budget.
        what: &'static str,
        /// The value given.
        bytes: u64,
        /// Why it was refused.
        why: String,
    },
    /// A device this build or machine does not have.
    #[error("unknown device {0}: this manager has host{1}")]
    UnknownDevice(DeviceKey, &'static str),
    /// The metrics endpoint could not be started (address in use, not local, ...).
    #[error("cannot serve metrics on {addr}: {why}")]
    Metrics {
        /// The address asked for.
        addr: SocketAddr,
        /// Why not.
        why: String,
    },
    /// An execution provider failed to start or stop.
    #[error(transparent)]
    Provider(#[from] ProviderError),
    /// A KV store failed to start.
    #[error(transparent)]
    KvStore(#[from] KvStoreError),
    /// Model residency failed to start.
    #[error(transparent)]
    Residency(#[from] ResidencyError),
    /// The manager is shutting down and admits nothing new.
    #[error("the memory manager is shutting down")]
    ShuttingDown,
    /// After shutdown some authority still has bytes on its books.
    #[error("books not at zero after shutdown: {0}")]
    BooksNotZero(ShutdownReport),
    /// An actor of the manager's own (a Governor, its supervisor, the holders' supervisor)
    /// failed to start.
    #[error("the memory manager's {what} failed to start: {source}")]
    Spawn {
        /// Which actor.
        what: &'static str,
        /// Why.
        #[source]
        source: ractor::SpawnErr,
    },
}

/// One authority's books at shutdown.
#[derive(Debug, Clone)]
pub struct AuthorityReport {
    /// The authority's name.
    pub name: String,
    /// Bytes still provisional.
    pub provisional: u64,
    /// Bytes still leased.
    pub leased: u64,
}

/// The books after shutdown.
#[derive(Debug, Clone, Default)]
pub struct ShutdownReport {
    /// Per authority.
    pub authorities: Vec<AuthorityReport>,
    /// Allocations the deferred-free queues freed over their life.
    pub deferred_frees: u64,
    /// Authorities whose Governor had died: their books are lost, so they cannot be zero.
    pub lost_authorities: Vec<String>,
    /// Deferred-free queues whose actor had died; what they held was freed after its fences
    /// by threads of its own.
    pub lost_queues: u64,
    /// Execution providers whose actor had died, so their queues could not be drained.
    pub lost_providers: Vec<String>,
}

impl ShutdownReport {
    /// Every authority reachable and at zero.
    pub fn is_zero(&self) -> bool {
        self.lost_authorities.is_empty()
            && self.lost_providers.is_empty()
            && self
                .authorities
                .iter()
                .all(|a| a.provisional == 0 && a.leased == 0)
    }
}

impl std::fmt::Display for ShutdownReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for a in &self.authorities {
            write!(
                f,
                "{}: {} provisional, {} leased; ",
                a.name, a.provisional, a.leased
            )?;
        }
        for name in &self.lost_authorities {
            write!(f, "{name}: governor gone, books lost; ")?;
        }
        for name in &self.lost_providers {
            write!(f, "{name} provider gone, queues not drained; ")?;
        }
        if self.lost_queues > 0 {
            write!(f, "{} deferred-free queues lost; ", self.lost_queues)?;
        }
        write!(f, "{} deferred frees", self.deferred_frees)
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

/// One authority: a Governor and the tiers it pays for.
#[derive(Debug, Clone)]
pub struct Authority {
    /// Its name.
    pub name: String,
    /// Its Governor.
    pub governor: GovernorHandle,
    /// The (device, tier) pairs it pays for.
    pub tiers: Vec<(DeviceKey, MemoryTier)>,
}

/// Ties a device, its mechanism, its provider context and its authority together.
#[derive(Debug, Clone)]
pub struct MemoryBinding {
    device: DeviceKey,
    tier: MemoryTier,
    governor: GovernorHandle,
    provider: Provider,
    capabilities: Capabilities,
    admitting: Arc<AtomicBool>,
}

impl MemoryBinding {
    /// The device.
    pub fn device(&self) -> DeviceKey {
        self.device
    }

    /// The tier.
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
        self.capabilities
    }

    /// Allocates for `holder`, charged before anything is taken.
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
        Ok(match &self.provider {
            Provider::Cpu(p) => {
                p.allocate(&self.governor, holder, request, priority, deadline, 0)
                    .await?
            }
            Provider::Cuda(p) => {
                p.allocate(&self.governor, holder, request, priority, deadline, 0)
                    .await?
            }
        })
    }
}

/// The execution provider behind a binding.
#[derive(Debug, Clone)]
enum Provider {
    Cpu(CpuProvider),
    Cuda(CudaProvider),
}

/// Builds a [`MemoryManager`].
#[derive(Debug, Clone, Default)]
pub struct MemoryManagerBuilder {
    host_budget: Option<u64>,
    cuda: Option<(u32, u64)>,
    unified: Option<bool>,
    metrics_addr: Option<SocketAddr>,
    streams: usize,
}

impl MemoryManagerBuilder {
    /// The host authority's budget in bytes.
    pub fn host_budget(mut self, bytes: u64) -> Self {
        self.host_budget = Some(bytes);
        self
    }

    /// Adds CUDA device `ordinal` with a device budget (used where a driver is present).
    pub fn cuda_device(mut self, ordinal: u32, budget: u64) -> Self {
        self.cuda = Some((ordinal, budget));
        self
    }

    /// Whether host and device memory are one pool (overrides detection).
    pub fn unified(mut self, unified: bool) -> Self {
        self.unified = Some(unified);
        self
    }

    /// Serves Prometheus metrics on `addr` (off unless set).
    pub fn metrics_addr(mut self, addr: SocketAddr) -> Self {
        self.metrics_addr = Some(addr);
        self
    }

    /// CPU streams (at least one).
    pub fn streams(mut self, n: usize) -> Self {
        self.streams = n;
        self
    }

    /// Starts everything on the current tokio runtime. On failure everything this call
    /// started is stopped again (the metrics recorder, once installed, stays: a process has
    /// one).
    pub async fn build(self) -> Result<MemoryManager, ManagerError> {
        let mut started = Started::default();
        match self.start(&mut started).await {
            Ok(manager) => Ok(manager),
            Err(error) => {
                started.stop().await;
                Err(error)
            }
        }
    }

    async fn start(self, started: &mut Started) -> Result<MemoryManager, ManagerError> {
        let machine = procmem::host::machine_memory_bytes().unwrap_or(u64::MAX);
        let host_budget = self.host_budget.unwrap_or(machine / 2);
        if host_budget == 0 || host_budget > machine {
            return Err(ManagerError::InvalidBudget {
                what: "host",
                bytes: host_budget,
                why: if host_budget == 0 {
                    "a budget of zero admits nothing".into()
                } else {
                    format!("the machine has {machine} bytes")
                },
            });
        }
        if matches!(self.cuda, Some((_, 0))) {
            return Err(ManagerError::InvalidBudget {
                what: "cuda",
                bytes: 0,
                why: "a budget of zero admits nothing".into(),
            });
        }
        // The recorder first: every actor takes its metric handles as it starts, and handles
        // taken before the recorder exists go to a no-op recorder for good.
        let metrics = match self.metrics_addr {
            Some(addr) => {
                let (handle, exporter) = install_metrics(addr)?;
                started.exporter = Some(exporter);
                Some(handle)
            }
            None => None,
        };
        // CUDA where asked: without a driver this is a typed error, never a silent fallback.
        let cuda = match self.cuda {
            Some((ordinal, budget)) => {
                let provider = CudaProvider::spawn(CudaProviderConfig {
                    ordinal,
                    ..CudaProviderConfig::default()
                })
                .await?;
                started.cuda = Some(provider.clone());
                let detected = provider
                    .mechanism()
                    .device()
                    .is_integrated()
                    .unwrap_or(false);
                Some((ordinal, budget, provider, self.unified.unwrap_or(detected)))
            }
            None => None,
        };
        // Supervised: a Governor that dies is restarted with the holders' books.
        let (host_governor, host_supervisor) =
            GovernorHandle::spawn_supervised(GovernorConfig::new("host", host_budget))
                .await
                .map_err(|source| ManagerError::Spawn {
                    what: "host Governor",
                    source,
                })?;
        started.governors.push(host_governor.clone());
        started.actors.push(host_supervisor.get_cell());
        let host = CpuProvider::spawn(CpuProviderConfig {
            streams: self.streams.max(1),
            registry: None,
        })
        .await?;
        started.host = Some(host.clone());
        let (supervisor, _) = Actor::spawn(None, HolderSupervisor, ())
            .await
            .map_err(|source| ManagerError::Spawn {
                what: "holder supervisor",
                source,
            })?;
        started.actors.push(supervisor.get_cell());
        let mut authorities = vec![Authority {
            name: "host".into(),
            governor: host_governor,
            tiers: vec![(DeviceKey::HOST, MemoryTier::Host)],
        }];
        let cuda_provider = match cuda {
            Some((ordinal, _, provider, true)) => {
                // Unified memory: the device tier is the host's bytes, one authority for both.
                authorities[0]
                    .tiers
                    .push((DeviceKey::cuda(ordinal), MemoryTier::Device));
                Some(provider)
            }
            Some((ordinal, budget, provider, false)) => {
                let name = DeviceKey::cuda(ordinal).to_string();
                let (governor, supervisor) =
                    GovernorHandle::spawn_supervised(GovernorConfig::new(name.clone(), budget))
                        .await
                        .map_err(|source| ManagerError::Spawn {
                            what: "device Governor",
                            source,
                        })?;
                started.governors.push(governor.clone());
                started.actors.push(supervisor.get_cell());
                authorities.push(Authority {
                    name,
                    governor,
                    tiers: vec![(DeviceKey::cuda(ordinal), MemoryTier::Device)],
                });
                Some(provider)
            }
            None => None,
        };
        let inner = Arc::new(Inner {
            authorities,
            host,
            cuda: cuda_provider,
            admitting: Arc::new(AtomicBool::new(true)),
            supervisor,
            metrics,
            exporter: Mutex::new(started.exporter.take()),
            holders: Mutex::new(Vec::new()),
            sampler: Mutex::new(None),
        });
        let sampler = tokio::spawn(sample(Arc::downgrade(&inner)));
        *inner.sampler.lock().unwrap_or_else(|p| p.into_inner()) = Some(sampler);
        *started = Started::default();
        Ok(MemoryManager { inner })
    }
}

/// What a `build` that fails part-way has started, to be stopped again.
#[derive(Default)]
struct Started {
    exporter: Option<JoinHandle<()>>,
    cuda: Option<CudaProvider>,
    host: Option<CpuProvider>,
    governors: Vec<GovernorHandle>,
    actors: Vec<ActorCell>,
}

impl Started {
    async fn stop(self) {
        if let Some(cuda) = self.cuda {
            let _ = cuda.shutdown().await;
            cuda.actor().stop(None);
        }
        if let Some(host) = self.host {
            let _ = host.shutdown().await;
            host.actor().stop(None);
        }
        for governor in self.governors {
            governor.stop();
        }
        for actor in self.actors {
            actor.stop(None);
        }
        if let Some(exporter) = self.exporter {
            exporter.abort();
        }
    }
}

fn install_metrics(addr: SocketAddr) -> Result<(PrometheusHandle, JoinHandle<()>), ManagerError> {
    let metrics_error = |why: String| ManagerError::Metrics { addr, why };
    let (recorder, exporter) = PrometheusBuilder::new()
        .with_http_listener(addr)
        .build()
        .map_err(|e| metrics_error(e.to_string()))?;
    let handle = recorder.handle();
    ::metrics::set_global_recorder(recorder).map_err(|e| metrics_error(e.to_string()))?;
    metrics::describe_all();
    let exporter = tokio::spawn(async move {
        if let Err(error) = exporter.await {
            tracing::error!(?error, "metrics exporter stopped");
        }
    });
    Ok((handle, exporter))
}

struct Inner {
    authorities: Vec<Authority>,
    host: CpuProvider,
    cuda: Option<CudaProvider>,
    admitting: Arc<AtomicBool>,
    supervisor: ActorRef<()>,
    metrics: Option<PrometheusHandle>,
    exporter: Mutex<Option<JoinHandle<()>>>,
    holders: Mutex<Vec<ActorCell>>,
    sampler: Mutex<Option<JoinHandle<()>>>,
}

/// Publishes what only the OS can tell: physical bytes per authority and their drift from the
/// ledger, and the host mechanism's resident bytes.
async fn sample(inner: std::sync::Weak<Inner>) {
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let Some(inner) = inner.upgrade() else { return };
        for a in &inner.authorities {
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
    /// Physical bytes behind an authority, read from the OS: the host mechanism's memfd pages
    /// and the resident pages of its eager allocations.
    /// `None` for an authority that pays for device bytes too (unified memory): the driver has
    /// no per-process truth for them, and counting only the host's would report every device
    /// byte as drift.
    fn os_bytes(&self, authority: &Authority) -> Option<u64> {
        if authority
            .tiers
            .iter()
            .all(|(d, _)| d.kind == DeviceKind::Host)
        {
            self.host.mechanism().resident_bytes().ok()
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
                    .authorities
                    .iter()
                    .map(|a| &a.name)
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl MemoryManager {
    /// A builder.
    pub fn builder() -> MemoryManagerBuilder {
        MemoryManagerBuilder::default()
    }

    /// The authorities.
    pub fn authorities(&self) -> &[Authority] {
        &self.inner.authorities
    }

    /// The Governor paying for `tier` on `device`.
    pub fn governor(&self, device: DeviceKey, tier: MemoryTier) -> Option<&GovernorHandle> {
        self.inner
            .authorities
            .iter()
            .find(|a| a.tiers.contains(&(device, tier)))
            .map(|a| &a.governor)
    }

    /// The host execution provider.
    pub fn host_provider(&self) -> &CpuProvider {
        &self.inner.host
    }

    /// What `device`'s mechanism can do, asked of the mechanism now.
    pub fn capabilities(&self, device: DeviceKey) -> Result<Capabilities, ManagerError> {
        let of = |m: &dyn DeviceMemoryMechanism| Capabilities {
            virtual_backing: m.virtual_backing().is_some(),
            shared_mapping: m.shared_mapping().is_some(),
            commit_model: m.allocator().commit_model(),
        };
        match device.kind {
            DeviceKind::Host => Ok(of(self.inner.host.mechanism())),
            DeviceKind::Cuda => match &self.inner.cuda {
                Some(p) if DeviceMemoryMechanism::device(p.mechanism()) == device => {
                    Ok(of(p.mechanism()))
                }
                _ => Err(ManagerError::UnknownDevice(device, self.device_list())),
            },
        }
    }

    fn device_list(&self) -> &'static str {
        if self.inner.cuda.is_some() {
            " and one CUDA device"
        } else {
            " only"
        }
    }

    /// A binding for `tier` on `device`.
    pub fn binding(
        &self,
        device: DeviceKey,
        tier: MemoryTier,
    ) -> Result<MemoryBinding, ManagerError> {
        let governor = self
            .governor(device, tier)
            .ok_or(ManagerError::UnknownDevice(device, self.device_list()))?
            .clone();
        let provider = match device.kind {
            DeviceKind::Host => Provider::Cpu(self.inner.host.clone()),
            DeviceKind::Cuda => Provider::Cuda(
                self.inner
                    .cuda
                    .clone()
                    .ok_or(ManagerError::UnknownDevice(device, self.device_list()))?,
            ),
        };
        Ok(MemoryBinding {
            device,
            tier,
            governor,
            provider,
            capabilities: self.capabilities(device)?,
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

    /// Starts a KV store on the host authority, supervised by the manager.
    pub async fn kv_store(&self, config: KvStoreConfig) -> Result<KvStoreHandle, ManagerError> {
        self.admit()?;
        let governor = self
            .governor(DeviceKey::HOST, MemoryTier::Host)
            .expect("the host authority always exists")
            .clone();
        let (kv, _) = KvStoreHandle::spawn_supervised(
            config,
            governor,
            self.inner.host.clone(),
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
        self.admit()?;
        let device = self
            .governor(DeviceKey::HOST, MemoryTier::Host)
            .expect("the host authority always exists")
            .clone();
        let args = ResidencyArgs {
            config,
            device,
            host: None,
            provider: self.inner.host.clone(),
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

    /// Each authority's books.
    pub async fn books(&self) -> Vec<(String, GovernorSnapshot, Option<u64>)> {
        let mut out = Vec::new();
        for a in &self.inner.authorities {
            if let Ok(s) = a.governor.snapshot().await {
                out.push((a.name.clone(), s, self.inner.os_bytes(a)));
            }
        }
        out
    }

    /// The Prometheus text the endpoint serves, when metrics are on.
    pub fn metrics_text(&self) -> Option<String> {
        self.inner.metrics.as_ref().map(PrometheusHandle::render)
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
        match self.inner.host.shutdown().await {
            Ok(d) => drained.add(d),
            Err(_) => lost_providers.push("host".to_string()),
        }
        if let Some(cuda) = &self.inner.cuda {
            match cuda.shutdown().await {
                Ok(d) => drained.add(d),
                Err(_) => lost_providers
                    .push(DeviceKey::cuda(cuda.mechanism().device().ordinal()).to_string()),
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
            for a in &self.inner.authorities {
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
        for a in &self.inner.authorities {
            a.governor.stop();
        }
        self.inner.host.actor().stop(None);
        if let Some(cuda) = &self.inner.cuda {
            cuda.actor().stop(None);
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

/// Supervises holders: a crash is logged and counted; the system goes on.
struct HolderSupervisor;

impl Actor for HolderSupervisor {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<()>, _: ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<()>,
        event: SupervisionEvent,
        _: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        if let SupervisionEvent::ActorFailed(who, reason) = event {
            tracing::error!(actor = ?who.get_id(), %reason, "holder crashed; its memory is freed after its fences");
            metrics::HOLDER_FAILURES_TOTAL.counter(&[]).increment(1);
        }
        Ok(())
    }
}
