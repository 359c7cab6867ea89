//! The server side: compute methods exposed by name, and per connection the computeds
//! handed out as replicas, each watched by one callback that queues its id for a single
//! coalescing task to push.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};

use coherent::Computed;
use coherent_rpc::{method_id, Blob, CallContext, Format, Peer, Service};
use futures::stream::{FuturesOrdered, StreamExt as _};
use parking_lot::Mutex;
use serde::{de::DeserializeOwned, Serialize};
use tokio::sync::{watch, Notify};

/// How long [`RemoteServer::invalidations_delivered`] waits for one client.
pub const DELIVERY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

use crate::wire::{value_hash, Failure, Held, ReplicaHost, ReplicaHostServer, ReplicaSinkClient};

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// A computed held for a replica. Holding it keeps the result cached (the core never
/// evicts an entry someone holds), so that a later invalidation still finds it.
pub(crate) trait Watched: Send + Sync {
    fn on_invalidated(&self, callback: Box<dyn FnOnce() + Send>);
    /// Completes when the computed is invalidated.
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    fn invalidated(&self) -> BoxFuture<()>;
}

impl<T: Clone + Send + Sync + 'static> Watched for Computed<T> {
    fn on_invalidated(&self, callback: Box<dyn FnOnce() + Send>) {
        Computed::on_invalidated(self, callback);
    }

    fn invalidated(&self) -> BoxFuture<()> {
        let c = self.clone();
        Box::pin(async move { c.when_invalidated().await })
    }
}

/// Decodes arguments, gets the computed behind the call and encodes its value.
type Fetch =
    dyn Fn(Blob, Format) -> BoxFuture<Result<(Blob, Box<dyn Watched>), Failure>> + Send + Sync;

/// The same for JSON text (the HTTP gateway): arguments as a JSON array.
#[cfg(feature = "http")]
pub(crate) type JsonFetch =
    dyn Fn(String) -> BoxFuture<Result<(String, Box<dyn Watched>), Failure>> + Send + Sync;

/// Compute methods exposed to remote clients. Turn it into an RPC service with
/// [`RemoteServer::service`] and add that to a `coherent_rpc::Endpoint`.
///
/// ```
/// # use coherent::{compute_service, ComputeService, ServiceHandle};
/// # #[derive(Clone, ComputeService)]
/// # struct Users { handle: ServiceHandle }
/// # #[compute_service]
/// # impl Users {
/// #     #[compute]
/// #     async fn name(&self, id: u64) -> String { format!("user {id}") }
/// # }
/// # let users = Users { handle: ServiceHandle::new() };
/// let remote = coherent_remote::RemoteServer::new()
///     .expose("Users.name", users.clone(), |u, (id,): (u64,)| async move { u.name_computed(id).await });
/// let endpoint = coherent_rpc::Endpoint::builder().service(remote.service()).build();
/// ```
///
/// Clones share the replicas held and their counters: a clone kept for reporting
/// ([`connections`](Self::connections), [`replicas_held`](Self::replicas_held)) sees those
/// of every service made from the original.
#[derive(Clone)]
pub struct RemoteServer {
    methods: HashMap<u32, Method>,
    max_replicas: usize,
    /// Shared by every service made from this server, and by its stats.
    connections: Connections,
}

type Connections = Arc<Mutex<HashMap<u64, Arc<Connection>>>>;

#[derive(Clone)]
pub(crate) struct Method {
    pub(crate) name: &'static str,
    fetch: Arc<Fetch>,
    #[cfg(feature = "http")]
    pub(crate) json: Arc<JsonFetch>,
}

impl Default for RemoteServer {
    fn default() -> Self {
        Self::new()
    }
}

impl RemoteServer {
    /// No methods yet; at most 100,000 replicas per connection.
    pub fn new() -> Self {
        Self {
            methods: HashMap::new(),
            max_replicas: 100_000,
            connections: Arc::default(),
        }
    }

    /// Exposes a compute method under `name` (by convention `"<Service>.<method>"`; clients
    /// call it by the same name). `get` receives a clone of `service` and the decoded
    /// argument tuple, and answers with the computed behind the call, usually through the
    /// generated `<method>_computed`.
    ///
    /// # Panics
    /// When another exposed name hashes to the same method id: rename one of them.
    pub fn expose<S, A, T, F, Fut>(mut self, name: &'static str, service: S, get: F) -> Self
    where
        S: Clone + Send + Sync + 'static,
        A: DeserializeOwned + Send + 'static,
        T: Serialize + Clone + Send + Sync + 'static,
        F: Fn(S, A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Computed<T>> + Send + 'static,
    {
        let get = Arc::new(get);
        #[cfg(feature = "http")]
        let json: Arc<JsonFetch> = {
            let (service, get) = (service.clone(), get.clone());
            Arc::new(move |args: String| {
                let (service, get) = (service.clone(), get.clone());
                Box::pin(async move {
                    // A method without arguments takes `()`, which JSON spells `null`; the
                    // gateway's default (and a client's natural guess) is `[]`.
                    let args: A = serde_json::from_str(&args)
                        .or_else(|e| match args.trim() {
                            "[]" => serde_json::from_str("null").map_err(|_| e),
                            _ => Err(e),
                        })
                        .map_err(|e| Failure::BadArguments(format!("arguments: {e}")))?;
                    let computed = get(service, args).await;
                    let value = serde_json::to_string(computed.value())
                        .map_err(|e| Failure::BadValue(e.to_string()))?;
                    Ok((value, Box::new(computed) as Box<dyn Watched>))
                }) as BoxFuture<_>
            })
        };
        let fetch: Arc<Fetch> = Arc::new(move |args: Blob, format: Format| {
            let (service, get) = (service.clone(), get.clone());
            Box::pin(async move {
                let args: A = format
                    .decode(&args)
                    .map_err(|e| Failure::BadArguments(e.message().to_owned()))?;
                let computed = get(service, args).await;
                let value = format
                    .encode(computed.value())
                    .map_err(|e| Failure::BadValue(e.message().to_owned()))?;
                Ok((Blob::from(value), Box::new(computed) as Box<dyn Watched>))
            }) as BoxFuture<_>
        });
        let id = method_id(name);
        if let Some(other) = self.methods.get(&id) {
            panic!(
                "compute methods {name} and {} both hash to {id:#010x}",
                other.name
            );
        }
        self.methods.insert(
            id,
            Method {
                name,
                fetch,
                #[cfg(feature = "http")]
                json,
            },
        );
        self
    }

    /// Exposes every method of a compute service defined by a trait: `service` is the
    /// `<Trait>Server` that `#[compute_service]` generates for the trait, over an
    /// implementation of it.
    ///
    /// With the `coherent` crate (which generates `<Trait>Server` with this crate's paths):
    /// `RemoteServer::new().expose_service(UsersServer::new(users))`; its crate docs show a whole
    /// server and client.
    ///
    /// # Panics
    /// When one of its method names hashes to the id of a method exposed already.
    pub fn expose_service(self, service: impl Expose) -> Self {
        service.expose_on(self)
    }

    /// How many replicas one connection may hold (default 100,000); a fetch beyond it fails
    /// with `Overloaded`. This bounds what a client can make the server keep.
    pub fn max_replicas_per_connection(mut self, n: usize) -> Self {
        self.max_replicas = n;
        self
    }

    /// The exposed methods, by name (for the HTTP gateway).
    #[cfg(feature = "http")]
    pub(crate) fn methods_by_name(&self) -> HashMap<&'static str, Method> {
        self.methods.values().map(|m| (m.name, m.clone())).collect()
    }

    /// How many client connections hold replicas now.
    pub fn connections(&self) -> usize {
        self.connections.lock().len()
    }

    /// How many replicas the server watches now, over all connections.
    pub fn replicas_held(&self) -> usize {
        let connections: Vec<_> = self.connections.lock().values().cloned().collect();
        connections.iter().map(|c| c.replicas.lock().len()).sum()
    }

    /// Completes when every replica invalidation queued before the call has been applied
    /// by its client (each push is answered once applied), or that client's connection is
    /// gone (it then revalidates everything it holds when it reconnects). A writer that
    /// awaits this after invalidating knows that no client of this server still answers
    /// from a value its write changed. A client that takes longer than
    /// [`DELIVERY_TIMEOUT`] is not waited for further: its connection is closed (it then
    /// reconnects and revalidates), and that is logged.
    pub async fn invalidations_delivered(&self) {
        let waits: Vec<(u64, watch::Receiver<u64>, Peer)> = self
            .connections
            .lock()
            .values()
            .filter_map(|c| {
                let queued = c.invalidated.lock().queued;
                let rx = c.delivered.subscribe();
                let behind = *rx.borrow() < queued;
                behind.then(|| (queued, rx, c.peer.clone()))
            })
            .collect();
        for (queued, mut rx, peer) in waits {
            let wait = rx.wait_for(|delivered| *delivered >= queued);
            if tokio::time::timeout(DELIVERY_TIMEOUT, wait).await.is_err() {
                // Closing makes the client reconnect and revalidate every replica it holds;
                // later writers do not wait for it again.
                tracing::warn!(
                    "a client did not acknowledge invalidations within {DELIVERY_TIMEOUT:?}: closing its connection"
                );
                peer.close();
            }
        }
    }

    /// The RPC service to add to an endpoint.
    pub fn service(&self) -> impl Service {
        ReplicaHostServer::new(Host {
            methods: self.methods.clone(),
            max_replicas: self.max_replicas,
            connections: self.connections.clone(),
        })
    }
}

/// A compute service that exposes all its methods at once: what `#[compute_service]`
/// generates for a trait (`<Trait>Server`) implements it. See [`RemoteServer::expose_service`].
pub trait Expose {
    /// Exposes this service's methods on `server`, each under `"<Trait>.<method>"`.
    fn expose_on(self, server: RemoteServer) -> RemoteServer;
}

struct Host {
    methods: HashMap<u32, Method>,
    max_replicas: usize,
    connections: Connections,
}

/// One replica's watch: the computed, and a marker whose loss turns the computed's
/// callback into a no-op (the core cannot take a callback back, so a released or replaced
/// watch leaves it behind, inert).
struct Watch {
    _watched: Box<dyn Watched>,
    _live: Arc<()>,
}

/// What the server keeps for one client connection.
struct Connection {
    /// Replica id → the computed it watches.
    replicas: Mutex<HashMap<u64, Watch>>,
    /// Replicas invalidated and not yet pushed. Only a live watch's callback adds its id,
    /// once, and the watch is removed when the id is pushed: this never outgrows `replicas`.
    invalidated: Mutex<Pending>,
    wake: Notify,
    /// How many ids the client has acknowledged (see [`Pending::queued`]); `u64::MAX` once
    /// the connection is gone.
    delivered: Arc<watch::Sender<u64>>,
    /// The connection, to close when its client does not acknowledge in time.
    peer: Peer,
}

/// Invalidated replicas waiting for the pusher.
#[derive(Default)]
struct Pending {
    ids: Vec<u64>,
    /// How many ids were ever queued on this connection.
    queued: u64,
}

impl Host {
    fn method(&self, id: u32) -> Result<Arc<Fetch>, Failure> {
        self.methods
            .get(&id)
            .map(|m| m.fetch.clone())
            .ok_or(Failure::UnknownMethod(id))
    }

    /// This call's connection state, made (with its pusher task) on first use.
    fn connection(&self, peer: &Peer) -> Arc<Connection> {
        let mut connections = self.connections.lock();
        if let Some(c) = connections.get(&peer.id()) {
            return c.clone();
        }
        let c = Arc::new(Connection {
            replicas: Mutex::new(HashMap::new()),
            invalidated: Mutex::new(Pending::default()),
            wake: Notify::new(),
            delivered: Arc::new(watch::Sender::new(0)),
            peer: peer.clone(),
        });
        connections.insert(peer.id(), c.clone());
        tokio::spawn(push_invalidations(
            peer.clone(),
            Arc::downgrade(&c),
            self.connections.clone(),
        ));
        c
    }
}

/// Sends each batch of invalidated replica ids in one message, until the connection closes;
/// then drops everything the connection held.
async fn push_invalidations(peer: Peer, connection: Weak<Connection>, connections: Connections) {
    let sink = ReplicaSinkClient::new(peer.clone());
    let delivered = match connection.upgrade() {
        Some(c) => c.delivered.clone(),
        None => return,
    };
    // Pushes sent and not answered yet, oldest first: each with what its answer
    // acknowledges (the last push of a batch acknowledges the batch), and when it was sent.
    // They are not awaited one by one: a client that stops reading fills the connection and
    // is cut off by the endpoint's write-stall timeout, as before pushes were answered.
    let mut unanswered = FuturesOrdered::new();
    let mut sent_at: VecDeque<tokio::time::Instant> = VecDeque::new();
    'pushing: loop {
        let Some(c) = connection.upgrade() else { break };
        let oldest = sent_at.front().copied();
        tokio::select! {
            () = c.wake.notified() => {}
            Some((upto, answer)) = unanswered.next(), if oldest.is_some() => {
                sent_at.pop_front();
                match answer {
                    Ok(()) => {
                        if let Some(upto) = upto {
                            delivered.send_replace(upto);
                        }
                    }
                    Err(e) => {
                        // The client must not keep replicas this side stopped watching:
                        // closing makes it reconnect and revalidate them.
                        tracing::debug!(%e, "an invalidation push failed: closing the connection");
                        peer.close();
                        break 'pushing;
                    }
                }
                continue;
            }
            () = tokio::time::sleep_until(oldest.unwrap_or_else(tokio::time::Instant::now) + DELIVERY_TIMEOUT), if oldest.is_some() => {
                tracing::warn!(
                    "a client did not answer an invalidation push within {DELIVERY_TIMEOUT:?}: closing its connection"
                );
                peer.close();
                break 'pushing;
            }
            _ = peer.closed() => break,
        }
        let (ids, upto) = {
            let mut pending = c.invalidated.lock();
            (std::mem::take(&mut pending.ids), pending.queued)
        };
        if ids.is_empty() {
            continue;
        }
        // Dropped here, not in the invalidation callback: that runs inside the core's
        // invalidation cascade, where releasing a computed is not welcome.
        let dropped: Vec<_> = {
            let mut replicas = c.replicas.lock();
            ids.iter().filter_map(|id| replicas.remove(id)).collect()
        };
        drop(dropped);
        drop(c);
        tracing::debug!(count = ids.len(), "pushing replica invalidations");
        // Each message within the client's limit (an id takes at most 10 bytes).
        let per_message = (peer.remote_max_message_size() as usize / 10).max(1);
        let chunks: Vec<Vec<u64>> = ids.chunks(per_message).map(<[u64]>::to_vec).collect();
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.into_iter().enumerate() {
            let call = sink.invalidated(chunk);
            let acknowledges = (i == last).then_some(upto);
            unanswered.push_back(async move { (acknowledges, call.await) });
            sent_at.push_back(tokio::time::Instant::now());
        }
    }
    connections.lock().remove(&peer.id());
    // Nothing more will be acknowledged here: release whoever waits (the client, cut off,
    // reconnects and revalidates every replica it holds).
    delivered.send_replace(u64::MAX);
}

impl Connection {
    /// Holds `watched` for `replica` and pushes the replica's id when it is invalidated.
    fn watch(self: &Arc<Self>, replica: u64, watched: Box<dyn Watched>) {
        let connection = Arc::downgrade(self);
        let live = Arc::new(());
        let marker = Arc::downgrade(&live);
        // Runs at once if the computed is already invalidated: the client then gets the
        // value and, right behind it, the news that it is stale.
        watched.on_invalidated(Box::new(move || {
            if let (Some(c), Some(_live)) = (connection.upgrade(), marker.upgrade()) {
                let mut pending = c.invalidated.lock();
                pending.ids.push(replica);
                pending.queued += 1;
                drop(pending);
                c.wake.notify_one();
            }
        }));
        let previous = self.replicas.lock().insert(
            replica,
            Watch {
                _watched: watched,
                _live: live,
            },
        );
        drop(previous);
    }
}

impl ReplicaHost for Host {
    async fn fetch(&self, method: u32, args: Blob, replica: u64) -> Result<Blob, Failure> {
        let fetch = self.method(method)?;
        let ctx = CallContext::current().expect("a handler runs with its call context");
        let connection = self.connection(ctx.peer());
        if connection.replicas.lock().len() >= self.max_replicas {
            return Err(Failure::TooManyReplicas(self.max_replicas));
        }
        if connection.replicas.lock().contains_key(&replica) {
            return Err(Failure::BadArguments(format!(
                "replica id {replica} is already watched on this connection"
            )));
        }
        let (value, watched) = fetch(args, ctx.peer().format()).await?;
        connection.watch(replica, watched);
        Ok(value)
    }

    async fn revalidate(&self, replicas: Vec<Held>) -> Vec<u64> {
        let ctx = CallContext::current().expect("a handler runs with its call context");
        let connection = self.connection(ctx.peer());
        let format = ctx.peer().format();
        let mut stale = Vec::new();
        for held in replicas {
            let current = match self.method(held.method) {
                Ok(fetch) => fetch(held.args, format).await,
                Err(e) => Err(e),
            };
            match current {
                Ok((value, watched))
                    if value_hash(&value) == held.hash
                        && connection.replicas.lock().len() < self.max_replicas =>
                {
                    connection.watch(held.replica, watched);
                }
                _ => stale.push(held.replica),
            }
        }
        tracing::debug!(stale = stale.len(), "replicas revalidated");
        stale
    }

    async fn call(&self, method: u32, args: Blob) -> Result<Blob, Failure> {
        let fetch = self.method(method)?;
        let format = CallContext::current()
            .expect("a handler runs with its call context")
            .peer()
            .format();
        let (value, _) = fetch(args, format).await?;
        Ok(value)
    }

    async fn release(&self, replicas: Vec<u64>) {
        let Some(ctx) = CallContext::current() else {
            return;
        };
        let Some(c) = self.connections.lock().get(&ctx.peer().id()).cloned() else {
            return;
        };
        let dropped: Vec<_> = {
            let mut held = c.replicas.lock();
            replicas.iter().filter_map(|id| held.remove(id)).collect()
        };
        drop(dropped);
    }
}
