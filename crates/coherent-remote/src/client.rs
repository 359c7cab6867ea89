//! The client side: replicas as dependencies. Each replica has a local *token*, a tiny
//! computed that the calling compute method reads before it asks the server; the server's
//! push invalidates the token, and the core's cascade does the rest. After a reconnect, the
//! replicas held are revalidated by hash; those that changed meanwhile are invalidated.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use coherent::{Registry, ServiceHandle};
use coherent_macros::{compute_service, ComputeService};
use coherent_rpc::{
    method_id, Backoff, Blob, Config, Endpoint, ErrorCode, Peer, Reconnecting, RpcError,
};
use parking_lot::Mutex;
use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{watch, Notify};

use crate::wire::{value_hash, Held, ReplicaHostClient, ReplicaSink, ReplicaSinkServer};

/// What the client knows of one replica: enough to ask the server to confirm it.
struct Replica {
    method: u32,
    args: Blob,
    /// `value_hash` of the value received; `None` while the fetch is in flight.
    hash: Option<u64>,
    /// False while the value comes from the persistent cache and the server has not
    /// confirmed it yet.
    confirmed: bool,
}

/// The replicas this client holds; shared by the client, its tokens and its sink.
#[derive(Default)]
struct Live {
    replicas: Mutex<HashMap<u64, Replica>>,
    /// Replicas dropped here while the server still watches them.
    released: Mutex<Vec<u64>>,
    wake: Notify,
    /// The persistent cache, whose entry for a key goes when its replica is invalidated.
    #[cfg(feature = "persistent")]
    disk: Option<crate::disk::Disk>,
}

impl Live {
    /// Asks the server to stop watching `replica` (again, if it may have started after
    /// an earlier release overtook the watch).
    fn release(&self, replica: u64) {
        self.released.lock().push(replica);
        self.wake.notify_one();
    }
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
        if self.live.replicas.lock().remove(&self.replica).is_some() {
            self.live.release(self.replica);
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

impl Tokens {
    /// Forgets these replicas and invalidates everything that read them. `stale`: the
    /// server said their values changed, so the persistent cache forgets them too (not when
    /// they are only unconfirmed, e.g. after a disconnect).
    fn invalidate(&self, replicas: impl IntoIterator<Item = u64>, stale: bool) {
        let replicas: Vec<u64> = replicas.into_iter().collect();
        let mut live = self.live.replicas.lock();
        let removed: Vec<Replica> = replicas.iter().filter_map(|id| live.remove(id)).collect();
        drop(live);
        #[cfg(feature = "persistent")]
        if let Some(disk) = self.live.disk.as_ref().filter(|_| stale) {
            // What the file holds for these keys is stale now.
            for r in removed {
                disk.remove(r.method, r.args);
            }
        }
        #[cfg(not(feature = "persistent"))]
        drop((removed, stale));
        for id in replicas {
            self.invalidate_token(id);
        }
    }
}

/// Invalidations pushed by the server.
struct Sink {
    tokens: Tokens,
}

impl ReplicaSink for Sink {
    async fn invalidated(&self, replicas: Vec<u64>) {
        tracing::debug!(count = replicas.len(), "replicas invalidated by the server");
        self.tokens.invalidate(replicas, true);
        // Acknowledged once the persistent cache forgot them too: a client that crashes
        // after the acknowledgement must not find the old values in its file.
        #[cfg(feature = "persistent")]
        if let Some(disk) = &self.tokens.live.disk {
            disk.flush().await;
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
/// A disconnect invalidates every replica as soon as the client knows of it, so that reads
/// made while it is away go to the server (they wait for the reconnection, or fail with its
/// error): the server has stopped waiting for this client, so a write may return meanwhile.
/// A connection that dies without a word is found by liveness pings
/// ([`RemoteClientBuilder::liveness`], 2 s), before the server's delivery timeout (5 s).
/// The client reconnects (with the builder's backoff; to another host, if it was given
/// several: [`connect_tcp_any`](Self::connect_tcp_any)). With
/// [`keep_replicas_through_disconnects`](RemoteClientBuilder::keep_replicas_through_disconnects)
/// it keeps them instead, answering from them while away, and revalidates them after the
/// reconnect: it sends the hash of each value, the server answers which ones changed
/// meanwhile, and those are invalidated. When reconnecting fails for good, or after
/// [`close`](Self::close), every replica is invalidated either way.
///
/// The client holds a *lease* on its registry ([`coherent::Registry::lease`]), renewed by
/// each liveness ping: the registry answers from its cache only while the client has heard
/// from the server within the liveness timeout, and no longer than the server itself could
/// answer from its caches (a cluster host's server bounds it by the host's own lease: see
/// `RemoteServer::lease_from`). So a client process paused (SIGSTOP, a frozen VM) past its
/// lease answers nothing from its replicas when it resumes, before it has read what the
/// server sent meanwhile: the reads go to the server. Give the client the registry of the
/// services that read its replicas ([`RemoteClientBuilder::registry`]): the lease fences
/// every cache of that registry while it is out.
#[derive(Clone)]
pub struct RemoteClient {
    inner: Arc<Inner>,
}

struct Inner {
    connection: Reconnecting,
    /// The addresses it connects to over TCP; `None` for other transports.
    hosts: Option<Arc<Hosts>>,
    host: ReplicaHostClient<Reconnecting>,
    tokens: Tokens,
    next_replica: AtomicU64,
    closed: AtomicBool,
    policy: Policy,
    /// Bumped after each reconnect's revalidation.
    revalidated: watch::Sender<u64>,
    /// This client's lease on the registry of its replicas (see [`RemoteClientBuilder::liveness`]);
    /// `None` without liveness pings or when replicas are kept through disconnects.
    lease: Option<coherent::Lease>,
    /// Until when the lease runs (on `lease_clock`; 0: not renewed since it was dropped).
    lease_until: AtomicU64,
    /// Times a renewal came after the lease had run out.
    leases_lost: AtomicU64,
    /// Whether the last renewal's answer left the lease any time.
    lease_granted: AtomicBool,
    /// While the lease is out: the replica last fetched for each method and arguments.
    /// Every read then computes again and fetches under a new id; the one before is read
    /// by nothing current, and is let go at once (else the server's watches on the
    /// connection grew with every read until a prune). Emptied when a lease is granted.
    fetched_unleased: Mutex<HashMap<(u32, Blob), u64>>,
    /// The keys the file held when the client started, until each is first read: the
    /// file answers only those reads (later ones come from the server or from memory).
    #[cfg(feature = "persistent")]
    from_disk: Mutex<std::collections::HashSet<(u32, Blob)>>,
}

/// How long a client goes without an answer from its server (default of
/// [`RemoteClientBuilder::liveness`]) before it takes the connection for dead: closes it,
/// invalidates its replicas and reconnects. Well below the server's
/// [`DELIVERY_TIMEOUT`](crate::DELIVERY_TIMEOUT) (5 s), after which a write stops waiting
/// for a client that does not answer its push.
pub const LIVENESS: std::time::Duration = std::time::Duration::from_secs(2);

/// Options of a [`RemoteClient`] connection.
pub struct RemoteClientBuilder {
    config: Config,
    token: String,
    registry: Option<Registry>,
    backoff: Option<Backoff>,
    liveness: Option<std::time::Duration>,
    keep_through_disconnects: bool,
    #[cfg(feature = "persistent")]
    persist_to: Option<std::path::PathBuf>,
}

impl Default for RemoteClientBuilder {
    fn default() -> Self {
        Self {
            config: Config::default(),
            token: String::new(),
            registry: None,
            backoff: None,
            liveness: Some(LIVENESS),
            keep_through_disconnects: false,
            #[cfg(feature = "persistent")]
            persist_to: None,
        }
    }
}

impl RemoteClientBuilder {
    /// The bearer token the client presents in its handshake, on every connection and
    /// reconnection (what the server's `authenticate_with` hook sees as
    /// `Credentials::token`). Default: none.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = token.into();
        self
    }

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

    /// How reconnection attempts are spaced (`Backoff::default()` if not set).
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = Some(backoff);
        self
    }

    /// How long the client waits for its server's answer to a liveness ping before it takes
    /// the connection for dead (default [`LIVENESS`], 2 s; `None`: never). It pings every quarter of it. A connection can die without a word
    /// (a half-open TCP connection: a NAT or a firewall forgot it, a host vanished): the
    /// server then stops waiting for this client's acknowledgements after its delivery
    /// timeout (5 s by default), and a write returns; this client must have stopped
    /// answering from its replicas by then. Keep it below the server's delivery timeout,
    /// with a second or more to spare for scheduling.
    ///
    /// The same pings renew the client's lease (see [`RemoteClient`]): `None` turns the
    /// lease off with the pings.
    pub fn liveness(mut self, timeout: Option<std::time::Duration>) -> Self {
        self.liveness = timeout.map(|t| t.max(std::time::Duration::from_millis(4)));
        self
    }

    /// Keeps the replicas through a disconnect, answering from them until the reconnect's
    /// revalidation invalidates those that changed (default: `false`, every replica is
    /// invalidated as soon as the client knows it is disconnected, so that reads go to the
    /// server). With `true`, a read made while disconnected may return a value that a
    /// write which has already returned changed; it trades that for answers while the
    /// server is away. A client whose connection cannot be made again invalidates them
    /// anyway.
    pub fn keep_replicas_through_disconnects(mut self, keep: bool) -> Self {
        self.keep_through_disconnects = keep;
        self
    }

    /// Keeps the last value of every replica in a SQLite file at `path` (feature
    /// `persistent`). A client started later with the same file answers a replica's first
    /// read from it at once, unconfirmed, and has the server confirm it behind the answer
    /// (by hash, as after a reconnect); if the server's value differs, the replica is
    /// invalidated and the next read fetches the new one.
    #[cfg(feature = "persistent")]
    pub fn persist_to(mut self, path: impl AsRef<std::path::Path>) -> Self {
        self.persist_to = Some(path.as_ref().to_owned());
        self
    }

    /// Connects over TCP, and reconnects to the same address.
    pub async fn connect_tcp(self, addr: SocketAddr) -> Result<RemoteClient, RpcError> {
        self.connect_tcp_any([addr]).await
    }

    /// Connects over TCP to the first of `addrs` that answers, and fails over among them:
    /// hosts that serve the same compute services over the same data.
    ///
    /// Each connection attempt tries every address once, in turn, starting with the one
    /// last connected to (so a brief blip returns to the same host) and going on at once to
    /// the next when one fails. The builder's [`backoff`](Self::backoff) spaces these
    /// rounds, not the addresses within one: a dead host costs one refused connect before
    /// the next address is tried, not a backoff sequence, and `max_attempts` counts rounds.
    /// (A host that drops packets instead of refusing costs up to the config's
    /// `handshake_timeout`.) The first connection is made the same way, starting with the
    /// first address.
    ///
    /// After a failover the replicas are revalidated against the new host, exactly as
    /// after a reconnect: those whose values differ there are invalidated, the others are
    /// kept and watched by the new host. [`RemoteClient::connected_to`] says which address
    /// the client is on; a failover is logged (`tracing`, level info).
    ///
    /// # Errors
    /// `Disconnected` when `addrs` is empty, or when no address answered within the
    /// backoff's attempts (the message lists each address's failure); `Unauthenticated`
    /// when a host refused the credentials and none accepted them.
    pub async fn connect_tcp_any(
        self,
        addrs: impl IntoIterator<Item = SocketAddr>,
    ) -> Result<RemoteClient, RpcError> {
        let hosts = Arc::new(Hosts::new(addrs.into_iter().collect())?);
        let to = hosts.clone();
        self.connect_through(
            move |endpoint| {
                let hosts = to.clone();
                async move { hosts.connect(&endpoint).await }
            },
            Some(hosts),
        )
        .await
    }

    /// Connects with `connect`, called again for every reconnection, with the endpoint to
    /// connect through (it serves the client's end of the protocol): any transport, e.g.
    /// `|e| async move { e.connect_unix(path).await }` or a WebSocket.
    pub async fn connect_with<F, Fut>(self, connect: F) -> Result<RemoteClient, RpcError>
    where
        F: Fn(Endpoint) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Peer, RpcError>> + Send + 'static,
    {
        self.connect_through(connect, None).await
    }

    /// [`connect_with`](Self::connect_with), with the TCP addresses `connect` goes through
    /// when it is [`Hosts::connect`].
    async fn connect_through<F, Fut>(
        self,
        connect: F,
        hosts: Option<Arc<Hosts>>,
    ) -> Result<RemoteClient, RpcError>
    where
        F: Fn(Endpoint) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Peer, RpcError>> + Send + 'static,
    {
        let backoff = self.backoff.unwrap_or_default();
        let policy = Policy {
            liveness: self.liveness,
            keep_through_disconnects: self.keep_through_disconnects,
        };
        #[cfg(feature = "persistent")]
        let disk = match &self.persist_to {
            Some(path) => Some(crate::disk::Disk::open(path)?),
            None => None,
        };
        #[cfg(feature = "persistent")]
        let from_disk = disk
            .as_ref()
            .map(crate::disk::Disk::keys)
            .unwrap_or_default();
        let (endpoint, tokens) = self.endpoint(
            #[cfg(feature = "persistent")]
            disk,
        );
        let connection = Reconnecting::new(move || connect(endpoint.clone()), backoff);
        RemoteClient::start(
            connection,
            hosts,
            tokens,
            policy,
            #[cfg(feature = "persistent")]
            from_disk,
        )
        .await
    }

    /// Connects over one byte stream (a child's pipes, an in-memory duplex). Such a
    /// connection cannot be made again: when it closes, every replica is invalidated.
    pub async fn connect<IO>(self, io: IO) -> Result<RemoteClient, RpcError>
    where
        IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let io = Arc::new(Mutex::new(Some(io)));
        self.backoff(Backoff {
            max_attempts: 1,
            ..Backoff::default()
        })
        .connect_with(move |endpoint| {
            let io = io.lock().take();
            async move {
                match io {
                    Some(io) => endpoint.connect(io).await,
                    None => Err(RpcError::new(
                        ErrorCode::Disconnected,
                        "a connection over a single byte stream cannot be made again",
                    )),
                }
            }
        })
        .await
    }

    fn endpoint(
        self,
        #[cfg(feature = "persistent")] disk: Option<crate::disk::Disk>,
    ) -> (Endpoint, Tokens) {
        let handle = match &self.registry {
            Some(r) => ServiceHandle::with_registry(r),
            None => ServiceHandle::new(),
        };
        let tokens = Tokens {
            handle,
            live: Arc::new(Live {
                #[cfg(feature = "persistent")]
                disk,
                ..Live::default()
            }),
        };
        let endpoint = Endpoint::builder()
            .config(self.config)
            .token(self.token)
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

    /// Connects over TCP to the first of `addrs` that answers, with default options, and
    /// fails over among them (see [`RemoteClientBuilder::connect_tcp_any`]).
    pub async fn connect_tcp_any(
        addrs: impl IntoIterator<Item = SocketAddr>,
    ) -> Result<Self, RpcError> {
        Self::builder().connect_tcp_any(addrs).await
    }

    async fn start(
        connection: Reconnecting,
        hosts: Option<Arc<Hosts>>,
        tokens: Tokens,
        policy: Policy,
        #[cfg(feature = "persistent")] from_disk: std::collections::HashSet<(u32, Blob)>,
    ) -> Result<Self, RpcError> {
        let first = connection.peer().await?;
        // Renewed once before the client is handed out (below); until a renewal, a value
        // fetched is answered only once one came (`replica_by_id`).
        let lease = (policy.liveness.is_some() && !policy.keep_through_disconnects)
            .then(|| tokens.handle.registry().lease());
        let client = Self {
            inner: Arc::new(Inner {
                host: ReplicaHostClient::new(connection.clone()),
                connection,
                hosts,
                tokens,
                next_replica: AtomicU64::new(1),
                closed: AtomicBool::new(false),
                policy,
                revalidated: watch::Sender::new(0),
                lease,
                lease_until: AtomicU64::new(0),
                leases_lost: AtomicU64::new(0),
                lease_granted: AtomicBool::new(false),
                fetched_unleased: Mutex::default(),
                #[cfg(feature = "persistent")]
                from_disk: Mutex::new(from_disk),
            }),
        };
        tokio::spawn(supervise(
            Arc::downgrade(&client.inner),
            first.when_closed(),
        ));
        if let Some(timeout) = policy.liveness {
            let weak = Arc::downgrade(&client.inner);
            let first_left = renew_within(&weak, &first, timeout).await;
            tokio::spawn(watch_liveness(weak, timeout, first_left));
        }
        tokio::spawn(release(
            Arc::downgrade(&client.inner),
            client.inner.tokens.live.clone(),
        ));
        Ok(client)
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
        self.replica_by_id(method_id(method), args).await
    }

    /// [`replica`](Self::replica) by the method's id ([`method_id`] of its name), which
    /// the stubs that `#[compute_service]` generates for a trait compute at compile time.
    pub async fn replica_by_id<A, T>(&self, method: u32, args: A) -> Result<T, RpcError>
    where
        A: Serialize,
        T: DeserializeOwned,
    {
        let inner = &*self.inner;
        if inner.closed.load(Ordering::Acquire) {
            return Err(RpcError::new(
                ErrorCode::Disconnected,
                "the client was closed",
            ));
        }
        let peer = inner.connection.peer().await?;
        let format = peer.format();
        let args = Blob::from(format.encode(&args)?);
        let replica = inner.next_replica.fetch_add(1, Ordering::Relaxed);
        inner.tokens.live.replicas.lock().insert(
            replica,
            Replica {
                method,
                args: args.clone(),
                hash: None,
                confirmed: true,
            },
        );
        // Read first, so that an invalidation that overtakes the answer finds the token
        // (and the caller, still computing, is stored as invalidated).
        drop(inner.tokens.token(replica).await);
        if inner.closed.load(Ordering::Acquire) {
            inner.tokens.invalidate([replica], false);
            return Err(RpcError::new(
                ErrorCode::Disconnected,
                "the client was closed",
            ));
        }
        #[cfg(feature = "persistent")]
        if let Some(stored) = inner
            .tokens
            .live
            .disk
            .as_ref()
            .filter(|_| inner.from_disk.lock().remove(&(method, args.clone())))
            .and_then(|d| d.get(method, &args, format))
        {
            if let Ok(value) = format.decode_bytes(stored.value.into_bytes()) {
                if let Some(r) = inner.tokens.live.replicas.lock().get_mut(&replica) {
                    r.hash = Some(stored.hash);
                    r.confirmed = false;
                }
                let client = self.clone();
                tokio::spawn(
                    async move { client.confirm(replica, method, args, stored.hash).await },
                );
                return Ok(value);
            }
        }
        let value = match inner.host.fetch(method, args.clone(), replica).await {
            Ok(Ok(value)) => value,
            Ok(Err(failure)) => return Err(failure.into()),
            Err(e) => return Err(e),
        };
        let hash = value_hash(&value);
        let live = &inner.tokens.live;
        // Fetched while the lease is out: the replica fetched before for these arguments
        // (under the same lease-less spell) is superseded.
        let unleased = inner.lease.is_some() && {
            let until = inner.lease_until.load(Ordering::Acquire);
            until == 0 || coherent::lease_clock() >= until
        };
        let key = unleased.then(|| (method, args.clone()));
        {
            let mut replicas = live.replicas.lock();
            match replicas.get_mut(&replica) {
                Some(r) => {
                    r.hash = Some(hash);
                    // Written while still live, under the lock: an invalidation that comes
                    // later removes it again, in order.
                    #[cfg(feature = "persistent")]
                    if let Some(disk) = &live.disk {
                        disk.put(method, args, value.clone(), hash, format);
                    }
                    #[cfg(not(feature = "persistent"))]
                    drop(args);
                }
                // Dropped or invalidated meanwhile: the server may have started watching after
                // the release went out, so release it again.
                None => {
                    drop(args);
                    live.release(replica);
                }
            }
        }
        if let Some(key) = key {
            let before = inner.fetched_unleased.lock().insert(key, replica);
            if let Some(before) = before.filter(|&b| b != replica) {
                // Whatever read it computes again on its next read anyway (the lease is
                // out): invalidated, and the server told to stop watching it.
                if live.replicas.lock().contains_key(&before) {
                    inner.tokens.invalidate([before], false);
                    live.release(before);
                }
            }
        }
        // No lease since a disconnect (or none renewed yet): this value, fetched on a new
        // connection, is answered (and kept) only under one renewed after it came.
        if let (Some(lease), Some(timeout)) = (&inner.lease, inner.policy.liveness) {
            if inner.lease_until.load(Ordering::Acquire) == 0 {
                let renewed = match inner.connection.current() {
                    Some(peer) => renew_within(&Arc::downgrade(&self.inner), &peer, timeout).await,
                    None => None,
                };
                if renewed.is_none() {
                    // Not renewed: the registry answers nothing until it is.
                    lease.renew(0);
                }
            }
        }
        format.decode_bytes(value.into_bytes())
    }

    /// Has the server confirm a value read from the persistent cache (and watch it from
    /// now on); invalidates the replica if the server's value differs or cannot be had.
    #[cfg(feature = "persistent")]
    async fn confirm(&self, replica: u64, method: u32, args: Blob, hash: u64) {
        let inner = &*self.inner;
        let held = Held {
            replica,
            method,
            args: args.clone(),
            hash,
        };
        drop(args);
        match inner.host.revalidate(vec![held]).await {
            Ok(stale) if stale.is_empty() => {
                if let Some(r) = inner.tokens.live.replicas.lock().get_mut(&replica) {
                    r.confirmed = true;
                }
            }
            Ok(_) => inner.tokens.invalidate([replica], true),
            // Not confirmed, but not known to be stale either: the file keeps it.
            Err(_) => inner.tokens.invalidate([replica], false),
        }
        if !inner.tokens.live.replicas.lock().contains_key(&replica) {
            inner.tokens.live.release(replica);
        }
    }

    /// How many replicas answer with a value from the persistent cache that the server has
    /// not confirmed yet.
    pub fn unconfirmed_count(&self) -> usize {
        let live = self.inner.tokens.live.replicas.lock();
        live.values().filter(|r| !r.confirmed).count()
    }

    /// Waits until every value received so far is written to the persistent cache (at
    /// once without one).
    pub async fn flush_cache(&self) {
        #[cfg(feature = "persistent")]
        if let Some(disk) = &self.inner.tokens.live.disk {
            disk.flush().await;
        }
    }

    /// Calls the server's compute method `method` once: a round trip every time, nothing
    /// cached here.
    pub async fn call<A, T>(&self, method: &str, args: A) -> Result<T, RpcError>
    where
        A: Serialize,
        T: DeserializeOwned,
    {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(RpcError::new(
                ErrorCode::Disconnected,
                "the client was closed",
            ));
        }
        let format = self.inner.connection.peer().await?.format();
        let args = Blob::from(format.encode(&args)?);
        let value = self.inner.host.call(method_id(method), args).await??;
        format.decode_bytes(value.into_bytes())
    }

    /// The client's connection as a caller for other RPC services the server serves on
    /// the same endpoint (e.g. `coherent_ops::CommandClient`): their calls share the
    /// connection, its reconnection and its failover.
    pub fn caller(&self) -> Reconnecting {
        self.inner.connection.clone()
    }

    /// The open connection, if there is one now.
    pub fn connection(&self) -> Option<Peer> {
        self.inner.connection.current()
    }

    /// The address of the open connection, if there is one now and the client connects
    /// over TCP ([`connect_tcp`](Self::connect_tcp) or
    /// [`connect_tcp_any`](Self::connect_tcp_any)); `None` for other transports.
    pub fn connected_to(&self) -> Option<SocketAddr> {
        let hosts = self.inner.hosts.as_ref()?;
        let peer = self.connection()?;
        hosts.address_of(&peer)
    }

    /// How many times a renewal of the client's lease came after it had run out (see
    /// [`RemoteClient`]): meanwhile every cache of its registry answered nothing from
    /// itself. A count that grows while the connection lives says the server (or this
    /// client's runtime) answers more slowly than the lease allows.
    pub fn leases_lost(&self) -> u64 {
        self.inner.leases_lost.load(Ordering::Relaxed)
    }

    /// How many connections were made so far (1 plus the reconnections).
    pub fn connections(&self) -> u64 {
        self.inner.connection.connections()
    }

    /// How many replicas the server watches for this client now.
    pub fn replica_count(&self) -> usize {
        self.inner.tokens.live.replicas.lock().len()
    }

    /// Waits until the replicas have been revalidated after `n` reconnections.
    pub async fn revalidated(&self, n: u64) {
        let mut rx = self.inner.revalidated.subscribe();
        let _ = rx.wait_for(|&done| done >= n).await;
    }

    /// Closes the connection for good: no reconnection, every replica invalidated.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        if let Some(peer) = self.connection() {
            peer.close();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Lets the release task see that the client is gone.
        self.tokens.live.wake.notify_one();
    }
}

/// What the client does when its connection dies.
#[derive(Clone, Copy)]
struct Policy {
    liveness: Option<std::time::Duration>,
    keep_through_disconnects: bool,
}

/// Renews the client's lease (see [`RemoteClientBuilder::liveness`]) every quarter of
/// `timeout`, or sooner when the server's own caches have less left, and closes a
/// connection that answered nothing sent in the last `timeout` (the supervisor then
/// invalidates and reconnects): when the lease runs out, not half a renewal later. Holds
/// the connection only while a call is out, so that dropping the client still closes it.
async fn watch_liveness(
    client: std::sync::Weak<Inner>,
    timeout: std::time::Duration,
    first_left: Option<u64>,
) {
    let _ended = LivenessEnded(client.clone());
    // After the renewal the client made as it connected (at once if it had no answer).
    let mut wait = match first_left {
        Some(left) if left > 0 => (timeout / 4).min(std::time::Duration::from_nanos(left / 3)),
        _ => std::time::Duration::ZERO,
    };
    // When the last answered call was sent: the connection is taken for dead once nothing
    // sent since has been answered for `timeout` (the lease runs out at the same moment).
    let (mut answered, mut on) = (0, None);
    // The wait between renewals while the server answers that nothing is left.
    let mut idle = std::time::Duration::ZERO;
    loop {
        tokio::time::sleep(wait).await;
        wait = timeout / 4;
        let Some(inner) = client.upgrade() else {
            return;
        };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        // Reconnecting: the supervisor renews the lease on the next connection.
        let Some(peer) = inner.connection.current() else {
            continue;
        };
        drop(inner);
        let sent = coherent::lease_clock();
        // A new connection gets a whole `timeout` from its first call.
        if on != Some(peer.id()) {
            on = Some(peer.id());
            answered = sent;
        }
        let due = std::time::Duration::from_nanos(
            answered
                .saturating_add(crate::wire::nanos(timeout))
                .saturating_sub(sent),
        )
        .max(LEASE_RENEWAL_MIN);
        match tokio::time::timeout(due, renew_lease(&client, &peer, timeout)).await {
            Err(_) => {
                // The lease ran out with it.
                if let Some(inner) = client.upgrade() {
                    if inner.lease_granted.swap(false, Ordering::AcqRel) {
                        inner.leases_lost.fetch_add(1, Ordering::Relaxed);
                    }
                }
                tracing::warn!(
                    ?timeout,
                    "no answer from the server to a liveness ping: closing the connection, \
                     invalidating the replicas, reconnecting"
                );
                peer.close_because(format!(
                    "no answer to a liveness ping within {timeout:?}: the server looks gone"
                ));
            }
            // Closed meanwhile: the supervisor invalidates and reconnects.
            Ok(None) => {}
            // Renewed well before it runs out: at a third of what the server had left.
            Ok(Some(left)) => {
                answered = sent;
                if left == 0 {
                    // The server's caches are fenced: ask again soon, backing off while
                    // they stay so (every renewal is a call on a server in trouble).
                    idle = (idle * 2).clamp(LEASE_RENEWAL_MIN, timeout / 4);
                    wait = idle;
                } else {
                    idle = std::time::Duration::ZERO;
                    let soon = std::time::Duration::from_nanos(left / 3);
                    wait = wait.min(soon.max(LEASE_RENEWAL_MIN));
                }
            }
        }
    }
}

/// Asks the server over `peer` how long its caches may still answer, and renews the
/// client's lease with it: every push the server queued before it read the call was
/// applied here before the answer came, so the replicas are current as of the moment
/// the call was sent, for as long as the server could answer from its own caches (and
/// the liveness timeout at most). Answers what the lease was renewed by, or `None` when
/// the connection closed or the client is gone.
async fn renew_lease(
    client: &std::sync::Weak<Inner>,
    peer: &Peer,
    timeout: std::time::Duration,
) -> Option<u64> {
    let sent = coherent::lease_clock();
    let left = lease_left(peer).await.ok()?;
    let left = left.min(crate::wire::nanos(timeout));
    let inner = client.upgrade()?;
    if let Some(lease) = &inner.lease {
        let until = sent.saturating_add(left);
        let before = inner.lease_until.fetch_max(until, Ordering::AcqRel);
        // Lost: a lease the server had granted ran out before this renewal. One it
        // answered with nothing left (its own caches fenced) is no loss, nor are the
        // renewals while it stays so.
        let granted = inner.lease_granted.swap(left > 0, Ordering::AcqRel);
        if left > 0 {
            // Replicas fetched from now on are read under this lease.
            inner.fetched_unleased.lock().clear();
        }
        if granted && before != 0 && coherent::lease_clock() > before {
            inner.leases_lost.fetch_add(1, Ordering::Relaxed);
        }
        lease.renew(until);
    }
    Some(left)
}

/// [`renew_lease`], given up after `timeout` (the liveness timeout).
async fn renew_within(
    client: &std::sync::Weak<Inner>,
    peer: &Peer,
    timeout: std::time::Duration,
) -> Option<u64> {
    tokio::time::timeout(timeout, renew_lease(client, peer, timeout))
        .await
        .ok()
        .flatten()
}

/// Held by the liveness task: when the task ends while the client lives (its runtime
/// shut down), nothing renews the lease or hears the server any more. The replicas are
/// invalidated (nothing would tell them of a write) and the lease is dropped, so that
/// the computeds the client's registry holds (which keep the client alive) do not keep
/// it fenced for good.
struct LivenessEnded(std::sync::Weak<Inner>);

impl Drop for LivenessEnded {
    fn drop(&mut self) {
        if let Some(inner) = self.0.upgrade() {
            invalidate_all(
                &inner,
                "the client's liveness task ended (its runtime shut down)",
            );
        }
    }
}

/// The shortest time between two renewals of a client's lease (a server whose caches are
/// fenced answers 0 left until they are not).
const LEASE_RENEWAL_MIN: std::time::Duration = std::time::Duration::from_millis(5);

/// Asks the server how long its caches may still answer (`ReplicaHost::lease`, answered
/// once this client acknowledged every push queued before it); a server of a release
/// without it is pinged instead (its answer follows every frame sent before it) and
/// bounds the lease by nothing but the liveness timeout.
async fn lease_left(peer: &Peer) -> Result<u64, RpcError> {
    match ReplicaHostClient::new(peer.clone()).lease().await {
        Err(e) if e.code() == ErrorCode::UnknownMethod => peer.ping().await.map(|()| u64::MAX),
        // Refused (overloaded, say) but not gone: the connection lives if a ping comes
        // back, and the lease is not extended.
        Err(e) if e.code() != ErrorCode::Disconnected => peer.ping().await.map(|()| 0),
        answer => answer,
    }
}

/// The addresses of a client connected over TCP, and the one it was last connected to.
struct Hosts {
    addrs: Vec<SocketAddr>,
    /// The index in `addrs` of the last connection made, where the next attempt starts,
    /// and that connection's `Peer::id` (`None` before the first).
    last: Mutex<(usize, Option<u64>)>,
}

impl Hosts {
    fn new(addrs: Vec<SocketAddr>) -> Result<Self, RpcError> {
        if addrs.is_empty() {
            return Err(RpcError::new(
                ErrorCode::Disconnected,
                "no address to connect to: connect_tcp_any was given an empty list",
            ));
        }
        Ok(Self {
            addrs,
            last: Mutex::new((0, None)),
        })
    }

    /// One connection attempt: every address once, in turn, from the last good one.
    async fn connect(&self, endpoint: &Endpoint) -> Result<Peer, RpcError> {
        let (start, _) = *self.last.lock();
        let n = self.addrs.len();
        let mut failures = Vec::new();
        for i in (start..start + n).map(|i| i % n) {
            let addr = self.addrs[i];
            match endpoint.connect_tcp(addr).await {
                Ok(peer) => {
                    let mut last = self.last.lock();
                    if last.1.is_some() && last.0 != i {
                        tracing::info!(from = %self.addrs[last.0], to = %addr, "failed over");
                    }
                    *last = (i, Some(peer.id()));
                    return Ok(peer);
                }
                Err(e) => {
                    tracing::debug!(%addr, %e, "connect failed");
                    failures.push((addr, e));
                }
            }
        }
        if let [(_, e)] = failures.as_slice() {
            // One address: its error as it is.
            return Err(e.clone());
        }
        // Wrong credentials are not worth retrying, as with one address.
        let code = if failures
            .iter()
            .any(|(_, e)| e.code() == ErrorCode::Unauthenticated)
        {
            ErrorCode::Unauthenticated
        } else {
            ErrorCode::Disconnected
        };
        let each: Vec<String> = failures
            .iter()
            .map(|(addr, e)| format!("{addr}: {e}"))
            .collect();
        Err(RpcError::new(
            code,
            format!("no address answered ({})", each.join("; ")),
        ))
    }

    /// The address of `peer`, if it is the last connection made.
    fn address_of(&self, peer: &Peer) -> Option<SocketAddr> {
        let (i, id) = *self.last.lock();
        (id == Some(peer.id())).then(|| self.addrs[i])
    }
}

/// After each disconnect: reconnects and revalidates the replicas held, or invalidates them
/// all when the client was closed or reconnecting fails. Holds no connection: dropping the
/// client closes it.
async fn supervise(
    client: std::sync::Weak<Inner>,
    closed: impl Future<Output = RpcError> + Send + 'static,
) {
    let mut closed: std::pin::Pin<Box<dyn Future<Output = RpcError> + Send>> = Box::pin(closed);
    let mut reconnects = 0u64;
    loop {
        let why = closed.as_mut().await;
        match client.upgrade() {
            // Reads go to the server until it is back: a write may return meanwhile
            // without waiting for this client (it is gone, as far as the server knows).
            Some(inner) if !inner.policy.keep_through_disconnects => {
                invalidate_all(&inner, &format!("disconnected: {why}"));
            }
            Some(_) => {}
            None => return,
        }
        let next = loop {
            let Some(inner) = client.upgrade() else {
                return;
            };
            if inner.closed.load(Ordering::Acquire) {
                invalidate_all(&inner, "the client was closed");
                return;
            }
            match inner.connection.peer().await {
                Ok(next) if inner.closed.load(Ordering::Acquire) => {
                    // `close()` ran while this connection was being made.
                    next.close();
                    invalidate_all(&inner, "the client was closed");
                    return;
                }
                Ok(next) => break next,
                Err(e) => {
                    // Nothing can be confirmed: invalidate (reads fail until a connection
                    // comes back), then keep trying.
                    invalidate_all(&inner, &e.to_string());
                    drop(inner);
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
            }
        };
        // The lease of the new connection before anything is answered from it (it ran
        // out while the client was away; the old connection's cannot be renewed).
        if let Some(timeout) = client.upgrade().and_then(|i| i.policy.liveness) {
            renew_within(&client, &next, timeout).await;
        }
        let Some(inner) = client.upgrade() else {
            return;
        };
        closed = Box::pin(next.when_closed());
        drop(next);
        reconnects += 1;
        // Replicas whose fetch was answered (or not) on the old connection without a hash
        // yet cannot be revalidated: they are invalidated, so that they are fetched again.
        let (held, unanswered): (Vec<Held>, Vec<u64>) = {
            let replicas = inner.tokens.live.replicas.lock();
            let mut held = Vec::new();
            let mut unanswered = Vec::new();
            for (&replica, r) in replicas.iter() {
                match r.hash {
                    Some(hash) => held.push(Held {
                        replica,
                        method: r.method,
                        args: r.args.clone(),
                        hash,
                    }),
                    None => unanswered.push(replica),
                }
            }
            (held, unanswered)
        };
        inner.tokens.invalidate(unanswered, false);
        let all: Vec<u64> = held.iter().map(|h| h.replica).collect();
        match inner.host.revalidate(held).await {
            Ok(stale) => {
                tracing::debug!(
                    held = all.len(),
                    stale = stale.len(),
                    "replicas revalidated"
                );
                inner.tokens.invalidate(stale, true);
            }
            // Not confirmed: none of them can be trusted.
            Err(_) => inner.tokens.invalidate(all.iter().copied(), false),
        }
        // Those dropped while revalidating may be watched again now: release them again.
        let gone: Vec<u64> = {
            let replicas = inner.tokens.live.replicas.lock();
            all.into_iter()
                .filter(|id| !replicas.contains_key(id))
                .collect()
        };
        for id in gone {
            inner.tokens.live.release(id);
        }
        inner.revalidated.send_replace(reconnects);
    }
}

/// Invalidates every replica: the client is disconnected (or closed), and reads go to the
/// server. Its lease is dropped meanwhile (no replica is left for it to bound; it would
/// only keep the rest of the registry from answering); a value fetched on the next
/// connection is answered only once that connection renewed it (`replica_by_id`).
fn invalidate_all(inner: &Inner, why: &str) {
    let all: Vec<u64> = inner.tokens.live.replicas.lock().keys().copied().collect();
    tracing::debug!(count = all.len(), why, "invalidating every replica");
    inner.tokens.invalidate(all, false);
    inner.fetched_unleased.lock().clear();
    if let Some(lease) = &inner.lease {
        lease.clear();
        inner.lease_until.store(0, Ordering::Release);
    }
}

/// Tells the server about dropped replicas, in batches, until the client is dropped.
async fn release(client: std::sync::Weak<Inner>, live: Arc<Live>) {
    loop {
        live.wake.notified().await;
        let Some(inner) = client.upgrade() else {
            return;
        };
        let released = std::mem::take(&mut *live.released.lock());
        if released.is_empty() {
            continue;
        }
        // Over whatever connection is open; if none, the server dropped them anyway.
        let _ = inner.host.release(released).await;
    }
}
