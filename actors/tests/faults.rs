//! A fault at every step of the grow transaction, of eviction and of deferred free: after
//! each, no grant is left provisional, the bytes the Governor has leased equal the bytes the
//! kernel reports, and the old state is intact and usable. Needs the `fault-injection`
//! feature (on for the workspace's tests through the root crate's dev-dependency).
#![cfg(feature = "fault-injection")]

use procmem_actors::kv::StepEnd;
use std::io::Write;
use std::time::Duration;

use procmem_actors::procmem::fault;
use procmem_actors::procmem::kv::KvShape;
use procmem_actors::{
    governor::GovernorHandle,
    kv::{AttendItem, KvStoreHandle, PreemptMode},
    provider::CpuProvider,
};

mod common;

use common::{another_holder_asks, kv_config, kv_system};

/// Fault points are process-global: one scenario at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const SHAPE: KvShape = common::shape(256);

fn figure(name: &str, passed: usize, total: usize) {
    let _ = writeln!(std::io::stderr(), "FIGURE {name} {passed}/{total}");
}

fn item(seq: u64, pos: usize, layer: usize) -> AttendItem {
    let tf = SHAPE.token_elems();
    let f = |w: u64| {
        (0..tf)
            .map(|i| {
                ((seq * 31 + pos as u64 * 7 + layer as u64 * 3 + w + i as u64) % 17) as f32 / 17.0
            })
            .collect::<Vec<_>>()
    };
    AttendItem {
        seq,
        q: vec![0.5; SHAPE.q_heads * SHAPE.head_dim],
        k: f(1),
        v: f(2),
    }
}

struct World {
    g: GovernorHandle,
    p: CpuProvider,
    kv: KvStoreHandle,
}

async fn world() -> World {
    let config = kv_config(SHAPE, 1, PreemptMode::Swap, Duration::from_millis(200));
    let (g, p, kv) = kv_system(1 << 30, config).await;
    World { g, p, kv }
}

async fn step(w: &World, seqs: &[u64], pos: usize) -> Result<(), String> {
    let step =
        w.kv.prepare(seqs.to_vec())
            .await
            .map_err(|e| e.to_string())?;
    for layer in 0..SHAPE.layers {
        let items = seqs.iter().map(|s| item(*s, pos, layer)).collect();
        step.attend(layer, items).await.map_err(|e| e.to_string())?;
    }
    step.complete(StepEnd::Submitted)
        .await
        .map_err(|e| e.to_string())
}

/// No provisional bytes, and what the Governor leases is what the kernel holds.
async fn books_match_the_os(w: &World) -> bool {
    let mut ok = false;
    for _ in 0..200 {
        let s = w.g.snapshot().await.unwrap();
        let os = w.p.mechanism().backing().resident_bytes().unwrap();
        let stats = w.kv.stats().await.unwrap();
        ok = s.books.provisional == 0 && s.books.leased == os && stats.leased_bytes == os;
        if ok {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    ok
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_at_every_step_of_growth_leaves_nothing_behind() {
    let _serial = SERIAL.lock().await;
    let points: Vec<(&'static str, u64)> = (0..SHAPE.buffers() as u64)
        .flat_map(|n| [("host.commit.allocate", n), ("host.commit.map", n)])
        .chain([("kv.grow.commit", 0), ("kv.grow.publish", 0)])
        .collect();
    let mut passed = 0;
    for (point, nth) in &points {
        let w = world().await;
        w.kv.open(1, vec![], 0).await.unwrap();
        w.kv.open(2, vec![], 0).await.unwrap();
        // Fill exactly one granule per buffer, so the next token needs a growth.
        let per_granule = (procmem_actors::procmem::granularity()
            / SHAPE.token_bytes(procmem_actors::procmem::kv::KvPart::K))
            as usize;
        for pos in 0..per_granule {
            step(&w, &[1, 2], pos).await.unwrap();
        }
        let before = w.kv.stats().await.unwrap();
        fault::take_seen();
        fault::arm(point, *nth);
        let failed = step(&w, &[1, 2], per_granule).await.is_err();
        let fired = !fault::disarm();
        let after = w.kv.stats().await.unwrap();
        let intact =
            after.tokens == before.tokens && after.exclusive_bytes == before.exclusive_bytes;
        let books = books_match_the_os(&w).await;
        // The same step then succeeds.
        let usable = step(&w, &[1, 2], per_granule).await.is_ok() && books_match_the_os(&w).await;
        let ok = failed && fired && intact && books && usable;
        if !ok {
            let _ = writeln!(
                std::io::stderr(),
                "fault {point}#{nth}: failed={failed} fired={fired} intact={intact} books={books} usable={usable}"
            );
        }
        passed += ok as usize;
    }
    figure("fault_points_grow", passed, points.len());
    assert_eq!(passed, points.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_during_eviction_or_deferred_free_loses_nothing() {
    let _serial = SERIAL.lock().await;
    let mut passed = 0;
    let total = 2;
    // Eviction: the victim's free fails; the ticket is answered with what was really freed.
    {
        let w = world().await;
        for s in [1, 2, 3] {
            w.kv.open(s, vec![], 0).await.unwrap();
        }
        for pos in 0..20 {
            step(&w, &[1, 2, 3], pos).await.unwrap();
        }
        let held = w.kv.stats().await.unwrap().exclusive_bytes;
        w.g.set_capacity(held).await.unwrap();
        fault::arm("kv.evict", 0);
        let grant = another_holder_asks(w.g.clone(), held / 4, Duration::from_secs(3)).await;
        let fired = !fault::disarm();
        let stats = w.kv.stats().await.unwrap();
        let granted = grant.is_ok();
        drop(grant);
        let books = books_match_the_os(&w).await;
        let ok = fired && granted && stats.preempted >= 1 && books;
        if !ok {
            let _ = writeln!(
                std::io::stderr(),
                "evict: fired={fired} granted={granted} preempted={} books={books}",
                stats.preempted
            );
        }
        passed += ok as usize;
    }
    // Deferred free: the release fails once; the item is retried and freed, then refunded.
    {
        let w = world().await;
        w.kv.open(1, vec![], 0).await.unwrap();
        for pos in 0..10 {
            step(&w, &[1], pos).await.unwrap();
        }
        fault::arm("deferred.release", 0);
        w.kv.close(1);
        // The close's free reaches the release, which fails once.
        let start = std::time::Instant::now();
        while fault::pending() && start.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let fired = !fault::disarm();
        // The next completion on the stream retries the queued free.
        w.p.stream(0).unwrap().submit(&[], || {}).unwrap();
        let mut freed = false;
        for _ in 0..200 {
            if w.g.snapshot().await.unwrap().books.leased == 0
                && w.p.mechanism().backing().resident_bytes().unwrap() == 0
            {
                freed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if !(fired && freed) {
            let _ = writeln!(std::io::stderr(), "deferred: fired={fired} freed={freed}");
        }
        passed += (fired && freed) as usize;
    }
    figure("fault_points_evict_and_free", passed, total);
    assert_eq!(passed, total);
}

/// A weights offload whose copy out fails loses nothing: the copy kernel keeps the device copy
/// (nothing is freed), and the layer's next use finds it there, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_weights_copy_keeps_the_layer_on_the_device() {
    use procmem_actors::procmem::MemoryRole;
    use procmem_actors::{
        governor::{GovernorConfig, ReserveRequest},
        provider::CpuProviderConfig,
        residency::{Placement, ResidencyArgs, ResidencyConfig, ResidencyHandle},
    };
    let _serial = SERIAL.lock().await;
    let (device, _) = GovernorHandle::spawn(GovernorConfig::new("device", 1 << 20))
        .await
        .unwrap();
    let provider = CpuProvider::spawn(CpuProviderConfig::default())
        .await
        .unwrap();
    let (res, _) = ResidencyHandle::spawn(ResidencyArgs {
        config: ResidencyConfig::new("weights")
            .priority(1)
            .wait(Duration::from_millis(200)),
        device: device.clone(),
        host: None,
        provider: provider.into(),
    })
    .await
    .unwrap();
    let weights: Vec<u8> = (0..64 * 1024).map(|i| (i * 13 % 251) as u8).collect();
    res.load(0, weights.clone(), false).await.unwrap();
    fault::arm("residency.offload.copy", 0);
    let other = device.register_holder("other", 9, None).await.unwrap();
    let grant = device
        .reserve(ReserveRequest {
            holder: other,
            role: MemoryRole::Workspace,
            bytes: (1 << 20) - 32 * 1024,
            priority: 9,
            deadline: Some(tokio::time::Instant::now() + Duration::from_millis(300)),
        })
        .await;
    assert!(!fault::disarm(), "the copy out failed");
    assert!(grant.is_err(), "nothing was freed by a failed copy");
    let back = res.with_weights(0, |w| w.to_vec()).await.unwrap();
    assert!(back == weights, "the layer is intact");
    assert_eq!(res.placement(0).await.unwrap(), Some(Placement::Device));
    assert_eq!(
        res.stats().await.unwrap().reloads,
        0,
        "nothing was reloaded"
    );
}
