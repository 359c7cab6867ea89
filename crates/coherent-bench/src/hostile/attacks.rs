//! The attacks: each a function that one hostile connection (one task) runs in a loop until
//! its deadline, tallying what the server answered. None of them may fail the bench: a
//! refusal, a close or a reset is an outcome to count.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use coherent::rpc::frame::{Compression, Header, Kind, MAX_HEADER_LEN};
use coherent::rpc::handshake::Hello;
use coherent::rpc::{CompressionSet, Format};
use coherent_tasks::api::ApiError;
use coherent_tasks::model::ListQuery;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::time::Instant;

use super::clients::{columns, protocol::Held, tcp_from, Http, RawReplicas};

/// The attacks, in the order they run.
pub(crate) const KINDS: [&str; 7] = [
    "rpc_ping_flood",
    "slowloris",
    "replica_churn",
    "huge_pages",
    "connection_flood",
    "oversize_ws_message",
    "silent_holders",
];

/// What the attackers need to know, and where they count.
pub(crate) struct Target {
    pub(crate) http: SocketAddr,
    pub(crate) rpc: SocketAddr,
    pub(crate) project: uuid::Uuid,
    /// Tasks shown on the board (the writer of `silent_holders` changes them).
    pub(crate) board: Vec<uuid::Uuid>,
    pub(crate) tally: Tally,
    /// Pings the `rpc_ping_flood` attackers may still send, all together (see
    /// [`PING_BUDGET`]).
    pub(crate) pings_left: AtomicI64,
}

/// The most pings the flood sends, over all its connections: 2 GiB once decompressed. A
/// server that bounds what it queues stops reading long before; one that does not would
/// take the machine (shared) down with it, and its row has failed by then anyway.
pub(crate) const PING_BUDGET: i64 = 2048;

/// Outcomes per attack kind: `kind -> outcome -> count`.
#[derive(Default)]
pub(crate) struct Tally(Mutex<BTreeMap<&'static str, BTreeMap<String, u64>>>);

impl Tally {
    pub(crate) fn add(&self, kind: &'static str, outcome: impl Into<String>, n: u64) {
        *self
            .0
            .lock()
            .entry(kind)
            .or_default()
            .entry(outcome.into())
            .or_default() += n;
    }

    pub(crate) fn get(&self, kind: &'static str) -> BTreeMap<String, u64> {
        self.0.lock().get(kind).cloned().unwrap_or_default()
    }
}

/// Runs attack `kind` on one connection until `until`.
pub(crate) async fn run(kind: &'static str, t: Arc<Target>, index: usize, until: Instant) {
    let from = attacker_address(index);
    let work = async {
        match kind {
            "rpc_ping_flood" => ping_flood(&t, from, until).await,
            "slowloris" => slowloris(&t, from, until).await,
            "replica_churn" => replica_churn(&t, from, until).await,
            "huge_pages" => huge_pages(&t, from, until).await,
            "connection_flood" => connection_flood(&t, from, until).await,
            "oversize_ws_message" => oversize_ws_message(&t, from, until).await,
            "silent_holders" => silent_holders(&t, index, from, until).await,
            _ => unreachable!("unknown attack {kind}"),
        }
    };
    // The deadline bounds every attack, whatever it waits on (a moment later, for the
    // attacks that tally at their deadline).
    match tokio::time::timeout_at(until + Duration::from_millis(300), work).await {
        Ok(Ok(())) | Err(_) => {}
        Ok(Err(e)) => t.tally.add(kind, format!("bench error: {e}"), 1),
    }
}

/// The addresses the attackers come from: 127.0.0.2 to 127.0.0.(1 + this), attacker `i`
/// from the `i % this`th. Linux routes all of 127.0.0.0/8 to the loopback interface, so
/// they are other hosts to the server: not the exempt 127.0.0.1 that the victim, the
/// writers and the boards come from (as a proxy on the server's host, or its monitors,
/// would), and each held to the server's per-address limits.
pub(crate) const ATTACKER_ADDRESSES: usize = 5;

/// Attacker `index`'s source address.
pub(crate) fn attacker_address(index: usize) -> IpAddr {
    IpAddr::from([127, 0, 0, 2 + (index % ATTACKER_ADDRESSES) as u8])
}

fn frame(kind: Kind, compression: Compression, payload: &[u8]) -> Vec<u8> {
    let mut head = [0u8; MAX_HEADER_LEN];
    let n = Header {
        kind,
        compression,
        upload: false,
        call_id: 0,
        method_id: 0,
        len: payload.len() as u32,
    }
    .encode(&mut head);
    let mut out = head[..n].to_vec();
    out.extend_from_slice(payload);
    out
}

/// A zstd frame of 1 MiB of `a`: eight RLE blocks of 128 KiB, 41 bytes in all.
pub(crate) fn zstd_mebibyte() -> Vec<u8> {
    // Magic; a descriptor: single segment, a 4-byte content size; the size.
    let mut z = vec![0x28, 0xB5, 0x2F, 0xFD, 0xA0];
    z.extend_from_slice(&(1u32 << 20).to_le_bytes());
    for block in 0..8 {
        let last = u32::from(block == 7);
        // Block header (3 bytes LE): size << 3 | type RLE (1) << 1 | last.
        let header = (128u32 << 10) << 3 | 1 << 1 | last;
        z.extend_from_slice(&header.to_le_bytes()[..3]);
        z.push(b'a');
    }
    z
}

/// How a read or write on a raw connection ended.
fn io_outcome(e: &std::io::Error) -> String {
    format!("connection {:?}", e.kind())
}

/// (1) RPC over TCP: a `Hello` that advertises `max_message_size = u32::MAX` (the server may
/// send us anything), then a flood of pings whose payload is 1 MiB of zstd-compressible
/// bytes (41 bytes on the wire each), never reading again: each ping makes the server
/// decompress 1 MiB and queue a 1 MiB pong it cannot send.
async fn ping_flood(t: &Target, from: IpAddr, until: Instant) -> anyhow::Result<()> {
    const KIND: &str = "rpc_ping_flood";
    let mut s = tcp_from(Some(from), t.rpc).await?;
    let hello = Hello {
        version: 1,
        format: Format::Postcard,
        decodes: CompressionSet::ALL,
        max_message_size: u32::MAX,
        max_inbound_calls: 1024,
        stream_window: 16,
        token: String::new(),
    };
    s.write_all(&frame(Kind::Hello, Compression::None, &hello.encode()))
        .await?;
    // Read the HelloAck (whatever else comes with it), then never read again.
    let mut buf = vec![0u8; 4096];
    let mut got = Vec::new();
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            t.tally.add(KIND, "closed at the handshake", 1);
            return Ok(());
        }
        got.extend_from_slice(&buf[..n]);
        if let Ok(Some((h, len))) = Header::decode(&got, u32::MAX) {
            if got.len() >= len + h.len as usize {
                t.tally
                    .add(KIND, format!("handshake answered {:?}", h.kind), 1);
                break;
            }
        }
    }
    const BATCH: i64 = 16;
    let ping = frame(Kind::Ping, Compression::Zstd, &zstd_mebibyte());
    let batch: Vec<u8> = ping
        .iter()
        .copied()
        .cycle()
        .take(ping.len() * BATCH as usize)
        .collect();
    let mut sent = 0u64;
    loop {
        if Instant::now() >= until {
            break;
        }
        if t.pings_left.fetch_sub(BATCH, Ordering::Relaxed) < BATCH {
            t.tally
                .add(KIND, "the bench's ping budget spent: held open, unread", 1);
            tokio::time::sleep_until(until).await;
            break;
        }
        match tokio::time::timeout_at(until, s.write_all(&batch)).await {
            Ok(Ok(())) => sent += BATCH as u64,
            Ok(Err(e)) => {
                t.tally.add(KIND, io_outcome(&e), 1);
                break;
            }
            Err(_) => {
                t.tally.add(
                    KIND,
                    "write blocked at the deadline (server stopped reading)",
                    1,
                );
                break;
            }
        }
    }
    t.tally
        .add(KIND, "pings written (1 MiB each decompressed)", sent);
    Ok(())
}

/// (2) Slowloris: a request head sent one byte every 100 ms, never finished.
async fn slowloris(t: &Target, from: IpAddr, until: Instant) -> anyhow::Result<()> {
    const KIND: &str = "slowloris";
    let mut s = tcp_from(Some(from), t.http).await?;
    s.set_nodelay(true)?;
    let start = Instant::now();
    let head = b"GET /api/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\n";
    let mut i = 0usize;
    let mut probe = [0u8; 512];
    loop {
        let byte = if i < head.len() {
            head[i]
        } else {
            b'X' + (i % 2) as u8
        };
        i += 1;
        if let Err(e) = s.write_all(&[byte]).await {
            t.tally.add(KIND, io_outcome(&e), 1);
            return Ok(());
        }
        // What the server said meanwhile, if anything (it answers only when it gives up).
        match tokio::time::timeout(Duration::from_millis(100), s.read(&mut probe)).await {
            Err(_) => {}
            Ok(Ok(0)) => {
                t.tally.add(
                    KIND,
                    format!(
                        "closed by the server after {:.0} s",
                        start.elapsed().as_secs_f64()
                    ),
                    1,
                );
                return Ok(());
            }
            Ok(Ok(n)) => {
                let line = String::from_utf8_lossy(&probe[..n]);
                let status = line.lines().next().unwrap_or("").to_owned();
                t.tally.add(KIND, format!("answered {status}"), 1);
                return Ok(());
            }
            Ok(Err(e)) => {
                t.tally.add(KIND, io_outcome(&e), 1);
                return Ok(());
            }
        }
        if Instant::now() + Duration::from_millis(100) >= until {
            t.tally.add(KIND, "still open at the deadline", 1);
            t.tally.add(KIND, "bytes sent (1 per 100 ms)", i as u64);
            return Ok(());
        }
    }
}

/// (3) Replica churn over WebSocket: fetch and release the same replica in a loop; every
/// 50th round a revalidate of 10,000 copies of one held replica.
async fn replica_churn(t: &Target, from: IpAddr, until: Instant) -> anyhow::Result<()> {
    const KIND: &str = "replica_churn";
    let c = match RawReplicas::connect(t.http, None, Some(from)).await {
        Ok(c) => c,
        Err(e) => {
            t.tally.add(KIND, format!("connect failed: {e}"), 1);
            return Ok(());
        }
    };
    let q = columns(t.project)[0];
    let (method, args) = c.page_args(&q)?;
    let mut round = 0u64;
    while Instant::now() < until {
        round += 1;
        match c.host.fetch(method, args.clone(), 1).await {
            Ok(Ok(_)) => t.tally.add(KIND, "fetch answered", 1),
            Ok(Err(f)) => t.tally.add(KIND, format!("fetch refused: {f:?}"), 1),
            Err(e) => {
                t.tally
                    .add(KIND, format!("fetch failed: {:?}", e.code()), 1);
                return Ok(());
            }
        }
        if c.host.release(vec![1]).await.is_err() {
            t.tally.add(KIND, "release failed", 1);
            return Ok(());
        }
        t.tally.add(KIND, "released", 1);
        if round % 50 == 0 {
            let held = Held {
                replica: 1,
                method,
                args: args.clone(),
                hash: 0,
            };
            match c.host.revalidate(vec![held; 10_000]).await {
                Ok(changed) => t.tally.add(
                    KIND,
                    format!(
                        "revalidate of 10,000 duplicates answered {} ids",
                        changed.len()
                    ),
                    1,
                ),
                Err(e) => {
                    t.tally
                        .add(KIND, format!("revalidate failed: {:?}", e.code()), 1);
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

/// (4) Pages of `limit = 4294967295`: over RPC (`ReplicaHost.call` on `/rpc`) and over the
/// gateway (`GET /gateway/TasksService.page?args=...`), in turn.
async fn huge_pages(t: &Target, from: IpAddr, until: Instant) -> anyhow::Result<()> {
    const KIND: &str = "huge_pages";
    let q = ListQuery {
        limit: u32::MAX,
        ..columns(t.project)[0]
    };
    let rpc = RawReplicas::connect(t.http, None, Some(from)).await;
    if let Err(e) = &rpc {
        t.tally.add(KIND, format!("rpc connect failed: {e}"), 1);
    }
    let json = serde_json::to_string(&[q])?;
    let path = format!(
        "/gateway/TasksService.page?args={}",
        percent_encode(json.as_bytes())
    );
    let mut http = Http::from_address(t.http, from);
    while Instant::now() < until {
        if let Ok(c) = &rpc {
            let (method, args) = c.page_args(&q)?;
            match c.host.call(method, args).await {
                Ok(Ok(blob)) => {
                    // The method's own error travels in its value: show it.
                    let value = c
                        .peer
                        .format()
                        .decode::<Result<coherent_tasks::model::Page, ApiError>>(&blob);
                    let what = match value {
                        Ok(Err(e)) => format!("rpc answered the error value {e}"),
                        Ok(Ok(page)) => format!("rpc answered a page of {}", page.items.len()),
                        Err(_) => format!("rpc answered {} undecoded bytes", blob.len()),
                    };
                    t.tally.add(KIND, what, 1);
                }
                Ok(Err(f)) => t.tally.add(KIND, format!("rpc refused: {f:?}"), 1),
                Err(e) => t.tally.add(KIND, format!("rpc failed: {:?}", e.code()), 1),
            }
        }
        match http.request(hyper::Method::GET, &path, None).await {
            Ok((status, body)) => t.tally.add(
                KIND,
                format!("gateway answered {status} ({} bytes)", body.len()),
                1,
            ),
            Err(e) => t.tally.add(KIND, format!("gateway failed: {e}"), 1),
        }
    }
    Ok(())
}

fn percent_encode(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|&b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Connections each `connection_flood` attacker opens and holds.
pub(crate) const FLOOD_PER_ATTACKER: usize = 40;

/// (5) A connection flood: TCP connections to the RPC port that never send a `Hello`,
/// opened as fast as the server accepts them and held.
async fn connection_flood(t: &Target, from: IpAddr, until: Instant) -> anyhow::Result<()> {
    const KIND: &str = "connection_flood";
    let mut held = Vec::new();
    let opening = until - Duration::from_millis(30);
    while held.len() < FLOOD_PER_ATTACKER && Instant::now() < opening {
        match tokio::time::timeout_at(opening, tcp_from(Some(from), t.rpc)).await {
            Ok(Ok(s)) => {
                t.tally.add(KIND, "connections opened and held", 1);
                held.push(s);
            }
            Ok(Err(e)) => t.tally.add(KIND, format!("connect {:?}", e.kind()), 1),
            Err(_) => t
                .tally
                .add(KIND, "a connect still pending at the deadline", 1),
        }
    }
    tokio::time::sleep_until(until - Duration::from_millis(15)).await;
    let mut buf = [0u8; 64];
    for s in &held {
        match s.try_read(&mut buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                t.tally.add(KIND, "still open at the deadline", 1);
            }
            Ok(n) if n > 0 => t.tally.add(KIND, "the server sent bytes", 1),
            _ => t.tally.add(KIND, "closed by the server", 1),
        }
    }
    Ok(())
}

/// (6) An oversize WebSocket message: a hand-made upgrade of `/rpc`, then one binary frame
/// that declares 32 MiB, streamed as zeros until the server closes or all is sent.
async fn oversize_ws_message(t: &Target, from: IpAddr, until: Instant) -> anyhow::Result<()> {
    const KIND: &str = "oversize_ws_message";
    const SIZE: u64 = 32 << 20;
    let mut s = tcp_from(Some(from), t.http).await?;
    s.write_all(
        b"GET /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
          Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
    )
    .await?;
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            t.tally.add(KIND, "closed before the upgrade", 1);
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let status = String::from_utf8_lossy(&head)
        .lines()
        .next()
        .unwrap_or("")
        .to_owned();
    if !status.contains(" 101 ") {
        t.tally.add(KIND, format!("upgrade answered {status}"), 1);
        return Ok(());
    }
    // FIN + binary; masked, 64-bit length; a zero mask (the payload goes as is).
    let mut frame = vec![0x82, 0x80 | 127];
    frame.extend_from_slice(&SIZE.to_be_bytes());
    frame.extend_from_slice(&[0, 0, 0, 0]);
    s.write_all(&frame).await?;
    let zeros = vec![0u8; 256 << 10];
    let mut sent = 0u64;
    let (mut rd, mut wr) = s.into_split();
    let reading = tokio::spawn(async move {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => return got,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    });
    let mut outcome = String::new();
    while sent < SIZE && Instant::now() < until {
        match tokio::time::timeout_at(until, wr.write_all(&zeros)).await {
            Ok(Ok(())) => sent += zeros.len() as u64,
            Ok(Err(e)) => {
                outcome = format!("{} after {} KiB sent", io_outcome(&e), sent >> 10);
                break;
            }
            Err(_) => {
                outcome = format!("write blocked after {} KiB sent", sent >> 10);
                break;
            }
        }
    }
    if outcome.is_empty() {
        outcome = if sent >= SIZE {
            "all 32 MiB sent".to_owned()
        } else {
            format!("deadline after {} KiB sent", sent >> 10)
        };
    }
    // What the server answered: a Close frame (0x88, its code) or nothing before closing.
    let got = tokio::time::timeout(Duration::from_millis(200), reading)
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    let answer = match got.first() {
        Some(0x88) if got.len() >= 4 => {
            format!("a WebSocket close {}", u16::from_be_bytes([got[2], got[3]]))
        }
        // A binary message: the RPC protocol's own frame inside (a Close, with its reason).
        Some(0x82) if got.len() > 2 && got[1] < 126 => {
            let rpc = &got[2..];
            match Header::decode(rpc, u32::MAX) {
                Ok(Some((h, n))) if h.kind == Kind::Close && rpc.len() >= n + 2 => format!(
                    "an RPC Close \"{}\"",
                    String::from_utf8_lossy(&rpc[n + 2..(n + h.len as usize).min(rpc.len())])
                ),
                Ok(Some((h, _))) => format!("an RPC {:?}", h.kind),
                _ => "a binary message".to_owned(),
            }
        }
        Some(b) => format!("a frame {b:#04x}"),
        None => "nothing".to_owned(),
    };
    t.tally
        .add(KIND, format!("{outcome}; server sent {answer}"), 1);
    Ok(())
}

/// Pushes the `silent_holders` attackers received (never answered).
pub(crate) static SILENT_PUSHES: AtomicU64 = AtomicU64::new(0);

/// (7) Silent replica holders: each holds the board's four columns and never answers a
/// push; attacker 0 also changes the board's tasks (PATCH of a title) in a loop.
async fn silent_holders(
    t: &Target,
    index: usize,
    from: IpAddr,
    until: Instant,
) -> anyhow::Result<()> {
    const KIND: &str = "silent_holders";
    if index == 0 {
        let mut http = Http::from_address(t.http, from);
        let mut n = 0u64;
        while Instant::now() < until {
            let id = t.board[n as usize % t.board.len()];
            n += 1;
            let body = format!(r#"{{"title":"Changed under silent holders {n}"}}"#);
            match http
                .request(
                    hyper::Method::PATCH,
                    &format!("/api/tasks/{id}"),
                    Some(body),
                )
                .await
            {
                Ok((status, _)) => t.tally.add(KIND, format!("writer PATCH {status}"), 1),
                Err(e) => t.tally.add(KIND, format!("writer failed: {e}"), 1),
            }
        }
        return Ok(());
    }
    let pushes = Arc::new(AtomicU64::new(0));
    let c = match RawReplicas::connect(t.http, Some(pushes.clone()), Some(from)).await {
        Ok(c) => c,
        Err(e) => {
            t.tally.add(KIND, format!("connect failed: {e}"), 1);
            return Ok(());
        }
    };
    if let Err(e) = c.hold_board(t.project).await {
        t.tally.add(KIND, format!("hold failed: {e}"), 1);
        return Ok(());
    }
    t.tally.add(KIND, "boards held", 1);
    let closed = tokio::time::timeout_at(until, c.peer.closed()).await;
    let n = pushes.load(Ordering::Relaxed);
    SILENT_PUSHES.fetch_add(n, Ordering::Relaxed);
    t.tally.add(KIND, "pushes received, never answered", n);
    match closed {
        Ok(e) => t
            .tally
            .add(KIND, format!("closed by the server: {:?}", e.code()), 1),
        Err(_) => t.tally.add(KIND, "still connected at the deadline", 1),
    }
    Ok(())
}
