//! The client side: replicas as dependencies. Each replica has a local *token*, a tiny
//! computed that the calling compute method reads before it asks the server; the server's
//! push invalidates the token, and the core's cascade does the rest.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use coherent::{compute_service, ComputeService, Registry, ServiceHandle};
use coherent_rpc::{method_id, Blob, Config, Endpoint, Peer, RpcError};
use parking_lot::Mutex;
use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Notify;

use crate::wire::{ReplicaHostClient, ReplicaSink, ReplicaSinkServer};

/// Ids of replicas this client holds; shared by the client, its tokens and its sink.
#[derive(Default)]
struct Live {
    /// Replicas the server watches for us.
    ids: Mutex<HashSet<u64>>,
    /// Replicas dropped here while the server still watches them.
    released: Mutex<Vec<u64>>,
    wake: Notify,
}

/// A replica's token. Dropped when the core drops the token's computed (after it was
/// invalidated, or evicted with everything that read it): the server is then told to stop
/// watching, unless the replica was invalidated already.
struct Token {
    replica: u64,
    live: Arc<Live>,
}

impl Drop for Token {
    fn drop(&mut self) {
        if self.live.ids.lock().remove(&self.replica) {
            self.live.released.lock().push(self.replica);
            self.live.wake.notify_one();
        }
    }
}

#[derive(Clone, ComputeService)]
struct Tokens {
    handle: ServiceHandle,
    live: Arc<Live>,
}

#[compute_service]
impl Tokens {
    /// A replica's token: read it to depend on the replica.
    #[compute]
    async fn token(&self, replica: u64) -> Arc<Token> {
        Arc::new(Token {
            replica,
            live: self.live.clone(),
        })
    }
}

/// Invalidations pushed by the server.
struct Sink {
    tokens: Tokens,
}

impl ReplicaSink for Sink {
    async fn invalidated(&self, replicas: Vec<u64>) {
        tracing::debug!(count = replicas.len(), "replicas invalidated by the server");
        let mut ids = self.tokens.live.ids.lock();
        for id in &replicas {
            ids.remove(id);
        }
        drop(ids);
        for id in replicas {
            self.tokens.invalidate_token(id);
        }
    }
}

/// A connection to a server's exposed compute methods (see `RemoteServer`).
///
/// [`replica`](Self::replica), called inside a client-side `#[compute]` method, makes that
/// method a replica of the server's: the first call asks the server, later calls are cache
/// hits, and the server's invalidation reaches it (and whatever depends on it) as soon as
/// the server's result changes. [`call`](Self::call) is a plain round trip.
///
/// When the connection closes, every replica it holds is invalidated: the next read asks
/// again (and fails while there is no connection). Nothing stale survives a disconnect.
#[derive(Clone)]
pub struct RemoteClient {
    inner: Arc<Inner>,
}

struct Inner {
    peer: Peer,
    host: ReplicaHostClient,
    tokens: Tokens,
    next_replica: AtomicU64,
}

/// Options of a [`RemoteClient`] connection.
#[derive(Default)]
pub struct RemoteClientBuilder {
    config: Config,
    registry: Option<Registry>,
}

impl RemoteClientBuilder {
    /// The connection's RPC settings.
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// The registry that holds the client's replica tokens (the default registry if not
    /// set); use the registry of the compute services that read the replicas.
    pub fn registry(mut self, registry: &Registry) -> Self {
        self.registry = Some(registry.clone());
        self
    }

    /// Connects over TCP.
    pub async fn connect_tcp(self, addr: SocketAddr) -> Result<RemoteClient, RpcError> {
        let (endpoint, tokens) = self.endpoint();
        let peer = endpoint.connect_tcp(addr).await?;
        Ok(RemoteClient::start(peer, tokens))
    }

    /// Connects over any byte stream (a Unix socket, a child's pipes, an in-memory duplex).
    pub async fn connect<IO>(self, io: IO) -> Result<RemoteClient, RpcError>
    where
        IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let (endpoint, tokens) = self.endpoint();
        let peer = endpoint.connect(io).await?;
        Ok(RemoteClient::start(peer, tokens))
    }

    fn endpoint(self) -> (Endpoint, Tokens) {
        let handle = match &self.registry {
            Some(r) => ServiceHandle::with_registry(r),
            None => ServiceHandle::new(),
        };
        let tokens = Tokens {
            handle,
            live: Arc::new(Live::default()),
        };
        let endpoint = Endpoint::builder()
            .config(self.config)
            .service(ReplicaSinkServer::new(Sink {
                tokens: tokens.clone(),
            }))
            .build();
        (endpoint, tokens)
    }
}

impl RemoteClient {
    /// Options for a connection.
    pub fn builder() -> RemoteClientBuilder {
        RemoteClientBuilder::default()
    }

    /// Connects over TCP with default options.
    pub async fn connect_tcp(addr: SocketAddr) -> Result<Self, RpcError> {
        Self::builder().connect_tcp(addr).await
    }

    fn start(peer: Peer, tokens: Tokens) -> Self {
        let client = Self {
            inner: Arc::new(Inner {
                host: ReplicaHostClient::new(peer.clone()),
                peer,
                tokens,
                next_replica: AtomicU64::new(1),
            }),
        };
        tokio::spawn(housekeeping(
            client.inner.peer.clone(),
            client.inner.host.clone(),
            client.inner.tokens.clone(),
        ));
        client
    }

    /// Calls the server's compute method `method` (the name it was exposed under) with the
    /// argument tuple `args`, as a replica: call it inside a `#[compute]` method, which then
    /// depends on the server's result and is invalidated with it.
    ///
    /// Outside a compute method it works like [`call`](Self::call), but the server keeps
    /// watching the result until the token is dropped.
    pub async fn replica<A, T>(&self, method: &str, args: A) -> Result<T, RpcError>
    where
        A: Serialize,
        T: DeserializeOwned,
    {
        let inner = &*self.inner;
        let replica = inner.next_replica.fetch_add(1, Ordering::Relaxed);
        inner.tokens.live.ids.lock().insert(replica);
        // Read first, so that an invalidation that overtakes the answer finds the token
        // (and the caller, still computing, is stored as invalidated).
        drop(inner.tokens.token(replica).await);
        if let Some(reason) = inner.peer.close_reason() {
            inner.tokens.invalidate_token(replica);
            return Err(reason);
        }
        let format = inner.peer.format();
        let args = Blob::from(format.encode(&args)?);
        let value = inner.host.fetch(method_id(method), args, replica).await??;
        format.decode_bytes(value.into_bytes())
    }

    /// Calls the server's compute method `method` once: a round trip every time, nothing
    /// cached here.
    pub async fn call<A, T>(&self, method: &str, args: A) -> Result<T, RpcError>
    where
        A: Serialize,
        T: DeserializeOwned,
    {
        let format = self.inner.peer.format();
        let args = Blob::from(format.encode(&args)?);
        let value = self.inner.host.call(method_id(method), args).await??;
        format.decode_bytes(value.into_bytes())
    }

    /// The underlying connection.
    pub fn peer(&self) -> &Peer {
        &self.inner.peer
    }

    /// How many replicas the server watches for this client now.
    pub fn replica_count(&self) -> usize {
        self.inner.tokens.live.ids.lock().len()
    }
}

/// Tells the server about dropped replicas (in batches), and invalidates every replica
/// when the connection closes.
async fn housekeeping(peer: Peer, host: ReplicaHostClient, tokens: Tokens) {
    let live = tokens.live.clone();
    loop {
        tokio::select! {
            () = live.wake.notified() => {}
            _ = peer.closed() => break,
        }
        let released = std::mem::take(&mut *live.released.lock());
        if !released.is_empty() && host.release(released).await.is_err() {
            break;
        }
    }
    let ids: Vec<u64> = live.ids.lock().drain().collect();
    tracing::debug!(
        count = ids.len(),
        "connection closed: invalidating its replicas"
    );
    for id in ids {
        tokens.invalidate_token(id);
    }
}
