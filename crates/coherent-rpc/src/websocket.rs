//! WebSocket transport: the protocol's byte stream carried in binary messages, so that an
//! existing axum app can serve it on a route and browsers can reach it. Message boundaries
//! carry no meaning; the frames inside are the same as on TCP.
//!
//! What an upgrade is checked for (the browser's `Origin`, [`origin_refusal`]) and the
//! largest message it takes ([`max_ws_message`]) are decided here, before the upgrade.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use axum::extract::ws::{Message as AxumMessage, WebSocket, WebSocketUpgrade};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::IntoResponse;
use axum::Extension;
use bytes::{Buf, Bytes};
use futures::{Sink, SinkExt, Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_tungstenite::tungstenite::Message as WsMessage;

use crate::config::{Config, Origins, Trust};
use crate::endpoint::Endpoint;
use crate::error::RpcError;
use crate::pace::Pacer;
use crate::peer::Peer;

/// Writes are cut into messages of at most this size, well under every WebSocket
/// implementation's default frame limit, whatever the RPC message limit is.
const MAX_WS_MESSAGE: usize = 1 << 20;

/// The largest WebSocket message (and frame) an accepting endpoint takes: what an honest
/// peer sends, no more. This crate's side cuts its writes at [`MAX_WS_MESSAGE`]; the
/// TypeScript client sends a frame over 64 KiB as one message of its own, so one frame of
/// the endpoint's largest message, with its header, must fit. axum's default (64 MiB)
/// would let a peer make the server buffer 16 times the default message limit before the
/// protocol's own limit sees a byte.
fn max_ws_message(config: &Config) -> usize {
    MAX_WS_MESSAGE.max(config.max_message_size as usize + crate::frame::MAX_HEADER_LEN)
}

/// The read buffer of an accepted WebSocket: a larger message reserves its own length as it
/// arrives. tungstenite's default (128 KiB) is allocated per connection, and its read
/// position walks through the whole of it before it starts over, so an idle tab held
/// 128 KiB of the server's memory (issue 32: 168 KB per connected board, measured by the
/// `hostile` suite's `server_bytes_per_client`). Each read of the socket takes at most this
/// much: a browser's frames (calls, acknowledgements) are far smaller.
const WEBSOCKET_READ_BUFFER: usize = 2 * 1024;

/// How much an accepted WebSocket's writes gather before they go to the socket: none, since
/// the endpoint's writer already batches frames into one message per write.
const WEBSOCKET_WRITE_BUFFER: usize = 0;

/// Why an upgrade request from a web page may not open a WebSocket, or `None` when it may:
/// no `Origin` (not a browser), the request's own origin, or one `allowed` lists.
fn origin_refusal(allowed: &Origins, headers: &HeaderMap, uri: &Uri) -> Option<String> {
    let origin = headers.get(header::ORIGIN)?;
    if *allowed == Origins::Any {
        return None;
    }
    let Ok(origin) = origin.to_str() else {
        return Some("the Origin header is not text".into());
    };
    let origin = crate::config::normalize_origin(origin);
    if let Origins::Listed(list) = allowed {
        if list.contains(&origin) {
            return None;
        }
    }
    // HTTP/2 carries the host in the request's authority instead of a `Host` header.
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_owned)
        .or_else(|| uri.authority().map(|a| a.to_string()));
    if host.is_some_and(|h| same_origin(&origin, &h.trim().to_ascii_lowercase())) {
        return None;
    }
    let shown: String = origin.chars().take(200).collect();
    Some(format!(
        "cross-origin WebSocket upgrade refused: the origin {shown} is not allowed"
    ))
}

/// Whether `origin` (`scheme://host[:port]`, lowercase) names the server at `host`
/// (a `Host` header, lowercase), the scheme's default port written or not.
fn same_origin(origin: &str, host: &str) -> bool {
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false;
    };
    let Some(default_port) = crate::config::default_port(scheme) else {
        return false;
    };
    let bare = |a: &str| a.strip_suffix(default_port).unwrap_or(a).to_owned();
    bare(authority) == bare(host)
}

/// Turns a stream + sink of binary messages into a byte stream.
struct MessageIo<S> {
    inner: S,
    pending: Bytes,
    /// The sink failed once: it is not polled again. `sink_map_err` maps one error with a
    /// `FnOnce` and panics ("polled MapErr after completion") at a second, which a flush
    /// or a shutdown after a failed write would reach.
    failed: bool,
}

impl<S> MessageIo<S> {
    fn new(inner: S) -> Self {
        Self {
            inner,
            pending: Bytes::new(),
            failed: false,
        }
    }

    /// `result` of polling the sink, remembering a failure.
    fn sink<T>(&mut self, result: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if let Poll::Ready(Err(_)) = &result {
            self.failed = true;
        }
        result
    }

    fn failed_before() -> io::Error {
        io::Error::new(
            io::ErrorKind::BrokenPipe,
            "the WebSocket failed on an earlier write",
        )
    }
}

impl<S> AsyncRead for MessageIo<S>
where
    S: Stream<Item = io::Result<Bytes>> + Unpin,
{
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            if !self.pending.is_empty() {
                let n = self.pending.len().min(buf.remaining());
                buf.put_slice(&self.pending[..n]);
                self.pending.advance(n);
                return Poll::Ready(Ok(()));
            }
            match ready!(self.inner.poll_next_unpin(cx)) {
                Some(Ok(b)) => self.pending = b,
                Some(Err(e)) => return Poll::Ready(Err(e)),
                None => return Poll::Ready(Ok(())),
            }
        }
    }
}

impl<S> AsyncWrite for MessageIo<S>
where
    S: Sink<Bytes, Error = io::Error> + Unpin,
{
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.failed {
            return Poll::Ready(Err(Self::failed_before()));
        }
        let ready = self.inner.poll_ready_unpin(cx);
        ready!(self.sink(ready))?;
        let n = buf.len().min(MAX_WS_MESSAGE);
        let sent = self
            .inner
            .start_send_unpin(Bytes::copy_from_slice(&buf[..n]));
        ready!(self.sink(Poll::Ready(sent)))?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.failed {
            return Poll::Ready(Err(Self::failed_before()));
        }
        let flushed = self.inner.poll_flush_unpin(cx);
        self.sink(flushed)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.failed {
            return Poll::Ready(Ok(()));
        }
        let closed = self.inner.poll_close_unpin(cx);
        self.sink(closed)
    }
}

/// The upgrade request to `url`, with `headers`.
fn websocket_request(
    url: &str,
    headers: &[(&str, &str)],
) -> Result<tokio_tungstenite::tungstenite::handshake::client::Request, RpcError> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let bad = |e: &dyn std::fmt::Display| RpcError::disconnected(format!("WebSocket request: {e}"));
    let mut request = url.into_client_request().map_err(|e| bad(&e))?;
    for (name, value) in headers {
        let name = axum::http::HeaderName::from_bytes(name.as_bytes()).map_err(|e| bad(&e))?;
        let value = axum::http::HeaderValue::from_str(value).map_err(|e| bad(&e))?;
        request.headers_mut().append(name, value);
    }
    Ok(request)
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "the WebSocket was closed")
}

impl Endpoint {
    /// Accepts a connection on an upgraded axum WebSocket: [`Trust::Untrusted`] unless
    /// [`Config::trust`](crate::Config::trust) says otherwise.
    pub async fn accept_websocket(&self, socket: WebSocket) -> Result<Peer, RpcError> {
        self.accept_websocket_from(socket, &HeaderMap::new()).await
    }

    /// [`accept_websocket`](Self::accept_websocket), giving the authentication hook
    /// ([`EndpointBuilder::authenticate_with`](crate::EndpointBuilder::authenticate_with))
    /// the upgrade request's `headers` (a browser's cookies).
    pub async fn accept_websocket_from(
        &self,
        socket: WebSocket,
        headers: &HeaderMap,
    ) -> Result<Peer, RpcError> {
        self.accept_websocket_paced(socket, headers, None).await
    }

    /// [`accept_websocket_from`](Self::accept_websocket_from), holding the connection's
    /// calls (if it is untrusted) to `address`'s rate as well as to its own
    /// ([`Config::untrusted_call_rate`](crate::Config::untrusted_call_rate)): give every
    /// connection of one IP address the same [`Pacer`], and what they start together is
    /// bounded, however many there are.
    pub async fn accept_websocket_paced(
        &self,
        socket: WebSocket,
        headers: &HeaderMap,
        address: Option<Pacer>,
    ) -> Result<Peer, RpcError> {
        let headers: Vec<(String, String)> = headers
            .iter()
            .filter_map(|(n, v)| Some((n.as_str().to_owned(), v.to_str().ok()?.to_owned())))
            .collect();
        let io = socket
            .map(|m| match m {
                Ok(AxumMessage::Binary(b)) => Some(Ok(b)),
                Ok(AxumMessage::Close(_)) => Some(Err(closed())),
                Ok(_) => None,
                Err(e) => Some(Err(io::Error::other(e))),
            })
            .filter_map(std::future::ready)
            .sink_map_err(io::Error::other)
            .with(|b: Bytes| std::future::ready(Ok::<_, io::Error>(AxumMessage::Binary(b))));
        self.accept_with(
            MessageIo::new(Box::pin(io)),
            Trust::Untrusted,
            headers,
            address,
        )
        .await
    }

    /// An axum handler that upgrades the request and serves the connection:
    /// `Router::new().route("/rpc", get(endpoint.websocket_handler()))`.
    ///
    /// A request from a web page of another origin than the endpoint's own, and not in
    /// [`Config::allowed_origins`], is answered HTTP 403 with the reason in plain text.
    /// A WebSocket message larger than the endpoint's
    /// [`max_message_size`](Config::max_message_size) (plus a frame's header, and at least
    /// 1 MiB) closes the connection instead of being buffered.
    ///
    /// A [`Pacer`] in the request's extensions (put there by the HTTP server, one per
    /// client address) is the rate the connection shares with the others of its address
    /// (see [`accept_websocket_paced`](Self::accept_websocket_paced)).
    #[allow(clippy::type_complexity)]
    pub fn websocket_handler(
        &self,
    ) -> impl Fn(
        HeaderMap,
        Uri,
        Option<Extension<Pacer>>,
        WebSocketUpgrade,
    ) -> std::future::Ready<axum::response::Response>
           + Clone
           + Send
           + 'static {
        let this = self.clone();
        move |headers: HeaderMap,
              uri: Uri,
              pacer: Option<Extension<Pacer>>,
              ws: WebSocketUpgrade| {
            let config = this.config_ref();
            if let Some(reason) = origin_refusal(&config.allowed_origins, &headers, &uri) {
                this.totals()
                    .refusals()
                    .origins_refused
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::debug!(%reason, "WebSocket upgrade refused");
                return std::future::ready((StatusCode::FORBIDDEN, reason).into_response());
            }
            let max = max_ws_message(config);
            let this = this.clone();
            let ws = ws
                .read_buffer_size(WEBSOCKET_READ_BUFFER)
                .write_buffer_size(WEBSOCKET_WRITE_BUFFER);
            std::future::ready(ws.max_message_size(max).max_frame_size(max).on_upgrade(
                move |socket| async move {
                    let pacer = pacer.map(|Extension(p)| p);
                    if let Err(e) = this.accept_websocket_paced(socket, &headers, pacer).await {
                        tracing::debug!(%e, "WebSocket handshake failed");
                    }
                },
            ))
        }
    }

    /// Connects to a `ws://` URL served by [`websocket_handler`](Self::websocket_handler).
    pub async fn connect_websocket(&self, url: &str) -> Result<Peer, RpcError> {
        self.connect_websocket_with_headers(url, &[]).await
    }

    /// [`connect_websocket`](Self::connect_websocket), sending `headers` with the upgrade
    /// request: a cookie or an `Authorization` header for a server whose authentication
    /// hook reads them, an `Origin` for one that checks it.
    pub async fn connect_websocket_with_headers(
        &self,
        url: &str,
        headers: &[(&str, &str)],
    ) -> Result<Peer, RpcError> {
        let request = websocket_request(url, headers)?;
        let timeout = self.config_ref().handshake_timeout;
        let (ws, _) = tokio::time::timeout(timeout, tokio_tungstenite::connect_async(request))
            .await
            .map_err(|_| RpcError::disconnected("WebSocket connect timed out"))?
            .map_err(|e| RpcError::disconnected(format!("WebSocket connect failed: {e}")))?;
        self.connect_upgraded(ws).await
    }

    /// [`connect_websocket_with_headers`](Self::connect_websocket_with_headers) over a
    /// stream already connected to the server of `url` (a socket bound to a chosen
    /// source address, or with options of its own; a tunnel). `ws://` only: a `wss://`
    /// URL needs the TLS on `stream` already, which this does not add.
    pub async fn connect_websocket_over<S>(
        &self,
        stream: S,
        url: &str,
        headers: &[(&str, &str)],
    ) -> Result<Peer, RpcError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let request = websocket_request(url, headers)?;
        let timeout = self.config_ref().handshake_timeout;
        let (ws, _) =
            tokio::time::timeout(timeout, tokio_tungstenite::client_async(request, stream))
                .await
                .map_err(|_| RpcError::disconnected("WebSocket connect timed out"))?
                .map_err(|e| RpcError::disconnected(format!("WebSocket connect failed: {e}")))?;
        self.connect_upgraded(ws).await
    }

    /// Connects over an upgraded client WebSocket.
    async fn connect_upgraded<S>(
        &self,
        ws: tokio_tungstenite::WebSocketStream<S>,
    ) -> Result<Peer, RpcError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let io = ws
            .map(|m| match m {
                Ok(WsMessage::Binary(b)) => Some(Ok(b)),
                Ok(WsMessage::Close(_)) => Some(Err(closed())),
                Ok(_) => None,
                Err(e) => Some(Err(io::Error::other(e))),
            })
            .filter_map(std::future::ready)
            .sink_map_err(io::Error::other)
            .with(|b: Bytes| std::future::ready(Ok::<_, io::Error>(WsMessage::Binary(b))));
        self.connect(MessageIo::new(Box::pin(io))).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sink that fails every poll, behind `sink_map_err` as the transports have it: a
    /// write, then a flush and a shutdown after its failure, answer errors, not a panic.
    #[tokio::test]
    async fn a_failed_sink_is_not_polled_again() {
        use tokio::io::AsyncWriteExt;
        struct Broken;
        impl Sink<Bytes> for Broken {
            type Error = &'static str;
            fn poll_ready(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Result<(), Self::Error>> {
                Poll::Ready(Err("broken"))
            }
            fn start_send(self: Pin<&mut Self>, _: Bytes) -> Result<(), Self::Error> {
                Err("broken")
            }
            fn poll_flush(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Result<(), Self::Error>> {
                Poll::Ready(Err("broken"))
            }
            fn poll_close(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Result<(), Self::Error>> {
                Poll::Ready(Err("broken"))
            }
        }
        let mut io = MessageIo::new(Box::pin(Broken.sink_map_err(io::Error::other)));
        assert!(io.write_all(b"frame").await.is_err());
        assert_eq!(
            io.flush().await.unwrap_err().kind(),
            io::ErrorKind::BrokenPipe
        );
        assert!(io.write_all(b"again").await.is_err());
        assert!(io.shutdown().await.is_ok());
    }

    fn refusal(allowed: &Origins, origin: Option<&str>, host: &str) -> Option<String> {
        let mut headers = HeaderMap::new();
        if let Some(o) = origin {
            headers.insert(header::ORIGIN, o.parse().unwrap());
        }
        headers.insert(header::HOST, host.parse().unwrap());
        origin_refusal(allowed, &headers, &Uri::from_static("/rpc"))
    }

    #[test]
    fn the_same_origin_and_no_origin_are_allowed_and_another_is_not() {
        let same = Origins::SameOrigin;
        assert_eq!(refusal(&same, None, "a.example"), None);
        assert_eq!(refusal(&same, Some("https://a.example"), "a.example"), None);
        assert_eq!(
            refusal(&same, Some("https://A.example/"), "a.example:443"),
            None
        );
        assert_eq!(
            refusal(&same, Some("http://127.0.0.1:8080"), "127.0.0.1:8080"),
            None
        );
        assert!(refusal(&same, Some("http://127.0.0.1:8081"), "127.0.0.1:8080").is_some());
        assert!(refusal(&same, Some("https://evil.example"), "a.example").is_some());
        assert!(refusal(&same, Some("null"), "a.example").is_some());
        let listed = Origins::Listed(vec!["https://app.example".into()]);
        assert_eq!(
            refusal(&listed, Some("https://app.example"), "api.example"),
            None
        );
        assert_eq!(
            refusal(&listed, Some("https://api.example"), "api.example"),
            None
        );
        assert!(refusal(&listed, Some("http://app.example"), "api.example").is_some());
        assert_eq!(refusal(&Origins::Any, Some("null"), "a.example"), None);
    }

    #[test]
    fn a_listed_origin_with_its_default_port_matches_what_browsers_send() {
        let listed = match crate::Config::default()
            .allowed_origins([
                "https://App.example:443/",
                "http://b.example:80",
                "https://c.example:8443",
            ])
            .allowed_origins
        {
            Origins::Listed(l) => l,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            listed,
            [
                "https://app.example",
                "http://b.example",
                "https://c.example:8443"
            ]
        );
        let listed = Origins::Listed(listed);
        for origin in [
            "https://app.example",
            "http://b.example",
            "https://c.example:8443",
        ] {
            assert_eq!(
                refusal(&listed, Some(origin), "api.example"),
                None,
                "{origin}"
            );
        }
        // The default port is the scheme's own: not a port of another scheme's.
        assert!(refusal(&listed, Some("https://b.example"), "api.example").is_some());
        assert!(refusal(&listed, Some("https://c.example"), "api.example").is_some());
        assert_eq!(
            crate::config::normalize_origin("https://:443"),
            "https://:443"
        );
    }
}
