//! Host backing: physical blocks from one memfd, mapped into reserved ranges with
//! `MAP_SHARED | MAP_FIXED`, returned to the OS by punching holes.

use std::ops::Range;
use std::sync::Arc;

use super::host_access::{range_bytes, range_bytes_mut};
use super::pool::MemfdPool;
use super::range::VirtualRange;
use super::{granularity, smaps, sys};
use crate::api::capabilities::copy_span;
use crate::api::{
    CommitResult, DecommitResult, GranuleMap, GranuleState, MapAccess, MechanismId, MemoryError,
    PhysicalBlock, Place, SharedMapping, SharedView, VirtualAllocation, VirtualBacking,
    VirtualRequest,
};

/// The memfd region behind one reservation: file offset = region start + virtual offset.
struct HostReservation {
    range: VirtualRange,
    file_base: u64,
    pool: Arc<MemfdPool>,
}

impl Drop for HostReservation {
    fn drop(&mut self) {
        // The range is unmapped right after this (a field), and nothing reaches it any more:
        // the region may be carved again at once.
        self.pool.retire_on_drop(self.file_base, self.range.len());
    }
}

/// A shared block's region of the memfd; its pages go back to the OS with the last reference.
struct HostBlock {
    file_offset: u64,
    len: u64,
    pool: Arc<MemfdPool>,
}

impl Drop for HostBlock {
    fn drop(&mut self) {
        self.pool.retire_on_drop(self.file_offset, self.len);
    }
}

/// The host's [`VirtualBacking`] and [`SharedMapping`] (Linux).
///
/// Physical accounting is read from the kernel: the memfd's data extents
/// (`SEEK_DATA`/`SEEK_HOLE`) per region, its `st_blocks` in total, and `/proc/self/smaps` for
/// pages copied on write, which are anonymous memory outside the memfd.
#[derive(Debug)]
pub struct HostBacking {
    id: MechanismId,
    granularity: u64,
    pool: Arc<MemfdPool>,
}

impl HostBacking {
    /// A backing with its own memfd, belonging to mechanism `id`.
    pub fn new(id: MechanismId) -> Result<Self, MemoryError> {
        Ok(HostBacking {
            id,
            granularity: granularity(),
            pool: Arc::new(MemfdPool::new("procmem-host")?),
        })
    }

    /// Physical bytes held by this backing in all (reservations and shared blocks), as the
    /// kernel counts the memfd's allocated blocks.
    pub fn resident_bytes(&self) -> Result<u64, MemoryError> {
        self.pool.resident_total()
    }

    /// Errors that happened while handles were dropped (they cannot be returned from `Drop`).
    pub fn take_drop_errors(&self) -> Vec<MemoryError> {
        self.pool.take_drop_errors()
    }

    fn reservation<'a>(
        &self,
        allocation: &'a VirtualAllocation,
    ) -> Result<&'a HostReservation, MemoryError> {
        allocation.check_owner(self.id)?;
        allocation
            .backend::<HostReservation>()
            .ok_or(MemoryError::Unsupported {
                capability: "host backing",
                reason: "the reservation was not made by a host backing",
            })
    }

    fn block<'a>(&self, block: &'a PhysicalBlock) -> Result<&'a HostBlock, MemoryError> {
        if block.mechanism() != self.id {
            return Err(MemoryError::ForeignHandle {
                owner: block.mechanism(),
                this: self.id,
            });
        }
        block.inner::<HostBlock>().ok_or(MemoryError::Unsupported {
            capability: "host shared mapping",
            reason: "the block was not made by a host backing",
        })
    }
}

impl VirtualBacking for HostBacking {
    fn mechanism(&self) -> MechanismId {
        self.id
    }

    fn place(&self) -> Place {
        Place::HOST
    }

    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn reserve(&self, request: &VirtualRequest) -> Result<VirtualAllocation, MemoryError> {
        GranuleMap::validate_len(request.bytes, self.granularity)?;
        let range = VirtualRange::reserve(request.bytes)?;
        let file_base = self.pool.carve(request.bytes)?;
        let addr = range.addr();
        let backend = HostReservation {
            range,
            file_base,
            pool: Arc::clone(&self.pool),
        };
        Ok(VirtualAllocation::new(
            addr,
            GranuleMap::new(request.bytes, self.granularity),
            request.role,
            Place::HOST,
            self.id,
            Box::new(backend),
        ))
    }

    fn commit_range(
        &self,
        allocation: &mut VirtualAllocation,
        range: Range<u64>,
    ) -> Result<CommitResult, MemoryError> {
        let reservation = self.reservation(allocation)?;
        let (addr, file_base) = (reservation.range.addr(), reservation.file_base);
        let granules = allocation.granules.validate_range(&range)?;
        allocation.granules.require_reserved(&granules)?;
        let len = range.end - range.start;
        let file_offset = file_base + range.start;
        let started = std::time::Instant::now();
        crate::fault::hit("host.commit.allocate")?;
        self.pool.allocate(file_offset, len)?;
        if let Err(e) = crate::fault::hit("host.commit.map") {
            self.pool.punch(file_offset, len)?;
            return Err(e);
        }
        // SAFETY: `range` was validated to lie inside this reservation, which the caller holds
        // by `&mut`, and every granule in it is only reserved, so no reference points there.
        let mapped = unsafe {
            sys::map_fd_fixed(
                addr + range.start,
                len,
                self.pool.fd(),
                file_offset,
                MapAccess::ReadWrite,
            )
        };
        if let Err(e) = mapped {
            // A failed MAP_FIXED may have removed the reservation there: put it back.
            // SAFETY: same range as above, still owned and unreferenced.
            let _ = unsafe { sys::reset_to_reserved(addr + range.start, len) };
            let _ = self.pool.punch(file_offset, len);
            return Err(e);
        }
        allocation.granules.set(granules, GranuleState::Committed);
        crate::metrics::BACKING_MAP_CALLS_TOTAL
            .counter(&["host"])
            .increment(1);
        crate::metrics::BACKING_MAP_SECONDS
            .histogram(&["host"])
            .record(started.elapsed().as_secs_f64());
        Ok(CommitResult {
            committed_bytes: len,
        })
    }

    fn decommit_range(
        &self,
        allocation: &mut VirtualAllocation,
        range: Range<u64>,
    ) -> Result<DecommitResult, MemoryError> {
        let reservation = self.reservation(allocation)?;
        let (addr, file_base) = (reservation.range.addr(), reservation.file_base);
        let granules = allocation.granules.validate_range(&range)?;
        allocation.granules.require_backed(&granules)?;
        let blocks_inside = allocation.shared_blocks_within(&range)?;
        let len = range.end - range.start;
        let started = std::time::Instant::now();
        crate::fault::hit("host.decommit")?;
        // SAFETY: `range` lies inside this reservation, held by `&mut`, so no reference into
        // it is live; the reservation goes back over it so the addresses stay ours.
        unsafe { sys::reset_to_reserved(addr + range.start, len)? };
        let mut freed = 0;
        let mut first_error = None;
        for run in allocation
            .granules
            .runs(granules.clone(), GranuleState::Committed)
        {
            match self.pool.punch(file_base + run.start, run.end - run.start) {
                Ok(()) => freed += run.end - run.start,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        for offset in blocks_inside {
            allocation.shared.remove(&offset);
        }
        allocation.granules.set(granules, GranuleState::Reserved);
        crate::metrics::BACKING_UNMAP_CALLS_TOTAL
            .counter(&["host"])
            .increment(1);
        crate::metrics::BACKING_UNMAP_SECONDS
            .histogram(&["host"])
            .record(started.elapsed().as_secs_f64());
        match first_error {
            Some(e) => Err(e),
            None => Ok(DecommitResult {
                unmapped_bytes: len,
                freed_bytes: freed,
            }),
        }
    }

    fn committed_bytes(&self, allocation: &VirtualAllocation) -> Result<u64, MemoryError> {
        let reservation = self.reservation(allocation)?;
        self.pool
            .resident_in(reservation.file_base, reservation.range.len())
    }

    fn read_range(
        &self,
        allocation: &VirtualAllocation,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), MemoryError> {
        self.reservation(allocation)?;
        dst.copy_from_slice(range_bytes(allocation, copy_span(offset, dst.len())?)?);
        Ok(())
    }

    fn write_range(
        &self,
        allocation: &mut VirtualAllocation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), MemoryError> {
        self.reservation(allocation)?;
        range_bytes_mut(allocation, copy_span(offset, src.len())?)?.copy_from_slice(src);
        Ok(())
    }
}

impl SharedMapping for HostBacking {
    fn mechanism(&self) -> MechanismId {
        self.id
    }

    fn create_block(&self, bytes: u64) -> Result<PhysicalBlock, MemoryError> {
        GranuleMap::validate_len(bytes, self.granularity)?;
        let file_offset = self.pool.carve(bytes)?;
        self.pool.allocate(file_offset, bytes)?;
        let inner = HostBlock {
            file_offset,
            len: bytes,
            pool: Arc::clone(&self.pool),
        };
        Ok(PhysicalBlock::new(bytes, self.id, Arc::new(inner)))
    }

    fn map_block(
        &self,
        allocation: &mut VirtualAllocation,
        offset: u64,
        block: &PhysicalBlock,
        access: MapAccess,
    ) -> Result<(), MemoryError> {
        let addr = self.reservation(allocation)?.range.addr();
        let file_offset = self.block(block)?.file_offset;
        let end = offset
            .checked_add(block.bytes())
            .ok_or(MemoryError::SizeOverflow {
                what: "block offset + length",
            })?;
        let granules = allocation.granules.validate_range(&(offset..end))?;
        allocation.granules.require_reserved(&granules)?;
        // SAFETY: the range was validated inside this reservation (held by `&mut`) and is only
        // reserved, so nothing references it.
        let mapped = unsafe {
            sys::map_fd_fixed(
                addr + offset,
                block.bytes(),
                self.pool.fd(),
                file_offset,
                access,
            )
        };
        if let Err(e) = mapped {
            // SAFETY: same range, still owned and unreferenced.
            let _ = unsafe { sys::reset_to_reserved(addr + offset, block.bytes()) };
            return Err(e);
        }
        allocation.granules.set(granules, GranuleState::Shared);
        allocation.shared.insert(
            offset,
            SharedView {
                block: block.clone(),
                access,
            },
        );
        Ok(())
    }

    fn block_resident_bytes(&self, block: &PhysicalBlock) -> Result<u64, MemoryError> {
        let inner = self.block(block)?;
        self.pool.resident_in(inner.file_offset, inner.len)
    }

    fn private_copy_bytes(&self, allocation: &VirtualAllocation) -> Result<u64, MemoryError> {
        let reservation = self.reservation(allocation)?;
        let start = reservation.range.addr();
        smaps::sum_field(start..start + reservation.range.len(), "Anonymous")
    }

    fn read_block(&self, block: &PhysicalBlock, dst: &mut [u8]) -> Result<(), MemoryError> {
        let inner = self.block(block)?;
        exact_len(inner.len, dst.len())?;
        let mut done = 0;
        while done < dst.len() {
            let n = rustix::io::pread(
                self.pool.fd(),
                &mut dst[done..],
                inner.file_offset + done as u64,
            )
            .map_err(|e| MemoryError::os("pread", e))?;
            if n == 0 {
                return Err(MemoryError::os(
                    "pread",
                    std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
                ));
            }
            done += n;
        }
        Ok(())
    }

    fn write_block(&self, block: &PhysicalBlock, src: &[u8]) -> Result<(), MemoryError> {
        let inner = self.block(block)?;
        exact_len(inner.len, src.len())?;
        let mut done = 0;
        while done < src.len() {
            let n = rustix::io::pwrite(
                self.pool.fd(),
                &src[done..],
                inner.file_offset + done as u64,
            )
            .map_err(|e| MemoryError::os("pwrite", e))?;
            done += n;
        }
        Ok(())
    }
}

/// A block copy moves exactly the block's bytes.
fn exact_len(block: u64, buffer: usize) -> Result<(), MemoryError> {
    if block == buffer as u64 {
        Ok(())
    } else {
        Err(MemoryError::OutOfReservation {
            range: 0..buffer as u64,
            reserved: block,
        })
    }
}
