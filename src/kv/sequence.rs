//! One sequence's KV memory: a K and a V buffer per layer, each a reservation of the model's
//! maximum length, backed only as far as tokens exist (plus at most one growth chunk).
//!
//! Each buffer is a [`VirtualBuffer`], and growth is its two-phase grow so a caller can wrap
//! it in a charge: [`KvSequence::map_growth`] maps the next chunk at the end of every buffer
//! (undoing its own mappings if any fails) without changing what readers see;
//! [`KvSequence::publish`] makes it visible, or [`KvSequence::abandon`] unmaps it again.

use thiserror::Error;

use super::elem::{narrow_into, KvElement, KvRows, KvView, LayerViews};
use super::shape::{mapped_bytes_for, KvDtype, KvPart, KvShape, RowLayout, ShapeError};
use std::ops::Range;
use std::sync::Arc;

use crate::api::{
    MapAccess, MemoryError, MemoryRole, PhysicalBlock, SharedMapping, VirtualBacking,
};
use crate::virtual_memory::{MappedTail, VirtualBuffer};

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

/// Bytes a growth maps at the end of each K buffer and of each V buffer (they differ where K
/// and V are kept in different types): what [`KvSequence::growth_for`] asks and
/// [`KvSequence::map_growth`] maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GrowthSize {
    /// Bytes at the end of each K buffer.
    pub k: u64,
    /// Bytes at the end of each V buffer.
    pub v: u64,
    /// Layers: buffers of each part.
    pub layers: usize,
}

impl GrowthSize {
    /// Bytes over every buffer: what the growth must be paid for with.
    pub fn bytes(&self) -> u64 {
        (self.layers as u64).saturating_mul(self.k.saturating_add(self.v))
    }

    /// True when nothing is to be mapped.
    pub fn is_empty(&self) -> bool {
        self.bytes() == 0
    }

    /// Bytes at the end of each buffer of `part`.
    pub fn of(&self, part: KvPart) -> u64 {
        match part {
            KvPart::K => self.k,
            KvPart::V => self.v,
        }
    }
}

/// A growth mapped but not yet visible. Publish it or abandon it.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "publish or abandon a mapped growth"]
pub struct PendingGrowth {
    /// Each buffer that grew, with its new tail.
    tails: Vec<(usize, MappedTail)>,
}

impl PendingGrowth {
    /// Physical bytes this growth mapped, over all buffers.
    pub fn bytes(&self) -> u64 {
        self.tails.iter().map(|(_, t)| t.bytes()).sum()
    }
}

/// One sequence's KV memory.
#[derive(Debug)]
pub struct KvSequence {
    shape: KvShape,
    chunk: u64,
    /// K then V for each layer; every K of one length, every V of one length.
    buffers: Vec<VirtualBuffer>,
    tokens: usize,
}

impl KvSequence {
    /// Reserves a K and a V buffer per layer; growth maps `chunk_granules` granules at a time.
    pub fn reserve(
        backing: Arc<dyn VirtualBacking>,
        shape: KvShape,
        chunk_granules: u64,
    ) -> Result<Self, KvError> {
        let g = backing.granularity();
        shape.validate(g)?;
        let buffers = (0..shape.buffers())
            .map(|b| {
                let bytes = shape.buffer_bytes(KvPart::of_buffer(b), g);
                VirtualBuffer::new(Arc::clone(&backing), bytes, MemoryRole::KvCache)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(KvSequence {
            shape,
            chunk: g * chunk_granules.max(1),
            buffers,
            tokens: 0,
        })
    }

    /// How the rows of buffer `b` lie.
    fn rows_of(&self, b: usize) -> RowLayout {
        self.shape.rows(KvPart::of_buffer(b))
    }

    /// The first buffer of `part` (every other of its part has its length).
    fn first(&self, part: KvPart) -> &VirtualBuffer {
        &self.buffers[part as usize]
    }

    /// The shape.
    pub fn shape(&self) -> &KvShape {
        &self.shape
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Bytes backed from the start of the buffers, over all of them (shared blocks and own
    /// memory).
    pub fn mapped_bytes(&self) -> u64 {
        self.buffers.iter().map(VirtualBuffer::len).sum()
    }

    /// Tokens that fit in what is mapped (in K and in V).
    pub fn mapped_tokens(&self) -> usize {
        KvPart::BOTH
            .iter()
            .map(|p| self.shape.rows(*p).rows_within(self.first(*p).len()))
            .min()
            .unwrap_or(0) as usize
    }

    /// Bytes of physical memory this sequence owns alone (not shared blocks), all buffers.
    pub fn exclusive_bytes(&self) -> u64 {
        self.buffers
            .iter()
            .map(|b| b.allocation().granules().committed_bytes())
            .sum()
    }

    /// The buffers: K then V for each layer.
    pub fn buffers(&self) -> &[VirtualBuffer] {
        &self.buffers
    }

    /// Bytes each K and each V buffer must map before `more` tokens can be appended.
    pub fn growth_for(&self, more: usize) -> GrowthSize {
        let part = |p: KvPart| {
            let b = self.first(p);
            mapped_bytes_for(
                self.tokens + more,
                self.shape.rows(p),
                self.chunk,
                b.capacity(),
            )
            .saturating_sub(b.len())
        };
        GrowthSize {
            k: part(KvPart::K),
            v: part(KvPart::V),
            layers: self.shape.layers,
        }
    }

    /// Maps `growth` at the end of every buffer (its K bytes on each K, its V bytes on each
    /// V). If any mapping fails, the ones this call made are unmapped and the sequence is
    /// unchanged.
    pub fn map_growth(&mut self, growth: GrowthSize) -> Result<PendingGrowth, KvError> {
        for p in KvPart::BOTH {
            let b = self.first(p);
            if b.len().saturating_add(growth.of(p)) > b.capacity() {
                return Err(KvError::Full(self.shape.max_tokens));
            }
        }
        let mut tails = Vec::with_capacity(self.buffers.len());
        for i in 0..self.buffers.len() {
            let bytes = growth.of(KvPart::of_buffer(i));
            if bytes == 0 {
                continue;
            }
            match self.buffers[i].map_tail(bytes) {
                Ok(t) => tails.push((i, t)),
                Err(e) => {
                    // Every tail mapped so far is unmapped, even past one that fails to.
                    let mut undo = Ok(());
                    for (done, tail) in tails {
                        if let Err(u) = self.buffers[done].unmap_tail(tail) {
                            undo = undo.and(Err(u));
                        }
                    }
                    undo?;
                    return Err(e.into());
                }
            }
        }
        Ok(PendingGrowth { tails })
    }

    /// Makes a mapped growth visible.
    pub fn publish(&mut self, growth: PendingGrowth) {
        for (b, tail) in growth.tails {
            self.buffers[b].publish(tail);
        }
    }

    /// Unmaps a growth that will not be published (its charge was refused).
    /// Every buffer's tail is unmapped, even past one that fails to (the first failure is
    /// returned; that tail stays mapped beyond the published length).
    pub fn abandon(&mut self, growth: PendingGrowth) -> Result<(), KvError> {
        let mut result = Ok(());
        for (b, tail) in growth.tails {
            if let Err(e) = self.buffers[b].unmap_tail(tail) {
                result = result.and(Err(e.into()));
            }
        }
        result
    }

    /// Maps shared prefix blocks at the start of an empty sequence: `blocks[i * buffers + b]`
    /// is block `i` of buffer `b`, mapped with `access[i]` (every K block of one size, every V
    /// block of one size). The sequence then holds `tokens` tokens (at most what the blocks
    /// cover in K and in V). If any mapping fails, the ones made by this call are undone.
    pub fn attach_prefix(
        &mut self,
        mapping: &dyn SharedMapping,
        blocks: &[PhysicalBlock],
        access: &[MapAccess],
        tokens: usize,
    ) -> Result<(), KvError> {
        let n = self.buffers.len();
        if self.mapped_bytes() != 0 || blocks.is_empty() || blocks.len() != access.len() * n {
            return Err(KvError::BadPrefix);
        }
        // The first K and V blocks set each part's size; every other must match its part's.
        let size = |i: usize| blocks[KvPart::of_buffer(i % n) as usize].bytes();
        if blocks.iter().enumerate().any(|(i, b)| b.bytes() != size(i)) {
            return Err(KvError::BadPrefix);
        }
        let covered = |b: usize| self.rows_of(b).rows_within(access.len() as u64 * size(b));
        if tokens as u64 > covered(0).min(covered(1)) {
            return Err(KvError::BadPrefix);
        }
        for (i, block) in blocks.iter().enumerate() {
            let b = i % n;
            if let Err(e) = self.buffers[b].append_shared(mapping, block, access[i / n]) {
                // Every buffer takes its blocks in turn: undo what each took so far.
                for buffer in &mut self.buffers {
                    let len = buffer.len();
                    if len > 0 {
                        buffer.shrink(len)?;
                    }
                }
                return Err(e.into());
            }
        }
        self.tokens = tokens;
        Ok(())
    }

    fn check_layer<T: KvElement>(&self, layer: usize, k: &[T], v: &[T]) -> Result<(), KvError> {
        if layer >= self.shape.layers {
            return Err(KvError::NoSuchLayer(layer));
        }
        self.check_type::<T>(KvPart::K)?;
        self.check_type::<T>(KvPart::V)?;
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

    fn check_type<T: KvElement>(&self, part: KvPart) -> Result<(), KvError> {
        let kept = self.shape.dtype(part);
        if T::DTYPE == kept {
            Ok(())
        } else {
            Err(KvError::WrongType {
                kept,
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
        self.write_rows(layer, pos, k, v)
    }

    /// Writes whole rows of `layer` from position `pos` on: `k` and `v` hold the same number
    /// of rows, at least one (`kv_heads × head_dim` elements each). Every row must be mapped
    /// and none in a read-only shared block; nothing is written otherwise.
    pub fn write_rows<T: KvElement>(
        &mut self,
        layer: usize,
        pos: usize,
        k: &[T],
        v: &[T],
    ) -> Result<(), KvError> {
        self.check_type::<T>(KvPart::K)?;
        self.check_type::<T>(KvPart::V)?;
        let ranges = self.writable_rows(layer, pos, k.len(), v.len())?;
        for ((b, data), range) in [(2 * layer, k), (2 * layer + 1, v)].into_iter().zip(ranges) {
            let bytes = self.buffers[b].bytes_mut(range)?;
            bytes.copy_from_slice(bytemuck::cast_slice(data));
        }
        Ok(())
    }

    /// [`KvSequence::write_rows`] from `f32` rows, whatever the type KV is kept in: copied,
    /// rounded to `f16`, or quantized to `q8_0` blocks as they are written.
    pub fn write_rows_f32(
        &mut self,
        layer: usize,
        pos: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvError> {
        let ranges = self.writable_rows(layer, pos, k.len(), v.len())?;
        let elems = self.shape.token_elems();
        for ((b, data), range) in [(2 * layer, k), (2 * layer + 1, v)].into_iter().zip(ranges) {
            let (dtype, layout) = (self.shape.dtype(KvPart::of_buffer(b)), self.rows_of(b));
            let start = range.start;
            let bytes = self.buffers[b].bytes_mut(range)?;
            // Row by row: where rows are grouped, a group's spare bytes lie between two rows.
            for (i, row) in data.chunks_exact(elems).enumerate() {
                let at = (layout.offset((pos + i) as u64) - start) as usize;
                narrow_into(dtype, row, &mut bytes[at..][..layout.row_bytes as usize]);
            }
        }
        Ok(())
    }

    /// The byte ranges of `layer`'s K and V buffers that rows of `k_len` and `v_len` values
    /// from `pos` take, once checked: whole rows, mapped, none in a read-only shared block.
    fn writable_rows(
        &self,
        layer: usize,
        pos: usize,
        k_len: usize,
        v_len: usize,
    ) -> Result<[Range<u64>; 2], KvError> {
        if layer >= self.shape.layers {
            return Err(KvError::NoSuchLayer(layer));
        }
        let elems = self.shape.token_elems();
        if k_len == 0 || k_len % elems != 0 || v_len != k_len {
            let rows = (k_len / elems).max(1);
            let got = if v_len != k_len { v_len } else { k_len };
            return Err(KvError::WrongLength {
                expected: rows * elems,
                got,
            });
        }
        let rows = (k_len / elems) as u64;
        let range = |b: usize| {
            let layout = self.rows_of(b);
            layout.offset(pos as u64)..layout.offset((pos as u64).saturating_add(rows))
        };
        let ranges = [range(2 * layer), range(2 * layer + 1)];
        for (b, Range { start, end }) in [2 * layer, 2 * layer + 1].into_iter().zip(ranges.clone())
        {
            if end > self.buffers[b].len() {
                return Err(KvError::NotMapped(pos));
            }
            let read_only = self.buffers[b]
                .allocation()
                .shared_views()
                .find_map(|(o, v)| {
                    let overlaps = o < end && start < o + v.block.bytes();
                    (overlaps && v.access != MapAccess::ReadWrite).then_some(o.max(start))
                });
            if let Some(at) = read_only {
                return Err(KvError::SharedBlock(
                    self.rows_of(b).rows_within(at) as usize
                ));
            }
        }
        Ok(ranges)
    }

    /// Counts one more token, once every layer's K and V for it are written.
    pub fn advance(&mut self) -> Result<(), KvError> {
        self.advance_by(1)
    }

    /// Counts `n` more tokens, once every layer's K and V for them are written; all or none.
    pub fn advance_by(&mut self, n: usize) -> Result<(), KvError> {
        let max = self.shape.max_tokens;
        let Some(end) = self.tokens.checked_add(n).filter(|e| *e <= max) else {
            return Err(KvError::Full(max));
        };
        if end > self.mapped_tokens() {
            return Err(KvError::NotMapped(self.mapped_tokens()));
        }
        self.tokens = end;
        Ok(())
    }

    fn elems<T: KvElement>(&self, buffer: usize, tokens: usize) -> Result<&[T], KvError> {
        self.check_type::<T>(KvPart::of_buffer(buffer))?;
        let len = self.rows_of(buffer).offset(tokens as u64);
        let bytes = self.buffers[buffer].bytes(0..len)?;
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

    /// Layer `layer`'s K and V for the first `tokens` positions as they are kept, whatever the
    /// type: what the attention operators read ([`gqa_causal_rows`](super::gqa_causal_rows)).
    pub fn rows_upto(
        &self,
        layer: usize,
        tokens: usize,
    ) -> Result<(KvRows<'_>, KvRows<'_>), KvError> {
        self.check_upto(layer, tokens)?;
        let side = |b: usize| -> Result<KvRows<'_>, KvError> {
            let (layout, dtype) = (self.rows_of(b), self.shape.dtype(KvPart::of_buffer(b)));
            let len = layout.offset(tokens as u64);
            let bytes = self.buffers[b].bytes(0..len)?;
            // Buffers are page-aligned and hold whole rows: the bytes are always whole values.
            KvRows::from_layout(dtype, bytes, tokens, self.shape.token_elems(), layout).ok_or(
                KvError::WrongLength {
                    expected: len as usize,
                    got: bytes.len(),
                },
            )
        };
        Ok((side(2 * layer)?, side(2 * layer + 1)?))
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
        let len = self.rows_of(buffer).offset(tokens as u64);
        Ok(self.buffers[buffer].bytes(0..len)?)
    }

    /// Copies buffer `buffer`'s first `tokens` rows into `dst` (exactly that many bytes),
    /// wherever it lives (a device-to-host copy on a GPU): what a swap copies out of device
    /// memory. Order it after the kernels that wrote them.
    pub fn read_buffer(&self, buffer: usize, tokens: usize, dst: &mut [u8]) -> Result<(), KvError> {
        if buffer >= self.buffers.len() {
            return Err(KvError::NoSuchLayer(buffer / 2));
        }
        if tokens > self.mapped_tokens() {
            return Err(KvError::NotMapped(tokens.saturating_sub(1)));
        }
        let len = self.rows_of(buffer).offset(tokens as u64);
        if dst.len() as u64 != len {
            return Err(KvError::WrongLength {
                expected: len as usize,
                got: dst.len(),
            });
        }
        Ok(self.buffers[buffer].read_into(0, dst)?)
    }

    /// Writes whole rows from position 0 of buffer `buffer` (a swap's copy coming back),
    /// wherever it lives (a host-to-device copy on a GPU); the rows must be mapped and writable.
    pub fn write_buffer_bytes(&mut self, buffer: usize, bytes: &[u8]) -> Result<(), KvError> {
        self.write_buffer_rows(buffer, 0, bytes)
    }

    /// Writes whole rows from position `from` of buffer `buffer` (a swap's copy coming back
    /// after the shared blocks mapped before it), wherever it lives; the rows must be mapped
    /// and writable (a read-only shared block is refused).
    pub fn write_buffer_rows(
        &mut self,
        buffer: usize,
        from: usize,
        bytes: &[u8],
    ) -> Result<(), KvError> {
        if buffer >= self.buffers.len() {
            return Err(KvError::NoSuchLayer(buffer / 2));
        }
        let layout = self.rows_of(buffer);
        let Some(at) = layout.checked_offset(from as u64) else {
            return Err(KvError::NotMapped(from));
        };
        if layout.rows_in(from as u64, bytes.len() as u64).is_none() {
            // The bytes of the whole rows nearest above what was given.
            let rows = layout.rows_within(at.saturating_add(bytes.len() as u64)) + 1;
            return Err(KvError::WrongLength {
                expected: layout.offset(rows).saturating_sub(at) as usize,
                got: bytes.len(),
            });
        }
        let end = at + bytes.len() as u64;
        let mapped = self.buffers[buffer].len();
        if end > mapped {
            return Err(KvError::NotMapped(layout.rows_within(mapped) as usize));
        }
        Ok(self.buffers[buffer].write_from(at, bytes)?)
    }

    /// Where layer `layer`'s K and V lie for a kernel, `tokens` rows of each (at most what is
    /// mapped): the reservations' own addresses, valid while the sequence keeps its memory.
    pub fn views(&self, layer: usize, tokens: usize) -> Result<LayerViews, KvError> {
        self.check_upto(layer, tokens)?;
        let view = |part: KvPart| {
            let b = &self.buffers[2 * layer + part as usize];
            KvView {
                addr: b.addr(),
                tokens,
                dtype: self.shape.dtype(part),
                token_stride: self.shape.token_bytes(part),
                head_stride: self.shape.head_bytes(part),
                group_rows: self.shape.rows(part).group_rows,
                group_stride: self.shape.rows(part).group_bytes,
                place: b.allocation().place(),
            }
        };
        Ok(LayerViews {
            k: view(KvPart::K),
            v: view(KvPart::V),
        })
    }

    /// Replaces the shared block holding position `pos` (in every buffer) with a private
    /// copy, so it can be written without other sequences seeing the write. Returns the bytes
    /// of private memory this took. Other mappings of the block are untouched.
    pub fn copy_on_write(&mut self, pos: usize) -> Result<u64, KvError> {
        let mut taken = 0;
        for (b, buffer) in self.buffers.iter_mut().enumerate() {
            let start = self.shape.rows(KvPart::of_buffer(b)).offset(pos as u64);
            let view = buffer
                .allocation()
                .shared_views()
                .find(|(o, v)| *o <= start && start < o + v.block.bytes())
                .map(|(o, v)| (o, v.block.bytes()));
            let Some((offset, len)) = view else { continue };
            taken += buffer.privatize(offset..offset + len)?;
        }
        Ok(taken)
    }

    /// Bytes of private memory [`KvSequence::copy_on_write`] at `pos` would take.
    pub fn copy_on_write_bytes(&self, pos: usize) -> u64 {
        self.buffers
            .iter()
            .enumerate()
            .filter_map(|(i, b)| {
                let start = self.rows_of(i).offset(pos as u64);
                b.allocation()
                    .shared_views()
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
