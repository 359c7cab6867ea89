//! Liveness and bounds (issue 30, holes 3 and 5). A host is alive while it writes its row
//! to the hosts table, whatever its poll interval, and by the database's clock, whatever
//! its own says: the others wait for its acknowledgements, and trimming waits for it. And
//! what a host holds for its commands and notices stays bounded: the waits of callers that
//! went away, the size of a `NOTIFY` payload, the queue of notices during an outage.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use coherent_ops::{Command, CommandError, Database, Handler, Tx};
use futures::FutureExt;
use serde::{Deserialize, Serialize};

use crate::inproc::{postgres_db, sqlite_db, wait_until};
use crate::support::{host, open_sqlite, SetValue};

/// Long enough never to run out in a test, however loaded the machine.
const PATIENT: Duration = Duration::from_secs(60);

/// A command that writes nothing; its invalidation takes `delay` on the host that runs
/// it, then counts itself. `pad` makes its notice as long as a test needs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Mark {
    #[serde(default)]
    pad: String,
}

impl Command for Mark {
    const NAME: &'static str = "test.mark";
    type Output = ();
}

/// The handler of [`Mark`] on one host.
#[derive(Clone, Default)]
struct Marks {
    delay: Duration,
    invalidated: Arc<AtomicU64>,
}

impl Marks {
    fn slow(delay: Duration) -> Self {
        Self {
            delay,
            ..Self::default()
        }
    }

    fn invalidated(&self) -> u64 {
        self.invalidated.load(Ordering::SeqCst)
    }
}

impl Handler<Mark> for Marks {
    async fn execute(&self, _: &Mark, _: &mut Tx<'_>) -> Result<(), CommandError> {
        Ok(())
    }

    fn invalidate(&self, _: &Mark, _: &()) {
        std::thread::sleep(self.delay);
        self.invalidated.fetch_add(1, Ordering::SeqCst);
    }
}

/// One number from the database: `sqlite` or `postgres`, whichever `db` is.
async fn query(db: &Database, sqlite: &str, postgres: &str) -> i64 {
    match (db.sqlite_path(), db.postgres_pool()) {
        (Some(path), _) => open_sqlite(path)
            .query_row(sqlite, [], |r| r.get(0))
            .unwrap(),
        (None, Some(pool)) => pool
            .get()
            .await
            .unwrap()
            .query_one(postgres, &[])
            .await
            .unwrap()
            .get(0),
        (None, None) => unreachable!(),
    }
}

/// Hole 3: a host whose poll interval is longer than the 5 s a row counts as alive (or
/// whose reads of the log stall: it wrote its row only after a read) dropped out of the
/// others' peers, and their commands answered before it applied them, uncounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_host_that_reads_the_log_seldom_is_still_waited_for() {
    let Some(db) = postgres_db("seldom_reader").await else {
        return;
    };
    let (a, _) = host(&db, |b| {
        b.acknowledgements(Some(PATIENT))
            .command::<Mark>(Marks::default())
    })
    .await;
    // B applies A's operations from notices; it reads the log (by itself) every 30 s. Its
    // invalidation takes a while: if A's command does not wait for B, it answers first.
    let marks_b = Marks::slow(Duration::from_millis(300));
    let (b, _) = host(&db, |b| {
        b.poll_interval(Duration::from_secs(30))
            .acknowledgements(Some(PATIENT))
            .command::<Mark>(marks_b.clone())
    })
    .await;
    wait_until(|| a.stats().peers == 1 && a.notifier_connected() && b.notifier_connected()).await;
    // Longer than a row counts as alive, and a few reads of the hosts table by A.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let peers = a.stats().peers;
    a.run(Mark::default()).await.unwrap();
    let b_stats = b.stats();
    let seen = (
        peers,
        marks_b.invalidated(),
        b_stats.applied_notified + b_stats.applied_from_log,
        a.stats().ack_timeouts,
    );
    assert_eq!(
        seen,
        (1, 1, 1, 0),
        "(A's peers 7 s on, B's invalidations and operations applied when A's command \
         answered, A's acknowledgement timeouts)"
    );
    a.stop().await;
    b.stop().await;
}

/// What a cluster looks like after a host with a skewed clock and a host with a right one
/// each logged an operation, every host passed both, and both hosts trimmed.
#[derive(Debug, PartialEq, Eq)]
struct AfterTrims {
    /// The peers the right host and the skewed host wait for (`None` where commands do not
    /// wait for acknowledgements: SQLite's default notifier polls).
    peers: Option<(u64, u64)>,
    /// The two hosts' rows in the hosts table.
    rows: i64,
    /// Operations the two trims deleted (none is older than the retention, one hour).
    trimmed: u64,
    /// Operations in the log.
    logged: u64,
}

/// Hole 3: `seen_at`, `logged_at` and the cutoffs were each host's own wall clock. A host
/// whose clock is behind looked dead to the others (not waited for), its row was trimmed
/// (it no longer held trimming back) and its operations were taken for old; a host whose
/// clock is ahead took the others for dead, trimmed their rows and their operations.
async fn a_skewed_host_stays_live_and_nothing_is_trimmed_early(db: Database, skew: Duration) {
    let (mut seen, mut expected) = (Vec::new(), Vec::new());
    for ahead in [true, false] {
        let skew = i64::try_from(skew.as_micros()).unwrap() * if ahead { 1 } else { -1 };
        let (a, _) = host(&db, |b| b).await;
        let (s, _) = host(&db, |b| b.clock_skew(skew)).await;
        a.run(SetValue { id: 1, value: 1 }).await.unwrap();
        s.run(SetValue { id: 2, value: 2 }).await.unwrap();
        // Both hosts have passed both operations, and their rows say so: only the
        // retention holds them in the log now.
        let deadline = std::time::Instant::now() + PATIENT;
        while hosts_past_the_log(&db).await < 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "the hosts pass the log"
            );
            a.catch_up().await.unwrap();
            s.catch_up().await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // A few reads of the hosts table by each.
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        let peers = db
            .postgres_pool()
            .map(|_| (a.stats().peers, s.stats().peers));
        let trimmed = a.trim().await.unwrap() + s.trim().await.unwrap();
        let rows = query(
            &db,
            "SELECT count(*) FROM coherent_hosts",
            "SELECT count(*) FROM coherent_hosts",
        )
        .await;
        let after = AfterTrims {
            peers,
            rows,
            trimmed,
            logged: db.log_len().await.unwrap(),
        };
        let right = AfterTrims {
            peers: peers.map(|_| (1, 1)),
            rows: 2,
            trimmed: 0,
            logged: 2,
        };
        a.stop().await;
        s.stop().await;
        // The next round starts from an empty log.
        clear_log(&db).await;
        seen.push((skew, after));
        expected.push((skew, right));
    }
    assert_eq!(seen, expected, "(the skew in µs, what two trims left)");
}

/// How many hosts' rows say they have passed every operation in the log.
async fn hosts_past_the_log(db: &Database) -> i64 {
    query(
        db,
        "SELECT count(*) FROM coherent_hosts \
         WHERE horizon > (SELECT max(id) FROM coherent_operations)",
        "SELECT count(*) FROM coherent_hosts \
         WHERE horizon > (SELECT max(xid)::text::bigint FROM coherent_operations)",
    )
    .await
}

async fn clear_log(db: &Database) {
    match (db.sqlite_path(), db.postgres_pool()) {
        (Some(path), _) => open_sqlite(path)
            .execute_batch("DELETE FROM coherent_operations; DELETE FROM coherent_hosts")
            .unwrap(),
        (None, Some(pool)) => pool
            .get()
            .await
            .unwrap()
            .batch_execute("DELETE FROM coherent_operations; DELETE FROM coherent_hosts")
            .await
            .unwrap(),
        (None, None) => unreachable!(),
    }
}

const AN_HOUR: Duration = Duration::from_secs(3600);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_host_whose_clock_is_an_hour_off_stays_live_and_nothing_is_trimmed_early() {
    let Some(db) = postgres_db("skewed_clock").await else {
        return;
    };
    a_skewed_host_stays_live_and_nothing_is_trimmed_early(db, AN_HOUR).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_host_whose_clock_is_an_hour_off_keeps_its_row_and_nothing_is_trimmed_early() {
    let dir = tempfile::tempdir().unwrap();
    a_skewed_host_stays_live_and_nothing_is_trimmed_early(sqlite_db(&dir).await, AN_HOUR).await;
}

/// Polls `value` until it reads `target`, for at most `within`; answers the last reading
/// (the caller asserts on it, so that a failure shows the value).
async fn settles<T: PartialEq>(within: Duration, target: T, mut value: impl FnMut() -> T) -> T {
    let deadline = std::time::Instant::now() + within;
    loop {
        let now = value();
        if now == target || std::time::Instant::now() >= deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A row in the hosts table of a host that is alive for the next hour (by the database's
/// clock) and never acknowledges anything.
async fn ghost(db: &Database) {
    db.postgres_pool()
        .unwrap()
        .get()
        .await
        .unwrap()
        .execute(
            "INSERT INTO coherent_hosts (host, horizon, seen_at) VALUES ('ghost', 0, \
             (extract(epoch FROM clock_timestamp()) * 1000000)::bigint + 3600000000)",
            &[],
        )
        .await
        .unwrap();
}

/// Hole 5 (a): a caller that dropped `Host::run`'s future once its command was in the
/// pipeline left its wait for acknowledgements in the host's map: with a peer that never
/// acknowledges, for good, one entry per such command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_callers_that_go_away_leave_no_acknowledgement_wait_behind() {
    let Some(db) = postgres_db("dropped_waits").await else {
        return;
    };
    ghost(&db).await;
    let (a, _) = host(&db, |b| {
        b.acknowledgements(Some(PATIENT))
            .command::<Mark>(Marks::default())
    })
    .await;
    wait_until(|| a.notifier_connected()).await;
    assert_eq!(a.stats().peers, 1, "the ghost is waited for");
    const RUNS: u64 = 200;
    for _ in 0..RUNS {
        // Polled once (the command is handed to the pipeline), then dropped: the command
        // commits all the same, and nobody waits for its acknowledgements. (A timeout of
        // zero polls it again until the timer fires, ~1 ms: some would reach their wait.)
        assert!(a.run(Mark::default()).now_or_never().is_none());
    }
    wait_until(|| a.stats().commands + a.stats().command_errors >= RUNS).await;
    let waiting = settles(Duration::from_secs(5), 0, || a.stats().acks_waiting).await;
    assert_eq!(
        (a.stats().commands, waiting),
        (RUNS, 0),
        "(commands committed, acknowledgement waits left in the map)"
    );
    a.stop().await;
}

/// Hole 5 (b): notices (and acknowledgements) go to PostgreSQL several to a payload, which
/// must stay under its 8,000 bytes. The packing left room for the notices alone: with a
/// long host id, a payload whose first notice was long passed the limit, and PostgreSQL
/// refused the whole `NOTIFY` (every notice and acknowledgement in it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_notices_and_acknowledgements_of_a_host_with_a_long_id_all_go_out() {
    let Some(db) = postgres_db("long_id").await else {
        return;
    };
    // Ids of 19 digits: notices and acknowledgements as long as they get.
    db.postgres_pool()
        .unwrap()
        .get()
        .await
        .unwrap()
        .batch_execute("ALTER SEQUENCE coherent_operations_id_seq RESTART WITH 9000000000000000000")
        .await
        .unwrap();
    // A waits for B's acknowledgements, long enough that only a lost one runs out.
    let (a, _) = host(&db, |b| {
        b.id("a".repeat(200))
            .acknowledgements(Some(Duration::from_secs(5)))
            .command::<Mark>(Marks::default())
    })
    .await;
    // B applies what notices carry, and reads its log only when a notice says to (one
    // too long to carry its operation); it acknowledges several operations at a time.
    let (b, _) = host(&db, |b| {
        b.id("b".repeat(200))
            .poll_interval(Duration::from_secs(3600))
            .notify_interval(Duration::from_millis(20))
            .command::<Mark>(Marks::default())
    })
    .await;
    wait_until(|| a.stats().peers == 1 && a.notifier_connected() && b.notifier_connected()).await;
    // Notices of 7,560 to 7,860 bytes, each alone in its payload (A notifies every 1 ms):
    // with A's id around them, some no longer fit (and, short of PostgreSQL's limit for
    // one notice, they carried their operation).
    let mut n = 0;
    for pad in (7_200..7_500).step_by(2) {
        a.run(Mark {
            pad: "x".repeat(pad),
        })
        .await
        .unwrap();
        n += 1;
    }
    // And many short ones together: B acknowledges many in one payload.
    let runs: Vec<_> = (0..300)
        .map(|_| {
            let a = a.clone();
            tokio::spawn(async move { a.run(Mark::default()).await })
        })
        .collect();
    for run in runs {
        run.await.unwrap().unwrap();
    }
    n += 300;
    let applied = || {
        let s = b.stats();
        s.applied_notified + s.applied_from_log
    };
    let applied = settles(Duration::from_secs(20), n, applied).await;
    assert_eq!(
        (applied, a.stats().ack_timeouts, a.stats().commands),
        (n, 0, n),
        "(A's operations B applied, A's commands whose acknowledgement did not come, A's commands)"
    );
    a.stop().await;
    b.stop().await;
}

/// Hole 5 (c): the queue of a host's notifying task (PostgreSQL) had no bound: while its
/// `NOTIFY`s did not go out, every notice and acknowledgement it made waited in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_the_notifying_queue_stays_bounded_while_nothing_goes_out() {
    let Some(db) = postgres_db("outbox").await else {
        return;
    };
    const BOUND: u64 = 16;
    const RUNS: u64 = 400;
    // B's notifying task sends one `NOTIFY`, then none for an hour: a stand-in for a
    // database its notifications do not reach. B applies A's operations from A's notices
    // (it reads its log only when told to: every operation is applied, and acknowledged,
    // once).
    let (b, _) = host(&db, |b| {
        b.notify_interval(Duration::from_secs(3600))
            .notify_queue(BOUND as usize)
            .poll_interval(Duration::from_secs(3600))
            .acknowledgements(None)
            .command::<Mark>(Marks::default())
    })
    .await;
    let (a, _) = host(&db, |b| {
        b.acknowledgements(None).command::<Mark>(Marks::default())
    })
    .await;
    wait_until(|| a.notifier_connected() && b.notifier_connected()).await;
    // B's notices: the first goes out; the notifying task holds at most one batch (256)
    // while it waits; the queue holds BOUND.
    for _ in 0..RUNS {
        b.run(Mark::default()).await.unwrap();
    }
    // B's acknowledgements of A's operations.
    for _ in 0..RUNS {
        a.run(Mark::default()).await.unwrap();
    }
    wait_until(|| {
        let s = b.stats();
        s.applied_notified + s.applied_from_log == RUNS
    })
    .await;
    let acks_dropped = settles(Duration::from_secs(5), RUNS, || b.stats().acks_dropped).await;
    let s = b.stats();
    assert_eq!(
        (
            s.notify_queued,
            acks_dropped,
            s.notices_dropped >= RUNS - 1 - 256 - BOUND
        ),
        (BOUND, RUNS, true),
        "(B's queue, acknowledgements B dropped, whether B dropped the notices that did \
         not fit: {} of {RUNS})",
        s.notices_dropped
    );
    a.stop().await;
    b.stop().await;
}

/// `Host::stats` took the host's locks all at once (the temporaries of one expression),
/// the publisher's among them once it reported the notifying queue, while a command's
/// finish takes the publisher, then the peers: each could wait for the other for good
/// (seen once in four runs of the test above, which polls the stats while commands
/// finish). The runtime runs on a thread of its own, watched from this one: deadlocked
/// workers drive no timer, and a runtime with a blocked worker cannot be dropped.
#[test]
fn postgres_stats_read_while_commands_finish_never_block_them() {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let Some(db) = postgres_db("stats_locks").await else {
                return;
            };
            let (a, _) = host(&db, |b| b.command::<Mark>(Marks::default())).await;
            wait_until(|| a.notifier_connected()).await;
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            // On a thread of its own, as a metrics exporter would.
            let reader = {
                let (a, stop) = (a.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::black_box(a.stats());
                    }
                })
            };
            let runs: Vec<_> = (0..2_000)
                .map(|_| {
                    let a = a.clone();
                    tokio::spawn(async move { a.run(Mark::default()).await })
                })
                .collect();
            for run in futures::future::join_all(runs).await {
                run.unwrap().unwrap();
            }
            stop.store(true, Ordering::Relaxed);
            reader.join().unwrap();
            a.stop().await;
        });
        let _ = done.send(());
    });
    match finished.recv_timeout(Duration::from_secs(120)) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("2,000 commands did not finish in 2 minutes while another thread read the stats")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            panic!("the test's thread panicked")
        }
    }
}
