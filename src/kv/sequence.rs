//! One sequence's KV memory: a K and a V buffer per layer, each a reservation of the model's
//! maximum length, backed only as far as tokens exist (plus at most one growth chunk).
//!
//! Growth is two-phase so a caller can wrap it in a charge: [`KvSequence::map_growth`] maps
//! the next chunk in every buffer (undoing its own mappings if any fails) without changing
//! what readers see; [`KvSequence::publish`] makes it visible, or [`KvSequence::abandon`]
//! unmaps it again.

use thiserror::Error;

use super::elem::{KvElement, KvView, LayerViews};
use super::shape::{mapped_bytes_for, KvDtype, KvShape, ShapeError};
use crate::api::{
    GranuleState, MapAccess, MemoryError, MemoryRole, PhysicalBlock, SharedMapping,
    VirtualAllocation, VirtualBacking, VirtualRequest,
};
use crate::virtual_memory::{range_bytes, range_bytes_mut};

/// Why a KV operation was refused; the sequence is as it was.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum KvError {
    /// The mechanism refused or failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The shape cannot be used.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// The sequence is at its maximum length.
    #[error("the sequence is full at {0} tokens")]
    Full(usize),
    /// The position has no backing yet; grow first.
    #[error("position {0} is not mapped yet; grow the sequence first")]
    NotMapped(usize),
    /// The position lies in a shared block; copy it on write first.
    #[error("position {0} lies in a shared prefix block; copy it on write first")]
    SharedBlock(usize),
    /// A layer index past the model.
    #[error("layer {0} does not exist")]
    NoSuchLayer(usize),
    /// A K or V vector of the wrong length.
    #[error("expected {expected} elements, got {got}")]
    WrongLength {
        /// Floats expected.
        expected: usize,
        /// Floats given.
        got: usize,
    },
    /// Elements of another type than the shape's.
    #[error("the KV is kept as {kept:?}, not {asked:?}")]
    WrongType {
        /// The shape's element type.
        kept: KvDtype,
        /// The type asked for.
        asked: KvDtype,
    },
    /// No sequence at that index of a step.
    #[error("the step has no sequence at index {0}")]
    BadIndex(usize),
    /// Shared blocks can only be attached to an empty sequence, in whole blocks.
    #[error("shared prefix blocks attach to an empty sequence, whole blocks per buffer")]
    BadPrefix,
}

/// A growth mapped but not yet visible. Publish it or abandon it.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "publish or abandon a mapped growth"]
pub struct PendingGrowth {
    from: u64,
    to: u64,
    buffers: usize,
}

impl PendingGrowth {
    /// Physical bytes this growth mapped, over all buffers.
    pub fn bytes(&self) -> u64 {
        (self.to - self.from) * self.buffers as u64
    }
}

/// One sequence's KV memory.
#[derive(Debug)]
pub struct KvSequence {
    shape: KvShape,
    chunk: u64,
    buffers: Vec<VirtualAllocation>,
    tokens: usize,
    mapped: u64,
}

impl KvSequence {
    /// Reserves a K and a V buffer per layer; growth maps `chunk_granules` granules at a time.
    pub fn reserve(
        backing: &dyn VirtualBacking,
        shape: KvShape,
        chunk_granules: u64,
    ) -> Result<Self, KvError> {
        let g = backing.granularity();
        shape.validate(g)?;
        let bytes = shape.buffer_bytes(g);
        let buffers = (0..shape.buffers())
            .map(|_| {
                backing.reserve(&VirtualRequest {
                    bytes,
                    role: MemoryRole::KvCache,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(KvSequence {
            shape,
            chunk: g * chunk_granules.max(1),
            buffers,
            tokens: 0,
            mapped: 0,
        })
    }

    /// The shape.
    pub fn shape(&self) -> &KvShape {
        &self.shape
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Bytes backed from the start of each buffer (shared blocks and own memory).
    pub fn mapped_bytes(&self) -> u64 {
        self.mapped
    }

    /// Tokens that fit in what is mapped.
    pub fn mapped_tokens(&self) -> usize {
        (self.mapped / self.shape.token_bytes()) as usize
    }

    /// Bytes of physical memory this sequence owns alone (not shared blocks), all buffers.
    pub fn exclusive_bytes(&self) -> u64 {
        self.buffers
            .iter()
            .map(|b| b.granules().committed_bytes())
            .sum()
    }

    /// The reservations: K then V for each layer.
    pub fn buffers(&self) -> &[VirtualAllocation] {
        &self.buffers
    }

    /// Bytes per buffer that must be mapped before `more` tokens can be appended.
    pub fn growth_for(&self, more: usize) -> u64 {
        let capacity = self.buffers[0].len();
        mapped_bytes_for(
            self.tokens + more,
            self.shape.token_bytes(),
            self.chunk,
            capacity,
        )
        .saturating_sub(self.mapped)
    }

    /// Maps `per_buffer` more bytes at the end of every buffer. If any mapping fails, the
    /// ones this call made are unmapped and the sequence is unchanged.
    pub fn map_growth(
        &mut self,
        backing: &dyn VirtualBacking,
        per_buffer: u64,
    ) -> Result<PendingGrowth, KvError> {
        let from = self.mapped;
        let to = from + per_buffer;
        if to > self.buffers[0].len() {
            return Err(KvError::Full(self.shape.max_tokens));
        }
        for i in 0..self.buffers.len() {
            if let Err(e) = backing.commit_range(&mut self.buffers[i], from..to) {
                for done in &mut self.buffers[..i] {
                    backing.decommit_range(done, from..to)?;
                }
                return Err(e.into());
            }
        }
        Ok(PendingGrowth {
            from,
            to,
            buffers: self.buffers.len(),
        })
    }

    /// Makes a mapped growth visible.
    pub fn publish(&mut self, growth: PendingGrowth) {
        debug_assert_eq!(growth.from, self.mapped, "growths publish in order");
        self.mapped = growth.to;
    }

    /// Unmaps a growth that will not be published (its charge was refused).
    pub fn abandon(
        &mut self,
        backing: &dyn VirtualBacking,
        growth: PendingGrowth,
    ) -> Result<(), KvError> {
        for b in &mut self.buffers {
            backing.decommit_range(b, growth.from..growth.to)?;
        }
        Ok(())
    }

    /// Maps shared prefix blocks at the start of an empty sequence: `blocks[i * buffers + b]`
    /// is block `i` of buffer `b`, mapped with `access[i]`. The sequence then holds `tokens`
    /// tokens (at most what the blocks cover). If any mapping fails, the ones made by this call
    /// are undone.
    pub fn attach_prefix(
        &mut self,
        backing: &dyn VirtualBacking,
        mapping: &dyn SharedMapping,
        blocks: &[PhysicalBlock],
        access: &[MapAccess],
        tokens: usize,
    ) -> Result<(), KvError> {
        let n = self.buffers.len();
        if self.mapped != 0 || blocks.is_empty() || blocks.len() != access.len() * n {
            return Err(KvError::BadPrefix);
        }
        let block_bytes = blocks[0].bytes();
        let covered = access.len() as u64 * block_bytes;
        if tokens as u64 * self.shape.token_bytes() > covered {
            return Err(KvError::BadPrefix);
        }
        let place = |i: usize| (i % n, (i / n) as u64 * block_bytes);
        for (i, block) in blocks.iter().enumerate() {
            let (b, offset) = place(i);
            if let Err(e) = mapping.map_block(&mut self.buffers[b], offset, block, access[i / n]) {
                for j in 0..i {
                    let (b, offset) = place(j);
                    backing.decommit_range(&mut self.buffers[b], offset..offset + block_bytes)?;
                }
                return Err(e.into());
            }
        }
        self.mapped = covered;
        self.tokens = tokens;
        Ok(())
    }

    fn check_layer<T: KvElement>(&self, layer: usize, k: &[T], v: &[T]) -> Result<(), KvError> {
        if layer >= self.shape.layers {
            return Err(KvError::NoSuchLayer(layer));
        }
        self.check_type::<T>()?;
        for x in [k.len(), v.len()] {
            if x != self.shape.token_elems() {
                return Err(KvError::WrongLength {
                    expected: self.shape.token_elems(),
                    got: x,
                });
            }
        }
        Ok(())
    }

    fn check_type<T: KvElement>(&self) -> Result<(), KvError> {
        if T::DTYPE == self.shape.dtype {
            Ok(())
        } else {
            Err(KvError::WrongType {
                kept: self.shape.dtype,
                asked: T::DTYPE,
            })
        }
    }

    /// Writes one token's K and V for `layer` at position `pos` (the next position, or an
    /// earlier one being rewritten). The position must be mapped and not in a shared block.
    pub fn write<T: KvElement>(
        &mut self,
        layer: usize,
        pos: usize,
        k: &[T],
        v: &[T],
    ) -> Result<(), KvError> {
        self.check_layer(layer, k, v)?;
        let tb = self.shape.token_bytes();
        let start = pos as u64 * tb;
        if start + tb > self.mapped {
            return Err(KvError::NotMapped(pos));
        }
        for (b, data) in [(2 * layer, k), (2 * layer + 1, v)] {
            let buffer = &mut self.buffers[b];
            let read_only_share = buffer.granules().state_at(start) == Some(GranuleState::Shared)
                && buffer.shared_views().any(|(o, v)| {
                    o <= start && start < o + v.block.bytes() && v.access != MapAccess::ReadWrite
                });
            if read_only_share {
                return Err(KvError::SharedBlock(pos));
            }
            let bytes = range_bytes_mut(buffer, start..start + tb)?;
            bytes.copy_from_slice(bytemuck::cast_slice(data));
        }
        Ok(())
    }

    /// Counts one more token, once every layer's K and V for it are written.
    pub fn advance(&mut self) -> Result<(), KvError> {
        if self.tokens >= self.shape.max_tokens {
            return Err(KvError::Full(self.shape.max_tokens));
        }
        if self.tokens + 1 > self.mapped_tokens() {
            return Err(KvError::NotMapped(self.tokens));
        }
        self.tokens += 1;
        Ok(())
    }

    fn elems<T: KvElement>(&self, buffer: usize, tokens: usize) -> Result<&[T], KvError> {
        self.check_type::<T>()?;
        let len = tokens as u64 * self.shape.token_bytes();
        let bytes = range_bytes(&self.buffers[buffer], 0..len)?;
        Ok(bytemuck::cast_slice(bytes))
    }

    /// Layer `layer`'s keys for the first `tokens` positions (which must be mapped): lets a
    /// step read the token it is writing before [`KvSequence::advance`] counts it.
    pub fn keys_upto<T: KvElement>(&self, layer: usize, tokens: usize) -> Result<&[T], KvError> {
        self.check_upto(layer, tokens)?;
        self.elems(2 * layer, tokens)
    }

    /// Layer `layer`'s values for the first `tokens` positions.
    pub fn values_upto<T: KvElement>(&self, layer: usize, tokens: usize) -> Result<&[T], KvError> {
        self.check_upto(layer, tokens)?;
        self.elems(2 * layer + 1, tokens)
    }

    fn check_upto(&self, layer: usize, tokens: usize) -> Result<(), KvError> {
        if layer >= self.shape.layers {
            return Err(KvError::NoSuchLayer(layer));
        }
        if tokens > self.mapped_tokens() {
            return Err(KvError::NotMapped(tokens.saturating_sub(1)));
        }
        Ok(())
    }

    /// Layer `layer`'s past keys: `tokens × kv_heads × head_dim` elements, one flat slice.
    pub fn keys<T: KvElement>(&self, layer: usize) -> Result<&[T], KvError> {
        self.keys_upto(layer, self.tokens)
    }

    /// Layer `layer`'s past values, laid out as the keys.
    pub fn values<T: KvElement>(&self, layer: usize) -> Result<&[T], KvError> {
        self.values_upto(layer, self.tokens)
    }

    /// Buffer `buffer`'s first `tokens` rows as bytes, whatever the element type: what a
    /// swap copies out.
    pub fn buffer_bytes(&self, buffer: usize, tokens: usize) -> Result<&[u8], KvError> {
        if buffer >= self.buffers.len() {
            return Err(KvError::NoSuchLayer(buffer / 2));
        }
        if tokens > self.mapped_tokens() {
            return Err(KvError::NotMapped(tokens.saturating_sub(1)));
        }
        Ok(range_bytes(
            &self.buffers[buffer],
            0..tokens as u64 * self.shape.token_bytes(),
        )?)
    }

    /// Writes whole rows from position 0 of buffer `buffer` (a swap's copy coming back); the
    /// rows must be mapped and writable.
    pub fn write_buffer_bytes(&mut self, buffer: usize, bytes: &[u8]) -> Result<(), KvError> {
        let tb = self.shape.token_bytes();
        if buffer >= self.buffers.len() {
            return Err(KvError::NoSuchLayer(buffer / 2));
        }
        if bytes.len() as u64 % tb != 0 {
            return Err(KvError::WrongLength {
                expected: (bytes.len() as u64).next_multiple_of(tb) as usize,
                got: bytes.len(),
            });
        }
        if bytes.len() as u64 > self.mapped {
            return Err(KvError::NotMapped((self.mapped / tb) as usize));
        }
        range_bytes_mut(&mut self.buffers[buffer], 0..bytes.len() as u64)?.copy_from_slice(bytes);
        Ok(())
    }

    /// Where layer `layer`'s K and V lie for a kernel, `tokens` rows of each (at most what is
    /// mapped): the reservations' own addresses, valid while the sequence keeps its memory.
    pub fn views(&self, layer: usize, tokens: usize) -> Result<LayerViews, KvError> {
        self.check_upto(layer, tokens)?;
        let view = |b: &VirtualAllocation| KvView {
            addr: b.addr(),
            tokens,
            dtype: self.shape.dtype,
            token_stride: self.shape.token_bytes(),
            head_stride: self.shape.head_dim as u64 * self.shape.dtype.bytes(),
            device: b.device(),
        };
        Ok(LayerViews {
            k: view(&self.buffers[2 * layer]),
            v: view(&self.buffers[2 * layer + 1]),
        })
    }

    /// Replaces the shared block holding position `pos` (in every buffer) with a private
    /// copy, so it can be written without other sequences seeing the write. Returns the bytes
    /// of private memory this took. Other mappings of the block are untouched.
    pub fn copy_on_write(
        &mut self,
        backing: &dyn VirtualBacking,
        pos: usize,
    ) -> Result<u64, KvError> {
        let start = pos as u64 * self.shape.token_bytes();
        let mut taken = 0;
        for b in 0..self.buffers.len() {
            let view = self.buffers[b]
                .shared_views()
                .find(|(o, v)| *o <= start && start < o + v.block.bytes())
                .map(|(o, v)| (o, v.block.bytes()));
            let Some((offset, len)) = view else { continue };
            let saved = range_bytes(&self.buffers[b], offset..offset + len)?.to_vec();
            backing.decommit_range(&mut self.buffers[b], offset..offset + len)?;
            backing.commit_range(&mut self.buffers[b], offset..offset + len)?;
            range_bytes_mut(&mut self.buffers[b], offset..offset + len)?.copy_from_slice(&saved);
            taken += len;
        }
        Ok(taken)
    }

    /// Bytes of private memory [`KvSequence::copy_on_write`] at `pos` would take.
    pub fn copy_on_write_bytes(&self, pos: usize) -> u64 {
        let start = pos as u64 * self.shape.token_bytes();
        self.buffers
            .iter()
            .filter_map(|b| {
                b.shared_views()
                    .find(|(o, v)| *o <= start && start < o + v.block.bytes())
                    .map(|(_, v)| v.block.bytes())
            })
            .sum()
    }

    /// Drops the token count to `tokens` (keeping the mapping): for rewinds.
    pub fn truncate(&mut self, tokens: usize) {
        self.tokens = self.tokens.min(tokens);
    }

    /// Elements per token in one buffer, for callers sizing vectors.
    pub fn token_elems(&self) -> usize {
        self.shape.token_elems()
    }
}
