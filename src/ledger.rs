//! The Governor's books as a pure state machine: no I/O, no clock, no async.
//!
//! ```text
//!              reserve                commit(actual)            release(bytes)
//!   free ───────────────▶ provisional ───────────────▶ leased ────────────────▶ free
//!              ◀───────────────────────
//!                 cancel / dropped grant
//! ```
//!
//! One [`Ledger`] keeps any number of authorities (one per physical pool; aliased tiers map
//! to the same one). Per authority, `approved = provisional + leased`, and every approved byte
//! belongs to exactly one grant or one lease. New approvals never take `approved` past
//! `capacity`; lowering the capacity below what is approved takes nothing back (only holders
//! free their own bytes, under pressure), it just stops approvals until releases bring
//! `approved` under the new capacity.
//!
//! Grants and leases are bound to the holder they were issued to: another holder, a
//! replay after consumption, or an identifier this ledger never issued is refused with a
//! typed error, and a refused operation changes nothing.

pub mod admission;
mod credit;
mod error;
mod reports;
#[cfg(test)]
mod tests;
mod waiting;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

pub use error::{Denial, HolderUsage, LedgerError};
pub use waiting::{InLine, PressureRound, WaitQueue};

use crate::api::{MemoryRole, MemoryTier, Place};

/// One physical pool's accounting identity within a ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AuthorityId(u64);

/// A registered holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HolderId(u64);

/// A provisional grant: approved bytes not yet backed by memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GrantId(u64);

/// A lease: approved bytes the holder has committed to memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(u64);

macro_rules! raw_accessor {
    ($($name:ident),*) => {$(
        impl $name {
            /// The raw number, for logs and metric labels. Identifiers cannot be made from numbers.
            pub const fn get(self) -> u64 {
                self.0
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}#{:x}", stringify!($name), self.0)
            }
        }
    )*};
}
raw_accessor!(AuthorityId, HolderId, GrantId, LeaseId);

/// How much a request or holder matters: higher is more important.
pub type Priority = u32;

/// Approved bytes and who they belong to: the content of a grant or a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The holder the bytes are approved for.
    pub holder: HolderId,
    /// The pool they come from.
    pub authority: AuthorityId,
    /// What they are for.
    pub role: MemoryRole,
    /// How many.
    pub bytes: u64,
}

/// A grant as issued: its identity and its charge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantRecord {
    /// Its identity; present it to commit or cancel.
    pub id: GrantId,
    /// What it approves.
    pub claim: Claim,
}

/// A lease as issued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord {
    /// Its identity; present it to release.
    pub id: LeaseId,
    /// What it holds.
    pub claim: Claim,
}

/// The books of one authority at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthoritySnapshot {
    /// Which authority.
    pub id: AuthorityId,
    /// Its name.
    pub name: String,
    /// Bytes it may approve.
    pub capacity: u64,
    /// Approved but not yet committed.
    pub provisional: u64,
    /// Committed (leased), standing credit included.
    pub leased: u64,
    /// Of `leased`, bytes approved in advance to children as standing credit (used by them
    /// or not: a child's unused part is known only to the child).
    pub credit: u64,
    /// Holders with their provisional and leased bytes, largest first.
    pub holders: Vec<HolderUsage>,
}

impl AuthoritySnapshot {
    /// `provisional + leased`.
    pub fn approved(&self) -> u64 {
        self.provisional.saturating_add(self.leased)
    }

    /// What can still be approved now (zero while over a lowered capacity).
    pub fn free(&self) -> u64 {
        self.capacity.saturating_sub(self.approved())
    }
}

/// An authority's totals ([`Ledger::totals`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// Bytes it may approve.
    pub capacity: u64,
    /// Approved but not yet committed.
    pub provisional: u64,
    /// Committed (leased).
    pub leased: u64,
}

impl Totals {
    /// What can still be approved now (zero while over a lowered capacity).
    pub fn free(&self) -> u64 {
        self.capacity
            .saturating_sub(self.provisional.saturating_add(self.leased))
    }
}

/// A holder's registration ([`Ledger::holder`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration<'a> {
    /// The authority it holds memory of.
    pub authority: AuthorityId,
    /// Its name.
    pub name: &'a str,
    /// Its priority.
    pub priority: Priority,
}

/// A live holder as pressure sees it ([`Ledger::holders_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HolderStanding {
    /// Which holder.
    pub holder: HolderId,
    /// Its priority.
    pub priority: Priority,
    /// Its provisional and leased bytes.
    pub approved: u64,
}

#[derive(Debug, Clone)]
struct AuthorityBooks {
    name: String,
    capacity: u64,
    provisional: u64,
    leased: u64,
}

impl AuthorityBooks {
    fn approved(&self) -> u64 {
        self.provisional + self.leased
    }
}

#[derive(Debug, Clone)]
struct HolderBooks {
    authority: AuthorityId,
    name: String,
    priority: Priority,
    provisional: u64,
    leased: u64,
    retired: bool,
}

/// What a holder owns, as it reports it to a restarted Governor: the books are rebuilt from
/// these reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderReport {
    /// Its identity (issued by the books before the restart).
    pub holder: HolderId,
    /// Its name.
    pub name: String,
    /// Its priority.
    pub priority: Priority,
    /// Whether it had been retired (it keeps its leases until their memory is freed).
    pub retired: bool,
    /// Its provisional grants: identity, role, bytes.
    pub grants: Vec<(GrantId, MemoryRole, u64)>,
    /// Its leases: identity, role, bytes still held.
    pub leases: Vec<(LeaseId, MemoryRole, u64)>,
    /// Which of its leases are standing credit (these may hold zero bytes).
    pub credit_lines: Vec<LeaseId>,
}

/// What retiring a holder did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retired {
    /// Grants returned at once, with their bytes.
    pub grants_returned: Vec<(GrantId, u64)>,
    /// Leased bytes still outstanding: they come back as the memory is actually freed.
    pub leased_outstanding: u64,
}

/// `charge`, if `holder` is the one it was issued to.
fn presented_by(charge: &Claim, holder: HolderId) -> Result<&Claim, LedgerError> {
    if charge.holder == holder {
        Ok(charge)
    } else {
        Err(LedgerError::NotYours {
            owner: charge.holder,
            caller: holder,
        })
    }
}

static LEDGER_SEQ: AtomicU64 = AtomicU64::new(1);

/// The books. See the module documentation for the rules.
#[derive(Debug, Clone)]
pub struct Ledger {
    id_base: u64,
    next_id: u64,
    authorities: BTreeMap<AuthorityId, AuthorityBooks>,
    tiers: BTreeMap<(Place, MemoryTier), AuthorityId>,
    holders: BTreeMap<HolderId, HolderBooks>,
    grants: BTreeMap<GrantId, Claim>,
    leases: BTreeMap<LeaseId, Claim>,
    /// Leases that are standing credit: kept at zero bytes until closed.
    credit: BTreeSet<LeaseId>,
}

impl Default for Ledger {
    fn default() -> Self {
        Self::new()
    }
}

impl Ledger {
    /// Empty books. Identifiers issued by one ledger are unknown to every other.
    pub fn new() -> Self {
        Ledger {
            id_base: LEDGER_SEQ.fetch_add(1, Ordering::Relaxed) << 40,
            next_id: 1,
            authorities: BTreeMap::new(),
            tiers: BTreeMap::new(),
            holders: BTreeMap::new(),
            grants: BTreeMap::new(),
            leases: BTreeMap::new(),
            credit: BTreeSet::new(),
        }
    }

    fn fresh(&mut self) -> u64 {
        let id = self.id_base | self.next_id;
        self.next_id += 1;
        id
    }

    /// Adds an authority (one physical pool) able to approve `capacity` bytes.
    pub fn add_authority(&mut self, name: impl Into<String>, capacity: u64) -> AuthorityId {
        let id = AuthorityId(self.fresh());
        self.authorities.insert(
            id,
            AuthorityBooks {
                name: name.into(),
                capacity,
                provisional: 0,
                leased: 0,
            },
        );
        id
    }

    /// Says that memory of `tier` on `place` is paid from `authority`. Tiers that alias the
    /// same bytes (unified memory) are bound to one authority.
    pub fn bind_tier(
        &mut self,
        place: Place,
        tier: MemoryTier,
        authority: AuthorityId,
    ) -> Result<(), LedgerError> {
        self.authority(authority)?;
        match self.tiers.get(&(place, tier)) {
            Some(existing) if *existing != authority => Err(LedgerError::TierAlreadyBound {
                place,
                tier,
                authority: *existing,
            }),
            _ => {
                self.tiers.insert((place, tier), authority);
                Ok(())
            }
        }
    }

    /// The authority that pays for `tier` on `place`.
    pub fn authority_for(&self, place: Place, tier: MemoryTier) -> Option<AuthorityId> {
        self.tiers.get(&(place, tier)).copied()
    }

    /// The (place, tier) pairs `authority` pays for.
    pub fn tiers_of(&self, authority: AuthorityId) -> Vec<(Place, MemoryTier)> {
        self.tiers
            .iter()
            .filter(|(_, a)| **a == authority)
            .map(|(k, _)| *k)
            .collect()
    }

    /// Fresh books for one authority of this ledger: the same authority (identity, name,
    /// capacity) and its tier bindings, nothing approved, and identifiers of their own (none
    /// it issues is known to this ledger or to another authority's books). A process keeps
    /// its topology as one ledger of every authority and gives each Governor the books of
    /// one, split off it.
    pub fn books_for(&self, authority: AuthorityId) -> Result<Ledger, LedgerError> {
        let books = self.authority(authority)?;
        let mut split = Ledger::new();
        split.authorities.insert(
            authority,
            AuthorityBooks {
                name: books.name.clone(),
                capacity: books.capacity,
                provisional: 0,
                leased: 0,
            },
        );
        split.tiers = self
            .tiers_of(authority)
            .into_iter()
            .map(|k| (k, authority))
            .collect();
        Ok(split)
    }

    /// Registers a holder of `authority`.
    pub fn register_holder(
        &mut self,
        authority: AuthorityId,
        name: impl Into<String>,
        priority: Priority,
    ) -> Result<HolderId, LedgerError> {
        self.authority(authority)?;
        let id = HolderId(self.fresh());
        self.holders.insert(
            id,
            HolderBooks {
                authority,
                name: name.into(),
                priority,
                provisional: 0,
                leased: 0,
                retired: false,
            },
        );
        Ok(id)
    }

    /// Retires a holder (it unregistered or died): its grants return at once, it can reserve
    /// no more, and its leases stay until released (as its memory is actually freed).
    pub fn retire_holder(&mut self, holder: HolderId) -> Result<Retired, LedgerError> {
        let books = self
            .holders
            .get(&holder)
            .ok_or(LedgerError::UnknownHolder(holder))?;
        if books.retired {
            return Err(LedgerError::HolderRetired(holder));
        }
        let grants: Vec<GrantId> = self
            .grants
            .iter()
            .filter(|(_, c)| c.holder == holder)
            .map(|(id, _)| *id)
            .collect();
        let mut returned = Vec::with_capacity(grants.len());
        for id in grants {
            returned.push((id, self.cancel(holder, id)?));
        }
        let books = self.holders.get_mut(&holder).expect("checked above");
        books.retired = true;
        let leased_outstanding = books.leased;
        self.forget_if_done(holder);
        Ok(Retired {
            grants_returned: returned,
            leased_outstanding,
        })
    }

    fn forget_if_done(&mut self, holder: HolderId) {
        if let Some(b) = self.holders.get(&holder) {
            let lines = self
                .credit
                .iter()
                .any(|l| self.leases.get(l).is_some_and(|c| c.holder == holder));
            if b.retired && b.leased == 0 && b.provisional == 0 && !lines {
                self.holders.remove(&holder);
            }
        }
    }

    fn authority(&self, id: AuthorityId) -> Result<&AuthorityBooks, LedgerError> {
        self.authorities
            .get(&id)
            .ok_or(LedgerError::UnknownAuthority(id))
    }

    fn live_holder(&self, holder: HolderId) -> Result<&HolderBooks, LedgerError> {
        let books = self
            .holders
            .get(&holder)
            .ok_or(LedgerError::UnknownHolder(holder))?;
        if books.retired {
            return Err(LedgerError::HolderRetired(holder));
        }
        Ok(books)
    }

    /// The holder's registration: authority, name and priority.
    pub fn holder(&self, holder: HolderId) -> Option<Registration<'_>> {
        self.holders.get(&holder).map(|b| Registration {
            authority: b.authority,
            name: b.name.as_str(),
            priority: b.priority,
        })
    }

    /// Live (not retired) holders of `authority`, with their priority and approved bytes.
    pub fn holders_of(&self, authority: AuthorityId) -> Vec<HolderStanding> {
        self.holders
            .iter()
            .filter(|(_, b)| b.authority == authority && !b.retired)
            .map(|(id, b)| HolderStanding {
                holder: *id,
                priority: b.priority,
                approved: b.provisional + b.leased,
            })
            .collect()
    }

    /// Approves `bytes` for `holder` from `authority` as a provisional grant, or explains why not.
    pub fn reserve(
        &mut self,
        holder: HolderId,
        authority: AuthorityId,
        role: MemoryRole,
        bytes: u64,
    ) -> Result<GrantRecord, LedgerError> {
        self.check_reserve(holder, authority, bytes)?;
        if !self.fits(authority, bytes)? {
            return Err(LedgerError::Denied(Box::new(self.denial(authority, bytes))));
        }
        let id = GrantId(self.fresh());
        let charge = Claim {
            holder,
            authority,
            role,
            bytes,
        };
        self.authorities
            .get_mut(&authority)
            .expect("checked")
            .provisional += bytes;
        self.holders.get_mut(&holder).expect("checked").provisional += bytes;
        self.grants.insert(id, charge.clone());
        Ok(GrantRecord { id, claim: charge })
    }

    /// Every check of [`Ledger::reserve`] except room: a live holder of that authority asking
    /// for at least one byte. A request that passes may wait for room.
    pub fn check_reserve(
        &self,
        holder: HolderId,
        authority: AuthorityId,
        bytes: u64,
    ) -> Result<(), LedgerError> {
        let books = self.live_holder(holder)?;
        if books.authority != authority {
            return Err(LedgerError::WrongAuthority {
                holder,
                registered: books.authority,
                asked: authority,
            });
        }
        if bytes == 0 {
            return Err(LedgerError::ZeroBytes);
        }
        Ok(())
    }

    /// The capacity, provisional and leased bytes of `authority`, without building a
    /// snapshot.
    pub fn totals(&self, authority: AuthorityId) -> Option<Totals> {
        self.authorities.get(&authority).map(|a| Totals {
            capacity: a.capacity,
            provisional: a.provisional,
            leased: a.leased,
        })
    }

    /// Whether `bytes` more could be approved in `authority` right now.
    pub fn fits(&self, authority: AuthorityId, bytes: u64) -> Result<bool, LedgerError> {
        let a = self.authority(authority)?;
        Ok(a.approved()
            .checked_add(bytes)
            .is_some_and(|total| total <= a.capacity))
    }

    /// Bytes that must be freed in `authority` before `bytes` more fit (zero if they fit).
    pub fn shortfall(&self, authority: AuthorityId, bytes: u64) -> Result<u64, LedgerError> {
        let a = self.authority(authority)?;
        Ok(a.approved()
            .saturating_add(bytes)
            .saturating_sub(a.capacity))
    }

    fn owned_grant(&self, holder: HolderId, grant: GrantId) -> Result<&Claim, LedgerError> {
        let charge = self
            .grants
            .get(&grant)
            .ok_or(LedgerError::UnknownGrant(grant))?;
        presented_by(charge, holder)
    }

    /// Turns a grant into a lease of `actual` bytes: the real footprint. Less than granted
    /// refunds the difference; more tops up only if it fits, otherwise the commit is refused
    /// and the grant stays as it was.
    pub fn commit(
        &mut self,
        holder: HolderId,
        grant: GrantId,
        actual: u64,
    ) -> Result<LeaseRecord, LedgerError> {
        let charge = self.owned_grant(holder, grant)?.clone();
        if actual == 0 {
            return Err(LedgerError::ZeroBytes);
        }
        if actual > charge.bytes {
            let extra = actual - charge.bytes;
            if !self.fits(charge.authority, extra)? {
                let mut denial = self.denial(charge.authority, extra);
                denial.during_commit = true;
                return Err(LedgerError::Denied(Box::new(denial)));
            }
        }
        self.grant_to_leased(grant, &charge, actual);
        let id = LeaseId(self.fresh());
        let lease = Claim {
            bytes: actual,
            ..charge
        };
        self.leases.insert(id, lease.clone());
        Ok(LeaseRecord { id, claim: lease })
    }

    /// Takes `grant` (whose charge is `charge`) off the books' provisional bytes and books
    /// `leased` bytes in its place, for its authority and its holder: a commit's one step.
    fn grant_to_leased(&mut self, grant: GrantId, charge: &Claim, leased: u64) {
        self.grants.remove(&grant);
        let a = self
            .authorities
            .get_mut(&charge.authority)
            .expect("grant's authority");
        a.provisional -= charge.bytes;
        a.leased += leased;
        let h = self
            .holders
            .get_mut(&charge.holder)
            .expect("grant's holder");
        h.provisional -= charge.bytes;
        h.leased += leased;
    }

    /// Returns a grant unused; reports the bytes returned.
    pub fn cancel(&mut self, holder: HolderId, grant: GrantId) -> Result<u64, LedgerError> {
        let charge = self.owned_grant(holder, grant)?.clone();
        self.grants.remove(&grant);
        self.authorities
            .get_mut(&charge.authority)
            .expect("grant's authority")
            .provisional -= charge.bytes;
        self.holders
            .get_mut(&holder)
            .expect("grant's holder")
            .provisional -= charge.bytes;
        self.forget_if_done(holder);
        Ok(charge.bytes)
    }

    /// Releases `bytes` of a lease (all or part) because that memory was actually freed.
    /// Returns the bytes left on the lease; a lease at zero is gone, unless it is standing
    /// credit (that goes when it is closed).
    pub fn release(
        &mut self,
        holder: HolderId,
        lease: LeaseId,
        bytes: u64,
    ) -> Result<u64, LedgerError> {
        let charge = self
            .leases
            .get(&lease)
            .ok_or(LedgerError::UnknownLease(lease))?;
        let charge = presented_by(charge, holder)?;
        if bytes == 0 {
            return Err(LedgerError::ZeroBytes);
        }
        if bytes > charge.bytes {
            return Err(LedgerError::ReleaseExceedsLease {
                lease,
                leased: charge.bytes,
                asked: bytes,
            });
        }
        let authority = charge.authority;
        let remaining = charge.bytes - bytes;
        if remaining == 0 && !self.credit.contains(&lease) {
            self.leases.remove(&lease);
        } else {
            self.leases.get_mut(&lease).expect("checked").bytes = remaining;
        }
        self.authorities
            .get_mut(&authority)
            .expect("lease's authority")
            .leased -= bytes;
        self.holders
            .get_mut(&holder)
            .expect("lease's holder")
            .leased -= bytes;
        self.forget_if_done(holder);
        Ok(remaining)
    }

    /// The lease's current charge, if it exists.
    pub fn lease(&self, lease: LeaseId) -> Option<&Claim> {
        self.leases.get(&lease)
    }

    /// The grant's charge, if it is still provisional.
    pub fn grant(&self, grant: GrantId) -> Option<&Claim> {
        self.grants.get(&grant)
    }

    /// Sets what `authority` may approve. Lowering it below what is approved takes nothing
    /// back; approvals stop until releases bring the books under it.
    pub fn set_capacity(
        &mut self,
        authority: AuthorityId,
        capacity: u64,
    ) -> Result<(), LedgerError> {
        self.authorities
            .get_mut(&authority)
            .ok_or(LedgerError::UnknownAuthority(authority))?
            .capacity = capacity;
        Ok(())
    }
}
