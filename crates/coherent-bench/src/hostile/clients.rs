//! The clients of the `hostile` suite: a keep-alive HTTP/1.1 connection (the victim and the
//! writers), boards over WebSocket that acknowledge every invalidation (`RemoteClient`), and
//! holders that never do (the replica protocol spoken by hand).

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use coherent::remote::RemoteClient;
use coherent::rpc::{method_id, Blob, Endpoint, Peer};
use coherent::ComputedState;
use coherent_tasks::live::{TasksService as _, TasksServiceClient};
use coherent_tasks::model::{ListQuery, Status};
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// The replica protocol's wire traits, declared again here (as `coherent-remote`'s tests
/// do): the same trait and method names give the same method ids, so a client built from
/// them speaks to a real server, and can misbehave where `RemoteClient` never would.
pub(crate) mod protocol {
    use coherent::rpc::{service, Blob};
    use serde::{Deserialize, Serialize};

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub(crate) enum Failure {
        UnknownMethod(u32),
        BadArguments(String),
        BadValue(String),
        TooManyReplicas(usize),
    }

    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub(crate) struct Held {
        pub(crate) replica: u64,
        pub(crate) method: u32,
        pub(crate) args: Blob,
        pub(crate) hash: u64,
    }

    #[service]
    pub(crate) trait ReplicaHost {
        async fn fetch(&self, method: u32, args: Blob, replica: u64) -> Result<Blob, Failure>;
        async fn call(&self, method: u32, args: Blob) -> Result<Blob, Failure>;
        async fn revalidate(&self, replicas: Vec<Held>) -> Vec<u64>;
        #[oneway]
        async fn release(&self, replicas: Vec<u64>);
    }

    #[service]
    pub(crate) trait ReplicaSink {
        async fn invalidated(&self, replicas: Vec<u64>);
    }
}

use protocol::{ReplicaHostClient, ReplicaSink, ReplicaSinkServer};

/// A TCP connection to `addr`, from the source address `from` if given (any port).
pub(crate) async fn tcp_from(from: Option<IpAddr>, addr: SocketAddr) -> std::io::Result<TcpStream> {
    match from {
        None => TcpStream::connect(addr).await,
        Some(ip) => {
            let socket = match ip {
                IpAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
                IpAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
            };
            socket.bind(SocketAddr::new(ip, 0))?;
            socket.connect(addr).await
        }
    }
}

/// A keep-alive HTTP/1.1 connection.
pub(crate) struct Http {
    addr: SocketAddr,
    from: Option<IpAddr>,
    send: Option<hyper::client::conn::http1::SendRequest<Full<Bytes>>>,
    /// Connections made after the first (the server closed one).
    pub(crate) reconnects: u64,
}

impl Http {
    pub(crate) fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            from: None,
            send: None,
            reconnects: 0,
        }
    }

    /// A connection from the source address `from`.
    pub(crate) fn from_address(addr: SocketAddr, from: IpAddr) -> Self {
        Self {
            from: Some(from),
            ..Self::new(addr)
        }
    }

    async fn connection(
        &mut self,
    ) -> anyhow::Result<&mut hyper::client::conn::http1::SendRequest<Full<Bytes>>> {
        if self.send.as_ref().is_none_or(|s| s.is_closed()) {
            if self.send.is_some() {
                self.reconnects += 1;
            }
            let stream = tcp_from(self.from, self.addr).await?;
            stream.set_nodelay(true)?;
            let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            tokio::spawn(conn);
            self.send = Some(send);
        }
        Ok(self.send.as_mut().expect("connected"))
    }

    /// Sends one request; its status and body.
    pub(crate) async fn request(
        &mut self,
        method: hyper::Method,
        path: &str,
        json: Option<String>,
    ) -> anyhow::Result<(u16, Bytes)> {
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "127.0.0.1");
        if json.is_some() {
            req = req.header("content-type", "application/json");
        }
        let req = req.body(Full::new(json.map(Bytes::from).unwrap_or_default()))?;
        let send = self.connection().await?;
        send.ready().await?;
        let answer = send.send_request(req).await;
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                self.send = None;
                return Err(e.into());
            }
        };
        let status = answer.status().as_u16();
        let body = answer.into_body().collect().await?.to_bytes();
        Ok((status, body))
    }
}

/// The board's four columns of `project`: a page of 12 per status, as the live page asks.
pub(crate) fn columns(project: uuid::Uuid) -> [ListQuery; 4] {
    Status::ALL.map(|status| ListQuery {
        project: Some(project),
        status: Some(status),
        limit: 12,
        after: None,
    })
}

/// `ws://ADDR/rpc`.
pub(crate) fn rpc_url(http: SocketAddr) -> String {
    format!("ws://{http}/rpc")
}

/// A well-behaved board: a `RemoteClient` over WebSocket holding the four column replicas,
/// read again by a `ComputedState` whenever one is invalidated (as the page re-renders).
pub(crate) struct Board {
    client: RemoteClient,
    _state: ComputedState<()>,
}

impl Board {
    pub(crate) async fn connect(
        http: SocketAddr,
        project: uuid::Uuid,
        refetches: Arc<AtomicU64>,
    ) -> anyhow::Result<Self> {
        let url = rpc_url(http);
        let client = RemoteClient::builder()
            .connect_with(move |e: Endpoint| {
                let url = url.clone();
                async move { e.connect_websocket(&url).await }
            })
            .await?;
        let api = TasksServiceClient::new(client.clone());
        // The first read here fails the connect when the server refuses.
        for q in columns(project) {
            api.page(q).await.map_err(|e| anyhow::anyhow!("{e:?}"))?;
        }
        let state = ComputedState::new(move || {
            let api = api.clone();
            let refetches = refetches.clone();
            async move {
                refetches.fetch_add(1, Ordering::Relaxed);
                for q in columns(project) {
                    let _ = api.page(q).await;
                }
            }
        })
        .await;
        Ok(Self {
            client,
            _state: state,
        })
    }

    pub(crate) fn close(&self) {
        self.client.close();
    }
}

/// A sink that records each push and never answers it.
struct Silent {
    pushes: Arc<AtomicU64>,
}

impl ReplicaSink for Silent {
    async fn invalidated(&self, _replicas: Vec<u64>) {
        self.pushes.fetch_add(1, Ordering::Relaxed);
        std::future::pending::<()>().await;
    }
}

/// A sink that answers every push at once (and forgets the replicas).
struct Answering;

impl ReplicaSink for Answering {
    async fn invalidated(&self, _replicas: Vec<u64>) {}
}

/// A replica connection spoken by hand over WebSocket.
pub(crate) struct RawReplicas {
    pub(crate) peer: Peer,
    pub(crate) host: ReplicaHostClient,
}

impl RawReplicas {
    /// Connects to `/rpc` (from the source address `from`, if given); a `silent` one never
    /// answers a push (it counts them in `pushes`), the others answer every one.
    pub(crate) async fn connect(
        http: SocketAddr,
        silent: Option<Arc<AtomicU64>>,
        from: Option<IpAddr>,
    ) -> anyhow::Result<Self> {
        let builder = Endpoint::builder();
        let endpoint = match silent {
            Some(pushes) => builder.service(ReplicaSinkServer::new(Silent { pushes })),
            None => builder.service(ReplicaSinkServer::new(Answering)),
        }
        .build();
        let peer = tokio::time::timeout(Duration::from_secs(10), async {
            let stream = tcp_from(from, http)
                .await
                .map_err(coherent::rpc::RpcError::from)?;
            let _ = stream.set_nodelay(true);
            endpoint
                .connect_websocket_over(stream, &rpc_url(http), &[])
                .await
        })
        .await
        .map_err(|_| anyhow::anyhow!("WebSocket connect timed out"))??;
        Ok(Self {
            host: ReplicaHostClient::new(peer.clone()),
            peer,
        })
    }

    /// `TasksService.page(q)`'s id and arguments, as this connection encodes them.
    pub(crate) fn page_args(&self, q: &ListQuery) -> anyhow::Result<(u32, Blob)> {
        let args = self.peer.format().encode(&(q,))?;
        Ok((method_id("TasksService.page"), Blob::from(args)))
    }

    /// Holds the board's four columns of `project` as replicas 1 to 4.
    pub(crate) async fn hold_board(&self, project: uuid::Uuid) -> anyhow::Result<()> {
        for (i, q) in columns(project).iter().enumerate() {
            let (method, args) = self.page_args(q)?;
            self.host
                .fetch(method, args, i as u64 + 1)
                .await?
                .map_err(|f| anyhow::anyhow!("fetch refused: {f:?}"))?;
        }
        Ok(())
    }
}

/// A holder of the board that never answers a push, and connects again (and holds the
/// board again) whenever the server closes its connection, until dropped.
pub(crate) async fn silent_holder(
    http: SocketAddr,
    project: uuid::Uuid,
    pushes: Arc<AtomicU64>,
    closed_by_server: Arc<AtomicU64>,
    ready: Option<tokio::sync::oneshot::Sender<anyhow::Result<()>>>,
) {
    let mut ready = ready;
    loop {
        let held = async {
            let c = RawReplicas::connect(http, Some(pushes.clone()), None).await?;
            c.hold_board(project).await?;
            anyhow::Ok(c)
        }
        .await;
        match held {
            Ok(c) => {
                if let Some(r) = ready.take() {
                    let _ = r.send(Ok(()));
                }
                c.peer.closed().await;
                closed_by_server.fetch_add(1, Ordering::Relaxed);
                // As a browser's client comes back: after its first backoff, 250 ms scaled
                // by a random factor in [0.5, 1) (`@coherent/client`'s reconnection), so
                // that holders closed together do not all return at once.
                let jitter = {
                    use rand::{RngExt as _, SeedableRng as _};
                    let seed = u64::from(
                        std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .unwrap_or_default()
                            .subsec_nanos(),
                    ) ^ (Arc::as_ptr(&pushes) as u64);
                    rand::rngs::SmallRng::seed_from_u64(seed).random_range(125..250)
                };
                tokio::time::sleep(Duration::from_millis(jitter)).await;
            }
            Err(e) => {
                if let Some(r) = ready.take() {
                    let _ = r.send(Err(e));
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}
