//! The caller's end of a server stream: decodes items, grants the producer credits as
//! items are consumed (so it never runs more than a window ahead), and cancels the
//! stream on the callee when dropped early.

use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::Stream;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use crate::error::RpcError;
use crate::frame::Kind;
use crate::peer::Shared;

/// Items of a streaming call, in order, then `None` at its end. An `Err` item is the
/// last one.
pub struct ClientStream<T> {
    shared: Arc<Shared>,
    id: u64,
    rx: mpsc::UnboundedReceiver<Result<Option<Bytes>, RpcError>>,
    buffered: Arc<AtomicU32>,
    unacked: u32,
    done: bool,
    _item: PhantomData<fn() -> T>,
}

impl<T> ClientStream<T> {
    pub(crate) fn new(
        shared: Arc<Shared>,
        id: u64,
        rx: mpsc::UnboundedReceiver<Result<Option<Bytes>, RpcError>>,
        buffered: Arc<AtomicU32>,
    ) -> Self {
        Self {
            shared,
            id,
            rx,
            buffered,
            unacked: 0,
            done: false,
            _item: PhantomData,
        }
    }
}

impl<T: DeserializeOwned> Stream for ClientStream<T> {
    type Item = Result<T, RpcError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        let this = &mut *self;
        match this.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                this.done = true;
                Poll::Ready(Some(Err(RpcError::disconnected("connection closed"))))
            }
            Poll::Ready(Some(Ok(None))) => {
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                this.done = true;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(Some(Ok(Some(bytes)))) => {
                this.buffered.fetch_sub(1, Ordering::Relaxed);
                this.unacked += 1;
                // Ack at half the window: the producer keeps sending while the ack travels.
                let window = this.shared.settings.local_window;
                if this.unacked >= window.div_ceil(2) {
                    let n = std::mem::take(&mut this.unacked);
                    let _ = this.shared.send(
                        Kind::StreamAck,
                        this.id,
                        0,
                        Bytes::copy_from_slice(&n.to_le_bytes()),
                    );
                }
                Poll::Ready(Some(this.shared.settings.format.decode(&bytes)))
            }
        }
    }
}

impl<T> Drop for ClientStream<T> {
    fn drop(&mut self) {
        if !self.done {
            self.shared.forget_call(self.id, true);
        }
    }
}
