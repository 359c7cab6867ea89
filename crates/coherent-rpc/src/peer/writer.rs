//! How an encoded frame reaches the transport. Owns the write half ([`WriteSide`]: the
//! transport, `carry` and the accepting side's cork, under one lock), the writer task
//! ([`write_loop`], started by the first frame that needs it: [`WriterStart`]) and its
//! batching (`append`, `push`, `flush`, `write_both`), and the `Shared` methods on a
//! frame's way out: `send`/`send_lone`/`send_stream` (through `submit`, in `early`),
//! `prepare` (the other side's limit, compression), `enqueue` (a lone frame of up to
//! `DIRECT_MAX` written by its sender, anything else queued for the writer task),
//! `uncork`, and `stop` (the `Close` and the shutdown of the write half). Also the queue's
//! bound (`Settings::max_queued`, this side's own, and the endpoint's budget over all
//! connections, counted in `Totals`): `wait_for_room`, and the writer's `abandon`.
//!
//! Invariants: a sender writes its frame itself only while `backlog` (items handed to the
//! writer task and not yet written) is zero, so it never overtakes one of its own queued
//! frames; what its write left in `carry` counts in `backlog` (an `Out::Flush`) until the
//! writer task has written it, before anything else; the write half's lock is never held
//! across an await; nothing is written after the `Close`.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use parking_lot::Mutex;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::codec::{self, Message};
use crate::error::{ErrorCode, RpcError};
use crate::frame::{Compression, Header, Kind, MAX_HEADER_LEN};

use super::Shared;

/// Payload parts this large are written straight from their buffer instead of being copied
/// into the batch: copying 10 MB to save one syscall does not pay. Blobs this large are
/// parts of their own (`codec::SPLICE_FROM`).
const DIRECT_WRITE: usize = codec::SPLICE_FROM;
/// The writer stops coalescing and writes once a batch reaches this size.
pub(super) const BATCH: usize = 64 * 1024;
/// Below this, the writer yields once before writing so that callers woken by the same
/// event can add their frames to the batch (a wake-up costs more than a short wait).
const SMALL_BATCH: usize = 4 * 1024;

/// The most `WriteSide::carry` keeps once written: lone frames are mostly small.
const CARRY_KEPT: usize = 1024;
/// A `carry` up to this large is let go of once written (a larger one is kept).
const CARRY_FREED: usize = 16 * 1024;

/// An encoded frame waiting for the writer, or an order to it.
pub(crate) enum Out {
    Frame {
        head: [u8; MAX_HEADER_LEN],
        head_len: u8,
        payload: Message,
    },
    Stop(Option<Box<Out>>),
    /// Write `carry` (what a sender's own write left) and flush.
    Flush,
}

/// A connection's write half, shared by its writer task and by senders that write their
/// frame themselves.
///
/// A lone frame (a call made while no other call waits on the connection, the answer to
/// the only call in a read) is written by its sender when nothing waits for the writer:
/// handing it to the writer task would cost a task switch, and from a thread outside the
/// runtime (a caller in `block_on`, a new connection's first call) a thread wake-up, for
/// no batching in return. Everything else goes through the writer's queue, where
/// concurrent frames are coalesced into few writes. See [`Shared::enqueue`].
pub(super) struct WriteSide {
    pub(super) wr: Box<dyn AsyncWrite + Send + Unpin>,
    /// Bytes that go out before anything queued: the part of a sender's own write the
    /// transport did not take at once (the writer task writes it), or, while `corked`,
    /// the frames gathered.
    pub(super) carry: Vec<u8>,
    /// Whether lone frames are gathered in `carry` instead of written: the accepting
    /// side's `HelloAck` waits there for the answers to the calls sent right behind the
    /// `Hello`, so that the connecting side reads them all at once (one write, one wake-up,
    /// instead of one each). See [`Shared::uncork`].
    pub(super) corked: bool,
}

impl WriteSide {
    /// Writes `carry` as far as the transport takes it; ready once it is all written.
    fn poll_carry(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        while !self.carry.is_empty() {
            match std::pin::Pin::new(&mut self.wr).poll_write(cx, &self.carry) {
                std::task::Poll::Ready(Ok(0)) => {
                    return std::task::Poll::Ready(Err(io::ErrorKind::WriteZero.into()))
                }
                std::task::Poll::Ready(Ok(n)) => drop(self.carry.drain(..n)),
                std::task::Poll::Ready(Err(e)) => return std::task::Poll::Ready(Err(e)),
                std::task::Poll::Pending => return std::task::Poll::Pending,
            }
        }
        if (CARRY_KEPT + 1..=CARRY_FREED).contains(&self.carry.capacity()) {
            // A larger answer written alone (a replica's first value) would otherwise keep
            // its size here for the connection's life. Not one over `CARRY_FREED`: freeing
            // that at every answer may make glibc give memory back to the kernel each time
            // (see `write_batches`), and a connection that answers such values keeps
            // needing the room.
            self.carry = Vec::new();
        }
        self.corked = false;
        std::task::Poll::Ready(Ok(()))
    }
}

/// The writer task's view of [`WriteSide`]: each poll takes the lock (never across an
/// await) and writes `carry` before anything else.
struct Locked<'a>(&'a Mutex<WriteSide>);

impl AsyncWrite for Locked<'_> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        let mut io = self.0.lock();
        std::task::ready!(io.poll_carry(cx))?;
        std::pin::Pin::new(&mut io.wr).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> std::task::Poll<io::Result<usize>> {
        let mut io = self.0.lock();
        std::task::ready!(io.poll_carry(cx))?;
        std::pin::Pin::new(&mut io.wr).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.lock().wr.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        let mut io = self.0.lock();
        std::task::ready!(io.poll_carry(cx))?;
        std::pin::Pin::new(&mut io.wr).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        let mut io = self.0.lock();
        std::task::ready!(io.poll_carry(cx))?;
        std::pin::Pin::new(&mut io.wr).poll_shutdown(cx)
    }
}

/// A connection's writer task before it runs: started by the first frame that needs it, so
/// that a connection whose frames all go out with their senders (a new connection's first
/// call and its answer, a `Close`) costs no task, nor the thread wake-up that starting one
/// from outside the runtime costs.
pub(super) struct WriterStart {
    pub(super) started: AtomicBool,
    pub(super) start: Mutex<Option<(mpsc::UnboundedReceiver<Out>, tokio::runtime::Handle)>>,
    /// Tells the writer task to drop its queue and end (see [`Shared::abandon`]).
    pub(super) abandon: tokio::sync::Notify,
}

/// Frames larger than this always go through the writer task.
const DIRECT_MAX: usize = 64 * 1024;

impl Shared {
    /// Encodes and queues one frame, compressing payloads above the threshold.
    pub(crate) fn send(
        &self,
        kind: Kind,
        call_id: u64,
        method_id: u32,
        payload: impl Into<Message>,
    ) -> Result<(), RpcError> {
        self.submit(kind, false, call_id, method_id, payload.into(), false)
    }

    /// Like [`send`](Self::send) for a lone frame: one that its sender may write itself
    /// (see [`WriteSide`]).
    pub(super) fn send_lone(
        &self,
        kind: Kind,
        call_id: u64,
        method_id: u32,
        payload: impl Into<Message>,
        lone: bool,
    ) -> Result<(), RpcError> {
        self.submit(kind, false, call_id, method_id, payload.into(), lone)
    }

    /// Like [`send`](Self::send) for a stream frame, flagged as an upload's or not.
    pub(crate) fn send_stream(
        &self,
        kind: Kind,
        upload: bool,
        call_id: u64,
        payload: Bytes,
    ) -> Result<(), RpcError> {
        self.submit(kind, upload, call_id, 0, payload.into(), false)
    }

    /// Encodes one frame (checking the other side's limit, compressing) without queuing it.
    pub(super) fn prepare(
        &self,
        kind: Kind,
        upload: bool,
        call_id: u64,
        method_id: u32,
        payload: Message,
    ) -> Result<Out, RpcError> {
        let remote_max = self.remote.max.load(Ordering::Relaxed);
        if payload.len() > remote_max as usize {
            return Err(RpcError::new(
                ErrorCode::TooLarge,
                format!(
                    "message of {} bytes exceeds the other side's limit of {remote_max}",
                    payload.len(),
                ),
            ));
        }
        let mut compression = Compression::None;
        let mut payload = payload;
        let wanted = self.remote.compression();
        if wanted != Compression::None && payload.len() >= self.settings.compression_threshold {
            if let Some(c) = codec::compress_message(wanted, &payload) {
                compression = wanted;
                payload = Bytes::from(c).into();
            }
        }
        Ok(encode(
            kind,
            compression,
            upload,
            call_id,
            method_id,
            payload,
        ))
    }

    /// Hands `out` to the writer task, or, for a small `lone` frame while nothing waits
    /// for the writer, writes it at once (gathers it in `carry` while corked).
    pub(super) fn enqueue(&self, out: Out, lone: bool) -> Result<(), RpcError> {
        if lone && self.backlog.load(Ordering::Acquire) == 0 {
            // Held by the writer task or another sender: the queue it is, then.
            if let Some(mut io) = self.io.try_lock() {
                if let Out::Frame {
                    head,
                    head_len,
                    payload,
                } = &out
                {
                    // `carry` is empty here unless corked: whatever a write left over
                    // counts in the backlog until the writer has written it.
                    if payload.len() <= DIRECT_MAX && self.backlog.load(Ordering::Acquire) == 0 {
                        put_frame(&mut io.carry, &head[..*head_len as usize], payload);
                        self.counters
                            .bytes_out
                            .fetch_add(payload.len() as u64, Ordering::Relaxed);
                        return if io.corked {
                            Ok(())
                        } else {
                            self.write_carry(&mut io)
                        };
                    }
                }
            }
        }
        self.enqueue_for_writer(out)
    }

    /// Writes `carry` as far as the transport takes it at once, and flushes; what is left
    /// (or an error) is the writer task's, told with an `Out::Flush`.
    fn write_carry(&self, io: &mut WriteSide) -> Result<(), RpcError> {
        let mut cx = std::task::Context::from_waker(futures::task::noop_waker_ref());
        let done = matches!(io.poll_carry(&mut cx), std::task::Poll::Ready(Ok(())))
            && matches!(
                std::pin::Pin::new(&mut io.wr).poll_flush(&mut cx),
                std::task::Poll::Ready(Ok(()))
            );
        if done {
            return Ok(());
        }
        self.backlog.fetch_add(1, Ordering::AcqRel);
        self.to_writer(Out::Flush)
    }

    /// Ends the accepting side's cork (see [`WriteSide::corked`]): writes what it gathered,
    /// unless the writer task wrote it already. The reader calls it before it first waits
    /// for input, having routed the frames that came with the `Hello`.
    pub(crate) fn uncork(&self) {
        let mut io = self.io.lock();
        if std::mem::take(&mut io.corked) {
            let _ = self.write_carry(&mut io);
        }
    }

    fn enqueue_for_writer(&self, out: Out) -> Result<(), RpcError> {
        let bytes = match &out {
            Out::Frame { payload, .. } => payload.len(),
            Out::Stop(_) | Out::Flush => 0,
        };
        let over_budget = bytes > 0 && {
            let now = self.queued.fetch_add(bytes, Ordering::Relaxed) + bytes;
            if now > self.queued_peak.load(Ordering::Relaxed) {
                self.queued_peak.fetch_max(now, Ordering::Relaxed);
            }
            self.totals.queue(bytes)
        };
        self.backlog.fetch_add(1, Ordering::AcqRel);
        let sent = self.to_writer(out);
        if sent.is_err() {
            // The writer task has ended: nothing will write these bytes.
            self.written(bytes);
        }
        if over_budget {
            self.totals.shed();
        }
        sent
    }

    /// Counts `bytes` off the queue (written, or dropped with the writer's queue).
    fn written(&self, bytes: usize) {
        if bytes > 0 {
            self.queued.fetch_sub(bytes, Ordering::Relaxed);
            self.totals.dequeue(bytes);
        }
    }

    /// Queues `out` for the writer task, starting that task first if it has not run yet.
    fn to_writer(&self, out: Out) -> Result<(), RpcError> {
        if !self.writer.started.load(Ordering::Acquire) {
            self.start_writer();
        }
        self.out.send(out).map_err(|_| self.closed_error())
    }

    #[cold]
    fn start_writer(&self) {
        let mut slot = self.writer.start.lock();
        if let Some((rx, runtime)) = slot.take() {
            // Set before anything is queued: `stop` reads it under the write side's lock.
            self.writer.started.store(true, Ordering::Release);
            if let Some(shared) = self.me.upgrade() {
                runtime.spawn(write_loop(shared, rx));
            }
        }
    }

    /// Sends `close` (if any) and shuts the write side down: at once where the writer task
    /// never started and the transport takes it all without waiting (a connection whose
    /// frames all went out with their senders), else through that task, after what it has.
    pub(super) fn stop(&self, close: Option<Out>) {
        if !self.writer.started.load(Ordering::Acquire) {
            let mut io = self.io.lock();
            if !self.writer.started.load(Ordering::Acquire) {
                // Nothing was ever queued: `carry` holds all there is to write before it.
                if let Some(Out::Frame {
                    head,
                    head_len,
                    payload,
                }) = &close
                {
                    put_frame(&mut io.carry, &head[..*head_len as usize], payload);
                }
                let mut cx = std::task::Context::from_waker(futures::task::noop_waker_ref());
                let done = matches!(io.poll_carry(&mut cx), std::task::Poll::Ready(Ok(())))
                    && matches!(
                        std::pin::Pin::new(&mut io.wr).poll_shutdown(&mut cx),
                        std::task::Poll::Ready(Ok(()))
                    );
                drop(io);
                if !done {
                    // The rest, `Close` included, is in `carry`: the writer writes it first.
                    let _ = self.to_writer(Out::Stop(None));
                }
                return;
            }
        }
        let _ = self.to_writer(Out::Stop(close.map(Box::new)));
    }
}

pub(crate) fn encode(
    kind: Kind,
    compression: Compression,
    upload: bool,
    call_id: u64,
    method_id: u32,
    payload: Message,
) -> Out {
    let mut head = [0u8; MAX_HEADER_LEN];
    let head_len = Header {
        kind,
        compression,
        upload,
        call_id,
        method_id,
        len: payload.len() as u32,
    }
    .encode(&mut head) as u8;
    Out::Frame {
        head,
        head_len,
        payload,
    }
}

/// The writer task: writes until it is told to stop (or to abandon its queue, or a write
/// fails), then counts off what it never wrote.
async fn write_loop(shared: Arc<Shared>, mut rx: mpsc::UnboundedReceiver<Out>) {
    // Bytes taken off the queue and not yet written: counted off once written, or at the
    // end, however the loop ends.
    let mut taken = 0usize;
    let result = tokio::select! {
        r = write_batches(&shared, &mut rx, &mut taken) => r,
        _ = shared.writer.abandon.notified() => {
            // The queue is dropped unwritten; the write half is shut down as far as the
            // transport takes it without waiting.
            let mut io = shared.io.lock();
            let mut cx = std::task::Context::from_waker(futures::task::noop_waker_ref());
            let _ = std::pin::Pin::new(&mut io.wr).poll_shutdown(&mut cx);
            Ok(())
        }
    };
    // From here on a send fails (and counts its bytes off itself); what was queued before
    // is counted off as it is dropped.
    rx.close();
    while let Ok(m) = rx.try_recv() {
        if let Out::Frame { payload, .. } = m {
            taken += payload.len();
        }
    }
    shared.written(taken);
    shared.drained.notify_waiters();
    if let Err(e) = result {
        shared.shutdown(e, false);
    }
}

/// The writer task's work: coalesces queued frames into few writes, after what senders of
/// lone frames left in `carry`. `taken`: see [`write_loop`].
async fn write_batches(
    shared: &Shared,
    rx: &mut mpsc::UnboundedReceiver<Out>,
    taken: &mut usize,
) -> Result<(), RpcError> {
    let mut wr = Locked(&shared.io);
    // Grown as batches need (up to about `BATCH`), not allocated at full size: most
    // connections write little, and freeing a 64 KiB buffer per connection made glibc give
    // the memory back to the kernel each time (an `madvise` and a TLB shootdown, which
    // interrupts the other cores: counted with `strace -c` on `examples/connect`). And
    // let go of while nothing waits (see `WriteBuffer`).
    let mut buf: Vec<u8> = Vec::new();
    let mut sizing = WriteBuffer::default();
    let stall = shared.settings.write_stall_timeout;
    loop {
        let first = match rx.try_recv() {
            Ok(m) => m,
            Err(_) => {
                if sizing.idle(&buf) {
                    buf = Vec::new();
                }
                match rx.recv().await {
                    Some(m) => m,
                    None => break,
                }
            }
        };
        if buf.capacity() == 0 {
            buf.reserve(SMALL_BATCH);
        }
        let mut items = 1;
        let mut stop = match append(&mut buf, first, taken) {
            None => false,
            Some(m) => push(&mut wr, &mut buf, m, taken, stall).await?,
        };
        let mut yielded = false;
        while !stop {
            match rx.try_recv() {
                Ok(m) => {
                    items += 1;
                    if let Some(m) = append(&mut buf, m, taken) {
                        stop = push(&mut wr, &mut buf, m, taken, stall).await?;
                    }
                }
                Err(_) if !yielded && buf.len() < SMALL_BATCH => {
                    yielded = true;
                    tokio::task::yield_now().await;
                }
                Err(_) => break,
            }
            if buf.len() >= BATCH {
                break;
            }
        }
        sizing.wrote(buf.len());
        flush(&mut wr, &mut buf, stall).await?;
        let written = std::mem::take(taken);
        shared
            .counters
            .bytes_out
            .fetch_add(written as u64, Ordering::Relaxed);
        shared.written(written);
        shared.drained.notify_waiters();
        // Not after the stop: nothing may be written past the `Close`.
        if !stop {
            shared.backlog.fetch_sub(items, Ordering::AcqRel);
        }
        if stop {
            let _ = wr.shutdown().await;
            return Ok(());
        }
    }
    Ok(())
}

/// When the writer lets go of its batch buffer: a connection that has nothing to write
/// holds none (a browser tab's connection waits minutes between invalidations; ten
/// thousand 4 KiB buffers are 40 MB), unless its recent batches were large, where
/// allocating and freeing a large buffer at every pause would cost more than the write
/// (see `write_batches`): then after [`CALM_BATCHES`] small ones in a row.
#[derive(Default)]
struct WriteBuffer {
    calm: u32,
}

/// Batches of at most [`SMALL_BATCH`] in a row after which a grown buffer is let go of.
const CALM_BATCHES: u32 = 16;

impl WriteBuffer {
    /// Counts a batch of `len` bytes.
    fn wrote(&mut self, len: usize) {
        if len > SMALL_BATCH {
            self.calm = 0;
        } else {
            self.calm = self.calm.saturating_add(1);
        }
    }

    /// Whether `buf` is to be let go of now that nothing waits to be written.
    fn idle(&mut self, buf: &Vec<u8>) -> bool {
        buf.capacity() > 0 && (buf.capacity() <= SMALL_BATCH || self.calm >= CALM_BATCHES)
    }
}

/// Appends a frame to the batch when none of its parts is written on its own (the usual
/// case, without the await points of [`push`]); hands any other item back.
#[inline]
fn append(buf: &mut Vec<u8>, m: Out, written: &mut usize) -> Option<Out> {
    match m {
        Out::Frame {
            head,
            head_len,
            payload,
        } if payload.parts().all(|p| p.len() < DIRECT_WRITE) => {
            put_frame(buf, &head[..head_len as usize], &payload);
            *written += payload.len();
            None
        }
        other => Some(other),
    }
}

/// Appends a frame's head and every part of its payload to `buf`.
#[inline]
fn put_frame(buf: &mut Vec<u8>, head: &[u8], payload: &Message) {
    buf.extend_from_slice(head);
    for part in payload.parts() {
        buf.extend_from_slice(part);
    }
}

/// Appends one queued item to the batch; returns whether it was the order to stop.
async fn push<W: AsyncWrite + Unpin>(
    wr: &mut W,
    buf: &mut Vec<u8>,
    m: Out,
    written: &mut usize,
    stall: Duration,
) -> Result<bool, RpcError> {
    match m {
        Out::Frame {
            head,
            head_len,
            payload,
        } => {
            buf.extend_from_slice(&head[..head_len as usize]);
            *written += payload.len();
            for part in payload.parts() {
                if part.len() >= DIRECT_WRITE {
                    // The batch so far and the part, in one vectored write where it can.
                    write_both(wr, buf, part, stall).await?;
                    buf.clear();
                } else {
                    buf.extend_from_slice(part);
                }
            }
            Ok(false)
        }
        Out::Stop(close) => {
            if let Some(close) = close {
                // The `Close` came with the stop, not through the queue's count (a stop
                // counts 0 bytes there): not counted off it either.
                let mut uncounted = 0;
                Box::pin(push(wr, buf, *close, &mut uncounted, stall)).await?;
            }
            Ok(true)
        }
        // The batch ends with a flush, which writes `carry` first.
        Out::Flush => Ok(false),
    }
}

async fn flush<W: AsyncWrite + Unpin>(
    wr: &mut W,
    buf: &mut Vec<u8>,
    stall: Duration,
) -> Result<(), RpcError> {
    if !buf.is_empty() {
        write_all(wr, buf, stall).await?;
        buf.clear();
    }
    wr.flush().await?;
    Ok(())
}

/// Writes `first` then `second`, both in one syscall where the transport takes vectored
/// writes (TCP and Unix sockets do).
async fn write_both<W: AsyncWrite + Unpin>(
    wr: &mut W,
    first: &[u8],
    second: &[u8],
    stall: Duration,
) -> Result<(), RpcError> {
    let write = async {
        let (mut first, mut second) = (first, second);
        while !first.is_empty() {
            let n = wr
                .write_vectored(&[std::io::IoSlice::new(first), std::io::IoSlice::new(second)])
                .await?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            if n < first.len() {
                first = &first[n..];
            } else {
                second = &second[n - first.len()..];
                first = &[];
            }
        }
        wr.write_all(second).await
    };
    match tokio::time::timeout(stall, write).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(stalled(stall)),
    }
}

fn stalled(stall: Duration) -> RpcError {
    RpcError::disconnected(format!(
        "the other side stopped reading (a write stalled for {stall:?})"
    ))
}

async fn write_all<W: AsyncWrite + Unpin>(
    wr: &mut W,
    bytes: &[u8],
    stall: Duration,
) -> Result<(), RpcError> {
    match tokio::time::timeout(stall, wr.write_all(bytes)).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(stalled(stall)),
    }
}

/// Backpressure for frames that make this side write (calls, pings): a peer that keeps
/// sending them but stops reading stalls here instead of growing the writer's queue.
pub(super) async fn wait_for_room(s: &Shared) {
    let mark = s.settings.max_queued;
    while s.queued.load(Ordering::Relaxed) > mark {
        let drained = s.drained.notified();
        if s.queued.load(Ordering::Relaxed) <= mark || s.closed_reason().is_some() {
            break;
        }
        drained.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quiet_connection_holds_no_batch_buffer() {
        let mut sizing = WriteBuffer::default();
        assert!(!sizing.idle(&Vec::new()), "nothing to let go of");
        let mut small = Vec::with_capacity(SMALL_BATCH);
        sizing.wrote(100);
        assert!(sizing.idle(&small), "a small buffer goes at every pause");
        small.reserve(BATCH);
        sizing.wrote(BATCH);
        assert!(
            !sizing.idle(&small),
            "a grown one stays while batches are large"
        );
        for _ in 1..CALM_BATCHES {
            sizing.wrote(100);
        }
        assert!(!sizing.idle(&small));
        sizing.wrote(100);
        assert!(sizing.idle(&small), "and goes after enough small ones");
    }
}
