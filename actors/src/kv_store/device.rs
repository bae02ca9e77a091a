//! Where a KV store's memory lives and where its steps run: the host provider (memfd blocks
//! mapped into reservations, kernels as closures on a CPU stream) or a CUDA provider (VMM
//! handles mapped into device reservations, kernels launched on a CUDA stream by the server).
//! The store's policy is the same on both; what differs is here, with the one way the store
//! hears of a fence: a message to itself once the fence completes.

use std::sync::Arc;

use procmem::fence::{Fence, StreamId, Timeline};
use procmem::host::HostMechanism;
use procmem::{Place, SharedMapping, VirtualBacking};
use ractor::ActorRef;

use super::{KvStoreError, KvStoreMsg, KvStoreState};
use crate::cuda_provider::{CudaStreamHandle, CudaSubmitError};
use crate::deferred_free::DeferredQueue;
use crate::provider_choice::Provider;
use crate::stream::{completed_within, CpuStream, StreamError};

/// The stream a KV store's steps run on.
#[derive(Debug, Clone)]
pub enum KvStream {
    /// A CPU stream: kernels are closures ([`KvStep::submit`](super::KvStep::submit)).
    Cpu(CpuStream),
    /// A CUDA stream: the server launches its kernels on it and completes the step with a
    /// fence of it.
    Cuda(CudaStreamHandle),
}

impl KvStream {
    /// Its identity.
    pub fn id(&self) -> StreamId {
        match self {
            KvStream::Cpu(s) => s.id(),
            KvStream::Cuda(s) => s.id(),
        }
    }

    /// Its timeline.
    pub fn timeline(&self) -> Arc<dyn Timeline> {
        match self {
            KvStream::Cpu(s) => s.timeline(),
            KvStream::Cuda(s) => s.timeline(),
        }
    }

    /// The CPU stream, on the host.
    pub fn cpu(&self) -> Option<&CpuStream> {
        match self {
            KvStream::Cpu(s) => Some(s),
            KvStream::Cuda(_) => None,
        }
    }

    /// The CUDA stream, on a GPU.
    pub fn cuda(&self) -> Option<&CudaStreamHandle> {
        match self {
            KvStream::Cuda(s) => Some(s),
            KvStream::Cpu(_) => None,
        }
    }

    pub(crate) fn deferred_free(&self) -> &DeferredQueue {
        match self {
            KvStream::Cpu(s) => s.deferred_free(),
            KvStream::Cuda(s) => s.deferred_free(),
        }
    }

    pub(crate) fn last_issued(&self) -> Fence {
        match self {
            KvStream::Cpu(s) => s.last_issued(),
            KvStream::Cuda(s) => s.last_issued(),
        }
    }

    /// A fence after everything queued on the stream so far: an empty kernel on a CPU stream,
    /// an event on a CUDA stream. `None` where the stream takes no more work.
    pub(crate) fn mark(&self) -> Option<Fence> {
        match self {
            KvStream::Cpu(s) => s.submit(&[], || {}).ok(),
            KvStream::Cuda(s) => match s.submit(&[], |_| Ok(())) {
                Ok(f) => Some(f),
                Err(CudaSubmitError::Stream(_)) => None,
                Err(CudaSubmitError::Work(e)) => {
                    tracing::error!(%e, "recording a CUDA event failed");
                    None
                }
            },
        }
    }

    /// Runs `f` once everything queued on the stream so far has run. On a stream that takes
    /// no more work, once the last value it issued completes (a stream that failed never
    /// completes it: `f`, and whatever it holds, is then kept rather than run early).
    pub(crate) fn after_queued(&self, f: impl FnOnce() + Send + 'static) {
        let fence = self.mark().unwrap_or_else(|| self.last_issued());
        self.timeline()
            .on_complete(fence.value, Box::new(move |_| f()));
    }

    /// Runs `kernel` on a CPU stream, after everything queued there, and returns its fence;
    /// a CUDA stream takes no closures (`StreamError::NotHost`: the memory is on its device,
    /// not in host memory). Unlike [`KvStep::submit`](super::KvStep::submit) the kernel is
    /// handed no KV and does not hold the step's memory: for a step's work that reads none.
    pub fn submit_host(
        &self,
        kernel: impl FnOnce() + Send + 'static,
    ) -> Result<Fence, StreamError> {
        match self {
            KvStream::Cpu(s) => s.submit(&[], kernel),
            KvStream::Cuda(s) => Err(StreamError::NotHost(Place::cuda(
                s.cuda().device().ordinal(),
            ))),
        }
    }
}

/// What the store uses of its provider's device.
pub(crate) struct KvDevice {
    pub(crate) provider: Provider,
    pub(crate) stream: KvStream,
    pub(crate) backing: Arc<dyn VirtualBacking>,
    pub(crate) shared: Arc<dyn SharedMapping>,
    /// Host memory for swap copies charged to a host tier (on the host, the provider's own).
    host: Option<HostMechanism>,
}

impl KvDevice {
    pub(crate) fn open(provider: Provider) -> Result<KvDevice, KvStoreError> {
        // The backing does both: reserving and mapping, and sharing prefix blocks.
        let (stream, backing, shared, host): (
            _,
            Arc<dyn VirtualBacking>,
            Arc<dyn SharedMapping>,
            _,
        ) = match &provider {
            Provider::Cpu(p) => {
                let b = p.mechanism().backing();
                (KvStream::Cpu(p.stream(0)?.clone()), b.clone(), b, None)
            }
            Provider::Cuda(p) => {
                let b = p.mechanism().backing();
                let host = Some(HostMechanism::new()?);
                (KvStream::Cuda(p.stream(0)?.clone()), b.clone(), b, host)
            }
        };
        Ok(KvDevice {
            provider,
            stream,
            backing,
            shared,
            host,
        })
    }

    /// The mapping granularity of the device.
    pub(crate) fn granularity(&self) -> u64 {
        self.backing.granularity()
    }

    /// Whether the KV is host memory (host kernels, host swap copies).
    pub(crate) fn is_host(&self) -> bool {
        matches!(self.provider, Provider::Cpu(_))
    }

    /// The host mechanism swap copies charged to a host tier are allocated from.
    pub(crate) fn host(&self) -> &HostMechanism {
        match (&self.provider, &self.host) {
            (Provider::Cpu(p), _) => p.mechanism(),
            (_, Some(host)) => host,
            (Provider::Cuda(_), None) => unreachable!("a CUDA store opens a host mechanism"),
        }
    }

    /// Waits (without blocking the thread) until `fence` of its stream completes, at most
    /// `limit`: false if it did not.
    pub(crate) async fn wait(&self, fence: Fence, limit: std::time::Duration) -> bool {
        completed_within(self.stream.timeline().as_ref(), fence.value, limit).await
    }

    /// Bytes of the store's memory as the device counts it: the memfd's allocated pages (as
    /// the kernel counts them), or the VMM handles mapped (as the driver was asked for them).
    pub(crate) fn resident_bytes(&self) -> u64 {
        match &self.provider {
            Provider::Cpu(p) => p.mechanism().backing().resident_bytes().unwrap_or(0),
            Provider::Cuda(p) => p.mechanism().backing().mapped_bytes(),
        }
    }
}

impl KvStoreState {
    /// Sends `msg` to the store once `fence` of its stream has completed (at once if it has).
    /// A store gone by then drops the message.
    pub(super) fn send_after(&self, myself: &ActorRef<KvStoreMsg>, fence: Fence, msg: KvStoreMsg) {
        let me = myself.clone();
        self.stream.timeline().on_complete(
            fence.value,
            Box::new(move |_| {
                let _ = me.cast(msg);
            }),
        );
    }
}
