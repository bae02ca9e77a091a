//! The host mechanism: eager allocator, virtual backing and shared mapping, one identity.

use std::sync::Arc;

use super::machine::{parse_process_rss, ProcessMemory};
use super::HostAllocator;
use crate::api::{
    Allocator, ContextId, MechanismId, MemoryError, MemoryMechanism, Place, SharedMapping,
    VirtualBacking,
};
use crate::virtual_memory::HostBacking;

/// Host memory as one mechanism: ordinary eager allocations, plus on-demand mapping and
/// shared physical blocks from one memfd. Every handle it creates carries its identity and
/// is refused by any other mechanism.
pub struct HostMechanism {
    id: MechanismId,
    context: ContextId,
    allocator: HostAllocator,
    backing: Arc<HostBacking>,
}

impl HostMechanism {
    /// A host mechanism with a fresh identity, in a fresh host context.
    pub fn new() -> Result<Self, MemoryError> {
        let id = MechanismId::fresh();
        let context = ContextId::fresh();
        Ok(HostMechanism {
            id,
            context,
            allocator: HostAllocator::new(id, context),
            backing: Arc::new(HostBacking::new(id)?),
        })
    }

    /// The host context its allocations belong to.
    pub fn context(&self) -> ContextId {
        self.context
    }

    /// The virtual backing as a shareable handle, for [`VirtualBuffer`](crate::virtual_memory::VirtualBuffer).
    pub fn backing(&self) -> Arc<HostBacking> {
        Arc::clone(&self.backing)
    }

    /// The eager allocator, concretely typed.
    pub fn host_allocator(&self) -> &HostAllocator {
        &self.allocator
    }

    /// Physical bytes behind everything this mechanism holds, as the kernel reports them:
    /// the memfd pages of its virtual backing and the resident pages of its eager
    /// allocations (the OS side of an authority's drift).
    pub fn resident_bytes(&self) -> Result<u64, MemoryError> {
        let backing = self.backing.resident_bytes()?;
        let eager = self.allocator.resident_total()?;
        Ok(backing.saturating_add(eager))
    }
}

impl HostMechanism {
    /// What this process holds resident, beside what this mechanism holds for the holders
    /// (`/proc/self/status` against the memfd's blocks and the eager allocations' pages);
    /// `None` where the kernel does not say.
    pub fn process_memory(&self) -> Option<ProcessMemory> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let rss = parse_process_rss(&status).ok()?;
        Some(ProcessMemory::new(
            rss,
            self.backing.resident_bytes().ok()?,
            self.allocator.resident_total().ok()?,
        ))
    }
}

/// Physical memory of this machine (`MemTotal` in `/proc/meminfo`), or `None` where it cannot
/// be read.
pub fn machine_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

impl MemoryMechanism for HostMechanism {
    fn id(&self) -> MechanismId {
        self.id
    }

    fn place(&self) -> Place {
        Place::HOST
    }

    fn allocator(&self) -> &dyn Allocator {
        &self.allocator
    }

    fn virtual_backing(&self) -> Option<&dyn VirtualBacking> {
        Some(self.backing.as_ref())
    }

    fn shared_mapping(&self) -> Option<&dyn SharedMapping> {
        Some(self.backing.as_ref())
    }
}
