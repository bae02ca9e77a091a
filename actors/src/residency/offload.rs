//! Offloading cold layers and bringing them back. A layer goes to the host tier (charged to
//! its Governor) where residency has one, and otherwise to an unlinked file on disk: on the
//! host backend the device is host memory, and only the disk is a lower tier there. The copy
//! out is a kernel on the stream (on a GPU, a device-to-host copy once the layer's kernels are
//! done); the device buffer is dropped right after it is queued, so its memory is freed and
//! refunded once the copy's fence completes. A reload waits for that fence first.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use procmem::fence::Fence;
use procmem::MemoryRole;
use tokio::time::Instant;

use super::{idle, Layer, ResidencyError, ResidencyState, Slot};
use crate::buffer::Buffer;
use crate::governor::{Lease, ReserveRequest};
use crate::provider_choice::Provider;
use crate::stream::completed_within;
use crate::ticket::PressureTicket;

/// How long a reload waits at least for its layer's copy kernel.
const COPY_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Where an offloaded layer's copy goes.
enum Place {
    /// Host-tier memory; its lease (if one was charged) goes with the copy.
    Host {
        copy: Mutex<Vec<u8>>,
        _lease: Option<Lease>,
    },
    /// An unlinked file, its blocks allocated before the copy is queued.
    Disk(File),
}

/// An offloaded layer: its copy, whether the copy succeeded, and the copy kernel's fence.
pub(super) struct Offloaded {
    place: Arc<Place>,
    len: usize,
    copied: Arc<AtomicBool>,
    fence: Option<Fence>,
    /// The device copy, until the copy kernel has written the lower tier's: the kernel drops
    /// it (freed after its fence) once its copy succeeded, and one that failed leaves it here,
    /// so a failed copy loses nothing.
    kept: Arc<Mutex<Option<Buffer>>>,
}

/// What a reload finds.
pub(super) enum Back {
    /// The copy's bytes.
    Bytes(Vec<u8>),
    /// The device copy, kept because the copy out failed: the layer never left.
    Kept(Buffer),
}

impl Offloaded {
    /// Bytes of the copy.
    pub(super) fn bytes(&self) -> u64 {
        self.len as u64
    }

    /// Gives the device copy to the copy kernel (see `kept`). Where the copy is already
    /// written (it ran first, or on a GPU it was made before) the buffer drops here, freed
    /// after the stream's work on it.
    fn hand_over(&self, buffer: Buffer) {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        if self.fence.is_some() && !self.copied.load(Ordering::Acquire) {
            *kept = Some(buffer);
        }
    }

    /// Whether the copy is on disk.
    pub(super) fn on_disk(&self) -> bool {
        matches!(*self.place, Place::Disk(_))
    }

    /// Writes `bytes` (the layer's) into the place; false on failure.
    fn fill(place: &Place, bytes: &[u8]) -> bool {
        if procmem::fault::hit("residency.offload.copy").is_err() {
            return false;
        }
        match place {
            Place::Host { copy, .. } => {
                let mut copy = copy.lock().unwrap_or_else(PoisonError::into_inner);
                copy.clear();
                copy.extend_from_slice(bytes);
                true
            }
            Place::Disk(file) => file
                .write_all_at(bytes, 0)
                .map_err(|e| tracing::warn!(%e, "weights offload write failed"))
                .is_ok(),
        }
    }
}

impl ResidencyState {
    /// Offloads cold, unpinned layers other than `keep` (least recently used first) until
    /// `wanted` bytes are covered. Returns the bytes that will be free once the copies'
    /// fences complete.
    pub(super) async fn offload(&mut self, wanted: u64, keep: Option<usize>) -> u64 {
        let mut candidates: Vec<(u64, usize, u64)> = self
            .layers
            .iter()
            .enumerate()
            .filter(|(i, _)| Some(*i) != keep)
            .filter_map(|(i, l)| match l {
                Some(Layer {
                    slot: Slot::Device(b),
                    pinned: false,
                    last_used,
                }) => Some((*last_used, i, b.charged_bytes())),
                _ => None,
            })
            .collect();
        candidates.sort();
        let mut pending = 0;
        for (_, layer, bytes) in candidates {
            if pending >= wanted {
                break;
            }
            let started = Instant::now();
            let Some(place) = self.place_for(bytes).await else {
                continue;
            };
            let entry = self.layers[layer].as_mut().expect("candidate exists");
            let Slot::Device(buffer) = &entry.slot else {
                continue;
            };
            let len = buffer.len() as usize;
            let Some(away) = copy_out(&self.provider, buffer, place, len, self.config.wait).await
            else {
                continue;
            };
            // The device buffer goes to the copy kernel, which drops it (queued for free after
            // its fence) once the copy is written.
            if let Slot::Device(buffer) = std::mem::replace(&mut entry.slot, Slot::Away(away)) {
                if let Slot::Away(away) = &entry.slot {
                    away.hand_over(buffer);
                }
            }
            pending += bytes;
            self.stats.offloads += 1;
            self.stats.offload_bytes_total += len as u64;
            self.metrics.offload.record(started.elapsed().as_secs_f64());
        }
        pending
    }

    /// Room for a copy of `bytes`: in the host tier (a grant of room there is now), or a
    /// file with its blocks allocated.
    async fn place_for(&self, bytes: u64) -> Option<Place> {
        match (&self.host, self.host_holder) {
            (Some(host), Some(holder)) => {
                let request = ReserveRequest {
                    holder,
                    role: MemoryRole::Weights,
                    bytes,
                    priority: self.config.priority,
                    deadline: None,
                };
                // No room in the host tier: this layer stays where it is.
                let grant = host.reserve(request).await.ok()?;
                let lease = grant.commit(bytes).await.ok()?;
                Some(Place::Host {
                    copy: Mutex::new(Vec::new()),
                    _lease: Some(lease),
                })
            }
            _ => {
                let file = procmem::host::unlinked_file(&self.disk_dir)
                    .map_err(|e| tracing::warn!(%e, "no file to offload weights to"))
                    .ok()?;
                // Blocks allocated now, so the copy cannot run out of space.
                rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, bytes)
                    .map_err(|e| tracing::warn!(%e, "no room on disk to offload weights"))
                    .ok()?;
                Some(Place::Disk(file))
            }
        }
    }

    /// Answers a pressure ticket by offloading.
    pub(super) async fn answer(&mut self, ticket: PressureTicket) {
        tracing::debug!(
            ticket = ticket.id.get(),
            wanted = ticket.bytes_wanted,
            "residency answering a pressure ticket"
        );
        let pending = self.offload(ticket.bytes_wanted, None).await;
        ticket.report(0, pending);
    }

    /// What an offloaded layer comes back from, once its copy kernel is done: the copy's
    /// bytes, or the device copy itself where the copy out failed.
    pub(super) async fn copy_back(
        &self,
        layer: usize,
        away: &Offloaded,
    ) -> Result<Back, ResidencyError> {
        if let (Some(fence), Provider::Cpu(provider)) = (away.fence, &self.provider) {
            let stream = provider.stream(0)?;
            // A copy kernel always finishes on a running stream; the limit only keeps a
            // stopped one from holding the actor.
            let limit = self.config.wait.max(COPY_WAIT);
            if !completed_within(stream.timeline().as_ref(), fence.value, limit).await {
                return Err(ResidencyError::CopyNotDone(layer));
            }
        }
        if !away.copied.load(Ordering::Acquire) {
            let kept = away
                .kept
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            return kept.map(Back::Kept).ok_or(ResidencyError::CopyLost(layer));
        }
        match &*away.place {
            Place::Host { copy, .. } => Ok(Back::Bytes(
                copy.lock().unwrap_or_else(PoisonError::into_inner).clone(),
            )),
            Place::Disk(file) => {
                let mut bytes = vec![0u8; away.len];
                file.read_exact_at(&mut bytes, 0)
                    .map_err(|_| ResidencyError::CopyLost(layer))?;
                Ok(Back::Bytes(bytes))
            }
        }
    }
}

/// Copies `buffer` out to `place`: a kernel on the host stream, or (on a GPU) a
/// device-to-host copy once the layer's kernels are done. `None` if it could not be queued.
async fn copy_out(
    provider: &Provider,
    buffer: &Buffer,
    place: Place,
    len: usize,
    wait: std::time::Duration,
) -> Option<Offloaded> {
    let place = Arc::new(place);
    let copied = Arc::new(AtomicBool::new(false));
    let kept: Arc<Mutex<Option<Buffer>>> = Arc::new(Mutex::new(None));
    let fence = match provider {
        Provider::Cpu(host) => {
            let (sink, done, keep) = (Arc::clone(&place), Arc::clone(&copied), Arc::clone(&kept));
            let stream = host.stream(0).ok()?;
            let fence = stream
                .submit_reading(&[buffer], move |bytes| {
                    // The flag is set under `keep`'s lock: the buffer is handed over either
                    // before this runs (and dropped here) or after (and dropped there).
                    let mut kept = keep.lock().unwrap_or_else(PoisonError::into_inner);
                    let ok = Offloaded::fill(&sink, bytes[0]);
                    done.store(ok, Ordering::Release);
                    if ok {
                        // Freed after this kernel's fence, as every use of it is.
                        drop(kept.take());
                    }
                })
                .ok()?;
            Some(fence)
        }
        Provider::Cuda(cuda) => {
            // The server's kernels over it must be done before a device-to-host copy.
            let stream = cuda.stream(0).ok()?;
            if !idle(buffer, stream, wait).await {
                return None;
            }
            let mut bytes = vec![0u8; len];
            provider
                .allocator()
                .read(buffer.allocation_handle(), 0, &mut bytes)
                .ok()?;
            if !Offloaded::fill(&place, &bytes) {
                return None;
            }
            copied.store(true, Ordering::Release);
            None
        }
    };
    Some(Offloaded {
        place,
        len,
        copied,
        fence,
        kept,
    })
}
