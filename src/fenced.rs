//! Memory that must outlive the work on streams that used it, with one owner.
//!
//! A [`Fenced`] holds the item (an allocation, a mapped block), the refund that pays for it
//! (a lease) and the fence of every stream that used it, each with its own timeline, whatever
//! provider or registry that stream belongs to. It can only be freed through
//! [`Fenced::release_when_idle`]: the item goes back to the mechanism that made it once every
//! fence has completed, woken by the last completion (no polling, no thread of its own), and
//! only then is the refund paid with the bytes actually freed. Dropped unreleased, it does the
//! same on its own.
//!
//! ```text
//!  record_use(fence on A) ─┐
//!  record_use(fence on B) ─┼─> release_when_idle ─> waits on A ─> waits on B ─> item.release()
//!                          │                         (A's thread)   (B's thread)   then refund
//! ```

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::deferred::{route, Route};
use crate::fence::{Fence, TimelineFence};
use crate::{Allocation, MemoryError};

/// Something that can be freed only by the mechanism that created it.
pub trait Release: Send + 'static {
    /// Frees it; returns the bytes actually freed.
    fn release(self: Box<Self>) -> Result<u64, MemoryError>;
}

impl Release for Allocation {
    fn release(self: Box<Self>) -> Result<u64, MemoryError> {
        Allocation::release(*self)
    }
}

/// What pays for a [`Fenced`] item: settled once, after the item was freed or failed to be.
pub trait Refund: Send + 'static {
    /// Bytes it pays for.
    fn bytes(&self) -> u64;
    /// The item was freed: `freed` bytes go back (what it held beyond that goes back too:
    /// nothing it paid for is still in use).
    fn refund(self, freed: u64);
    /// The mechanism failed to free: the bytes may still be held, so the charge stays.
    fn keep(self);
}

/// No refund: memory nobody was charged for.
impl Refund for () {
    fn bytes(&self) -> u64 {
        0
    }
    fn refund(self, _: u64) {}
    fn keep(self) {}
}

/// Something work on a stream uses: the stream records the work's fence on it when the work
/// is submitted, so it is not freed before that fence completes.
pub trait RecordUse {
    /// Work fenced by `use_` reads or writes it.
    fn record_use(&self, use_: TimelineFence);
}

impl<T: Release + ?Sized, R: Refund> RecordUse for Fenced<T, R> {
    fn record_use(&self, use_: TimelineFence) {
        Fenced::record_use(self, use_);
    }
}

/// How a release ended, handed to the callback of [`Fenced::release_when_idle`].
#[derive(Debug)]
pub struct Released {
    /// Bytes the mechanism freed, or why it could not.
    pub outcome: Result<u64, MemoryError>,
    /// When the last fence it waited for completed; `None` if none was pending at release.
    pub fence_done_at: Option<Instant>,
    /// Streams whose fence it waited for.
    pub waited_on: usize,
    /// How long the mechanism's own free took, on the thread that ran it (part of the time
    /// from `fence_done_at` to the refund, and the floor under it).
    pub free_took: Duration,
}

/// Asked just before an idle item is freed: `Some(fence)` puts the free off until that fence
/// completes (a retry after an injected fault), `None` frees it now.
pub type Gate = Box<dyn FnMut() -> Option<TimelineFence> + Send + 'static>;

/// An item, its refund and the fences of every stream that used it.
pub struct Fenced<T: Release + ?Sized, R: Refund> {
    item: Option<Box<T>>,
    refund: Option<R>,
    uses: Mutex<Vec<TimelineFence>>,
}

impl<T: Release + ?Sized, R: Refund> Fenced<T, R> {
    /// `item`, paid for by `refund`, used by no stream yet.
    pub fn new(item: Box<T>, refund: Option<R>) -> Self {
        Fenced {
            item: Some(item),
            refund,
            uses: Mutex::new(Vec::new()),
        }
    }

    /// The item, while it is owned here.
    pub fn item(&self) -> &T {
        self.item.as_deref().expect("owned until released")
    }

    /// The item, mutably.
    pub fn item_mut(&mut self) -> &mut T {
        self.item.as_deref_mut().expect("owned until released")
    }

    /// Bytes the refund pays for.
    pub fn charged_bytes(&self) -> u64 {
        self.refund.as_ref().map_or(0, R::bytes)
    }

    /// Records that work fenced by `use_` reads or writes the item. A later fence of the same
    /// stream replaces an earlier one: a stream completes in order.
    pub fn record_use(&self, use_: TimelineFence) {
        let mut uses = self.uses.lock().unwrap_or_else(|p| p.into_inner());
        let f = use_.fence();
        match uses.iter_mut().find(|u| u.fence().stream == f.stream) {
            Some(u) if u.fence().value >= f.value => {}
            Some(u) => *u = use_,
            None => uses.push(use_),
        }
    }

    /// The latest fence of each stream that used it.
    pub fn fences(&self) -> Vec<Fence> {
        let uses = self.uses.lock().unwrap_or_else(|p| p.into_inner());
        uses.iter().map(TimelineFence::fence).collect()
    }

    /// The first use still pending: [`route`] decides, with each stream's completed value
    /// read from the timeline stored with its fence.
    pub fn first_pending(&self) -> Option<TimelineFence> {
        let uses = self.uses.lock().unwrap_or_else(|p| p.into_inner());
        let completed = |stream| {
            uses.iter()
                .find(|u| u.fence().stream == stream)
                .map_or(0, |u| u.timeline().completed())
        };
        match route(uses.iter().map(TimelineFence::fence), completed) {
            Route::FreeNow => None,
            Route::WaitOn(fence) => uses.iter().find(|u| u.fence() == fence).cloned(),
        }
    }

    /// True once every stream that used it is done with it.
    pub fn is_idle(&self) -> bool {
        self.first_pending().is_none()
    }

    /// Blocks until every stream that used it is done with it.
    pub fn wait_idle(&self) {
        while let Some(pending) = self.first_pending() {
            pending.wait_until_complete();
        }
    }

    fn take_uses(&mut self) -> Mutex<Vec<TimelineFence>> {
        Mutex::new(std::mem::take(
            &mut *self.uses.lock().unwrap_or_else(|p| p.into_inner()),
        ))
    }

    fn take(&mut self) -> Fenced<T, R> {
        Fenced {
            item: self.item.take(),
            refund: self.refund.take(),
            uses: self.take_uses(),
        }
    }

    /// Frees the item through its own mechanism once every fence that used it has
    /// completed, then settles the refund with the bytes freed, then calls `done`. The wait
    /// is a chain of wakers on the pending fences' timelines: the free runs on the thread that
    /// completes the last of them, or here if none is pending. `gate` may put a free off to a
    /// later fence.
    pub fn release_when_idle(
        mut self,
        gate: Option<Gate>,
        done: impl FnOnce(Released) + Send + 'static,
    ) {
        let waiting = self.take();
        waiting.chain(gate, None, 0, Box::new(done));
    }

    fn chain(
        mut self,
        mut gate: Option<Gate>,
        fence_done_at: Option<Instant>,
        waited_on: usize,
        done: Box<dyn FnOnce(Released) + Send>,
    ) {
        let next = self
            .first_pending()
            .or_else(|| gate.as_mut().and_then(|g| g()));
        match next {
            Some(pending) => pending.on_complete(Box::new(move |at| {
                self.chain(gate, Some(at), waited_on + 1, done)
            })),
            None => {
                let (outcome, free_took) = self.release_now();
                done(Released {
                    outcome,
                    fence_done_at,
                    waited_on,
                    free_took,
                });
            }
        }
    }

    /// Frees and settles; only called once no fence is pending. Returns the outcome and how
    /// long the free itself took.
    fn release_now(&mut self) -> (Result<u64, MemoryError>, Duration) {
        let Some(item) = self.item.take() else {
            return (Ok(0), Duration::ZERO);
        };
        // A mechanism that panics here runs on a stream's thread: it must neither take that
        // thread down nor let the refund go back for memory that may still be held.
        let started = Instant::now();
        let released = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| item.release()))
            .unwrap_or(Err(MemoryError::ReleasePanicked { what: "an item" }));
        let took = started.elapsed();
        let outcome = match released {
            Ok(freed) => {
                if let Some(refund) = self.refund.take() {
                    refund.refund(freed);
                }
                Ok(freed)
            }
            Err(error) => {
                if let Some(refund) = self.refund.take() {
                    refund.keep();
                }
                Err(error)
            }
        };
        (outcome, took)
    }
}

impl<T: Release, R: Refund> Fenced<T, R> {
    /// The same, with the item's type erased (to queue items of several kinds together).
    pub fn into_dyn(mut self) -> Fenced<dyn Release, R> {
        Fenced {
            item: self.item.take().map(|b| b as Box<dyn Release>),
            refund: self.refund.take(),
            uses: self.take_uses(),
        }
    }

    /// Takes the item back without freeing it, with its refund, once no stream uses it; the
    /// caller owns both again. Refused (handed back) while a fence is pending.
    pub fn into_parts(mut self) -> Result<(T, Option<R>), Self> {
        if !self.is_idle() {
            return Err(self);
        }
        let item = self.item.take().expect("owned until released");
        Ok((*item, self.refund.take()))
    }
}

impl<T: Release + ?Sized, R: Refund> Drop for Fenced<T, R> {
    fn drop(&mut self) {
        if self.item.is_none() {
            return;
        }
        crate::metrics::DEFERRED_FREE_ORPHANS_TOTAL
            .counter(&[])
            .increment(1);
        let orphan = self.take();
        orphan.chain(
            None,
            None,
            0,
            Box::new(|released: Released| {
                if let Err(error) = released.outcome {
                    tracing_free_error(&error);
                }
            }),
        );
    }
}

fn tracing_free_error(error: &MemoryError) {
    // The core crate has no logger: the error goes to stderr once, the charge stays.
    eprintln!("procmem: mechanism failed to free an orphaned allocation ({error}); still charged");
}

impl<T: Release + ?Sized, R: Refund> std::fmt::Debug for Fenced<T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fenced")
            .field("owned", &self.item.is_some())
            .field("charged_bytes", &self.charged_bytes())
            .field("fences", &self.fences())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::{HostTimeline, StreamId, Timeline};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    #[derive(Debug)]
    struct Item {
        bytes: u64,
        freed: Arc<AtomicU64>,
        fail: bool,
    }

    impl Release for Item {
        fn release(self: Box<Self>) -> Result<u64, MemoryError> {
            if self.fail {
                return Err(MemoryError::Injected {
                    point: "test release",
                });
            }
            self.freed.fetch_add(self.bytes, Ordering::SeqCst);
            Ok(self.bytes)
        }
    }

    #[derive(Clone, Default)]
    struct Books(Arc<Mutex<(u64, u64)>>);

    struct Charge(u64, Books);

    impl Refund for Charge {
        fn bytes(&self) -> u64 {
            self.0
        }
        fn refund(self, freed: u64) {
            self.1 .0.lock().unwrap().0 += freed.min(self.0);
        }
        fn keep(self) {
            self.1 .0.lock().unwrap().1 += self.0;
        }
    }

    fn item(bytes: u64, freed: &Arc<AtomicU64>) -> Box<Item> {
        Box::new(Item {
            bytes,
            freed: Arc::clone(freed),
            fail: false,
        })
    }

    fn stream() -> Arc<HostTimeline> {
        Arc::new(HostTimeline::new(StreamId::fresh()))
    }

    fn use_of(t: &Arc<HostTimeline>) -> (Fence, TimelineFence) {
        let f = t.signal_next();
        (
            f,
            TimelineFence::new(f, t.clone() as Arc<dyn Timeline>).unwrap(),
        )
    }

    /// Defect (issue 11, 1) at its root: a buffer used on streams of two providers is freed
    /// only after both complete, in either order, whichever queue holds it.
    #[test]
    fn freed_only_after_every_stream_of_every_provider() {
        for a_first in [true, false] {
            let (a, b) = (stream(), stream());
            let freed = Arc::new(AtomicU64::new(0));
            let books = Books::default();
            let fenced = Fenced::new(item(64, &freed), Some(Charge(64, books.clone())));
            let (fa, ua) = use_of(&a);
            let (fb, ub) = use_of(&b);
            fenced.record_use(ua);
            fenced.record_use(ub);
            let done = Arc::new(AtomicU64::new(0));
            let d = Arc::clone(&done);
            fenced.release_when_idle(None, move |r| {
                assert_eq!(r.outcome.unwrap(), 64);
                d.store(r.waited_on as u64 + 1, Ordering::SeqCst);
            });
            let (first, second) = if a_first { (&a, &b) } else { (&b, &a) };
            let (v1, v2) = if a_first {
                (fa.value, fb.value)
            } else {
                (fb.value, fa.value)
            };
            first.complete(v1);
            assert_eq!(freed.load(Ordering::SeqCst), 0, "one stream still runs");
            assert_eq!(books.0.lock().unwrap().0, 0, "no refund before the free");
            second.complete(v2);
            assert_eq!(freed.load(Ordering::SeqCst), 64);
            assert_eq!(*books.0.lock().unwrap(), (64, 0));
            assert!(done.load(Ordering::SeqCst) >= 2);
        }
    }

    #[test]
    fn dropped_unreleased_frees_after_its_fences_without_a_thread() {
        let a = stream();
        let freed = Arc::new(AtomicU64::new(0));
        let fenced: Fenced<Item, ()> = Fenced::new(item(8, &freed), None);
        let (f, u) = use_of(&a);
        fenced.record_use(u);
        drop(fenced);
        assert_eq!(freed.load(Ordering::SeqCst), 0);
        assert_eq!(a.pending_wakers(), 1, "it waits as a waker, not a thread");
        a.complete(f.value);
        assert_eq!(freed.load(Ordering::SeqCst), 8);
    }

    struct Panics;

    impl Release for Panics {
        fn release(self: Box<Self>) -> Result<u64, MemoryError> {
            panic!("a mechanism that panics while freeing")
        }
    }

    /// Review finding: a release that panicked dropped the refund, which gave back bytes the
    /// memory may still hold.
    #[test]
    fn a_release_that_panics_keeps_the_charge() {
        let books = Books::default();
        let fenced = Fenced::new(Box::new(Panics), Some(Charge(4, books.clone())));
        fenced.release_when_idle(None, |r| {
            assert!(matches!(
                r.outcome,
                Err(MemoryError::ReleasePanicked { .. })
            ))
        });
        assert_eq!(*books.0.lock().unwrap(), (0, 4));
    }

    #[test]
    fn a_failed_free_keeps_the_charge() {
        let books = Books::default();
        let fenced = Fenced::new(
            Box::new(Item {
                bytes: 4,
                freed: Arc::default(),
                fail: true,
            }),
            Some(Charge(4, books.clone())),
        );
        fenced.release_when_idle(None, |r| assert!(r.outcome.is_err()));
        assert_eq!(*books.0.lock().unwrap(), (0, 4));
    }

    #[test]
    fn a_gate_puts_the_free_off_to_a_later_fence() {
        let a = stream();
        let freed = Arc::new(AtomicU64::new(0));
        let fenced: Fenced<Item, ()> = Fenced::new(item(8, &freed), None);
        let mut once = true;
        let t = a.clone();
        let gate: Gate = Box::new(move || {
            if std::mem::take(&mut once) {
                let f = Fence {
                    stream: t.stream(),
                    value: t.completed() + 1,
                };
                TimelineFence::new(f, t.clone() as Arc<dyn Timeline>)
            } else {
                None
            }
        });
        fenced.release_when_idle(Some(gate), |_| {});
        assert_eq!(freed.load(Ordering::SeqCst), 0);
        a.complete(a.signal_next().value);
        assert_eq!(freed.load(Ordering::SeqCst), 8);
    }

    #[test]
    fn only_an_idle_item_is_handed_back() {
        let a = stream();
        let freed = Arc::new(AtomicU64::new(0));
        let fenced: Fenced<Item, ()> = Fenced::new(item(8, &freed), None);
        let (f, u) = use_of(&a);
        fenced.record_use(u);
        let fenced = fenced.into_parts().unwrap_err();
        a.complete(f.value);
        let (it, _) = fenced.into_parts().ok().unwrap();
        assert_eq!(it.bytes, 8);
        assert_eq!(freed.load(Ordering::SeqCst), 0, "handed back, not freed");
    }
}
