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
//! least recently used blocks to make room, tails of chains before their heads (a block goes
//! only once no block on disk names it as its parent), and an open at a smaller capacity
//! keeps the most recently used whole chains. The caller's admission filter decides first
//! whether a block may push another out (see [`super::frequency`]).
//!
//! **Reading a hostile directory.** Only regular files are read, each checked against the size
//! its header or the index says before a byte is read (`files.rs`); with the store's block size
//! given ([`DiskTierConfig::with_block`]) a start holds at most one block file or the index at
//! a time, and the index at most what the capacity's blocks need. A file refused is removed;
//! a block no chain from the root reaches is removed at open. An index that cannot be written
//! at open (a full disk) leaves the tier serving what it found, read only until a write
//! succeeds ([`OpenReport::read_only`]).

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

const BLOCK_MAGIC: &[u8; 4] = b"PMKB";
const INDEX_MAGIC: &[u8; 4] = b"PMKI";
const VERSION: u32 = 1;
/// The most tokens a block may claim (a block is a handful of KV pages).
pub const MAX_BLOCK_TOKENS: usize = 1 << 16;
/// The most payload bytes a block may claim (one block's K/V over every layer).
pub const MAX_BLOCK_BYTES: u64 = 1 << 32;
/// The least an index may take before it is refused unread: the entries of some 50,000
/// blocks of 32 tokens, however small the tier is opened.
pub const MIN_INDEX_BYTES: u64 = 8 << 20;

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
    /// A file could not be written (the disk full or unwritable, say); nothing was half-kept.
    #[error("disk tier: {what} {}: {source}", path.display())]
    File {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS's answer.
        #[source]
        source: io::Error,
    },
    /// No room for a block without dropping blocks of its own chain (a chain longer than the
    /// tier keeps its head).
    #[error("no room for a block of {bytes} bytes without dropping the blocks before it")]
    NoRoom {
        /// The block's payload.
        bytes: u64,
    },
    /// A block keyed as the root, which every chain's first block names as its parent: no
    /// block may be it.
    #[error("a block cannot take the root's key (0)")]
    RootKey,
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
    /// Every block's tokens and payload bytes, where they are all one size (a KV store's):
    /// a block of another size is refused, and what a start reads is bounded by it.
    pub block: Option<(usize, u64)>,
}

impl DiskTierConfig {
    /// A tier in `dir` for `model`, holding at most `capacity` bytes.
    pub fn new(dir: impl Into<PathBuf>, model: u64, capacity: u64) -> Self {
        DiskTierConfig {
            dir: dir.into(),
            model,
            capacity,
            block: None,
        }
    }

    /// Every block holds `tokens` tokens in `bytes` payload bytes.
    pub fn with_block(mut self, tokens: usize, bytes: u64) -> Self {
        self.block = Some((tokens, bytes));
        self
    }

    /// The most bytes a block file this tier keeps may take.
    fn block_limit(&self) -> u64 {
        match self.block {
            Some((tokens, bytes)) => block_len(tokens, bytes),
            None => block_len(MAX_BLOCK_TOKENS, self.capacity.min(MAX_BLOCK_BYTES)),
        }
    }

    /// The most bytes its index may take: four times the entries the capacity holds, and at
    /// least [`MIN_INDEX_BYTES`] (a tier opened much smaller than before still reads its index,
    /// so keeps its hottest chains), at most [`files::MAX_INDEX_BYTES`].
    fn index_limit(&self) -> u64 {
        let Some((tokens, bytes)) = self.block else {
            return files::MAX_INDEX_BYTES;
        };
        let entries = (self.capacity / bytes.max(1)).saturating_add(1);
        let entry = 40 + 4 * tokens as u64;
        entries
            .saturating_mul(4 * entry)
            .saturating_add(64 << 10)
            .clamp(MIN_INDEX_BYTES, files::MAX_INDEX_BYTES)
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
#[non_exhaustive]
pub struct OpenReport {
    /// Blocks found whole.
    pub blocks: usize,
    /// Their payload bytes.
    pub bytes: u64,
    /// Files not trusted, and why: removed (or, where the OS could not read them now, left in
    /// place and not used). The first 32 are named; `skipped_count` counts them all.
    pub skipped: Vec<(PathBuf, String)>,
    /// Every file skipped, named or not.
    pub skipped_count: usize,
    /// Blocks dropped to fit the capacity: the least recently used chains' tails, and block
    /// files the index did not name past what the capacity holds (removed unread).
    pub dropped: usize,
    /// Block files of other identities (another model, or the same model's KV in another
    /// shape or element type): left alone, never read as this one's.
    pub others: usize,
    /// Blocks no chain from the root reaches (their parent not on disk): removed.
    pub orphans: usize,
    /// Why the index could not be written at open (a full disk, say, naming the file): the
    /// tier serves the blocks it found, and keeps new ones once a write succeeds.
    pub read_only: Option<String>,
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
        let dir = config.dir.clone();
        // The files hold prompts' tokens and K/V: the server's user's alone (0700, 0600).
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(io("create the directory"))?;
        let mut report = OpenReport::default();
        let lock = open::lock_dir(&dir, &mut report)?;
        open::blocks_dir(&dir, &mut report)?;
        let mut entries = open::read_index(&index_path(&dir, config.model), &config, &mut report)?;
        let mut changed = open::reconcile(&dir, &config, &mut entries, &mut report)?;
        changed |= open::renumber(&mut entries);
        let mut tier = DiskTier {
            dir,
            model: config.model,
            capacity: config.capacity,
            bytes: entries.values().map(|e| e.bytes).sum(),
            clock: entries.values().map(|e| e.last_use).max().unwrap_or(0),
            entries,
            _lock: lock,
        };
        for orphan in chains::unreachable(&tier.entries) {
            tier.forget(orphan);
            report.orphans += 1;
            changed = true;
        }
        // A smaller capacity than last time: the least recently used chains go, tails first
        // (every block left reaches the root, so some block is always a tail).
        let over = tier.bytes.saturating_sub(tier.capacity);
        let victims = chains::victims(&tier.entries, 0, over, None);
        let victims = victims.unwrap_or_else(|| tier.entries.keys().copied().collect());
        for victim in victims {
            tier.forget(victim);
            report.dropped += 1;
            changed = true;
        }
        // Written only where it changed: a full disk then costs nothing to serve what is there.
        if changed {
            if let Err(e) = tier.write_index() {
                report.read_only = Some(e.to_string());
            }
        }
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

    /// The first block to go when room is needed: the least recently used of those no block
    /// on disk names as its parent.
    pub fn lru(&self) -> Option<u64> {
        chains::victims(&self.entries, 0, 1, None)?.first().copied()
    }

    /// Which blocks `put`ting `bytes` more under `parent` would push out, in the order they
    /// go (see [`DiskTier::lru`]; never `parent` nor a block before it in its chain); `None`
    /// where those cannot make the room.
    pub fn victims_for(&self, bytes: u64, parent: u64) -> Option<Vec<u64>> {
        let free = self.capacity.saturating_sub(self.bytes);
        chains::victims(&self.entries, free, bytes, Some(parent))
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
            .and_then(|raw| Ok(raw.ok_or_else(|| "missing".to_string())?))
            .and_then(|raw| Ok(decode_block(&raw, self.model).map(|b| (b, raw))?));
        // The file itself must be the block asked for: an index may name another file's CRC.
        let asked = |b: &format::Block| {
            b.key == key
                && b.crc == entry.crc
                && b.parent == parent
                && b.tokens == tokens
                && b.payload.len() as u64 == entry.bytes
        };
        match checked {
            Ok((block, mut raw)) if asked(&block) => {
                self.clock += 1;
                if let Some(e) = self.entries.get_mut(&key) {
                    e.last_use = self.clock;
                }
                // The payload in place: the file's bytes less its header and CRC.
                raw.truncate(block.payload.end);
                raw.drain(..block.payload.start);
                Ok(Some(raw))
            }
            // The OS could not read it now: a miss, the block kept.
            Err(files::Unread::Failed(_)) => Ok(None),
            _ => {
                self.forget_chain(key);
                self.write_index()?;
                Ok(None)
            }
        }
    }

    /// Keeps block `key` (its parent's key, its tokens, its K/V rows), pushing out the least
    /// recently used blocks to make room; returns those. A failure (the disk full or
    /// unwritable) keeps nothing new (a block put under a key another held has dropped the
    /// old one's chain all the same).
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
        if key == chains::ROOT {
            return Err(DiskTierError::RootKey);
        }
        let replaced = match self.entries.get(&key) {
            Some(old) if old.parent == parent && old.tokens == tokens => {
                return Ok(Vec::new()); // kept already
            }
            Some(_) => self.forget_chain(key), // another block: its chain goes with it
            None => false,
        };
        let put = self.put_new(key, parent, tokens, payload);
        if put.is_err() && replaced {
            // The old chain is gone either way: the index says so where it can.
            let _ = self.write_index();
        }
        put
    }

    /// [`DiskTier::put`] of a key the tier does not hold.
    fn put_new(
        &mut self,
        key: u64,
        parent: u64,
        tokens: &[u32],
        payload: &[u8],
    ) -> Result<Vec<u64>, DiskTierError> {
        let bytes = payload.len() as u64;
        let victims = self
            .victims_for(bytes, parent)
            .ok_or(DiskTierError::NoRoom { bytes })?;
        let raw = encode_block(self.model, key, parent, tokens, payload);
        let crc = u32::from_le_bytes(raw[raw.len() - 4..].try_into().expect("4 bytes"));
        let path = block_path(&self.dir, self.model, key);
        write_atomically(&path, &raw, false)?;
        for victim in &victims {
            self.forget(*victim);
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

    /// Drops block `key`, and the blocks after it in its chains (no prompt reaches them
    /// without it); returns whether it was held.
    pub fn remove(&mut self, key: u64) -> Result<bool, DiskTierError> {
        let held = self.forget_chain(key);
        if held {
            self.write_index()?;
        }
        Ok(held)
    }

    /// Drops `key` and every block whose chain runs through it (the index is written by the
    /// caller): a child never outlives its parent on disk.
    fn forget_chain(&mut self, key: u64) -> bool {
        let after = chains::after(&self.entries, key);
        let held = self.forget(key);
        for k in after {
            self.forget(k);
        }
        held
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
    let failed = |what: &'static str| {
        move |source| DiskTierError::File {
            what,
            path: path.to_path_buf(),
            source,
        }
    };
    crate::fault::hit("disk_tier.write").map_err(|e| failed("write")(io::Error::other(e)))?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let result = (|| {
        // A new file of its own: a link or FIFO left under the temporary name is not followed.
        files::remove(&tmp);
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&tmp)
            .map_err(failed("create"))?;
        f.write_all(raw).map_err(failed("write"))?;
        if sync {
            f.sync_data().map_err(failed("sync"))?;
        }
        fs::rename(&tmp, path).map_err(failed("rename"))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

mod chains;
mod files;
mod format;
mod open;

use format::{block_len, decode_block, encode_block, encode_index};
#[cfg(test)]
mod tests;
