//! Pressure tickets: how a Governor asks holders of every kind for memory back.

use procmem::ledger::{AuthorityId, HolderId, Priority};
use ractor::DerivedActorRef;
use tokio::time::Instant;

/// Identity of one pressure ticket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TicketId(pub(crate) u64);

impl TicketId {
    /// The raw number, for logs.
    pub fn get(self) -> u64 {
        self.0
    }
}

/// "Please free up to `bytes_wanted` by `deadline`." The holder decides what, if anything,
/// to free (0 bytes is a valid answer) and answers with [`PressureTicket::report`].
#[derive(Debug, Clone)]
pub struct PressureTicket {
    /// Which ticket.
    pub id: TicketId,
    /// The pool under pressure.
    pub authority: AuthorityId,
    /// The holder asked.
    pub holder: HolderId,
    /// Bytes the Governor would like back.
    pub bytes_wanted: u64,
    /// Priority of the request waiting for them.
    pub priority: Priority,
    /// After this the Governor stops waiting for the answer.
    pub deadline: Instant,
    // Where the answer goes: a derived reference, so tickets know nothing of the Governor's
    // own messages.
    pub(crate) answer_to: DerivedActorRef<PressureReport>,
}

#[cfg(feature = "cluster")]
impl ractor::Message for PressureTicket {}

impl PressureTicket {
    /// Answers the ticket: bytes freed now (their lease releases already sent, before this
    /// report), and bytes that will be released once a fence completes. The report tells the
    /// Governor what is still to come, so it does not ask others for the same bytes.
    pub fn report(&self, freed_now: u64, freed_pending_fence: u64) {
        let _ = self.answer_to.send_message(PressureReport {
            ticket: self.id,
            holder: self.holder,
            freed_now,
            freed_pending_fence,
        });
    }
}

/// A holder's answer to a ticket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PressureReport {
    /// The ticket answered.
    pub ticket: TicketId,
    /// Who answered.
    pub holder: HolderId,
    /// Bytes released already.
    pub freed_now: u64,
    /// Bytes that will be released after their fences complete.
    pub freed_pending_fence: u64,
}

#[cfg(feature = "cluster")]
impl ractor::Message for PressureReport {}

/// How a Governor reaches a holder of any kind: a derived reference of any actor whose
/// message type converts from [`PressureTicket`].
pub type TicketInbox = DerivedActorRef<PressureTicket>;
