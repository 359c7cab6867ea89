//! The reader task of a connection ([`read_loop`]): reads frames off the transport and
//! routes each one ([`route`]): replies to the callers waiting in `pending`, stream items
//! to their receivers (within the window), credits to the producers, calls to `serve`.
//! Owns the read buffer ([`ReadBuffers`]: 64 KiB, 256 KiB while reads come in bulk),
//! large frames read into a buffer of their own ([`Large`], with the socket's low-water
//! mark set through `Due`), the keep-alive pings and the idle timeout, the wait for a
//! zero-RTT answer, and the end of the accepting side's cork.
//!
//! Invariants: every complete frame in the buffer is routed before the next read, split
//! off it without a copy; a frame that breaks the protocol (or a read that fails) closes
//! the connection; with zero-RTT, the first frame is the handshake's answer.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::mpsc;

use crate::codec;
use crate::error::{ErrorCode, RpcError};
use crate::frame::{Compression, Header, Kind};
use crate::net::Due;

use super::early::take_handshake_answer;
use super::serve::start_call;
use super::writer::{wait_for_room, BATCH};
use super::{Pending, Shared};

pub(super) async fn read_loop<R: AsyncRead + Unpin>(
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
    // The handshake's buffer (4 KiB) is let go of as soon as it is empty: a connection
    // starts quiet.
    let mut buffers = ReadBuffers {
        gone_quiet: true,
        ..ReadBuffers::default()
    };
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
        if large.is_none() && buffers.shrink(&buf) {
            buf = BytesMut::with_capacity(QUIET_BUFFER);
        }
        if large.is_none() && buf.capacity() - buf.len() < buffers.low_water() {
            buf.reserve(buffers.size());
        }
        let room = buf.capacity() - buf.len();
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
                        buffers.read(n, room);
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

/// How much the reader reserves when its buffer is (nearly) full.
///
/// Frames are split off the read buffer and handed on without a copy, so a buffer's memory
/// lives until the last of its frames is dropped, often on another thread; glibc then takes
/// the arena's lock and may give the memory back to the kernel (`madvise`), to be faulted in
/// again by the next buffer. A connection whose reads come in bulk reads into 256 KiB
/// buffers instead of 64 KiB: a quarter of the buffers to allocate and free, and fewer frames
/// cut in two (whose start is copied to the next buffer). Streaming 100-byte items
/// (`examples/streams 16 100`, medians of six runs in turns): 19.6M -> 20.4M items/s,
/// `madvise` calls halved.
///
/// A quiet connection (a browser tab holding replicas: a few small frames a minute) reads
/// into 1 KiB: a 64 KiB buffer for each of ten thousand of them would be most of what the
/// server holds for them (issue 32, `hostile.server_bytes_per_client`). A read that fills
/// all the room it had (more may be waiting) moves a quiet connection up to 64 KiB at once.
#[derive(Default)]
struct ReadBuffers {
    /// Reads in a row since the last one that kept the connection at its level.
    calm: u32,
    level: Level,
    /// Gone quiet: the larger buffer is to be let go of once it holds nothing.
    gone_quiet: bool,
}

#[derive(Clone, Copy, Default, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    /// Small reads, far apart: [`QUIET_BUFFER`].
    #[default]
    Quiet,
    /// Reads that filled their buffer: [`BATCH`].
    Active,
    /// Reads of [`BUSY_READ`] and more: [`BUSY_BUFFER`].
    Busy,
}

/// A read at least this long makes a connection busy.
const BUSY_READ: usize = 32 * 1024;
/// The read buffer of a busy connection.
const BUSY_BUFFER: usize = 256 * 1024;
/// The read buffer of a quiet connection.
const QUIET_BUFFER: usize = 1024;
/// Reads in a row below its level after which a connection goes down one level.
const CALM_READS: u32 = 16;

impl ReadBuffers {
    /// Counts a read of `n` bytes into `room` bytes of free buffer.
    fn read(&mut self, n: usize, room: usize) {
        let level = if n >= BUSY_READ {
            Level::Busy
        } else if n >= room {
            Level::Active
        } else {
            Level::Quiet
        };
        if level >= self.level {
            if level > self.level {
                // Busier again before the old buffer was let go of: keep it.
                self.gone_quiet = false;
            }
            self.level = level;
            self.calm = 0;
        } else {
            self.calm += 1;
            if self.calm >= CALM_READS {
                self.calm = 0;
                self.level = match self.level {
                    Level::Busy => Level::Active,
                    _ => Level::Quiet,
                };
                self.gone_quiet = self.level == Level::Quiet;
            }
        }
    }

    /// What a full buffer reserves.
    fn size(&self) -> usize {
        match self.level {
            Level::Quiet => QUIET_BUFFER,
            Level::Active => BATCH,
            Level::Busy => BUSY_BUFFER,
        }
    }

    /// Whether `buf`, quiet again and empty, is to be replaced by a small one: else a
    /// long-lived connection that once read a burst would walk its 64 KiB over the hours,
    /// every page of it resident. Whatever `buf.capacity()` says: that is the room left
    /// past its read position, not the allocation, which `reserve` takes back whole once
    /// the frames split off it are dropped.
    fn shrink(&mut self, buf: &BytesMut) -> bool {
        let now = self.gone_quiet && buf.is_empty();
        if now {
            self.gone_quiet = false;
        }
        now
    }

    /// Less free room than this, and the buffer reserves [`size`](Self::size) more.
    fn low_water(&self) -> usize {
        self.size().min(4 * 4096) / 4
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

/// The largest payload of a control frame (`Ping`, `Pong`, `StreamAck`, `Close`) from an
/// untrusted peer, once decompressed: a larger one closes the connection (`TooLarge`).
pub(crate) const UNTRUSTED_CONTROL_MAX: u32 = 64 * 1024;

/// Handles one received frame. An `Err` closes the connection with that reason.
/// `lone`: whether an answer sent at once may be written by this task (see [`WriteSide`]).
///
/// [`WriteSide`]: super::writer::WriteSide
pub(super) async fn route(
    shared: &Arc<Shared>,
    h: Header,
    payload: Bytes,
    lone: bool,
) -> Result<(), RpcError> {
    let s = &**shared;
    // A call (or a ping) of a paced connection waits for its turn before anything is done
    // for it, its payload not even decompressed; one that waited past the connection's
    // close is dropped.
    if matches!(h.kind, Kind::Call | Kind::OneWay | Kind::Ping)
        && s.pacing.is_on()
        && !s.pacing.wait(s).await
    {
        return Ok(());
    }
    // A payload is decompressed only where it is read (not for an answer to a call this
    // side gave up on), and a control frame of an untrusted peer to at most
    // `UNTRUSTED_CONTROL_MAX` (an honest one carries a few bytes).
    let control_max = if s.trust == crate::Trust::Untrusted {
        UNTRUSTED_CONTROL_MAX.min(s.settings.local_max)
    } else {
        s.settings.local_max
    };
    let open = |payload: Bytes, max: u32| -> Result<Bytes, RpcError> {
        if h.compression == Compression::None {
            if payload.len() > max as usize {
                return Err(RpcError::new(
                    crate::ErrorCode::TooLarge,
                    format!(
                        "a {:?} frame of {} bytes (at most {max})",
                        h.kind,
                        payload.len()
                    ),
                ));
            }
            Ok(payload)
        } else {
            codec::decompress(h.compression, payload, max)
        }
    };
    match h.kind {
        Kind::Call | Kind::OneWay => {
            let payload = open(payload, s.settings.local_max)?;
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
                let payload = match open(payload, s.settings.local_max) {
                    Ok(payload) => payload,
                    Err(e) => {
                        p.fail(e.clone());
                        return Err(e);
                    }
                };
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
            // A compressed item of an unknown id (a stream this side gave up on, or a
            // finished call) is dropped unopened; an uncompressed one, as ever, where the
            // one look-up below finds nothing.
            if h.compression != Compression::None {
                let known = if h.upload {
                    s.inbound
                        .lock()
                        .get(&h.call_id)
                        .is_some_and(|i| i.upload.is_some())
                } else {
                    matches!(s.pending.lock().get(&h.call_id), Some(Pending::Stream(..)))
                };
                if !known {
                    return Ok(());
                }
            }
            let payload = open(payload, s.settings.local_max)?;
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
            match pending {
                Some(Pending::Stream(tx, _)) => {
                    let _ = tx.send(crate::stream::Event::End);
                }
                // A unary call answered as a stream (the two sides disagree on the method):
                // that call fails, saying so, and the connection goes on.
                Some(p @ Pending::Unary(_)) => p.fail(RpcError::protocol(format!(
                    "the other side answered call {} with a stream",
                    h.call_id
                ))),
                None => {}
            }
        }
        Kind::Cancel => {
            let inbound = s.inbound.lock().remove(&h.call_id);
            if let Some(i) = inbound {
                i.abort.abort();
            }
        }
        Kind::StreamAck => {
            let payload = open(payload, control_max)?;
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
            // Paced above, as a call: its payload is decompressed and echoed.
            let payload = open(payload, control_max)?;
            wait_for_room(s).await;
            s.send(Kind::Pong, 0, 0, payload)?;
        }
        Kind::Pong => {
            let payload = open(payload, control_max)?;
            // An answer to `Peer::ping` carries its number; keep-alive pongs are empty.
            if let Ok(seq) = <[u8; 8]>::try_from(&payload[..]) {
                let seq = u64::from_le_bytes(seq);
                // Never past what was sent: a peer cannot answer pings ahead of time.
                if seq <= s.pings_sent.load(Ordering::Relaxed) {
                    s.pings_answered.fetch_max(seq, Ordering::Release);
                    s.pong.notify_waiters();
                }
            }
        }
        Kind::Close => {
            let reason = match open(payload, control_max) {
                Ok(payload) => RpcError::from_payload(&payload),
                Err(e) => e,
            };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_reads_into_big_buffers_while_its_reads_come_in_bulk() {
        let mut b = ReadBuffers::default();
        assert_eq!(b.size(), QUIET_BUFFER, "quiet at first");
        assert_eq!(b.low_water(), QUIET_BUFFER / 4);
        b.read(100, QUIET_BUFFER);
        assert_eq!(b.size(), QUIET_BUFFER, "a short read changes nothing");
        b.read(QUIET_BUFFER, QUIET_BUFFER);
        assert_eq!(
            b.size(),
            BATCH,
            "a read that filled its room: more may wait"
        );
        assert_eq!(b.low_water(), 4096);
        b.read(BUSY_READ - 1, BATCH);
        assert_eq!(b.size(), BATCH, "not yet a bulk read");
        b.read(BUSY_READ, BATCH);
        assert_eq!(b.size(), BUSY_BUFFER);
        for _ in 1..CALM_READS {
            b.read(100, BUSY_BUFFER);
        }
        assert_eq!(
            b.size(),
            BUSY_BUFFER,
            "busy until enough short reads in a row"
        );
        b.read(BUSY_READ, BUSY_BUFFER);
        for _ in 1..CALM_READS {
            b.read(100, BUSY_BUFFER);
        }
        assert_eq!(b.size(), BUSY_BUFFER, "a long read starts the count again");
        b.read(100, BUSY_BUFFER);
        assert_eq!(b.size(), BATCH, "down one level");
        let big = BytesMut::with_capacity(BATCH);
        assert!(!b.shrink(&big), "not quiet yet");
        for _ in 0..CALM_READS {
            b.read(100, BATCH);
        }
        assert_eq!(b.size(), QUIET_BUFFER, "quiet again");
        let mut holding = BytesMut::with_capacity(BATCH);
        holding.extend_from_slice(b"part of a frame");
        assert!(!b.shrink(&holding), "not while it holds bytes");
        assert!(b.shrink(&big), "the big buffer goes once empty");
        assert!(!b.shrink(&big), "once");
        for _ in 0..CALM_READS {
            b.read(100, QUIET_BUFFER);
        }
        b.read(QUIET_BUFFER, QUIET_BUFFER);
        assert_eq!(b.size(), BATCH);
        for _ in 0..CALM_READS {
            b.read(100, BATCH);
        }
        b.read(QUIET_BUFFER, QUIET_BUFFER);
        assert!(!b.shrink(&big), "busier again before it was empty: kept");
    }
}
