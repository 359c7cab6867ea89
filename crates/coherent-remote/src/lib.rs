//! Compute services over Coherent RPC: a client holds *replicas* of a server's computed
//! results, answers its own calls from them at local-cache speed, and the server pushes an
//! invalidation the moment a result it handed out becomes stale.
//!
//! - The server exposes compute methods by name with [`RemoteServer::expose`] and adds
//!   [`RemoteServer::service`] to a `coherent_rpc::Endpoint`.
//! - The client connects a [`RemoteClient`] and calls [`RemoteClient::replica`] inside its
//!   own `#[compute]` methods. Those methods (and everything that reads them: other compute
//!   methods, `ComputedState`s) are invalidated when the server's result is.
//!
//! How it works: for every replica the server holds the computed it handed out (so it stays
//! cached) with one invalidation callback, which queues the replica's id, and which it takes
//! back when the replica is released, replaced or its connection closes; one task per
//! connection pushes queued ids in batches. The client reads a local token computed per
//! replica before it asks the server, so the pushed id invalidates the token and the core's
//! cascade carries it to every dependant.
//!
//! A writer that awaits [`RemoteServer::invalidations_delivered`] waits for the trusted
//! holders (the application's own tiers) and for its own connection, never for an untrusted
//! one (a browser): see `coherent_rpc::Trust`.
//!
//! With the `http` feature (on by default), [`RemoteServer::gateway`] serves the same methods
//! to clients without the SDK: JSON `GET` endpoints with ETags and Server-Sent Events that
//! report invalidations.
//!
//! A client invalidates its replicas as soon as it knows it is disconnected (liveness pings
//! find a connection that died without a word within 2 s), so that reads go to the server
//! while it is away. One built with `keep_replicas_through_disconnects` keeps answering from
//! them instead, and after the reconnect (or a server restart) revalidates every replica it
//! holds by the hash of its value: unchanged ones stay, changed ones are invalidated.
//!
//! With the `persistent` feature, `RemoteClientBuilder::persist_to` keeps the last value
//! of every replica in a SQLite file: a restarted client answers from it at once and has the
//! server confirm each value behind the answer, the same way.
//!
//! The runnable example is `examples/remote_server.rs` with `examples/remote_client.rs`.

// The macros' generated code names `::coherent`; here that is the core (the facade
// depends on this crate, not the other way round).
extern crate coherent_core as coherent;

mod caller;
mod client;
#[cfg(feature = "persistent")]
mod disk;
#[cfg(feature = "http")]
mod gateway;
mod server;
mod wire;

/// The axum this crate builds the gateway with: the version of the `Router` that the
/// gateway returns.
#[cfg(feature = "http")]
pub use axum;
pub use caller::Caller;
pub use client::{RemoteClient, RemoteClientBuilder, LIVENESS};
#[cfg(feature = "http")]
pub use gateway::{MAX_GATEWAY_ARGS_LEN, MAX_SSE_FEEDS, MAX_SSE_LIFETIME};
pub use server::{
    Expose, RemoteServer, ServerStats, DELIVERY_TIMEOUT, MAX_REPLICAS_PER_CONNECTION,
    MAX_REPLICAS_PER_UNTRUSTED_CONNECTION, MAX_UNANSWERED_PUSHES, MAX_UNTRUSTED_REPLICAS,
};
