//! Which processes are still there: each one's link found again after a reconnect, its pid
//! named by the kernel where its session came over the Unix socket, and the credit of one
//! gone (its pidfd, or its session lost past the grace) given back; waiters past their
//! deadline refused.

use std::time::Duration;

use procmem::metrics as m;
use ractor::ActorRef;
use tokio::time::Instant;

use super::{link_group, peer, refuse, NodeState, Watch, Watched};

/// Reaped processes remembered to tell their late frames from hostile ones: far more than
/// exit at once on one node.
pub(super) const REAPED_KEPT: usize = 256;

impl NodeState {
    /// A frame from a process that is not (or no longer) joined: late where the node reaped
    /// that very session (it left, or its connection closed, before this frame came),
    /// rejected otherwise. Either way it is dropped, and the log says which and why.
    pub(super) fn stranger(&mut self, token: u64, key: u64, what: &'static str) {
        match self
            .reaped
            .iter()
            .rev()
            .find(|r| r.0 == token && r.1 == key)
        {
            Some(&(_, _, why)) => {
                self.status.late_frames += 1;
                m::NODE_LATE_FRAMES_TOTAL.counter(&[]).increment(1);
                tracing::info!(
                    token,
                    frame = what,
                    reaped = why,
                    "a frame after its process was reaped, dropped"
                );
            }
            None => self.rejected(&super::WireError::Invalid(what)),
        }
    }

    pub(super) fn find_link(&mut self, token: u64) {
        let Some(p) = self.processes.get_mut(&token) else {
            return;
        };
        let alive = p
            .link
            .as_ref()
            .is_some_and(|l| l.get_status() == ractor::ActorStatus::Running);
        if !alive {
            p.link = ractor::pg::get_members(&link_group(token))
                .into_iter()
                .find(|c| c.get_status() == ractor::ActorStatus::Running)
                .map(ActorRef::from);
        }
        // A link whose session came over the Unix socket: the kernel said which process it
        // is, in this namespace; from now on its pidfd tells when it is gone.
        let named = match (&p.watch, p.link.as_ref().map(|l| l.get_id())) {
            (Watch::Session { .. }, Some(ractor::ActorId::Remote { node_id, .. })) => {
                peer::pid_of(&self.pids, node_id)
            }
            _ => None,
        };
        if let Some((pid, watched)) = named.and_then(|pid| Some((pid, Watched::open(pid).ok()?))) {
            tracing::info!(token, claimed = p.pid, pid, "process named by the kernel");
            p.pid = pid;
            p.watch = Watch::Pid(watched);
        }
    }

    /// `(chunk, need)`: the chunk if it fits now, else the need (now or once room is made).
    /// The process is gone (exited, or left): its credit comes back.
    pub(super) fn reap(&mut self, token: u64, why: &'static str) {
        let Some(p) = self.processes.remove(&token) else {
            return;
        };
        let mut returned = 0u64;
        for m in p.members.values() {
            // Named while its credit line still says which authority it draws on: once retired
            // the line is gone, and a zero written under another label would leave the dead
            // process's last figures standing in `/metrics`.
            let authority = self.authority_name(m.line).to_string();
            let bytes = self.ledger.lease(m.line).map_or(0, |c| c.bytes);
            if bytes > 0 && self.ledger.release(m.holder, m.line, bytes).is_ok() {
                returned += bytes;
            }
            let _ = self.ledger.close_credit(m.holder, m.line);
            let _ = self.ledger.retire_holder(m.holder);
            for gauge in [
                &m::NODE_PROCESS_CREDIT_BYTES,
                &m::NODE_PROCESS_OS_BYTES,
                &m::NODE_PROCESS_GUARANTEE_BYTES,
            ] {
                gauge.gauge(&[&authority, &p.label()]).set(0.0);
            }
        }
        self.reaped.push_back((token, p.key, why));
        if self.reaped.len() > REAPED_KEPT {
            self.reaped.pop_front();
        }
        for queue in self.waiters.values_mut() {
            queue.drain_where(|w| w.token == token);
        }
        for round in self.rounds.values_mut() {
            if round.outstanding.is_some_and(|(_, t, _)| t == token) {
                round.outstanding = None;
            }
        }
        self.status.reaped += 1;
        m::NODE_REAPED_PROCESSES_TOTAL.counter(&[]).increment(1);
        tracing::info!(token, pid = p.pid, name = %p.name, returned, why, "process reaped");
    }

    pub(super) fn tick(&mut self) {
        let now = Instant::now();
        // Waiters past their deadline are refused.
        for queue in self.waiters.values_mut() {
            for w in queue.drain_where(|w| w.deadline <= now || w.reply.is_closed()) {
                refuse(w.reply, "deadline passed while waiting for room");
            }
        }
        let tokens: Vec<u64> = self.processes.keys().copied().collect();
        for token in tokens {
            self.find_link(token);
        }
        // Processes confirmed gone (their pidfd), or unnamed ones whose session stayed gone
        // past the grace: their credit comes back.
        let grace = self.config.session_grace;
        let mut dead = Vec::new();
        for (token, p) in &mut self.processes {
            let running = p
                .link
                .as_ref()
                .is_some_and(|l| l.get_status() == ractor::ActorStatus::Running);
            match &mut p.watch {
                Watch::Pid(w) if w.exited() => dead.push((*token, "exited")),
                Watch::Pid(_) => {}
                Watch::Session { lost } if running => *lost = None,
                Watch::Session { lost } => {
                    if now.duration_since(*lost.get_or_insert(now)) >= grace {
                        dead.push((*token, "session gone past its grace"));
                    }
                }
            }
        }
        for (token, why) in dead {
            self.reap(token, why);
        }
        for round in self.rounds.values_mut() {
            if round.outstanding.is_some_and(|(_, _, d)| d <= now) {
                round.outstanding = None;
            }
        }
        if now.duration_since(self.last_summary) >= Duration::from_millis(500) {
            self.last_summary = now;
            self.publish_summary();
        }
    }
}
