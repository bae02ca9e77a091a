use super::*;
use format::decode_index;

fn payload(key: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (key as usize * 31 + i) as u8).collect()
}

fn tier(dir: &Path, model: u64, capacity: u64) -> (DiskTier, OpenReport) {
    DiskTier::open(DiskTierConfig::new(dir, model, capacity)).unwrap()
}

#[test]
fn a_block_comes_back_whole_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, report) = tier(dir.path(), 7, 1 << 20);
    assert_eq!(report, OpenReport::default());
    t.put(1, 0, &[10, 11], &payload(1, 1000)).unwrap();
    t.put(2, 1, &[12, 13], &payload(2, 1000)).unwrap();
    assert_eq!(t.get(1, 0, &[10, 11]).unwrap(), Some(payload(1, 1000)));
    drop(t);
    let (mut t, report) = tier(dir.path(), 7, 1 << 20);
    assert_eq!((report.blocks, report.bytes), (2, 2000));
    assert!(report.skipped.is_empty(), "{:?}", report.skipped);
    assert_eq!(t.get(2, 1, &[12, 13]).unwrap(), Some(payload(2, 1000)));
}

#[test]
fn a_second_tier_on_one_directory_is_refused_until_the_first_goes() {
    let dir = tempfile::tempdir().unwrap();
    let (first, _) = tier(dir.path(), 7, 1 << 20);
    let second = DiskTier::open(DiskTierConfig::new(dir.path(), 8, 1 << 20));
    assert!(
        matches!(second, Err(DiskTierError::Locked(_))),
        "{second:?}"
    );
    drop(first);
    tier(dir.path(), 8, 1 << 20);
}

#[test]
fn another_prompt_under_a_colliding_key_is_a_miss() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, _) = tier(dir.path(), 7, 1 << 20);
    t.put(5, 0, &[1, 2], &payload(5, 64)).unwrap();
    assert_eq!(t.get(5, 0, &[1, 3]).unwrap(), None);
    assert_eq!(t.get(5, 9, &[1, 2]).unwrap(), None);
    assert_eq!(t.get(6, 0, &[1, 2]).unwrap(), None);
    assert!(
        t.contains(5),
        "a miss by a colliding prompt does not drop the block"
    );
}

#[test]
fn a_full_tier_pushes_out_its_least_recently_used_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, _) = tier(dir.path(), 7, 3000);
    for key in 1..=3 {
        t.put(key, 0, &[key as u32], &payload(key, 1000)).unwrap();
    }
    t.get(1, 0, &[1]).unwrap().unwrap(); // 2 is now the oldest
    assert_eq!(t.victims_for(1000, 0), Some(vec![2]));
    assert_eq!(t.put(4, 0, &[4], &payload(4, 1000)).unwrap(), vec![2]);
    assert_eq!((t.len(), t.bytes()), (3, 3000));
    assert!(!t.contains(2));
    assert!(!block_path(dir.path(), 7, 2).exists());
    drop(t);
    // Opened again smaller: the oldest go.
    let (t, report) = tier(dir.path(), 7, 1000);
    assert_eq!((report.blocks, t.bytes()), (1, 1000));
    assert!(t.contains(4));
}

#[test]
fn sizes_at_their_limits_are_refused_not_kept() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, _) = tier(dir.path(), 7, 100);
    let refused = t.put(1, 0, &[1], &[0; 101]);
    assert!(matches!(
        refused,
        Err(DiskTierError::TooLarge { bytes: 101, .. })
    ));
    let many = vec![0u32; MAX_BLOCK_TOKENS + 1];
    assert!(matches!(
        t.put(1, 0, &many, &[0; 4]),
        Err(DiskTierError::TooLarge { .. })
    ));
    assert!(t.is_empty());
    let (mut huge, _) = {
        drop(t);
        tier(dir.path(), 7, u64::MAX)
    };
    huge.put(u64::MAX, u64::MAX, &[u32::MAX], &[1]).unwrap();
    assert_eq!(
        huge.get(u64::MAX, u64::MAX, &[u32::MAX]).unwrap(),
        Some(vec![1])
    );
}

#[test]
fn an_altered_block_is_never_used_and_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, _) = tier(dir.path(), 7, 1 << 20);
    t.put(1, 0, &[1], &payload(1, 256)).unwrap();
    t.put(2, 1, &[2], &payload(2, 256)).unwrap();
    let path = block_path(dir.path(), 7, 1);
    let mut raw = fs::read(&path).unwrap();
    raw[60] ^= 0xff; // a payload byte: same size, wrong checksum
    fs::write(&path, &raw).unwrap();
    assert_eq!(t.get(1, 0, &[1]).unwrap(), None);
    assert!(!t.contains(1) && !path.exists());
    // Its child, reached only through it, goes with it.
    assert!(!t.contains(2) && t.bytes() == 0);
}

#[test]
fn torn_blocks_temporary_files_and_a_torn_index_are_skipped_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, _) = tier(dir.path(), 7, 1 << 20);
    for key in 1..=3 {
        t.put(key, 0, &[key as u32], &payload(key, 500)).unwrap();
    }
    drop(t);
    // Block 1 torn (cut short), a temporary file left by a killed write.
    let one = block_path(dir.path(), 7, 1);
    let raw = fs::read(&one).unwrap();
    fs::write(&one, &raw[..raw.len() / 2]).unwrap();
    let tmp = dir
        .path()
        .join("blocks")
        .join("0000000000000007-0000000000000009.kv.tmp42");
    fs::write(&tmp, b"half a block").unwrap();
    let index_tmp = dir.path().join("INDEX-0000000000000007.tmp42");
    fs::write(&index_tmp, b"half an index").unwrap();
    let (mut t, report) = tier(dir.path(), 7, 1 << 20);
    assert_eq!(report.blocks, 2);
    // Once, and removed: a named file of the wrong size is not read again as unnamed.
    assert_eq!(report.skipped.len(), 1, "{:?}", report.skipped);
    assert!(
        report.skipped[0].1.contains("not the"),
        "{:?}",
        report.skipped
    );
    assert!(!one.exists());
    assert!(!tmp.exists() && !index_tmp.exists());
    assert_eq!(t.get(1, 0, &[1]).unwrap(), None);
    drop(t);
    // The index torn: the blocks are adopted from their own (checked) files.
    let index = index_path(dir.path(), 7);
    let raw = fs::read(&index).unwrap();
    fs::write(&index, &raw[..raw.len() - 3]).unwrap();
    let (mut t, report) = tier(dir.path(), 7, 1 << 20);
    assert_eq!(report.blocks, 2, "{report:?}");
    assert!(report
        .skipped
        .iter()
        .any(|(p, why)| *p == index && ["truncated", "checksum mismatch"].contains(&why.as_str())));
    assert_eq!(t.get(3, 0, &[3]).unwrap(), Some(payload(3, 500)));
}

#[test]
fn another_models_files_are_never_returned() {
    let dir = tempfile::tempdir().unwrap();
    let (mut a, _) = tier(dir.path(), 0xa, 1 << 20);
    a.put(1, 0, &[1], &payload(1, 100)).unwrap();
    drop(a);
    // Model b's name on model a's file: refused by its header.
    fs::copy(
        block_path(dir.path(), 0xa, 1),
        block_path(dir.path(), 0xb, 1),
    )
    .unwrap();
    let (mut b, report) = tier(dir.path(), 0xb, 1 << 20);
    assert_eq!((report.blocks, report.others), (0, 1));
    assert!(
        report.skipped[0].1.starts_with("another model's"),
        "{report:?}"
    );
    assert_eq!(b.get(1, 0, &[1]).unwrap(), None);
    drop(b);
    let (mut a, report) = tier(dir.path(), 0xa, 1 << 20);
    assert_eq!(a.get(1, 0, &[1]).unwrap(), Some(payload(1, 100)));
    // Model b refused the copy under its name and removed it: nothing of b's is left.
    assert_eq!((report.blocks, report.others), (1, 0));
    assert!(!block_path(dir.path(), 0xb, 1).exists());
}

#[test]
fn hostile_index_and_block_bytes_are_refused_without_panic() {
    let mut entries = HashMap::new();
    entries.insert(
        3,
        Entry {
            parent: 1,
            tokens: vec![1, 2],
            bytes: 9,
            crc: 4,
            last_use: 2,
        },
    );
    let good = encode_index(7, &entries);
    assert_eq!(decode_index(&good, 7).unwrap(), entries);
    let block = encode_block(7, 3, 1, &[1, 2], &[9; 9]);
    assert!(decode_block(&block, 7).is_ok());
    for raw in [&good, &block] {
        for cut in 0..raw.len() {
            assert!(decode_index(&raw[..cut], 7).is_err());
            assert!(decode_block(&raw[..cut], 7).is_err());
        }
    }
    // Counts at their limits, with a valid checksum over the lie.
    let lie = |at: usize, value: &[u8], raw: &[u8]| {
        let mut b = raw[..raw.len() - 4].to_vec();
        b[at..at + value.len()].copy_from_slice(value);
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    };
    assert!(decode_index(&lie(16, &u64::MAX.to_le_bytes(), &good), 7).is_err());
    assert!(decode_block(&lie(32, &u32::MAX.to_le_bytes(), &block), 7).is_err());
    assert!(decode_block(&lie(44, &u64::MAX.to_le_bytes(), &block), 7).is_err());
    assert!(decode_index(&good, 8).is_err(), "another model's index");
}

/// Runs `f` on a thread and fails if it takes more than 10 s: an open blocked in `open(2)` on
/// a FIFO would hang forever.
fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(f()).unwrap());
    rx.recv_timeout(std::time::Duration::from_secs(10))
        .expect("the tier hung on a hostile file")
}

fn mkfifo(path: &Path) {
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        path,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .unwrap();
}

/// A closed tier of model 7 holding a chain of two blocks: 1 (tokens 10, 11) and 2 (12, 13)
/// after it, 1,000 bytes each.
fn chain_of_two(dir: &Path) {
    let (mut t, _) = tier(dir, 7, 1 << 20);
    t.put(1, 0, &[10, 11], &payload(1, 1000)).unwrap();
    t.put(2, 1, &[12, 13], &payload(2, 1000)).unwrap();
}

/// Defect (issue 50, 1): a FIFO named like a block file, or like the index, hung the start
/// forever in `open()`. Both are refused without waiting, named in the report, and removed.
#[test]
fn a_fifo_for_a_block_or_the_index_is_refused_without_waiting() {
    let dir = tempfile::tempdir().unwrap();
    chain_of_two(dir.path());
    let block = block_path(dir.path(), 7, 2);
    fs::remove_file(&block).unwrap();
    mkfifo(&block);
    let index = index_path(dir.path(), 7);
    fs::remove_file(&index).unwrap();
    mkfifo(&index);
    let path = dir.path().to_path_buf();
    let (mut t, report) = within_10s(move || tier(&path, 7, 1 << 20));
    let why = |p: &Path| {
        report
            .skipped
            .iter()
            .find(|(f, _)| f == p)
            .map(|(_, w)| w.clone())
    };
    assert!(
        why(&index).is_some_and(|w| w.contains("FIFO")),
        "{report:?}"
    );
    assert!(
        why(&block).is_some_and(|w| w.contains("FIFO")),
        "{report:?}"
    );
    // The good block is adopted again (the index was lost); the FIFOs are gone.
    assert_eq!(report.blocks, 1);
    assert_eq!(t.get(1, 0, &[10, 11]).unwrap(), Some(payload(1, 1000)));
    assert!(!block.exists());
    t.put(2, 1, &[12, 13], &payload(2, 1000)).unwrap();
    assert_eq!(t.get(2, 1, &[12, 13]).unwrap(), Some(payload(2, 1000)));
}

/// Defect (issue 50, 2): a block replaced by a 2 GB sparse file was read whole (2.4 GB of
/// RSS) and left for the next start; a block or the index linked to /dev/zero read until the
/// allocation failed. Now the size is checked before a byte is read, links are not followed,
/// and what was refused is removed.
#[test]
fn an_oversized_block_and_links_to_dev_zero_are_refused_unread_and_removed() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, _) = tier(dir.path(), 7, 1 << 20);
    for k in 1..=3 {
        t.put(k, 0, &[k as u32], &payload(k, 1000)).unwrap();
    }
    drop(t);
    // Block 1: 2 GB, sparse. Block 2: a link to /dev/zero. The index: a link to /dev/zero.
    let big = block_path(dir.path(), 7, 1);
    File::options()
        .write(true)
        .open(&big)
        .unwrap()
        .set_len(2 << 30)
        .unwrap();
    let linked = block_path(dir.path(), 7, 2);
    fs::remove_file(&linked).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &linked).unwrap();
    let index = index_path(dir.path(), 7);
    fs::remove_file(&index).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &index).unwrap();
    let path = dir.path().to_path_buf();
    let (mut t, report) = within_10s(move || tier(&path, 7, 1 << 20));
    assert_eq!((report.blocks, report.skipped.len()), (1, 3), "{report:?}");
    for (file, why) in &report.skipped {
        let expected = if *file == big {
            "more than"
        } else {
            "symbolic link"
        };
        assert!(why.contains(expected), "{file:?}: {why}");
        // Removed; the index is written again, as a file of its own.
        let now = fs::symlink_metadata(file);
        match *file == index {
            true => assert!(now.unwrap().is_file(), "the index is a link still"),
            false => assert!(now.is_err(), "{file:?} was left"),
        }
    }
    assert_eq!(t.get(3, 0, &[3]).unwrap(), Some(payload(3, 1000)));
    assert_eq!(t.get(1, 0, &[1]).unwrap(), None);
    // The next start finds nothing to refuse.
    drop(t);
    let (_, report) = tier(dir.path(), 7, 1 << 20);
    assert!(report.skipped.is_empty(), "{report:?}");
}

/// A directory named like a block file was skipped and left, so that block could never be
/// written; a block whose file became a link after the open is refused when read.
#[test]
fn a_directory_in_a_blocks_place_is_removed_and_the_block_written_again() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, _) = tier(dir.path(), 7, 1 << 20);
    t.put(1, 0, &[1], &payload(1, 1000)).unwrap();
    t.put(2, 1, &[2], &payload(2, 1000)).unwrap();
    // Replaced while the tier is open: a link to a file of the right size is not followed.
    let b2 = block_path(dir.path(), 7, 2);
    let copy = dir.path().join("copy");
    fs::rename(&b2, &copy).unwrap();
    std::os::unix::fs::symlink(&copy, &b2).unwrap();
    assert_eq!(t.get(2, 1, &[2]).unwrap(), None);
    assert!(fs::symlink_metadata(&b2).is_err());
    drop(t);
    let b1 = block_path(dir.path(), 7, 1);
    fs::remove_file(&b1).unwrap();
    fs::create_dir(&b1).unwrap();
    fs::write(b1.join("inside"), b"x").unwrap();
    let (mut t, report) = tier(dir.path(), 7, 1 << 20);
    assert!(
        report
            .skipped
            .iter()
            .any(|(f, w)| *f == b1 && w.contains("directory")),
        "{report:?}"
    );
    t.put(1, 0, &[1], &payload(1, 1000)).unwrap();
    assert_eq!(t.get(1, 0, &[1]).unwrap(), Some(payload(1, 1000)));
}

/// The chains a tier keeps are whole from their root: blocks of 1,000 bytes, a root (100) put
/// first and three chains of two under it after.
fn root_and_three_chains(dir: &Path, capacity: u64) -> DiskTier {
    let (mut t, _) = tier(dir, 7, capacity);
    t.put(100, 0, &[100], &payload(100, 1000)).unwrap();
    for c in 1..=3u64 {
        t.put(c * 10 + 1, 100, &[c as u32, 1], &payload(c * 10 + 1, 1000))
            .unwrap();
        t.put(
            c * 10 + 2,
            c * 10 + 1,
            &[c as u32, 2],
            &payload(c * 10 + 2, 1000),
        )
        .unwrap();
    }
    t
}

/// Issue 50: opened at a third of its size, a tier keeps the root its chains share (put first,
/// so the least recently used: the old order dropped it first and served nothing) and the
/// most recently used chain under it, whole.
#[test]
fn a_tier_opened_smaller_keeps_its_hottest_chain_whole() {
    let dir = tempfile::tempdir().unwrap();
    drop(root_and_three_chains(dir.path(), 1 << 20));
    let (mut t, report) = tier(dir.path(), 7, 3000);
    assert_eq!((report.blocks, report.bytes), (3, 3000), "{report:?}");
    assert_eq!(t.get(100, 0, &[100]).unwrap(), Some(payload(100, 1000)));
    assert_eq!(t.get(31, 100, &[3, 1]).unwrap(), Some(payload(31, 1000)));
    assert_eq!(t.get(32, 31, &[3, 2]).unwrap(), Some(payload(32, 1000)));
    let files = fs::read_dir(dir.path().join("blocks")).unwrap().count();
    assert_eq!(files, 3, "the blocks dropped are removed");
}

/// A full tier makes room from the tails of its least recently used chains, never a block
/// another on disk names as its parent, nor the chain of the block being put; a chain longer
/// than the tier keeps its head.
#[test]
fn eviction_takes_a_chain_s_tail_before_its_head() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = root_and_three_chains(dir.path(), 7000);
    assert_eq!(t.lru(), Some(12), "the oldest tail, not the root");
    assert_eq!(
        t.put(41, 100, &[4, 1], &payload(41, 1000)).unwrap(),
        vec![12]
    );
    assert_eq!(
        t.put(42, 41, &[4, 2], &payload(42, 1000)).unwrap(),
        vec![11]
    );
    assert_eq!(
        t.put(43, 42, &[4, 3], &payload(43, 1000)).unwrap(),
        vec![22]
    );
    assert!(
        chains::unreachable(&t.entries).is_empty(),
        "every block reachable"
    );
    assert!(t.contains(100));
    // Only the chain being put is left to drop: its head stays, the tail is not kept.
    let (mut one, _) = {
        drop(t);
        tier(dir.path(), 7, 7000)
    };
    // Removing a block removes the chain after it: 21 takes 22 with it.
    for key in [21, 31] {
        assert!(one.remove(key).unwrap());
    }
    assert!(!one.contains(22) && !one.contains(32));
    assert!(!block_path(dir.path(), 7, 32).exists());
    assert_eq!(one.len(), 4, "the root and chain 4");
    let mut long = one;
    long.capacity = 4000;
    let refused = long.put(44, 43, &[4, 4], &payload(44, 1000));
    assert!(
        matches!(refused, Err(DiskTierError::NoRoom { bytes: 1000 })),
        "{refused:?}"
    );
    assert_eq!(long.len(), 4);
    assert!(!block_path(dir.path(), 7, 44).exists());
}

/// A block whose parent is not on disk at open (its file lost) cannot be reached from a
/// prompt's first block: it is removed and counted, not kept for nothing.
#[test]
fn blocks_whose_parent_is_gone_are_removed_at_open() {
    let dir = tempfile::tempdir().unwrap();
    drop(root_and_three_chains(dir.path(), 1 << 20));
    fs::remove_file(block_path(dir.path(), 7, 21)).unwrap();
    let (t, report) = tier(dir.path(), 7, 1 << 20);
    assert_eq!((report.blocks, report.orphans), (5, 1), "{report:?}");
    assert_eq!(report.skipped.len(), 1, "the missing file");
    assert!(!t.contains(22) && !block_path(dir.path(), 7, 22).exists());
    // A cycle of parents a hostile index could claim reaches no root either.
    let mut entries = t.entries.clone();
    entries.get_mut(&100).unwrap().parent = 32;
    let mut lost = chains::unreachable(&entries);
    lost.sort_unstable();
    assert_eq!(lost, [11, 12, 31, 32, 100]);
}

/// With the store's block size given, a block file of another size is refused at open, and
/// the index read is bounded by what the capacity's blocks need.
#[test]
fn a_tier_of_one_block_size_refuses_others_and_bounds_its_index() {
    let dir = tempfile::tempdir().unwrap();
    drop(root_and_three_chains(dir.path(), 1 << 20));
    let config = DiskTierConfig::new(dir.path(), 7, 1 << 20).with_block(2, 1000);
    assert_eq!(config.index_limit(), MIN_INDEX_BYTES);
    // SmolLM2's f16 blocks (32 tokens, 737,280 bytes): at the default 1 GiB the floor, at
    // 64 GiB four times what the blocks' entries need (the bounds the docs give).
    let smol = DiskTierConfig::new(dir.path(), 7, 1 << 30).with_block(32, 737_280);
    assert_eq!(smol.index_limit(), 8_388_608);
    let big = DiskTierConfig::new(dir.path(), 7, 64 << 30).with_block(32, 737_280);
    assert_eq!(big.index_limit(), 62_700_640);
    assert_eq!(smol.block_limit(), block_len(32, 737_280));
    let (t, report) = DiskTier::open(config).unwrap();
    // The root holds one token: not a block of this store.
    assert!(!t.contains(100));
    assert_eq!((report.blocks, report.orphans), (0, 6), "{report:?}");
}

/// Nothing changed at open: the index is not written again (a full disk then costs nothing).
#[test]
fn an_unchanged_tier_opens_without_writing_its_index() {
    let dir = tempfile::tempdir().unwrap();
    drop(root_and_three_chains(dir.path(), 1 << 20));
    let index = index_path(dir.path(), 7);
    let before = fs::metadata(&index).unwrap().modified().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let (_, report) = tier(dir.path(), 7, 1 << 20);
    assert_eq!((report.blocks, &report.read_only), (7, &None));
    assert_eq!(fs::metadata(&index).unwrap().modified().unwrap(), before);
}

/// Issue 50's case: three chains of three blocks written interleaved (a stop's flush puts
/// blocks in key order: every root, then every middle block, then every tail), opened at a
/// third of the size, serve one chain whole. The old order kept the three tails: 0 tokens.
#[test]
fn three_chains_opened_at_a_third_serve_one_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, _) = tier(dir.path(), 7, 1 << 20);
    let key = |chain: u64, at: u64| chain * 10 + at;
    for at in 1..=3 {
        for chain in 1..=3 {
            let parent = if at == 1 { 0 } else { key(chain, at - 1) };
            let k = key(chain, at);
            t.put(k, parent, &[k as u32], &payload(k, 1000)).unwrap();
        }
    }
    drop(t);
    let (mut t, report) = tier(dir.path(), 7, 3000);
    assert_eq!(report.blocks, 3, "{report:?}");
    let served: Vec<u64> = (1..=3)
        .filter(|chain| {
            (1..=3).all(|at| {
                let (k, parent) = (
                    key(*chain, at),
                    if at == 1 { 0 } else { key(*chain, at - 1) },
                );
                t.get(k, parent, &[k as u32]).unwrap() == Some(payload(k, 1000))
            })
        })
        .collect();
    assert_eq!(served, [3], "the most recently used chain, whole");
}

/// Found in review (issue 50's first case again): a FIFO named `LOCK` hung the start in
/// `open()` for writing; a dangling link named `LOCK` made its target, outside the tier; a
/// directory named `LOCK` stopped the start. Each is removed and a lock made in its place.
#[test]
fn a_fifo_link_or_directory_for_the_lock_is_replaced_without_waiting() {
    let outside = tempfile::tempdir().unwrap();
    let target = outside.path().join("made-by-the-tier");
    type Make = Box<dyn Fn(&Path)>;
    let cases: [(&str, Make); 3] = [
        ("FIFO", Box::new(mkfifo)),
        (
            "link",
            Box::new({
                let target = target.clone();
                move |p: &Path| std::os::unix::fs::symlink(&target, p).unwrap()
            }),
        ),
        ("directory", Box::new(|p: &Path| fs::create_dir(p).unwrap())),
    ];
    for (what, make) in cases {
        let dir = tempfile::tempdir().unwrap();
        make(&dir.path().join("LOCK"));
        let path = dir.path().to_path_buf();
        let (mut t, report) = within_10s(move || tier(&path, 7, 1 << 20));
        assert_eq!(report.skipped_count, 1, "{what}: {report:?}");
        assert!(
            report.skipped[0].1.contains("not a regular file"),
            "{report:?}"
        );
        t.put(1, 0, &[1], &payload(1, 100)).unwrap();
        let meta = fs::symlink_metadata(dir.path().join("LOCK")).unwrap();
        assert!(meta.is_file(), "{what}: the lock is a file now");
        // Held: a second tier is refused.
        let second = DiskTier::open(DiskTierConfig::new(dir.path(), 7, 1 << 20));
        assert!(matches!(second, Err(DiskTierError::Locked(_))), "{what}");
    }
    assert!(!target.exists(), "nothing made outside the tier");
}

/// Found in review: `blocks` linked to a directory elsewhere had the tier list, remove and
/// write files there (any name holding `.tmp` was removed). The link is removed, never
/// followed, and a directory of the tier's own made.
#[test]
fn a_blocks_directory_linked_elsewhere_is_never_followed() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let theirs = [
        "notes.tmp.txt".to_string(),
        format!("{:016x}-{:016x}.kv", 7, 1),
        format!("{:016x}-{:016x}.kv.tmp1", 7, 2),
    ];
    for name in &theirs {
        fs::write(outside.path().join(name), b"theirs").unwrap();
    }
    std::os::unix::fs::symlink(outside.path(), dir.path().join("blocks")).unwrap();
    let (mut t, report) = tier(dir.path(), 7, 1 << 20);
    assert!(report.skipped[0].1.contains("symbolic link"), "{report:?}");
    t.put(3, 0, &[3], &payload(3, 100)).unwrap();
    for name in &theirs {
        assert_eq!(fs::read(outside.path().join(name)).unwrap(), b"theirs");
    }
    assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 3);
    assert!(fs::symlink_metadata(dir.path().join("blocks"))
        .unwrap()
        .is_dir());
}

/// Rewrites the tier's index with `change` applied to its entries (its CRC made right).
fn edit_index(dir: &Path, model: u64, change: impl FnOnce(&mut HashMap<u64, Entry>)) {
    let path = index_path(dir, model);
    let mut entries = decode_index(&fs::read(&path).unwrap(), model).unwrap();
    change(&mut entries);
    fs::write(&path, encode_index(model, &entries)).unwrap();
}

/// Found in review: a read compared the index's entry with the prompt and the file's CRC with
/// the entry's, but not the file's own tokens and parent with the prompt's: an index naming
/// another prompt's tokens beside a real block's CRC had that block's K/V served for them.
#[test]
fn an_index_lying_about_a_block_s_tokens_serves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    chain_of_two(dir.path());
    edit_index(dir.path(), 7, |e| {
        e.get_mut(&2).unwrap().tokens = vec![98, 99]
    });
    let (mut t, _) = tier(dir.path(), 7, 1 << 20);
    assert_eq!(t.get(2, 1, &[98, 99]).unwrap(), None, "another block's K/V");
    assert!(!t.contains(2), "the lying entry is dropped");
    assert_eq!(t.get(1, 0, &[10, 11]).unwrap(), Some(payload(1, 1000)));
}

/// Found in review: an index whose entries claim `u64::MAX` uses overflowed the tier's clock
/// at the next read (a panic in a debug build; in a release build new blocks became the
/// coldest). The uses are numbered afresh at open.
#[test]
fn uses_at_u64_max_in_an_index_neither_panic_nor_make_new_blocks_cold() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, _) = tier(dir.path(), 7, 3000);
    for k in 1..=3 {
        t.put(k, 0, &[k as u32], &payload(k, 1000)).unwrap();
    }
    drop(t);
    edit_index(dir.path(), 7, |e| {
        for (k, entry) in e.iter_mut() {
            entry.last_use = u64::MAX - 3 + k;
        }
    });
    let (mut t, _) = tier(dir.path(), 7, 3000);
    assert_eq!(t.get(1, 0, &[1]).unwrap(), Some(payload(1, 1000)));
    assert_eq!(t.put(4, 0, &[4], &payload(4, 1000)).unwrap(), vec![2]);
    assert_eq!(t.lru(), Some(3), "the new block is not the coldest");
}

/// Found in review: a block file keyed as the root (0), which every chain's first block names
/// as its parent, made every block someone's parent: nothing could be dropped, and a tier
/// opened smaller kept more than its capacity. Such a file is refused, and no block is put
/// under the root's key.
#[test]
fn a_block_keyed_as_the_root_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, _) = tier(dir.path(), 7, 1 << 20);
    assert!(matches!(
        t.put(0, 0, &[1], &payload(0, 10)),
        Err(DiskTierError::RootKey)
    ));
    t.put(5, 0, &[5], &payload(5, 1000)).unwrap();
    drop(t);
    let raw = encode_block(7, 0, 5, &[6], &payload(0, 1000));
    fs::write(block_path(dir.path(), 7, 0), raw).unwrap();
    edit_index(dir.path(), 7, |e| {
        let mut root = e[&5].clone();
        (root.parent, root.tokens) = (5, vec![6]);
        e.insert(0, root);
    });
    let (t, report) = tier(dir.path(), 7, 1000);
    // The index naming the root is refused whole (block 5 is adopted from its file), and the
    // root's file is removed: each counted once.
    assert_eq!(report.skipped_count, 2, "{report:?}");
    let index = index_path(dir.path(), 7);
    assert!(
        report
            .skipped
            .iter()
            .any(|(f, why)| *f == index && why.contains("root")),
        "{report:?}"
    );
    assert_eq!((t.len(), t.bytes()), (1, 1000), "{report:?}");
    assert!(t.contains(5), "the real block is kept");
    assert!(!block_path(dir.path(), 7, 0).exists());
}

/// Found in review: a block file named with a `+`, capitals or the wrong count of digits was
/// read at every start, never counted and never removed. Only the tier's own names are
/// blocks; a name close to this model's is removed. Past 32, skipped files are counted, not
/// named.
#[test]
fn names_the_tier_does_not_write_are_removed_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, _) = tier(dir.path(), 7, 1 << 20);
    t.put(10, 0, &[1], &payload(10, 100)).unwrap();
    drop(t);
    let good = fs::read(block_path(dir.path(), 7, 10)).unwrap();
    let blocks = dir.path().join("blocks");
    let mut odd = vec![
        format!("{:016x}-+{:015x}.kv", 7, 10),
        format!("{:016x}-{:016X}.kv", 7, 0xab),
        format!("{:016x}-{:x}.kv", 7, 10),
    ];
    odd.extend((0..40).map(|i| format!("{:016x}-{:020x}.kv", 7, i)));
    for name in &odd {
        fs::write(blocks.join(name), &good).unwrap();
    }
    let (t, report) = tier(dir.path(), 7, 1 << 20);
    assert_eq!((report.skipped_count, report.skipped.len()), (43, 32));
    assert_eq!(t.len(), 1);
    assert_eq!(fs::read_dir(&blocks).unwrap().count(), 1, "only the block");
}

/// Writes a block file of two tokens and its entry straight to disk (a tier's files, made
/// fast).
fn write_block(dir: &Path, entries: &mut HashMap<u64, Entry>, key: u64, parent: u64, use_: u64) {
    write_block_of(dir, entries, (key, parent, use_), 2);
}

/// [`write_block`] of `tokens` tokens.
fn write_block_of(
    dir: &Path,
    entries: &mut HashMap<u64, Entry>,
    (key, parent, use_): (u64, u64, u64),
    tokens: usize,
) {
    let tokens: Vec<u32> = (0..tokens as u32).map(|t| t ^ key as u32).collect();
    let bytes = payload(key, 100);
    let raw = encode_block(7, key, parent, &tokens, &bytes);
    let crc = u32::from_le_bytes(raw[raw.len() - 4..].try_into().unwrap());
    fs::write(block_path(dir, 7, key), raw).unwrap();
    let entry = Entry {
        parent,
        tokens,
        bytes: 100,
        crc,
        last_use: use_,
    };
    entries.insert(key, entry);
}

/// Found in review: the index was read only up to four times what the new capacity's
/// entries need, so a tier of 3,000 blocks opened at a hundredth of its size refused its
/// index, adopted its blocks unranked and kept chains in key order. Now the index is read
/// (it is bounded by [`MIN_INDEX_BYTES`] below), and the hottest chain is kept whole.
#[test]
fn a_tier_opened_at_a_hundredth_keeps_its_hottest_chain() {
    let dir = tempfile::tempdir().unwrap();
    let config = |capacity| DiskTierConfig::new(dir.path(), 7, capacity).with_block(2, 100);
    drop(DiskTier::open(config(300_000)).unwrap());
    let mut entries = HashMap::new();
    for k in 1..=2997 {
        write_block(dir.path(), &mut entries, k, 0, k);
    }
    // The hottest: a chain of three, used last.
    for (k, parent) in [(5001, 0), (5002, 5001), (5003, 5002)] {
        write_block(dir.path(), &mut entries, k, parent, 10_000 + k);
    }
    fs::write(index_path(dir.path(), 7), encode_index(7, &entries)).unwrap();
    assert!(fs::metadata(index_path(dir.path(), 7)).unwrap().len() > 140_000);
    let (t, report) = DiskTier::open(config(3000)).unwrap();
    assert_eq!(
        (report.skipped_count, report.dropped),
        (0, 2970),
        "{report:?}"
    );
    for k in 5001..=5003 {
        assert!(t.contains(k), "{k}");
    }
    assert_eq!(fs::read_dir(dir.path().join("blocks")).unwrap().count(), 30);
}

/// Found in a second review: the 8 MiB floor holds the entries of some 50,000 blocks of 32
/// tokens (34 GiB of SmolLM2's), so a 64 GiB tier opened at 1 GiB refused its index and lost
/// its hottest chains. The index may take what the entries of the block files on disk take.
#[test]
fn an_index_past_the_floor_is_read_where_the_blocks_on_disk_need_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = |capacity| DiskTierConfig::new(dir.path(), 7, capacity).with_block(1000, 100);
    drop(DiskTier::open(config(1 << 30)).unwrap());
    let mut entries = HashMap::new();
    for k in 1..=2100 {
        write_block_of(dir.path(), &mut entries, (k, 0, k), 1000);
    }
    for (k, parent) in [(5001, 0), (5002, 5001)] {
        write_block_of(dir.path(), &mut entries, (k, parent, 10_000 + k), 1000);
    }
    fs::write(index_path(dir.path(), 7), encode_index(7, &entries)).unwrap();
    let index = fs::metadata(index_path(dir.path(), 7)).unwrap().len();
    assert!(index > MIN_INDEX_BYTES, "{index}");
    let (t, report) = DiskTier::open(config(1000)).unwrap();
    assert_eq!((report.skipped_count, report.blocks), (0, 10), "{report:?}");
    assert!(t.contains(5001) && t.contains(5002), "the hottest chain");
}

/// Found in review: with the index lost, every block file was read to be adopted: a start
/// read as many bytes as the directory held. Files past the capacity are removed unread:
/// blocks whose check would fail show which were read (a read one is skipped, an unread one
/// dropped).
#[test]
fn a_start_without_an_index_reads_no_more_than_its_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let make = |good: u64, all: u64| {
        let _ = fs::remove_dir_all(dir.path().join("blocks"));
        drop(tier(dir.path(), 7, 1 << 20));
        let mut entries = HashMap::new();
        for k in 1..=all {
            write_block(dir.path(), &mut entries, k, 0, k);
            if k > good {
                let path = block_path(dir.path(), 7, k);
                let mut raw = fs::read(&path).unwrap();
                raw[60] ^= 1;
                fs::write(&path, raw).unwrap();
            }
        }
    };
    // Any block size: read in key order until the blocks fill the capacity.
    make(10, 500);
    let (t, report) = tier(dir.path(), 7, 1000);
    assert_eq!((report.blocks, t.bytes()), (10, 1000), "{report:?}");
    assert_eq!((report.skipped_count, report.dropped), (0, 490));
    assert_eq!(fs::read_dir(dir.path().join("blocks")).unwrap().count(), 10);
    drop(t);
    // One block size: no more files listed than the capacity holds blocks, and one.
    make(0, 500);
    let config = DiskTierConfig::new(dir.path(), 7, 1000).with_block(2, 100);
    let (t, report) = DiskTier::open(config).unwrap();
    assert_eq!(
        (report.skipped_count, report.dropped),
        (11, 489),
        "{report:?}"
    );
    assert!(t.is_empty());
    assert_eq!(fs::read_dir(dir.path().join("blocks")).unwrap().count(), 0);
    drop(t);
    // Files of another size (seen unread) take no room: ten blocks among 5,000 empty files
    // named like blocks are all kept (a driven start over 50,000 such files lost its 18).
    make(10, 10);
    for k in 1000..6000 {
        File::create(block_path(dir.path(), 7, k)).unwrap();
    }
    let config = DiskTierConfig::new(dir.path(), 7, 1000).with_block(2, 100);
    let (t, report) = DiskTier::open(config).unwrap();
    assert_eq!(
        (report.blocks, report.skipped_count, report.dropped),
        (10, 5000, 0)
    );
    assert_eq!(t.bytes(), 1000);
}

/// Found in review: a block put under a held key with another parent kept the old block's
/// children under the new content; put under its own descendant, that made a cycle no
/// eviction could break. The old chain goes first.
#[test]
fn a_block_put_over_another_under_its_key_takes_the_old_chain_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let (mut t, _) = tier(dir.path(), 7, 1 << 20);
    t.put(1, 0, &[1], &payload(1, 100)).unwrap();
    t.put(2, 1, &[2], &payload(2, 100)).unwrap();
    t.put(1, 2, &[9], &payload(9, 100)).unwrap();
    assert!(!t.contains(2));
    assert!(t.lru().is_some(), "no cycle: a block can be dropped");
    assert_eq!((t.len(), t.bytes()), (1, 100));
}

/// Found in review: a link or a FIFO under a write's temporary name was followed (a file
/// elsewhere overwritten) or waited on. Temporary files are made new, links not followed.
#[test]
fn a_link_under_a_temporary_name_is_not_written_through() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let theirs = outside.path().join("theirs");
    fs::write(&theirs, b"theirs").unwrap();
    let (mut t, _) = tier(dir.path(), 7, 1 << 20);
    let pid = std::process::id();
    let tmp = |p: PathBuf| PathBuf::from(format!("{}.tmp{pid}", p.display()));
    std::os::unix::fs::symlink(&theirs, tmp(index_path(dir.path(), 7))).unwrap();
    mkfifo(&tmp(block_path(dir.path(), 7, 1)));
    within_10s(move || {
        t.put(1, 0, &[1], &payload(1, 100)).unwrap();
        assert_eq!(t.get(1, 0, &[1]).unwrap(), Some(payload(1, 100)));
    });
    assert_eq!(fs::read(&theirs).unwrap(), b"theirs");
}

/// Found in review: an error that says nothing of the file (no descriptor or memory left)
/// had the file removed as hostile. Only refusals remove.
#[test]
fn errors_of_the_os_are_not_refusals() {
    for errno in [libc::EMFILE, libc::ENFILE, libc::ENOMEM, libc::EINTR] {
        let e = std::io::Error::from_raw_os_error(errno);
        assert!(files::transient(&e), "{e}");
    }
    // An I/O error says the file cannot be read: refused, so not promised again.
    for errno in [
        libc::ELOOP,
        libc::EACCES,
        libc::EISDIR,
        libc::ENXIO,
        libc::EIO,
    ] {
        let e = std::io::Error::from_raw_os_error(errno);
        assert!(!files::transient(&e), "{e}");
    }
}

/// Found driving it: the tier's directory and files were made 0755 and 0644, and block files
/// hold prompts' tokens and K/V, so any user of the machine could read others' conversations.
/// What the tier makes is its user's alone.
#[test]
fn what_the_tier_makes_is_its_user_s_alone() {
    use std::os::unix::fs::PermissionsExt;
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("made").join("tier");
    let (mut t, _) = tier(&dir, 7, 1 << 20);
    t.put(1, 0, &[1], &payload(1, 100)).unwrap();
    let mode = |p: &Path| fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777;
    for made in [root.path().join("made"), dir.clone(), dir.join("blocks")] {
        assert_eq!(mode(&made), 0o700, "{made:?}");
    }
    for made in [
        dir.join("LOCK"),
        index_path(&dir, 7),
        block_path(&dir, 7, 1),
    ] {
        assert_eq!(mode(&made), 0o600, "{made:?}");
    }
}
