//! # Coherent
//!
//! Results computed once, cached everywhere, invalidated exactly when their inputs change.
//!
//! A compute service is an ordinary struct whose `#[compute]` async methods are memoized per
//! (service, method, arguments). While a method runs, every compute method or state it reads is
//! recorded as a dependency; invalidating a result invalidates everything computed from it,
//! transitively and synchronously, and the next call recomputes.
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use coherent::{compute_service, ComputeService, ServiceHandle};
//!
//! #[derive(Clone, ComputeService)]
//! struct Prices {
//!     handle: ServiceHandle,
//!     base: Arc<AtomicU64>,
//! }
//!
//! #[compute_service]
//! impl Prices {
//!     #[compute]
//!     async fn base(&self) -> u64 {
//!         self.base.load(Ordering::SeqCst)
//!     }
//!
//!     #[compute]
//!     async fn with_tax(&self, percent: u64) -> u64 {
//!         let base = self.base().await; // recorded as a dependency
//!         base + base * percent / 100
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let prices = Prices { handle: ServiceHandle::new(), base: Arc::new(AtomicU64::new(100)) };
//! assert_eq!(prices.with_tax(20).await, 120);
//!
//! prices.base.store(200, Ordering::SeqCst);
//! prices.invalidate_base(); // cascades to with_tax(20)
//! assert_eq!(prices.with_tax(20).await, 240);
//! # }
//! ```
//!
//! See the README for a tour and ARCHITECTURE.md for how it works.

pub use coherent_core::{
    invalidate, untracked, BoxFuture, ComputeOptions, ComputeService, Computed, ComputedState,
    ComputedStateBuilder, ConsistencyState, Metrics, MutableState, OutputKind, Registry,
    RegistryBuilder, ServiceHandle, TransientError, MAX_METHODS,
};
pub use coherent_macros::{compute_service, ComputeService};

#[doc(hidden)]
pub use coherent_core::plumbing;

/// The README's code blocks, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;
