//! The only place this crate calls `mmap`/`munmap`: thin wrappers, each with its preconditions.

use std::os::fd::BorrowedFd;
use std::ptr::{null_mut, NonNull};

use rustix::mm::{mmap, mmap_anonymous, munmap, MapFlags, ProtFlags};

use crate::api::{MapAccess, MemoryError};

fn as_ptr(addr: u64) -> *mut std::ffi::c_void {
    addr as usize as *mut std::ffi::c_void
}

/// Reserves `len` bytes of address space with no access and no physical backing.
pub(crate) fn reserve(len: usize) -> Result<NonNull<u8>, MemoryError> {
    // SAFETY: with a null hint and no MAP_FIXED the kernel picks an unused range, so no
    // existing mapping is replaced; PROT_NONE makes every access fault until something is mapped.
    let ptr = unsafe {
        mmap_anonymous(
            null_mut(),
            len,
            ProtFlags::empty(),
            MapFlags::PRIVATE | MapFlags::NORESERVE,
        )
    }
    .map_err(|e| MemoryError::os("mmap(PROT_NONE) reservation", e))?;
    NonNull::new(ptr.cast()).ok_or(MemoryError::Unsupported {
        capability: "reservation",
        reason: "the kernel returned a null mapping",
    })
}

/// Ordinary eager anonymous memory: every page is faulted in before this returns.
pub(crate) fn map_anonymous_populated(len: usize) -> Result<NonNull<u8>, MemoryError> {
    // SAFETY: no MAP_FIXED, so the kernel picks an unused range and nothing is replaced.
    let ptr = unsafe {
        mmap_anonymous(
            null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE | MapFlags::POPULATE,
        )
    }
    .map_err(|e| match e {
        rustix::io::Errno::NOMEM => MemoryError::OutOfMemory {
            op: "allocating",
            bytes: len as u64,
        },
        e => MemoryError::os("mmap(anonymous)", e),
    })?;
    NonNull::new(ptr.cast()).ok_or(MemoryError::Unsupported {
        capability: "allocation",
        reason: "the kernel returned a null mapping",
    })
}

/// Unmaps `addr..addr + len`.
///
/// # Safety
/// 1. The range was mapped by this crate and is owned by the caller.
/// 2. No reference into it outlives this call.
pub(crate) unsafe fn unmap(addr: u64, len: u64) -> Result<(), MemoryError> {
    // SAFETY: preconditions 1 and 2 of this function.
    unsafe { munmap(as_ptr(addr), len as usize) }.map_err(|e| MemoryError::os("munmap", e))
}

/// Maps `len` bytes of `fd` at `file_offset` over `addr..addr + len`, replacing what is there.
///
/// # Safety
/// 1. `addr..addr + len` lies inside a reservation owned by the caller.
/// 2. No reference into that range is live (its contents change).
pub(crate) unsafe fn map_fd_fixed(
    addr: u64,
    len: u64,
    fd: BorrowedFd<'_>,
    file_offset: u64,
    access: MapAccess,
) -> Result<(), MemoryError> {
    let (prot, flags) = match access {
        // Populating a shared mapping only builds page tables for pages already allocated.
        MapAccess::ReadWrite => (
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED | MapFlags::POPULATE,
        ),
        MapAccess::ReadOnly => (ProtFlags::READ, MapFlags::SHARED | MapFlags::POPULATE),
        // Never populate a private writable mapping: that would copy every page up front.
        MapAccess::CopyOnWrite => (ProtFlags::READ | ProtFlags::WRITE, MapFlags::PRIVATE),
    };
    // SAFETY: MAP_FIXED replaces only `addr..addr + len`, which precondition 1 says the caller
    // owns; precondition 2 says nobody holds a reference whose contents would change.
    let got = unsafe {
        mmap(
            as_ptr(addr),
            len as usize,
            prot,
            flags | MapFlags::FIXED,
            fd,
            file_offset,
        )
    }
    .map_err(|e| MemoryError::os("mmap(MAP_FIXED) of a memfd block", e))?;
    debug_assert_eq!(got as u64, addr);
    Ok(())
}

/// Puts the reservation back over `addr..addr + len`: no access, no backing, address kept.
///
/// # Safety
/// 1. `addr..addr + len` lies inside a reservation owned by the caller.
/// 2. No reference into that range is live.
pub(crate) unsafe fn reset_to_reserved(addr: u64, len: u64) -> Result<(), MemoryError> {
    // SAFETY: MAP_FIXED replaces only the caller's range (precondition 1); nothing reads it
    // afterwards (precondition 2).
    unsafe {
        mmap_anonymous(
            as_ptr(addr),
            len as usize,
            ProtFlags::empty(),
            MapFlags::PRIVATE | MapFlags::NORESERVE | MapFlags::FIXED,
        )
    }
    .map(|_| ())
    .map_err(|e| MemoryError::os("mmap(PROT_NONE, MAP_FIXED) over a decommitted range", e))
}

/// The bytes at `addr..addr + len` as a slice.
///
/// # Safety
/// 1. The range is mapped readable for the whole of `'a`.
/// 2. Nothing writes it during `'a` except through this slice's owner.
pub(crate) unsafe fn slice<'a>(addr: u64, len: u64) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: preconditions 1 and 2.
    unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len as usize) }
}

/// The bytes at `addr..addr + len` as a mutable slice.
///
/// # Safety
/// 1. The range is mapped readable and writable for the whole of `'a`.
/// 2. No other reference to it exists during `'a`.
pub(crate) unsafe fn slice_mut<'a>(addr: u64, len: u64) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: preconditions 1 and 2.
    unsafe { std::slice::from_raw_parts_mut(addr as usize as *mut u8, len as usize) }
}

/// Bytes of `addr..addr + len` whose pages are resident, as `mincore` reports them.
///
/// # Safety
/// 1. The range is mapped by the caller (mincore only reads page-table state).
pub(crate) unsafe fn resident_bytes(addr: u64, len: u64, page: u64) -> Result<u64, MemoryError> {
    let pages = len.div_ceil(page) as usize;
    let mut vec = vec![0u8; pages];
    // SAFETY: precondition 1; `vec` has one byte per page of the range.
    let rc = unsafe { libc::mincore(as_ptr(addr), len as usize, vec.as_mut_ptr()) };
    if rc != 0 {
        return Err(MemoryError::os("mincore", std::io::Error::last_os_error()));
    }
    Ok(vec.iter().filter(|b| **b & 1 == 1).count() as u64 * page)
}
