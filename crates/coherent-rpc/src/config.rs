//! Per-endpoint settings: limits, format, compression, keep-alive and timeouts.
//! A builder over private fields, so new settings never break callers.

use std::time::Duration;

use crate::codec::{CompressionSet, Format};
use crate::frame::Compression;

/// Settings an endpoint applies to each of its connections.
#[derive(Debug, Clone)]
pub struct Config {
    pub(crate) format: Format,
    pub(crate) compression: Compression,
    pub(crate) decodes: CompressionSet,
    pub(crate) compression_threshold: usize,
    pub(crate) max_message_size: u32,
    pub(crate) max_inbound_calls: u32,
    pub(crate) stream_window: u32,
    pub(crate) handshake_timeout: Duration,
    pub(crate) keepalive_interval: Option<Duration>,
    pub(crate) idle_timeout: Option<Duration>,
    pub(crate) write_stall_timeout: Duration,
    pub(crate) call_timeout: Option<Duration>,
    pub(crate) zero_rtt: bool,
    pub(crate) tcp_send_buffer: SendBuffer,
    pub(crate) trust: Option<Trust>,
}

/// Whether the other side of an accepted connection is one of the application's own
/// processes or a stranger's client. Code above the transport decides by it what it may
/// wait for: a write of the cluster waits until the replicas held by trusted connections
/// (the tiers) have applied its invalidations, and never for an untrusted one (a browser
/// tab that went to sleep must not hold up every writer). Read it with [`Peer::trust`].
///
/// [`Peer::trust`]: crate::Peer::trust
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Trust {
    /// One of the application's own processes (an HTTP tier, another backend).
    Trusted,
    /// An end user's client: a browser, a mobile app, anything on the open internet.
    Untrusted,
}

/// The send buffer (`SO_SNDBUF`) of an endpoint's TCP connections (plain and TLS), set
/// before the connect on the connecting side and on each accepted socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SendBuffer {
    /// 512 KiB on a connection whose other end is on this host (a loopback address),
    /// the kernel's autotuning otherwise. The default.
    ///
    /// On loopback there is no distance to fill, and a smaller buffer keeps the bytes
    /// in flight in the CPU caches between the sender's copy and the receiver's: a
    /// 10 MiB echo ran 1.5 times as fast with it as with the kernel's 4 MiB (measured on
    /// a 2-core VM, see BENCHMARKS.md). Across a network the kernel's autotuning sizes
    /// the buffer to the link, which a fixed size would cap.
    #[default]
    Auto,
    /// The kernel's autotuning on every connection.
    Kernel,
    /// This many bytes on every connection. Linux doubles the value for its own
    /// bookkeeping and caps it at `net.core.wmem_max`; the buffer no longer grows.
    Bytes(u32),
}

impl Default for Config {
    fn default() -> Self {
        Self {
            format: Format::Postcard,
            compression: Compression::None,
            decodes: CompressionSet::ALL,
            compression_threshold: 1024,
            max_message_size: 4 << 20,
            max_inbound_calls: 1024,
            stream_window: 256,
            handshake_timeout: Duration::from_secs(10),
            keepalive_interval: Some(Duration::from_secs(20)),
            idle_timeout: Some(Duration::from_secs(60)),
            write_stall_timeout: Duration::from_secs(30),
            call_timeout: None,
            zero_rtt: false,
            tcp_send_buffer: SendBuffer::Auto,
            trust: None,
        }
    }
}

impl Config {
    /// The serde format this side asks for when it connects (the accepting side follows
    /// the connecting side's choice). Default: postcard.
    pub fn format(mut self, format: Format) -> Self {
        self.format = format;
        self
    }

    /// The compression this side applies to payloads of at least `threshold` bytes, when
    /// the other side can decode it and it makes the payload smaller. Default: none, 1 KiB.
    pub fn compression(mut self, compression: Compression, threshold: usize) -> Self {
        self.compression = compression;
        self.compression_threshold = threshold;
        self
    }

    /// The compressions this side accepts from the other. Default: LZ4 and zstd.
    pub fn decodes(mut self, set: CompressionSet) -> Self {
        self.decodes = set;
        self
    }

    /// The largest payload this side accepts (after decompression). Default: 4 MiB.
    pub fn max_message_size(mut self, bytes: u32) -> Self {
        self.max_message_size = bytes;
        self
    }

    /// How many calls from the other side may run at once; beyond that a call is answered
    /// `Overloaded` at once. Default: 1024.
    pub fn max_inbound_calls(mut self, n: u32) -> Self {
        self.max_inbound_calls = n;
        self
    }

    /// How many items of one stream the producer may send ahead of this side's acks.
    /// Default: 256. Must be at least 1.
    pub fn stream_window(mut self, items: u32) -> Self {
        self.stream_window = items.max(1);
        self
    }

    /// Zero-RTT connects: when this side connects, it does not wait for the other side's
    /// answer to its `Hello`. `connect` returns once the `Hello` is written, and calls
    /// made at once travel right behind it, saving a round trip on a new connection.
    /// Default: off.
    ///
    /// What changes:
    /// - A refusal (a bad token, an unsupported version) no longer fails `connect`: the
    ///   calls made meanwhile fail with its code (`Unauthenticated`...) and reason.
    /// - Until the answer, messages are sent uncompressed, and one over 64 KiB waits for
    ///   the answer (and the other side's limit), as does everything sent after it; an
    ///   upload sends its first items once the answer grants its window.
    /// - The answer must come within the handshake timeout, or the connection closes.
    /// - A held message the answer shows to be too large fails its call alone
    ///   (`TooLarge`); a one-way call has no reply to fail, so it is dropped with a warning.
    /// - An accepting side with a `max_message_size` under 64 KiB closes the connection
    ///   on an early message over its limit instead of the call failing alone.
    pub fn zero_rtt(mut self, on: bool) -> Self {
        self.zero_rtt = on;
        self
    }

    /// How long the handshake may take before the connection is dropped. Default: 10 s.
    pub fn handshake_timeout(mut self, d: Duration) -> Self {
        self.handshake_timeout = d;
        self
    }

    /// How often this side sends a keep-alive ping, and how long it waits without
    /// receiving anything before it closes the connection as dead. Default: 20 s and 60 s.
    pub fn keepalive(mut self, interval: Option<Duration>, idle_timeout: Option<Duration>) -> Self {
        self.keepalive_interval = interval;
        self.idle_timeout = idle_timeout;
        self
    }

    /// How long one socket write may stall (the other side stopped reading) before the
    /// connection is closed. Default: 30 s.
    pub fn write_stall_timeout(mut self, d: Duration) -> Self {
        self.write_stall_timeout = d;
        self
    }

    /// The deadline of calls that set none themselves. Default: none.
    pub fn call_timeout(mut self, d: Option<Duration>) -> Self {
        self.call_timeout = d;
        self
    }

    /// The send buffer of TCP connections. Default: [`SendBuffer::Auto`] (512 KiB to a
    /// peer on this host, the kernel's autotuning otherwise).
    pub fn tcp_send_buffer(mut self, choice: SendBuffer) -> Self {
        self.tcp_send_buffer = choice;
        self
    }

    /// How far this endpoint trusts the connections it accepts. Default: by transport:
    /// connections accepted over WebSocket ([`Endpoint::websocket_handler`], what browsers
    /// use) are [`Trust::Untrusted`], those over TCP, TLS and Unix sockets are
    /// [`Trust::Trusted`] (the application's tiers, on its own network). Give an endpoint
    /// that listens on the open internet over TCP `Trust::Untrusted`. Connections this
    /// side makes are always trusted (it chose whom to connect to).
    ///
    /// [`Endpoint::websocket_handler`]: crate::Endpoint::websocket_handler
    pub fn trust(mut self, trust: Trust) -> Self {
        self.trust = Some(trust);
        self
    }
}
