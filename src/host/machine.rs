//! The host authority's capacity following the machine: cgroup limits and Linux PSI, as pure
//! parsing and a pure policy (the actors crate reads the files on a timer and applies it).
//!
//! The capacity is the configured budget, cut to the cgroup's limit (`memory.high` where set,
//! else `memory.max`; cgroup v1's soft and hard limits likewise) less a reserve for memory the
//! Governor does not govern. When memory pressure (`some avg10`, the share of the last ten
//! seconds some task stalled on memory) rises above a threshold, each sample lowers the
//! capacity by a step, down to a floor, so pressure tickets make room before the kernel reclaims
//! or the OOM killer acts; once pressure falls below half the threshold each sample gives a
//! step back.

/// One reading of a PSI file (`/proc/pressure/memory` or a cgroup's `memory.pressure`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PsiSample {
    /// `some avg10`: percent of the last 10 s in which some task stalled on memory.
    pub some_avg10: f64,
    /// `full avg10`: percent in which all non-idle tasks stalled.
    pub full_avg10: f64,
    /// `some total`: microseconds of stall since boot.
    pub some_total_us: u64,
}

/// Why a file did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot parse {what}: {line:?}")]
pub struct ParseError {
    /// Which file.
    pub what: &'static str,
    /// The line.
    pub line: String,
}

impl ParseError {
    /// `what` did not parse at `line` (kept to its first 200 characters).
    fn new(what: &'static str, line: &str) -> Self {
        ParseError {
            what,
            line: line.chars().take(200).collect(),
        }
    }
}

fn field(line: &str, key: &str) -> Option<String> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=').map(str::to_owned))
}

/// Parses a PSI file.
pub fn parse_psi(text: &str) -> Result<PsiSample, ParseError> {
    let bad = |line: &str| ParseError::new("PSI", line);
    let mut sample = PsiSample::default();
    let mut saw_some = false;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let kind = line.split_whitespace().next().unwrap_or("");
        let avg10: f64 = field(line, "avg10")
            .and_then(|v| v.parse().ok())
            .filter(|v: &f64| v.is_finite() && (0.0..=100.0).contains(v))
            .ok_or_else(|| bad(line))?;
        let total: u64 = field(line, "total")
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad(line))?;
        match kind {
            "some" => {
                sample.some_avg10 = avg10;
                sample.some_total_us = total;
                saw_some = true;
            }
            "full" => sample.full_avg10 = avg10,
            _ => return Err(bad(line)),
        }
    }
    if saw_some {
        Ok(sample)
    } else {
        Err(bad(text))
    }
}

/// Parses a cgroup limit file: a byte count, or `max` (v2) or a number near `i64::MAX` (v1's
/// "no limit") for none.
pub fn parse_limit(text: &str) -> Result<Option<u64>, ParseError> {
    let t = text.trim();
    if t == "max" {
        return Ok(None);
    }
    let v: u64 = t.parse().map_err(|_| ParseError::new("cgroup limit", t))?;
    // cgroup v1 writes "no limit" as i64::MAX rounded down to a page.
    Ok((v < 1 << 62).then_some(v))
}

/// The limits of the cgroup the process runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CgroupLimits {
    /// Hard limit (`memory.max`; v1 `memory.limit_in_bytes`): the OOM killer acts there.
    pub max: Option<u64>,
    /// Throttling limit (`memory.high`; v1 `memory.soft_limit_in_bytes`): reclaim starts there.
    pub high: Option<u64>,
}

impl CgroupLimits {
    /// The lower of the two limits, if any is set.
    pub fn effective(&self) -> Option<u64> {
        match (self.max, self.high) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// How the host capacity follows the machine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PressurePolicy {
    /// The budget asked for.
    pub configured: u64,
    /// The least kept free under a cgroup limit for memory the Governor does not govern (the
    /// heap, code, other libraries); more where the gauge measures more (see
    /// [`PressureGauge::outside`]).
    pub reserve: u64,
    /// `some avg10` (percent) above which the capacity is lowered.
    pub threshold: f64,
    /// Fraction of the base capacity each sample under pressure takes off (and gives back).
    pub step: f64,
    /// The capacity never goes below this fraction of its base.
    pub floor: f64,
}

impl PressurePolicy {
    /// `configured` bytes, a reserve of at least 64 MiB, threshold 10 %, steps of 10 %, floor 25 %.
    pub fn new(configured: u64) -> Self {
        PressurePolicy {
            configured,
            reserve: 64 << 20,
            threshold: 10.0,
            step: 0.10,
            floor: 0.25,
        }
    }
}

/// Readings of the memory held outside the Governor's books the reserve follows.
const OUTSIDE_READINGS: usize = 10;

/// The reserve is kept in whole steps of this, so a capacity does not move with every page.
const RESERVE_STEP: u64 = 4 << 20;

/// Parses a cgroup's `memory.stat` for its inactive file pages (`inactive_file`; v1's
/// hierarchical `total_inactive_file` where present): page cache the kernel reclaims first.
pub fn parse_inactive_file(stat: &str) -> Result<u64, ParseError> {
    let value = |key: &str| {
        stat.lines().find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == key).then(|| v.trim().parse::<u64>().ok())
        })
    };
    match value("total_inactive_file").or_else(|| value("inactive_file")) {
        Some(Some(v)) => Ok(v),
        _ => Err(ParseError::new(
            "memory.stat",
            stat.lines().next().unwrap_or(""),
        )),
    }
}

/// A process's resident pages by kind, from `/proc/<pid>/status` (`RssAnon`, `RssFile`,
/// `RssShmem`), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProcessRss {
    /// Anonymous pages: heap, stacks, private mappings (the eager host allocations too).
    pub anon: u64,
    /// Pages of mapped files: the program's code and libraries, files it maps.
    pub file: u64,
    /// Shared memory mapped (memfd, tmpfs): the KV backing's mapped pages.
    pub shmem: u64,
}

/// Parses `/proc/<pid>/status` for [`ProcessRss`]; a field missing or unreadable is an error
/// (a kernel too old to split `VmRSS`, or not Linux).
pub fn parse_process_rss(status: &str) -> Result<ProcessRss, ParseError> {
    let kb = |key: &str| {
        status.lines().find_map(|l| {
            let rest = l.strip_prefix(key)?.strip_prefix(':')?;
            let n = rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
            n.checked_mul(1024)
        })
    };
    match (kb("RssAnon"), kb("RssFile"), kb("RssShmem")) {
        (Some(anon), Some(file), Some(shmem)) => Ok(ProcessRss { anon, file, shmem }),
        _ => Err(ParseError::new(
            "/proc/self/status",
            status.lines().next().unwrap_or(""),
        )),
    }
}

/// What a process holds beside what its books hold, as the kernel reports both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProcessMemory {
    /// Resident bytes the process holds: anonymous and file-backed pages, and every page of
    /// its shared backing once (a memfd's pages, whether a view maps them now, or several).
    pub held: u64,
    /// Of those, the holders' memory that the books pay for: the backing's pages and the
    /// eager allocations' resident pages.
    pub books: u64,
    /// The rest: heap, code, scratch, activations, anything no holder leases.
    pub outside: u64,
}

impl ProcessMemory {
    /// From the process's resident pages, its shared backing's pages (`backing`: a memfd's
    /// allocated blocks) and its eager allocations' resident pages (`eager`, anonymous).
    pub fn new(rss: ProcessRss, backing: u64, eager: u64) -> Self {
        // Not `RssShmem`: the kernel counts a shared page once per mapping of it, and a prefix
        // shared by eight sequences is mapped eight times. The memfd's blocks count it once.
        let held = rss.anon.saturating_add(rss.file).saturating_add(backing);
        let books = backing.saturating_add(eager);
        ProcessMemory {
            held,
            books,
            outside: held.saturating_sub(books),
        }
    }

    /// The same with `reserved` bytes more in the books: a named reserve the Governor holds
    /// for memory no mechanism allocates (a step's activations on the heap).
    pub fn with_reserve(self, reserved: u64) -> Self {
        let books = self.books.saturating_add(reserved);
        ProcessMemory {
            books,
            outside: self.held.saturating_sub(books),
            ..self
        }
    }
}

/// The policy's state: how far pressure has cut the capacity, and the last readings of what
/// the process's cgroup holds outside the Governor's books.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PressureGauge {
    /// Fraction of the base taken off, in `[0, 1 - floor]`.
    cut: f64,
    /// The last readings of [`PressureGauge::outside`], a ring.
    outside: [u64; OUTSIDE_READINGS],
    readings: usize,
}

impl PressureGauge {
    /// The capacity after one sample: the base from the limits, cut further while `psi` says
    /// memory is under pressure, and restored step by step as it falls.
    pub fn next(
        &mut self,
        policy: &PressurePolicy,
        limits: CgroupLimits,
        psi: Option<PsiSample>,
    ) -> u64 {
        let base = match limits.effective() {
            Some(limit) => policy
                .configured
                .min(limit.saturating_sub(self.reserve(policy))),
            None => policy.configured,
        };
        let step = policy.step.clamp(0.0, 1.0);
        let most = (1.0 - policy.floor.clamp(0.0, 1.0)).max(0.0);
        if let Some(psi) = psi {
            if psi.some_avg10 > policy.threshold {
                self.cut = (self.cut + step).min(most);
            } else if psi.some_avg10 < policy.threshold / 2.0 {
                self.cut = (self.cut - step).max(0.0);
            }
        }
        let kept = (1.0 - self.cut).clamp(0.0, 1.0);
        (base as f64 * kept) as u64
    }

    /// Records a reading of the memory the process's cgroup holds outside the Governor's books:
    /// its working set (usage less inactive file pages) less what the Governor approved. That
    /// is the heap, activations, code and the model file's active pages, which a fixed reserve
    /// only guesses.
    pub fn outside(&mut self, bytes: u64) {
        self.outside[self.readings % OUTSIDE_READINGS] = bytes;
        self.readings = self.readings.wrapping_add(1);
    }

    /// What a limit keeps free for memory the Governor does not govern: the largest of the
    /// last ten readings of [`PressureGauge::outside`] rounded up to 4 MiB, never less than
    /// the policy's reserve.
    pub fn reserve(&self, policy: &PressurePolicy) -> u64 {
        let seen = self.outside.iter().copied().max().unwrap_or(0);
        let seen = seen
            .checked_next_multiple_of(RESERVE_STEP)
            .unwrap_or(u64::MAX);
        policy.reserve.max(seen)
    }

    /// Fraction of the base taken off now.
    pub fn cut(&self) -> f64 {
        self.cut
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_memory_splits_the_books_from_the_rest() {
        let status = "Name:\tx\nVmRSS:\t  300 kB\nRssAnon:\t  200 kB\nRssFile:\t   60 kB\nRssShmem:\t   40 kB\n";
        let rss = parse_process_rss(status).unwrap();
        assert_eq!(
            rss,
            ProcessRss {
                anon: 200 << 10,
                file: 60 << 10,
                shmem: 40 << 10
            }
        );
        // 100 KiB of memfd, 40 of it mapped; 50 KiB of eager (anonymous) allocations.
        let m = ProcessMemory::new(rss, 100 << 10, 50 << 10);
        assert_eq!(m.held, (200 + 60 + 100) << 10);
        assert_eq!(m.books, 150 << 10);
        assert_eq!(m.outside, 210 << 10);
        // A memfd page mapped at two addresses is in `RssShmem` twice, in the memfd once.
        let twice = ProcessRss {
            shmem: 80 << 10,
            ..rss
        };
        assert_eq!(
            ProcessMemory::new(twice, 40 << 10, 0).held,
            (200 + 60 + 40) << 10
        );
        let reserved = m.with_reserve(100 << 10);
        assert_eq!((reserved.books, reserved.outside), (250 << 10, 110 << 10));
        assert_eq!(m.with_reserve(u64::MAX).outside, 0);
        // Books above what is seen (a racing read) never go below zero.
        assert_eq!(ProcessMemory::new(rss, 0, u64::MAX).outside, 0);
        for bad in [
            "",
            "RssAnon: 1 kB\n",
            "RssAnon: x kB\nRssFile: 1 kB\nRssShmem: 1 kB\n",
            "RssAnon: 99999999999999999999 kB\nRssFile: 1 kB\nRssShmem: 1 kB\n",
        ] {
            assert!(parse_process_rss(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn psi_files_parse_and_garbage_is_an_error() {
        let text = "some avg10=12.50 avg60=3.00 avg300=1.00 total=332564551\n\
                    full avg10=2.00 avg60=0.00 avg300=0.00 total=313283928\n";
        let s = parse_psi(text).unwrap();
        assert_eq!(
            (s.some_avg10, s.full_avg10, s.some_total_us),
            (12.5, 2.0, 332564551)
        );
        assert!(parse_psi("").is_err());
        assert!(parse_psi("some avg10=x total=1").is_err());
        assert!(parse_psi("some avg10=101 total=1").is_err(), "over 100 %");
        assert!(parse_psi("some avg10=NaN total=1").is_err());
        assert!(parse_psi("weird avg10=1 total=1").is_err());
        assert!(parse_psi("full avg10=1 total=1").is_err(), "no some line");
    }

    #[test]
    fn memory_stat_gives_inactive_file_pages() {
        let v1 = "cache 100\nrss 5\ninactive_file 7\ntotal_inactive_file 9\n";
        assert_eq!(parse_inactive_file(v1), Ok(9), "v1: the hierarchy's");
        assert_eq!(parse_inactive_file("anon 4\ninactive_file 12\n"), Ok(12));
        assert!(parse_inactive_file("").is_err());
        assert!(parse_inactive_file("inactive_file -3\n").is_err());
        assert!(parse_inactive_file("inactive_file 99999999999999999999999\n").is_err());
    }

    #[test]
    fn limits_parse_max_and_v1_unlimited_as_none() {
        assert_eq!(parse_limit("max\n"), Ok(None));
        assert_eq!(parse_limit("9223372036854771712"), Ok(None));
        assert_eq!(parse_limit("123731968\n"), Ok(Some(123731968)));
        assert!(parse_limit("-1").is_err());
        assert!(parse_limit("").is_err());
        let l = CgroupLimits {
            max: Some(100),
            high: Some(80),
        };
        assert_eq!(l.effective(), Some(80));
        assert_eq!(CgroupLimits::default().effective(), None);
    }

    #[test]
    fn capacity_follows_limits_and_pressure_with_hysteresis_and_a_floor() {
        let mut p = PressurePolicy::new(1000);
        p.reserve = 100;
        let mut g = PressureGauge::default();
        let calm = Some(PsiSample::default());
        let hot = Some(PsiSample {
            some_avg10: 50.0,
            ..PsiSample::default()
        });
        let between = Some(PsiSample {
            some_avg10: 7.0,
            ..PsiSample::default()
        });
        let none = CgroupLimits::default();
        assert_eq!(g.next(&p, none, calm), 1000);
        let limited = CgroupLimits {
            max: Some(600),
            high: None,
        };
        assert_eq!(g.next(&p, limited, calm), 500, "limit less the reserve");
        assert_eq!(g.next(&p, none, hot), 900);
        assert_eq!(g.next(&p, none, hot), 800);
        for _ in 0..20 {
            g.next(&p, none, hot);
        }
        assert_eq!(g.next(&p, none, hot), 250, "never below the floor");
        assert_eq!(
            g.next(&p, none, between),
            250,
            "between half and the threshold: held"
        );
        assert_eq!(g.next(&p, none, calm), 350, "calm gives a step back");
        assert_eq!(g.next(&p, none, None), 350, "no reading: held");
        let tiny = CgroupLimits {
            max: Some(50),
            high: None,
        };
        assert_eq!(
            g.next(&p, tiny, calm),
            0,
            "a limit under the reserve leaves nothing"
        );
        let mut measured = PressureGauge::default();
        let mut m = PressurePolicy::new(1 << 40);
        m.reserve = 64 << 20;
        let limit = CgroupLimits {
            max: Some(1 << 30),
            high: None,
        };
        assert_eq!(measured.next(&m, limit, calm), (1 << 30) - (64 << 20));
        measured.outside(230 << 20);
        assert_eq!(
            measured.next(&m, limit, calm),
            (1 << 30) - (232 << 20),
            "a measured 230 MiB outside the books, rounded up to 4 MiB"
        );
        for _ in 0..9 {
            measured.outside(10 << 20);
        }
        assert_eq!(
            measured.reserve(&m),
            232 << 20,
            "the largest of ten readings"
        );
        measured.outside(10 << 20);
        assert_eq!(measured.reserve(&m), 64 << 20, "never under the policy's");
        measured.outside(u64::MAX);
        assert_eq!(
            measured.next(&m, limit, calm),
            0,
            "more outside than the limit"
        );
        let mut huge = PressurePolicy::new(u64::MAX);
        huge.reserve = u64::MAX;
        assert_eq!(PressureGauge::default().next(&huge, none, calm), u64::MAX);
    }
}
