//! WebSocket transport: the protocol's byte stream carried in binary messages, so that an
//! existing axum app can serve it on a route and browsers can reach it. Message boundaries
//! carry no meaning; the frames inside are the same as on TCP.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use axum::extract::ws::{Message as AxumMessage, WebSocket, WebSocketUpgrade};
use bytes::{Buf, Bytes};
use futures::{Sink, SinkExt, Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_tungstenite::tungstenite::Message as WsMessage;

use crate::config::Trust;
use crate::endpoint::Endpoint;
use crate::error::RpcError;
use crate::peer::Peer;

/// Writes are cut into messages of at most this size, well under every WebSocket
/// implementation's default frame limit, whatever the RPC message limit is.
const MAX_WS_MESSAGE: usize = 1 << 20;

/// Turns a stream + sink of binary messages into a byte stream.
struct MessageIo<S> {
    inner: S,
    pending: Bytes,
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
        ready!(self.inner.poll_ready_unpin(cx))?;
        let n = buf.len().min(MAX_WS_MESSAGE);
        self.inner
            .start_send_unpin(Bytes::copy_from_slice(&buf[..n]))?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.inner.poll_flush_unpin(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.inner.poll_close_unpin(cx)
    }
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "the WebSocket was closed")
}

impl Endpoint {
    /// Accepts a connection on an upgraded axum WebSocket: [`Trust::Untrusted`] unless
    /// [`Config::trust`](crate::Config::trust) says otherwise.
    pub async fn accept_websocket(&self, socket: WebSocket) -> Result<Peer, RpcError> {
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
        self.accept_by(
            MessageIo {
                inner: Box::pin(io),
                pending: Bytes::new(),
            },
            Trust::Untrusted,
        )
        .await
    }

    /// An axum handler that upgrades the request and serves the connection:
    /// `Router::new().route("/rpc", get(endpoint.websocket_handler()))`.
    pub fn websocket_handler(
        &self,
    ) -> impl Fn(WebSocketUpgrade) -> std::future::Ready<axum::response::Response> + Clone + Send + 'static
    {
        let this = self.clone();
        move |ws: WebSocketUpgrade| {
            let this = this.clone();
            std::future::ready(ws.on_upgrade(move |socket| async move {
                if let Err(e) = this.accept_websocket(socket).await {
                    tracing::debug!(%e, "WebSocket handshake failed");
                }
            }))
        }
    }

    /// Connects to a `ws://` URL served by [`websocket_handler`](Self::websocket_handler).
    pub async fn connect_websocket(&self, url: &str) -> Result<Peer, RpcError> {
        let timeout = self.config_ref().handshake_timeout;
        let (ws, _) = tokio::time::timeout(timeout, tokio_tungstenite::connect_async(url))
            .await
            .map_err(|_| RpcError::disconnected("WebSocket connect timed out"))?
            .map_err(|e| RpcError::disconnected(format!("WebSocket connect failed: {e}")))?;
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
        self.connect(MessageIo {
            inner: Box::pin(io),
            pending: Bytes::new(),
        })
        .await
    }
}
