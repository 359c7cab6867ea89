//! The registry: the capacity all of its tables share, the counters, and pruning. Pruning runs
//! in the caller that pushes the registry past a high-water mark (one at a time, never on the
//! hit path), first removing invalidated and expired entries, then, if the registry is still
//! over capacity, the least recently used entries that nothing else references.

use std::fmt;
use std::sync::atomic::{AtomicIsize, AtomicUsize};
use std::sync::OnceLock;

use crossbeam_utils::CachePadded;

use crate::clock;
use crate::metrics::{Counters, Metrics};
use crate::sync::{Arc, AtomicU64, Ordering, Weak};

/// What a table offers to the registry's pruning and metrics.
pub(crate) trait Prunable: Send + Sync {
    /// Removes invalidated entries and unreferenced entries unused for longer than their
    /// keep-alive. Returns how many were removed.
    fn prune_expired(&self, now: u32) -> usize;
    /// Appends the idle time (in ticks) of every entry that may be evicted.
    fn collect_idle(&self, now: u32, out: &mut Vec<u32>);
    /// Removes up to `budget` evictable entries idle for at least `min_idle` ticks.
    fn evict_idle(&self, now: u32, min_idle: u32, budget: &mut usize) -> usize;
    fn hits(&self) -> u64;
    /// Invalidates every entry (computing or consistent). Returns how many were invalidated.
    fn invalidate_all(&self) -> usize;
}

/// Where compute results live: a capacity shared by all the tables of the services created with
/// it, pruning, and the counters. Cloning is cheap and shares the registry.
///
/// ```
/// use coherent_core::Registry;
///
/// let registry = Registry::builder().capacity(10_000).build();
/// assert_eq!(registry.capacity(), 10_000);
/// assert_eq!(registry.metrics().entries, 0);
/// ```
#[derive(Clone)]
pub struct Registry {
    pub(crate) inner: Arc<RegistryInner>,
}

pub(crate) struct RegistryInner {
    capacity: usize,
    /// How many holders fence the registry now ([`Registry::fence`]); read by every hit,
    /// written only when a fence goes up or down, so it sits with the read-only fields.
    fences: AtomicUsize,
    /// Until when (on [`lease_clock`]) the cache may answer: the earliest of the holders'
    /// leases; `u64::MAX`: no lease.
    lease_until: std::sync::atomic::AtomicU64,
    /// Each holder's lease (holder, until): 0 is [`Registry::set_lease`]'s, the others
    /// [`Lease`]s. Written only when a lease is renewed or dropped.
    leases: parking_lot::Mutex<Vec<(u64, u64)>>,
    pub(crate) counters: Arc<Counters>,
    len: CachePadded<AtomicIsize>,
    inserts_since_prune: CachePadded<AtomicUsize>,
    tables: parking_lot::Mutex<Vec<Weak<dyn Prunable>>>,
    /// Held by the one caller that prunes; others skip pruning rather than wait.
    prune_lock: parking_lot::Mutex<()>,
}

static VERSIONS: AtomicU64 = AtomicU64::new(1);

/// The clock of leases ([`Registry::set_lease`]): nanoseconds on `CLOCK_MONOTONIC_COARSE`
/// on Linux (a few nanoseconds to read, millisecond resolution; it keeps counting while
/// the process is stopped), elsewhere since the first call.
#[inline]
pub fn lease_clock() -> u64 {
    #[cfg(target_os = "linux")]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant Linux has.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
        (ts.tv_sec as u64)
            .wrapping_mul(1_000_000_000)
            .wrapping_add(ts.tv_nsec as u64)
    }
    #[cfg(not(target_os = "linux"))]
    {
        static START: OnceLock<std::time::Instant> = OnceLock::new();
        START
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_nanos() as u64
    }
}

/// The version the next computed will get: every computed made from now on has at least it.
pub(crate) fn current_version() -> u64 {
    VERSIONS.load(Ordering::SeqCst)
}

/// The next process-wide computed version.
pub(crate) fn next_version() -> u64 {
    VERSIONS.fetch_add(1, Ordering::Relaxed)
}

/// Configures a [`Registry`].
#[derive(Clone, Debug)]
pub struct RegistryBuilder {
    capacity: usize,
}

impl RegistryBuilder {
    /// The number of entries the registry aims to stay under. Entries that a live computed
    /// depends on, or that a caller holds, are never evicted, so the bound is soft by exactly
    /// what the application itself keeps alive. Default: 100,000.
    #[must_use]
    pub fn capacity(mut self, capacity: usize) -> Self {
        self.capacity = capacity.max(1);
        self
    }

    /// Builds the registry.
    pub fn build(self) -> Registry {
        clock::start();
        Registry {
            inner: Arc::new(RegistryInner {
                capacity: self.capacity,
                fences: AtomicUsize::new(0),
                lease_until: std::sync::atomic::AtomicU64::new(u64::MAX),
                leases: parking_lot::Mutex::new(Vec::new()),
                counters: Arc::new(Counters::default()),
                len: CachePadded::new(AtomicIsize::new(0)),
                inserts_since_prune: CachePadded::new(AtomicUsize::new(0)),
                tables: parking_lot::Mutex::new(Vec::new()),
                prune_lock: parking_lot::Mutex::new(()),
            }),
        }
    }
}

impl Default for RegistryBuilder {
    fn default() -> Self {
        Self { capacity: 100_000 }
    }
}

impl Registry {
    /// A registry with the default settings.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Starts configuring a registry.
    pub fn builder() -> RegistryBuilder {
        RegistryBuilder::default()
    }

    /// The process-wide registry used by services that were not given one.
    pub fn global() -> &'static Registry {
        static GLOBAL: OnceLock<Registry> = OnceLock::new();
        GLOBAL.get_or_init(Registry::new)
    }

    /// The configured capacity.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// The number of entries held now.
    pub fn len(&self) -> usize {
        usize::try_from(self.inner.len.load(Ordering::Relaxed)).unwrap_or(0)
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A snapshot of the counters.
    pub fn metrics(&self) -> Metrics {
        let hits = self.live_tables().iter().map(|t| t.hits()).sum();
        self.inner.counters.snapshot(hits, self.len())
    }

    /// Prunes now: removes invalidated entries and unreferenced ones past their keep-alive, then,
    /// if still over capacity, the least recently used unreferenced ones. Returns how many
    /// entries were removed.
    pub fn prune(&self) -> usize {
        let _guard = self.inner.prune_lock.lock();
        self.prune_locked()
    }

    /// Invalidates every result of every table of this registry, and whatever depends on
    /// them (in other registries too); results being computed now are flagged and will not be
    /// cached. Every later call recomputes. For a cache that can no longer tell which of its
    /// entries are current: a host that lost track of the writes made elsewhere.
    /// Returns how many entries were invalidated (not counting dependants reached by cascade).
    pub fn invalidate_all(&self) -> usize {
        let n = self.live_tables().iter().map(|t| t.invalidate_all()).sum();
        tracing::debug!(target: "coherent::invalidate", n, "invalidated every entry");
        n
    }

    /// Fences the registry: until every fence is lifted ([`unfence`](Self::unfence)), no
    /// call answers from a cached result. A call that finds one consistent invalidates it
    /// (and its dependants) and computes anew; results computed meanwhile are stored as
    /// usual, but not answered from while the fence stands. For a cache that cannot tell
    /// whether its entries are current until something outside it catches up: a host of a
    /// cluster whose notifier is down, or that its peers have not yet counted in. Fences
    /// nest (each holder lifts its own). A hit pays one relaxed load for it.
    pub fn fence(&self) {
        self.inner.fences.fetch_add(1, Ordering::SeqCst);
    }

    /// Lifts one [`fence`](Self::fence); calls answer from the cache again once none is left.
    pub fn unfence(&self) {
        let _ = self
            .inner
            .fences
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    /// Whether a fence stands ([`fence`](Self::fence)), or the lease ran out
    /// ([`set_lease`](Self::set_lease)).
    #[inline]
    pub fn is_fenced(&self) -> bool {
        if self.inner.fences.load(Ordering::Relaxed) != 0 {
            return true;
        }
        let until = self.inner.lease_until.load(Ordering::Relaxed);
        until != u64::MAX && lease_clock() > until
    }

    /// Lets the cache answer until `until` (nanoseconds on [`lease_clock`]) and no longer:
    /// past it, the registry is fenced until the lease is renewed. For a cache whose
    /// holder must prove now and then that it still hears about every write (a host of a
    /// cluster, whose peers stop waiting for it after a deadline): a process paused past
    /// its lease (SIGSTOP, a stalled VM) answers nothing from its cache when it resumes,
    /// before it has run anything else. A hit pays a coarse clock read while a lease is
    /// set. A lease never moves back. This is the registry's own lease; another holder
    /// takes one of its own with [`lease`](Self::lease), and the cache answers only while
    /// every holder's lease runs.
    pub fn set_lease(&self, until: u64) {
        self.renew_lease(0, until);
    }

    /// Drops the lease of [`set_lease`](Self::set_lease): the cache answers without it
    /// (other holders' leases still count).
    pub fn clear_lease(&self) {
        self.drop_lease(0);
    }

    /// A lease of its own on this registry, beside the registry's own
    /// ([`set_lease`](Self::set_lease)) and other holders': the cache answers only while
    /// every holder's lease runs. It starts unset (it bounds nothing until renewed) and
    /// is dropped with the [`Lease`]. For two things that each must prove they still hear
    /// about every write, in one registry: a cluster host and a replica client whose
    /// computeds share it.
    pub fn lease(&self) -> Lease {
        static HOLDERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Lease {
            registry: self.clone(),
            holder: HOLDERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// How long the cache may still answer, in nanoseconds on [`lease_clock`]: 0 while a
    /// fence stands or a lease ran out, `None` when neither a fence nor a lease bounds it.
    pub fn lease_left(&self) -> Option<u64> {
        if self.inner.fences.load(Ordering::SeqCst) != 0 {
            return Some(0);
        }
        match self.inner.lease_until.load(Ordering::SeqCst) {
            u64::MAX => None,
            until => Some(until.saturating_sub(lease_clock())),
        }
    }

    /// How long the cache may still answer by its own lease ([`set_lease`](Self::set_lease))
    /// and its fences, leaving out other holders' ([`lease`](Self::lease)): 0 while fenced
    /// or past it, `None` when neither bounds it. What a replica server bounds its clients
    /// by: a client's own lease on the registry its server reads would bound itself.
    pub fn own_lease_left(&self) -> Option<u64> {
        if self.inner.fences.load(Ordering::SeqCst) != 0 {
            return Some(0);
        }
        let leases = self.inner.leases.lock();
        let (_, until) = leases.iter().find(|(h, _)| *h == 0)?;
        Some(until.saturating_sub(lease_clock()))
    }

    fn renew_lease(&self, holder: u64, until: u64) {
        let mut leases = self.inner.leases.lock();
        match leases.iter_mut().find(|(h, _)| *h == holder) {
            Some((_, at)) => *at = (*at).max(until),
            None => leases.push((holder, until)),
        }
        self.store_lease(&leases);
    }

    fn drop_lease(&self, holder: u64) {
        let mut leases = self.inner.leases.lock();
        leases.retain(|(h, _)| *h != holder);
        self.store_lease(&leases);
    }

    /// Publishes the earliest lease (under the lock, so that the last writer's is right).
    fn store_lease(&self, leases: &[(u64, u64)]) {
        let earliest = leases.iter().map(|(_, at)| *at).min().unwrap_or(u64::MAX);
        self.inner.lease_until.store(earliest, Ordering::SeqCst);
    }

    pub(crate) fn register_table(&self, table: Weak<dyn Prunable>) {
        let mut tables = self.inner.tables.lock();
        tables.retain(|t| t.strong_count() > 0);
        tables.push(table);
    }

    pub(crate) fn counters(&self) -> &Arc<Counters> {
        &self.inner.counters
    }

    /// Accounts for a new entry and prunes when the registry passes its high-water mark, or
    /// when enough inserts have happened that expired entries are worth sweeping.
    pub(crate) fn on_insert(&self) {
        let len = self.inner.len.fetch_add(1, Ordering::Relaxed) + 1;
        let inserts = self
            .inner
            .inserts_since_prune
            .fetch_add(1, Ordering::Relaxed)
            + 1;
        let capacity = self.inner.capacity;
        let slack = (capacity / 4).max(16);
        let over = usize::try_from(len).unwrap_or(0) > capacity + slack;
        if over || inserts > capacity.max(1024) {
            if let Some(_guard) = self.inner.prune_lock.try_lock() {
                self.prune_locked();
            }
        }
    }

    pub(crate) fn on_remove(&self, n: usize) {
        self.inner
            .len
            .fetch_sub(isize::try_from(n).unwrap_or(isize::MAX), Ordering::Relaxed);
    }

    fn live_tables(&self) -> Vec<Arc<dyn Prunable>> {
        self.inner
            .tables
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }

    fn prune_locked(&self) -> usize {
        self.inner.inserts_since_prune.store(0, Ordering::Relaxed);
        let now = clock::precise_now();
        let tables = self.live_tables();
        let mut removed: usize = tables.iter().map(|t| t.prune_expired(now)).sum();
        let capacity = self.inner.capacity;
        let len = self.len();
        if len > capacity {
            let mut idle = Vec::new();
            for table in &tables {
                table.collect_idle(now, &mut idle);
            }
            let excess = (len - capacity).min(idle.len());
            if excess > 0 {
                // The `excess`-th longest idle time is the cut: evict at least that idle.
                let cut = idle.len() - excess;
                let (_, threshold, _) = idle.select_nth_unstable(cut);
                let threshold = *threshold;
                let mut budget = excess;
                for table in &tables {
                    removed += table.evict_idle(now, threshold, &mut budget);
                }
            }
        }
        if removed > 0 {
            self.inner.counters.record_evictions(removed);
            tracing::debug!(target: "coherent::evict", removed, "pruned");
        }
        removed
    }
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

/// One holder's lease on a [`Registry`] ([`Registry::lease`]): the registry's cache answers
/// only until the time this lease was last renewed to (and every other holder's). Dropping
/// it takes the lease away.
pub struct Lease {
    registry: Registry,
    holder: u64,
}

impl Lease {
    /// Lets the cache answer until `until` (nanoseconds on [`lease_clock`]) as far as this
    /// holder is concerned. A lease never moves back.
    pub fn renew(&self, until: u64) {
        self.registry.renew_lease(self.holder, until);
    }

    /// Takes this holder's lease away until it is renewed again: the cache answers as far
    /// as this holder is concerned.
    pub fn clear(&self) {
        self.registry.drop_lease(self.holder);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.registry.drop_lease(self.holder);
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("holder", &self.holder)
            .finish()
    }
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("capacity", &self.inner.capacity)
            .field("len", &self.len())
            .finish()
    }
}
