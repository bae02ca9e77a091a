//! The host capacity follows the machine: a fake PSI source that rises and falls, and a real
//! cgroup made here where the machine lets this test make one (skipped with the reason
//! otherwise).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use procmem_actors::machine::{CgroupVersion, HostPressure, LinuxSource, MachineSource};
use procmem_actors::procmem::host::machine::{CgroupLimits, PressurePolicy, PsiSample};
use procmem_actors::procmem::ledger::HolderId;
use procmem_actors::procmem::MemoryRole;
use procmem_actors::{
    governor::{GovernorConfig, GovernorHandle, Lease, ReserveRequest},
    holder::{holder_mailbox, PressureTicket},
};
use ractor::{Actor, ActorProcessingErr, ActorRef};

const MIB: u64 = 1 << 20;

#[derive(Clone, Default)]
struct Fake(Arc<Mutex<(CgroupLimits, Option<PsiSample>)>>);

impl Fake {
    fn set(&self, limits: CgroupLimits, some_avg10: f64) {
        *self.0.lock().unwrap() = (
            limits,
            Some(PsiSample {
                some_avg10,
                ..PsiSample::default()
            }),
        );
    }
}

impl MachineSource for Fake {
    fn limits(&mut self) -> std::io::Result<CgroupLimits> {
        Ok(self.0.lock().unwrap().0)
    }
    fn psi(&mut self) -> std::io::Result<Option<PsiSample>> {
        Ok(self.0.lock().unwrap().1)
    }
}

/// A cache that frees one 1 MiB lease per ticket.
struct Cache;
enum CacheMsg {
    Ticket(PressureTicket),
    Hold(Lease),
}
holder_mailbox!(CacheMsg::Ticket);
#[cfg(feature = "cluster")]
impl ractor::Message for CacheMsg {}

impl Actor for Cache {
    type Msg = CacheMsg;
    type State = Vec<Lease>;
    type Arguments = ();
    async fn pre_start(
        &self,
        _: ActorRef<CacheMsg>,
        _: (),
    ) -> Result<Vec<Lease>, ActorProcessingErr> {
        Ok(Vec::new())
    }
    async fn handle(
        &self,
        _: ActorRef<CacheMsg>,
        msg: CacheMsg,
        held: &mut Vec<Lease>,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            CacheMsg::Hold(lease) => held.push(lease),
            CacheMsg::Ticket(t) => {
                let mut freed = 0;
                while freed < t.bytes_wanted {
                    let Some(lease) = held.pop() else { break };
                    freed += lease.bytes();
                }
                t.report(freed, 0);
            }
        }
        Ok(())
    }
}

async fn capacity(g: &GovernorHandle) -> u64 {
    g.snapshot().await.unwrap().books.capacity
}

async fn approved(g: &GovernorHandle) -> u64 {
    g.snapshot().await.unwrap().books.approved()
}

async fn until(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < Duration::from_secs(10), "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn cache_of(g: &GovernorHandle, mib: u64) -> (HolderId, ActorRef<CacheMsg>) {
    let (actor, _) = Actor::spawn(None, Cache, ()).await.unwrap();
    let h = g
        .register_holder("cache", 0, Some(actor.get_derived()))
        .await
        .unwrap();
    for _ in 0..mib {
        let lease = g
            .reserve(ReserveRequest {
                holder: h,
                role: MemoryRole::KvCache,
                bytes: MIB,
                priority: 0,
                deadline: None,
            })
            .await
            .unwrap()
            .commit(MIB)
            .await
            .unwrap();
        actor.cast(CacheMsg::Hold(lease)).unwrap();
    }
    (h, actor)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rising_pressure_lowers_the_capacity_and_tickets_make_room_then_it_comes_back() {
    let (g, _) = GovernorHandle::spawn(GovernorConfig::new("host", 100 * MIB))
        .await
        .unwrap();
    let _cache = cache_of(&g, 80).await;
    let fake = Fake::default();
    fake.set(CgroupLimits::default(), 0.0);
    let mut policy = PressurePolicy::new(100 * MIB);
    policy.reserve = 0;
    let follow = HostPressure::spawn(g.clone(), policy, fake.clone(), Duration::from_millis(5));
    until("the configured capacity", async || {
        capacity(&g).await == 100 * MIB
    })
    .await;
    // Pressure: the capacity goes down step by step to the floor, and the cache is asked to
    // give back what is over it.
    fake.set(CgroupLimits::default(), 60.0);
    until("the floor", async || capacity(&g).await == 25 * MIB).await;
    until("the cache freed down to it", async || {
        approved(&g).await <= 25 * MIB
    })
    .await;
    assert!(g.snapshot().await.unwrap().tickets_sent > 0);
    // A cgroup limit cuts the base.
    fake.set(
        CgroupLimits {
            max: Some(40 * MIB),
            high: Some(200 * MIB),
        },
        60.0,
    );
    until("a quarter of the limit", async || {
        capacity(&g).await == 10 * MIB
    })
    .await;
    // Calm again: it comes back, to the limit.
    fake.set(
        CgroupLimits {
            max: Some(40 * MIB),
            high: None,
        },
        0.0,
    );
    until("the limit again", async || capacity(&g).await == 40 * MIB).await;
    fake.set(CgroupLimits::default(), 0.0);
    until("the whole budget again", async || {
        capacity(&g).await == 100 * MIB
    })
    .await;
    follow.stop();
}

/// Makes a child memory cgroup under this process's own, where permitted (`tag` tells the
/// tests of one process apart).
fn make_cgroup(tag: &str) -> Result<(PathBuf, CgroupVersion), String> {
    let source = LinuxSource::detect();
    let Some((dir, version)) = source.cgroup().cloned() else {
        return Err("this process runs in no memory cgroup this test can find".into());
    };
    let child = dir.join(format!("procmem-test-{}-{tag}", std::process::id()));
    std::fs::create_dir(&child).map_err(|e| format!("cannot make {}: {e}", child.display()))?;
    let (file, value) = match version {
        CgroupVersion::V2 => ("memory.max", "123731968"),
        CgroupVersion::V1 => ("memory.limit_in_bytes", "123731968"),
    };
    if let Err(e) = std::fs::write(child.join(file), value) {
        let _ = std::fs::remove_dir(&child);
        return Err(format!("cannot set {file}: {e}"));
    }
    Ok((child, version))
}

/// A host Governor following the cgroup `dir` every 5 ms with a policy reserve of 16 MiB;
/// the limit the kernel kept (rounded to pages).
async fn follow_cgroup(dir: &Path, version: CgroupVersion) -> (GovernorHandle, HostPressure, u64) {
    let (g, _) = GovernorHandle::spawn(GovernorConfig::new("host", 1 << 30))
        .await
        .unwrap();
    let mut policy = PressurePolicy::new(1 << 30);
    policy.reserve = 16 * MIB;
    let source = LinuxSource::for_cgroup(Some((dir.to_path_buf(), version)));
    let follow = HostPressure::spawn(g.clone(), policy, source, Duration::from_millis(5));
    let file = match version {
        CgroupVersion::V2 => "memory.max",
        CgroupVersion::V1 => "memory.limit_in_bytes",
    };
    let limit: u64 = std::fs::read_to_string(dir.join(file))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    (g, follow, limit)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_cgroup_limit_becomes_the_capacity() {
    let (dir, version) = match make_cgroup("limit") {
        Ok(c) => c,
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
    let (g, follow, limit) = follow_cgroup(&dir, version).await;
    until("the cgroup's limit less the reserve", async || {
        capacity(&g).await == limit - 16 * MIB
    })
    .await;
    // A process moved into the cgroup finds it from its own /proc/self/cgroup.
    let tasks = match version {
        CgroupVersion::V2 => "cgroup.procs",
        CgroupVersion::V1 => "tasks",
    };
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {}/{tasks} && cat /proc/self/cgroup",
            dir.display()
        ))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let inside = LinuxSource::from_cgroup_file(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(inside.cgroup(), Some(&(dir.clone(), version)));
    eprintln!(
        "cgroup {version:?} {}: limit {limit} B, capacity {} B",
        dir.display(),
        capacity(&g).await
    );
    follow.stop();
    let _ = std::fs::remove_dir(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_the_cgroup_holds_outside_the_books_is_kept_free_under_its_limit() {
    let (dir, version) = match make_cgroup("outside") {
        Ok(c) => c,
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
    let (g, follow, limit) = follow_cgroup(&dir, version).await;
    until("the limit less the policy's reserve", async || {
        capacity(&g).await == limit - 16 * MIB
    })
    .await;
    // A process in the cgroup holds 48 MiB the Governor never approved: `dd` reads them from
    // /dev/zero into its buffer and blocks writing them to a pipe nobody reads.
    let tasks = match version {
        CgroupVersion::V2 => "cgroup.procs",
        CgroupVersion::V1 => "tasks",
    };
    let mut heap = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {}/{tasks} && exec dd if=/dev/zero bs=48M count=1 status=none",
            dir.display()
        ))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    until("48 MiB outside the books kept free", async || {
        capacity(&g).await <= limit - 48 * MIB
    })
    .await;
    let held = capacity(&g).await;
    let _ = heap.kill();
    let _ = heap.wait();
    until(
        "the reserve back to the policy's once it is gone",
        async || capacity(&g).await == limit - 16 * MIB,
    )
    .await;
    eprintln!(
        "cgroup {version:?}: limit {limit} B; capacity {} B with 48 MiB held outside the \
         books (reserve {} B), {} B after",
        held,
        limit - held,
        capacity(&g).await
    );
    follow.stop();
    let _ = std::fs::remove_dir(&dir);
}
