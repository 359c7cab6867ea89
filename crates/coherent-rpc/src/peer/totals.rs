//! An endpoint's counters over all its connections, live and closed: what
//! [`Endpoint::stats`](crate::Endpoint::stats) reports (and what a metrics exporter reads),
//! and the endpoint-wide bounds that need them: the accepted connections' slots
//! ([`Config::max_connections`]) and the queued bytes' budget ([`Config::queue_budget`]).
//!
//! Nothing here is on a call's path but one atomic add per frame queued for the writer
//! task: each connection keeps counting in its own [`Counters`](super::Counters), the
//! endpoint keeps a weak reference to every live connection, and a connection's counts
//! move to the closed total when it is dropped. A report sums the two.
//!
//! [`Config::max_connections`]: crate::Config::max_connections
//! [`Config::queue_budget`]: crate::Config::queue_budget

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::config::Trust;
use crate::error::{ErrorCode, RpcError};

use super::{Shared, Stats};

/// What the connections of one endpoint counted, and its endpoint-wide bounds.
pub(crate) struct Totals {
    live: Mutex<HashMap<u64, Weak<Shared>>>,
    /// Counts of the connections dropped so far.
    closed: Mutex<Stats>,
    opened: AtomicU64,
    /// Connections not yet closed, made or accepted: what the budget is shared among.
    open: AtomicUsize,
    /// Accepted connections holding a [`Slot`], in their handshake or open.
    accepted: AtomicUsize,
    max_connections: usize,
    /// The last of `max_connections` that only trusted connections may take.
    trusted_reserve: usize,
    /// Bytes queued for the writer tasks of all connections (see `Shared::queued`).
    queued: AtomicUsize,
    queued_peak: AtomicUsize,
    budget: usize,
    /// Whether a thread is choosing a connection to close for the budget: one at a time.
    shedding: AtomicBool,
    refusals: Refusals,
}

/// Counts of what the endpoint refused, each a field of [`EndpointStats`].
#[derive(Default)]
pub(crate) struct Refusals {
    pub(crate) connections_refused: AtomicU64,
    pub(crate) calls_refused: AtomicU64,
    pub(crate) connections_shed: AtomicU64,
    pub(crate) accept_errors: AtomicU64,
    pub(crate) origins_refused: AtomicU64,
    pub(crate) calls_paced: AtomicU64,
}

/// An accepted connection's place under [`Config::max_connections`](crate::Config):
/// taken before its handshake, given back when it closes (or fails its handshake).
pub(crate) struct Slot(Arc<Totals>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.accepted.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Totals {
    pub(crate) fn new(max_connections: usize, trusted_reserve: usize, budget: usize) -> Self {
        Self {
            live: Mutex::default(),
            closed: Mutex::default(),
            opened: AtomicU64::new(0),
            open: AtomicUsize::new(0),
            accepted: AtomicUsize::new(0),
            max_connections,
            trusted_reserve,
            queued: AtomicUsize::new(0),
            queued_peak: AtomicUsize::new(0),
            budget,
            shedding: AtomicBool::new(false),
            refusals: Refusals::default(),
        }
    }

    pub(crate) fn refusals(&self) -> &Refusals {
        &self.refusals
    }

    /// The most connections untrusted clients may hold: `max_connections` less the
    /// trusted reserve.
    pub(crate) fn untrusted_max(&self) -> usize {
        self.max_connections - self.trusted_reserve
    }

    /// A slot for a newly accepted connection, or the refusal to send it when the endpoint
    /// has `max_connections` already.
    pub(crate) fn take_slot(self: &Arc<Self>, trust: Trust) -> Result<Slot, RpcError> {
        let max = match trust {
            Trust::Trusted => self.max_connections,
            Trust::Untrusted => self.max_connections - self.trusted_reserve,
        };
        let mut n = self.accepted.load(Ordering::Acquire);
        loop {
            if n >= max {
                self.refusals
                    .connections_refused
                    .fetch_add(1, Ordering::Relaxed);
                return Err(RpcError::new(
                    ErrorCode::Overloaded,
                    match trust {
                        Trust::Trusted => format!(
                            "this endpoint has its maximum of {} connections open",
                            self.max_connections
                        ),
                        Trust::Untrusted => format!(
                            "this endpoint has {max} connections open, the most it takes from \
                             untrusted clients ({} more are kept for its tiers)",
                            self.trusted_reserve
                        ),
                    },
                ));
            }
            match self
                .accepted
                .compare_exchange_weak(n, n + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(Slot(self.clone())),
                Err(now) => n = now,
            }
        }
    }

    pub(super) fn open(&self, shared: &Arc<Shared>) {
        self.opened.fetch_add(1, Ordering::Relaxed);
        self.open.fetch_add(1, Ordering::Relaxed);
        self.live.lock().insert(shared.id, Arc::downgrade(shared));
    }

    /// A connection closed (its first shutdown, or its drop if it never shut down).
    pub(super) fn closing(&self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }

    /// A connection's last counts, as it is dropped.
    pub(super) fn close(&self, id: u64, last: Stats) {
        self.live.lock().remove(&id);
        add_counts(&mut self.closed.lock(), &last);
    }

    /// Counts `bytes` more queued; returns whether the sum is now over the budget.
    #[inline]
    pub(super) fn queue(&self, bytes: usize) -> bool {
        let now = self.queued.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if now > self.queued_peak.load(Ordering::Relaxed) {
            self.queued_peak.fetch_max(now, Ordering::Relaxed);
        }
        now > self.budget
    }

    /// Counts `bytes` written (or dropped) off the queues.
    #[inline]
    pub(super) fn dequeue(&self, bytes: usize) {
        self.queued.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Whether a connection holding `own` queued bytes is to refuse new calls: the sum is
    /// over the budget and it holds more than its share of it.
    pub(super) fn over_fair_share(&self, own: usize) -> bool {
        self.queued.load(Ordering::Relaxed) > self.budget
            && own > self.budget / self.open.load(Ordering::Relaxed).max(1)
    }

    /// The sum is over the budget: closes the open connection that holds the most queued
    /// bytes, unless the open ones together are within it (the excess is in the queues of
    /// connections already closing, on their way out).
    #[cold]
    pub(super) fn shed(&self) {
        if self.shedding.swap(true, Ordering::Acquire) {
            return;
        }
        // Upgraded under the lock, dropped after it: a last handle dropped here would
        // take the lock again (in `close`).
        let live: Vec<_> = self
            .live
            .lock()
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        let mut sum = 0usize;
        let mut largest: Option<(usize, &Arc<Shared>)> = None;
        for s in live.iter().filter(|s| !s.is_closed()) {
            let q = s.queued.load(Ordering::Relaxed);
            sum += q;
            if largest.is_none_or(|(most, _)| q > most) {
                largest = Some((q, s));
            }
        }
        if let Some((q, victim)) = largest.filter(|_| sum > self.budget) {
            self.refusals
                .connections_shed
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                queued = q,
                budget = self.budget,
                "closing the connection holding the most queued bytes: the endpoint's send queues are over budget"
            );
            victim.abandon(RpcError::new(
                ErrorCode::Overloaded,
                format!(
                    "the endpoint's send queues are over their budget of {} bytes, and this \
                     connection held the most ({q} bytes): is the other side reading?",
                    self.budget
                ),
            ));
        }
        self.shedding.store(false, Ordering::Release);
        drop(live);
    }

    pub(crate) fn report(&self) -> EndpointStats {
        let live: Vec<_> = self
            .live
            .lock()
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        let mut totals = *self.closed.lock();
        // The upgraded connections cannot close into `closed` while held here, so none is
        // counted twice; one whose last handle is being dropped right now may be in
        // neither, so a sum may dip for one report (an exporter's counter keeps its maximum).
        for shared in &live {
            let s = shared.stats();
            add_counts(&mut totals, &s);
            totals.in_flight_in += s.in_flight_in;
            totals.queued_bytes += s.queued_bytes;
        }
        let r = &self.refusals;
        EndpointStats {
            connections_open: live.iter().filter(|s| !s.is_closed()).count() as u64,
            connections_total: self.opened.load(Ordering::Relaxed),
            totals,
            connections_refused: r.connections_refused.load(Ordering::Relaxed),
            calls_refused: r.calls_refused.load(Ordering::Relaxed),
            connections_shed: r.connections_shed.load(Ordering::Relaxed),
            accept_errors: r.accept_errors.load(Ordering::Relaxed),
            origins_refused: r.origins_refused.load(Ordering::Relaxed),
            calls_paced: r.calls_paced.load(Ordering::Relaxed),
            queued_bytes: self.queued.load(Ordering::Relaxed) as u64,
            queued_bytes_peak: self.queued_peak.load(Ordering::Relaxed) as u64,
        }
    }
}

/// Adds `s`'s counts to `to` (not `in_flight_in` nor `queued_bytes`, which are levels, not
/// counts); the peak is the largest.
fn add_counts(to: &mut Stats, s: &Stats) {
    to.calls_out += s.calls_out;
    to.calls_in += s.calls_in;
    to.errors_in += s.errors_in;
    to.bytes_out += s.bytes_out;
    to.bytes_in += s.bytes_in;
    to.queued_bytes_peak = to.queued_bytes_peak.max(s.queued_bytes_peak);
}

/// An endpoint's counters: its connections, the sums of their [`Stats`] (those of
/// connections already closed included; `in_flight_in` and `queued_bytes` are the open
/// ones' only, `queued_bytes_peak` is the largest of one connection), and what its bounds
/// refused (see [`Config`](crate::Config)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct EndpointStats {
    /// Connections open now.
    pub connections_open: u64,
    /// Connections made or accepted since the endpoint was built.
    pub connections_total: u64,
    /// The connections' counters, summed.
    pub totals: Stats,
    /// Connections refused because the endpoint had its
    /// [`max_connections`](crate::Config::max_connections) open.
    pub connections_refused: u64,
    /// Calls answered `Overloaded` at once: over
    /// [`max_inbound_calls`](crate::Config::max_inbound_calls) on their connection, or
    /// on a connection over its share of the [`queue_budget`](crate::Config::queue_budget).
    pub calls_refused: u64,
    /// Connections closed because the endpoint's queued bytes went over its
    /// [`queue_budget`](crate::Config::queue_budget) and they held the most.
    pub connections_shed: u64,
    /// Failed accepts on the endpoint's listeners (out of file descriptors, connections
    /// reset before they were accepted...).
    pub accept_errors: u64,
    /// WebSocket upgrades refused for their `Origin` (see
    /// [`allowed_origins`](crate::Config::allowed_origins)).
    pub origins_refused: u64,
    /// Calls of untrusted connections that waited before they started, held to
    /// [`untrusted_call_rate`](crate::Config::untrusted_call_rate) or to the rate their
    /// address shares (see [`crate::pace`]).
    pub calls_paced: u64,
    /// Bytes queued for sending over all connections now, in bytes.
    pub queued_bytes: u64,
    /// The most bytes queued for sending over all connections at once, since the endpoint
    /// was built.
    pub queued_bytes_peak: u64,
}
