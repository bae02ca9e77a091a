//! The prefix cache's disk tier under the faults a server meets: a process killed while it
//! writes (the index never names a torn block), and the disk refusing a write (the block is
//! dropped; the tier's books and files stay as they were).

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use procmem::kv::disk_tier::{DiskTier, DiskTierConfig, DiskTierError};

/// Fault points are process-wide: the tests here take turns.
static SERIAL: Mutex<()> = Mutex::new(());

const MODEL: u64 = 0x5eed;
const CHILD: &str = "PROCMEM_DISK_TIER_WRITER";

fn payload(key: u64) -> Vec<u8> {
    let len = 4096 + (key as usize % 7) * 1000;
    (0..len)
        .map(|i| (key as usize * 131 + i * 7) as u8)
        .collect()
}

fn tokens(key: u64) -> Vec<u32> {
    vec![key as u32, (key >> 32) as u32, 7]
}

/// The writer a test kills: puts blocks until it is killed (run by the test below, in a
/// process of its own; a plain test run returns at once).
#[test]
fn writer_until_killed() {
    let Ok(dir) = std::env::var(CHILD) else {
        return;
    };
    let config = DiskTierConfig::new(dir, MODEL, 256 * 1024);
    let (mut tier, _) = DiskTier::open(config).expect("open");
    for key in 1.. {
        tier.put(key, parent(key), &tokens(key), &payload(key))
            .expect("put");
    }
}

/// Chains of four blocks: 1-4, 5-8, ...
fn parent(key: u64) -> u64 {
    if key % 4 == 1 {
        0
    } else {
        key - 1
    }
}

fn check_whole(dir: &Path) -> (usize, usize) {
    let config = DiskTierConfig::new(dir, MODEL, 256 * 1024);
    let (mut tier, report) = DiskTier::open(config).expect("reopen");
    let keys: Vec<u64> = (0..100_000).filter(|k| tier.contains(*k)).collect();
    for key in &keys {
        let got = tier.get(*key, parent(*key), &tokens(*key)).unwrap();
        assert_eq!(
            got,
            Some(payload(*key)),
            "block {key} named by the index is whole"
        );
    }
    (keys.len(), report.skipped.len())
}

#[test]
fn a_writer_killed_at_any_moment_leaves_only_whole_blocks() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut kept = Vec::new();
    for (round, wait_ms) in [30u64, 75, 120, 10, 200].into_iter().enumerate() {
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "writer_until_killed",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(wait_ms));
        child.kill().unwrap(); // SIGKILL: no destructor, no flush
        child.wait().unwrap();
        let (blocks, skipped) = check_whole(dir.path());
        kept.push((round, blocks, skipped));
    }
    assert!(
        kept.iter().any(|(_, blocks, _)| *blocks > 0),
        "the writer wrote: {kept:?}"
    );
}

#[test]
fn a_disk_that_refuses_a_write_drops_the_block_and_keeps_the_books() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let (mut tier, _) = DiskTier::open(DiskTierConfig::new(dir.path(), MODEL, 1 << 20)).unwrap();
    tier.put(1, 0, &tokens(1), &payload(1)).unwrap();
    let before = (tier.len(), tier.bytes());
    // The block's own write fails, then (next put) the index's.
    for nth in [0, 1] {
        procmem::fault::arm("disk_tier.write", nth);
        let refused = tier.put(2, 1, &tokens(2), &payload(2));
        assert!(!procmem::fault::disarm(), "the fault fired");
        match &refused {
            // The error names the file it could not write.
            Err(e @ DiskTierError::File { path, .. }) => {
                assert!(e.to_string().contains(&*path.to_string_lossy()), "{e}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!((tier.len(), tier.bytes()), before);
        assert!(!tier.contains(2));
        let files = std::fs::read_dir(dir.path().join("blocks"))
            .unwrap()
            .count();
        assert_eq!(files, 1, "no file of the refused block is left");
    }
    drop(tier);
    let (mut tier, report) =
        DiskTier::open(DiskTierConfig::new(dir.path(), MODEL, 1 << 20)).unwrap();
    assert_eq!((report.blocks, report.skipped.len()), (1, 0), "{report:?}");
    assert_eq!(tier.get(1, 0, &tokens(1)).unwrap(), Some(payload(1)));
    assert_eq!(tier.get(2, 1, &tokens(2)).unwrap(), None);
}

/// Issue 50: a disk that refuses the index's write at open (full) still serves what it holds:
/// the open succeeds read only, naming the file; a later write that succeeds keeps blocks
/// again. Before, the open failed and the server exited.
#[test]
fn a_full_disk_at_open_serves_what_is_there() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let (mut tier, _) = DiskTier::open(DiskTierConfig::new(dir.path(), MODEL, 1 << 20)).unwrap();
    for key in 1..=3 {
        tier.put(key, parent(key), &tokens(key), &payload(key))
            .unwrap();
    }
    drop(tier);
    // Opened smaller, the index must be written again: the disk refuses.
    procmem::fault::arm("disk_tier.write", 0);
    let smaller = DiskTierConfig::new(dir.path(), MODEL, payload(1).len() as u64);
    let (mut tier, report) = DiskTier::open(smaller).expect("opens read only");
    assert!(!procmem::fault::disarm(), "the fault fired");
    let why = report.read_only.expect("read only");
    assert!(why.contains("INDEX-"), "names the index file: {why}");
    assert_eq!(report.blocks, 1);
    assert_eq!(tier.get(1, 0, &tokens(1)).unwrap(), Some(payload(1)));
    // The disk has room again: the next block is kept (the index with it).
    tier.remove(1).unwrap();
    tier.put(21, parent(21), &tokens(21), &payload(21)).unwrap();
    drop(tier);
    let (mut tier, report) =
        DiskTier::open(DiskTierConfig::new(dir.path(), MODEL, 1 << 20)).unwrap();
    assert_eq!((report.blocks, &report.read_only), (1, &None), "{report:?}");
    assert_eq!(tier.get(21, 0, &tokens(21)).unwrap(), Some(payload(21)));
}
