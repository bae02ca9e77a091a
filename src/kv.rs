//! KV cache policy and memory, without actors: geometry, the GQA decode operator, one
//! sequence's virtually contiguous K/V buffers with two-phase growth, the prefix cache's
//! rules, victim choice, the prefix cache's disk tier with the frequency filter in front
//! of it, and the digest of held prefixes a node publishes to routers.

pub mod causal;
pub mod digest;
#[cfg(target_os = "linux")]
pub mod disk_tier;
pub mod elem;
pub mod frequency;
pub mod gqa;
pub mod host_tier;
pub mod prefix;
#[allow(unsafe_code)]
pub mod q8_0;
#[cfg(target_os = "linux")]
pub mod sequence;
pub mod shape;
pub mod table;
pub mod victims;

pub use causal::{gqa_causal, gqa_causal_rows};
pub use digest::{prompt_keys, PrefixDigest};
pub use elem::{KvElement, KvRows, KvView, LayerViews, Q8Rows};
pub use gqa::{gqa_decode, gqa_decode_plain, gqa_decode_rows, SPLIT_TOKENS};
/// The 16-bit float KV may be kept in.
pub use half::f16;
pub use prefix::{chain_hash, BlockState, Incarnation, Lookup, PrefixCache};
#[cfg(target_os = "linux")]
pub use sequence::{GrowthSize, KvError, KvSequence, PendingGrowth};
pub use shape::{Heads, KvDtype, KvPart, KvShape, RowLayout, ShapeError, ROW_GROUP_BYTES};
pub use table::{
    first_duplicate, Lent, Phase, PreemptMode, SeqData, SeqId, SeqState, Sequence, SequenceTable,
    TableError,
};
pub use victims::{choose_victims, PrefixCandidate, SequenceCandidate, Victim};
