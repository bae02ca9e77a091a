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

use procmem::host::{allocation_bytes, allocation_bytes_mut, unlinked_file, HostMechanism};
use procmem::kv::KvSequence;
use procmem::ledger::{HolderId, Priority};
use procmem::{AllocationRequest, DeviceAllocation, DeviceAllocator, MemoryError, MemoryRole};

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
pub(super) fn default_disk_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("PROCMEM_SWAP_DIR") {
        return PathBuf::from(dir);
    }
    let var_tmp = Path::new("/var/tmp");
    if var_tmp.is_dir() {
        return var_tmp.to_path_buf();
    }
    std::env::temp_dir()
}

/// A swapped-out sequence's rows: each buffer's first `tokens` rows, one buffer after the
/// other, `per_buffer` bytes each.
pub(super) struct Saved {
    per_buffer: u64,
    buffers: usize,
    place: Place,
}

enum Place {
    /// The copy, then what pays for it (fields drop in this order).
    Host {
        rows: DeviceAllocation,
        _lease: Lease,
    },
    Disk(File),
}

fn io(op: &'static str, source: std::io::Error) -> MemoryError {
    MemoryError::Os { op, source }
}

impl Saved {
    /// Copies `memory`'s first `tokens` rows of every buffer out to `space`. `None` when the
    /// space has no room or the copy failed (the caller then drops the KV: recompute).
    pub(super) async fn save(
        space: &Space,
        host: &HostMechanism,
        memory: &KvSequence,
        tokens: usize,
    ) -> Option<Saved> {
        let buffers = memory.shape().buffers();
        let per_buffer = tokens as u64 * memory.shape().token_bytes();
        let total = per_buffer.checked_mul(buffers as u64)?;
        let place = match space {
            Space::Disk(dir) => {
                let file = unlinked_file(dir)
                    .map_err(|e| tracing::warn!(%e, dir = %dir.display(), "no swap file"))
                    .ok()?;
                for b in 0..buffers {
                    let rows = memory.buffer_bytes(b, tokens).ok()?;
                    if let Err(e) = file.write_all_at(rows, b as u64 * per_buffer) {
                        tracing::warn!(%e, "swap file write failed");
                        return None;
                    }
                }
                Place::Disk(file)
            }
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
                let mut rows = host.host_allocator().allocate(&request).ok()?;
                let out = allocation_bytes_mut(&mut rows).ok()?;
                for b in 0..buffers {
                    let from = memory.buffer_bytes(b, tokens).ok()?;
                    let at = b * per_buffer as usize;
                    out[at..at + from.len()].copy_from_slice(from);
                }
                Place::Host {
                    rows,
                    _lease: lease,
                }
            }
        };
        Some(Saved {
            per_buffer,
            buffers,
            place,
        })
    }

    /// Bytes of KV held.
    pub(super) fn bytes(&self) -> u64 {
        self.per_buffer * self.buffers as u64
    }

    /// Copies every buffer's rows back into `memory` (mapped for them).
    pub(super) fn restore_into(&self, memory: &mut KvSequence) -> Result<(), MemoryError> {
        let mut rows = vec![0u8; self.per_buffer as usize];
        for b in 0..self.buffers {
            let at = b as u64 * self.per_buffer;
            match &self.place {
                Place::Disk(file) => file
                    .read_exact_at(&mut rows, at)
                    .map_err(|e| io("reading a swap file", e))?,
                Place::Host { rows: copy, .. } => {
                    let all = allocation_bytes(copy)?;
                    rows.copy_from_slice(&all[at as usize..(at + self.per_buffer) as usize]);
                }
            }
            memory.write_buffer_bytes(b, &rows).map_err(|e| match e {
                procmem::kv::KvError::Memory(m) => m,
                other => MemoryError::Unsupported {
                    capability: "restoring swapped KV",
                    reason: if matches!(other, procmem::kv::KvError::NotMapped(_)) {
                        "the rows are not mapped"
                    } else {
                        "the rows do not fit the sequence"
                    },
                },
            })?;
        }
        Ok(())
    }
}
