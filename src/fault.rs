//! Fault points for reliability tests: each names a step of a transaction where a real
//! failure could happen (a mapping call, a charge, a free). With the `fault-injection`
//! feature, a test arms one point to fail on its n-th hit; without it, every point compiles
//! to `Ok(())`.

use crate::api::MemoryError;

#[cfg(feature = "fault-injection")]
mod armed {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    pub(super) static ANY: AtomicBool = AtomicBool::new(false);
    pub(super) static COUNTING: AtomicBool = AtomicBool::new(false);
    pub(super) static PLAN: Mutex<Option<(&'static str, u64)>> = Mutex::new(None);
    pub(super) static SEEN: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());

    pub(super) fn record(point: &'static str) -> bool {
        if COUNTING.load(Ordering::Relaxed) {
            *SEEN
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(point)
                .or_default() += 1;
        }
        if !ANY.load(Ordering::Acquire) {
            return false;
        }
        let mut plan = PLAN.lock().unwrap_or_else(|p| p.into_inner());
        match plan.as_mut() {
            Some((p, left)) if *p == point => {
                if *left == 0 {
                    *plan = None;
                    ANY.store(false, Ordering::Release);
                    true
                } else {
                    *left -= 1;
                    false
                }
            }
            _ => false,
        }
    }
}

/// Passes through fault point `point`: fails with [`MemoryError::Injected`] if a test armed it.
#[inline(always)]
pub fn hit(point: &'static str) -> Result<(), MemoryError> {
    #[cfg(feature = "fault-injection")]
    if armed::record(point) {
        return Err(MemoryError::Injected { point });
    }
    let _ = point;
    Ok(())
}

/// Panics if a test armed `point`: placed at the top of an actor's message handler, it kills
/// the actor mid-message, the way a bug would.
#[inline(always)]
pub fn panic_point(point: &'static str) {
    if hit(point).is_err() {
        panic!("injected panic at {point}");
    }
}

/// Arms `point` to fail on its hit number `after` (0 = the next one). One point at a time.
#[cfg(feature = "fault-injection")]
pub fn arm(point: &'static str, after: u64) {
    *armed::PLAN.lock().unwrap_or_else(|p| p.into_inner()) = Some((point, after));
    armed::ANY.store(true, std::sync::atomic::Ordering::Release);
}

/// Whether a point is armed and has not fired yet.
#[cfg(feature = "fault-injection")]
pub fn pending() -> bool {
    armed::PLAN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .is_some()
}

/// Disarms every point; returns whether the armed one never fired.
#[cfg(feature = "fault-injection")]
pub fn disarm() -> bool {
    armed::ANY.store(false, std::sync::atomic::Ordering::Release);
    armed::PLAN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
        .is_some()
}

/// Starts counting the hits of every point (from zero); see [`take_seen`].
#[cfg(feature = "fault-injection")]
pub fn start_counting() {
    armed::SEEN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clear();
    armed::COUNTING.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Stops counting and returns every point passed through since [`start_counting`], with its
/// hit count.
#[cfg(feature = "fault-injection")]
pub fn take_seen() -> Vec<(&'static str, u64)> {
    armed::COUNTING.store(false, std::sync::atomic::Ordering::Relaxed);
    std::mem::take(&mut *armed::SEEN.lock().unwrap_or_else(|p| p.into_inner()))
        .into_iter()
        .collect()
}
