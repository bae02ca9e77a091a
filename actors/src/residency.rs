//! Model-weight residency: a holder actor keeping each layer's weights in device memory and
//! offloading cold, unpinned layers to a lower tier under pressure. The copy out runs on the
//! execution provider's stream and the device copy is freed only after that copy's fence;
//! a layer is reloaded before it is used again.
//!
//! Residency runs on any device ([`Provider`]): on the host a layer is used by a closure
//! over its bytes on the CPU stream ([`ResidencyHandle::with_weights`]); on a GPU the server
//! launches its kernels over the layer's device address on the CUDA stream and returns their
//! fence ([`ResidencyHandle::with_device_weights`]), which the buffer records, so an offload
//! or a free waits for it. On a GPU the copy out is a device-to-host copy made once the
//! layer's recorded fences have completed.
//!
//! Offloaded copies go to the host tier, charged to its Governor, where one is given; without
//! one (the host backend, where the device is host memory and a host copy would take exactly
//! what the offload gives back) they go to an unlinked file on disk (`PROCMEM_SWAP_DIR`, else
//! `/var/tmp`), as swapped KV does. A reload that finds too little room first offloads the
//! residency's own coldest layers, so one layer's reload never waits on a ticket to itself. A
//! host tier that is the device's own authority is refused at start.

use std::path::PathBuf;

use procmem::fence::{Fence, TimelineFence};
use procmem::fenced::RecordUse;
use procmem::ledger::{HolderId, Priority};
use procmem::{AllocationRequest, MemoryError, MemoryRole};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::time::{Duration, Instant};

use crate::buffer::{Buffer, BufferView};
use crate::cuda_provider::CudaStreamHandle;
use crate::execution::ProviderError;
use crate::governor::GovernorHandle;
use crate::mailbox::HolderRef;
use crate::provider_choice::Provider;
use crate::stream::completed_within;
use crate::ticket::PressureTicket;

mod metrics;
mod offload;

/// How to start model residency: [`ResidencyConfig::new`], then the setters of what differs
/// from the defaults (a new field never breaks a caller).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ResidencyConfig {
    /// Holder name.
    pub name: String,
    /// Holder priority (weights usually matter more than caches).
    pub priority: Priority,
    /// How long a reload may wait for room.
    pub wait: Duration,
}

impl ResidencyConfig {
    /// Residency named `name`: priority 10 (above a KV store's default 0, so caches are
    /// asked first), reloads waiting up to 5 s for room.
    pub fn new(name: impl Into<String>) -> Self {
        ResidencyConfig {
            name: name.into(),
            priority: 10,
            wait: Duration::from_secs(5),
        }
    }

    /// Sets the holder priority.
    #[must_use]
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// Sets how long a reload may wait for room.
    #[must_use]
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }
}

/// Layers residency keeps at most (far beyond any model's).
const MAX_LAYERS: usize = 1 << 16;

/// Why residency refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResidencyError {
    /// Allocating or charging device memory failed.
    #[error(transparent)]
    Provider(#[from] ProviderError),
    /// No such layer.
    #[error("layer {0} is not loaded")]
    NoSuchLayer(usize),
    /// A layer index beyond what a model has; nothing was loaded.
    #[error("layer {layer} is out of range: at most {max} layers")]
    LayerOutOfRange {
        /// The index given.
        layer: usize,
        /// Layers residency keeps at most.
        max: usize,
    },
    /// The holder is not running.
    #[error("model residency is not running")]
    Unavailable,
    /// A Governor refused to register the holder at startup.
    #[error("model residency could not register with its Governor: {0}")]
    Register(#[from] crate::governor::GovernorError),
    /// An offloaded layer's copy could not be read back: its weights are gone, and it must be
    /// loaded again. (A copy out that failed keeps the device copy instead.)
    #[error("the offloaded copy of layer {0} was lost; load it again")]
    CopyLost(usize),
    /// An offloaded layer's copy kernel has not finished (its stream stopped taking work).
    #[error("the copy out of layer {0} has not finished")]
    CopyNotDone(usize),
    /// The host tier given is the device's own authority: offloading there frees nothing.
    #[error("the host tier is the device's own authority; offloading there frees nothing")]
    HostAliased,
    /// The actor could not be started (it panicked while starting).
    #[error("model residency could not start: {0}")]
    Start(#[source] ractor::SpawnErr),
    /// The weights are on another kind of device than the call works on: host closures for
    /// host weights ([`ResidencyHandle::with_weights`]), device kernels for GPU weights
    /// ([`ResidencyHandle::with_device_weights`]).
    #[error("the weights are not on the device this call works with")]
    WrongDevice,
    /// The kernels over the weights failed to queue.
    #[error("the device kernels over the weights failed: {0}")]
    Kernels(#[source] MemoryError),
}

/// Where a layer's weights are now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// In device memory.
    Device,
    /// Offloaded to the host tier.
    Host,
    /// Offloaded to a file on disk.
    Disk,
}

/// Residency at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResidencyStats {
    /// Layers in device memory.
    pub resident_layers: usize,
    /// Layers offloaded.
    pub offloaded_layers: usize,
    /// Of those, on disk.
    pub disk_layers: usize,
    /// Device bytes charged.
    pub device_bytes: u64,
    /// Bytes of the offloaded copies (host tier or disk).
    pub offloaded_bytes: u64,
    /// Offloads so far.
    pub offloads: u64,
    /// Reloads so far.
    pub reloads: u64,
    /// Bytes offloaded so far.
    pub offload_bytes_total: u64,
    /// Bytes reloaded so far.
    pub reload_bytes_total: u64,
}

type WeightsFn = Box<dyn FnOnce(&[u8]) + Send + 'static>;
type DeviceWeightsFn =
    Box<dyn FnOnce(BufferView, &CudaStreamHandle) -> Result<(), MemoryError> + Send + 'static>;

/// The residency mailbox.
pub(crate) enum ResidencyMsg {
    /// A Governor's pressure ticket.
    Ticket(PressureTicket),
    /// Loads a layer's weights into device memory.
    Load {
        /// The layer.
        layer: usize,
        /// Its weights.
        weights: Vec<u8>,
        /// Pinned layers are never offloaded.
        pinned: bool,
        /// Answered once the layer is in device memory, or with why not.
        reply: RpcReplyPort<Result<(), ResidencyError>>,
    },
    /// Runs `f` over a layer's weights on the stream, reloading them first if offloaded.
    Use {
        /// The layer.
        layer: usize,
        /// The kernel body.
        f: WeightsFn,
        /// The kernel's fence, once queued (the kernel signals its own completion).
        reply: RpcReplyPort<Result<TimelineFence, ResidencyError>>,
    },
    /// Queues the server's kernels over a GPU layer's weights (reloading them first if
    /// offloaded); their fence is recorded on the weights.
    UseDevice {
        /// The layer.
        layer: usize,
        /// Queues the kernels.
        f: DeviceWeightsFn,
        /// The kernels' fence, once queued.
        reply: RpcReplyPort<Result<Fence, ResidencyError>>,
    },
    /// Where a layer is.
    Placement {
        /// The layer.
        layer: usize,
        /// Its placement.
        reply: RpcReplyPort<Result<Option<Placement>, ResidencyError>>,
    },
    /// Where the layers are and what moved, for `ResidencyHandle::stats`.
    Stats {
        /// Answered with the counters.
        reply: RpcReplyPort<Result<ResidencyStats, ResidencyError>>,
    },
    /// Offloads every unpinned layer now (`ResidencyHandle::offload_all`).
    OffloadAll {
        /// Answered with the bytes that will be free once the copies' fences complete.
        reply: RpcReplyPort<Result<u64, ResidencyError>>,
    },
}

#[cfg(feature = "cluster")]
impl ractor::Message for ResidencyMsg {}

crate::holder::holder_mailbox!(ResidencyMsg::Ticket);

enum Slot {
    Device(Buffer),
    /// Offloaded: the copy (and what pays for it) goes once the layer is back.
    Away(offload::Offloaded),
}

struct Layer {
    slot: Slot,
    pinned: bool,
    last_used: u64,
}

/// Residency's state.
pub(crate) struct ResidencyState {
    config: ResidencyConfig,
    provider: Provider,
    device: GovernorHandle,
    host: Option<GovernorHandle>,
    holder: HolderId,
    host_holder: Option<HolderId>,
    layers: Vec<Option<Layer>>,
    /// Where copies go without a host tier.
    disk_dir: PathBuf,
    clock: u64,
    stats: ResidencyStats,
    metrics: metrics::ResidencyMetrics,
}

/// The residency actor.
#[derive(Debug, Default)]
pub(crate) struct ModelResidency;

/// What residency needs to start.
pub struct ResidencyArgs {
    /// Configuration.
    pub config: ResidencyConfig,
    /// The device tier's Governor.
    pub device: GovernorHandle,
    /// The host tier's Governor, which offloaded copies are charged to; `None` sends them to
    /// an unlinked file on disk.
    pub host: Option<GovernorHandle>,
    /// The execution provider that holds device memory and runs copies (a `CpuProvider`
    /// or a `CudaProvider`, `.into()`).
    pub provider: Provider,
}

impl Actor for ModelResidency {
    type Msg = ResidencyMsg;
    type State = ResidencyState;
    type Arguments = ResidencyArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ResidencyMsg>,
        args: ResidencyArgs,
    ) -> Result<ResidencyState, ActorProcessingErr> {
        let ResidencyArgs {
            config,
            device,
            host,
            provider,
        } = args;
        if host
            .as_ref()
            .is_some_and(|h| h.authority() == device.authority())
        {
            return Err(ResidencyError::HostAliased.into());
        }
        let holder = device
            .register_holder(
                config.name.clone(),
                config.priority,
                Some(myself.get_derived()),
            )
            .await
            .map_err(ResidencyError::from)?;
        let host_holder = match &host {
            Some(h) => Some(
                h.register_holder(format!("{}-offload", config.name), config.priority, None)
                    .await
                    .map_err(ResidencyError::from)?,
            ),
            None => None,
        };
        let metrics = metrics::ResidencyMetrics::new(&config.name, device.name());
        Ok(ResidencyState {
            config,
            provider,
            device,
            host,
            holder,
            host_holder,
            layers: Vec::new(),
            disk_dir: crate::kv_store::default_disk_dir(),
            clock: 0,
            stats: ResidencyStats::default(),
            metrics,
        })
    }

    async fn handle(
        &self,
        _: ActorRef<ResidencyMsg>,
        msg: ResidencyMsg,
        state: &mut ResidencyState,
    ) -> Result<(), ActorProcessingErr> {
        procmem::fault::panic_point("residency.handle");
        state.clock += 1;
        match msg {
            ResidencyMsg::Ticket(ticket) => state.answer(ticket).await,
            ResidencyMsg::Load {
                layer,
                weights,
                pinned,
                reply,
            } => {
                let result = state.load(layer, &weights, pinned).await;
                let _ = reply.send(result);
            }
            ResidencyMsg::Use { layer, f, reply } => {
                let result = state.use_layer(layer, f).await;
                let _ = reply.send(result);
            }
            ResidencyMsg::UseDevice { layer, f, reply } => {
                let result = state.use_device_layer(layer, f).await;
                let _ = reply.send(result);
            }
            ResidencyMsg::Placement { layer, reply } => {
                let placement = state
                    .layers
                    .get(layer)
                    .and_then(Option::as_ref)
                    .map(|l| match &l.slot {
                        Slot::Device(_) => Placement::Device,
                        Slot::Away(a) if a.on_disk() => Placement::Disk,
                        Slot::Away(_) => Placement::Host,
                    });
                let _ = reply.send(Ok(placement));
            }
            ResidencyMsg::Stats { reply } => {
                let _ = reply.send(Ok(state.stats()));
            }
            ResidencyMsg::OffloadAll { reply } => {
                let freed = state.offload(u64::MAX, None).await;
                let _ = reply.send(Ok(freed));
            }
        }
        state.metrics.publish(&state.stats());
        Ok(())
    }
}

impl ResidencyState {
    async fn device_buffer(&self, bytes: &[u8]) -> Result<Buffer, ResidencyError> {
        let request = AllocationRequest::new(bytes.len() as u64, MemoryRole::Weights);
        let deadline = Some(Instant::now() + self.config.wait);
        let mut buffer = self
            .provider
            .allocate(
                &self.device,
                self.holder,
                &request,
                self.config.priority,
                deadline,
            )
            .await?;
        // A plain copy on the host, a host-to-device copy on a GPU (the buffer is new: no
        // work uses it yet).
        let allocator = self.provider.allocator();
        buffer
            .write_with(|a| allocator.write(a, 0, bytes))
            .map_err(ProviderError::from)?;
        Ok(buffer)
    }

    async fn load(
        &mut self,
        layer: usize,
        weights: &[u8],
        pinned: bool,
    ) -> Result<(), ResidencyError> {
        // The index sizes a table: refuse one no model has before anything is allocated.
        if layer >= MAX_LAYERS {
            return Err(ResidencyError::LayerOutOfRange {
                layer,
                max: MAX_LAYERS,
            });
        }
        self.make_room(weights.len() as u64, layer).await;
        let buffer = self.device_buffer(weights).await?;
        if self.layers.len() <= layer {
            self.layers.resize_with(layer + 1, || None);
        }
        self.layers[layer] = Some(Layer {
            slot: Slot::Device(buffer),
            pinned,
            last_used: self.clock,
        });
        Ok(())
    }

    /// With too little room for `bytes`, this residency's own coldest layers (other than
    /// `keep`) go first: a ticket the Governor sent for this load would come back to this
    /// busy actor.
    async fn make_room(&mut self, bytes: u64, keep: usize) {
        // What the allocation will be charged: its footprint on the device.
        let request = AllocationRequest::new(bytes, MemoryRole::Weights);
        let need = self
            .provider
            .allocator()
            .footprint(&request)
            .unwrap_or(bytes);
        let free = match self.device.snapshot().await {
            Ok(s) => s.books.free(),
            Err(_) => return,
        };
        if free < need {
            self.offload(need - free, Some(keep)).await;
        }
    }

    /// The layer's device buffer, reloaded first if it was offloaded.
    async fn resident(&mut self, layer: usize) -> Result<&mut Buffer, ResidencyError> {
        let clock = self.clock;
        let started = Instant::now();
        let back = match self.layers.get(layer).and_then(Option::as_ref) {
            None => return Err(ResidencyError::NoSuchLayer(layer)),
            Some(Layer {
                slot: Slot::Away(away),
                ..
            }) => Some(self.copy_back(layer, away).await?),
            Some(_) => None,
        };
        match back {
            None => {}
            // The copy out failed: the device copy never left.
            Some(offload::Back::Kept(buffer)) => {
                self.layers[layer].as_mut().expect("checked").slot = Slot::Device(buffer);
            }
            Some(offload::Back::Bytes(bytes)) => {
                let need = bytes.len() as u64;
                self.make_room(need, layer).await;
                let buffer = self.device_buffer(&bytes).await?;
                let entry = self.layers[layer].as_mut().expect("checked");
                // The copy and its lease go once the device copy exists.
                entry.slot = Slot::Device(buffer);
                self.stats.reloads += 1;
                self.stats.reload_bytes_total += need;
                self.metrics.reload.record(started.elapsed().as_secs_f64());
            }
        }
        let entry = self.layers[layer].as_mut().expect("checked");
        entry.last_used = clock;
        match &mut entry.slot {
            Slot::Device(buffer) => Ok(buffer),
            Slot::Away(_) => unreachable!("reloaded above"),
        }
    }

    async fn use_layer(
        &mut self,
        layer: usize,
        f: WeightsFn,
    ) -> Result<TimelineFence, ResidencyError> {
        let Provider::Cpu(provider) = self.provider.clone() else {
            return Err(ResidencyError::WrongDevice);
        };
        let buffer = self.resident(layer).await?;
        let stream = provider.stream(0)?;
        let fence = stream
            .submit_reading(&[&*buffer], move |bytes| f(bytes[0]))
            .map_err(|_| ProviderError::Unavailable)?;
        Ok(TimelineFence::new(fence, stream.timeline()).expect("a fence of this stream"))
    }

    async fn use_device_layer(
        &mut self,
        layer: usize,
        f: DeviceWeightsFn,
    ) -> Result<Fence, ResidencyError> {
        let Provider::Cuda(provider) = self.provider.clone() else {
            return Err(ResidencyError::WrongDevice);
        };
        let stream = provider.stream(0)?.clone();
        let buffer = self.resident(layer).await?;
        let queued = f(buffer.view(), &stream);
        // The weights record a fence of the store's own after whatever `f` queued, failed or
        // not (it may have queued some): an offload or a free waits for it. On a stream that
        // takes no more work, the last value it issued.
        let fence = stream
            .submit(&[], |_| Ok(()))
            .unwrap_or_else(|_| stream.last_issued());
        let used = TimelineFence::new(fence, stream.timeline()).expect("a fence of this stream");
        buffer.record_use(used);
        queued.map_err(ResidencyError::Kernels)?;
        Ok(fence)
    }

    fn stats(&self) -> ResidencyStats {
        let mut s = self.stats.clone();
        for l in self.layers.iter().flatten() {
            match &l.slot {
                Slot::Device(b) => {
                    s.resident_layers += 1;
                    s.device_bytes += b.charged_bytes();
                }
                Slot::Away(away) => {
                    s.offloaded_layers += 1;
                    s.disk_layers += usize::from(away.on_disk());
                    s.offloaded_bytes += away.bytes();
                }
            }
        }
        s
    }
}

/// Waits (without blocking the thread, at most `limit`) until every fence recorded on `buffer`
/// has completed; false if one did not, or is of another stream than `stream`.
async fn idle(buffer: &Buffer, stream: &CudaStreamHandle, limit: Duration) -> bool {
    let timeline = stream.timeline();
    for fence in buffer.fences() {
        if fence.stream != stream.id()
            || !completed_within(timeline.as_ref(), fence.value, limit).await
        {
            return false;
        }
    }
    true
}

/// A cheap, cloneable handle to model residency.
#[derive(Debug, Clone)]
pub struct ResidencyHandle {
    holder: HolderRef<ResidencyMsg>,
}

impl ResidencyHandle {
    /// Starts residency as a holder of `args.device`.
    pub async fn spawn(
        args: ResidencyArgs,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ResidencyError> {
        Self::start(args, None).await
    }

    /// The same, supervised by `supervisor` (its failure is reported there, not fatal).
    pub async fn spawn_supervised(
        args: ResidencyArgs,
        supervisor: ractor::ActorCell,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ResidencyError> {
        Self::start(args, Some(supervisor)).await
    }

    async fn start(
        args: ResidencyArgs,
        supervisor: Option<ractor::ActorCell>,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ResidencyError> {
        let (holder, join) =
            HolderRef::spawn(ModelResidency, args, supervisor, ResidencyError::Start).await?;
        Ok((ResidencyHandle { holder }, join))
    }

    /// Its actor, to supervise, stop or kill it (it takes no message from outside).
    pub fn actor(&self) -> ractor::ActorCell {
        self.holder.cell()
    }

    async fn ask<T: Send + 'static>(
        &self,
        build: impl FnOnce(RpcReplyPort<Result<T, ResidencyError>>) -> ResidencyMsg,
    ) -> Result<T, ResidencyError> {
        self.holder.ask(build, ResidencyError::Unavailable).await
    }

    /// Loads a layer's weights into device memory.
    pub async fn load(
        &self,
        layer: usize,
        weights: Vec<u8>,
        pinned: bool,
    ) -> Result<(), ResidencyError> {
        self.ask(|reply| ResidencyMsg::Load {
            layer,
            weights,
            pinned,
            reply,
        })
        .await
    }

    /// Runs `f` over a layer's weights on the stream (reloading them first if offloaded) and
    /// returns its result once the kernel has run. Host weights only (GPU weights answer
    /// `WrongDevice`: use [`ResidencyHandle::with_device_weights`]).
    pub async fn with_weights<T: Send + 'static>(
        &self,
        layer: usize,
        f: impl FnOnce(&[u8]) -> T + Send + 'static,
    ) -> Result<T, ResidencyError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit_with_weights(layer, move |w| {
            let _ = tx.send(f(w));
        })
        .await?;
        rx.await.map_err(|_| ResidencyError::Unavailable)
    }

    /// Queues `f` over a layer's weights on the host stream (reloading them first if
    /// offloaded) and returns its fence once it is queued, without waiting for it to run: the
    /// weights stay in place until that fence completes (an offload or a free waits for it).
    /// Work queued on the same stream after this call runs after `f`, so a server can queue a
    /// whole step's kernels, layer after layer, and wait only for the last. Host weights only
    /// (GPU weights answer `WrongDevice`).
    pub async fn submit_with_weights(
        &self,
        layer: usize,
        f: impl FnOnce(&[u8]) + Send + 'static,
    ) -> Result<TimelineFence, ResidencyError> {
        self.ask(|reply| ResidencyMsg::Use {
            layer,
            f: Box::new(f),
            reply,
        })
        .await
    }

    /// Queues the server's kernels over a GPU layer's weights: `f` gets the weights' device
    /// address and the CUDA stream and queues its kernels there. Residency then records a
    /// fence of that stream after them, which the weights keep (they are not offloaded or
    /// freed before it completes), and returns it. Offloaded weights are reloaded first.
    /// Host weights answer `WrongDevice` (use [`ResidencyHandle::with_weights`]).
    pub async fn with_device_weights(
        &self,
        layer: usize,
        f: impl FnOnce(BufferView, &CudaStreamHandle) -> Result<(), MemoryError> + Send + 'static,
    ) -> Result<Fence, ResidencyError> {
        self.ask(|reply| ResidencyMsg::UseDevice {
            layer,
            f: Box::new(f),
            reply,
        })
        .await
    }

    /// Where a layer is.
    pub async fn placement(&self, layer: usize) -> Result<Option<Placement>, ResidencyError> {
        self.ask(|reply| ResidencyMsg::Placement { layer, reply })
            .await
    }

    /// Where the layers are now, the bytes on each tier, and the offloads and reloads so far.
    pub async fn stats(&self) -> Result<ResidencyStats, ResidencyError> {
        self.ask(|reply| ResidencyMsg::Stats { reply }).await
    }

    /// Offloads every unpinned layer now, as pressure would, least recently used first: an
    /// idle server's sleep. Each comes back when it is next used. Returns the device bytes
    /// that will be free once the copies' fences complete.
    pub async fn offload_all(&self) -> Result<u64, ResidencyError> {
        self.ask(|reply| ResidencyMsg::OffloadAll { reply }).await
    }
}
