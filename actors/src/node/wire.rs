//! What crosses the cluster between a process and its node Governor, and how it is checked.
//!
//! `ractor_cluster` carries each message as a variant name and a byte payload inside its own
//! authenticated, length-checked frames. The payload is ours: `postcard` (a kept serde
//! format whose decoder returns errors, never panics) of the types below. Every payload is
//! decoded defensively (a frame that does not decode becomes a [`WireError`] the receiving
//! actor counts and drops) and then validated ([`NodeRequest::validate`]) before it can touch
//! the books. ractor's own `BytesConvertable` decoders index slices and may panic on a short
//! payload, so none of them is used here.

use procmem::kv::{prompt_keys, PrefixDigest};
use ractor::message::{BoxedDowncastErr, SerializedMessage};
use ractor::RpcReplyPort;
use serde::{Deserialize, Serialize};

/// The largest payload either side accepts (the cluster's frames are capped as well): room
/// for a summary with [`MAX_DIGESTS`] prefix digests.
pub const MAX_PAYLOAD: usize = 32 * 1024;
/// The most prefix digests a node's summary carries (one per model and block size; models
/// past these are summarised without one).
pub const MAX_DIGESTS: usize = 12;
/// The longest name a process or an authority may have.
pub const MAX_NAME: usize = 128;

/// The reason of a refused ask when no other process holds anything it could give: the asker's
/// own holders make the room (its link tells its Governor so).
pub const NOBODY_CAN_GIVE: &str = "no room: no other process can give";

/// The most hits a cached prompt block may have and still be given to another process's
/// burst by a process at or under its guarantee: blocks used once at most since they were
/// cached. A system prompt every conversation uses has more, and stays.
pub const COLD_HITS: u32 = 1;

/// A process's request to its node Governor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeRequest {
    /// Joins (or rejoins) the node for one authority; `held` is the credit the process holds
    /// from before (after a reconnect or a node restart), zero on a first join.
    Join {
        /// The process's token: random, fixed for its life (an identity, not a secret).
        token: u64,
        /// The key the node issued at this process's first join (zero then): a rejoin of a
        /// process the node still knows must present it.
        key: u64,
        /// Its operating-system process id (the node watches it to know when it is gone).
        pid: u32,
        /// Its name.
        name: String,
        /// How much it matters: less important processes are asked to give back first.
        priority: u32,
        /// The authority's name on the node ("host", "cuda:0").
        authority: String,
        /// Credit it holds already.
        held: u64,
        /// The share of the authority it is guaranteed.
        share: Share,
    },
    /// Asks for `bytes` more credit (a chunk), or at least `at_least` (what its waiters need),
    /// waiting for room up to `wait_ms`.
    Ask {
        /// The process.
        token: u64,
        /// Its key (see [`NodeReply::Joined`]).
        key: u64,
        /// The authority.
        authority: String,
        /// Bytes wanted.
        bytes: u64,
        /// Bytes needed (at most `bytes`).
        at_least: u64,
        /// How long it may wait, in milliseconds.
        wait_ms: u64,
    },
    /// The books of the node (for operators and tests).
    Status,
}

/// The most a process's weight may be: a share of one in a million is as small as a share
/// gets, and sums of weights stay far from overflow.
pub const MAX_WEIGHT: u32 = 1_000_000;

/// The share of an authority a process is guaranteed: what it gets back, within one ticket
/// round, from processes over theirs (their unused credit and cache first, then their running
/// sequences), however long their conversations last. Above the guarantees the node lends
/// what is idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Share {
    /// Its weight among the processes without a set guarantee: they divide what the set
    /// guarantees leave of the capacity in proportion to their weights (1 to [`MAX_WEIGHT`]).
    pub weight: u32,
    /// A guarantee in bytes instead of a share by weight. Set guarantees that together exceed
    /// the capacity are honoured in priority order (the most important first).
    pub guarantee: Option<u64>,
}

impl Default for Share {
    /// Weight 1, no set guarantee: an equal share with every other such process.
    fn default() -> Self {
        Share {
            weight: 1,
            guarantee: None,
        }
    }
}

/// A process's one-way notice to its node Governor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeNotice {
    /// Gives `bytes` of credit back (zero: the answer to a ticket when there is nothing).
    Give {
        /// The process.
        token: u64,
        /// Its key (see [`NodeReply::Joined`]).
        key: u64,
        /// The authority.
        authority: String,
        /// Bytes given back.
        bytes: u64,
        /// The ticket this answers, or 0.
        ticket: u64,
    },
    /// What the process holds now, as its own books and the OS say.
    Report {
        /// The process.
        token: u64,
        /// Its key (see [`NodeReply::Joined`]).
        key: u64,
        /// The authority.
        authority: String,
        /// Bytes its Governor approved to its holders.
        approved: u64,
        /// Bytes the OS or driver reports its memory holds.
        os_bytes: u64,
        /// The model it serves.
        model: String,
        /// The prompt blocks it holds (what a router places requests by), where it can tell.
        prefixes: Option<HeldPrefixes>,
    },
    /// The process leaves: its memory is freed, its credit goes back.
    Leave {
        /// The process.
        token: u64,
        /// Its key (see [`NodeReply::Joined`]).
        key: u64,
    },
}

/// The node Governor's answer to a [`NodeRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeReply {
    /// Joined: the credit the node's books hold for the process.
    Joined {
        /// Credit in bytes.
        credit: u64,
        /// The process's key: a random secret the node issues at its first join and sends
        /// only in this reply, which goes back over the session that joined. Every later
        /// frame of the process carries it; a frame with the process's token and another key
        /// is refused and counted, never applied (tokens are no secret: the process's link
        /// group is named after its token).
        key: u64,
    },
    /// `bytes` more credit, approved.
    Granted {
        /// Bytes.
        bytes: u64,
    },
    /// Refused, and why.
    Refused {
        /// Why.
        reason: String,
    },
    /// The node's books.
    Status(NodeStatus),
}

/// The node's books at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct NodeStatus {
    /// Per authority: name, capacity, credit approved to processes.
    pub authorities: Vec<(String, u64, u64)>,
    /// Per process and authority.
    pub processes: Vec<ProcessStatus>,
    /// Requests waiting for room.
    pub waiting: u64,
    /// Tickets sent to processes.
    pub tickets: u64,
    /// Frames that did not decode or did not validate.
    pub rejected_frames: u64,
    /// Of those, frames naming a process with another session's key.
    pub foreign_frames: u64,
    /// Processes whose credit came back because they were confirmed gone.
    pub reaped: u64,
    /// Frames from a process the node had already reaped (its last report or its leave, sent
    /// as it exited, arriving after its session closed): benign, not counted as rejected.
    #[serde(default)]
    pub late_frames: u64,
}

/// One process's figures on one authority.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessStatus {
    /// Its token.
    pub token: u64,
    /// Its pid.
    pub pid: u32,
    /// Its name.
    pub name: String,
    /// The authority.
    pub authority: String,
    /// Credit the node approved to it.
    pub credit: u64,
    /// What it last reported approved to its holders.
    pub approved: u64,
    /// What it last reported the OS holds for it.
    pub os_bytes: u64,
    /// Whether its session is up.
    pub connected: bool,
    /// The share of the authority the node guarantees it now (see [`Share`]).
    pub guarantee: u64,
}

/// The prompt blocks a process (or a node's processes of one model) holds, as a frame carries
/// a [`PrefixDigest`]: checked by [`HeldPrefixes::digest`] before use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldPrefixes {
    /// The block size the keys were cut with.
    pub block_tokens: u32,
    /// How many blocks were put in.
    pub blocks: u64,
    /// The filter ([`PrefixDigest::BYTES`] long).
    pub bits: Vec<u8>,
}

impl HeldPrefixes {
    /// The digest, or `None` if the frame's fields do not make one.
    pub fn digest(&self) -> Option<PrefixDigest> {
        self.clone().into_digest()
    }

    /// The same, taking the frame's bytes.
    pub fn into_digest(self) -> Option<PrefixDigest> {
        PrefixDigest::from_parts(self.block_tokens, self.bits, self.blocks)
    }

    /// Whether its fields make a digest.
    fn fits(&self) -> bool {
        PrefixDigest::parts_fit(self.block_tokens, self.bits.len())
    }
}

impl From<&PrefixDigest> for HeldPrefixes {
    fn from(d: &PrefixDigest) -> Self {
        HeldPrefixes {
            block_tokens: d.block_tokens() as u32,
            blocks: d.blocks(),
            bits: d.bits().to_vec(),
        }
    }
}

/// One model's processes on a node, for a router.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSummary {
    /// The model's name.
    pub model: String,
    /// Processes serving it.
    pub processes: u64,
    /// Prompt blocks they hold, in memory and on disk.
    pub cached_blocks: u64,
    /// Which blocks: one digest per block size its processes cut prompts with, merged over
    /// the processes (none past [`MAX_DIGESTS`] in the summary).
    pub prefixes: Vec<HeldPrefixes>,
}

impl ModelSummary {
    /// How many tokens at the start of `prompt` this node's processes may hold cached: the
    /// longest leading run of the prompt's block keys any of the digests holds. A router
    /// sends the request where this is longest. It errs one way only: a run held is always
    /// counted, and, rarely, a block not held is counted as well.
    pub fn cached_tokens(&self, prompt: &[u32]) -> usize {
        self.prefixes
            .iter()
            .filter_map(HeldPrefixes::digest)
            .map(|d| {
                let bt = d.block_tokens();
                d.leading(&prompt_keys(prompt, bt)) * bt
            })
            .max()
            .unwrap_or(0)
    }
}

/// What a node Governor publishes to the cluster's watchers (a router, `cluster_status`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeSummary {
    /// The node's name.
    pub node: String,
    /// Per authority: name, capacity, credit approved, free.
    pub authorities: Vec<(String, u64, u64, u64)>,
    /// The machine's memory pressure (PSI `some avg10`, percent), where the kernel reports it.
    pub pressure: Option<f64>,
    /// Per model: its processes and the prompt blocks they hold.
    pub models: Vec<ModelSummary>,
    /// Requests waiting for room.
    pub waiting: u64,
    /// Per process and authority: its credit and what it reported approved (for operators:
    /// the credit moving between processes).
    pub processes: Vec<ProcessStatus>,
}

impl NodeSummary {
    /// Makes it fit a payload: the processes go first (from the last), then the digests
    /// (from the last model on), then the models (from the last), then the authorities. A
    /// node whose summary did not fit would vanish from every watcher's view.
    pub fn fit(&mut self) {
        let size = |s: &NodeSummary| postcard::to_stdvec(s).map_or(usize::MAX, |b| b.len());
        while size(self) > MAX_PAYLOAD {
            if self.processes.pop().is_some() {
                continue;
            }
            if let Some(m) = self
                .models
                .iter_mut()
                .rev()
                .find(|m| !m.prefixes.is_empty())
            {
                m.prefixes.clear();
            } else if self.models.pop().is_none() && self.authorities.pop().is_none() {
                return;
            }
        }
    }
}

/// A watcher's mailbox: node summaries, checked.
#[derive(Debug)]
pub enum WatchMsg {
    /// A node's summary, or why its payload was dropped.
    Summary(Result<NodeSummary, WireError>),
}

impl ractor::Message for WatchMsg {
    fn serializable() -> bool {
        true
    }

    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        match self {
            WatchMsg::Summary(Ok(summary)) => Ok(SerializedMessage::Cast {
                variant: CAST.into(),
                args: encode(&summary)?,
                metadata: None,
            }),
            WatchMsg::Summary(Err(_)) => Err(BoxedDowncastErr),
        }
    }

    fn deserialize(bytes: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        Ok(WatchMsg::Summary(match bytes {
            SerializedMessage::Cast { variant, args, .. } if variant == CAST => {
                decode::<NodeSummary>(&args)
            }
            SerializedMessage::Cast { variant, .. } | SerializedMessage::Call { variant, .. } => {
                Err(WireError::UnknownKind(variant))
            }
            SerializedMessage::CallReply(..) => Err(WireError::UnknownKind("reply".into())),
        }))
    }
}

/// The node Governor's one-way notice to a process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinkNotice {
    /// Give back `bytes` of credit: unused first, then by asking your holders.
    Ticket {
        /// The ticket.
        id: u64,
        /// The authority.
        authority: String,
        /// Bytes wanted.
        bytes: u64,
        /// How long the process has, in milliseconds.
        deadline_ms: u64,
        /// `None`: anything above the process's guarantee, its holders choosing (cached
        /// blocks, then running sequences, then weights). `Some(hits)`: the process is at or
        /// under its guarantee, and gives only credit it does not use and cached prompt
        /// blocks used at most `hits` times ([`COLD_HITS`]): its hot prefixes, its running
        /// sequences and its weights stay.
        worth: Option<u32>,
    },
    /// `bytes` of credit above the process's guarantee were taken back without its answer (it
    /// stopped answering while another process waited under its own guarantee): its credit
    /// is that much lower, and its holders make the room at once.
    Revoked {
        /// The authority.
        authority: String,
        /// Bytes taken back.
        bytes: u64,
    },
}

/// Why a payload was dropped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Larger than [`MAX_PAYLOAD`].
    #[error("payload of {0} bytes is over the limit")]
    TooLarge(usize),
    /// Not a payload of this protocol.
    #[error("payload does not decode: {0}")]
    Garbage(String),
    /// A variant this side does not know, or a call where a cast belongs.
    #[error("unknown message kind {0:?}")]
    UnknownKind(String),
    /// It decoded, but its fields are not acceptable.
    #[error("invalid: {0}")]
    Invalid(&'static str),
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, BoxedDowncastErr> {
    postcard::to_stdvec(value).map_err(|_| BoxedDowncastErr)
}

/// Decodes a payload of at most [`MAX_PAYLOAD`] bytes that must be consumed whole.
pub fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, WireError> {
    if bytes.len() > MAX_PAYLOAD {
        return Err(WireError::TooLarge(bytes.len()));
    }
    match postcard::take_from_bytes::<T>(bytes) {
        Ok((value, [])) => Ok(value),
        Ok((_, rest)) => Err(WireError::Garbage(format!("{} trailing bytes", rest.len()))),
        Err(e) => Err(WireError::Garbage(e.to_string())),
    }
}

/// Encodes a reply for the wire.
pub fn encode_reply(reply: &NodeReply) -> Vec<u8> {
    // A reply of these types always encodes (no maps, no unsupported types).
    postcard::to_stdvec(reply).unwrap_or_default()
}

fn name_ok(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME && !name.chars().any(char::is_control)
}

impl NodeRequest {
    /// Checks fields no well-behaved process sends.
    pub fn validate(&self) -> Result<(), WireError> {
        match self {
            NodeRequest::Join {
                token,
                pid,
                name,
                authority,
                share,
                ..
            } => {
                if *token == 0 {
                    return Err(WireError::Invalid("token 0"));
                }
                if *pid == 0 || *pid > i32::MAX as u32 {
                    return Err(WireError::Invalid("pid out of range"));
                }
                if !name_ok(name) || !name_ok(authority) {
                    return Err(WireError::Invalid("bad name"));
                }
                if share.weight == 0 || share.weight > MAX_WEIGHT {
                    return Err(WireError::Invalid("weight out of range"));
                }
                Ok(())
            }
            NodeRequest::Ask {
                bytes,
                at_least,
                authority,
                ..
            } => {
                if *at_least == 0 || at_least > bytes {
                    return Err(WireError::Invalid("zero bytes, or need over the ask"));
                }
                if !name_ok(authority) {
                    return Err(WireError::Invalid("bad name"));
                }
                Ok(())
            }
            NodeRequest::Status => Ok(()),
        }
    }
}

/// Who sent a notice ([`NodeNotice::sender`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sender {
    /// The process's token.
    pub token: u64,
    /// The key of its session.
    pub key: u64,
}

impl NodeNotice {
    /// The process the notice is from, and the key it presents.
    pub fn sender(&self) -> Sender {
        match *self {
            NodeNotice::Give { token, key, .. }
            | NodeNotice::Report { token, key, .. }
            | NodeNotice::Leave { token, key } => Sender { token, key },
        }
    }

    /// Checks fields no well-behaved process sends.
    pub fn validate(&self) -> Result<(), WireError> {
        match self {
            // Zero bytes is an answer to a ticket ("nothing to give"), never a bare notice.
            NodeNotice::Give {
                bytes,
                authority,
                ticket,
                ..
            } if (*bytes == 0 && *ticket == 0) || !name_ok(authority) => {
                Err(WireError::Invalid("bad give"))
            }
            NodeNotice::Report {
                authority, model, ..
            } if !name_ok(authority) || !name_ok(model) => Err(WireError::Invalid("bad name")),
            NodeNotice::Report {
                prefixes: Some(p), ..
            } if !p.fits() => Err(WireError::Invalid("bad prefix digest")),
            _ => Ok(()),
        }
    }
}

const CALL: &str = "call";
const CAST: &str = "cast";

/// The node Governor's mailbox: what processes send (checked), and its own timers.
#[derive(Debug)]
pub enum NodeMsg {
    /// A request from a process; the reply goes back as bytes.
    Call {
        /// The request, or why its payload was dropped.
        request: Result<NodeRequest, WireError>,
        /// Where the encoded [`NodeReply`] goes.
        reply: RpcReplyPort<Vec<u8>>,
    },
    /// A one-way notice from a process.
    Cast(Result<NodeNotice, WireError>),
    /// The node's own periodic check (local only).
    Tick,
    /// Sets an authority's capacity (local only: the machine-following task, an operator's
    /// handle); replies whether the authority exists.
    SetCapacity {
        /// The authority's name.
        authority: String,
        /// Its new capacity.
        bytes: u64,
        /// Whether it was set.
        reply: RpcReplyPort<bool>,
    },
}

impl ractor::Message for NodeMsg {
    fn serializable() -> bool {
        true
    }

    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        match self {
            NodeMsg::Call {
                request: Ok(request),
                reply,
            } => Ok(SerializedMessage::Call {
                variant: CALL.into(),
                args: encode(&request)?,
                reply,
                metadata: None,
            }),
            NodeMsg::Cast(Ok(notice)) => Ok(SerializedMessage::Cast {
                variant: CAST.into(),
                args: encode(&notice)?,
                metadata: None,
            }),
            _ => Err(BoxedDowncastErr),
        }
    }

    fn deserialize(bytes: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        // Never an error: a bad frame becomes a message the node counts and drops, so that
        // nothing a peer sends can stop the actor.
        Ok(match bytes {
            SerializedMessage::Call {
                variant,
                args,
                reply,
                ..
            } => NodeMsg::Call {
                request: if variant == CALL {
                    decode::<NodeRequest>(&args).and_then(|r| r.validate().map(|()| r))
                } else {
                    Err(WireError::UnknownKind(variant))
                },
                reply,
            },
            SerializedMessage::Cast { variant, args, .. } => NodeMsg::Cast(if variant == CAST {
                decode::<NodeNotice>(&args).and_then(|n| n.validate().map(|()| n))
            } else {
                Err(WireError::UnknownKind(variant))
            }),
            SerializedMessage::CallReply(..) => {
                NodeMsg::Cast(Err(WireError::UnknownKind("reply".into())))
            }
        })
    }
}

/// A process's link actor's mailbox: notices from the node (checked) and local events.
#[derive(Debug)]
pub enum LinkMsg {
    /// A notice from the node.
    Notice(Result<LinkNotice, WireError>),
    /// The process's Governor waits for `bytes` it has no room for (local only).
    Need(u64),
    /// An ask to the node came back (local only).
    Asked(Result<NodeReply, String>),
    /// The link's own periodic check (local only).
    Tick,
}

impl ractor::Message for LinkMsg {
    fn serializable() -> bool {
        true
    }

    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        match self {
            LinkMsg::Notice(Ok(notice)) => Ok(SerializedMessage::Cast {
                variant: CAST.into(),
                args: encode(&notice)?,
                metadata: None,
            }),
            _ => Err(BoxedDowncastErr),
        }
    }

    fn deserialize(bytes: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        Ok(LinkMsg::Notice(match bytes {
            SerializedMessage::Cast { variant, args, .. } if variant == CAST => {
                decode::<LinkNotice>(&args)
            }
            SerializedMessage::Cast { variant, .. } | SerializedMessage::Call { variant, .. } => {
                Err(WireError::UnknownKind(variant))
            }
            SerializedMessage::CallReply(..) => Err(WireError::UnknownKind("reply".into())),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_truncation_and_trailing_bytes_are_errors_not_panics() {
        let good = NodeRequest::Ask {
            token: 7,
            key: 9,
            authority: "host".into(),
            bytes: 1 << 20,
            at_least: 1,
            wait_ms: 100,
        };
        let bytes = postcard::to_stdvec(&good).unwrap();
        assert_eq!(decode::<NodeRequest>(&bytes).unwrap(), good);
        for cut in 0..bytes.len() {
            assert!(
                decode::<NodeRequest>(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(decode::<NodeRequest>(&long).is_err(), "trailing byte");
        assert!(decode::<NodeRequest>(&[0xff; 64]).is_err(), "garbage");
        assert!(matches!(
            decode::<NodeRequest>(&vec![0; MAX_PAYLOAD + 1]),
            Err(WireError::TooLarge(_))
        ));
        // A string length far past the payload.
        let mut huge_name = vec![0u8]; // Join
        huge_name.extend([1, 1, 0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert!(decode::<NodeRequest>(&huge_name).is_err());
    }

    #[test]
    fn a_report_with_a_digest_that_does_not_check_is_invalid() {
        let report = |block_tokens, len| NodeNotice::Report {
            token: 1,
            key: 1,
            authority: "host".into(),
            approved: 0,
            os_bytes: 0,
            model: "m".into(),
            prefixes: Some(HeldPrefixes {
                block_tokens,
                blocks: u64::MAX,
                bits: vec![0xff; len],
            }),
        };
        assert!(report(16, PrefixDigest::BYTES).validate().is_ok());
        assert!(report(16, PrefixDigest::BYTES + 1).validate().is_err());
        assert!(report(16, 0).validate().is_err());
        assert!(report(0, PrefixDigest::BYTES).validate().is_err());
        assert!(report(u32::MAX, PrefixDigest::BYTES).validate().is_err());
        // A whole report with a digest fits a payload, and comes back equal.
        let bytes = postcard::to_stdvec(&report(16, PrefixDigest::BYTES)).unwrap();
        assert!(bytes.len() < MAX_PAYLOAD);
        assert_eq!(
            decode::<NodeNotice>(&bytes).unwrap(),
            report(16, PrefixDigest::BYTES)
        );
    }

    #[test]
    fn a_summary_with_every_digest_it_may_carry_fits_a_payload() {
        let digest = HeldPrefixes {
            block_tokens: 16,
            blocks: u64::MAX,
            bits: vec![0xff; PrefixDigest::BYTES],
        };
        let model = |i: usize| ModelSummary {
            model: format!("{i:0>width$}", width = MAX_NAME),
            processes: u64::MAX,
            cached_blocks: u64::MAX,
            prefixes: vec![digest.clone()],
        };
        let summary = NodeSummary {
            node: "n".repeat(MAX_NAME),
            authorities: vec![("a".repeat(MAX_NAME), u64::MAX, u64::MAX, u64::MAX); 4],
            pressure: Some(100.0),
            models: (0..MAX_DIGESTS).map(model).collect(),
            waiting: u64::MAX,
            processes: Vec::new(),
        };
        let bytes = postcard::to_stdvec(&summary).unwrap();
        assert!(bytes.len() <= MAX_PAYLOAD, "{} bytes", bytes.len());
        assert_eq!(decode::<NodeSummary>(&bytes).unwrap(), summary);
    }

    #[test]
    fn a_summary_of_too_many_models_is_cut_to_fit() {
        let model = |i: usize| ModelSummary {
            model: format!("{i:0>width$}", width = MAX_NAME),
            processes: 1,
            cached_blocks: 1,
            prefixes: vec![HeldPrefixes {
                block_tokens: 16,
                blocks: 1,
                bits: vec![0xff; PrefixDigest::BYTES],
            }],
        };
        let mut summary = NodeSummary {
            node: "n".into(),
            authorities: vec![("host".into(), 1, 1, 1)],
            pressure: None,
            models: (0..500).map(model).collect(),
            waiting: 0,
            processes: (0..1000)
                .map(|i| ProcessStatus {
                    token: i,
                    pid: 1,
                    name: "p".repeat(MAX_NAME),
                    authority: "host".into(),
                    credit: 1,
                    approved: 1,
                    os_bytes: 1,
                    connected: true,
                    guarantee: u64::MAX,
                })
                .collect(),
        };
        summary.fit();
        let bytes = postcard::to_stdvec(&summary).unwrap();
        assert!(bytes.len() <= MAX_PAYLOAD, "{} bytes", bytes.len());
        assert!(summary.processes.is_empty(), "processes go first");
        assert_eq!(summary.authorities.len(), 1, "models go before authorities");
        assert!(!summary.models.is_empty());
        assert!(summary.models.iter().all(|m| m.prefixes.is_empty()));
        assert_eq!(decode::<NodeSummary>(&bytes).unwrap(), summary);
    }

    #[test]
    fn requests_no_well_behaved_process_sends_are_invalid() {
        let join_weighted = |token, pid, name: &str, weight| NodeRequest::Join {
            token,
            key: 0,
            pid,
            name: name.into(),
            priority: 0,
            authority: "host".into(),
            held: 0,
            share: Share {
                weight,
                guarantee: Some(u64::MAX),
            },
        };
        let join = |token, pid, name: &str| join_weighted(token, pid, name, 1);
        assert!(join(1, 1, "a").validate().is_ok());
        assert!(join_weighted(1, 1, "a", MAX_WEIGHT).validate().is_ok());
        assert!(join_weighted(1, 1, "a", 0).validate().is_err());
        assert!(join_weighted(1, 1, "a", MAX_WEIGHT + 1).validate().is_err());
        assert!(join(0, 1, "a").validate().is_err());
        assert!(join(1, 0, "a").validate().is_err());
        assert!(join(1, u32::MAX, "a").validate().is_err());
        assert!(join(1, 1, "").validate().is_err());
        assert!(join(1, 1, &"x".repeat(MAX_NAME + 1)).validate().is_err());
        assert!(join(1, 1, "a\nb").validate().is_err());
        let ask = |bytes, at_least| NodeRequest::Ask {
            token: 1,
            key: 1,
            authority: "host".into(),
            bytes,
            at_least,
            wait_ms: 0,
        };
        assert!(ask(10, 5).validate().is_ok());
        assert!(ask(0, 0).validate().is_err());
        assert!(ask(10, 0).validate().is_err());
        assert!(ask(5, 10).validate().is_err());
    }
}
