//! The node's state driven without sessions: what a process's exit leaves in the books, in
//! `/metrics` and in the counts of dropped frames.

use std::sync::Arc;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use ractor::concurrency::oneshot;

use super::*;
use crate::node::wire::decode;

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
