//! The server that clients in other languages test against (the `ts_server` example runs
//! it; its doc comment is the contract: routes, methods, modes, stdout). Here as a library
//! so that a Rust test can start it in-process.
//!
//! - `/rpc`: an [`Endpoint`] over WebSocket whose handshake must carry the configured token,
//!   serving the plain RPC service [`Calc`] and the replicas of the compute service
//!   [`Counters`];
//! - `/gateway/...`: the HTTP JSON gateway of `Counters` ([`RemoteServer::gateway`]);
//! - `/hostile`: a WebSocket that breaks the protocol on purpose ([`Hostile`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::ws::{Message as WsMessage, WebSocket, WebSocketUpgrade};
use axum::extract::Query;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use coherent::prelude::*;
use coherent::rpc::frame::{write_varint, Header, Kind};
use coherent::rpc::handshake::Hello;
use coherent::rpc::{
    service, Blob, CompressionSet, Format, Identity, MethodInfo, ServerStream, Service,
};
use futures::StreamExt;
use parking_lot::Mutex;
use serde::Deserialize;

/// The plain RPC service of the test server: every call is a round trip.
#[service]
pub trait Calc {
    /// `a + b` (wrapping).
    async fn add(&self, a: i64, b: i64) -> i64;
    /// `s` itself.
    async fn echo(&self, s: String) -> String;
    /// `n` bytes (`i % 251` at offset `i`), as a byte string: a large message.
    async fn blob(&self, n: u32) -> Blob;
    /// Answers an `Error` frame of `code` (1 to 11 as they are; any other code as 65535,
    /// the `Unknown` of this build) and `message`. Never answers `Ok`.
    async fn fail(&self, code: u16, message: String);
    /// `a / b`, or the application error `Err("division by zero")` in an `Ok` frame.
    async fn div(&self, a: i64, b: i64) -> Result<i64, String>;
    /// Sleeps `ms` milliseconds, then answers `ms`. A call cancelled before (its handler
    /// aborted) counts in [`cancelled`](Calc::cancelled).
    async fn sleep(&self, ms: u64) -> u64;
    /// How many `sleep` calls were dropped before they finished, since the server started.
    async fn cancelled(&self) -> u64;
    /// Streams `0, 1, ..., n - 1` under the caller's credits.
    async fn count(&self, n: u32) -> ServerStream<u32>;
    /// How many items every `count` stream together has handed to the connection so far
    /// (an item is produced only when the stream has a credit for it).
    async fn produced(&self) -> u64;
    /// Adds `by` to counter `name`, invalidates `Counters.get(name)` (and so every
    /// `Counters.sum` that includes it), and answers the new value once every client
    /// holding a replica of it has acknowledged the invalidation.
    async fn bump(&self, name: String, by: i64) -> i64;
}

/// The compute service of the test server: clients hold replicas of its results, and the
/// server pushes `ReplicaSink.invalidated` when one changes (after `Calc.bump`).
#[compute_service]
pub trait Counters {
    /// The value of counter `name` (0 when it was never set).
    async fn get(&self, name: String) -> Result<i64, RpcError>;
    /// The sum of the counters `names`, computed from [`get`](Counters::get).
    async fn sum(&self, names: Vec<String>) -> Result<i64, RpcError>;
}

/// The counters: a shared map behind the compute service.
#[derive(Clone, ComputeService)]
pub struct CounterMap {
    handle: ServiceHandle,
    values: Arc<Mutex<HashMap<String, i64>>>,
}

#[compute_service]
impl Counters for CounterMap {
    async fn get(&self, name: String) -> Result<i64, RpcError> {
        Ok(self.values.lock().get(&name).copied().unwrap_or(0))
    }

    async fn sum(&self, names: Vec<String>) -> Result<i64, RpcError> {
        let mut sum = 0i64;
        for name in names {
            sum = sum.wrapping_add(self.get(name).await?);
        }
        Ok(sum)
    }
}

/// What the test server's handlers count.
#[derive(Default)]
struct Counts {
    cancelled: AtomicU64,
    produced: AtomicU64,
}

/// The implementation of [`Calc`].
#[derive(Clone)]
struct CalcImpl {
    counts: Arc<Counts>,
    counters: CounterMap,
    remote: RemoteServer,
}

/// Counts a `sleep` that is dropped before it completes.
struct SleepGuard {
    counts: Arc<Counts>,
    completed: bool,
}

impl Drop for SleepGuard {
    fn drop(&mut self) {
        if !self.completed {
            self.counts.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Calc for CalcImpl {
    async fn add(&self, a: i64, b: i64) -> i64 {
        a.wrapping_add(b)
    }

    async fn echo(&self, s: String) -> String {
        s
    }

    async fn blob(&self, n: u32) -> Blob {
        (0..n).map(|i| (i % 251) as u8).collect::<Vec<u8>>().into()
    }

    /// Not reached: [`WithFail`] answers `fail` itself.
    async fn fail(&self, code: u16, message: String) {
        let _ = (code, message);
    }

    async fn div(&self, a: i64, b: i64) -> Result<i64, String> {
        if b == 0 {
            Err("division by zero".to_owned())
        } else {
            Ok(a.wrapping_div(b))
        }
    }

    async fn sleep(&self, ms: u64) -> u64 {
        let mut guard = SleepGuard {
            counts: self.counts.clone(),
            completed: false,
        };
        tokio::time::sleep(Duration::from_millis(ms)).await;
        guard.completed = true;
        ms
    }

    async fn cancelled(&self) -> u64 {
        self.counts.cancelled.load(Ordering::SeqCst)
    }

    async fn count(&self, n: u32) -> ServerStream<u32> {
        let counts = self.counts.clone();
        Box::pin(futures::stream::iter(0..n).map(move |i| {
            counts.produced.fetch_add(1, Ordering::SeqCst);
            i
        }))
    }

    async fn produced(&self) -> u64 {
        self.counts.produced.load(Ordering::SeqCst)
    }

    async fn bump(&self, name: String, by: i64) -> i64 {
        let value = {
            let mut values = self.counters.values.lock();
            let v = values.entry(name.clone()).or_insert(0);
            *v = v.wrapping_add(by);
            *v
        };
        self.counters.invalidate_get(name);
        self.remote.invalidations_delivered().await;
        value
    }
}

/// `CalcServer`, except that `Calc.fail` answers an `Error` frame, which a `#[service]`
/// method cannot (its result always travels in an `Ok` frame).
struct WithFail(CalcServer<CalcImpl>);

impl Service for WithFail {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    fn methods(&self) -> &'static [MethodInfo] {
        self.0.methods()
    }

    fn call(&self, index: usize, args: bytes::Bytes, format: Format) -> coherent::rpc::Response {
        if self.0.methods()[index].id != calc_method_ids::FAIL {
            return self.0.call(index, args, format);
        }
        coherent::rpc::Response::Unary(Box::pin(async move {
            let (code, message): (u16, String) = format.decode_bytes(args)?;
            Err(RpcError::new(ErrorCode::from_u16(code), message))
        }))
    }
}

/// `config` trusting its WebSocket clients: the test server's clients are the tests, and
/// `Calc.bump` answers once every client holding what it changed applied that (a server on
/// the open internet leaves browsers untrusted, and its writes do not wait for them).
pub fn trusted(config: coherent::rpc::Config) -> coherent::rpc::Config {
    config.trust(coherent::rpc::Trust::Trusted)
}

/// How the test server is set up.
#[derive(Debug, Clone)]
pub struct Options {
    /// The bearer token a client's handshake must carry on `/rpc`.
    pub token: String,
    /// The counters' starting values.
    pub initial: Vec<(String, i64)>,
    /// The endpoint's settings (its handshake's limits, its keep-alive).
    pub config: coherent::rpc::Config,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            token: "secret".to_owned(),
            initial: Vec::new(),
            config: trusted(coherent::rpc::Config::default()),
        }
    }
}

/// A test server: its endpoint, its compute service and what it exposes.
#[derive(Clone)]
pub struct TestServer {
    endpoint: Endpoint,
    remote: RemoteServer,
    counters: CounterMap,
}

impl TestServer {
    /// A server set up by `options` (its counters in a registry of their own).
    pub fn new(options: Options) -> Self {
        let counters = CounterMap {
            handle: ServiceHandle::with_registry(&Registry::new()),
            values: Arc::new(Mutex::new(options.initial.into_iter().collect())),
        };
        let remote = RemoteServer::new().expose_service(CountersServer::new(counters.clone()));
        let calc = CalcImpl {
            counts: Arc::default(),
            counters: counters.clone(),
            remote: remote.clone(),
        };
        let token = Arc::<str>::from(options.token);
        let endpoint = Endpoint::builder()
            .service(WithFail(CalcServer::new(calc)))
            .service(remote.service())
            .config(options.config)
            .authenticate(move |presented| {
                let ok = *presented == *token;
                async move {
                    if ok {
                        Ok(Identity::new("client"))
                    } else {
                        Err("bad token".to_owned())
                    }
                }
            })
            .build();
        Self {
            endpoint,
            remote,
            counters,
        }
    }

    /// The RPC endpoint (`/rpc` serves it).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The replicas' server.
    pub fn remote(&self) -> &RemoteServer {
        &self.remote
    }

    /// The current value of counter `name`.
    pub fn counter(&self, name: &str) -> i64 {
        self.counters.values.lock().get(name).copied().unwrap_or(0)
    }

    /// The routes: `/rpc`, `/gateway/...` (any origin may fetch it) and `/hostile`.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/rpc", get(self.endpoint.websocket_handler()))
            .route("/hostile", get(hostile))
            .nest(
                "/gateway",
                self.remote
                    .gateway()
                    .layer(tower_http::cors::CorsLayer::permissive()),
            )
    }
}

/// What `/hostile` does wrong (`?mode=`); see the `ts_server` example's documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Hostile {
    /// A valid `HelloAck`, then a frame of kind 15 (no such kind).
    Kind15,
    /// A valid `HelloAck`, then an `Ok` frame whose length is one more than the client's
    /// `max_message_size` (only its envelope and a few bytes are sent).
    Toolarge,
    /// An `Ok` frame where the `HelloAck` should be.
    Badack,
    /// A valid `HelloAck`; then, to the client's first `Call`, a `StreamBatch` whose payload
    /// ends inside an item.
    GarbageBatch,
}

/// When `/hostile` misbehaves (`?after=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum After {
    /// Right after the handshake.
    Handshake,
    /// Once the client's first `Call` arrived.
    Call,
}

#[derive(Deserialize)]
struct HostileQuery {
    mode: Option<Hostile>,
    after: Option<After>,
}

async fn hostile(
    ws: WebSocketUpgrade,
    query: Result<Query<HostileQuery>, QueryRejection>,
) -> Response {
    let Ok(Query(query)) = query else {
        return (
            StatusCode::BAD_REQUEST,
            "mode: kind15, toolarge, badack or garbage-batch; after: handshake or call",
        )
            .into_response();
    };
    let mode = query.mode.unwrap_or(Hostile::Kind15);
    let after = match (mode, query.after) {
        (Hostile::GarbageBatch, _) => After::Call,
        (_, after) => after.unwrap_or(After::Handshake),
    };
    ws.on_upgrade(move |socket| async move {
        // A session that the client does not end within a minute is ended here.
        let _ = tokio::time::timeout(
            Duration::from_secs(60),
            hostile_session(socket, mode, after),
        )
        .await;
    })
}

/// Reads whole frames off a WebSocket whose messages carry the protocol's byte stream.
struct Frames {
    socket: WebSocket,
    buf: Vec<u8>,
}

impl Frames {
    /// The next frame's envelope and payload; `None` when the socket ends or the bytes are
    /// no frame.
    async fn next(&mut self) -> Option<(Header, Vec<u8>)> {
        loop {
            if let Some((header, at)) = Header::decode(&self.buf, u32::MAX).ok()? {
                let end = at + header.len as usize;
                if self.buf.len() >= end {
                    let payload = self.buf[at..end].to_vec();
                    self.buf.drain(..end);
                    return Some((header, payload));
                }
            }
            match self.socket.recv().await? {
                Ok(WsMessage::Binary(b)) => self.buf.extend_from_slice(&b),
                Ok(WsMessage::Close(_)) | Err(_) => return None,
                Ok(_) => {}
            }
        }
    }

    async fn send(&mut self, bytes: Vec<u8>) -> Option<()> {
        self.socket.send(WsMessage::Binary(bytes.into())).await.ok()
    }
}

/// A frame's bytes: `first` is the whole first byte (kind and flags), so that invalid kinds
/// can be written; `len` is the length field, which may disagree with `payload`.
fn raw_frame(first: u8, call_id: u64, method_id: u32, len: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![first];
    let mut varint = [0u8; 10];
    let n = write_varint(call_id, &mut varint);
    out.extend_from_slice(&varint[..n]);
    out.extend_from_slice(&method_id.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(payload);
    out
}

fn frame(kind: Kind, call_id: u64, payload: &[u8]) -> Vec<u8> {
    raw_frame(kind as u8, call_id, 0, payload.len() as u32, payload)
}

async fn hostile_session(socket: WebSocket, mode: Hostile, after: After) -> Option<()> {
    let mut frames = Frames {
        socket,
        buf: Vec::new(),
    };
    let (header, payload) = frames.next().await?;
    if header.kind != Kind::Hello {
        return None;
    }
    let hello = Hello::decode(&payload).ok()?;
    if mode == Hostile::Badack {
        // MessagePack nil (postcard unit would be empty): a plausible answer to call 1.
        frames.send(frame(Kind::Ok, 1, &[0xC0])).await?;
    } else {
        let ack = Hello {
            version: hello.version,
            format: hello.format,
            decodes: CompressionSet::NONE,
            max_message_size: 16 << 20,
            max_inbound_calls: 64,
            stream_window: 16,
            token: String::new(),
        };
        frames.send(frame(Kind::HelloAck, 0, &ack.encode())).await?;
        let mut call_id = 1;
        if after == After::Call {
            loop {
                let (header, _) = frames.next().await?;
                if header.kind == Kind::Call {
                    call_id = header.call_id;
                    break;
                }
            }
        }
        let bad = match mode {
            Hostile::Kind15 => raw_frame(0x0F, 0, 0, 0, &[]),
            Hostile::Toolarge => raw_frame(
                Kind::Ok as u8,
                call_id,
                0,
                hello.max_message_size.saturating_add(1),
                &[0; 16],
            ),
            // An item of 5 bytes of which 2 came: the payload ends inside it.
            Hostile::GarbageBatch => frame(Kind::StreamBatch, call_id, &[0x05, 0x01, 0x02]),
            Hostile::Badack => unreachable!("answered above"),
        };
        frames.send(bad).await?;
    }
    // The client is the one to close; what it sends meanwhile is read and dropped.
    while frames.socket.recv().await?.is_ok() {}
    None
}
