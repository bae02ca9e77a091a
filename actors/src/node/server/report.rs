//! What the node Governor shows: its status for operators and tests, its metrics, and the
//! summary it publishes to the cluster's watchers.

use std::collections::BTreeMap;

use procmem::kv::PrefixDigest;
use procmem::ledger::LeaseId;
use procmem::metrics as m;
use ractor::ActorRef;

use super::NodeState;
use crate::node::wire::{
    HeldPrefixes, ModelSummary, NodeStatus, NodeSummary, ProcessStatus, WatchMsg, MAX_DIGESTS,
};

impl NodeState {
    pub(super) fn snapshot(&self) -> NodeStatus {
        let mut status = self.status.clone();
        status.authorities = self
            .authorities
            .iter()
            .map(|(name, aid)| {
                let capacity = self.ledger.totals(*aid).map_or(0, |t| t.capacity);
                (name.clone(), capacity, self.ledger.credit_bytes(*aid))
            })
            .collect();
        let guarantees = self.guarantees();
        status.processes = self
            .processes
            .iter()
            .flat_map(|(token, p)| {
                let guarantees = &guarantees;
                p.members.iter().map(move |(aid, m)| ProcessStatus {
                    guarantee: guarantees.get(&(*aid, *token)).copied().unwrap_or(0),
                    token: *token,
                    pid: p.pid,
                    name: p.name.clone(),
                    authority: self.authority_name_of(*aid),
                    credit: self.ledger.lease(m.line).map_or(0, |c| c.bytes),
                    approved: m.approved,
                    os_bytes: m.os_bytes,
                    connected: p
                        .link
                        .as_ref()
                        .is_some_and(|l| l.get_status() == ractor::ActorStatus::Running),
                })
            })
            .collect();
        status.waiting = self.waiters.values().map(|q| q.len() as u64).sum();
        status
    }

    pub(super) fn publish(&self) {
        for (name, aid) in &self.authorities {
            let capacity = self.ledger.totals(*aid).unwrap_or_default().capacity;
            m::NODE_CAPACITY_BYTES.gauge(&[name]).set(capacity as f64);
            m::NODE_CREDIT_BYTES
                .gauge(&[name])
                .set(self.ledger.credit_bytes(*aid) as f64);
        }
        let guarantees = self.guarantees();
        for (token, p) in &self.processes {
            let label = p.label();
            for (aid, m) in &p.members {
                let authority = self.authority_name(m.line);
                let guarantee = guarantees.get(&(*aid, *token)).copied().unwrap_or(0);
                m::NODE_PROCESS_GUARANTEE_BYTES
                    .gauge(&[authority, &label])
                    .set(guarantee as f64);
                let credit = self.ledger.lease(m.line).map_or(0, |c| c.bytes);
                m::NODE_PROCESS_CREDIT_BYTES
                    .gauge(&[authority, &label])
                    .set(credit as f64);
                m::NODE_PROCESS_OS_BYTES
                    .gauge(&[authority, &label])
                    .set(m.os_bytes as f64);
            }
        }
    }

    /// The node's figures for routers: to every member of [`super::WATCH_GROUP`].
    pub(super) fn publish_summary(&self) {
        let watchers = ractor::pg::get_members(&crate::node::WATCH_GROUP.to_string());
        if watchers.is_empty() {
            return;
        }
        let models = self.model_summaries();
        let mut summary = NodeSummary {
            node: self.config.name.clone(),
            authorities: self
                .authorities
                .iter()
                .map(|(name, aid)| {
                    let s = self.ledger.snapshot(*aid).ok();
                    let (capacity, free) = s.map_or((0, 0), |s| (s.capacity, s.free()));
                    (name.clone(), capacity, self.ledger.credit_bytes(*aid), free)
                })
                .collect(),
            pressure: std::fs::read_to_string("/proc/pressure/memory")
                .ok()
                .and_then(|t| procmem::host::machine::parse_psi(&t).ok())
                .map(|p| p.some_avg10),
            models,
            waiting: self.waiters.values().map(|q| q.len() as u64).sum(),
            processes: self.snapshot().processes,
        };
        summary.fit();
        for w in watchers {
            let w: ActorRef<WatchMsg> = ActorRef::from(w);
            let _ = w.cast(WatchMsg::Summary(Ok(summary.clone())));
        }
    }

    pub(super) fn authority_name(&self, line: LeaseId) -> &str {
        self.ledger
            .lease(line)
            .and_then(|c| {
                self.authorities
                    .iter()
                    .find(|(_, a)| **a == c.authority)
                    .map(|(n, _)| n.as_str())
            })
            .unwrap_or("")
    }

    /// Per model: its processes, the blocks they hold, and their digests merged by block
    /// size (at most [`MAX_DIGESTS`] digests in all, for the frame's size).
    fn model_summaries(&self) -> Vec<ModelSummary> {
        let mut models: BTreeMap<&str, (ModelSummary, Vec<PrefixDigest>)> = BTreeMap::new();
        let members = self.processes.values().flat_map(|p| p.members.values());
        for m in members.filter(|m| !m.model.is_empty()) {
            let (summary, digests) = models.entry(&m.model).or_insert_with(|| {
                let summary = ModelSummary {
                    model: m.model.clone(),
                    processes: 0,
                    cached_blocks: 0,
                    prefixes: Vec::new(),
                };
                (summary, Vec::new())
            });
            summary.processes += 1;
            let Some(d) = &m.prefixes else { continue };
            summary.cached_blocks = summary.cached_blocks.saturating_add(d.blocks());
            if !digests.iter_mut().any(|merged| merged.merge(d)) {
                digests.push(d.clone());
            }
        }
        let mut room = MAX_DIGESTS;
        models
            .into_values()
            .map(|(mut summary, digests)| {
                let kept = digests.len().min(room);
                room -= kept;
                summary.prefixes = digests[..kept].iter().map(HeldPrefixes::from).collect();
                summary
            })
            .collect()
    }
}
