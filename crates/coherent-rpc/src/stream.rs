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

/// What the connection's reader hands a stream's consumer.
pub(crate) enum Event {
    /// Items, in order (all those that arrived in one read).
    Items(Vec<Bytes>),
    /// The producer's normal end.
    End,
    /// The stream failed (an `Error` frame, or the connection closed).
    Failed(RpcError),
}

/// Items of a streaming call, in order, then `None` at its end. An `Err` item is the
/// last one.
pub struct ClientStream<T> {
    shared: Arc<Shared>,
    id: u64,
    rx: mpsc::UnboundedReceiver<Event>,
    ready: std::vec::IntoIter<Bytes>,
    buffered: Arc<AtomicU32>,
    unacked: u32,
    done: bool,
    _item: PhantomData<fn() -> T>,
}

impl<T> ClientStream<T> {
    pub(crate) fn new(
        shared: Arc<Shared>,
        id: u64,
        rx: mpsc::UnboundedReceiver<Event>,
        buffered: Arc<AtomicU32>,
    ) -> Self {
        Self {
            shared,
            id,
            rx,
            ready: Vec::new().into_iter(),
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
        loop {
            if let Some(bytes) = this.ready.next() {
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
                return Poll::Ready(Some(this.shared.settings.format.decode(&bytes)));
            }
            match this.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Event::Items(items))) => this.ready = items.into_iter(),
                Poll::Ready(Some(Event::End)) => {
                    this.done = true;
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Event::Failed(e))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(RpcError::disconnected("connection closed"))));
                }
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
