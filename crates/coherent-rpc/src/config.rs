//! Per-endpoint settings: limits, format, compression, keep-alive and timeouts.
//! A builder over private fields, so new settings never break callers.

use std::time::Duration;

use crate::codec::{CompressionSet, Format};
use crate::frame::Compression;
use crate::pace::Rate;

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
    pub(crate) max_queued_bytes: Option<usize>,
    pub(crate) max_connections: usize,
    pub(crate) trusted_reserve: Option<usize>,
    pub(crate) queue_budget: usize,
    pub(crate) allowed_origins: Origins,
    pub(crate) untrusted_call_rate: Option<Rate>,
}

/// The per-connection queue's mark when none is set: room for this side's largest message
/// twice, and at least 16 MiB.
pub(crate) fn default_max_queued(max_message_size: u32) -> usize {
    (max_message_size as usize).saturating_mul(2).max(16 << 20)
}

/// An origin as it is compared: trimmed, lowercase, without a trailing `/`, and without
/// its scheme's default port (`https://a.example:443` is `https://a.example`, as a browser
/// sends it).
pub(crate) fn normalize_origin(origin: &str) -> String {
    let o = origin.trim().trim_end_matches('/').to_ascii_lowercase();
    let Some(default_port) = o.split_once("://").and_then(|(s, _)| default_port(s)) else {
        return o;
    };
    match o.strip_suffix(default_port) {
        // Only a port after the host (`[::1]:443`, `a.example:443`), not the end of one.
        Some(bare) if !bare.ends_with("://") => bare.to_owned(),
        _ => o,
    }
}

/// The default port of a web scheme (lowercase), as an origin's or a `Host`'s suffix.
pub(crate) fn default_port(scheme: &str) -> Option<&'static str> {
    match scheme {
        "http" | "ws" => Some(":80"),
        "https" | "wss" => Some(":443"),
        _ => None,
    }
}

/// Which web pages may open a WebSocket to the endpoint (see [`Config::allowed_origins`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) enum Origins {
    /// Same origin only, and the listed ones (normalized: lowercase, no trailing `/`).
    #[default]
    SameOrigin,
    Listed(Vec<String>),
    Any,
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
            max_queued_bytes: None,
            max_connections: 10_000,
            trusted_reserve: None,
            queue_budget: 1 << 30,
            allowed_origins: Origins::SameOrigin,
            untrusted_call_rate: Some(Rate::DEFAULT_UNTRUSTED),
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

    /// The bytes queued for sending on one connection above which its reader stops taking
    /// new work (calls, pings) from the other side, and its streams stop producing, until
    /// the queue drains. A larger message still goes whole: the queue may hold this mark
    /// plus one message (plus the answers of calls already running). What the other side
    /// announces in its `Hello` never raises it. Default: twice this side's
    /// [`max_message_size`](Self::max_message_size), and at least 16 MiB.
    pub fn max_queued_bytes(mut self, bytes: usize) -> Self {
        self.max_queued_bytes = Some(bytes);
        self
    }

    /// The rate at which each untrusted connection ([`Trust::Untrusted`]: a browser, any
    /// client on the open internet) may start calls (pings count as calls); `None` for no
    /// limit. Trusted connections are never paced.
    ///
    /// A call over the rate is not refused: the connection's reader waits until the call
    /// is due, reading nothing meanwhile (see [`crate::pace`]), and counts it in
    /// [`EndpointStats::calls_paced`](crate::EndpointStats). A closed loop of calls, as
    /// many as the server can answer, is thus held to the rate, and what one connection
    /// can make the server do is bounded by it. An HTTP server that accepts the
    /// WebSockets can hold every connection of one address to a rate they share as well
    /// (see [`Endpoint::websocket_handler`](crate::Endpoint::websocket_handler)).
    ///
    /// Default: 100 calls a second, with bursts of 200 (a live page fetching its replicas
    /// again after a burst of invalidations stays well within it).
    pub fn untrusted_call_rate(mut self, rate: Option<Rate>) -> Self {
        self.untrusted_call_rate = rate;
        self
    }

    /// How many connections this endpoint may have accepted and not yet closed at once
    /// (those still in their handshake included). One more is answered with a `Close`
    /// (`Overloaded`, saying so) and dropped, without reading its `Hello`. Connections this
    /// endpoint makes do not count. Over TLS (`serve_tls`), connections still in the TLS
    /// handshake are bounded apart, by as many as untrusted clients may hold (this less
    /// `trusted_reserve`), and one more is closed before its handshake, with no `Close`.
    /// Default: 10,000.
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n;
        self
    }

    /// How many of [`max_connections`](Self::max_connections) only trusted connections
    /// ([`Trust::Trusted`]: the application's tiers) may take: untrusted ones (browsers) are
    /// refused once the rest are taken, so that a crowd of them, or an attacker opening
    /// sockets, cannot keep a tier from reconnecting. Default: a tenth of
    /// `max_connections`.
    pub fn trusted_reserve(mut self, n: usize) -> Self {
        self.trusted_reserve = Some(n);
        self
    }

    /// The bytes queued for sending over all of this endpoint's connections together
    /// (each one's queue is bounded by [`max_queued_bytes`](Self::max_queued_bytes)).
    /// Default: 1 GiB, 64 connections at the default per-connection mark, or 256 replies
    /// of 4 MiB on their way at once: far above what clients that read their answers
    /// leave queued, and memory a server that takes 10,000 connections can spare.
    ///
    /// The policy once the sum goes over the budget:
    /// - the open connection that holds the most queued bytes is closed at once (its
    ///   queue dropped, not written: the other side is not reading it) and counted in
    ///   [`EndpointStats::connections_shed`](crate::EndpointStats); it holds more than
    ///   its fair share (the budget divided among the open connections), since the sum
    ///   is over the budget;
    /// - until the sum is under the budget again, a new call on a connection that holds
    ///   more than its fair share is answered `Overloaded` at once.
    ///
    /// So a client that stops reading, over however many connections, loses its largest
    /// queues first, and a client whose queue stays small is served throughout. The sum
    /// may pass the budget by what the connection being closed held plus one message per
    /// connection sending at that moment.
    pub fn queue_budget(mut self, bytes: usize) -> Self {
        self.queue_budget = bytes;
        self
    }

    /// The web pages (origins, as in `https://app.example.com` or
    /// `http://localhost:3000`) that may open a WebSocket to
    /// [`Endpoint::websocket_handler`], besides the endpoint's own. Browsers do not apply
    /// the same-origin policy to WebSockets: without this check any page a user visits
    /// could open the RPC route with the user's cookies. `"*"` allows every origin.
    ///
    /// Origins are compared without case, a trailing `/` or the scheme's default port
    /// (`https://app.example:443` is `https://app.example`, as browsers send it).
    ///
    /// Default: an upgrade whose `Origin` header names the request's own `Host` (same
    /// origin) is accepted, as is one without an `Origin` (not a browser); any other is
    /// answered HTTP 403 and counted in
    /// [`EndpointStats::origins_refused`](crate::EndpointStats). Behind a proxy that
    /// rewrites `Host`, list the public origin here.
    ///
    /// [`Endpoint::websocket_handler`]: crate::Endpoint::websocket_handler
    pub fn allowed_origins<I, S>(mut self, origins: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut listed = Vec::new();
        for o in origins {
            let o: String = o.into();
            if o.trim() == "*" {
                self.allowed_origins = Origins::Any;
                return self;
            }
            listed.push(normalize_origin(&o));
        }
        self.allowed_origins = Origins::Listed(listed);
        self
    }

    /// The queue mark of one connection: set, or the default for this side's limit.
    pub(crate) fn queue_mark(&self) -> usize {
        self.max_queued_bytes
            .unwrap_or_else(|| default_max_queued(self.max_message_size))
    }
}
