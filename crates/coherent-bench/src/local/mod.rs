//! The `local` suite: `UserService.get(id)` over 1,000 users in SQLite (a WAL file) and
//! PostgreSQL, direct (a query per call) and cached (a compute method), with one reader, and
//! with 20 readers per core plus a mutator that writes through the service every 10 ms while
//! every read is checked against the version committed before it started. Peers: a concurrent
//! map, moka and quick_cache, on the same keys and the same value type. Then the bytes each
//! cached result takes, and hits and invalidation at scale (`memory.rs`).

pub(crate) mod memory;
mod peers;
pub(crate) mod service;
pub(crate) mod store;

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use coherent::Registry;
use tokio::runtime::Runtime;

use crate::report::{cores, progress, Report, Row};
use crate::Timing;
use service::UserService;
use store::{Store, StoreError, User, USERS};

/// Calls between two checks of the stop flag (and, with many readers, a yield). A yield costs
/// the reader's task a trip through the scheduler, several hits' worth: at 64 the yields were a
/// visible part of the readers+mutator rows, which measure reads, not the scheduler.
pub(crate) const BATCH: u32 = 256;
pub(crate) const READERS_PER_CORE: usize = 20;
const MUTATOR_PERIOD: Duration = Duration::from_millis(10);

/// A cheap deterministic generator of user ids.
#[derive(Clone, Copy)]
pub(crate) struct Ids(pub(crate) u64);

impl Ids {
    /// A user's id, in `1..=USERS`.
    #[inline]
    pub(crate) fn next(&mut self) -> u64 {
        self.below(USERS) + 1
    }

    /// A number in `0..n` (`n` at most 2^32).
    #[inline]
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) % n
    }
}

/// Below this ratio of a hit to quick_cache's, the suite warns (`.ci/run` shows it): the hit
/// path regressed once without anyone seeing it (issue 32).
const HIT_WARNING: f64 = 0.9;

/// The latest version of each user whose write has returned.
pub(crate) struct Committed(pub(crate) Vec<AtomicU64>);

impl Committed {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self((0..=USERS).map(|_| AtomicU64::new(0)).collect()))
    }

    pub(crate) fn floor(&self, id: u64) -> u64 {
        self.0[id as usize].load(Ordering::Acquire)
    }
}

#[derive(Default, Clone, Copy)]
struct Outcome {
    calls: u64,
    stale: u64,
    elapsed: Duration,
    writes: u64,
    invalidations: u64,
}

impl Outcome {
    fn rate(&self) -> f64 {
        self.calls as f64 / self.elapsed.as_secs_f64()
    }
}

/// Something readers call: the direct store, the compute service, or a peer cache.
pub(crate) trait Getter: Send + Sync + 'static {
    fn get(&self, id: u64) -> impl Future<Output = Result<User, StoreError>> + Send;
}

impl Getter for Store {
    async fn get(&self, id: u64) -> Result<User, StoreError> {
        Store::get(self, id).await
    }
}

impl Getter for UserService {
    #[inline]
    async fn get(&self, id: u64) -> Result<User, StoreError> {
        UserService::get(self, id).await
    }
}

/// How a mutator writes: through the service (which invalidates), or straight to the store.
#[derive(Clone)]
enum Writer {
    Service(UserService),
    Store(Arc<Store>),
}

impl Writer {
    /// A writer whose store connections belong to the runtime it is called on.
    fn for_this_runtime(&self) -> anyhow::Result<Self> {
        Ok(match self {
            Writer::Service(service) => Writer::Service(
                service.with_store(Arc::new(service.store().for_another_runtime()?)),
            ),
            Writer::Store(store) => Writer::Store(Arc::new(store.for_another_runtime()?)),
        })
    }

    async fn update(&self, id: u64, version: u64) -> Result<(), StoreError> {
        match self {
            Writer::Service(service) => service.update(id, version).await,
            Writer::Store(store) => store.update(id, version).await,
        }
    }
}

async fn read_loop<G: Getter>(
    getter: Arc<G>,
    committed: Arc<Committed>,
    stop: Arc<AtomicBool>,
    seed: u64,
    check: bool,
) -> (u64, u64) {
    let mut ids = Ids(seed | 1);
    let (mut calls, mut stale) = (0u64, 0u64);
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..BATCH {
            let id = ids.next();
            let floor = if check { committed.floor(id) } else { 0 };
            // black_box: every getter must hand over the whole value; without it, a getter
            // inlined into this loop could skip copying fields nobody reads.
            let user = std::hint::black_box(getter.get(id).await.expect("the store answers"));
            if user.version < floor {
                stale += 1;
            }
            calls += 1;
        }
        if check {
            // Hits never wait: without a yield, a reader would keep its worker from the other
            // readers and from the tasks that drive the store's I/O for misses.
            tokio::task::yield_now().await;
        }
    }
    (calls, stale)
}

/// Starts `readers` reader tasks, each with its own id sequence.
pub(crate) fn spawn_readers<G: Getter>(
    getter: &Arc<G>,
    readers: usize,
    committed: &Arc<Committed>,
    stop: &Arc<AtomicBool>,
    check: bool,
) -> Vec<tokio::task::JoinHandle<(u64, u64)>> {
    (0..readers)
        .map(|i| {
            tokio::spawn(read_loop(
                getter.clone(),
                committed.clone(),
                stop.clone(),
                0x9E37_79B9_7F4A_7C15u64.wrapping_mul(i as u64 + 1),
                check,
            ))
        })
        .collect()
}

/// Sets `stop` after `duration` and waits for the readers; returns their calls and stale
/// reads. The signal comes from an OS thread, not a tokio timer: a reader whose calls are all
/// hits never yields, and would keep the worker that drives the timers from firing them.
pub(crate) async fn stop_readers(
    tasks: Vec<tokio::task::JoinHandle<(u64, u64)>>,
    stop: &Arc<AtomicBool>,
    duration: Duration,
) -> (u64, u64) {
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    {
        let stop = stop.clone();
        std::thread::spawn(move || {
            std::thread::sleep(duration);
            stop.store(true, Ordering::Relaxed);
            let _ = done_tx.send(());
        });
    }
    let _ = done_rx.await;
    let (mut calls, mut stale) = (0, 0);
    for task in tasks {
        let (c, s) = task.await.expect("a reader task");
        calls += c;
        stale += s;
    }
    (calls, stale)
}

/// Writes every `MUTATOR_PERIOD` (a random user per write) until `stop`, on a thread and
/// runtime of its own, so that its write rate does not depend on how the scheduler treats it
/// among the readers. `setup` runs on that runtime first (store connections belong to the
/// runtime that made them); `write` gets a clone of what it made and the user's id. The
/// thread answers how many writes it made.
pub(crate) fn spawn_mutator<W, S, F, Fut>(
    stop: Arc<AtomicBool>,
    setup: S,
    mut write: F,
) -> std::thread::JoinHandle<u64>
where
    W: Clone,
    S: FnOnce() -> W + Send + 'static,
    F: FnMut(W, u64) -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for the mutator");
        runtime.block_on(async move {
            let target = setup();
            let mut ids = Ids(0xDEAD_BEEF);
            let mut tick = tokio::time::interval(MUTATOR_PERIOD);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut writes = 0u64;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                write(target.clone(), ids.next()).await;
                writes += 1;
            }
            writes
        })
    })
}

/// Runs `readers` reader tasks (and the mutator, if any) for `duration`.
async fn run_once<G: Getter>(
    getter: &Arc<G>,
    readers: usize,
    writer: Option<&Writer>,
    registry: Option<&Registry>,
    committed: &Arc<Committed>,
    duration: Duration,
) -> Outcome {
    let stop = Arc::new(AtomicBool::new(false));
    let before = registry.map(Registry::metrics);
    let check = writer.is_some();
    let tasks = spawn_readers(getter, readers, committed, &stop, check);
    // The mutator runs on a thread of its own, so that its write rate (one every 10 ms) does
    // not depend on how the scheduler treats it among the readers.
    let mutator = writer.map(|writer| {
        let (writer, committed) = (writer.clone(), committed.clone());
        spawn_mutator(
            stop.clone(),
            move || {
                writer
                    .for_this_runtime()
                    .expect("a store connection for the mutator")
            },
            move |writer: Writer, id| {
                let committed = committed.clone();
                async move {
                    let version = committed.floor(id) + 1;
                    writer
                        .update(id, version)
                        .await
                        .expect("the store accepts the write");
                    committed.0[id as usize].store(version, Ordering::Release);
                }
            },
        )
    });
    let started = Instant::now();
    let mut outcome = Outcome::default();
    (outcome.calls, outcome.stale) = stop_readers(tasks, &stop, duration).await;
    outcome.elapsed = started.elapsed();
    if let Some(mutator) = mutator {
        outcome.writes = tokio::task::spawn_blocking(move || mutator.join())
            .await
            .expect("joined")
            .expect("the mutator thread");
    }
    if let (Some(registry), Some(before)) = (registry, before) {
        outcome.invalidations = registry.metrics().since(&before).invalidations;
    }
    outcome
}

/// A warm-up, then the best of `timing.runs`; stale reads are summed over every run.
async fn best_of<G: Getter>(
    timing: Timing,
    getter: &Arc<G>,
    readers: usize,
    writer: Option<&Writer>,
    registry: Option<&Registry>,
    committed: &Arc<Committed>,
) -> (Outcome, u64) {
    let warmup = run_once(getter, readers, writer, registry, committed, timing.warmup).await;
    let mut stale = warmup.stale;
    let mut best = Outcome::default();
    for _ in 0..timing.runs {
        let outcome = run_once(getter, readers, writer, registry, committed, timing.run).await;
        stale += outcome.stale;
        if best.calls == 0 || outcome.rate() > best.rate() {
            best = outcome;
        }
    }
    (best, stale)
}

fn mutator_row(name: String, best: Outcome, stale: u64, cached: bool) -> Row {
    let seconds = best.elapsed.as_secs_f64();
    let mut row = Row::new(name, best.rate(), "calls/s")
        .with("stale_reads", stale)
        .with("writes", best.writes);
    if cached {
        row = row.with("invalidations", best.invalidations).with(
            "invalidations_per_s",
            (best.invalidations as f64 / seconds).round(),
        );
    }
    row
}

/// One store's four rows.
/// With `defer_cached_1reader`, the `cached.1reader` row is left to the caller, which measures
/// it side by side with the peers; the service to measure is returned.
async fn store_rows(
    prefix: &str,
    store: Arc<Store>,
    timing: Timing,
    report: &mut Report,
    bar: &indicatif::ProgressBar,
    defer_cached_1reader: bool,
) -> Arc<UserService> {
    let many = READERS_PER_CORE * cores();

    bar.set_message(format!("{prefix}.direct.1reader"));
    let committed = Committed::new();
    let (best, _) = best_of(timing, &store, 1, None, None, &committed).await;
    // The chart draws each store's rows per workload, direct and cached side by side.
    let one_reader_group = format!("{prefix}.1reader");
    let mutator_group = format!("{prefix}.readers+mutator");
    report.push(
        Row::new(format!("{prefix}.direct.1reader"), best.rate(), "calls/s")
            .in_group(&one_reader_group),
    );
    bar.inc(1);

    let registry = Registry::new();
    let one_reader = Arc::new(UserService::new(store.clone(), &registry));
    if !defer_cached_1reader {
        bar.set_message(format!("{prefix}.cached.1reader"));
        let (best, _) = best_of(timing, &one_reader, 1, None, Some(&registry), &committed).await;
        report.push(
            Row::new(format!("{prefix}.cached.1reader"), best.rate(), "calls/s")
                .compared_to(&format!("{prefix}.direct.1reader"))
                .in_group(&one_reader_group),
        );
        bar.inc(1);
    }

    bar.set_message(format!("{prefix}.direct.readers+mutator"));
    let writer = Writer::Store(store.clone());
    let (best, stale) = best_of(timing, &store, many, Some(&writer), None, &committed).await;
    report.push(
        mutator_row(
            format!("{prefix}.direct.readers+mutator"),
            best,
            stale,
            false,
        )
        .in_group(&mutator_group),
    );
    bar.inc(1);

    bar.set_message(format!("{prefix}.cached.readers+mutator"));
    // A fresh cache: the direct row above wrote to the store behind the first service's back,
    // so its cached users are stale, as any cache bypassed by a writer would be.
    let registry = Registry::new();
    let service = Arc::new(UserService::new(store.clone(), &registry));
    let writer = Writer::Service((*service).clone());
    let (best, stale) = best_of(
        timing,
        &service,
        many,
        Some(&writer),
        Some(&registry),
        &committed,
    )
    .await;
    report.push(
        mutator_row(
            format!("{prefix}.cached.readers+mutator"),
            best,
            stale,
            true,
        )
        .compared_to(&format!("{prefix}.cached.1reader"))
        .in_group(&mutator_group),
    );
    bar.inc(1);
    one_reader
}

/// Runs the suite.
/// `only`: `""` for every row; `1reader` for ours and the peers side by side alone (the hit
/// path, for iterating on it).
pub(crate) fn run(timing: Timing, only: &str) -> anyhow::Result<Report> {
    let hits_alone = match only {
        "" => false,
        "1reader" => true,
        other => anyhow::bail!("local --only takes `1reader`, not `{other}`"),
    };
    let runtime: Runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores())
        .enable_all()
        .build()?;
    runtime.block_on(run_async(timing, hits_alone))
}

async fn run_async(timing: Timing, hits_alone: bool) -> anyhow::Result<Report> {
    let mut report = Report::new("local");
    let bar = progress(11 + memory::steps(timing));
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("users.db");
    let sqlite = Arc::new(Store::sqlite(&path, (cores() * 2) as u32)?);
    let sqlite_service = if hits_alone {
        Arc::new(UserService::new(sqlite, &Registry::new()))
    } else {
        store_rows("sqlite", sqlite, timing, &mut report, &bar, true).await
    };
    report.note(format!(
        "sqlite: a WAL-mode file ({}) through an r2d2 pool",
        path.display()
    ));

    if !hits_alone {
        let url = crate::report::database_url();
        match Store::postgres(&url, cores() * 4).await {
            Ok(Some(postgres)) => {
                store_rows(
                    "postgres",
                    Arc::new(postgres),
                    timing,
                    &mut report,
                    &bar,
                    false,
                )
                .await;
                report.note("postgres: tokio-postgres through a deadpool pool");
            }
            Ok(None) | Err(_) => {
                bar.inc(4);
                report.note(format!("postgres rows skipped: {url} is not reachable"));
            }
        }
    }

    // Ours and the peers side by side: each round runs every contender once, so that the drift
    // of this shared machine over minutes reaches all of them alike; the best round counts.
    bar.set_message("sqlite.cached.1reader and peers, interleaved");
    let mut contenders: Vec<(String, peers::Peer)> = vec![(
        "sqlite.cached.1reader".to_owned(),
        peers::Peer::Ours(sqlite_service),
    )];
    contenders.extend(
        peers::all()
            .into_iter()
            .map(|(name, make)| (format!("peer.{name}.1reader"), make())),
    );
    let committed = Committed::new();
    let mut best = vec![Outcome::default(); contenders.len()];
    for round in 0..=timing.runs {
        let duration = if round == 0 {
            timing.warmup
        } else {
            timing.run
        };
        for (i, (_, contender)) in contenders.iter().enumerate() {
            let outcome = contender.run_once(&committed, duration).await;
            if round > 0 && (best[i].calls == 0 || outcome.rate() > best[i].rate()) {
                best[i] = outcome;
            }
        }
    }
    for ((name, _), best) in contenders.iter().zip(&best) {
        // Measured side by side with sqlite.cached.1reader: charted with it.
        let row = Row::new(name.clone(), best.rate(), "calls/s").in_group("sqlite.1reader");
        if name == "sqlite.cached.1reader" {
            report.insert_after(
                "sqlite.direct.1reader",
                row.compared_to("sqlite.direct.1reader"),
            );
        } else {
            report.push(row);
        }
        bar.inc(1);
    }
    // Ours against each peer.
    let cached = report.value("sqlite.cached.1reader");
    for peer in ["map", "moka", "quickcache"] {
        let name = format!("peer.{peer}.1reader");
        if let (Some(ours), Some(theirs)) = (cached, report.value(&name)) {
            report.note(format!(
                "sqlite.cached.1reader / {name} = {:.2}",
                ours / theirs
            ));
            // A warning, not a failure: one short run on a shared machine can dip. Not for
            // a debug build, whose ratio says nothing about the hit path.
            if peer == "quickcache" && ours / theirs < HIT_WARNING && !cfg!(debug_assertions) {
                eprintln!(
                    "warning: the hit path is slow: sqlite.cached.1reader / {name} = {:.2}, \
                     below {HIT_WARNING}",
                    ours / theirs
                );
            }
        }
    }
    report.note(peers::SETTINGS);
    if hits_alone {
        bar.finish_and_clear();
        return Ok(report);
    }

    memory::rows(timing, &mut report, &bar)?;
    if let Some(leaf) = report.value("memory.coherent.leaf") {
        for peer in ["map", "moka", "quickcache"] {
            if let Some(theirs) = report.value(&format!("memory.{peer}")) {
                report.note(format!(
                    "memory.coherent.leaf / memory.{peer} = {:.2}",
                    leaf / theirs
                ));
            }
        }
    }
    bar.finish_and_clear();
    Ok(report)
}

/// `hits`: a fixed number of calls on one contender (`ours`, `map`, `moka`, `quickcache`),
/// from `threads` threads at once (each with `calls / threads`), with nothing timed, for
/// instruction counts under `valgrind --tool=callgrind` (the difference between two call
/// counts, divided by the difference in calls, is what one call costs, whatever the machine is
/// doing meanwhile) and for wall-clock comparisons run in turns (`time`).
pub(crate) fn count_calls(contender: &str, calls: u64, threads: usize) -> anyhow::Result<()> {
    let current_thread = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    };
    let dir = tempfile::tempdir()?;
    let made = current_thread()?.block_on(async {
        let store = Arc::new(Store::sqlite(&dir.path().join("users.db"), 1)?);
        let made = match contender {
            "ours" => peers::Peer::Ours(Arc::new(UserService::new(store, &Registry::new()))),
            other => match peers::all().into_iter().find(|(name, _)| *name == other) {
                Some((_, make)) => make(),
                None => anyhow::bail!("unknown contender {other:?}: ours, map, moka or quickcache"),
            },
        };
        // Every key once, so that the counted calls are all hits.
        made.call_n(USERS, 1).await;
        anyhow::Ok(Arc::new(made))
    })?;
    let threads = threads.max(1);
    let workers: Vec<_> = (0..threads as u64)
        .map(|i| {
            let made = made.clone();
            let runtime = current_thread();
            std::thread::spawn(move || {
                let runtime = runtime.expect("a runtime per thread");
                runtime.block_on(made.call_n(calls / threads as u64, 7 + 2 * i))
            })
        })
        .collect();
    let mut sum = 0u64;
    for worker in workers {
        sum ^= worker.join().expect("a calling thread");
    }
    println!("{contender}: {calls} calls on {threads} threads (checksum {sum})");
    Ok(())
}
