//! Sending a stream under flow control: [`pump`] sends an answer stream's items (for a
//! streaming handler: [`produce`]) or this side's upload under the receiver's credits, and
//! [`Batch`] encodes the items that are ready together into one `StreamBatch` payload
//! (each after its varint length; at most `STREAM_BATCH` or the receiver's limit; a lone
//! item goes as a `StreamItem`).
//!
//! Invariants: never more items than the credits taken ([`take_credits`]), and none while
//! the connection's queue is over its mark (as for the reader's new calls); what is
//! batched goes out before waiting for credits, before an error and before the stream's
//! end (which the caller sends). A stream's first batch reserves what the connection's
//! last stream needed (`Shared::stream_batch`).

use std::sync::atomic::Ordering;

use bytes::{Buf, Bytes};

use tokio::sync::Semaphore;

use crate::error::{ErrorCode, RpcError};
use crate::frame::Kind;

use super::writer::wait_for_room;
use super::Shared;

/// Pulls a streaming handler's items under flow control and sends them in batches: the
/// items that are ready together, up to `STREAM_BATCH` bytes, go out as one `StreamBatch`
/// (a lone item as a `StreamItem`), encoded straight into the frame's payload.
pub(super) async fn produce(
    s: &Shared,
    id: u64,
    fut: crate::service::BoxFuture<Result<crate::service::ItemStream, RpcError>>,
    credits: &Semaphore,
) -> Result<(), RpcError> {
    let mut items = fut.await?;
    pump(s, id, false, &mut items, credits).await
}

/// Sends `items` as the stream of call `id` (an answer stream, or this side's upload) under
/// `credits`, in batches; the caller sends the end.
pub(super) async fn pump(
    s: &Shared,
    id: u64,
    upload: bool,
    items: &mut crate::service::ItemStream,
    credits: &Semaphore,
) -> Result<(), RpcError> {
    let limit = STREAM_BATCH.min(s.remote.max.load(Ordering::Relaxed) as usize);
    let mut batch = Batch {
        buf: Vec::new(),
        count: 0,
        capacity: s.stream_batch.load(Ordering::Relaxed).min(limit + 64),
        peak: MIN_BATCH,
        limit,
        upload,
        prefix: 1,
    };
    let result = pump_batches(s, id, items, credits, &mut batch).await;
    s.stream_batch.store(batch.peak, Ordering::Relaxed);
    result
}

async fn pump_batches(
    s: &Shared,
    id: u64,
    items: &mut crate::service::ItemStream,
    credits: &Semaphore,
    batch: &mut Batch,
) -> Result<(), RpcError> {
    use std::task::{Context, Poll};
    let format = s.settings.format;
    let mut credit = 0u32;
    loop {
        if s.queued.load(Ordering::Relaxed) > s.settings.max_queued {
            // Credits say what the other side will buffer, not that it reads: one that
            // announced a huge window and acks without reading would fill the queue.
            batch.flush(s, id)?;
            wait_for_room(s).await;
        }
        if credit == 0 {
            // Out of credits: what is batched goes now, not after the consumer catches up.
            batch.flush(s, id)?;
            credit = take_credits(credits).await?;
            // With zero-RTT, an upload's first credits come with the other side's limit.
            batch.limit = STREAM_BATCH.min(s.remote.max.load(Ordering::Relaxed) as usize);
        }
        batch.reserve();
        let start = batch.buf.len();
        // Room for the item's length, as long as the last item's was: a stream's items are
        // mostly alike, and a wrong guess costs moving the item once.
        batch.buf.resize(start + batch.prefix, 0);
        // A panicking item fails the stream after the items before it went out.
        let mut poll = |cx: &mut Context<'_>| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                items.as_mut().poll_encode(cx, format, &mut batch.buf)
            }))
            .unwrap_or_else(|_| {
                Poll::Ready(Some(Err(RpcError::new(
                    ErrorCode::Internal,
                    "the handler panicked",
                ))))
            })
        };
        let polled = if batch.count == 0 {
            std::future::poll_fn(&mut poll).await
        } else {
            // Only items that are ready now join a started batch.
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            match poll(&mut cx) {
                Poll::Ready(r) => r,
                Poll::Pending => {
                    batch.buf.truncate(start);
                    batch.flush(s, id)?;
                    continue;
                }
            }
        };
        match polled {
            Some(Ok(())) => {}
            end => {
                batch.buf.truncate(start);
                // Items sent before an error arrive before it.
                batch.flush(s, id)?;
                return end.unwrap_or(Ok(()));
            }
        }
        credit -= 1;
        batch.seal(start);
        if batch.buf.len() > batch.limit && batch.count > 1 {
            // The last item does not fit: it starts the next batch, in a buffer of the
            // next batch's size.
            let mut next = Vec::with_capacity(batch.capacity.max(batch.buf.len() - start));
            next.extend_from_slice(&batch.buf[start..]);
            batch.buf.truncate(start);
            batch.count -= 1;
            batch.flush(s, id)?;
            batch.buf = next;
            batch.count = 1;
        }
        if batch.buf.len() >= batch.limit {
            batch.flush(s, id)?;
        }
    }
}

/// The largest `StreamBatch` payload a producer builds.
const STREAM_BATCH: usize = 64 * 1024;

/// The least a batch reserves.
pub(super) const MIN_BATCH: usize = 256;

/// Items of one stream waiting to be sent, each as `length (varint) · item`.
pub(super) struct Batch {
    buf: Vec<u8>,
    count: u32,
    /// What a new batch reserves: twice the last batch, within `MIN_BATCH..=limit + 64`.
    capacity: usize,
    /// The most that `capacity` was: what the connection's next stream starts with.
    peak: usize,
    limit: usize,
    /// Whether the frames are an upload's.
    upload: bool,
    /// Bytes left before each item for its length: the last item's.
    prefix: usize,
}

impl Batch {
    /// Makes room for an item's length and a small item.
    fn reserve(&mut self) {
        if self.buf.capacity() == 0 {
            self.buf = Vec::with_capacity(self.capacity);
        } else {
            self.buf.reserve(16);
        }
    }

    /// Writes the length of the item encoded after the `prefix` bytes left at `start`.
    #[inline]
    fn seal(&mut self, start: usize) {
        let len = self.buf.len() - start - self.prefix;
        if self.prefix == 1 && len < 0x80 {
            // The common case of short items: a one-byte length where one was left.
            self.buf[start] = len as u8;
            self.count += 1;
            return;
        }
        self.seal_long(start, len);
    }

    #[inline(never)]
    fn seal_long(&mut self, start: usize, len: usize) {
        let mut prefix = [0u8; 10];
        let n = crate::frame::write_varint(len as u64, &mut prefix);
        if n != self.prefix {
            // The guess was wrong (the first item of 128 bytes or more, or sizes that changed):
            // move the item to fit the length, and guess this length for the next.
            let item = start + self.prefix..start + self.prefix + len;
            if n > self.prefix {
                self.buf.resize(self.buf.len() + n - self.prefix, 0);
            }
            self.buf.copy_within(item, start + n);
            self.buf.truncate(start + n + len);
            self.prefix = n;
        }
        self.buf[start..start + n].copy_from_slice(&prefix[..n]);
        self.count += 1;
    }

    /// Sends what is batched: a lone item as `StreamItem`, more as `StreamBatch`.
    fn flush(&mut self, s: &Shared, id: u64) -> Result<(), RpcError> {
        let count = std::mem::take(&mut self.count);
        if count == 0 {
            return Ok(());
        }
        let len = self.buf.len();
        self.capacity = (len * 2).clamp(MIN_BATCH, self.limit + 64);
        self.peak = self.peak.max(self.capacity);
        let mut payload = Bytes::from(std::mem::take(&mut self.buf));
        if count == 1 {
            let (_, prefix) = crate::frame::read_varint(&payload)
                .ok()
                .flatten()
                .expect("a sealed item starts with its length");
            payload.advance(prefix);
            s.send_stream(Kind::StreamItem, self.upload, id, payload)
        } else {
            s.send_stream(Kind::StreamBatch, self.upload, id, payload)
        }
    }
}

/// Takes every credit there is, waiting for one if there are none.
async fn take_credits(credits: &Semaphore) -> Result<u32, RpcError> {
    credits
        .acquire()
        .await
        .map_err(|_| RpcError::disconnected("stream closed"))?
        .forget();
    let more = credits.available_permits() as u32;
    let more = match credits.try_acquire_many(more) {
        Ok(p) if more > 0 => {
            p.forget();
            more
        }
        _ => 0,
    };
    Ok(1 + more)
}
