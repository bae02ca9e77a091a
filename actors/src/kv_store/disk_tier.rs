//! The prefix cache's tier below the store's memory: a prompt block evicted under pressure is
//! copied to disk (when the frequency filter lets it in) instead of dropped, and a later open
//! of a prompt that starts the same way maps it back instead of computing it again. The disk
//! tier persists: a store started later with the same model and directory finds its blocks.
//!
//! The copy out is a kernel on the store's stream, like a swap: it runs after the work queued
//! before it, reads the block, and only then lets the block's memory (and what paid for it)
//! go; a writer thread puts the bytes on disk, so no file call or `fsync` waits between the
//! decode kernels unless more than a few blocks wait for it (their bytes are outside every
//! ledger, so the queue is short: a copy out that finds it full waits). The copy in is a
//! kernel on the stream as well, queued once the open's grant has come and before the open is
//! answered: the store goes on with other messages and the server with its own work while it
//! runs, and the sequence's first step waits for its fence. A block that fails its checks, or
//! a disk that fails, is never used: the sequence is recomputed from its tokens (see
//! `copy_in.rs`), never run over wrong K/V.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use ::metrics::Histogram;
use procmem::fence::Fence;
use procmem::kv::disk_tier::{DiskTier, DiskTierConfig, DiskTierError, OpenReport};
use procmem::kv::frequency::{Admission, AdmissionFilter};
use procmem::kv::{chain_hash, Incarnation, KvDtype, KvShape, PrefixDigest};
use procmem::metrics::KV_PREFIX_DISK_SECONDS;
use procmem::SharedMapping;

use super::prefix::{KeyedBlock, SharedPrefix};
use super::KvStoreStats;

/// Where a store keeps the prompt blocks it evicts, for itself and for the stores started
/// after it: [`PrefixDisk::new`], then the setters. One directory serves one running store
/// (its `LOCK` refuses a second: [`KvStoreError::DiskTier`](super::KvStoreError::DiskTier)).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PrefixDisk {
    /// The directory (created if missing).
    pub dir: PathBuf,
    /// The model's identity, given by the caller (a hash of its weights file, say). Blocks are
    /// kept under it and the store's shape together: another model's blocks never match.
    pub model: u64,
    /// The most bytes of blocks kept on disk.
    pub capacity: u64,
    /// How many times a block must have been asked for before it may enter (2: a prompt seen
    /// once never churns the disk).
    pub min_hits: u8,
}

impl PrefixDisk {
    /// Blocks of `model` kept in `dir`, at most `capacity` bytes, each let in once asked for
    /// twice.
    pub fn new(dir: impl Into<PathBuf>, model: u64, capacity: u64) -> Self {
        PrefixDisk {
            dir: dir.into(),
            model,
            capacity,
            min_hits: 2,
        }
    }

    /// Sets how many asks let a block in (1 lets every evicted block in).
    #[must_use]
    pub fn min_hits(mut self, min_hits: u8) -> Self {
        self.min_hits = min_hits;
        self
    }
}

/// What the copies on the stream did, counted where they ran.
#[derive(Debug, Default)]
struct Outcomes {
    writes: AtomicU64,
    failures: AtomicU64,
    /// Prompt tokens whose blocks were filled from disk.
    hit_tokens: AtomicU64,
}

/// A copy in from disk, queued on the store's stream at an open: the blocks it fills, in
/// order, and how many of them (from the first) it filled once its fence has completed.
pub(super) struct CopyIn {
    /// After the kernel (`None`: the stream took no more work, and nothing was filled).
    pub(super) fence: Option<Fence>,
    /// The sequence's incarnation, which claimed the blocks.
    pub(super) writer: Incarnation,
    /// The blocks' keys.
    pub(super) keys: Vec<u64>,
    /// The blocks the open counted as cached (the copy falls short below them).
    pub(super) promised: usize,
    /// Whether a shortfall was taken off the store's hit count already.
    pub(super) short_counted: bool,
    filled: Arc<AtomicUsize>,
}

impl CopyIn {
    /// A copy in of the blocks `keys`, claimed by `writer`, `promised` of them counted as
    /// cached; it fills `filled` from the first (final once `fence` completes; `None`: not
    /// queued, or not yet).
    pub(super) fn new(
        writer: Incarnation,
        promised: usize,
        keys: Vec<u64>,
        fence: Option<Fence>,
        filled: Arc<AtomicUsize>,
    ) -> Self {
        CopyIn {
            fence,
            writer,
            keys,
            promised,
            short_counted: false,
            filled,
        }
    }

    /// How many blocks, from the first, the kernel filled (final once its fence completed).
    pub(super) fn filled(&self) -> usize {
        self.filled.load(Ordering::Acquire)
    }
}

/// Blocks read out of memory and waiting for the writer thread at most: the bytes they hold
/// are outside every ledger, so the queue is short, and a copy out that finds it full waits
/// (the stream with it) rather than drop the block or hold more.
const WRITE_QUEUE: usize = 8;

/// One block read out of memory, for the writer thread to put on disk.
struct Write {
    key: u64,
    prompt: (u64, Vec<u32>),
    payload: Vec<u8>,
    start: std::time::Instant,
}

/// The disk tier of one store, with its admission filter.
pub(super) struct PrefixTier {
    disk: Arc<Mutex<DiskTier>>,
    filter: AdmissionFilter,
    outcomes: Arc<Outcomes>,
    /// To the writer thread, which puts blocks on disk off the store's stream (its files and
    /// `fsync`s never wait between decode kernels). It ends when this sender goes.
    writes: std::sync::mpsc::SyncSender<Write>,
    /// Hangs up when the writer thread has put its last block.
    written: std::sync::mpsc::Receiver<()>,
    copy_in: Histogram,
    /// Other identities' block files found at open.
    others: usize,
}

impl PrefixTier {
    /// Opens the tier for a store of `shape` whose prompt blocks hold `block_tokens` tokens
    /// and `block_bytes` bytes.
    pub(super) fn open(
        config: &PrefixDisk,
        shape: &KvShape,
        block_tokens: usize,
        block_bytes: u64,
        labels: [&str; 2],
    ) -> Result<(PrefixTier, OpenReport), DiskTierError> {
        let model = model_identity(config.model, shape, block_tokens);
        let disk = DiskTierConfig::new(&config.dir, model, config.capacity)
            .with_block(block_tokens, block_bytes);
        let (disk, report) = DiskTier::open(disk)?;
        let blocks = (config.capacity / block_bytes.max(1)).min(1 << 20) as usize;
        let [store, authority] = labels;
        let disk = Arc::new(Mutex::new(disk));
        let outcomes: Arc<Outcomes> = Arc::default();
        let latency = KV_PREFIX_DISK_SECONDS.histogram(&[store, authority, "out"]);
        let (writes, written) = spawn_writer(Arc::clone(&disk), Arc::clone(&outcomes), latency)?;
        let tier = PrefixTier {
            disk,
            // Sized for several times the blocks the disk holds: the candidates outnumber them.
            filter: AdmissionFilter::new(blocks.saturating_mul(4), config.min_hits),
            outcomes,
            writes,
            written,
            copy_in: KV_PREFIX_DISK_SECONDS.histogram(&[store, authority, "in"]),
            others: report.others,
        };
        Ok((tier, report))
    }

    fn disk(&self) -> MutexGuard<'_, DiskTier> {
        self.disk.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A prompt block was asked for (found or not): the filter counts it.
    pub(super) fn record(&mut self, key: u64) {
        self.filter.record(key);
    }

    /// How many of `keys`, from the first, the disk holds.
    pub(super) fn leading_on_disk(&self, keys: &[u64]) -> usize {
        let disk = self.disk();
        keys.iter().take_while(|k| disk.contains(**k)).count()
    }

    /// Whether an evicted block `key` of `bytes` may go to disk: asked for often enough, and
    /// more often than the block it would push out there.
    pub(super) fn admit(&mut self, key: u64, bytes: u64) -> bool {
        let victim = {
            let disk = self.disk();
            if disk.contains(key) {
                return false; // kept there already (it came from there): nothing to copy
            }
            // The block it would push out, where there is no room: the least recently used.
            let room = disk.capacity().saturating_sub(disk.bytes());
            if room < bytes {
                disk.lru()
            } else {
                None
            }
        };
        self.filter.admit(key, victim) == Admission::Admit
    }

    /// The kernel that reads an evicted block out of memory, lets the memory go, and hands the
    /// bytes to the writer thread (waiting while its short queue is full).
    pub(super) fn copy_out(
        &self,
        key: u64,
        prompt: (u64, Vec<u32>),
        block: Arc<SharedPrefix>,
        mapping: Arc<dyn SharedMapping>,
    ) -> impl FnOnce() + Send + 'static {
        let (writes, outcomes) = (self.writes.clone(), Arc::clone(&self.outcomes));
        move || {
            let start = std::time::Instant::now();
            let payload = read_block(&block, mapping.as_ref());
            // The memory goes now, once read: its charge follows it.
            drop(block);
            let queued = payload.is_some_and(|payload| {
                let write = Write {
                    key,
                    prompt,
                    payload,
                    start,
                };
                writes.send(write).is_ok()
            });
            if !queued {
                outcomes.failures.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The kernel that fills `blocks` (fresh, written by nothing else) from disk, in order,
    /// stopping at the first the disk has no whole copy of; with what it fills, counted.
    /// Queued on the store's stream at an open, so every step after it sees the blocks whole.
    pub(super) fn copy_in(
        &self,
        (writer, promised): (Incarnation, usize),
        blocks: Vec<KeyedBlock>,
        mapping: Arc<dyn SharedMapping>,
    ) -> (impl FnOnce() + Send + 'static, CopyIn) {
        let filled: Arc<AtomicUsize> = Arc::default();
        let keys = blocks.iter().map(|b| b.key).collect();
        let copy = CopyIn::new(writer, promised, keys, None, Arc::clone(&filled));
        let (disk, outcomes) = (Arc::clone(&self.disk), Arc::clone(&self.outcomes));
        let latency = self.copy_in.clone();
        let kernel = move || {
            for KeyedBlock {
                key,
                parent,
                tokens,
                block,
            } in blocks
            {
                let start = std::time::Instant::now();
                // A block gone since the open looked (pushed out by a copy out) is a plain
                // miss; one that fails its checks, or a disk or copy that fails, a failure.
                let got = {
                    let mut disk = disk.lock().unwrap_or_else(|p| p.into_inner());
                    let held = disk.contains(key);
                    (held, disk.get(key, parent, &tokens))
                };
                let whole = match got {
                    (_, Ok(Some(payload))) => write_block(&block, mapping.as_ref(), &payload),
                    (false, Ok(None)) => break,
                    (true, Ok(None)) | (_, Err(_)) => false,
                };
                if !whole {
                    outcomes.failures.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                outcomes
                    .hit_tokens
                    .fetch_add(tokens.len() as u64, Ordering::Relaxed);
                latency.record(start.elapsed().as_secs_f64());
                filled.fetch_add(1, Ordering::Release);
            }
        };
        (kernel, copy)
    }

    /// The store is stopping: the whole blocks still in its memory go to disk where the
    /// filter lets them in (as an eviction would send them), so a store started again on the
    /// directory finds its hot prefixes too, not only those pressure pushed out. Blocks on
    /// the thread's behalf: returns once the writer has put every block queued (this and
    /// the copies out before it), or after `wait`. Returns how many it let in.
    pub(super) fn flush(
        mut self,
        blocks: Vec<KeyedBlock>,
        mapping: Arc<dyn SharedMapping>,
        wait: std::time::Duration,
    ) -> usize {
        let mut admitted = 0;
        for KeyedBlock {
            key,
            parent,
            tokens,
            block,
        } in blocks
        {
            if self.admit(key, block.bytes) {
                // The copy out an eviction queues on the stream, run here.
                self.copy_out(key, (parent, tokens), block, Arc::clone(&mapping))();
                admitted += 1;
            }
        }
        let PrefixTier {
            writes, written, ..
        } = self;
        // The thread ends once every sender has gone (copies out still on the stream hold
        // theirs): nothing is ever sent on `written`, it only hangs up.
        drop(writes);
        let _ = written.recv_timeout(wait);
        admitted
    }

    /// Puts the keys of the blocks on disk in `digest`, with those of `in_memory` (the
    /// store's whole blocks in memory): a block back from disk is in both and counts once.
    /// One lock for the lot.
    pub(super) fn digest_into(
        &self,
        digest: &mut PrefixDigest,
        in_memory: impl Iterator<Item = u64>,
    ) {
        let disk = self.disk();
        for key in in_memory.filter(|k| !disk.contains(*k)).chain(disk.keys()) {
            digest.insert(key);
        }
    }

    /// Its figures, into the store's.
    pub(super) fn fill(&self, stats: &mut KvStoreStats) {
        let disk = self.disk();
        stats.prefix_disk_blocks = disk.len();
        stats.prefix_disk_bytes = disk.bytes();
        stats.prefix_disk_others = self.others;
        stats.prefix_disk_hit_tokens = self.outcomes.hit_tokens.load(Ordering::Relaxed);
        stats.prefix_disk_writes = self.outcomes.writes.load(Ordering::Relaxed);
        stats.prefix_disk_failures = self.outcomes.failures.load(Ordering::Relaxed);
        stats.prefix_disk_refused = self.filter.refused();
    }
}

/// Starts the thread that puts blocks on disk, in the order they were read.
fn spawn_writer(
    disk: Arc<Mutex<DiskTier>>,
    outcomes: Arc<Outcomes>,
    latency: Histogram,
) -> Result<
    (
        std::sync::mpsc::SyncSender<Write>,
        std::sync::mpsc::Receiver<()>,
    ),
    DiskTierError,
> {
    let (tx, rx) = std::sync::mpsc::sync_channel::<Write>(WRITE_QUEUE);
    let (done, written) = std::sync::mpsc::channel::<()>();
    std::thread::Builder::new()
        .name("procmem-prefix-disk".into())
        .spawn(move || {
            // Dropped as the thread ends: whoever waits on `written` hears it hang up.
            let _done = done;
            for w in rx {
                // The outcome is counted under the tier's lock, so that whoever reads the
                // blocks on disk (`fill`, under the same lock) reads the count that goes with
                // them.
                let mut tier = disk.lock().unwrap_or_else(|p| p.into_inner());
                let put = tier.put(w.key, w.prompt.0, &w.prompt.1, &w.payload);
                let counter = if put.is_ok() {
                    &outcomes.writes
                } else {
                    &outcomes.failures
                };
                counter.fetch_add(1, Ordering::Relaxed);
                drop(tier);
                if put.is_ok() {
                    latency.record(w.start.elapsed().as_secs_f64());
                }
            }
        })
        .map_err(|source| DiskTierError::Io {
            what: "start the writer thread",
            source,
        })?;
    Ok((tx, written))
}

/// The identity blocks are kept under: the caller's model id, the store's geometry, its
/// element types and its block size (a block of another shape or type is never the same
/// K/V). K and V of one type are recorded as one, as they always were.
fn model_identity(model: u64, shape: &KvShape, block_tokens: usize) -> u64 {
    let mut geometry = vec![
        shape.layers,
        shape.q_heads,
        shape.kv_heads,
        shape.head_dim,
        dtype_code(shape.k_dtype),
        block_tokens,
    ];
    if shape.v_dtype != shape.k_dtype {
        geometry.push(dtype_code(shape.v_dtype) << 16);
    }
    let geometry: Vec<u32> = geometry.into_iter().map(|x| x as u32).collect();
    chain_hash(model, &geometry)
}

/// The element type as the identity records it: the byte widths it always recorded for
/// `f32` and `f16` (so their tiers stay readable), a code no width takes for `q8_0`.
fn dtype_code(dtype: KvDtype) -> usize {
    match dtype {
        KvDtype::F32 => 4,
        KvDtype::F16 => 2,
        KvDtype::Q8_0 => 0x108,
    }
}

/// A block's bytes, buffer after buffer (`None` if the mechanism cannot read it).
fn read_block(block: &SharedPrefix, mapping: &dyn SharedMapping) -> Option<Vec<u8>> {
    let mut payload = vec![0u8; usize::try_from(block.bytes).ok()?];
    let mut rest = &mut payload[..];
    for b in &block.blocks {
        let (dst, after) = rest.split_at_mut_checked(usize::try_from(b.bytes()).ok()?)?;
        mapping.read_block(b, dst).ok()?;
        rest = after;
    }
    rest.is_empty().then_some(payload)
}

/// Writes `payload` (as [`read_block`] laid it out) into `block`.
pub(super) fn write_block(
    block: &SharedPrefix,
    mapping: &dyn SharedMapping,
    payload: &[u8],
) -> bool {
    if payload.len() as u64 != block.bytes || block.blocks.is_empty() {
        return false;
    }
    // Each physical block takes its own bytes in turn (K and V blocks may differ).
    let mut rest = payload;
    block.blocks.iter().all(|b| {
        let Some((src, after)) = usize::try_from(b.bytes())
            .ok()
            .and_then(|n| rest.split_at_checked(n))
        else {
            return false;
        };
        rest = after;
        mapping.write_block(b, src).is_ok()
    }) && rest.is_empty()
}
