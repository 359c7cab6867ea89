//! Starting the pieces: the database, a Coherent backend (its RPC endpoint and its
//! operation host), the HTTP tiers of each backend kind.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use coherent::ops::{CommandServer, Notifier};
use coherent::prelude::*;
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
        let store = db.open(16).await?;
        let registry = Registry::new();
        let backend = TasksBackend::new(store, &registry);
        // Server-sent event feeds hold an HTTP connection each for as long as they last: at
        // most a tenth of `HttpLimits::max_connections`, so that feeds cannot take them all.
        let remote = RemoteServer::new()
            .max_sse_feeds(1_000)
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
        let mut endpoint = Endpoint::builder()
            .service(remote.service())
            .service(CommandServer::new(host.clone()));
        if let Some(auth) = auth {
            endpoint = endpoint.authenticate_with(move |creds| {
                // A cookie that does not verify (signed under a secret since changed) is
                // no login, as over HTTP: the connection is anonymous.
                let user = creds
                    .cookies(crate::session::COOKIE)
                    .find_map(|v| auth.verify(v));
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
            serving,
        })
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

    /// Everything this backend serves over HTTP: the API (`/api`, a tier of this backend,
    /// since the page writes through it) beside [`web_router_in`](Self::web_router_in)`(dir)`.
    pub async fn http_router(&self, dir: PathBuf) -> anyhow::Result<axum::Router> {
        Ok(live_router(&[self.addr])
            .await?
            .merge(self.web_router_in(dir)))
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
    // One registry for the tier's views and the client's replicas: the client's lease on
    // it stops the views answering from the cache while the backend cannot vouch for them.
    let registry = Registry::new();
    let client = coherent::remote::RemoteClient::builder()
        .registry(&registry)
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
    /// The longest pause between two pieces of a request's body. Default: 10 s.
    pub body_read_timeout: Duration,
    /// How long a request may take, from its head to its answer's head, its body read
    /// included: a body dripped a byte at a time within `body_read_timeout` still ends
    /// here (408). A stream once started (server-sent events, an upgraded WebSocket) is
    /// not cut. Default: 30 s.
    pub request_timeout: Duration,
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
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_connections: 10_000,
            max_connections_per_ip: 256,
            max_header_bytes: 16 << 10,
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
    let per_ip = PerIp::new(limits.max_connections_per_ip.max(1));
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
        let Some(ip_slot) = per_ip.take(addr.ip()) else {
            tracing::debug!(ip = %addr.ip(), "an address over its connection limit: closed");
            continue;
        };
        // No Nagle: a WebSocket's small frames (an invalidation, an answer) would otherwise
        // wait for the peer's delayed ACK, 40 ms on Linux, behind an earlier one.
        let _ = stream.set_nodelay(true);
        // The places go with the socket, into an upgraded WebSocket too, and are given back
        // when it closes.
        let stream = Placed {
            io: stream,
            _places: (permit, ip_slot),
        };
        let service = TowerToHyperService::new(router.clone());
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
/// socket is dropped.
struct Placed<P> {
    io: tokio::net::TcpStream,
    _places: P,
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
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Connections per IP address.
#[derive(Clone)]
struct PerIp {
    max: usize,
    open: Arc<parking_lot::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
}

/// One connection's place among its address's: given back when dropped.
struct IpSlot {
    ip: std::net::IpAddr,
    open: Arc<parking_lot::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
}

impl PerIp {
    fn new(max: usize) -> Self {
        Self {
            max,
            open: Arc::default(),
        }
    }

    fn take(&self, ip: std::net::IpAddr) -> Option<IpSlot> {
        let mut open = self.open.lock();
        let n = open.entry(ip).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(IpSlot {
            ip,
            open: self.open.clone(),
        })
    }
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        let mut open = self.open.lock();
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                // Only addresses with connections are kept: the map is bounded by them.
                open.remove(&self.ip);
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
