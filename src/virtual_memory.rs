//! Virtually contiguous, physically scattered memory on the host.
//!
//! A [`VirtualRange`] reserves addresses; [`HostBacking`] maps physical blocks of a memfd
//! into them (`MAP_SHARED | MAP_FIXED`) and punches holes to give pages back; a
//! [`VirtualBuffer`] grows at its end without its base ever moving, so an attention kernel
//! keeps seeing one flat buffer while the bytes behind it stay individually reclaimable.
//!
//! Linux is implemented fully. Elsewhere the host mechanism reports these capabilities as
//! unsupported rather than pretending.

#[cfg(target_os = "linux")]
mod buffer;
#[cfg(target_os = "linux")]
pub use buffer::{round_up, MappedTail, VirtualBuffer};
#[cfg(target_os = "linux")]
mod backing;
#[cfg(target_os = "linux")]
mod host_access;
#[cfg(target_os = "linux")]
mod pool;
#[cfg(target_os = "linux")]
mod range;
#[cfg(target_os = "linux")]
pub(crate) mod smaps;
#[cfg(target_os = "linux")]
pub(crate) mod sys;

#[cfg(target_os = "linux")]
pub use backing::HostBacking;
pub(crate) use host_access::{check_readable, check_writable};
#[cfg(target_os = "linux")]
pub use host_access::{range_bytes, range_bytes_mut};
#[cfg(target_os = "linux")]
pub use range::VirtualRange;

/// This platform's minimum mapping granularity in bytes: the page size, asked of the OS.
pub fn granularity() -> u64 {
    rustix::param::page_size() as u64
}
