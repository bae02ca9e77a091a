//! The contract: identities, requests, owning handles, capability traits and errors.
//!
//! ```text
//!  Holder ──reserve/commit──▶ Governor          (whether there is room)
//!     │
//!     └──▶ MemoryMechanism                      (how memory is obtained)
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

pub use allocation::{Allocation, AllocationRequest};
pub(crate) use allocation::{AllocationOrigin, AllocationParts};
pub use capabilities::{Allocator, CommitModel, MemoryMechanism, SharedMapping, VirtualBacking};
pub use error::{FreeError, MemoryError, Refused};
pub use granules::{GranuleMap, GranuleState};
pub use ids::{
    BlockId, ChargeId, ContextId, MechanismId, MemoryRole, MemoryTier, Place, PlaceKind,
};
pub use virtual_allocation::{
    CommitResult, DecommitResult, MapAccess, PhysicalBlock, SharedView, VirtualAllocation,
    VirtualRequest,
};
