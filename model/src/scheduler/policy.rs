//! The scheduler's decisions, pure: whether preempted requests may come back and new ones
//! may start, given its queues and what it remembers of pressure; whether a lone request
//! refused memory is tried again and after what pause; how long a step waits for sequences
//! a step given up still holds; and what the loop does after a step fails (the decision
//! table of [`Policy::failed_step`]: a [`Failure`] class in, an [`Action`] out). The async
//! loop (`run.rs`) asks before it acts and tells what happened; nothing here awaits, sleeps
//! or reads a clock (the time is passed in), so every rule is tested without a runtime.

use std::time::{Duration, Instant};

use procmem_actors::governor::GovernorError;
use procmem_actors::kv::{KvStoreError, SeqId, TableError};
use procmem_actors::procmem::ledger::LedgerError;
use procmem_actors::provider::ProviderError;
use procmem_actors::residency::ResidencyError;

use crate::error::ModelError;

/// How long, in all, a lone sequence is tried again by default while it finds no room
/// (holders may still be freeing: a swap's copy, a fence behind a busy stream), before the
/// request fails: the budget cannot hold it. Time, not a count: on a loaded machine one wait
/// for room can pass while the memory is still on its way back.
pub(super) const LONELY_FOR: Duration = Duration::from_secs(5);
/// The longest pause between two tries of a lone sequence.
pub(super) const LONELY_PAUSE: Duration = Duration::from_millis(50);
/// How long a step waits, in all, for sequences a step given up still holds (the store
/// hands them back once that step's kernels are done) before the step fails.
pub(super) const BUSY_FOR: Duration = Duration::from_secs(5);
/// Steps without pressure after which admission opens again.
pub(super) const CALM_STEPS: u32 = 16;
/// The pause before a step whose sequences a step given up still holds is tried again.
pub(super) const BUSY_PAUSE: Duration = Duration::from_millis(1);

/// A failed step's error, by what the scheduler can do about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Failure {
    /// Pressure took this sequence while the step waited for its grant.
    Preempted(SeqId),
    /// A sequence is still held by a step given up (the store has it back after that step's
    /// kernels).
    Busy,
    /// The step's memory (its KV, or a layer's weights brought back) was not there by its
    /// deadline, or the OS had no room for its mappings; `later`: the Governor's refusal says
    /// the same may fit later (not more than the whole capacity).
    Short {
        /// Whether it may fit later.
        later: bool,
    },
    /// Anything else: no retry mends it.
    Fault,
}

impl Failure {
    /// The class of `e`.
    pub(super) fn of(e: &ModelError) -> Failure {
        match e {
            ModelError::Prepare(KvStoreError::Table(TableError::Preempted(seq, _))) => {
                Failure::Preempted(*seq)
            }
            ModelError::Prepare(KvStoreError::Table(TableError::Busy(_))) => Failure::Busy,
            e if short_of_room(e) => Failure::Short {
                later: may_fit_later(refusal(e)),
            },
            _ => Failure::Fault,
        }
    }
}

/// What the loop does after a step failed ([`Policy::failed_step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    /// The request of this preempted sequence is parked, to be restored later.
    Park(SeqId),
    /// The newest running request starts over later from the tokens it knows.
    ShedNewest,
    /// The same step is tried again after this pause.
    Again(Duration),
    /// The lone request is tried again after this pause.
    RetryAlone(Duration),
    /// Every running request fails with the step's error.
    FailAll,
}

/// The Governor's refusal inside `e`, where the store was refused memory.
pub(super) fn store_refusal(e: &KvStoreError) -> Option<&GovernorError> {
    match e {
        KvStoreError::Governor(g) => Some(g),
        _ => None,
    }
}

/// The Governor's refusal inside `e`, where a step's memory was refused (its KV, or a
/// layer's weights brought back from offload).
pub(super) fn refusal(e: &ModelError) -> Option<&GovernorError> {
    match e {
        ModelError::Prepare(kv) => store_refusal(kv),
        ModelError::Weights(ResidencyError::Provider(ProviderError::Governor(g))) => Some(g),
        _ => None,
    }
}

/// Whether the refusal `g` says memory was not there by its deadline: less, or the same a
/// little later, may fit. Anything else is a fault no retry mends.
fn short(g: Option<&GovernorError>) -> bool {
    matches!(
        g,
        Some(
            GovernorError::DeadlineExpired(_)
                | GovernorError::Ledger(LedgerError::Denied(_))
                | GovernorError::Busy { .. }
        )
    )
}

/// Whether a step did not get memory by its deadline ([`short`]).
pub(super) fn short_of_room(e: &ModelError) -> bool {
    // The OS out of room for the step's mappings (at `vm.max_map_count`: small prompt blocks
    // each take a mapping in every layer's buffers) is pressure too: fewer sequences pass.
    short(refusal(e)) || matches!(e, ModelError::Prepare(kv) if kv.is_os_out_of_memory())
}

/// Whether a lone try refused with `g` may pass later: short of room, and not told at once,
/// without waiting, that the bytes asked are more than the whole capacity (no wait makes
/// room for those). A Governor with an upstream lets such a request wait for credit instead;
/// if its wait runs out, that is `DeadlineExpired`, which a later try may pass.
pub(super) fn may_fit_later(g: Option<&GovernorError>) -> bool {
    short(g)
        && !matches!(g, Some(GovernorError::Ledger(LedgerError::Denied(d))) if d.asked > d.capacity)
}

/// The lone sequence that has found no room (to open, restore or step): since when, and how
/// many times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Lonely {
    seq: SeqId,
    since: Instant,
    tries: u32,
}

/// What the scheduler remembers of pressure, and the rules it decides by.
#[derive(Debug)]
pub(super) struct Policy {
    /// How long a lone sequence is tried again ([`LONELY_FOR`] by default).
    lonely_for: Duration,
    /// Pressure was met: nothing new is admitted while others run, until one finishes or
    /// [`CALM_STEPS`] steps go through.
    hold: bool,
    calm: u32,
    lonely: Option<Lonely>,
    /// Since when steps have found a sequence still held by a step given up.
    busy_since: Option<Instant>,
    /// A restore refused while others ran waits until one of them finishes.
    restore_blocked: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy::new(LONELY_FOR)
    }
}

impl Policy {
    /// The rules, a lone sequence tried again for `lonely_for`.
    pub(super) fn new(lonely_for: Duration) -> Self {
        Policy {
            lonely_for,
            hold: false,
            calm: 0,
            lonely: None,
            busy_since: None,
            restore_blocked: false,
        }
    }

    /// Whether a preempted request may come back now, with `running` requests running of
    /// `most`: once one of those running has finished since the last preemption or refused
    /// restore (or none runs), so a restore does not take the room a preemption just made
    /// and get preempted again, round and round.
    pub(super) fn may_restore(&self, running: usize, most: usize) -> bool {
        running < most && (!self.restore_blocked || running == 0)
    }

    /// Whether a new request may start now: nothing is parked (those come back first), there
    /// is room in the batch, and no pressure holds admission while others run.
    pub(super) fn may_admit(&self, running: usize, parked: usize, most: usize) -> bool {
        parked == 0 && running < most && (!self.hold || running == 0)
    }

    /// A restore was refused while others ran: restores wait for one of them to finish.
    pub(super) fn restore_refused(&mut self) {
        self.restore_blocked = true;
    }

    /// An open was refused while others ran: admission waits.
    pub(super) fn open_refused(&mut self) {
        self.hold = true;
    }

    /// A step met pressure (a sequence shed for room): admission waits until calm.
    pub(super) fn pressure(&mut self) {
        self.hold = true;
        self.calm = 0;
    }

    /// A sequence of the step was preempted: pressure, and restores wait for a finish.
    pub(super) fn preempted(&mut self) {
        self.pressure();
        self.restore_blocked = true;
    }

    /// A step went through: the lone sequence's patience ends, a wait for busy sequences
    /// too, and after [`CALM_STEPS`] such steps admission opens again.
    pub(super) fn stepped(&mut self) {
        self.lonely = None;
        self.busy_since = None;
        self.calm += 1;
        if self.calm >= CALM_STEPS {
            self.hold = false;
        }
    }

    /// A request finished, or was cancelled: its room is back, for restores and new ones.
    pub(super) fn finished(&mut self) {
        self.restore_blocked = false;
        self.hold = false;
    }

    /// A request whose caller left was closed: restores may try again.
    pub(super) fn cancelled(&mut self) {
        self.restore_blocked = false;
    }

    /// The step's requests failed: nothing lone or blocked is remembered.
    pub(super) fn step_failed(&mut self) {
        self.lonely = None;
        self.restore_blocked = false;
    }

    /// `seq` got memory: a later refusal starts its patience afresh.
    pub(super) fn got_room(&mut self, seq: SeqId) {
        if self.lonely.is_some_and(|l| l.seq == seq) {
            self.lonely = None;
        }
    }

    /// `seq`, alone (nothing else running), was refused memory with `g` at `now`: the pause
    /// before it is tried again, or `None` where it fails. Tried again while the refusal
    /// [`may_fit_later`] and `seq` has been refused for less than its patience (counted for
    /// that sequence: one that left meanwhile leaves nothing behind for the next), the pause
    /// doubling from 2 ms up to [`LONELY_PAUSE`]. Its opening, its restore and its steps all
    /// count: a lone request short of room waits the same way at each.
    pub(super) fn retry_alone(
        &mut self,
        seq: SeqId,
        g: Option<&GovernorError>,
        now: Instant,
    ) -> Option<Duration> {
        if !may_fit_later(g) {
            return None;
        }
        self.retry_lone(seq, now)
    }

    /// [`Policy::retry_alone`] for a refusal that may fit later.
    fn retry_lone(&mut self, seq: SeqId, now: Instant) -> Option<Duration> {
        let tries = match &mut self.lonely {
            Some(l) if l.seq == seq => {
                if now.saturating_duration_since(l.since) >= self.lonely_for {
                    return None;
                }
                l.tries += 1;
                l.tries
            }
            _ => {
                self.lonely = Some(Lonely {
                    seq,
                    since: now,
                    tries: 1,
                });
                1
            }
        };
        Some(Duration::from_millis(1 << tries.min(6)).min(LONELY_PAUSE))
    }

    /// A step found a sequence still held by a step given up, at `now`: whether to try the
    /// same step again shortly (for [`BUSY_FOR`] in all) rather than fail it.
    fn busy(&mut self, now: Instant) -> bool {
        let since = *self.busy_since.get_or_insert(now);
        now.saturating_duration_since(since) < BUSY_FOR
    }

    /// The decision table of a step of `running` requests that failed with `failure` at
    /// `now` (`lone`: the one request, where only one runs), first row that applies:
    ///
    /// | failure | running | action |
    /// |---|---|---|
    /// | `Preempted(seq)` | any | park that request; pressure, restores wait for a finish |
    /// | `Short` | more than one | shed the newest; pressure |
    /// | `Busy`, for less than [`BUSY_FOR`] | any | the same step again after [`BUSY_PAUSE`] |
    /// | `Short { later: true }`, within the patience | one | it again, after a pause ([`Policy::retry_alone`]) |
    /// | anything else | any | every request fails |
    pub(super) fn failed_step(
        &mut self,
        failure: Failure,
        running: usize,
        lone: Option<SeqId>,
        now: Instant,
    ) -> Action {
        if failure != Failure::Busy {
            self.busy_since = None;
        }
        let action = match failure {
            Failure::Preempted(seq) => {
                self.preempted();
                return Action::Park(seq);
            }
            Failure::Short { .. } if running > 1 => {
                self.pressure();
                return Action::ShedNewest;
            }
            Failure::Busy if self.busy(now) => return Action::Again(BUSY_PAUSE),
            Failure::Short { later: true } => lone
                .filter(|_| running == 1)
                .and_then(|seq| self.retry_lone(seq, now))
                .map(Action::RetryAlone),
            _ => None,
        };
        action.unwrap_or_else(|| {
            self.step_failed();
            Action::FailAll
        })
    }
}

#[cfg(test)]
mod tests {
    use procmem_actors::procmem::kv::KvError;
    use procmem_actors::procmem::ledger::{Denial, Ledger};
    use procmem_actors::procmem::MemoryError;

    use super::*;

    /// A step refused because a mapping call met `ENOMEM` (the process's mappings at
    /// `vm.max_map_count`: the serving bench's q8_0 row failed 25 of 95 requests on it) is
    /// pressure, which the loop answers by starting the newest request over; another OS error
    /// is a fault.
    #[test]
    fn the_os_out_of_room_for_mappings_is_pressure() {
        let os = |errno| MemoryError::Os {
            op: "mmap(PROT_NONE, MAP_FIXED) over a decommitted range",
            source: std::io::Error::from_raw_os_error(errno),
        };
        let nomem = ModelError::Prepare(KvStoreError::Kv(KvError::Memory(os(libc::ENOMEM))));
        assert!(short_of_room(&nomem));
        let direct = ModelError::Prepare(KvStoreError::Memory(os(libc::ENOMEM)));
        assert!(short_of_room(&direct));
        let other = ModelError::Prepare(KvStoreError::Memory(os(libc::EINVAL)));
        assert!(!short_of_room(&other));
        assert!(!short_of_room(&ModelError::Device(os(libc::ENOMEM))));
    }

    /// A denial of `asked` bytes by an authority of `capacity`.
    fn denial(asked: u64, capacity: u64) -> Box<Denial> {
        let authority = Ledger::new().add_authority("host", capacity);
        Box::new(Denial {
            authority,
            authority_name: "host".into(),
            asked,
            capacity,
            approved: 0,
            waiting: 0,
            top_holders: Vec::new(),
            during_commit: false,
        })
    }

    fn deadline() -> GovernorError {
        GovernorError::DeadlineExpired(denial(1, 1))
    }

    #[test]
    fn pressure_holds_admission_until_a_finish_or_calm_steps() {
        let mut p = Policy::default();
        assert!(p.may_admit(3, 0, 8));
        assert!(!p.may_admit(3, 1, 8), "parked requests come back first");
        assert!(!p.may_admit(8, 0, 8), "the batch is full");
        p.pressure();
        assert!(!p.may_admit(3, 0, 8));
        assert!(
            p.may_admit(0, 0, 8),
            "with nothing running, admission is never held"
        );
        for _ in 1..CALM_STEPS {
            p.stepped();
        }
        assert!(!p.may_admit(3, 0, 8), "one step short of calm");
        p.stepped();
        assert!(p.may_admit(3, 0, 8));
        p.open_refused();
        assert!(!p.may_admit(3, 0, 8));
        p.finished();
        assert!(p.may_admit(3, 0, 8), "a finish gives its room back");
    }

    #[test]
    fn restores_wait_for_a_finish_after_a_preemption() {
        let mut p = Policy::default();
        assert!(p.may_restore(2, 8));
        p.preempted();
        assert!(!p.may_restore(2, 8));
        assert!(p.may_restore(0, 8), "alone, a restore always tries");
        for _ in 0..CALM_STEPS {
            p.stepped();
        }
        assert!(!p.may_restore(2, 8), "calm steps do not unblock restores");
        p.cancelled();
        assert!(p.may_restore(2, 8));
        p.restore_refused();
        assert!(!p.may_restore(2, 8));
        p.finished();
        assert!(p.may_restore(2, 8));
        assert!(!p.may_restore(8, 8), "the batch is full");
    }

    #[test]
    fn a_lone_request_is_retried_with_doubling_pauses_for_a_while_then_fails() {
        let mut p = Policy::default();
        let t0 = Instant::now();
        let g = deadline();
        let pauses: Vec<_> = (0..8)
            .map(|i| p.retry_alone(7, Some(&g), t0 + Duration::from_millis(i)))
            .collect();
        let ms: Vec<u64> = pauses
            .iter()
            .map(|d| d.unwrap().as_millis() as u64)
            .collect();
        assert_eq!(ms, [2, 4, 8, 16, 32, 50, 50, 50]);
        assert_eq!(
            p.retry_alone(7, Some(&g), t0 + LONELY_FOR),
            None,
            "its patience is time"
        );
        // Another sequence starts afresh; one that got room too.
        assert_eq!(
            p.retry_alone(8, Some(&g), t0 + LONELY_FOR),
            Some(Duration::from_millis(2))
        );
        p.got_room(8);
        assert_eq!(
            p.retry_alone(8, Some(&g), t0 + 2 * LONELY_FOR),
            Some(Duration::from_millis(2))
        );
        p.stepped();
        assert_eq!(
            p.retry_alone(8, Some(&g), t0 + 3 * LONELY_FOR),
            Some(Duration::from_millis(2)),
            "a step that went through ends the count"
        );
    }

    #[test]
    fn a_refusal_no_wait_mends_is_never_retried() {
        let mut p = Policy::default();
        let now = Instant::now();
        let over = GovernorError::Ledger(LedgerError::Denied(denial(10, 5)));
        assert_eq!(p.retry_alone(1, Some(&over), now), None);
        assert_eq!(p.retry_alone(1, None, now), None, "not a refusal of room");
        let within = GovernorError::Ledger(LedgerError::Denied(denial(5, 10)));
        assert!(p.retry_alone(1, Some(&within), now).is_some());
    }

    #[test]
    fn a_busy_step_waits_a_while_from_its_first_busy_answer() {
        let mut p = Policy::default();
        let t0 = Instant::now();
        let again = Action::Again(BUSY_PAUSE);
        assert_eq!(p.failed_step(Failure::Busy, 2, None, t0), again);
        assert_eq!(
            p.failed_step(Failure::Busy, 2, None, t0 + BUSY_FOR / 2),
            again
        );
        assert_eq!(
            p.failed_step(Failure::Busy, 2, None, t0 + BUSY_FOR),
            Action::FailAll,
            "its wait is over"
        );
        p.stepped();
        assert_eq!(
            p.failed_step(Failure::Busy, 2, None, t0 + BUSY_FOR),
            again,
            "a new wait starts afresh after a step went through"
        );
        assert_eq!(
            p.failed_step(Failure::Fault, 2, None, t0 + 2 * BUSY_FOR),
            Action::FailAll
        );
        assert_eq!(
            p.failed_step(Failure::Busy, 2, None, t0 + 2 * BUSY_FOR),
            again,
            "and after any other outcome"
        );
    }

    #[test]
    fn the_decision_table_row_by_row() {
        let now = Instant::now();
        let short = Failure::Short { later: true };
        let never = Failure::Short { later: false };
        // A preempted sequence parks its request, whatever runs; admission and restores wait.
        let mut p = Policy::default();
        assert_eq!(
            p.failed_step(Failure::Preempted(4), 3, None, now),
            Action::Park(4)
        );
        assert!(!p.may_admit(2, 0, 8) && !p.may_restore(2, 8));
        assert_eq!(
            p.failed_step(Failure::Preempted(4), 1, Some(4), now),
            Action::Park(4)
        );
        // Short of room with others running: the newest goes, and admission waits.
        let mut p = Policy::default();
        assert_eq!(p.failed_step(short, 2, None, now), Action::ShedNewest);
        assert_eq!(p.failed_step(never, 5, None, now), Action::ShedNewest);
        assert!(!p.may_admit(1, 0, 8));
        // Alone and short of room: tried again after a pause, until its patience is out.
        let mut p = Policy::new(Duration::from_secs(1));
        assert_eq!(
            p.failed_step(short, 1, Some(9), now),
            Action::RetryAlone(Duration::from_millis(2))
        );
        assert_eq!(
            p.failed_step(short, 1, Some(9), now + Duration::from_millis(10)),
            Action::RetryAlone(Duration::from_millis(4))
        );
        assert_eq!(
            p.failed_step(short, 1, Some(9), now + Duration::from_secs(1)),
            Action::FailAll
        );
        // Alone, refused more than the whole capacity (or the OS out of mappings): no retry.
        let mut p = Policy::default();
        assert_eq!(p.failed_step(never, 1, Some(9), now), Action::FailAll);
        // Any other fault fails every request, lone or not, and forgets the lone patience.
        let mut p = Policy::default();
        assert!(matches!(
            p.failed_step(short, 1, Some(9), now),
            Action::RetryAlone(_)
        ));
        assert_eq!(
            p.failed_step(Failure::Fault, 1, Some(9), now),
            Action::FailAll
        );
        assert_eq!(
            p.failed_step(short, 1, Some(9), now + Duration::from_secs(30)),
            Action::RetryAlone(Duration::from_millis(2)),
            "a new patience after the failure"
        );
        assert_eq!(p.failed_step(Failure::Fault, 3, None, now), Action::FailAll);
    }

    #[test]
    fn errors_are_classed_by_what_the_scheduler_can_do() {
        use procmem_actors::kv::PreemptMode;
        let table = |e| ModelError::Prepare(KvStoreError::Table(e));
        assert_eq!(
            Failure::of(&table(TableError::Preempted(3, PreemptMode::Swap))),
            Failure::Preempted(3)
        );
        assert_eq!(Failure::of(&table(TableError::Busy(3))), Failure::Busy);
        assert_eq!(Failure::of(&table(TableError::Unknown(3))), Failure::Fault);
        let kv_late = ModelError::Prepare(KvStoreError::Governor(deadline()));
        assert_eq!(Failure::of(&kv_late), Failure::Short { later: true });
        let weights_late = ModelError::Weights(ResidencyError::Provider(ProviderError::Governor(
            GovernorError::Busy { waiting: 1 },
        )));
        assert_eq!(Failure::of(&weights_late), Failure::Short { later: true });
        let too_big = ModelError::Prepare(KvStoreError::Governor(GovernorError::Ledger(
            LedgerError::Denied(denial(10, 5)),
        )));
        assert_eq!(Failure::of(&too_big), Failure::Short { later: false });
        assert_eq!(Failure::of(&ModelError::EmptyPrompt(1)), Failure::Fault);
    }
}
