//! Admission, pure: given the books, the wait queue, a request and the time, grant it now,
//! let it wait, or deny it, and say why. The Governor actor only applies the answer, so every
//! rule here is tested without a runtime.

use std::time::Instant;

use super::{AuthorityId, InLine, Ledger, Priority, Totals, WaitQueue};

/// What the Governor does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// It fits without taking room a waiter ahead of it needs: grant it now.
    GrantNow,
    /// It may fit once holders free memory: queue it until its deadline.
    Wait,
    /// Refused now.
    Deny(Refusal),
}

/// Why a request was refused without waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No room now, and the request does not wait (no deadline, or one already past).
    NoRoom,
    /// Larger than the authority's whole capacity: it can never fit.
    NeverFits,
    /// The wait queue is full: try again later.
    Busy,
}

/// How the queue is bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Requests that may wait at once; one more is refused with [`Refusal::Busy`].
    pub max_waiters: usize,
    /// The capacity can grow (it is credit from a parent that may approve more): a request
    /// larger than it waits instead of being refused as one that can never fit.
    pub elastic: bool,
}

impl Default for AdmissionLimits {
    fn default() -> Self {
        AdmissionLimits {
            max_waiters: 4096,
            elastic: false,
        }
    }
}

/// A request as admission sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    /// Bytes asked.
    pub bytes: u64,
    /// Its priority: waiters are served highest first.
    pub priority: Priority,
    /// Until when it may wait; `None` answers now.
    pub deadline: Option<Instant>,
}

/// Decides a new request. It is granted now when it fits and either no waiter is ahead of it
/// (the queue is empty or it outranks the first in line) or the free bytes cover everything
/// the waiters want as well as it: a request that takes nothing a waiter needs never waits.
pub fn admit<T>(
    ledger: &Ledger,
    authority: AuthorityId,
    queue: &WaitQueue<T>,
    ask: Ask,
    now: Instant,
    limits: AdmissionLimits,
) -> Admission {
    let Some(totals) = ledger.totals(authority) else {
        return Admission::Deny(Refusal::NoRoom);
    };
    if ask.bytes > totals.capacity && !limits.elastic {
        return Admission::Deny(Refusal::NeverFits);
    }
    let free = totals.free();
    let outranks = queue
        .front_priority()
        .is_none_or(|front| ask.priority > front);
    let beside_waiters = free.saturating_sub(queue.bytes()) >= ask.bytes;
    if free >= ask.bytes && (outranks || beside_waiters) {
        return Admission::GrantNow;
    }
    if ask.deadline.is_none_or(|d| d <= now) {
        return Admission::Deny(Refusal::NoRoom);
    }
    if queue.len() >= limits.max_waiters {
        return Admission::Deny(Refusal::Busy);
    }
    Admission::Wait
}

/// What to do with the first waiter in line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Front {
    /// It fits: grant it (then look again).
    Grant(u64),
    /// It can never fit (capacity was lowered below it): deny it now rather than let it
    /// block everyone behind it until its deadline.
    Deny(u64),
    /// It does not fit yet: everyone waits for room.
    Wait,
    /// Nobody waits.
    Empty,
}

/// Decides the first waiter of `queue` (its sequence number in the answer).
pub fn front<T>(
    ledger: &Ledger,
    authority: AuthorityId,
    queue: &WaitQueue<T>,
    limits: AdmissionLimits,
) -> Front {
    let Some(InLine { seq, bytes, .. }) = queue.front() else {
        return Front::Empty;
    };
    let Some(Totals { capacity, .. }) = ledger.totals(authority) else {
        return Front::Deny(seq);
    };
    if bytes > capacity && !limits.elastic {
        Front::Deny(seq)
    } else if ledger.fits(authority, bytes).unwrap_or(false) {
        Front::Grant(seq)
    } else {
        Front::Wait
    }
}

/// Bytes holders must free for everything approved and waiting to fit (zero if it does).
pub fn shortfall<T>(ledger: &Ledger, authority: AuthorityId, queue: &WaitQueue<T>) -> u64 {
    let Some(t) = ledger.totals(authority) else {
        return 0;
    };
    // In 128 bits: sums of byte counts near `u64::MAX` must neither wrap nor saturate early.
    let wanted = u128::from(t.provisional) + u128::from(t.leased) + u128::from(queue.bytes());
    u64::try_from(wanted.saturating_sub(u128::from(t.capacity))).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryRole;
    use std::time::Duration;

    fn books(capacity: u64, used: u64) -> (Ledger, AuthorityId, super::super::HolderId) {
        let mut l = Ledger::new();
        let a = l.add_authority("pool", capacity);
        let h = l.register_holder(a, "h", 0).unwrap();
        if used > 0 {
            l.reserve(h, a, MemoryRole::KvCache, used).unwrap();
        }
        (l, a, h)
    }

    fn ask(bytes: u64, priority: Priority, wait: bool) -> Ask {
        Ask {
            bytes,
            priority,
            deadline: wait.then(|| Instant::now() + Duration::from_secs(60)),
        }
    }

    /// Defect (issue 11, 3): a no-wait request that fits was denied while any waiter was
    /// queued, with a denial saying the free bytes covered it.
    #[test]
    fn a_request_that_fits_beside_the_waiters_is_granted() {
        let (l, a, _) = books(100, 50);
        let mut q = WaitQueue::default();
        q.push(5, 30, ());
        let now = Instant::now();
        let lim = AdmissionLimits::default();
        assert_eq!(
            admit(&l, a, &q, ask(20, 0, false), now, lim),
            Admission::GrantNow
        );
        assert_eq!(
            admit(&l, a, &q, ask(21, 0, false), now, lim),
            Admission::Deny(Refusal::NoRoom),
            "it would take bytes the waiter needs"
        );
        assert_eq!(
            admit(&l, a, &q, ask(21, 0, true), now, lim),
            Admission::Wait
        );
        assert_eq!(
            admit(&l, a, &q, ask(50, 9, false), now, lim),
            Admission::GrantNow,
            "a higher priority goes ahead of the line"
        );
    }

    #[test]
    fn never_fits_busy_and_extreme_sizes_are_refused_without_panics() {
        let (l, a, _) = books(u64::MAX, u64::MAX - 1);
        let mut q = WaitQueue::default();
        q.push(0, u64::MAX, ());
        q.push(0, u64::MAX, ());
        assert_eq!(q.bytes(), u64::MAX, "waiting bytes saturate");
        let now = Instant::now();
        let lim = AdmissionLimits {
            max_waiters: 2,
            elastic: false,
        };
        assert_eq!(
            admit(&l, a, &q, ask(u64::MAX, 0, true), now, lim),
            Admission::Deny(Refusal::Busy)
        );
        assert_eq!(
            admit(&l, a, &q, ask(1, 1, false), now, lim),
            Admission::GrantNow
        );
        assert_eq!(shortfall(&l, a, &q), u64::MAX - 1);
        let (small, b, _) = books(10, 0);
        assert_eq!(
            admit(
                &small,
                b,
                &WaitQueue::<()>::default(),
                ask(11, 0, true),
                now,
                lim
            ),
            Admission::Deny(Refusal::NeverFits)
        );
        let past = Ask {
            deadline: Some(now - Duration::from_millis(1)),
            ..ask(10, 0, true)
        };
        let (full, c, _) = books(10, 5);
        assert_eq!(
            admit(&full, c, &WaitQueue::<()>::default(), past, now, lim),
            Admission::Deny(Refusal::NoRoom)
        );
    }

    /// Defect (issue 11, 3): a waiter that could never fit after the capacity was lowered
    /// blocked the queue until its deadline.
    #[test]
    fn a_waiter_that_can_never_fit_is_denied_at_the_front() {
        let (mut l, a, _) = books(100, 0);
        let mut q = WaitQueue::default();
        let big = q.push(1, 80, ());
        let small = q.push(0, 10, ());
        assert_eq!(
            front(&l, a, &q, AdmissionLimits::default()),
            Front::Grant(big)
        );
        l.set_capacity(a, 50).unwrap();
        assert_eq!(
            front(&l, a, &q, AdmissionLimits::default()),
            Front::Deny(big)
        );
        // Under an upstream that may approve more, it waits instead.
        let elastic = AdmissionLimits {
            elastic: true,
            ..AdmissionLimits::default()
        };
        assert_eq!(front(&l, a, &q, elastic), Front::Wait);
        let ask = Ask {
            bytes: 80,
            priority: 0,
            deadline: Some(Instant::now() + Duration::from_secs(1)),
        };
        assert_eq!(
            admit(&l, a, &q, ask, Instant::now(), elastic),
            Admission::Wait
        );
        q.remove(big);
        assert_eq!(
            front(&l, a, &q, AdmissionLimits::default()),
            Front::Grant(small)
        );
        q.remove(small);
        assert_eq!(front(&l, a, &q, AdmissionLimits::default()), Front::Empty);
    }
}
