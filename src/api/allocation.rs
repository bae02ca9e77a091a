//! Allocation requests and the owning allocation handle.

use std::fmt;
use std::sync::Arc;

use super::error::MemoryError;
use super::ids::{ChargeId, ContextId, MechanismId, MemoryRole, Place};

/// A request for ordinary (non-virtual) memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocationRequest {
    /// Usable bytes wanted.
    pub bytes: u64,
    /// Required alignment of the start address, a power of two.
    pub alignment: u64,
    /// What the bytes are for.
    pub role: MemoryRole,
    /// The charge that pays for these bytes, if the caller holds one.
    pub charge: Option<ChargeId>,
}

impl AllocationRequest {
    /// `bytes` for `role`, aligned to 64 bytes, with no charge attached.
    pub fn new(bytes: u64, role: MemoryRole) -> Self {
        AllocationRequest {
            bytes,
            alignment: 64,
            role,
            charge: None,
        }
    }

    /// The same request with another alignment.
    pub fn with_alignment(mut self, alignment: u64) -> Self {
        self.alignment = alignment;
        self
    }

    /// The same request paid for by `charge`.
    pub fn with_charge(mut self, charge: ChargeId) -> Self {
        self.charge = Some(charge);
        self
    }

    /// Checks size and alignment against what a mechanism can give.
    pub fn validate(&self, max_alignment: u64) -> Result<(), MemoryError> {
        if self.bytes == 0 {
            return Err(MemoryError::ZeroSize {
                what: "allocation size",
            });
        }
        if !self.alignment.is_power_of_two() || self.alignment > max_alignment {
            return Err(MemoryError::BadAlignment {
                alignment: self.alignment,
                max: max_alignment,
            });
        }
        if self.bytes > isize::MAX as u64 {
            return Err(MemoryError::SizeOverflow {
                what: "allocation size",
            });
        }
        Ok(())
    }
}

/// The creator side of an allocation: the only code that may give its bytes back.
pub(crate) trait AllocationOrigin: Send + Sync {
    /// Returns `footprint` bytes at `addr` to the system; reports the bytes actually freed.
    fn release(&self, addr: u64, footprint: u64) -> Result<u64, MemoryError>;
    /// Keeps an error that happened while dropping a handle, so it can be read back.
    fn record_drop_error(&self, error: MemoryError);
}

/// An owning handle to ordinary (non-virtual) memory.
///
/// It remembers the mechanism, place, context and charge that created it, and keeps the
/// creator alive. It is released only through its creator: by
/// [`Allocator::free`](super::Allocator::free) on that creator (any other
/// mechanism refuses it and hands it back), or when dropped.
pub struct Allocation {
    addr: u64,
    bytes: u64,
    footprint: u64,
    role: MemoryRole,
    device: Place,
    context: ContextId,
    mechanism: MechanismId,
    charge: Option<ChargeId>,
    origin: Option<Arc<dyn AllocationOrigin>>,
}

/// What a mechanism records about a fresh allocation.
pub(crate) struct AllocationParts {
    pub(crate) addr: u64,
    pub(crate) bytes: u64,
    pub(crate) footprint: u64,
    pub(crate) role: MemoryRole,
    pub(crate) device: Place,
    pub(crate) context: ContextId,
    pub(crate) mechanism: MechanismId,
    pub(crate) charge: Option<ChargeId>,
}

impl Allocation {
    pub(crate) fn new(parts: AllocationParts, origin: Arc<dyn AllocationOrigin>) -> Self {
        Allocation {
            addr: parts.addr,
            bytes: parts.bytes,
            footprint: parts.footprint,
            role: parts.role,
            device: parts.device,
            context: parts.context,
            mechanism: parts.mechanism,
            charge: parts.charge,
            origin: Some(origin),
        }
    }

    /// The start address (a host pointer or a device address, by place).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Usable bytes, as requested.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Physical bytes this allocation takes: what its charge must cover.
    pub fn footprint(&self) -> u64 {
        self.footprint
    }

    /// What the bytes are for.
    pub fn role(&self) -> MemoryRole {
        self.role
    }

    /// Where the bytes live.
    pub fn place(&self) -> Place {
        self.device
    }

    /// The provider context that created it.
    pub fn context(&self) -> ContextId {
        self.context
    }

    /// The mechanism that created it.
    pub fn mechanism(&self) -> MechanismId {
        self.mechanism
    }

    /// The charge that pays for it.
    pub fn charge(&self) -> Option<ChargeId> {
        self.charge
    }

    /// Gives the memory back through the mechanism that created it (the only one that can),
    /// returning the bytes actually freed. Callers that know the device may still be using it
    /// go through a deferred-free queue instead.
    pub fn release(self) -> Result<u64, MemoryError> {
        self.release_now()
    }

    /// Releases through the creator; called only after the caller checked identity.
    pub(crate) fn release_now(mut self) -> Result<u64, MemoryError> {
        match self.origin.take() {
            Some(origin) => origin.release(self.addr, self.footprint),
            None => Ok(0),
        }
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if let Some(origin) = self.origin.take() {
            if let Err(error) = origin.release(self.addr, self.footprint) {
                origin.record_drop_error(error);
            }
        }
    }
}

impl fmt::Debug for Allocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocation")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("bytes", &self.bytes)
            .field("footprint", &self.footprint)
            .field("role", &self.role)
            .field("place", &self.device)
            .field("context", &self.context)
            .field("mechanism", &self.mechanism)
            .field("charge", &self.charge)
            .finish()
    }
}
