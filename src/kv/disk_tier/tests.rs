use super::*;

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
    assert_eq!(t.victims_for(1000), vec![2]);
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
    let path = block_path(dir.path(), 7, 1);
    let mut raw = fs::read(&path).unwrap();
    raw[60] ^= 0xff; // a payload byte: same size, wrong checksum
    fs::write(&path, &raw).unwrap();
    assert_eq!(t.get(1, 0, &[1]).unwrap(), None);
    assert!(!t.contains(1) && !path.exists() && t.bytes() == 0);
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
    assert_eq!(report.skipped.len(), 2, "{:?}", report.skipped); // from the index, then as a file
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
    // Model b's copy is another identity's file to a: counted, left alone.
    assert_eq!((report.blocks, report.others), (1, 1));
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
