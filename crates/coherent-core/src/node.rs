//! The type-erased heart of a computed: its consistency state machine and its edges in the
//! dependency graph. Everything that must be right under concurrency lives here, behind the
//! `sync` shim, so that it can be model-checked on its own.
//!
//! States: `COMPUTING` → `CONSISTENT` → `INVALIDATED`, with a detour for the race rule: a
//! computed invalidated while its body still runs becomes `COMPUTING_INVALIDATED`, and is born
//! `INVALIDATED` when the body completes. Every transition into an invalidated state is a
//! compare-and-swap, so each computed is invalidated, and its callbacks run, exactly once.
//!
//! The cascade is complete when any invalidating call returns, not only the one that won a
//! computed's compare-and-swap: a caller that finds a computed invalidated but not yet
//! *settled* (its cascade may still be running on another thread) walks its dependants itself
//! rather than wait for that thread (waiting could deadlock: a callback may invalidate again,
//! and two cascades may each hold what the other reaches). A computed's dependant list is
//! frozen once it is invalidated (`add_dependant` refuses), so a walk that has reached every
//! computed its walked computeds list has invalidated the closure of each, and settles them:
//! later callers stop there, and the lists are released.

use crate::metrics::Counters;
use std::collections::HashSet;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use smallvec::SmallVec;

use crate::sync::{Arc, AtomicBool, AtomicU32, AtomicU8, Mutex, Ordering, Weak};

pub(crate) const COMPUTING: u8 = 0;
pub(crate) const COMPUTING_INVALIDATED: u8 = 1;
pub(crate) const CONSISTENT: u8 = 2;
pub(crate) const INVALIDATED: u8 = 3;

/// What every computed is to the dependency graph, whatever its value type.
pub(crate) trait AnyComputed: Send + Sync + 'static {
    fn node(&self) -> &Node;
}

/// A callback run once, when the computed is invalidated.
pub(crate) type InvalidationCallback = Box<dyn FnOnce() + Send>;

/// Names an invalidation callback registered on a computed, to take it back with
/// [`Computed::remove_invalidation_callback`](crate::Computed::remove_invalidation_callback).
/// Unique in the process (keys are never reused), so a stale key or one of another computed
/// removes nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallbackKey(u64);

/// Hands out callback keys. A std atomic even under loom: it orders nothing (keys are taken
/// under the edge lock, which orders them per node), it only makes them unique.
static NEXT_CALLBACK_KEY: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn next_callback_key() -> CallbackKey {
    CallbackKey(NEXT_CALLBACK_KEY.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// Where computeds come from: the method (or state) name and the registry's counters, shared
/// by every computed of one table instead of copied into each (issue 32: a cached result in
/// as few bytes as can be).
pub(crate) struct Origin {
    pub(crate) name: &'static str,
    pub(crate) counters: Arc<Counters>,
}

impl Origin {
    pub(crate) fn new(name: &'static str, counters: Arc<Counters>) -> Arc<Self> {
        Arc::new(Self { name, counters })
    }
}

/// `repr(C)`: the fields a hit reads (`state`, `last_used`) come first, so that they sit right
/// after the value in `ComputedInner` and a hit reads adjacent cache lines.
///
/// 48 bytes on 64-bit targets (asserted in the tests): what every computed needs inline is its state, its last
/// use, its version, where it comes from and its edge lock. Its edges (dependencies,
/// dependants, callbacks, an inherited version) are allocated when the first one comes: a
/// leaf nobody depends on and nobody watches has none. The waiters' `Notify` is allocated
/// by the first task that waits.
#[repr(C)]
pub(crate) struct Node {
    state: AtomicU8,
    /// Invalidated, and every computed that depends on it, transitively, is invalidated too
    /// (see [`invalidate`]). Written under the edge lock; read without it by callers that
    /// may stop their walk here. It fills padding: `Node` keeps its size.
    settled: AtomicBool,
    /// The computed's output is stored (see `ComputedInner::set_output`): set once, with
    /// `Release`, after the output is written. It fills padding too.
    has_output: AtomicBool,
    /// Coarse clock tick of the last use, written only when the tick changes.
    last_used: AtomicU32,
    version: u64,
    origin: Arc<Origin>,
    /// A short critical section, never held across `.await` or while calling out. `None`
    /// until the first edge or callback: never reset to `None` after that.
    edges: Mutex<Option<Box<Edges>>>,
    /// Wakes tasks waiting for completion or invalidation; they re-check the state in a loop.
    /// Made by the first waiter; see [`Node::wake`] for why no wake-up is lost meanwhile.
    #[cfg(not(loom))]
    notify: once_cell::race::OnceBox<tokio::sync::Notify>,
}

#[derive(Default)]
struct Edges {
    /// Strong: a dependency lives as long as a computed that used it, so that invalidating it
    /// still reaches this computed.
    dependencies: Dependencies,
    /// Weak: a dependant that was dropped or recomputed is not kept alive by its inputs.
    dependants: SmallVec<[Weak<dyn AnyComputed>; 1]>,
    /// Length of `dependants` after the last compaction; the list is compacted when it doubles.
    compacted_len: usize,
    /// In the order they were registered, so keys ascend (each is taken under this lock) and
    /// a removal finds its entry by binary search. A removed callback is dropped at once and
    /// leaves a `None` until the list is compacted (see [`Node::add_callback`]): a vector of
    /// pairs, not a map, keeps `Node` its size and a computed with one callback one small
    /// allocation.
    callbacks: Vec<(CallbackKey, Option<InvalidationCallback>)>,
    /// The version this one replaced while its cascade still ran ([`Node::inherit`]):
    /// walked with the dependants, held (strongly: it can be checked without an upgrade, so
    /// under a table lock) until this one is invalidated or dropped, or let go of by
    /// [`Node::release_inherited`].
    inherited: Option<Arc<dyn AnyComputed>>,
}

/// A computed's dependencies, the first one inline: most computeds read one input, and a
/// separate buffer for it would cost an allocation of 80 bytes and a cache miss when the
/// cascade releases it. The same for dependants.
type Dependencies = SmallVec<[Arc<dyn AnyComputed>; 1]>;

/// A computed holds its dependencies (and the version it inherited) strongly, so dropping the
/// last holder of a long chain (a table holding a million results, each computed from the
/// one before) would drop the chain by recursion, a stack frame per link, and overflow the
/// stack. Instead, the outermost drop on a thread drains a list that the nested drops only
/// append to: the depth stays one link.
impl Drop for Edges {
    fn drop(&mut self) {
        let mut released = std::mem::take(&mut self.dependencies);
        released.extend(self.inherited.take());
        if !released.is_empty() {
            drop_iteratively(released);
        }
    }
}

#[cfg(not(loom))]
fn drop_iteratively(released: Dependencies) {
    use std::cell::RefCell;
    thread_local! {
        /// The drops queued by the outermost [`drop_iteratively`] running on this thread.
        static QUEUED: RefCell<Option<Vec<Arc<dyn AnyComputed>>>> = const { RefCell::new(None) };
    }
    /// Ends the outermost drop, also when a value's own `Drop` panics: later drops on this
    /// thread must not queue for a loop that is gone.
    struct Outermost;
    impl Drop for Outermost {
        fn drop(&mut self) {
            let left = QUEUED.try_with(|queued| queued.borrow_mut().take());
            drop(left);
        }
    }
    let outermost = QUEUED.try_with(move |queued| {
        let mut queued = queued.borrow_mut();
        match queued.as_mut() {
            // A drop inside the outermost one's loop: queued, not dropped here.
            Some(queue) => {
                queue.extend(released);
                None
            }
            None => {
                *queued = Some(Vec::new());
                Some(released)
            }
        }
    });
    // `Err`: this thread's locals are being torn down; `released` went by plain recursion.
    let Ok(Some(released)) = outermost else {
        return;
    };
    let _outermost = Outermost;
    // Dropped with no borrow held: a last reference dropped here queues its own edges.
    drop(released);
    // Two buffers in turn: the batch being dropped, and the queue its drops fill.
    let mut batch = Vec::new();
    loop {
        QUEUED.with(|queued| {
            if let Some(queue) = queued.borrow_mut().as_mut() {
                std::mem::swap(queue, &mut batch);
            }
        });
        if batch.is_empty() {
            break;
        }
        batch.clear();
    }
}

/// Loom's model runs its threads on one OS thread, so a thread-local queue would be shared
/// between them: the models' chains are short, dropped by recursion.
#[cfg(loom)]
fn drop_iteratively(released: Dependencies) {
    drop(released);
}

/// How many computeds ahead of the one it works on a cascade asks for: a walk over dependants
/// spread through memory (a million of them, out of every cache) would otherwise wait for each
/// one's cache misses in turn, since the reference-count updates between them are locked
/// instructions that let no later load start early.
const PREFETCH_AHEAD: usize = 8;

/// Asks the processor to bring the line holding a computed's reference counts (`data` is the
/// pointer an `Arc` or `Weak` of it holds; the counts lie just before it) into cache. A hint:
/// it reads nothing and never faults, whatever the address. One line, not also the node's
/// next one: a second prefetch made the 10K cascade slower and the 1M one no faster.
#[inline(always)]
fn prefetch(data: *const ()) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let data = data.cast::<i8>();
        // SAFETY: a prefetch dereferences nothing.
        #[allow(unused_unsafe)]
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(data.wrapping_sub(16));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// Drops a released dependant list, asking for each entry's counts a few entries ahead.
fn release_dependants(list: SmallVec<[Weak<dyn AnyComputed>; 1]>) {
    let mut rest = list.into_iter();
    loop {
        if let Some(ahead) = rest.as_slice().get(PREFETCH_AHEAD) {
            prefetch(Weak::as_ptr(ahead).cast());
        }
        match rest.next() {
            Some(dependant) => drop(dependant),
            None => break,
        }
    }
}

impl Edges {
    /// Queues the live dependants (kept: another caller may need to walk them until the node
    /// settles). `true` when there is none.
    fn queue_dependants(&self, pending: &mut Vec<Arc<dyn AnyComputed>>) -> bool {
        let before = pending.len();
        let dependants = &self.dependants[..];
        pending.reserve(dependants.len());
        for (i, dependant) in dependants.iter().enumerate() {
            if let Some(ahead) = dependants.get(i + PREFETCH_AHEAD) {
                prefetch(Weak::as_ptr(ahead).cast());
            }
            pending.extend(dependant.upgrade());
        }
        pending.extend(
            self.inherited
                .iter()
                .filter(|p| !p.node().is_settled())
                .cloned(),
        );
        pending.len() == before
    }
}

/// The edges of a node that has one, allocated on first need ([`Node::edges`]).
fn edges_of(slot: &mut Option<Box<Edges>>) -> &mut Edges {
    slot.get_or_insert_with(Box::default)
}

impl Node {
    pub(crate) fn new(origin: Arc<Origin>, version: u64, now: u32) -> Self {
        Self {
            state: AtomicU8::new(COMPUTING),
            settled: AtomicBool::new(false),
            has_output: AtomicBool::new(false),
            last_used: AtomicU32::new(now),
            version,
            origin,
            edges: Mutex::new(None),
            #[cfg(not(loom))]
            notify: once_cell::race::OnceBox::new(),
        }
    }

    #[inline]
    pub(crate) fn state(&self) -> u8 {
        self.state.load(Ordering::Acquire)
    }

    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    /// Whether the output is stored; `Acquire`: the output's bytes are visible after `true`.
    #[inline]
    pub(crate) fn has_output(&self) -> bool {
        self.has_output.load(Ordering::Acquire)
    }

    /// Records that the output is stored (after it was written; once).
    pub(crate) fn mark_output(&self) {
        self.has_output.store(true, Ordering::Release);
    }

    pub(crate) fn name(&self) -> &'static str {
        self.origin.name
    }

    pub(crate) fn is_invalidated(&self) -> bool {
        matches!(self.state(), COMPUTING_INVALIDATED | INVALIDATED)
    }

    pub(crate) fn is_done(&self) -> bool {
        matches!(self.state(), CONSISTENT | INVALIDATED)
    }

    #[inline]
    pub(crate) fn touch(&self, now: u32) {
        // A plain store on every hit would bounce the cache line between readers of one key;
        // the comparison keeps it shared until the tick changes.
        if self.last_used.load(Ordering::Relaxed) != now {
            self.last_used.store(now, Ordering::Relaxed);
        }
    }

    pub(crate) fn last_used(&self) -> u32 {
        self.last_used.load(Ordering::Relaxed)
    }

    /// Marks a computing node as done. The value must be stored before this call. Returns the
    /// final state: `INVALIDATED` if a dependency was invalidated while the body ran.
    pub(crate) fn complete(&self) -> u8 {
        let outcome = match self.state.compare_exchange(
            COMPUTING,
            CONSISTENT,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => CONSISTENT,
            Err(_) => {
                // Only an invalidation can have moved us off COMPUTING; its cascade has run.
                self.state.store(INVALIDATED, Ordering::Release);
                let released = self
                    .edges
                    .lock()
                    .as_mut()
                    .map(|e| std::mem::take(&mut e.dependencies));
                drop(released);
                INVALIDATED
            }
        };
        self.wake();
        outcome
    }

    /// Marks a node whose body will never finish (cancelled or panicked) as invalidated, so that
    /// tasks waiting on it retry instead of hanging.
    pub(crate) fn abandon(this: &dyn AnyComputed) {
        if this.node().state() == COMPUTING {
            invalidate(this);
        }
        let node = this.node();
        node.state.store(INVALIDATED, Ordering::Release);
        let released = node
            .edges
            .lock()
            .as_mut()
            .map(|e| std::mem::take(&mut e.dependencies));
        drop(released);
        node.wake();
    }

    /// Moves the node into an invalidated state; `true` for the one caller that did it.
    fn begin_invalidation(&self) -> bool {
        let mut current = self.state.load(Ordering::Acquire);
        loop {
            let next = match current {
                COMPUTING => COMPUTING_INVALIDATED,
                CONSISTENT => INVALIDATED,
                _ => return false,
            };
            match self
                .state
                .compare_exchange(current, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(actual) => current = actual,
            }
        }
    }

    /// The second half of an invalidation won by this caller: take the callbacks (and the
    /// dependencies, unless the body still runs) under the lock, queue the dependants for the
    /// walk, then wake waiters and run the callbacks outside the lock. A callback that panics
    /// does not stop the cascade: its panic is kept for the caller (the first one), and
    /// raised when the walk is done. Returns `true` if the node settled at once (no
    /// dependants: nothing left to walk).
    fn finish_invalidation(
        &self,
        pending: &mut Vec<Arc<dyn AnyComputed>>,
        panic: &mut Option<Box<dyn std::any::Any + Send>>,
    ) -> bool {
        let (callbacks, dependencies, settled) = {
            let mut slot = self.edges.lock();
            match slot.as_mut() {
                // No edges: nothing to walk, release or call.
                None => {
                    self.settled.store(true, Ordering::Release);
                    (Vec::new(), Default::default(), true)
                }
                Some(edges) => {
                    let dependencies = if self.state.load(Ordering::Acquire) == INVALIDATED {
                        std::mem::take(&mut edges.dependencies)
                    } else {
                        // The body still runs and may add more; `complete` releases them.
                        Dependencies::new()
                    };
                    let settled = edges.queue_dependants(pending);
                    let released = if settled {
                        self.settled.store(true, Ordering::Release);
                        // Only dropped dependants left: their memory goes now.
                        edges.compacted_len = 0;
                        (
                            std::mem::take(&mut edges.dependants),
                            edges.inherited.take(),
                        )
                    } else {
                        (Default::default(), None)
                    };
                    (
                        std::mem::take(&mut edges.callbacks),
                        (dependencies, released),
                        settled,
                    )
                }
            }
        };
        self.origin.counters.record_invalidation();
        tracing::debug!(target: "coherent::invalidate", method = self.origin.name, version = self.version, "invalidated");
        self.wake();
        for (_, callback) in callbacks {
            if let Some(callback) = callback {
                if let Err(payload) = catch_unwind(AssertUnwindSafe(callback)) {
                    panic.get_or_insert(payload);
                }
            }
        }
        drop(dependencies);
        settled
    }

    /// Queues the dependants of a node another caller invalidated and may still be walking:
    /// this caller walks them too. Nothing if it has settled meanwhile.
    fn help_invalidation(&self, pending: &mut Vec<Arc<dyn AnyComputed>>) {
        let edges = self.edges.lock();
        if let (false, Some(edges)) = (self.is_settled(), edges.as_ref()) {
            edges.queue_dependants(pending);
        }
    }

    /// Marks an invalidated node whose closure is invalidated as settled, and releases its
    /// dependant list: no walk needs it any more.
    fn settle(&self) {
        let released = {
            let mut slot = self.edges.lock();
            self.settled.store(true, Ordering::Release);
            slot.as_mut().map(|edges| {
                edges.compacted_len = 0;
                (
                    std::mem::take(&mut edges.dependants),
                    edges.inherited.take(),
                )
            })
        };
        if let Some((dependants, inherited)) = released {
            release_dependants(dependants);
            drop(inherited);
        }
    }

    /// Invalidated, with its whole cascade done.
    #[inline]
    pub(crate) fn is_settled(&self) -> bool {
        self.settled.load(Ordering::Acquire)
    }

    /// Makes `previous`, the version of the same key or state this node replaces, walked
    /// with this one's dependants: an invalidation of this version that returns while the
    /// cascade of `previous` still runs on another thread would leave what was computed
    /// from `previous` consistent after the later write returned. A settled `previous`
    /// stops the walk at once. Called on a node nobody else can see yet (so not
    /// invalidated).
    pub(crate) fn inherit(&self, previous: Arc<dyn AnyComputed>) {
        edges_of(&mut self.edges.lock()).inherited = Some(previous);
    }

    /// Lets go of the inherited version once the caller saw it settle.
    pub(crate) fn release_inherited(&self) {
        let inherited = self.edges.lock().as_mut().and_then(|e| e.inherited.take());
        drop(inherited);
    }

    /// Holds an inherited version whose cascade still runs: dropping this node now (an
    /// eviction) would lose the link. Takes the edge lock; drops nothing, so a table may
    /// ask under its own lock.
    pub(crate) fn inherits_unsettled(&self) -> bool {
        let edges = self.edges.lock();
        edges
            .as_ref()
            .and_then(|e| e.inherited.as_ref())
            .is_some_and(|p| !p.node().is_settled())
    }

    /// Records `dependant` as a user of this node. Returns `false` when this node is already
    /// invalidated: the dependant was built on a stale input and must be invalidated too.
    fn add_dependant(&self, dependant: Weak<dyn AnyComputed>) -> bool {
        // What the compaction upgraded, dropped after the lock: the last reference to a
        // dependant may be one of these, and its drop must not run under this node's lock.
        let mut upgraded = Vec::new();
        let mut slot = self.edges.lock();
        // Checked under the lock: an invalidation flips the state first and then takes the
        // list under this lock, so either it sees our entry or we see its state.
        if self.is_invalidated() {
            return false;
        }
        let edges = edges_of(&mut slot);
        edges.dependants.push(dependant);
        let len = edges.dependants.len();
        if len >= 16 && len >= 2 * edges.compacted_len {
            // Dependants that were dropped or already settled need no notification; without
            // this, a long-lived input read by churning dependants would grow without bound.
            edges.dependants.retain(|w| match w.upgrade() {
                Some(d) => {
                    let keep = !d.node().is_settled();
                    upgraded.push(d);
                    keep
                }
                None => false,
            });
            edges.compacted_len = edges.dependants.len();
        }
        drop(slot);
        drop(upgraded);
        true
    }

    fn add_dependency(&self, dependency: Arc<dyn AnyComputed>) {
        let mut slot = self.edges.lock();
        if self.state.load(Ordering::Acquire) != INVALIDATED {
            edges_of(&mut slot).dependencies.push(dependency);
        }
    }

    /// Registers a callback run once on invalidation; runs it now if that already happened
    /// (its key then names nothing).
    pub(crate) fn add_callback(&self, callback: InvalidationCallback) -> CallbackKey {
        {
            let mut slot = self.edges.lock();
            // Checked under the lock, as in `add_dependant`: an invalidation flips the state
            // before it takes the list, so either it runs this callback or we do.
            if !self.is_invalidated() {
                let key = next_callback_key();
                let callbacks = &mut edges_of(&mut slot).callbacks;
                if callbacks.len() == callbacks.capacity() && callbacks.len() >= 8 {
                    // Full: drop what removals left behind before growing. When that frees
                    // under half, grow anyway, so that the next compaction is at least as
                    // many registrations away as it costs (amortized O(1) per call); when
                    // it leaves the list mostly empty, give the memory back.
                    callbacks.retain(|(_, c)| c.is_some());
                    let (len, capacity) = (callbacks.len(), callbacks.capacity());
                    if len > capacity / 2 {
                        callbacks.reserve(len);
                    } else if len < capacity / 4 {
                        callbacks.shrink_to(2 * len);
                    }
                }
                callbacks.push((key, Some(callback)));
                return key;
            }
        }
        callback();
        next_callback_key()
    }

    /// Takes back the callback registered under `key`, unless the invalidation took it first
    /// (it has run, or runs now on the invalidating thread). `true`: it will never run.
    pub(crate) fn remove_callback(&self, key: CallbackKey) -> bool {
        let removed = {
            let mut slot = self.edges.lock();
            let Some(edges) = slot.as_mut() else {
                return false;
            };
            let callbacks = &mut edges.callbacks;
            let removed = callbacks
                .binary_search_by_key(&key.0, |(k, _)| k.0)
                .ok()
                .and_then(|i| callbacks[i].1.take());
            while callbacks.last().is_some_and(|(_, c)| c.is_none()) {
                callbacks.pop();
            }
            if callbacks.is_empty() && callbacks.capacity() > 0 {
                *callbacks = Vec::new();
            }
            removed
        };
        // Dropped outside the lock: what the closure owns may do anything when dropped.
        removed.is_some()
    }

    /// How many callbacks are registered and waiting for the invalidation.
    pub(crate) fn callback_count(&self) -> usize {
        let edges = self.edges.lock();
        edges.as_ref().map_or(0, |e| {
            e.callbacks.iter().filter(|(_, c)| c.is_some()).count()
        })
    }

    /// How many entries the callback list holds, removed ones not compacted yet included.
    #[cfg(test)]
    fn callback_slots(&self) -> usize {
        self.edges.lock().as_ref().map_or(0, |e| e.callbacks.len())
    }

    pub(crate) fn dependency_count(&self) -> usize {
        self.edges
            .lock()
            .as_ref()
            .map_or(0, |e| e.dependencies.len())
    }

    /// Wakes the waiters after a change of state. The state was written before this call and
    /// a waiter makes the `Notify` before it reads the state: with a sequentially consistent
    /// fence on both sides (here and in [`Node::wait_for`]), either this call sees the waiter's
    /// `Notify`, or the waiter sees the new state. A `Notified` made before `notify_waiters`
    /// is woken by it, registered or not (tokio's guarantee).
    #[cfg(not(loom))]
    fn wake(&self) {
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if let Some(notify) = self.notify.get() {
            notify.notify_waiters();
        }
    }

    #[cfg(loom)]
    fn wake(&self) {}

    /// Waits until `done(state)` holds.
    #[cfg(not(loom))]
    pub(crate) async fn wait_for(&self, done: impl Fn(u8) -> bool) {
        let notify = self
            .notify
            .get_or_init(|| Box::new(tokio::sync::Notify::new()));
        loop {
            let notified = notify.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the check, so a transition between the check and the await
            // still wakes us; the fence pairs with the one in `wake`.
            notified.as_mut().enable();
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            if done(self.state()) {
                return;
            }
            notified.await;
        }
    }
}

/// Invalidates `start` and, transitively, everything that depends on it. Iterative, so that a
/// long chain of dependants cannot overflow the stack. Returns `false` if it was already invalid.
///
/// When it returns, every computed that depends on `start` is invalidated, whether this call
/// invalidated `start` or found it invalidated by another whose cascade still runs: it then
/// walks what is not settled itself (see the module's documentation). Callbacks run once, on
/// the thread that invalidated their computed: a callback of a computed another thread
/// invalidated may still be running when this returns.
pub(crate) fn invalidate(start: &dyn AnyComputed) -> bool {
    let node = start.node();
    let won = node.begin_invalidation();
    if !won && node.is_settled() {
        return false;
    }
    let mut pending = Vec::new();
    let mut panic = None;
    let settled = if won {
        node.finish_invalidation(&mut pending, &mut panic)
    } else {
        node.help_invalidation(&mut pending);
        false
    };
    if !settled {
        let walked = walk(start, pending, &mut panic);
        node.settle();
        for next in walked {
            next.node().settle();
        }
    }
    if let Some(payload) = panic {
        if std::thread::panicking() {
            // Run from a destructor while a panic unwinds (a body that panicked is
            // abandoned): raising another would abort the process.
            tracing::error!(target: "coherent::invalidate", "an invalidation callback panicked while another panic unwound; the cascade completed");
            drop(payload);
        } else {
            resume_unwind(payload);
        }
    }
    won
}

/// Invalidates what `pending` reaches, returning the nodes it walked (each still to settle).
/// A node invalidated by another caller and not settled is walked too; the set of walked
/// addresses, needed only then (or when this walk meets itself again through a diamond), is
/// built on first need.
fn walk(
    start: &dyn AnyComputed,
    mut pending: Vec<Arc<dyn AnyComputed>>,
    panic: &mut Option<Box<dyn std::any::Any + Send>>,
) -> Vec<Arc<dyn AnyComputed>> {
    fn address(c: &dyn AnyComputed) -> usize {
        c as *const dyn AnyComputed as *const () as usize
    }
    let mut walked: Vec<Arc<dyn AnyComputed>> = Vec::new();
    let mut seen: Option<HashSet<usize>> = None;
    while let Some(next) = pending.pop() {
        if let Some(ahead) = pending.len().checked_sub(PREFETCH_AHEAD) {
            prefetch(Arc::as_ptr(&pending[ahead]).cast());
        }
        let node = next.node();
        if node.begin_invalidation() {
            if node.finish_invalidation(&mut pending, panic) {
                // Settled, and let go of at the end of this iteration: its address is not
                // recorded (the allocator may give it to a new node this walk reaches).
                continue;
            }
            if let Some(seen) = &mut seen {
                seen.insert(address(&*next));
            }
        } else {
            if node.is_settled() {
                continue;
            }
            let seen = seen.get_or_insert_with(|| {
                std::iter::once(address(start))
                    .chain(walked.iter().map(|c| address(&**c)))
                    .collect()
            });
            if !seen.insert(address(&*next)) {
                continue;
            }
            node.help_invalidation(&mut pending);
        }
        walked.push(next);
    }
    walked
}

/// Records that `dependant` (a computed whose body is running) used `dependency`.
pub(crate) fn record_use(dependant: &Arc<dyn AnyComputed>, dependency: Arc<dyn AnyComputed>) {
    if std::ptr::addr_eq(Arc::as_ptr(dependant), Arc::as_ptr(&dependency)) {
        return;
    }
    if dependency.node().add_dependant(Arc::downgrade(dependant)) {
        dependant.node().add_dependency(dependency);
    } else {
        invalidate(&**dependant);
    }
}

/// Model-checked interleavings of the state machine: every schedule loom can produce of
/// completion, invalidation, edge registration and callbacks. Run with
/// `RUSTFLAGS="--cfg loom" cargo test -p coherent-core --release --lib`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicUsize;
    use loom::thread;

    struct TestComputed(Node);

    impl AnyComputed for TestComputed {
        fn node(&self) -> &Node {
            &self.0
        }
    }

    fn computing(name: &'static str) -> Arc<dyn AnyComputed> {
        Arc::new(TestComputed(Node::new(
            Origin::new(name, Arc::default()),
            1,
            0,
        )))
    }

    fn consistent(name: &'static str) -> Arc<dyn AnyComputed> {
        let c = computing(name);
        assert_eq!(c.node().complete(), CONSISTENT);
        c
    }

    fn counting_callback(node: &Node) -> Arc<AtomicUsize> {
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = calls.clone();
        node.add_callback(Box::new(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        calls
    }

    #[test]
    fn a_dependency_invalidated_while_the_body_completes_leaves_no_consistent_dependant() {
        loom::model(|| {
            let dependency = consistent("dependency");
            let dependant = computing("dependant");
            record_use(&dependant, dependency.clone());
            let writer = thread::spawn(move || assert!(invalidate(&*dependency)));
            dependant.node().complete();
            writer.join().unwrap();
            assert_eq!(dependant.node().state(), INVALIDATED);
        });
    }

    #[test]
    fn a_dependency_invalidated_while_its_use_is_recorded_still_invalidates_the_dependant() {
        loom::model(|| {
            let dependency = consistent("dependency");
            let dependant = computing("dependant");
            let writer = {
                let dependency = dependency.clone();
                thread::spawn(move || assert!(invalidate(&*dependency)))
            };
            record_use(&dependant, dependency);
            writer.join().unwrap();
            assert_eq!(dependant.node().complete(), INVALIDATED);
            assert_eq!(dependant.node().state(), INVALIDATED);
        });
    }

    #[test]
    fn both_sides_of_a_diamond_invalidated_at_once_invalidate_the_top_exactly_once() {
        loom::model(|| {
            let left = consistent("left");
            let right = consistent("right");
            let top = computing("top");
            record_use(&top, left.clone());
            record_use(&top, right.clone());
            assert_eq!(top.node().complete(), CONSISTENT);
            let calls = counting_callback(top.node());
            let other = thread::spawn(move || invalidate(&*right));
            let here = invalidate(&*left);
            let there = other.join().unwrap();
            assert!(
                here && there,
                "each side was consistent, so each call invalidated it"
            );
            assert_eq!(top.node().state(), INVALIDATED);
            assert_eq!(calls.load(Ordering::SeqCst), 1);
        });
    }

    /// `dependant` computed from `dependency`, both consistent.
    fn consistent_pair() -> (Arc<dyn AnyComputed>, Arc<dyn AnyComputed>) {
        let dependency = consistent("dependency");
        let dependant = computing("dependant");
        record_use(&dependant, dependency.clone());
        assert_eq!(dependant.node().complete(), CONSISTENT);
        (dependency, dependant)
    }

    #[test]
    fn a_caller_that_loses_the_race_returns_only_after_the_cascade() {
        loom::model(|| {
            let (dependency, dependant) = consistent_pair();
            let other = {
                let (dependency, dependant) = (dependency.clone(), dependant.clone());
                thread::spawn(move || {
                    invalidate(&*dependency);
                    assert_eq!(dependant.node().state(), INVALIDATED);
                })
            };
            invalidate(&*dependency);
            assert_eq!(dependant.node().state(), INVALIDATED);
            other.join().unwrap();
            assert!(dependency.node().is_settled() && dependant.node().is_settled());
        });
    }

    #[test]
    fn a_chain_is_invalidated_to_its_end_before_either_racing_caller_returns() {
        loom::model(|| {
            let (dependency, middle) = consistent_pair();
            let top = computing("top");
            record_use(&top, middle.clone());
            assert_eq!(top.node().complete(), CONSISTENT);
            let other = {
                let (dependency, top) = (dependency.clone(), top.clone());
                thread::spawn(move || {
                    invalidate(&*dependency);
                    assert_eq!(top.node().state(), INVALIDATED);
                })
            };
            invalidate(&*middle);
            assert_eq!(top.node().state(), INVALIDATED);
            other.join().unwrap();
        });
    }

    #[test]
    fn invalidating_a_new_version_walks_the_previous_one_until_it_settles() {
        loom::model(|| {
            let (previous, dependant) = consistent_pair();
            let next = consistent("next");
            next.node().inherit(previous.clone());
            let other = thread::spawn(move || invalidate(&*previous));
            invalidate(&*next);
            assert_eq!(dependant.node().state(), INVALIDATED);
            other.join().unwrap();
        });
    }

    #[test]
    fn racing_invalidations_of_one_computed_cascade_once() {
        loom::model(|| {
            let shared = consistent("shared");
            let calls = counting_callback(shared.node());
            let other = {
                let shared = shared.clone();
                thread::spawn(move || invalidate(&*shared))
            };
            let here = invalidate(&*shared);
            let there = other.join().unwrap();
            assert!(here ^ there, "exactly one caller performs the invalidation");
            assert_eq!(calls.load(Ordering::SeqCst), 1);
        });
    }

    #[test]
    fn a_callback_registered_while_invalidating_runs_exactly_once() {
        loom::model(|| {
            let computed = consistent("computed");
            let other = {
                let computed = computed.clone();
                thread::spawn(move || invalidate(&*computed))
            };
            let calls = counting_callback(computed.node());
            other.join().unwrap();
            assert_eq!(calls.load(Ordering::SeqCst), 1);
        });
    }

    #[test]
    fn a_callback_removed_while_invalidating_either_runs_or_is_removed() {
        loom::model(|| {
            let computed = consistent("computed");
            let calls = Arc::new(AtomicUsize::new(0));
            let counter = calls.clone();
            let key = computed.node().add_callback(Box::new(move || {
                counter.fetch_add(1, Ordering::SeqCst);
            }));
            let other = {
                let computed = computed.clone();
                thread::spawn(move || invalidate(&*computed))
            };
            let removed = computed.node().remove_callback(key);
            other.join().unwrap();
            assert_eq!(usize::from(removed) + calls.load(Ordering::SeqCst), 1);
            assert_eq!(computed.node().callback_count(), 0);
        });
    }
}

/// The same races on real threads, many times over, and the bounds of the callback list.
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Barrier;

    struct TestComputed(Node);

    impl AnyComputed for TestComputed {
        fn node(&self) -> &Node {
            &self.0
        }
    }

    fn consistent() -> Arc<dyn AnyComputed> {
        let c: Arc<dyn AnyComputed> = Arc::new(TestComputed(Node::new(
            Origin::new("test", Arc::default()),
            1,
            0,
        )));
        assert_eq!(c.node().complete(), CONSISTENT);
        c
    }

    /// A callback that counts its runs, and whose drop is counted too (to see it freed).
    fn counting(runs: &Arc<AtomicUsize>, drops: &Arc<AtomicUsize>) -> InvalidationCallback {
        struct OnDrop(Arc<AtomicUsize>);
        impl Drop for OnDrop {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let (runs, dropped) = (runs.clone(), OnDrop(drops.clone()));
        Box::new(move || {
            let _dropped = dropped;
            runs.fetch_add(1, Ordering::SeqCst);
        })
    }

    #[test]
    fn a_body_abandoned_while_it_panics_survives_a_panicking_callback_in_the_cascade() {
        let previous = consistent();
        let dependant: Arc<dyn AnyComputed> = Arc::new(TestComputed(Node::new(
            Origin::new("test", Arc::default()),
            1,
            0,
        )));
        record_use(&dependant, previous.clone());
        assert_eq!(dependant.node().complete(), CONSISTENT);
        dependant
            .node()
            .add_callback(Box::new(|| panic!("a callback failed")));
        // Another caller won `previous` and has not walked it yet.
        assert!(previous.node().begin_invalidation());
        let this: Arc<dyn AnyComputed> = Arc::new(TestComputed(Node::new(
            Origin::new("test", Arc::default()),
            1,
            0,
        )));
        this.node().inherit(previous.clone());
        struct AbandonOnDrop(Arc<dyn AnyComputed>);
        impl Drop for AbandonOnDrop {
            fn drop(&mut self) {
                Node::abandon(&*self.0);
            }
        }
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _abandon = AbandonOnDrop(this.clone());
            panic!("the body failed");
        }));
        assert!(outcome.is_err(), "the body's panic, not an abort");
        assert_eq!(dependant.node().state(), INVALIDATED);
    }

    /// What every computed carries inline (issue 32). Growing it is a decision: say why in
    /// ARCHITECTURE.md ("What a cached result costs").
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn a_node_takes_48_bytes() {
        assert_eq!(std::mem::size_of::<Node>(), 48);
        // Boxed, for a computed with an edge or a callback; one dependency and one dependant
        // inline.
        assert_eq!(std::mem::size_of::<Edges>(), 96);
        assert_eq!(
            std::mem::size_of::<crate::computed::ComputedInner<u64>>(),
            56,
            "a u64 result: its value and its node"
        );
    }

    #[test]
    fn dropping_a_chain_of_a_million_dependencies_does_not_overflow_the_stack() {
        // Each computed holds the one before it, as a table of results each computed from the
        // previous one would; the last holder goes, and the chain with it.
        let mut last = consistent();
        for _ in 0..1_000_000 {
            let next: Arc<dyn AnyComputed> = Arc::new(TestComputed(Node::new(
                Origin::new("test", Arc::default()),
                1,
                0,
            )));
            record_use(&next, last);
            last = next;
        }
        // Run on a thread with a small stack: recursion would need a frame per link.
        std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || drop(last))
            .expect("a thread")
            .join()
            .expect("dropped without overflowing");
    }

    #[test]
    fn a_leaf_invalidated_with_no_edges_settles_and_wakes() {
        let c = consistent();
        assert!(
            c.node().edges.lock().is_none(),
            "no edges allocated for a leaf"
        );
        assert!(invalidate(&*c));
        assert!(c.node().is_settled());
        assert!(c.node().edges.lock().is_none());
        assert!(!invalidate(&*c));
    }

    #[test]
    fn a_removed_callback_is_freed_at_once_and_never_runs() {
        let c = consistent();
        let (runs, drops) = (Arc::default(), Arc::default());
        let key = c.node().add_callback(counting(&runs, &drops));
        let kept = c.node().add_callback(counting(&runs, &drops));
        assert_eq!(c.node().callback_count(), 2);
        assert!(c.node().remove_callback(key));
        assert_eq!(drops.load(Ordering::SeqCst), 1, "freed when removed");
        assert!(!c.node().remove_callback(key), "removed once");
        assert_eq!(c.node().callback_count(), 1);
        assert!(invalidate(&*c));
        assert_eq!(runs.load(Ordering::SeqCst), 1, "only the one kept ran");
        assert!(!c.node().remove_callback(kept), "it ran: nothing to remove");
        assert_eq!(c.node().callback_slots(), 0);
    }

    #[test]
    fn a_key_of_another_computed_removes_nothing() {
        let (a, b) = (consistent(), consistent());
        let (runs, drops) = (Arc::default(), Arc::default());
        let key = a.node().add_callback(counting(&runs, &drops));
        b.node().add_callback(counting(&runs, &drops));
        assert!(!b.node().remove_callback(key));
        assert_eq!(b.node().callback_count(), 1);
        assert!(a.node().remove_callback(key));
    }

    #[test]
    fn a_callback_added_to_an_invalidated_computed_runs_at_once_and_its_key_names_nothing() {
        let c = consistent();
        invalidate(&*c);
        let (runs, drops) = (Arc::default(), Arc::default());
        let key = c.node().add_callback(counting(&runs, &drops));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(!c.node().remove_callback(key));
    }

    #[test]
    fn callbacks_run_in_the_order_they_were_added_after_removals() {
        let c = consistent();
        let order = Arc::new(crate::sync::Mutex::new(Vec::new()));
        let keys: Vec<_> = (0..40)
            .map(|i| {
                let order = order.clone();
                c.node()
                    .add_callback(Box::new(move || order.lock().push(i)))
            })
            .collect();
        for key in keys.iter().step_by(3) {
            assert!(c.node().remove_callback(*key));
        }
        invalidate(&*c);
        let expected: Vec<i32> = (0..40).filter(|i| i % 3 != 0).collect();
        assert_eq!(*order.lock(), expected);
    }

    #[test]
    fn adding_and_removing_in_a_loop_keeps_the_list_bounded() {
        let c = consistent();
        let (runs, drops) = (Arc::default(), Arc::default());
        // A few that stay, so that the list is never empty and freed that way.
        let kept: Vec<_> = (0..5)
            .map(|_| c.node().add_callback(counting(&runs, &drops)))
            .collect();
        for i in 0..100_000 {
            let key = c.node().add_callback(counting(&runs, &drops));
            // Removed out of order now and then: the removed entry is not always the last.
            if i % 2 == 0 {
                assert!(c.node().remove_callback(key));
            } else {
                let older = c.node().add_callback(counting(&runs, &drops));
                assert!(c.node().remove_callback(key));
                assert!(c.node().remove_callback(older));
            }
        }
        assert_eq!(c.node().callback_count(), 5);
        assert!(
            c.node().callback_slots() <= 64,
            "{}",
            c.node().callback_slots()
        );
        assert_eq!(drops.load(Ordering::SeqCst), 150_000);
        for key in kept {
            assert!(c.node().remove_callback(key));
        }
        assert_eq!(c.node().callback_slots(), 0);
        assert_eq!(runs.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn many_removed_at_once_are_each_freed_at_once() {
        let c = consistent();
        let (runs, drops) = (Arc::default(), Arc::default());
        let keep = c.node().add_callback(counting(&runs, &drops));
        let keys: Vec<_> = (0..200_000)
            .map(|_| c.node().add_callback(counting(&runs, &drops)))
            .collect();
        for key in keys.into_iter().rev().skip(1) {
            assert!(c.node().remove_callback(key));
        }
        assert_eq!(
            drops.load(Ordering::SeqCst),
            199_999,
            "each freed when removed"
        );
        assert_eq!(c.node().callback_count(), 2);
        assert!(c.node().remove_callback(keep));
        invalidate(&*c);
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the one never removed ran");
    }

    #[test]
    fn removal_racing_invalidation_runs_or_removes_each_callback_exactly_once() {
        for _ in 0..2_000 {
            let c = consistent();
            let (runs, drops) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
            let keys: Vec<_> = (0..8)
                .map(|_| c.node().add_callback(counting(&runs, &drops)))
                .collect();
            let start = Arc::new(Barrier::new(3));
            let invalidating = {
                let (c, start) = (c.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    invalidate(&*c);
                })
            };
            let (front, back) = keys.split_at(4);
            let removing = |keys: Vec<CallbackKey>| {
                let (c, start) = (c.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    keys.into_iter()
                        .filter(|k| c.node().remove_callback(*k))
                        .count()
                })
            };
            let (one, two) = (removing(front.to_vec()), removing(back.to_vec()));
            invalidating.join().unwrap();
            let removed = one.join().unwrap() + two.join().unwrap();
            assert_eq!(removed + runs.load(Ordering::SeqCst), 8);
            assert_eq!(drops.load(Ordering::SeqCst), 8, "every callback freed");
            assert_eq!(c.node().callback_slots(), 0);
        }
    }
}
