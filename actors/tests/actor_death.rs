//! Actor death at every message for the actors that are not holders: the Governor, the CPU
//! execution provider and each stream's deferred-free actor, each killed before every step of
//! a scripted scenario and made to panic at every message it handles in that scenario.
//!
//! After each death the scenario goes on as far as it can; then, for every run: nothing was
//! freed before its fence (the buffers that gated kernels use are still resident before the
//! gates open, and the kernels find their patterns intact after), and the memory settles
//! back to zero in the kernel's view and, where the Governor lives, in its books. Needs the
//! `fault-injection` feature (panic points), on for the workspace's tests.
#![cfg(feature = "fault-injection")]

use procmem_actors::kv::StepEnd;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{bounded, Sender};
use procmem_actors::procmem::fault;
use procmem_actors::procmem::fence::Fence;
use procmem_actors::procmem::fenced::RecordUse;
use procmem_actors::procmem::kv::KvShape;
use procmem_actors::procmem::ledger::HolderId;
use procmem_actors::procmem::{AllocationRequest, MemoryRole};
use procmem_actors::{
    governor::{GovernorConfig, GovernorHandle, ReserveRequest},
    kv::{AttendItem, KvStoreConfig, KvStoreHandle, PreemptMode},
    provider::{CpuProvider, CpuProviderConfig},
    residency::{ResidencyArgs, ResidencyConfig, ResidencyHandle},
    Buffer,
};

mod common;
use common::{figure, let_messages_land, settles_to_zero, system};

/// Fault points are process-global: one scenario at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const BYTES: u64 = 64 << 10;
const STEPS: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Governor,
    Provider,
    DeferredFree(usize),
}

#[derive(Debug, Clone, Copy)]
enum Death {
    None,
    /// Killed before scripted step `n` (`STEPS` = after the last).
    KillBefore(Target, usize),
    /// Panics at its `n`-th message (fault point `point`).
    PanicAt(&'static str, u64),
}

struct Outcome {
    /// Gated buffers still resident before their kernels were let go.
    kept_until_fence: bool,
    /// Pattern mismatches the kernels found.
    corrupt: u64,
    /// Kernel's view (and the books, if the Governor lives) back at zero.
    settled: bool,
    /// The armed panic point fired.
    fired: bool,
}

impl Outcome {
    fn ok(&self) -> bool {
        self.kept_until_fence && self.corrupt == 0 && self.settled && self.fired
    }
}

fn kill(target: Target, g: &GovernorHandle, p: &CpuProvider) {
    match target {
        Target::Governor => g.actor().kill(),
        Target::Provider => p.actor().kill(),
        Target::DeferredFree(i) => p.stream(i).unwrap().deferred_free().actor().kill(),
    }
}

fn fill(buffer: &mut Buffer, value: u8) {
    buffer.host_bytes_mut().unwrap().fill(value);
}

/// A kernel that waits for its gate, then checks that `views` still hold their patterns.
fn checker(
    gate: Option<crossbeam_channel::Receiver<()>>,
    views: Vec<(procmem_actors::provider::BufferView, u8)>,
    corrupt: Arc<AtomicU64>,
) -> impl FnOnce() + Send + 'static {
    move || {
        if let Some(gate) = gate {
            let _ = gate.recv();
        }
        for (view, value) in views {
            // SAFETY: every view's buffer was passed in `uses`, so it stays mapped until this
            // kernel's fence; nothing writes it meanwhile.
            #[allow(unsafe_code)]
            let bytes = unsafe { common::read_by_address(&view) };
            if bytes.iter().any(|b| *b != value) {
                corrupt.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The scenario, with `death` applied; returns what was observed.
async fn scenario(death: Death, count_messages: bool) -> (Outcome, Vec<(&'static str, u64)>) {
    let (g, _) = GovernorHandle::spawn(GovernorConfig::new("host", 1 << 30))
        .await
        .unwrap();
    if count_messages {
        fault::start_counting();
    }
    let mut fired = true;
    if let Death::PanicAt(point, n) = death {
        fault::arm(point, n);
    }
    let p = CpuProvider::spawn(CpuProviderConfig {
        streams: 2,
        registry: None,
        ..Default::default()
    })
    .await;
    let Ok(p) = p else {
        // The provider died starting (its first message): nothing was allocated.
        if let Death::PanicAt(..) = death {
            fired = !fault::disarm();
        }
        let seen = if count_messages {
            fault::take_seen()
        } else {
            vec![]
        };
        let books_zero = g.snapshot().await.map_or(true, |s| s.books.approved() == 0);
        let outcome = Outcome {
            kept_until_fence: true,
            corrupt: 0,
            settled: books_zero,
            fired,
        };
        return (outcome, seen);
    };
    let corrupt = Arc::new(AtomicU64::new(0));
    let mut gated: Vec<(Sender<()>, usize, Fence)> = Vec::new();
    let mut fences = Vec::new();
    let mut gated_bytes = 0;
    let mut holder: Option<HolderId> = None;
    let (mut a, mut b): (Option<Buffer>, Option<Buffer>) = (None, None);
    let request = AllocationRequest::new(BYTES, MemoryRole::Workspace);
    for step in 0..STEPS {
        if let Death::KillBefore(target, n) = death {
            if n == step {
                kill(target, &g, &p);
            }
        }
        match step {
            0 => holder = g.register_holder("death", 0, None).await.ok(),
            1 | 2 => {
                let Some(h) = holder else { continue };
                let home = step - 1;
                if let Ok(mut buf) = p.allocate(&g, h, &request, 0, None, home).await {
                    fill(&mut buf, 0xA0 + step as u8);
                    if step == 1 {
                        a = Some(buf);
                    } else {
                        b = Some(buf);
                    }
                }
            }
            3 | 4 => {
                // Stream 0 reads A and B, stream 1 reads B, each behind a gate.
                let stream = step - 3;
                let uses: Vec<(&Buffer, u8)> = if stream == 0 {
                    [(a.as_ref(), 0xA1), (b.as_ref(), 0xA2)]
                        .into_iter()
                        .filter_map(|(x, v)| x.map(|x| (x, v)))
                        .collect()
                } else {
                    b.as_ref().map(|x| (x, 0xA2)).into_iter().collect()
                };
                if uses.is_empty() {
                    continue;
                }
                let (open, gate) = bounded::<()>(1);
                let views = uses.iter().map(|(x, v)| (x.view(), *v)).collect();
                let buffers: Vec<&dyn RecordUse> = uses.iter().map(|(x, _)| *x as _).collect();
                let kernel = checker(Some(gate), views, corrupt.clone());
                if let Ok(f) = p.stream(stream).unwrap().submit(&buffers, kernel) {
                    gated.push((open, stream, f));
                }
            }
            5 => gated_bytes += a.take().map_or(0, |x| x.charged_bytes()),
            6 => gated_bytes += b.take().map_or(0, |x| x.charged_bytes()),
            7 => {
                let Some(h) = holder else { continue };
                if let Ok(mut c) = p.allocate(&g, h, &request, 0, None, 0).await {
                    fill(&mut c, 0xC3);
                    let kernel = checker(None, vec![(c.view(), 0xC3)], corrupt.clone());
                    if let Ok(f) = p.stream(0).unwrap().submit(&[&c], kernel) {
                        fences.push((0, f));
                        // Behind stream 0's gated kernel, if there is one: C must wait too.
                        if gated.iter().any(|(_, stream, _)| *stream == 0) {
                            gated_bytes += c.charged_bytes();
                        }
                    }
                }
                let grant = g
                    .reserve(ReserveRequest {
                        holder: h,
                        role: MemoryRole::Workspace,
                        bytes: BYTES,
                        priority: 0,
                        deadline: None,
                    })
                    .await;
                if let Ok(grant) = grant {
                    drop(grant.commit(BYTES).await);
                }
            }
            _ => unreachable!(),
        }
    }
    if let Death::KillBefore(target, STEPS) = death {
        kill(target, &g, &p);
    }
    // Nothing that a gated kernel uses may be gone before its gate opens.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let kept_until_fence = p.mechanism().host_allocator().resident_total().unwrap() >= gated_bytes;
    // Stream 1's gate first, so that B (used on both streams) is freed when stream 0's
    // fence completes and every run handles the same messages.
    let wait = |stream: usize, fence: Fence| {
        let s = p.stream(stream).unwrap().clone();
        tokio::task::spawn_blocking(move || s.host_wait(fence))
    };
    for (open, stream, fence) in gated.into_iter().rev() {
        drop(open);
        wait(stream, fence).await.unwrap();
    }
    for (stream, fence) in fences {
        wait(stream, fence).await.unwrap();
    }
    // The provider's last message: stop the streams, drain the queues.
    let _ = p.shutdown().await;
    // Let the last completions and refunds land before the count is taken.
    let_messages_land(Duration::from_millis(50)).await;
    if let Death::PanicAt(..) = death {
        fired = !fault::disarm();
    }
    let seen = if count_messages {
        fault::take_seen()
    } else {
        vec![]
    };
    let settled = settles_to_zero(&g, &p).await;
    let outcome = Outcome {
        kept_until_fence,
        corrupt: corrupt.load(Ordering::Relaxed),
        settled,
        fired,
    };
    (outcome, seen)
}

fn report(what: String, outcome: &Outcome) {
    if !outcome.ok() {
        let _ = writeln!(
            std::io::stderr(),
            "{what}: kept until fence {}, corrupt {}, settled {}, fired {}",
            outcome.kept_until_fence,
            outcome.corrupt,
            outcome.settled,
            outcome.fired
        );
    }
}

/// Killed before every step, then panicking at every message it handled in a clean run.
async fn every_death_of(name: &str, target: Target, point: &'static str) {
    let _serial = SERIAL.lock().await;
    let (clean, seen) = scenario(Death::None, true).await;
    assert!(clean.ok(), "the clean scenario itself fails");
    let messages = seen
        .iter()
        .find(|(p, _)| *p == point)
        .map_or(0, |(_, n)| *n);
    assert!(messages > 0, "{point} never handled a message");
    let mut passed = 0;
    let mut total = 0;
    for step in 0..=STEPS {
        let (outcome, _) = scenario(Death::KillBefore(target, step), false).await;
        report(format!("{name} killed before step {step}"), &outcome);
        passed += outcome.ok() as usize;
        total += 1;
    }
    // A panic point is shared by every actor of a kind: for the deferred-free actors this
    // covers the messages of both streams' actors, in the order they were handled.
    if target == Target::DeferredFree(0) || !matches!(target, Target::DeferredFree(_)) {
        for n in 0..messages {
            let (outcome, _) = scenario(Death::PanicAt(point, n), false).await;
            report(format!("{name} panicking at message {n}"), &outcome);
            passed += outcome.ok() as usize;
            total += 1;
        }
    }
    figure(&format!("actor_death_{name}"), passed, total);
    assert_eq!(passed, total);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_governor_killed_or_panicking_at_every_message() {
    every_death_of("governor", Target::Governor, "governor.handle").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cpu_provider_killed_or_panicking_at_every_message() {
    every_death_of("cpu_provider", Target::Provider, "provider.handle").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_free_actor_killed_or_panicking_at_every_message() {
    every_death_of(
        "deferred_free_0",
        Target::DeferredFree(0),
        "deferred.handle",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_other_deferred_free_actor_killed_at_every_step() {
    every_death_of(
        "deferred_free_1",
        Target::DeferredFree(1),
        "deferred.handle",
    )
    .await;
}

// Holders: the KV store and model residency, killed before every message of a scripted
// scenario and made to panic at every message they handle in it (their own messages, such as
// a grant arriving for a pending growth, included).

const SHAPE: KvShape = common::shape(128);

enum Msg {
    Open(u64),
    Prepare(Vec<u64>),
    Attend(usize, Vec<u64>),
    Finish,
    Close(u64),
}

fn script() -> Vec<Msg> {
    let mut s = vec![Msg::Open(1), Msg::Open(2)];
    for _ in 0..4 {
        s.push(Msg::Prepare(vec![1, 2]));
        s.push(Msg::Attend(0, vec![1, 2]));
        s.push(Msg::Attend(1, vec![1, 2]));
        s.push(Msg::Finish);
    }
    s.push(Msg::Close(1));
    s
}

#[derive(Debug, Clone, Copy)]
enum HolderDeath {
    None,
    KillBefore(usize),
    PanicAt(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    KvStore,
    Residency,
}

impl Holder {
    fn point(self) -> &'static str {
        match self {
            Holder::KvStore => "kv.handle",
            Holder::Residency => "residency.handle",
        }
    }

    fn steps(self) -> usize {
        match self {
            Holder::KvStore => script().len(),
            Holder::Residency => 6,
        }
    }
}

/// Runs `holder`'s scenario with `death` applied; returns (settled, fired, messages handled).
async fn holder_run(holder: Holder, death: HolderDeath) -> (bool, bool, u64) {
    let (g, p) = system(1 << 30, 1).await;
    let kv = match holder {
        Holder::KvStore => {
            let config = KvStoreConfig::new("kv", SHAPE)
                .preempt(PreemptMode::Recompute)
                .wait(Duration::from_millis(100));
            Some(
                KvStoreHandle::spawn(config, g.clone(), p.clone())
                    .await
                    .unwrap()
                    .0,
            )
        }
        Holder::Residency => None,
    };
    let residency = match holder {
        Holder::Residency => {
            let args = ResidencyArgs {
                config: ResidencyConfig::new("w")
                    .priority(1)
                    .wait(Duration::from_millis(100)),
                device: g.clone(),
                host: None,
                provider: p.clone().into(),
            };
            Some(ResidencyHandle::spawn(args).await.unwrap().0)
        }
        Holder::KvStore => None,
    };
    let kill = || {
        if let Some(kv) = &kv {
            kv.actor().kill();
        }
        if let Some(r) = &residency {
            r.actor().kill();
        }
    };
    fault::start_counting();
    if let HolderDeath::PanicAt(n) = death {
        fault::arm(holder.point(), n);
    }
    let tf = SHAPE.token_elems();
    let item = |s: u64| AttendItem {
        seq: s,
        q: vec![0.1; 64],
        k: vec![0.2; tf],
        v: vec![0.3; tf],
    };
    let mut kv_script = script().into_iter();
    let mut step = None;
    for i in 0..holder.steps() {
        if let HolderDeath::KillBefore(k) = death {
            if k == i {
                kill();
                break;
            }
        }
        if let Some(kv) = &kv {
            let _ = match kv_script.next().unwrap() {
                Msg::Open(s) => kv.open(s, vec![], 0).await.map(drop),
                Msg::Prepare(s) => kv.prepare(s).await.map(|st| step = Some(st)),
                Msg::Attend(l, s) => match &step {
                    Some(st) => st
                        .attend(l, s.into_iter().map(item).collect())
                        .await
                        .map(drop),
                    None => Ok(()),
                },
                Msg::Finish => match step.take() {
                    Some(st) => st.complete(StepEnd::Submitted).await,
                    None => Ok(()),
                },
                Msg::Close(s) => {
                    kv.close(s);
                    Ok(())
                }
            };
        }
        if let Some(r) = &residency {
            if i < 3 {
                let _ = r.load(i, vec![i as u8; 8192], false).await;
            } else {
                let _ = r.with_weights(i - 3, |w| w.len()).await;
            }
        }
    }
    // Let messages the holder sends itself (closes, grants) land before counting.
    let_messages_land(Duration::from_millis(50)).await;
    let fired = match death {
        HolderDeath::PanicAt(_) => !fault::disarm(),
        _ => true,
    };
    let messages = fault::take_seen()
        .into_iter()
        .find(|(p, _)| *p == holder.point())
        .map_or(0, |(_, n)| n);
    // Whatever happened above, the holder goes now: everything it held must come back, the
    // memory a step of it still held once the step is dropped.
    kill();
    drop(step);
    let settled = settles_to_zero(&g, &p).await;
    let _ = p.shutdown().await;
    (settled, fired, messages)
}

async fn every_death_of_a_holder(name: &str, holder: Holder) {
    let _serial = SERIAL.lock().await;
    let (clean, _, messages) = holder_run(holder, HolderDeath::None).await;
    assert!(clean, "the clean scenario itself does not settle");
    assert!(messages > 0, "{name} never handled a message");
    let (mut passed, mut total) = (0, 0);
    for k in 0..=holder.steps() {
        let (settled, _, _) = holder_run(holder, HolderDeath::KillBefore(k)).await;
        if !settled {
            let _ = writeln!(
                std::io::stderr(),
                "{name} killed before message {k}: did not settle"
            );
        }
        passed += settled as usize;
        total += 1;
    }
    for n in 0..messages {
        let (settled, fired, _) = holder_run(holder, HolderDeath::PanicAt(n)).await;
        if !(settled && fired) {
            let _ = writeln!(
                std::io::stderr(),
                "{name} panicking at message {n}: settled {settled}, fired {fired}"
            );
        }
        passed += (settled && fired) as usize;
        total += 1;
    }
    figure(&format!("actor_death_{name}"), passed, total);
    assert_eq!(passed, total);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_store_killed_or_panicking_at_every_message_gives_everything_back() {
    every_death_of_a_holder("kv_store", Holder::KvStore).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn residency_killed_or_panicking_at_every_message_gives_everything_back() {
    every_death_of_a_holder("residency", Holder::Residency).await;
}
