//! Where a sequence's KV goes when pressure swaps it out, and the copy that comes back.
//!
//! Swapping must free memory in the authority under pressure and put the copy somewhere that
//! is budgeted too. When the KV lives on a device, that is the host tier: the copy is host
//! memory charged to the host tier's Governor (and a host tier without room makes the
//! sequence be recomputed instead). When the KV already lives in host memory (the device is
//! the host: aliased tiers, one authority), a copy in host memory would take exactly what the
//! eviction gave back, so the store writes it to an unlinked file on disk instead. Disk over
//! recompute: a write and a read of each byte (through the page cache, which the kernel can
//! reclaim, unlike the anonymous memory KV is kept in) against replaying every token of the
//! sequence through the whole model; a server that prefers recomputing says
//! `PreemptMode::Recompute`.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use procmem::fence::Fence;

use procmem::host::{allocation_bytes, allocation_bytes_mut, unlinked_file, HostMechanism};
use procmem::kv::{KvError, KvPart, KvSequence, KvShape, RowLayout};
use procmem::ledger::{HolderId, Priority};
use procmem::{Allocation, AllocationRequest, Allocator, MemoryError, MemoryRole};

use crate::governor::{GovernorHandle, Lease, ReserveRequest};

/// Where swapped-out KV goes (see the module docs for the choice).
#[derive(Debug, Clone, Default)]
pub enum SwapSpace {
    /// Decided from where the KV lives: a disk file in the system's directory for temporary
    /// files on disk (`PROCMEM_SWAP_DIR`, else `/var/tmp`, else the temporary directory) when
    /// it lives in host memory, as it does for the host provider.
    #[default]
    Auto,
    /// Host memory charged to this Governor: the host tier, a different authority from the
    /// one the KV is charged to (refused at start otherwise).
    Host(GovernorHandle),
    /// Unlinked files in this directory.
    Disk(PathBuf),
}

/// Where a store's swapped KV went, as its stats say.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SwapKind {
    /// Host memory charged to the host tier.
    Host,
    /// Files on disk (the KV's own memory is host memory).
    #[default]
    Disk,
}

/// A store's swap space once started.
pub(super) enum Space {
    Host {
        governor: GovernorHandle,
        holder: HolderId,
        priority: Priority,
    },
    Disk(PathBuf),
}

impl Space {
    pub(super) fn kind(&self) -> SwapKind {
        match self {
            Space::Host { .. } => SwapKind::Host,
            Space::Disk(_) => SwapKind::Disk,
        }
    }
}

/// The directory `Auto` swaps to when KV lives in host memory.
pub(crate) fn default_disk_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("PROCMEM_SWAP_DIR") {
        return PathBuf::from(dir);
    }
    let var_tmp = Path::new("/var/tmp");
    if var_tmp.is_dir() {
        return var_tmp.to_path_buf();
    }
    std::env::temp_dir()
}

/// What the copies out did, counted by the copy kernels themselves when they finish: a swap
/// counts once its bytes are written, and a copy that failed is a fallback (its sequence is
/// recomputed).
#[derive(Debug, Default)]
pub(super) struct SwapOutcomes {
    pub(super) outs: AtomicU64,
    pub(super) out_bytes: AtomicU64,
    pub(super) failed: AtomicU64,
}

/// A swapped-out sequence's rows: each buffer's first `tokens` rows, one buffer after the
/// other (K and V rows may differ in bytes). The copy itself is a kernel on the store's stream
/// ([`Saved::copy`]); until its fence completes the rows are not there yet.
pub(super) struct Saved {
    layout: Layout,
    /// Shared with the copy kernel, which keeps it alive while it writes.
    place: Arc<Mutex<SwapPlace>>,
    copied: Arc<AtomicBool>,
    /// The copy kernel's fence.
    pub(super) fence: Option<Fence>,
}

enum SwapPlace {
    /// The copy, then what pays for it (fields drop in this order).
    Host {
        rows: Allocation,
        _lease: Lease,
    },
    Disk(File),
}

impl Saved {
    /// Makes room in `space` for `memory`'s first `tokens` rows of every buffer (a host-tier
    /// lease and allocation, or a file). `None` when the space has no room or failed (the
    /// caller then drops the KV: recompute). Nothing is copied yet.
    pub(super) async fn reserve(
        space: &Space,
        host: &HostMechanism,
        memory: &KvSequence,
        tokens: usize,
    ) -> Option<Saved> {
        let layout = Layout::of(memory.shape(), tokens)?;
        let total = layout.bytes();
        let place = match space {
            Space::Disk(dir) => SwapPlace::Disk(
                unlinked_file(dir)
                    .map_err(|e| tracing::warn!(%e, dir = %dir.display(), "no swap file"))
                    .ok()?,
            ),
            Space::Host {
                governor,
                holder,
                priority,
            } => {
                let request = AllocationRequest::new(total.max(1), MemoryRole::KvCache);
                let charge = host.host_allocator().footprint(&request).ok()?;
                let grant = governor
                    .reserve(ReserveRequest {
                        holder: *holder,
                        role: MemoryRole::KvCache,
                        bytes: charge,
                        priority: *priority,
                        // A swap happens inside a pressure answer: it takes room there is now.
                        deadline: None,
                    })
                    .await
                    .ok()?;
                let lease = grant.commit(charge).await.ok()?;
                let rows = host.host_allocator().allocate(&request).ok()?;
                SwapPlace::Host {
                    rows,
                    _lease: lease,
                }
            }
        };
        Some(Saved {
            layout,
            place: Arc::new(Mutex::new(place)),
            copied: Arc::new(AtomicBool::new(false)),
            fence: None,
        })
    }

    /// The copy out, to run as a kernel once `memory` is no longer used: every buffer's rows
    /// into the place reserved. It records whether it succeeded.
    pub(super) fn copy(
        &self,
        latency: ::metrics::Histogram,
        outcomes: Arc<SwapOutcomes>,
    ) -> impl FnOnce(&KvSequence) + Send + 'static {
        let (place, copied) = (Arc::clone(&self.place), Arc::clone(&self.copied));
        let layout = self.layout;
        move |memory: &KvSequence| {
            let start = std::time::Instant::now();
            let tokens = layout.tokens;
            let mut place = place.lock().unwrap_or_else(PoisonError::into_inner);
            // Rows are read with the buffer's own copy (a memcpy on the host, a
            // device-to-host copy on a GPU).
            let mut staging = Vec::new();
            let ok = (0..layout.buffers).all(|b| {
                let (at, len) = layout.span(b, 0);
                match &mut *place {
                    SwapPlace::Disk(file) => {
                        staging.resize(len as usize, 0);
                        memory
                            .read_buffer(b, tokens, &mut staging)
                            .map_err(|e| tracing::warn!(%e, "swap copy out failed"))
                            .is_ok()
                            && file
                                .write_all_at(&staging, at)
                                .map_err(|e| tracing::warn!(%e, "swap file write failed"))
                                .is_ok()
                    }
                    SwapPlace::Host { rows: copy, .. } => match allocation_bytes_mut(copy) {
                        Ok(out) => memory
                            .read_buffer(b, tokens, &mut out[at as usize..(at + len) as usize])
                            .map_err(|e| tracing::warn!(%e, "swap copy out failed"))
                            .is_ok(),
                        Err(_) => false,
                    },
                }
            });
            if ok {
                outcomes.outs.fetch_add(1, Ordering::Relaxed);
                outcomes
                    .out_bytes
                    .fetch_add(layout.bytes(), Ordering::Relaxed);
            } else {
                outcomes.failed.fetch_add(1, Ordering::Relaxed);
            }
            copied.store(ok, Ordering::Release);
            latency.record(start.elapsed().as_secs_f64());
        }
    }

    /// Whether the copy out has run and succeeded.
    pub(super) fn copied(&self) -> bool {
        self.copied.load(Ordering::Acquire)
    }

    /// Bytes of KV held.
    pub(super) fn bytes(&self) -> u64 {
        self.layout.bytes()
    }

    /// Copies every buffer's rows from row `from` on back into `memory` (mapped for them; the
    /// rows before `from` are shared blocks it maps again). Returns the bytes copied.
    pub(super) fn restore_into(
        &self,
        memory: &mut KvSequence,
        from: usize,
    ) -> Result<u64, KvError> {
        if !self.copied() {
            return Err(MemoryError::Unsupported {
                capability: "restoring swapped KV",
                reason: "the copy out did not complete",
            }
            .into());
        }
        let layout = self.layout;
        if from > layout.tokens || memory.shape().buffers() != layout.buffers {
            return Err(KvError::NotMapped(from));
        }
        let place = self.place.lock().unwrap_or_else(PoisonError::into_inner);
        let mut rows = Vec::new();
        let mut copied = 0;
        for b in 0..layout.buffers {
            let (at, len) = layout.span(b, from);
            rows.resize(len as usize, 0);
            copied += len;
            match &*place {
                SwapPlace::Disk(file) => {
                    file.read_exact_at(&mut rows, at)
                        .map_err(|source| MemoryError::Os {
                            op: "reading a swap file",
                            source,
                        })?
                }
                SwapPlace::Host { rows: copy, .. } => {
                    let all = allocation_bytes(copy)?;
                    let len = rows.len();
                    rows.copy_from_slice(&all[at as usize..at as usize + len]);
                }
            }
            memory.write_buffer_rows(b, from, &rows)?;
        }
        Ok(copied)
    }
}

/// Where each buffer's rows lie in a swap copy: buffer after buffer, each `tokens` rows laid
/// out as its part's buffer keeps them ([`RowLayout`]), so a copy is one read per buffer.
#[derive(Debug, Clone, Copy)]
struct Layout {
    tokens: usize,
    buffers: usize,
    /// How rows of K and of V lie.
    rows: [RowLayout; 2],
}

impl Layout {
    /// `None` where the sizes overflow.
    fn of(shape: &KvShape, tokens: usize) -> Option<Layout> {
        let layout = Layout {
            tokens,
            buffers: shape.buffers(),
            rows: KvPart::BOTH.map(|p| shape.rows(p)),
        };
        let [k, v] = layout.rows.map(|r| r.checked_offset(tokens as u64));
        k?.checked_add(v?)?.checked_mul(shape.layers as u64)?;
        Some(layout)
    }

    /// Bytes of one buffer of part `p`'s rows.
    fn part_bytes(&self, p: usize) -> u64 {
        self.rows[p].offset(self.tokens as u64)
    }

    /// Bytes of every buffer's rows.
    fn bytes(&self) -> u64 {
        (self.part_bytes(0) + self.part_bytes(1)) * (self.buffers / 2) as u64
    }

    /// Where buffer `b`'s rows from row `from` on start, and their bytes.
    fn span(&self, b: usize, from: usize) -> (u64, u64) {
        let start = (b / 2) as u64 * (self.part_bytes(0) + self.part_bytes(1))
            + (b % 2) as u64 * self.part_bytes(0);
        let skip = self.rows[b % 2].offset(from as u64);
        (start + skip, self.part_bytes(b % 2) - skip)
    }
}
