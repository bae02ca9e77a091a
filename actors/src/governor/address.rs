//! Where a Governor is, and what its handles hold: the record a restarted Governor rebuilds its
//! books from.
//!
//! Every [`Grant`](super::Grant) and [`Lease`](super::Lease) reaches its Governor through an
//! `Address`, never a bare actor reference. The address keeps, for each live handle, what it
//! holds (the holders' own account of what they own) and changes it together with sending the
//! message that tells the Governor, both under a shared gate. A supervisor that restarts a dead
//! Governor takes the gate exclusively, reads that account and swaps the new actor in, so every
//! release happens either before the account is read (and the new books never count it) or
//! after the swap (and reaches the new Governor): no byte is counted twice or lost. Handles
//! share the gate, so sends (which may wake a parked thread) never queue behind one another;
//! only the account's maps are behind a short mutex.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, Weak};

use procmem::ledger::{self, GrantId, HolderId, HolderReport, LeaseId, Priority};
use procmem::MemoryRole;
use ractor::{ActorRef, MessagingErr};

use super::credit::CreditShared;
use super::GovernorMsg;
use crate::pressure::TicketInbox;

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

/// The current Governor actor of one authority and the account of what its handles hold.
pub(crate) struct Address {
    /// The Governor now; read-locked by every send, write-locked only to swap it.
    gate: RwLock<Option<ActorRef<GovernorMsg>>>,
    /// Taken after the gate, never before it.
    record: Mutex<Record>,
    /// Told how many bytes waiters need beyond the capacity (see [`Upstream`]).
    upstream: Mutex<Option<Upstream>>,
}

/// Where a Governor whose capacity is itself credit (a process under a node Governor) asks
/// for more: called with the bytes its waiters need beyond its capacity. The Governor then
/// asks its own holders only for what it holds over its capacity (the node decides who gives
/// back, through tickets that lower the capacity).
pub type Upstream = std::sync::Arc<dyn Fn(u64) + Send + Sync>;

/// What a restarted Governor is handed as its first message: each holder's report of what it
/// owns, with its ticket inbox. Only a Governor's supervisor makes one.
#[derive(Debug)]
pub(crate) struct Recovery(pub(crate) Vec<(HolderReport, Option<TicketInbox>)>);

impl Address {
    /// An address with no Governor yet: [`Address::set`] it once the actor is spawned (the
    /// actor is given the address as it starts).
    pub(crate) fn new() -> Self {
        Address {
            gate: RwLock::new(None),
            record: Mutex::new(Record {
                holders: BTreeMap::new(),
                grants: HashMap::new(),
                leases: HashMap::new(),
                credit: HashMap::new(),
                issued: 0,
                capacity: None,
                stopping: false,
            }),
            upstream: Mutex::new(None),
        }
    }

    /// Sets (or clears) where the Governor asks for more capacity.
    pub(crate) fn set_upstream(&self, upstream: Option<Upstream>) {
        *self.upstream.lock().unwrap_or_else(|p| p.into_inner()) = upstream;
    }

    /// Whether the Governor has an upstream.
    pub(crate) fn has_upstream(&self) -> bool {
        self.upstream
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Where the Governor asks for more capacity, if anywhere.
    pub(crate) fn upstream(&self) -> Option<Upstream> {
        self.upstream
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn record(&self) -> std::sync::MutexGuard<'_, Record> {
        self.record.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn gate(&self) -> RwLockReadGuard<'_, Option<ActorRef<GovernorMsg>>> {
        self.gate.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Points the address at its first Governor.
    pub(crate) fn set(&self, actor: ActorRef<GovernorMsg>) {
        *self.gate.write().unwrap_or_else(|p| p.into_inner()) = Some(actor);
    }

    /// The Governor actor now (`None` only before [`Address::set`]).
    pub(crate) fn actor(&self) -> Option<ActorRef<GovernorMsg>> {
        self.gate().clone()
    }

    /// Sends `msg` to the Governor now (a request whose reply port is inside it).
    pub(crate) fn cast(&self, msg: GovernorMsg) -> Result<(), MessagingErr<GovernorMsg>> {
        Self::send(&self.gate(), msg)
    }

    fn send(
        actor: &Option<ActorRef<GovernorMsg>>,
        msg: GovernorMsg,
    ) -> Result<(), MessagingErr<GovernorMsg>> {
        match actor {
            Some(actor) => actor.cast(msg),
            None => Err(MessagingErr::SendErr(msg)),
        }
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
    pub(crate) fn grant_gone(
        &self,
        grant: GrantId,
        then: Option<GovernorMsg>,
    ) -> Result<(), MessagingErr<GovernorMsg>> {
        let gate = self.gate();
        self.record().grants.remove(&grant);
        match then {
            Some(msg) => Self::send(&gate, msg),
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
    pub(crate) fn lease_released(
        &self,
        lease: LeaseId,
        bytes: u64,
        then: Option<GovernorMsg>,
    ) -> Result<(), MessagingErr<GovernorMsg>> {
        let gate = self.gate();
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
            Some(msg) => Self::send(&gate, msg),
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
    pub(crate) fn credit_closed(
        &self,
        line: LeaseId,
        unused: u64,
        then: Option<GovernorMsg>,
    ) -> Result<(), MessagingErr<GovernorMsg>> {
        let gate = self.gate();
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
            Some(msg) => Self::send(&gate, msg),
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
        let gate = self.gate();
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
    pub(crate) fn restart(
        &self,
        next: ActorRef<GovernorMsg>,
        recover: impl FnOnce(Recovery) -> GovernorMsg,
    ) -> Result<bool, MessagingErr<GovernorMsg>> {
        let mut gate = self.gate.write().unwrap_or_else(|p| p.into_inner());
        let r = self.record();
        if r.stopping {
            next.stop(None);
            return Ok(false);
        }
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
        let recovery = reports
            .into_values()
            .map(|mut report| {
                report.grants.sort_unstable();
                report.leases.sort_unstable();
                report.credit_lines.sort_unstable();
                let inbox = r.holders.get(&report.holder).and_then(|h| h.inbox.clone());
                (report, inbox)
            })
            .collect();
        if let Err(e) = next.cast(recover(Recovery(recovery))) {
            next.stop(None);
            return Err(e);
        }
        *gate = Some(next);
        Ok(true)
    }
}
