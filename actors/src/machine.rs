//! The host authority's capacity following the machine: a task reads the cgroup's limits and
//! memory pressure (PSI) on a timer and sets the host Governor's capacity by
//! [`procmem::host::machine`]'s policy. Lowering the capacity makes room by pressure tickets
//! (the Governor never takes bytes); raising it lets waiters in.
//!
//! PSI is polled: a trigger (`POLLPRI` on a written threshold) needs `CAP_SYS_RESOURCE` for
//! windows under 2 s, and a poll of one small file per interval costs microseconds.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use procmem::host::machine::{
    parse_inactive_file, parse_limit, parse_psi, CgroupLimits, PressureGauge, PressurePolicy,
    PsiSample,
};
use procmem::metrics as m;
use tokio::task::JoinHandle;

use crate::governor::GovernorHandle;

/// Whose capacity follows the machine: a process's host Governor, or one authority of a node
/// Governor (whose cgroup holds the node and its processes).
pub(crate) trait Followed: Send + Sync + 'static {
    /// What is approved on the books the capacity bounds (the memory they stand for).
    fn approved(&self) -> impl std::future::Future<Output = Option<u64>> + Send;
    /// Sets the capacity; false once the books are gone.
    fn set_capacity(&self, bytes: u64) -> impl std::future::Future<Output = bool> + Send;
}

impl Followed for GovernorHandle {
    async fn approved(&self) -> Option<u64> {
        self.snapshot().await.ok().map(|s| s.books.approved())
    }

    async fn set_capacity(&self, bytes: u64) -> bool {
        GovernorHandle::set_capacity(self, bytes).await.is_ok()
    }
}

/// Where the machine's figures come from (a fake one in tests).
pub trait MachineSource: Send + 'static {
    /// The limits of the cgroup the process runs in (none outside one).
    fn limits(&mut self) -> io::Result<CgroupLimits>;
    /// Memory pressure now, where the kernel reports it.
    fn psi(&mut self) -> io::Result<Option<PsiSample>>;
    /// The cgroup's working set: its usage less its inactive file pages (what the kernel
    /// reclaims first); `None` outside a cgroup.
    fn working_set(&mut self) -> io::Result<Option<u64>> {
        Ok(None)
    }
}

/// Which cgroup hierarchy a cgroup's files follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// `memory.max`, `memory.high`, `memory.pressure`.
    V2,
    /// `memory.limit_in_bytes`, `memory.soft_limit_in_bytes` (PSI from `/proc/pressure`).
    V1,
}

/// The real machine: a cgroup's files, and PSI from the cgroup (v2) or `/proc/pressure/memory`.
#[derive(Debug, Clone)]
pub struct LinuxSource {
    cgroup: Option<(PathBuf, CgroupVersion)>,
    psi: Option<PathBuf>,
}

impl LinuxSource {
    /// The cgroup this process runs in (`/proc/self/cgroup`), v2 first, then v1's memory
    /// controller; PSI from the cgroup or the whole machine.
    pub fn detect() -> Self {
        Self::from_cgroup_file(&std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default())
    }

    /// The memory cgroup named by a `/proc/<pid>/cgroup` text (of this process or another).
    pub fn from_cgroup_file(text: &str) -> Self {
        Self::for_cgroup(find_cgroup(text))
    }

    /// The given cgroup directory (or none).
    pub fn for_cgroup(cgroup: Option<(PathBuf, CgroupVersion)>) -> Self {
        let psi = cgroup
            .as_ref()
            .filter(|(_, v)| *v == CgroupVersion::V2)
            .map(|(dir, _)| dir.join("memory.pressure"))
            .filter(|p| p.exists())
            .or_else(|| Some(PathBuf::from("/proc/pressure/memory")).filter(|p| p.exists()));
        LinuxSource { cgroup, psi }
    }

    /// The cgroup followed, if any.
    pub fn cgroup(&self) -> Option<&(PathBuf, CgroupVersion)> {
        self.cgroup.as_ref()
    }
}

/// The memory cgroup of a `/proc/<pid>/cgroup` text, where its directory exists.
fn find_cgroup(text: &str) -> Option<(PathBuf, CgroupVersion)> {
    let mut v1 = None;
    let mut v2 = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let path = path.trim_start_matches('/');
        if controllers.is_empty() {
            for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
                let dir = Path::new(root).join(path);
                if dir.join("memory.max").exists() || dir.join("memory.high").exists() {
                    v2 = Some((dir, CgroupVersion::V2));
                    break;
                }
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            let dir = Path::new("/sys/fs/cgroup/memory").join(path);
            if dir.join("memory.limit_in_bytes").exists() {
                v1 = Some((dir, CgroupVersion::V1));
            }
        }
    }
    v2.or(v1)
}

fn read_limit(path: &Path) -> io::Result<Option<u64>> {
    match std::fs::read_to_string(path) {
        Ok(text) => parse_limit(&text).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

impl MachineSource for LinuxSource {
    fn limits(&mut self) -> io::Result<CgroupLimits> {
        let Some((dir, version)) = &self.cgroup else {
            return Ok(CgroupLimits::default());
        };
        let (max, high) = match version {
            CgroupVersion::V2 => ("memory.max", "memory.high"),
            CgroupVersion::V1 => ("memory.limit_in_bytes", "memory.soft_limit_in_bytes"),
        };
        Ok(CgroupLimits {
            max: read_limit(&dir.join(max))?,
            high: read_limit(&dir.join(high))?,
        })
    }

    fn working_set(&mut self) -> io::Result<Option<u64>> {
        let Some((dir, version)) = &self.cgroup else {
            return Ok(None);
        };
        let usage = match version {
            CgroupVersion::V2 => "memory.current",
            CgroupVersion::V1 => "memory.usage_in_bytes",
        };
        let bad = |e| io::Error::new(io::ErrorKind::InvalidData, e);
        let usage = read_limit(&dir.join(usage))?;
        let stat = std::fs::read_to_string(dir.join("memory.stat"))?;
        let inactive = parse_inactive_file(&stat).map_err(bad)?;
        Ok(usage.map(|u| u.saturating_sub(inactive)))
    }

    fn psi(&mut self) -> io::Result<Option<PsiSample>> {
        let Some(path) = &self.psi else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)?;
        parse_psi(&text)
            .map(Some)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

/// Reads what the cgroup holds outside `followed`'s books into `gauge` (its working set less
/// what is approved); nothing where the source has no cgroup or a reading fails.
async fn measure_outside(
    followed: &impl Followed,
    source: &mut impl MachineSource,
    gauge: &mut PressureGauge,
    policy: &PressurePolicy,
) {
    let working = match source.working_set() {
        Ok(Some(w)) => w,
        Ok(None) => return,
        Err(e) => {
            tracing::warn!(%e, "cgroup usage unreadable; reserve kept");
            return;
        }
    };
    let Some(approved) = followed.approved().await else {
        return;
    };
    let outside = working.saturating_sub(approved);
    gauge.outside(outside);
    m::HOST_OUTSIDE_BOOKS_BYTES.gauge(&[]).set(outside as f64);
    m::HOST_RESERVE_BYTES
        .gauge(&[])
        .set(gauge.reserve(policy) as f64);
}

/// The task that keeps the host Governor's capacity following the machine.
#[derive(Debug)]
pub struct HostPressure {
    task: JoinHandle<()>,
}

impl HostPressure {
    /// Samples `source` every `interval` and sets `governor`'s capacity by `policy` whenever it
    /// changes. A reading that fails keeps the last capacity (and is logged).
    pub fn spawn(
        governor: GovernorHandle,
        policy: PressurePolicy,
        source: impl MachineSource,
        interval: Duration,
    ) -> Self {
        Self::follow(governor, policy, source, interval)
    }

    /// Keeps `followed`'s capacity following `source` (the node's `spawn_for_node` too).
    pub(crate) fn follow(
        followed: impl Followed,
        policy: PressurePolicy,
        mut source: impl MachineSource,
        interval: Duration,
    ) -> Self {
        let task = tokio::spawn(async move {
            let mut gauge = PressureGauge::default();
            let mut last = None;
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let limits = match source.limits() {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::warn!(%e, "cgroup limits unreadable; capacity kept");
                        continue;
                    }
                };
                measure_outside(&followed, &mut source, &mut gauge, &policy).await;
                let psi = source.psi().unwrap_or_else(|e| {
                    tracing::warn!(%e, "PSI unreadable");
                    None
                });
                let capacity = gauge.next(&policy, limits, psi);
                if last != Some(capacity) {
                    tracing::info!(
                        capacity,
                        cut = gauge.cut(),
                        reserve = gauge.reserve(&policy),
                        some_avg10 = psi.map(|p| p.some_avg10),
                        limit = limits.effective(),
                        "host capacity follows the machine"
                    );
                    if !followed.set_capacity(capacity).await {
                        return;
                    }
                    last = Some(capacity);
                }
            }
        });
        HostPressure { task }
    }

    /// Stops following the machine (the capacity stays where it is).
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for HostPressure {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_cgroup_is_found_in_either_hierarchy_or_not_at_all() {
        assert_eq!(find_cgroup(""), None);
        assert_eq!(find_cgroup("garbage"), None);
        assert_eq!(find_cgroup("0::/no/such/cgroup/anywhere"), None);
        assert_eq!(find_cgroup("4:memory:/no/such/cgroup/anywhere"), None);
    }
}
