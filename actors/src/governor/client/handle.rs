//! [`GovernorHandle`]: what a holder calls its Governor through. (Starting a Governor is the
//! server's: `GovernorHandle::spawn` and its kin are defined there.)

use std::fmt;
use std::sync::Arc;

use procmem::ledger::{AuthorityId, HolderId, Priority, Retired};

use super::account::Account;
use super::lease::{GovernorMsg, Grant};
use super::route::Route;
use crate::governor::protocol::{GovernorError, GovernorSnapshot, ReserveRequest, Upstream};
use crate::ticket::TicketInbox;

/// A cheap, cloneable handle to one authority's Governor. It reaches whichever Governor
/// actor serves the authority now: a supervised Governor that died is replaced behind it.
#[derive(Clone)]
pub struct GovernorHandle {
    pub(in crate::governor) account: Arc<Account>,
    authority: AuthorityId,
    /// The authority's name (its metrics' label).
    name: Arc<str>,
    /// From a reserve call to its grant.
    grant_latency: ::metrics::Histogram,
}

impl fmt::Debug for GovernorHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GovernorHandle")
            .field("authority", &self.authority)
            .field("actor", &self.route().actor().map(|a| a.get_id()))
            .finish()
    }
}

impl GovernorHandle {
    /// A handle to the Governor of `authority` that `account`'s route reaches.
    pub(in crate::governor) fn new(
        account: Arc<Account>,
        authority: AuthorityId,
        name: &str,
    ) -> Self {
        GovernorHandle {
            account,
            authority,
            name: name.into(),
            grant_latency: procmem::metrics::GOVERNOR_GRANT_SECONDS.histogram(&[name]),
        }
    }

    fn route(&self) -> &Route {
        self.account.route()
    }

    /// The Governor actor serving the authority now (for tests that kill it, and for
    /// supervision).
    pub fn actor(&self) -> ractor::ActorCell {
        self.route()
            .actor()
            .expect("a handle exists only once its Governor was spawned")
    }

    /// Stops the Governor on purpose (its supervisor, if any, does not restart it).
    pub fn stop(&self) {
        self.account.stop();
    }

    /// The authority it keeps the books of.
    pub fn authority(&self) -> AuthorityId {
        self.authority
    }

    /// The authority's name, as its metrics are labelled.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Registers a holder. With an inbox, it receives pressure tickets and is watched: if
    /// its actor dies, its grants return at once.
    pub async fn register_holder(
        &self,
        name: impl Into<String>,
        priority: Priority,
        inbox: Option<TicketInbox>,
    ) -> Result<HolderId, GovernorError> {
        let name = name.into();
        self.route()
            .ask(|reply| GovernorMsg::RegisterHolder {
                name,
                priority,
                inbox,
                reply,
            })
            .await?
            .map_err(Into::into)
    }

    /// Retires a holder: grants return now, leases as their memory is freed.
    pub async fn unregister_holder(&self, holder: HolderId) -> Result<Retired, GovernorError> {
        self.route()
            .ask(|reply| GovernorMsg::UnregisterHolder {
                holder,
                reply: Some(reply),
            })
            .await?
            .map_err(Into::into)
    }

    /// Asks for a provisional grant; waits for room until the request's deadline.
    pub async fn reserve(&self, request: ReserveRequest) -> Result<Grant, GovernorError> {
        let asked = std::time::Instant::now();
        let grant = self
            .route()
            .ask(|reply| GovernorMsg::Reserve { request, reply })
            .await??;
        self.grant_latency.record(asked.elapsed().as_secs_f64());
        Ok(grant)
    }

    /// Makes the capacity credit from `upstream` (a node Governor's link): waiters beyond it
    /// are asked of the upstream, not of the holders. `None` makes the Governor govern alone.
    pub fn set_upstream(&self, upstream: Option<Upstream>) {
        self.route().set_upstream(upstream);
        let _ = self.route().cast(GovernorMsg::Nudge);
    }

    /// Sets the capacity.
    pub async fn set_capacity(&self, bytes: u64) -> Result<(), GovernorError> {
        self.route()
            .ask(|reply| GovernorMsg::SetCapacity {
                bytes,
                reply: Some(reply),
            })
            .await
    }

    /// Tells the Governor its upstream ([`set_upstream`](Self::set_upstream))
    /// refused an ask, nobody there having room to give: for a ticket's time its own holders
    /// are asked for the whole shortfall, not only for what it holds over its capacity.
    pub fn upstream_refused(&self) {
        let _ = self.route().cast(GovernorMsg::UpstreamRefused);
    }

    /// The books and the queue.
    pub async fn snapshot(&self) -> Result<GovernorSnapshot, GovernorError> {
        self.route()
            .ask(|reply| GovernorMsg::Snapshot { reply })
            .await
    }
}
