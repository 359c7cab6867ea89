//! The `remote` suite: the `local` suite's `UserService` (PostgreSQL when reachable, SQLite
//! otherwise) behind a coherent-rpc server on loopback, read by 20 readers per core while a
//! mutator writes through the server's service every 10 ms:
//!
//! - `remote.http.regular`: HTTP JSON, an endpoint that queries the store on every request;
//! - `remote.http.cached`: HTTP JSON through the gateway, answered from the server's cache;
//! - `remote.local.cached`: the service called in-process (the reference);
//! - `remote.rpc.cached`: a `RemoteClient::call` per read, a round trip to the server's cache;
//! - `remote.replica`: a client compute method reading `RemoteClient::replica`, answered
//!   from the client's cache until the server pushes an invalidation;
//! - `remote.invalidation_p50_us` / `_p99_us`: from a write returning on the server to the
//!   client's replica of that user being invalidated.
//!
//! Stale reads: a read that starts after a write returned (in-process and RPC rows), or after
//! the write's invalidation reached the client (the replica row), must see that write.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::IntoResponse;
use bytes::Bytes;

use coherent::remote::{RemoteClient, RemoteServer};
use coherent::rpc::Endpoint;
use coherent::{compute_service, ComputeService, Registry, ServiceHandle};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;

use crate::local::service::UserService;
use crate::local::store::{Store, StoreError, User};
use crate::local::{
    spawn_mutator, spawn_readers, stop_readers, Committed, Getter, READERS_PER_CORE,
};
use crate::report::{cores, percentile, progress, Report, Row};
use crate::Timing;

/// The name the server exposes `UserService::get` under.
const GET: &str = "UserService.get";

/// The client's replica of `UserService::get`.
#[derive(Clone, ComputeService)]
struct UserReplica {
    handle: ServiceHandle,
    remote: RemoteClient,
}

#[compute_service]
impl UserReplica {
    #[compute]
    async fn get(&self, id: u64) -> Result<User, StoreError> {
        match self.remote.replica(GET, (id,)).await {
            Ok(answer) => answer,
            Err(e) => Err(e.to_string().into()),
        }
    }
}

impl Getter for UserReplica {
    #[inline]
    async fn get(&self, id: u64) -> Result<User, StoreError> {
        UserReplica::get(self, id).await
    }
}

/// HTTP JSON reads through a hyper connection pool (HTTP/1.1: one request in flight per
/// connection, so as many connections as readers).
struct HttpGetter {
    client: Client<HttpConnector, Empty<Bytes>>,
    /// The URL up to the id.
    prefix: String,
    /// What follows the id.
    suffix: &'static str,
}

impl HttpGetter {
    fn new(prefix: String, suffix: &'static str) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            prefix,
            suffix,
        }
    }
}

impl Getter for HttpGetter {
    async fn get(&self, id: u64) -> Result<User, StoreError> {
        let url = format!("{}{id}{}", self.prefix, self.suffix);
        let request = hyper::Request::get(url)
            .body(Empty::new())
            .map_err(|e| StoreError::from(e.to_string()))?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| StoreError::from(e.to_string()))?;
        if !response.status().is_success() {
            return Err(format!("HTTP {}", response.status()).into());
        }
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| StoreError::from(e.to_string()))?
            .to_bytes();
        // The gateway answers the method's own `Result`; the plain endpoint the user.
        serde_json::from_slice::<Result<User, StoreError>>(&body)
            .or_else(|_| serde_json::from_slice::<User>(&body).map(Ok))
            .map_err(|e| StoreError::from(e.to_string()))?
    }
}

/// A round trip per read.
struct RpcGetter(RemoteClient);

impl Getter for RpcGetter {
    async fn get(&self, id: u64) -> Result<User, StoreError> {
        match self.0.call(GET, (id,)).await {
            Ok(answer) => answer,
            Err(e) => Err(e.to_string().into()),
        }
    }
}

pub(crate) fn run(timing: Timing) -> anyhow::Result<Report> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores())
        .enable_all()
        .build()?;
    runtime.block_on(run_async(timing))
}

/// What one measured run gives.
#[derive(Default, Clone)]
struct Outcome {
    calls: u64,
    stale: u64,
    writes: u64,
    elapsed: Duration,
    /// Write returned → replica invalidated, in microseconds (replica row only).
    latencies: Vec<f64>,
}

impl Outcome {
    fn rate(&self) -> f64 {
        self.calls as f64 / self.elapsed.as_secs_f64()
    }
}

async fn run_async(timing: Timing) -> anyhow::Result<Report> {
    let mut report = Report::new("remote");
    let bar = progress(timing.runs as u64 + 1);
    let dir = tempfile::tempdir()?;
    let url = crate::report::database_url();
    let store = match Store::postgres(&url, cores() * 4).await {
        Ok(Some(pg)) => {
            report.note("store: PostgreSQL (tokio-postgres through a deadpool pool)");
            pg
        }
        Ok(None) | Err(_) => {
            let path = dir.path().join("users.db");
            report.note(format!(
                "store: SQLite ({}), because PostgreSQL at {url} is not reachable",
                path.display()
            ));
            Store::sqlite(&path, (cores() * 2) as u32)?
        }
    };

    let server_registry = Registry::new();
    let service = UserService::new(Arc::new(store), &server_registry);
    let exposed = RemoteServer::new().expose(GET, service.clone(), |s, (id,): (u64,)| async move {
        s.get_computed(id).await
    });
    let endpoint = Endpoint::builder().service(exposed.service()).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { endpoint.serve_tcp(listener).await });

    // HTTP: the gateway over the same cache, and a plain endpoint that queries every time.
    let store = service.clone();
    let app = axum::Router::new().nest("/api", exposed.gateway()).route(
        "/regular/{id}",
        axum::routing::get(move |axum::extract::Path(id): axum::extract::Path<u64>| {
            let store = store.clone();
            async move {
                match store.store().get(id).await {
                    Ok(user) => axum::Json(user).into_response(),
                    Err(e) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
                        .into_response(),
                }
            }
        }),
    );
    let http_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let http_addr = http_listener.local_addr()?;
    tokio::spawn(async move { axum::serve(http_listener, app).await });

    let client_registry = Registry::new();
    let remote = RemoteClient::builder()
        .registry(&client_registry)
        .connect_tcp(addr)
        .await?;
    let replica = UserReplica {
        handle: ServiceHandle::with_registry(&client_registry),
        remote: remote.clone(),
    };
    let readers = READERS_PER_CORE * cores();

    // The three rows are compared: their runs take turns (local, rpc, replica, local, ...),
    // so that the drift of this shared machine reaches all of them alike.
    let local_getter = Arc::new(service.clone());
    let rpc_getter = Arc::new(RpcGetter(remote.clone()));
    let replica_getter = Arc::new(replica.clone());
    let regular_getter = Arc::new(HttpGetter::new(format!("http://{http_addr}/regular/"), ""));
    let gateway_getter = Arc::new(HttpGetter::new(
        format!("http://{http_addr}/api/{GET}?args=%5B"),
        "%5D",
    ));
    let mut best: [(Outcome, u64); 5] = Default::default();
    for round in 0..=timing.runs {
        let duration = if round == 0 {
            timing.warmup
        } else {
            timing.run
        };
        bar.set_message(format!("round {round} of {}", timing.runs));
        let outcomes = [
            run_once(&local_getter, readers, &service, &replica, false, duration).await,
            run_once(&rpc_getter, readers, &service, &replica, false, duration).await,
            run_once(&replica_getter, readers, &service, &replica, true, duration).await,
            run_once(
                &regular_getter,
                readers,
                &service,
                &replica,
                false,
                duration,
            )
            .await,
            run_once(
                &gateway_getter,
                readers,
                &service,
                &replica,
                false,
                duration,
            )
            .await,
        ];
        for (b, o) in best.iter_mut().zip(outcomes) {
            b.1 += o.stale;
            if round > 0 && (b.0.calls == 0 || o.rate() > b.0.rate()) {
                b.0 = o;
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let [local, rpc, replicated, regular, gateway] = best;

    let row = |name: &str, o: &(Outcome, u64)| {
        Row::new(name.to_owned(), o.0.rate(), "calls/s")
            .with("stale_reads", o.1)
            .with("writes", o.0.writes)
    };
    report.push(row("remote.http.regular", &regular));
    report.push(row("remote.http.cached", &gateway).compared_to("remote.http.regular"));
    // The chart draws the three ways of reading the service in one panel.
    let reads = "remote.reads";
    report.push(row("remote.local.cached", &local).in_group(reads));
    report.push(
        row("remote.rpc.cached", &rpc)
            .compared_to("remote.local.cached")
            .in_group(reads),
    );
    report.push(
        row("remote.replica", &replicated)
            .compared_to("remote.local.cached")
            .in_group(reads)
            .with(
                "x_rpc_cached",
                format!("{:.1}", replicated.0.rate() / rpc.0.rate()),
            ),
    );
    let mut latencies = replicated.0.latencies.clone();
    latencies.sort_by(f64::total_cmp);
    let samples = latencies.len();
    for (name, p) in [("p50", 0.5), ("p99", 0.99)] {
        report.push(
            Row::new(
                format!("remote.invalidation_{name}_us"),
                percentile(&latencies, p),
                "us",
            )
            .with("samples", samples)
            .in_group("remote.invalidation"),
        );
    }
    report.note(format!(
        "{readers} readers (20 per core) over 1,000 users; a mutator on its own thread writes a random user through the server's service every 10 ms"
    ));
    report
        .note("client and server in this process, over one TCP connection on 127.0.0.1; postcard");
    report.note("http: axum on 127.0.0.1, a hyper client pool with one connection per reader (HTTP/1.1), JSON; regular = a query per request, cached = the gateway over the server's cache");
    Ok(report)
}

/// Readers for `duration` while the mutator writes. With `replica_floor`, a read must see a
/// write once its invalidation reached the client; otherwise once the write returned.
async fn run_once<G: Getter>(
    getter: &Arc<G>,
    readers: usize,
    service: &UserService,
    replica: &UserReplica,
    replica_floor: bool,
    duration: Duration,
) -> Outcome {
    let stop = Arc::new(AtomicBool::new(false));
    let returned = Committed::new();
    let arrived = Committed::new();
    let floor = if replica_floor { &arrived } else { &returned };
    let tasks = spawn_readers(getter, readers, floor, &stop, true);
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let mutator = {
        let (service, replica, latencies) = (service.clone(), replica.clone(), latencies.clone());
        let (returned, arrived) = (returned.clone(), arrived.clone());
        spawn_mutator(
            stop.clone(),
            move || {
                let store = service
                    .store()
                    .for_another_runtime()
                    .expect("a store connection for the mutator");
                (service.with_store(Arc::new(store)), replica)
            },
            move |(service, replica): (UserService, UserReplica), id| {
                let (returned, arrived, latencies) =
                    (returned.clone(), arrived.clone(), latencies.clone());
                async move {
                    // The client's replica of this user, as it is before the write.
                    let held = replica.get_computed(id).await;
                    let version = returned.floor(id) + 1;
                    service
                        .update(id, version)
                        .await
                        .expect("the store accepts the write");
                    let written = Instant::now();
                    returned.0[id as usize].store(version, Ordering::Release);
                    tokio::time::timeout(Duration::from_secs(10), held.when_invalidated())
                        .await
                        .expect("the replica's invalidation arrives");
                    let micros = written.elapsed().as_secs_f64() * 1e6;
                    arrived.0[id as usize].store(version, Ordering::Release);
                    latencies.lock().push(micros);
                }
            },
        )
    };
    let started = Instant::now();
    let mut outcome = Outcome::default();
    (outcome.calls, outcome.stale) = stop_readers(tasks, &stop, duration).await;
    outcome.elapsed = started.elapsed();
    outcome.writes = tokio::task::spawn_blocking(move || mutator.join())
        .await
        .expect("joined")
        .expect("the mutator thread");
    if replica_floor {
        outcome.latencies = std::mem::take(&mut *latencies.lock());
    }
    outcome
}
