//! An endpoint's counters over all its connections, live and closed: what
//! [`Endpoint::stats`](crate::Endpoint::stats) reports (and what a metrics exporter reads).
//!
//! Nothing here is on a call's path: each connection keeps counting in its own
//! [`Counters`](super::Counters), the endpoint keeps a weak reference to every live
//! connection, and a connection's counts move to the closed total when it is dropped.
//! A report sums the two.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Weak;

use parking_lot::Mutex;

use super::{Shared, Stats};

/// What the connections of one endpoint counted.
#[derive(Default)]
pub(crate) struct Totals {
    live: Mutex<HashMap<u64, Weak<Shared>>>,
    /// Counts of the connections dropped so far.
    closed: Mutex<Stats>,
    opened: AtomicU64,
}

impl Totals {
    pub(super) fn open(&self, shared: &std::sync::Arc<Shared>) {
        self.opened.fetch_add(1, Ordering::Relaxed);
        self.live
            .lock()
            .insert(shared.id, std::sync::Arc::downgrade(shared));
    }

    /// A connection's last counts, as it is dropped.
    pub(super) fn close(&self, id: u64, last: Stats) {
        self.live.lock().remove(&id);
        add_counts(&mut self.closed.lock(), &last);
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
        }
        EndpointStats {
            connections_open: live.iter().filter(|s| !s.is_closed()).count() as u64,
            connections_total: self.opened.load(Ordering::Relaxed),
            totals,
        }
    }
}

/// Adds `s`'s counts to `to` (not `in_flight_in`, which is a level, not a count).
fn add_counts(to: &mut Stats, s: &Stats) {
    to.calls_out += s.calls_out;
    to.calls_in += s.calls_in;
    to.errors_in += s.errors_in;
    to.bytes_out += s.bytes_out;
    to.bytes_in += s.bytes_in;
}

/// An endpoint's counters: its connections, and the sums of their [`Stats`] (those of
/// connections already closed included; `in_flight_in` is the open ones' only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct EndpointStats {
    /// Connections open now.
    pub connections_open: u64,
    /// Connections made or accepted since the endpoint was built.
    pub connections_total: u64,
    /// The connections' counters, summed.
    pub totals: Stats,
}
