//! `coherent-bench`: Coherent's benchmark suites, each measuring ours against real peers in the
//! same run, on the same machine, and reporting ratios.
//!
//! ```text
//! cargo run --release -p coherent-bench -- local|rpc|remote|cluster|tasks|hostile [--json out.json] [--chart out.svg] [--quick] [--seconds N]
//! ```
//!
//! `--chart PATH` writes an SVG of the run: a bar panel per row group, ours against each peer,
//! every peer's bar labelled with ours' ratio to it (see `chart.rs`).

mod chart;
mod cluster;
mod cpu;
mod dbchanges;
mod hostile;
mod load;
mod local;
mod remote;
mod report;
mod rpc;
mod tasks;
mod tasks_faults;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};

/// Command-line options shared by every suite.
#[derive(Parser, Debug)]
#[command(
    name = "coherent-bench",
    about = "Coherent's benchmarks, measured side by side with peers"
)]
struct Cli {
    #[command(subcommand)]
    suite: Suite,
    /// Write the results as JSON to this file.
    #[arg(long, global = true)]
    json: Option<PathBuf>,
    /// Write an SVG chart to this file: a bar panel per row group (`calls.sum`, ...), ours
    /// against each peer, each peer's bar labelled with ours ÷ it.
    #[arg(long, global = true)]
    chart: Option<PathBuf>,
    /// Run every case for a fraction of a second (a smoke run, for CI).
    #[arg(long, global = true)]
    quick: bool,
    /// Seconds per measured run (each case: a warm-up, then the best of 3 runs).
    #[arg(long, global = true, default_value_t = 3.0)]
    seconds: f64,
    /// Run only the `rpc` cases under this name (`calls`, `calls.sum`, `streams`,
    /// `streams.1`, `latency`, `payload`), only the `tasks` rows whose name contains this
    /// (`mixed`, `tasks.sqlite`, `get_one.coherent`), or only the `cluster` phases whose
    /// name contains it (`cached`, `propagation`, `nats`, `direct`, `ttl`, `commands`), or,
    /// in `local`, `1reader`: ours and the peers side by side, nothing else: for iterating on
    /// one part.
    #[arg(long, global = true)]
    only: Option<String>,
}

#[derive(Subcommand, Debug, Clone)]
enum Suite {
    /// The compute core in one process: a user service over SQLite and PostgreSQL, direct vs
    /// cached, against a concurrent map, moka and quick_cache.
    Local,
    /// The RPC protocol against tonic, tarpc, HTTP JSON and a raw TCP limit: calls, streams,
    /// latency and 10 MB payloads.
    Rpc,
    /// Compute services over the wire: client replicas against in-process, RPC round-trip
    /// and (later) HTTP reads of the same service, with writes invalidating.
    Remote,
    /// Three hosts (child processes) over one PostgreSQL, commands through coherent-ops:
    /// cached readers against direct queries and a 1 s TTL cache, stale reads counted;
    /// commands against plain writes; propagation over LISTEN/NOTIFY and NATS.
    Cluster,
    /// Changes made outside the application (a plain connection updating 200 users a
    /// second) reaching cached readers through the change feed: readers and stale reads
    /// against direct queries and a 1 s TTL cache, on one host and two; propagation.
    Dbchanges,
    /// The Tasks API (apps/tasks) under an HTTP load generator in the shape of wrk: its
    /// `direct`, `grpc` and `coherent` backends side by side, on PostgreSQL and SQLite.
    Tasks {
        /// Also run the real `wrk` (Debian package) for every row, reported beside ours.
        #[arg(long)]
        wrk: bool,
    },
    /// The Tasks app's Coherent backend (a child process) under attack: a well-behaved
    /// client's read p99 with and without 50 hostile connections, the server's peak RSS,
    /// and write p99 with 1,000 WebSocket replica clients, 100 of them silent.
    Hostile,
    /// The server of the `hostile` suite (the suite starts it as a child process).
    #[command(hide = true)]
    HostileServer(hostile::ServerArgs),
    /// A host of the `cluster` suite (the suite starts these as child processes).
    #[command(hide = true)]
    ClusterHost(cluster::HostArgs),
    /// A host process of the `cluster` suite's checker phases (settings in its environment).
    #[command(hide = true)]
    CheckerHost,
    /// One figure of the `local` suite's memory and scale rows (the suite starts these as
    /// child processes, one per figure).
    #[command(hide = true)]
    MemoryProbe(ProbeArgs),
    /// A fixed amount of `rpc` work on one peer, untimed: for counting instructions per call
    /// or per stream item under callgrind (see BENCHMARKS.md).
    #[command(hide = true)]
    RpcCount {
        /// `coherent`, `tonic` or `rawtcp` (`sum` only).
        peer: String,
        /// `sum`, `connect` (a new connection, one call, its close), or
        /// `streams.<item size>` (`streams.1`, `streams.100`).
        case: String,
        /// How many calls, or stream items.
        #[arg(long, default_value_t = 100_000)]
        n: u64,
        /// How many calls or streams at once, on one connection.
        #[arg(long, default_value_t = 200)]
        callers: usize,
    },
    /// A fixed number of reads of a task through one of the Tasks app's routers, called in
    /// this process and untimed: for counting instructions per request of the router's own
    /// work under callgrind (see BENCHMARKS.md).
    #[command(hide = true)]
    HttpCount {
        /// `coherent`, `static` or `direct` (on SQLite).
        router: String,
        /// How many requests.
        #[arg(long, default_value_t = 100_000)]
        n: u64,
        /// Each request a `PATCH` of a task's status instead of a read.
        #[arg(long)]
        patch: bool,
        /// With `--patch`: each `PATCH` followed by a read of its task (two requests).
        #[arg(long)]
        read_after: bool,
        /// On PostgreSQL (`DATABASE_URL`, a schema of its own) instead of SQLite.
        #[arg(long)]
        postgres: bool,
    },
    /// A fixed number of single-reader `local` calls on one contender, untimed: for counting
    /// instructions per call under callgrind (see BENCHMARKS.md).
    #[command(hide = true)]
    Hits {
        /// `ours`, `map`, `moka` or `quickcache`.
        contender: String,
        /// How many calls.
        #[arg(long, default_value_t = 1_000_000)]
        calls: u64,
        /// How many threads share them.
        #[arg(long, default_value_t = 1)]
        threads: usize,
    },
}

/// One `local` memory or scale figure, measured in this fresh process (see `local/memory.rs`).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct ProbeArgs {
    /// `coherent.leaf`, `coherent.node_leaf`, `coherent.dag4`, `coherent.cascade`, `map`,
    /// `moka` or `quickcache`.
    shape: String,
    /// How many results to build.
    #[arg(long, default_value_t = 1_000_000)]
    keys: u64,
    /// Then read them for this many seconds (not for `coherent.cascade`).
    #[arg(long, default_value_t = 0.0)]
    hit_seconds: f64,
}

/// How long and how often each case runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timing {
    pub(crate) run: Duration,
    pub(crate) warmup: Duration,
    pub(crate) runs: usize,
}

impl Timing {
    fn from_cli(cli: &Cli) -> Self {
        if cli.quick {
            Self {
                run: Duration::from_millis(150),
                warmup: Duration::from_millis(50),
                runs: 1,
            }
        } else {
            Self {
                run: Duration::from_secs_f64(cli.seconds.max(0.1)),
                warmup: Duration::from_secs_f64((cli.seconds / 3.0).max(0.1)),
                runs: 3,
            }
        }
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // `RUST_LOG=warn` (say) prints what the servers under test log, on stderr.
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    if cli.only.is_some()
        && !matches!(
            cli.suite,
            Suite::Rpc | Suite::Tasks { .. } | Suite::Cluster | Suite::Local
        )
    {
        anyhow::bail!("--only applies to the local, rpc, tasks and cluster suites");
    }
    let timing = Timing::from_cli(&cli);
    let report = match &cli.suite {
        Suite::Hits {
            contender,
            calls,
            threads,
        } => return local::count_calls(contender, *calls, *threads),
        Suite::HttpCount {
            router,
            n,
            patch,
            read_after,
            postgres,
        } => return tasks::count_requests(router, *n, *patch, *read_after, *postgres),
        Suite::RpcCount {
            peer,
            case,
            n,
            callers,
        } => return rpc::count(peer, case, *n, *callers),
        Suite::MemoryProbe(args) => {
            return local::memory::probe(&args.shape, args.keys, args.hit_seconds)
        }
        Suite::Local => local::run(timing, cli.only.as_deref().unwrap_or(""))?,
        Suite::Rpc => rpc::run(timing, cli.only.as_deref().unwrap_or(""))?,
        Suite::Remote => remote::run(timing)?,
        Suite::Dbchanges => dbchanges::run(timing)?,
        Suite::Cluster => cluster::run(timing, cli.only.as_deref().unwrap_or(""))?,
        Suite::Tasks { wrk } => tasks::run(timing, *wrk, cli.only.as_deref().unwrap_or(""))?,
        Suite::Hostile => hostile::run(timing)?,
        Suite::HostileServer(args) => return hostile::server::main(args.clone()),
        Suite::ClusterHost(args) => return cluster::host::main(args.clone()),
        Suite::CheckerHost => return cluster::checker::host_main(),
    };
    report.print_table();
    if let Some(path) = &cli.json {
        report.write_json(path)?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &cli.chart {
        chart::write(&report, path)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
