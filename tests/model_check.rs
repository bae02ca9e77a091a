//! # Model check of the memory protocol
//!
//! A model of one Governor, two holders and one execution provider whose buffers live on a
//! home stream (with its deferred-free queue) and may also be used on a foreign stream of
//! another provider. The checker explores every interleaving of reserve, commit (with and
//! without a top-up), cancel, pressure ticket, answer, release, submit, fence completion,
//! drop, holder death, capacity change and Governor restart within small bounds, and checks
//! the protocol's properties in every reachable state.
//!
//! ## Why stateright and not loom
//!
//! loom explores the interleavings of real threads over real atomics, mutexes and condition
//! variables; it is the right tool for the fence timeline (see `fence.rs`). This protocol is
//! different: it is message passing between actors whose mailboxes interleave arbitrarily
//! (FIFO per sender, nothing across senders), with timers, crashes and restarts. That is
//! exactly stateright's model: a nondeterministic state machine whose actions are "this
//! actor handles the next message from that sender", explored breadth first with every
//! state fingerprinted, so the reachable space is covered exhaustively and a violation
//! comes back as the path that reaches it (short, as the search is breadth first and stops
//! once the properties a test looks for are found).
//!
//! ## What is real and what is modelled
//!
//! * The books are the real [`procmem::ledger::Ledger`]: every reserve, commit, cancel,
//!   release, retire and capacity change goes through it, and every decision that depends on
//!   room (`fits`, `check_reserve`, refused top-ups, refusals of stale or retired handles)
//!   is the ledger's answer. The ledger is `Clone` but neither `Hash` nor `Eq`, and its
//!   identifiers depend on the order they were issued, so two paths to the same logical
//!   state would hash differently. The state therefore keeps a compact mirror of the books
//!   (capacity, one entry per request slot, which holders are registered) that is hashed and
//!   compared, and carries the real ledger beside it, excluded from hashing and equality.
//!   After every operation the ledger's totals, per-holder usage and per-grant and per-lease
//!   bytes are checked against the mirror and `Ledger::check_invariants` must pass; any
//!   disagreement panics, so the mirror cannot drift from the real books.
//! * Whom to ask under pressure is the real [`PressureRound::next_holder`].
//! * When a queued buffer may be freed is the real [`procmem::deferred::route`] over real
//!   [`Fence`]s; the model only chooses which "completed" lookup it is given.
//! * The Governor's admission, queue and pressure logic (the actor layer) is modelled here,
//!   after `actors/src/governor.rs`, with a flag per defect ([`Bug`]) so that a test can
//!   show the checker finds each defect with its fix reverted and nothing with every fix in.
//!
//! ## Properties
//!
//! Always: approved bytes never exceed the capacity (a lowered capacity takes nothing back
//! but nothing more is approved above it); no memory is freed while a fence that used it is
//! pending; the books equal what the holders, the deferred-free queue and the messages in
//! flight own, slot by slot (so also right after a restart rebuilt them); no waiter that fits
//! waits behind one that can never fit; pressure never idles while bytes are still wanted
//! beyond what was promised and a holder with unpromised bytes has not been asked since the
//! books last changed; no ticket asks for bytes already promised. Eventually (on every path
//! to a state with nothing left to do): every grant ends committed, cancelled or returned;
//! every waiter is granted, or denied by its deadline only when it could not fit. Both
//! eventually-conditions are stable once true, which is what stateright's path-based check
//! needs to be exact at joins of the state graph.
//!
//! ## Bounds, and why two scopes
//!
//! Capacity 4 units (lowered at most once to 2), two holders of priorities 1 and 2, requests
//! of 1 to 3 units that answer now or wait one tick, each stream signals at most one fence,
//! at most one holder dies. Time is counted in ticks left to each deadline; the clock moves
//! only while a deadline is pending, and a due timer fires before it moves on, so "by its
//! deadline" is exact. Everything at once does not fit in a minute on two cores (holders'
//! messages in flight alone multiply the space by about ten), so the fixed protocol is
//! checked in two scopes, each exhaustively:
//!
//! * [`Bounds::WIRE`]: one reservation per holder whose messages travel (one at a time), so
//!   they can be overtaken, outlive a dead holder or be lost with a restarting Governor;
//!   the Governor restarts once; buffers are used on the foreign stream; commits top up.
//! * [`Bounds::QUEUE`]: two reservations for the less important holder (so it can hold a
//!   lease while it waits for more), one for the other; holders' messages are handled as
//!   they are sent; pressure rounds, promises pending a fence on the home stream.
//!
//! ## What the checker found beyond the defects
//!
//! * Defect 3b (a no-wait request denied behind waiters) cannot fail on its own: the
//!   Governor grants waiters after every message, so the first one never fits, and free
//!   bytes covering every waiter and the request would make it fit. It shows only behind a
//!   waiter that can never fit (3a).
//! * In the fix as it is being written: [`Bug::PromisesEndWithRound`],
//!   [`Bug::PromisePerHolder`] and [`Bug::ChangeSpentMidRound`], each with a test.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use procmem::deferred::{route, Route};
use procmem::fence::{Fence, StreamId};
use procmem::ledger::{
    AuthorityId, GrantId, HolderId, LeaseId, Ledger, LedgerError, PressureRound, Priority,
};
use procmem::MemoryRole;
use stateright::{Checker, HasDiscoveries, Model, Property};

/// Holders in the model.
const HOLDERS: usize = 2;
/// Reservations each holder may make (one request slot each).
const SLOTS: usize = 2;
/// What the authority may approve at first.
const CAPACITY: u64 = 4;
/// What the operator may lower it to (once).
const LOWERED_CAPACITY: u64 = 2;
/// Holder priorities: holder 0 is the less important, so it is asked first under pressure.
const PRIORITY: [Priority; HOLDERS] = [1, 2];
/// The provider's own stream: its deferred-free queue holds the buffers.
const HOME: usize = 0;
/// A stream of another provider that the buffers may also be used on.
const FOREIGN: usize = 1;
/// Ticks a holder has to answer a ticket before the next holder is asked.
const TICKET_TIMEOUT: u8 = 1;
/// Senders into the Governor's mailbox: each holder, the deferred-free queue, and
/// supervision (holder deaths). FIFO per sender, arbitrary across senders.
const CHANNELS: usize = HOLDERS + 2;
const QUEUE_CHANNEL: usize = HOLDERS;
const SUPERVISION_CHANNEL: usize = HOLDERS + 1;

/// A defect whose fix can be reverted in the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Bug {
    /// Defect 1: the deferred-free queue asks its own provider's stream registry for each
    /// fence's completed value, and the registry answers "complete" for a stream it does not
    /// know. Fixed: each fence is read on the timeline recorded with it.
    RegistryLookup,
    /// Defect 3a: a waiter that can never fit (capacity lowered below its bytes, or its
    /// holder retired) stays in the queue and blocks everyone behind it. Fixed: denied at
    /// once.
    HopelessWaiterBlocks,
    /// Defect 3b: a request that fits is granted at once only if it outranks the first
    /// waiter. Fixed: also when the free bytes cover every waiter and it.
    NoWaitDeniedBehindWaiters,
    /// Defect 3c: a pressure round lasts until the shortfall is gone, a new waiter arrives or
    /// the capacity changes, so once every holder answered no one is asked again even after
    /// releases change the picture. Fixed (as in the Governor): a release, a new waiter or a
    /// capacity change marks the picture changed, and a round that ran out of holders then
    /// asks them all again.
    StaleRound,
    /// Defect 3d: one promised-bytes counter that any release lowers, whoever released.
    /// Fixed: promises per lease (a holder's promise is the sum of its promised leases),
    /// each settled by that lease's own release, kept across rounds.
    SharedPromise,
    /// Not one of the defects: a finding of this model about the fix as it is being
    /// written. Promises are kept inside the round, and the round ends when the shortfall
    /// vanishes; a shortfall that comes back then asks again for bytes whose release is
    /// still pending a fence.
    PromisesEndWithRound,
    /// Not one of the defects: a finding of this model about the fix as it is being
    /// written. Promises are kept per holder, so a holder's release of a lease it never
    /// promised settles the promise of another of its leases, still pending a fence.
    PromisePerHolder,
    /// Not one of the defects: a finding of this model about the fix as it is being
    /// written. The picture-changed flag is taken before asking whether the round ran out of
    /// holders, so a change seen while some holder is still to be asked is spent then, and
    /// the holders asked before the change are not asked again once the round runs out.
    ChangeSpentMidRound,
}

impl Bug {
    /// Every defect of the Governor's queue (defect 3).
    const QUEUE: [Bug; 4] = [
        Bug::HopelessWaiterBlocks,
        Bug::NoWaitDeniedBehindWaiters,
        Bug::StaleRound,
        Bug::SharedPromise,
    ];
}

/// One reservation of one holder: the unit whose life the protocol tracks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct SlotId {
    holder: usize,
    index: usize,
}

impl SlotId {
    /// Its bit in a set of slots.
    fn bit(self) -> u8 {
        1 << (self.holder * SLOTS + self.index)
    }

    fn all() -> impl Iterator<Item = SlotId> {
        (0..HOLDERS).flat_map(|holder| (0..SLOTS).map(move |index| SlotId { holder, index }))
    }
}

/// Last fence value each stream signalled for a buffer (0: never used there).
type Uses = [u8; 2];

/// Where one reservation is in its life, as the holder, the queue and the wire see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum SlotState {
    /// Not asked for yet.
    Unused,
    /// `Reserve` is in the holder's channel; `wait` is how many ticks it may wait.
    Requested { bytes: u64, wait: Option<u8> },
    /// In the Governor's wait queue.
    Waiting,
    /// The holder holds a provisional grant.
    Granted { bytes: u64, topped_up: bool },
    /// `Commit { actual }` is in the holder's channel.
    Committing { bytes: u64, actual: u64 },
    /// The grant was cancelled or dropped; `Cancel` is in the holder's channel.
    Cancelling { bytes: u64 },
    /// The holder owns the committed buffer.
    Leased { bytes: u64, uses: Uses },
    /// Dropped into the home stream's deferred-free queue, waiting for a fence.
    Queued { bytes: u64, uses: Uses },
    /// Freed by its mechanism; `Release` is on its way to the Governor.
    Releasing { bytes: u64, uses: Uses },
    /// Denied although it fitted, counting only the waiters ahead of it that could fit.
    DeniedWhileItFit,
    /// Ended: committed and released, cancelled, rolled back, justly denied, or cut off by a
    /// Governor restart. (One state for all of them keeps the space small; only an unjust
    /// denial matters to a property.)
    Done,
}

impl SlotState {
    /// The end of a denied request.
    fn denied(just: bool) -> Self {
        if just {
            SlotState::Done
        } else {
            SlotState::DeniedWhileItFit
        }
    }
}

/// A message to the Governor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Msg {
    Reserve(SlotId),
    Commit(SlotId),
    Cancel(SlotId),
    Release(SlotId),
    /// A holder's answer; `current` while it answers the ticket the Governor waits on;
    /// `pending` is the lease it dropped whose memory comes back after a fence (bytes freed
    /// now were released before, on the same channel).
    Report {
        current: bool,
        pending: Option<(SlotId, u64)>,
    },
    HolderDied(usize),
}

/// One slot's entry in the Governor's books.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Entry {
    None,
    Grant(u64),
    Lease(u64),
}

/// Why the real ledger refused.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    /// No room (a top-up that does not fit).
    Denied,
    /// A grant or lease it does not know (returned, consumed, or from another ledger), or a
    /// retired or unknown holder.
    Unknown,
}

impl From<LedgerError> for Refusal {
    fn from(e: LedgerError) -> Self {
        match e {
            LedgerError::Denied(_) => Refusal::Denied,
            LedgerError::UnknownGrant(_)
            | LedgerError::UnknownLease(_)
            | LedgerError::UnknownHolder(_)
            | LedgerError::HolderRetired(_) => Refusal::Unknown,
            other => panic!("the model never makes this request: {other}"),
        }
    }
}

/// The real ledger and the identifiers it issued, keyed by model slot.
#[derive(Clone, Debug)]
struct RealBooks {
    ledger: Ledger,
    authority: AuthorityId,
    holders: [HolderId; HOLDERS],
    grants: BTreeMap<SlotId, GrantId>,
    leases: BTreeMap<SlotId, LeaseId>,
}

/// The Governor's books: a hashable mirror plus the real ledger it is checked against.
#[derive(Clone, Debug)]
struct Books {
    capacity: u64,
    entries: [[Entry; SLOTS]; HOLDERS],
    /// Registered and not retired.
    live: [bool; HOLDERS],
    real: Arc<RealBooks>,
}

impl PartialEq for Books {
    fn eq(&self, other: &Self) -> bool {
        (self.capacity, self.entries, self.live) == (other.capacity, other.entries, other.live)
    }
}

impl Eq for Books {}

impl Hash for Books {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The real ledger is determined by the mirror up to the identifiers it issued.
        (self.capacity, self.entries, self.live).hash(state);
    }
}

impl Books {
    /// Fresh books with both holders registered.
    fn new(capacity: u64) -> Self {
        Self::rebuilt(capacity, &[], [true; HOLDERS])
    }

    /// The books of a restarted Governor: every holder registers and reports what it owns
    /// (grants and leases, including buffers waiting in a deferred-free queue); holders that
    /// are dead are retired after their memory is booked.
    fn rebuilt(capacity: u64, owned: &[(SlotId, Entry)], alive: [bool; HOLDERS]) -> Self {
        let mut ledger = Ledger::new();
        // Booking what exists cannot be refused: the capacity applies once it is booked.
        let authority = ledger.add_authority("pool", u64::MAX);
        let holders: [HolderId; HOLDERS] = std::array::from_fn(|h| {
            ledger
                .register_holder(authority, format!("holder{h}"), PRIORITY[h])
                .expect("own authority")
        });
        let mut books = Books {
            capacity: u64::MAX,
            entries: [[Entry::None; SLOTS]; HOLDERS],
            live: [true; HOLDERS],
            real: Arc::new(RealBooks {
                ledger,
                authority,
                holders,
                grants: BTreeMap::new(),
                leases: BTreeMap::new(),
            }),
        };
        for &(slot, entry) in owned {
            match entry {
                Entry::Grant(bytes) => books.reserve(slot, bytes).expect("booking a grant"),
                Entry::Lease(bytes) => {
                    books.reserve(slot, bytes).expect("booking a lease");
                    books.commit(slot, bytes).expect("booking a lease");
                }
                Entry::None => {}
            }
        }
        for h in (0..HOLDERS).filter(|&h| !alive[h]) {
            books.retire(h);
        }
        books.set_capacity(capacity);
        books
    }

    fn entry(&self, slot: SlotId) -> Entry {
        self.entries[slot.holder][slot.index]
    }

    fn set(&mut self, slot: SlotId, entry: Entry) {
        self.entries[slot.holder][slot.index] = entry;
    }

    fn holder_approved(&self, holder: usize) -> u64 {
        self.entries[holder]
            .iter()
            .map(|e| match e {
                Entry::Grant(b) | Entry::Lease(b) => *b,
                Entry::None => 0,
            })
            .sum()
    }

    fn approved(&self) -> u64 {
        (0..HOLDERS).map(|h| self.holder_approved(h)).sum()
    }

    fn free(&self) -> u64 {
        self.capacity.saturating_sub(self.approved())
    }

    fn lease_bytes(&self, slots: u8) -> u64 {
        SlotId::all()
            .filter(|s| slots & s.bit() != 0)
            .map(|s| match self.entry(s) {
                Entry::Lease(b) => b,
                _ => 0,
            })
            .sum()
    }

    /// The ledger's answer to "do `bytes` more fit now?".
    fn fits(&self, bytes: u64) -> bool {
        let fits = self
            .real
            .ledger
            .fits(self.real.authority, bytes)
            .expect("own authority");
        assert_eq!(fits, self.approved() + bytes <= self.capacity, "mirror");
        fits
    }

    fn check_reserve(&self, holder: usize, bytes: u64) -> Result<(), Refusal> {
        let real = &self.real;
        real.ledger
            .check_reserve(real.holders[holder], real.authority, bytes)
            .map_err(Refusal::from)
    }

    fn reserve(&mut self, slot: SlotId, bytes: u64) -> Result<(), Refusal> {
        let real = Arc::make_mut(&mut self.real);
        let grant = real.ledger.reserve(
            real.holders[slot.holder],
            real.authority,
            MemoryRole::KvCache,
            bytes,
        )?;
        real.grants.insert(slot, grant.id);
        self.set(slot, Entry::Grant(bytes));
        self.verify();
        Ok(())
    }

    fn commit(&mut self, slot: SlotId, actual: u64) -> Result<(), Refusal> {
        let real = Arc::make_mut(&mut self.real);
        let grant = *real.grants.get(&slot).ok_or(Refusal::Unknown)?;
        let lease = real
            .ledger
            .commit(real.holders[slot.holder], grant, actual)?;
        real.grants.remove(&slot);
        real.leases.insert(slot, lease.id);
        self.set(slot, Entry::Lease(actual));
        self.verify();
        Ok(())
    }

    /// Returns the grant; the bytes it held.
    fn cancel(&mut self, slot: SlotId) -> Result<u64, Refusal> {
        let real = Arc::make_mut(&mut self.real);
        let grant = *real.grants.get(&slot).ok_or(Refusal::Unknown)?;
        let bytes = real.ledger.cancel(real.holders[slot.holder], grant)?;
        real.grants.remove(&slot);
        self.set(slot, Entry::None);
        self.verify();
        Ok(bytes)
    }

    fn release(&mut self, slot: SlotId, bytes: u64) -> Result<(), Refusal> {
        let real = Arc::make_mut(&mut self.real);
        let lease = *real.leases.get(&slot).ok_or(Refusal::Unknown)?;
        let left = real
            .ledger
            .release(real.holders[slot.holder], lease, bytes)?;
        assert_eq!(left, 0, "the model releases whole leases");
        real.leases.remove(&slot);
        self.set(slot, Entry::None);
        self.verify();
        Ok(())
    }

    /// Retires a holder; the bytes of the grants that came back.
    fn retire(&mut self, holder: usize) -> u64 {
        let real = Arc::make_mut(&mut self.real);
        let retired = real
            .ledger
            .retire_holder(real.holders[holder])
            .expect("a live holder");
        // The holder's grant identifiers stay where they are: presenting one later is
        // refused by the ledger, as a stale handle is.
        for index in 0..SLOTS {
            if let Entry::Grant(_) = self.entries[holder][index] {
                self.entries[holder][index] = Entry::None;
            }
        }
        self.live[holder] = false;
        self.verify();
        retired.grants_returned.iter().map(|(_, b)| b).sum()
    }

    fn set_capacity(&mut self, capacity: u64) {
        let real = Arc::make_mut(&mut self.real);
        real.ledger
            .set_capacity(real.authority, capacity)
            .expect("own authority");
        self.capacity = capacity;
        self.verify();
    }

    /// The real policy's choice of whom to ask next, given who was asked this round.
    fn next_holder(&self, asked: u8) -> Option<usize> {
        let real = &self.real;
        let holders = real.ledger.holders_of(real.authority);
        let mut round = PressureRound::default();
        for h in (0..HOLDERS).filter(|h| asked & (1 << h) != 0) {
            round.asked(real.holders[h]);
        }
        let chosen = round.next_holder(&holders)?;
        real.holders.iter().position(|&id| id == chosen)
    }

    /// Panics unless the real ledger agrees with the mirror in every number.
    fn verify(&self) {
        let real = &self.real;
        let ledger = &real.ledger;
        ledger.check_invariants().expect("ledger invariants");
        let procmem::ledger::Totals {
            capacity,
            provisional,
            leased,
        } = ledger.totals(real.authority).expect("authority");
        let mut mirror = (0, 0);
        for slot in SlotId::all() {
            match self.entry(slot) {
                Entry::Grant(b) => {
                    mirror.0 += b;
                    let id = real.grants[&slot];
                    assert_eq!(ledger.grant(id).map(|c| c.bytes), Some(b), "{slot:?}");
                }
                Entry::Lease(b) => {
                    mirror.1 += b;
                    let id = real.leases[&slot];
                    assert_eq!(ledger.lease(id).map(|c| c.bytes), Some(b), "{slot:?}");
                }
                Entry::None => {}
            }
        }
        assert_eq!(
            (provisional, leased),
            mirror,
            "ledger totals against the mirror"
        );
        assert_eq!(self.capacity, capacity, "capacity");
        let live: Vec<HolderId> = ledger
            .holders_of(real.authority)
            .into_iter()
            .map(|h| h.holder)
            .collect();
        for h in 0..HOLDERS {
            assert_eq!(
                live.contains(&real.holders[h]),
                self.live[h],
                "holder {h} live"
            );
        }
        for usage in ledger.top_holders(real.authority, usize::MAX) {
            let h = real
                .holders
                .iter()
                .position(|&id| id == usage.holder)
                .expect("a model holder");
            assert_eq!(usage.total(), self.holder_approved(h), "holder {h} usage");
        }
    }
}

/// A short sequence kept inline, so that cloning a state allocates nothing (the checker
/// clones one per transition, millions of times).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seq<T: Copy, const N: usize> {
    len: usize,
    /// `Some` below `len`, `None` from there on.
    items: [Option<T>; N],
}

impl<T: Copy, const N: usize> Default for Seq<T, N> {
    fn default() -> Self {
        Seq {
            len: 0,
            items: [None; N],
        }
    }
}

impl<T: Copy + Hash, const N: usize> Hash for Seq<T, N> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.len.hash(state);
        self.iter().for_each(|x| x.hash(state));
    }
}

impl<T: Copy, const N: usize> Seq<T, N> {
    fn iter(&self) -> impl Iterator<Item = &T> {
        self.items[..self.len].iter().flatten()
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn get(&self, at: usize) -> Option<T> {
        self.items.get(at).copied().flatten()
    }

    fn first(&self) -> Option<&T> {
        self.items[0].as_ref()
    }

    fn push(&mut self, item: T) {
        self.insert(self.len, item);
    }

    fn insert(&mut self, at: usize, item: T) {
        assert!(self.len < N, "the model's bound of {N} was exceeded");
        self.items[at..=self.len].rotate_right(1);
        self.items[at] = Some(item);
        self.len += 1;
    }

    fn remove(&mut self, at: usize) -> T {
        let item = self.items[at].take().expect("in range");
        self.items[at..self.len].rotate_left(1);
        self.len -= 1;
        item
    }
}

/// A request waiting for room.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Waiter {
    slot: SlotId,
    bytes: u64,
    /// Ticks left until its deadline.
    left: u8,
}

/// The current pressure round.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
struct Round {
    /// Holders asked in this round (bits).
    asked: u8,
    /// Its promises, under [`Bug::PromisesEndWithRound`].
    promises: Promises,
}

/// Bytes holders promised to release once a fence completes, as the Governor counts them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
struct Promises {
    /// Promised leases (fixed): each counts while it is on the books.
    leases: u8,
    /// Promised bytes per holder ([`Bug::PromisePerHolder`]) or in one counter at index 0
    /// ([`Bug::SharedPromise`]).
    bytes: [u64; HOLDERS],
}

/// What changed in the books, for deciding whom to ask again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Change {
    Release,
    NewWaiter,
    Capacity,
}

/// The ticket the Governor waits on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Ticket {
    holder: usize,
    /// Ticks left until it times out.
    left: u8,
}

/// The Governor actor's state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Governor {
    books: Books,
    /// In service order: priority (highest first), then arrival.
    waiters: Seq<Waiter, 4>,
    round: Option<Round>,
    /// Memory was released, a waiter arrived or the capacity changed since holders were
    /// last asked (fixed [`Bug::StaleRound`]): once the round runs out of holders, it asks
    /// them again.
    picture_changed: bool,
    /// Promises, kept across rounds (fixed [`Bug::PromisesEndWithRound`]).
    promises: Promises,
    /// The outstanding ticket.
    ticket: Option<Ticket>,
}

impl Governor {
    fn new(books: Books) -> Self {
        Governor {
            books,
            waiters: Seq::default(),
            round: None,
            picture_changed: false,
            promises: Promises::default(),
            ticket: None,
        }
    }

    fn waiting_bytes(&self) -> u64 {
        self.waiters.iter().map(|w| w.bytes).sum()
    }

    /// Whether the Governor knows the waiter can still fit some day.
    fn can_fit(&self, w: &Waiter) -> bool {
        w.bytes <= self.books.capacity && self.books.live[w.slot.holder]
    }

    /// Bytes wanted by the waiters that can still fit.
    fn hopeful_bytes(&self) -> u64 {
        self.waiters
            .iter()
            .filter(|w| self.can_fit(w))
            .map(|w| w.bytes)
            .sum()
    }

    /// Whether a denial of the waiter at `index` is just: it did not fit even counting only
    /// the waiters ahead of it that can still fit.
    fn denial_is_just(&self, index: usize) -> bool {
        let w = &self.waiters.get(index).expect("a waiter");
        if !self.can_fit(w) {
            return true;
        }
        let ahead: u64 = self
            .waiters
            .iter()
            .take(index + 1)
            .filter(|w| self.can_fit(w))
            .map(|w| w.bytes)
            .sum();
        self.books.free() < ahead
    }
}

/// What the environment has done (each is bounded).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
struct Env {
    capacity_lowered: bool,
    deaths: u8,
    restarts: u8,
}

/// Bookkeeping for properties that are about events, not states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Ghost {
    /// What `approved` may legitimately reach: the capacity, or what was already approved
    /// when the capacity fell below it (lowering takes nothing back), shrinking with every
    /// byte returned.
    approval_bound: u64,
    /// Holders consulted since the books last changed in a way that could let a holder give
    /// more (a release, a new waiter, a capacity change, a restart) or since the shortfall
    /// last vanished: asked since, or asked before and still to answer.
    asked: u8,
    /// Leases promised to this Governor by a report (the truth the Governor should track).
    promised: u8,
    /// A ticket asked for bytes that were already promised.
    over_asked: bool,
}

/// The whole system.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    slots: [[SlotState; SLOTS]; HOLDERS],
    alive: [bool; HOLDERS],
    /// The ticket each holder has received and not answered: `true` while it is the one the
    /// Governor waits on. (A newer ticket supersedes an unanswered older one: the holder
    /// answers the latest question. Tickets carry no number: only whether a report answers
    /// the outstanding ticket matters, and numbers would only tell equal states apart.)
    inbox: [Option<bool>; HOLDERS],
    mail: [Seq<Msg, 8>; CHANNELS],
    signalled: [u8; 2],
    completed: [u8; 2],
    gov: Governor,
    env: Env,
    ghost: Ghost,
}

impl State {
    fn slot(&self, slot: SlotId) -> SlotState {
        self.slots[slot.holder][slot.index]
    }

    fn set(&mut self, slot: SlotId, state: SlotState) {
        self.slots[slot.holder][slot.index] = state;
    }

    /// Whether the holder awaits the answer to a call (one at a time).
    fn awaiting(&self, holder: usize) -> bool {
        self.slots[holder].iter().any(|s| {
            matches!(
                s,
                SlotState::Requested { .. } | SlotState::Waiting | SlotState::Committing { .. }
            )
        })
    }

    /// Whether every fence that used a buffer has completed (the truth).
    fn idle(&self, uses: Uses) -> bool {
        (0..2).all(|s| uses[s] <= self.completed[s])
    }

    fn hopeless_waiter_blocks_one_that_fits(&self) -> bool {
        let gov = &self.gov;
        let free = gov.books.free();
        let mut ahead = 0;
        let mut hopeless_ahead = false;
        for w in gov.waiters.iter() {
            if !gov.can_fit(w) {
                hopeless_ahead = true;
                continue;
            }
            ahead += w.bytes;
            if hopeless_ahead && ahead <= free {
                return true;
            }
        }
        false
    }

    /// Pressure is idle although bytes are still wanted beyond what was promised and a live
    /// holder holding bytes it has not promised has not been asked since the books last
    /// changed.
    fn pressure_stalled(&self) -> bool {
        let gov = &self.gov;
        if gov.ticket.is_some() {
            return false;
        }
        let books = &gov.books;
        let shortfall = (books.approved() + gov.hopeful_bytes()).saturating_sub(books.capacity);
        let wanted = shortfall.saturating_sub(books.lease_bytes(self.ghost.promised));
        wanted > 0
            && (0..HOLDERS).any(|h| {
                let own = ((1u8 << SLOTS) - 1) << (h * SLOTS);
                let unpromised =
                    books.holder_approved(h) - books.lease_bytes(self.ghost.promised & own);
                books.live[h] && unpromised > 0 && self.ghost.asked & (1 << h) == 0
            })
    }

    /// Every slot's entry in the books agrees with what its holder, the queue and the wire
    /// hold.
    fn books_match_what_is_owned(&self) -> bool {
        SlotId::all().all(|slot| {
            let owned = self.slot(slot);
            match self.gov.books.entry(slot) {
                Entry::Grant(b) => matches!(owned,
                    SlotState::Granted { bytes, .. }
                    | SlotState::Committing { bytes, .. }
                    | SlotState::Cancelling { bytes } if bytes == b),
                Entry::Lease(b) => matches!(owned,
                    SlotState::Leased { bytes, .. }
                    | SlotState::Queued { bytes, .. }
                    | SlotState::Releasing { bytes, .. } if bytes == b),
                Entry::None => match owned {
                    SlotState::Granted { .. }
                    | SlotState::Leased { .. }
                    | SlotState::Queued { .. }
                    | SlotState::Releasing { .. } => false,
                    // A grant being committed by a holder the Governor knows to be alive.
                    SlotState::Committing { .. } => !self.gov.books.live[slot.holder],
                    _ => true,
                },
            }
        })
    }

    /// No reservation can still be made or is still outstanding.
    fn requests_over(&self, reserves: [usize; HOLDERS]) -> bool {
        SlotId::all().all(|slot| match self.slot(slot) {
            SlotState::Unused => !self.alive[slot.holder] || slot.index >= reserves[slot.holder],
            SlotState::Requested { .. } | SlotState::Waiting => false,
            _ => true,
        })
    }
}

/// How much of the protocol one run explores. Two scopes cover every action between them;
/// each is explored exhaustively (see the module documentation for why there are two).
#[derive(Clone, Copy, Debug)]
struct Bounds {
    /// Reservations each holder may make (at most [`SLOTS`]).
    reserves: [usize; HOLDERS],
    /// Sizes a holder may reserve.
    sizes: &'static [u64],
    /// How long a request may wait, in ticks (`None`: answer now).
    waits: &'static [Option<u8>],
    /// Fences each stream (home, foreign) may signal.
    signals: [u8; 2],
    /// Whether a commit may ask for one unit more than granted (once per grant).
    top_up: bool,
    /// Whether the operator may lower the capacity (once).
    capacity_drop: bool,
    /// Holders that may die.
    deaths: u8,
    /// Times the Governor may restart.
    restarts: u8,
    /// How many of its messages a holder may have in flight before it sends another
    /// (answering a ticket may add a release and a report at once); `None`: a holder's
    /// message is handled as it is sent.
    holder_mail: Option<usize>,
}

impl Bounds {
    /// The wire: holders' messages travel (and can be overtaken, outlive their sender, or be
    /// lost with a dying Governor), the Governor restarts, buffers are used on the foreign
    /// stream, commits top up; one reservation per holder.
    const WIRE: Bounds = Bounds {
        reserves: [1, 1],
        sizes: &[1, 2, 3],
        waits: &[None, Some(1)],
        signals: [1, 1],
        top_up: true,
        capacity_drop: true,
        deaths: 1,
        restarts: 1,
        holder_mail: Some(1),
    };

    /// The queue: two reservations for the less important holder (so it can hold a lease
    /// while it waits for more), pressure rounds, promises pending a fence on the home
    /// stream; holders' messages are handled as they are sent.
    const QUEUE: Bounds = Bounds {
        reserves: [2, 1],
        sizes: &[1, 2, 3],
        waits: &[None, Some(1)],
        signals: [1, 0],
        top_up: false,
        capacity_drop: true,
        deaths: 1,
        restarts: 0,
        holder_mail: None,
    };
}

/// The model: which fixes are reverted, and the bounds.
struct Protocol {
    bugs: BTreeSet<Bug>,
    bounds: Bounds,
    /// The two streams: home (index 0) and foreign (index 1).
    streams: [StreamId; 2],
}

/// Everything that can happen next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Reserve {
        holder: usize,
        bytes: u64,
        wait: Option<u8>,
    },
    Commit {
        slot: SlotId,
        actual: u64,
    },
    Cancel(SlotId),
    /// Work using the buffer on a stream; it signals the stream's next fence.
    Submit {
        slot: SlotId,
        stream: usize,
    },
    /// The owning buffer is dropped into the home stream's deferred-free queue.
    Drop(SlotId),
    /// The holder answers the ticket it holds, freeing one buffer or nothing.
    Answer {
        holder: usize,
        free: Option<SlotId>,
    },
    /// The Governor handles the next message from one sender.
    Deliver(usize),
    WaiterDeadline(SlotId),
    TicketDeadline,
    Tick,
    /// A stream completes its next fence.
    Complete(usize),
    LowerCapacity,
    Kill(usize),
    RestartGovernor,
}

impl Protocol {
    /// The protocol within `bounds`, with the fixes of `bugs` reverted.
    fn new(bounds: Bounds, bugs: &[Bug]) -> Self {
        Protocol {
            bugs: bugs.iter().copied().collect(),
            bounds,
            streams: [StreamId::fresh(), StreamId::fresh()],
        }
    }

    fn has(&self, bug: Bug) -> bool {
        self.bugs.contains(&bug)
    }

    /// Whether the queue frees a buffer last used at `uses` now, by the real routing rule.
    fn may_free(&self, s: &State, uses: Uses) -> bool {
        let fences: Vec<Fence> = (0..2)
            .filter(|&i| uses[i] > 0)
            .map(|i| Fence {
                stream: self.streams[i],
                value: u64::from(uses[i]),
            })
            .collect();
        let completed = |stream: StreamId| {
            let i = self
                .streams
                .iter()
                .position(|&id| id == stream)
                .expect("a model stream");
            if self.has(Bug::RegistryLookup) && i != HOME {
                // The home provider's registry does not know the foreign stream.
                u64::MAX
            } else {
                // The timeline recorded with the fence.
                u64::from(s.completed[i])
            }
        };
        route(fences.iter().copied(), completed) == Route::FreeNow
    }

    /// A buffer reaches the deferred-free queue: freed now (its release sent) or queued.
    fn enqueue(&self, s: &mut State, slot: SlotId, bytes: u64, uses: Uses) {
        if self.may_free(s, uses) {
            s.set(slot, SlotState::Releasing { bytes, uses });
            s.mail[QUEUE_CHANNEL].push(Msg::Release(slot));
        } else {
            s.set(slot, SlotState::Queued { bytes, uses });
        }
    }

    /// Where the Governor keeps its promises (none while there is no round, if they live
    /// in the round).
    fn promises<'g>(&self, gov: &'g mut Governor) -> Option<&'g mut Promises> {
        if self.has(Bug::PromisesEndWithRound) {
            gov.round.as_mut().map(|r| &mut r.promises)
        } else {
            Some(&mut gov.promises)
        }
    }

    /// After the books changed so that a holder may be able to give more.
    fn books_changed(&self, s: &mut State, change: Change) {
        // Only the holder whose answer is still to come has been consulted since.
        s.ghost.asked = s.gov.ticket.map_or(0, |t| 1 << t.holder);
        if !self.has(Bug::StaleRound) {
            s.gov.picture_changed = true;
        } else if change != Change::Release {
            // The old Governor started a fresh round only for a waiter or a capacity change.
            s.gov.round = None;
        }
    }

    /// Bytes came back to the books (a release or a returned grant).
    fn returned(s: &mut State) {
        let approved = s.gov.books.approved();
        let capacity = s.gov.books.capacity;
        s.ghost.approval_bound = capacity.max(s.ghost.approval_bound.min(approved));
    }

    fn grant(s: &mut State, slot: SlotId, bytes: u64) {
        match s.gov.books.reserve(slot, bytes) {
            Ok(()) if s.alive[slot.holder] => s.set(
                slot,
                SlotState::Granted {
                    bytes,
                    topped_up: false,
                },
            ),
            Ok(()) => {
                // The reply cannot be delivered: the grant goes straight back.
                s.gov.books.cancel(slot).expect("just granted");
                s.set(slot, SlotState::Done);
            }
            // A retired holder can never be granted.
            Err(Refusal::Unknown) => s.set(slot, SlotState::Done),
            Err(Refusal::Denied) => unreachable!("granted only when it fits"),
        }
    }

    fn handle_reserve(&self, s: &mut State, slot: SlotId) {
        let SlotState::Requested { bytes, wait } = s.slot(slot) else {
            unreachable!("a reserve message for a requested slot")
        };
        if s.gov.books.check_reserve(slot.holder, bytes).is_err() {
            s.set(slot, SlotState::Done);
            return;
        }
        let gov = &s.gov;
        let fits = gov.books.fits(bytes);
        let may_jump = gov
            .waiters
            .first()
            .is_none_or(|front| PRIORITY[slot.holder] > PRIORITY[front.slot.holder]);
        let covers_all = gov.books.free() >= gov.waiting_bytes() + bytes;
        if fits && (may_jump || (covers_all && !self.has(Bug::NoWaitDeniedBehindWaiters))) {
            Self::grant(s, slot, bytes);
            return;
        }
        match wait {
            Some(ticks) if bytes <= gov.books.capacity => {
                let at = gov
                    .waiters
                    .iter()
                    .position(|w| PRIORITY[w.slot.holder] < PRIORITY[slot.holder])
                    .unwrap_or(gov.waiters.len);
                s.gov.waiters.insert(
                    at,
                    Waiter {
                        slot,
                        bytes,
                        left: ticks,
                    },
                );
                s.set(slot, SlotState::Waiting);
                self.books_changed(s, Change::NewWaiter);
            }
            _ => {
                let just = gov.books.free() < gov.hopeful_bytes() + bytes;
                s.set(slot, SlotState::denied(just));
            }
        }
    }

    fn handle_commit(&self, s: &mut State, slot: SlotId) {
        let SlotState::Committing { bytes, actual } = s.slot(slot) else {
            unreachable!("a commit message for a committing slot")
        };
        let alive = s.alive[slot.holder];
        match s.gov.books.commit(slot, actual) {
            Ok(()) if alive => s.set(
                slot,
                SlotState::Leased {
                    bytes: actual,
                    uses: [0; 2],
                },
            ),
            Ok(()) => {
                // The caller is gone: nobody owns the lease, so it goes back whole.
                s.gov.books.release(slot, actual).expect("just leased");
                s.set(slot, SlotState::Done);
                Self::returned(s);
            }
            Err(Refusal::Denied) if alive => s.set(
                slot,
                SlotState::Granted {
                    bytes,
                    topped_up: true,
                },
            ),
            // Dead: the dropped grant's `Cancel` follows on the same channel.
            Err(Refusal::Denied) => s.set(slot, SlotState::Cancelling { bytes }),
            // Dead, and its grants were returned when it was retired.
            Err(Refusal::Unknown) if !alive => s.set(slot, SlotState::Done),
            Err(Refusal::Unknown) => panic!("a live holder's grant is unknown: {slot:?}"),
        }
    }

    fn handle_cancel(&self, s: &mut State, slot: SlotId) {
        let returned = s.gov.books.cancel(slot).unwrap_or(0);
        if let SlotState::Cancelling { .. } = s.slot(slot) {
            s.set(slot, SlotState::Done);
        }
        if returned > 0 {
            Self::returned(s);
        }
    }

    fn handle_release(&self, s: &mut State, slot: SlotId) {
        let SlotState::Releasing { bytes, .. } = s.slot(slot) else {
            unreachable!("a release message for a freed slot")
        };
        s.gov
            .books
            .release(slot, bytes)
            .expect("a lease on the books");
        s.set(slot, SlotState::Done);
        if let Some(promises) = self.promises(&mut s.gov) {
            // The one counter whoever released, the holder's, or the lease's own promise.
            let who = match (
                self.has(Bug::SharedPromise),
                self.has(Bug::PromisePerHolder),
            ) {
                (true, _) => Some(0),
                (false, true) => Some(slot.holder),
                (false, false) => None,
            };
            if let Some(who) = who {
                promises.bytes[who] = promises.bytes[who].saturating_sub(bytes);
            }
            promises.leases &= !slot.bit();
        }
        s.ghost.promised &= !slot.bit();
        Self::returned(s);
        self.books_changed(s, Change::Release);
    }

    fn handle_report(&self, s: &mut State, current: bool, pending: Option<(SlotId, u64)>) {
        if let Some((slot, bytes)) = pending {
            let on_books = matches!(s.gov.books.entry(slot), Entry::Lease(_));
            let shared = self.has(Bug::SharedPromise);
            let per_holder = self.has(Bug::PromisePerHolder);
            if let Some(promises) = self.promises(&mut s.gov) {
                if shared || per_holder {
                    promises.bytes[if shared { 0 } else { slot.holder }] += bytes;
                } else if on_books {
                    promises.leases |= slot.bit();
                }
            }
            if on_books {
                s.ghost.promised |= slot.bit();
            }
        }
        if current {
            s.gov.ticket = None;
        }
    }

    fn handle_set_capacity(&self, s: &mut State, capacity: u64) {
        s.gov.books.set_capacity(capacity);
        s.ghost.approval_bound = capacity.max(s.gov.books.approved());
        self.books_changed(s, Change::Capacity);
    }

    fn handle_died(&self, s: &mut State, holder: usize) {
        let returned = s.gov.books.retire(holder);
        if returned > 0 {
            Self::returned(s);
        }
    }

    /// Grants waiters in order while the first fits (after denying those that never can).
    fn pump(&self, s: &mut State) {
        if !self.has(Bug::HopelessWaiterBlocks) {
            let mut i = 0;
            while let Some(w) = s.gov.waiters.get(i) {
                if s.gov.can_fit(&w) {
                    i += 1;
                } else {
                    s.gov.waiters.remove(i);
                    s.set(w.slot, SlotState::Done);
                }
            }
        }
        while let Some(&front) = s.gov.waiters.first() {
            if !s.gov.books.fits(front.bytes) {
                break;
            }
            s.gov.waiters.remove(0);
            Self::grant(s, front.slot, front.bytes);
        }
    }

    /// Asks the next holder for the shortfall, one ticket at a time.
    fn drive_pressure(&self, s: &mut State) {
        if s.gov.ticket.is_some() {
            return;
        }
        let books = &s.gov.books;
        let shortfall = (books.approved() + s.gov.waiting_bytes()).saturating_sub(books.capacity);
        if shortfall == 0 {
            s.gov.round = None;
            s.ghost.asked = 0;
            return;
        }
        let mut round = s.gov.round.unwrap_or_default();
        let promises = if self.has(Bug::PromisesEndWithRound) {
            round.promises
        } else {
            s.gov.promises
        };
        let counted = promises.bytes.iter().sum::<u64>() + books.lease_bytes(promises.leases);
        // Bytes promised and not yet released are expected: not asked for twice.
        let wanted = shortfall.saturating_sub(counted);
        let truth = books.lease_bytes(s.ghost.promised);
        let mut sent = None;
        if wanted > 0 {
            if self.has(Bug::ChangeSpentMidRound) {
                // As written: the flag is taken whether or not the round has run out.
                let changed = std::mem::take(&mut s.gov.picture_changed);
                if changed && books.next_holder(round.asked).is_none() {
                    round.asked = 0;
                }
            }
            let mut asked_again = false;
            loop {
                match books.next_holder(round.asked) {
                    Some(holder) => {
                        round.asked |= 1 << holder;
                        s.ghost.asked |= 1 << holder;
                        // A ticket to a dead actor cannot be sent: the next holder is asked.
                        if s.alive[holder] {
                            sent = Some(holder);
                            break;
                        }
                    }
                    // The round ran out (perhaps only now, on tickets that could not be
                    // sent): if the picture changed meanwhile, everyone is asked again.
                    None if !asked_again
                        && !self.has(Bug::ChangeSpentMidRound)
                        && std::mem::take(&mut s.gov.picture_changed) =>
                    {
                        round.asked = 0;
                        asked_again = true;
                    }
                    None => break,
                }
            }
        }
        s.gov.round = Some(round);
        if let Some(holder) = sent {
            if wanted > shortfall.saturating_sub(truth) {
                s.ghost.over_asked = true;
            }
            let front = s.gov.waiters.first().map_or(u8::MAX, |w| w.left);
            s.gov.ticket = Some(Ticket {
                holder,
                left: front.min(TICKET_TIMEOUT),
            });
            s.inbox[holder] = Some(true);
        }
    }

    fn deliver(&self, s: &mut State, channel: usize) {
        match s.mail[channel].remove(0) {
            Msg::Reserve(slot) => self.handle_reserve(s, slot),
            Msg::Commit(slot) => self.handle_commit(s, slot),
            Msg::Cancel(slot) => self.handle_cancel(s, slot),
            Msg::Release(slot) => self.handle_release(s, slot),
            Msg::Report { current, pending } => self.handle_report(s, current, pending),
            Msg::HolderDied(holder) => self.handle_died(s, holder),
        }
    }

    /// The Governor dies with its mailbox and comes back with books rebuilt from what every
    /// holder and queue reports it owns.
    fn restart(s: &mut State) {
        for channel in 0..CHANNELS {
            for &msg in std::mem::take(&mut s.mail[channel]).iter() {
                match msg {
                    Msg::Commit(slot) => {
                        // The call failed: a live holder keeps its grant and may retry.
                        if let SlotState::Committing { bytes, actual } = s.slot(slot) {
                            let next = if s.alive[slot.holder] {
                                SlotState::Granted {
                                    bytes,
                                    topped_up: actual > bytes,
                                }
                            } else {
                                SlotState::Done
                            };
                            s.set(slot, next);
                        }
                    }
                    // The call failed; or the grant or the memory is gone, the message with it.
                    Msg::Reserve(slot) | Msg::Cancel(slot) | Msg::Release(slot) => {
                        s.set(slot, SlotState::Done);
                    }
                    Msg::Report { .. } | Msg::HolderDied(_) => {}
                }
            }
        }
        for &w in std::mem::take(&mut s.gov.waiters).iter() {
            s.set(w.slot, SlotState::Done);
        }
        s.inbox = [None; HOLDERS];
        let owned: Vec<(SlotId, Entry)> = SlotId::all()
            .filter_map(|slot| match s.slot(slot) {
                SlotState::Granted { bytes, .. } => Some((slot, Entry::Grant(bytes))),
                SlotState::Leased { bytes, .. } | SlotState::Queued { bytes, .. } => {
                    Some((slot, Entry::Lease(bytes)))
                }
                SlotState::Unused | SlotState::DeniedWhileItFit | SlotState::Done => None,
                other => panic!("{slot:?} still {other:?} after the mailbox was dropped"),
            })
            .collect();
        let capacity = if s.env.capacity_lowered {
            LOWERED_CAPACITY
        } else {
            CAPACITY
        };
        s.gov = Governor::new(Books::rebuilt(capacity, &owned, s.alive));
        s.ghost.asked = 0;
        s.ghost.promised = 0;
        s.ghost.approval_bound = capacity.max(s.gov.books.approved());
        s.env.restarts += 1;
    }

    fn timer_due(s: &State) -> bool {
        s.gov.waiters.iter().any(|w| w.left == 0) || s.gov.ticket.is_some_and(|t| t.left == 0)
    }

    /// The outstanding ticket timed out: answers to it are stale from now on.
    fn ticket_timed_out(s: &mut State) {
        if let Some(t) = s.gov.ticket.take() {
            if let Some(current) = &mut s.inbox[t.holder] {
                *current = false;
            }
            for msg in s.mail[t.holder].items.iter_mut().flatten() {
                if let Msg::Report { current, .. } = msg {
                    *current = false;
                }
            }
        }
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            slots: [[SlotState::Unused; SLOTS]; HOLDERS],
            alive: [true; HOLDERS],
            inbox: [None; HOLDERS],
            mail: Default::default(),
            signalled: [0; 2],
            completed: [0; 2],
            gov: Governor::new(Books::new(CAPACITY)),
            env: Env::default(),
            ghost: Ghost {
                approval_bound: CAPACITY,
                asked: 0,
                promised: 0,
                over_asked: false,
            },
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        for holder in (0..HOLDERS).filter(|&h| s.alive[h]) {
            // A holder sends only while fewer than the bound of its messages are in flight.
            let may_send = self
                .bounds
                .holder_mail
                .is_none_or(|n| s.mail[holder].len < n);
            let awaiting = s.awaiting(holder) || !may_send;
            if !awaiting
                && s.slots[holder][..self.bounds.reserves[holder]].contains(&SlotState::Unused)
            {
                for &bytes in self.bounds.sizes {
                    for &wait in self.bounds.waits {
                        actions.push(Action::Reserve {
                            holder,
                            bytes,
                            wait,
                        });
                    }
                }
            }
            for index in 0..SLOTS {
                let slot = SlotId { holder, index };
                match s.slot(slot) {
                    SlotState::Granted { bytes, topped_up } => {
                        if !awaiting {
                            actions.push(Action::Commit {
                                slot,
                                actual: bytes,
                            });
                            if !topped_up && self.bounds.top_up {
                                actions.push(Action::Commit {
                                    slot,
                                    actual: bytes + 1,
                                });
                            }
                        }
                        if may_send {
                            actions.push(Action::Cancel(slot));
                        }
                    }
                    SlotState::Leased { uses, .. } => {
                        for stream in [HOME, FOREIGN] {
                            if s.signalled[stream] < self.bounds.signals[stream]
                                && uses[stream] == 0
                            {
                                actions.push(Action::Submit { slot, stream });
                            }
                        }
                        actions.push(Action::Drop(slot));
                    }
                    _ => {}
                }
            }
            if s.inbox[holder].is_some() && may_send {
                actions.push(Action::Answer { holder, free: None });
                for index in 0..SLOTS {
                    let slot = SlotId { holder, index };
                    if let SlotState::Leased { .. } = s.slot(slot) {
                        actions.push(Action::Answer {
                            holder,
                            free: Some(slot),
                        });
                    }
                }
            }
        }
        for channel in 0..CHANNELS {
            if !s.mail[channel].is_empty() {
                actions.push(Action::Deliver(channel));
            }
        }
        for w in s.gov.waiters.iter().filter(|w| w.left == 0) {
            actions.push(Action::WaiterDeadline(w.slot));
        }
        if s.gov.ticket.is_some_and(|t| t.left == 0) {
            actions.push(Action::TicketDeadline);
        }
        if (!s.gov.waiters.is_empty() || s.gov.ticket.is_some()) && !Self::timer_due(s) {
            actions.push(Action::Tick);
        }
        for stream in [HOME, FOREIGN] {
            if s.completed[stream] < s.signalled[stream] {
                actions.push(Action::Complete(stream));
            }
        }
        // The environment acts only while something else can still happen: at rest nothing
        // is owned, so a death, a restart or a smaller capacity would change nothing, and
        // offering them would leave no path at rest without them (a restart rebuilds the
        // books, which would hide a leak from the eventually-properties).
        if actions.is_empty() {
            return;
        }
        if self.bounds.capacity_drop && !s.env.capacity_lowered {
            actions.push(Action::LowerCapacity);
        }
        if s.env.deaths < self.bounds.deaths {
            for holder in (0..HOLDERS).filter(|&h| s.alive[h]) {
                actions.push(Action::Kill(holder));
            }
        }
        if s.env.restarts < self.bounds.restarts {
            actions.push(Action::RestartGovernor);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Reserve {
                holder,
                bytes,
                wait,
            } => {
                let index = s.slots[holder]
                    .iter()
                    .position(|x| *x == SlotState::Unused)?;
                let slot = SlotId { holder, index };
                s.set(slot, SlotState::Requested { bytes, wait });
                s.mail[holder].push(Msg::Reserve(slot));
            }
            Action::Commit { slot, actual } => {
                let SlotState::Granted { bytes, .. } = s.slot(slot) else {
                    return None;
                };
                s.set(slot, SlotState::Committing { bytes, actual });
                s.mail[slot.holder].push(Msg::Commit(slot));
            }
            Action::Cancel(slot) => {
                let SlotState::Granted { bytes, .. } = s.slot(slot) else {
                    return None;
                };
                s.set(slot, SlotState::Cancelling { bytes });
                s.mail[slot.holder].push(Msg::Cancel(slot));
            }
            Action::Submit { slot, stream } => {
                let SlotState::Leased { bytes, mut uses } = s.slot(slot) else {
                    return None;
                };
                s.signalled[stream] += 1;
                uses[stream] = s.signalled[stream];
                s.set(slot, SlotState::Leased { bytes, uses });
            }
            Action::Drop(slot) => {
                let SlotState::Leased { bytes, uses } = s.slot(slot) else {
                    return None;
                };
                self.enqueue(&mut s, slot, bytes, uses);
            }
            Action::Answer { holder, free } => {
                let current = s.inbox[holder].take()?;
                let mut pending = None;
                if let Some(slot) = free {
                    let SlotState::Leased { bytes, uses } = s.slot(slot) else {
                        return None;
                    };
                    if s.idle(uses) {
                        // Freed now: its release goes first, on the holder's own channel.
                        s.set(slot, SlotState::Releasing { bytes, uses });
                        s.mail[holder].push(Msg::Release(slot));
                    } else {
                        self.enqueue(&mut s, slot, bytes, uses);
                        pending = Some((slot, bytes));
                    }
                }
                s.mail[holder].push(Msg::Report { current, pending });
            }
            Action::Deliver(channel) => {
                self.deliver(&mut s, channel);
                self.pump(&mut s);
                self.drive_pressure(&mut s);
            }
            Action::WaiterDeadline(slot) => {
                let index = s.gov.waiters.iter().position(|w| w.slot == slot)?;
                let just = s.gov.denial_is_just(index);
                s.gov.waiters.remove(index);
                s.set(slot, SlotState::denied(just));
                self.pump(&mut s);
                self.drive_pressure(&mut s);
            }
            Action::TicketDeadline => {
                Self::ticket_timed_out(&mut s);
                self.pump(&mut s);
                self.drive_pressure(&mut s);
            }
            // Time passes: a tick off every deadline.
            Action::Tick => {
                for w in s.gov.waiters.items.iter_mut().flatten() {
                    w.left -= 1;
                }
                if let Some(t) = &mut s.gov.ticket {
                    t.left -= 1;
                }
            }
            Action::Complete(stream) => {
                s.completed[stream] += 1;
                // Each queued buffer is woken by the completion and routed again.
                for slot in SlotId::all() {
                    if let SlotState::Queued { bytes, uses } = s.slot(slot) {
                        self.enqueue(&mut s, slot, bytes, uses);
                    }
                }
            }
            Action::LowerCapacity => {
                // The operator's message carries nothing that could change in flight, so it
                // is handled as it is sent (when it is sent is already arbitrary).
                s.env.capacity_lowered = true;
                self.handle_set_capacity(&mut s, LOWERED_CAPACITY);
                self.pump(&mut s);
                self.drive_pressure(&mut s);
            }
            Action::Kill(holder) => {
                s.alive[holder] = false;
                s.env.deaths += 1;
                s.inbox[holder] = None;
                for index in 0..SLOTS {
                    let slot = SlotId { holder, index };
                    match s.slot(slot) {
                        // A dropped grant returns itself.
                        SlotState::Granted { bytes, .. } => {
                            s.set(slot, SlotState::Cancelling { bytes });
                            s.mail[holder].push(Msg::Cancel(slot));
                        }
                        SlotState::Committing { .. } => s.mail[holder].push(Msg::Cancel(slot)),
                        // A dropped buffer goes to its deferred-free queue.
                        SlotState::Leased { bytes, uses } => {
                            self.enqueue(&mut s, slot, bytes, uses);
                        }
                        _ => {}
                    }
                }
                // Supervision tells the Governor, on its own channel.
                s.mail[SUPERVISION_CHANNEL].push(Msg::HolderDied(holder));
            }
            Action::RestartGovernor => {
                Self::restart(&mut s);
                // The new Governor starts asking at once if what is owned exceeds capacity.
                self.pump(&mut s);
                self.drive_pressure(&mut s);
            }
        }
        if self.bounds.holder_mail.is_none() {
            for holder in 0..HOLDERS {
                while !s.mail[holder].is_empty() {
                    self.deliver(&mut s, holder);
                    self.pump(&mut s);
                    self.drive_pressure(&mut s);
                }
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(APPROVED_WITHIN_CAPACITY, |_, s: &State| {
                s.gov.books.approved() <= s.ghost.approval_bound
            }),
            Property::always(FREED_AFTER_FENCES, |_, s: &State| {
                SlotId::all().all(|slot| match s.slot(slot) {
                    SlotState::Releasing { uses, .. } => s.idle(uses),
                    _ => true,
                })
            }),
            Property::always(BOOKS_MATCH_OWNERS, |_, s: &State| {
                s.books_match_what_is_owned()
            }),
            Property::always(NO_WAITER_BEHIND_HOPELESS, |_, s: &State| {
                !s.hopeless_waiter_blocks_one_that_fits()
            }),
            Property::always(PRESSURE_NEVER_STALLS, |_, s: &State| !s.pressure_stalled()),
            Property::always(NO_ASKING_FOR_PROMISED, |_, s: &State| !s.ghost.over_asked),
            Property::eventually(GRANTS_END, |m: &Protocol, s: &State| {
                s.requests_over(m.bounds.reserves)
                    && SlotId::all().all(|slot| {
                        !matches!(
                            s.slot(slot),
                            SlotState::Granted { .. }
                                | SlotState::Committing { .. }
                                | SlotState::Cancelling { .. }
                        ) && !matches!(s.gov.books.entry(slot), Entry::Grant(_))
                    })
            }),
            Property::eventually(WAITERS_ANSWERED, |m: &Protocol, s: &State| {
                s.requests_over(m.bounds.reserves)
                    && SlotId::all().all(|slot| s.slot(slot) != SlotState::DeniedWhileItFit)
            }),
        ]
    }
}

const APPROVED_WITHIN_CAPACITY: &str = "approved <= capacity (a lowered capacity takes nothing back, and nothing more is approved above it)";
const FREED_AFTER_FENCES: &str = "no memory is freed while a fence that used it is pending";
const BOOKS_MATCH_OWNERS: &str =
    "the books equal what holders, queues and the wire own (after a restart too)";
const NO_WAITER_BEHIND_HOPELESS: &str = "no waiter that fits waits behind one that can never fit";
const PRESSURE_NEVER_STALLS: &str = "pressure never idles while a holder with unpromised bytes was not asked since the books changed";
const NO_ASKING_FOR_PROMISED: &str = "a ticket never asks for bytes already promised";
const GRANTS_END: &str = "every grant ends committed, cancelled or returned";
const WAITERS_ANSWERED: &str =
    "every waiter is eventually granted, or denied by its deadline only when it could not fit";

/// Runs the checker to completion (or to the first discovery of `stop_at`) and reports.
fn check(
    model: Protocol,
    label: &str,
    stop_at: &[&'static str],
) -> BTreeMap<&'static str, Vec<Action>> {
    let names: Vec<&'static str> = model.properties().iter().map(|p| p.name).collect();
    let started = Instant::now();
    let mut builder = model
        .checker()
        .threads(std::thread::available_parallelism().map_or(1, |n| n.get().min(2)));
    if !stop_at.is_empty() {
        builder = builder.finish_when(HasDiscoveries::AllOf(stop_at.iter().copied().collect()));
    }
    let checker = builder.spawn_bfs().join();
    let discoveries: BTreeMap<&'static str, Vec<Action>> = checker
        .discoveries()
        .into_iter()
        .map(|(name, path)| (name, path.into_actions()))
        .collect();
    // Straight to stderr, past the test harness's capture: `scripts/reliability.sh` reads it.
    let mut err = std::io::stderr().lock();
    let _ = writeln!(
        err,
        "model_check: {} states explored, {}/{} properties held ({label}; {} generated, depth {}, {:.1?})",
        checker.unique_state_count(),
        names.len() - discoveries.len(),
        names.len(),
        checker.state_count(),
        checker.max_depth(),
        started.elapsed(),
    );
    for (name, actions) in &discoveries {
        let _ = writeln!(
            err,
            "  counterexample to \"{name}\" ({} steps):",
            actions.len()
        );
        for action in actions {
            let _ = writeln!(err, "    {action:?}");
        }
    }
    discoveries
}

/// Asserts the checker found each of `expected`.
fn assert_found(found: &BTreeMap<&'static str, Vec<Action>>, expected: &[&'static str]) {
    for name in expected {
        assert!(
            found.contains_key(name),
            "expected a counterexample to \"{name}\"; found {:?}",
            found.keys().collect::<Vec<_>>()
        );
    }
}

#[test]
fn protocol_holds_when_fixed() {
    for (bounds, label) in [
        (Bounds::WIRE, "wire scope, every fix in"),
        (Bounds::QUEUE, "queue scope, every fix in"),
    ] {
        let found = check(Protocol::new(bounds, &[]), label, &[]);
        assert!(found.is_empty(), "{label}: counterexamples {found:#?}");
    }
    let _ = writeln!(std::io::stderr(), "FIGURE model_check_scopes 2/2");
}

#[test]
fn finds_cross_provider_free_before_fence() {
    let found = check(
        Protocol::new(Bounds::WIRE, &[Bug::RegistryLookup]),
        "wire scope, defect 1 reverted (registry lookup)",
        &[FREED_AFTER_FENCES],
    );
    assert_found(&found, &[FREED_AFTER_FENCES]);
}

#[test]
fn finds_queue_blocked_by_a_waiter_that_cannot_fit() {
    let found = check(
        Protocol::new(Bounds::QUEUE, &[Bug::HopelessWaiterBlocks]),
        "queue scope, defect 3a reverted (hopeless waiter blocks)",
        &[NO_WAITER_BEHIND_HOPELESS, WAITERS_ANSWERED],
    );
    assert_found(&found, &[NO_WAITER_BEHIND_HOPELESS, WAITERS_ANSWERED]);
}

#[test]
fn finds_pressure_round_that_never_asks_again() {
    let found = check(
        Protocol::new(Bounds::QUEUE, &[Bug::StaleRound]),
        "queue scope, defect 3c reverted (stale round)",
        &[PRESSURE_NEVER_STALLS],
    );
    assert_found(&found, &[PRESSURE_NEVER_STALLS]);
}

#[test]
fn finds_release_that_cancels_another_holders_promise() {
    let found = check(
        Protocol::new(Bounds::QUEUE, &[Bug::SharedPromise]),
        "queue scope, defect 3d reverted (shared promise)",
        &[NO_ASKING_FOR_PROMISED],
    );
    assert_found(&found, &[NO_ASKING_FOR_PROMISED]);
}

/// Not one of the defects: what the model finds in the fix being written, where
/// promises live in the pressure round and the round ends as soon as the shortfall vanishes.
#[test]
fn finds_promise_forgotten_when_the_round_ends() {
    let found = check(
        Protocol::new(Bounds::QUEUE, &[Bug::PromisesEndWithRound]),
        "queue scope, promises kept inside the round",
        &[NO_ASKING_FOR_PROMISED],
    );
    assert_found(&found, &[NO_ASKING_FOR_PROMISED]);
}

/// Not one of the defects: what the model finds in the fix being written, where the
/// picture-changed flag is spent by a round that still has holders to ask.
#[test]
fn finds_change_spent_before_the_round_runs_out() {
    // It takes a second reservation for the more important holder too.
    let bounds = Bounds {
        reserves: [2, 2],
        ..Bounds::QUEUE
    };
    let found = check(
        Protocol::new(bounds, &[Bug::ChangeSpentMidRound]),
        "queue scope, picture change taken before the round runs out",
        &[PRESSURE_NEVER_STALLS],
    );
    assert_found(&found, &[PRESSURE_NEVER_STALLS]);
}

/// Not one of the defects: what the model finds in the fix being written, where
/// promises are kept per holder: a release of another lease of the same holder settles them.
#[test]
fn finds_promise_settled_by_another_lease() {
    let found = check(
        Protocol::new(Bounds::QUEUE, &[Bug::PromisePerHolder]),
        "queue scope, promises kept per holder",
        &[NO_ASKING_FOR_PROMISED],
    );
    assert_found(&found, &[NO_ASKING_FOR_PROMISED]);
}

/// The no-wait rule (3b) cannot fail on its own: the Governor pumps after every message, so
/// the first waiter never fits, and a request that fits beside every waiter would make it
/// fit. It bites only while a waiter that can never fit holds the head of the queue, and
/// then what denies the request unjustly is that waiter (3a), under either rule.
#[test]
fn no_wait_rule_fails_only_with_a_hopeless_waiter() {
    let alone = check(
        Protocol::new(Bounds::QUEUE, &[Bug::NoWaitDeniedBehindWaiters]),
        "queue scope, defect 3b reverted alone",
        &[],
    );
    assert!(alone.is_empty(), "counterexamples: {alone:#?}");
    let with_3a = check(
        Protocol::new(
            Bounds::QUEUE,
            &[Bug::NoWaitDeniedBehindWaiters, Bug::HopelessWaiterBlocks],
        ),
        "queue scope, defects 3a and 3b reverted",
        &[WAITERS_ANSWERED],
    );
    assert_found(&with_3a, &[WAITERS_ANSWERED]);
}

#[test]
fn finds_every_queue_defect_at_once() {
    let expected = [
        NO_WAITER_BEHIND_HOPELESS,
        WAITERS_ANSWERED,
        PRESSURE_NEVER_STALLS,
        NO_ASKING_FOR_PROMISED,
    ];
    let found = check(
        Protocol::new(Bounds::QUEUE, &Bug::QUEUE),
        "queue scope, every defect 3 fix reverted",
        &expected,
    );
    assert_found(&found, &expected);
}

/// The queue scope with two reservations for each holder: several million states, too slow
/// for every run (`cargo test --test model_check -- --ignored`).
#[test]
#[ignore = "several million states; run with --ignored"]
fn protocol_holds_when_fixed_with_two_reservations_each() {
    let bounds = Bounds {
        reserves: [2, 2],
        ..Bounds::QUEUE
    };
    let found = check(
        Protocol::new(bounds, &[]),
        "queue scope with two reservations each, every fix in",
        &[],
    );
    assert!(found.is_empty(), "counterexamples: {found:#?}");
}
