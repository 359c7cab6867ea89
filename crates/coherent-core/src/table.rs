//! The per-method table of a service: arguments → the latest computed, behind a
//! thread-striped read-write lock (`striped.rs`). A hit is one hash, entering this thread's
//! stripe, one state load and a clone of the output: it writes no cache line that
//! another core's hits write. A miss inserts a computing entry before the body runs, so
//! concurrent misses for one key wait for that one body (single flight) and an invalidation
//! that arrives mid-computation finds the entry to flag (the race rule).

use std::hash::{BuildHasher, Hash};
use std::ptr::NonNull;

use crossbeam_utils::CachePadded;
use hashbrown::HashTable;

use crate::clock;
use crate::computed::{AbandonOnDrop, Computed, ComputedInner, Recompute};
use crate::node::{self, Node, Origin, COMPUTING, COMPUTING_INVALIDATED, CONSISTENT, INVALIDATED};
use crate::options::OutputKind;
use crate::registry::{next_version, Prunable, Registry};
use crate::service::MethodDescriptor;
use crate::striped::{ReadGuard, StripedRwLock};
use crate::sync::Arc;

/// No stored hash: every entry is 8 bytes smaller for it (issue 32), and the table hashes
/// each key again when it rehashes, under its write lock: when it grows (once per entry per
/// doubling), and when it rehashes in place to reclaim what evictions left. For a key
/// behind a pointer (a `String`) that is a cache miss per entry while hits wait; a key's
/// `Hash` runs under the lock as its `Eq` always did.
struct Entry<K, T> {
    key: K,
    computed: Arc<ComputedInner<T>>,
}

/// The results of one compute method of one service instance.
pub struct Table<K, T> {
    /// One lock for the whole table, not shards: with shards, the lock to take depends on the
    /// key's hash; with one, the processor takes the lock while it still hashes (measured: a
    /// hit 8-12% faster than with four shards). Shards would only let misses of different keys
    /// insert at once, and a miss holds the write lock just to insert an entry, never while its
    /// body runs. Hits are counted on the stripe the reader entered (see `Stripe::count_hit`).
    map: CachePadded<StripedRwLock<HashTable<Entry<K, T>>>>,
    hasher: foldhash::fast::RandomState,
    registry: Registry,
    method: &'static MethodDescriptor,
    classify: fn(&T) -> OutputKind,
    keep_alive_ticks: u32,
    /// The name and counters every computed of this table points to.
    origin: Arc<Origin>,
}

/// A cached value found by [`Table::hit`]: deref it, clone what it holds, drop it at once
/// (it may hold the table's read lock). Not `Send`: the lock is this thread's. Never hold it
/// across an `.await` or `mem::forget` it: every write to the table (a miss, a prune) would
/// wait for it, and a forgotten one for ever.
pub struct Hit<'a, K, T> {
    /// Into the computed that `_hold` keeps alive: its value is set once and never changes.
    value: NonNull<T>,
    _hold: Hold<'a, K, T>,
}

/// What keeps a hit's value alive and unchanged: held for its `Drop`, never read.
#[allow(dead_code)]
enum Hold<'a, K, T> {
    /// The table's read lock: no writer removes the entry (and its computed) meanwhile.
    Table(ReadGuard<'a, HashTable<Entry<K, T>>>),
    /// The computed itself (a hit inside a compute body, whose lock went before recording).
    Computed(Arc<ComputedInner<T>>),
}

impl<K, T> std::ops::Deref for Hit<'_, K, T> {
    type Target = T;

    #[inline(always)]
    fn deref(&self) -> &T {
        // SAFETY: `value` points into a computed's value, set before the computed became
        // consistent and never written again; `_hold` keeps that computed alive for as long
        // as this hit lives (see `Hold`).
        unsafe { self.value.as_ref() }
    }
}

enum Found<T> {
    Ready(Arc<ComputedInner<T>>),
    /// Consistent or computing, but begun before a call made while the registry is fenced:
    /// invalidated (outside the lock; a computation is flagged, and born invalidated),
    /// then again.
    Fenced(Arc<ComputedInner<T>>),
    Wait(Arc<ComputedInner<T>>),
    Own(Arc<ComputedInner<T>>),
}

impl<K, T> Table<K, T>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    T: Clone + Send + Sync + 'static,
{
    pub(crate) fn new(
        registry: Registry,
        method: &'static MethodDescriptor,
        classify: fn(&T) -> OutputKind,
    ) -> Self {
        Self {
            map: CachePadded::new(StripedRwLock::new(HashTable::new())),
            hasher: foldhash::fast::RandomState::default(),
            method,
            classify,
            keep_alive_ticks: clock::to_ticks(method.options().keep_alive),
            origin: Origin::new(method.name(), registry.counters().clone()),
            registry,
        }
    }

    /// A consistent cached result, held for the caller to clone out of it and drop at once:
    /// `if let Some(hit) = table.hit(&key) { return T::clone(&hit); }`. Outside a compute
    /// body it holds the table's read lock (this thread's stripe: a plain store releases
    /// it), so the value is cloned straight from the table into the caller's answer, once;
    /// answering `Option<T>` instead moved the value through two or three temporaries whose
    /// partial stores stalled the loads that copied them on (a third of a hit). Inside a
    /// compute body it holds the computed instead, the lock released and the dependency
    /// recorded. Always inlined.
    #[inline(always)]
    pub fn hit(&self, key: &K) -> Option<Hit<'_, K, T>> {
        let hash = self.hasher.hash_one(key);
        let map = self.map.read();
        let computed = &map.find(hash, |e| e.key == *key)?.computed;
        if computed.node.state() != CONSISTENT || self.registry.is_fenced() {
            return None;
        }
        // A consistent computed has its value.
        let value = NonNull::from(computed.output()?);
        computed.node.touch(clock::now());
        map.stripe().count_hit();
        tracing::trace!(target: "coherent::hit", method = self.method.name());
        if crate::context::is_capturing() {
            return Some(Self::hit_while_capturing(computed.clone(), value, map));
        }
        Some(Hit {
            value,
            _hold: Hold::Table(map),
        })
    }

    /// A hit inside a compute body: records the dependency after the table lock is released
    /// (recording may cascade an invalidation, which must never run under a table lock).
    #[cold]
    #[inline(never)]
    fn hit_while_capturing<'a>(
        computed: Arc<ComputedInner<T>>,
        value: NonNull<T>,
        map: ReadGuard<'a, HashTable<Entry<K, T>>>,
    ) -> Hit<'a, K, T> {
        drop(map);
        computed.record_use();
        Hit {
            value,
            _hold: Hold::Computed(computed),
        }
    }

    /// The slow path of a call: waits for a running computation of the same key, or runs the
    /// body.
    pub async fn compute<F, Fut>(&self, key: K, body: F) -> T
    where
        F: FnOnce(K) -> Fut,
        Fut: std::future::Future<Output = T>,
    {
        let computed = self.resolve(key, body).await;
        computed
            .output()
            .expect("a resolved computed holds its output")
            .clone()
    }

    /// Like [`compute`](Self::compute), but answers with the computed itself; `input` tells
    /// it how to call the method again (for [`Computed::update`]).
    pub async fn computed<F, Fut>(
        &self,
        key: K,
        input: impl FnOnce(&K) -> Recompute<T>,
        body: F,
    ) -> Computed<T>
    where
        F: FnOnce(K) -> Fut,
        Fut: std::future::Future<Output = T>,
    {
        let input = input(&key);
        Computed::from_inner(self.resolve(key, body).await, input)
    }

    async fn resolve<F, Fut>(&self, key: K, body: F) -> Arc<ComputedInner<T>>
    where
        F: FnOnce(K) -> Fut,
        Fut: std::future::Future<Output = T>,
    {
        let hash = self.hasher.hash_one(&key);
        let mut body = Some(body);
        // While the registry is fenced, only a result whose computation began after this
        // call did may answer it (computeds are numbered as they are made): one that began
        // earlier may have read the database before a write this call must see.
        let fenced_since = self
            .registry
            .is_fenced()
            .then(crate::registry::current_version);
        loop {
            let mut inserted = false;
            // The version a new one replaces, dropped after the table lock: its output's drop
            // is the user's code.
            let mut replaced = None;
            let found = {
                let mut map = self.map.write();
                let new_computed = || ComputedInner::new(self.new_node());
                match map.find_mut(hash, |e| e.key == key) {
                    Some(entry) => match entry.computed.node.state() {
                        CONSISTENT | COMPUTING
                            if fenced_since.is_some_and(|v| entry.computed.node.version() < v) =>
                        {
                            Found::Fenced(entry.computed.clone())
                        }
                        CONSISTENT => Found::Ready(entry.computed.clone()),
                        COMPUTING | COMPUTING_INVALIDATED => Found::Wait(entry.computed.clone()),
                        _ => {
                            let computed = new_computed();
                            if !entry.computed.node.is_settled() {
                                // Its cascade may still run on another thread: an
                                // invalidation of the new version must not return first.
                                computed.node.inherit(entry.computed.clone());
                            }
                            replaced =
                                Some(std::mem::replace(&mut entry.computed, computed.clone()));
                            Found::Own(computed)
                        }
                    },
                    None => {
                        let computed = new_computed();
                        let entry = Entry {
                            key: key.clone(),
                            computed: computed.clone(),
                        };
                        map.insert_unique(hash, entry, |e| self.hasher.hash_one(&e.key));
                        inserted = true;
                        Found::Own(computed)
                    }
                }
            };
            drop(replaced);
            // A computation this call owns is abandoned (its waiters retry) if this call ends
            // before its body runs: a prune below may drop user values, which may panic.
            let mut owned = match &found {
                Found::Own(computed) => AbandonOnDrop(Some(computed.clone() as _)),
                _ => AbandonOnDrop(None),
            };
            if inserted {
                // Outside the table lock: this may prune, which takes table locks.
                self.registry.on_insert();
            }
            match found {
                Found::Ready(computed) => {
                    computed.node.touch(clock::now());
                    self.map.local_stripe().count_hit();
                    computed.record_use();
                    return computed;
                }
                Found::Fenced(computed) => {
                    node::invalidate(&*computed);
                }
                Found::Wait(computed) => {
                    computed
                        .node
                        .wait_for(|s| s == CONSISTENT || s == INVALIDATED)
                        .await;
                    // A result born invalidated is only for the callers that started before the
                    // invalidation; one who merely waited cannot know it did, so it retries.
                    if computed.node.state() == CONSISTENT {
                        computed.record_use();
                        return computed;
                    }
                }
                Found::Own(computed) => {
                    self.registry.counters().record_miss();
                    let body = body.take().expect("a call owns at most one computation");
                    let body = body(key);
                    // `run` abandons it from here on.
                    owned.0 = None;
                    computed
                        .run(body, self.method.options(), self.classify)
                        .await;
                    computed.record_use();
                    return computed;
                }
            }
        }
    }

    fn new_node(&self) -> Node {
        Node::new(self.origin.clone(), next_version(), clock::now())
    }

    fn find(&self, key: &K) -> Option<Arc<ComputedInner<T>>> {
        let hash = self.hasher.hash_one(key);
        let map = self.map.read();
        map.find(hash, |e| e.key == *key)
            .map(|e| e.computed.clone())
    }

    /// Invalidates the result for `key` (computing or consistent) and everything depending on
    /// it. Returns `false` when there was nothing to invalidate.
    pub fn invalidate(&self, key: &K) -> bool {
        // Cloned out first: the cascade must not run under the table lock.
        match self.find(key) {
            Some(computed) => node::invalidate(&*computed),
            None => false,
        }
    }

    /// The cached computed for `key`, in whatever state it is, without calling the method;
    /// `input` tells it how to call the method again (for [`Computed::update`]).
    pub fn existing(&self, key: &K, input: impl FnOnce(&K) -> Recompute<T>) -> Option<Computed<T>> {
        self.find(key)
            .filter(|c| c.node.is_done() && c.output().is_some())
            .map(|c| Computed::from_inner(c, input(key)))
    }

    fn is_evictable(entry: &Entry<K, T>) -> bool {
        // Only the table holds it: no dependant, no caller, no running body.
        entry.computed.node.state() == CONSISTENT
            && Arc::strong_count(&entry.computed) == 1
            // Evicting it would drop its link to a previous version whose cascade still
            // runs, and a later write to the key could then return before that cascade.
            && !entry.computed.node.inherits_unsettled()
    }

    fn remove_where(&self, mut remove: impl FnMut(&Entry<K, T>) -> bool) -> usize {
        let dropped: Vec<Entry<K, T>> = {
            let mut map = self.map.write();
            map.extract_if(|e| remove(e)).collect()
        };
        let removed = dropped.len();
        // Dropped here, outside the lock: dropping a computed releases its dependencies.
        drop(dropped);
        self.registry.on_remove(removed);
        removed
    }
}

impl<K, T> Prunable for Table<K, T>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    T: Clone + Send + Sync + 'static,
{
    fn prune_expired(&self, now: u32) -> usize {
        let keep_alive = self.keep_alive_ticks;
        self.remove_where(|e| {
            // An invalidated entry whose cascade still runs stays: a new version of its key
            // must inherit it (see `resolve`).
            (e.computed.node.state() == INVALIDATED && e.computed.node.is_settled())
                || (Self::is_evictable(e)
                    && now.saturating_sub(e.computed.node.last_used()) >= keep_alive)
        })
    }

    fn collect_idle(&self, now: u32, out: &mut Vec<u32>) {
        let map = self.map.read();
        out.extend(
            map.iter()
                .filter(|e| Self::is_evictable(e))
                .map(|e| now.saturating_sub(e.computed.node.last_used())),
        );
    }

    fn evict_idle(&self, now: u32, min_idle: u32, budget: &mut usize) -> usize {
        self.remove_where(|e| {
            if *budget > 0
                && Self::is_evictable(e)
                && now.saturating_sub(e.computed.node.last_used()) >= min_idle
            {
                *budget -= 1;
                true
            } else {
                false
            }
        })
    }

    fn hits(&self) -> u64 {
        self.map.hits()
    }

    fn invalidate_all(&self) -> usize {
        // Cloned out first: the cascades must not run under the table lock.
        let all: Vec<Arc<ComputedInner<T>>> = {
            let map = self.map.read();
            map.iter().map(|e| e.computed.clone()).collect()
        };
        // Every entry, even if a callback panics on the way: the first panic is raised
        // once all are invalidated.
        let mut panic = None;
        let mut n = 0;
        for c in &all {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| node::invalidate(&**c)))
            {
                Ok(invalidated) => n += usize::from(invalidated),
                Err(payload) => {
                    n += 1;
                    panic.get_or_insert(payload);
                }
            }
        }
        drop(all);
        if let Some(payload) = panic {
            std::panic::resume_unwind(payload);
        }
        n
    }
}

impl<K, T> Drop for Table<K, T> {
    fn drop(&mut self) {
        let len = self.map.get_mut().len();
        self.registry.on_remove(len);
    }
}
