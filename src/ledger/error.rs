//! Ledger refusals. Each one left the books unchanged.

use std::fmt;

use super::{AuthorityId, GrantId, HolderId, LeaseId};
use crate::api::{MemoryTier, Place};

/// One holder's share of an authority.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderUsage {
    /// Which holder.
    pub holder: HolderId,
    /// Its registered name.
    pub name: String,
    /// Its provisional bytes.
    pub provisional: u64,
    /// Its leased bytes.
    pub leased: u64,
}

impl HolderUsage {
    /// Provisional plus leased.
    pub fn total(&self) -> u64 {
        self.provisional.saturating_add(self.leased)
    }
}

/// Why a request did not fit: the diagnosis, not just the verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    /// The authority asked.
    pub authority: AuthorityId,
    /// Its name.
    pub authority_name: String,
    /// Bytes asked (for a commit, the top-up beyond the grant).
    pub asked: u64,
    /// The authority's capacity.
    pub capacity: u64,
    /// Bytes approved at the time.
    pub approved: u64,
    /// Bytes wanted by requests queued ahead of this one (free bytes they need are not
    /// free for it).
    pub waiting: u64,
    /// The largest holders with their bytes.
    pub top_holders: Vec<HolderUsage>,
    /// True when the denial refused a commit's top-up (the grant stays as it was).
    pub during_commit: bool,
}

impl Denial {
    /// Bytes that were free.
    pub fn free(&self) -> u64 {
        self.capacity.saturating_sub(self.approved)
    }
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}): asked {} bytes{}, {} free of {} ({} approved, {} wanted by requests queued ahead); largest holders:",
            self.authority_name,
            self.authority,
            self.asked,
            if self.during_commit {
                " to top up a commit"
            } else {
                ""
            },
            self.free(),
            self.capacity,
            self.approved,
            self.waiting
        )?;
        if self.top_holders.is_empty() {
            write!(f, " none")?;
        }
        for (i, h) in self.top_holders.iter().enumerate() {
            let sep = if i == 0 { " " } else { ", " };
            write!(
                f,
                "{sep}{} {} bytes ({} leased)",
                h.name,
                h.total(),
                h.leased
            )?;
        }
        Ok(())
    }
}

/// Why the ledger refused an operation. The books are unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    /// The request does not fit; the denial names what is free and who holds the rest.
    #[error("denied: {0}")]
    Denied(Box<Denial>),
    /// No such authority in this ledger.
    #[error("{0} is not an authority of this ledger")]
    UnknownAuthority(AuthorityId),
    /// No such holder (never registered here, or retired with nothing left).
    #[error("{0} is not registered")]
    UnknownHolder(HolderId),
    /// The holder was retired and may not reserve or cancel any more.
    #[error("{0} is retired")]
    HolderRetired(HolderId),
    /// The holder belongs to another authority.
    #[error("{holder} is registered with {registered}, not {asked}")]
    WrongAuthority {
        /// The holder.
        holder: HolderId,
        /// Where it is registered.
        registered: AuthorityId,
        /// Where it asked.
        asked: AuthorityId,
    },
    /// The grant was never issued here, or was already committed or cancelled.
    #[error("{0} is unknown: never issued here, or already committed or cancelled")]
    UnknownGrant(GrantId),
    /// The lease was never issued here, or was already released in full.
    #[error("{0} is unknown: never issued here, or already released")]
    UnknownLease(LeaseId),
    /// The lease is not an open credit line.
    #[error("{0} is not an open credit line")]
    NotCredit(LeaseId),
    /// The grant or lease belongs to another holder.
    #[error("issued to {owner}, presented by {caller}")]
    NotYours {
        /// Who it was issued to.
        owner: HolderId,
        /// Who presented it.
        caller: HolderId,
    },
    /// Zero bytes were asked, committed or released.
    #[error(
        "zero bytes: reserve, commit and release move at least one byte (cancel returns a grant)"
    )]
    ZeroBytes,
    /// A release larger than the lease.
    #[error("{lease} holds {leased} bytes; cannot release {asked}")]
    ReleaseExceedsLease {
        /// The lease.
        lease: LeaseId,
        /// What it holds.
        leased: u64,
        /// What was asked.
        asked: u64,
    },
    /// The tier is already paid for by another authority.
    #[error("{tier:?} on {place} is already bound to {authority}")]
    TierAlreadyBound {
        /// The place.
        place: Place,
        /// The tier.
        tier: MemoryTier,
        /// The authority it is bound to.
        authority: AuthorityId,
    },
}
