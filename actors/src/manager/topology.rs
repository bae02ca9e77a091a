//! Which authority pays for which (place, tier): the ledger's own tier bindings
//! ([`Ledger::bind_tier`], [`Ledger::authority_for`]) over one topology ledger of every
//! authority. Each Governor keeps the books of one authority, split off it
//! ([`Ledger::books_for`]), so an authority has one identity everywhere.

use std::collections::BTreeMap;

use procmem::ledger::{AuthorityId, Ledger, LedgerError};
use procmem::{MemoryTier, Place};

use crate::governor::GovernorHandle;

/// One authority: a Governor and the tiers it pays for.
#[derive(Debug, Clone)]
pub struct Authority {
    /// Its name.
    pub name: String,
    /// Its Governor.
    pub governor: GovernorHandle,
    /// The (place, tier) pairs it pays for.
    pub tiers: Vec<(Place, MemoryTier)>,
}

/// The authorities of a process and the tiers each pays for.
#[derive(Debug, Default)]
pub(crate) struct Topology {
    books: Ledger,
    authorities: Vec<Authority>,
    index: BTreeMap<AuthorityId, usize>,
}

impl Topology {
    /// Adds an authority of `capacity` bytes paying for `tiers`; its Governor is spawned over
    /// [`Topology::books_for`] and handed to [`Topology::serve`]. Refused if a tier is
    /// already paid for by another authority.
    pub(crate) fn add(
        &mut self,
        name: &str,
        capacity: u64,
        tiers: &[(Place, MemoryTier)],
    ) -> Result<AuthorityId, LedgerError> {
        if let Some((place, tier)) = tiers
            .iter()
            .find(|(p, t)| self.books.authority_for(*p, *t).is_some())
        {
            let authority = self
                .books
                .authority_for(*place, *tier)
                .expect("found bound");
            return Err(LedgerError::TierAlreadyBound {
                place: *place,
                tier: *tier,
                authority,
            });
        }
        let id = self.books.add_authority(name, capacity);
        for (place, tier) in tiers {
            self.books.bind_tier(*place, *tier, id)?;
        }
        Ok(id)
    }

    /// Fresh books for `authority`, for its Governor.
    pub(crate) fn books_for(&self, authority: AuthorityId) -> Result<Ledger, LedgerError> {
        self.books.books_for(authority)
    }

    /// Records the Governor that keeps `governor.authority()`'s books.
    pub(crate) fn serve(&mut self, name: &str, governor: GovernorHandle) {
        let id = governor.authority();
        let tiers = self.books.tiers_of(id);
        self.index.insert(id, self.authorities.len());
        self.authorities.push(Authority {
            name: name.to_owned(),
            governor,
            tiers,
        });
    }

    /// Every authority, in the order they were added.
    pub(crate) fn authorities(&self) -> &[Authority] {
        &self.authorities
    }

    /// The Governor paying for `tier` on `place`.
    pub(crate) fn governor(&self, place: Place, tier: MemoryTier) -> Option<&GovernorHandle> {
        let id = self.books.authority_for(place, tier)?;
        let at = *self.index.get(&id)?;
        Some(&self.authorities[at].governor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tier_has_one_authority_and_unified_tiers_share_it() {
        let mut t = Topology::default();
        let host = t
            .add(
                "host",
                100,
                &[
                    (Place::HOST, MemoryTier::Host),
                    (Place::cuda(0), MemoryTier::Device),
                ],
            )
            .unwrap();
        let again = t.add("cuda:0", 50, &[(Place::cuda(0), MemoryTier::Device)]);
        assert!(
            matches!(again, Err(LedgerError::TierAlreadyBound { authority, .. }) if authority == host)
        );
        assert_eq!(
            t.books_for(host).unwrap().totals(host).map(|t| t.capacity),
            Some(100)
        );
    }
}
