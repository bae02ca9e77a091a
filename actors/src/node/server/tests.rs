//! The node's state driven without sessions: what a process's exit leaves in the books, in
//! `/metrics` and in the counts of dropped frames.

use std::sync::Arc;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use ractor::concurrency::oneshot;

use super::*;
use crate::node::wire::{decode, NodeNotice, Share};

const MIB: u64 = 1 << 20;

fn node() -> NodeState {
    NodeState::new(
        NodeConfig::new("cookie", 0, "host", 64 * MIB),
        PeerPids::default(),
    )
}

/// Sends `request` to the node's state and returns its decoded reply.
fn call(state: &mut NodeState, request: NodeRequest) -> NodeReply {
    let (tx, mut rx) = oneshot();
    state.request(request, RpcReplyPort::from(tx));
    decode(&rx.try_recv().expect("answered at once")).unwrap()
}

/// Joins process `token` (pid `pid`) holding `held` bytes; its key.
fn join(state: &mut NodeState, token: u64, pid: u32, held: u64) -> u64 {
    let reply = call(
        state,
        NodeRequest::Join {
            token,
            key: 0,
            pid,
            name: "inference_server".into(),
            priority: 0,
            authority: "host".into(),
            held,
            share: Share::default(),
        },
    );
    match reply {
        NodeReply::Joined { credit, key } => {
            assert_eq!(credit, held);
            key
        }
        other => panic!("join refused: {other:?}"),
    }
}

/// The gauges of `name` in `recorder`'s snapshot: each series' labels and value.
fn gauges(recorder: &DebuggingRecorder, name: &str) -> Vec<(Vec<(String, String)>, f64)> {
    recorder
        .snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == name)
        .filter_map(|(key, _, _, value)| match value {
            DebugValue::Gauge(v) => Some((
                key.key()
                    .labels()
                    .map(|l| (l.key().to_string(), l.value().to_string()))
                    .collect(),
                v.into_inner(),
            )),
            _ => None,
        })
        .collect()
}

/// A process that leaves has its credit series set to zero under the authority it drew on,
/// so the per-process series add up to the node's credit, not to every process ever seen.
#[test]
fn a_reaped_process_reads_zero_under_its_own_authority() {
    let recorder = Arc::new(DebuggingRecorder::new());
    let mut state = node();
    metrics::with_local_recorder(recorder.as_ref(), || {
        let key = join(&mut state, 7, 4242, 8 * MIB);
        state.publish();
        let live = gauges(&recorder, m::NODE_PROCESS_CREDIT_BYTES.name);
        assert_eq!(live.len(), 1);
        assert_eq!(live[0].1, (8 * MIB) as f64);
        state.notice(NodeNotice::Leave { token: 7, key });
        state.publish();
        for name in [
            m::NODE_PROCESS_CREDIT_BYTES.name,
            m::NODE_PROCESS_OS_BYTES.name,
        ] {
            for (labels, value) in gauges(&recorder, name) {
                assert!(
                    labels.contains(&("authority".into(), "host".into())),
                    "{name} {labels:?}"
                );
                assert_eq!(value, 0.0, "{name} {labels:?} after the leave");
            }
        }
    });
    assert_eq!(state.status.reaped, 1);
}

/// A frame a process sent as it exited, arriving after the node reaped it (its pidfd, or its
/// leave), is late, not hostile: counted apart. A frame naming a token the node never saw, or
/// a reaped one under another key, is still rejected.
#[test]
fn frames_after_a_processs_exit_are_late_and_strangers_are_rejected() {
    let mut state = node();
    let key = join(&mut state, 7, 4242, 4 * MIB);
    state.reap(7, "exited");
    let report = |token, key| NodeNotice::Report {
        token,
        key,
        authority: "host".into(),
        approved: 0,
        os_bytes: 0,
        model: "m".into(),
        prefixes: None,
    };
    state.notice(report(7, key));
    state.notice(NodeNotice::Give {
        token: 7,
        key,
        authority: "host".into(),
        bytes: MIB,
        ticket: 1,
    });
    state.notice(NodeNotice::Leave { token: 7, key });
    let asked = call(
        &mut state,
        NodeRequest::Ask {
            token: 7,
            key,
            authority: "host".into(),
            bytes: MIB,
            at_least: MIB,
            wait_ms: 0,
        },
    );
    assert!(matches!(asked, NodeReply::Refused { .. }), "{asked:?}");
    assert_eq!(
        (state.status.late_frames, state.status.rejected_frames),
        (4, 0)
    );
    // The same token under another key, and a token never seen: hostile.
    state.notice(report(7, key ^ 1));
    state.notice(report(99, key));
    assert_eq!(
        (state.status.late_frames, state.status.rejected_frames),
        (4, 2)
    );
    // The books gave the credit back once, whatever came after.
    assert_eq!(state.ledger.credit_bytes(state.authorities["host"]), 0);
}

/// The reaped processes remembered are bounded: a node that outlives many processes keeps
/// only the last few hundred.
#[test]
fn the_reaped_remembered_are_bounded() {
    let mut state = node();
    for token in 1..=(3 * liveness::REAPED_KEPT as u64) {
        join(&mut state, token, token as u32, 0);
        state.reap(token, "exited");
    }
    assert_eq!(state.reaped.len(), liveness::REAPED_KEPT);
    assert_eq!(state.status.reaped, 3 * liveness::REAPED_KEPT as u64);
}

/// Records what the node sends a process's link.
struct Recorder;

type Notices = Arc<std::sync::Mutex<Vec<LinkNotice>>>;

impl Actor for Recorder {
    type Msg = LinkMsg;
    type State = Notices;
    type Arguments = Notices;

    async fn pre_start(
        &self,
        _: ActorRef<LinkMsg>,
        notices: Notices,
    ) -> Result<Notices, ActorProcessingErr> {
        Ok(notices)
    }

    async fn handle(
        &self,
        _: ActorRef<LinkMsg>,
        msg: LinkMsg,
        notices: &mut Notices,
    ) -> Result<(), ActorProcessingErr> {
        if let LinkMsg::Notice(Ok(n)) = msg {
            notices.lock().unwrap().push(n);
        }
        Ok(())
    }
}

use crate::node::wire::LinkNotice;

/// A node of `capacity` serving at once, and process `token` joined holding `held` bytes of
/// which its holders use `approved`, with a link that records what it is sent.
struct Books {
    state: NodeState,
    keys: BTreeMap<u64, u64>,
    links: BTreeMap<u64, Notices>,
}

impl Books {
    fn new(capacity: u64) -> Self {
        let mut state = NodeState::new(
            NodeConfig::new("cookie", 0, "host", capacity),
            PeerPids::default(),
        );
        state.serving_from = Instant::now();
        Books {
            state,
            keys: BTreeMap::new(),
            links: BTreeMap::new(),
        }
    }

    async fn join(&mut self, token: u64, priority: u32, held: u64, approved: u64) {
        let reply = call(
            &mut self.state,
            NodeRequest::Join {
                token,
                key: 0,
                pid: token as u32,
                name: format!("server{token}"),
                priority,
                authority: "host".into(),
                held: 0,
                share: Share::default(),
            },
        );
        let NodeReply::Joined { key, .. } = reply else {
            panic!("join refused: {reply:?}")
        };
        // Adopted as a rejoin would: the credit straight into its line.
        let aid = self.state.authorities["host"];
        let m = &self.state.processes[&token].members[&aid];
        let (holder, line) = (m.holder, m.line);
        assert!(self.state.approve(holder, aid, line, held));
        let notices = Notices::default();
        let (link, _) = Actor::spawn(None, Recorder, notices.clone()).await.unwrap();
        self.state.processes.get_mut(&token).unwrap().link = Some(link);
        self.keys.insert(token, key);
        self.links.insert(token, notices);
        self.report(token, approved);
    }

    fn report(&mut self, token: u64, approved: u64) {
        self.state.notice(NodeNotice::Report {
            token,
            key: self.keys[&token],
            authority: "host".into(),
            approved,
            os_bytes: approved,
            model: "m".into(),
            prefixes: None,
        });
    }

    /// `token` asks for `bytes`, waiting up to 5 s; the reply, once it comes.
    fn ask(&mut self, token: u64, bytes: u64) -> ractor::concurrency::OneshotReceiver<Vec<u8>> {
        let (tx, rx) = oneshot();
        let request = NodeRequest::Ask {
            token,
            key: self.keys[&token],
            authority: "host".into(),
            bytes,
            at_least: bytes,
            wait_ms: 5000,
        };
        self.state.request(request, RpcReplyPort::from(tx));
        self.state.pump();
        self.state.drive_tickets();
        rx
    }

    /// `token` gives `bytes` back, answering ticket `ticket`.
    fn give(&mut self, token: u64, bytes: u64, ticket: u64) {
        self.state.notice(NodeNotice::Give {
            token,
            key: self.keys[&token],
            authority: "host".into(),
            bytes,
            ticket,
        });
    }

    /// What each process's link was sent so far.
    async fn sent(&self, token: u64) -> Vec<LinkNotice> {
        tokio::time::sleep(Duration::from_millis(20)).await;
        self.links[&token].lock().unwrap().clone()
    }

    fn credit(&self, token: u64) -> u64 {
        self.state
            .member(token, self.state.authorities["host"])
            .unwrap()
    }
}

/// The bytes of each ticket (`revoked` false) or each revocation (true) among `notices`.
fn bytes_sent(notices: &[LinkNotice], revoked: bool) -> Vec<u64> {
    notices
        .iter()
        .filter_map(|n| match (n, revoked) {
            (LinkNotice::Ticket { bytes, .. }, false) => Some(*bytes),
            (LinkNotice::Revoked { bytes, .. }, true) => Some(*bytes),
            _ => None,
        })
        .collect()
}

/// A process under its guarantee that asks is given the room by the process over its own,
/// which is asked for no more than is wanted; the process under its guarantee holding only
/// live memory is not asked at all.
#[tokio::test]
async fn a_process_under_its_guarantee_is_given_room_by_the_one_over_its_own() {
    let mut b = Books::new(300 * MIB);
    b.join(1, 0, 200 * MIB, 200 * MIB).await; // a burst: 100 MiB over its guarantee
    b.join(2, 0, 50 * MIB, 50 * MIB).await; // the asker, 50 under
    b.join(3, 0, 50 * MIB, 50 * MIB).await; // idle, its cache all it holds
    let _reply = b.ask(2, 40 * MIB);
    assert_eq!(bytes_sent(&b.sent(1).await, false), vec![40 * MIB]);
    assert!(b.sent(3).await.is_empty(), "a process under its guarantee");
    // It gives: the waiter is granted.
    b.give(1, 40 * MIB, 1);
    b.state.pump();
    assert_eq!((b.credit(1), b.credit(2)), (160 * MIB, 90 * MIB));
    let status = b.state.snapshot();
    assert!(status.processes.iter().all(|p| p.guarantee == 100 * MIB));
}

/// A more important process idle under its guarantee keeps its cache (and its weights) when a
/// burst over its own guarantee asks: nobody may be asked, so the burst's own holders make
/// the room.
#[tokio::test]
async fn an_idle_process_under_its_guarantee_keeps_what_it_holds_whatever_its_priority() {
    let mut b = Books::new(300 * MIB);
    b.join(1, 0, 190 * MIB, 190 * MIB).await; // over its guarantee, asking more
    b.join(2, 5, 90 * MIB, 90 * MIB).await; // important, idle, all cache and weights
    b.join(3, 0, 20 * MIB, 20 * MIB).await;
    let reply = b.ask(1, 30 * MIB);
    b.state.drive_tickets();
    assert!(b.sent(2).await.is_empty(), "{:?}", b.sent(2).await);
    assert!(b.sent(3).await.is_empty());
    let answer = decode::<NodeReply>(&reply.await.unwrap()).unwrap();
    assert_eq!(
        answer,
        NodeReply::Refused {
            reason: crate::node::wire::NOBODY_CAN_GIVE.into()
        }
    );
    assert_eq!(b.credit(2), 90 * MIB);
}

/// A process over its guarantee that stops answering (SIGSTOP) has what it holds above its
/// guarantee taken back once it has been silent past `STALLED`, when another waits under its
/// own; a give it sent before it learnt of that is applied to what it holds, not refused.
#[tokio::test]
async fn a_stopped_process_over_its_guarantee_loses_the_excess_without_its_answer() {
    let mut b = Books::new(300 * MIB);
    b.join(1, 0, 220 * MIB, 220 * MIB).await;
    b.join(2, 0, 40 * MIB, 40 * MIB).await;
    b.join(3, 0, 40 * MIB, 40 * MIB).await;
    // Not silent long enough: a ticket, no revocation.
    let _first = b.ask(2, 50 * MIB);
    assert_eq!(bytes_sent(&b.sent(1).await, false), vec![50 * MIB]);
    assert_eq!(b.credit(1), 220 * MIB);
    // Silent past the bound: the excess it is asked for is taken.
    b.state.processes.get_mut(&1).unwrap().heard = Instant::now() - share::STALLED;
    b.state.drive_tickets();
    assert_eq!((b.credit(1), b.credit(2)), (170 * MIB, 90 * MIB));
    assert_eq!(bytes_sent(&b.sent(1).await, true), vec![50 * MIB]);
    // Never below its guarantee, however long it stays silent.
    let _second = b.ask(3, 200 * MIB);
    b.state.drive_tickets();
    assert!(b.credit(1) >= 100 * MIB, "{}", b.credit(1));
    // It runs again: a give it sent before it learnt of the revocation, for more than it
    // holds now, is applied (all it holds goes), not counted as hostile.
    let before = b.state.status.rejected_frames;
    b.give(1, 500 * MIB, 1);
    assert_eq!(b.state.status.rejected_frames, before);
    assert_eq!(b.credit(1), 0);
}
