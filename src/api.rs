//! The contract: identities, requests, owning handles, capability traits and errors.
//!
//! ```text
//!  Holder ──reserve/commit──▶ Governor          (whether there is room)
//!     │
//!     └──▶ DeviceMemoryMechanism                 (how memory is obtained)
//!            ├── allocator()        required  : allocate / free
//!            ├── virtual_backing()  optional  : reserve / commit_range / decommit_range
//!            └── shared_mapping()   optional  : one physical block at several addresses
//! ```
//!
//! Capabilities are negotiated: a missing one is `None`, never a method that succeeds
//! without doing anything. Handles remember their creator and can be released only through it.

mod allocation;
pub(crate) mod capabilities;
mod error;
mod granules;
mod ids;
mod virtual_allocation;

pub(crate) use allocation::{AllocationOrigin, AllocationParts};
pub use allocation::{AllocationRequest, DeviceAllocation};
pub use capabilities::{
    CommitModel, DeviceAllocator, DeviceMemoryMechanism, SharedMapping, VirtualBacking,
};
pub use error::{FreeError, MemoryError, Refused};
pub use granules::{GranuleMap, GranuleState};
pub use ids::{
    BlockId, ChargeId, ContextId, DeviceKey, DeviceKind, MechanismId, MemoryRole, MemoryTier,
};
pub use virtual_allocation::{
    CommitResult, DecommitResult, MapAccess, PhysicalBlock, SharedView, VirtualAllocation,
    VirtualRequest,
};
