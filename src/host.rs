//! The host mechanism (Linux): an eager allocator for ordinary allocations and the memfd
//! backing for virtual buffers and shared blocks.

mod allocator;
mod file;
pub mod heap;
pub mod machine;
mod mechanism;

pub use allocator::{allocation_bytes, allocation_bytes_mut, HostAllocator};
pub use file::unlinked_file;
pub use mechanism::{machine_memory_bytes, HostMechanism};
