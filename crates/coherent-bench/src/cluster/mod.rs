//! The `cluster` suite: three hosts as child processes of the bench (the `local` suite's
//! `UserService` over 1,000 users in PostgreSQL, a fresh schema per run), readers on each
//! host, and one mutator (a task in the parent) sending `UpdateUser` commands over RPC to a
//! random host every 5 ms.
//!
//! Rows (names are stable):
//!
//! - `cluster.cached.readers`: reads through the compute method `UserService::get` on hosts
//!   that are `coherent::ops::Host`s (the command's UPDATE and its operation in one
//!   transaction, the invalidation here, `LISTEN`/`NOTIFY` to the others); calls/s summed
//!   over the three hosts;
//! - `cluster.direct.readers`: a query per read through a pool (8 connections per host);
//! - `cluster.ttl.readers`: what a team would usually pick instead, a moka cache with a 1 s
//!   TTL per host in front of the same query. Its hosts, like the direct ones, run the
//!   mutator's command as the plain UPDATE (no log, no notification), and drop the user from
//!   their own cache after it (a team's cache forgets its own host's writes); the other
//!   hosts' copies live out their TTL;
//! - `cluster.commands`: commands/s through `Host::run` (the host's defaults: a command
//!   whose one write is deferred with its text, `Tx::defer_sql`, is one statement with its
//!   operation's row; commands that wait while the host's 8 transactions are busy commit
//!   together, in one transaction; the local invalidation;
//!   the NOTIFY queued for the host's notifying task; `commands_per_transaction` says how
//!   many shared a transaction on average) against
//!   `cluster.plain_writes`, the same UPDATE on its own (autocommit): both in the parent, from
//!   the same number of concurrent tasks (`WRITERS`), through the same pool (the host's);
//! - `cluster.propagation_p50_us.<pg|nats>`, `..._p99_us.<pg|nats>`: from the commit on one
//!   host to the invalidation applied on another (`Applied::applied_at - committed_at`,
//!   both wall clocks of this machine; `committed_at` is taken by the committing host
//!   right after its commit and its own invalidation), measured on three cached hosts with that
//!   notifier while only the mutator runs (readers idle). The pg rows also carry the p99
//!   measured during the `cluster.cached.readers` phase (`p99_under_readers_us`), when
//!   every core is busy with readers.
//!
//! Every reader row counts `stale_reads`: a read that starts at least 10 ms after the
//! mutator received the answer to the command that wrote a newer version of the user (the
//! command has committed and returned on its host by then) and returns an older version.
//! The mutator publishes, per user, that version and the time it got the answer in the
//! board, a file in /dev/shm mapped by every process (one atomic per user; see `board.rs`),
//! right after each answer; each read loads it as it starts. The cached row also counts
//! `stale_after_apply`: a read that starts after its host applied a newer version (the
//! handler's invalidation raises a per-user floor on that host right after invalidating)
//! and returns an older one. Stale counts are summed over the warm-up and every run; the
//! rate is the best run's.
//!
//! Hosts run with `cores()` tokio workers each, `READERS_PER_HOST` reader tasks each; all
//! three processes and PostgreSQL share this machine's cores. Children are killed when the
//! suite ends (a guard, also on error or panic) and exit by themselves when the parent dies
//! (their stdin closes). Without PostgreSQL the suite is skipped with a note; without NATS
//! (`NATS_URL`, default `nats://127.0.0.1:4222`) its rows are.

mod board;
pub(crate) mod checker;
pub(crate) mod host;

use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use coherent::ops::{CommandClient, Database, Host, Notifier};
use coherent::rpc::{service, Endpoint, Peer};
use serde::{Deserialize, Serialize};

use crate::local::store::{create_users, now_micros, to_i64, Store, PG_UPDATE};
use crate::local::Ids;
use crate::report::{percentile, progress, round2, Report, Row};
use crate::Timing;
use board::{now_us, Board, Floors};
pub(crate) use host::HostArgs;
use host::{UpdateUser, Users};

const HOSTS: usize = 3;
const READERS_PER_HOST: u32 = 8;
const MUTATOR_PERIOD: Duration = Duration::from_millis(5);
/// Concurrent writers of `cluster.commands` and `cluster.plain_writes`.
const WRITERS: usize = 8;

/// Readers' counts of one host over one run.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub(crate) struct Counts {
    pub(crate) calls: u64,
    pub(crate) stale_reads: u64,
    pub(crate) stale_after_apply: u64,
    pub(crate) elapsed_us: u64,
    /// The host's commands that answered without every other host's acknowledgement, from
    /// its start (cached hosts).
    #[serde(default)]
    pub(crate) ack_timeouts: u64,
}

/// Propagation samples a host gathered (from its `Applied` events of other hosts'
/// operations) since it was last asked.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct Propagation {
    pub(crate) samples_us: Vec<i64>,
    /// How many arrived by a read of the log rather than a notification.
    pub(crate) via_log: u64,
    /// Events the sampler missed (it fell behind).
    pub(crate) lagged: u64,
}

/// How the parent drives a host's readers.
#[service]
pub(crate) trait Control {
    /// Starts `readers` reader tasks (counts from zero).
    async fn start(&self, readers: u32) -> bool;
    /// Stops them; their counts.
    async fn stop(&self) -> Counts;
    /// The propagation samples since the last call.
    async fn propagation(&self) -> Propagation;
}

/// The child processes; killed when dropped.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Three running hosts and the parent's connections to them.
struct Cluster {
    _children: Children,
    addrs: Vec<SocketAddr>,
    controls: Vec<ControlClient>,
}

struct Settings {
    url: String,
    nats: String,
    schema: String,
    board: Arc<Board>,
    base_us: u64,
}

impl Cluster {
    async fn start(settings: &Settings, mode: &str, notifier: &str) -> anyhow::Result<Self> {
        let exe = std::env::current_exe()?;
        let mut children = Children(Vec::new());
        for _ in 0..HOSTS {
            let child = std::process::Command::new(&exe)
                .arg("cluster-host")
                .args(HostArgs::command_line(
                    &settings.schema,
                    notifier,
                    mode,
                    settings.board.path(),
                    settings.base_us,
                    &settings.url,
                    &settings.nats,
                ))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()?;
            children.0.push(child);
        }
        let mut addrs = Vec::new();
        for child in &mut children.0 {
            let stdout = child.stdout.take().expect("piped");
            let line = tokio::time::timeout(
                Duration::from_secs(30),
                tokio::task::spawn_blocking(move || {
                    let mut line = String::new();
                    std::io::BufReader::new(stdout)
                        .read_line(&mut line)
                        .map(|_| line)
                }),
            )
            .await
            .map_err(|_| anyhow::anyhow!("a {mode} host did not start within 30 s"))???;
            let addr = line
                .trim()
                .strip_prefix("ADDR ")
                .ok_or_else(|| anyhow::anyhow!("a {mode} host failed to start (see its stderr)"))?;
            addrs.push(addr.parse::<SocketAddr>()?);
        }
        let mut controls = Vec::new();
        for addr in &addrs {
            controls.push(ControlClient::new(connect(*addr).await?));
        }
        Ok(Self {
            _children: children,
            addrs,
            controls,
        })
    }

    /// Who serves the readers: the hosts and PostgreSQL (see [`crate::cpu`]).
    fn servers(&self) -> crate::cpu::Servers {
        crate::cpu::Servers {
            children: self._children.0.iter().map(Child::id).collect(),
            postgres: true,
        }
    }

    /// Runs every host's readers for `duration`; their counts.
    async fn read_for(&self, duration: Duration) -> anyhow::Result<Vec<Counts>> {
        for c in &self.controls {
            anyhow::ensure!(c.start(READERS_PER_HOST).await?, "readers already running");
        }
        tokio::time::sleep(duration).await;
        let stops = self.controls.iter().map(|c| c.stop());
        let mut counts = Vec::new();
        for result in futures::future::join_all(stops).await {
            counts.push(result?);
        }
        Ok(counts)
    }

    /// Every host's propagation samples since the last call.
    async fn propagation(&self) -> anyhow::Result<Propagation> {
        let mut all = Propagation::default();
        for c in &self.controls {
            let p = c.propagation().await?;
            all.samples_us.extend(p.samples_us);
            all.via_log += p.via_log;
            all.lagged += p.lagged;
        }
        Ok(all)
    }
}

async fn connect(addr: SocketAddr) -> anyhow::Result<Peer> {
    Ok(Endpoint::builder().build().connect_tcp(addr).await?)
}

/// The mutator: a task sending `UpdateUser` for a random user to a random host every 5 ms,
/// one command at a time, publishing each returned version on the board.
struct Mutator {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<anyhow::Result<u64>>,
}

impl Mutator {
    async fn start(settings: &Settings, cluster: &Cluster) -> anyhow::Result<Self> {
        let mut clients = Vec::new();
        for addr in &cluster.addrs {
            clients.push(CommandClient::new(connect(*addr).await?));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (board, base_us, flag) = (settings.board.clone(), settings.base_us, stop.clone());
        let task = tokio::spawn(async move {
            let mut ids = Ids(0xDEAD_BEEF ^ now_us());
            let mut hosts = Ids(0x1234_5678 ^ now_us());
            let mut tick = tokio::time::interval(MUTATOR_PERIOD);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut writes = 0u64;
            while !flag.load(Ordering::Relaxed) {
                tick.tick().await;
                let id = ids.next();
                let version = board.read(id).0 + 1;
                let host = (hosts.next() % HOSTS as u64) as usize;
                clients[host].run(&UpdateUser { id, version }).await?;
                board.publish(id, version, now_us().saturating_sub(base_us));
                writes += 1;
            }
            Ok(writes)
        });
        Ok(Self { stop, task })
    }

    /// Stops it; how many commands it sent.
    async fn stop(self) -> anyhow::Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await?
    }
}

/// A readers row: the best run's rate, stale counts over every run, the mutator's writes.
async fn readers_row(
    name: &str,
    settings: &Settings,
    cluster: &Cluster,
    timing: Timing,
    cached: bool,
) -> anyhow::Result<Row> {
    let mutator = Mutator::start(settings, cluster).await?;
    let started = Instant::now();
    let (mut best, mut stale, mut after_apply, mut ack_timeouts) = (0f64, 0u64, 0u64, 0u64);
    let mut best_cost = None;
    let servers = cluster.servers();
    for run in 0..=timing.runs {
        let duration = if run == 0 { timing.warmup } else { timing.run };
        let before = servers.snapshot();
        let counts = cluster.read_for(duration).await?;
        let spent = crate::cpu::Spent::between(&before, &servers.snapshot(), Duration::ZERO);
        let rate: f64 = counts
            .iter()
            .map(|c| c.calls as f64 / (c.elapsed_us.max(1) as f64 / 1e6))
            .sum();
        stale += counts.iter().map(|c| c.stale_reads).sum::<u64>();
        after_apply += counts.iter().map(|c| c.stale_after_apply).sum::<u64>();
        // Counted from each host's start: the last run's sum is the phase's.
        ack_timeouts = counts.iter().map(|c| c.ack_timeouts).sum::<u64>();
        if run > 0 && rate > best {
            best = rate;
            best_cost = spent.us_per(counts.iter().map(|c| c.calls).sum());
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let writes = mutator.stop().await?;
    let mut row = Row::new(name, best, "calls/s")
        .in_group("cluster.readers")
        .with("stale_reads", stale);
    if let Some(cost) = best_cost {
        row = row.with("cpu_us_per_req", round2(cost));
    }
    if cached {
        row = row
            .with("stale_after_apply", after_apply)
            .with("ack_timeouts", ack_timeouts);
    }
    Ok(row
        .with("writes", writes)
        .with("writes_per_s", (writes as f64 / seconds).round()))
}

/// The propagation rows of one notifier, from the samples of a phase where only the
/// mutator runs.
async fn propagation_rows(
    notifier: &str,
    settings: &Settings,
    cluster: &Cluster,
    timing: Timing,
) -> anyhow::Result<(Row, Row)> {
    cluster.propagation().await?; // drop earlier samples
    let mutator = Mutator::start(settings, cluster).await?;
    tokio::time::sleep(timing.warmup + timing.run * timing.runs as u32).await;
    let writes = mutator.stop().await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let p = cluster.propagation().await?;
    let mut sorted: Vec<f64> = p.samples_us.iter().map(|&s| s as f64).collect();
    sorted.sort_by(f64::total_cmp);
    let extra = |row: Row| {
        row.with("samples", sorted.len())
            .with("commands", writes)
            .with("via_log", p.via_log)
            .with("lagged", p.lagged)
            .with("max_us", sorted.last().copied().unwrap_or(0.0))
    };
    Ok((
        extra(Row::new(
            format!("cluster.propagation_p50_us.{notifier}"),
            percentile(&sorted, 0.50),
            "µs",
        )),
        extra(Row::new(
            format!("cluster.propagation_p99_us.{notifier}"),
            percentile(&sorted, 0.99),
            "µs",
        )),
    ))
}

/// `cluster.commands` and `cluster.plain_writes`, in the parent: `WRITERS` tasks, through a
/// host's pipeline and then through the same pool as a plain UPDATE, in alternating rounds
/// (so that the drift of this shared machine reaches both alike); the best round of each.
async fn writes_rows(settings: &Settings, timing: Timing) -> anyhow::Result<(Row, Row)> {
    let db = Database::postgres_in_schema(&settings.url, &settings.schema).await?;
    let host = Host::builder(db.clone())
        .notifier(Notifier::Postgres)
        .command::<UpdateUser>(Users {
            service: None,
            floors: Arc::new(Floors::new()),
        })
        .start()
        .await?;
    let mut config: tokio_postgres::Config = settings.url.parse()?;
    config.options(format!("-c search_path={}", settings.schema));
    let pool = db.postgres_pool().expect("PostgreSQL").clone();
    let store = Arc::new(Store::Postgres(pool.clone(), Box::new(config)));
    // Versions far above the mutator's: nothing reads after this phase.
    let version = Arc::new(AtomicU64::new(1 << 20));
    let (mut commands, mut plain, mut plain_tx) = (0f64, 0f64, 0f64);
    // This process (the writers are a few tasks; the host, or the pool, does the work) and
    // PostgreSQL.
    let servers = crate::cpu::Servers {
        children: Vec::new(),
        postgres: true,
    };
    let (mut commands_cost, mut plain_cost) = (None, None);
    for round in 0..=timing.runs {
        let duration = if round == 0 {
            timing.warmup
        } else {
            timing.run
        };
        let before = servers.snapshot();
        let (c, c_writes) = write_for(duration, &version, {
            let host = host.clone();
            move |id, version| {
                let host = host.clone();
                async move {
                    host.run(UpdateUser { id, version })
                        .await
                        .map_err(Into::into)
                }
            }
        })
        .await?;
        let c_spent = crate::cpu::Spent::between(&before, &servers.snapshot(), Duration::ZERO);
        let before = servers.snapshot();
        let (p, p_writes) = write_for(duration, &version, {
            let store = store.clone();
            move |id, version| {
                let store = store.clone();
                async move {
                    store
                        .update(id, version)
                        .await
                        .map_err(|e| anyhow::anyhow!("{e}"))
                }
            }
        })
        .await?;
        let p_spent = crate::cpu::Spent::between(&before, &servers.snapshot(), Duration::ZERO);
        // The same UPDATE in a transaction of its own (BEGIN, UPDATE, COMMIT): how much of
        // the pipeline's cost is round trips, for the notes.
        let (t, _) = write_for(duration, &version, {
            let pool = pool.clone();
            move |id, version| {
                let pool = pool.clone();
                async move {
                    let mut client = pool.get().await?;
                    let tx = client.transaction().await?;
                    let update = tx.prepare_cached(PG_UPDATE).await?;
                    let name = format!("User {id} v{version}");
                    tx.execute(
                        &update,
                        &[&to_i64(id), &to_i64(version), &name, &now_micros()],
                    )
                    .await?;
                    tx.commit().await?;
                    anyhow::Ok(())
                }
            }
        })
        .await?;
        if round > 0 {
            if c > commands {
                commands = c;
                commands_cost = c_spent.us_per(c_writes);
            }
            if p > plain {
                plain = p;
                plain_cost = p_spent.us_per(p_writes);
            }
            plain_tx = plain_tx.max(t);
        }
    }
    let stats = host.stats();
    host.stop().await;
    // Commands that waited while the host's transactions were busy shared one (HostBuilder::max_batch).
    let per_transaction = stats.commands as f64 / stats.batches.max(1) as f64;
    let cost = |row: Row, cost: Option<f64>| match cost {
        Some(cost) => row.with("cpu_us_per_req", round2(cost)),
        None => row,
    };
    Ok((
        cost(
            Row::new("cluster.commands", commands, "ops/s"),
            commands_cost,
        )
        .compared_to("cluster.plain_writes")
        .in_group("cluster.writes")
        .with("writers", WRITERS)
        .with(
            "commands_per_transaction",
            (per_transaction * 100.0).round() / 100.0,
        )
        .with("batches_split", stats.batches_split),
        cost(Row::new("cluster.plain_writes", plain, "ops/s"), plain_cost)
            .in_group("cluster.writes")
            .with("in_a_transaction_ops_per_s", plain_tx.round())
            .with("writers", WRITERS),
    ))
}

/// `WRITERS` tasks calling `write` on random users for `duration`; writes/s and writes.
async fn write_for<F, Fut>(
    duration: Duration,
    version: &Arc<AtomicU64>,
    write: F,
) -> anyhow::Result<(f64, u64)>
where
    F: Fn(u64, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let started = Instant::now();
    let deadline = started + duration;
    let tasks: Vec<_> = (0..WRITERS as u64)
        .map(|i| {
            let (write, version) = (write.clone(), version.clone());
            tokio::spawn(async move {
                let mut ids = Ids(0xC0FF_EE00 + 2 * i + 1);
                let mut n = 0u64;
                while Instant::now() < deadline {
                    write(ids.next(), version.fetch_add(1, Ordering::Relaxed)).await?;
                    n += 1;
                }
                anyhow::Ok(n)
            })
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await??;
    }
    Ok((total as f64 / started.elapsed().as_secs_f64(), total))
}

/// Runs the suite.
/// Runs the suite; `only` (when not empty) keeps the phases whose name contains it:
/// `cached` (with the pg propagation under readers), `propagation.pg`, `propagation.nats`,
/// `direct`, `ttl`, `commands` (with `plain_writes`).
pub(crate) fn run(timing: Timing, only: &str) -> anyhow::Result<Report> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(run_async(timing, only))
}

async fn run_async(timing: Timing, only: &str) -> anyhow::Result<Report> {
    let mut report = Report::new("cluster");
    let url = crate::report::database_url();
    let nats = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .subsec_nanos();
    let schema = format!("bench_cluster_{}_{nanos}", std::process::id());
    let config: tokio_postgres::Config = url.parse()?;
    let admin = match tokio::time::timeout(
        Duration::from_secs(3),
        config.connect(tokio_postgres::NoTls),
    )
    .await
    {
        Ok(Ok((client, connection))) => {
            tokio::spawn(connection);
            client
        }
        _ => {
            report.note(format!("cluster suite skipped: {url} is not reachable"));
            return Ok(report);
        }
    };
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA {schema}; SET search_path TO {schema};"
        ))
        .await?;
    let result = async {
        create_users(&admin).await?;
        // The log's tables, made here once: three hosts starting at once race to create them
        // (`Database::postgres_in_schema` releases its advisory lock before its implicit
        // transaction commits), and one of them fails.
        Database::postgres_in_schema(&url, &schema).await?;
        let settings = Settings {
            url: url.clone(),
            nats: nats.clone(),
            schema: schema.clone(),
            board: Arc::new(Board::create()?),
            base_us: now_us(),
        };
        suite(&settings, timing, only, &mut report).await
    }
    .await;
    if let Err(e) = admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
    {
        eprintln!("could not drop the schema {schema}: {e}");
    }
    result?;
    Ok(report)
}

async fn suite(
    settings: &Settings,
    timing: Timing,
    only: &str,
    report: &mut Report,
) -> anyhow::Result<()> {
    let phases = [
        "cached",
        "propagation.pg",
        "propagation.nats",
        "direct",
        "ttl",
        "commands",
        "checker.pg",
        "checker.nats",
        "checker.pause",
        "burst",
    ];
    let wanted: Vec<&str> = phases.into_iter().filter(|p| p.contains(only)).collect();
    anyhow::ensure!(
        !wanted.is_empty(),
        "--only {only:?} names no phase of the cluster suite ({})",
        phases.join(", ")
    );
    let want = |phase: &str| wanted.contains(&phase);
    let bar = progress(wanted.len() as u64);
    let nats_up = nats_reachable(&settings.nats).await;
    let mut rows = Vec::new();
    let mut propagation = Vec::new();

    if want("cached") || want("propagation.pg") {
        let cluster = Cluster::start(settings, "cached", "pg").await?;
        let mut p99_under = None;
        if want("cached") {
            bar.set_message("cluster.cached.readers (pg)");
            let cached =
                readers_row("cluster.cached.readers", settings, &cluster, timing, true).await?;
            let under_readers = cluster.propagation().await?;
            let mut under: Vec<f64> = under_readers.samples_us.iter().map(|&s| s as f64).collect();
            under.sort_by(f64::total_cmp);
            let p99 = percentile(&under, 0.99);
            p99_under = Some(p99);
            rows.push(
                cached
                    .with("propagation_p99_us", p99)
                    .with("propagation_max_us", under.last().copied().unwrap_or(0.0))
                    .with("via_log", under_readers.via_log)
                    .compared_to("cluster.direct.readers"),
            );
            bar.inc(1);
        }
        if want("propagation.pg") {
            bar.set_message("cluster.propagation.pg");
            let (pg50, pg99) = propagation_rows("pg", settings, &cluster, timing).await?;
            propagation.push(pg50);
            propagation.push(match p99_under {
                Some(p99) => pg99.with("p99_under_readers_us", p99),
                None => pg99,
            });
            bar.inc(1);
        }
    }

    if want("propagation.nats") {
        bar.set_message("cluster.propagation.nats");
        if nats_up {
            let cluster = Cluster::start(settings, "cached", "nats").await?;
            let (n50, n99) = propagation_rows("nats", settings, &cluster, timing).await?;
            propagation.push(n50);
            propagation.push(n99);
        } else {
            report.note(format!(
                "nats rows skipped: {} is not reachable",
                settings.nats
            ));
        }
        bar.inc(1);
    }

    for (phase, name) in [
        ("direct", "cluster.direct.readers"),
        ("ttl", "cluster.ttl.readers"),
    ] {
        if want(phase) {
            bar.set_message(name);
            let cluster = Cluster::start(settings, phase, "pg").await?;
            let row = readers_row(name, settings, &cluster, timing, false).await?;
            rows.push(if phase == "ttl" {
                row.compared_to("cluster.direct.readers")
            } else {
                row
            });
            bar.inc(1);
        }
    }

    if want("commands") {
        bar.set_message("cluster.commands / cluster.plain_writes");
        let (commands, plain) = writes_rows(settings, timing).await?;
        rows.push(commands);
        rows.push(plain);
        bar.inc(1);
    }
    for phase in ["checker.pg", "checker.nats", "checker.pause", "burst"] {
        if !want(phase) {
            continue;
        }
        bar.set_message(format!("cluster.{phase}"));
        let row = match phase {
            "checker.pg" => Some(checker::checker_row(&settings.url, false, timing).await?),
            "checker.nats" if std::path::Path::new("/usr/sbin/nats-server").exists() => {
                Some(checker::checker_row(&settings.url, true, timing).await?)
            }
            "checker.nats" => {
                report.note("cluster.checker.nats skipped: no /usr/sbin/nats-server");
                None
            }
            "checker.pause" => Some(checker::pause_row(&settings.url, timing).await?),
            _ => Some(checker::burst_row(&settings.url, timing).await?),
        };
        rows.extend(row);
        bar.inc(1);
    }
    bar.finish_and_clear();

    for row in rows.into_iter().chain(propagation) {
        report.push(row);
    }
    report.note(format!(
        "{HOSTS} hosts (child processes, {} tokio workers each), {READERS_PER_HOST} readers per host, over 1,000 users in PostgreSQL; a mutator in the parent sends UpdateUser to a random host every {} ms",
        crate::report::cores(),
        MUTATOR_PERIOD.as_millis()
    ));
    report.note("stale_reads: a read starting >= 10 ms after the newer version's command returned to the mutator; stale_after_apply: a read starting after its host applied the newer version");
    report.note("ttl: moka, 1 s TTL per host, its own host's writes invalidated; direct and ttl hosts run the command as a plain UPDATE");
    report.note(format!("commands vs plain_writes: {WRITERS} concurrent tasks in one process, Host::run vs the same UPDATE through the same pool"));
    report.note("cpu_us_per_req: processor time over the best run divided by its reads or writes; readers: the three hosts and every PostgreSQL process; writes: this process (the writers and the host or pool) and every PostgreSQL process (see cpu.rs)");
    report.note("checker: coherent-checker's runs (3 host processes over PostgreSQL, 2 readers and 2 writers each, every returned write and every read recorded and checked); the value is the violations (reads that began after a write of their key returned and saw an older version, reads of a host that went backwards, hosts that did not converge); faults_injected.* counts each fault; burst: 10 writers per host, bursts of 1,500 commands and 3 s transactions holding an xid across them");
    report.note("propagation: commit on one host to applied on another (Applied events), mutator only, readers idle; p99_under_readers_us: during the cached readers phase");
    Ok(())
}

async fn nats_reachable(url: &str) -> bool {
    let hostport = url.trim_start_matches("nats://");
    matches!(
        tokio::time::timeout(
            Duration::from_secs(2),
            tokio::net::TcpStream::connect(hostport)
        )
        .await,
        Ok(Ok(_))
    )
}
