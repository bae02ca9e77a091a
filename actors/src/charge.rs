//! What pays for one piece of a holder's memory (a sequence, a shared prefix block, a device
//! buffer): the leases (or parts of leases, see [`Lease::split`]) that were committed for it,
//! kept with that memory and released when it is freed, not before and not from a pool.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use procmem::fenced::Refund;

use crate::governor::Lease;

/// Bytes a holder's charges hold, its own leases included as they wait for their fences:
/// what the Governor's books say the holder has leased.
#[derive(Clone, Debug, Default)]
pub struct Tally(Arc<AtomicU64>);

impl Tally {
    /// Bytes held now.
    pub fn bytes(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    fn add(&self, bytes: u64) {
        self.0.fetch_add(bytes, Ordering::AcqRel);
    }

    fn sub(&self, bytes: u64) {
        // Never below zero: every subtraction matches an earlier addition.
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(v.saturating_sub(bytes))
            });
    }
}

/// The leases paying for one piece of memory. Dropped, it releases them; as the refund of a
/// [`Fenced`](procmem::fenced::Fenced) owner, it is released once the memory is freed after
/// its fences, or kept charged if the free failed.
#[derive(Debug, Default)]
pub struct Charge {
    leases: Vec<Lease>,
    tally: Option<Tally>,
}

impl Charge {
    /// An empty charge counted in `tally`.
    pub fn counted(tally: &Tally) -> Self {
        Charge {
            leases: Vec::new(),
            tally: Some(tally.clone()),
        }
    }

    /// Bytes it pays for.
    pub fn bytes(&self) -> u64 {
        self.leases.iter().map(Lease::bytes).sum()
    }

    /// Adds a lease.
    pub fn add(&mut self, lease: Lease) {
        if let Some(t) = &self.tally {
            t.add(lease.bytes());
        }
        self.leases.push(lease);
    }

    /// Moves all of `other` into this charge.
    pub fn absorb(&mut self, mut other: Charge) {
        let moved = std::mem::take(&mut other.leases);
        if let Some(t) = &other.tally {
            t.sub(moved.iter().map(Lease::bytes).sum());
        }
        for lease in moved {
            self.add(lease);
        }
    }

    /// Splits `bytes` off into a charge of their own (counted in the same tally), taking the
    /// newest leases first. `None` for zero or more than it holds, changing nothing.
    pub fn split(&mut self, bytes: u64) -> Option<Charge> {
        if bytes == 0 || bytes > self.bytes() {
            return None;
        }
        let mut part = Charge {
            leases: Vec::new(),
            tally: self.tally.clone(),
        };
        let mut left = bytes;
        while left > 0 {
            let last = self.leases.last_mut().expect("held covers bytes");
            if last.bytes() <= left {
                left -= last.bytes();
                part.leases.push(self.leases.pop().expect("exists"));
            } else {
                part.leases
                    .push(last.split(left).expect("0 < left < what the lease holds"));
                left = 0;
            }
        }
        Some(part)
    }
}

impl From<Lease> for Charge {
    fn from(lease: Lease) -> Self {
        Charge {
            leases: vec![lease],
            tally: None,
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        let bytes = self.bytes();
        if let Some(t) = &self.tally {
            t.sub(bytes);
        }
        // Each lease releases what it still holds as it drops.
    }
}

impl Refund for Charge {
    fn bytes(&self) -> u64 {
        Charge::bytes(self)
    }

    fn refund(self, _freed: u64) {
        // Everything it paid for was freed with the memory: all of it goes back.
    }

    fn keep(mut self) {
        // The books must not claim bytes came back that may not have: the charge stays, and
        // so does its count in the tally (the Governor still counts it too).
        self.tally = None;
        for lease in std::mem::take(&mut self.leases) {
            lease.keep_charged();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::governor::{GovernorConfig, GovernorHandle, ReserveRequest};
    use procmem::MemoryRole;

    async fn lease(g: &GovernorHandle, holder: procmem::ledger::HolderId, bytes: u64) -> Lease {
        let request = ReserveRequest {
            holder,
            role: MemoryRole::KvCache,
            bytes,
            priority: 0,
            deadline: None,
        };
        g.reserve(request)
            .await
            .unwrap()
            .commit(bytes)
            .await
            .unwrap()
    }

    async fn leased(g: &GovernorHandle) -> u64 {
        g.snapshot().await.unwrap().books.leased
    }

    #[tokio::test]
    async fn split_moves_bytes_across_leases_and_each_part_goes_back_with_its_memory() {
        let (g, _) = GovernorHandle::spawn(GovernorConfig::new("charge", 1 << 20))
            .await
            .unwrap();
        let h = g.register_holder("h", 0, None).await.unwrap();
        let tally = Tally::default();
        let mut whole = Charge::counted(&tally);
        whole.add(lease(&g, h, 100).await);
        whole.add(lease(&g, h, 50).await);
        assert_eq!((tally.bytes(), leased(&g).await), (150, 150));

        assert!(whole.split(0).is_none(), "zero");
        assert!(whole.split(151).is_none(), "more than held");
        assert!(whole.split(u64::MAX).is_none(), "u64::MAX");
        assert_eq!(whole.bytes(), 150, "a refused split changes nothing");

        // 70 spans both leases: all 50 of the newer one and 20 of the older one.
        let part = whole.split(70).unwrap();
        assert_eq!((part.bytes(), whole.bytes()), (70, 80));
        assert_eq!(tally.bytes(), 150, "moved, not released");
        drop(part);
        assert_eq!(tally.bytes(), 80);
        assert_eq!(leased(&g).await, 80, "the Governor got the part back");

        let mut other = Charge::counted(&tally);
        other.absorb(whole.split(80).unwrap());
        assert_eq!((other.bytes(), whole.bytes(), tally.bytes()), (80, 0, 80));
        drop(whole);
        drop(other);
        assert_eq!((tally.bytes(), leased(&g).await), (0, 0));
    }

    #[tokio::test]
    async fn a_charge_kept_after_a_failed_free_stays_in_the_books_and_the_tally() {
        let (g, _) = GovernorHandle::spawn(GovernorConfig::new("charge", 1 << 20))
            .await
            .unwrap();
        let h = g.register_holder("h", 0, None).await.unwrap();
        let tally = Tally::default();
        let mut charge = Charge::counted(&tally);
        charge.add(lease(&g, h, 64).await);
        Refund::keep(charge);
        assert_eq!((tally.bytes(), leased(&g).await), (64, 64));

        let mut refunded = Charge::counted(&tally);
        refunded.add(lease(&g, h, 36).await);
        Refund::refund(refunded, 36);
        assert_eq!((tally.bytes(), leased(&g).await), (64, 64));
    }
}
