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
//! ## One definition, in process or remote
//!
//! A trait marked `#[compute_service]` defines a compute service once. Implement it with
//! `#[compute_service]` on the `impl` and the implementation is memoized; with the `remote`
//! feature (on by default) the macro also generates `<Trait>Server`, which exposes every
//! method to remote clients in one call, and `<Trait>Client`, a typed stub that implements
//! the same trait with *replicas*: answered from the client's cache and invalidated by the
//! server the moment its result changes. Code written against the trait runs unchanged on
//! either.
//!
//! Every method returns `Result<T, E>` where `E: From<RpcError>`: a stub reports a lost
//! connection through it. `RpcError` itself will do, or an error type of your own.
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use coherent::prelude::*;
//!
//! #[compute_service]
//! pub trait Counter {
//!     /// The count, times `factor`.
//!     async fn scaled(&self, factor: u64) -> Result<u64, RpcError>;
//! }
//!
//! #[derive(Clone, ComputeService)]
//! struct Local {
//!     handle: ServiceHandle,
//!     count: Arc<AtomicU64>,
//! }
//!
//! #[compute_service]
//! impl Counter for Local {
//!     async fn scaled(&self, factor: u64) -> Result<u64, RpcError> {
//!         Ok(self.count.load(Ordering::SeqCst) * factor)
//!     }
//! }
//!
//! /// Written once against the trait: runs on the service itself or on a remote stub.
//! async fn report(counter: &impl Counter) -> String {
//!     match counter.scaled(10).await {
//!         Ok(n) => format!("{n}"),
//!         Err(e) => format!("failed: {e}"),
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), RpcError> {
//! let local = Local { handle: ServiceHandle::new(), count: Arc::new(AtomicU64::new(4)) };
//! assert_eq!(report(&local).await, "40");
//!
//! // The server: every method of `Counter` exposed in one call.
//! let remote = RemoteServer::new().expose_service(CounterServer::new(local.clone()));
//! let endpoint = Endpoint::builder().service(remote.service()).build();
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
//! let addr = listener.local_addr().unwrap();
//! tokio::spawn(async move { endpoint.serve_tcp(listener).await });
//!
//! // The client: the same trait, answered from replicas.
//! let counter = CounterClient::new(RemoteClient::connect_tcp(addr).await?);
//! assert_eq!(report(&counter).await, "40"); // a round trip
//! assert_eq!(report(&counter).await, "40"); // a hit on the client
//!
//! local.count.store(5, Ordering::SeqCst);
//! local.invalidate_scaled(10); // pushed to the client's replica
//! let fresh = counter.scaled_computed(10).await;
//! fresh.when_invalidated().await; // (the push may still be on its way)
//! assert_eq!(report(&counter).await, "50");
//! # Ok(()) }
//! ```
//!
//! ## One dependency
//!
//! The layers are modules of this crate, each behind a feature: [`rpc`] (`rpc`: the
//! protocol, plain RPC services with `#[rpc::service]`), [`remote`] (`remote`: replicas and
//! the HTTP gateway with `http`, a persistent client cache with `persistent`), the
//! transports `tls` and `websocket`, `ops` (commands, the operation log and
//! invalidation across the hosts of a cluster, with `nats` for the NATS notifier),
//! [`metrics`] (`metrics`: the counters through the `metrics` facade), and `typescript`
//! (`coherent::typescript`: TypeScript declarations of a compute service's methods and
//! types, through ts-rs, for clients calling it over MessagePack; see
//! `#[compute_service(typescript)]`). Defaults: `remote`, `http`, `tls`, `metrics`. The
//! [`prelude`] imports what a service and its clients use.
//!
//! See the README for a tour and ARCHITECTURE.md for how it works.

pub use coherent_core::{
    invalidate, lease_clock, untracked, BoxFuture, CallbackKey, ComputeOptions, ComputeService,
    Computed, ComputedState, ComputedStateBuilder, ConsistencyState, Lease, Metrics, MutableState,
    OutputKind, Registry, RegistryBuilder, ServiceHandle, TransientError, MAX_METHODS,
};
pub use coherent_macros::{compute_service, ComputeService};

/// Implements `From<coherent::rpc::RpcError>` for an error enum: the variant marked
/// `#[rpc_error]` is what a lost connection or a refused call becomes (it holds the
/// `RpcError`, its message, or nothing). The error of a compute service's trait methods
/// needs it, for its client stub.
///
/// ```
/// #[derive(Debug, Clone, PartialEq, coherent::FromRpcError)]
/// pub enum UsersError {
///     Database(String),
///     #[rpc_error]
///     Unavailable(String),
/// }
/// let e: UsersError = coherent::rpc::RpcError::new(coherent::rpc::ErrorCode::Disconnected, "gone").into();
/// assert!(matches!(e, UsersError::Unavailable(m) if m.contains("gone")));
/// ```
#[cfg(feature = "rpc")]
pub use coherent_macros::FromRpcError;

#[doc(hidden)]
pub use coherent_core::plumbing;

/// The RPC protocol: endpoints, peers, transports, and plain RPC services defined by a
/// trait marked [`rpc::service`] (no caching: every call is a round trip). See the
/// `coherent-rpc` crate's README.
#[cfg(feature = "rpc")]
pub mod rpc {
    pub use coherent_rpc::*;
    /// Marks a trait as an RPC service: see the `coherent-rpc` crate's `service`. Here the
    /// generated code reaches the protocol through `::coherent::rpc`, so that a crate that
    /// depends on this facade alone can use it.
    pub use coherent_rpc_macros::facade_service as service;
}

/// Compute services over RPC: [`RemoteServer`](remote::RemoteServer) and
/// [`RemoteClient`](remote::RemoteClient), client replicas, the HTTP gateway. See the
/// `coherent-remote` crate's README.
#[cfg(feature = "remote")]
pub use coherent_remote as remote;

/// Coherent across hosts: commands through a pipeline, an operation log in the shared
/// database (SQLite or PostgreSQL), and every host replaying the invalidations, woken by
/// PostgreSQL `LISTEN`/`NOTIFY` or NATS. See the `coherent-ops` crate's README.
#[cfg(feature = "ops")]
pub use coherent_ops as ops;

/// The rusqlite that `ops` links (SQLite allows one per program): the version of the
/// connection a command's handler gets on SQLite (`Tx::require_sqlite`). Depend on it
/// through here rather than guess the version to pin.
#[cfg(feature = "ops")]
pub use coherent_ops::rusqlite;

/// The tokio-postgres that `ops` uses: the version of the client a command's handler gets
/// on PostgreSQL, and of its errors.
#[cfg(feature = "ops")]
pub use coherent_ops::tokio_postgres as postgres;

/// The axum that the HTTP gateway (`http`) and the WebSocket transport (`websocket`) are
/// built on: the version of the `Router` they return and take.
#[cfg(feature = "http")]
pub use coherent_remote::axum;
#[cfg(all(feature = "websocket", not(feature = "http")))]
pub use coherent_rpc::axum;

#[cfg(feature = "metrics")]
pub mod metrics;

#[cfg(feature = "typescript")]
pub mod typescript;

/// What a compute service, its server and its clients use: `use coherent::prelude::*;`.
pub mod prelude {
    pub use coherent_core::{
        ComputeService, Computed, ComputedState, MutableState, Registry, ServiceHandle,
    };
    pub use coherent_macros::{compute_service, ComputeService};

    #[cfg(feature = "rpc")]
    pub use coherent_macros::FromRpcError;
    #[cfg(feature = "rpc")]
    pub use coherent_rpc::{Endpoint, ErrorCode, RpcError};

    #[cfg(feature = "remote")]
    pub use coherent_remote::{RemoteClient, RemoteServer};

    #[cfg(feature = "ops")]
    pub use coherent_ops::{
        Command, CommandClient, CommandError, CommandServer, Database, Handler, Host, Tx,
    };
}

/// What the macros' generated code names; not a public API.
#[doc(hidden)]
pub mod __private {
    #[cfg(feature = "remote")]
    pub use coherent_remote as remote;
    #[cfg(feature = "rpc")]
    pub use coherent_rpc as rpc;
}

/// Keeps its input where the `remote` feature is on: the `<Trait>Client` and
/// `<Trait>Server` that `#[compute_service]` generates for a trait.
#[doc(hidden)]
#[cfg(feature = "remote")]
#[macro_export]
macro_rules! __if_remote {
    ($($item:tt)*) => { $($item)* };
}

/// Drops its input: the `remote` feature is off.
#[doc(hidden)]
#[cfg(not(feature = "remote"))]
#[macro_export]
macro_rules! __if_remote {
    ($($item:tt)*) => {};
}

/// Keeps its input where the `typescript` feature is on: the `<Trait>Server::typescript()`
/// that `#[compute_service(typescript)]` generates.
#[doc(hidden)]
#[cfg(feature = "typescript")]
#[macro_export]
macro_rules! __if_typescript {
    ($($item:tt)*) => { $($item)* };
}

/// Refuses its input: `#[compute_service(typescript)]` without the `typescript` feature.
#[doc(hidden)]
#[cfg(not(feature = "typescript"))]
#[macro_export]
macro_rules! __if_typescript {
    ($($item:tt)*) => {
        ::core::compile_error!(
            "#[compute_service(typescript)] needs the `typescript` feature of `coherent`"
        );
    };
}

/// The README's code blocks, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;

/// The ops crate's README's code blocks, compiled (and run where they need no database)
/// as doc tests of the facade, whose paths they use.
#[cfg(all(doctest, feature = "ops"))]
#[doc = include_str!("../../coherent-ops/README.md")]
struct OpsReadmeDoctests;
