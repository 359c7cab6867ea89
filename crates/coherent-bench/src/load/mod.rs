//! A closed-loop HTTP/1.1 load generator in the manner of wrk, for the suites that measure an
//! HTTP server: `threads` OS threads, each a current-thread tokio runtime that drives its share
//! of `connections` keep-alive connections; each connection sends its next request as soon as
//! it has read the previous response.
//!
//! The client is a minimal HTTP/1.1 writer and parser over a `TcpStream` with `TCP_NODELAY`:
//! the request is encoded into a reused buffer and written with one `write`, the response is
//! read into a reused buffer and its head parsed with `httparse`, the body located by
//! `Content-Length` (or decoded from chunks). One `write` and one `read` per request, like
//! hyper's client connection, but with less than half its user-space CPU time (hyper passes
//! each request and response between the `SendRequest` handle and the connection task, and
//! builds a `HeaderMap` for each response). That matters because the generator runs on the
//! same machine as the server: each CPU cycle it spends per request is one the server does
//! not get.
//!
//! A [`Workload`] decides every request and checks every response, with a state of its own per
//! connection. Latency is recorded per request, in microseconds, into a per-thread
//! [`Histogram`] (3 significant digits), merged at the end. Requests sent during the warm-up
//! are not recorded; requests still in flight at the deadline are not counted.
//!
//! [`wrk`] runs the real wrk binary, when it is installed, for a reference row.

pub(crate) mod wrk;

use std::cell::RefCell;
use std::io::Write as _;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use hdrhistogram::Histogram;
use hyper::Method;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, Interest};
use tokio::net::TcpStream;

/// How many error messages a run keeps for its report (every error is counted).
const KEPT_ERRORS: usize = 8;
/// The most response headers the parser accepts.
const MAX_HEADERS: usize = 64;
/// The read buffer grows by this much when less than [`MIN_SPARE`] of it is free.
const READ_CHUNK: usize = 16 * 1024;
/// The least free space the read buffer offers to a `read`.
const MIN_SPARE: usize = 4 * 1024;
/// The largest latency the histogram records, in microseconds (larger ones saturate).
const MAX_LATENCY_US: u64 = 60_000_000;
/// How long a connection waits before it tries to connect again after a failed connect.
const RECONNECT_PAUSE: Duration = Duration::from_millis(10);

/// The shape of a run: how many threads and connections, for how long.
#[derive(Clone, Debug)]
pub(crate) struct LoadConfig {
    /// OS threads, each running a current-thread tokio runtime (at most `connections`).
    pub(crate) threads: usize,
    /// Keep-alive connections in all, spread evenly over the threads.
    pub(crate) connections: usize,
    /// How long the measured window lasts, after the warm-up.
    pub(crate) duration: Duration,
    /// How long the connections run before the measured window opens: their requests are
    /// sent and checked but not recorded. Connecting happens in it.
    pub(crate) warmup: Duration,
    /// Who serves, to measure their processor time over the window
    /// ([`LoadResult::spent`]); `None` measures nothing.
    pub(crate) cost: Option<crate::cpu::Servers>,
}

impl Default for LoadConfig {
    /// wrk's setting in the Tasks API benchmark: 4 threads, 50 connections; a 1 s warm-up and
    /// a 3 s window.
    fn default() -> Self {
        Self {
            threads: 4,
            connections: 50,
            duration: Duration::from_secs(3),
            warmup: Duration::from_secs(1),
            cost: None,
        }
    }
}

/// One HTTP/1.1 request, as a [`Workload`] decides it.
#[derive(Clone, Debug)]
pub(crate) struct Request {
    /// The method (`GET`, `POST`, `PATCH`, ...).
    pub(crate) method: Method,
    /// The request target: the path and query, e.g. `/tasks/17?fields=title`.
    pub(crate) path: String,
    /// Headers besides `Host` and `Content-Length`, which are written for every request.
    pub(crate) headers: Vec<(&'static str, String)>,
    /// The body, JSON: sent with `Content-Type: application/json` unless `headers` name a
    /// content type.
    pub(crate) body: Option<Bytes>,
}

impl Request {
    /// A `GET` of `path` with no extra headers.
    pub(crate) fn get(path: impl Into<String>) -> Self {
        Self::new(Method::GET, path, None)
    }

    /// A request of `method` to `path` with a JSON `body`.
    pub(crate) fn json(method: Method, path: impl Into<String>, body: impl Into<Bytes>) -> Self {
        Self::new(method, path, Some(body.into()))
    }

    /// A request of `method` to `path` with an optional JSON `body` and no extra headers.
    pub(crate) fn new(method: Method, path: impl Into<String>, body: Option<Bytes>) -> Self {
        Self {
            method,
            path: path.into(),
            headers: Vec::new(),
            body,
        }
    }

    /// This request with the header `name: value` added.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn with_header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    /// Appends this request, as HTTP/1.1 bytes, to `out`.
    fn encode(&self, host: &str, out: &mut Vec<u8>) {
        out.extend_from_slice(self.method.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(self.path.as_bytes());
        out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
        out.extend_from_slice(host.as_bytes());
        out.extend_from_slice(b"\r\n");
        let mut has_content_type = false;
        for (name, value) in &self.headers {
            has_content_type |= name.eq_ignore_ascii_case("content-type");
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        let body: &[u8] = self.body.as_deref().unwrap_or_default();
        if self.body.is_some() && !has_content_type {
            out.extend_from_slice(b"content-type: application/json\r\n");
        }
        if self.body.is_some() || !matches!(self.method, Method::GET | Method::HEAD) {
            // Writing into a Vec cannot fail.
            let _ = write!(out, "content-length: {}\r\n", body.len());
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(body);
    }
}

/// A response as the generator read it, borrowed from its connection's buffers for the
/// duration of [`Workload::check`].
#[derive(Debug)]
pub(crate) struct Response<'a> {
    /// The status code.
    pub(crate) status: u16,
    /// The headers, in the order the server wrote them.
    #[cfg_attr(not(test), allow(dead_code))]
    headers: &'a [httparse::Header<'a>],
    /// The body (decoded, when it came in chunks).
    pub(crate) body: &'a [u8],
}

#[cfg_attr(not(test), allow(dead_code))]
impl<'a> Response<'a> {
    /// The value of the first header named `name` (compared without regard to case).
    pub(crate) fn header(&self, name: &str) -> Option<&'a [u8]> {
        self.headers
            .iter()
            .find(|header| header.name.eq_ignore_ascii_case(name))
            .map(|header| header.value)
    }

    /// Every header as (name, value), in the order the server wrote them.
    pub(crate) fn headers(&self) -> impl Iterator<Item = (&'a str, &'a [u8])> + '_ {
        self.headers
            .iter()
            .map(|header| (header.name, header.value))
    }
}

/// What a run sends and how it judges the answers: one state per connection, made by
/// [`Workload::connection`], which decides each next request and checks each response.
pub(crate) trait Workload: Send + Sync + 'static {
    /// The state of one connection (e.g. the ids it works on, the ETags it has seen).
    type Conn: Send + 'static;

    /// The state of connection `index` (`0..connections`), made on the thread that drives it.
    fn connection(&self, index: usize) -> Self::Conn;

    /// The request connection `conn` sends next.
    fn next(&self, conn: &mut Self::Conn) -> Request;

    /// Judges `resp`, the response to `req` (the request [`Workload::next`] returned last for
    /// `conn`), sent at `sent` and fully received at `done`. An `Err` is counted as an error
    /// and the first few are kept for the report. Called for every response, those of the
    /// warm-up included (their errors are not counted).
    fn check(
        &self,
        conn: &mut Self::Conn,
        req: &Request,
        resp: &Response<'_>,
        sent: Instant,
        done: Instant,
    ) -> Result<(), String>;
}

/// The outcome of a [`run`]: counts over the measured window and the latency histogram.
pub(crate) struct LoadResult {
    /// Responses fully received in the window, whatever their status and check.
    pub(crate) requests: u64,
    /// Failed checks, plus I/O and protocol errors (connect, write, read, malformed or cut
    /// responses), in the window.
    pub(crate) errors: u64,
    /// Responses in the window whose status is not 2xx, nor 304.
    pub(crate) non_2xx: u64,
    /// Responses in the window with status 304 (Not Modified): counted as successes.
    pub(crate) not_modified: u64,
    /// Connections opened again in the window, after the server closed one or an error.
    pub(crate) reconnects: u64,
    /// The length of the measured window.
    pub(crate) elapsed: Duration,
    /// The latency of every counted request, in microseconds, from the write of its first byte
    /// to the read of the response's last.
    pub(crate) latency: Histogram<u64>,
    /// The first few error messages, for the report.
    pub(crate) first_errors: Vec<String>,
    /// The servers' processor time over the window, with [`LoadConfig::cost`]: this process
    /// less the load threads, and the processes it names.
    pub(crate) spent: Option<crate::cpu::Spent>,
}

impl std::fmt::Debug for LoadResult {
    /// The counts and a few percentiles: the histogram's own `Debug` lists every bucket.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadResult")
            .field("requests", &self.requests)
            .field("errors", &self.errors)
            .field("non_2xx", &self.non_2xx)
            .field("not_modified", &self.not_modified)
            .field("reconnects", &self.reconnects)
            .field("elapsed", &self.elapsed)
            .field("p50_ms", &self.p50_ms())
            .field("p99_ms", &self.p99_ms())
            .field("max_ms", &(self.latency.max() as f64 / 1000.0))
            .field("first_errors", &self.first_errors)
            .finish()
    }
}

impl LoadResult {
    /// Requests per second over the measured window.
    pub(crate) fn rps(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64().max(f64::MIN_POSITIVE)
    }

    /// The median latency in milliseconds.
    pub(crate) fn p50_ms(&self) -> f64 {
        self.percentile_ms(50.0)
    }

    /// The servers' processor time per request, in microseconds (see [`crate::cpu`]).
    pub(crate) fn cpu_us_per_req(&self) -> Option<f64> {
        self.spent?.us_per(self.requests)
    }

    /// The 99th percentile latency in milliseconds.
    pub(crate) fn p99_ms(&self) -> f64 {
        self.percentile_ms(99.0)
    }

    /// The 99.9th percentile latency in milliseconds.
    pub(crate) fn p999_ms(&self) -> f64 {
        self.percentile_ms(99.9)
    }

    /// The latency at `percentile` (0 to 100) in milliseconds; 0 when nothing was recorded.
    pub(crate) fn percentile_ms(&self, percentile: f64) -> f64 {
        self.latency.value_at_percentile(percentile) as f64 / 1000.0
    }
}

/// Runs `workload` against the HTTP/1.1 server at `addr` as `config` says, and returns what it
/// measured. Fails when the server does not accept a first connection or a thread cannot be
/// started; errors during the run are counted in the result instead.
pub(crate) fn run<W: Workload>(
    addr: SocketAddr,
    config: &LoadConfig,
    workload: Arc<W>,
) -> anyhow::Result<LoadResult> {
    anyhow::ensure!(
        config.threads > 0 && config.connections > 0,
        "a load run needs at least one thread and one connection"
    );
    std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("the server under load at {addr} does not accept connections"))?;
    let threads = config.threads.min(config.connections);
    let start = Instant::now();
    let window = Window {
        opens: start + config.warmup,
        closes: start + config.warmup + config.duration,
    };
    // The servers' processor time from the window's opening (the load threads read their own
    // from then too) to the end of the last load thread.
    let sampler = config.cost.clone().map(|servers| {
        std::thread::spawn(move || {
            std::thread::sleep(window.opens.saturating_duration_since(Instant::now()));
            (servers.snapshot(), servers)
        })
    });
    let mut handles = Vec::with_capacity(threads);
    for thread in 0..threads {
        let indices: Vec<usize> = (thread..config.connections).step_by(threads).collect();
        let workload = Arc::clone(&workload);
        let handle = std::thread::Builder::new()
            .name(format!("load-{thread}"))
            .spawn(move || drive_thread(addr, workload, indices, window))
            .context("starting a load thread")?;
        handles.push(handle);
    }
    let mut total = Stats::new();
    for handle in handles {
        let stats = handle
            .join()
            .map_err(|_| anyhow::anyhow!("a load thread panicked"))??;
        total.merge(stats)?;
    }
    let spent = match sampler {
        Some(sampler) => {
            let (before, servers) = sampler
                .join()
                .map_err(|_| anyhow::anyhow!("the processor-time sampler panicked"))?;
            Some(crate::cpu::Spent::between(
                &before,
                &servers.snapshot(),
                total.load_cpu,
            ))
        }
        None => None,
    };
    Ok(LoadResult {
        spent,
        requests: total.requests,
        errors: total.errors,
        non_2xx: total.non_2xx,
        not_modified: total.not_modified,
        reconnects: total.reconnects,
        elapsed: config.duration,
        latency: total.latency,
        first_errors: total.first_errors,
    })
}

/// The measured window: requests sent from `opens` on and answered before `closes` count.
#[derive(Clone, Copy, Debug)]
struct Window {
    /// The end of the warm-up.
    opens: Instant,
    /// The deadline: every connection stops here.
    closes: Instant,
}

/// One thread's counts, merged into the [`LoadResult`] at the end.
struct Stats {
    /// See [`LoadResult::requests`].
    requests: u64,
    /// See [`LoadResult::errors`].
    errors: u64,
    /// See [`LoadResult::non_2xx`].
    non_2xx: u64,
    /// See [`LoadResult::not_modified`].
    not_modified: u64,
    /// See [`LoadResult::reconnects`].
    reconnects: u64,
    /// See [`LoadResult::latency`].
    latency: Histogram<u64>,
    /// See [`LoadResult::first_errors`].
    first_errors: Vec<String>,
    /// This load thread's processor time from the window's opening to its end.
    load_cpu: Duration,
}

/// An empty latency histogram: 1 µs to 60 s, 3 significant digits.
pub(crate) fn latency_histogram() -> Histogram<u64> {
    // 1..=60 s with 3 digits is a valid range: this cannot fail.
    Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).expect("valid histogram bounds")
}

/// Records the time from `sent` to `done` in `histogram`, in microseconds (at least 1;
/// longer than the histogram holds saturates).
pub(crate) fn record_latency(histogram: &mut Histogram<u64>, sent: Instant, done: Instant) {
    let micros = u64::try_from(done.duration_since(sent).as_micros()).unwrap_or(u64::MAX);
    histogram.saturating_record(micros.max(1));
}

impl Stats {
    /// Zero counts and an empty histogram of 1 µs to 60 s at 3 significant digits.
    fn new() -> Self {
        Self {
            requests: 0,
            errors: 0,
            non_2xx: 0,
            not_modified: 0,
            reconnects: 0,
            latency: latency_histogram(),
            first_errors: Vec::new(),
            load_cpu: Duration::ZERO,
        }
    }

    /// Counts an error, keeping its message if it is one of the first.
    fn error(&mut self, message: impl FnOnce() -> String) {
        self.errors += 1;
        if self.first_errors.len() < KEPT_ERRORS {
            self.first_errors.push(message());
        }
    }

    /// Adds `other`'s counts to these.
    fn merge(&mut self, other: Stats) -> anyhow::Result<()> {
        self.requests += other.requests;
        self.errors += other.errors;
        self.non_2xx += other.non_2xx;
        self.not_modified += other.not_modified;
        self.reconnects += other.reconnects;
        self.load_cpu += other.load_cpu;
        self.latency
            .add(&other.latency)
            .map_err(|e| anyhow::anyhow!("merging latency histograms: {e:?}"))?;
        let room = KEPT_ERRORS.saturating_sub(self.first_errors.len());
        self.first_errors
            .extend(other.first_errors.into_iter().take(room));
        Ok(())
    }
}

/// The body of one load thread: a current-thread runtime driving the connections `indices`
/// until the window closes.
fn drive_thread<W: Workload>(
    addr: SocketAddr,
    workload: Arc<W>,
    indices: Vec<usize>,
    window: Window,
) -> anyhow::Result<Stats> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building a load thread's runtime")?;
    let stats = Rc::new(RefCell::new(Stats::new()));
    let tasks = tokio::task::LocalSet::new();
    // This thread's processor time when the window opens (now, if it has).
    let cpu_at_open = Rc::new(std::cell::Cell::new(None));
    {
        let cpu_at_open = Rc::clone(&cpu_at_open);
        tasks.spawn_local(async move {
            tokio::time::sleep_until(tokio::time::Instant::from_std(window.opens)).await;
            cpu_at_open.set(Some(crate::cpu::thread_cpu()));
        });
    }
    for index in indices {
        let workload = Arc::clone(&workload);
        let stats = Rc::clone(&stats);
        tasks.spawn_local(async move {
            let conn = workload.connection(index);
            let deadline = tokio::time::Instant::from_std(window.closes);
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => {}
                () = drive_connection(addr, &*workload, conn, &stats, window) => {}
            }
        });
    }
    runtime.block_on(tasks);
    let now = crate::cpu::thread_cpu();
    let mut stats = Rc::try_unwrap(stats)
        .map_err(|_| anyhow::anyhow!("a connection task outlived its runtime"))?
        .into_inner();
    stats.load_cpu = now.saturating_sub(cpu_at_open.get().unwrap_or(now));
    Ok(stats)
}

/// One connection's closed loop: connect, then send each next request as soon as the previous
/// response is read; connect again after the server closes or an error. Returns at the
/// deadline, or is cancelled there by [`drive_thread`] while it waits.
async fn drive_connection<W: Workload>(
    addr: SocketAddr,
    workload: &W,
    mut conn: W::Conn,
    stats: &RefCell<Stats>,
    window: Window,
) {
    let host = addr.to_string();
    let mut client: Option<Client> = None;
    let mut connected_once = false;
    loop {
        let client_ref = match &mut client {
            Some(client) => client,
            None => {
                let now = Instant::now();
                if now >= window.closes {
                    return;
                }
                let measured = now >= window.opens;
                if connected_once && measured {
                    stats.borrow_mut().reconnects += 1;
                }
                match Client::connect(addr).await {
                    Ok(new) => {
                        connected_once = true;
                        client.insert(new)
                    }
                    Err(e) => {
                        if measured {
                            stats
                                .borrow_mut()
                                .error(|| format!("connecting to {addr}: {e}"));
                        }
                        tokio::time::sleep(RECONNECT_PAUSE).await;
                        continue;
                    }
                }
            }
        };
        let req = workload.next(&mut conn);
        let sent = Instant::now();
        if sent >= window.closes {
            return;
        }
        let measured = sent >= window.opens;
        let outcome = client_ref
            .exchange(&req, &host, |resp| {
                let done = Instant::now();
                if done >= window.closes {
                    return false;
                }
                let checked = workload.check(&mut conn, &req, resp, sent, done);
                if measured {
                    let mut stats = stats.borrow_mut();
                    stats.requests += 1;
                    record_latency(&mut stats.latency, sent, done);
                    match resp.status {
                        200..=299 => {}
                        304 => stats.not_modified += 1,
                        _ => stats.non_2xx += 1,
                    }
                    if let Err(message) = checked {
                        stats.error(|| message);
                    }
                }
                true
            })
            .await;
        match outcome {
            Ok((true, keep_alive)) => {
                if !keep_alive {
                    client = None;
                }
            }
            // The response came after the deadline: not counted.
            Ok((false, _)) => return,
            Err(e) => {
                if measured && Instant::now() < window.closes {
                    stats
                        .borrow_mut()
                        .error(|| format!("{} {}: {e}", req.method, req.path));
                }
                client = None;
            }
        }
    }
}

/// How the length of a response body is known.
#[derive(Clone, Copy, Debug)]
enum Framing {
    /// `Content-Length` bytes (none for 204, 304 and responses to `HEAD`).
    Length(usize),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Neither: the body lasts until the server closes the connection.
    UntilClose,
}

/// One keep-alive HTTP/1.1 connection with its reused buffers.
struct Client {
    /// The socket, with `TCP_NODELAY`.
    stream: TcpStream,
    /// The encoded request.
    write: Vec<u8>,
    /// The bytes of the response read so far.
    read: Vec<u8>,
    /// A chunked body, decoded.
    chunked: Vec<u8>,
}

impl Client {
    /// Connects to `addr` and turns Nagle's algorithm off.
    async fn connect(addr: SocketAddr) -> std::io::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Self {
            stream,
            write: Vec::with_capacity(1024),
            read: Vec::with_capacity(READ_CHUNK),
            chunked: Vec::new(),
        })
    }

    /// Sends `req` and reads its response, then calls `judge` with it. Returns what `judge`
    /// returned and whether the connection may be used again, or a description of what failed
    /// (after which the connection must be dropped).
    async fn exchange<R>(
        &mut self,
        req: &Request,
        host: &str,
        judge: impl FnOnce(&Response<'_>) -> R,
    ) -> Result<(R, bool), String> {
        self.write.clear();
        req.encode(host, &mut self.write);
        self.stream
            .write_all(&self.write)
            .await
            .map_err(|e| format!("writing the request: {e}"))?;
        // Closed loop, no pipelining: bytes left from an earlier response would be a protocol
        // error that the previous parse reported already.
        self.read.clear();
        let head_only = req.method == Method::HEAD;
        let mut eof = false;
        // The total length of the message, once the head is parsed and the body has a length:
        // no need to parse again until that many bytes are in.
        let mut wanted = 0;
        // False after an interim response, whose successor may be buffered already.
        let mut read_first = true;
        loop {
            if read_first {
                if self.read.capacity() - self.read.len() < MIN_SPARE {
                    self.read.reserve(READ_CHUNK);
                }
                let read = self
                    .stream
                    .read_buf(&mut self.read)
                    .await
                    .map_err(|e| format!("reading the response: {e}"))?;
                if read == 0 {
                    if self.read.is_empty() {
                        return Err("the server closed the connection before responding".into());
                    }
                    eof = true;
                } else if self.read.len() < wanted {
                    continue;
                }
            }
            read_first = true;
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut head = httparse::Response::new(&mut headers);
            let head_len = match head.parse(&self.read) {
                Ok(httparse::Status::Complete(len)) => len,
                Ok(httparse::Status::Partial) if !eof => continue,
                Ok(httparse::Status::Partial) => {
                    return Err("the server closed the connection mid-response".into())
                }
                Err(e) => return Err(format!("malformed response head: {e}")),
            };
            let status = head.code.unwrap_or_default();
            if (100..200).contains(&status) {
                // An interim response (100 Continue): drop it and read the final one.
                self.read.drain(..head_len);
                wanted = 0;
                read_first = self.read.is_empty();
                continue;
            }
            let mut keep_alive = head.version == Some(1);
            let mut framing = Framing::UntilClose;
            for header in head.headers.iter() {
                if header.name.eq_ignore_ascii_case("content-length") {
                    let length = std::str::from_utf8(header.value)
                        .ok()
                        .and_then(|value| value.trim().parse().ok())
                        .ok_or_else(|| "malformed Content-Length".to_owned())?;
                    framing = Framing::Length(length);
                } else if header.name.eq_ignore_ascii_case("transfer-encoding") {
                    if header.value.eq_ignore_ascii_case(b"chunked") {
                        framing = Framing::Chunked;
                    }
                } else if header.name.eq_ignore_ascii_case("connection") {
                    keep_alive = if header.value.eq_ignore_ascii_case(b"close") {
                        false
                    } else {
                        keep_alive || header.value.eq_ignore_ascii_case(b"keep-alive")
                    };
                }
            }
            if head_only || status == 204 || status == 304 {
                framing = Framing::Length(0);
            }
            let rest = &self.read[head_len..];
            let body: &[u8] = match framing {
                Framing::Length(length) => {
                    if rest.len() < length {
                        if eof {
                            return Err("the server closed the connection mid-body".into());
                        }
                        wanted = head_len + length;
                        continue;
                    }
                    &rest[..length]
                }
                Framing::Chunked => match decode_chunked(rest, &mut self.chunked)? {
                    Some(_) => &self.chunked,
                    None if eof => return Err("the server closed the connection mid-body".into()),
                    None => continue,
                },
                Framing::UntilClose => {
                    if !eof {
                        continue;
                    }
                    keep_alive = false;
                    rest
                }
            };
            let keep_alive = keep_alive && !eof;
            if keep_alive {
                // Closed loop: nothing more comes until the next request is written, so mark
                // the socket not readable now. The next read then waits for the response
                // instead of first failing with `WouldBlock` (a system call saved per request).
                let _ = self.stream.try_io(Interest::READABLE, || {
                    Err::<(), _>(std::io::ErrorKind::WouldBlock.into())
                });
            }
            let response = Response {
                status,
                headers: head.headers,
                body,
            };
            return Ok((judge(&response), keep_alive));
        }
    }
}

/// Decodes the chunked body at the start of `src` into `out` (cleared first). Returns the
/// length of the whole chunked body in `src` (trailers included) once it is all there, `None`
/// while it is not, or an error for malformed chunks.
fn decode_chunked(src: &[u8], out: &mut Vec<u8>) -> Result<Option<usize>, String> {
    out.clear();
    let mut at = 0;
    loop {
        let (size_len, size) = match httparse::parse_chunk_size(&src[at..]) {
            Ok(httparse::Status::Complete(found)) => found,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(_) => return Err("malformed chunk size".into()),
        };
        at += size_len;
        if size == 0 {
            // Trailers (usually none), each ending in CRLF, then an empty line.
            loop {
                let Some(end) = src[at..].windows(2).position(|pair| pair == b"\r\n") else {
                    return Ok(None);
                };
                at += end + 2;
                if end == 0 {
                    return Ok(Some(at));
                }
            }
        }
        let size = usize::try_from(size).map_err(|_| "chunk too large".to_owned())?;
        if src.len() - at < size + 2 {
            return Ok(None);
        }
        out.extend_from_slice(&src[at..at + size]);
        if &src[at + size..at + size + 2] != b"\r\n" {
            return Err("a chunk does not end in CRLF".into());
        }
        at += size + 2;
    }
}

#[cfg(test)]
mod tests;
