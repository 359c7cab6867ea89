//! The compute core of Coherent: memoized async compute methods whose results record the other
//! results and states they read, so that invalidating one invalidates, synchronously and exactly
//! once, everything computed from it. The next call recomputes.
//!
//! Most users depend on the `coherent` facade, which re-exports this crate together with the
//! `#[compute_service]` macro. The pieces, one file each:
//!
//! - [`Computed`]: one version of a result, its state, its invalidation (`computed.rs`, with the
//!   state machine and the dependency graph in `node.rs`);
//! - dependency capture across `.await` (`context.rs`);
//! - the per-method table with single-flight misses (`table.rs`);
//! - the [`Registry`]: capacity, pruning, [`Metrics`] (`registry.rs`, `metrics.rs`);
//! - [`ServiceHandle`] and [`ComputeService`] (`service.rs`);
//! - [`MutableState`] and [`ComputedState`] (`state.rs`);
//! - per-method [`ComputeOptions`] (`options.rs`).
//!
//! Architecture invariant: this crate knows nothing about the network or a database.

mod clock;
mod computed;
mod context;
mod metrics;
mod node;
mod options;
#[doc(hidden)]
pub mod plumbing;
mod registry;
mod service;
mod state;
mod sync;
mod table;

pub use computed::{BoxFuture, Computed, ConsistencyState};
pub use context::untracked;
pub use metrics::Metrics;
pub use options::{ComputeOptions, OutputKind, TransientError};
pub use registry::{Registry, RegistryBuilder};
pub use service::{ComputeService, ServiceHandle, MAX_METHODS};
pub use state::{ComputedState, ComputedStateBuilder, MutableState};

/// Invalidates `computed` and everything that depends on it; see [`Computed::invalidate`].
pub fn invalidate<T: Clone + Send + Sync + 'static>(computed: &Computed<T>) -> bool {
    computed.invalidate()
}
