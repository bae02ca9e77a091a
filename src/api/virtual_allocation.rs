//! Reservations of virtual address space and physical blocks that can be mapped into them.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use super::error::MemoryError;
use super::granules::GranuleMap;
use super::ids::{BlockId, MechanismId, MemoryRole, Place};

/// A request to reserve virtual address space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtualRequest {
    /// Length of the range, a whole number of granules.
    pub bytes: u64,
    /// What the range will hold.
    pub role: MemoryRole,
}

/// How a physical block is seen through one mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapAccess {
    /// Reads and writes reach the block; every mapping sees them.
    ReadWrite,
    /// Reads only; a write faults.
    ReadOnly,
    /// Reads see the block; the first write to a page gives this mapping its own private copy.
    CopyOnWrite,
}

/// What a commit installed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitResult {
    /// Physical bytes installed by this call.
    pub committed_bytes: u64,
}

/// What a decommit removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecommitResult {
    /// Bytes of address range that no longer have backing.
    pub unmapped_bytes: u64,
    /// Of those, exclusively owned bytes whose physical memory went back to the system.
    /// Shared blocks are freed only when their last mapping and handle go.
    pub freed_bytes: u64,
}

/// A physical block that may be mapped at several addresses. Cloning it adds a reference;
/// its physical memory goes back to the system when the last clone (including the ones held
/// by mappings) is gone.
#[derive(Clone)]
pub struct PhysicalBlock {
    id: BlockId,
    bytes: u64,
    mechanism: MechanismId,
    inner: Arc<dyn Any + Send + Sync>,
}

impl PhysicalBlock {
    pub(crate) fn new(
        bytes: u64,
        mechanism: MechanismId,
        inner: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        PhysicalBlock {
            id: BlockId::fresh(),
            bytes,
            mechanism,
            inner,
        }
    }

    /// Its identity.
    pub fn id(&self) -> BlockId {
        self.id
    }

    /// Its length in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The mechanism that created it.
    pub fn mechanism(&self) -> MechanismId {
        self.mechanism
    }

    /// How many handles and mappings keep it alive.
    pub fn references(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    pub(crate) fn inner<T: Any>(&self) -> Option<&T> {
        self.inner.downcast_ref()
    }
}

impl fmt::Debug for PhysicalBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PhysicalBlock")
            .field("id", &self.id)
            .field("bytes", &self.bytes)
            .field("mechanism", &self.mechanism)
            .field("references", &self.references())
            .finish()
    }
}

/// A shared block mapped into a reservation.
#[derive(Debug, Clone)]
pub struct SharedView {
    /// The block (this clone keeps it alive while mapped).
    pub block: PhysicalBlock,
    /// How it is seen here.
    pub access: MapAccess,
}

/// An owning handle to a reserved range of virtual addresses: which granules are backed,
/// which shared blocks are mapped where. Dropping it unmaps everything and releases the
/// range; exclusively committed physical memory goes back to the system.
pub struct VirtualAllocation {
    addr: u64,
    role: MemoryRole,
    device: Place,
    mechanism: MechanismId,
    pub(crate) granules: GranuleMap,
    // Declared before `shared`: the range is unmapped before the last block references go.
    backend: Box<dyn Any + Send + Sync>,
    pub(crate) shared: BTreeMap<u64, SharedView>,
}

impl VirtualAllocation {
    pub(crate) fn new(
        addr: u64,
        granules: GranuleMap,
        role: MemoryRole,
        device: Place,
        mechanism: MechanismId,
        backend: Box<dyn Any + Send + Sync>,
    ) -> Self {
        VirtualAllocation {
            addr,
            role,
            device,
            mechanism,
            granules,
            backend,
            shared: BTreeMap::new(),
        }
    }

    /// The base address; it never changes while the reservation lives.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Reserved length in bytes.
    pub fn len(&self) -> u64 {
        self.granules.len_bytes()
    }

    /// Always false: a reservation is at least one granule.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The mapping granularity of the mechanism that made it.
    pub fn granularity(&self) -> u64 {
        self.granules.granularity()
    }

    /// What the range holds.
    pub fn role(&self) -> MemoryRole {
        self.role
    }

    /// Where the range lives.
    pub fn place(&self) -> Place {
        self.device
    }

    /// The mechanism that reserved it.
    pub fn mechanism(&self) -> MechanismId {
        self.mechanism
    }

    /// Per-granule state, as the mechanism's bookkeeping has it.
    pub fn granules(&self) -> &GranuleMap {
        &self.granules
    }

    /// Shared blocks mapped into this range, by offset.
    pub fn shared_views(&self) -> impl Iterator<Item = (u64, &SharedView)> {
        self.shared.iter().map(|(o, v)| (*o, v))
    }

    pub(crate) fn check_owner(&self, this: MechanismId) -> Result<(), MemoryError> {
        if self.mechanism == this {
            Ok(())
        } else {
            Err(MemoryError::ForeignHandle {
                owner: self.mechanism,
                this,
            })
        }
    }

    pub(crate) fn backend<T: Any>(&self) -> Option<&T> {
        self.backend.downcast_ref()
    }

    pub(crate) fn backend_mut<T: Any>(&mut self) -> Option<&mut T> {
        self.backend.downcast_mut()
    }

    /// Offsets of the shared blocks lying inside `range`; refuses a range that would split
    /// one, since shared blocks are mapped and unmapped whole.
    pub(crate) fn shared_blocks_within(
        &self,
        range: &std::ops::Range<u64>,
    ) -> Result<Vec<u64>, MemoryError> {
        let mut inside = Vec::new();
        for (offset, view) in self.shared.range(..range.end) {
            let block_end = offset + view.block.bytes();
            if block_end <= range.start {
                continue;
            }
            if *offset < range.start || block_end > range.end {
                return Err(MemoryError::PartialBlock {
                    range: range.clone(),
                    block: *offset,
                });
            }
            inside.push(*offset);
        }
        Ok(inside)
    }
}

impl fmt::Debug for VirtualAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VirtualAllocation")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len())
            .field("committed", &self.granules.committed_bytes())
            .field("shared", &self.granules.shared_bytes())
            .field("place", &self.device)
            .field("mechanism", &self.mechanism)
            .finish()
    }
}
