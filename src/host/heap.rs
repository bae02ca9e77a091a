//! The C heap's habits that decide how much of a server's memory stays outside its books.
//!
//! glibc's `malloc` serves a large request with its own `mmap`, and gives it back to the
//! kernel on `free`, but only below a threshold that it raises to the size of each large
//! block freed (up to 32 MiB). A server that reads its weights into buffers, hands them to
//! residency and frees them has raised that threshold by the time it serves: every later
//! buffer of a step's activations comes from the heap, and the heap keeps what was freed. On
//! SmolLM2 that kept about 90 MB resident that no holder leased (measured in
//! docs/metrics.md's process rows). A fixed threshold keeps large buffers returning to the
//! kernel when they are freed, at the cost of a mapping call (and its page faults) for each;
//! so it sits above a step's activations, which then stay on the heap and are reused, and the
//! heap gives back what it holds free at its top beyond a little.

/// Buffers at least this large are mapped for themselves and unmapped when freed: the
/// weights read at load and the output head's copy go back to the kernel; a step's
/// activations (a prompt chunk's 256 rows of 1,536 values is 1.5 MiB, 16 rows of logits 3
/// MiB) stay on the heap and are reused, without a mapping and its page faults each time.
/// With a 1 MiB threshold, the same load on SmolLM2 (`scripts/rss-under-load.py`) took
/// 16.7-18.2 s against 13.6-15.3 s here, for 31 MB outside the books at most against 39 MB.
pub const LARGE_BUFFER: usize = 8 << 20;

/// The most free memory the heap keeps at its top before it gives it back (glibc's trim
/// threshold, which a fixed mapping threshold would otherwise leave at 128 KiB: the top of a
/// step's activations given back and faulted in again every step).
pub const KEPT_FREE: usize = 2 << 20;

/// Fixes the C heap's mapping threshold at [`LARGE_BUFFER`] and its trim threshold at
/// [`KEPT_FREE`], so that freed large buffers go back to the kernel for the whole life of the
/// process (glibc; elsewhere nothing is done).
/// A process-wide setting: a server calls it once, before it loads a model. Returns whether
/// the allocator took it.
pub fn return_large_frees() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only sets a parameter of the allocator, which takes its own lock;
        // the value is a size within `c_int`.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, LARGE_BUFFER as libc::c_int) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, KEPT_FREE as libc::c_int) == 1
        }
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
