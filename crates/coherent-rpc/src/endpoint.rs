//! An endpoint: the services one side serves, its settings and its auth hook, and the
//! handshakes through which it connects to or accepts a connection over any byte
//! stream (TCP, Unix sockets, TLS, an in-memory duplex, a child's stdin/stdout...).

use std::future::Future;
use std::io;
use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, ToSocketAddrs};

use crate::codec::CompressionSet;
use crate::config::{Config, Trust};
use crate::error::{ErrorCode, RpcError};
use crate::frame::{Compression, Header, Kind};
use crate::handshake::{self, Hello};
use crate::net::Due;
use crate::pace::Pacer;
use crate::peer::{self, Out, Pacing, Peer, Role, Settings};
use crate::service::{BoxFuture, Credentials, Identity, Registry, Service};

/// How long, and for how many bytes, a refused connection is drained before it is dropped.
const LINGER: std::time::Duration = std::time::Duration::from_secs(1);
const LINGER_BYTES: usize = 1 << 20;

type AuthHook =
    Arc<dyn Fn(Credentials) -> BoxFuture<Result<Option<Identity>, String>> + Send + Sync>;

/// Builds an [`Endpoint`].
#[derive(Default)]
pub struct EndpointBuilder {
    registry: Registry,
    config: Config,
    auth: Option<AuthHook>,
    token: String,
}

impl EndpointBuilder {
    /// Serves `service` on every connection of this endpoint.
    ///
    /// # Panics
    /// When one of its method ids collides with an already registered method.
    pub fn service<S: Service>(mut self, service: S) -> Self {
        self.registry.add(Arc::new(service));
        self
    }

    /// The endpoint's settings.
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// Checks the bearer token of every accepted connection (empty when the other side sent
    /// none). `Ok(identity)` accepts it and makes `identity` visible to handlers through
    /// `CallContext::identity`; `Err(reason)` rejects it with `Unauthenticated`.
    pub fn authenticate<F, Fut>(mut self, hook: F) -> Self
    where
        F: Fn(String) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Identity, String>> + Send + 'static,
    {
        self.auth = Some(Arc::new(move |c: Credentials| {
            let checked = hook(c.token);
            Box::pin(async move { checked.await.map(Some) })
        }));
        self
    }

    /// Checks every accepted connection by what it presented ([`Credentials`]: its token,
    /// and over WebSocket its upgrade request's headers and cookies). `Ok(Some(identity))`
    /// accepts it as `identity` (visible to handlers through `CallContext::identity`,
    /// with a typed principal if the hook attached one), `Ok(None)` accepts it as
    /// anonymous, `Err(reason)` refuses it with `Unauthenticated`.
    ///
    /// ```
    /// # use coherent_rpc::{Endpoint, Identity};
    /// #[derive(Debug)]
    /// struct User { id: u64 }
    /// let endpoint = Endpoint::builder()
    ///     .authenticate_with(|creds| async move {
    ///         match creds.cookie("session") {
    ///             Some("s3cr3t") => Ok(Some(Identity::new("alice").with_principal(User { id: 7 }))),
    ///             Some(_) => Err("unknown session".to_owned()),
    ///             None => Ok(None), // anonymous: what it may do is up to the services
    ///         }
    ///     })
    ///     .build();
    /// # let _ = endpoint;
    /// ```
    pub fn authenticate_with<F, Fut>(mut self, hook: F) -> Self
    where
        F: Fn(Credentials) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Option<Identity>, String>> + Send + 'static,
    {
        self.auth = Some(Arc::new(move |c| Box::pin(hook(c))));
        self
    }

    /// The bearer token this endpoint presents when it connects.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = token.into();
        self
    }

    /// The endpoint.
    pub fn build(self) -> Endpoint {
        Endpoint {
            inner: Arc::new(Inner {
                registry: Arc::new(self.registry),
                totals: Arc::new(peer::Totals::new(
                    self.config.max_connections,
                    self.config
                        .trusted_reserve
                        .unwrap_or(self.config.max_connections / 10)
                        .min(self.config.max_connections),
                    self.config.queue_budget,
                )),
                config: self.config,
                auth: self.auth,
                token: self.token,
            }),
        }
    }
}

struct Inner {
    registry: Arc<Registry>,
    totals: Arc<peer::Totals>,
    config: Config,
    auth: Option<AuthHook>,
    token: String,
}

/// One side of the protocol: it can accept connections, make them, or both, and serves
/// its services on each of them (so calls flow in both directions).
#[derive(Clone)]
pub struct Endpoint {
    inner: Arc<Inner>,
}

impl Endpoint {
    /// A builder with no services and the default [`Config`].
    pub fn builder() -> EndpointBuilder {
        EndpointBuilder::default()
    }

    /// Counters over every connection this endpoint made or accepted, open or closed.
    pub fn stats(&self) -> peer::EndpointStats {
        self.inner.totals.report()
    }

    fn hello(&self, token: &str) -> Hello {
        let c = &self.inner.config;
        Hello {
            version: handshake::VERSION,
            format: c.format,
            decodes: c.decodes,
            max_message_size: c.max_message_size,
            max_inbound_calls: c.max_inbound_calls,
            stream_window: c.stream_window,
            token: token.to_owned(),
        }
    }

    /// What an accepted connection's calls are held to: nothing on a trusted one.
    fn pacing(&self, trust: Trust, address: Option<Pacer>) -> Pacing {
        if trust == Trust::Trusted {
            return Pacing::default();
        }
        Pacing {
            own: self.inner.config.untrusted_call_rate.map(Pacer::new),
            shared: address,
        }
    }

    fn settings(&self, remote: &Hello) -> Settings {
        let c = &self.inner.config;
        let send_compression = if remote.decodes.contains(c.compression) {
            c.compression
        } else {
            Compression::None
        };
        Settings {
            format: remote.format,
            send_compression,
            compression_threshold: c.compression_threshold,
            local_max: c.max_message_size,
            remote_max: remote.max_message_size,
            max_inbound: c.max_inbound_calls,
            max_queued: c.queue_mark(),
            local_window: c.stream_window,
            remote_window: remote.stream_window,
            keepalive_interval: c.keepalive_interval,
            idle_timeout: c.idle_timeout,
            write_stall_timeout: c.write_stall_timeout,
            call_timeout: c.call_timeout,
        }
    }

    /// Connects over an established byte stream: sends `Hello`, waits for `HelloAck`
    /// (unless [`Config::zero_rtt`]).
    /// The returned handle closes the connection when its last clone is dropped.
    pub async fn connect<IO>(&self, io: IO) -> Result<Peer, RpcError>
    where
        IO: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (rd, wr) = tokio::io::split(io);
        self.connect_halves(rd, wr, None).await
    }

    /// [`connect`](Self::connect) over a transport's two halves, with the handle through
    /// which the reader tells a socket read as it is how many bytes are due (see [`Due`]).
    async fn connect_halves<R, W>(
        &self,
        mut rd: R,
        mut wr: W,
        due: Option<Due>,
    ) -> Result<Peer, RpcError>
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let timeout = self.inner.config.handshake_timeout;
        let hello = self.hello(&self.inner.token);
        if self.inner.config.zero_rtt {
            tokio::time::timeout(timeout, write_frame(&mut wr, Kind::Hello, &hello.encode()))
                .await
                .map_err(|_| RpcError::disconnected("the Hello stalled"))??;
            // Provisional until the answer: what every endpoint takes blind.
            let mut settings = self.settings(&hello);
            settings.send_compression = Compression::None;
            settings.remote_max = peer::EARLY_MAX as u32;
            let early = peer::Early::new(self.inner.config.compression, hello.format, timeout);
            return Ok(Peer::start(
                (rd, due),
                wr,
                BytesMut::new(),
                settings,
                (self.inner.registry.clone(), self.inner.totals.clone()),
                Role::Connecting { early: Some(early) },
            ));
        }
        let exchange = async {
            write_frame(&mut wr, Kind::Hello, &hello.encode()).await?;
            let mut buf = BytesMut::with_capacity(4096);
            let (h, payload) = read_frame(&mut rd, &mut buf).await?;
            match h.kind {
                Kind::HelloAck => Ok((Hello::decode(&payload)?, buf)),
                Kind::Close => Err(RpcError::from_payload(&payload)),
                k => Err(RpcError::protocol(format!("expected HelloAck, got {k:?}"))),
            }
        };
        let (ack, leftover) = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| {
                RpcError::disconnected(format!("no handshake answer within {timeout:?}"))
            })??;
        let mut settings = self.settings(&ack);
        // The connecting side chose the format; an answer in another one is a broken peer.
        if ack.format != hello.format {
            return Err(RpcError::protocol(
                "the other side answered in another format",
            ));
        }
        settings.format = hello.format;
        Ok(Peer::start(
            (rd, due),
            wr,
            leftover,
            settings,
            (self.inner.registry.clone(), self.inner.totals.clone()),
            Role::Connecting { early: None },
        ))
    }

    /// Accepts a connection over an established byte stream: reads `Hello`, checks the
    /// token, answers `HelloAck` (or `Close` with the reason it refuses). The connection is
    /// [`Trust::Trusted`] unless [`Config::trust`] says otherwise.
    pub async fn accept<IO>(&self, io: IO) -> Result<Peer, RpcError>
    where
        IO: AsyncRead + AsyncWrite + Send + 'static,
    {
        self.accept_by(io, Trust::Trusted).await
    }

    /// [`accept`](Self::accept), with the trust that the transport gives its connections
    /// unless [`Config::trust`] says otherwise.
    pub(crate) async fn accept_by<IO>(&self, io: IO, transport: Trust) -> Result<Peer, RpcError>
    where
        IO: AsyncRead + AsyncWrite + Send + 'static,
    {
        self.accept_with(io, transport, Vec::new(), None).await
    }

    /// [`accept_by`](Self::accept_by), with the headers of the HTTP request that carried
    /// the connection (WebSocket), for the authentication hook, and the pacer of the
    /// connection's address, if the HTTP server gave one.
    pub(crate) async fn accept_with<IO>(
        &self,
        io: IO,
        transport: Trust,
        headers: Vec<(String, String)>,
        address_pacer: Option<Pacer>,
    ) -> Result<Peer, RpcError>
    where
        IO: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (rd, wr) = tokio::io::split(io);
        let (peer, reader) = self
            .handshake_accepting(rd, wr, None, (transport, headers, address_pacer))
            .await?;
        // The reader runs later, on its own task: the answer to the `Hello` goes now.
        peer.shared.uncork();
        tokio::spawn(reader);
        Ok(peer)
    }

    /// Accepts a connection and serves it on the calling task until it closes: the task
    /// that read the `Hello` reads on (frames sent right behind it included) instead of
    /// handing the connection to a new reader task.
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    pub(crate) async fn serve_accepted<IO>(&self, io: IO) -> Result<(), RpcError>
    where
        IO: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (rd, wr) = tokio::io::split(io);
        self.serve_halves(rd, wr, None).await
    }

    /// [`serve_accepted`](Self::serve_accepted) over a transport's two halves, with the
    /// reader's [`Due`].
    async fn serve_halves<R, W>(&self, rd: R, wr: W, due: Option<Due>) -> Result<(), RpcError>
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (_peer, reader) = self
            .handshake_accepting(rd, wr, due, (Trust::Trusted, Vec::new(), None))
            .await?;
        reader.await;
        Ok(())
    }

    /// How many connections may wait in a transport's own handshake (TLS) at once, before
    /// they take a place among the endpoint's: as many as untrusted clients may hold, so
    /// that those who have not shown a certificate yet cannot take the places kept for the
    /// tiers.
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    pub(crate) fn max_in_handshake(&self) -> usize {
        self.inner.totals.untrusted_max().max(1)
    }

    /// Counts a connection refused before its handshake.
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    pub(crate) fn count_refused(&self) {
        self.inner
            .totals
            .refusals()
            .connections_refused
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    async fn handshake_accepting<R, W>(
        &self,
        mut rd: R,
        mut wr: W,
        due: Option<Due>,
        (transport, headers, address_pacer): (Trust, Vec<(String, String)>, Option<Pacer>),
    ) -> Result<(Peer, impl Future<Output = ()> + Send + 'static), RpcError>
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let timeout = self.inner.config.handshake_timeout;
        let trust = self.inner.config.trust.unwrap_or(transport);
        let slot = self.inner.totals.take_slot(trust);
        let exchange = async {
            // Refused before its `Hello` is read: a connection over the limit costs no
            // parsing and no auth hook.
            let slot = slot?;
            let mut buf = BytesMut::with_capacity(4096);
            let (h, payload) = read_frame(&mut rd, &mut buf).await?;
            if h.kind != Kind::Hello {
                return Err(RpcError::protocol(format!(
                    "expected Hello, got {:?}",
                    h.kind
                )));
            }
            let hello = Hello::decode(&payload)?;
            let identity = match &self.inner.auth {
                None => None,
                Some(auth) => {
                    // A WebSocket upgrade always has headers (`Host`, `Upgrade`...).
                    let over_http = !headers.is_empty();
                    let credentials = Credentials {
                        token: hello.token.clone(),
                        headers,
                        over_http,
                    };
                    auth(credentials)
                        .await
                        .map_err(|m| RpcError::new(ErrorCode::Unauthenticated, m))?
                }
            };
            Ok((hello, identity, buf, slot))
        };
        let outcome = match tokio::time::timeout(timeout, exchange).await {
            Ok(r) => r,
            Err(_) => Err(RpcError::protocol(format!(
                "no handshake within {timeout:?}"
            ))),
        };
        let (hello, identity, leftover, slot) = match outcome {
            Ok(v) => v,
            Err(e) => {
                // Best effort: the reason helps a legitimate client; a hostile one may not read.
                let _ = tokio::time::timeout(timeout, async {
                    write_frame(&mut wr, Kind::Close, &e.to_payload()).await?;
                    wr.shutdown().await.map_err(RpcError::from)
                })
                .await;
                // A lingering close: what the other side sent meanwhile (zero-RTT calls) is
                // read and dropped until it hangs up, since closing a socket with bytes
                // unread resets the connection, and a reset can overtake the `Close`.
                let _ = tokio::time::timeout(LINGER.min(timeout), async {
                    let mut sink = [0u8; 4096];
                    let mut left = LINGER_BYTES;
                    while left > 0 {
                        match rd.read(&mut sink).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => left = left.saturating_sub(n),
                        }
                    }
                })
                .await;
                return Err(e);
            }
        };
        let mut ack = self.hello("");
        ack.format = hello.format;
        // The answer goes out with the answers to the calls sent right behind the `Hello`
        // (zero-RTT), in one write, once the reader has routed them: see `Shared::uncork`.
        Ok(Peer::start_writer(
            (rd, due),
            wr,
            leftover,
            self.settings(&hello),
            (self.inner.registry.clone(), self.inner.totals.clone()),
            Role::Accepting {
                identity,
                trust,
                answer: frame(Kind::HelloAck, &ack.encode()),
                slot,
                pacing: self.pacing(trust, address_pacer),
            },
        ))
    }

    /// Connects over TCP (with `TCP_NODELAY`: the writer batches already). A connect the
    /// kernel completes at once (loopback) and the connection's first reads and writes
    /// skip a turn of tokio's reactor, which is most of a new connection's cost on a busy
    /// or small machine.
    pub async fn connect_tcp(&self, addr: impl ToSocketAddrs) -> Result<Peer, RpcError> {
        let stream = tokio::time::timeout(
            self.inner.config.handshake_timeout,
            crate::net::connect_tcp(addr, self.inner.config.tcp_send_buffer),
        )
        .await
        .map_err(|_| RpcError::disconnected("TCP connect timed out"))??;
        let (rd, wr, due) = crate::net::eager_halves(stream);
        self.connect_halves(rd, wr, due).await
    }

    /// Accepts TCP connections until the listener fails, serving each on its own task.
    /// A connection that fails its handshake is dropped; the others go on. A failure to
    /// accept that is not the kind that passes (too many open files, a connection reset
    /// before it was accepted: paused and retried, counted in `accept_errors`) ends it,
    /// as an [`RpcError`] like every other failure of the endpoint's.
    pub async fn serve_tcp(&self, listener: TcpListener) -> Result<(), RpcError> {
        let inherited = crate::net::nodelay_inherited(&listener);
        let mut backoff = AcceptBackoff::default();
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(s) => {
                    backoff.succeeded();
                    s
                }
                Err(e) => {
                    self.accept_failed(&mut backoff, e).await?;
                    continue;
                }
            };
            if !inherited {
                let _ = stream.set_nodelay(true);
            }
            crate::net::set_send_buffer(&stream, peer, self.inner.config.tcp_send_buffer);
            self.hand_off(stream).await;
        }
    }

    /// Serves an accepted connection on a task of its own, and lets that task run first: it
    /// reads the `Hello` (and what came with it) and answers while the next accept waits.
    async fn hand_off<S>(&self, stream: S)
    where
        S: crate::net::Splits + Send + 'static,
    {
        let this = self.clone();
        tokio::spawn(async move {
            let (rd, wr, due) = crate::net::eager_halves(stream);
            if let Err(e) = this.serve_halves(rd, wr, due).await {
                tracing::debug!(%e, "handshake failed");
            }
        });
        tokio::task::yield_now().await;
    }

    /// Connects over a Unix domain socket.
    #[cfg(unix)]
    pub async fn connect_unix(&self, path: impl AsRef<std::path::Path>) -> Result<Peer, RpcError> {
        let stream = tokio::net::UnixStream::connect(path).await?;
        let (rd, wr, due) = crate::net::eager_halves(stream);
        self.connect_halves(rd, wr, due).await
    }

    /// Accepts Unix domain socket connections until the listener fails (as
    /// [`serve_tcp`](Self::serve_tcp)).
    #[cfg(unix)]
    pub async fn serve_unix(&self, listener: tokio::net::UnixListener) -> Result<(), RpcError> {
        let mut backoff = AcceptBackoff::default();
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(s) => {
                    backoff.succeeded();
                    s
                }
                Err(e) => {
                    self.accept_failed(&mut backoff, e).await?;
                    continue;
                }
            };
            self.hand_off(stream).await;
        }
    }

    /// A listener's accept failed: counts it, and returns the error if it is the
    /// listener's own, else waits as long as `backoff` says before the next accept.
    pub(crate) async fn accept_failed(
        &self,
        backoff: &mut AcceptBackoff,
        e: io::Error,
    ) -> Result<(), RpcError> {
        self.inner
            .totals
            .refusals()
            .accept_errors
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pause = backoff
            .failed(e)
            .map_err(|e| RpcError::disconnected(format!("the listener failed: {e}")))?;
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        Ok(())
    }

    /// The endpoint's counters and bounds over all its connections.
    #[cfg(feature = "websocket")]
    pub(crate) fn totals(&self) -> &peer::Totals {
        &self.inner.totals
    }

    #[cfg(any(feature = "tls", feature = "websocket"))]
    pub(crate) fn config_ref(&self) -> &Config {
        &self.inner.config
    }

    /// The compressions this endpoint decodes.
    pub fn decodes(&self) -> CompressionSet {
        self.inner.config.decodes
    }
}

/// An accept error that concerns one connection (reset before it was accepted...): the
/// next accept may go at once.
fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    )
}

/// An accept error that says the process or the system is out of something (file
/// descriptors, socket buffers, memory) that only time gives back: accepting again at once
/// would fail the same way, in a loop that takes a core.
fn is_exhaustion(e: &io::Error) -> bool {
    #[cfg(unix)]
    {
        e.raw_os_error()
            .is_some_and(|c| [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::ENOMEM].contains(&c))
    }
    #[cfg(not(unix))]
    {
        // WSAEMFILE, WSAENOBUFS.
        e.raw_os_error().is_some_and(|c| c == 10024 || c == 10055)
    }
}

/// How long an accept loop waits after a failed accept: nothing after a transient one;
/// after running out of file descriptors (and the like) [`MIN`](Self::MIN), doubling at
/// each failure in a row up to [`MAX`](Self::MAX), and back to nothing after an accept
/// that succeeds. It logs at most one warning per pause, with the failures since the last.
#[derive(Debug, Default)]
pub(crate) struct AcceptBackoff {
    /// The last pause; zero when the last accept succeeded.
    pause: std::time::Duration,
    /// Failures not yet in a warning.
    unlogged: u64,
}

impl AcceptBackoff {
    /// The first pause.
    pub(crate) const MIN: std::time::Duration = std::time::Duration::from_millis(10);
    /// The longest pause: what a listener that ran out of descriptors takes at worst to
    /// notice that some are free again.
    pub(crate) const MAX: std::time::Duration = std::time::Duration::from_secs(1);

    pub(crate) fn succeeded(&mut self) {
        self.pause = std::time::Duration::ZERO;
    }

    /// The pause before the next accept after `e`, or `e` itself when it is the
    /// listener's own failure (the loop ends with it).
    pub(crate) fn failed(&mut self, e: io::Error) -> io::Result<std::time::Duration> {
        self.unlogged += 1;
        if is_transient(&e) {
            tracing::debug!(%e, "accept failed");
            return Ok(std::time::Duration::ZERO);
        }
        if !is_exhaustion(&e) {
            return Err(e);
        }
        self.pause = (self.pause * 2).clamp(Self::MIN, Self::MAX);
        tracing::warn!(
            %e,
            failures = std::mem::take(&mut self.unlogged),
            pause = ?self.pause,
            "accept failed: pausing before the next accept"
        );
        Ok(self.pause)
    }
}

async fn write_frame<W: AsyncWrite + Unpin>(
    wr: &mut W,
    kind: Kind,
    payload: &[u8],
) -> Result<(), RpcError> {
    wr.write_all(&frame(kind, payload)).await?;
    wr.flush().await?;
    Ok(())
}

/// A handshake frame's bytes: uncompressed, call id and method id 0.
fn frame(kind: Kind, payload: &[u8]) -> Vec<u8> {
    let Out::Frame { head, head_len, .. } =
        peer::encode(kind, Compression::None, false, 0, 0, Bytes::new().into())
    else {
        unreachable!("encode returns a frame")
    };
    // The length field is the last 4 bytes of the envelope.
    let mut head = head;
    let n = head_len as usize;
    head[n - 4..n].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    let mut frame = Vec::with_capacity(n + payload.len());
    frame.extend_from_slice(&head[..n]);
    frame.extend_from_slice(payload);
    frame
}

/// Reads one handshake frame; bytes after it stay in `buf` for the connection's reader.
async fn read_frame<R: AsyncRead + Unpin>(
    rd: &mut R,
    buf: &mut BytesMut,
) -> Result<(Header, Bytes), RpcError> {
    let max = (handshake::FIXED_LEN + handshake::MAX_TOKEN_LEN) as u32;
    loop {
        if let Some((h, head_len)) =
            Header::decode(buf, max).map_err(|e| RpcError::protocol(e.to_string()))?
        {
            let total = head_len + h.len as usize;
            if buf.len() >= total {
                let mut frame = buf.split_to(total);
                frame.advance(head_len);
                if h.compression != Compression::None {
                    return Err(RpcError::protocol("compressed handshake frame"));
                }
                return Ok((h, frame.freeze()));
            }
        }
        if rd.read_buf(buf).await? == 0 {
            return Err(RpcError::disconnected("closed during the handshake"));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use parking_lot::Mutex;

    use super::*;

    /// The server's side of a duplex pipe, which keeps a copy of every write it takes.
    struct Recorded {
        inner: tokio::io::DuplexStream,
        writes: Arc<Mutex<Vec<Vec<u8>>>>,
    }

    impl AsyncRead for Recorded {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for Recorded {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let n = std::task::ready!(Pin::new(&mut self.inner).poll_write(cx, buf))?;
            self.writes.lock().push(buf[..n].to_vec());
            Poll::Ready(Ok(n))
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_flush(cx)
        }

        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_shutdown(cx)
        }
    }

    /// The accepting side answers the calls that came with the `Hello` (zero-RTT) in the
    /// same write as its `HelloAck`: the connecting side reads them all at once.
    #[tokio::test]
    async fn the_hello_ack_and_the_answers_to_early_calls_go_out_in_one_write() {
        let server = Endpoint::builder().build();
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let writes = Arc::new(Mutex::new(Vec::new()));
        let io = Recorded {
            inner: server_io,
            writes: writes.clone(),
        };
        let served = tokio::spawn(async move { server.serve_accepted(io).await });

        // A `Hello` and a call to a method the server does not have, in one write: the
        // server answers the call inline, with an error.
        let hello = Endpoint::builder().build().hello("");
        let mut sent = frame(Kind::Hello, &hello.encode());
        let Out::Frame {
            head,
            head_len,
            payload,
        } = peer::encode(
            Kind::Call,
            Compression::None,
            false,
            1,
            12345,
            Bytes::new().into(),
        )
        else {
            unreachable!("encode returns a frame")
        };
        sent.extend_from_slice(&head[..head_len as usize]);
        for part in payload.parts() {
            sent.extend_from_slice(part);
        }
        let (mut rd, mut wr) = tokio::io::split(client_io);
        wr.write_all(&sent).await.unwrap();

        let mut got = BytesMut::new();
        let mut kinds = Vec::new();
        while kinds.len() < 2 {
            assert!(rd.read_buf(&mut got).await.unwrap() > 0, "closed early");
            while let Some((h, head_len)) = Header::decode(&got, 1 << 20).unwrap() {
                let total = head_len + h.len as usize;
                if got.len() < total {
                    break;
                }
                got.advance(total);
                kinds.push((h.kind, h.call_id));
            }
        }
        assert_eq!(kinds, [(Kind::HelloAck, 0), (Kind::Error, 1)]);
        let writes = writes.lock().clone();
        assert_eq!(writes.len(), 1, "one write for both frames: {writes:?}");
        drop((rd, wr));
        served.await.unwrap().unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn accepts_out_of_descriptors_pause_doubling_to_a_second_and_start_over_after_a_success() {
        use std::time::Duration;
        let emfile = || io::Error::from_raw_os_error(libc::EMFILE);
        let mut backoff = AcceptBackoff::default();
        let pauses: Vec<_> = (0..9).map(|_| backoff.failed(emfile()).unwrap()).collect();
        let ms = |n| Duration::from_millis(n);
        assert_eq!(
            pauses,
            [10, 20, 40, 80, 160, 320, 640, 1000, 1000].map(ms),
            "from 10 ms doubling, at most 1 s"
        );
        // A connection reset before its accept: the next accept goes at once.
        let reset = io::Error::from(io::ErrorKind::ConnectionAborted);
        assert_eq!(backoff.failed(reset).unwrap(), Duration::ZERO);
        assert_eq!(backoff.failed(emfile()).unwrap(), ms(1000));
        backoff.succeeded();
        let enfile = io::Error::from_raw_os_error(libc::ENFILE);
        assert_eq!(backoff.failed(enfile).unwrap(), ms(10), "after a success");
        // The listener's own failure ends the loop.
        let bad = io::Error::from_raw_os_error(libc::EBADF);
        assert_eq!(
            backoff.failed(bad).unwrap_err().raw_os_error(),
            Some(libc::EBADF)
        );
    }
}
