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
//!   and its charge's remainder, and only then writes the fresh blocks.
//! - **Whole once written.** The blocks are claimed by a writer of their own and join the
//!   cache as whole when the kernel's fence completes (`Kept`); until then an open of the same
//!   tokens shares none of them, as for any block being written.
//!
//! Only where the memory is host memory (the rows are read in place); a store on a GPU closes
//! as a plain close. A sequence in a step, preempted, or waiting for a copy in closes plainly
//! too, as does one whose first blocks are not the ones the tokens name (a careless caller).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use procmem::kv::{Incarnation, KvSequence, Phase};
use procmem::SharedMapping;
use ractor::ActorRef;

use super::prefix::{Mapped, SharedPrefix};
use super::sequences::SeqEntry;
use super::{KvStoreMsg, KvStoreState, SeqId};

/// The blocks a kernel is filling for a keeper: their keys in order, and how many it filled.
pub(super) type Keeping = (Incarnation, Vec<u64>, Arc<AtomicUsize>);

impl KvStoreState {
    /// Closes `seq`, leaving the whole blocks of `tokens` (the ids whose K/V its rows hold,
    /// prompt then answer; those past its rows are ignored) that the cache lacks to the cache.
    pub(super) fn close_keeping(
        &mut self,
        myself: &ActorRef<KvStoreMsg>,
        seq: SeqId,
        tokens: Vec<u32>,
    ) {
        let idle = self
            .sequences
            .table
            .get(seq)
            .is_some_and(|r| r.phase == Phase::Idle);
        let (writer, entry) = self.sequences.close(seq);
        if let Some(writer) = writer {
            self.prefixes.abandon(writer);
        }
        let Some(entry) = entry else {
            return;
        };
        let keepable = idle
            && self.device.is_host()
            && entry.memory.is_some()
            && entry.saved.is_none()
            && entry.copy_in.is_none();
        match keepable {
            true => self.keep(myself, entry, &tokens),
            false => self.retire(entry),
        }
    }

    /// Claims the blocks of `tokens` past those `entry` maps, makes them from its charge and
    /// queues the kernel that fills them and frees its memory. Anything short of that
    /// retires it as a plain close would.
    fn keep(&mut self, myself: &ActorRef<KvStoreMsg>, mut entry: SeqEntry, tokens: &[u32]) {
        let shape = self.config.shape;
        let g = self.device.granularity();
        let bt = shape.block_tokens(g);
        let rows = entry.memory.as_ref().map_or(0, KvSequence::tokens);
        let whole = tokens.len().min(rows) / bt.max(1);
        if whole <= entry.prefixes.len() {
            return self.retire(entry);
        }
        let keeper = self.sequences.table.new_writer();
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
        let bytes = keys.len() as u64 * shape.buffers() as u64 * shape.block_bytes(g);
        // Paid for from the sequence's charge; on failure what was not used stays in it,
        // with the memory it pays for.
        let fresh = match named && !keys.is_empty() && entry.charge.bytes() >= bytes {
            true => self.make_blocks(keys.len(), &mut entry.charge).ok(),
            false => None,
        };
        let Some(fresh) = fresh else {
            self.prefixes.abandon(keeper);
            return self.retire(entry);
        };
        for (key, block) in keys.iter().zip(&fresh) {
            // Claimed by `keeper` just now, and only it fills a claim.
            let _ = self.prefixes.fill(*key, keeper, Arc::clone(block));
        }
        // Made by a request, as the blocks an open claims are: the filter counts them once.
        if let Some(tier) = self.tier.as_mut() {
            keys.iter().for_each(|k| tier.record(*k));
        }
        let filled: Arc<AtomicUsize> = Arc::default();
        let kernel = keep_kernel(
            entry,
            (first, bt),
            fresh.into_iter().map(Mapped::new).collect(),
            Arc::clone(&self.device.shared),
            Arc::clone(&filled),
        );
        match self.device.stream.submit_host(kernel) {
            Ok(fence) => {
                let msg = KvStoreMsg::Kept((keeper, keys, filled));
                self.send_after(myself, fence, msg);
            }
            // A closed stream ran nothing: the memory and the fresh blocks went with it.
            Err(_) => {
                self.prefixes.abandon(keeper);
            }
        }
    }

    /// A keep kernel ran: the blocks it filled are whole; any it did not fill leave.
    pub(super) fn kept(&mut self, (keeper, keys, filled): Keeping) {
        let filled = filled.load(Ordering::Acquire).min(keys.len());
        for key in &keys[..filled] {
            self.prefixes.complete(*key, keeper);
        }
        self.prefixes.abandon(keeper);
        self.stats.prefix_blocks_kept += filled as u64;
    }
}

/// The kernel that copies rows of `entry`'s memory, from block `first` on, into `fresh`:
/// every row read first, then the memory and what is left of its charge freed, then the
/// blocks written (so the OS never holds both). Counts the blocks written whole, in order.
fn keep_kernel(
    entry: SeqEntry,
    (first, bt): (usize, usize),
    fresh: Vec<Mapped>,
    mapping: Arc<dyn SharedMapping>,
    filled: Arc<AtomicUsize>,
) -> impl FnOnce() + Send + 'static {
    move || {
        let SeqEntry {
            memory,
            charge,
            prefixes,
            ..
        } = entry;
        let rows = memory.map(|m| read_rows(&m, first, fresh.len(), bt));
        drop((prefixes, charge));
        let Some(Some(rows)) = rows else {
            return;
        };
        for (block, payload) in fresh.iter().zip(rows) {
            let per = payload.len() / block.blocks.len().max(1);
            let whole = block
                .blocks
                .iter()
                .zip(payload.chunks(per.max(1)))
                .all(|(b, src)| mapping.write_block(b, src).is_ok());
            if !whole {
                break;
            }
            filled.fetch_add(1, Ordering::Release);
        }
    }
}

/// Blocks `first .. first + count` of `memory`, each laid out buffer after buffer (`None` if
/// a row cannot be read). The memory is freed as this returns.
fn read_rows(memory: &KvSequence, first: usize, count: usize, bt: usize) -> Option<Vec<Vec<u8>>> {
    let shape = memory.shape();
    let per = bt * shape.token_bytes() as usize;
    let end = (first + count) * bt;
    let buffers: Vec<&[u8]> = (0..shape.buffers())
        .map(|b| memory.buffer_bytes(b, end).ok())
        .collect::<Option<_>>()?;
    let blocks = (first..first + count)
        .map(|j| {
            buffers
                .iter()
                .flat_map(|rows| &rows[j * per..(j + 1) * per])
                .copied()
                .collect()
        })
        .collect();
    Some(blocks)
}
