//! A host process of a checked run: the `Registers` service over PostgreSQL, a
//! [`Host`] with the commands that write it, readers and writers that
//! record their history, and a line protocol on stdin/stdout through which the parent
//! starts and stops the workload and injects the faults that need the host's help.
//!
//! Settings come in environment variables (see [`Node`]); each answer is a stdout line
//! that starts with `@@ ` (anything else on stdout is skipped by the parent).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use coherent::ops::{Command, CommandError, Database, Handler, Host, Notifier, Tx};
use coherent::prelude::*;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::history::{now_ns, Read, Recorder, Write};
use crate::tier::{Proxy, Tier, TierRuntime};

/// Set (to anything) in a host process's environment: [`main`] runs.
pub const NODE_MODE: &str = "COHERENT_CHECKER_NODE";

/// The registers: `registers(id, value)`, one computed per register.
#[derive(Clone, ComputeService)]
pub struct Registers {
    handle: ServiceHandle,
    pool: deadpool_postgres::Pool,
}

/// A read that failed (the database unreachable, a connection lost): it says nothing
/// about the register, so it is cached for the short transient delay (1 s), not the 10 s
/// of an error about the data. On the wire it is its message (as a `String` would be).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ReadError(pub String);

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl coherent::TransientError for ReadError {
    fn is_transient(&self) -> bool {
        true
    }
}

#[compute_service]
impl Registers {
    /// A register's version, read from the database.
    #[compute]
    pub async fn value(&self, key: i64) -> Result<i64, ReadError> {
        let failed = |e: &dyn std::fmt::Display| ReadError(e.to_string());
        let c = self.pool.get().await.map_err(|e| failed(&e))?;
        let row = c
            .query_one("SELECT value FROM registers WHERE id = $1", &[&key])
            .await
            .map_err(|e| failed(&e))?;
        Ok(row.get(0))
    }
}

/// Adds one to a register; answers the new version.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Increment {
    /// The register.
    pub key: i64,
}

impl Command for Increment {
    const NAME: &'static str = "checker.increment";
    type Output = i64;
}

/// The same write as a command of "the next release": only hosts started as such know it;
/// the others cannot replay it, and must not serve stale entries because of it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IncrementNext {
    /// The register.
    pub key: i64,
    /// A field the old release never had.
    pub reason: String,
}

impl Command for IncrementNext {
    const NAME: &'static str = "checker.increment_next";
    type Output = i64;
}

/// An increment whose transaction takes its id first, then holds it open for `hold_ms`
/// before it writes: a long transaction that pins every snapshot's `xmin` meanwhile.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SlowIncrement {
    /// The register.
    pub key: i64,
    /// How long the transaction stays open before its write.
    pub hold_ms: u64,
}

impl Command for SlowIncrement {
    const NAME: &'static str = "checker.slow_increment";
    type Output = i64;
}

/// Adds one to register `key`, one of two ways, so that the faults find both: an even key
/// by `Tx::finish_sql` (the write and the operation's row as one statement, committed
/// alone, for a command alone that opened nothing; `SlowIncrement`'s, after its read, in
/// its transaction), an odd one by an awaited statement in the transaction, the row and
/// the commit after.
async fn increment(key: i64, tx: &mut Tx<'_>) -> Result<i64, CommandError> {
    if key % 2 == 0 {
        let written: Option<i64> = tx
            .finish_sql(
                "UPDATE registers SET value = value + 1 WHERE id = $1 RETURNING to_json(value)",
                vec![Box::new(key)],
            )
            .await?;
        return written.ok_or_else(|| CommandError::not_found(format!("register {key}")));
    }
    let row = tx
        .require_postgres()?
        .query_one(
            "UPDATE registers SET value = value + 1 WHERE id = $1 RETURNING value",
            &[&key],
        )
        .await?;
    Ok(row.get(0))
}

impl Handler<Increment> for Registers {
    async fn execute(&self, c: &Increment, tx: &mut Tx<'_>) -> Result<i64, CommandError> {
        increment(c.key, tx).await
    }

    fn invalidate(&self, c: &Increment, _: &i64) {
        self.invalidate_value(c.key);
    }
}

impl Handler<IncrementNext> for Registers {
    async fn execute(&self, c: &IncrementNext, tx: &mut Tx<'_>) -> Result<i64, CommandError> {
        increment(c.key, tx).await
    }

    fn invalidate(&self, c: &IncrementNext, _: &i64) {
        self.invalidate_value(c.key);
    }
}

impl Handler<SlowIncrement> for Registers {
    async fn execute(&self, c: &SlowIncrement, tx: &mut Tx<'_>) -> Result<i64, CommandError> {
        tx.require_postgres()?
            .query_one("SELECT pg_current_xact_id()::text", &[])
            .await?;
        tokio::time::sleep(Duration::from_millis(c.hold_ms)).await;
        increment(c.key, tx).await
    }

    fn invalidate(&self, c: &SlowIncrement, _: &i64) {
        self.invalidate_value(c.key);
    }
}

/// Core-level writers racing on shared dependants (issue 30, hole 8), in the host process
/// and without the database: pairs of states `(a, b)`, each pair read by one computed
/// (`pair`) and through it by another (`view`). Two writers add one to a state of a pair
/// at random, so the cascades of two sets meet on the same dependants; readers read
/// `view`. Each state is a history key of its own (`core_base + 2 * pair + side`): a
/// read of `view` that began after a set of either state returned must see it.
#[derive(Clone, ComputeService)]
pub struct Pairs {
    handle: ServiceHandle,
    states: Arc<Vec<[MutableState<i64>; 2]>>,
}

#[compute_service]
impl Pairs {
    /// Both states of pair `p`.
    #[compute]
    pub async fn pair(&self, p: u32) -> (i64, i64) {
        let [a, b] = &self.states[p as usize];
        (a.get(), b.get())
    }

    /// The pair, through `pair`: the cascade has two levels to go.
    #[compute]
    pub async fn view(&self, p: u32) -> (i64, i64) {
        self.pair(p).await
    }
}

impl Pairs {
    /// `n` pairs at version 0, in a registry of their own.
    pub fn new(n: u32) -> Self {
        let registry = Registry::new();
        let states = (0..n)
            .map(|_| [0, 1].map(|_| MutableState::with_registry(&registry, "checker.pair", 0i64)))
            .collect();
        Self {
            handle: ServiceHandle::with_registry(&registry),
            states: Arc::new(states),
        }
    }

    /// Adds one to side `side` of pair `p`; answers the version written.
    pub fn bump(&self, p: u32, side: usize) -> i64 {
        let mut written = 0;
        self.states[p as usize][side].update(|v| {
            written = v + 1;
            written
        });
        written
    }
}

/// Pairs of states in each host process: few, so that writers meet on them.
const PAIRS: u32 = 4;

/// Creates the registers table (if missing) with `keys` registers at version 0.
pub async fn create_registers(client: &tokio_postgres::Client, keys: u32) -> anyhow::Result<()> {
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS registers (id BIGINT PRIMARY KEY, value BIGINT NOT NULL)",
        )
        .await?;
    client
        .execute(
            "INSERT INTO registers SELECT i, 0 FROM generate_series(1, $1::bigint) AS i \
             ON CONFLICT DO NOTHING",
            &[&i64::from(keys)],
        )
        .await?;
    Ok(())
}

/// A host process's settings, from its environment.
#[derive(Debug, Clone)]
pub struct Node {
    /// `CHK_URL`: PostgreSQL.
    pub url: String,
    /// `CHK_SCHEMA`: the schema of the run.
    pub schema: String,
    /// `CHK_NATS`: a NATS URL, or empty for PostgreSQL's LISTEN/NOTIFY.
    pub nats: Option<String>,
    /// `CHK_HISTORY`: the file the history goes to.
    pub history: std::path::PathBuf,
    /// `CHK_KEYS`: how many registers.
    pub keys: u32,
    /// `CHK_READERS`, `CHK_WRITERS`: tasks of each.
    pub readers: u32,
    /// Writer tasks.
    pub writers: u32,
    /// `CHK_TIER_READERS`: reader tasks of the tier (replicas of this host's registers,
    /// recorded in the history [`tier_history`] names, as a host of its own).
    pub tier_readers: u32,
    /// `CHK_READ_BATCH`: reads between two pauses of 1 ms of a reader.
    pub read_batch: u32,
    /// `CHK_NEXT_RELEASE`: this host knows [`IncrementNext`] and writes it half the time.
    pub next_release: bool,
    /// `CHK_CLOCK_SKEW_MS`: this host's wall clock is off by this much.
    pub clock_skew_ms: i64,
    /// `CHK_CORE_BASE`: the first history key of this process's core-level pairs
    /// ([`Pairs`]), unique to it (its states are its own).
    pub core_base: u32,
}

impl Node {
    /// The settings from the environment.
    pub fn from_env() -> anyhow::Result<Self> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let num = |k: &str, d: u32| var(k).map_or(Ok(d), |v| v.parse());
        Ok(Self {
            url: var("CHK_URL").ok_or_else(|| anyhow::anyhow!("CHK_URL"))?,
            schema: var("CHK_SCHEMA").ok_or_else(|| anyhow::anyhow!("CHK_SCHEMA"))?,
            nats: var("CHK_NATS"),
            history: var("CHK_HISTORY")
                .ok_or_else(|| anyhow::anyhow!("CHK_HISTORY"))?
                .into(),
            keys: num("CHK_KEYS", 32)?,
            readers: num("CHK_READERS", 2)?,
            writers: num("CHK_WRITERS", 2)?,
            tier_readers: num("CHK_TIER_READERS", 2)?,
            read_batch: num("CHK_READ_BATCH", 8)?,
            next_release: var("CHK_NEXT_RELEASE").is_some(),
            clock_skew_ms: var("CHK_CLOCK_SKEW_MS").map_or(Ok(0), |v| v.parse())?,
            core_base: num("CHK_CORE_BASE", 1_000_000)?,
        })
    }

    /// The environment that gives these settings.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            (NODE_MODE, "1".to_owned()),
            ("CHK_URL", self.url.clone()),
            ("CHK_SCHEMA", self.schema.clone()),
            ("CHK_HISTORY", self.history.display().to_string()),
            ("CHK_KEYS", self.keys.to_string()),
            ("CHK_READERS", self.readers.to_string()),
            ("CHK_WRITERS", self.writers.to_string()),
            ("CHK_TIER_READERS", self.tier_readers.to_string()),
            ("CHK_READ_BATCH", self.read_batch.to_string()),
            ("CHK_CLOCK_SKEW_MS", self.clock_skew_ms.to_string()),
            ("CHK_CORE_BASE", self.core_base.to_string()),
        ];
        if let Some(nats) = &self.nats {
            env.push(("CHK_NATS", nats.clone()));
        }
        if self.next_release {
            env.push(("CHK_NEXT_RELEASE", "1".to_owned()));
        }
        env
    }
}

/// The history of the tier of the host whose history is `host`.
pub fn tier_history(host: &std::path::Path) -> std::path::PathBuf {
    host.with_extension("tier.bin")
}

fn say(line: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "@@ {line}");
    let _ = out.flush();
}

/// Counts of a host process's workload.
#[derive(Default)]
struct Counts {
    reads: AtomicU64,
    read_errors: AtomicU64,
    tier_reads: AtomicU64,
    tier_read_errors: AtomicU64,
    core_reads: AtomicU64,
    writes: AtomicU64,
    write_errors: AtomicU64,
}

struct Workload {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// Runs a host process; returns its exit code. Call from a multi-threaded tokio runtime.
pub async fn main() -> i32 {
    match serve().await {
        Ok(()) => 0,
        Err(e) => {
            say(&format!("err {e:#}"));
            1
        }
    }
}

async fn serve() -> anyhow::Result<()> {
    let node = Node::from_env()?;
    let db = Database::postgres_in_schema(&node.url, &node.schema).await?;
    let pool = db.postgres_pool().expect("PostgreSQL").clone();
    let registry = Registry::new();
    let registers = Registers {
        handle: ServiceHandle::with_registry(&registry),
        pool,
    };
    let mut builder = Host::builder(db)
        .registry(&registry)
        .command::<Increment>(registers.clone())
        .command::<SlowIncrement>(registers.clone());
    if node.next_release {
        builder = builder.command::<IncrementNext>(registers.clone());
    }
    if let Some(url) = &node.nats {
        builder = builder.notifier(Notifier::Nats(url.clone()));
    }
    if node.clock_skew_ms != 0 {
        builder = builder.clock_skew(node.clock_skew_ms.saturating_mul(1000));
    }
    // The registers exposed to the tier; a command returns once the tier applied its
    // invalidation (and the tier's replicas hold this host's lease).
    let remote = RemoteServer::new().expose(
        "Registers.value",
        registers.clone(),
        |r: Registers, (key,): (i64,)| async move { r.value_computed(key).await },
    );
    builder = builder.serve_replicas(&remote);
    let host = builder.start().await?;
    let endpoint = Endpoint::builder().service(remote.service()).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let served = listener.local_addr()?;
    tokio::spawn(async move { endpoint.serve_tcp(listener).await });
    let proxy = Proxy::start(served).await?;
    // The same replicas over a WebSocket, for the TypeScript readers the parent runs
    // (trusted: a Node.js tier of the application, which writes wait for), behind a
    // proxy of its own.
    let ws_endpoint = Endpoint::builder()
        .service(remote.service())
        .config(coherent::rpc::Config::default().trust(coherent::rpc::Trust::Trusted))
        .build();
    let ws_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let ws_served = ws_listener.local_addr()?;
    let router = coherent::axum::Router::new().route(
        "/rpc",
        coherent::axum::routing::get(ws_endpoint.websocket_handler()),
    );
    tokio::spawn(async move { coherent::axum::serve(ws_listener, router).await });
    let ts_proxy = Proxy::start(ws_served).await?;
    // The tier runs on a thread of its own (the run freezes it alone: `tier_pause`).
    let tier_runtime = TierRuntime::start()?;
    let tier = {
        let addr = proxy.addr();
        tier_runtime
            .handle()
            .spawn(async move { Tier::connect(addr).await })
            .await??
    };
    let recorder = Arc::new(Recorder::create(&node.history)?);
    let tier_recorder = Arc::new(Recorder::create(&tier_history(&node.history))?);
    let counts = Arc::new(Counts::default());
    {
        let (recorder, tier_recorder) = (recorder.clone(), tier_recorder.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(20)).await;
                let _ = recorder.flush();
                let _ = tier_recorder.flush();
            }
        });
    }
    say(&format!("ready {} ws://{}/rpc", host.id(), ts_proxy.addr()));
    let mut workload: Option<Workload> = None;
    // Bursts and slow commands the parent started: waited for at `stop`.
    let mut extra: Vec<tokio::task::JoinHandle<()>> = Vec::new();
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["start"] => {
                if workload.is_none() {
                    let readers = Readers {
                        registers: &registers,
                        recorder: &recorder,
                        tier: &tier,
                        tier_recorder: &tier_recorder,
                        tier_runtime: tier_runtime.handle(),
                    };
                    workload = Some(start(&node, &host, &readers, &counts));
                }
                say("started");
            }
            ["burst", n] => {
                // Answered at once: the burst runs beside the workload.
                let n: u32 = n.parse()?;
                let (node, host, recorder, counts) =
                    (node.clone(), host.clone(), recorder.clone(), counts.clone());
                extra.push(tokio::spawn(async move {
                    burst(&node, &host, &recorder, &counts, n).await
                }));
                say("burst started");
            }
            ["slow", key, ms] => {
                let (key, hold_ms): (i64, u64) = (key.parse()?, ms.parse()?);
                let (host, recorder, counts) = (host.clone(), recorder.clone(), counts.clone());
                extra.push(tokio::spawn(async move {
                    let start = now_ns();
                    let result = host.run(SlowIncrement { key, hold_ms }).await;
                    record_write(&recorder, &counts, key, start, result);
                }));
                say("slow started");
            }
            ["tier_cut"] => {
                proxy.cut();
                say("tier cut");
            }
            ["tier_pause", ms] => {
                let ms: u64 = ms.parse()?;
                tier_runtime.freeze(Duration::from_millis(ms));
                say("tier paused");
            }
            ["tier_reconnect_pause", ms] => {
                // Cut, then frozen as soon as it connected again: the window where its
                // first renewal on the new connection is what stands between its
                // revalidated replicas and a write its host may not wait for.
                let ms: u64 = ms.parse()?;
                let before = tier.connections();
                proxy.cut();
                let reconnected = async {
                    while tier.connections() == before {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                };
                let _ = tokio::time::timeout(Duration::from_secs(5), reconnected).await;
                tier_runtime.freeze(Duration::from_millis(ms));
                say("tier reconnected and paused");
            }
            ["tier_half_open"] => {
                proxy.half_open();
                say("tier half-open");
            }
            ["ts_cut"] => {
                ts_proxy.cut();
                say("ts cut");
            }
            ["ts_half_open"] => {
                ts_proxy.half_open();
                say("ts half-open");
            }
            ["stop"] => {
                if let Some(w) = workload.take() {
                    w.stop.store(true, Ordering::Relaxed);
                    for t in w.tasks {
                        let _ = t.await;
                    }
                }
                for t in extra.drain(..) {
                    let _ = t.await;
                }
                recorder.flush()?;
                tier_recorder.flush()?;
                say("stopped");
            }
            ["final"] => {
                host.catch_up().await?;
                let mut values = Vec::new();
                for key in 1..=i64::from(node.keys) {
                    // A read failed by the last fault (the database away) is read again
                    // once its error is no longer cached.
                    let mut answer = registers.value(key).await;
                    for _ in 0..100 {
                        if answer.is_ok() {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        answer = registers.value(key).await;
                    }
                    values.push(match answer {
                        Ok(v) => v.to_string(),
                        Err(_) => "err".to_owned(),
                    });
                }
                say(&format!("final {}", values.join(" ")));
            }
            ["final_tier"] => {
                // Caught up (`final` first): once the tier applied what the host pushed,
                // it answers what the host does.
                host.catch_up().await?;
                remote.invalidations_delivered().await;
                let mut values = Vec::new();
                for key in 1..=i64::from(node.keys) {
                    // A read failed by a connection the last fault cut is read again.
                    let mut answer = tier.value(key).await;
                    for _ in 0..100 {
                        if answer.is_ok() {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        answer = tier.value(key).await;
                    }
                    values.push(match answer {
                        Ok(v) => v.to_string(),
                        Err(_) => "err".to_owned(),
                    });
                }
                say(&format!("final {}", values.join(" ")));
            }
            ["stats"] => {
                let s = host.stats();
                let c = &counts;
                let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
                say(&format!(
                    "stats reads={} read_errors={} tier_reads={} tier_read_errors={} \
                     tier_connections={} tier_leases_lost={} tier_hits={} tier_misses={} core_reads={} writes={} write_errors={} unknown={} \
                     undecodable={} replay_panics={} flushes={} ack_timeouts={} duplicates={} \
                     applied_notified={} applied_from_log={}",
                    r(&c.reads),
                    r(&c.read_errors),
                    r(&c.tier_reads),
                    r(&c.tier_read_errors),
                    tier.connections(),
                    tier.leases_lost(),
                    tier.hits_and_misses().0,
                    tier.hits_and_misses().1,
                    r(&c.core_reads),
                    r(&c.writes),
                    r(&c.write_errors),
                    s.unknown,
                    s.undecodable,
                    s.replay_panics,
                    s.flushes,
                    s.ack_timeouts,
                    s.duplicates,
                    s.applied_notified,
                    s.applied_from_log,
                ));
            }
            ["quit"] => {
                host.stop().await;
                recorder.flush()?;
                tier_recorder.flush()?;
                say("bye");
                return Ok(());
            }
            _ => say(&format!("err unknown line {line:?}")),
        }
    }
    Ok(())
}

fn record_write(
    recorder: &Recorder,
    counts: &Counts,
    key: i64,
    start: u64,
    result: Result<i64, CommandError>,
) {
    match result {
        Ok(version) => {
            let end = now_ns();
            counts.writes.fetch_add(1, Ordering::Relaxed);
            recorder.write(&Write {
                key: key as u32,
                version,
                start,
                end,
            });
        }
        Err(_) => {
            counts.write_errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn write_once(node: &Node, host: &Host, key: i64, i: u64) -> Result<i64, CommandError> {
    if node.next_release && i % 2 == 1 {
        host.run(IncrementNext {
            key,
            reason: "next release".into(),
        })
        .await
    } else {
        host.run(Increment { key }).await
    }
}

/// What the readers read through, and where they record it.
struct Readers<'a> {
    registers: &'a Registers,
    recorder: &'a Arc<Recorder>,
    tier: &'a Tier,
    tier_recorder: &'a Arc<Recorder>,
    tier_runtime: &'a tokio::runtime::Handle,
}

/// A reader's loop on `on`: `read` a random key, record what it saw, until `stop`.
#[allow(clippy::too_many_arguments)]
fn reader<F, Fut>(
    on: &tokio::runtime::Handle,
    node: &Node,
    reader: u32,
    stop: &Arc<AtomicBool>,
    recorder: &Arc<Recorder>,
    counts: &Arc<Counts>,
    tier: bool,
    read: F,
) -> tokio::task::JoinHandle<()>
where
    F: Fn(i64) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<i64, String>> + Send,
{
    let (stop, recorder, counts) = (stop.clone(), recorder.clone(), counts.clone());
    let (keys, batch) = (node.keys, node.read_batch.max(1));
    on.spawn(async move {
        let (reads, errors) = if tier {
            (&counts.tier_reads, &counts.tier_read_errors)
        } else {
            (&counts.reads, &counts.read_errors)
        };
        while !stop.load(Ordering::Relaxed) {
            for _ in 0..batch {
                let key = rand::random_range(1..=keys);
                let start = now_ns();
                let answer = read(i64::from(key)).await;
                let end = now_ns();
                match answer {
                    Ok(seen) => {
                        reads.fetch_add(1, Ordering::Relaxed);
                        recorder.read(&Read {
                            key,
                            seen,
                            start,
                            end,
                            reader,
                        });
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
}

fn start(node: &Node, host: &Host, readers: &Readers<'_>, counts: &Arc<Counts>) -> Workload {
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for r in 0..node.readers {
        let registers = readers.registers.clone();
        tasks.push(reader(
            &tokio::runtime::Handle::current(),
            node,
            r,
            &stop,
            readers.recorder,
            counts,
            false,
            move |key| {
                let registers = registers.clone();
                async move { registers.value(key).await.map_err(|e| e.0) }
            },
        ));
    }
    for r in 0..node.tier_readers {
        let tier = readers.tier.clone();
        tasks.push(reader(
            readers.tier_runtime,
            node,
            r,
            &stop,
            readers.tier_recorder,
            counts,
            true,
            move |key| {
                let tier = tier.clone();
                async move { tier.value(key).await }
            },
        ));
    }
    // Core-level writers and readers racing on the pairs' shared dependants.
    let pairs = Pairs::new(PAIRS);
    let key_of = {
        let base = node.core_base;
        move |p: u32, side: usize| base + 2 * p + side as u32
    };
    for _ in 0..2 {
        let (stop, pairs, recorder) = (stop.clone(), pairs.clone(), readers.recorder.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..8 {
                    let (p, side) = (rand::random_range(0..PAIRS), rand::random_range(0..2));
                    let start = now_ns();
                    let version = pairs.bump(p, side);
                    recorder.write(&Write {
                        key: key_of(p, side),
                        version,
                        start,
                        end: now_ns(),
                    });
                    tokio::task::yield_now().await;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }));
    }
    for r in 0..2 {
        let (stop, pairs, recorder, counts) = (
            stop.clone(),
            pairs.clone(),
            readers.recorder.clone(),
            counts.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..8 {
                    let p = rand::random_range(0..PAIRS);
                    let start = now_ns();
                    let (a, b) = pairs.view(p).await;
                    let end = now_ns();
                    counts.core_reads.fetch_add(1, Ordering::Relaxed);
                    for (side, seen) in [(0, a), (1, b)] {
                        recorder.read(&Read {
                            key: key_of(p, side),
                            seen,
                            start,
                            end,
                            reader: 100 + r,
                        });
                    }
                    tokio::task::yield_now().await;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }));
    }
    for _ in 0..node.writers {
        let (stop, host, recorder, counts, node) = (
            stop.clone(),
            host.clone(),
            readers.recorder.clone(),
            counts.clone(),
            node.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let key = i64::from(rand::random_range(1..=node.keys));
                let start = now_ns();
                let result = write_once(&node, &host, key, i).await;
                if result.is_err() {
                    // A fault (a terminated connection, say): do not spin on it.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                record_write(&recorder, &counts, key, start, result);
                i += 1;
            }
        }));
    }
    Workload { stop, tasks }
}

/// `n` increments at once, 64 in flight: more than a page of the log between two reads
/// of every other host.
async fn burst(node: &Node, host: &Host, recorder: &Arc<Recorder>, counts: &Arc<Counts>, n: u32) {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (node, host, recorder, counts, next) = (
            node.clone(),
            host.clone(),
            recorder.clone(),
            counts.clone(),
            next.clone(),
        );
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= u64::from(n) {
                    return;
                }
                let key = i64::from(rand::random_range(1..=node.keys));
                let start = now_ns();
                let result = write_once(&node, &host, key, i).await;
                record_write(&recorder, &counts, key, start, result);
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}
