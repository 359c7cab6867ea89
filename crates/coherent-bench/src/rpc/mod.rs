//! The `rpc` suite: our protocol against tonic, tarpc, HTTP JSON and a raw TCP limit, all
//! served and called in this process over loopback, each peer at its best measured setting.
//! Result names are the stable ones of issue 3 (`calls.sum.coherent`, ...).

mod coherent;
mod harness;
mod http;
mod model;
mod peer;
mod rawtcp;
mod tarpc_peer;
mod tonic_peer;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use ::coherent::rpc::Compression;
use indicatif::ProgressBar;

use crate::report::{percentile, progress, Report, Row};
use crate::Timing;
use coherent::Coherent;
use harness::{interleaved, micros, throughput, Work};
use http::Http;
use model::PayloadKind;
use peer::Peer;
use rawtcp::RawTcp;
use tarpc_peer::Tarpc;
use tonic_peer::Tonic;

#[derive(Clone, Copy)]
enum Call {
    Sum,
    GetUser,
    SayHello,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Self::Sum => "sum",
            Self::GetUser => "getuser",
            Self::SayHello => "sayhello",
        }
    }
}

/// (callers, connections) settings tried per peer; the best counts. `--quick` tries the first.
fn settings(peer: &str) -> &'static [(usize, usize)] {
    match peer {
        "http" => &[(50, 50), (16, 16)],
        "tonic" | "tarpc" => &[(200, 2), (1000, 4), (200, 1)],
        _ => &[(200, 2), (1000, 2), (200, 1)],
    }
}

/// Runs the suite on its own multi-threaded runtime (one worker per core).
pub(crate) fn run(timing: Timing, only: &str) -> anyhow::Result<Report> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run_async(timing, only))
}

struct Servers {
    coherent: SocketAddr,
    rawtcp: SocketAddr,
    tarpc: SocketAddr,
    tonic: SocketAddr,
    http: SocketAddr,
}

async fn run_async(timing: Timing, only: &str) -> anyhow::Result<Report> {
    // `only` selects whole name segments: "streams.1" runs streams.1, not streams.100.
    let wanted = |group: &str| {
        only.is_empty()
            || group == only
            || group.starts_with(&format!("{only}."))
            || only.starts_with(&format!("{group}."))
    };
    let quick = timing.runs == 1;
    let mut report = Report::new("rpc");
    let s = Servers {
        coherent: coherent::start(Compression::None).await?,
        rawtcp: rawtcp::start().await?,
        tarpc: tarpc_peer::start().await?,
        tonic: tonic_peer::start().await?,
        http: http::start().await?,
    };
    let bar = progress(15 + 6 + 10 + 10 + 11);

    for call in [Call::Sum, Call::GetUser, Call::SayHello] {
        if !wanted(&format!("calls.{}", call.name())) {
            continue;
        }
        calls(&mut report, &bar, timing, quick, &s, call).await?;
    }

    for (size, label) in [(1u32, "1"), (100, "100"), (10_240, "10k")] {
        if !wanted(&format!("streams.{label}")) {
            continue;
        }
        streams(&mut report, &bar, timing, quick, &s, size, label).await?;
    }

    if wanted("latency") {
        let probes = [
            Probe::new::<Coherent>(s.coherent).await?,
            Probe::new::<Tonic>(s.tonic).await?,
            Probe::new::<Tarpc>(s.tarpc).await?,
            Probe::new::<Http>(s.http).await?,
            Probe::new::<RawTcp>(s.rawtcp).await?,
        ];
        latency(&mut report, &bar, timing, &probes).await?;
    }

    if wanted("payload") {
        payloads(&mut report, &bar, timing, &s).await?;
    }
    bar.finish_and_clear();

    report.note("every peer serves and calls in this process over 127.0.0.1; ratios compare coherent with tonic (other peers: with coherent)");
    report.note("latency: the peers take turns, 8 new-connection samples (each a connect, one call and a drop) or 100 calls on a kept connection at a time; calls made from the thread that runs the runtime's block_on");
    report.note("calls: each peer's best of (callers, connections) settings, shown in its row, all peers' runs taking turns; coherent/rawtcp tried (200,2) (1000,2) (200,1), tonic/tarpc (200,2) (1000,4) (200,1), http (50,50) (16,16)");
    report.note("coherent: postcard, no compression, default limits but 16 MB messages, stream window 1024 items, zero-RTT connects, the default 512 KiB TCP send buffer to a loopback peer (other peers: the kernel's autotuning; tonic offers no such setting); tonic: HTTP/2, TCP_NODELAY, 8 MB windows; tarpc: bincode serde transport, requests spawned; http: axum + hyper pool, JSON; rawtcp: length-prefixed postcard frames, one batching writer and one reader per connection, answers computed inline");
    report.note(
        "payload: 10 MiB echoed per round trip by one caller; MB/s = 10.49 MB x round trips/s",
    );
    Ok(report)
}

async fn connect_all<P: Peer>(addr: SocketAddr, n: usize) -> anyhow::Result<Vec<P>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(P::connect(addr).await?);
    }
    Ok(out)
}

fn call_work<P: Peer>(clients: Vec<P>, call: Call) -> Work {
    let clients = Arc::new(clients);
    Arc::new(move |i| {
        let c = clients[i % clients.len()].clone();
        Box::pin(async move {
            match call {
                Call::Sum => {
                    let r = c.sum(i as i32, 1).await?;
                    anyhow::ensure!(r == i as i32 + 1, "wrong sum");
                }
                Call::GetUser => {
                    let u = c.get_user(i as i64).await?;
                    anyhow::ensure!(u == model::user(i as i64), "wrong user");
                }
                Call::SayHello => {
                    let h = model::hello();
                    let r = c.say_hello(h.clone()).await?;
                    anyhow::ensure!(r == h, "the echo differs from the request");
                }
            }
            Ok(1)
        })
    })
}

/// A new connection, one call on it, and its close, per unit: `latency.connect_call`'s
/// work, for `rpc-count`.
fn connect_work<P: Peer>(addr: SocketAddr) -> Work {
    Arc::new(move |i| {
        Box::pin(async move {
            let c = P::connect(addr).await?;
            anyhow::ensure!(c.sum(i as i32, 1).await? == i as i32 + 1, "wrong sum");
            drop(c);
            Ok(1)
        })
    })
}

/// One peer's cases for `call`: a [`Work`] per (callers, connections) setting it tries.
async fn call_cases<P: Peer>(
    quick: bool,
    addr: SocketAddr,
    call: Call,
) -> anyhow::Result<Vec<(usize, usize, Work)>> {
    let tried = if quick {
        &settings(P::NAME)[..1]
    } else {
        settings(P::NAME)
    };
    let mut out = Vec::with_capacity(tried.len());
    for &(callers, connections) in tried {
        let clients = connect_all::<P>(addr, connections).await?;
        out.push((callers, connections, call_work(clients, call)));
    }
    Ok(out)
}

/// Every peer's calls/s on `call`, each at its best setting. The runs of all peers and
/// settings take turns, so that a slow phase of the machine hits every peer alike (run
/// one after the other, a ratio moved by a third between runs on 2 vCPUs).
async fn calls(
    report: &mut Report,
    bar: &ProgressBar,
    timing: Timing,
    quick: bool,
    s: &Servers,
    call: Call,
) -> anyhow::Result<()> {
    bar.set_message(format!("calls.{}", call.name()));
    let peers = [
        (
            Coherent::NAME,
            call_cases::<Coherent>(quick, s.coherent, call).await?,
        ),
        (
            Tonic::NAME,
            call_cases::<Tonic>(quick, s.tonic, call).await?,
        ),
        (
            Tarpc::NAME,
            call_cases::<Tarpc>(quick, s.tarpc, call).await?,
        ),
        (Http::NAME, call_cases::<Http>(quick, s.http, call).await?),
        (
            RawTcp::NAME,
            call_cases::<RawTcp>(quick, s.rawtcp, call).await?,
        ),
    ];
    let cases: Vec<(usize, Work)> = peers
        .iter()
        .flat_map(|(_, list)| list.iter().map(|(callers, _, w)| (*callers, w.clone())))
        .collect();
    let mut results = interleaved(timing, &cases).await?.into_iter();
    for (peer, list) in &peers {
        let mut best = (0f64, 0, 0);
        for &(callers, connections, _) in list {
            let v = results.next().expect("one result per case");
            if v > best.0 {
                best = (v, callers, connections);
            }
        }
        let name = format!("calls.{}.{peer}", call.name());
        let mut row = Row::new(name, best.0, "calls/s")
            .with("callers", best.1)
            .with("connections", best.2);
        row = if *peer == Coherent::NAME {
            row.compared_to(&format!("calls.{}.tonic", call.name()))
        } else {
            row.compared_to(&format!("calls.{}.coherent", call.name()))
        };
        report.push(row);
        bar.inc(1);
    }
    Ok(())
}

async fn streams(
    report: &mut Report,
    bar: &ProgressBar,
    timing: Timing,
    quick: bool,
    s: &Servers,
    size: u32,
    label: &str,
) -> anyhow::Result<()> {
    let tried: &[(usize, usize)] = if quick { &[(4, 1)] } else { &[(4, 1), (16, 2)] };
    let name = |peer: &str| format!("streams.{label}.{peer}");
    bar.set_message(name("coherent"));
    // Per setting, ours and tonic's runs take turns; each peer's best setting counts.
    let mut best = [(0f64, 0, 0); 2];
    for &(callers, connections) in tried {
        let ours = Arc::new(connect_all::<Coherent>(s.coherent, connections).await?);
        let ours: Work = Arc::new(move |i| {
            let c = ours[i % ours.len()].clone();
            Box::pin(async move { c.items(model::STREAM_ITEMS, size).await })
        });
        let theirs = Arc::new(connect_all::<Tonic>(s.tonic, connections).await?);
        let theirs: Work = Arc::new(move |i| {
            let c = theirs[i % theirs.len()].clone();
            Box::pin(async move { c.items(model::STREAM_ITEMS, size).await })
        });
        let v = interleaved(timing, &[(callers, ours), (callers, theirs)]).await?;
        for (b, v) in best.iter_mut().zip(v) {
            if v > b.0 {
                *b = (v, callers, connections);
            }
        }
    }
    for (peer, (v, callers, connections)) in ["coherent", "tonic"].into_iter().zip(best) {
        let mut row = Row::new(name(peer), v, "items/s")
            .with("streams", callers)
            .with("connections", connections);
        if peer == "coherent" {
            row = row.compared_to(&name("tonic"));
        }
        report.push(row);
        bar.inc(1);
    }
    Ok(())
}

type Sample<T> = Pin<Box<dyn Future<Output = anyhow::Result<T>> + Send>>;

/// One peer's latency samples: a new connection and one call (connect and call µs), and
/// one call on a connection kept open (µs).
struct Probe {
    name: &'static str,
    connect_call: Box<dyn Fn() -> Sample<(f64, f64)> + Send + Sync>,
    call: Box<dyn Fn() -> Sample<f64> + Send + Sync>,
}

impl Probe {
    async fn new<P: Peer>(addr: SocketAddr) -> anyhow::Result<Self> {
        let kept = P::connect(addr).await?;
        Ok(Self {
            name: P::NAME,
            connect_call: Box::new(move || {
                Box::pin(async move {
                    let t0 = Instant::now();
                    let c = P::connect(addr).await?;
                    let t1 = Instant::now();
                    anyhow::ensure!(c.sum(1, 2).await? == 3);
                    let t2 = Instant::now();
                    drop(c);
                    Ok((micros(t1 - t0), micros(t2 - t1)))
                })
            }),
            call: Box::new(move || {
                let c = kept.clone();
                Box::pin(async move {
                    let t0 = Instant::now();
                    anyhow::ensure!(c.sum(1, 2).await? == 3);
                    Ok(micros(t0.elapsed()))
                })
            }),
        })
    }
}

/// New-connection samples a peer makes in a row before the next peer's turn. A closed
/// connection's teardown runs on while the next connection is set up, so a sample pays
/// for the teardown before it: in runs, most samples pay for their own peer's previous
/// connection, as in a client that connects again and again, instead of every sample
/// paying for the same other peer's (sample by sample, each peer followed one fixed peer).
const CONNECT_RUN: usize = 8;

/// The latency cases of every peer. The peers take turns, in runs of [`CONNECT_RUN`]
/// samples for a new connection and of 100 calls on a kept one, so that a slow phase of
/// the machine hits every peer alike.
async fn latency(
    report: &mut Report,
    bar: &ProgressBar,
    timing: Timing,
    probes: &[Probe],
) -> anyhow::Result<()> {
    bar.set_message("latency.connect_call");
    let n = probes.len();
    let (mut connects, mut calls, mut totals) = (
        vec![Vec::new(); n],
        vec![Vec::new(); n],
        vec![Vec::new(); n],
    );
    let budget = timing.run * n as u32;
    let start = Instant::now();
    while totals[0].len() < 5_000 && (totals[0].len() < 50 || start.elapsed() < budget) {
        for (i, p) in probes.iter().enumerate() {
            for _ in 0..CONNECT_RUN {
                let (connect, call) = (p.connect_call)().await?;
                connects[i].push(connect);
                calls[i].push(call);
                totals[i].push(connect + call);
            }
        }
    }

    bar.set_message("latency.rtt");
    let mut rtts = vec![Vec::new(); n];
    for p in probes {
        for _ in 0..10 {
            (p.call)().await?;
        }
    }
    let start = Instant::now();
    while rtts[0].len() < 1_000 || start.elapsed() < budget {
        for (i, p) in probes.iter().enumerate() {
            for _ in 0..100 {
                rtts[i].push((p.call)().await?);
            }
        }
    }

    for (i, p) in probes.iter().enumerate() {
        for v in [
            &mut totals[i],
            &mut connects[i],
            &mut calls[i],
            &mut rtts[i],
        ] {
            v.sort_by(f64::total_cmp);
        }
        let mut row = Row::new(
            format!("latency.connect_call.{}", p.name),
            percentile(&totals[i], 0.5),
            "us",
        )
        .with("connect_us", percentile(&connects[i], 0.5))
        .with("call_us", percentile(&calls[i], 0.5))
        .with("samples", totals[i].len());
        if p.name == "coherent" {
            row = row.compared_to("latency.connect_call.tonic");
        }
        report.push(row);
        for (q, label) in [(0.5, "rtt_p50"), (0.99, "rtt_p99")] {
            let mut row = Row::new(
                format!("latency.{label}.{}", p.name),
                percentile(&rtts[i], q),
                "us",
            )
            .with("samples", rtts[i].len());
            if p.name == "coherent" {
                row = row.compared_to(&format!("latency.{label}.tonic"));
            }
            report.push(row);
        }
        bar.inc(2);
    }
    Ok(())
}

async fn payloads(
    report: &mut Report,
    bar: &ProgressBar,
    timing: Timing,
    s: &Servers,
) -> anyhow::Result<()> {
    let mb = model::PAYLOAD_LEN as f64 / 1e6;
    let data: Vec<_> = PayloadKind::ALL
        .iter()
        .map(|k| (*k, k.make(model::PAYLOAD_LEN)))
        .collect();
    // Uncompressed, ours and tonic's runs take turns: these rows are compared.
    let coherent = Coherent(coherent::connect_with(s.coherent, Compression::None).await?);
    let tonic = Tonic(tonic_peer::connect_with(s.tonic, false).await?);
    for (kind, bytes) in &data {
        let name = |peer: &str| format!("payload.10mb.{}.none.{peer}", kind.name());
        bar.set_message(name("coherent"));
        let ours = echo_work(
            coherent.clone(),
            bytes.clone(),
            |c: Coherent, b| async move { c.echo(b).await },
        );
        let theirs = echo_work(tonic.clone(), bytes.clone(), |c: Tonic, b| async move {
            c.echo(b).await
        });
        let v = interleaved(timing, &[(1, ours), (1, theirs)]).await?;
        // The chart draws each kind of payload in one panel, compressed or not.
        let group = format!("payload.10mb.{}", kind.name());
        report.push(
            Row::new(name("coherent"), v[0] * mb, "MB/s")
                .compared_to(&name("tonic"))
                .in_group(&group),
        );
        report.push(Row::new(name("tonic"), v[1] * mb, "MB/s").in_group(&group));
        bar.inc(2);
    }
    for (compression, label) in [(Compression::Lz4, "lz4"), (Compression::Zstd, "zstd")] {
        let addr = coherent::start(compression).await?;
        let client = Coherent(coherent::connect_with(addr, compression).await?);
        for (kind, bytes) in &data {
            let name = format!("payload.10mb.{}.{label}.coherent", kind.name());
            bar.set_message(name.clone());
            let work = echo_work(client.clone(), bytes.clone(), |c: Coherent, b| async move {
                c.echo(b).await
            });
            let v = throughput(timing, 1, work).await? * mb;
            let group = format!("payload.10mb.{}", kind.name());
            report.push(Row::new(name, v, "MB/s").in_group(&group));
            bar.inc(1);
        }
    }
    let client = Tonic(tonic_peer::connect_with(s.tonic, true).await?);
    for (kind, bytes) in &data {
        let name = format!("payload.10mb.{}.gzip.tonic", kind.name());
        bar.set_message(name.clone());
        let work = echo_work(client.clone(), bytes.clone(), |c: Tonic, b| async move {
            c.echo(b).await
        });
        let v = throughput(timing, 1, work).await? * mb;
        let group = format!("payload.10mb.{}", kind.name());
        report.push(Row::new(name, v, "MB/s").in_group(&group));
        bar.inc(1);
    }
    Ok(())
}

/// One caller echoing `bytes` through `echo`, checking that the answer equals what it sent.
fn echo_work<C, Fut>(client: C, bytes: bytes::Bytes, echo: fn(C, bytes::Bytes) -> Fut) -> Work
where
    C: Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<bytes::Bytes>> + Send + 'static,
{
    Arc::new(move |_| {
        let (c, bytes) = (client.clone(), bytes.clone());
        Box::pin(async move {
            let back = echo(c, bytes.clone()).await?;
            anyhow::ensure!(back == bytes, "the echo differs");
            Ok(1)
        })
    })
}

/// `rpc-count`: a fixed amount of work on one peer, untimed, for instruction counts under
/// `valgrind --tool=callgrind` (two runs of different sizes: the difference in instructions
/// over the difference in work is what one call or item costs, client and server together,
/// in user space; the kernel's share is not counted). `case`: `sum` (`n` unary calls from
/// `callers` tasks on one connection) or `streams.<size>` (`n` items in streams of
/// [`model::STREAM_ITEMS`], `callers` at once); `peer`: `coherent`, `tonic`, and for `sum`
/// also `rawtcp`. Runs on a runtime like the suite's.
pub(crate) fn count(peer: &str, case: &str, n: u64, callers: usize) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let callers = callers.max(1);
    let done = runtime.block_on(async {
        let work: Work = match (peer, case) {
            ("coherent", "sum") => call_work(
                vec![Coherent::connect(coherent::start(Compression::None).await?).await?],
                Call::Sum,
            ),
            ("tonic", "sum") => call_work(
                vec![Tonic::connect(tonic_peer::start().await?).await?],
                Call::Sum,
            ),
            ("rawtcp", "sum") => call_work(
                vec![RawTcp::connect(rawtcp::start().await?).await?],
                Call::Sum,
            ),
            ("coherent", "connect") => {
                connect_work::<Coherent>(coherent::start(Compression::None).await?)
            }
            ("tonic", "connect") => connect_work::<Tonic>(tonic_peer::start().await?),
            ("rawtcp", "connect") => connect_work::<RawTcp>(rawtcp::start().await?),
            (_, stream) if stream.starts_with("streams.") => {
                let size: u32 = stream["streams.".len()..].parse()?;
                match peer {
                    "coherent" => {
                        let c =
                            Coherent::connect(coherent::start(Compression::None).await?).await?;
                        Arc::new(move |_| {
                            let c = c.clone();
                            Box::pin(async move { c.items(model::STREAM_ITEMS, size).await })
                        })
                    }
                    "tonic" => {
                        let c = Tonic::connect(tonic_peer::start().await?).await?;
                        Arc::new(move |_| {
                            let c = c.clone();
                            Box::pin(async move { c.items(model::STREAM_ITEMS, size).await })
                        })
                    }
                    other => anyhow::bail!("no streams for {other:?}: coherent or tonic"),
                }
            }
            other => anyhow::bail!(
                "unknown peer and case {other:?}: coherent, tonic or rawtcp with sum or \
                 connect; coherent or tonic with streams.<size>"
            ),
        };
        // Each unit of work is one call, or one stream of STREAM_ITEMS items.
        let per_unit = if case == "sum" || case == "connect" {
            1
        } else {
            u64::from(model::STREAM_ITEMS)
        };
        let units = n.div_ceil(per_unit);
        let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let tasks: Vec<_> = (0..callers)
            .map(|i| {
                let (work, next) = (work.clone(), next.clone());
                tokio::spawn(async move {
                    let mut done = 0u64;
                    while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < units {
                        done += work(i).await?;
                    }
                    anyhow::Ok(done)
                })
            })
            .collect();
        let mut done = 0u64;
        for task in tasks {
            done += task.await??;
        }
        anyhow::Ok(done)
    })?;
    println!("{peer} {case}: {done} done by {callers} callers");
    Ok(())
}
