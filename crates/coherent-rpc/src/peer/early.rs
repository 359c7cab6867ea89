//! Zero-RTT: the connecting side sends its calls right behind its `Hello`, before the
//! other side's answer. Owns [`Early`] (the state until the `HelloAck`: the compression
//! wanted, the `Hello`'s format, how long the answer may take, the frames held),
//! [`EARLY_MAX`], `Shared::submit` (every frame's way to the writer: it holds a frame over
//! `EARLY_MAX` and every frame after it until the answer), `Shared::hello_acked` (takes
//! the answer's limit, window and compression, then sends what was held) and
//! `take_handshake_answer` (the reader's first frame on such a connection: the `HelloAck`,
//! or a refusal that fails the calls made meanwhile).
//!
//! Invariants: until `remote.known` is set, the other side's values in `remote` are
//! provisional; `submit` checks it again under the `early` lock, which `hello_acked` holds
//! while it sends the held frames, so no frame overtakes a held one.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::codec::{Format, Message};
use crate::error::RpcError;
use crate::frame::{Compression, Header, Kind};

use super::Shared;

/// With zero-RTT, the largest message sent before the other side's `HelloAck`: a larger
/// one waits for it (and for its `max_message_size`). Every endpoint configured with a
/// limit of at least this takes such a message blind.
pub(crate) const EARLY_MAX: usize = 64 * 1024;

/// A zero-RTT connection's state until the other side's `HelloAck`.
pub(crate) struct Early {
    /// The compression to send with, if the other side turns out to decode it.
    wanted: Compression,
    /// The `Hello` this side sent: the answer must echo its format.
    format: Format,
    /// How long the answer may take.
    pub(super) within: Duration,
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

impl Shared {
    #[inline]
    pub(super) fn submit(
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
        // Only what this side sends: its own bounds (the queue's mark) are its settings.
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
}

/// Zero-RTT: takes the answer to this side's `Hello`. A refusal (`Close`) fails the calls
/// made meanwhile with the other side's reason and code (`Unauthenticated`...).
pub(super) fn take_handshake_answer(s: &Shared, h: Header, payload: &[u8]) -> Result<(), RpcError> {
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
