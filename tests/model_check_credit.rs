//! # Model check of standing credit
//!
//! A child holds a credit line of one Governor; another holder competes for the same
//! capacity. The child takes bytes from its line's unused counter and gives them back (no
//! message while the line is open; a release message to the Governor once it is closed), closes
//! the line; the Governor tops the line up (a grant committed into it, the rest deposited in
//! the counter), takes unused credit back under pressure, and handles the release and close
//! messages in any order. Every step of the counter is one atomic operation, so each is one
//! action; messages interleave freely. The books are the real [`Ledger`] (credit lines:
//! `open_credit`, `commit_into`, `release`, `close_credit`), checked after every step.
//!
//! Properties, in every reachable state: approved bytes never exceed the capacity; the child's
//! used and unused credit never exceed what the books approved to its line (invariant 11);
//! every byte of the line is accounted for exactly once: the line's bytes in the books equal
//! the unused counter (while open) plus the child's leases plus the releases and the close in
//! flight; a line closed with nothing outstanding is gone from the books. With the close flag
//! of the counter removed (a give-back after the close lands in a counter nobody reads) the
//! checker finds the lost bytes.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::sync::Arc;

use procmem::ledger::{AuthorityId, GrantId, HolderId, LeaseId, Ledger};
use procmem::MemoryRole;
use stateright::{Checker, Model, Property};

const CAPACITY: u64 = 6;
const MAX_TOPUPS: u8 = 4;
const MAX_OTHER: u64 = 3;

#[derive(Clone, Debug)]
struct Real {
    ledger: Ledger,
    authority: AuthorityId,
    child: HolderId,
    other: HolderId,
    line: LeaseId,
    other_grants: Vec<GrantId>,
}

#[derive(Clone, Debug)]
struct State {
    /// The counter: unused bytes, and whether the line is closed.
    unused: u64,
    closed: bool,
    /// Bytes the child holds, as leases taken from the line (sorted).
    leases: Vec<u64>,
    /// Release messages to the Governor (sorted), and the close message.
    releases: Vec<u64>,
    close: Option<u64>,
    topups: u8,
    /// The competitor's provisional bytes.
    other: u64,
    real: Arc<Real>,
}

impl State {
    fn key(&self) -> impl Hash + Eq + '_ {
        (
            self.unused,
            self.closed,
            &self.leases,
            &self.releases,
            self.close,
            self.topups,
            self.other,
            self.line_bytes(),
        )
    }

    fn line_bytes(&self) -> Option<u64> {
        self.real.ledger.lease(self.real.line).map(|c| c.bytes)
    }
}

impl PartialEq for State {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}
impl Eq for State {}
impl Hash for State {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.key().hash(h);
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    TopUp(u64),
    Take(u64),
    GiveBack(usize),
    Close,
    Reclaim(u64),
    DeliverRelease(usize),
    DeliverClose,
    OtherReserve,
    OtherCancel,
}

struct CreditModel {
    /// The defect: give-backs ignore the closed flag.
    lost_after_close: bool,
}

fn sorted_push(v: &mut Vec<u64>, x: u64) {
    let at = v.partition_point(|y| *y <= x);
    v.insert(at, x);
}

impl Model for CreditModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let mut ledger = Ledger::new();
        let authority = ledger.add_authority("pool", CAPACITY);
        let child = ledger.register_holder(authority, "child", 0).unwrap();
        let other = ledger.register_holder(authority, "other", 1).unwrap();
        let line = ledger.open_credit(child, MemoryRole::KvCache).unwrap().id;
        vec![State {
            unused: 0,
            closed: false,
            leases: Vec::new(),
            releases: Vec::new(),
            close: None,
            topups: 0,
            other: 0,
            real: Arc::new(Real {
                ledger,
                authority,
                child,
                other,
                line,
                other_grants: Vec::new(),
            }),
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        let open_in_books = s.real.ledger.is_credit(s.real.line);
        if !s.closed && open_in_books && s.topups < MAX_TOPUPS {
            for n in 1..=3 {
                out.push(Action::TopUp(n));
            }
        }
        if !s.closed {
            for n in 1..=s.unused.min(3) {
                out.push(Action::Take(n));
            }
            out.push(Action::Close);
        }
        for i in 0..s.leases.len() {
            if i == 0 || s.leases[i] != s.leases[i - 1] {
                out.push(Action::GiveBack(i));
            }
        }
        if s.unused > 0 && !s.closed {
            for k in 1..=s.unused.min(2) {
                out.push(Action::Reclaim(k));
            }
        }
        for i in 0..s.releases.len() {
            if i == 0 || s.releases[i] != s.releases[i - 1] {
                out.push(Action::DeliverRelease(i));
            }
        }
        if s.close.is_some() {
            out.push(Action::DeliverClose);
        }
        if s.other < MAX_OTHER {
            out.push(Action::OtherReserve);
        }
        if s.other > 0 {
            out.push(Action::OtherCancel);
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        let real = Arc::make_mut(&mut n.real);
        let (child, line, authority) = (real.child, real.line, real.authority);
        match action {
            Action::TopUp(bytes) => {
                // Admission through the books; the rest of the top-up is deposited unused.
                let grant = real
                    .ledger
                    .reserve(child, authority, MemoryRole::KvCache, bytes)
                    .ok()?;
                real.ledger.commit_into(child, grant.id, line).unwrap();
                n.topups += 1;
                n.unused += bytes;
            }
            Action::Take(bytes) => {
                n.unused -= bytes;
                sorted_push(&mut n.leases, bytes);
            }
            Action::GiveBack(i) => {
                let bytes = n.leases.remove(i);
                if !n.closed || self.lost_after_close {
                    n.unused += bytes;
                } else {
                    sorted_push(&mut n.releases, bytes);
                }
            }
            Action::Close => {
                n.closed = true;
                n.close = Some(n.unused);
                n.unused = 0;
            }
            Action::Reclaim(k) => {
                let taken = n.unused.min(k);
                n.unused -= taken;
                real.ledger.release(child, line, taken).unwrap();
            }
            Action::DeliverRelease(i) => {
                let bytes = n.releases.remove(i);
                real.ledger.release(child, line, bytes).unwrap();
            }
            Action::DeliverClose => {
                let unused = n.close.take().unwrap();
                if unused > 0 {
                    real.ledger.release(child, line, unused).unwrap();
                }
                real.ledger.close_credit(child, line).unwrap();
            }
            Action::OtherReserve => {
                let other = real.other;
                let g = real
                    .ledger
                    .reserve(other, authority, MemoryRole::Workspace, 1)
                    .ok()?;
                real.other_grants.push(g.id);
                n.other += 1;
            }
            Action::OtherCancel => {
                let g = real.other_grants.pop().unwrap();
                real.ledger.cancel(real.other, g).unwrap();
                n.other -= 1;
            }
        }
        real.ledger
            .check_invariants()
            .expect("the books hold together");
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(WITHIN_CAPACITY, |_, s: &State| {
                s.real.ledger.within_capacity(s.real.authority)
            }),
            Property::always(USED_AND_UNUSED_WITHIN_LINE, |_, s: &State| {
                let held: u64 = s.leases.iter().sum::<u64>() + s.unused;
                held <= s.line_bytes().unwrap_or(0)
            }),
            Property::always(EVERY_BYTE_ONCE, |_, s: &State| {
                let open_unused = if s.closed { 0 } else { s.unused };
                let owned = open_unused
                    + s.leases.iter().sum::<u64>()
                    + s.releases.iter().sum::<u64>()
                    + s.close.unwrap_or(0);
                s.line_bytes().unwrap_or(0) == owned
            }),
            Property::always(CLOSED_LINE_GOES, |_, s: &State| {
                let done =
                    s.closed && s.close.is_none() && s.leases.is_empty() && s.releases.is_empty();
                !done || s.line_bytes().is_none()
            }),
            Property::sometimes("a closed line with bytes still used", |_, s: &State| {
                s.closed && !s.leases.is_empty() && s.line_bytes().is_some_and(|b| b > 0)
            }),
        ]
    }
}

const WITHIN_CAPACITY: &str = "approved <= capacity, credit included";
const USED_AND_UNUSED_WITHIN_LINE: &str =
    "the child's used and unused credit never exceed what was approved to its line";
const EVERY_BYTE_ONCE: &str =
    "every byte of the line is in the counter, a lease, or a message in flight, exactly once";
const CLOSED_LINE_GOES: &str = "a closed line with nothing outstanding is gone from the books";

fn check(model: CreditModel, label: &str) -> BTreeMap<&'static str, usize> {
    let names: Vec<&'static str> = model.properties().iter().map(|p| p.name).collect();
    let checker = model.checker().threads(2).spawn_bfs().join();
    let found: BTreeMap<&'static str, usize> = checker
        .discoveries()
        .into_iter()
        .map(|(name, path)| (name, path.into_actions().len()))
        .collect();
    let violated: Vec<_> = found
        .keys()
        .filter(|k| !k.starts_with("a closed line"))
        .collect();
    let _ = writeln!(
        std::io::stderr(),
        "model_check_credit: {} states explored, {}/{} safety properties held ({label})",
        checker.unique_state_count(),
        names.len() - 1 - violated.len(),
        names.len() - 1
    );
    found
}

#[test]
fn credit_protocol_holds() {
    let found = check(
        CreditModel {
            lost_after_close: false,
        },
        "every fix in",
    );
    assert!(
        found.contains_key("a closed line with bytes still used"),
        "the interesting case is reached"
    );
    assert_eq!(found.len(), 1, "only the reachability witness: {found:?}");
    let _ = writeln!(std::io::stderr(), "FIGURE model_check_credit 1/1");
}

#[test]
fn finds_bytes_lost_when_a_give_back_ignores_the_close() {
    let found = check(
        CreditModel {
            lost_after_close: true,
        },
        "close flag removed",
    );
    assert!(found.contains_key(EVERY_BYTE_ONCE), "{found:?}");
}
