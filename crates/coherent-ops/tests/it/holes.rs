//! The holes of issue 30, each as the interleaving that opened it: an operation whose
//! transaction was in flight across a full read of the log, an operation a host cannot
//! replay (another release's command, one that does not decode), and a replay that panics.
//! Each must leave no stale entry behind and the host still applying what follows.

use std::time::Duration;

use coherent::prelude::*;
use coherent_ops::{CommandError, Database, Handler, Host, Notifier, Tx};

use crate::inproc::{postgres_db, sqlite_db, wait_until};
use crate::support::{host, open_sqlite, Items, Reader, SetValue};

/// A guard for waits that must end (never a measurement).
const GUARD: Duration = Duration::from_secs(60);

pub(crate) async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(GUARD, f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not end within {GUARD:?}"))
}

/// A plain connection to the database of `db` (PostgreSQL), in its schema: what a
/// `psql` session or another service would hold.
pub(crate) async fn sql(db: &Database) -> tokio_postgres::Client {
    let pool = db.postgres_pool().unwrap();
    let schema: String = pool
        .get()
        .await
        .unwrap()
        .query_one("SELECT current_schema()", &[])
        .await
        .unwrap()
        .get(0);
    let url = std::env::var("DATABASE_URL").unwrap();
    crate::support::connect_in_schema(&url, &schema).await
}

/// Logs `n` operations of another host on item 2, each in a transaction of its own
/// (autocommit statements, pipelined on one connection).
async fn log_many(c: &tokio_postgres::Client, n: i64) {
    let insert = c
        .prepare(
            "INSERT INTO coherent_operations (host, logged_at, kind, command, output) \
             VALUES ('burst', 0, 'test.set_value', $1, '0')",
        )
        .await
        .unwrap();
    let runs = (0..n).map(|i| {
        let command = format!(r#"{{"id":2,"value":{i}}}"#);
        let insert = &insert;
        async move { c.execute(insert, &[&command]).await.unwrap() }
    });
    futures::future::join_all(runs).await;
}

/// Hole 1: a command whose transaction took its id before a read of the log that came
/// back full (more than 1,000 operations since the host's last read: a burst, a stalled
/// reader, a long transaction pinning the snapshot's xmin) and committed after it. The
/// read moved the horizon to the last row's position, past the transaction in flight:
/// later reads started after it, and the host served the entry from before its write
/// for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_in_flight_across_a_full_read_is_applied() {
    let Some(db) = postgres_db("in_flight_full_read").await else {
        return;
    };
    let (b, items_b) = host(&db, |b| b.poll_interval(Duration::from_secs(3600))).await;
    assert_eq!(items_b.value(1).await, Ok(0));

    // A transaction takes its id now, and commits after the burst.
    let long = sql(&db).await;
    long.batch_execute("BEGIN").await.unwrap();
    long.query_one("SELECT pg_current_xact_id()::text", &[])
        .await
        .unwrap();
    let burst = sql(&db).await;
    log_many(&burst, 2_500).await;
    within("B's read of the burst", b.catch_up()).await.unwrap();

    long.batch_execute(
        "UPDATE items SET value = 42 WHERE id = 1; \
         INSERT INTO coherent_operations (host, logged_at, kind, command, output) \
         VALUES ('late', 0, 'test.set_value', '{\"id\":1,\"value\":42}', '0'); \
         COMMIT",
    )
    .await
    .unwrap();
    within("B's read after the commit", b.catch_up())
        .await
        .unwrap();
    assert_eq!(
        items_b.value(1).await,
        Ok(42),
        "B applied the operation that committed after its full reads"
    );
    // And later reads do not read the whole burst again and again.
    let horizon = b.stats().horizon;
    within("B's next read", b.catch_up()).await.unwrap();
    assert!(b.stats().horizon >= horizon);
}

/// Hole 1, the other face: more than a read's worth of operations in one transaction (a
/// batch of `max_batch` ≥ 1,000 commands) all have one position; a read that came back
/// full started again at that position and read the same rows for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_transaction_of_more_operations_than_a_read_is_read_through() {
    let Some(db) = postgres_db("one_big_transaction").await else {
        return;
    };
    let (b, items_b) = host(&db, |b| b.poll_interval(Duration::from_secs(3600))).await;
    assert_eq!(items_b.value(1).await, Ok(0));
    let c = sql(&db).await;
    c.batch_execute(
        "BEGIN; \
         INSERT INTO coherent_operations (host, logged_at, kind, command, output) \
         SELECT 'big', 0, 'test.set_value', '{\"id\":2,\"value\":' || i || '}', '0' \
         FROM generate_series(1, 2500) AS i; \
         UPDATE items SET value = 7 WHERE id = 1; \
         INSERT INTO coherent_operations (host, logged_at, kind, command, output) \
         VALUES ('big', 0, 'test.set_value', '{\"id\":1,\"value\":7}', '0'); \
         COMMIT",
    )
    .await
    .unwrap();
    within(
        "B's read of one transaction of 2,501 operations",
        b.catch_up(),
    )
    .await
    .unwrap();
    assert_eq!(items_b.value(1).await, Ok(7));
}

/// A command of "the next release": no handler here knows its kind. Writes the row and
/// the item in one transaction, as its host would.
fn log_foreign_sqlite(db: &Database, kind: &str, command: &str, id: i64, value: i64) {
    let c = open_sqlite(db.sqlite_path().unwrap());
    c.execute_batch("BEGIN IMMEDIATE").unwrap();
    c.execute(
        "UPDATE items SET value = ?2 WHERE id = ?1",
        rusqlite::params![id, value],
    )
    .unwrap();
    c.execute(
        "INSERT INTO coherent_operations (host, logged_at, kind, command, output) \
         VALUES ('next-release', 0, ?1, ?2, 'null')",
        rusqlite::params![kind, command],
    )
    .unwrap();
    c.execute_batch("COMMIT").unwrap();
}

/// Hole 2: an operation a host cannot replay (an unknown kind, a command that does not
/// decode) invalidated nothing and was acknowledged as applied. The host must treat its
/// cache as unknown: flush it before it acknowledges, and count it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_that_cannot_be_replayed_flushes_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let db = sqlite_db(&dir).await;
    let (b, items_b) = host(&db, |b| b.poll_interval(Duration::from_secs(3600))).await;
    assert_eq!(items_b.value(1).await, Ok(0));
    assert_eq!(items_b.value(3).await, Ok(0));

    log_foreign_sqlite(&db, "test.next_release", r#"{"anything":1}"#, 1, 5);
    within("B's read", b.catch_up()).await.unwrap();
    assert_eq!(items_b.value(1).await, Ok(5), "an unknown kind");
    let stats = b.stats();
    assert_eq!(stats.unknown, 1);
    assert_eq!(stats.flushes, 1);

    // A known kind whose command has a field this release does not read is replayed; one
    // whose fields do not decode here flushes.
    log_foreign_sqlite(&db, "test.set_value", r#"{"id":"three","value":6}"#, 3, 6);
    within("B's read", b.catch_up()).await.unwrap();
    assert_eq!(
        items_b.value(3).await,
        Ok(6),
        "a command that does not decode"
    );
    let stats = b.stats();
    assert_eq!(stats.undecodable, 1);
    assert_eq!(stats.flushes, 2);
}

/// The same over PostgreSQL with its notifier, where the operation may arrive by a
/// notice (here the log's row arrives through a read: nobody sent a notice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_operation_flushes_the_cache_on_postgres() {
    let Some(db) = postgres_db("unknown_kind").await else {
        return;
    };
    let (b, items_b) = host(&db, |b| b.poll_interval(Duration::from_secs(3600))).await;
    assert_eq!(items_b.value(4).await, Ok(0));
    sql(&db)
        .await
        .batch_execute(
            "BEGIN; UPDATE items SET value = 8 WHERE id = 4; \
             INSERT INTO coherent_operations (host, logged_at, kind, command, output) \
             VALUES ('next-release', 0, 'test.next_release', '{}', 'null'); COMMIT",
        )
        .await
        .unwrap();
    within("B's read", b.catch_up()).await.unwrap();
    assert_eq!(items_b.value(4).await, Ok(8));
    assert_eq!(b.stats().unknown, 1);
    assert!(b.stats().flushes >= 1);
}

/// The `SetValue` handler of a host whose invalidation panics for one value.
#[derive(Clone)]
struct Touchy(Items);

const PANICS: i64 = 666;

impl Handler<SetValue> for Touchy {
    async fn execute(&self, c: &SetValue, tx: &mut Tx<'_>) -> Result<i64, CommandError> {
        Handler::<SetValue>::execute(&self.0, c, tx).await
    }

    fn invalidate(&self, c: &SetValue, old: &i64) {
        assert_ne!(c.value, PANICS, "a replay that panics (on purpose)");
        Handler::<SetValue>::invalidate(&self.0, c, old);
    }
}

async fn touchy_host(db: &Database, notifier: Option<Notifier>) -> (Host, Items) {
    let registry = Registry::new();
    let items = Items {
        handle: ServiceHandle::with_registry(&registry),
        reader: Reader::for_db(db),
    };
    let mut builder = Host::builder(db.clone())
        .registry(&registry)
        .command::<SetValue>(Touchy(items.clone()));
    if let Some(n) = notifier {
        builder = builder.notifier(n);
    }
    (builder.start().await.unwrap(), items)
}

/// Hole 4: a replay that panicked ended the task that ran it (the log reader, or the
/// notifier's listener) without a word: the host applied nothing more, and its
/// `notifier_connected` still said true. It must be caught, counted, and fail safe.
async fn a_replay_that_panics_fails_safe(db: Database, notifier: Option<Notifier>) {
    let (a, _items_a) = host(&db, |b| b).await;
    let (b, items_b) = touchy_host(&db, notifier).await;
    wait_until(|| b.notifier_connected()).await;
    assert_eq!(items_b.value(1).await, Ok(0));
    assert_eq!(items_b.value(2).await, Ok(0));

    a.run(SetValue {
        id: 1,
        value: PANICS,
    })
    .await
    .unwrap();
    within("B's replay of the panicking operation", async {
        while b.stats().replay_panics == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // Its invalidation did not run, but B flushed: no stale entry is served.
    assert_eq!(items_b.value(1).await, Ok(PANICS));
    assert!(b.stats().flushes >= 1);

    // And B goes on applying what follows.
    let value_2 = items_b.value_computed(2).await;
    a.run(SetValue { id: 2, value: 9 }).await.unwrap();
    within("B's invalidation of item 2", value_2.when_invalidated()).await;
    assert_eq!(items_b.value(2).await, Ok(9));
    assert!(b.notifier_connected());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_that_panics_fails_safe_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let db = sqlite_db(&dir).await;
    a_replay_that_panics_fails_safe(db, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_that_panics_fails_safe_postgres() {
    let Some(db) = postgres_db("replay_panics").await else {
        return;
    };
    a_replay_that_panics_fails_safe(db, Some(Notifier::Postgres)).await;
}

/// The `SetValue` handler of a host whose replay takes a millisecond.
#[derive(Clone)]
struct Slow(Items);

impl Handler<SetValue> for Slow {
    async fn execute(&self, c: &SetValue, tx: &mut Tx<'_>) -> Result<i64, CommandError> {
        Handler::<SetValue>::execute(&self.0, c, tx).await
    }

    fn invalidate(&self, c: &SetValue, old: &i64) {
        std::thread::sleep(Duration::from_millis(1));
        Handler::<SetValue>::invalidate(&self.0, c, old);
    }
}

/// A read of the log that chased the writers: later pages read what committed after the
/// read began, so while the log grew faster than the host applied it, the read (and
/// `catch_up`, the heartbeat, the prune of what the host remembers) never ended. Found by
/// review; it failed before the read was bounded by its first page.
async fn a_read_ends_while_the_log_grows_faster_than_it_is_applied(db: Database) {
    let registry = Registry::new();
    let items = Items {
        handle: ServiceHandle::with_registry(&registry),
        reader: Reader::for_db(&db),
    };
    let b = Host::builder(db.clone())
        .registry(&registry)
        .poll_interval(Duration::from_secs(3600))
        .command::<SetValue>(Slow(items.clone()))
        .start()
        .await
        .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (stop, db) = (stop.clone(), db.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                log_twenty(&db).await;
                n += 20;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            n
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let caught = tokio::time::timeout(Duration::from_secs(15), b.catch_up()).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let written = writer.await.unwrap();
    assert!(
        caught.is_ok(),
        "catch_up did not end in 15 s while {written} operations were logged"
    );
}

/// Twenty operations of another host on item 2, in one transaction.
async fn log_twenty(db: &Database) {
    match db.postgres_pool() {
        Some(pool) => {
            pool.get()
                .await
                .unwrap()
                .batch_execute(
                    "INSERT INTO coherent_operations (host, logged_at, kind, command, output) \
                     SELECT 'w', 0, 'test.set_value', '{\"id\":2,\"value\":1}', '0' \
                     FROM generate_series(1, 20)",
                )
                .await
                .unwrap();
        }
        None => {
            let path = db.sqlite_path().unwrap().to_owned();
            tokio::task::spawn_blocking(move || {
                let c = open_sqlite(&path);
                c.execute_batch(
                    "BEGIN IMMEDIATE; \
                     WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20) \
                     INSERT INTO coherent_operations (host, logged_at, kind, command, output) \
                     SELECT 'w', 0, 'test.set_value', '{\"id\":2,\"value\":1}', '0' FROM n; \
                     COMMIT",
                )
                .unwrap();
            })
            .await
            .unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_ends_while_the_log_grows_postgres() {
    let Some(db) = postgres_db("read_chases").await else {
        return;
    };
    a_read_ends_while_the_log_grows_faster_than_it_is_applied(db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_ends_while_the_log_grows_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let db = sqlite_db(&dir).await;
    a_read_ends_while_the_log_grows_faster_than_it_is_applied(db).await;
}

/// The writer's own invalidation panicked: the command's caller hears that its outcome is
/// unknown, but the write committed, and the log reader skips the host's own operations:
/// the host served the entry from before its write for good. Found by review; it failed
/// before the host flushed on such a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_invalidation_that_panics_leaves_no_stale_entry() {
    let dir = tempfile::tempdir().unwrap();
    let db = sqlite_db(&dir).await;
    let (a, items) = touchy_host(&db, None).await;
    assert_eq!(items.value(1).await, Ok(0));
    let answered = a
        .run(SetValue {
            id: 1,
            value: PANICS,
        })
        .await;
    assert!(answered.is_err(), "{answered:?}");
    assert!(db.is_logged(1).await.unwrap());
    assert_eq!(items.value(1).await, Ok(PANICS));
    assert!(a.stats().flushes >= 1, "{:?}", a.stats());
    // Its log reader, which applies the host's own operations it did not see finished,
    // replays it once it reads it (the invalidation panics again: a second flush).
    a.catch_up().await.unwrap();
    let stats = a.stats();
    assert_eq!((stats.flushes, stats.own_applied), (2, 1), "{stats:?}");
}

/// A host started over a registry that holds entries (warmed first, or left by a host
/// stopped before it): what committed in between is before the new host's cursor, so it
/// is never applied. Found by review; it failed before `start` flushed the registry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_started_over_a_warm_registry_serves_nothing_stale() {
    let dir = tempfile::tempdir().unwrap();
    let db = sqlite_db(&dir).await;
    let registry = Registry::new();
    let items = Items {
        handle: ServiceHandle::with_registry(&registry),
        reader: Reader::for_db(&db),
    };
    let start = || {
        Host::builder(db.clone())
            .registry(&registry)
            .command::<SetValue>(items.clone())
            .start()
    };
    let first = start().await.unwrap();
    assert_eq!(items.value(1).await, Ok(0));
    first.stop().await;
    drop(first);
    let (writer, _) = host(&db, |b| b).await;
    writer.run(SetValue { id: 1, value: 5 }).await.unwrap();
    let second = start().await.unwrap();
    within("the second host's read", second.catch_up())
        .await
        .unwrap();
    assert_eq!(items.value(1).await, Ok(5));
}

/// A fenced registry answers nothing from its cache: every call recomputes (here, reads
/// the database, where a write made behind the cache's back shows at once); lifted, the
/// cache answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_registry_answers_from_the_database() {
    let dir = tempfile::tempdir().unwrap();
    let db = sqlite_db(&dir).await;
    let registry = Registry::new();
    let items = Items {
        handle: ServiceHandle::with_registry(&registry),
        reader: Reader::for_db(&db),
    };
    let behind = |value: i64| {
        open_sqlite(db.sqlite_path().unwrap())
            .execute(
                "UPDATE items SET value = ?1 WHERE id = 1",
                rusqlite::params![value],
            )
            .unwrap();
    };
    assert_eq!(items.value(1).await, Ok(0));
    let pair = items.pair(1, 1).await;
    assert_eq!(pair, Ok(0));
    behind(77);
    assert_eq!(items.value(1).await, Ok(0), "cached");
    registry.fence();
    assert!(registry.is_fenced());
    assert_eq!(items.value(1).await, Ok(77), "fenced: from the database");
    assert_eq!(items.pair(1, 1).await, Ok(77_077), "and what depends on it");
    behind(78);
    assert_eq!(items.value(1).await, Ok(78));
    registry.unfence();
    assert_eq!(items.value(1).await, Ok(78));
    behind(79);
    assert_eq!(items.value(1).await, Ok(78), "cached again");
}

/// A host starts fenced and rejoins (its peers welcome it); when its listener's connection
/// is terminated, it fences again, and rejoins once the listener is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_fences_while_its_notifier_is_down_and_rejoins() {
    let Some(db) = postgres_db("fence_rejoin").await else {
        return;
    };
    let (a, _) = host(&db, |b| b).await;
    let (b, items_b) = host(&db, |b| b).await;
    within("B's rejoin", async {
        while b.is_fenced() || a.is_fenced() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert_eq!(b.stats().fences, 1, "fenced from its start");
    assert_eq!(b.stats().rejoins_incomplete, 0, "A welcomed it");
    assert_eq!(items_b.value(1).await, Ok(0));

    sql(&db)
        .await
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            &[&format!("coherent-listener:{}", b.id())],
        )
        .await
        .unwrap();
    within("B's fence", async {
        while b.stats().fences < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    within("B's second rejoin", async {
        while b.is_fenced() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    // And the cluster works as before: A's write reaches B before it returns.
    let value_b = items_b.value_computed(1).await;
    a.run(SetValue { id: 1, value: 3 }).await.unwrap();
    assert_eq!(value_b.state(), coherent::ConsistencyState::Invalidated);
    assert_eq!(items_b.value(1).await, Ok(3));
}

/// Hole 6: a database blip. Every connection of the host's pool is terminated (what a
/// failover or a restarted pooler does), again and again, between commands: a command that
/// draws a connection whose backend is gone runs again on another, and its caller hears
/// nothing of it. (Whether a given round meets a dead connection depends on when the
/// client reads the server's goodbye; across 30 rounds some do, and `commits_retried`
/// counts them. Each command must succeed and its write be there.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_commands_survive_terminated_pool_connections() {
    let Some(url) = crate::support::database_url() else {
        return;
    };
    let name = format!("blip_{}", std::process::id());
    let sep = if url.contains('?') { '&' } else { '?' };
    let db = Database::postgres_in_schema(
        &format!("{url}{sep}application_name={name}"),
        &crate::support::fresh_schema("blip"),
    )
    .await
    .unwrap();
    crate::support::create_items(&db, 10).await;
    let (a, _) = host(&db, |b| b).await;
    let check = sql(&db).await;
    for round in 1..=30i64 {
        // Several connections in the pool, idle.
        let runs: Vec<_> = (1..=4)
            .map(|id| {
                let a = a.clone();
                tokio::spawn(async move { a.run(SetValue { id, value: -round }).await })
            })
            .collect();
        for run in runs {
            run.await.unwrap().unwrap();
        }
        check
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name = $1",
                &[&name],
            )
            .await
            .unwrap();
        a.run(SetValue {
            id: 1,
            value: round,
        })
        .await
        .unwrap_or_else(|e| panic!("round {round}: {e}"));
        let value: i64 = check
            .query_one("SELECT value FROM items WHERE id = 1", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(value, round);
    }
    eprintln!("commits retried: {}", a.stats().commits_retried);
    a.stop().await;
}
