//! KV cache policy and memory, without actors: geometry, the GQA decode operator, one
//! sequence's virtually contiguous K/V buffers with two-phase growth, the prefix cache's
//! rules, victim choice, the prefix cache's disk tier with the frequency filter in front
//! of it, and the digest of held prefixes a node publishes to routers.
//!
//! Every name has one path: the policy's types and functions are here, at `kv::`; three
//! modules stay namespaces of their own, their items not repeated here: [`disk_tier`] (the
//! prefix cache's files), [`frequency`] (the filter in front of the disk) and [`q8_0`] (the
//! 8-bit codec).

mod causal;
mod digest;
#[cfg(target_os = "linux")]
pub mod disk_tier;
mod elem;
pub mod frequency;
mod gqa;
mod host_tier;
mod prefix;
#[allow(unsafe_code)]
pub mod q8_0;
#[cfg(target_os = "linux")]
mod sequence;
mod shape;
mod table;
mod victims;

pub use causal::{gqa_causal, gqa_causal_rows, ROW_BLOCK};
pub use digest::{prompt_keys, PrefixDigest};
pub use elem::{narrow_into, KvElement, KvRows, KvView, LayerViews, Q8Rows};
pub use gqa::{gqa_decode, gqa_decode_plain, gqa_decode_rows, SPLIT_TOKENS};
/// The 16-bit float KV may be kept in.
pub use half::f16;
pub use host_tier::HostTierIndex;
pub use prefix::{chain_hash, BlockState, Incarnation, Lookup, PrefixCache};
#[cfg(target_os = "linux")]
pub use sequence::{GrowthSize, KvError, KvSequence, PendingGrowth};
pub use shape::{
    mapped_bytes_for, Heads, KvDtype, KvPart, KvShape, RowLayout, ShapeError, MAX_BLOCK_GRANULES,
    MIN_GROUPED_BLOCK_TOKENS, ROW_GROUP_BYTES,
};
pub use table::{
    first_duplicate, Filling, Lent, PreemptMode, RestoreStart, SeqData, SeqId, SeqState, Sequence,
    SequenceTable, TableError, Writer,
};
pub use victims::{choose_victims, PrefixCandidate, SequenceCandidate, Victim};
