//! The C heap's habits that decide how much of a server's memory stays outside its books.
//!
//! glibc's `malloc` serves a large request with its own `mmap`, and gives it back to the
//! kernel on `free`, but only below a threshold that it raises to the size of each large
//! block freed (up to 32 MiB). A server that reads its weights into buffers, hands them to
//! residency and frees them has raised that threshold by the time it serves: every later
//! buffer of a step's activations comes from the heap, and the heap keeps what was freed. On
//! SmolLM2 that kept about 90 MB resident that no holder leased (measured in
//! docs/metrics.md's process rows). A fixed threshold keeps large buffers returning to the
//! kernel when they are freed, at the cost of a mapping call (and its page faults) for each.

/// Buffers at least this large are mapped for themselves and unmapped when freed: a step's
/// activation of a few rows stays on the heap (reused, no system call), a prompt chunk's
/// (256 rows of 1,536 values is 1.5 MiB) and a weight read at load go back to the kernel.
pub const LARGE_BUFFER: usize = 1 << 20;

/// Fixes the C heap's mapping threshold at [`LARGE_BUFFER`], so that freed large buffers go
/// back to the kernel for the whole life of the process (glibc; elsewhere nothing is done).
/// A process-wide setting: a server calls it once, before it loads a model. Returns whether
/// the allocator took it.
pub fn return_large_frees() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only sets a parameter of the allocator, which takes its own lock;
        // the value is a size within `c_int`.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, LARGE_BUFFER as libc::c_int) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Gives the heap's free pages back to the kernel now (glibc's `malloc_trim`): what a load
/// freed in the middle of the heap, which a fixed threshold does not reach. Returns whether
/// any memory was released.
pub fn trim() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `malloc_trim` walks the allocator's own arenas under their locks.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_is_taken_and_a_trim_answers() {
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            assert!(return_large_frees());
        }
        // Either answer is valid (there may be nothing to give back); it must not fail.
        let _ = trim();
    }
}
