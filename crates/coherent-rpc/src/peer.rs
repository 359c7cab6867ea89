//! One connection after its handshake: the call tables, the single writer task that
//! coalesces queued frames into few socket writes (lone frames are written by their
//! senders), the single reader task that routes each frame, and the `Peer` handle through
//! which both sides make calls.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use std::future::Future;

use futures::FutureExt;
use parking_lot::Mutex;
use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, watch, Notify, Semaphore};
use tokio::task::AbortHandle;
use tracing::Instrument;

use crate::codec::{self, Format, Message};
use crate::error::{ErrorCode, RpcError};
use crate::frame::{Compression, Header, Kind, MAX_HEADER_LEN};
use crate::net::Due;
use crate::service::{CallContext, Identity, MethodKind, Registry, Response, CONTEXT};
use crate::stream::ClientStream;

/// Payload parts this large are written straight from their buffer instead of being copied
/// into the batch: copying 10 MB to save one syscall does not pay. Blobs this large are
/// parts of their own (`codec::SPLICE_FROM`).
const DIRECT_WRITE: usize = codec::SPLICE_FROM;
/// The writer stops coalescing and writes once a batch reaches this size.
const BATCH: usize = 64 * 1024;
/// Below this, the writer yields once before writing so that callers woken by the same
/// event can add their frames to the batch (a wake-up costs more than a short wait).
const SMALL_BATCH: usize = 4 * 1024;

/// With zero-RTT, the largest message sent before the other side's `HelloAck`: a larger
/// one waits for it (and for its `max_message_size`). Every endpoint configured with a
/// limit of at least this takes such a message blind.
pub(crate) const EARLY_MAX: usize = 64 * 1024;

/// Settings agreed in the handshake, fixed for the connection's life.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) format: Format,
    pub(crate) send_compression: Compression,
    pub(crate) compression_threshold: usize,
    pub(crate) local_max: u32,
    pub(crate) remote_max: u32,
    pub(crate) max_inbound: u32,
    pub(crate) local_window: u32,
    pub(crate) remote_window: u32,
    pub(crate) keepalive_interval: Option<Duration>,
    pub(crate) idle_timeout: Option<Duration>,
    pub(crate) write_stall_timeout: Duration,
    pub(crate) call_timeout: Option<Duration>,
}

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

/// What the reader delivers to a caller waiting on an outbound call.
pub(crate) enum Pending {
    Unary(oneshot::Sender<Result<Bytes, RpcError>>),
    Stream(
        mpsc::UnboundedSender<crate::stream::Event>,
        /// Items received and not yet consumed: never more than the window from an
        /// honest producer, so more is a protocol violation, not a reason to buffer.
        Arc<std::sync::atomic::AtomicU32>,
    ),
}

impl Pending {
    fn fail(self, e: RpcError) {
        match self {
            Pending::Unary(tx) => drop(tx.send(Err(e))),
            Pending::Stream(tx, _) => drop(tx.send(crate::stream::Event::Failed(e))),
        }
    }
}

/// A call the other side made and this side is running.
struct Inbound {
    abort: AbortHandle,
    credits: Option<Arc<Semaphore>>,
    /// Where the caller's upload goes (methods that take one), until its end.
    upload: Option<Receiving>,
}

/// The receiving end's half of a stream as the reader sees it: where items go, and how many
/// are buffered unconsumed (never more than the window from an honest sender).
pub(crate) type Receiving = (
    mpsc::UnboundedSender<crate::stream::Event>,
    Arc<std::sync::atomic::AtomicU32>,
);

/// Counters of one connection; read them with [`Peer::stats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    calls_out: AtomicU64,
    calls_in: AtomicU64,
    errors_in: AtomicU64,
    bytes_out: AtomicU64,
    bytes_in: AtomicU64,
}

/// A snapshot of a connection's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Stats {
    /// Calls this side made.
    pub calls_out: u64,
    /// Calls the other side made.
    pub calls_in: u64,
    /// `Error` frames received.
    pub errors_in: u64,
    /// Bytes written to the transport.
    pub bytes_out: u64,
    /// Bytes read from the transport.
    pub bytes_in: u64,
    /// Calls from the other side running now.
    pub in_flight_in: u64,
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
struct WriteSide {
    wr: Box<dyn AsyncWrite + Send + Unpin>,
    /// Bytes that go out before anything queued: the part of a sender's own write the
    /// transport did not take at once (the writer task writes it), or, while `corked`,
    /// the frames gathered.
    carry: Vec<u8>,
    /// Whether lone frames are gathered in `carry` instead of written: the accepting
    /// side's `HelloAck` waits there for the answers to the calls sent right behind the
    /// `Hello`, so that the connecting side reads them all at once (one write, one wake-up,
    /// instead of one each). See [`Shared::uncork`].
    corked: bool,
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
struct WriterStart {
    started: AtomicBool,
    start: Mutex<Option<(mpsc::UnboundedReceiver<Out>, tokio::runtime::Handle)>>,
}

/// Frames larger than this always go through the writer task.
const DIRECT_MAX: usize = 64 * 1024;

/// The other side's limit, stream window and the compression this side sends with.
struct Remote {
    max: AtomicU32,
    window: AtomicU32,
    compression: AtomicU8,
    /// Whether the values above are the other side's (always, but with zero-RTT before
    /// its `HelloAck`).
    known: AtomicBool,
}

impl Remote {
    fn compression(&self) -> Compression {
        Compression::from_u8(self.compression.load(Ordering::Relaxed)).unwrap_or(Compression::None)
    }
}

/// Which side of the handshake a connection's end was.
pub(crate) enum Role {
    /// The connecting side; with zero-RTT, its state until the answer and how long the
    /// answer may take.
    Connecting { early: Option<Early> },
    /// The accepting side, with the identity its auth hook returned and its answer to the
    /// `Hello` (sent first, corked: see [`WriteSide::corked`]).
    Accepting {
        identity: Option<Identity>,
        answer: Vec<u8>,
    },
}

/// A zero-RTT connection's state until the other side's `HelloAck`.
pub(crate) struct Early {
    /// The compression to send with, if the other side turns out to decode it.
    wanted: Compression,
    /// The `Hello` this side sent: the answer must echo its format.
    format: Format,
    /// How long the answer may take.
    within: Duration,
    /// Frames held until the answer, in order: the first too large to send blind and
    /// everything after it.
    held: Vec<Held>,
}

impl Early {
    pub(crate) fn new(wanted: Compression, format: Format, within: Duration) -> Self {
        Self {
            wanted,
            format,
            within,
            held: Vec::new(),
        }
    }
}

struct Held {
    kind: Kind,
    upload: bool,
    call_id: u64,
    method_id: u32,
    payload: Message,
}

/// Calls by id. foldhash instead of SipHash: hashing ids was a tenth of a unary call's
/// instructions. Its seed is random per table, and a table the other side fills (`inbound`)
/// holds at most `max_inbound` calls, so colliding ids cannot make it slow without bound.
type CallTable<V> = HashMap<u64, V, foldhash::fast::RandomState>;

pub(crate) struct Shared {
    /// Unique among this process's connections.
    id: u64,
    out: mpsc::UnboundedSender<Out>,
    // parking_lot mutexes, not tokio ones: no `.await` happens while either is held.
    pending: Mutex<CallTable<Pending>>,
    /// Credits of this side's uploads in flight, by call id.
    uploads: Mutex<CallTable<Arc<Semaphore>>>,
    inbound: Mutex<CallTable<Inbound>>,
    next_id: AtomicU64,
    pub(crate) settings: Settings,
    /// What the other side announced: fixed from the start, except with zero-RTT, where it
    /// is provisional until the `HelloAck` arrives.
    remote: Remote,
    /// Zero-RTT only: frames waiting for the `HelloAck` (see [`EARLY_MAX`]).
    early: Option<Mutex<Early>>,
    /// The write half, shared with senders of lone frames.
    io: Mutex<WriteSide>,
    /// The writer task, started on first need.
    writer: WriterStart,
    /// This connection, for starting its writer task.
    me: std::sync::Weak<Shared>,
    /// Items handed to the writer task and not yet written (`Out::Flush` included): a
    /// sender writes its frame itself only while this is zero, so that it never overtakes
    /// one of its own frames still queued.
    backlog: AtomicUsize,
    registry: Arc<Registry>,
    identity: Option<Identity>,
    closed: watch::Sender<Option<RpcError>>,
    /// What calls fail with once the connection is closed (set with `closed`).
    failure: std::sync::OnceLock<RpcError>,
    /// Bytes handed to the writer and not yet written: the reader stops taking new
    /// calls above `high_water` so that a peer that stops reading cannot grow this queue.
    queued: AtomicUsize,
    high_water: AtomicUsize,
    drained: Notify,
    counters: Counters,
    /// What a new stream's first batch reserves: what the last stream's batches did (see
    /// [`Batch::capacity`]). Growing each stream's first batch from a few hundred bytes
    /// took a `realloc` at every doubling, and glibc's arena lock with it, which the
    /// writer's thread freeing sent batches contends for.
    stream_batch: AtomicUsize,
}

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
    fn send_lone(
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

    #[inline]
    fn submit(
        &self,
        kind: Kind,
        upload: bool,
        call_id: u64,
        method_id: u32,
        payload: Message,
        lone: bool,
    ) -> Result<(), RpcError> {
        if let Some(early) = &self.early {
            if !self.remote.known.load(Ordering::Acquire) {
                let mut early = early.lock();
                // Re-checked under the lock, which the `HelloAck` takes to flush.
                if !self.remote.known.load(Ordering::Acquire)
                    && (!early.held.is_empty() || payload.len() > EARLY_MAX)
                {
                    early.held.push(Held {
                        kind,
                        upload,
                        call_id,
                        method_id,
                        payload,
                    });
                    return Ok(());
                }
                // Queued under the lock: the flush cannot slip in between.
                let out = self.prepare(kind, upload, call_id, method_id, payload)?;
                return self.enqueue(out, lone);
            }
        }
        let out = self.prepare(kind, upload, call_id, method_id, payload)?;
        self.enqueue(out, lone)
    }

    /// Zero-RTT: takes the other side's `HelloAck`, then sends the held frames with its
    /// settings. A held call now too large fails alone, as it would have at once.
    fn hello_acked(&self, ack: &crate::handshake::Hello) -> Result<(), RpcError> {
        let Some(early) = &self.early else {
            return Err(RpcError::protocol("handshake frame after the handshake"));
        };
        let mut early = early.lock();
        if ack.format != early.format {
            return Err(RpcError::protocol(
                "the other side answered in another format",
            ));
        }
        let compression = if ack.decodes.contains(early.wanted) {
            early.wanted
        } else {
            Compression::None
        };
        self.remote
            .max
            .store(ack.max_message_size, Ordering::Relaxed);
        self.high_water.store(
            high_water(self.settings.local_max, ack.max_message_size),
            Ordering::Relaxed,
        );
        self.remote
            .window
            .store(ack.stream_window, Ordering::Relaxed);
        self.remote
            .compression
            .store(compression as u8, Ordering::Relaxed);
        let mut dropped = Vec::new();
        for h in std::mem::take(&mut early.held) {
            let is_call = matches!(h.kind, Kind::Call | Kind::OneWay);
            let cancelled = if h.kind == Kind::Call {
                !self.pending.lock().contains_key(&h.call_id)
            } else {
                dropped.contains(&h.call_id)
            };
            if cancelled {
                // Cancelled while held: the callee need not hear of it, nor of its Cancel.
                dropped.push(h.call_id);
                continue;
            }
            match self.prepare(h.kind, h.upload, h.call_id, h.method_id, h.payload) {
                Ok(out) => self.enqueue(out, false)?,
                Err(e) if is_call => {
                    // Too large for the other side after all: the call fails alone, and
                    // what else it queued (an upload's items and end) is not sent.
                    dropped.push(h.call_id);
                    match self.pending.lock().remove(&h.call_id) {
                        Some(p) => p.fail(e),
                        None => tracing::warn!(
                            %e,
                            "a one-way call made before the handshake's answer was not sent"
                        ),
                    }
                }
                Err(e) => return Err(e),
            }
        }
        // Uploads started before the answer wait for their first credits: the window.
        let uploads = self.uploads.lock();
        self.remote.known.store(true, Ordering::Release);
        for credits in uploads.values() {
            credits.add_permits(ack.stream_window as usize);
        }
        Ok(())
    }

    /// Encodes one frame (checking the other side's limit, compressing) without queuing it.
    fn prepare(
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
    fn enqueue(&self, out: Out, lone: bool) -> Result<(), RpcError> {
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
        self.queued.fetch_add(bytes, Ordering::Relaxed);
        self.backlog.fetch_add(1, Ordering::AcqRel);
        self.to_writer(out)
    }

    /// Queues `out` for the writer task, starting that task first if it has not run yet.
    fn to_writer(&self, out: Out) -> Result<(), RpcError> {
        if !self.writer.started.load(Ordering::Acquire) {
            self.start_writer();
        }
        self.out.send(out).map_err(|_| self.closed_error())
    }

    /// What an operation on the closed connection fails with: the reason calls fail with
    /// (a refusal's `Unauthenticated`, say), set before the writer task lets go of its queue
    /// and before any caller's reply is dropped unanswered.
    fn closed_error(&self) -> RpcError {
        self.failure
            .get()
            .cloned()
            .unwrap_or_else(|| RpcError::disconnected("connection closed"))
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
    fn stop(&self, close: Option<Out>) {
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

    /// Awaits an upload call's `reply` within its deadline (`opts.timeout`, else the
    /// connection's default); past it, the answer is `DeadlineExceeded`.
    async fn within_deadline<T>(
        &self,
        opts: CallOptions,
        reply: impl Future<Output = Result<T, RpcError>>,
    ) -> Result<T, RpcError> {
        match opts.timeout.or(self.settings.call_timeout) {
            None => reply.await,
            Some(d) => tokio::time::timeout(d, reply).await.unwrap_or_else(|_| {
                Err(RpcError::new(
                    ErrorCode::DeadlineExceeded,
                    format!("no reply within {d:?}"),
                ))
            }),
        }
    }

    fn closed_reason(&self) -> Option<RpcError> {
        self.closed.borrow().clone()
    }

    /// Closes the connection once: fails every waiting caller, aborts every running
    /// handler, and tells the writer to stop (after sending `Close` when `tell_remote`).
    pub(crate) fn shutdown(&self, reason: RpcError, tell_remote: bool) {
        let failure = if reason.code() == ErrorCode::Disconnected {
            reason.clone()
        } else {
            RpcError::disconnected(format!("connection closed: {reason}"))
        };
        self.shutdown_failing(reason, tell_remote, failure);
    }

    /// Closes the connection for `reason`; calls in flight, and calls made from now on,
    /// fail with `failure`.
    fn shutdown_failing(&self, reason: RpcError, tell_remote: bool, failure: RpcError) {
        // Set before `closed`: whoever sees the reason finds the failure too.
        let _ = self.failure.set(failure.clone());
        let first = self.closed.send_if_modified(|c| {
            if c.is_none() {
                *c = Some(reason.clone());
                true
            } else {
                false
            }
        });
        if !first {
            return;
        }
        tracing::debug!(%reason, "connection closing");
        let close = tell_remote.then(|| {
            encode(
                Kind::Close,
                Compression::None,
                false,
                0,
                0,
                Bytes::from(reason.to_payload()).into(),
            )
        });
        // Counted and never written off: no sender writes on its own after this.
        self.backlog.fetch_add(1, Ordering::AcqRel);
        self.stop(close);
        let pending: Vec<_> = self.pending.lock().drain().collect();
        for (_, p) in pending {
            p.fail(failure.clone());
        }
        let inbound: Vec<_> = self.inbound.lock().drain().collect();
        for (_, i) in inbound {
            i.abort.abort();
        }
        self.drained.notify_waiters();
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Registers an outbound call; fails if the connection is (or just got) closed.
    /// Returns whether it is the only call waiting on the connection.
    fn register(&self, id: u64, p: Pending) -> Result<bool, RpcError> {
        let lone = {
            let mut pending = self.pending.lock();
            pending.insert(id, p);
            pending.len() == 1
        };
        // Checked after inserting: `shutdown` sets the failure before draining the
        // table, so a call inserted after the drain sees it here (one atomic load, where
        // the reason's watch would take a read lock that every caller shares).
        if let Some(failure) = self.failure.get() {
            self.pending.lock().remove(&id);
            return Err(failure.clone());
        }
        Ok(lone)
    }

    /// Registers unary call `id` and sends its `Call` frame. The guard, while armed, forgets
    /// the call and cancels it on the callee when dropped.
    #[inline]
    fn start_unary(
        &self,
        id: u64,
        method_id: u32,
        payload: Message,
    ) -> Result<(oneshot::Receiver<Result<Bytes, RpcError>>, CallGuard<'_>), RpcError> {
        let (tx, rx) = oneshot::channel();
        let lone = self.register(id, Pending::Unary(tx))?;
        if let Err(e) = self.send_lone(Kind::Call, id, method_id, payload, lone) {
            self.pending.lock().remove(&id);
            return Err(e);
        }
        self.counters.calls_out.fetch_add(1, Ordering::Relaxed);
        let guard = CallGuard {
            shared: self,
            id,
            armed: true,
        };
        Ok((rx, guard))
    }

    pub(crate) fn forget_call(&self, id: u64, send_cancel: bool) {
        if self.pending.lock().remove(&id).is_some() && send_cancel {
            let _ = self.send(Kind::Cancel, id, 0, Bytes::new());
        }
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

/// Options of one call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallOptions {
    /// How long the caller waits for the reply; on expiry the call is cancelled on the
    /// callee and fails with `DeadlineExceeded`. `None` uses the endpoint's default.
    pub timeout: Option<Duration>,
    /// Whether running the call twice is harmless: a reconnecting caller resends such a
    /// call when the connection drops while it is in flight (set by `#[idempotent]`).
    pub idempotent: bool,
}

/// A handle to one connection. Clone it freely; calls from clones share the connection.
///
/// The handle returned by a connect closes the connection when its last clone is
/// dropped; the handles an accepting endpoint hands out (and `CallContext::peer`) do not:
/// that side's connection lives as long as the connecting side keeps it.
#[derive(Clone)]
pub struct Peer {
    pub(crate) shared: Arc<Shared>,
    _owner: Option<Arc<Owner>>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("format", &self.shared.settings.format)
            .field("identity", &self.shared.identity)
            .field("closed", &self.shared.closed_reason())
            .finish()
    }
}

struct Owner(Arc<Shared>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.shutdown(
            RpcError::disconnected("the client dropped the connection"),
            true,
        );
    }
}

/// Forgets an upload's credits when its call ends, however it ends.
struct UploadGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for UploadGuard<'_> {
    fn drop(&mut self) {
        self.shared.uploads.lock().remove(&self.id);
    }
}

/// Removes the pending entry and tells the callee to stop when a call's future is
/// dropped before its reply arrived.
struct CallGuard<'a> {
    shared: &'a Shared,
    id: u64,
    armed: bool,
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.shared.forget_call(self.id, true);
        }
    }
}

impl Peer {
    /// Makes a unary call: `args` is the tuple of the method's arguments.
    pub async fn call<A, R>(
        &self,
        method_id: u32,
        args: A,
        opts: CallOptions,
    ) -> Result<R, RpcError>
    where
        A: Serialize,
        R: DeserializeOwned,
    {
        let format = self.shared.settings.format;
        let payload = format.encode_message(&args)?;
        drop(args);
        let bytes = self.call_message(method_id, payload, opts).await?;
        format.decode_bytes(bytes)
    }

    /// Makes a unary call with already encoded arguments and returns the encoded result.
    pub async fn call_bytes(
        &self,
        method_id: u32,
        payload: Bytes,
        opts: CallOptions,
    ) -> Result<Bytes, RpcError> {
        self.call_message(method_id, payload.into(), opts).await
    }

    /// Like [`call_bytes`](Self::call_bytes), with arguments made by
    /// [`Format::encode_message`] (their large blobs are sent without a copy).
    #[inline]
    pub async fn call_message(
        &self,
        method_id: u32,
        payload: Message,
        opts: CallOptions,
    ) -> Result<Bytes, RpcError> {
        let s = &*self.shared;
        let (rx, mut guard) = s.start_unary(s.next_id(), method_id, payload)?;
        // Not through `within_deadline`: on this hot path the extra future layer cost about
        // 9% of `calls.sum` (measured with `coherent-bench rpc --only calls.sum`).
        let reply = match opts.timeout.or(s.settings.call_timeout) {
            None => rx.await,
            Some(d) => match tokio::time::timeout(d, rx).await {
                Ok(r) => r,
                // Still armed: the guard cancels the call on the callee.
                Err(_) => {
                    return Err(RpcError::new(
                        ErrorCode::DeadlineExceeded,
                        format!("no reply within {d:?}"),
                    ))
                }
            },
        };
        guard.armed = false;
        reply.map_err(|_| s.closed_error())?
    }

    /// Sends a one-way call: no reply, no delivery guarantee beyond the queue.
    pub fn call_oneway<A: Serialize>(&self, method_id: u32, args: A) -> Result<(), RpcError> {
        let s = &*self.shared;
        let payload = s.settings.format.encode_message(&args)?;
        let id = s.next_id();
        s.counters.calls_out.fetch_add(1, Ordering::Relaxed);
        s.send(Kind::OneWay, id, method_id, payload)
    }

    /// Starts a streaming call; items arrive on the returned stream under flow control.
    pub fn call_stream<A, T>(&self, method_id: u32, args: A) -> Result<ClientStream<T>, RpcError>
    where
        A: Serialize,
        T: DeserializeOwned,
    {
        let s = &self.shared;
        let payload = s.settings.format.encode_message(&args)?;
        let id = s.next_id();
        let (tx, rx) = mpsc::unbounded_channel();
        let buffered = Arc::new(std::sync::atomic::AtomicU32::new(0));
        s.register(id, Pending::Stream(tx, buffered.clone()))?;
        if let Err(e) = s.send(Kind::Call, id, method_id, payload) {
            s.pending.lock().remove(&id);
            return Err(e);
        }
        s.counters.calls_out.fetch_add(1, Ordering::Relaxed);
        Ok(ClientStream::new(s.clone(), id, rx, buffered))
    }

    /// Makes a call whose method takes an upload: `args` is the tuple of the other
    /// arguments, `items` the stream sent alongside, under the callee's credits. The reply
    /// may come before the upload ends (the handler stopped reading); the rest of the
    /// upload is then dropped. Dropping the future cancels the call.
    pub async fn call_upload<A, T, R, S>(
        &self,
        method_id: u32,
        args: A,
        items: S,
        opts: CallOptions,
    ) -> Result<R, RpcError>
    where
        A: Serialize,
        T: Serialize + 'static,
        R: DeserializeOwned,
        S: futures::Stream<Item = T> + Send + 'static,
    {
        let s = &*self.shared;
        let format = s.settings.format;
        let payload = format.encode_message(&args)?;
        drop(args);
        let id = s.next_id();
        let credits = {
            let mut uploads = s.uploads.lock();
            // With zero-RTT before the answer, the window is unknown: the answer grants it.
            let window = if s.remote.known.load(Ordering::Acquire) {
                s.remote.window.load(Ordering::Relaxed) as usize
            } else {
                0
            };
            let credits = Arc::new(Semaphore::new(window));
            uploads.insert(id, credits.clone());
            credits
        };
        let _upload = UploadGuard { shared: s, id };
        let (rx, mut guard) = s.start_unary(id, method_id, payload)?;
        let mut items = crate::service::item_stream(Box::pin(items));
        let sending = async {
            pump(s, id, true, &mut items, &credits).await?;
            s.send_stream(Kind::StreamEnd, true, id, Bytes::new())
        };
        let exchange = async {
            let mut sending = std::pin::pin!(sending);
            let mut rx = rx;
            let mut sent = false;
            loop {
                tokio::select! {
                    reply = &mut rx => return reply.map_err(|_| self.shared.closed_error())?,
                    r = &mut sending, if !sent => {
                        sent = true;
                        // An item that does not encode ends the call (the guard cancels it).
                        r?;
                    }
                }
            }
        };
        let reply = s.within_deadline(opts, exchange).await;
        if reply.is_ok() {
            guard.armed = false;
        }
        format.decode_bytes(reply?)
    }

    /// A number that identifies this end of the connection among all of this process's
    /// connection ends (every clone of this handle shares it): a key for per-connection
    /// state kept outside the connection.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// Who the other side authenticated as (on the accepting side), if anyone.
    pub fn identity(&self) -> Option<&Identity> {
        self.shared.identity.as_ref()
    }

    /// The serde format of this connection.
    pub fn format(&self) -> Format {
        self.shared.settings.format
    }

    /// The largest payload the other side accepts. With zero-RTT, until the other side's
    /// answer arrives, the size sent without waiting for it (64 KiB).
    pub fn remote_max_message_size(&self) -> u32 {
        self.shared.remote.max.load(Ordering::Relaxed)
    }

    /// Closes the connection, telling the other side why.
    pub fn close(&self) {
        self.shared
            .shutdown(RpcError::disconnected("closed by this side"), true);
    }

    /// Why the connection closed, or `None` while it is open.
    pub fn close_reason(&self) -> Option<RpcError> {
        self.shared.closed_reason()
    }

    /// Waits until the connection is closed and returns why.
    pub async fn closed(&self) -> RpcError {
        let mut rx = self.shared.closed.subscribe();
        loop {
            if let Some(r) = rx.borrow_and_update().clone() {
                return r;
            }
            if rx.changed().await.is_err() {
                return RpcError::disconnected("connection dropped");
            }
        }
    }

    /// Like [`closed`](Self::closed), but the future does not hold this handle: waiting on
    /// it does not keep the connection open when every handle is dropped.
    pub fn when_closed(&self) -> impl Future<Output = RpcError> + Send + 'static {
        let mut rx = self.shared.closed.subscribe();
        async move {
            loop {
                if let Some(r) = rx.borrow_and_update().clone() {
                    return r;
                }
                if rx.changed().await.is_err() {
                    return RpcError::disconnected("connection dropped");
                }
            }
        }
    }

    /// A snapshot of this connection's counters.
    pub fn stats(&self) -> Stats {
        let c = &self.shared.counters;
        Stats {
            calls_out: c.calls_out.load(Ordering::Relaxed),
            calls_in: c.calls_in.load(Ordering::Relaxed),
            errors_in: c.errors_in.load(Ordering::Relaxed),
            bytes_out: c.bytes_out.load(Ordering::Relaxed),
            bytes_in: c.bytes_in.load(Ordering::Relaxed),
            in_flight_in: self.shared.inbound.lock().len() as u64,
        }
    }

    /// Starts the reader and writer tasks of a connection whose handshake is done.
    pub(crate) fn start<R, W>(
        (rd, due): (R, Option<Due>),
        wr: W,
        leftover: BytesMut,
        settings: Settings,
        registry: Arc<Registry>,
        role: Role,
    ) -> Peer
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (peer, reader) = Self::start_writer((rd, due), wr, leftover, settings, registry, role);
        tokio::spawn(reader);
        peer
    }

    /// Like [`start`](Self::start), but hands back the reader's future for the caller to
    /// run: a server's connection task reads on, instead of spawning a reader and waking
    /// it for the frames already received.
    pub(crate) fn start_writer<R, W>(
        (rd, due): (R, Option<Due>),
        wr: W,
        leftover: BytesMut,
        settings: Settings,
        registry: Arc<Registry>,
        role: Role,
    ) -> (Peer, impl Future<Output = ()> + Send + 'static)
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        let (identity, owned, early, answer) = match role {
            Role::Accepting { identity, answer } => (identity, false, None, answer),
            Role::Connecting { early } => (None, true, early, Vec::new()),
        };
        let remote = Remote {
            max: AtomicU32::new(settings.remote_max),
            window: AtomicU32::new(settings.remote_window),
            compression: AtomicU8::new(settings.send_compression as u8),
            known: AtomicBool::new(early.is_none()),
        };
        let early = early.map(Mutex::new);
        let high_water = high_water(settings.local_max, settings.remote_max);
        let wr: Box<dyn AsyncWrite + Send + Unpin> = Box::new(wr);
        static NEXT_CONNECTION: AtomicU64 = AtomicU64::new(1);
        let writer = WriterStart {
            started: AtomicBool::new(false),
            start: Mutex::new(Some((rx, tokio::runtime::Handle::current()))),
        };
        let shared = Arc::new_cyclic(|me| Shared {
            writer,
            me: me.clone(),
            id: NEXT_CONNECTION.fetch_add(1, Ordering::Relaxed),
            out: tx,
            pending: Mutex::default(),
            uploads: Mutex::default(),
            inbound: Mutex::default(),
            next_id: AtomicU64::new(1),
            settings,
            remote,
            early,
            io: Mutex::new(WriteSide {
                wr,
                corked: !answer.is_empty(),
                carry: answer,
            }),
            backlog: AtomicUsize::new(0),
            registry,
            identity,
            closed: watch::Sender::new(None),
            failure: std::sync::OnceLock::new(),
            queued: AtomicUsize::new(0),
            high_water: AtomicUsize::new(high_water),
            drained: Notify::new(),
            counters: Counters::default(),
            stream_batch: AtomicUsize::new(MIN_BATCH),
        });
        let reader = read_loop(shared.clone(), rd, due, leftover);
        let owner = owned.then(|| Arc::new(Owner(shared.clone())));
        let peer = Peer {
            shared,
            _owner: owner,
        };
        (peer, reader)
    }

    fn unowned(shared: Arc<Shared>) -> Peer {
        Peer {
            shared,
            _owner: None,
        }
    }
}

/// The writer task: coalesces queued frames into few writes, after what senders of lone
/// frames left in `carry`.
async fn write_loop(shared: Arc<Shared>, mut rx: mpsc::UnboundedReceiver<Out>) {
    let mut wr = Locked(&shared.io);
    // Grown as batches need (up to about `BATCH`), not allocated at full size: most
    // connections write little, and freeing a 64 KiB buffer per connection made glibc give
    // the memory back to the kernel each time (an `madvise` and a TLB shootdown, which
    // interrupts the other cores: counted with `strace -c` on `examples/connect`).
    let mut buf: Vec<u8> = Vec::with_capacity(SMALL_BATCH);
    let stall = shared.settings.write_stall_timeout;
    let result: Result<(), RpcError> = async {
        while let Some(first) = rx.recv().await {
            let mut written_payload = 0usize;
            let mut items = 1;
            let mut stop = match append(&mut buf, first, &mut written_payload) {
                None => false,
                Some(m) => push(&mut wr, &mut buf, m, &mut written_payload, stall).await?,
            };
            let mut yielded = false;
            while !stop {
                match rx.try_recv() {
                    Ok(m) => {
                        items += 1;
                        if let Some(m) = append(&mut buf, m, &mut written_payload) {
                            stop = push(&mut wr, &mut buf, m, &mut written_payload, stall).await?;
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
            flush(&mut wr, &mut buf, stall).await?;
            shared
                .counters
                .bytes_out
                .fetch_add(written_payload as u64, Ordering::Relaxed);
            shared.queued.fetch_sub(written_payload, Ordering::Relaxed);
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
    .await;
    if let Err(e) = result {
        shared.shutdown(e, false);
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
                Box::pin(push(wr, buf, *close, written, stall)).await?;
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

async fn read_loop<R: AsyncRead + Unpin>(
    shared: Arc<Shared>,
    mut rd: R,
    due: Option<Due>,
    mut buf: BytesMut,
) {
    let mut closed = shared.closed.subscribe();
    let tick = shared
        .settings
        .keepalive_interval
        .or(shared.settings.idle_timeout);
    let mut ticker = tick.map(|d| {
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + d, d);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    let mut last_recv = tokio::time::Instant::now();
    let max = shared.settings.local_max;
    // Zero-RTT: the other side's first frame is its answer to the `Hello`, due in time.
    let mut awaiting_answer = shared.early.is_some();
    let mut uncork = true;
    let answer_within = shared.early.as_ref().map(|e| e.lock().within);
    let mut answer_due = answer_within.map(|d| Box::pin(tokio::time::sleep(d)));
    let mut large: Option<Large> = None;
    let mut buffers = ReadBuffers::default();
    // The low-water mark asked of the socket, and whether it must wake at every byte.
    let (mut marked, mut every_byte) = (0u32, false);
    let reason = 'conn: loop {
        if let Some(l) = large.take_if(|l| l.rest() == 0) {
            let h = l.header;
            if let Err(e) = route(&shared, h, l.finish(), true).await {
                break 'conn (e, true);
            }
        }
        // Route every complete frame in the buffer before reading more.
        while large.is_none() {
            match Header::decode(&buf, max) {
                Ok(Some((h, head_len))) => {
                    let total = head_len + h.len as usize;
                    if buf.len() < total {
                        if h.len as usize >= LARGE_FRAME && !awaiting_answer {
                            // The rest of a large frame goes straight into a buffer of
                            // its own, which its decoded blobs then share.
                            buf.advance(head_len);
                            large = Some(Large::start(h, &buf));
                            buf.clear();
                        } else {
                            buf.reserve(total - buf.len());
                        }
                        break;
                    }
                    let mut frame = buf.split_to(total);
                    frame.advance(head_len);
                    if awaiting_answer {
                        if let Err(e) = take_handshake_answer(&shared, h, &frame) {
                            break 'conn (e, true);
                        }
                        awaiting_answer = false;
                        continue;
                    }
                    // The last frame of a read (or one that came with the `Hello`, whose
                    // answers are gathered) may be answered with a write of its own.
                    let lone = buf.is_empty() || uncork;
                    if let Err(e) = route(&shared, h, frame.freeze(), lone).await {
                        break 'conn (e, true);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    let code = match e {
                        crate::frame::FrameError::TooLarge { .. } => ErrorCode::TooLarge,
                        _ => ErrorCode::Protocol,
                    };
                    break 'conn (RpcError::new(code, e.to_string()), true);
                }
            }
        }
        // The frames that came with the `Hello` are routed: the accepting side's answers
        // to them go out with its `HelloAck` (a no-op on the connecting side).
        if uncork {
            uncork = false;
            shared.uncork();
        }
        if large.is_none() && buf.capacity() - buf.len() < 4096 {
            buf.reserve(buffers.size());
        }
        // While a large frame arrives, the socket need not wake this task before a good part
        // of its rest is queued (see `Due`); after a keep-alive tick, it wakes at every byte
        // until some arrive, so that a slow sender is not taken for a dead one.
        let mark = match &large {
            Some(l) if !every_byte => l.low_mark(),
            _ => 0,
        };
        if mark != marked {
            if let Some(due) = &due {
                due.set(mark);
                marked = mark;
            }
        }
        tokio::select! {
            r = read_some(&mut rd, &mut buf, large.as_mut()) => match r {
                Ok(0) => break (RpcError::disconnected("the other side closed the connection"), false),
                Ok(n) => {
                    if large.is_none() {
                        buffers.read(n);
                    }
                    shared.counters.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
                    last_recv = tokio::time::Instant::now();
                    every_byte = false;
                }
                Err(e) => break (RpcError::disconnected(e.to_string()), false),
            },
            _ = closed.changed() => return,
            _ = async { answer_due.as_mut().expect("zero-RTT").await }, if awaiting_answer => {
                let within = answer_within.unwrap_or_default();
                break (RpcError::disconnected(format!("no handshake answer within {within:?}")), false);
            }
            _ = async { ticker.as_mut().expect("ticker").tick().await }, if ticker.is_some() => {
                if let Some(idle) = shared.settings.idle_timeout {
                    // Not while the socket held wake-ups back: bytes may have come unseen.
                    if marked == 0 && last_recv.elapsed() >= idle {
                        break (RpcError::disconnected(format!("nothing received for {idle:?}: the other side looks dead")), true);
                    }
                    every_byte = true;
                }
                if shared.settings.keepalive_interval.is_some() {
                    let _ = shared.send(Kind::Ping, 0, 0, Bytes::new());
                }
            }
        }
    };
    shared.shutdown(reason.0, reason.1);
}

/// How much the reader reserves when its buffer is full.
///
/// Frames are split off the read buffer and handed on without a copy, so a buffer's memory
/// lives until the last of its frames is dropped, often on another thread; glibc then takes
/// the arena's lock and may give the memory back to the kernel (`madvise`), to be faulted in
/// again by the next buffer. A connection whose reads come in bulk reads into 256 KiB
/// buffers instead of 64 KiB: a quarter of the buffers to allocate and free, and fewer frames
/// cut in two (whose start is copied to the next buffer). Streaming 100-byte items
/// (`examples/streams 16 100`, medians of six runs in turns): 19.6M -> 20.4M items/s,
/// `madvise` calls halved. A quiet connection keeps the small buffer.
#[derive(Default)]
struct ReadBuffers {
    /// Short reads in a row since the last long one.
    calm: u32,
    busy: bool,
}

/// A read at least this long makes a connection busy.
const BUSY_READ: usize = 32 * 1024;
/// The read buffer of a busy connection.
const BUSY_BUFFER: usize = 256 * 1024;
/// Short reads in a row after which a busy connection is quiet again.
const CALM_READS: u32 = 16;

impl ReadBuffers {
    /// Counts a read of `n` bytes.
    fn read(&mut self, n: usize) {
        if n >= BUSY_READ {
            self.busy = true;
            self.calm = 0;
        } else if self.busy {
            self.calm += 1;
            if self.calm >= CALM_READS {
                self.busy = false;
            }
        }
    }

    /// What a full buffer reserves.
    fn size(&self) -> usize {
        if self.busy {
            BUSY_BUFFER
        } else {
            BATCH
        }
    }
}

/// Frames at least this long are read into a buffer of their own (see [`Large`]).
const LARGE_FRAME: usize = 1 << 20;

/// A large frame's payload while it arrives: read straight into a buffer of its length,
/// never past its end, so that the frames after it start a new read buffer.
struct Large {
    header: Header,
    payload: Vec<u8>,
}

impl Large {
    /// `got`: the start of the payload, already read.
    fn start(header: Header, got: &[u8]) -> Self {
        let mut payload = Vec::with_capacity(header.len as usize);
        payload.extend_from_slice(got);
        Self { header, payload }
    }

    /// The bytes of the frame still to come.
    fn rest(&self) -> usize {
        self.header.len as usize - self.payload.len()
    }

    fn finish(self) -> Bytes {
        Bytes::from(self.payload)
    }

    /// The bytes to ask the socket to wait for before it wakes the reader: [`LOW_MARK`]
    /// while at least that much of the frame is due, else 0 (wake at every byte), so that
    /// the mark changes twice per frame, not at every read.
    fn low_mark(&self) -> u32 {
        if self.rest() >= LOW_MARK {
            LOW_MARK as u32
        } else {
            0
        }
    }
}

/// The receive low-water mark of a large frame's reads. Measured with `examples/payload`
/// (10 MiB echoed, in turns): 128 KiB to 2 MiB all beat waking at every segment, 512 KiB
/// best (median of ten 1-second runs: 1,141 MB/s against 942); at 4 MiB (the send
/// buffer's size) the gain is gone.
const LOW_MARK: usize = 512 * 1024;

/// Reads into the large frame's buffer while one arrives, else into the read buffer.
async fn read_some<R: AsyncRead + Unpin>(
    rd: &mut R,
    buf: &mut BytesMut,
    large: Option<&mut Large>,
) -> io::Result<usize> {
    match large {
        Some(l) => {
            let rest = l.rest();
            rd.read_buf(&mut bytes::BufMut::limit(&mut l.payload, rest))
                .await
        }
        None => rd.read_buf(buf).await,
    }
}

/// Zero-RTT: takes the answer to this side's `Hello`. A refusal (`Close`) fails the calls
/// made meanwhile with the other side's reason and code (`Unauthenticated`...).
fn take_handshake_answer(s: &Shared, h: Header, payload: &[u8]) -> Result<(), RpcError> {
    if h.compression != Compression::None {
        return Err(RpcError::protocol("compressed handshake frame"));
    }
    match h.kind {
        Kind::HelloAck => s.hello_acked(&crate::handshake::Hello::decode(payload)?),
        Kind::Close => {
            let reason = RpcError::from_payload(payload);
            let e = RpcError::new(
                reason.code(),
                format!(
                    "the other side refused the connection: {}",
                    reason.message()
                ),
            );
            s.shutdown_failing(e.clone(), false, e.clone());
            Err(e)
        }
        k => Err(RpcError::protocol(format!("expected HelloAck, got {k:?}"))),
    }
}

/// Handles one received frame. An `Err` closes the connection with that reason.
/// `lone`: whether an answer sent at once may be written by this task (see [`WriteSide`]).
async fn route(
    shared: &Arc<Shared>,
    h: Header,
    payload: Bytes,
    lone: bool,
) -> Result<(), RpcError> {
    let s = &**shared;
    let payload = if h.compression == Compression::None {
        payload
    } else {
        codec::decompress(h.compression, payload, s.settings.local_max)?
    };
    match h.kind {
        Kind::Call | Kind::OneWay => {
            wait_for_room(s).await;
            start_call(shared, h, payload, lone);
        }
        Kind::Ok | Kind::Error => {
            if h.kind == Kind::Error {
                s.counters.errors_in.fetch_add(1, Ordering::Relaxed);
            }
            // An unknown id is a reply to a call this side already gave up on. The lock is
            // let go before the caller is woken: it may run at once on another thread and
            // take the lock itself (to make its next call, or to close the connection).
            let pending = s.pending.lock().remove(&h.call_id);
            if let Some(p) = pending {
                let r = if h.kind == Kind::Ok {
                    Ok(payload)
                } else {
                    Err(RpcError::from_payload(&payload))
                };
                match p {
                    Pending::Unary(tx) => drop(tx.send(r)),
                    Pending::Stream(tx, _) => drop(tx.send(match r {
                        Ok(_) => crate::stream::Event::Failed(RpcError::protocol(
                            "an Ok frame answered a streaming call",
                        )),
                        Err(e) => crate::stream::Event::Failed(e),
                    })),
                }
            }
        }
        Kind::StreamItem | Kind::StreamBatch => {
            let count = if h.kind == Kind::StreamItem {
                1
            } else {
                crate::frame::batch_len(&payload)
                    .map_err(|e| RpcError::protocol(format!("stream {}: {e}", h.call_id)))?
            };
            let window = s.settings.local_window;
            let deliver = |tx: &mpsc::UnboundedSender<crate::stream::Event>,
                           buffered: &std::sync::atomic::AtomicU32|
             -> Result<(), RpcError> {
                let before = buffered.fetch_add(count, Ordering::Relaxed);
                if before.saturating_add(count) > window {
                    return Err(RpcError::protocol(format!(
                        "stream {} sent more than its window of {window} items",
                        h.call_id
                    )));
                }
                let _ = tx.send(if h.kind == Kind::StreamItem {
                    crate::stream::Event::Item(payload)
                } else {
                    crate::stream::Event::Batch(payload)
                });
                Ok(())
            };
            // An unknown id is a stream this side gave up on (or a finished call).
            if h.upload {
                if let Some((tx, buffered)) = s
                    .inbound
                    .lock()
                    .get(&h.call_id)
                    .and_then(|i| i.upload.as_ref())
                {
                    deliver(tx, buffered)?;
                }
            } else if let Some(Pending::Stream(tx, buffered)) = s.pending.lock().get(&h.call_id) {
                deliver(tx, buffered)?;
            }
        }
        Kind::StreamEnd if h.upload => {
            let upload = s
                .inbound
                .lock()
                .get_mut(&h.call_id)
                .and_then(|i| i.upload.take());
            if let Some((tx, _)) = upload {
                let _ = tx.send(crate::stream::Event::End);
            }
        }
        Kind::StreamEnd => {
            let pending = s.pending.lock().remove(&h.call_id);
            if let Some(Pending::Stream(tx, _)) = pending {
                let _ = tx.send(crate::stream::Event::End);
            }
        }
        Kind::Cancel => {
            let inbound = s.inbound.lock().remove(&h.call_id);
            if let Some(i) = inbound {
                i.abort.abort();
            }
        }
        Kind::StreamAck => {
            let Ok(n) = <[u8; 4]>::try_from(&payload[..]) else {
                return Err(RpcError::protocol("stream ack payload is not 4 bytes"));
            };
            let n = u32::from_le_bytes(n) as usize;
            // For an upload, the callee returns credits of a call this side made.
            let credits = if h.upload {
                s.uploads.lock().get(&h.call_id).cloned()
            } else {
                s.inbound
                    .lock()
                    .get(&h.call_id)
                    .and_then(|i| i.credits.clone())
            };
            if let Some(c) = credits {
                // Never more credits than the window, whatever the other side claims.
                let room = (s.remote.window.load(Ordering::Relaxed) as usize)
                    .saturating_sub(c.available_permits());
                c.add_permits(n.min(room));
            }
        }
        Kind::Ping => {
            wait_for_room(s).await;
            s.send(Kind::Pong, 0, 0, payload)?;
        }
        Kind::Pong => {}
        Kind::Close => {
            let reason = RpcError::from_payload(&payload);
            let e = RpcError::new(
                reason.code(),
                format!("closed by the other side: {}", reason.message()),
            );
            // The other side is gone: no point answering its Close with ours.
            s.shutdown(e.clone(), false);
            return Err(e);
        }
        Kind::Hello | Kind::HelloAck => {
            return Err(RpcError::protocol("handshake frame after the handshake"));
        }
    }
    Ok(())
}

/// Queued bytes above which the reader stops taking new calls: room for the largest
/// message either way, twice, and at least 16 MiB.
fn high_water(local_max: u32, remote_max: u32) -> usize {
    (local_max as usize)
        .max(remote_max as usize)
        .saturating_mul(2)
        .max(16 << 20)
}

/// Backpressure for frames that make this side write (calls, pings): a peer that keeps
/// sending them but stops reading stalls here instead of growing the writer's queue.
async fn wait_for_room(s: &Shared) {
    while s.queued.load(Ordering::Relaxed) > s.high_water.load(Ordering::Relaxed) {
        let drained = s.drained.notified();
        if s.queued.load(Ordering::Relaxed) <= s.high_water.load(Ordering::Relaxed)
            || s.closed_reason().is_some()
        {
            break;
        }
        drained.await;
    }
}

fn start_call(shared: &Arc<Shared>, h: Header, args: Bytes, lone: bool) {
    let s = &**shared;
    let id = h.call_id;
    let reply = h.kind == Kind::Call;
    let fail = |e: RpcError| {
        if reply {
            let _ = s.send_lone(Kind::Error, id, 0, Bytes::from(e.to_payload()), lone);
        }
    };
    let Some(entry) = s.registry.get(h.method_id) else {
        return fail(RpcError::new(
            ErrorCode::UnknownMethod,
            format!("no method with id {:#010x}", h.method_id),
        ));
    };
    let inbound = s.inbound.lock();
    if inbound.len() >= s.settings.max_inbound as usize {
        drop(inbound);
        return fail(RpcError::new(
            ErrorCode::Overloaded,
            format!(
                "{} calls already running on this connection",
                s.settings.max_inbound
            ),
        ));
    }
    if inbound.contains_key(&id) {
        drop(inbound);
        return fail(RpcError::protocol(format!(
            "call id {id} is already running"
        )));
    }
    s.counters.calls_in.fetch_add(1, Ordering::Relaxed);
    // A method that takes an upload reads it through its call context.
    let (upload, upload_rx) = if entry.kind == MethodKind::Upload {
        let (tx, rx) = mpsc::unbounded_channel();
        let buffered = Arc::new(std::sync::atomic::AtomicU32::new(0));
        (Some((tx, buffered.clone())), Some((rx, buffered)))
    } else {
        (None, None)
    };
    // Shared by the contexts made below (inline poll, then the task if it waits).
    let upload_slot = upload_rx.map(|u| Arc::new(parking_lot::Mutex::new(Some(u))));
    let context = || CallContext {
        peer: Peer::unowned(shared.clone()),
        call_id: id,
        method_id: h.method_id,
        upload: upload_slot.clone(),
    };
    let span = tracing::debug_span!("rpc.serve", call_id = id, method_id = h.method_id);
    // Unlocked while the handler runs inline: a handler may look at this connection.
    drop(inbound);
    let response = entry.service.call(entry.index, args, s.settings.format);
    let (credits, task) = match response {
        Response::Unary(fut) => {
            // Most handlers finish without waiting: answering inline saves a task spawn and
            // a wake-up per call (and, polled here in a synchronous scope, an allocation).
            // One that waits is polled again by its task, which registers the real waker.
            let mut fut = Some(fut);
            let polled = {
                let _entered = span.enter();
                let mut cx = std::task::Context::from_waker(futures::task::noop_waker_ref());
                CONTEXT.sync_scope(context(), || {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        fut.as_mut()
                            .expect("not yet dropped")
                            .as_mut()
                            .poll(&mut cx)
                    }));
                    if !matches!(r, Ok(std::task::Poll::Pending)) {
                        // Finished or panicked: dropped here, where its `Drop` still sees
                        // the call's context.
                        let done = fut.take();
                        let _ =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(done)));
                    }
                    r
                })
            };
            match polled {
                Ok(std::task::Poll::Ready(r)) => return answer(s, id, reply, Ok(r), lone),
                Err(panic) => return answer(s, id, reply, Err(panic), lone),
                Ok(std::task::Poll::Pending) => {}
            }
            let fut = fut.expect("pending, so not dropped");
            let fut = CONTEXT.scope(context(), std::panic::AssertUnwindSafe(fut).catch_unwind());
            let sh = shared.clone();
            let task = async move {
                let r = fut.await;
                // Whoever removes the entry owns the answer: if `Cancel` got it first,
                // the caller no longer waits.
                if sh.inbound.lock().remove(&id).is_some() {
                    answer(&sh, id, reply, r, false);
                }
            };
            (None, task.boxed())
        }
        Response::Stream(fut) => {
            let credits = Arc::new(Semaphore::new(
                s.remote.window.load(Ordering::Relaxed) as usize
            ));
            let c = credits.clone();
            let sh = shared.clone();
            let task = async move {
                let end = std::panic::AssertUnwindSafe(produce(&sh, id, fut, &c))
                    .catch_unwind()
                    .await
                    .unwrap_or_else(|_| {
                        Err(RpcError::new(ErrorCode::Internal, "the handler panicked"))
                    });
                if sh.inbound.lock().remove(&id).is_some() {
                    let _ = match end {
                        Ok(()) => sh.send(Kind::StreamEnd, id, 0, Bytes::new()),
                        Err(e) => sh.send(Kind::Error, id, 0, Bytes::from(e.to_payload())),
                    };
                }
            };
            (Some(credits), CONTEXT.scope(context(), task).boxed())
        }
    };
    debug_assert!(entry.kind != MethodKind::Stream || credits.is_some());
    // Spawned while holding the table's lock so that the task, which removes its own
    // entry when done, always finds it there. Only this reader inserts, so the checks
    // made above still hold.
    let mut inbound = s.inbound.lock();
    let handle = tokio::spawn(task.instrument(span));
    inbound.insert(
        id,
        Inbound {
            abort: handle.abort_handle(),
            credits,
            upload,
        },
    );
}

/// Sends a unary call's answer (nothing for a one-way call).
/// `lone`: see [`route`].
fn answer(
    s: &Shared,
    id: u64,
    reply: bool,
    r: std::thread::Result<Result<Message, RpcError>>,
    lone: bool,
) {
    if !reply {
        return;
    }
    let r = r.unwrap_or_else(|_| Err(RpcError::new(ErrorCode::Internal, "the handler panicked")));
    let sent = match r {
        Ok(bytes) => s.send_lone(Kind::Ok, id, 0, bytes, lone),
        Err(e) => s.send_lone(Kind::Error, id, 0, Bytes::from(e.to_payload()), lone),
    };
    if let Err(e) = sent {
        let _ = s.send(Kind::Error, id, 0, Bytes::from(e.to_payload()));
    }
}

/// Pulls a streaming handler's items under flow control and sends them in batches: the
/// items that are ready together, up to `STREAM_BATCH` bytes, go out as one `StreamBatch`
/// (a lone item as a `StreamItem`), encoded straight into the frame's payload.
async fn produce(
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
async fn pump(
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
const MIN_BATCH: usize = 256;

/// Items of one stream waiting to be sent, each as `length (varint) · item`.
struct Batch {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_reads_into_big_buffers_while_its_reads_come_in_bulk() {
        let mut b = ReadBuffers::default();
        assert_eq!(b.size(), BATCH, "quiet at first");
        b.read(BUSY_READ - 1);
        assert_eq!(b.size(), BATCH, "a short read changes nothing");
        b.read(BUSY_READ);
        assert_eq!(b.size(), BUSY_BUFFER);
        for _ in 1..CALM_READS {
            b.read(100);
        }
        assert_eq!(
            b.size(),
            BUSY_BUFFER,
            "busy until enough short reads in a row"
        );
        b.read(BUSY_READ);
        for _ in 1..CALM_READS {
            b.read(100);
        }
        assert_eq!(b.size(), BUSY_BUFFER, "a long read starts the count again");
        b.read(100);
        assert_eq!(b.size(), BATCH, "quiet again");
    }
}
