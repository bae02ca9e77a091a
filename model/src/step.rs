//! One step of a batch, as the scheduler runs it and a model computes it: the scheduler
//! prepares the step's KV ([`prepare`]), hands the model the step and its inputs
//! ([`StepModel::step`]), and completes the step with the end the model returns
//! ([`StepOutput::end`]). A model never prepares or completes a step itself; a caller that
//! steps a model without a scheduler does the same three things ([`run`]).

use std::future::Future;
use std::pin::Pin;

use procmem_actors::kv::{KvStep, KvStoreHandle, NewTokens, SeqId, StepEnd};

use crate::error::ModelError;

/// One sequence's part of a step: `tokens` (at least one) written from `position` on. A
/// prompt's chunk has many; a decode step one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepInput {
    /// The sequence.
    pub seq: SeqId,
    /// Its new tokens.
    pub tokens: Vec<u32>,
    /// Where the first goes: the tokens the store holds for it.
    pub position: usize,
}

impl StepInput {
    /// A decode step's part: one `token` of `seq` at `position`.
    pub fn decode(seq: SeqId, token: u32, position: usize) -> Self {
        StepInput {
            seq,
            tokens: vec![token],
            position,
        }
    }
}

/// What a model's step computed: the logits of each input's last token (in the inputs'
/// order, or of every new token where asked), and what covers the kernels that wrote the
/// step's KV rows, for [`KvStep::complete`].
#[derive(Debug)]
pub struct StepOutput {
    /// Logits, one row per input (or per new token).
    pub logits: Vec<Vec<f32>>,
    /// The end of the step's writes.
    pub end: StepEnd,
}

/// A model's step, on its way.
pub type StepFuture<'a> = Pin<Box<dyn Future<Output = Result<StepOutput, ModelError>> + Send + 'a>>;

/// What a model does once a step of its ended, on its way.
pub type AfterFuture<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// A model the scheduler steps: each input's new tokens through the model over a step the
/// scheduler prepared, returning the logits of each input's last token (in the inputs'
/// order) and the end of its writes.
pub trait StepModel: Send + Sync + 'static {
    /// The KV store the model's sequences live in.
    fn kv(&self) -> &KvStoreHandle;

    /// One step of `batch` over `step` (prepared for `batch`, in its order).
    fn step<'a>(&'a self, step: &'a KvStep, batch: &'a [StepInput]) -> StepFuture<'a>;

    /// Called once a step that went through is complete (its memory back in the store): what
    /// the model reads after each step (the synthetic job samples the books). Nothing by
    /// default.
    fn after_step(&self) -> AfterFuture<'_> {
        Box::pin(async {})
    }
}

/// Room for `batch`'s new tokens in one grant, checked against where the store holds each
/// sequence: a token written at another row than its position says would be rotated for one
/// place and stored at another ([`ModelError::Position`]; the step is dropped, counting
/// nothing).
pub async fn prepare(kv: &KvStoreHandle, batch: &[StepInput]) -> Result<KvStep, ModelError> {
    let step = kv
        .prepare_tokens(
            batch
                .iter()
                .map(|b| NewTokens {
                    seq: b.seq,
                    count: b.tokens.len(),
                })
                .collect(),
        )
        .await
        .map_err(ModelError::Prepare)?;
    for (b, &held) in batch.iter().zip(step.positions()) {
        if held != b.position {
            return Err(ModelError::Position {
                seq: b.seq,
                held,
                asked: b.position,
            });
        }
    }
    Ok(step)
}

/// A whole step of `batch` through `model`: [`prepare`], [`StepModel::step`], then
/// [`KvStep::complete`] with the model's end, and [`StepModel::after_step`]. A step that fails is dropped (its tokens do not
/// count); so is one whose caller gives up before the store has it back.
pub async fn run<M: StepModel + ?Sized>(
    model: &M,
    batch: &[StepInput],
) -> Result<Vec<Vec<f32>>, ModelError> {
    let step = prepare(model.kv(), batch).await?;
    let out = model.step(&step, batch).await?;
    step.complete(out.end).await.map_err(ModelError::Store)?;
    model.after_step().await;
    Ok(out.logits)
}
