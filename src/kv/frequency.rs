//! Who may enter a slow tier, pure: a frequency filter in front of the disk, so a prompt seen
//! once never churns it and hot prefixes are not pushed out by cold ones.
//!
//! **The choice.** A block may enter the disk tier only once it has been asked for at least
//! [`AdmissionFilter::min_hits`] times (two by default), counted by a TinyLFU-style sketch
//! rather than an exact table:
//! - an exact "hit twice" table grows with every distinct block ever seen (one entry per
//!   one-off prompt block, forever), which is the churn the filter is there to stop; the
//!   sketch is a fixed `4 x width` array of 4-bit-range counters, whatever the traffic;
//! - the sketch ages: after `10 x width` recorded hits every counter is halved, so a prefix
//!   that was hot yesterday does not keep its place against one that is hot now;
//! - where the tier is full, a candidate enters only if it is asked for more often than the
//!   block it would push out (TinyLFU's rule), so a burst of lukewarm blocks cannot flush the
//!   hot ones.
//!
//! A count-min sketch errs one way only: its estimate is never below the true (aged,
//! saturated) count, so a block asked for twice is always admitted. It can over-estimate
//! where keys share counters in every row, so a one-off block can, rarely, pass; the
//! property test in `tests/kv_admission.rs` checks the one-sided bound against an exact
//! reference, and that the estimate is exact where a key has a counter of its own.

/// The most a counter holds (TinyLFU's 4-bit counters).
pub const MAX_COUNT: u8 = 15;

/// How many hash rows the sketch keeps.
pub const ROWS: usize = 4;

/// A count-min sketch of how often each key was asked for, with aging.
#[derive(Debug, Clone)]
pub struct FrequencySketch {
    width: usize,
    counters: Vec<u8>,
    /// Hits recorded since the last halving.
    recorded: u64,
    /// Hits after which every counter is halved.
    sample: u64,
}

impl FrequencySketch {
    /// A sketch for about `capacity` distinct hot keys (at least 16 counters a row).
    pub fn new(capacity: usize) -> Self {
        let width = capacity.clamp(16, 1 << 20).next_power_of_two();
        FrequencySketch {
            width,
            counters: vec![0; ROWS * width],
            recorded: 0,
            sample: 10 * width as u64,
        }
    }

    /// Counters per row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Hits after which every counter is halved.
    pub fn sample(&self) -> u64 {
        self.sample
    }

    /// The counter `key` uses in `row`.
    pub fn slot(&self, key: u64, row: usize) -> usize {
        // A different odd multiplier per row, then the top bits (a multiplicative hash).
        const SEEDS: [u64; ROWS] = [
            0x9e37_79b9_7f4a_7c15,
            0xc2b2_ae3d_27d4_eb4f,
            0x1656_67b1_9e37_79f9,
            0x27d4_eb2f_1656_67c5,
        ];
        let mixed = (key ^ (key >> 29)).wrapping_mul(SEEDS[row]);
        let bits = self.width.trailing_zeros();
        row * self.width + (mixed >> (64 - bits)) as usize
    }

    /// Records one hit of `key`. Returns whether this hit halved every counter (aging).
    pub fn record(&mut self, key: u64) -> bool {
        for row in 0..ROWS {
            let slot = self.slot(key, row);
            let c = &mut self.counters[slot];
            *c = (*c + 1).min(MAX_COUNT);
        }
        self.recorded += 1;
        if self.recorded >= self.sample {
            for c in &mut self.counters {
                *c /= 2;
            }
            self.recorded = 0;
            return true;
        }
        false
    }

    /// How often `key` was asked for (aged, at most [`MAX_COUNT`]): never below the truth.
    pub fn estimate(&self, key: u64) -> u8 {
        (0..ROWS)
            .map(|row| self.counters[self.slot(key, row)])
            .min()
            .unwrap_or(0)
    }
}

/// The disk tier's door: a block enters once asked for often enough, and, where the tier is
/// full, only ahead of a block asked for less.
#[derive(Debug, Clone)]
pub struct AdmissionFilter {
    sketch: FrequencySketch,
    min_hits: u8,
    refused: u64,
}

/// Why a block was or was not let into the tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// It enters (with room, or ahead of the victim named).
    Admit,
    /// Asked for fewer than `min_hits` times: a one-off stays out.
    TooRare,
    /// The tier is full and the block it would push out is asked for at least as often.
    ColderThanVictim,
}

impl AdmissionFilter {
    /// A filter for about `capacity` blocks that admits a block asked for `min_hits` times
    /// (at least 1, at most [`MAX_COUNT`]).
    pub fn new(capacity: usize, min_hits: u8) -> Self {
        AdmissionFilter {
            sketch: FrequencySketch::new(capacity),
            min_hits: min_hits.clamp(1, MAX_COUNT),
            refused: 0,
        }
    }

    /// How many hits a block needs.
    pub fn min_hits(&self) -> u8 {
        self.min_hits
    }

    /// Records that `key` was asked for (a lookup, hit or miss, in any tier).
    pub fn record(&mut self, key: u64) {
        self.sketch.record(key);
    }

    /// How often `key` was asked for, as the sketch estimates it.
    pub fn frequency(&self, key: u64) -> u8 {
        self.sketch.estimate(key)
    }

    /// Whether `candidate` may enter; `victim` is the block it would push out where the tier
    /// is full (`None` where there is room). A refusal is counted.
    pub fn admit(&mut self, candidate: u64, victim: Option<u64>) -> Admission {
        let f = self.sketch.estimate(candidate);
        let verdict = if f < self.min_hits {
            Admission::TooRare
        } else if victim.is_some_and(|v| self.sketch.estimate(v) >= f) {
            Admission::ColderThanVictim
        } else {
            Admission::Admit
        };
        if verdict != Admission::Admit {
            self.refused += 1;
        }
        verdict
    }

    /// How many admissions were refused.
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// The sketch.
    pub fn sketch(&self) -> &FrequencySketch {
        &self.sketch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_one_off_stays_out_and_a_second_ask_lets_it_in() {
        let mut f = AdmissionFilter::new(1024, 2);
        f.record(7);
        assert_eq!(f.admit(7, None), Admission::TooRare);
        f.record(7);
        assert_eq!(f.admit(7, None), Admission::Admit);
        assert_eq!(f.refused(), 1);
    }

    #[test]
    fn a_full_tier_keeps_the_hotter_block() {
        let mut f = AdmissionFilter::new(1024, 2);
        for _ in 0..5 {
            f.record(1);
        }
        for _ in 0..2 {
            f.record(2);
        }
        assert_eq!(f.admit(2, Some(1)), Admission::ColderThanVictim);
        assert_eq!(f.admit(1, Some(2)), Admission::Admit);
    }

    #[test]
    fn counters_saturate_and_age() {
        let mut s = FrequencySketch::new(16);
        for _ in 0..40 {
            s.record(3);
        }
        assert_eq!(s.estimate(3), MAX_COUNT);
        let mut halved = false;
        for k in 0..s.sample() {
            halved |= s.record(1000 + k);
        }
        assert!(halved, "a sample's worth of hits halves the counters");
        assert!(s.estimate(3) < MAX_COUNT);
    }

    #[test]
    fn extreme_arguments_are_clamped() {
        let f = AdmissionFilter::new(usize::MAX, u8::MAX);
        assert_eq!(f.min_hits(), MAX_COUNT);
        assert_eq!(f.sketch().width(), 1 << 20);
        let f = AdmissionFilter::new(0, 0);
        assert_eq!(f.min_hits(), 1);
        assert_eq!(f.sketch().width(), 16);
        assert_eq!(f.frequency(u64::MAX), 0);
    }
}
