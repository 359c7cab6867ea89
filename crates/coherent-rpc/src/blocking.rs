//! Calls from programs without an async runtime: a client that owns a small runtime (one
//! worker thread, so the connection's reader, writer and keep-alives keep running
//! between calls) and blocks the calling thread on each call.

use std::future::Future;

use tokio::runtime::Runtime;

use crate::endpoint::Endpoint;
use crate::error::RpcError;
use crate::peer::Peer;

/// A typed client (e.g. a generated `CalcClient`) driven from blocking code.
///
/// ```no_run
/// # use coherent_rpc::{service, blocking::BlockingClient, Endpoint};
/// # #[service] pub trait Calc { async fn sum(&self, a: i32, b: i32) -> i32; }
/// let calc = BlockingClient::connect_tcp(&Endpoint::builder().build(), "127.0.0.1:7000", CalcClient::new)?;
/// let three = calc.block_on(calc.client().sum(1, 2))?;
/// # Ok::<(), coherent_rpc::RpcError>(())
/// ```
pub struct BlockingClient<C> {
    client: C,
    // Declared after the client: the client's connection is dropped before its runtime.
    runtime: Runtime,
}

impl<C> BlockingClient<C> {
    /// Connects over TCP and wraps the connection with `make` (e.g. `CalcClient::new`).
    pub fn connect_tcp(
        endpoint: &Endpoint,
        addr: impl tokio::net::ToSocketAddrs,
        make: impl FnOnce(Peer) -> C,
    ) -> Result<Self, RpcError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("coherent-rpc-blocking")
            .enable_all()
            .build()?;
        let peer = runtime.block_on(endpoint.connect_tcp(addr))?;
        Ok(Self {
            client: make(peer),
            runtime,
        })
    }

    /// The typed client: pass its calls to [`block_on`](Self::block_on).
    pub fn client(&self) -> &C {
        &self.client
    }

    /// Runs one call (or any future) to completion on this client's runtime.
    ///
    /// # Panics
    /// When called from inside an async runtime (use the async client there).
    pub fn block_on<F: Future>(&self, call: F) -> F::Output {
        self.runtime.block_on(call)
    }
}
