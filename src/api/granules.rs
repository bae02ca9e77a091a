//! Per-granule bookkeeping of a reservation: pure, no system calls.
//!
//! Every mechanism validates ranges the same way through this map, so the rules
//! (non-empty, granule-aligned, inside the reservation, state as required) live in one place
//! and a refused request never reaches the OS.

use std::ops::Range;

use super::error::MemoryError;

/// What sits behind one granule of a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GranuleState {
    /// Address only: nothing is mapped, touching it faults.
    Reserved,
    /// Backed by physical memory owned by this reservation alone.
    Committed,
    /// Backed by a shared physical block that other reservations may map too.
    Shared,
}

/// The state of every granule of one reservation.
#[derive(Debug, Clone)]
pub struct GranuleMap {
    granularity: u64,
    states: Vec<GranuleState>,
    committed: usize,
    shared: usize,
}

impl GranuleMap {
    /// A map of `len` bytes, all reserved. `len` must already be validated as a non-zero
    /// multiple of `granularity`.
    pub(crate) fn new(len: u64, granularity: u64) -> Self {
        let count = usize::try_from(len / granularity).unwrap_or(usize::MAX);
        GranuleMap {
            granularity,
            states: vec![GranuleState::Reserved; count],
            committed: 0,
            shared: 0,
        }
    }

    /// Checks a reservation length: non-zero and a whole number of granules.
    pub fn validate_len(len: u64, granularity: u64) -> Result<(), MemoryError> {
        if len == 0 {
            return Err(MemoryError::ZeroSize {
                what: "reservation length",
            });
        }
        if len % granularity != 0 {
            return Err(MemoryError::Misaligned {
                what: "reservation length",
                value: len,
                granularity,
            });
        }
        if usize::try_from(len).is_err() || len > isize::MAX as u64 {
            return Err(MemoryError::SizeOverflow {
                what: "reservation length",
            });
        }
        Ok(())
    }

    /// The mapping granularity in bytes.
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// The reservation's length in bytes.
    pub fn len_bytes(&self) -> u64 {
        self.states.len() as u64 * self.granularity
    }

    /// Bytes this map believes are exclusively committed.
    pub fn committed_bytes(&self) -> u64 {
        self.committed as u64 * self.granularity
    }

    /// Bytes this map believes are backed by shared blocks.
    pub fn shared_bytes(&self) -> u64 {
        self.shared as u64 * self.granularity
    }

    /// The state of the granule holding `offset`, if inside the reservation.
    pub fn state_at(&self, offset: u64) -> Option<GranuleState> {
        let index = usize::try_from(offset / self.granularity).ok()?;
        self.states.get(index).copied()
    }

    /// Validates a byte range: non-empty, granule-aligned at both ends, inside the reservation.
    /// Returns the granule indices it covers.
    pub fn validate_range(&self, range: &Range<u64>) -> Result<Range<usize>, MemoryError> {
        if range.end < range.start {
            return Err(MemoryError::SizeOverflow {
                what: "range end before start",
            });
        }
        if range.start == range.end {
            return Err(MemoryError::ZeroSize { what: "range" });
        }
        for (what, value) in [("range start", range.start), ("range end", range.end)] {
            if value % self.granularity != 0 {
                return Err(MemoryError::Misaligned {
                    what,
                    value,
                    granularity: self.granularity,
                });
            }
        }
        if range.end > self.len_bytes() {
            return Err(MemoryError::OutOfReservation {
                range: range.clone(),
                reserved: self.len_bytes(),
            });
        }
        let g = self.granularity;
        Ok((range.start / g) as usize..(range.end / g) as usize)
    }

    /// Fails unless every granule in `granules` is only reserved.
    pub fn require_reserved(&self, granules: &Range<usize>) -> Result<(), MemoryError> {
        match self.states[granules.clone()]
            .iter()
            .position(|s| *s != GranuleState::Reserved)
        {
            Some(i) => Err(MemoryError::AlreadyCommitted {
                offset: (granules.start + i) as u64 * self.granularity,
            }),
            None => Ok(()),
        }
    }

    /// Fails unless every granule in `granules` is backed (committed or shared).
    pub fn require_backed(&self, granules: &Range<usize>) -> Result<(), MemoryError> {
        match self.states[granules.clone()]
            .iter()
            .position(|s| *s == GranuleState::Reserved)
        {
            Some(i) => Err(MemoryError::NotCommitted {
                offset: (granules.start + i) as u64 * self.granularity,
            }),
            None => Ok(()),
        }
    }

    /// Sets every granule in `granules` to `state`, keeping the counts exact.
    pub(crate) fn set(&mut self, granules: Range<usize>, state: GranuleState) {
        for s in &mut self.states[granules] {
            match *s {
                GranuleState::Committed => self.committed -= 1,
                GranuleState::Shared => self.shared -= 1,
                GranuleState::Reserved => {}
            }
            match state {
                GranuleState::Committed => self.committed += 1,
                GranuleState::Shared => self.shared += 1,
                GranuleState::Reserved => {}
            }
            *s = state;
        }
    }

    /// Maximal runs of granules in `state` inside `granules`, as byte ranges.
    pub fn runs(&self, granules: Range<usize>, state: GranuleState) -> Vec<Range<u64>> {
        let g = self.granularity;
        let mut runs = Vec::new();
        let mut open: Option<usize> = None;
        for i in granules.clone() {
            match (self.states[i] == state, open) {
                (true, None) => open = Some(i),
                (false, Some(start)) => {
                    runs.push(start as u64 * g..i as u64 * g);
                    open = None;
                }
                _ => {}
            }
        }
        if let Some(start) = open {
            runs.push(start as u64 * g..granules.end as u64 * g);
        }
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_ranges_without_touching_state() {
        let map = GranuleMap::new(8 * 4096, 4096);
        assert!(matches!(
            map.validate_range(&(0..0)),
            Err(MemoryError::ZeroSize { .. })
        ));
        assert!(matches!(
            map.validate_range(&(1..4096)),
            Err(MemoryError::Misaligned { value: 1, .. })
        ));
        assert!(matches!(
            map.validate_range(&(0..9 * 4096)),
            Err(MemoryError::OutOfReservation { .. })
        ));
        assert_eq!(map.validate_range(&(4096..3 * 4096)).unwrap(), 1..3);
    }

    #[test]
    fn counts_follow_state_changes_and_runs_coalesce() {
        let mut map = GranuleMap::new(8 * 4096, 4096);
        map.set(1..3, GranuleState::Committed);
        map.set(4..6, GranuleState::Shared);
        map.set(5..7, GranuleState::Committed);
        assert_eq!(map.committed_bytes(), 4 * 4096);
        assert_eq!(map.shared_bytes(), 4096);
        assert_eq!(
            map.runs(0..8, GranuleState::Committed),
            vec![4096..3 * 4096, 5 * 4096..7 * 4096]
        );
        assert!(matches!(
            map.require_reserved(&(0..2)),
            Err(MemoryError::AlreadyCommitted { offset: 4096 })
        ));
        assert!(matches!(
            map.require_backed(&(1..4)),
            Err(MemoryError::NotCommitted { offset: 12288 })
        ));
    }
}
