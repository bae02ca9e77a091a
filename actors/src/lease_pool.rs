//! Leases shared by everything a holder keeps: one grant per step can pay for memory that
//! is later freed piece by piece (a sequence here, a prefix block there), and the pool
//! outlives the holder for as long as any of that memory waits for its fences.

use std::sync::{Arc, Mutex};

use crate::governor::Lease;

/// A holder's leases; clones share them.
#[derive(Clone, Default, Debug)]
pub struct LeasePool {
    leases: Arc<Mutex<Vec<Lease>>>,
}

impl LeasePool {
    /// Adds a committed lease.
    pub fn add(&self, lease: Lease) {
        self.leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(lease);
    }

    /// Bytes held by all leases.
    pub fn bytes(&self) -> u64 {
        self.leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(Lease::bytes)
            .sum()
    }

    /// Releases `bytes` (memory that was actually freed) from the pool's leases, newest
    /// first, without waiting. Returns the bytes released: less than asked only if the pool
    /// holds less, which means the books were already short.
    pub fn release(&self, bytes: u64) -> u64 {
        let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        let mut left = bytes;
        while left > 0 {
            let Some(last) = leases.last_mut() else { break };
            let take = left.min(last.bytes());
            if take > 0 && last.release(take).is_err() {
                break;
            }
            left -= take;
            if last.bytes() == 0 {
                leases.pop();
            }
        }
        bytes - left
    }
}
