//! The `dbchanges` suite (issue 34): the `local` suite's `UserService.get(id)` over
//! PostgreSQL, while a connection that is not Coherent's (what a migration, a cron job or
//! another service holds) updates a random user 200 times a second. The cached service
//! learns of those writes only from the change feed (logical decoding): a host's
//! `watch_table("users")` invalidates `get(id)`.
//!
//! Rows: readers of the direct query, of a moka cache with a 1 s TTL, of the cached
//! service on one host, and of the cached service on two hosts (half the readers each,
//! each host with its own cache), then the two hosts again while the feed loses its slot
//! with a transaction open (`slot_lost`, see [`lose_the_slot`]); each counts
//! `stale_reads`: reads that started more than 20 ms after a write's commit returned and
//! saw an older version. And the propagation, from the commit returned to the host's
//! watch invalidating the entry.
//!
//! PostgreSQL runs on this machine too (a loopback URL): the suite leaves it one CPU
//! ([`DatabaseCore`]), so that what is measured is the feed, not readers starving the
//! database's processes of time slices.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use coherent::ops::{watch_table, ChangeFeed, Database, Host};
use coherent::Registry;
use parking_lot::Mutex;

use crate::cluster::host::TtlUsers;
use crate::local::service::UserService;
use crate::local::store::{create_users, Store, PG_UPDATE, USERS};
use crate::local::{Getter, Ids, BATCH, READERS_PER_CORE};
use crate::report::{cores, progress, Report, Row};
use crate::Timing;

/// How often the outside writer writes.
const WRITE_PERIOD: Duration = Duration::from_millis(5);
/// A read that starts this long after a write's commit returned must see it.
const STALE_AFTER: Duration = Duration::from_millis(20);

/// The recent writes of each user: (when the commit returned, the version), newest last.
struct Written(Vec<Mutex<VecDeque<(Instant, u64)>>>);

impl Written {
    fn new() -> Arc<Self> {
        Arc::new(Self(
            (0..=USERS).map(|_| Mutex::new(VecDeque::new())).collect(),
        ))
    }

    fn record(&self, id: u64, version: u64, at: Instant) {
        let mut w = self.0[id as usize].lock();
        w.push_back((at, version));
        if w.len() > 8 {
            w.pop_front();
        }
    }

    /// The newest version whose commit returned `STALE_AFTER` before `start`.
    fn floor(&self, id: u64, start: Instant) -> u64 {
        let w = self.0[id as usize].lock();
        w.iter()
            .rev()
            .find(|(at, _)| *at + STALE_AFTER <= start)
            .map_or(0, |(_, v)| *v)
    }

    fn latest(&self, id: u64) -> u64 {
        self.0[id as usize].lock().back().map_or(0, |(_, v)| *v)
    }
}

/// Commit instants by (id, version), for the propagation samples.
type Commits = Arc<Mutex<HashMap<(u64, u64), Instant>>>;

/// Calls and stale reads of `readers` tasks over `getters` (taken in turn) for `duration`.
async fn read<G: Getter>(
    getters: &[Arc<G>],
    readers: usize,
    written: &Arc<Written>,
    duration: Duration,
) -> (u64, u64, Duration) {
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..readers)
        .map(|i| {
            let getter = getters[i % getters.len()].clone();
            let (written, stop) = (written.clone(), stop.clone());
            tokio::spawn(async move {
                let mut ids = Ids(0x9E37_79B9_7F4A_7C15u64.wrapping_mul(i as u64 + 1) | 1);
                let (mut calls, mut stale) = (0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..BATCH {
                        let id = ids.next();
                        let start = Instant::now();
                        let user = std::hint::black_box(getter.get(id).await.expect("answers"));
                        if user.version < written.floor(id, start) {
                            stale += 1;
                        }
                        calls += 1;
                    }
                    tokio::task::yield_now().await;
                }
                (calls, stale)
            })
        })
        .collect();
    let started = Instant::now();
    {
        let stop = stop.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            std::thread::sleep(duration);
            stop.store(true, Ordering::Relaxed);
            let _ = tx.send(());
        });
        let _ = rx.await;
    }
    let (mut calls, mut stale) = (0, 0);
    for t in tasks {
        let (c, s) = t.await.expect("a reader");
        calls += c;
        stale += s;
    }
    (calls, stale, started.elapsed())
}

/// The outside writer: a plain tokio-postgres connection of its own, on a thread and
/// runtime of its own, updating a random user every `WRITE_PERIOD` until `stop`.
fn spawn_writer(
    config: tokio_postgres::Config,
    written: Arc<Written>,
    commits: Commits,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for the writer");
        runtime.block_on(async move {
            let (client, connection) = config
                .connect(tokio_postgres::NoTls)
                .await
                .expect("the writer's connection");
            tokio::spawn(connection);
            let update = client.prepare(PG_UPDATE).await.expect("prepared");
            let mut ids = Ids(0xDEAD_BEEF);
            let mut tick = tokio::time::interval(WRITE_PERIOD);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut writes = 0u64;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let id = ids.next();
                let version = written.latest(id) + 1;
                let name = format!("User {id} v{version}");
                client
                    .execute(
                        &update,
                        &[
                            &(id as i64),
                            &(version as i64),
                            &name,
                            &crate::local::store::now_micros(),
                        ],
                    )
                    .await
                    .expect("the write");
                let at = Instant::now();
                commits.lock().insert((id, version), at);
                written.record(id, version, at);
                writes += 1;
            }
            writes
        })
    })
}

/// A host with the cached service, whose watch of `users` invalidates `get(id)` and
/// samples the propagation.
async fn cached_host(
    db: &Database,
    store: Arc<Store>,
    commits: &Commits,
    samples: &Arc<Mutex<hdrhistogram::Histogram<u64>>>,
) -> anyhow::Result<(Host, Arc<UserService>, Registry)> {
    let registry = Registry::new();
    let service = Arc::new(UserService::new(store, &registry));
    let (watching, commits, samples) = (service.clone(), commits.clone(), samples.clone());
    let host = Host::builder(db.clone())
        .registry(&registry)
        .watch(
            watch_table("users")
                .columns(["version"])
                .on_change(move |change| {
                    let (Some(id), Some(version)) =
                        (change.key::<u64>("id"), change.key::<u64>("version"))
                    else {
                        return;
                    };
                    watching.invalidate_get(id);
                    if let Some(at) = commits.lock().get(&(id, version)) {
                        let _ = samples
                            .lock()
                            .record(at.elapsed().as_micros().max(1) as u64);
                    }
                }),
        )
        .change_feed(ChangeFeed::postgres())
        .start()
        .await?;
    Ok((host, service, registry))
}

/// How long the fault's transaction stays open once the new slot waits for it.
const SLOT_WAIT: Duration = Duration::from_secs(2);

/// What [`lose_the_slot`] did: whether the new slot was seen waiting for the open
/// transaction, and how long that transaction stayed open.
struct SlotLoss {
    waited: bool,
    open_for: Duration,
}

/// The fault of the `slot_lost` row: a transaction that holds a transaction id is opened
/// on a connection of its own, the feed's publication `name` is dropped under the writer's
/// changes (the feed's reads are refused, and after three it gives the slot up and makes
/// another, which waits for every transaction running then), and the transaction is
/// committed [`SLOT_WAIT`] after the new slot was seen waiting (or after 10 s without).
/// A change the writer commits in that wait is in no slot: the hosts hold their caches
/// (every call reads the database) until the flush after the new slot.
async fn lose_the_slot(config: &tokio_postgres::Config, name: &str) -> anyhow::Result<SlotLoss> {
    let connect = || async {
        let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
        tokio::spawn(connection);
        anyhow::Ok(client)
    };
    let (long, psql) = (connect().await?, connect().await?);
    long.batch_execute("BEGIN; SELECT pg_current_xact_id()")
        .await?;
    let opened = Instant::now();
    psql.batch_execute(&format!("DROP PUBLICATION IF EXISTS {name}"))
        .await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut waited = false;
    while Instant::now() < deadline {
        let waiting: i64 = psql
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE query LIKE '%pg_create_logical_replication_slot%' \
                   AND state = 'active' AND pid <> pg_backend_pid() \
                   AND application_name LIKE $1",
                &[&format!("{}%", coherent::ops::changes::FEED_APPLICATION)],
            )
            .await?
            .get(0);
        if waiting > 0 {
            waited = true;
            tokio::time::sleep(SLOT_WAIT).await;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    long.batch_execute("COMMIT").await?;
    Ok(SlotLoss {
        waited,
        open_for: opened.elapsed(),
    })
}

pub(crate) fn run(timing: Timing) -> anyhow::Result<Report> {
    // Before any thread of the suite starts: they keep the main thread's CPUs.
    let left = crate::report::database_url()
        .parse::<tokio_postgres::Config>()
        .ok()
        .filter(on_this_machine)
        .and_then(|_| DatabaseCore::leave());
    // Counted after: the readers and workers are those of the CPUs the suite keeps.
    let used = cores();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(used)
        .enable_all()
        .build()?;
    let mut report = runtime.block_on(run_async(timing))?;
    drop(runtime);
    report.note(match &left {
        Some(left) => format!(
            "the suite's threads (readers, hosts, feed, writer) ran on {used} CPU(s), off \
             CPU {}, which PostgreSQL (on this machine) had free of them, as it has a \
             machine of its own in production: with every CPU busy with readers, each step \
             of a change's way (the walsender, a backend's answer, a notification) waits for \
             a time slice, and the stale reads measure that (COHERENT_BENCH_SHARE_CORES=1 \
             runs the suite on every CPU)",
            left.core
        ),
        None => format!(
            "the suite's threads ran on {used} CPU(s), shared with PostgreSQL if it runs \
             on this machine"
        ),
    });
    Ok(report)
}

/// Whether `config` names a server on this machine (a loopback address or a Unix socket):
/// only then do the suite and the server share CPUs.
fn on_this_machine(config: &tokio_postgres::Config) -> bool {
    use tokio_postgres::config::Host;
    let loopback = |name: &str| {
        name == "localhost"
            || name
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    };
    config.get_hostaddrs().iter().all(|a| a.is_loopback())
        && config.get_hosts().iter().all(|h| match h {
            Host::Tcp(name) => loopback(name),
            #[cfg(unix)]
            Host::Unix(_) => true,
        })
}

/// One CPU kept free of the suite's threads for PostgreSQL, which runs on the same
/// machine here: the suite's main thread (and so every thread it starts) keeps to the
/// others until this is dropped. The last CPU the process may use; nothing when it may
/// use one only, off Linux, or with `COHERENT_BENCH_SHARE_CORES=1`. (A CPU free of the
/// suite's threads, not one PostgreSQL is bound to: its processes run where the scheduler
/// puts them, which is mostly there.)
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
struct DatabaseCore {
    #[cfg(target_os = "linux")]
    saved: libc::cpu_set_t,
    core: usize,
}

impl DatabaseCore {
    #[cfg(target_os = "linux")]
    fn leave() -> Option<Self> {
        if std::env::var_os("COHERENT_BENCH_SHARE_CORES").is_some_and(|v| v != "0") {
            return None;
        }
        // SAFETY: `cpu_set_t` is plain data; the calls get and set the calling thread's
        // mask with the set's own size.
        unsafe {
            let mut saved: libc::cpu_set_t = std::mem::zeroed();
            let size = std::mem::size_of::<libc::cpu_set_t>();
            if libc::sched_getaffinity(0, size, &mut saved) != 0 {
                return None;
            }
            let allowed: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &saved))
                .collect();
            let (&core, _) = allowed.split_last().filter(|(_, rest)| !rest.is_empty())?;
            let mut mask = saved;
            libc::CPU_CLR(core, &mut mask);
            (libc::sched_setaffinity(0, size, &mask) == 0).then_some(Self { saved, core })
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn leave() -> Option<Self> {
        None
    }
}

impl Drop for DatabaseCore {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        // SAFETY: as in `leave`: the calling thread's mask, back to what it was.
        unsafe {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.saved);
        }
    }
}

async fn run_async(timing: Timing) -> anyhow::Result<Report> {
    let mut report = Report::new("dbchanges");
    let url = crate::report::database_url();
    let schema = format!("bench_dbchanges_{}", std::process::id());
    let db = match Database::postgres_in_schema(&url, &schema).await {
        Ok(db) => db,
        Err(e) => {
            report.note(format!("skipped: PostgreSQL at {url}: {e}"));
            return Ok(report);
        }
    };
    let pool = db.postgres_pool().expect("PostgreSQL").clone();
    {
        let client = pool.get().await?;
        let level: String = client.query_one("SHOW wal_level", &[]).await?.get(0);
        if level != "logical" {
            report.note(format!(
                "skipped: wal_level is {level} (the feed needs logical; .ci/run sets it)"
            ));
            return Ok(report);
        }
        create_users(&client).await?;
    }
    let mut config: tokio_postgres::Config = url.parse()?;
    config.options(format!("-c search_path={schema}"));
    let readers = READERS_PER_CORE * cores();
    let bar = progress(5);

    let written = Written::new();
    let commits: Commits = Arc::default();
    let samples = Arc::new(Mutex::new(hdrhistogram::Histogram::<u64>::new(3)?));
    let store = || -> anyhow::Result<Arc<Store>> {
        Ok(Arc::new(Store::postgres_with(config.clone(), cores() * 4)?))
    };
    let other = Arc::new(Mutex::new(hdrhistogram::Histogram::<u64>::new(3)?));
    let (host_a, service_a, registry_a) = cached_host(&db, store()?, &commits, &samples).await?;
    // The second host starts once the first reads the feed, so that the first one's samples
    // are those of the host that reads it.
    while !host_a.feed_stats().is_some_and(|f| f.leading) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (host_b, service_b, registry_b) = cached_host(&db, store()?, &commits, &other).await?;

    // Each row: the writer runs throughout; a warm-up, then the best of the runs.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = spawn_writer(
        config.clone(),
        written.clone(),
        commits.clone(),
        stop.clone(),
    );
    async fn row<G: Getter>(
        timing: Timing,
        getters: &[Arc<G>],
        readers: usize,
        written: &Arc<Written>,
    ) -> (f64, u64) {
        let (_, mut stale, _) = read(getters, readers, written, timing.warmup).await;
        let mut best = 0f64;
        for _ in 0..timing.runs {
            let (calls, s, elapsed) = read(getters, readers, written, timing.run).await;
            stale += s;
            best = best.max(calls as f64 / elapsed.as_secs_f64());
        }
        (best, stale)
    }

    // The mechanism alone: the writer, no readers (the suite's CPUs for the feed and the hosts).
    bar.set_message("dbchanges.propagation, no readers");
    tokio::time::sleep(timing.warmup).await;
    samples.lock().reset();
    other.lock().reset();
    tokio::time::sleep(timing.run).await;
    let idle = samples.lock().clone();
    let idle_other = other.lock().clone();

    bar.set_message("dbchanges.direct.readers");
    let direct = store()?;
    let (rate, stale) = row(timing, std::slice::from_ref(&direct), readers, &written).await;
    report.push(Row::new("dbchanges.direct.readers", rate, "calls/s").with("stale_reads", stale));
    bar.inc(1);

    bar.set_message("dbchanges.ttl.readers");
    let ttl = Arc::new(TtlUsers {
        cache: moka::sync::Cache::builder()
            .max_capacity(10_000)
            .time_to_live(Duration::from_secs(1))
            .build(),
        store: direct.clone(),
    });
    let (rate, stale) = row(timing, &[ttl], readers, &written).await;
    report.push(
        Row::new("dbchanges.ttl.readers", rate, "calls/s")
            .with("stale_reads", stale)
            .compared_to("dbchanges.direct.readers"),
    );
    bar.inc(1);

    bar.set_message("dbchanges.cached.readers");
    samples.lock().reset();
    other.lock().reset();
    let before = registry_a.metrics();
    let (rate, stale) = row(timing, std::slice::from_ref(&service_a), readers, &written).await;
    let invalidations = registry_a.metrics().since(&before).invalidations;
    report.push(
        Row::new("dbchanges.cached.readers", rate, "calls/s")
            .with("stale_reads", stale)
            .with("invalidations", invalidations)
            .compared_to("dbchanges.direct.readers"),
    );
    let h = samples.lock().clone();
    let h_other = other.lock().clone();
    bar.inc(1);

    bar.set_message("dbchanges.cluster.readers");
    let (rate, stale) = row(
        timing,
        &[service_a.clone(), service_b.clone()],
        readers,
        &written,
    )
    .await;
    report.push(
        Row::new("dbchanges.cluster.readers", rate, "calls/s")
            .with("stale_reads", stale)
            .compared_to("dbchanges.direct.readers"),
    );
    bar.inc(1);

    // The slot lost while a transaction is open (a long transaction, a slot past
    // `max_slot_wal_keep_size`, a dropped publication): the readers of both hosts run
    // through the fault, the writer on.
    bar.set_message("dbchanges.slot_lost.readers");
    let counts = |h: &Host| {
        let feed = h.feed_stats().unwrap_or_default();
        (h.stats().change_holds, feed.slots_created)
    };
    let (holds_before, slots_before) = {
        let (a, b) = (counts(&host_a), counts(&host_b));
        (a.0 + b.0, a.1 + b.1)
    };
    let feed_name = format!(
        "coherent_{}_{}",
        config.get_dbname().unwrap_or("postgres"),
        schema
    );
    let fault = {
        let (config, name) = (config.clone(), feed_name.clone());
        tokio::spawn(async move { lose_the_slot(&config, &name).await })
    };
    let (mut calls, mut stale) = (0u64, 0u64);
    // Stale reads by when they were read, in slices of 100 ms: before either host held
    // its cache, while one did, and after both answered from their caches again.
    let mut phases = [0u64; 3];
    let mut phase = 0;
    let started = Instant::now();
    loop {
        let held = registry_a.is_fenced() || registry_b.is_fenced();
        if held {
            phase = 1;
        } else if phase == 1 {
            phase = 2;
        }
        // Until the fault is over and both hosts answer from their caches again (the
        // flush after the new slot).
        if fault.is_finished() && !held && started.elapsed() >= timing.run {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            report.note("slot_lost: the hosts still held their caches after 60 s");
            break;
        }
        let (c, s, _) = read(
            &[service_a.clone(), service_b.clone()],
            readers,
            &written,
            Duration::from_millis(100),
        )
        .await;
        calls += c;
        stale += s;
        phases[phase] += s;
    }
    let elapsed = started.elapsed();
    let loss = fault.await??;
    let (holds, slots) = {
        let (a, b) = (counts(&host_a), counts(&host_b));
        (a.0 + b.0 - holds_before, a.1 + b.1 - slots_before)
    };
    report.push(
        Row::new(
            "dbchanges.slot_lost.readers",
            calls as f64 / elapsed.as_secs_f64(),
            "calls/s",
        )
        .with("stale_reads", stale)
        .with("stale_before_hold", phases[0])
        .with("stale_while_held", phases[1])
        .with("stale_after_hold", phases[2])
        .with("slots_created", slots)
        .with("change_holds", holds)
        .with("slot_waited", u64::from(loss.waited))
        .with("transaction_open_ms", loss.open_for.as_millis() as u64)
        .compared_to("dbchanges.direct.readers"),
    );
    if !loss.waited {
        report.note("slot_lost: the new slot was not seen waiting for the open transaction");
    }
    bar.inc(1);
    stop.store(true, Ordering::Relaxed);
    let writes = tokio::task::spawn_blocking(move || writer.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the writer panicked"))?;

    // The propagation to every host: the worse of the two at each quantile.
    for (row, reading, other) in [
        ("dbchanges.propagation", &h, &h_other),
        ("dbchanges.propagation_idle", &idle, &idle_other),
    ] {
        for (name, q) in [("p50", 0.5), ("p99", 0.99)] {
            let (a, b) = (reading.value_at_quantile(q), other.value_at_quantile(q));
            report.push(
                Row::new(format!("{row}_{name}_us"), a.max(b) as f64, "us")
                    .with("reading_host_us", a)
                    .with("other_host_us", b)
                    .with("reading_host_max_us", reading.max())
                    .with("other_host_max_us", other.max())
                    .with("samples", reading.len() + other.len()),
            );
        }
    }
    let feed: Vec<_> = [&host_a, &host_b]
        .iter()
        .filter_map(|h| h.feed_stats())
        .collect();
    let operations: u64 = feed.iter().map(|f| f.operations).sum();
    let rows: u64 = feed.iter().map(|f| f.rows).sum();
    report.note(format!(
        "an outside connection wrote {writes} times (every {WRITE_PERIOD:?}); the feed \
         logged {rows} rows in {operations} operations; {readers} readers; a read is stale \
         when it started {STALE_AFTER:?} after a commit returned and saw an older version"
    ));
    report.note(
        "feed: ChangeFeed::postgres() with its defaults (pgoutput slot read by one host); \
         propagation = commit returned to the watch's invalidation, on the host that reads \
         the feed and on the other (the row: the worse of the two; `_idle`: the writer alone, \
         no readers)",
    );
    report.note("ttl: moka::sync::Cache with a 1 s time to live in front of the direct query");
    report.note(format!(
        "slot_lost: both hosts' readers while a transaction holds an id and the feed's \
         publication is dropped (its reads refused, the slot given up after three, a new one \
         waiting for that transaction, committed {SLOT_WAIT:?} after); stale reads split by \
         when they were read: before either host held its cache, while one did, after"
    ));
    host_a.stop().await;
    host_b.stop().await;
    {
        let client = pool.get().await?;
        let slot = feed_name;
        // The feed's thread may still be reading it for a moment after the stop.
        for _ in 0..500 {
            let _ = client
                .execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                     WHERE slot_name = $1 AND NOT active",
                    &[&slot],
                )
                .await;
            let gone = client
                .query_opt(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await?
                .is_none();
            if gone {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = client
            .batch_execute(&format!(
                "DROP PUBLICATION IF EXISTS {slot}; DROP SCHEMA {schema} CASCADE"
            ))
            .await;
    }
    bar.finish_and_clear();
    Ok(report)
}
