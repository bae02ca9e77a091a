//! The sharing bench's shrinking machine: a memory cgroup made for one row under the bench's
//! own, with the bench moved into it so that the servers it starts, and the node it runs, are
//! charged there; its soft limit lowered during the load, then its hard limit; its usage,
//! working set and OOM kills sampled every 100 ms.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use procmem_actors::machine::{CgroupVersion, LinuxSource, MachineSource};
use procmem_actors::node::NodeHandle;
use serde_json::{json, Value};

const MIB: u64 = 1 << 20;

/// When the soft limit falls, from the start of the load (the first phase's burst is on).
pub const SOFT_AT: Duration = Duration::from_secs(12);
/// When the hard limit follows, after the soft one.
pub const HARD_AFTER: Duration = Duration::from_secs(10);

/// A memory cgroup this bench made and runs in until it is dropped.
pub struct Group {
    dir: PathBuf,
    version: CgroupVersion,
    parent: PathBuf,
}

impl Group {
    /// A new group under the bench's own, the bench moved into it.
    pub fn make(tag: &str) -> Result<Self, String> {
        let source = LinuxSource::detect();
        let Some((parent, version)) = source.cgroup().cloned() else {
            return Err("cgroup: this process runs in no memory cgroup it can find".into());
        };
        let dir = parent.join(format!("procmem-sharing-{}-{tag}", std::process::id()));
        std::fs::create_dir(&dir)
            .map_err(|e| format!("cgroup: cannot make {}: {e}", dir.display()))?;
        let group = Group {
            dir,
            version,
            parent,
        };
        std::fs::write(
            group.dir.join("cgroup.procs"),
            std::process::id().to_string(),
        )
        .map_err(|e| {
            format!(
                "cgroup: cannot move the bench into {}: {e}",
                group.dir.display()
            )
        })?;
        Ok(group)
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its files, as a machine source.
    pub fn source(&self) -> LinuxSource {
        LinuxSource::for_cgroup(Some((self.dir.clone(), self.version)))
    }

    /// Its file of that name in this hierarchy (v1's name, v2's name).
    fn file(&self, v1: &str, v2: &str) -> PathBuf {
        self.dir.join(match self.version {
            CgroupVersion::V1 => v1,
            CgroupVersion::V2 => v2,
        })
    }

    fn read(&self, v1: &str, v2: &str) -> io::Result<String> {
        std::fs::read_to_string(self.file(v1, v2))
    }

    /// What the kernel charges it, page cache included.
    pub fn usage(&self) -> u64 {
        let text = self
            .read("memory.usage_in_bytes", "memory.current")
            .unwrap_or_default();
        text.trim().parse().unwrap_or(0)
    }

    /// Its usage less its inactive file pages.
    pub fn working_set(&self) -> u64 {
        self.source().working_set().ok().flatten().unwrap_or(0)
    }

    /// Processes the kernel's OOM killer killed in it.
    pub fn oom_kills(&self) -> u64 {
        let text = self
            .read("memory.oom_control", "memory.events")
            .unwrap_or_default();
        text.lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Sets the soft limit (v1 `memory.soft_limit_in_bytes`, v2 `memory.high`).
    pub fn set_soft(&self, bytes: u64) -> io::Result<()> {
        let file = self.file("memory.soft_limit_in_bytes", "memory.high");
        std::fs::write(file, bytes.to_string())
    }

    /// Sets the hard limit (v1 `memory.limit_in_bytes`, v2 `memory.max`); v1 refuses a limit
    /// below what it cannot reclaim (EBUSY).
    pub fn set_hard(&self, bytes: u64) -> io::Result<()> {
        let file = self.file("memory.limit_in_bytes", "memory.max");
        std::fs::write(file, bytes.to_string())
    }
}

impl Drop for Group {
    /// Moves the bench back where it was and removes the group (its processes stopped).
    fn drop(&mut self) {
        let _ = std::fs::write(
            self.parent.join("cgroup.procs"),
            std::process::id().to_string(),
        );
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("sharing: could not remove {}", self.dir.display());
    }
}

/// What the memory under governance is: what the node's processes report approved, or (for
/// servers nobody governs) a fixed figure.
pub enum Governed {
    Node(NodeHandle),
    Fixed(u64),
}

impl Governed {
    async fn bytes(&self) -> u64 {
        match self {
            Governed::Node(n) => n
                .status()
                .await
                .map_or(0, |s| s.processes.iter().map(|p| p.approved).sum()),
            Governed::Fixed(b) => *b,
        }
    }
}

/// The shrink of one row, running until `done` fires: at [`SOFT_AT`] the soft limit falls to
/// 60% of `m` plus what the group holds outside the governed memory then; [`HARD_AFTER`]
/// later the hard limit follows to just above it (2%, at least 16 MiB). The figures as JSON.
pub async fn shrink(
    group: &Group,
    governed: Governed,
    m: u64,
    mut done: tokio::sync::oneshot::Receiver<()>,
) -> Value {
    let start = Instant::now();
    let oom_before = group.oom_kills();
    let (mut soft, mut hard) = (None::<u64>, None::<u64>);
    let mut f = json!({});
    let mut samples = Vec::new();
    let (mut ws_under, mut usage_under) = (None::<f64>, None::<f64>);
    let (mut most_usage_after_hard, mut most_ws_after_soft) = (0u64, 0u64);
    loop {
        let at = start.elapsed();
        let (usage, ws) = (group.usage(), group.working_set());
        samples.push(json!([at.as_secs_f64(), usage, ws]));
        if soft.is_none() && at >= SOFT_AT {
            let held = governed.bytes().await;
            let outside = ws.saturating_sub(held);
            let limit = m * 6 / 10 + outside;
            let wrote = group.set_soft(limit);
            f["soft_at_s"] = json!(at.as_secs_f64());
            f["soft_limit_bytes"] = json!(limit);
            f["outside_books_at_soft_bytes"] = json!(outside);
            f["governed_at_soft_bytes"] = json!(held);
            f["working_set_at_soft_bytes"] = json!(ws);
            f["usage_at_soft_bytes"] = json!(usage);
            f["soft_write"] = json!(wrote.map_or_else(|e| e.to_string(), |()| "ok".into()));
            soft = Some(limit);
        }
        if let Some(limit) = soft {
            let since = (at - SOFT_AT).as_secs_f64();
            most_ws_after_soft = most_ws_after_soft.max(ws);
            if ws <= limit {
                ws_under.get_or_insert(since);
            }
            if usage <= limit {
                usage_under.get_or_insert(since);
            }
            if hard.is_none() && at >= SOFT_AT + HARD_AFTER {
                let h = limit + (limit / 50).max(16 * MIB);
                let wrote = group.set_hard(h);
                f["hard_at_s"] = json!(at.as_secs_f64());
                f["hard_limit_bytes"] = json!(h);
                f["hard_write"] = json!(wrote.map_or_else(|e| e.to_string(), |()| "ok".into()));
                hard = Some(h);
            } else if hard.is_some() {
                most_usage_after_hard = most_usage_after_hard.max(usage);
            }
        }
        tokio::select! {
            _ = &mut done => break,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    f["working_set_under_soft_after_s"] = json!(ws_under);
    f["usage_under_soft_after_s"] = json!(usage_under);
    f["most_working_set_after_soft_bytes"] = json!(most_ws_after_soft);
    f["most_usage_after_hard_bytes"] = json!(most_usage_after_hard);
    f["oom_kills"] = json!(group.oom_kills() - oom_before);
    f["group"] = json!(group.dir().display().to_string());
    f["samples_s_usage_working_set"] = json!(samples);
    f
}
