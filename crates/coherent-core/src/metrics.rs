//! Counters a registry keeps, and the snapshot it reports. Hits are counted on the stripe of the
//! table lock they entered (a cache line the hit already writes), never in one shared hot counter.

use crossbeam_utils::CachePadded;

use crate::sync::{AtomicU64, Ordering};

#[derive(Default)]
pub(crate) struct Counters {
    misses: CachePadded<AtomicU64>,
    invalidations: CachePadded<AtomicU64>,
    evictions: AtomicU64,
}

impl Counters {
    pub(crate) fn record_miss(&self) {
        self.misses.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn record_invalidation(&self) {
        self.invalidations.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn record_evictions(&self, n: usize) {
        self.evictions.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self, hits: u64, entries: usize) -> Metrics {
        Metrics {
            hits,
            misses: self.misses.load(Ordering::Relaxed),
            invalidations: self.invalidations.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            entries,
        }
    }
}

/// A snapshot of a [`Registry`](crate::Registry)'s counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Metrics {
    /// Calls answered from a consistent cached result.
    pub hits: u64,
    /// Calls that ran the method body (including recomputations after invalidation).
    pub misses: u64,
    /// Computeds invalidated, counting each one once, cascades included.
    pub invalidations: u64,
    /// Entries removed by pruning (expired, invalidated, or over capacity).
    pub evictions: u64,
    /// Entries held by the registry's tables right now.
    pub entries: usize,
}

impl Metrics {
    /// The counts accumulated since `earlier` (entries stay as they are now).
    #[must_use]
    pub fn since(&self, earlier: &Metrics) -> Metrics {
        Metrics {
            hits: self.hits.saturating_sub(earlier.hits),
            misses: self.misses.saturating_sub(earlier.misses),
            invalidations: self.invalidations.saturating_sub(earlier.invalidations),
            evictions: self.evictions.saturating_sub(earlier.evictions),
            entries: self.entries,
        }
    }
}
