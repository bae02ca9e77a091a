//! Opening a tier over a directory an outside hand may have altered (issue 50): the lock and
//! the blocks' directory must be what they claim (a link or a FIFO in their place is removed,
//! never followed), only names the tier itself writes are touched, and a start reads and holds
//! a bounded number of bytes: the index (at most [`DiskTierConfig::index_limit`]), and the
//! block files the index does not name, one at a time, until they fill the capacity (the rest
//! removed unread).

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::chains::ROOT;
use super::files::{self, Unread};
use super::format::{block_len, decode_block, decode_index, Block};
use super::{block_path, io, DiskTierConfig, DiskTierError, Entry, OpenReport};

/// The most skipped files a report names; the rest are counted ([`OpenReport::skipped_count`]).
pub(super) const NAMED_SKIPS: usize = 32;

impl OpenReport {
    /// Counts a file skipped, and names it while fewer than [`NAMED_SKIPS`] are.
    pub(super) fn skip(&mut self, path: PathBuf, why: impl ToString) {
        self.skipped_count += 1;
        if self.skipped.len() < NAMED_SKIPS {
            self.skipped.push((path, why.to_string()));
        }
    }
}

/// Takes the directory's lock: `LOCK` held with `flock`. A link, FIFO, directory or device
/// in its place (no tier holds such a lock) is removed and a file made in its stead; a regular
/// file that cannot be opened (another user's, say) is never removed: the open fails. The lock
/// held is the file the name leads to (another start may have replaced a FIFO at the same
/// moment): where it is not, the lock is taken again.
pub(super) fn lock_dir(dir: &Path, report: &mut OpenReport) -> Result<File, DiskTierError> {
    let path = dir.join("LOCK");
    for _ in 0..3 {
        let lock = match files::open_regular(&path, true) {
            Ok(f) => f,
            Err(e) => match fs::symlink_metadata(&path) {
                Ok(m) if !m.is_file() => {
                    let why = format!("not a regular file ({})", files::kind(&m.file_type()));
                    report.skip(path.clone(), why);
                    files::remove(&path);
                    continue;
                }
                _ => return Err(io("open the lock")(e)),
            },
        };
        match rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                return Err(DiskTierError::Locked(dir.to_path_buf()))
            }
            Err(e) => return Err(io("lock the directory")(e.into())),
        }
        let held = lock.metadata().map_err(io("look at the lock"))?;
        let named = fs::symlink_metadata(&path).ok();
        if named.is_some_and(|m| (m.dev(), m.ino()) == (held.dev(), held.ino())) {
            return Ok(lock);
        }
    }
    Err(DiskTierError::Locked(dir.to_path_buf()))
}

/// Makes `dir/blocks` a directory of the tier's own: a link (to a directory elsewhere, whose
/// files the tier would list, remove and write) or a file in its place is removed first.
pub(super) fn blocks_dir(dir: &Path, report: &mut OpenReport) -> Result<(), DiskTierError> {
    let blocks = dir.join("blocks");
    match fs::symlink_metadata(&blocks) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(m) => {
            let why = format!("not a directory ({})", files::kind(&m.file_type()));
            files::remove(&blocks);
            report.skip(blocks.clone(), why);
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(io("look at the blocks' directory")(e)),
    }
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&blocks)
        .map_err(io("create the blocks' directory"))
}

/// The index's entries: none where there is no index, or where it is refused (then removed:
/// a FIFO or a directory in its place would also stop it from being written again). An index
/// the OS cannot read now fails the open, and stays.
pub(super) fn read_index(
    path: &Path,
    config: &DiskTierConfig,
    report: &mut OpenReport,
) -> Result<HashMap<u64, Entry>, DiskTierError> {
    let read = files::read_regular(path, index_limit(config)).and_then(|raw| {
        Ok(raw
            .map(|raw| decode_index(&raw, config.model))
            .transpose()?)
    });
    match read {
        Ok(entries) => Ok(entries.unwrap_or_default()),
        Err(Unread::Failed(source)) => Err(DiskTierError::File {
            what: "read the index",
            path: path.to_path_buf(),
            source,
        }),
        Err(why) => {
            files::remove(path);
            report.skip(path.to_path_buf(), why);
            Ok(HashMap::new())
        }
    }
}

/// The most bytes the index may take: the configuration's bound, or, where more blocks of this
/// model's size are on disk, what their entries take (a tier opened much smaller than it was
/// still reads the index of what it holds), at most [`files::MAX_INDEX_BYTES`].
fn index_limit(config: &DiskTierConfig) -> u64 {
    let Some((tokens, _)) = config.block else {
        return config.index_limit();
    };
    let blocks = fs::read_dir(config.dir.join("blocks")).map_or(0, |items| {
        items
            .filter_map(|i| i.ok())
            .filter(|i| {
                let name = i.file_name();
                let name = name.to_str().and_then(block_name);
                name.is_some_and(|(m, _)| m == config.model)
            })
            .count() as u64
    });
    let entries = blocks.saturating_mul(40 + 4 * tokens as u64);
    config
        .index_limit()
        .max(entries.saturating_add(64 << 10))
        .min(files::MAX_INDEX_BYTES)
}

/// Checks the index's entries against the files: temporary files are removed, entries whose
/// file is missing or of the wrong size are dropped, and whole blocks of this model the index
/// does not name are adopted until they fill the capacity. Whether the entries changed.
pub(super) fn reconcile(
    dir: &Path,
    config: &DiskTierConfig,
    entries: &mut HashMap<u64, Entry>,
    report: &mut OpenReport,
) -> Result<bool, DiskTierError> {
    let model = config.model;
    // A block of another size than the store's is not one of its blocks.
    let sized = |tokens: usize, bytes: u64| config.block.is_none_or(|b| b == (tokens, bytes));
    let mut on_disk = listing(dir, config, entries, report)?;
    let before = entries.len();
    entries.retain(|key, e| {
        let Some(path) = on_disk.remove(key) else {
            report.skip(block_path(dir, model, *key), "missing");
            return false;
        };
        let why = match sized(e.tokens.len(), e.bytes) {
            false => Err(Unread::Refused("not of the store's block size".into())),
            true => files::regular_of(&path, block_len(e.tokens.len(), e.bytes)),
        };
        match why {
            Ok(()) | Err(Unread::Failed(_)) => true, // checked again when read
            Err(why) => {
                // Torn, not a regular file, or not this store's: removed, so no start
                // reads it again.
                files::remove(&path);
                report.skip(path, why);
                false
            }
        }
    });
    let mut changed = entries.len() != before;
    let mut held: u64 = entries.values().map(|e| e.bytes).sum();
    let mut unnamed: Vec<_> = on_disk.into_iter().collect();
    unnamed.sort_unstable();
    for (key, path) in unnamed {
        if held >= config.capacity {
            // What a start reads is bounded: past the capacity, removed unread.
            files::remove(&path);
            report.dropped += 1;
            continue;
        }
        let adopted = read_checked(&path, model, config.block_limit()).and_then(|b| {
            if b.key != key {
                Err("named for another key".to_string().into())
            } else if !sized(b.tokens.len(), b.payload.len() as u64) {
                Err("not of the store's block size".to_string().into())
            } else {
                Ok(b)
            }
        });
        match adopted {
            Ok(b) => {
                held = held.saturating_add(b.payload.len() as u64);
                entries.insert(key, b.entry());
                changed = true;
            }
            Err(why) => {
                // Refused once: removed, so the next start neither reads it nor finds the
                // name taken.
                if matches!(why, Unread::Refused(_)) {
                    files::remove(&path);
                }
                report.skip(path, why);
            }
        }
    }
    Ok(changed)
}

/// The block files of this model by key (and the others' counted), once the temporary files of
/// writes that never finished are removed (the lock says none is under way). Past the index's
/// entries, at most as many files as the capacity holds blocks are listed; the rest are
/// removed unread.
fn listing(
    dir: &Path,
    config: &DiskTierConfig,
    indexed: &HashMap<u64, Entry>,
    report: &mut OpenReport,
) -> Result<HashMap<u64, PathBuf>, DiskTierError> {
    let index = super::index_path(dir, config.model);
    let index = index.file_name().and_then(|n| n.to_str()).unwrap_or("");
    for item in fs::read_dir(dir).map_err(io("list the directory"))? {
        let path = item.map_err(io("list the directory"))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if temporary(name).is_some_and(|stem| stem == index) {
            files::remove(&path);
        }
    }
    let room = match config.block {
        Some((_, bytes)) => (config.capacity / bytes.max(1)).saturating_add(1),
        None => 1 << 16,
    };
    let (mut on_disk, mut unnamed) = (HashMap::new(), 0u64);
    for item in fs::read_dir(dir.join("blocks")).map_err(io("list the blocks"))? {
        let path = item.map_err(io("list the blocks"))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if temporary(name).is_some_and(|stem| block_name(stem).is_some()) {
            files::remove(&path); // a write that never finished
            continue;
        }
        match block_name(name) {
            Some((m, _)) if m != config.model => report.others += 1,
            Some((_, ROOT)) => {
                files::remove(&path);
                report.skip(path, "names the root, which is no block");
            }
            Some((_, key)) if indexed.contains_key(&key) => {
                on_disk.insert(key, path);
            }
            Some((_, key)) if unnamed < room => {
                // Where every block is one size, a file of another size (seen by `lstat`,
                // unread) takes no room from the blocks.
                let sized = config
                    .block
                    .map(|(t, b)| files::regular_of(&path, block_len(t, b)));
                match sized {
                    Some(Err(why @ Unread::Refused(_))) => {
                        files::remove(&path);
                        report.skip(path, why);
                    }
                    _ => {
                        unnamed += 1;
                        on_disk.insert(key, path);
                    }
                }
            }
            Some(_) => {
                files::remove(&path);
                report.dropped += 1;
            }
            // Close to this model's names but not one the tier writes (`+` or capitals in the
            // key, too few or too many digits): never one of its blocks, and never counted.
            None if name.starts_with(&format!("{:016x}-", config.model)) => {
                files::remove(&path);
                report.skip(path, "not a name the tier writes");
            }
            None => {}
        }
    }
    Ok(on_disk)
}

/// `(model, key)` of a block file's name, exactly as the tier writes it:
/// `<16 hex digits>-<16 hex digits>.kv`, in lower case.
pub(super) fn block_name(name: &str) -> Option<(u64, u64)> {
    let (model, key) = name.strip_suffix(".kv")?.split_once('-')?;
    let hex = |s: &str| {
        let digits = s.len() == 16 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        digits.then(|| u64::from_str_radix(s, 16).ok()).flatten()
    };
    Some((hex(model)?, hex(key)?))
}

/// The name a temporary file `<name>.tmp<pid>` stands in for.
fn temporary(name: &str) -> Option<&str> {
    let (stem, pid) = name.rsplit_once(".tmp")?;
    let digits = !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit());
    digits.then_some(stem)
}

/// The block file at `path`, read (at most `limit` bytes, a regular file only) and checked.
fn read_checked(path: &Path, model: u64, limit: u64) -> Result<Block, Unread> {
    let raw = files::read_regular(path, limit)?.ok_or_else(|| "missing".to_string())?;
    Ok(decode_block(&raw, model)?)
}

/// Numbers the entries' uses 1, 2, ... in their order where an index made them so large the
/// tier's clock would run out; whether it did.
pub(super) fn renumber(entries: &mut HashMap<u64, Entry>) -> bool {
    if entries.values().all(|e| e.last_use < u64::MAX / 2) {
        return false;
    }
    let mut order: Vec<_> = entries.iter().map(|(k, e)| (e.last_use, *k)).collect();
    order.sort_unstable();
    for (rank, (_, key)) in order.into_iter().enumerate() {
        if let Some(e) = entries.get_mut(&key) {
            e.last_use = rank as u64 + 1;
        }
    }
    true
}
