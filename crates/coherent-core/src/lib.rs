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

#![cfg_attr(loom, allow(dead_code, unreachable_pub))]

// Under `--cfg loom` only the state machine (`node.rs`), the tables' lock (`striped.rs`) and what
// they need are built, so that the model checker explores them alone: `RUSTFLAGS="--cfg loom" cargo test -p coherent-core --lib`.
#[cfg(not(loom))]
mod clock;
#[cfg(not(loom))]
mod computed;
#[cfg(not(loom))]
mod context;
mod metrics;
mod node;
#[cfg(not(loom))]
mod options;
#[cfg(not(loom))]
#[doc(hidden)]
pub mod plumbing;
#[cfg(not(loom))]
mod registry;
#[cfg(not(loom))]
mod service;
#[cfg(not(loom))]
mod state;
mod striped;
mod sync;
#[cfg(not(loom))]
mod table;

#[cfg(not(loom))]
pub use computed::{BoxFuture, Computed, ConsistencyState};
#[cfg(not(loom))]
pub use context::untracked;
pub use metrics::Metrics;
pub use node::CallbackKey;
#[cfg(not(loom))]
pub use options::{ComputeOptions, OutputKind, TransientError};
#[cfg(not(loom))]
pub use registry::{lease_clock, Lease, Registry, RegistryBuilder};
#[cfg(not(loom))]
pub use service::{ComputeService, ServiceHandle, MAX_METHODS};
#[cfg(not(loom))]
pub use state::{ComputedState, ComputedStateBuilder, MutableState};

/// Invalidates `computed` and everything that depends on it; see [`Computed::invalidate`].
#[cfg(not(loom))]
pub fn invalidate<T: Clone + Send + Sync + 'static>(computed: &Computed<T>) -> bool {
    computed.invalidate()
}
