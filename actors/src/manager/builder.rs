//! Building a manager: the metrics recorder first, then the providers, the authorities (a
//! Governor each, over books split off one topology), the holders' supervisor; a build that
//! fails part-way stops what it started.

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use procmem::{MemoryTier, Place};
use ractor::{Actor, ActorCell};
use tokio::task::JoinHandle;

use super::supervisor::HolderSupervisor;
use super::topology::Topology;
use super::{sample, Inner, ManagerError, MemoryManager};
use crate::cuda_provider::{CudaProvider, CudaProviderConfig};
use crate::execution::{CpuProvider, CpuProviderConfig};
use crate::governor::{GovernorConfig, GovernorHandle};
use crate::provider_choice::Provider;

/// Builds a [`MemoryManager`].
#[derive(Debug, Clone, Default)]
pub struct MemoryManagerBuilder {
    host_budget: Option<u64>,
    cuda: Option<(u32, u64)>,
    unified: Option<bool>,
    metrics_addr: Option<SocketAddr>,
    keep_metrics: bool,
    streams: usize,
    stream_threads: Option<usize>,
    follow_machine: bool,
}

impl MemoryManagerBuilder {
    /// The host authority's budget in bytes (half the machine's memory unless set).
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

    /// Serves Prometheus metrics on `addr` at `/metrics` (off unless set).
    pub fn metrics_addr(mut self, addr: SocketAddr) -> Self {
        self.metrics_addr = Some(addr);
        self
    }

    /// Keeps Prometheus metrics without an endpoint of its own: the embedder serves
    /// [`MemoryManager::metrics_text`](crate::MemoryManager::metrics_text) where it likes (on
    /// its own HTTP port, say). [`MemoryManagerBuilder::metrics_addr`] implies it.
    pub fn keep_metrics(mut self, keep: bool) -> Self {
        self.keep_metrics = keep;
        self
    }

    /// Makes the host authority's capacity follow the machine: its cgroup's limits and memory
    /// pressure (PSI), sampled once a second (see [`crate::machine`]). Off unless set.
    pub fn follow_machine(mut self, follow: bool) -> Self {
        self.follow_machine = follow;
        self
    }

    /// CPU streams (at least one).
    pub fn streams(mut self, n: usize) -> Self {
        self.streams = n;
        self
    }

    /// Worker threads of each CPU stream's own pool, on which its kernels and their parallel
    /// calls run (one per CPU unless set; 0 runs them on the stream thread and rayon's global
    /// pool: see [`CpuProviderConfig::threads`]).
    pub fn stream_threads(mut self, n: usize) -> Self {
        self.stream_threads = Some(n);
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

    fn host_budget_checked(&self) -> Result<u64, ManagerError> {
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
        Ok(host_budget)
    }

    async fn start(self, started: &mut Started) -> Result<MemoryManager, ManagerError> {
        let host_budget = self.host_budget_checked()?;
        // The recorder first: every actor takes its metric handles as it starts, and handles
        // taken before the recorder exists go to a no-op recorder for good.
        let metrics = match (self.metrics_addr, self.keep_metrics) {
            (Some(addr), _) => {
                let (handle, exporter) = install_metrics(Some(addr))?;
                started.exporter = exporter;
                Some(handle)
            }
            (None, true) => Some(install_metrics(None)?.0),
            (None, false) => None,
        };
        let cuda = self.start_cuda(started).await?;
        let topology = start_governors(host_budget, cuda.as_ref(), started).await?;
        let host = CpuProvider::spawn(CpuProviderConfig {
            streams: self.streams.max(1),
            threads: self
                .stream_threads
                .unwrap_or_else(crate::stream::default_stream_threads),
            registry: None,
        })
        .await?;
        started.providers.push(host.clone().into());
        let (supervisor, _) = Actor::spawn(None, HolderSupervisor, ())
            .await
            .map_err(|source| ManagerError::Spawn {
                what: "holder supervisor",
                source,
            })?;
        started.actors.push(supervisor.get_cell());
        let mut providers: Vec<Provider> = vec![host.clone().into()];
        let cuda = cuda.map(|(_, _, cuda, _)| cuda);
        if let Some(cuda) = &cuda {
            providers.push(cuda.clone().into());
        }
        let inner = Arc::new(Inner {
            topology,
            host,
            cuda,
            providers,
            admitting: Arc::new(AtomicBool::new(true)),
            supervisor,
            metrics,
            exporter: Mutex::new(started.exporter.take()),
            holders: Mutex::new(Vec::new()),
            sampler: Mutex::new(None),
            machine: Mutex::new(None),
            reserved: Arc::default(),
        });
        if self.follow_machine {
            if let Some(governor) = inner.topology.governor(Place::HOST, MemoryTier::Host) {
                let follow = crate::machine::HostPressure::spawn(
                    governor.clone(),
                    procmem::host::machine::PressurePolicy::new(host_budget),
                    crate::machine::LinuxSource::detect(),
                    std::time::Duration::from_secs(1),
                );
                *inner.machine.lock().unwrap_or_else(|p| p.into_inner()) = Some(follow);
            }
        }
        let sampler = tokio::spawn(sample(Arc::downgrade(&inner)));
        *inner.sampler.lock().unwrap_or_else(|p| p.into_inner()) = Some(sampler);
        *started = Started::default();
        Ok(MemoryManager { inner })
    }

    /// The CUDA provider where asked (without a driver this is a typed error, never a silent
    /// fallback), and whether its memory is the host's.
    async fn start_cuda(&self, started: &mut Started) -> Result<Option<Cuda>, ManagerError> {
        let Some((ordinal, budget)) = self.cuda else {
            return Ok(None);
        };
        let provider = CudaProvider::spawn(CudaProviderConfig {
            ordinal,
            ..CudaProviderConfig::default()
        })
        .await?;
        started.providers.push(provider.clone().into());
        let detected = provider
            .mechanism()
            .device()
            .is_integrated()
            .unwrap_or(false);
        Ok(Some((
            ordinal,
            budget,
            provider,
            self.unified.unwrap_or(detected),
        )))
    }
}

/// A started CUDA device: its ordinal, budget, provider, and whether its memory is unified
/// with the host's.
type Cuda = (u32, u64, CudaProvider, bool);

/// The topology: host, and the device either as a tier of the host's pool (unified memory)
/// or as an authority of its own; each authority's Governor started supervised (one that
/// dies is restarted with the holders' books).
async fn start_governors(
    host_budget: u64,
    cuda: Option<&Cuda>,
    started: &mut Started,
) -> Result<Topology, ManagerError> {
    let mut topology = Topology::default();
    let mut host_tiers = vec![(Place::HOST, MemoryTier::Host)];
    let mut device_authority = None;
    if let Some((ordinal, budget, _, unified)) = cuda {
        let device = (Place::cuda(*ordinal), MemoryTier::Device);
        if *unified {
            host_tiers.push(device);
        } else {
            device_authority = Some((Place::cuda(*ordinal).to_string(), *budget, device));
        }
    }
    let host_id = topology.add("host", host_budget, &host_tiers)?;
    let mut authorities = vec![(host_id, "host".to_string(), host_budget)];
    if let Some((name, budget, tier)) = device_authority {
        let id = topology.add(&name, budget, &[tier])?;
        authorities.push((id, name, budget));
    }
    for (id, name, budget) in authorities {
        let books = topology.books_for(id)?;
        let config = GovernorConfig::new(name.clone(), budget);
        let (governor, supervisor) = GovernorHandle::spawn_supervised_books(books, id, config)
            .await
            .map_err(|source| ManagerError::Spawn {
                what: "Governor",
                source,
            })?;
        started.governors.push(governor.clone());
        started.actors.push(supervisor);
        topology.serve(&name, governor);
    }
    Ok(topology)
}

/// What a `build` that fails part-way has started, to be stopped again.
#[derive(Default)]
pub(super) struct Started {
    exporter: Option<JoinHandle<()>>,
    providers: Vec<Provider>,
    governors: Vec<GovernorHandle>,
    actors: Vec<ActorCell>,
}

impl Started {
    async fn stop(self) {
        for provider in self.providers {
            let _ = provider.shutdown().await;
            provider.actor().stop(None);
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

/// Installs the process's Prometheus recorder, with an HTTP listener of its own at `addr`
/// (or none: the embedder serves the text).
pub(crate) fn install_metrics(
    addr: Option<SocketAddr>,
) -> Result<(PrometheusHandle, Option<JoinHandle<()>>), ManagerError> {
    let metrics_error = |why: String| ManagerError::Metrics {
        addr: addr.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0))),
        why,
    };
    // Every latency is a histogram with buckets for its range (summaries cannot be summed
    // across processes).
    let mut builder = PrometheusBuilder::new();
    for m in procmem::metrics::all().filter(|m| !m.buckets.is_empty()) {
        builder = builder
            .set_buckets_for_metric(Matcher::Full(m.name.to_string()), m.buckets)
            .map_err(|e| metrics_error(e.to_string()))?;
    }
    let Some(addr) = addr else {
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        ::metrics::set_global_recorder(recorder).map_err(|e| metrics_error(e.to_string()))?;
        procmem::metrics::describe_all();
        return Ok((handle, None));
    };
    let (recorder, exporter) = builder
        .with_http_listener(addr)
        .build()
        .map_err(|e| metrics_error(e.to_string()))?;
    let handle = recorder.handle();
    ::metrics::set_global_recorder(recorder).map_err(|e| metrics_error(e.to_string()))?;
    procmem::metrics::describe_all();
    let exporter = tokio::spawn(async move {
        if let Err(error) = exporter.await {
            tracing::error!(?error, "metrics exporter stopped");
        }
    });
    Ok((handle, Some(exporter)))
}
