//! One memfd per host mechanism, carved into regions: a reservation's own blocks and shared
//! blocks. Physical truth comes from the file itself, never from a counter kept here.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Mutex;

use rustix::fs::{
    fallocate, fstat, ftruncate, memfd_create, seek, FallocateFlags, MemfdFlags, SeekFrom,
};
use rustix::io::Errno;

use crate::api::MemoryError;

/// The file is sized once, sparsely, so every region ever carved lies inside it and mapping
/// never faults with SIGBUS; size costs nothing until pages are allocated.
const POOL_FILE_BYTES: u64 = 1 << 60;

#[derive(Debug)]
pub(crate) struct MemfdPool {
    fd: OwnedFd,
    next_region: Mutex<u64>,
    drop_errors: Mutex<Vec<MemoryError>>,
}

impl MemfdPool {
    pub(crate) fn new(name: &str) -> Result<Self, MemoryError> {
        let fd = memfd_create(name, MemfdFlags::CLOEXEC)
            .map_err(|e| MemoryError::os("memfd_create", e))?;
        ftruncate(&fd, POOL_FILE_BYTES).map_err(|e| MemoryError::os("ftruncate(memfd)", e))?;
        Ok(MemfdPool {
            fd,
            next_region: Mutex::new(0),
            drop_errors: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Carves a fresh file region of `len` bytes (address space in the file, nothing allocated).
    pub(crate) fn carve(&self, len: u64) -> Result<u64, MemoryError> {
        let mut next = self.next_region.lock().unwrap_or_else(|p| p.into_inner());
        let start = *next;
        let end = start
            .checked_add(len)
            .filter(|end| *end <= POOL_FILE_BYTES)
            .ok_or(MemoryError::SizeOverflow {
                what: "memfd pool regions",
            })?;
        *next = end;
        Ok(start)
    }

    /// Allocates physical pages for `offset..offset + len`; on failure none of them stay.
    pub(crate) fn allocate(&self, offset: u64, len: u64) -> Result<(), MemoryError> {
        match fallocate(&self.fd, FallocateFlags::empty(), offset, len) {
            Ok(()) => Ok(()),
            Err(e) => {
                let _ = self.punch(offset, len);
                Err(match e {
                    Errno::NOSPC | Errno::NOMEM => MemoryError::OutOfMemory {
                        op: "committing",
                        bytes: len,
                    },
                    e => MemoryError::os("fallocate(memfd)", e),
                })
            }
        }
    }

    /// Returns the physical pages of `offset..offset + len` to the OS.
    pub(crate) fn punch(&self, offset: u64, len: u64) -> Result<(), MemoryError> {
        fallocate(
            &self.fd,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            offset,
            len,
        )
        .map_err(|e| MemoryError::os("fallocate(PUNCH_HOLE)", e))
    }

    /// Punches from a destructor: errors are kept for [`Self::take_drop_errors`].
    pub(crate) fn punch_on_drop(&self, offset: u64, len: u64) {
        if let Err(e) = self.punch(offset, len) {
            self.record_drop_error(e);
        }
    }

    pub(crate) fn record_drop_error(&self, e: MemoryError) {
        self.drop_errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(e);
    }

    pub(crate) fn take_drop_errors(&self) -> Vec<MemoryError> {
        std::mem::take(&mut *self.drop_errors.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Physical bytes present in `offset..offset + len`, walking the file's data extents
    /// (`SEEK_DATA`/`SEEK_HOLE`) as the kernel reports them.
    pub(crate) fn resident_in(&self, offset: u64, len: u64) -> Result<u64, MemoryError> {
        let end = offset + len;
        let mut pos = offset;
        let mut total = 0;
        while pos < end {
            let data = match seek(&self.fd, SeekFrom::Data(pos)) {
                Ok(d) => d,
                Err(Errno::NXIO) => break,
                Err(e) => return Err(MemoryError::os("lseek(SEEK_DATA)", e)),
            };
            if data >= end {
                break;
            }
            let hole = seek(&self.fd, SeekFrom::Hole(data))
                .map_err(|e| MemoryError::os("lseek(SEEK_HOLE)", e))?;
            total += hole.min(end) - data;
            pos = hole;
        }
        Ok(total)
    }

    /// Physical bytes of the whole pool: the file's allocated blocks (`st_blocks` × 512).
    pub(crate) fn resident_total(&self) -> Result<u64, MemoryError> {
        let st = fstat(&self.fd).map_err(|e| MemoryError::os("fstat(memfd)", e))?;
        Ok(st.st_blocks as u64 * 512)
    }
}
