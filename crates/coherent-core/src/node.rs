//! The type-erased heart of a computed: its consistency state machine and its edges in the
//! dependency graph. Everything that must be right under concurrency lives here, behind the
//! `sync` shim, so that it can be model-checked on its own.
//!
//! States: `COMPUTING` → `CONSISTENT` → `INVALIDATED`, with a detour for the race rule: a
//! computed invalidated while its body still runs becomes `COMPUTING_INVALIDATED`, and is born
//! `INVALIDATED` when the body completes. Every transition into an invalidated state is a
//! compare-and-swap, so the cascade runs exactly once per computed.

use crate::metrics::Counters;
use crate::sync::{Arc, AtomicU32, AtomicU8, Mutex, Ordering, Weak};

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

/// `repr(C)`: the fields a hit reads (`state`, `last_used`) come first, so that they sit right
/// after the value in `ComputedInner` and a hit reads adjacent cache lines.
#[repr(C)]
pub(crate) struct Node {
    state: AtomicU8,
    /// Coarse clock tick of the last use, written only when the tick changes.
    last_used: AtomicU32,
    version: u64,
    name: &'static str,
    counters: Arc<Counters>,
    /// A short critical section, never held across `.await` or while calling out.
    edges: Mutex<Edges>,
    /// Wakes tasks waiting for completion or invalidation; they re-check the state in a loop.
    #[cfg(not(loom))]
    notify: tokio::sync::Notify,
}

#[derive(Default)]
struct Edges {
    /// Strong: a dependency lives as long as a computed that used it, so that invalidating it
    /// still reaches this computed.
    dependencies: Vec<Arc<dyn AnyComputed>>,
    /// Weak: a dependant that was dropped or recomputed is not kept alive by its inputs.
    dependants: Vec<Weak<dyn AnyComputed>>,
    /// Length of `dependants` after the last compaction; the list is compacted when it doubles.
    compacted_len: usize,
    callbacks: Vec<InvalidationCallback>,
}

impl Node {
    pub(crate) fn new(name: &'static str, version: u64, counters: Arc<Counters>, now: u32) -> Self {
        Self {
            state: AtomicU8::new(COMPUTING),
            last_used: AtomicU32::new(now),
            version,
            name,
            counters,
            edges: Mutex::new(Edges::default()),
            #[cfg(not(loom))]
            notify: tokio::sync::Notify::new(),
        }
    }

    #[inline]
    pub(crate) fn state(&self) -> u8 {
        self.state.load(Ordering::Acquire)
    }

    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    pub(crate) fn name(&self) -> &'static str {
        self.name
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
                let released = std::mem::take(&mut self.edges.lock().dependencies);
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
        let released = std::mem::take(&mut node.edges.lock().dependencies);
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

    /// The second half of an invalidation: detach the edges under the lock, then notify outside it.
    fn finish_invalidation(&self, pending: &mut Vec<Arc<dyn AnyComputed>>) {
        let (dependants, callbacks, dependencies) = {
            let mut edges = self.edges.lock();
            let dependencies = if self.state.load(Ordering::Acquire) == INVALIDATED {
                std::mem::take(&mut edges.dependencies)
            } else {
                // The body still runs and may add more; `complete` releases them.
                Vec::new()
            };
            edges.compacted_len = 0;
            (
                std::mem::take(&mut edges.dependants),
                std::mem::take(&mut edges.callbacks),
                dependencies,
            )
        };
        self.counters.record_invalidation();
        tracing::debug!(target: "coherent::invalidate", method = self.name, version = self.version, "invalidated");
        self.wake();
        for callback in callbacks {
            callback();
        }
        pending.extend(dependants.iter().filter_map(Weak::upgrade));
        drop(dependencies);
    }

    /// Records `dependant` as a user of this node. Returns `false` when this node is already
    /// invalidated: the dependant was built on a stale input and must be invalidated too.
    fn add_dependant(&self, dependant: Weak<dyn AnyComputed>) -> bool {
        let mut edges = self.edges.lock();
        // Checked under the lock: an invalidation flips the state first and then takes the
        // list under this lock, so either it sees our entry or we see its state.
        if self.is_invalidated() {
            return false;
        }
        edges.dependants.push(dependant);
        let len = edges.dependants.len();
        if len >= 16 && len >= 2 * edges.compacted_len {
            // Dependants that were dropped or already invalidated need no notification; without
            // this, a long-lived input read by churning dependants would grow without bound.
            edges
                .dependants
                .retain(|w| w.upgrade().is_some_and(|d| d.node().state() != INVALIDATED));
            edges.compacted_len = edges.dependants.len();
        }
        true
    }

    fn add_dependency(&self, dependency: Arc<dyn AnyComputed>) {
        let mut edges = self.edges.lock();
        if self.state.load(Ordering::Acquire) != INVALIDATED {
            edges.dependencies.push(dependency);
        }
    }

    /// Registers a callback run once on invalidation; runs it now if that already happened.
    pub(crate) fn on_invalidated(&self, callback: InvalidationCallback) {
        {
            let mut edges = self.edges.lock();
            if !self.is_invalidated() {
                edges.callbacks.push(callback);
                return;
            }
        }
        callback();
    }

    pub(crate) fn dependency_count(&self) -> usize {
        self.edges.lock().dependencies.len()
    }

    #[cfg(not(loom))]
    fn wake(&self) {
        self.notify.notify_waiters();
    }

    #[cfg(loom)]
    fn wake(&self) {}

    /// Waits until `done(state)` holds.
    #[cfg(not(loom))]
    pub(crate) async fn wait_for(&self, done: impl Fn(u8) -> bool) {
        loop {
            let notified = self.notify.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the check, so a transition between the check and the await
            // still wakes us.
            notified.as_mut().enable();
            if done(self.state()) {
                return;
            }
            notified.await;
        }
    }
}

/// Invalidates `start` and, transitively, everything that depends on it. Iterative, so that a
/// long chain of dependants cannot overflow the stack. Returns `false` if it was already invalid.
pub(crate) fn invalidate(start: &dyn AnyComputed) -> bool {
    if !start.node().begin_invalidation() {
        return false;
    }
    let mut pending = Vec::new();
    start.node().finish_invalidation(&mut pending);
    while let Some(next) = pending.pop() {
        if next.node().begin_invalidation() {
            next.node().finish_invalidation(&mut pending);
        }
    }
    true
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
        Arc::new(TestComputed(Node::new(name, 1, Arc::default(), 0)))
    }

    fn consistent(name: &'static str) -> Arc<dyn AnyComputed> {
        let c = computing(name);
        assert_eq!(c.node().complete(), CONSISTENT);
        c
    }

    fn counting_callback(node: &Node) -> Arc<AtomicUsize> {
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = calls.clone();
        node.on_invalidated(Box::new(move || {
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
}
