//! Servers of each backend over a fresh database, and a small HTTP client.

use std::net::SocketAddr;
use std::path::Path;

use bytes::Bytes;
use coherent_tasks::app::{self, DbConfig, LiveBackend};
use http_body_util::{BodyExt, Full};
use hyper::{HeaderMap, Method, Request, StatusCode};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The backends the API runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Direct,
    Grpc,
    Coherent,
}

pub(crate) const KINDS: [Kind; 3] = [Kind::Direct, Kind::Grpc, Kind::Coherent];

/// A fresh database: a SQLite file in a temporary directory, or a fresh schema of the
/// PostgreSQL at `DATABASE_URL`.
pub(crate) struct Db {
    pub(crate) config: DbConfig,
    _dir: Option<tempfile::TempDir>,
}

impl Db {
    pub(crate) fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        Self {
            config: DbConfig::Sqlite(dir.path().join("tasks.db")),
            _dir: Some(dir),
        }
    }

    /// `None` (and a note) where `DATABASE_URL` is not set.
    pub(crate) fn postgres(name: &str) -> Option<Self> {
        let Ok(url) = std::env::var("DATABASE_URL") else {
            eprintln!("DATABASE_URL not set: the PostgreSQL cases of {name} are skipped");
            return None;
        };
        let schema = format!("tasks_{name}_{:08x}", rand::random::<u32>());
        Some(Self {
            config: DbConfig::Postgres { url, schema },
            _dir: None,
        })
    }

    /// SQLite, and PostgreSQL where configured.
    pub(crate) fn all(name: &str) -> Vec<Self> {
        let mut dbs = vec![Self::sqlite()];
        dbs.extend(Self::postgres(name));
        dbs
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        if let DbConfig::Postgres { url, schema } = &self.config {
            let (url, schema) = (url.clone(), schema.clone());
            // Best effort, on a thread of its own: drop runs inside the test's runtime.
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .ok()?;
                rt.block_on(async {
                    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                        .await
                        .ok()?;
                    tokio::spawn(conn);
                    client
                        .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                        .await
                        .ok()
                })
            })
            .join();
        }
    }
}

/// A running HTTP tier (and what it stands on).
pub(crate) struct Server {
    pub(crate) kind: Kind,
    pub(crate) base: String,
    pub(crate) client: Http,
    http: JoinHandle<()>,
    pub(crate) backend: Option<LiveBackend>,
    grpc: Option<JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.http.abort();
        if let Some(g) = &self.grpc {
            g.abort();
        }
    }
}

/// Serves `router` on a fresh loopback port.
pub(crate) async fn serve(router: axum::Router) -> (String, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let handle = tokio::spawn(async move {
        let _ = app::serve_http(listener, router).await;
    });
    (format!("http://{addr}"), handle)
}

/// A Coherent backend on a fresh loopback port.
pub(crate) async fn live_backend(db: &DbConfig) -> LiveBackend {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    LiveBackend::start(db, listener, None).await.unwrap()
}

/// A tier of the `coherent` backend connected to `addrs`.
pub(crate) async fn live_tier(addrs: &[SocketAddr]) -> Server {
    let (base, http) = serve(app::live_router(addrs).await.unwrap()).await;
    Server {
        kind: Kind::Coherent,
        base,
        client: Http::new(),
        http,
        backend: None,
        grpc: None,
    }
}

/// A tier of the `coherent` backend with that backend in-process, serving the web router
/// (the live page's files from `web`) beside the API, as `tasks serve` does.
pub(crate) async fn live_with_web(db: &DbConfig, web: &Path) -> Server {
    let backend = live_backend(db).await;
    let router = backend.http_router(web.to_owned()).await.unwrap();
    let (base, http) = serve(router).await;
    Server {
        kind: Kind::Coherent,
        base,
        client: Http::new(),
        http,
        backend: Some(backend),
        grpc: None,
    }
}

/// A tier of `kind` over `db`, with its own backend.
pub(crate) async fn start(kind: Kind, db: &DbConfig) -> Server {
    match kind {
        Kind::Direct => {
            let (base, http) = serve(app::direct_router(db).await.unwrap()).await;
            Server {
                kind,
                base,
                client: Http::new(),
                http,
                backend: None,
                grpc: None,
            }
        }
        Kind::Grpc => {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let (addr, backend) = app::start_grpc_backend(db, listener).await.unwrap();
            let (base, http) = serve(app::grpc_router(addr).await.unwrap()).await;
            Server {
                kind,
                base,
                client: Http::new(),
                http,
                backend: None,
                grpc: Some(backend),
            }
        }
        Kind::Coherent => {
            let backend = live_backend(db).await;
            let mut server = live_tier(&[backend.addr]).await;
            server.backend = Some(backend);
            server
        }
    }
}

/// An HTTP/1.1 client with keep-alive.
#[derive(Clone)]
pub(crate) struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

/// A response, its body read.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Reply {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    /// The field a 400 names.
    pub(crate) fn field(&self) -> String {
        assert_eq!(self.status, StatusCode::BAD_REQUEST, "{self:?}");
        self.json()["field"].as_str().unwrap_or_default().to_owned()
    }
}

impl Http {
    pub(crate) fn new() -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    pub(crate) async fn send(
        &self,
        method: Method,
        url: &str,
        body: Option<Bytes>,
        headers: &[(&str, &str)],
    ) -> Reply {
        let typed = body.as_ref().map(|_| ("content-type", "application/json"));
        let headers: Vec<_> = headers.iter().copied().chain(typed).collect();
        self.request(method, url, body.unwrap_or_default(), &headers)
            .await
    }

    /// A request with a body and exactly the headers given (no content type of its own).
    pub(crate) async fn send_untyped(
        &self,
        method: Method,
        url: &str,
        body: &str,
        headers: &[(&str, &str)],
    ) -> Reply {
        self.request(method, url, Bytes::from(body.to_owned()), headers)
            .await
    }

    async fn request(
        &self,
        method: Method,
        url: &str,
        body: Bytes,
        headers: &[(&str, &str)],
    ) -> Reply {
        let mut req = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(body)).unwrap();
        let resp = self.client.request(req).await.expect("the request");
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.expect("the body").to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }
}

impl Server {
    pub(crate) async fn get(&self, path: &str) -> Reply {
        self.client
            .send(Method::GET, &format!("{}{path}", self.base), None, &[])
            .await
    }

    pub(crate) async fn get_with(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        self.client
            .send(Method::GET, &format!("{}{path}", self.base), None, headers)
            .await
    }

    pub(crate) async fn send_json(&self, method: Method, path: &str, body: &Value) -> Reply {
        let body = Bytes::from(serde_json::to_vec(body).unwrap());
        self.client
            .send(method, &format!("{}{path}", self.base), Some(body), &[])
            .await
    }

    pub(crate) async fn send_raw(
        &self,
        method: Method,
        path: &str,
        body: impl Into<Bytes>,
    ) -> Reply {
        self.client
            .send(
                method,
                &format!("{}{path}", self.base),
                Some(body.into()),
                &[],
            )
            .await
    }

    pub(crate) async fn delete(&self, path: &str) -> Reply {
        self.client
            .send(Method::DELETE, &format!("{}{path}", self.base), None, &[])
            .await
    }

    /// Creates a project; answers its id.
    pub(crate) async fn project(&self, name: &str) -> String {
        let r = self
            .send_json(
                Method::POST,
                "/api/projects",
                &serde_json::json!({ "name": name }),
            )
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
        r.json()["id"].as_str().unwrap().to_owned()
    }

    /// Creates a task; answers it.
    pub(crate) async fn task(&self, project: &str, title: &str) -> Value {
        let r = self
            .send_json(
                Method::POST,
                "/api/tasks",
                &serde_json::json!({ "project": project, "title": title }),
            )
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
        r.json()
    }
}
