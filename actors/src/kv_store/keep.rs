//! A closed sequence's whole blocks of prompt and answer, left to the prefix cache: a chat's
//! next turn sends the conversation so far (the last answer included) as its prompt, and
//! finds those blocks cached instead of computing them again.
//!
//! The store sees a sequence's rows, never its token ids past the prompt, so the caller
//! names them at close ([`KvStoreHandle::close_keeping`](super::KvStoreHandle::close_keeping)).
//! The blocks past the ones the sequence already maps are copied out of its own memory into
//! fresh shared blocks by a kernel on the store's stream, after its last step's kernels:
//! - **Paid for by the sequence.** The fresh blocks take their part of the sequence's charge
//!   (they copy rows of its own memory, so they never need more than it holds); no grant is
//!   asked, and nothing else is pressed to make room for a cache.
//! - **The OS never above the ledger.** The kernel reads the rows, frees the sequence's memory
//!   and its charge's remainder, and only then makes the fresh blocks (a host block is
//!   allocated as it is made) and writes them.
//! - **Whole once written.** The blocks are claimed by a writer of their own and join the
//!   cache, whole, when the kernel's fence completes (`Kept`); until then an open of the same
//!   tokens stops sharing at the first of them, as at any block being written.
//!
//! Only where the memory is host memory (the rows are read in place); a store on a GPU closes
//! as a plain close. A sequence in a step, preempted, or waiting for a copy in closes plainly
//! too, as does one whose first blocks are not the ones the tokens name (a careless caller).

use std::sync::{Arc, Mutex, PoisonError};

use procmem::fence::Fence;
use procmem::kv::{Incarnation, KvPart, KvSequence};
use procmem::SharedMapping;
use ractor::ActorRef;

use super::disk_tier::write_block;
use super::prefix::SharedPrefix;
use super::sequences::Resident;
use super::{KvStoreMsg, KvStoreState, SeqId};
use crate::charge::Charge;

/// What a keep kernel makes, for the store once it has run: the keys claimed for `keeper`,
/// in order, and the blocks the kernel made whole (from the first).
pub(crate) struct Keeping {
    keeper: Incarnation,
    keys: Vec<u64>,
    made: Made,
    /// The keep kernel's fence.
    fence: Fence,
}

/// Where a keep kernel leaves the blocks it made.
type Made = Arc<Mutex<Vec<Arc<SharedPrefix>>>>;

impl KvStoreState {
    /// Closes `seq`, leaving the whole blocks of `tokens` (the ids whose K/V its rows hold,
    /// prompt then answer; those past its rows are ignored) that the cache lacks to the cache.
    pub(super) fn close_keeping(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        seq: SeqId,
        tokens: Vec<u32>,
    ) {
        let idle = self.sequences.is_idle(seq);
        let Some(entry) = self.take_closed(seq) else {
            return;
        };
        let keepable = idle && self.device.is_host() && entry.copy_in.is_none();
        match keepable {
            true => self.keep(myself, entry, &tokens),
            false => self.retire(entry),
        }
    }

    /// Claims the blocks of `tokens` past those `entry` maps, makes them from its charge and
    /// queues the kernel that fills them and frees its memory. Anything short of that
    /// retires it as a plain close would.
    fn keep(&mut self, myself: &ActorRef<KvStoreMsg>, mut entry: Resident, tokens: &[u32]) {
        let shape = self.config.shape;
        let g = self.device.granularity();
        let bt = shape.block_tokens(g);
        let rows = entry.memory.tokens();
        let whole = tokens.len().min(rows) / bt.max(1);
        if whole <= entry.prefixes.len() {
            return self.retire(entry);
        }
        let keeper = self.sequences.new_writer();
        let lookup = self
            .prefixes
            .lookup(&tokens[..whole * bt], bt, keeper, self.clock);
        // The tokens must name the blocks the sequence maps (the same blocks, not only the
        // same keys): otherwise its rows are not the K/V of those tokens.
        let mapped = &entry.prefixes;
        let named = lookup.hits.len() >= mapped.len()
            && mapped
                .iter()
                .zip(&lookup.hits)
                .all(|(m, (_, hit))| std::ptr::eq::<SharedPrefix>(&**m, &**hit));
        let first = lookup.hits.len();
        let keys = lookup.claimed;
        let block_bytes = shape.block_bytes_all(g);
        // Each block is paid for by its part of the sequence's charge, split off now and
        // handed to the kernel with the memory.
        let paid = entry.charge.bytes() >= keys.len() as u64 * block_bytes;
        let parts: Option<Vec<Charge>> = match named && paid && !keys.is_empty() {
            true => keys
                .iter()
                .map(|_| entry.charge.split(block_bytes))
                .collect(),
            false => None,
        };
        let Some(parts) = parts else {
            // Nothing to keep, or a charge short of the blocks.
            self.prefixes.abandon(keeper);
            return self.retire(entry);
        };
        // Made by a request, as the blocks an open claims are: the filter counts them once.
        if let Some(tier) = self.tier.as_mut() {
            keys.iter().for_each(|k| tier.record(*k));
        }
        let made: Made = Arc::default();
        let kernel = keep_kernel(
            entry,
            (first, bt, g),
            parts,
            Arc::clone(&self.device.shared),
            Arc::clone(&made),
        );
        match self.device.stream.submit_host(kernel) {
            Ok(fence) => {
                // A ticket that comes before the blocks join the cache waits for them.
                self.keeping = Some(fence);
                let msg = KvStoreMsg::Kept(Keeping {
                    keeper,
                    keys,
                    made,
                    fence,
                });
                self.send_after(myself, fence, msg);
            }
            // A closed stream ran nothing: the memory and the fresh blocks went with it.
            Err(_) => {
                self.prefixes.abandon(keeper);
            }
        }
    }

    /// A keep kernel ran: the blocks it made join the cache, whole, under the keys claimed
    /// for them; the claims it made no block for leave.
    pub(super) fn kept(
        &mut self,
        Keeping {
            keeper,
            keys,
            made,
            fence,
        }: Keeping,
    ) {
        // Kernels on the stream complete in order: the last one queued is the last to land.
        if self.keeping == Some(fence) {
            self.keeping = None;
        }
        let made = std::mem::take(&mut *made.lock().unwrap_or_else(PoisonError::into_inner));
        for (key, block) in keys.iter().zip(made) {
            // Claimed by `keeper` at close, and only it fills and completes a claim.
            if self.prefixes.fill(*key, keeper, block).is_ok()
                && self.prefixes.complete(*key, keeper)
            {
                self.stats.prefix_blocks_kept += 1;
            }
        }
        self.prefixes.abandon(keeper);
    }
}

/// The kernel that copies rows of `entry`'s memory, from block `first` on, into one fresh
/// block per charge part: every row read first, then the memory and what is left of its
/// charge freed, then each block made and written (so the OS never holds both). The blocks
/// made whole go to `made`, in order, up to the first that could not be.
fn keep_kernel(
    entry: Resident,
    (first, bt, g): (usize, usize, u64),
    parts: Vec<Charge>,
    mapping: Arc<dyn SharedMapping>,
    made: Made,
) -> impl FnOnce() + Send + 'static {
    move || {
        let Resident {
            memory,
            charge,
            prefixes,
            ..
        } = entry;
        let shape = *memory.shape();
        let rows = read_rows(&memory, first, parts.len(), bt);
        drop(memory);
        drop((prefixes, charge));
        let Some(rows) = rows else {
            return;
        };
        let mut whole = Vec::with_capacity(parts.len());
        for (part, payload) in parts.into_iter().zip(rows) {
            // Made only now, after the memory went: a host block is allocated as it is made.
            let block = SharedPrefix::create(mapping.as_ref(), &shape, g, part);
            match block {
                Ok(block) if write_block(&block, mapping.as_ref(), &payload) => {
                    whole.push(Arc::new(block))
                }
                _ => break,
            }
        }
        *made.lock().unwrap_or_else(PoisonError::into_inner) = whole;
    }
}

/// Blocks `first .. first + count` of `memory`, each laid out buffer after buffer (`None` if
/// a row cannot be read). The memory is freed as this returns.
fn read_rows(memory: &KvSequence, first: usize, count: usize, bt: usize) -> Option<Vec<Vec<u8>>> {
    let shape = memory.shape();
    let end = (first + count) * bt;
    // Each buffer's rows, and the bytes of one block of them (K and V may differ).
    let buffers: Vec<(&[u8], usize)> = (0..shape.buffers())
        .map(|b| {
            let per = shape.rows(KvPart::of_buffer(b)).offset(bt as u64) as usize;
            memory.buffer_bytes(b, end).ok().map(|rows| (rows, per))
        })
        .collect::<Option<_>>()?;
    let blocks = (first..first + count)
        .map(|j| {
            buffers
                .iter()
                .flat_map(|(rows, per)| &rows[j * per..(j + 1) * per])
                .copied()
                .collect()
        })
        .collect();
    Some(blocks)
}
