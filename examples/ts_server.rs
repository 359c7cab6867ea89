//! A server for the tests of clients in other languages (the TypeScript client's, first):
//! the protocol of PROTOCOL.md over WebSocket, with methods that exercise each part of it.
//!
//! ```sh
//! cargo run -p coherent-examples --example ts_server -- \
//!     [--listen 127.0.0.1:0] [--token secret] [--initial NAME=VALUE]... \
//!     [--max-message-size 4194304] [--stream-window 256]
//! ```
//!
//! The endpoint's `HelloAck` announces the format the client chose, LZ4 and zstd,
//! `max_message_size` 4 MiB and `stream_window` 256 unless given, `max_inbound_calls` 1024;
//! it pings every 20 s and closes a connection silent for 60 s (the crate's defaults).
//!
//! # Stdout
//!
//! Once it listens, exactly one line, `{"listening":"127.0.0.1:PORT"}` (the bound address,
//! so `--listen 127.0.0.1:0` picks a free port), flushed; nothing else is ever written to
//! stdout (errors go to stderr). It then serves until it is killed (SIGTERM, SIGKILL). A
//! server restarted with `--listen` on the port of the previous one serves the same routes
//! with the new `--initial` values: what a client's reconnection and revalidation need.
//!
//! # Routes
//!
//! - `GET /rpc`: WebSocket; the protocol, accepting side. The `Hello`'s token must equal
//!   `--token` (default `secret`), or the answer is `Close` with `Unauthenticated` (6) and
//!   the reason `bad token`. Any format (MessagePack is format 1) and compression.
//! - `GET /gateway/{Trait.method}?args=<JSON array>`: the HTTP JSON gateway of the compute
//!   methods (`/gateway/Counters.get?args=["a"]` answers `{"Ok":1}` with an `ETag`), and
//!   `/gateway/{Trait.method}/events?args=...` its Server-Sent Events; any origin may fetch
//!   them (CORS).
//! - `GET /hostile?mode=M&after=A`: a WebSocket that breaks the protocol, to check that a
//!   client closes the connection (with a reason) instead of going on. It reads the
//!   client's `Hello`, then, by mode:
//!   - `kind15` (the default): a valid `HelloAck` (the client's format, no compression,
//!     16 MiB limit, 64 calls, window 16, no token), then the frame `0f 00 00000000 00000000`:
//!     kind 15, which does not exist (`UnknownKind`).
//!   - `toolarge`: the `HelloAck`, then the envelope of an `Ok` frame (call 1, or the
//!     client's first call with `after=call`) whose length field is the client's announced
//!     `max_message_size` + 1 (at most 2^32 - 1), followed by 16 zero bytes (`TooLarge` as
//!     soon as the length is read).
//!   - `badack`: no `HelloAck`: the first frame is `Ok` for call 1 with the payload `c0`
//!     (`Protocol`: the first frame must be `HelloAck` or `Close`).
//!   - `garbage-batch`: the `HelloAck`; then, once the client's first `Call` arrives (any
//!     method), a `StreamBatch` for that call id with the payload `05 01 02`: an item of 5
//!     bytes of which 2 are there (`Protocol`).
//!
//!   `after` is `handshake` (the default: the bad frame follows the `HelloAck` at once) or
//!   `call` (it waits for the client's first `Call`, whose id it then uses);
//!   `garbage-batch` always waits. The server then reads and drops whatever comes until the
//!   client closes (a minute at most). An unknown mode or `after` answers 400.
//!
//! # Services on `/rpc`
//!
//! Method ids are the FNV-1a of `"<Service>.<method>"` (PROTOCOL.md section 4); arguments
//! are the tuple of the arguments, in MessagePack an array. `Result<T, E>` is an enum:
//! `{"Ok": T}` or `{"Err": E}` in MessagePack.
//!
//! | method | id | arguments | answer |
//! |---|---|---|---|
//! | `Calc.add` | `0xBDAF910D` | `(a: i64, b: i64)` | `i64`: `a + b` (wrapping) |
//! | `Calc.echo` | `0xC75860CF` | `(s: string)` | `string`: `s` |
//! | `Calc.blob` | `0x8C14A355` | `(n: u32)` | bytes (bin): `n` bytes, byte `i` is `i % 251` |
//! | `Calc.fail` | `0x278D848E` | `(code: u16, message: string)` | an `Error` frame of `code` (1 to 11 as given, others as 65535) and `message` |
//! | `Calc.div` | `0x7A87E479` | `(a: i64, b: i64)` | `Result<i64, string>`: `Err("division by zero")` for `b = 0` |
//! | `Calc.sleep` | `0xC0CAA811` | `(ms: u64)` | `u64`: `ms`, after sleeping that long; a `Cancel` aborts it |
//! | `Calc.cancelled` | `0x8349D6D9` | `()` | `u64`: how many `sleep` calls were aborted before they finished, since start |
//! | `Calc.count` | `0x7D90396D` | `(n: u32)` | a stream of `u32`: `0` to `n - 1`, under the caller's credits |
//! | `Calc.produced` | `0xD4C930D2` | `()` | `u64`: items all `count` streams produced since start; an item is produced only once it has a credit, so with a consumer that stops reading it stays within the window of what was read |
//! | `Calc.bump` | `0x598B93AE` | `(name: string, by: i64)` | `i64`: the counter's new value, answered once every client holding a replica of `Counters.get(name)` (or a `sum` over it) has acknowledged its `ReplicaSink.invalidated` |
//!
//! The compute service `Counters` (held as replicas through `ReplicaHost`, PROTOCOL.md
//! section 9; `--initial` sets the starting values, a counter never set is 0):
//!
//! | method | id | arguments | value |
//! |---|---|---|---|
//! | `Counters.get` | `0xB789D2F6` | `(name: string)` | `Result<i64, RpcError>`: the counter |
//! | `Counters.sum` | `0x4EBF3355` | `(names: [string])` | `Result<i64, RpcError>`: the sum of those counters, computed from `get` (invalidated with any of them) |
//!
//! (`RpcError` as a value is `(code: u16, message: string)`; these methods never fail.)

use std::io::Write;
use std::net::SocketAddr;

use clap::Parser;
use coherent::rpc::Config;
use coherent_examples::test_server::{trusted, Options, TestServer};

#[derive(Parser)]
#[command(
    name = "ts_server",
    about = "The test server of other languages' clients"
)]
struct Cli {
    /// Where to listen (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// The token that `/rpc` accepts.
    #[arg(long, default_value = "secret")]
    token: String,
    /// A counter's starting value, `NAME=VALUE` (repeatable).
    #[arg(long, value_parser = parse_initial)]
    initial: Vec<(String, i64)>,
    /// The largest payload `/rpc` accepts (its `HelloAck`'s `max_message_size`).
    #[arg(long, default_value_t = 4 << 20)]
    max_message_size: u32,
    /// The stream window `/rpc` grants uploads (its `HelloAck`'s `stream_window`).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    stream_window: u32,
    /// Treat `/rpc`'s connections as untrusted (a browser's: writes do not wait for them,
    /// and their lease has no bound) instead of trusted (a Node.js tier's).
    #[arg(long)]
    untrusted: bool,
    /// Answer every lease renewal with nothing left, as a server whose own caches are
    /// fenced (a cluster host past its lease) does: the client reads through to it.
    #[arg(long)]
    lease_fenced: bool,
}

fn parse_initial(s: &str) -> Result<(String, i64), String> {
    let (name, value) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=VALUE"))?;
    let value = value
        .parse()
        .map_err(|e| format!("{value:?} is not an i64: {e}"))?;
    Ok((name.to_owned(), value))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let config = Config::default()
        .max_message_size(cli.max_message_size)
        .stream_window(cli.stream_window);
    let server = TestServer::new(Options {
        token: cli.token,
        initial: cli.initial,
        config: if cli.untrusted {
            config.trust(coherent::rpc::Trust::Untrusted)
        } else {
            trusted(config)
        },
    });
    if cli.lease_fenced {
        let fenced = coherent::Registry::new();
        fenced.fence();
        server.remote().lease_from(&fenced);
    }
    let listener = tokio::net::TcpListener::bind(cli.listen).await?;
    let addr = listener.local_addr()?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{{\"listening\":\"{addr}\"}}")?;
        out.flush()?;
    }
    axum::serve(listener, server.router()).await?;
    Ok(())
}
