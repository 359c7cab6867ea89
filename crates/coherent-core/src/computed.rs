//! `Computed<T>`: one version of a memoized result, with its consistency state, its output (a
//! value or an error), a way to wait for its invalidation, and a way to get the fresh version.

use std::cell::UnsafeCell;
use std::fmt;
use std::future::Future;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::time::Duration;

use crate::context::{self, Capture};
use crate::node::{
    self, AnyComputed, CallbackKey, Node, COMPUTING, COMPUTING_INVALIDATED, CONSISTENT,
};
use crate::options::{ComputeOptions, OutputKind};
use crate::sync::{Arc, Weak};

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How to produce the fresh version of a computed: call the method again, read the state again.
/// `None` when its source is gone (a dropped state).
pub type Recompute<T> = Arc<dyn Fn() -> BoxFuture<'static, Option<Computed<T>>> + Send + Sync>;

/// `repr(C)`, value first: a hit reads the value and the state at the start of the node, one
/// run of adjacent cache lines instead of lines scattered by the compiler's field order.
///
/// What a cached result holds: its value and its node. How to call the method again (the
/// [`Recompute`] that [`Computed::update`] needs) is not kept here but in each
/// [`Computed`] handed out: a table makes one only when a caller asks for the computed,
/// not for every result it caches.
///
/// The output is written once, by the one task that runs the body (or at birth, for a
/// state's value), before the node says so (`Node::mark_output`, `Release`); read only
/// after `Node::has_output` (`Acquire`). A `OnceLock` would do the same with a flag of its
/// own, 8 bytes more per result once padded; the node has a spare byte.
#[repr(C)]
pub(crate) struct ComputedInner<T> {
    value: UnsafeCell<MaybeUninit<T>>,
    pub(crate) node: Node,
}

// SAFETY: the output is written once before `has_output` is set and never again, and only
// read through `&T` after it is set (see the type's docs): shared as a `T` would be, so as
// thread-safe as `T` is `Sync`, and sent with the `T` it owns.
unsafe impl<T: Send + Sync> Sync for ComputedInner<T> {}
// SAFETY: it owns a `T` (and the node, which is `Send`).
unsafe impl<T: Send> Send for ComputedInner<T> {}

/// The impls above vouch for the node too: it must stay `Send` and `Sync` on its own.
const _: () = {
    const fn thread_safe<N: Send + Sync>() {}
    thread_safe::<Node>();
};

impl<T> ComputedInner<T> {
    /// The output, once it is stored.
    #[inline(always)]
    pub(crate) fn output(&self) -> Option<&T> {
        if self.node.has_output() {
            // SAFETY: written before `has_output` was set (Release, read with Acquire), and
            // never written again.
            Some(unsafe { (*self.value.get()).assume_init_ref() })
        } else {
            None
        }
    }

    /// Stores the output. Called once, by the one caller that owns the computation.
    fn set_output(&self, output: T) {
        debug_assert!(!self.node.has_output(), "an output is stored once");
        // SAFETY: nobody reads the output before `has_output`, and only the owner of the
        // computation writes it, once.
        unsafe { (*self.value.get()).write(output) };
        self.node.mark_output();
    }
}

impl<T> Drop for ComputedInner<T> {
    fn drop(&mut self) {
        if self.node.has_output() {
            // SAFETY: stored (see `has_output`), and dropped once, here.
            unsafe { self.value.get_mut().assume_init_drop() };
        }
    }
}

impl<T: Send + Sync + 'static> AnyComputed for ComputedInner<T> {
    fn node(&self) -> &Node {
        &self.node
    }
}

impl<T: Clone + Send + Sync + 'static> ComputedInner<T> {
    pub(crate) fn new(node: Node) -> Arc<Self> {
        Arc::new(Self {
            node,
            value: UnsafeCell::new(MaybeUninit::uninit()),
        })
    }

    /// A computed that is consistent from birth, holding `value` (used by states).
    pub(crate) fn consistent(node: Node, value: T) -> Arc<Self> {
        let this = Self::new(node);
        this.set_output(value);
        this.node.complete();
        this
    }

    /// Records this computed as a dependency of the compute body being polled, if any.
    #[inline]
    pub(crate) fn record_use(self: &Arc<Self>) {
        context::record(|| self.clone() as Arc<dyn AnyComputed>);
    }

    /// Runs the body of a computing computed to completion and stores its output. The callers
    /// get the output even when a dependency was invalidated meanwhile (the race rule); the
    /// stored computed is then born invalidated, so the next call recomputes.
    pub(crate) async fn run<F>(
        self: &Arc<Self>,
        body: F,
        options: &ComputeOptions,
        classify: fn(&T) -> OutputKind,
    ) where
        F: Future<Output = T>,
    {
        let mut abandon = AbandonOnDrop(Some(self.clone() as Arc<dyn AnyComputed>));
        let output = Capture::new(Some(self.clone() as Arc<dyn AnyComputed>), body).await;
        let kind = classify(&output);
        self.set_output(output);
        abandon.0 = None; // completed: nothing to abandon
        let state = self.node.complete();
        tracing::debug!(
            target: "coherent::compute",
            method = self.node.name(),
            version = self.node.version(),
            consistent = state == CONSISTENT,
            "computed"
        );
        if state == CONSISTENT {
            if let Some(delay) = options.expiry(kind) {
                self.invalidate_after(delay);
            }
        }
    }

    /// Schedules the expiry of a result with a time-to-live: a timer task on the current
    /// runtime, which an earlier invalidation cancels (so that a computed invalidated sooner
    /// leaves no task sleeping out its TTL). The computed is invalidated however the timer
    /// ends: it fires, or its runtime shuts down first (nothing would expire it after that,
    /// and an early invalidation is always safe).
    fn invalidate_after(self: &Arc<Self>, delay: Duration) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                target: "coherent::compute",
                method = self.node.name(),
                "no Tokio runtime: the result's time-to-live is not enforced"
            );
            return;
        };
        let expiry = ExpireOnDrop(Arc::downgrade(self) as Weak<dyn AnyComputed>);
        let timer = runtime.spawn(async move {
            let _expiry = expiry;
            tokio::time::sleep(delay).await;
        });
        let timer = timer.abort_handle();
        self.node.add_callback(Box::new(move || timer.abort()));
    }
}

/// Invalidates its computed when dropped: when the time-to-live timer that owns it fires, is
/// cancelled, or is dropped by a runtime shutting down.
struct ExpireOnDrop(Weak<dyn AnyComputed>);

impl Drop for ExpireOnDrop {
    fn drop(&mut self) {
        if let Some(computed) = self.0.upgrade() {
            node::invalidate(&*computed);
        }
    }
}

/// Invalidates a computing computed whose body was dropped before completing (the caller was
/// cancelled, or the body panicked), so that callers waiting for it retry instead of hanging.
pub(crate) struct AbandonOnDrop(pub(crate) Option<Arc<dyn AnyComputed>>);

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        if let Some(node) = self.0.take() {
            Node::abandon(&*node);
        }
    }
}

/// The consistency state of a [`Computed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConsistencyState {
    /// The body is running.
    Computing,
    /// The output is current: nothing it depends on has changed since.
    Consistent,
    /// Something it depends on changed; the next call recomputes.
    Invalidated,
}

/// One version of a memoized result: its output (a value or an error, whatever the method
/// returns), its consistency state, and the means to wait for its invalidation and to get the
/// version that replaces it.
///
/// Cloning is cheap (two reference counts). A `Computed` handed out always holds its output.
pub struct Computed<T> {
    pub(crate) inner: Arc<ComputedInner<T>>,
    /// How to get the version that replaces this one.
    input: Recompute<T>,
}

impl<T> Clone for Computed<T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            input: self.input.clone(),
        }
    }
}

impl<T: Clone + Send + Sync + 'static> Computed<T> {
    pub(crate) fn from_inner(inner: Arc<ComputedInner<T>>, input: Recompute<T>) -> Self {
        debug_assert!(inner.output().is_some());
        Self { inner, input }
    }

    /// The output, without recording a dependency.
    pub fn value(&self) -> &T {
        self.inner
            .output()
            .expect("a Computed handed out always holds its output")
    }

    /// The output; inside a compute method, also records this computed as a dependency of it.
    pub fn get(&self) -> T {
        self.inner.record_use();
        self.value().clone()
    }

    /// The consistency state now.
    pub fn state(&self) -> ConsistencyState {
        match self.inner.node.state() {
            COMPUTING => ConsistencyState::Computing,
            CONSISTENT => ConsistencyState::Consistent,
            COMPUTING_INVALIDATED | node::INVALIDATED => ConsistencyState::Invalidated,
            _ => unreachable!("no other state is ever stored"),
        }
    }

    /// Whether the output is still current.
    pub fn is_consistent(&self) -> bool {
        self.inner.node.state() == CONSISTENT
    }

    /// A process-wide unique number of this version; a recomputed result gets a new one.
    pub fn version(&self) -> u64 {
        self.inner.node.version()
    }

    /// The name of the method (or state) that produced it, e.g. `"UserService::get"`.
    pub fn name(&self) -> &'static str {
        self.inner.node.name()
    }

    /// How many computeds this one read while it was computed.
    pub fn dependency_count(&self) -> usize {
        self.inner.node.dependency_count()
    }

    /// Invalidates this computed and, transitively, everything that depends on it. Returns
    /// `false` if it was invalidated already. Either way, when it returns, everything that
    /// depends on it is invalidated, even if another thread's invalidation of it is still
    /// under way (this call then finishes that cascade's walk itself).
    pub fn invalidate(&self) -> bool {
        node::invalidate(&*self.inner)
    }

    /// Completes when this computed is invalidated (at once if it already is).
    pub async fn when_invalidated(&self) {
        self.inner
            .node
            .wait_for(|state| matches!(state, COMPUTING_INVALIDATED | node::INVALIDATED))
            .await;
    }

    /// Runs `callback` once when this computed is invalidated (at once if it already is). The
    /// callback runs on the invalidating thread, inside the cascade: keep it short and
    /// non-blocking. If it panics, the cascade goes on and the panic reaches the invalidating
    /// caller when the cascade is done. It is kept until then; to take it back earlier, register it with
    /// [`add_invalidation_callback`](Self::add_invalidation_callback).
    pub fn on_invalidated(&self, callback: impl FnOnce() + Send + 'static) {
        self.add_invalidation_callback(callback);
    }

    /// [`on_invalidated`](Self::on_invalidated), and a key that takes the callback back with
    /// [`remove_invalidation_callback`](Self::remove_invalidation_callback). A caller that
    /// watches a long-lived computed for a while (a remote replica, a subscription) removes
    /// its callback when it stops watching, so that watches that come and go do not pile up
    /// on the computed until its invalidation.
    pub fn add_invalidation_callback(
        &self,
        callback: impl FnOnce() + Send + 'static,
    ) -> CallbackKey {
        self.inner.node.add_callback(Box::new(callback))
    }

    /// Takes back the callback `key` names and drops it now. `true`: it was removed and will
    /// never run. `false`: the invalidation got to it first: it has run, or is running right
    /// now on the invalidating thread (so its effects may still be on their way), or `key`
    /// is not one of this computed's. Exactly one of the two happens to a callback: it runs
    /// once or it is removed.
    pub fn remove_invalidation_callback(&self, key: CallbackKey) -> bool {
        self.inner.node.remove_callback(key)
    }

    /// How many invalidation callbacks wait on this computed now (for tests and diagnostics:
    /// it locks the computed's edges and counts).
    #[doc(hidden)]
    pub fn invalidation_callback_count(&self) -> usize {
        self.inner.node.callback_count()
    }

    /// The current version: this one if it is still consistent, otherwise the result of calling
    /// the method (or reading the state) again. A computed whose state was dropped has no newer
    /// version and returns itself.
    pub async fn update(&self) -> Computed<T> {
        if self.is_consistent() {
            return self.clone();
        }
        (self.input)().await.unwrap_or_else(|| self.clone())
    }
}

impl<T: fmt::Debug + Clone + Send + Sync + 'static> fmt::Debug for Computed<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Computed")
            .field("name", &self.name())
            .field("version", &self.version())
            .field("state", &self.state())
            .field("value", &self.inner.output())
            .finish()
    }
}
