//! The one error type of the mechanisms, each variant saying what the caller can do.

use std::io;
use std::ops::Range;

use super::ids::MechanismId;

/// Why a mechanism refused or failed an operation. A refused operation changed nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// A size of zero was asked for; ask for at least one granule.
    #[error("{what} is zero bytes; ask for at least one granule")]
    ZeroSize {
        /// Which argument was zero.
        what: &'static str,
    },
    /// Arithmetic on the requested size overflowed; the request cannot be represented.
    #[error("{what} overflows the address space")]
    SizeOverflow {
        /// Which computation overflowed.
        what: &'static str,
    },
    /// A size or offset is not a whole number of granules; round it with the granularity.
    #[error("{what} = {value} is not a multiple of the mapping granularity {granularity}")]
    Misaligned {
        /// Which argument was misaligned.
        what: &'static str,
        /// The value given.
        value: u64,
        /// The granularity it must be a multiple of.
        granularity: u64,
    },
    /// An alignment that is not a power of two, or larger than the mechanism provides.
    #[error("alignment {alignment} is not a power of two no larger than {max}")]
    BadAlignment {
        /// The alignment asked for.
        alignment: u64,
        /// The largest alignment this mechanism provides.
        max: u64,
    },
    /// A range reaches past the reservation; reserve more up front.
    #[error("range {:#x}..{:#x} lies outside the reservation of {reserved} bytes", range.start, range.end)]
    OutOfReservation {
        /// The offending range.
        range: Range<u64>,
        /// The reservation's length.
        reserved: u64,
    },
    /// Part of the range is already backed; decommit it first or pick another range.
    #[error("offset {offset:#x} is already committed")]
    AlreadyCommitted {
        /// The first committed offset found.
        offset: u64,
    },
    /// Part of the range has no backing; there is nothing to decommit there.
    #[error("offset {offset:#x} is not committed")]
    NotCommitted {
        /// The first uncommitted offset found.
        offset: u64,
    },
    /// A shrink larger than what is committed.
    #[error("cannot shrink by {by} bytes: only {len} are committed")]
    ShrinkBelowZero {
        /// How much the caller asked to remove.
        by: u64,
        /// How much is committed.
        len: u64,
    },
    /// A range would split a shared block; shared blocks are mapped and unmapped whole.
    #[error("range {:#x}..{:#x} splits the shared block mapped at {block:#x}; unmap whole blocks", range.start, range.end)]
    PartialBlock {
        /// The range asked for.
        range: Range<u64>,
        /// The offset at which the split block is mapped.
        block: u64,
    },
    /// A handle was given to a mechanism that did not create it; release it through its creator.
    #[error("handle was created by {owner}, not by {this}; release it through its creator")]
    ForeignHandle {
        /// The mechanism that created the handle.
        owner: MechanismId,
        /// The mechanism it was handed to.
        this: MechanismId,
    },
    /// The capability does not exist here. Nothing happened; take the explicit fallback.
    #[error("{capability} is not supported: {reason}")]
    Unsupported {
        /// The capability asked for.
        capability: &'static str,
        /// Why it is missing.
        reason: &'static str,
    },
    /// No CUDA driver library on this machine: CUDA mechanisms cannot be used here.
    #[error("no CUDA driver: {api} needs libcuda, which is not present on this machine")]
    NoCudaDriver {
        /// The entry point that was called.
        api: &'static str,
    },
    /// The CUDA driver refused a call.
    #[error("CUDA {op} failed: {code}")]
    Driver {
        /// The driver call.
        op: &'static str,
        /// The driver's error code.
        code: String,
    },
    /// The operating system or driver has no physical memory for this; free something first.
    #[error("out of physical memory while {op} {bytes} bytes")]
    OutOfMemory {
        /// The operation that ran out.
        op: &'static str,
        /// How many bytes it wanted.
        bytes: u64,
    },
    /// The mechanism panicked while freeing: whether the memory is still held is unknown, so
    /// its charge is kept.
    #[error("the mechanism panicked while freeing {what}; its charge is kept")]
    ReleasePanicked {
        /// What was being freed.
        what: &'static str,
    },
    /// A host kernel still reads the memory: it can be neither written nor freed until that
    /// kernel's fence completes; wait for it.
    #[error("a host kernel still reads the memory, so it cannot be {op} yet")]
    InUse {
        /// What was refused ("written", "freed").
        op: &'static str,
    },
    /// The host memory file would grow past the process's file-size limit (`ulimit -f`,
    /// `RLIMIT_FSIZE`): raise the limit, or reserve less.
    #[error("the host memory file needs {needed} bytes; the process's file-size limit (ulimit -f) is {limit}")]
    FileSizeLimit {
        /// Bytes the file would have to span.
        needed: u64,
        /// The limit in bytes.
        limit: u64,
    },
    /// A fault injected by a reliability test at the named point.
    #[error("injected fault at {point}")]
    Injected {
        /// The fault point.
        point: &'static str,
    },
    /// A system call failed for another reason.
    #[error("{op} failed: {source}")]
    Os {
        /// The system call or step.
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

impl MemoryError {
    /// Whether the OS had no room for a call (`ENOMEM`): no memory, or the process's mappings
    /// at `vm.max_map_count` (a mapping call on a range splits or adds one). Less mapped may
    /// pass: a caller treats it as pressure, not a fault.
    pub fn is_os_out_of_memory(&self) -> bool {
        matches!(self, MemoryError::Os { source, .. } if source.raw_os_error() == Some(libc::ENOMEM))
    }

    pub(crate) fn os(op: &'static str, source: impl Into<io::Error>) -> Self {
        MemoryError::Os {
            op,
            source: source.into(),
        }
    }
}

/// An operation refused a handle, and gives it back so it is neither leaked nor freed by the wrong owner.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct Refused<T: std::fmt::Debug> {
    /// Why it was refused.
    #[source]
    pub error: MemoryError,
    /// The handle, untouched.
    pub handle: T,
}

/// Why [`Allocator::free`](super::Allocator::free) did not free.
#[derive(Debug, thiserror::Error)]
pub enum FreeError {
    /// The allocation belongs to another mechanism or context; it is handed back untouched.
    #[error(transparent)]
    Refused(Box<Refused<super::Allocation>>),
    /// The creator tried and the system call failed; the handle is consumed.
    #[error("the creating mechanism failed to free: {0}")]
    Failed(#[source] MemoryError),
}
