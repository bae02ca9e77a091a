//! The disk tier of the prefix cache: whole prompt blocks kept in files, found again by a
//! server started later with the same model and directory, and never trusted unchecked.
//!
//! **Layout.** `dir/LOCK` (held with `flock` while a tier is open: a second server on the same
//! directory is refused with [`DiskTierError::Locked`], so two never write one index),
//! `dir/INDEX-<model>` (the index of one model's blocks), and
//! `dir/blocks/<model>-<key>.kv` (one block each). Every name carries the model's identity,
//! so models share a directory without meeting.
//!
//! **Files.** A block file holds a header (magic, version, model, the block's chain key, its
//! parent's key, its tokens, the payload's length), the payload (the block's K/V rows), and a
//! CRC-32 of everything before it. The index holds, per block, the key, parent, payload length,
//! the block file's CRC and when it was last used, and ends with a CRC of its own.
//!
//! **Crash safety.** A block is written under a temporary name and renamed into place once
//! whole; the index is written the same way (then `fsync`ed and renamed), and only after the
//! block it names is in place. So a process killed at any point leaves either the old index or
//! the new one, each naming only whole blocks; a temporary file left behind is removed at the
//! next open, and a whole block the index does not name (killed between the two renames) is
//! adopted after its CRC is checked. A block is checked again (header, tokens, parent, CRC)
//! every time it is read: a torn, foreign or altered file is skipped and dropped from the
//! index, never used.
//!
//! **Budget.** The tier holds at most `capacity` payload bytes; [`DiskTier::put`] evicts its
//! least recently used blocks to make room (the caller's admission filter decides first
//! whether a block may push another out: see [`super::admission`]).

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

const BLOCK_MAGIC: &[u8; 4] = b"PMKB";
const INDEX_MAGIC: &[u8; 4] = b"PMKI";
const VERSION: u32 = 1;
/// The most tokens a block may claim (a block is a handful of KV pages).
pub const MAX_BLOCK_TOKENS: usize = 1 << 16;
/// The most payload bytes a block may claim (one block's K/V over every layer).
pub const MAX_BLOCK_BYTES: u64 = 1 << 32;

/// Why the disk tier could not do what was asked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiskTierError {
    /// Another process (or another tier in this one) holds the directory.
    #[error("{0} is in use by another disk tier (its LOCK is held)")]
    Locked(PathBuf),
    /// A file operation failed (the disk full or unwritable, say); nothing was half-kept.
    #[error("disk tier: {what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The OS's answer.
        #[source]
        source: io::Error,
    },
    /// A block larger than the tier, or than any block may be.
    #[error("a block of {bytes} bytes cannot be kept (the tier holds {capacity})")]
    TooLarge {
        /// The block's payload.
        bytes: u64,
        /// The tier's capacity.
        capacity: u64,
    },
}

fn io(what: &'static str) -> impl FnOnce(io::Error) -> DiskTierError {
    move |source| DiskTierError::Io { what, source }
}

/// Where a tier lives and how much it may hold.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DiskTierConfig {
    /// The directory (created if missing).
    pub dir: PathBuf,
    /// The model's identity (a hash of its weights, or of its shape and a caller's id): blocks
    /// of another model are never returned.
    pub model: u64,
    /// The most payload bytes kept.
    pub capacity: u64,
}

impl DiskTierConfig {
    /// A tier in `dir` for `model`, holding at most `capacity` bytes.
    pub fn new(dir: impl Into<PathBuf>, model: u64, capacity: u64) -> Self {
        DiskTierConfig {
            dir: dir.into(),
            model,
            capacity,
        }
    }
}

/// One block the index names.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    parent: u64,
    tokens: Vec<u32>,
    bytes: u64,
    crc: u32,
    last_use: u64,
}

/// What opening found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenReport {
    /// Blocks found whole.
    pub blocks: usize,
    /// Their payload bytes.
    pub bytes: u64,
    /// Files not trusted, and why (each was left out; temporary files were removed).
    pub skipped: Vec<(PathBuf, String)>,
    /// Block files of other identities (another model, or the same model's KV in another
    /// shape or element type): left alone, never read as this one's.
    pub others: usize,
}

/// The disk tier of one model in one directory.
#[derive(Debug)]
pub struct DiskTier {
    dir: PathBuf,
    model: u64,
    capacity: u64,
    entries: HashMap<u64, Entry>,
    bytes: u64,
    clock: u64,
    /// Held open for its `flock` (released when the tier drops).
    _lock: File,
}

impl DiskTier {
    /// Opens (or creates) the tier in `config.dir`: takes the directory's lock, reads the
    /// model's index, and checks what it names against the files there.
    pub fn open(config: DiskTierConfig) -> Result<(DiskTier, OpenReport), DiskTierError> {
        let dir = config.dir;
        fs::create_dir_all(dir.join("blocks")).map_err(io("create the directory"))?;
        let lock = lock_dir(&dir)?;
        let mut report = OpenReport::default();
        let index_path = index_path(&dir, config.model);
        let index = files::read_regular(&index_path, files::MAX_INDEX_BYTES)
            .and_then(|raw| raw.map(|raw| decode_index(&raw, config.model)).transpose());
        let mut entries = match index {
            Ok(entries) => entries.unwrap_or_default(),
            Err(why) => {
                // Not trusted, and removed: a FIFO or a directory in its place would also
                // stop the index from being written again.
                files::remove(&index_path);
                report.skipped.push((index_path.clone(), why));
                HashMap::new()
            }
        };
        let limit = block_len(MAX_BLOCK_TOKENS, config.capacity.min(MAX_BLOCK_BYTES));
        reconcile(&dir, (config.model, limit), &mut entries, &mut report)?;
        let clock = entries.values().map(|e| e.last_use).max().unwrap_or(0);
        let mut tier = DiskTier {
            dir,
            model: config.model,
            capacity: config.capacity,
            bytes: entries.values().map(|e| e.bytes).sum(),
            entries,
            clock,
            _lock: lock,
        };
        // A smaller capacity than last time: the oldest blocks go first.
        while tier.bytes > tier.capacity {
            let Some(victim) = tier.lru() else { break };
            tier.forget(victim);
        }
        tier.write_index()?;
        report.blocks = tier.entries.len();
        report.bytes = tier.bytes;
        Ok((tier, report))
    }

    /// Payload bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The most payload bytes held.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The keys of the blocks the index names (not yet checked: [`DiskTier::get`] checks).
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.entries.keys().copied()
    }

    /// Whether the index names block `key` (not yet checked: [`DiskTier::get`] checks).
    pub fn contains(&self, key: u64) -> bool {
        self.entries.contains_key(&key)
    }

    /// The least recently used block: the first to go when room is needed.
    pub fn lru(&self) -> Option<u64> {
        self.entries
            .iter()
            .min_by_key(|(key, e)| (e.last_use, **key))
            .map(|(key, _)| *key)
    }

    /// Which blocks `put`ting `bytes` more would push out, oldest first.
    pub fn victims_for(&self, bytes: u64) -> Vec<u64> {
        let mut by_age: Vec<(u64, u64, u64)> = self
            .entries
            .iter()
            .map(|(k, e)| (e.last_use, *k, e.bytes))
            .collect();
        by_age.sort_unstable();
        let mut free = self.capacity.saturating_sub(self.bytes);
        let mut out = Vec::new();
        for (_, key, b) in by_age {
            if free >= bytes {
                break;
            }
            free += b;
            out.push(key);
        }
        out
    }

    /// Block `key`'s payload, if the tier holds it and it is whole: its file's header must
    /// name this model, `key`, `parent` and exactly `tokens`, and its CRC must match. A block
    /// that fails any check is dropped (file and entry) and `Ok(None)` returned.
    pub fn get(
        &mut self,
        key: u64,
        parent: u64,
        tokens: &[u32],
    ) -> Result<Option<Vec<u8>>, DiskTierError> {
        let Some(entry) = self.entries.get(&key) else {
            return Ok(None);
        };
        if entry.parent != parent || entry.tokens != tokens {
            return Ok(None); // another prompt's block under a colliding key: a miss
        }
        let path = block_path(&self.dir, self.model, key);
        // Exactly the file the index names, or nothing is read.
        let checked = files::read_regular(&path, block_len(entry.tokens.len(), entry.bytes))
            .and_then(|raw| raw.ok_or_else(|| "missing".to_string()))
            .and_then(|raw| decode_block(&raw, self.model).map(|b| (b, raw)));
        match checked {
            Ok((block, mut raw)) if block.key == key && block.crc == entry.crc => {
                self.clock += 1;
                if let Some(e) = self.entries.get_mut(&key) {
                    e.last_use = self.clock;
                }
                // The payload in place: the file's bytes less its header and CRC.
                raw.truncate(block.payload.end);
                raw.drain(..block.payload.start);
                Ok(Some(raw))
            }
            _ => {
                self.forget(key);
                self.write_index()?;
                Ok(None)
            }
        }
    }

    /// Keeps block `key` (its parent's key, its tokens, its K/V rows), pushing out the least
    /// recently used blocks to make room; returns those. A failure (the disk full or
    /// unwritable) keeps nothing new and leaves the index as it was.
    pub fn put(
        &mut self,
        key: u64,
        parent: u64,
        tokens: &[u32],
        payload: &[u8],
    ) -> Result<Vec<u64>, DiskTierError> {
        let bytes = payload.len() as u64;
        if bytes > self.capacity || bytes > MAX_BLOCK_BYTES || tokens.len() > MAX_BLOCK_TOKENS {
            return Err(DiskTierError::TooLarge {
                bytes,
                capacity: self.capacity,
            });
        }
        if let Some(old) = self.entries.get(&key) {
            if old.parent == parent && old.tokens == tokens {
                return Ok(Vec::new()); // kept already
            }
        }
        let raw = encode_block(self.model, key, parent, tokens, payload);
        let crc = u32::from_le_bytes(raw[raw.len() - 4..].try_into().expect("4 bytes"));
        let path = block_path(&self.dir, self.model, key);
        write_atomically(&path, &raw, false)?;
        let victims = self.victims_for(bytes);
        for victim in &victims {
            if *victim != key {
                self.forget(*victim);
            }
        }
        if let Some(old) = self.entries.remove(&key) {
            self.bytes -= old.bytes;
        }
        self.clock += 1;
        self.entries.insert(
            key,
            Entry {
                parent,
                tokens: tokens.to_vec(),
                bytes,
                crc,
                last_use: self.clock,
            },
        );
        self.bytes += bytes;
        if let Err(e) = self.write_index() {
            // The index on disk is the old one; keep the books to it.
            self.forget(key);
            return Err(e);
        }
        Ok(victims)
    }

    /// Drops block `key`; returns whether it was held.
    pub fn remove(&mut self, key: u64) -> Result<bool, DiskTierError> {
        let held = self.forget(key);
        if held {
            self.write_index()?;
        }
        Ok(held)
    }

    /// Drops `key`'s entry and file (the index is written by the caller).
    fn forget(&mut self, key: u64) -> bool {
        let Some(entry) = self.entries.remove(&key) else {
            return false;
        };
        self.bytes -= entry.bytes;
        files::remove(&block_path(&self.dir, self.model, key));
        true
    }

    fn write_index(&self) -> Result<(), DiskTierError> {
        let raw = encode_index(self.model, &self.entries);
        write_atomically(&index_path(&self.dir, self.model), &raw, true)
    }
}

fn lock_dir(dir: &Path) -> Result<File, DiskTierError> {
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("LOCK"))
        .map_err(io("open the lock"))?;
    match rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(lock),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(DiskTierError::Locked(dir.to_path_buf())),
        Err(e) => Err(io("lock the directory")(e.into())),
    }
}

fn index_path(dir: &Path, model: u64) -> PathBuf {
    dir.join(format!("INDEX-{model:016x}"))
}

fn block_path(dir: &Path, model: u64, key: u64) -> PathBuf {
    dir.join("blocks")
        .join(format!("{model:016x}-{key:016x}.kv"))
}

/// Writes `raw` to a temporary file beside `path`, then renames it over `path`: a reader sees
/// the old file or the whole new one. `sync` flushes it to the disk before the rename.
fn write_atomically(path: &Path, raw: &[u8], sync: bool) -> Result<(), DiskTierError> {
    crate::fault::hit("disk_tier.write").map_err(|e| io("write")(io::Error::other(e)))?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let result = (|| {
        let mut f = File::create(&tmp).map_err(io("create a file"))?;
        f.write_all(raw).map_err(io("write"))?;
        if sync {
            f.sync_data().map_err(io("sync"))?;
        }
        fs::rename(&tmp, path).map_err(io("rename"))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Checks the index's entries against the files: temporary files are removed, entries whose
/// file is missing or of the wrong size are dropped, and whole blocks of this model the index
/// does not name are adopted.
fn reconcile(
    dir: &Path,
    (model, limit): (u64, u64),
    entries: &mut HashMap<u64, Entry>,
    report: &mut OpenReport,
) -> Result<(), DiskTierError> {
    // An index write that never finished (this model's own; the lock says no one else's is
    // under way).
    let index = index_path(dir, model);
    let index_tmp = format!(
        "{}.tmp",
        index.file_name().and_then(|n| n.to_str()).unwrap_or("")
    );
    for item in fs::read_dir(dir).map_err(io("list the directory"))? {
        let path = item.map_err(io("list the directory"))?.path();
        if path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(&index_tmp))
        {
            let _ = fs::remove_file(&path);
        }
    }
    let prefix = format!("{model:016x}-");
    let mut on_disk = HashMap::new();
    for item in fs::read_dir(dir.join("blocks")).map_err(io("list the blocks"))? {
        let path = item.map_err(io("list the blocks"))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.contains(".tmp") {
            let _ = fs::remove_file(&path); // a write that never finished
            continue;
        }
        let key = name
            .strip_prefix(&prefix)
            .and_then(|rest| rest.strip_suffix(".kv"))
            .and_then(|hex| u64::from_str_radix(hex, 16).ok());
        match key {
            Some(key) => {
                on_disk.insert(key, path);
            }
            None if name.ends_with(".kv") => report.others += 1,
            None => {}
        }
    }
    entries.retain(|key, e| {
        let whole = on_disk
            .get(key)
            .is_some_and(|p| files::is_regular_of(p, block_len(e.tokens.len(), e.bytes)));
        if !whole {
            report
                .skipped
                .push((block_path(dir, model, *key), "missing or torn".into()));
        }
        whole
    });
    for (key, path) in on_disk {
        if entries.contains_key(&key) {
            continue;
        }
        let adopted = read_checked(&path, model, limit).and_then(|b| {
            if b.key == key {
                Ok(b)
            } else {
                Err("named for another key".to_string())
            }
        });
        match adopted {
            Ok(b) => {
                entries.insert(key, b.entry());
            }
            Err(why) => {
                // Refused once: removed, so the next start neither reads it nor finds the
                // name taken.
                files::remove(&path);
                report.skipped.push((path, why));
            }
        }
    }
    Ok(())
}

/// The block file at `path`, read (at most `limit` bytes, a regular file only) and checked.
fn read_checked(path: &Path, model: u64, limit: u64) -> Result<Block, String> {
    let raw = files::read_regular(path, limit)?.ok_or_else(|| "missing".to_string())?;
    decode_block(&raw, model)
}

/// A block file, decoded and checked.
struct Block {
    key: u64,
    parent: u64,
    tokens: Vec<u32>,
    /// Where the payload lies in the file's bytes.
    payload: std::ops::Range<usize>,
    crc: u32,
}

impl Block {
    fn entry(&self) -> Entry {
        Entry {
            parent: self.parent,
            tokens: self.tokens.clone(),
            bytes: self.payload.len() as u64,
            crc: self.crc,
            last_use: 0,
        }
    }
}

fn block_len(tokens: usize, bytes: u64) -> u64 {
    // magic, version, model, key, parent, token count, tokens, payload length, payload, CRC.
    4 + 4 + 8 + 8 + 8 + 4 + 4 * tokens as u64 + 8 + bytes + 4
}

fn encode_block(model: u64, key: u64, parent: u64, tokens: &[u32], payload: &[u8]) -> Vec<u8> {
    let mut raw = Vec::with_capacity(block_len(tokens.len(), payload.len() as u64) as usize);
    raw.extend_from_slice(BLOCK_MAGIC);
    raw.extend_from_slice(&VERSION.to_le_bytes());
    for v in [model, key, parent] {
        raw.extend_from_slice(&v.to_le_bytes());
    }
    raw.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for t in tokens {
        raw.extend_from_slice(&t.to_le_bytes());
    }
    raw.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    raw.extend_from_slice(payload);
    let crc = crc32fast::hash(&raw);
    raw.extend_from_slice(&crc.to_le_bytes());
    raw
}

/// Reads little-endian fields off a byte slice, refusing to run past its end.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("truncated".into());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn tokens(&mut self) -> Result<Vec<u32>, String> {
        let n = self.u32()? as usize;
        if n > MAX_BLOCK_TOKENS || n * 4 > self.0.len() {
            return Err(format!("claims {n} tokens"));
        }
        (0..n).map(|_| self.u32()).collect()
    }
}

/// Splits off and checks the trailing CRC-32; returns the checked bytes and the CRC.
fn checked(raw: &[u8]) -> Result<(&[u8], u32), String> {
    if raw.len() < 4 {
        return Err("truncated".into());
    }
    let (body, tail) = raw.split_at(raw.len() - 4);
    let crc = u32::from_le_bytes(tail.try_into().expect("4 bytes"));
    if crc32fast::hash(body) != crc {
        return Err("checksum mismatch".into());
    }
    Ok((body, crc))
}

fn header(c: &mut Cursor<'_>, magic: &[u8; 4], model: u64) -> Result<(), String> {
    if c.take(4)? != magic {
        return Err("not a procmem disk tier file".into());
    }
    let version = c.u32()?;
    if version != VERSION {
        return Err(format!("version {version}"));
    }
    let theirs = c.u64()?;
    if theirs != model {
        return Err(format!("another model's ({theirs:016x})"));
    }
    Ok(())
}

fn decode_block(raw: &[u8], model: u64) -> Result<Block, String> {
    let (body, crc) = checked(raw)?;
    let mut c = Cursor(body);
    header(&mut c, BLOCK_MAGIC, model)?;
    let (key, parent) = (c.u64()?, c.u64()?);
    let tokens = c.tokens()?;
    let len = c.u64()?;
    if len != c.0.len() as u64 {
        return Err(format!("claims {len} payload bytes, holds {}", c.0.len()));
    }
    let start = body.len() - c.0.len();
    Ok(Block {
        key,
        parent,
        tokens,
        payload: start..body.len(),
        crc,
    })
}

fn encode_index(model: u64, entries: &HashMap<u64, Entry>) -> Vec<u8> {
    let mut raw = Vec::new();
    raw.extend_from_slice(INDEX_MAGIC);
    raw.extend_from_slice(&VERSION.to_le_bytes());
    raw.extend_from_slice(&model.to_le_bytes());
    raw.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    let mut keys: Vec<_> = entries.keys().copied().collect();
    keys.sort_unstable();
    for key in keys {
        let e = &entries[&key];
        for v in [key, e.parent, e.bytes, e.last_use] {
            raw.extend_from_slice(&v.to_le_bytes());
        }
        raw.extend_from_slice(&e.crc.to_le_bytes());
        raw.extend_from_slice(&(e.tokens.len() as u32).to_le_bytes());
        for t in &e.tokens {
            raw.extend_from_slice(&t.to_le_bytes());
        }
    }
    let crc = crc32fast::hash(&raw);
    raw.extend_from_slice(&crc.to_le_bytes());
    raw
}

fn decode_index(raw: &[u8], model: u64) -> Result<HashMap<u64, Entry>, String> {
    let (body, _) = checked(raw)?;
    let mut c = Cursor(body);
    header(&mut c, INDEX_MAGIC, model)?;
    let count = c.u64()?;
    // Each entry takes at least 40 bytes: a count past what the file holds is a lie.
    if count > c.0.len() as u64 / 40 {
        return Err(format!("claims {count} entries"));
    }
    let mut entries = HashMap::with_capacity(count as usize);
    for _ in 0..count {
        let (key, parent, bytes, last_use) = (c.u64()?, c.u64()?, c.u64()?, c.u64()?);
        let crc = c.u32()?;
        let tokens = c.tokens()?;
        if bytes > MAX_BLOCK_BYTES {
            return Err(format!("an entry claims {bytes} bytes"));
        }
        let entry = Entry {
            parent,
            tokens,
            bytes,
            crc,
            last_use,
        };
        if entries.insert(key, entry).is_some() {
            return Err(format!("names block {key:016x} twice"));
        }
    }
    if !c.0.is_empty() {
        return Err("trailing bytes".into());
    }
    Ok(entries)
}

mod files;
#[cfg(test)]
mod tests;
