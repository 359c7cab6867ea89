//! Starting the pieces: the database, a Coherent backend (its RPC endpoint and its
//! operation host), the HTTP tiers of each backend kind.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use coherent::ops::{CommandError, CommandServer, Notifier};
use coherent::prelude::*;
use coherent::rpc::pace::{Pacer, Rate};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::api;
use crate::direct::Direct;
use crate::live::{self, LiveTier, TasksBackend, TasksServiceServer};
use crate::store::Store;
use crate::web;

/// Where the data lives.
#[derive(Clone, Debug)]
pub enum DbConfig {
    /// A SQLite file (created if missing).
    Sqlite(PathBuf),
    /// PostgreSQL at a URL, tables in a schema.
    Postgres {
        /// `postgres://...`
        url: String,
        /// The schema of the tables (and of the operation log).
        schema: String,
    },
}

impl DbConfig {
    /// Opens the store (creating the tables if missing).
    pub async fn open(&self, pool_size: usize) -> anyhow::Result<Store> {
        Ok(match self {
            Self::Sqlite(path) => Store::sqlite(path)
                .with_context(|| format!("opening SQLite file {}", path.display()))?,
            Self::Postgres { url, schema } => Store::postgres(url, schema, pool_size)
                .await
                .context("connecting to PostgreSQL")?,
        })
    }

    /// The operation log's database (the same database, the same schema).
    pub async fn operations(&self) -> anyhow::Result<coherent::ops::Database> {
        Ok(match self {
            Self::Sqlite(path) => coherent::ops::Database::sqlite(path)?,
            Self::Postgres { url, schema } => {
                coherent::ops::Database::postgres_in_schema(url, schema).await?
            }
        })
    }
}

/// A running Coherent backend: the compute service behind an RPC endpoint, and the host
/// that runs its commands and replays the other backends' operations.
pub struct LiveBackend {
    /// Where its endpoint listens.
    pub addr: SocketAddr,
    /// The operation host.
    pub host: coherent::ops::Host,
    /// The compute service.
    pub backend: TasksBackend,
    /// Its replicas served to tiers.
    pub remote: RemoteServer,
    /// Its RPC endpoint: replicas of `TasksService` and the commands.
    endpoint: Endpoint,
    /// The registry of its cache (and of the in-process tier's views).
    registry: Registry,
    serving: JoinHandle<()>,
}

impl LiveBackend {
    /// Starts a backend on `listener`, over `db`; `notifier` picks how operations of other
    /// backends arrive (the database's default when `None`).
    pub async fn start(
        db: &DbConfig,
        listener: TcpListener,
        notifier: Option<Notifier>,
    ) -> anyhow::Result<Self> {
        Self::start_with(db, listener, notifier, None).await
    }

    /// [`start`](Self::start), with logins: a connection to the endpoint over `/rpc` that
    /// carries a login cookie authenticates as its user (`coherent::rpc::Identity`, the
    /// [`User`](crate::session::User) as its principal), one without is anonymous (and
    /// may read, not run commands), as is one whose cookie does not verify.
    pub async fn start_with(
        db: &DbConfig,
        listener: TcpListener,
        notifier: Option<Notifier>,
        auth: Option<crate::session::Auth>,
    ) -> anyhow::Result<Self> {
        Self::start_paced(db, listener, notifier, auth, Some(Rate::DEFAULT_UNTRUSTED)).await
    }

    /// [`start_with`](Self::start_with), holding each untrusted connection of the endpoint
    /// (a browser over `/rpc`) to `untrusted_call_rate` calls (`None`: no limit of its own;
    /// the HTTP server's per-address rate still applies). `start_with` gives the
    /// endpoint's default, 100 a second.
    pub async fn start_paced(
        db: &DbConfig,
        listener: TcpListener,
        notifier: Option<Notifier>,
        auth: Option<crate::session::Auth>,
        untrusted_call_rate: Option<Rate>,
    ) -> anyhow::Result<Self> {
        let options = BackendOptions {
            untrusted_call_rate,
            ..BackendOptions::default()
        };
        Self::start_with_options(db, listener, notifier, auth, options).await
    }

    /// [`start_with`](Self::start_with), with what a browser's connections to the endpoint
    /// may do set by `options`.
    pub async fn start_with_options(
        db: &DbConfig,
        listener: TcpListener,
        notifier: Option<Notifier>,
        auth: Option<crate::session::Auth>,
        options: BackendOptions,
    ) -> anyhow::Result<Self> {
        let BackendOptions {
            untrusted_call_rate,
            allowed_origins,
            max_sse_feeds,
            tier_token,
        } = options;
        let store = db.open(16).await?;
        let registry = Registry::new();
        let backend = TasksBackend::new(store, &registry);
        // Server-sent event feeds hold an HTTP connection each for as long as they last: by
        // default at most a tenth of `HttpLimits::max_connections`, so that feeds cannot
        // take them all.
        let remote = RemoteServer::new()
            .max_sse_feeds(max_sse_feeds)
            .expose_service(TasksServiceServer::new(backend.clone()));
        // A command's answer waits until the tiers holding replicas it invalidated have
        // applied that: a read that starts after a write returned sees it, on any tier of
        // this backend.
        let mut builder = coherent::ops::Host::builder(db.operations().await?)
            .id("tasks-backend")
            .registry(&registry)
            .serve_replicas(&remote);
        if let Some(n) = notifier {
            builder = builder.notifier(n);
        }
        let host = live::commands(builder, &backend).start().await?;
        let mut config = coherent::rpc::Config::default().untrusted_call_rate(untrusted_call_rate);
        if !allowed_origins.is_empty() {
            config = config.allowed_origins(allowed_origins);
        }
        let mut endpoint = Endpoint::builder()
            .config(config)
            .service(remote.service())
            .service(CommandServer::new(BackendCommands {
                host: host.clone(),
                auth: auth.clone(),
            }));
        if auth.is_some() || tier_token.is_some() {
            endpoint = endpoint.authenticate_with(move |creds| {
                // Keyed on the transport, as the endpoint's trust is (its `Config::trust`
                // is left to its default: TCP trusted, WebSocket not): a connection that
                // did not come through an HTTP upgrade is a tier's, trusted.
                if !creds.over_http() {
                    // With a token set, only one that presents it.
                    let refused = tier_token.as_deref().is_some_and(|t| {
                        !crate::session::same_secret(creds.token().as_bytes(), t.as_bytes())
                    });
                    return std::future::ready(if refused {
                        Err(
                            "this endpoint is for the application's tiers: their token is required"
                                .to_owned(),
                        )
                    } else {
                        Ok(None)
                    });
                }
                // A cookie that does not verify (signed under a secret since changed) is
                // no login, as over HTTP: the connection is anonymous.
                let user = auth.as_ref().and_then(|auth| {
                    creds
                        .cookies(auth.cookie_name())
                        .find_map(|v| auth.verify(v))
                });
                std::future::ready(Ok(
                    user.map(|u| coherent::rpc::Identity::new(u.name.clone()).with_principal(u))
                ))
            });
        }
        let endpoint = endpoint.build();
        let addr = listener.local_addr()?;
        let serving = tokio::spawn({
            let endpoint = endpoint.clone();
            async move {
                if let Err(e) = endpoint.serve_tcp(listener).await {
                    tracing::error!(%e, "the backend's endpoint stopped");
                }
            }
        });
        Ok(Self {
            addr,
            host,
            backend,
            remote,
            endpoint,
            registry,
            serving,
        })
    }

    /// What [`Metrics`] reports of this backend, each labelled `backend`: its cache
    /// (`registry`), its endpoint (`endpoint`), the replicas it serves (`server`) and its
    /// operation host (`host`).
    pub fn observer(&self) -> coherent::metrics::Observer {
        coherent::metrics::Observer::new()
            .registry("backend", &self.registry)
            .endpoint("backend", &self.endpoint)
            .remote_server("backend", &self.remote)
            .host("backend", &self.host)
    }

    /// Its RPC endpoint (the one that listens on [`addr`](Self::addr)): replicas of
    /// `TasksService` (`ReplicaHost`) and the commands (`Commands`).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// What a browser needs, over HTTP: `GET /rpc` is this backend's endpoint over
    /// WebSocket (a client there holds replicas of `TasksService` and runs commands, in the
    /// format its handshake picks: MessagePack for the TypeScript client),
    /// `GET /gateway/{method}` the HTTP JSON gateway of `TasksService`'s methods (and
    /// `/gateway/{method}/events`), and every other `GET` the live page's files from
    /// [`web::dir`]`(None)` (see [`web::files`]). Merge it with the API's router.
    pub fn web_router(&self) -> axum::Router {
        self.web_router_in(web::dir(None))
    }

    /// [`web_router`](Self::web_router), with the live page's files from `dir`.
    pub fn web_router_in(&self, dir: PathBuf) -> axum::Router {
        axum::Router::new()
            .route(
                "/rpc",
                axum::routing::get(self.endpoint.websocket_handler()),
            )
            .nest("/gateway", self.remote.gateway())
            .merge(web::files(dir))
    }

    /// The API (`/api`) served by a tier in this process ([`LiveTier::in_process`]): its
    /// reads are computed from this backend's results, its writes are commands run on this
    /// backend's host, with no connection between.
    pub fn api_router(&self) -> axum::Router {
        api::router(Arc::new(LiveTier::in_process(&self.backend, &self.host)))
    }

    /// Everything this backend serves over HTTP: the API ([`api_router`](Self::api_router),
    /// since the page writes through it) beside [`web_router_in`](Self::web_router_in)`(dir)`.
    pub async fn http_router(&self, dir: PathBuf) -> anyhow::Result<axum::Router> {
        Ok(self.api_router().merge(self.web_router_in(dir)))
    }

    /// Stops serving and leaves the cluster.
    pub async fn stop(self) {
        self.serving.abort();
        self.host.stop().await;
    }
}

/// The HTTP router of a `coherent` tier connected to the backends at `addrs` (it fails
/// over between them).
pub async fn live_router(addrs: &[SocketAddr]) -> anyhow::Result<axum::Router> {
    live_router_with(addrs, None).await
}

/// [`live_router`], presenting `tier_token` to the backends (see
/// [`BackendOptions::tier_token`]).
pub async fn live_router_with(
    addrs: &[SocketAddr],
    tier_token: Option<String>,
) -> anyhow::Result<axum::Router> {
    // One registry for the tier's views and the client's replicas: the client's lease on
    // it stops the views answering from the cache while the backend cannot vouch for them.
    let registry = Registry::new();
    let client = coherent::remote::RemoteClient::builder()
        .registry(&registry)
        .token(tier_token.unwrap_or_default())
        .connect_tcp_any(addrs.to_vec())
        .await
        .context("connecting to the Coherent backend")?;
    let tier = LiveTier::new(client, &registry);
    Ok(api::router(Arc::new(tier)))
}

/// Connections of the `direct` and `grpc` backends' pools: many more than the cores of a
/// database server that tasks keep busy, and few enough that the three backends of the
/// bench stay under PostgreSQL's default of 100 connections (the `coherent` backend has
/// 16, and 16 for its operation host).
pub const POOL_SIZE: usize = 24;

/// The HTTP router of the `direct` backend.
pub async fn direct_router(db: &DbConfig) -> anyhow::Result<axum::Router> {
    Ok(api::router(Arc::new(Direct::new(
        db.open(POOL_SIZE).await?,
    ))))
}

/// The default of [`BackendOptions::max_sse_feeds`]: a tenth of `HttpLimits::max_connections`.
pub const MAX_SSE_FEEDS: usize = 1_000;

/// What a browser's connections to a backend's endpoint (`/rpc`, the gateway) may do, and
/// what its tiers must present: see [`LiveBackend::start_with_options`].
#[derive(Clone)]
pub struct BackendOptions {
    /// Calls each untrusted connection (a browser over `/rpc`) may start, on top of its
    /// address's rate (`None`: no limit of its own). Default: 100 a second, 200 at once.
    pub untrusted_call_rate: Option<Rate>,
    /// Web pages besides the server's own origin that may open `/rpc`
    /// (`coherent::rpc::Config::allowed_origins`): behind a proxy that rewrites `Host`, the
    /// public origin. Default: none (the same origin only).
    pub allowed_origins: Vec<String>,
    /// Gateway event feeds open at once: each holds an HTTP connection for as long as it
    /// lasts. Default: 1,000, a tenth of `HttpLimits::max_connections`.
    pub max_sse_feeds: usize,
    /// The token the application's tiers present ([`live_router_with`]): with one, a
    /// connection to the backend's TCP endpoint must present it or is refused
    /// (`Unauthenticated`), since every connection there is trusted as a tier (its writes
    /// wait for it, its commands run unchecked). Without one, anything that reaches the
    /// endpoint's port is a tier. Either way keep the port on a private network: the
    /// token travels unencrypted in the handshake, and a connection holds its place among
    /// the endpoint's connections until its handshake is refused. Default: none.
    pub tier_token: Option<String>,
}

impl std::fmt::Debug for BackendOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token itself: a log line of the options must not carry it.
        f.debug_struct("BackendOptions")
            .field("untrusted_call_rate", &self.untrusted_call_rate)
            .field("allowed_origins", &self.allowed_origins)
            .field("max_sse_feeds", &self.max_sse_feeds)
            .field(
                "tier_token",
                &self.tier_token.as_ref().map(|_| "(set, not shown)"),
            )
            .finish()
    }
}

impl Default for BackendOptions {
    fn default() -> Self {
        Self {
            untrusted_call_rate: Some(Rate::DEFAULT_UNTRUSTED),
            allowed_origins: Vec::new(),
            max_sse_feeds: MAX_SSE_FEEDS,
            tier_token: None,
        }
    }
}

/// The backend's commands over RPC: the host's own policy (a tier's trusted connection,
/// or a browser's that logged in: `authenticated_or_trusted`); a logged-in browser's
/// commands held to its user's rate
/// ([`AuthConfig::commands_per_user`](crate::session::AuthConfig::commands_per_user)), as its
/// writes through `/api` are to its address's, and its errors as a stranger may see them
/// ([`for_a_stranger`](crate::live::for_a_stranger)).
#[derive(Clone)]
struct BackendCommands {
    host: coherent::ops::Host,
    auth: Option<crate::session::Auth>,
}

impl coherent::ops::Commands for BackendCommands {
    async fn run(&self, kind: String, command: String) -> Result<String, CommandError> {
        let Some(ctx) = coherent::rpc::CallContext::current() else {
            return self.host.run_json(&kind, command).await;
        };
        coherent::ops::authenticated_or_trusted(&ctx, &kind)?;
        if ctx.peer().trust() == coherent::rpc::Trust::Trusted {
            return self.host.run_json(&kind, command).await;
        }
        // A browser that logged in: held to its user's rate, and told of a failure of the
        // server's own only by reference.
        if let (Some(auth), Some(user)) = (&self.auth, ctx.identity()) {
            match auth.pace_command(user.name()) {
                Ok(wait) if wait.is_zero() => {}
                Ok(wait) => tokio::time::sleep(wait).await,
                Err(after) => {
                    return Err(CommandError::rate_limited(format!(
                        "{kind}: {} ran too many commands; retry in {} ms",
                        user.name(),
                        after.as_millis().max(1)
                    )))
                }
            }
        }
        self.host
            .run_json(&kind, command)
            .await
            .map_err(|e| crate::live::for_a_stranger(&kind, e))
    }
}

/// The bounds of the HTTP server that a client can reach: how long it may take to send a
/// request, how long a connection may stay idle, how many connections are served at once,
/// and how many of them one address may hold. Every field has a default fit for the open
/// internet.
#[derive(Clone, Debug)]
pub struct HttpLimits {
    /// How long a client may take to send a request's head (its line and headers), counted
    /// from the connection's start or the end of its previous answer: a connection that
    /// sends nothing (or one byte a minute, slowloris) is closed when it runs out. It is
    /// also how long a kept-alive connection may stay idle. Default: 10 s.
    pub header_read_timeout: Duration,
    /// The longest pause between two pieces of a request's body: past it the request is
    /// answered 408 (`ApiError::TimedOut`). Default: 10 s.
    pub body_read_timeout: Duration,
    /// How long a request may take, from its head to its answer's head, its body read
    /// included: a body dripped a byte at a time within `body_read_timeout` still ends
    /// here (408). A stream once started (server-sent events, an upgraded WebSocket) is
    /// not cut. Default: 30 s.
    pub request_timeout: Duration,
    /// The longest a write to a client may wait for room in its socket (the client reads
    /// nothing): then the connection is closed (an answer, a stream of server-sent events
    /// or an upgraded WebSocket alike) and counted in [`HttpStats::writes_stalled`], so
    /// that a client that stops reading cannot hold its connection and what is queued
    /// for it. Default: 30 s.
    pub write_stall_timeout: Duration,
    /// Connections served at once, WebSockets upgraded from them included (a connection
    /// holds its place until it closes); further connections wait in the kernel's backlog
    /// until one closes. Default: 10,000.
    pub max_connections: usize,
    /// Connections one IP address may hold at once; beyond it a new one from that address
    /// is closed at once. Default: 256 (a browser opens about six per site; many users
    /// behind one NAT or proxy share an address).
    pub max_connections_per_ip: usize,
    /// The largest request head, in bytes: a larger one is answered 431 and closed.
    /// Default: 16 KiB.
    pub max_header_bytes: usize,
    /// The rate one IP address may send requests at, its RPC calls over `/rpc` included
    /// (they share it with its requests; each untrusted connection is also held to the
    /// endpoint's own `untrusted_call_rate`); `None` for no limit. A request over the rate
    /// waits until it is due (counted in [`HttpStats::requests_paced`]), or, if that is
    /// more than [`max_pace_wait`](Self::max_pace_wait) away, is answered 429 with a
    /// `Retry-After` (counted in [`HttpStats::requests_refused`]). Default: 100 a second,
    /// 200 at once (a page and its calls take a few dozen; many users behind one NAT may
    /// need more).
    pub requests_per_ip: Option<Rate>,
    /// The rate one IP address may send writes at (any method but `GET`, `HEAD` and
    /// `OPTIONS`), within `requests_per_ip`: a write costs the server many reads (a transaction, the
    /// invalidations it pushes). Over it, the same wait or 429. Default: 20 a second, 40
    /// at once.
    pub writes_per_ip: Option<Rate>,
    /// The longest a request over its address's rate is held back before it is served;
    /// past it, 429. Default: 1 s.
    pub max_pace_wait: Duration,
    /// Peers held to neither `requests_per_ip` nor `max_connections_per_ip`: the
    /// application's own monitors, or a reverse proxy that limits per client itself. It
    /// applies to the address a connection comes from, never to one a proxy's
    /// `X-Forwarded-For` names (see [`trusted_proxies`](Self::trusted_proxies), the way to
    /// keep per-client limits behind a proxy). Default: `127.0.0.1` and `::1` (local tools,
    /// a proxy on the same host).
    pub exempt_ips: Vec<IpAddr>,
    /// Reverse proxies whose `X-Forwarded-For` is believed. A request over a connection from
    /// one of these is held to the rates of the client the header names, not the proxy's,
    /// and its failed logins count against that client: the rightmost entry that is not
    /// itself one of these proxies (a client can write anything in front of what its proxy
    /// appends, so entries further left are never read). A request with no such entry, or
    /// with one that is not an address where the client should be, counts as the last hop
    /// believed (its proxy, or a trusted proxy further left). Whatever address that gives
    /// is held to the rates, even one in [`exempt_ips`](Self::exempt_ips). Their
    /// connections are held to no per-address connection limit: a proxy carries many
    /// clients' requests over them. From any other address the header is ignored. Every
    /// proxy listed must append the address it was reached from (or overwrite the header)
    /// on every route, WebSocket upgrades included: one that passes a client's header on
    /// unchanged lets that client name any address. IPv4 addresses mapped into IPv6 (a
    /// dual-stack listener's) compare as IPv4. Default: none.
    pub trusted_proxies: Vec<IpAddr>,
    /// How many addresses' worth of the per-address limits (`max_connections_per_ip`,
    /// `requests_per_ip`, `writes_per_ip`) the IPv6 /64s of one network of
    /// [`network_prefix`](Self::network_prefix) bits get in all, each still within its own;
    /// 0 for no such limit. A provider gives one customer a /56 (a home, a cloud network) or
    /// a /48 (a site): 256 or 65,536 /64s, each of which would otherwise have limits of its
    /// own. Counted in [`HttpStats::connections_refused_per_network`]. Default: 8.
    pub network_share: u32,
    /// The length of the IPv6 prefix whose /64s share
    /// [`network_share`](Self::network_share) (at most 63: a /64 is one address here).
    /// Longer than one customer's allocation, and one customer can crowd out the others
    /// in it; shorter, and a customer with several gets a share for each. Default: 56.
    pub network_prefix: u8,
}

/// What [`serve_http_counted`]'s limits did, counted since it started.
#[derive(Debug, Default)]
pub struct HttpStats {
    /// Requests (and RPC calls over `/rpc`, through the endpoint's pacer) held back to
    /// their address's rate: see [`HttpLimits::requests_per_ip`]. Only requests are
    /// counted here; the endpoint counts the calls it held (`calls_paced`).
    pub requests_paced: AtomicU64,
    /// Requests answered 429: their address's rate would have held them back longer than
    /// [`HttpLimits::max_pace_wait`].
    pub requests_refused: AtomicU64,
    /// Connections closed at once because their address had
    /// [`HttpLimits::max_connections_per_ip`] open.
    pub connections_refused_per_ip: AtomicU64,
    /// Connections closed at once because the IPv6 network of their address had its share
    /// of connections open ([`HttpLimits::network_share`]).
    pub connections_refused_per_network: AtomicU64,
    /// Connections closed because a write to them waited
    /// [`HttpLimits::write_stall_timeout`] for room (the client read nothing).
    pub writes_stalled: AtomicU64,
    /// Connections open now, WebSocket upgrades included: at
    /// [`HttpLimits::max_connections`] the server accepts no more until one closes.
    pub connections_open: AtomicU64,
}

impl HttpStats {
    /// Sets the [`metrics`](coherent::metrics) facade's counters and gauge to these counts,
    /// labelled `server = name`; give it to [`Observer::source`](coherent::metrics::Observer::source)
    /// (as [`Metrics::new`] does):
    ///
    /// | metric | kind | what |
    /// |---|---|---|
    /// | `coherent_tasks_http_requests_paced_total` | counter | [`requests_paced`](Self::requests_paced) |
    /// | `coherent_tasks_http_requests_refused_total` | counter | [`requests_refused`](Self::requests_refused) (429) |
    /// | `coherent_tasks_http_connections_refused_per_ip_total` | counter | [`connections_refused_per_ip`](Self::connections_refused_per_ip) |
    /// | `coherent_tasks_http_connections_refused_per_network_total` | counter | [`connections_refused_per_network`](Self::connections_refused_per_network) |
    /// | `coherent_tasks_http_writes_stalled_total` | counter | [`writes_stalled`](Self::writes_stalled) |
    /// | `coherent_tasks_http_connections_open` | gauge | [`connections_open`](Self::connections_open) |
    pub fn record(&self, name: &str) {
        let label = [("server", name.to_owned())];
        let read = |n: &AtomicU64| n.load(Ordering::Relaxed);
        metrics::counter!("coherent_tasks_http_requests_paced_total", &label)
            .absolute(read(&self.requests_paced));
        metrics::counter!("coherent_tasks_http_requests_refused_total", &label)
            .absolute(read(&self.requests_refused));
        metrics::counter!(
            "coherent_tasks_http_connections_refused_per_ip_total",
            &label
        )
        .absolute(read(&self.connections_refused_per_ip));
        metrics::counter!(
            "coherent_tasks_http_connections_refused_per_network_total",
            &label
        )
        .absolute(read(&self.connections_refused_per_network));
        metrics::counter!("coherent_tasks_http_writes_stalled_total", &label)
            .absolute(read(&self.writes_stalled));
        metrics::gauge!("coherent_tasks_http_connections_open", &label)
            .set(read(&self.connections_open) as f64);
    }
}

/// Counts a connection in [`HttpStats::connections_open`] while it lives.
struct Open(Arc<HttpStats>);

impl Open {
    fn new(stats: &Arc<HttpStats>) -> Self {
        stats.connections_open.fetch_add(1, Ordering::Relaxed);
        Self(stats.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.connections_open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The process's counters in Prometheus' text format, read at each scrape: whatever its
/// [`Observer`](coherent::metrics::Observer) watches (the cache, the RPC endpoint, the
/// replicas' server, the operation host) and the HTTP servers' [`HttpStats`].
///
/// It records into a recorder of its own, not the process's global one: two of them (two
/// servers in one test process) do not fight over it, and an application that installed
/// another exporter keeps it.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<MetricsInner>,
}

struct MetricsInner {
    recorder: metrics_exporter_prometheus::PrometheusRecorder,
    handle: metrics_exporter_prometheus::PrometheusHandle,
    observer: coherent::metrics::Observer,
}

impl Metrics {
    /// What `observer` watches, and each `(name, stats)` of `http` labelled `server = name`.
    pub fn new(
        observer: coherent::metrics::Observer,
        http: impl IntoIterator<Item = (&'static str, Arc<HttpStats>)>,
    ) -> Self {
        let observer = http.into_iter().fold(observer, |observer, (name, stats)| {
            observer.source(move || stats.record(name))
        });
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        Self {
            inner: Arc::new(MetricsInner {
                recorder,
                handle,
                observer,
            }),
        }
    }

    /// Reads every source now and renders the result.
    pub fn render(&self) -> String {
        let inner = &*self.inner;
        metrics::with_local_recorder(&inner.recorder, || inner.observer.record());
        inner.handle.render()
    }

    /// `GET /metrics`, in Prometheus' text format. Serve it on an address of its own, for
    /// the operator's network: the counts tell a stranger how the server is doing.
    pub fn router(&self) -> axum::Router {
        let metrics = self.clone();
        axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let metrics = metrics.clone();
                async move {
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        metrics.render(),
                    )
                }
            }),
        )
    }
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            write_stall_timeout: Duration::from_secs(30),
            max_connections: 10_000,
            max_connections_per_ip: 256,
            max_header_bytes: 16 << 10,
            requests_per_ip: Some(Rate::per_second(100)),
            writes_per_ip: Some(Rate::per_second(20)),
            max_pace_wait: Duration::from_secs(1),
            exempt_ips: vec![
                IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
                IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
            ],
            trusted_proxies: Vec::new(),
            network_share: 8,
            network_prefix: 56,
        }
    }
}

/// Serves `router` on `listener` until the process ends, with [`HttpLimits::default`].
pub async fn serve_http(listener: TcpListener, router: axum::Router) -> anyhow::Result<()> {
    serve_http_with(listener, router, HttpLimits::default()).await
}

/// Serves `router` on `listener` with `limits` (HTTP/1.1, WebSocket upgrades included)
/// until the process ends: a failed accept is logged and retried, never the end.
///
/// Not `axum::serve`: it sets no timer, so hyper's header timeout never runs, and it
/// has no cap on connections.
pub async fn serve_http_with(
    listener: TcpListener,
    router: axum::Router,
    limits: HttpLimits,
) -> anyhow::Result<()> {
    serve_http_counted(listener, router, limits, Arc::default()).await
}

/// [`serve_http_with`], counting what its limits did in `stats`.
pub async fn serve_http_counted(
    listener: TcpListener,
    router: axum::Router,
    limits: HttpLimits,
    stats: Arc<HttpStats>,
) -> anyhow::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;

    let router = router
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
            limits.body_read_timeout,
        ))
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            axum::http::StatusCode::REQUEST_TIMEOUT,
            limits.request_timeout,
        ));
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let per_ip = PerIp::new(
        limits.max_connections_per_ip.max(1),
        (limits.requests_per_ip, limits.writes_per_ip),
        (limits.network_share, limits.network_prefix),
        limits.exempt_ips.clone(),
    );
    let trusted: Arc<[IpAddr]> = limits
        .trusted_proxies
        .iter()
        .map(IpAddr::to_canonical)
        .collect();
    let mut backoff = AcceptBackoff::default();
    loop {
        let permit = slots
            .clone()
            .acquire_owned()
            .await
            .context("the connection slots were closed")?;
        let (stream, addr) = match listener.accept().await {
            Ok(accepted) => {
                backoff.reset();
                accepted
            }
            // One connection's trouble (reset before it was accepted): the next, at once.
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                // Out of file descriptors or memory, or anything else: accepting again at
                // once would spin a core, and giving up would end the server. Wait, longer
                // each time, for connections to close.
                backoff.wait(&e).await;
                continue;
            }
        };
        // A trusted proxy's connection holds no place among its address's: each of its
        // requests is held to the rates of the client it names.
        let proxied = trusted.contains(&addr.ip().to_canonical());
        let ip_slot = if proxied {
            IpSlot(None)
        } else {
            match per_ip.take(addr.ip()) {
                Ok(slot) => slot,
                Err(Over::Address) => {
                    stats
                        .connections_refused_per_ip
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(ip = %addr.ip(), "an address over its connection limit: closed");
                    continue;
                }
                Err(Over::Network) => {
                    stats
                        .connections_refused_per_network
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(
                        ip = %addr.ip(),
                        "an address whose IPv6 network is over its connections: closed"
                    );
                    continue;
                }
            }
        };
        let client = if proxied {
            Client::Proxied(Forwarded {
                proxy: addr.ip().to_canonical(),
                per_ip: per_ip.clone(),
                trusted: trusted.clone(),
            })
        } else {
            let from = ip_slot
                .0
                .is_some()
                .then(|| ClientAddr(address_key(addr.ip())));
            Client::Peer(from, ip_slot.pacers())
        };
        // No Nagle: a WebSocket's small frames (an invalidation, an answer) would otherwise
        // wait for the peer's delayed ACK, 40 ms on Linux, behind an earlier one.
        let _ = stream.set_nodelay(true);
        // The places go with the socket, into an upgraded WebSocket too, and are given back
        // when it closes.
        let stream = Placed {
            io: stream,
            _places: (permit, ip_slot, Open::new(&stats)),
            stall_limit: limits.write_stall_timeout,
            stall: None,
            stats: stats.clone(),
        };
        let service = TowerToHyperService::new(Paced {
            router: router.clone(),
            client,
            max_wait: limits.max_pace_wait,
            stats: stats.clone(),
        });
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            .max_buf_size(limits.max_header_bytes.max(8192));
        tokio::spawn(async move {
            let served = http
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades()
                .await;
            if let Err(e) = served {
                tracing::debug!(%e, "an HTTP connection ended with an error");
            }
        });
    }
}

/// A socket and the places it holds (the server's, its address's), given back when the
/// socket is dropped; a write that makes no progress for `stall_limit` fails it.
struct Placed<P> {
    io: tokio::net::TcpStream,
    _places: P,
    stall_limit: Duration,
    /// Runs while a write waits for room in the socket: started by the first write that
    /// found none, dropped by the next that made progress.
    stall: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    stats: Arc<HttpStats>,
}

impl<P> Placed<P> {
    /// After a write found no room in the socket: `Pending` until the stall has lasted
    /// `stall_limit`, then the error that closes the connection.
    fn stalled<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<T>> {
        use std::future::Future as _;
        let limit = self.stall_limit;
        let sleep = self
            .stall
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match sleep.as_mut().poll(cx) {
            std::task::Poll::Pending => std::task::Poll::Pending,
            std::task::Poll::Ready(()) => {
                self.stall = None;
                self.stats.writes_stalled.fetch_add(1, Ordering::Relaxed);
                std::task::Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the client read nothing for {limit:?}"),
                )))
            }
        }
    }

    /// What a write or flush of the socket answered, with the stall bound applied.
    fn bounded<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        polled: std::task::Poll<std::io::Result<T>>,
    ) -> std::task::Poll<std::io::Result<T>> {
        match polled {
            std::task::Poll::Pending => self.stalled(cx),
            ready => {
                self.stall = None;
                ready
            }
        }
    }
}

impl<P: Unpin> tokio::io::AsyncRead for Placed<P> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<P: Unpin> tokio::io::AsyncWrite for Placed<P> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.io).poll_write(cx, buf);
        self.bounded(cx, polled)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.bounded(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let polled = std::pin::Pin::new(&mut self.io).poll_flush(cx);
        self.bounded(cx, polled)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The address a request came from, as its limits key it (an IPv6 address by its /64),
/// in the request's extensions when served by [`serve_http_with`]: the connection's peer,
/// or, over a connection from one of [`HttpLimits::trusted_proxies`], the client its
/// `X-Forwarded-For` names. Absent for a peer in [`HttpLimits::exempt_ips`] (one that stands
/// for many clients: nothing may be held against it, such as failed logins).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientAddr(pub IpAddr);

/// A connection's requests, held to its address's rate before the router sees them; the
/// rate goes on to `/rpc` in the request's extensions (see
/// `Endpoint::websocket_handler`).
#[derive(Clone)]
struct Paced {
    router: axum::Router,
    client: Client,
    max_wait: Duration,
    stats: Arc<HttpStats>,
}

impl<B> tower::Service<axum::http::Request<B>> for Paced
where
    B: axum::body::HttpBody<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = axum::response::Response;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: axum::http::Request<B>) -> Self::Future {
        use tower::ServiceExt as _;
        let this = self.clone();
        Box::pin(async move {
            let forwarded;
            let (from, pacers) = match &this.client {
                Client::Peer(from, pacers) => (*from, pacers),
                Client::Proxied(f) => {
                    forwarded = f.client(req.headers());
                    (Some(forwarded.0), &forwarded.1)
                }
            };
            let write = !matches!(
                *req.method(),
                axum::http::Method::GET | axum::http::Method::HEAD | axum::http::Method::OPTIONS
            );
            let writes = pacers.writes.as_ref().filter(|_| write);
            let paced_by = || pacers.requests.iter().chain(writes);
            // Refused by either, it takes from neither (a refused write costs its address
            // no read).
            let due = paced_by().map(Pacer::due).max().unwrap_or_default();
            if due > this.max_wait {
                this.stats.requests_refused.fetch_add(1, Ordering::Relaxed);
                return Ok(too_many_requests(due - this.max_wait));
            }
            let wait = paced_by().map(Pacer::delay).max().unwrap_or_default();
            if !wait.is_zero() {
                this.stats.requests_paced.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(wait).await;
            }
            if let Some(pacer) = &pacers.requests {
                req.extensions_mut().insert(pacer.clone());
            }
            if let Some(from) = from {
                req.extensions_mut().insert(from);
            }
            this.router.oneshot(req.map(axum::body::Body::new)).await
        })
    }
}

/// 429, with the whole seconds after which a request is within its address's rate again.
fn too_many_requests(after: Duration) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    (
        axum::http::StatusCode::TOO_MANY_REQUESTS,
        [(axum::http::header::RETRY_AFTER, secs.max(1).to_string())],
        "too many requests from this address: retry later\n",
    )
        .into_response()
}

/// The rates one address's requests share: all of them, and its writes.
#[derive(Clone, Default)]
struct Pacers {
    requests: Option<Pacer>,
    writes: Option<Pacer>,
}

impl Pacers {
    /// Whether neither holds anything taken lately (a new one would answer the same) and no
    /// one holds them but the `handles` counted by the caller: then they can be dropped.
    fn unused(&self, handles: usize) -> bool {
        [&self.requests, &self.writes]
            .into_iter()
            .flatten()
            .all(|p| p.is_full() && p.handles() <= handles)
    }
}

/// What the per-address map keeps limits under: a client's address (see [`address_key`]),
/// or the IPv6 network of [`HttpLimits::network_prefix`] bits its /64 is in, whose
/// addresses share [`HttpLimits::network_share`] times the per-address limits (the bits
/// past the prefix cleared).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Key {
    Address(IpAddr),
    Network(u128),
}

type Addresses = Arc<parking_lot::Mutex<HashMap<Key, (usize, Pacers)>>>;

/// Connections per IP address (and per IPv6 network), and the rates each address's
/// requests share.
#[derive(Clone)]
struct PerIp {
    max: usize,
    rates: (Option<Rate>, Option<Rate>),
    /// How many addresses' worth of the limits one IPv6 network gets in all (0: no such
    /// limit), and its prefix's length.
    network: (u32, u8),
    exempt: Arc<[IpAddr]>,
    open: Addresses,
    /// The map's size at which `take` next drops the addresses that no longer count.
    sweep_at: Arc<AtomicUsize>,
}

/// The size of the per-address map below which it is not swept.
const SWEEP_MIN: usize = 1024;

/// The address a client's limits are kept under: an IPv4 address as it is (an IPv4 one
/// mapped into IPv6 too), an IPv6 address by its /64 network, which one subscriber
/// usually holds whole (keyed by the full address, one client could take a new limit per
/// address of its network).
fn address_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(
                u128::from(v6) & !((1u128 << 64) - 1),
            )),
        },
    }
}

/// Why a connection got no place.
enum Over {
    /// Its address holds `max_connections_per_ip`.
    Address,
    /// Its IPv6 network holds its share.
    Network,
}

/// One connection's place among its address's: given back when dropped. None for an exempt
/// address.
struct IpSlot(Option<TakenIp>);

struct TakenIp {
    key: Key,
    /// The place it also holds among its IPv6 network's.
    network: Option<Key>,
    pacers: Pacers,
    open: Addresses,
}

impl PerIp {
    fn new(
        max: usize,
        rates: (Option<Rate>, Option<Rate>),
        network: (u32, u8),
        exempt: Vec<IpAddr>,
    ) -> Self {
        Self {
            max,
            rates,
            network,
            exempt: exempt.into(),
            open: Arc::default(),
            sweep_at: Arc::new(AtomicUsize::new(SWEEP_MIN)),
        }
    }

    /// The IPv6 network an address key is in, if networks have limits (none for IPv4): so
    /// that one holder of many /64s cannot take a limit for each.
    fn network_key(&self, key: IpAddr) -> Option<Key> {
        let (share, prefix) = self.network;
        match key {
            IpAddr::V6(v6) if share > 0 && (1..64).contains(&prefix) => {
                Some(Key::Network(u128::from(v6) & !(u128::MAX >> prefix)))
            }
            _ => None,
        }
    }

    /// The key `ip`'s limits are kept under, or `None` for an exempt address.
    fn key(&self, ip: IpAddr) -> Option<IpAddr> {
        let key = address_key(ip);
        (!self.exempt.contains(&ip) && !self.exempt.contains(&key)).then_some(key)
    }

    /// The entry of address `key` in `open` (made if there is none, with its network's if
    /// it has one: its pacers within the network's), after a sweep if the map is due one.
    fn entry<'a>(
        &self,
        open: &'a mut HashMap<Key, (usize, Pacers)>,
        key: IpAddr,
    ) -> &'a mut (usize, Pacers) {
        if open.len() >= self.sweep_at.load(Ordering::Relaxed) {
            // Addresses with no connection left are kept while their bucket is not full
            // (one that closes and reconnects must not get its burst again) or anyone else
            // holds it (a WebSocket; an address's pacers hold their network's); drop the
            // rest, and sweep again when the map has doubled.
            // Addresses first, then networks: a network's pacers are held by its addresses'
            // until those go.
            let keep = |n: usize, pacers: &Pacers| n > 0 || !pacers.unused(1);
            open.retain(|k, (n, pacers)| matches!(k, Key::Network(_)) || keep(*n, pacers));
            open.retain(|k, (n, pacers)| matches!(k, Key::Address(_)) || keep(*n, pacers));
            self.sweep_at
                .store((open.len() * 2).max(SWEEP_MIN), Ordering::Relaxed);
        }
        let network = self.network_key(key).map(|k| {
            let share = self.network.0;
            let (_, pacers) = open.entry(k).or_insert_with(|| {
                let pacer = |r: Option<Rate>| r.map(|r| Pacer::new(r.times(share)));
                (
                    0,
                    Pacers {
                        requests: pacer(self.rates.0),
                        writes: pacer(self.rates.1),
                    },
                )
            });
            pacers.clone()
        });
        open.entry(Key::Address(key)).or_insert_with(|| {
            let pacer = |r: Option<Rate>, parent: Option<&Pacer>| {
                r.map(|r| parent.map_or_else(|| Pacer::new(r), |p| Pacer::within(r, p)))
            };
            let network = network.as_ref();
            (
                0,
                Pacers {
                    requests: pacer(self.rates.0, network.and_then(|n| n.requests.as_ref())),
                    writes: pacer(self.rates.1, network.and_then(|n| n.writes.as_ref())),
                },
            )
        })
    }

    fn take(&self, ip: IpAddr) -> Result<IpSlot, Over> {
        let Some(ip) = self.key(ip) else {
            return Ok(IpSlot(None));
        };
        let mut open = self.open.lock();
        let (n, pacers) = self.entry(&mut open, ip);
        if *n >= self.max {
            return Err(Over::Address);
        }
        let pacers = pacers.clone();
        let network = self.network_key(ip);
        if let Some(network) = network {
            let (n, _) = open
                .get_mut(&network)
                .expect("made with the address's entry");
            if *n >= self.max.saturating_mul(self.network.0 as usize) {
                return Err(Over::Network);
            }
            *n += 1;
        }
        let key = Key::Address(ip);
        open.get_mut(&key).expect("made above").0 += 1;
        Ok(IpSlot(Some(TakenIp {
            key,
            network,
            pacers,
            open: self.open.clone(),
        })))
    }

    /// The rates a request that came through a trusted proxy from `ip` is held to, and the
    /// address it counts as. `exempt_ips` is not applied: it names peers, and this address
    /// is one a header named. It takes no connection place; its address's entry stays
    /// until its buckets are full again and no one holds them (an upgraded WebSocket keeps
    /// its request pacer), swept as `take`'s are.
    fn request_from(&self, ip: IpAddr) -> (ClientAddr, Pacers) {
        let key = address_key(ip);
        if self.rates.0.is_none() && self.rates.1.is_none() {
            return (ClientAddr(key), Pacers::default());
        }
        let mut open = self.open.lock();
        let (_, pacers) = self.entry(&mut open, key);
        (ClientAddr(key), pacers.clone())
    }
}

/// Whom a connection's requests are held to.
#[derive(Clone)]
enum Client {
    /// The connection's peer: the address it counts as (none for an exempt one) and the
    /// rates it shares with its address's other connections.
    Peer(Option<ClientAddr>, Pacers),
    /// A trusted proxy's connection: each request's client, as its header names it.
    Proxied(Forwarded),
}

/// What a connection from a trusted proxy needs to find each request's client (see
/// [`HttpLimits::trusted_proxies`]).
#[derive(Clone)]
struct Forwarded {
    proxy: IpAddr,
    per_ip: PerIp,
    trusted: Arc<[IpAddr]>,
}

impl Forwarded {
    /// The address a request counts as, and the rates it is held to.
    fn client(&self, headers: &axum::http::HeaderMap) -> (ClientAddr, Pacers) {
        self.per_ip
            .request_from(forwarded_client(headers, self.proxy, &self.trusted))
    }
}

/// The client a request that came from `proxy` was sent by: the rightmost entry of its
/// `X-Forwarded-For` lines (taken together, in order) that is not in `trusted` (IPv4
/// addresses mapped into IPv6 compared as IPv4). Walking from the right, each trusted
/// entry passes the question one hop further; an entry that is not an address stops the
/// walk at the last hop believed, which then counts as the client. Entries are read one
/// by one from the bytes, so that what a client wrote in front of its proxy's entry (a
/// byte that is not text, say) cannot keep that entry from being read.
fn forwarded_client(headers: &axum::http::HeaderMap, proxy: IpAddr, trusted: &[IpAddr]) -> IpAddr {
    let mut client = proxy;
    for line in headers.get_all("x-forwarded-for").iter().rev() {
        for entry in line.as_bytes().rsplit(|b| *b == b',') {
            let ip = std::str::from_utf8(entry)
                .ok()
                .and_then(|e| forwarded_addr(e.trim()))
                .map(|ip| ip.to_canonical());
            match ip {
                Some(ip) if trusted.contains(&ip) => client = ip,
                Some(ip) => return ip,
                None => return client,
            }
        }
    }
    client
}

/// An `X-Forwarded-For` entry's address: `192.0.2.7`, `2001:db8::7`, and, as some proxies
/// write them, with a port (`192.0.2.7:4711`, `[2001:db8::7]:4711`) or in brackets.
fn forwarded_addr(entry: &str) -> Option<IpAddr> {
    entry
        .parse::<IpAddr>()
        .ok()
        .or_else(|| entry.parse::<std::net::SocketAddr>().ok().map(|a| a.ip()))
        .or_else(|| {
            entry
                .strip_prefix('[')
                .and_then(|e| e.strip_suffix(']'))
                .and_then(|e| e.parse::<std::net::Ipv6Addr>().ok())
                .map(IpAddr::V6)
        })
}

impl IpSlot {
    /// The rates the connection's address shares (none for an exempt one).
    fn pacers(&self) -> Pacers {
        self.0
            .as_ref()
            .map(|t| t.pacers.clone())
            .unwrap_or_default()
    }
}

impl Drop for TakenIp {
    fn drop(&mut self) {
        let mut open = self.open.lock();
        if let Some((n, _)) = open.get_mut(&self.key) {
            *n -= 1;
            // The map's and this slot's handles: any other (a connection's that outlives
            // its slot, a WebSocket's) keeps it for the sweep.
            if *n == 0 && self.pacers.unused(2) {
                // Addresses with connections are kept, and those whose bucket still
                // counts (swept by `take`): the map is bounded by them.
                open.remove(&self.key);
            }
        }
        // The network's pacers are held by this slot's until it is gone: a network with no
        // connection left is dropped by the sweep (or at once if it paces nothing).
        if let Some(network) = self.network {
            if let Some((n, pacers)) = open.get_mut(&network) {
                *n -= 1;
                if *n == 0 && pacers.unused(1) {
                    open.remove(&network);
                }
            }
        }
    }
}

/// Accept errors about one connection (reset or aborted before it was accepted): the
/// listener is fine, and the next accept may go at once.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        e.kind(),
        ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset | ErrorKind::Interrupted
    )
}

/// Waits between accepts that failed (for want of file descriptors or memory, mostly): 10 ms,
/// doubling to 1 s, back to 10 ms after an accept succeeds. Logs once per failure streak.
#[derive(Default)]
struct AcceptBackoff {
    failures: u32,
}

impl AcceptBackoff {
    fn reset(&mut self) {
        if self.failures > 0 {
            tracing::info!(failures = self.failures, "accepting HTTP connections again");
        }
        self.failures = 0;
    }

    async fn wait(&mut self, e: &std::io::Error) {
        if self.failures == 0 {
            tracing::warn!(%e, "cannot accept HTTP connections now: backing off");
        }
        let delay = Duration::from_millis(10 << self.failures.min(7)).min(Duration::from_secs(1));
        self.failures = self.failures.saturating_add(1);
        tokio::time::sleep(delay).await;
    }
}

/// Fills the database: `projects` projects, `tasks` tasks spread over them (round robin),
/// with varied priorities, statuses and assignees. Answers the projects' ids.
pub async fn seed(store: &Store, projects: usize, tasks: usize) -> anyhow::Result<Vec<uuid::Uuid>> {
    use crate::model::{new_id, now_micros, Priority, Project, Status, Task};
    let start = now_micros() - i64::try_from(tasks).unwrap_or(0) * 1_000;
    let mut ids = Vec::with_capacity(projects);
    for p in 0..projects.max(1) {
        let now = start - 1_000 * i64::try_from(projects - p).unwrap_or(0);
        let project = store
            .insert_project(Project {
                id: new_id(now),
                name: format!("Project {}", p + 1),
                created_at: now,
            })
            .await?;
        ids.push(project.id);
    }
    let mut batch = Vec::with_capacity(1_000);
    for i in 0..tasks {
        let now = start + i64::try_from(i).unwrap_or(0) * 1_000;
        batch.push(Task {
            id: new_id(now),
            project: ids[i % ids.len()],
            title: format!("Task {}", i + 1),
            description: format!(
                "The description of task {}, long enough to look like one.",
                i + 1
            ),
            priority: Priority::ALL[i % 4],
            status: Status::ALL[(i / 4) % 4],
            assignee: (i % 3 != 0).then(|| format!("user{}", i % 17)),
            created_at: now,
            updated_at: now,
        });
        if batch.len() == 1_000 {
            store.insert_many(std::mem::take(&mut batch)).await?;
        }
    }
    if !batch.is_empty() {
        store.insert_many(batch).await?;
    }
    Ok(ids)
}

/// Starts the `grpc` backend's `Tasks` service over `db` on `listener`, in a task of its own.
/// Answers the address it listens on, and the task (abort it to stop serving).
pub async fn start_grpc_backend(
    db: &DbConfig,
    listener: TcpListener,
) -> anyhow::Result<(SocketAddr, JoinHandle<()>)> {
    let store = db.open(POOL_SIZE).await?;
    let addr = listener.local_addr()?;
    let serving = tokio::spawn(async move {
        if let Err(e) = crate::grpc::serve_grpc(store, listener).await {
            tracing::error!(error = %format!("{e:#}"), "the gRPC backend stopped");
        }
    });
    Ok((addr, serving))
}

/// The HTTP router of a `grpc` tier connected to the `Tasks` gRPC service at `addr`.
pub async fn grpc_router(addr: SocketAddr) -> anyhow::Result<axum::Router> {
    let tier = crate::grpc::GrpcTier::connect(addr).await?;
    Ok(api::router(Arc::new(tier)))
}

#[cfg(test)]
mod tests {
    use super::{forwarded_client, IpAddr, Key, Over, PerIp, Rate, SWEEP_MIN};

    fn v6(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// The /64s of one IPv6 network (here a /56) share its share of connections (here
    /// 2 x 2) and of the rate; another network has its own; with no share, no such limit.
    #[tokio::test(start_paused = true)]
    async fn the_addresses_of_one_ipv6_network_share_its_limits() {
        use std::time::Duration;
        let rates = (Some(Rate::per_second(100).burst(2)), None);
        let per_ip = PerIp::new(2, rates, (2, 56), Vec::new());
        let a = per_ip.take(v6("2001:db8:0:10a::1")).ok().unwrap();
        let b = per_ip.take(v6("2001:db8:0:10b::1")).ok().unwrap();
        let _a2 = per_ip.take(v6("2001:db8:0:10a::2")).ok().unwrap();
        // The /64 holds its 2.
        assert!(matches!(
            per_ip.take(v6("2001:db8:0:10a::3")),
            Err(Over::Address)
        ));
        let _b2 = per_ip.take(v6("2001:db8:0:10b::2")).ok().unwrap();
        // The /56 holds its 4, though this /64 has none yet; the next /56 has its own.
        assert!(matches!(
            per_ip.take(v6("2001:db8:0:1ff::1")),
            Err(Over::Network)
        ));
        assert!(per_ip.take(v6("2001:db8:0:200::1")).is_ok());
        // A place given back is the network's again.
        drop(b);
        let c = per_ip.take(v6("2001:db8:0:1ff::1")).ok().unwrap();

        // Rates: each /64 within its burst of 2, the /56 within 4 in all.
        let pd = per_ip.request_from(v6("2001:db8:0:1dd::1")).1;
        let [pa, pc, pd] = [a.pacers(), c.pacers(), pd].map(|p| p.requests.unwrap());
        for p in [&pa, &pa, &pc, &pc] {
            assert_eq!(p.delay(), Duration::ZERO);
        }
        assert!(pd.delay() > Duration::ZERO, "the network's burst is spent");
        let other = per_ip.request_from(v6("2001:db8:0:2dd::1")).1;
        assert_eq!(other.requests.unwrap().delay(), Duration::ZERO);

        // A share of 0: each /64 on its own.
        let per_ip = PerIp::new(1, rates, (0, 56), Vec::new());
        let _held: Vec<_> = (0..10)
            .map(|i| {
                per_ip
                    .take(v6(&format!("2001:db8:0:1{i:02x}::1")))
                    .ok()
                    .unwrap()
            })
            .collect();
    }

    /// Accepts that keep failing (out of file descriptors) wait 10 ms, doubling to 1 s, and
    /// at once again after one succeeds: the accept loop never spins.
    #[tokio::test(start_paused = true)]
    async fn failed_accepts_back_off() {
        use std::time::Duration;
        let mut backoff = super::AcceptBackoff::default();
        let e = std::io::Error::from_raw_os_error(24);
        let waited = |n: u32| {
            let mut backoff = super::AcceptBackoff::default();
            async move {
                let start = tokio::time::Instant::now();
                for _ in 0..n {
                    backoff.wait(&std::io::Error::from_raw_os_error(24)).await;
                }
                start.elapsed()
            }
        };
        assert_eq!(waited(1).await, Duration::from_millis(10));
        assert_eq!(waited(3).await, Duration::from_millis(10 + 20 + 40));
        // 10 + 20 + ... + 640, then 1 s each: 100 failures in about 94 s, not a spin.
        assert_eq!(waited(100).await, Duration::from_millis(1270 + 93 * 1000));
        backoff.wait(&e).await;
        backoff.wait(&e).await;
        backoff.reset();
        let start = tokio::time::Instant::now();
        backoff.wait(&e).await;
        assert_eq!(start.elapsed(), Duration::from_millis(10));
    }

    /// A pacer someone holds (an upgraded WebSocket's) survives the sweep of a full map, so
    /// that its address's next request shares it; one no one holds goes.
    #[test]
    fn a_held_pacer_outlives_the_sweep() {
        let per_ip = PerIp::new(8, (Some(Rate::per_second(1000)), None), (8, 56), Vec::new());
        let held = per_ip.request_from("203.0.113.1".parse().unwrap()).1;
        drop(per_ip.request_from("203.0.113.2".parse().unwrap()));
        // Enough other addresses for a sweep; none of them takes anything.
        for i in 0..=SWEEP_MIN as u32 {
            per_ip.request_from(IpAddr::V4((0x0a00_0000 + i).into()));
        }
        let open = per_ip.open.lock();
        assert!(open.len() < SWEEP_MIN, "swept: {}", open.len());
        assert!(open.contains_key(&Key::Address("203.0.113.1".parse().unwrap())));
        assert!(!open.contains_key(&Key::Address("203.0.113.2".parse().unwrap())));
        drop(open);
        let again = per_ip.request_from("203.0.113.1".parse().unwrap()).1;
        // The map's handle, `held` and `again`: one pacer.
        assert_eq!(again.requests.as_ref().unwrap().handles(), 3);
        drop(held);
    }

    fn client(lines: &[&str], proxy: &str, trusted: &[&str]) -> String {
        let lines: Vec<&[u8]> = lines.iter().map(|l| l.as_bytes()).collect();
        client_bytes(&lines, proxy, trusted)
    }

    fn client_bytes(lines: &[&[u8]], proxy: &str, trusted: &[&str]) -> String {
        let mut headers = axum::http::HeaderMap::new();
        for line in lines {
            let value = axum::http::HeaderValue::from_bytes(line).unwrap();
            headers.append("x-forwarded-for", value);
        }
        let trusted: Vec<IpAddr> = trusted.iter().map(|t| t.parse().unwrap()).collect();
        forwarded_client(&headers, proxy.parse().unwrap(), &trusted).to_string()
    }

    #[test]
    fn the_client_is_the_rightmost_entry_no_trusted_proxy_wrote() {
        let p = "10.0.0.1";
        // What the proxy appended is believed; what the client wrote before it is not.
        assert_eq!(client(&["203.0.113.9"], p, &[p]), "203.0.113.9");
        assert_eq!(
            client(&["198.51.100.1, 203.0.113.9"], p, &[p]),
            "203.0.113.9"
        );
        assert_eq!(
            client(&["198.51.100.1", "203.0.113.9"], p, &[p]),
            "203.0.113.9"
        );
        // Through a second trusted proxy, one hop further.
        let both = [p, "10.0.0.2"];
        assert_eq!(
            client(&["198.51.100.1, 203.0.113.9, 10.0.0.2"], p, &both),
            "203.0.113.9"
        );
        assert_eq!(
            client(&["203.0.113.9", "10.0.0.2"], p, &both),
            "203.0.113.9"
        );
        // Ports and brackets, as some proxies write them.
        assert_eq!(client(&["203.0.113.9:4711"], p, &[p]), "203.0.113.9");
        assert_eq!(client(&["[2001:db8::7]:4711"], p, &[p]), "2001:db8::7");
        assert_eq!(client(&["[2001:db8::7]"], p, &[p]), "2001:db8::7");
        assert_eq!(client(&[" 2001:db8::7 "], p, &[p]), "2001:db8::7");
    }

    #[test]
    fn without_a_believable_entry_the_request_is_its_proxys() {
        let p = "10.0.0.1";
        let both = [p, "10.0.0.2"];
        assert_eq!(client(&[], p, &[p]), p);
        assert_eq!(client(&["unknown"], p, &[p]), p);
        assert_eq!(client(&[""], p, &[p]), p);
        // A bad entry stops the walk at the last hop believed: the client cannot pass the
        // question further left, to an address of its choosing.
        assert_eq!(
            client(&["203.0.113.9, junk, 10.0.0.2"], p, &both),
            "10.0.0.2"
        );
        assert_eq!(client(&["203.0.113.9", "10.0.0.2, _hidden"], p, &both), p);
        // Only trusted proxies all the way: the leftmost of them.
        assert_eq!(client(&["10.0.0.2"], p, &both), "10.0.0.2");
    }

    #[test]
    fn what_a_client_writes_in_front_cannot_hide_its_proxys_entry() {
        let p = "10.0.0.1";
        // nginx appends to the client's own line: a byte that is not text in front does
        // not keep the proxy's entry from being read.
        assert_eq!(
            client_bytes(&[b"\xff, 203.0.113.9"], p, &[p]),
            "203.0.113.9"
        );
        assert_eq!(
            client_bytes(&[b"\xff", b"203.0.113.9"], p, &[p]),
            "203.0.113.9"
        );
        assert_eq!(client_bytes(&[b"203.0.113.9, \xff"], p, &[p]), p);
        assert_eq!(client(&["fe80::1%eth0"], p, &[p]), p);
    }

    #[test]
    fn ipv4_mapped_into_ipv6_is_ipv4() {
        let p = "10.0.0.1";
        // A dual-stack proxy writes a trusted hop, or its client, in the mapped form.
        assert_eq!(
            client(&["203.0.113.9, ::ffff:10.0.0.2"], p, &[p, "10.0.0.2"]),
            "203.0.113.9"
        );
        assert_eq!(client(&["::ffff:203.0.113.9"], p, &[p]), "203.0.113.9");
    }
}
