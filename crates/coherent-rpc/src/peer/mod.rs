//! One connection after its handshake: the call tables, the single writer task that
//! coalesces queued frames into few socket writes (lone frames are written by their
//! senders), the single reader task that routes each frame, and the `Peer` handle through
//! which both sides make calls.
//!
//! This file owns the connection's state, `Shared`: the settings agreed in the handshake,
//! what the other side announced (`Remote`), the call tables (`pending`: this side's calls
//! waiting for their answer; `uploads`: the credits of this side's uploads; `inbound`: the
//! other side's calls running here), the counters, and the close (`shutdown`: once, the
//! failure set before the reason, then every waiting caller failed and every running
//! handler aborted). It also owns the `Peer` handle: its calls (`call*`), what it tells
//! (`stats`, `close_reason`...) and the start of a connection (`Peer::start`).
//!
//! Invariants: a call registered after the close fails at once (`register` checks the
//! failure after inserting; `shutdown` sets it before draining the table); a reply is
//! delivered by whoever removes the call's `pending` entry, and by no one else.
//!
//! The rest, by task:
//! - `writer`: how an encoded frame reaches the transport (the writer task and its
//!   batching, lone frames written by their senders, the cork, the queue's bound);
//! - `early`: zero-RTT, frames held until the other side's `HelloAck`;
//! - `reader`: the reader task, which reads frames and routes them;
//! - `serve`: running the other side's calls and answering them;
//! - `streams`: sending a stream's items in batches under the receiver's credits.

mod early;
mod reader;
mod serve;
mod streams;
mod totals;
mod writer;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use std::future::Future;

use parking_lot::Mutex;
use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot, watch, Notify, Semaphore};
use tokio::task::AbortHandle;

use crate::codec::{Format, Message};
use crate::config::Trust;
use crate::error::{ErrorCode, RpcError};
use crate::frame::{Compression, Kind};
use crate::net::Due;
use crate::service::{Identity, Registry};
use crate::stream::ClientStream;

pub(crate) use early::{Early, EARLY_MAX};
pub use totals::EndpointStats;
pub(crate) use totals::{Slot, Totals};
pub(crate) use writer::{encode, Out};

use reader::read_loop;
use streams::{pump, MIN_BATCH};
use writer::{WriteSide, WriterStart};

/// Settings agreed in the handshake, fixed for the connection's life.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) format: Format,
    pub(crate) send_compression: Compression,
    pub(crate) compression_threshold: usize,
    pub(crate) local_max: u32,
    pub(crate) remote_max: u32,
    pub(crate) max_inbound: u32,
    /// Queued bytes above which the reader stops taking new work (`Config::queue_mark`):
    /// this side's own setting, never the other side's.
    pub(crate) max_queued: usize,
    pub(crate) local_window: u32,
    pub(crate) remote_window: u32,
    pub(crate) keepalive_interval: Option<Duration>,
    pub(crate) idle_timeout: Option<Duration>,
    pub(crate) write_stall_timeout: Duration,
    pub(crate) call_timeout: Option<Duration>,
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
    /// Bytes queued for sending now (see [`Config::max_queued_bytes`]).
    ///
    /// [`Config::max_queued_bytes`]: crate::Config::max_queued_bytes
    pub queued_bytes: u64,
    /// The most bytes queued for sending at once.
    pub queued_bytes_peak: u64,
}

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
        trust: Trust,
        answer: Vec<u8>,
        slot: Slot,
        pacing: Pacing,
    },
}

/// The rates an accepted connection's calls are held to (see [`crate::pace`]): its own,
/// and the one it shares with the other connections of its address. Neither on a trusted
/// connection.
#[derive(Default)]
pub(crate) struct Pacing {
    pub(crate) own: Option<crate::pace::Pacer>,
    pub(crate) shared: Option<crate::pace::Pacer>,
}

impl Pacing {
    /// Whether there is a pacer: checked before [`wait`](Self::wait), so that a trusted
    /// connection's call pays one branch for it.
    #[inline]
    pub(crate) fn is_on(&self) -> bool {
        self.own.is_some() || self.shared.is_some()
    }

    /// Takes a call from each pacer of `s`, and waits for the longer of what they ask
    /// (counted in `calls_paced`); `false` if the connection closed before or meanwhile.
    pub(crate) async fn wait(&self, s: &Shared) -> bool {
        let own = self.own.as_ref().map_or(Duration::ZERO, |p| p.delay());
        let shared = self.shared.as_ref().map_or(Duration::ZERO, |p| p.delay());
        let wait = own.max(shared);
        if !wait.is_zero() {
            s.totals
                .refusals()
                .calls_paced
                .fetch_add(1, Ordering::Relaxed);
            let mut closed = s.closed.subscribe();
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                _ = closed.wait_for(Option::is_some) => return false,
            }
        }
        s.closed_reason().is_none()
    }
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
    trust: Trust,
    closed: watch::Sender<Option<RpcError>>,
    /// What calls fail with once the connection is closed (set with `closed`).
    failure: std::sync::OnceLock<RpcError>,
    /// Bytes handed to the writer and not yet written: the reader stops taking new
    /// calls above `settings.max_queued` so that a peer that stops reading cannot grow
    /// this queue. Counted in the endpoint's `Totals` too, for its budget.
    queued: AtomicUsize,
    queued_peak: AtomicUsize,
    drained: Notify,
    /// The last liveness ping sent ([`Peer::ping`]) and the highest one answered: pongs
    /// come back in order, so each ping waits for the answered number to reach its own.
    pings_sent: AtomicU64,
    pings_answered: AtomicU64,
    pong: Notify,
    /// An accepted connection's place under the endpoint's `max_connections`, given back
    /// when it closes.
    slot: Mutex<Option<Slot>>,
    /// The rates this connection's calls are held to (untrusted connections only).
    pub(crate) pacing: Pacing,
    counters: Counters,
    /// What a new stream's first batch reserves: what the last stream's batches did (see
    /// [`Batch::capacity`]). Growing each stream's first batch from a few hundred bytes
    /// took a `realloc` at every doubling, and glibc's arena lock with it, which the
    /// writer's thread freeing sent batches contends for.
    ///
    /// [`Batch::capacity`]: streams::Batch::capacity
    stream_batch: AtomicUsize,
    /// The endpoint's counters over all its connections (this one's counts join its
    /// closed total when this is dropped).
    totals: Arc<Totals>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        if self.closed.borrow().is_none() {
            // Never shut down (its tasks were dropped with their runtime).
            self.totals.closing();
        }
        self.totals.close(self.id, self.stats());
    }
}

impl Shared {
    /// This connection's counters now.
    fn stats(&self) -> Stats {
        let c = &self.counters;
        Stats {
            calls_out: c.calls_out.load(Ordering::Relaxed),
            calls_in: c.calls_in.load(Ordering::Relaxed),
            errors_in: c.errors_in.load(Ordering::Relaxed),
            bytes_out: c.bytes_out.load(Ordering::Relaxed),
            bytes_in: c.bytes_in.load(Ordering::Relaxed),
            in_flight_in: self.inbound.lock().len() as u64,
            queued_bytes: self.queued.load(Ordering::Relaxed) as u64,
            queued_bytes_peak: self.queued_peak.load(Ordering::Relaxed) as u64,
        }
    }

    fn is_closed(&self) -> bool {
        self.failure.get().is_some()
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
        self.totals.closing();
        drop(self.slot.lock().take());
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

    /// Closes the connection for `reason` and drops what its writer has queued instead of
    /// writing it: the endpoint's budget needs the memory back now, and the other side is
    /// not reading it anyway. The reason is this side's only: a `Close` would wait behind
    /// the unread bytes.
    pub(super) fn abandon(&self, reason: RpcError) {
        self.shutdown(reason, false);
        self.writer.abandon.notify_one();
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

    /// Whether the other side is one of the application's own processes or a stranger's
    /// client: see [`Trust`] and [`Config::trust`](crate::Config::trust). Always
    /// [`Trust::Trusted`] on the side that connected.
    pub fn trust(&self) -> Trust {
        self.shared.trust
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

    /// Closes the connection, telling the other side (if it still listens) and this side's
    /// callers `reason`.
    pub fn close_because(&self, reason: impl Into<String>) {
        self.shared
            .shutdown(RpcError::disconnected(reason.into()), true);
    }

    /// A round trip through the other side's reader: completes when the other side has
    /// answered a ping sent now. The other side answers in order, after everything it
    /// received before, and this side processes what it receives in order: so when this
    /// completes, every frame the other side sent before it read the ping has been read
    /// here (and a call it made, handled inline, has run). Every version of the protocol
    /// answers pings. Fails when the connection closes first; it has no deadline of its
    /// own (wrap it in `tokio::time::timeout`).
    pub async fn ping(&self) -> Result<(), RpcError> {
        let s = &*self.shared;
        let seq = s.pings_sent.fetch_add(1, Ordering::Relaxed) + 1;
        let mut closed = s.closed.subscribe();
        let pong = s.pong.notified();
        let mut pong = std::pin::pin!(pong);
        pong.as_mut().enable();
        s.send(Kind::Ping, 0, 0, Bytes::copy_from_slice(&seq.to_le_bytes()))?;
        loop {
            if s.pings_answered.load(Ordering::Acquire) >= seq {
                return Ok(());
            }
            if closed.borrow_and_update().is_some() {
                return Err(s.closed_error());
            }
            tokio::select! {
                _ = pong.as_mut() => {
                    pong.set(s.pong.notified());
                    pong.as_mut().enable();
                }
                _ = closed.changed() => {}
            }
        }
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
        self.shared.stats()
    }

    /// Starts the reader and writer tasks of a connection whose handshake is done.
    pub(crate) fn start<R, W>(
        (rd, due): (R, Option<Due>),
        wr: W,
        leftover: BytesMut,
        settings: Settings,
        (registry, totals): (Arc<Registry>, Arc<Totals>),
        role: Role,
    ) -> Peer
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (peer, reader) =
            Self::start_writer((rd, due), wr, leftover, settings, (registry, totals), role);
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
        (registry, totals): (Arc<Registry>, Arc<Totals>),
        role: Role,
    ) -> (Peer, impl Future<Output = ()> + Send + 'static)
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        let (identity, trust, owned, early, answer, slot, pacing) = match role {
            Role::Accepting {
                identity,
                trust,
                answer,
                slot,
                pacing,
            } => (identity, trust, false, None, answer, Some(slot), pacing),
            Role::Connecting { early } => (
                None,
                Trust::Trusted,
                true,
                early,
                Vec::new(),
                None,
                Pacing::default(),
            ),
        };
        let remote = Remote {
            max: AtomicU32::new(settings.remote_max),
            window: AtomicU32::new(settings.remote_window),
            compression: AtomicU8::new(settings.send_compression as u8),
            known: AtomicBool::new(early.is_none()),
        };
        let early = early.map(Mutex::new);
        let wr: Box<dyn AsyncWrite + Send + Unpin> = Box::new(wr);
        static NEXT_CONNECTION: AtomicU64 = AtomicU64::new(1);
        let writer = WriterStart {
            started: AtomicBool::new(false),
            start: Mutex::new(Some((rx, tokio::runtime::Handle::current()))),
            abandon: Notify::new(),
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
            trust,
            closed: watch::Sender::new(None),
            failure: std::sync::OnceLock::new(),
            queued: AtomicUsize::new(0),
            queued_peak: AtomicUsize::new(0),
            drained: Notify::new(),
            pings_sent: AtomicU64::new(0),
            pings_answered: AtomicU64::new(0),
            pong: Notify::new(),
            slot: Mutex::new(slot),
            pacing,
            counters: Counters::default(),
            stream_batch: AtomicUsize::new(MIN_BATCH),
            totals,
        });
        shared.totals.open(&shared);
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
