//! One memfd per host mechanism, carved into regions: a reservation's own blocks and shared
//! blocks. Physical truth comes from the file itself, never from a counter kept here.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Mutex;

use rustix::fs::{
    fallocate, fstat, ftruncate, memfd_create, seek, FallocateFlags, MemfdFlags, SeekFrom,
};
use rustix::io::Errno;

use crate::api::MemoryError;

/// The most file space the pool's regions may span.
const POOL_FILE_BYTES: u64 = 1 << 60;
/// The file grows in steps of this much (sparse: size costs nothing until pages are
/// allocated), never past the process's file-size limit.
const GROWTH_STEP: u64 = 1 << 30;

/// Which parts of the file are carved into regions. The file is grown (sparsely) before a
/// region past its end is handed out, so mapping never faults with SIGBUS; regions given back
/// are carved again, so the file spans at most what is live at its busiest.
#[derive(Debug, Default)]
struct Regions {
    /// The file's size.
    size: u64,
    /// Where the carved part ends.
    top: u64,
    /// Free regions below `top`, by offset (adjacent ones merged).
    free: BTreeMap<u64, u64>,
}

impl Regions {
    fn take_free(&mut self, len: u64) -> Option<u64> {
        let (&start, &free) = self.free.iter().find(|(_, &l)| l >= len)?;
        self.free.remove(&start);
        if free > len {
            self.free.insert(start + len, free - len);
        }
        Some(start)
    }

    fn give_back(&mut self, mut start: u64, mut len: u64) {
        if let Some((&before, &l)) = self.free.range(..start).next_back() {
            if before + l == start {
                self.free.remove(&before);
                start = before;
                len += l;
            }
        }
        if let Some(l) = self.free.remove(&(start + len)) {
            len += l;
        }
        if start + len == self.top {
            self.top = start;
        } else {
            self.free.insert(start, len);
        }
    }
}

#[derive(Debug)]
pub(crate) struct MemfdPool {
    fd: OwnedFd,
    regions: Mutex<Regions>,
    drop_errors: Mutex<Vec<MemoryError>>,
}

/// The process's file-size limit in bytes (`RLIMIT_FSIZE`), `u64::MAX` where there is none.
/// Growing a file past it raises SIGXFSZ, whose default action kills the process before the
/// error could be returned: the pool checks first.
fn file_size_limit() -> u64 {
    rustix::process::getrlimit(rustix::process::Resource::Fsize)
        .current
        .unwrap_or(u64::MAX)
}

impl MemfdPool {
    pub(crate) fn new(name: &str) -> Result<Self, MemoryError> {
        let fd = memfd_create(name, MemfdFlags::CLOEXEC)
            .map_err(|e| MemoryError::os("memfd_create", e))?;
        Ok(MemfdPool {
            fd,
            regions: Mutex::new(Regions::default()),
            drop_errors: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Carves a file region of `len` bytes (space in the file, nothing allocated), growing
    /// the file where the region lies past its end. A region given back with [`Self::release`]
    /// is carved again.
    pub(crate) fn carve(&self, len: u64) -> Result<u64, MemoryError> {
        let mut regions = self.regions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(start) = regions.take_free(len) {
            return Ok(start);
        }
        let start = regions.top;
        let end = start
            .checked_add(len)
            .filter(|end| *end <= POOL_FILE_BYTES)
            .ok_or(MemoryError::SizeOverflow {
                what: "memfd pool regions",
            })?;
        if end > regions.size {
            let limit = file_size_limit();
            if end > limit {
                return Err(MemoryError::FileSizeLimit { needed: end, limit });
            }
            let size = end
                .next_multiple_of(GROWTH_STEP)
                .min(limit)
                .min(POOL_FILE_BYTES);
            ftruncate(&self.fd, size).map_err(|e| MemoryError::os("ftruncate(memfd)", e))?;
            regions.size = size;
        }
        regions.top = end;
        Ok(start)
    }

    /// Gives a region back once nothing maps it and its pages are punched out.
    pub(crate) fn release(&self, start: u64, len: u64) {
        self.regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .give_back(start, len);
    }

    /// The file's size in bytes.
    #[cfg(test)]
    pub(crate) fn file_size(&self) -> u64 {
        self.regions.lock().unwrap_or_else(|p| p.into_inner()).size
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

    /// A region nothing maps any more, from a destructor: its pages go back to the OS and the
    /// region is carved again. A region whose punch failed is not (its pages may still be
    /// there, and a new owner would find them); the error is kept for
    /// [`Self::take_drop_errors`].
    pub(crate) fn retire_on_drop(&self, offset: u64, len: u64) {
        match self.punch(offset, len) {
            Ok(()) => self.release(offset, len),
            Err(e) => self.record_drop_error(e),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_given_back_are_carved_again_and_merge_with_their_neighbours() {
        let mut r = Regions {
            top: 300,
            ..Regions::default()
        };
        r.give_back(100, 100);
        assert_eq!(r.take_free(150), None, "one free region of 100");
        r.give_back(0, 100);
        assert_eq!(r.free.len(), 1, "0..100 and 100..200 merge");
        assert_eq!(r.take_free(150), Some(0));
        assert_eq!(r.free.get(&150), Some(&50));
        r.give_back(200, 100);
        assert_eq!(
            r.top, 150,
            "what is free at the top lowers it, merged with 150..200"
        );
        assert!(r.free.is_empty());
    }

    #[test]
    fn the_file_grows_with_what_is_carved_and_not_with_what_was_given_back() {
        let pool = MemfdPool::new("procmem-pool-test").unwrap();
        assert_eq!(pool.file_size(), 0);
        let a = pool.carve(4 << 20).unwrap();
        assert_eq!(pool.file_size(), GROWTH_STEP.min(file_size_limit()));
        for _ in 0..1000 {
            let b = pool.carve(8 << 20).unwrap();
            pool.release(b, 8 << 20);
        }
        assert_eq!(pool.carve(8 << 20).unwrap(), a + (4 << 20));
        assert_eq!(pool.file_size(), GROWTH_STEP.min(file_size_limit()));
        assert!(matches!(
            pool.carve(POOL_FILE_BYTES),
            Err(MemoryError::SizeOverflow { .. } | MemoryError::FileSizeLimit { .. })
        ));
    }
}
