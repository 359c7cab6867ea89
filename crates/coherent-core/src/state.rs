//! States: `MutableState<T>`, a value that compute methods can depend on and that invalidates
//! them when set; and `ComputedState<T>`, a computation that recomputes itself after it is
//! invalidated (after an update delay) and publishes each new value, for UIs and background jobs.

use std::fmt;
use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use tokio::sync::watch;

use crate::clock;
use crate::computed::{BoxFuture, Computed, ComputedInner, Recompute};
use crate::node::{self, Node, Origin};
use crate::options::{ComputeOptions, OutputKind};
use crate::registry::{next_version, Registry};
use crate::sync::{Arc, Weak};

fn value_kind<T>(_: &T) -> OutputKind {
    OutputKind::Value
}

/// A new version's node: one `Origin` per state, shared by all its versions.
fn new_node(origin: &Arc<Origin>) -> Node {
    Node::new(origin.clone(), next_version(), clock::now())
}

/// A value that compute methods can read as a dependency: setting it invalidates them.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use coherent_core::MutableState;
///
/// let counter = MutableState::new(1);
/// let before = counter.computed();
/// counter.set(2);
/// assert!(!before.is_consistent());
/// assert_eq!(counter.get(), 2);
/// # }
/// ```
pub struct MutableState<T> {
    inner: Arc<MutableInner<T>>,
}

impl<T> Clone for MutableState<T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

struct MutableInner<T> {
    /// A std-style mutex held only to swap the pointer; invalidation happens after release.
    current: parking_lot::Mutex<Arc<ComputedInner<T>>>,
    /// The name and the registry's counters, shared by every version.
    origin: Arc<Origin>,
    input: Recompute<T>,
}

impl<T: Clone + Send + Sync + 'static> MutableState<T> {
    /// A state in the global registry.
    pub fn new(value: T) -> Self {
        Self::with_registry(Registry::global(), "MutableState", value)
    }

    /// A state named `name` (it shows in traces) counted in `registry`.
    pub fn with_registry(registry: &Registry, name: &'static str, value: T) -> Self {
        let inner = Arc::new_cyclic(|weak: &Weak<MutableInner<T>>| {
            let weak = weak.clone();
            let input: Recompute<T> = Arc::new(move || {
                let state = weak.upgrade();
                Box::pin(async move {
                    state.map(|s| Computed::from_inner(s.current.lock().clone(), s.input.clone()))
                })
            });
            let origin = Origin::new(name, registry.counters().clone());
            let first = ComputedInner::consistent(new_node(&origin), value);
            MutableInner {
                current: parking_lot::Mutex::new(first),
                origin,
                input,
            }
        });
        Self { inner }
    }

    /// The value; inside a compute method, also records the state as a dependency.
    pub fn get(&self) -> T {
        let current = self.inner.current.lock().clone();
        current.record_use();
        current
            .output()
            .expect("a state always holds a value")
            .clone()
    }

    /// The current version as a computed.
    pub fn computed(&self) -> Computed<T> {
        Computed::from_inner(self.inner.current.lock().clone(), self.inner.input.clone())
    }

    /// Sets the value and invalidates everything that read the previous one. When this returns,
    /// the invalidation cascade has completed.
    pub fn set(&self, value: T) {
        self.update(|_| value);
    }

    /// Sets the value to `f(previous)` atomically with respect to other updates.
    pub fn update(&self, f: impl FnOnce(&T) -> T) {
        let inner = &*self.inner;
        let (previous, next) = {
            let mut current = inner.current.lock();
            let value = f(current.output().expect("a state always holds a value"));
            let next = ComputedInner::consistent(new_node(&inner.origin), value);
            // Until the previous version settles, invalidating this one walks it too: a
            // later update must not return while this one's cascade still runs.
            next.node.inherit(current.clone());
            (std::mem::replace(&mut *current, next.clone()), next)
        };
        node::invalidate(&*previous);
        // Settled now: the new version need not hold the old one any longer.
        next.node.release_inherited();
    }
}

impl<T: fmt::Debug + Clone + Send + Sync + 'static> fmt::Debug for MutableState<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("MutableState")
            .field(&self.computed())
            .finish()
    }
}

type Compute<T> = Arc<dyn Fn() -> BoxFuture<'static, T> + Send + Sync>;

/// A computation that keeps itself up to date: after whatever it read is invalidated, it waits
/// the update delay and recomputes, publishing each new value.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use coherent_core::{ComputedState, MutableState};
///
/// let name = MutableState::new("Ann".to_string());
/// let greeting = {
///     let name = name.clone();
///     ComputedState::new(move || {
///         let name = name.clone();
///         async move { format!("Hello, {}!", name.get()) }
///     })
///     .await
/// };
/// let mut changes = greeting.watch();
/// name.set("Bob".to_string());
/// changes.changed().await.unwrap();
/// assert_eq!(greeting.latest(), "Hello, Bob!");
/// # }
/// ```
pub struct ComputedState<T> {
    inner: Arc<StateInner<T>>,
}

impl<T> Clone for ComputedState<T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

struct StateInner<T> {
    compute: Compute<T>,
    current: parking_lot::Mutex<Computed<T>>,
    /// Serializes recomputation, so that two refreshes never race to publish.
    refreshing: tokio::sync::Mutex<()>,
    sender: watch::Sender<T>,
    /// The name and the registry's counters, shared by every version.
    origin: Arc<Origin>,
    input: Recompute<T>,
    updater: parking_lot::Mutex<Option<tokio::task::AbortHandle>>,
}

impl<T> Drop for StateInner<T> {
    fn drop(&mut self) {
        if let Some(updater) = self.updater.get_mut().take() {
            updater.abort();
        }
    }
}

/// Configures a [`ComputedState`].
#[derive(Clone, Debug)]
pub struct ComputedStateBuilder {
    update_delay: Duration,
    registry: Registry,
    name: &'static str,
}

impl ComputedStateBuilder {
    /// How long to wait after an invalidation before recomputing; several invalidations within
    /// the delay cost one recomputation. Default: zero.
    #[must_use]
    pub fn update_delay(mut self, delay: Duration) -> Self {
        self.update_delay = delay;
        self
    }

    /// The registry whose counters the state's computations count in.
    #[must_use]
    pub fn registry(mut self, registry: &Registry) -> Self {
        self.registry = registry.clone();
        self
    }

    /// The name that shows in traces.
    #[must_use]
    pub fn name(mut self, name: &'static str) -> Self {
        self.name = name;
        self
    }

    /// Computes the first value and starts keeping it up to date. Must be called within a Tokio
    /// runtime: the updates run on a task of that runtime.
    pub async fn build<T, F, Fut>(self, compute: F) -> ComputedState<T>
    where
        T: Clone + Send + Sync + 'static,
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = T> + Send + 'static,
    {
        let compute: Compute<T> = Arc::new(move || Box::pin(compute()));
        // The computeds need a way back to the state before the state exists.
        let slot: Arc<OnceLock<Weak<StateInner<T>>>> = Arc::default();
        let input: Recompute<T> = {
            let slot = slot.clone();
            Arc::new(move || {
                let state = slot.get().and_then(Weak::upgrade);
                Box::pin(async move {
                    match state {
                        Some(state) => Some(state.refresh().await),
                        None => None,
                    }
                })
            })
        };
        let origin = Origin::new(self.name, self.registry.counters().clone());
        let first = compute_version(&compute, &input, &origin).await;
        let (sender, _) = watch::channel(first.value().clone());
        let inner = Arc::new(StateInner {
            compute,
            current: parking_lot::Mutex::new(first),
            refreshing: tokio::sync::Mutex::new(()),
            sender,
            origin,
            input,
            updater: parking_lot::Mutex::new(None),
        });
        let _ = slot.set(Arc::downgrade(&inner));
        let updater = tokio::spawn(update_loop(Arc::downgrade(&inner), self.update_delay));
        *inner.updater.lock() = Some(updater.abort_handle());
        ComputedState { inner }
    }
}

const STATE_OPTIONS: ComputeOptions = ComputeOptions::DEFAULT;

async fn compute_version<T: Clone + Send + Sync + 'static>(
    compute: &Compute<T>,
    input: &Recompute<T>,
    origin: &Arc<Origin>,
) -> Computed<T> {
    let computed = ComputedInner::new(new_node(origin));
    computed.run(compute(), &STATE_OPTIONS, value_kind).await;
    Computed::from_inner(computed, input.clone())
}

/// Waits for the current version to be invalidated, then refreshes it; ends when the state is
/// dropped (holding only a weak reference while it waits).
async fn update_loop<T: Clone + Send + Sync + 'static>(
    state: Weak<StateInner<T>>,
    delay: Duration,
) {
    loop {
        let Some(current) = state.upgrade().map(|s| s.current.lock().clone()) else {
            return;
        };
        current.when_invalidated().await;
        drop(current);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let Some(state) = state.upgrade() else {
            return;
        };
        state.refresh().await;
    }
}

impl<T: Clone + Send + Sync + 'static> StateInner<T> {
    /// Recomputes unless the current version is still consistent; publishes the new value.
    async fn refresh(&self) -> Computed<T> {
        let _one_at_a_time = self.refreshing.lock().await;
        let current = self.current.lock().clone();
        if current.is_consistent() {
            return current;
        }
        let next = compute_version(&self.compute, &self.input, &self.origin).await;
        *self.current.lock() = next.clone();
        self.sender.send_replace(next.value().clone());
        next
    }
}

impl ComputedState<()> {
    /// Starts configuring a computed state.
    pub fn builder() -> ComputedStateBuilder {
        ComputedStateBuilder {
            update_delay: Duration::ZERO,
            registry: Registry::global().clone(),
            name: "ComputedState",
        }
    }
}

impl<T: Clone + Send + Sync + 'static> ComputedState<T> {
    /// A state with the default settings (no update delay, the global registry). Must be called
    /// within a Tokio runtime.
    pub async fn new<F, Fut>(compute: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = T> + Send + 'static,
    {
        ComputedState::builder().build(compute).await
    }

    /// The latest value, without recording a dependency.
    pub fn latest(&self) -> T {
        self.inner.current.lock().value().clone()
    }

    /// The latest value; inside a compute method, also records the state as a dependency.
    pub fn get(&self) -> T {
        self.inner.current.lock().clone().get()
    }

    /// The current version as a computed (it may be invalidated and about to be replaced).
    pub fn computed(&self) -> Computed<T> {
        self.inner.current.lock().clone()
    }

    /// A receiver that sees every value the state publishes from now on.
    pub fn watch(&self) -> watch::Receiver<T> {
        self.inner.sender.subscribe()
    }

    /// The current version, recomputed now if it is invalidated (not waiting for the delay).
    pub async fn update(&self) -> Computed<T> {
        self.inner.refresh().await
    }
}

impl<T: fmt::Debug + Clone + Send + Sync + 'static> fmt::Debug for ComputedState<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ComputedState")
            .field(&self.computed())
            .finish()
    }
}
