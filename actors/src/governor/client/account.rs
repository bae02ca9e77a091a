//! What a Governor's handles hold: the record a restarted Governor rebuilds its books from,
//! and the counters of its credit lines.
//!
//! Every [`Grant`](super::Grant) and [`Lease`](super::Lease) reaches its Governor through an
//! `Account`, never a bare actor reference. The account keeps, for each live handle, what it
//! holds (the holders' own account of what they own) and changes it together with sending the
//! message that tells the Governor, both under its [`Route`]'s gate. A supervisor that restarts
//! a dead Governor takes the gate exclusively, reads that account and swaps the new actor in,
//! so every release happens either before the account is read (and the new books never count
//! it) or after the swap (and reaches the new Governor): no byte is counted twice or lost.
//! Handles share the gate, so sends (which may wake a parked thread) never queue behind one
//! another; only the account's maps are behind a short mutex.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crossbeam_utils::CachePadded;
use procmem::ledger::{self, GrantId, HolderId, HolderReport, LeaseId, Priority};
use procmem::MemoryRole;
use ractor::{ActorRef, Message, MessagingErr};

use super::route::Route;
use crate::governor::protocol::Recovery;
use crate::ticket::TicketInbox;

#[derive(Debug, Clone)]
struct HolderEntry {
    name: String,
    priority: Priority,
    retired: bool,
    inbox: Option<TicketInbox>,
}

struct Record {
    holders: BTreeMap<HolderId, HolderEntry>,
    grants: HashMap<GrantId, (HolderId, MemoryRole, u64)>,
    leases: HashMap<LeaseId, (HolderId, MemoryRole, u64)>,
    /// Open credit lines (their leases are in `leases`, and stay there at zero bytes) and
    /// the unused bytes each child holds.
    credit: HashMap<LeaseId, Weak<CreditShared>>,
    issued: u64,
    capacity: Option<u64>,
    stopping: bool,
}

/// The account of what one authority's handles hold, beside the route to its Governor.
pub(crate) struct Account {
    /// The Governor now; its gate is taken before the record, never after it.
    route: Route,
    record: Mutex<Record>,
}

impl Account {
    /// An account with no Governor yet: [`Route::set`] its route once the actor is spawned
    /// (the actor is given the account as it starts).
    pub(crate) fn new() -> Self {
        Account {
            route: Route::new(),
            record: Mutex::new(Record {
                holders: BTreeMap::new(),
                grants: HashMap::new(),
                leases: HashMap::new(),
                credit: HashMap::new(),
                issued: 0,
                capacity: None,
                stopping: false,
            }),
        }
    }

    /// Where the Governor is.
    pub(crate) fn route(&self) -> &Route {
        &self.route
    }

    fn record(&self) -> MutexGuard<'_, Record> {
        self.record.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn saw(record: &mut Record, raw: u64) {
        record.issued = record.issued.max(raw);
    }

    pub(crate) fn holder_registered(
        &self,
        holder: HolderId,
        name: &str,
        priority: Priority,
        inbox: Option<TicketInbox>,
    ) {
        let mut r = self.record();
        Self::saw(&mut r, holder.get());
        r.holders.insert(
            holder,
            HolderEntry {
                name: name.to_owned(),
                priority,
                retired: false,
                inbox,
            },
        );
    }

    pub(crate) fn holder_retired(&self, holder: HolderId) {
        let mut r = self.record();
        r.grants.retain(|_, (h, _, _)| *h != holder);
        if let Some(entry) = r.holders.get_mut(&holder) {
            entry.retired = true;
            entry.inbox = None;
        }
        Self::forget_if_done(&mut r, holder);
    }

    /// A retired holder that holds nothing any more leaves the account (a server whose
    /// holders come and go must not grow it without end).
    fn forget_if_done(r: &mut Record, holder: HolderId) {
        let retired = r.holders.get(&holder).is_some_and(|h| h.retired);
        if retired && !r.leases.values().any(|(h, _, _)| *h == holder) {
            r.holders.remove(&holder);
        }
    }

    pub(crate) fn grant_issued(&self, grant: &ledger::GrantRecord) {
        let mut r = self.record();
        Self::saw(&mut r, grant.id.get());
        let c = &grant.claim;
        r.grants.insert(grant.id, (c.holder, c.role, c.bytes));
    }

    /// The grant is gone (committed, cancelled, rolled back); `then` is sent under the gate.
    pub(crate) fn grant_gone<M: Message>(
        &self,
        grant: GrantId,
        then: Option<M>,
    ) -> Result<(), MessagingErr<M>> {
        let gate = self.route.gate();
        self.record().grants.remove(&grant);
        match then {
            Some(msg) => Route::send(&gate, msg),
            None => Ok(()),
        }
    }

    /// The grant became the lease (a commit): one step, so a restart never counts both.
    pub(crate) fn grant_committed(&self, grant: GrantId, lease: &ledger::LeaseRecord) {
        let mut r = self.record();
        r.grants.remove(&grant);
        Self::saw(&mut r, lease.id.get());
        let c = &lease.claim;
        r.leases.insert(lease.id, (c.holder, c.role, c.bytes));
    }

    /// `bytes` of the lease came back; `then` (the Governor's release) is sent under the gate.
    pub(crate) fn lease_released<M: Message>(
        &self,
        lease: LeaseId,
        bytes: u64,
        then: Option<M>,
    ) -> Result<(), MessagingErr<M>> {
        let gate = self.route.gate();
        {
            let mut r = self.record();
            let standing = r.credit.contains_key(&lease);
            if let Some(entry) = r.leases.get_mut(&lease) {
                entry.2 = entry.2.saturating_sub(bytes);
                if entry.2 == 0 && !standing {
                    let holder = entry.0;
                    r.leases.remove(&lease);
                    Self::forget_if_done(&mut r, holder);
                }
            }
        }
        match then {
            Some(msg) => Route::send(&gate, msg),
            None => Ok(()),
        }
    }

    /// A credit line was opened (at zero bytes).
    pub(crate) fn credit_opened(&self, line: &ledger::LeaseRecord, shared: &Arc<CreditShared>) {
        let mut r = self.record();
        Self::saw(&mut r, line.id.get());
        let c = &line.claim;
        r.leases.insert(line.id, (c.holder, c.role, c.bytes));
        r.credit.insert(line.id, Arc::downgrade(shared));
    }

    /// `grant` was committed into the credit line `line`, which now holds `total` bytes.
    pub(crate) fn credit_topped_up(&self, grant: GrantId, line: LeaseId, total: u64) {
        let mut r = self.record();
        r.grants.remove(&grant);
        if let Some(entry) = r.leases.get_mut(&line) {
            entry.2 = total;
        }
    }

    /// The credit line was closed with `unused` bytes going back; `then` is sent under the
    /// gate. What its children still hold comes back as their leases are released.
    pub(crate) fn credit_closed<M: Message>(
        &self,
        line: LeaseId,
        unused: u64,
        then: Option<M>,
    ) -> Result<(), MessagingErr<M>> {
        let gate = self.route.gate();
        {
            let mut r = self.record();
            r.credit.remove(&line);
            if let Some(entry) = r.leases.get_mut(&line) {
                entry.2 = entry.2.saturating_sub(unused);
                if entry.2 == 0 {
                    let holder = entry.0;
                    r.leases.remove(&line);
                    Self::forget_if_done(&mut r, holder);
                }
            }
        }
        match then {
            Some(msg) => Route::send(&gate, msg),
            None => Ok(()),
        }
    }

    /// The unused bytes of the open credit line `line`, if it is open and its child alive.
    pub(crate) fn credit_line(&self, line: LeaseId) -> Option<Arc<CreditShared>> {
        self.record().credit.get(&line)?.upgrade()
    }

    /// The open credit lines: line, holder, the child's unused bytes. (A line whose child
    /// dropped every handle is closing: its close is on its way.)
    pub(crate) fn credit_lines(&self) -> Vec<(LeaseId, HolderId, Arc<CreditShared>)> {
        let r = self.record();
        r.credit
            .iter()
            .filter_map(|(line, shared)| {
                let holder = r.leases.get(line)?.0;
                Some((*line, holder, shared.upgrade()?))
            })
            .collect()
    }

    /// The Governor's capacity was set to `bytes`.
    pub(crate) fn capacity_set(&self, bytes: u64) {
        self.record().capacity = Some(bytes);
    }

    /// The capacity last set, if it was set after the Governor started.
    pub(crate) fn capacity(&self) -> Option<u64> {
        self.record().capacity
    }

    /// Marks the Governor as being stopped on purpose: its supervisor does not restart it.
    pub(crate) fn stop(&self) {
        let gate = self.route.gate();
        self.record().stopping = true;
        if let Some(actor) = gate.as_ref() {
            actor.stop(None);
        }
    }

    pub(crate) fn is_stopping(&self) -> bool {
        self.record().stopping
    }

    /// The highest identifier the Governor's books handed out, as far as handles saw.
    pub(crate) fn issued(&self) -> u64 {
        self.record().issued
    }

    /// Hands `next` the holders' account, as its first message, and makes it the Governor
    /// every handle reaches from now on, in one step with the gate held exclusively (no
    /// handle sends meanwhile). If the Governor was stopped on purpose meanwhile, `next` is
    /// stopped instead and `false` returned.
    pub(crate) fn restart<M: Message>(
        &self,
        next: ActorRef<M>,
        recover: impl FnOnce(Recovery) -> M,
    ) -> Result<bool, MessagingErr<M>> {
        let mut gate = self.route.gate_mut();
        let r = self.record();
        if r.stopping {
            next.stop(None);
            return Ok(false);
        }
        if let Err(e) = next.cast(recover(Recovery(Self::reports(&r)))) {
            next.stop(None);
            return Err(e);
        }
        *gate = Some(next.get_cell());
        Ok(true)
    }

    /// Each holder's report of what it owns, with its ticket inbox.
    fn reports(r: &Record) -> Vec<(HolderReport, Option<TicketInbox>)> {
        let mut reports: BTreeMap<HolderId, HolderReport> = r
            .holders
            .iter()
            .map(|(id, h)| {
                (
                    *id,
                    HolderReport {
                        holder: *id,
                        name: h.name.clone(),
                        priority: h.priority,
                        retired: h.retired,
                        grants: Vec::new(),
                        leases: Vec::new(),
                        credit_lines: Vec::new(),
                    },
                )
            })
            .collect();
        for (id, (holder, role, bytes)) in &r.grants {
            if let Some(report) = reports.get_mut(holder) {
                report.grants.push((*id, *role, *bytes));
            }
        }
        for (id, (holder, role, bytes)) in &r.leases {
            if let Some(report) = reports.get_mut(holder) {
                report.leases.push((*id, *role, *bytes));
                if r.credit.contains_key(id) {
                    report.credit_lines.push(*id);
                }
            }
        }
        reports
            .into_values()
            .map(|mut report| {
                report.grants.sort_unstable();
                report.leases.sort_unstable();
                report.credit_lines.sort_unstable();
                let inbox = r.holders.get(&report.holder).and_then(|h| h.inbox.clone());
                (report, inbox)
            })
            .collect()
    }
}

/// Set once the line is closed: from then on, bytes given back go to the Governor.
const CLOSED: u64 = 1 << 63;
/// The most one line may hold unused (the counter keeps its top bit for `CLOSED`).
pub const MAX_CREDIT: u64 = CLOSED - 1;

/// A child's unused credit, shared by the child's leases and the Governor. On a cache line
/// of its own: holders taking from their own lines never contend.
pub(crate) struct CreditShared {
    state: CachePadded<AtomicU64>,
    /// The account bytes go back through once the line is closed. (The account keeps a weak
    /// reference to this, so there is no cycle.)
    account: Arc<Account>,
}

impl std::fmt::Debug for CreditShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CreditShared")
            .field("unused", &self.unused())
            .finish()
    }
}

impl CreditShared {
    pub(crate) fn new(account: Arc<Account>) -> Self {
        CreditShared {
            state: CachePadded::new(AtomicU64::new(0)),
            account,
        }
    }

    pub(crate) fn account(&self) -> &Arc<Account> {
        &self.account
    }

    /// Takes exactly `bytes` if the line is open and holds that many unused.
    pub(crate) fn take(&self, bytes: u64) -> bool {
        self.state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                (v & CLOSED == 0 && v >= bytes).then(|| v - bytes)
            })
            .is_ok()
    }

    /// Takes up to `max` unused bytes of an open line; returns how many.
    pub(crate) fn take_up_to(&self, max: u64) -> u64 {
        match self
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                (v & CLOSED == 0 && v > 0 && max > 0).then(|| v - v.min(max))
            }) {
            Ok(before) => before.min(max),
            Err(_) => 0,
        }
    }

    /// Puts `bytes` back as unused, if the line is open (and they fit the counter).
    pub(crate) fn give_back(&self, bytes: u64) -> bool {
        self.state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                if v & CLOSED != 0 {
                    return None;
                }
                v.checked_add(bytes).filter(|t| *t <= MAX_CREDIT)
            })
            .is_ok()
    }

    /// Closes the line; returns the unused bytes it held (zero if it was closed already).
    pub(crate) fn close(&self) -> u64 {
        let before = self.state.fetch_or(CLOSED, Ordering::AcqRel);
        if before & CLOSED != 0 {
            0
        } else {
            before
        }
    }

    /// Unused bytes now (zero once closed).
    pub(crate) fn unused(&self) -> u64 {
        let v = self.state.load(Ordering::Acquire);
        if v & CLOSED != 0 {
            0
        } else {
            v
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{Account, CreditShared, MAX_CREDIT};

    #[test]
    fn the_counter_refuses_what_it_cannot_do_and_changes_nothing() {
        let c = CreditShared::new(Arc::new(Account::new()));
        assert!(!c.take(1), "empty");
        assert!(c.give_back(100));
        assert!(!c.take(101), "more than unused");
        assert!(c.take(40));
        assert_eq!(c.unused(), 60);
        assert!(!c.give_back(u64::MAX), "past the counter");
        assert!(
            !c.give_back(MAX_CREDIT),
            "60 + MAX_CREDIT overflows the counter"
        );
        assert_eq!(c.unused(), 60);
        assert_eq!(c.take_up_to(0), 0);
        assert_eq!(c.take_up_to(u64::MAX), 60);
        assert_eq!(c.take_up_to(u64::MAX), 0, "nothing left");
        assert!(c.give_back(10));
        assert_eq!(c.close(), 10);
        assert_eq!(c.close(), 0, "closed twice returns nothing twice");
        assert!(!c.give_back(5), "a closed line takes nothing back");
        assert_eq!(c.take_up_to(5), 0);
    }
}
