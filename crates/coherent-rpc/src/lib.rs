//! Coherent RPC: a compact, multiplexed binary protocol for calling Rust services from
//! another process, over TCP, Unix sockets, TLS or any byte stream.
//!
//! A service is a trait marked [`service`]; the macro generates `<Trait>Server` (serve it
//! with [`EndpointBuilder::service`]) and `<Trait>Client` (wrap a [`Peer`] in it). The wire
//! format is specified byte by byte in `PROTOCOL.md` at the repository root.
//!
//! ```
//! use coherent_rpc::{service, Endpoint, RpcError};
//!
//! #[service]
//! pub trait Calc {
//!     async fn sum(&self, a: i32, b: i32) -> i32;
//! }
//!
//! struct MyCalc;
//! impl Calc for MyCalc {
//!     async fn sum(&self, a: i32, b: i32) -> i32 { a + b }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), RpcError> {
//! let server = Endpoint::builder().service(CalcServer::new(MyCalc)).build();
//! let (a, b) = tokio::io::duplex(64 * 1024);
//! let accepted = tokio::spawn(async move { server.accept(a).await });
//! let peer = Endpoint::builder().build().connect(b).await?;
//! let _server_side = accepted.await.unwrap()?;
//! assert_eq!(CalcClient::new(peer).sum(2, 3).await?, 5);
//! # Ok(())
//! # }
//! ```

mod blob;
pub mod blocking;
mod caller;
mod codec;
mod compact;
mod config;
mod endpoint;
mod error;
pub mod frame;
pub mod handshake;
mod net;
pub mod pace;
mod peer;
mod reconnect;
mod service;
mod stream;
#[cfg(feature = "tls")]
pub mod tls;
#[cfg(feature = "websocket")]
mod websocket;

pub use blob::Blob;
pub use caller::Caller;
pub use codec::{decompress, CompressionSet, Format, Message};
pub use coherent_rpc_macros::service;
pub use config::{Config, SendBuffer, Trust};
pub use endpoint::{Endpoint, EndpointBuilder};
pub use error::{ErrorCode, RpcError};
pub use frame::Compression;
pub use peer::{CallOptions, EndpointStats, Peer, Stats};
pub use reconnect::{Backoff, Reconnecting};
pub use service::{
    item_stream, method_id, BoxFuture, CallContext, Credentials, EncodeItems, Identity, ItemStream,
    MethodInfo, MethodKind, Response, ServerStream, Service,
};
pub use stream::{ClientStream, Upload};

/// The axum the WebSocket transport is served from: the version of the `Router` and the
/// upgrade it takes.
#[cfg(feature = "websocket")]
pub use axum;

/// Plumbing for the code `#[service]` generates; not a public API.
#[doc(hidden)]
pub mod __private {
    pub use bytes::Bytes;
    pub use futures::{FutureExt, Stream, StreamExt};
    pub use serde;
}
