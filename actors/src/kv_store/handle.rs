//! The handle a server holds: open, prepare, restore and close sequences, and read the
//! store's figures. Every call is a message to the store's actor.

use std::sync::Arc;

use procmem::kv::PrefixDigest;
use ractor::RpcReplyPort;

use super::{
    answer, KvStep, KvStore, KvStoreArgs, KvStoreConfig, KvStoreError, KvStoreMsg, KvStoreStats,
    NewTokens, Opened, Provider, Restored, SeqId,
};
use crate::governor::GovernorHandle;
use crate::mailbox::HolderRef;
use procmem::ledger::Priority;

/// A cheap, cloneable handle to a KV store.
#[derive(Debug, Clone)]
pub struct KvStoreHandle {
    holder: HolderRef<KvStoreMsg>,
    digest: tokio::sync::watch::Receiver<Arc<PrefixDigest>>,
}

impl KvStoreHandle {
    /// Starts a store registered as a holder with `governor`, backed by `provider` (the
    /// host's [`CpuProvider`](crate::provider::CpuProvider) or a [`CudaProvider`](crate::provider::CudaProvider)).
    /// A store that cannot start says why (a bad shape is `KvStoreError::Kv`).
    pub async fn spawn(
        config: KvStoreConfig,
        governor: GovernorHandle,
        provider: impl Into<Provider>,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), KvStoreError> {
        Self::start(config, governor, provider.into(), None).await
    }

    /// The same, supervised by `supervisor` (its failure is reported there, not fatal).
    pub async fn spawn_supervised(
        config: KvStoreConfig,
        governor: GovernorHandle,
        provider: impl Into<Provider>,
        supervisor: ractor::ActorCell,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), KvStoreError> {
        Self::start(config, governor, provider.into(), Some(supervisor)).await
    }

    async fn start(
        config: KvStoreConfig,
        governor: GovernorHandle,
        provider: Provider,
        supervisor: Option<ractor::ActorCell>,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), KvStoreError> {
        // The store puts an empty digest of its block size in as it starts.
        let (digest, digests) = tokio::sync::watch::channel(Arc::new(PrefixDigest::new(1)));
        let args = KvStoreArgs {
            config,
            governor,
            provider,
            digest,
        };
        let (holder, join) =
            HolderRef::spawn(KvStore, args, supervisor, KvStoreError::Start).await?;
        let handle = KvStoreHandle {
            holder,
            digest: digests,
        };
        Ok((handle, join))
    }

    /// The store's actor, to supervise, stop or kill it (it takes no message from outside).
    pub fn actor(&self) -> ractor::ActorCell {
        self.holder.cell()
    }

    /// Makes the store's actor panic at its next message (tests of supervision).
    #[cfg(feature = "fault-injection")]
    pub fn crash(&self) {
        self.holder.cast(KvStoreMsg::Crash);
    }

    async fn ask<T: Send + 'static>(
        &self,
        build: impl FnOnce(RpcReplyPort<Result<T, KvStoreError>>) -> KvStoreMsg,
    ) -> Result<T, KvStoreError> {
        self.holder.ask(build, KvStoreError::Unavailable).await
    }

    /// Opens a sequence for `prompt`; cached whole prompt blocks are mapped shared.
    pub async fn open(
        &self,
        seq: SeqId,
        prompt: Vec<u32>,
        priority: Priority,
    ) -> Result<Opened, KvStoreError> {
        let waiting = self.waiting(answer::Left::Open(seq));
        let answer = self.ask(|reply| KvStoreMsg::Open {
            seq,
            prompt,
            priority,
            reply,
        });
        let answer = answer.await;
        waiting.answered();
        answer.map(answer::OpenAnswer::take)
    }

    fn waiting(&self, call: answer::Left) -> answer::Waiting {
        answer::Waiting::new(self.holder.clone(), call)
    }

    /// Makes room for one more token in each sequence, under one grant, and lends them to
    /// the caller as a step (see [`KvStep`]): the decode case of
    /// [`KvStoreHandle::prepare_tokens`]. Refused as a whole, changing nothing.
    pub async fn prepare(&self, seqs: Vec<SeqId>) -> Result<KvStep, KvStoreError> {
        self.prepare_tokens(
            seqs.into_iter()
                .map(|seq| NewTokens { seq, count: 1 })
                .collect(),
        )
        .await
    }

    /// Makes room for [`NewTokens::count`] more tokens in each sequence (a prompt's chunk,
    /// or one token of decode), all under one grant, and lends them to the caller as a step: the
    /// sequence's new rows start at its [`KvStep::positions`] entry and number its
    /// [`KvStep::counts`] entry. Refused as a whole, changing nothing: a count of 0
    /// ([`KvStoreError::NoTokens`]), one past the shape's `max_tokens` (`Full`), a sequence
    /// named twice (`Duplicate`).
    pub async fn prepare_tokens(&self, seqs: Vec<NewTokens>) -> Result<KvStep, KvStoreError> {
        let waiting = seqs
            .first()
            .map(|r| self.waiting(answer::Left::Step(r.seq)));
        let step = self.ask(|reply| KvStoreMsg::Prepare { seqs, reply }).await;
        waiting.into_iter().for_each(answer::Waiting::answered);
        step
    }

    /// Brings a preempted sequence back.
    pub async fn restore(&self, seq: SeqId) -> Result<Restored, KvStoreError> {
        let waiting = self.waiting(answer::Left::Restore(seq));
        let restored = self.ask(|reply| KvStoreMsg::Restore { seq, reply }).await;
        waiting.answered();
        restored
    }

    /// Closes a sequence.
    pub fn close(&self, seq: SeqId) {
        self.holder.cast(KvStoreMsg::Close {
            seq,
            tokens: Vec::new(),
        });
    }

    /// Closes a sequence and leaves its whole blocks to the prefix cache: `tokens` are the
    /// ids whose K/V its rows hold, prompt then what was generated (those past its rows are
    /// ignored), so that a later prompt starting the same way (a chat's next turn, which
    /// sends the last answer back) maps them instead of computing them. The blocks are
    /// copied out of the sequence's own memory and paid for by its charge: nothing is asked
    /// of the Governor. Only on the host; on a GPU, in a step, or preempted, it closes as
    /// [`close`](Self::close) does. The tokens are trusted past the blocks the sequence
    /// maps, as its rows are.
    pub fn close_keeping(&self, seq: SeqId, tokens: Vec<u32>) {
        self.holder.cast(KvStoreMsg::Close { seq, tokens });
    }

    /// The keys of the whole prompt blocks the store holds, in memory and on its disk tier, as
    /// last published (at most 100 ms old while the store is busy): what a process reports to
    /// its node for routers (`node::LinkConfig::prefixes`, with the `cluster` feature). No
    /// message to the store.
    pub fn prefix_digest(&self) -> Arc<PrefixDigest> {
        Arc::clone(&self.digest.borrow())
    }

    /// Evicts cached prompt blocks nobody maps that were used at most `worth` times (the least
    /// used first, the least recent among equals) until `bytes` are freed; the bytes freed
    /// (some after their copy to the tier below). Blocks used more often stay, whatever is
    /// wanted: it is what a process gives another's burst (see `node::LinkConfig::shed`, with
    /// the `cluster` feature).
    pub async fn shed_cold(&self, bytes: u64, worth: u32) -> Result<u64, KvStoreError> {
        self.ask(|reply| KvStoreMsg::ShedCold {
            bytes,
            worth,
            reply,
        })
        .await
    }

    /// What the store holds now and what it did so far (see [`KvStoreStats`]).
    pub async fn stats(&self) -> Result<KvStoreStats, KvStoreError> {
        self.ask(|reply| KvStoreMsg::Stats { reply }).await
    }
}
