//! A Governor that dies is restarted with its books (issue 11). A supervised Governor is
//! killed before every step of a scripted scenario and made to panic at every message it
//! handles in it; after each restart the books equal what the holders own (the charges of
//! their live buffers and grants) and equal what the OS reports, and the scenario completes:
//! a call that met the dead Governor is tried again, as a server would.
#![cfg(feature = "fault-injection")]

mod common;

use std::future::Future;
use std::io::Write;
use std::time::{Duration, Instant};

use procmem_actors::procmem::fault;
use procmem_actors::procmem::fenced::RecordUse;
use procmem_actors::procmem::ledger::HolderId;
use procmem_actors::procmem::{AllocationRequest, MemoryRole};
use procmem_actors::{
    governor::{GovernorConfig, GovernorError, GovernorHandle, Grant, ReserveRequest},
    provider::{CpuProvider, CpuProviderConfig},
    Buffer,
};

use common::{figure, let_messages_land, os_bytes};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const BYTES: u64 = 64 << 10;
const STEPS: usize = 7;

#[derive(Debug, Clone, Copy)]
enum Death {
    None,
    KillBefore(usize),
    PanicAt(u64),
}

/// Calls `op` until it succeeds (a Governor being restarted answers nothing for a moment).
async fn retry<T, E: std::fmt::Debug, F: Future<Output = Result<T, E>>>(
    what: &str,
    mut op: impl FnMut() -> F,
) -> T {
    let start = Instant::now();
    loop {
        match op().await {
            Ok(v) => return v,
            Err(_) if start.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Err(e) => panic!("{what} never succeeded: {e:?}"),
        }
    }
}

struct World {
    g: GovernorHandle,
    p: CpuProvider,
    a: HolderId,
    b: HolderId,
    buffers_a: Vec<Buffer>,
    buffers_b: Vec<Buffer>,
    grant: Option<Grant>,
    capacity: u64,
}

impl World {
    /// What the holders own: leased bytes of their live buffers, provisional bytes of the
    /// grant they hold.
    fn owned(&self) -> (u64, u64) {
        let leased = self
            .buffers_a
            .iter()
            .chain(&self.buffers_b)
            .map(Buffer::charged_bytes)
            .sum();
        (self.grant.as_ref().map_or(0, Grant::bytes), leased)
    }

    async fn allocate(&self, holder: HolderId) -> Buffer {
        let request = AllocationRequest::new(BYTES, MemoryRole::Workspace);
        retry("allocate", || {
            self.p.allocate(&self.g, holder, &request, 0, None, 0)
        })
        .await
    }

    async fn step(&mut self, step: usize) {
        match step {
            0 => {
                for _ in 0..4 {
                    let b = self.allocate(self.a).await;
                    self.buffers_a.push(b);
                }
            }
            1 => {
                for _ in 0..2 {
                    let b = self.allocate(self.b).await;
                    self.buffers_b.push(b);
                }
            }
            2 => {
                let uses: Vec<&dyn RecordUse> =
                    self.buffers_a.iter().map(|b| b as &dyn RecordUse).collect();
                let fence = self.p.stream(0).unwrap().submit(&uses, || {}).unwrap();
                self.buffers_a.truncate(2);
                self.p.stream(0).unwrap().host_wait(fence);
            }
            3 => {
                let (g, b) = (self.g.clone(), self.b);
                let grant = retry("reserve", || {
                    g.reserve(ReserveRequest {
                        holder: b,
                        role: MemoryRole::KvCache,
                        bytes: 2 * BYTES,
                        priority: 0,
                        deadline: None,
                    })
                })
                .await;
                self.grant = Some(grant);
            }
            4 => {
                let grant = self.grant.take().unwrap();
                match grant.cancel().await {
                    Ok(_) => {}
                    // Met the dead Governor: the grant is in the new books, which the
                    // cancel's handle already left; nothing more to do.
                    Err(GovernorError::Unavailable) => {}
                    Err(e) => panic!("cancel: {e}"),
                }
                let b = self.allocate(self.a).await;
                self.buffers_a.push(b);
            }
            5 => {
                let g = self.g.clone();
                retry("set_capacity", || g.set_capacity(32 << 20)).await;
                self.capacity = 32 << 20;
                self.buffers_b.pop();
            }
            6 => {
                self.buffers_a.clear();
            }
            7 => {
                self.buffers_b.clear();
            }
            _ => unreachable!(),
        }
    }
}

/// Waits (up to 10 s) until the Governor answers and its books equal what the holders own
/// and what the OS reports.
async fn books_match(w: &World) -> Result<(), String> {
    let start = Instant::now();
    let mut last = String::new();
    // Let the step's messages land first, so a clean run usually asks once.
    tokio::time::sleep(Duration::from_millis(5)).await;
    while start.elapsed() < Duration::from_secs(10) {
        let (provisional, leased) = w.owned();
        if let Ok(s) = w.g.snapshot().await {
            let os = os_bytes(&w.p);
            let books = (s.books.provisional, s.books.leased);
            if books == (provisional, leased)
                && s.books.leased == os
                && s.books.capacity == w.capacity
            {
                return Ok(());
            }
            last = format!(
                "books {books:?}, holders own {:?}, os {os}, capacity {} (set {})",
                (provisional, leased),
                s.books.capacity,
                w.capacity
            );
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Err(last)
}

/// How a run went.
enum Run {
    Held,
    Broke(String),
    /// The armed panic point was never reached (a run can take fewer snapshots than the
    /// counting run): no death was exercised.
    NotExercised,
}

/// Runs the scenario with `death`; returns the messages the Governor handled during the
/// steps (when counting) and how it went.
async fn scenario(death: Death, count: bool) -> (u64, Run) {
    let (g, supervisor) = GovernorHandle::spawn_supervised(GovernorConfig::new("host", 1 << 30))
        .await
        .unwrap();
    let p = CpuProvider::spawn(CpuProviderConfig {
        streams: 1,
        registry: None,
        ..Default::default()
    })
    .await
    .unwrap();
    let a = g.register_holder("a", 0, None).await.unwrap();
    let b = g.register_holder("b", 1, None).await.unwrap();
    if count {
        fault::start_counting();
    }
    if let Death::PanicAt(n) = death {
        fault::arm("governor.handle", n);
    }
    let mut w = World {
        g,
        p,
        a,
        b,
        buffers_a: Vec::new(),
        buffers_b: Vec::new(),
        grant: None,
        capacity: 1 << 30,
    };
    let mut result = Ok(());
    for step in 0..=STEPS {
        if let Death::KillBefore(k) = death {
            if k == step {
                let before = w.g.actor().get_id();
                w.g.actor().kill();
                let start = Instant::now();
                while w.g.actor().get_id() == before {
                    if start.elapsed() > Duration::from_secs(10) {
                        result = Err(format!("not restarted after a kill before step {step}"));
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
        w.step(step).await;
        if let Err(e) = books_match(&w).await {
            result = result.and(Err(format!("after step {step}: {e}")));
        }
    }
    let seen = if count {
        fault::take_seen()
            .iter()
            .find(|(p, _)| *p == "governor.handle")
            .map_or(0, |(_, n)| *n)
    } else {
        0
    };
    let_messages_land(Duration::from_millis(20)).await;
    let exercised = !matches!(death, Death::PanicAt(_)) || !fault::disarm();
    let settled = books_match(&w).await;
    let zero = w.g.snapshot().await.map(|s| s.books.approved());
    if settled.is_err() || zero != Ok(0) || os_bytes(&w.p) != 0 {
        result = result.and(Err(format!("not back to zero: {settled:?} {zero:?}")));
    }
    let _ = w.p.shutdown().await;
    w.g.stop();
    supervisor.stop(None);
    let run = match result {
        Err(e) => Run::Broke(e),
        Ok(()) if exercised => Run::Held,
        Ok(()) => Run::NotExercised,
    };
    (seen, run)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_governor_killed_or_panicking_at_every_message_restarts_with_the_holders_books() {
    let _serial = SERIAL.lock().await;
    let (messages, clean) = scenario(Death::None, true).await;
    assert!(
        matches!(clean, Run::Held),
        "the clean scenario itself fails"
    );
    assert!(messages > 10, "the Governor handled {messages} messages");
    let mut passed = 0;
    let mut total = 0;
    let mut failures = Vec::new();
    let mut not_exercised = 0;
    let deaths = (0..=STEPS)
        .map(Death::KillBefore)
        .chain((0..messages).map(Death::PanicAt));
    for death in deaths {
        match scenario(death, false).await.1 {
            Run::Held => passed += 1,
            Run::Broke(e) => failures.push(format!("{death:?}: {e}")),
            Run::NotExercised => {
                not_exercised += 1;
                continue;
            }
        }
        total += 1;
    }
    let _ = writeln!(
        std::io::stderr(),
        "governor_restart: {total} deaths exercised ({} kills), {not_exercised} panic points not reached",
        STEPS + 1
    );
    assert!(not_exercised * 4 <= total, "too few deaths were exercised");
    figure("governor_restart", passed, total);
    assert!(failures.is_empty(), "{failures:#?}");
}
