//! Host access to parts of a reservation: reading backed granules, writing writable ones.

use std::ops::Range;

use super::sys;
use crate::api::{GranuleState, MapAccess, MemoryError, PlaceKind, VirtualAllocation};

fn check_host(allocation: &VirtualAllocation) -> Result<(), MemoryError> {
    if allocation.place().kind == PlaceKind::Host {
        Ok(())
    } else {
        Err(MemoryError::Unsupported {
            capability: "host access to a reservation",
            reason: "the reservation lives in device memory",
        })
    }
}

/// Checks that every granule `range` touches is backed (committed or a shared block, read-only
/// ones included): what reading it needs, on any device.
pub(crate) fn check_readable(
    allocation: &VirtualAllocation,
    range: &Range<u64>,
) -> Result<(), MemoryError> {
    if range.is_empty() {
        return Ok(());
    }
    let g = allocation.granularity();
    let granules = allocation
        .granules()
        .validate_range(&(range.start / g * g..range.end.next_multiple_of(g)))?;
    allocation.granules().require_backed(&granules)
}

/// Checks that every granule `range` touches is exclusively committed or a shared block mapped
/// read-write: what writing it needs, on any device.
pub(crate) fn check_writable(
    allocation: &VirtualAllocation,
    range: &Range<u64>,
) -> Result<(), MemoryError> {
    if range.is_empty() {
        return Ok(());
    }
    let g = allocation.granularity();
    let granules = allocation
        .granules()
        .validate_range(&(range.start / g * g..range.end.next_multiple_of(g)))?;
    for i in granules {
        let offset = i as u64 * g;
        let writable = match allocation.granules().state_at(offset) {
            Some(GranuleState::Committed) => true,
            Some(GranuleState::Shared) => allocation
                .shared_views()
                .filter(|(o, v)| *o <= offset && offset < o + v.block.bytes())
                .any(|(_, v)| v.access == MapAccess::ReadWrite),
            _ => false,
        };
        if !writable {
            return Err(MemoryError::Unsupported {
                capability: "writing through this mapping",
                reason: "the granule is unmapped, or a shared block mapped read-only",
            });
        }
    }
    Ok(())
}

/// Bytes `range` of a host reservation; every granule it touches must be backed (committed
/// or a shared block, read-only ones included).
pub fn range_bytes(
    allocation: &VirtualAllocation,
    range: Range<u64>,
) -> Result<&[u8], MemoryError> {
    check_host(allocation)?;
    if range.is_empty() {
        return Ok(&[]);
    }
    check_readable(allocation, &range)?;
    // SAFETY: every granule under `range` is mapped readable on the host, and stays so while
    // `allocation` is borrowed: changing its mappings takes `&mut`.
    Ok(unsafe { sys::slice(allocation.addr() + range.start, range.end - range.start) })
}

/// Bytes `range` of a host reservation, writable; every granule it touches must be exclusively
/// committed or a shared block mapped read-write.
pub fn range_bytes_mut(
    allocation: &mut VirtualAllocation,
    range: Range<u64>,
) -> Result<&mut [u8], MemoryError> {
    check_host(allocation)?;
    if range.is_empty() {
        return Ok(&mut []);
    }
    check_writable(allocation, &range)?;
    // SAFETY: every granule under `range` is mapped read-write on the host; `&mut` makes this
    // the only reference into the reservation while it lives.
    Ok(unsafe { sys::slice_mut(allocation.addr() + range.start, range.end - range.start) })
}
