//! The server side: compute methods exposed by name, and per connection the computeds
//! handed out as replicas, each watched by one callback that queues its id for a single
//! coalescing task to push.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use coherent::{CallbackKey, Computed, Registry};
use coherent_rpc::{method_id, Blob, CallContext, Format, Peer, Service, Trust};
use futures::stream::{FuturesOrdered, StreamExt as _};
use parking_lot::Mutex;
use serde::{de::DeserializeOwned, Serialize};
use tokio::sync::{watch, Notify};

/// The default of [`RemoteServer::delivery_timeout`]: how long a client may take to answer
/// an invalidation push before its connection is closed.
pub const DELIVERY_TIMEOUT: Duration = Duration::from_secs(5);

/// The default of [`RemoteServer::max_unanswered_pushes`].
pub const MAX_UNANSWERED_PUSHES: usize = 1024;

/// The default of [`RemoteServer::max_replicas_per_connection`].
pub const MAX_REPLICAS_PER_CONNECTION: usize = 100_000;

/// The default of [`RemoteServer::max_replicas_per_untrusted_connection`].
pub const MAX_REPLICAS_PER_UNTRUSTED_CONNECTION: usize = 1_000;

/// The default of [`RemoteServer::max_untrusted_replicas`].
pub const MAX_UNTRUSTED_REPLICAS: usize = 100_000;

use crate::wire::{value_hash, Failure, Held, ReplicaHost, ReplicaHostServer, ReplicaSinkClient};

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// A computed held for a replica. Holding it keeps the result cached (the core never
/// evicts an entry someone holds), so that a later invalidation still finds it.
pub(crate) trait Watched: Send + Sync {
    fn add_callback(&self, callback: Box<dyn FnOnce() + Send>) -> CallbackKey;
    fn remove_callback(&self, key: CallbackKey) -> bool;
    /// Completes when the computed is invalidated.
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    fn invalidated(&self) -> BoxFuture<()>;
}

impl<T: Clone + Send + Sync + 'static> Watched for Computed<T> {
    fn add_callback(&self, callback: Box<dyn FnOnce() + Send>) -> CallbackKey {
        self.add_invalidation_callback(callback)
    }

    fn remove_callback(&self, key: CallbackKey) -> bool {
        self.remove_invalidation_callback(key)
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
    limits: ReplicaLimits,
    delivery_timeout: Duration,
    max_unanswered_pushes: usize,
    #[cfg(feature = "http")]
    pub(crate) gateway_limits: crate::gateway::Limits,
    /// Shared by every service made from this server, and by its stats.
    connections: Connections,
    pub(crate) counters: Arc<Counters>,
    /// The registries whose lease bounds what this server's trusted clients may answer
    /// from their replicas ([`lease_from`](RemoteServer::lease_from)); shared by clones.
    lease_sources: Arc<Mutex<Vec<Registry>>>,
}

type Connections = Arc<Mutex<HashMap<u64, Arc<Connection>>>>;

/// What a server counts, shared by its clones, its services and its gateway.
#[derive(Default)]
pub(crate) struct Counters {
    pushes: AtomicU64,
    closed_unresponsive: AtomicU64,
    waits_skipped_untrusted: AtomicU64,
    /// Replicas watched for untrusted connections now: one per [`Watch`] holding a
    /// [`Slot`], so that every way a watch goes gives its place back.
    untrusted_replicas: AtomicUsize,
    refused_per_connection: AtomicU64,
    refused_untrusted_total: AtomicU64,
    pub(crate) sse_feeds_open: AtomicUsize,
    pub(crate) sse_feeds_refused: AtomicU64,
    pub(crate) sse_feeds_expired: AtomicU64,
}

/// A snapshot of a [`RemoteServer`]'s counters: see [`RemoteServer::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerStats {
    /// Client connections holding replicas now.
    pub connections: usize,
    /// Replicas watched now, over all connections.
    pub replicas_held: usize,
    /// Replicas watched now for untrusted connections, together: what
    /// [`RemoteServer::max_untrusted_replicas`] bounds.
    pub untrusted_replicas_held: usize,
    /// Replicas refused (a fetch answered `TooManyReplicas`, or an id a revalidation
    /// reported stale without computing it) because their connection held as many as it
    /// may: [`RemoteServer::max_replicas_per_connection`], or for an untrusted one
    /// [`RemoteServer::max_replicas_per_untrusted_connection`].
    pub replicas_refused_per_connection: u64,
    /// Replicas refused to untrusted connections because they held
    /// [`RemoteServer::max_untrusted_replicas`] together.
    pub replicas_refused_untrusted_total: u64,
    /// Invalidation messages pushed to clients (a batch too large for one message counts
    /// once per message).
    pub pushes: u64,
    /// Connections closed because their client left pushes unanswered for longer than
    /// [`RemoteServer::delivery_timeout`], or more of them than
    /// [`RemoteServer::max_unanswered_pushes`].
    pub clients_closed_unresponsive: u64,
    /// Untrusted connections that had not yet applied a write's invalidations when
    /// [`RemoteServer::invalidations_delivered`] was called, and were not waited for.
    pub waits_skipped_untrusted: u64,
    /// Server-Sent Events feeds of the HTTP gateway open now.
    pub sse_feeds_open: usize,
    /// Feeds the gateway refused because as many as `RemoteServer::max_sse_feeds` (with the
    /// `http` feature) were open.
    pub sse_feeds_refused: u64,
    /// Feeds the gateway ended because they had been open for
    /// `RemoteServer::max_sse_lifetime`.
    pub sse_feeds_expired: u64,
}

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
    /// No methods yet; at most 100,000 replicas per connection, 1,000 per untrusted one and
    /// 100,000 for the untrusted ones together; see each setting for its default.
    pub fn new() -> Self {
        Self {
            methods: HashMap::new(),
            limits: ReplicaLimits {
                per_connection: MAX_REPLICAS_PER_CONNECTION,
                per_untrusted_connection: MAX_REPLICAS_PER_UNTRUSTED_CONNECTION,
                untrusted_total: MAX_UNTRUSTED_REPLICAS,
            },
            delivery_timeout: DELIVERY_TIMEOUT,
            max_unanswered_pushes: MAX_UNANSWERED_PUSHES,
            #[cfg(feature = "http")]
            gateway_limits: crate::gateway::Limits::default(),
            connections: Arc::default(),
            counters: Arc::default(),
            lease_sources: Arc::default(),
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
                    // Any `Caller` in them filled in (here: anonymous).
                    let args: A = crate::caller::filled_in(|| {
                        serde_json::from_str(&args).or_else(|e| match args.trim() {
                            "[]" => serde_json::from_str("null").map_err(|_| e),
                            _ => Err(e),
                        })
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
                // Any `Caller` in them filled in by the call being served.
                let args: A = crate::caller::filled_in(|| format.decode(&args))
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

    /// How many replicas one connection may hold (default
    /// [`MAX_REPLICAS_PER_CONNECTION`], 100,000); a fetch beyond it fails with
    /// `TooManyReplicas` (`Overloaded` for a Rust client). This bounds what one of the
    /// application's tiers can make the server keep; an untrusted connection is also held
    /// to [`max_replicas_per_untrusted_connection`](Self::max_replicas_per_untrusted_connection),
    /// and the untrusted ones together to [`max_untrusted_replicas`](Self::max_untrusted_replicas).
    ///
    /// Each replica keeps its computed cached (the core never evicts what is held), so what
    /// it costs is the computed's value, its dependencies and about a hundred bytes of
    /// bookkeeping: the limits count replicas, not bytes (not yet), so a method whose values
    /// are large (a page of results) makes each replica cost that much more.
    pub fn max_replicas_per_connection(mut self, n: usize) -> Self {
        self.limits.per_connection = n;
        self
    }

    /// How many replicas one untrusted connection ([`Trust::Untrusted`]: a browser over
    /// WebSocket, by default) may hold (default [`MAX_REPLICAS_PER_UNTRUSTED_CONNECTION`],
    /// 1,000; the smaller of this and
    /// [`max_replicas_per_connection`](Self::max_replicas_per_connection) applies). A page
    /// holds a handful to a few hundred; anyone on the internet may open a connection, so this
    /// is what one of them can make the server keep per connection. Beyond it a fetch fails
    /// with `TooManyReplicas`, counted in [`ServerStats::replicas_refused_per_connection`].
    ///
    /// Entries are counted, not bytes (not yet): with a method whose values weigh 33 KiB, the
    /// default lets one connection pin about 33 MiB. Lower it, or
    /// [`max_untrusted_replicas`](Self::max_untrusted_replicas), where values are large.
    pub fn max_replicas_per_untrusted_connection(mut self, n: usize) -> Self {
        self.limits.per_untrusted_connection = n;
        self
    }

    /// How many replicas the untrusted connections may hold together (default
    /// [`MAX_UNTRUSTED_REPLICAS`], 100,000): beyond it, a fetch on an untrusted connection
    /// fails with `TooManyReplicas` (`Overloaded`) and a revalidation reports the replicas
    /// it cannot watch as stale, until pushes, releases or disconnections give places back.
    /// Counted in [`ServerStats::replicas_refused_untrusted_total`]; the total held is
    /// [`ServerStats::untrusted_replicas_held`]. Trusted connections (the application's
    /// tiers) are never refused for it, and do not count toward it: many connections, each
    /// within its own limit, cannot together make the server keep more than this for
    /// anonymous clients.
    ///
    /// It bounds entries, not bytes (not yet): what the untrusted clients can pin is this
    /// many times the largest value (and dependencies) of the methods exposed to them, e.g.
    /// about 3.3 GB at the default for a method whose values weigh 33 KiB. Size it for the
    /// heaviest method, or expose heavy methods on a server of their own with lower limits.
    pub fn max_untrusted_replicas(mut self, n: usize) -> Self {
        self.limits.untrusted_total = n;
        self
    }

    /// How long a client may leave an invalidation push unanswered (default
    /// [`DELIVERY_TIMEOUT`], 5 s) before its connection is closed; it then reconnects and
    /// revalidates what it holds. Also the longest that
    /// [`invalidations_delivered`](Self::invalidations_delivered) waits.
    pub fn delivery_timeout(mut self, timeout: Duration) -> Self {
        self.delivery_timeout = timeout;
        self
    }

    /// How many invalidation pushes one connection may leave unanswered at once (default
    /// [`MAX_UNANSWERED_PUSHES`], 1,024); beyond it the connection is closed. Pushes are
    /// coalesced (each carries every id invalidated since the previous one), so a healthy
    /// client has a handful in flight; this bounds what the server keeps for one that
    /// stopped answering but goes on reading, until the delivery timeout closes it.
    pub fn max_unanswered_pushes(mut self, n: usize) -> Self {
        self.max_unanswered_pushes = n.max(1);
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
        connections
            .iter()
            .map(|c| c.replicas.lock().watches.len())
            .sum()
    }

    /// The server's gauges and counters now (shared by its clones).
    pub fn stats(&self) -> ServerStats {
        let c = &self.counters;
        ServerStats {
            connections: self.connections(),
            replicas_held: self.replicas_held(),
            untrusted_replicas_held: c.untrusted_replicas.load(Ordering::Relaxed),
            replicas_refused_per_connection: c.refused_per_connection.load(Ordering::Relaxed),
            replicas_refused_untrusted_total: c.refused_untrusted_total.load(Ordering::Relaxed),
            pushes: c.pushes.load(Ordering::Relaxed),
            clients_closed_unresponsive: c.closed_unresponsive.load(Ordering::Relaxed),
            waits_skipped_untrusted: c.waits_skipped_untrusted.load(Ordering::Relaxed),
            sse_feeds_open: c.sse_feeds_open.load(Ordering::Relaxed),
            sse_feeds_refused: c.sse_feeds_refused.load(Ordering::Relaxed),
            sse_feeds_expired: c.sse_feeds_expired.load(Ordering::Relaxed),
        }
    }

    /// Completes once the replica invalidations queued before the call have reached the
    /// holders a writer may wait for. What each holder is promised:
    ///
    /// - A **trusted** connection ([`Trust::Trusted`]: the application's own tiers, over
    ///   TCP, TLS or a Unix socket by default) is waited for until its client has applied
    ///   them (it answers each push once applied) or its connection is gone. So are its
    ///   fetches and revalidations in flight when this is called (one may have computed its
    ///   value before the write and watch it only after: its client then gets the old value
    ///   and, right behind it, a push), and then the pushes they queued. When this
    ///   completes, no trusted client of this server still answers from a value the write
    ///   changed.
    /// - The **connection of the call being served**, if this runs inside an RPC handler
    ///   (`CallContext::current()`, as when a command came over RPC), is waited for the same
    ///   way whatever its trust: a client that writes sees its own write when the answer
    ///   arrives (read-your-writes), and only it pays for its own slowness.
    /// - An **untrusted** connection (a browser over WebSocket, by default) is not waited
    ///   for: it gets its pushes as soon as the others, and a writer never waits for it
    ///   (counted in [`ServerStats::waits_skipped_untrusted`]). It may answer from a stale
    ///   value for as long as a push takes to reach it.
    ///
    /// Whatever its trust, a client that leaves a push unanswered for longer than
    /// [`delivery_timeout`](Self::delivery_timeout) (5 s by default) has its connection
    /// closed (it then reconnects and revalidates what it holds), and that is logged; so
    /// this waits at most that long. A fetch still computing by then is not waited for
    /// further (logged; its connection stays open: a slow method is not its client's fault),
    /// and that client may get the old value and its push after this completes.
    pub async fn invalidations_delivered(&self) {
        let caller = CallContext::current().map(|ctx| ctx.peer().id());
        let connections: Vec<Arc<Connection>> = self.connections.lock().values().cloned().collect();
        let mut skipped = 0;
        let mut waits = Vec::new();
        for c in connections {
            let waited = c.peer.trust() == Trust::Trusted || Some(c.peer.id()) == caller;
            // The fetches in flight first, then the queue: one that registers its watch
            // after the queue was read (its value computed before the write, its callback
            // run at once) is waited for through its generation.
            let fetches = if waited {
                c.retire_fetches_in_flight()
            } else {
                None
            };
            let queued = c.invalidated.lock().queued;
            let rx = c.delivered.subscribe();
            let behind = *rx.borrow() < queued;
            if waited && (behind || fetches.is_some()) {
                waits.push((queued, rx, fetches, c));
            } else if behind && !waited {
                skipped += 1;
            }
        }
        if skipped > 0 {
            self.counters
                .waits_skipped_untrusted
                .fetch_add(skipped, Ordering::Relaxed);
        }
        // One deadline for all: the clients are waited for at the same time, so a write
        // waits for the slowest of them, not for their sum.
        let deadline = tokio::time::Instant::now() + self.delivery_timeout;
        for (mut queued, mut rx, fetches, c) in waits {
            if let Some(mut gone) = fetches {
                // A fetch (or revalidation) that began before the call may have computed its
                // value before the write and register its watch after it: its client gets
                // that value and, right behind it, the push its watch queues at once. Wait
                // for it to be done (or the connection gone), then for that push too.
                if tokio::time::timeout_at(deadline, fetches_done(&mut gone, &rx))
                    .await
                    .is_ok()
                {
                    queued = c.invalidated.lock().queued;
                } else {
                    // A slow computation is not the client's fault: not closed for it.
                    tracing::warn!(
                        peer = c.peer.id(),
                        "fetches in flight on a trusted connection were not done within {:?}: \
                         a write did not wait for them further",
                        self.delivery_timeout
                    );
                }
            }
            let wait = rx.wait_for(|delivered| *delivered >= queued);
            if tokio::time::timeout_at(deadline, wait).await.is_err() {
                // Closing makes the client reconnect and revalidate every replica it holds;
                // later writers do not wait for it again.
                c.close_unresponsive(
                    &self.counters,
                    format_args!(
                        "did not acknowledge invalidations within {:?}",
                        self.delivery_timeout
                    ),
                );
            }
        }
    }

    /// The RPC service to add to an endpoint.
    pub fn service(&self) -> impl Service {
        ReplicaHostServer::new(Host {
            methods: self.methods.clone(),
            limits: self.limits,
            push: PushSettings {
                delivery_timeout: self.delivery_timeout,
                max_unanswered: self.max_unanswered_pushes,
                counters: self.counters.clone(),
            },
            connections: self.connections.clone(),
            lease_sources: self.lease_sources.clone(),
        })
    }

    /// Bounds the lease of this server's trusted clients by `registry`'s own (its fences
    /// and [`Registry::set_lease`], a cluster host's; not other holders' leases, which may
    /// be this server's own clients'): a client answers from its replicas no longer than
    /// this server could answer from the registry when it last heard from it (see
    /// `RemoteClient`'s liveness). For a server whose computeds
    /// live in a registry that is itself leased or fenced (a cluster host's:
    /// `HostBuilder::serve_replicas` calls it): while the host cannot tell whether its
    /// cache is current, neither can its replicas. Shared by this server's clones; each
    /// call adds one registry.
    pub fn lease_from(&self, registry: &Registry) {
        self.lease_sources.lock().push(registry.clone());
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
    limits: ReplicaLimits,
    push: PushSettings,
    connections: Connections,
    lease_sources: Arc<Mutex<Vec<Registry>>>,
}

/// What a connection's pusher needs from the server.
#[derive(Clone)]
struct PushSettings {
    delivery_timeout: Duration,
    max_unanswered: usize,
    counters: Arc<Counters>,
}

/// How many replicas the server watches, per connection and for the untrusted ones.
#[derive(Clone, Copy)]
struct ReplicaLimits {
    per_connection: usize,
    per_untrusted_connection: usize,
    untrusted_total: usize,
}

/// One replica's watch: the computed, held so that it stays cached, and its callback,
/// taken back when the watch is dropped (released, replaced, pushed, or its connection
/// gone), so that watches that come and go leave nothing on a long-lived computed.
struct Watch {
    watched: Box<dyn Watched>,
    key: CallbackKey,
    /// An untrusted connection's place under [`RemoteServer::max_untrusted_replicas`],
    /// given back with the watch (handed on to the watch that replaces it).
    slot: Option<Slot>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        // `false` when the invalidation took the callback first (a pushed watch): nothing
        // is left on the computed either way.
        self.watched.remove_callback(self.key);
    }
}

/// One replica counted in [`Counters::untrusted_replicas`], until dropped.
struct Slot(Arc<Counters>);

impl Slot {
    /// A place under `max`, if one is left.
    fn take(counters: &Arc<Counters>, max: usize) -> Option<Self> {
        counters
            .untrusted_replicas
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(counters.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.untrusted_replicas.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection's watches, and the generation of its fetches in flight.
struct Replicas {
    /// Replica id → the computed it watches.
    watches: HashMap<u64, Watch>,
    /// Cloned by each fetch (and each replica a revalidation computes) under this lock,
    /// which it takes anyway, and dropped once its watch is registered: see [`InFlight`].
    in_flight: Arc<InFlight>,
}

/// A generation of the fetches in flight on a connection: each fetch holds the generation
/// current when it began until its watch is registered (and has queued the replica's push,
/// if its value was invalidated meanwhile). A writer that must wait for the fetches that
/// began before it ([`RemoteServer::invalidations_delivered`]) starts a new generation and
/// waits for the old one to be dropped. A fetch pays for it with a reference count.
///
/// Each generation keeps the next one alive, so that a generation is dropped only once the
/// fetches of every earlier one are done too.
struct InFlight {
    /// The generation that a writer started after this one.
    next: OnceLock<Arc<InFlight>>,
    /// Dropped with the generation: what the writer that retired it waits for.
    gone: watch::Sender<()>,
}

impl InFlight {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            next: OnceLock::new(),
            gone: watch::Sender::new(()),
        })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // The later generations this one was the last to hold, one at a time rather than
        // recursively: a slow fetch under many writes makes a long chain.
        let mut next = self.next.take();
        while let Some(mut generation) = next.and_then(Arc::into_inner) {
            next = generation.next.take();
        }
    }
}

/// What the server keeps for one client connection.
struct Connection {
    /// Its watches (replica id → the computed it watches) and fetches in flight. Never held
    /// while a callback runs or a watch is dropped, except where noted.
    replicas: Mutex<Replicas>,
    /// How many replicas it may hold: the smaller per-connection limit if it is untrusted.
    max_replicas: usize,
    /// Whether its watches count toward [`RemoteServer::max_untrusted_replicas`].
    untrusted: bool,
    /// Replicas invalidated and not yet pushed. A watch's callback adds its id once, and the
    /// watch is removed when the id is pushed; a callback that the invalidation took while
    /// its watch was being dropped may add one id more, which the next push drains: this
    /// stays within `replicas` plus the watches dropped since the last push.
    invalidated: Mutex<Pending>,
    wake: Notify,
    /// How many ids the client has acknowledged (see [`Pending::queued`]); `u64::MAX` once
    /// the connection is gone.
    delivered: Arc<watch::Sender<u64>>,
    /// The connection, to close when its client does not acknowledge in time.
    peer: Peer,
    /// Set by the first close for not answering, so that it is counted once.
    closed_unresponsive: AtomicBool,
}

/// Invalidated replicas waiting for the pusher.
#[derive(Default)]
struct Pending {
    ids: Vec<u64>,
    /// How many ids were ever queued on this connection.
    queued: u64,
}

impl Host {
    /// Refuses a replica beyond the server's limit for the untrusted connections together,
    /// before it is computed (`watch` takes the place, for fetches that overlap).
    fn refuse_untrusted(&self, connection: &Connection) -> Result<(), Failure> {
        let (counters, max) = (&self.push.counters, self.limits.untrusted_total);
        if connection.untrusted && counters.untrusted_replicas.load(Ordering::Relaxed) >= max {
            return Err(refused(counters, Limit::UntrustedTotal(max)));
        }
        Ok(())
    }

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
        let untrusted = peer.trust() != Trust::Trusted;
        let c = Arc::new(Connection {
            replicas: Mutex::new(Replicas {
                watches: HashMap::new(),
                in_flight: InFlight::new(),
            }),
            max_replicas: if untrusted {
                self.limits
                    .per_connection
                    .min(self.limits.per_untrusted_connection)
            } else {
                self.limits.per_connection
            },
            untrusted,
            invalidated: Mutex::new(Pending::default()),
            wake: Notify::new(),
            delivered: Arc::new(watch::Sender::new(0)),
            peer: peer.clone(),
            closed_unresponsive: AtomicBool::new(false),
        });
        connections.insert(peer.id(), c.clone());
        tokio::spawn(push_invalidations(
            peer.clone(),
            Arc::downgrade(&c),
            self.connections.clone(),
            self.push.clone(),
        ));
        c
    }
}

/// Which limit refused a replica, and its value.
enum Limit {
    Connection(usize),
    UntrustedTotal(usize),
}

/// Counts a refusal: the failure to answer. Both limits answer `TooManyReplicas` with the
/// limit reached, which every client knows already.
fn refused(counters: &Counters, limit: Limit) -> Failure {
    let (counter, n) = match limit {
        Limit::Connection(n) => (&counters.refused_per_connection, n),
        Limit::UntrustedTotal(n) => (&counters.refused_untrusted_total, n),
    };
    counter.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(limit = n, "a replica refused: too many held");
    Failure::TooManyReplicas(n)
}

/// The longest a `lease` call waits for the fetches in flight when it came (a slow
/// computation) before it answers that nothing is left: well below a client's liveness
/// timeout (2 s by default).
const LEASE_FETCH_WAIT: Duration = Duration::from_millis(500);

/// Until the fetches of a generation retired by `Connection::retire_fetches_in_flight`
/// (`gone`) are done, or the connection is gone (its `delivered` set to `u64::MAX`).
async fn fetches_done(gone: &mut watch::Receiver<()>, delivered: &watch::Receiver<u64>) {
    let mut closed = delivered.clone();
    tokio::select! {
        _ = gone.changed() => {}
        _ = closed.wait_for(|d| *d == u64::MAX) => {}
    }
}

/// Sends each batch of invalidated replica ids in one message, until the connection closes;
/// then drops everything the connection held.
async fn push_invalidations(
    peer: Peer,
    connection: Weak<Connection>,
    connections: Connections,
    settings: PushSettings,
) {
    let PushSettings {
        delivery_timeout,
        max_unanswered,
        counters,
    } = settings;
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
            () = tokio::time::sleep_until(oldest.unwrap_or_else(tokio::time::Instant::now) + delivery_timeout), if oldest.is_some() => {
                c.close_unresponsive(
                    &counters,
                    format_args!("did not answer an invalidation push within {delivery_timeout:?}"),
                );
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
            ids.iter()
                .filter_map(|id| replicas.watches.remove(id))
                .collect()
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
            counters.pushes.fetch_add(1, Ordering::Relaxed);
        }
        if sent_at.len() > max_unanswered {
            // A client that reads but never answers (a stalled tab, a hostile client) would
            // otherwise make this side keep a pending call per push until the timeout.
            if let Some(c) = connection.upgrade() {
                c.close_unresponsive(
                    &counters,
                    format_args!("left more than {max_unanswered} invalidation pushes unanswered"),
                );
            }
            peer.close();
            break 'pushing;
        }
    }
    let gone = connections.lock().remove(&peer.id());
    // Released now, not when the last handler still running on this connection lets go of
    // it: each watch takes its callback back from its computed as it drops.
    if let Some(c) = gone.or_else(|| connection.upgrade()) {
        let held = std::mem::take(&mut c.replicas.lock().watches);
        drop(held);
    }
    // Nothing more will be acknowledged here: release whoever waits (the client, cut off,
    // reconnects and revalidates every replica it holds).
    delivered.send_replace(u64::MAX);
}

impl Connection {
    /// Holds `watched` for `replica` and pushes the replica's id when it is invalidated.
    /// An id held already is refused (`fetch`) or its watch replaced (`revalidate`:
    /// `replace`); a new id beyond the connection's limit, or for an untrusted connection
    /// beyond the untrusted ones' limit together, is refused. Either way the connection
    /// keeps at most one watch, hence one callback, per replica id.
    fn watch(
        self: &Arc<Self>,
        replica: u64,
        watched: Box<dyn Watched>,
        host: &Host,
        replace: bool,
    ) -> Result<(), Failure> {
        let counters = &host.push.counters;
        let mut replicas = self.replicas.lock();
        let held = replicas.watches.len();
        let slot = match replicas.watches.get_mut(&replica) {
            Some(_) if !replace => {
                return Err(Failure::BadArguments(format!(
                    "replica id {replica} is already watched on this connection"
                )));
            }
            // The watch it replaces hands on its place.
            Some(previous) => previous.slot.take(),
            None if held >= self.max_replicas => {
                return Err(refused(counters, Limit::Connection(self.max_replicas)));
            }
            None if self.untrusted => {
                let max = host.limits.untrusted_total;
                let slot = Slot::take(counters, max);
                Some(slot.ok_or_else(|| refused(counters, Limit::UntrustedTotal(max)))?)
            }
            None => None,
        };
        // Registered under the lock, so that two calls for one id cannot both get in. The
        // callback takes only `invalidated`, never `replicas`, and it runs at once if the
        // computed is already invalidated: the client then gets the value and, right behind
        // it, the news that it is stale.
        let connection = Arc::downgrade(self);
        let key = watched.add_callback(Box::new(move || {
            if let Some(c) = connection.upgrade() {
                let mut pending = c.invalidated.lock();
                pending.ids.push(replica);
                pending.queued += 1;
                drop(pending);
                c.wake.notify_one();
            }
        }));
        let previous = replicas
            .watches
            .insert(replica, Watch { watched, key, slot });
        drop(replicas);
        // Outside the lock: dropping a watch locks its computed to take its callback back.
        drop(previous);
        Ok(())
    }

    /// Starts a new generation of fetches in flight, if any fetch is in flight: what
    /// completes once every fetch that began before is done (see [`InFlight`]).
    fn retire_fetches_in_flight(&self) -> Option<watch::Receiver<()>> {
        let mut replicas = self.replicas.lock();
        // Fetches clone the generation under this lock, and an earlier generation still
        // alive holds this one: held by the connection alone, nothing is in flight.
        if Arc::strong_count(&replicas.in_flight) == 1 {
            return None;
        }
        let old = std::mem::replace(&mut replicas.in_flight, InFlight::new());
        let _ = old.next.set(replicas.in_flight.clone());
        let gone = old.gone.subscribe();
        drop(replicas);
        drop(old);
        Some(gone)
    }

    /// Closes the connection of a client that does not answer its pushes; logged and
    /// counted once per connection.
    fn close_unresponsive(&self, counters: &Counters, why: std::fmt::Arguments<'_>) {
        if !self.closed_unresponsive.swap(true, Ordering::Relaxed) {
            counters.closed_unresponsive.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                peer = self.peer.id(),
                trust = ?self.peer.trust(),
                "a client {why}: closing its connection (it reconnects and revalidates)"
            );
        }
        self.peer.close();
    }
}

impl ReplicaHost for Host {
    async fn fetch(&self, method: u32, args: Blob, replica: u64) -> Result<Blob, Failure> {
        let fetch = self.method(method)?;
        let ctx = CallContext::current().expect("a handler runs with its call context");
        let connection = self.connection(ctx.peer());
        // Checked before the computation too, so that a refused fetch costs nothing; `watch`
        // checks again, for fetches of the same id that overlap.
        self.refuse_untrusted(&connection)?;
        let in_flight = {
            let held = connection.replicas.lock();
            if held.watches.len() >= connection.max_replicas {
                let limit = Limit::Connection(connection.max_replicas);
                return Err(refused(&self.push.counters, limit));
            }
            if held.watches.contains_key(&replica) {
                return Err(Failure::BadArguments(format!(
                    "replica id {replica} is already watched on this connection"
                )));
            }
            held.in_flight.clone()
        };
        let (value, watched) = fetch(args, ctx.peer().format()).await?;
        connection.watch(replica, watched, self, false)?;
        // In flight until its watch is registered (and has queued its push, if the value
        // was invalidated meanwhile): a writer waiting for this connection waits for that.
        drop(in_flight);
        Ok(value)
    }

    async fn revalidate(&self, replicas: Vec<Held>) -> Vec<u64> {
        let ctx = CallContext::current().expect("a handler runs with its call context");
        let connection = self.connection(ctx.peer());
        let format = ctx.peer().format();
        let mut stale = Vec::new();
        // An id listed twice is looked at once: a list of copies of one replica costs one
        // computation and leaves one watch.
        let mut seen = HashSet::new();
        for held in replicas {
            if !seen.insert(held.replica) {
                continue;
            }
            // Beyond the connection's limit (or the untrusted ones') the rest are stale
            // without being computed: the client drops them (and a fetch of one is refused
            // as over the limit). An id held already is watched anew in its place.
            let (watched, count, in_flight) = {
                let r = connection.replicas.lock();
                let watched = r.watches.contains_key(&held.replica);
                (watched, r.watches.len(), r.in_flight.clone())
            };
            let admitted = || {
                if watched {
                    Ok(())
                } else if count >= connection.max_replicas {
                    let limit = Limit::Connection(connection.max_replicas);
                    Err(refused(&self.push.counters, limit))
                } else {
                    self.refuse_untrusted(&connection)
                }
            };
            let current = match self
                .method(held.method)
                .and_then(|f| admitted().map(|()| f))
            {
                Ok(fetch) => fetch(held.args, format).await,
                Err(e) => Err(e),
            };
            let confirmed = match current {
                // An id this connection holds already gets a new watch in place of the old.
                Ok((value, watched)) if value_hash(&value) == held.hash => {
                    connection.watch(held.replica, watched, self, true).is_ok()
                }
                _ => false,
            };
            drop(in_flight);
            if !confirmed {
                stale.push(held.replica);
                // The client drops it: a watch this connection had for the id goes too.
                let dropped = connection.replicas.lock().watches.remove(&held.replica);
                drop(dropped);
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

    async fn lease(&self) -> u64 {
        let Some(ctx) = CallContext::current() else {
            return 0;
        };
        // An untrusted client is promised nothing by writes (they never wait for it): no
        // bound from here.
        if ctx.peer().trust() != Trust::Trusted {
            return u64::MAX;
        }
        // What the server's caches have left as the call arrives, as a deadline: a lease
        // of the host renewed while this call waits covers notices applied after it came,
        // whose pushes the answer does not wait for.
        let now = coherent::lease_clock();
        let until = self
            .lease_sources
            .lock()
            .iter()
            .filter_map(Registry::own_lease_left)
            // Nothing bounds the caches: half the delivery timeout, after which writes
            // stop waiting for this client (the client's liveness timeout may be longer).
            .chain(std::iter::once(
                crate::wire::nanos(self.push.delivery_timeout) / 2,
            ))
            .min()
            .map_or(u64::MAX, |left| now.saturating_add(left));
        // Answered only once the client acknowledged every invalidation this connection
        // had queued when the call came, and the fetches in flight then registered their
        // watches (one that computed its value before an invalidation queues its push at
        // once): the client renews its lease with the answer, so its replicas are current
        // as of the call.
        let connection = self.connections.lock().get(&ctx.peer().id()).cloned();
        if let Some(c) = connection {
            let mut delivered = c.delivered.subscribe();
            if let Some(mut gone) = c.retire_fetches_in_flight() {
                // A slow computation is not the client's silence: answered in time (with
                // nothing left, so the lease is not extended) rather than let the
                // client's liveness timeout close a healthy connection.
                let done = fetches_done(&mut gone, &delivered);
                if tokio::time::timeout(LEASE_FETCH_WAIT, done).await.is_err() {
                    return 0;
                }
            }
            let upto = c.invalidated.lock().queued;
            drop(c);
            if delivered.wait_for(|&d| d >= upto).await.is_err() {
                return 0;
            }
        }
        until.saturating_sub(coherent::lease_clock())
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
            replicas
                .iter()
                .filter_map(|id| held.watches.remove(id))
                .collect()
        };
        drop(dropped);
    }
}
