//! A step as the server drives it: the prepared sequences' memory, lent to the server until
//! the step ends, with a view of every layer's flat K and V and the stream to run on.
//!
//! While a step is out its sequences' memory (and what pays for it) is *in the step*, not in
//! the store: no victim choice, close or restore can touch it. Kernels submitted through
//! [`KvStep::submit`] share it, so it cannot be freed before the last of them ran. When the
//! step ends ([`KvStep::complete`], [`KvStep::abandon`] or a drop) the store records a fence of
//! its own on the step's stream after everything submitted, and takes the memory back once
//! that fence completes; a sequence closed meanwhile is freed then.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use procmem::fence::{Fence, TimelineFence};
use procmem::kv::{
    gqa_decode_rows, GrowthSize, Incarnation, KvElement, KvError, KvRows, KvSequence, KvShape,
    LayerViews, PendingGrowth, TableError,
};
use ractor::{ActorRef, MessagingErr, RpcReplyPort};

use super::device::KvStream;
use super::prefix::Mapped;
use super::{AttendItem, KvStoreError, KvStoreMsg, SeqId};
use crate::charge::Charge;
use crate::governor::Lease;
use crate::stream::StreamError;

/// Room asked for a step: `count` new tokens of `seq` (a prompt's chunk, or one token of
/// decode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NewTokens {
    /// The sequence.
    pub seq: SeqId,
    /// How many tokens it gains.
    pub count: usize,
}

/// One sequence's memory while a step has it.
pub(super) struct StepSeq {
    pub(super) seq: SeqId,
    pub(super) writer: Incarnation,
    /// New tokens the step makes room for.
    pub(super) count: usize,
    /// Dropped first: unmapped before the blocks it maps and before its charge goes back.
    pub(super) memory: KvSequence,
    pub(super) prefixes: Vec<Mapped>,
    pub(super) charge: Charge,
    /// Growth for the token after this step's, mapped while the step runs (paid for by
    /// `charge`); published at the next prepare.
    pub(super) ahead: Option<PendingGrowth>,
}

/// The memory of a step's sequences, shared by the step and every kernel it submitted.
/// However its last share goes (the store takes it back, or a message carrying it is dropped
/// with a stopped store), memory still in it is freed only after everything queued on the
/// step's stream so far has run: a server's kernels may use it through the views.
pub(crate) struct StepMemory {
    seqs: Mutex<Vec<StepSeq>>,
    stream: KvStream,
}

impl StepMemory {
    pub(super) fn new(seqs: Vec<StepSeq>, stream: KvStream) -> Arc<Self> {
        Arc::new(StepMemory {
            seqs: Mutex::new(seqs),
            stream,
        })
    }

    /// A kernel that panicked holding the lock left the memory as it was (writes are whole
    /// rows), so a poisoned lock is still used.
    fn lock(&self) -> MutexGuard<'_, Vec<StepSeq>> {
        self.seqs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Maps `per` (bytes per K and per V buffer) at the end of sequence `seq` (this incarnation) for the token
    /// after the step's, paid for by `lease`, unless that was done already or the sequence's
    /// growth changed meanwhile (then the lease goes back). Blocks while a host kernel holds
    /// the memory.
    pub(super) fn map_ahead(
        &self,
        seq: SeqId,
        writer: Incarnation,
        per: GrowthSize,
        lease: Lease,
        latency: &::metrics::Histogram,
    ) {
        let mut seqs = self.lock();
        let Some(s) = seqs.iter_mut().find(|s| s.seq == seq && s.writer == writer) else {
            return;
        };
        if s.ahead.is_some() || s.memory.growth_for(s.count + 1) != per {
            return;
        }
        // The lease was committed before this maps: the books never trail the memory.
        match super::metrics::timed(latency, || s.memory.map_growth(per)) {
            Ok(growth) => {
                s.charge.add(lease);
                s.ahead = Some(growth);
            }
            Err(e) => tracing::debug!(%e, seq, "mapping ahead failed; the next prepare maps"),
        }
    }

    /// The sequences back, once no kernel holds the memory any more.
    pub(super) fn take(self: Arc<Self>) -> Result<Vec<StepSeq>, Arc<Self>> {
        Arc::try_unwrap(self).map(|m| std::mem::take(&mut *m.lock()))
    }
}

impl Drop for StepMemory {
    fn drop(&mut self) {
        let seqs = std::mem::take(&mut *self.lock());
        if !seqs.is_empty() {
            // Memory, then what paid for it, once everything queued on the stream so far has
            // run (on a stream that takes no more work, once the last value it issued
            // completes; one that failed never does, and the memory is kept).
            self.stream.after_queued(move || drop(seqs));
        }
    }
}

/// The memory of a step, as a host kernel sees it: sequence `i` is the step's `i`-th, its
/// [`StepKv::count`] new rows start at [`StepKv::position`], and reads cover every row up to
/// and including the step's last. A causal kernel over a chunk reads, for its new row `j`,
/// the first `position + j + 1` rows of [`StepKv::keys`] and [`StepKv::values`].
pub struct StepKv<'a> {
    seqs: &'a mut [StepSeq],
}

impl StepKv<'_> {
    /// Sequences in the step.
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// True for a step of no sequence.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    fn get(&self, i: usize) -> Result<&StepSeq, KvError> {
        self.seqs.get(i).ok_or(KvError::BadIndex(i))
    }

    /// The id of sequence `i`.
    pub fn seq(&self, i: usize) -> Option<SeqId> {
        self.seqs.get(i).map(|s| s.seq)
    }

    /// Where sequence `i`'s first new row goes (the tokens it held before the step).
    pub fn position(&self, i: usize) -> Option<usize> {
        self.seqs.get(i).map(|s| s.memory.tokens())
    }

    /// How many new rows sequence `i` has in the step.
    pub fn count(&self, i: usize) -> Option<usize> {
        self.seqs.get(i).map(|s| s.count)
    }

    /// Writes the first new row's K and V of layer `layer` of sequence `i` (`kv_heads ×
    /// head_dim` elements each, of the shape's element type): the decode case of
    /// [`StepKv::write_rows`].
    pub fn write<T: KvElement>(
        &mut self,
        i: usize,
        layer: usize,
        k: &[T],
        v: &[T],
    ) -> Result<(), KvError> {
        self.write_rows(i, layer, 0, k, v)
    }

    /// Writes whole rows of layer `layer` of sequence `i` from its new row `first` on: `k` and
    /// `v` hold the same number of rows (`kv_heads × head_dim` elements each), and `first`
    /// plus that number is at most the sequence's [`StepKv::count`] (rows of the step only).
    pub fn write_rows<T: KvElement>(
        &mut self,
        i: usize,
        layer: usize,
        first: usize,
        k: &[T],
        v: &[T],
    ) -> Result<(), KvError> {
        let (memory, pos) = self.new_rows(i, first, k.len())?;
        memory.write_rows(layer, pos, k, v)
    }

    /// [`StepKv::write_rows`] from `f32` rows, whatever the type KV is kept in (rounded to
    /// `f16`, or quantized to `q8_0` blocks, as they are written).
    pub fn write_rows_f32(
        &mut self,
        i: usize,
        layer: usize,
        first: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvError> {
        let (memory, pos) = self.new_rows(i, first, k.len())?;
        memory.write_rows_f32(layer, pos, k, v)
    }

    /// Sequence `i`'s memory and the position of its new row `first`, once rows of `values`
    /// values from there are checked to be rows of the step only.
    fn new_rows(
        &mut self,
        i: usize,
        first: usize,
        values: usize,
    ) -> Result<(&mut KvSequence, usize), KvError> {
        let s = self.seqs.get_mut(i).ok_or(KvError::BadIndex(i))?;
        let rows = values / s.memory.token_elems().max(1);
        if first.checked_add(rows).is_none_or(|end| end > s.count) {
            return Err(KvError::NotMapped(s.memory.tokens().saturating_add(first)));
        }
        let pos = s.memory.tokens() + first;
        Ok((&mut s.memory, pos))
    }

    /// Layer `layer`'s K and V of sequence `i` as they are kept, whatever the type, the
    /// step's new rows included: what [`gqa_causal_rows`](procmem::kv::gqa_causal_rows) reads.
    pub fn rows(&self, i: usize, layer: usize) -> Result<(KvRows<'_>, KvRows<'_>), KvError> {
        let s = self.get(i)?;
        s.memory.rows_upto(layer, s.memory.tokens() + s.count)
    }

    /// Layer `layer`'s keys of sequence `i`, the step's new rows included.
    pub fn keys<T: KvElement>(&self, i: usize, layer: usize) -> Result<&[T], KvError> {
        let s = self.get(i)?;
        s.memory.keys_upto(layer, s.memory.tokens() + s.count)
    }

    /// Layer `layer`'s values of sequence `i`, the step's new rows included.
    pub fn values<T: KvElement>(&self, i: usize, layer: usize) -> Result<&[T], KvError> {
        let s = self.get(i)?;
        s.memory.values_upto(layer, s.memory.tokens() + s.count)
    }
}

/// What covers the kernels that wrote a step's rows, for [`KvStep::complete`]: the memory
/// comes back, and the rows count, only after it.
#[derive(Debug, Clone)]
pub enum StepEnd {
    /// The kernels submitted through the step ([`KvStep::submit`] and its kin): the host
    /// path.
    Submitted,
    /// A fence of the step's own stream, recorded after kernels queued on it outside
    /// `submit` (a CUDA server's launches).
    Fence(Fence),
    /// A fence of another stream (another provider's, a copy engine's) with its timeline,
    /// besides everything queued on the step's own stream. The same holds if the call is
    /// given up (dropped) while it waits.
    After(TimelineFence),
}

impl From<Fence> for StepEnd {
    fn from(fence: Fence) -> Self {
        StepEnd::Fence(fence)
    }
}

impl From<TimelineFence> for StepEnd {
    fn from(fence: TimelineFence) -> Self {
        StepEnd::After(fence)
    }
}

/// One step of a batch of sequences, lent by [`KvStoreHandle::prepare_tokens`] (or
/// [`KvStoreHandle::prepare`], one token each): room for each sequence's new tokens is mapped
/// and paid for, and until the step ends none of them can be taken by pressure.
///
/// For each sequence and layer, [`KvStep::views`] says where its flat K and V lie (address,
/// rows, element type, strides) for the server's own kernels, valid until the step's fence.
/// Host kernels run on [`KvStep::stream`] through [`KvStep::submit`], which hands them the
/// memory as typed slices ([`StepKv`]). A step ends one of two ways: [`KvStep::complete`]
/// once every layer's K/V is written (the new tokens count), or [`KvStep::abandon`] (or a
/// drop: nothing counts; its memory is still held until every kernel it submitted ran).
///
/// [`KvStoreHandle::prepare`]: super::KvStoreHandle::prepare
/// [`KvStoreHandle::prepare_tokens`]: super::KvStoreHandle::prepare_tokens
pub struct KvStep {
    id: u64,
    store: ActorRef<KvStoreMsg>,
    shape: KvShape,
    seqs: Vec<SeqId>,
    positions: Vec<usize>,
    counts: Vec<usize>,
    /// `[sequence][layer]`.
    views: Vec<Vec<LayerViews>>,
    memory: Option<Arc<StepMemory>>,
    stream: KvStream,
    last_fence: Mutex<Option<Fence>>,
    /// A fence of another stream the step's end waits for ([`StepEnd::After`]).
    after: Option<TimelineFence>,
}

impl std::fmt::Debug for KvStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvStep")
            .field("id", &self.id)
            .field("seqs", &self.seqs)
            .field("positions", &self.positions)
            .field("stream", &self.stream.id())
            .finish()
    }
}

impl KvStep {
    pub(super) fn new(
        id: u64,
        store: ActorRef<KvStoreMsg>,
        shape: KvShape,
        seqs: Vec<StepSeq>,
        views: Vec<Vec<LayerViews>>,
        stream: KvStream,
    ) -> Self {
        KvStep {
            id,
            store,
            shape,
            positions: seqs.iter().map(|s| s.memory.tokens()).collect(),
            counts: seqs.iter().map(|s| s.count).collect(),
            seqs: seqs.iter().map(|s| s.seq).collect(),
            views,
            memory: Some(StepMemory::new(seqs, stream.clone())),
            stream,
            last_fence: Mutex::new(None),
            after: None,
        }
    }

    /// The sequences, in the order they were prepared.
    pub fn seqs(&self) -> &[SeqId] {
        &self.seqs
    }

    /// Where each sequence's first new row goes (its tokens before the step).
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// How many new rows each sequence has in the step (1 for a decode token).
    pub fn counts(&self) -> &[usize] {
        &self.counts
    }

    /// The model's KV geometry (element type included).
    pub fn shape(&self) -> &KvShape {
        &self.shape
    }

    /// Where layer `layer` of the `i`-th sequence lies: `position + count` rows of K and of
    /// V, the new rows last. Valid until the step's fence; `None` past the batch or the model.
    pub fn views(&self, i: usize, layer: usize) -> Option<LayerViews> {
        self.views.get(i)?.get(layer).copied()
    }

    /// The stream the step's kernels run on; the step's fence must be one of its fences. On
    /// the host it is a CPU stream ([`KvStep::submit`] runs closures on it); on a GPU a CUDA
    /// stream the server launches its own kernels on, over the views' device addresses.
    pub fn stream(&self) -> &KvStream {
        &self.stream
    }

    /// The fence of the last kernel submitted through [`KvStep::submit`].
    pub fn last_fence(&self) -> Option<Fence> {
        *self
            .last_fence
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn memory(&self) -> &Arc<StepMemory> {
        self.memory.as_ref().expect("a live step has its memory")
    }

    /// The step's memory, without keeping it from coming back to the store.
    pub(super) fn memory_weak(&self) -> std::sync::Weak<StepMemory> {
        Arc::downgrade(self.memory())
    }

    /// Runs `kernel` on the step's stream, after the work submitted before it, with the step's
    /// memory as typed slices. Returns its fence. Host KV only: on a GPU this is
    /// `StreamError::NotHost` (launch kernels on [`KvStep::stream`] instead).
    pub fn submit<F>(&self, kernel: F) -> Result<Fence, StreamError>
    where
        F: FnOnce(&mut StepKv<'_>) + Send + 'static,
    {
        let memory = Arc::clone(self.memory());
        let fence = self.stream.submit_host(move || {
            let mut seqs = memory.lock();
            kernel(&mut StepKv { seqs: &mut seqs });
        })?;
        *self
            .last_fence
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(fence);
        Ok(fence)
    }

    /// The built-in operator as one user of the step: writes each item's K/V for `layer`
    /// (converted to the shape's element type) and runs the GQA decode over every token on
    /// the stream. Items name sequences of the step, each at most once.
    pub async fn attend(
        &self,
        layer: usize,
        items: Vec<AttendItem>,
    ) -> Result<Vec<Vec<f32>>, KvStoreError> {
        let shape = self.shape;
        if layer >= shape.layers {
            return Err(KvError::NoSuchLayer(layer).into());
        }
        let mut index = Vec::with_capacity(items.len());
        for item in &items {
            let i = self
                .seqs
                .iter()
                .position(|s| *s == item.seq)
                .ok_or(KvStoreError::Table(TableError::NotInStep(item.seq)))?;
            if index.contains(&i) {
                return Err(KvStoreError::Table(TableError::Duplicate(item.seq)));
            }
            index.push(i);
            let q = shape.q_heads * shape.head_dim;
            for (expected, got) in [
                (q, item.q.len()),
                (shape.token_elems(), item.k.len()),
                (shape.token_elems(), item.v.len()),
            ] {
                if expected != got {
                    return Err(KvError::WrongLength { expected, got }.into());
                }
            }
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(move |kv| {
            let _ = tx.send(attend_all(kv, shape, layer, &index, &items));
        })?;
        rx.await
            .map_err(|_| KvStoreError::KernelFailed)?
            .map_err(KvStoreError::from)
    }

    /// Ends the step: every sequence holds its new tokens, written by the kernels that `end`
    /// covers ([`StepEnd`]: those submitted through the step, a fence of the step's stream, or
    /// a fence of any other stream besides). Returns once the store has the memory back
    /// (after that fence, and after every kernel submitted through the step). A
    /// [`StepEnd::Fence`] of another stream is refused (`ForeignFence`) and the step ends as
    /// if abandoned: the store cannot see that stream, so work there must be covered with
    /// [`StepEnd::After`]. The other way a step ends is [`KvStep::abandon`] (or a drop).
    pub async fn complete(mut self, end: impl Into<StepEnd>) -> Result<(), KvStoreError> {
        let fence = match end.into() {
            StepEnd::Submitted => self.last_fence(),
            StepEnd::Fence(fence) => Some(fence),
            StepEnd::After(after) => {
                self.after = Some(after);
                self.last_fence()
            }
        };
        self.end(fence, true).await
    }

    /// Ends the step without its tokens counting (what a drop does): the memory goes back
    /// after every kernel submitted through the step, and no sequence grows.
    pub fn abandon(self) {
        drop(self);
    }

    async fn end(&mut self, fence: Option<Fence>, advance: bool) -> Result<(), KvStoreError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let port: RpcReplyPort<Result<(), KvStoreError>> = tx.into();
        self.send_end(fence, advance, Some(port));
        rx.await.unwrap_or(Err(KvStoreError::Unavailable))
    }

    fn send_end(
        &mut self,
        fence: Option<Fence>,
        advance: bool,
        reply: Option<RpcReplyPort<Result<(), KvStoreError>>>,
    ) {
        let Some(memory) = self.memory.take() else {
            return;
        };
        let (store, step) = (self.store.clone(), self.id);
        let send = move || {
            let msg = KvStoreMsg::StepEnded {
                step,
                memory,
                fence,
                advance,
                reply,
            };
            if let Err(MessagingErr::SendErr(KvStoreMsg::StepEnded { memory, reply, .. })) =
                store.cast(msg)
            {
                // The store is gone: the memory is freed after everything queued on the
                // stream (the last share to go sees to it), then what paid for it goes back.
                drop(memory);
                if let Some(reply) = reply {
                    let _ = reply.send(Err(KvStoreError::Unavailable));
                }
            }
        };
        match self.after.take().filter(|a| !a.is_complete()) {
            // The store hears of the end only once the other stream's work is done.
            Some(after) => after.on_complete(Box::new(move |_| send())),
            None => send(),
        }
    }
}

impl Drop for KvStep {
    fn drop(&mut self) {
        // Not completed: nothing counts, and the memory goes back after the kernels it served.
        self.send_end(None, false, None);
    }
}

fn attend_all(
    kv: &mut StepKv<'_>,
    shape: KvShape,
    layer: usize,
    index: &[usize],
    items: &[AttendItem],
) -> Result<Vec<Vec<f32>>, KvError> {
    let mut outputs = Vec::with_capacity(items.len());
    for (&i, item) in index.iter().zip(items) {
        kv.write_rows_f32(i, layer, 0, &item.k, &item.v)?;
        let (k, v) = kv.rows(i, layer)?;
        let tokens = k.len() / shape.token_elems();
        let mut out = vec![0f32; item.q.len()];
        gqa_decode_rows(&item.q, k, v, tokens, shape.heads(), &mut out);
        outputs.push(out);
    }
    Ok(outputs)
}
