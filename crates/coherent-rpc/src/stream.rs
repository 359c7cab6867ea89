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
use crate::frame::{BatchItems, Kind};
use crate::peer::Shared;

/// What the connection's reader hands a stream's consumer.
pub(crate) enum Event {
    /// One item (a `StreamItem` payload).
    Item(Bytes),
    /// Several items (a `StreamBatch` payload, checked by the reader).
    Batch(Bytes),
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
    /// The batch being consumed and the offset of its next item.
    batch: Bytes,
    at: usize,
    buffered: Arc<AtomicU32>,
    unacked: u32,
    done: bool,
    /// The receiving end of an upload (the callee's), not of an answer stream.
    upload: bool,
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
            batch: Bytes::new(),
            at: 0,
            buffered,
            unacked: 0,
            done: false,
            upload: false,
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
            if this.at < this.batch.len() {
                let mut items = BatchItems::new(&this.batch[this.at..]);
                let Some(Ok(item)) = items.next() else {
                    // The reader checked the batch; this is only a second line of defence.
                    this.done = true;
                    return Poll::Ready(Some(Err(RpcError::protocol("malformed stream batch"))));
                };
                let end = this.batch.len() - items.remaining().len();
                let range = end - item.len()..end;
                this.at = end;
                let format = this.shared.settings.format;
                let decoded = crate::blob::decode_in(&mut this.batch, range, |b| format.decode(b));
                this.consumed();
                return Poll::Ready(Some(decoded));
            }
            match this.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Event::Item(bytes))) => {
                    let decoded = this.shared.settings.format.decode_bytes(bytes);
                    this.consumed();
                    return Poll::Ready(Some(decoded));
                }
                Poll::Ready(Some(Event::Batch(batch))) => {
                    this.batch = batch;
                    this.at = 0;
                }
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

impl<T> ClientStream<T> {
    /// Counts one consumed item and returns credits at half the window, so the producer
    /// keeps sending while the ack travels.
    fn consumed(&mut self) {
        self.unacked += 1;
        if self.unacked >= self.shared.settings.local_window.div_ceil(2) {
            let n = std::mem::take(&mut self.unacked);
            // Released before the credits go out: the producer can then send `n` more
            // without the reader seeing more than the window buffered.
            self.buffered.fetch_sub(n, Ordering::Relaxed);
            let _ = self.shared.send_stream(
                Kind::StreamAck,
                self.upload,
                self.id,
                Bytes::copy_from_slice(&n.to_le_bytes()),
            );
        }
    }
}

impl<T> Drop for ClientStream<T> {
    fn drop(&mut self) {
        // An answer stream dropped early cancels its call; an upload's receiver dropped
        // early only stops reading (the handler's answer ends the call).
        if !self.done && !self.upload {
            self.shared.forget_call(self.id, true);
        }
    }
}

/// The stream a caller uploads, as the handler of a method that takes it reads it: items in
/// order, then `None` at the upload's end (an `Err` item if the connection closed first).
/// Credits go back as items are consumed, so the caller never runs more than the window
/// ahead.
pub struct Upload<T>(ClientStream<T>);

impl<T> Upload<T> {
    pub(crate) fn new(
        shared: Arc<Shared>,
        id: u64,
        rx: mpsc::UnboundedReceiver<Event>,
        buffered: Arc<AtomicU32>,
    ) -> Self {
        let mut stream = ClientStream::new(shared, id, rx, buffered);
        stream.upload = true;
        Self(stream)
    }
}

impl<T: DeserializeOwned> Stream for Upload<T> {
    type Item = Result<T, RpcError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.0).poll_next(cx)
    }
}
