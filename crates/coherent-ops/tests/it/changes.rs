//! Issue 34: changes made outside the application (a `psql`-style connection of its own,
//! or a SQLite connection of the process) invalidate exactly the computeds that read the
//! changed rows, on every host; a command's own writes are not invalidated twice; the
//! feed's connection dropped, the slot lost, the leading host stopped: no change is lost.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use coherent::prelude::*;
use coherent_ops::{watch_table, ChangeFeed, Database, Host, HostBuilder};
use parking_lot::Mutex;

use crate::holes::{sql, within};
use crate::inproc::{postgres_db, sqlite_db};
use crate::support::{drop_slot_when_free, host, open_sqlite, Items, SetValue};

/// How often each host's watch saw each id, and how often the table-wide hooks ran.
#[derive(Default)]
struct Seen {
    rows: Mutex<HashMap<i64, usize>>,
    every_row: AtomicUsize,
}

impl Seen {
    fn of(&self, id: i64) -> usize {
        self.rows.lock().get(&id).copied().unwrap_or(0)
    }
}

/// A slot and publication name that no other test (of this run or an earlier one) uses;
/// slots that earlier runs of this binary left behind are dropped (a slot holds the log
/// back for ever).
/// The slot and publication name of `test` in this run: the process id and a number of
/// the run (process ids come back; a name of an earlier run must not be this one's).
fn feed_name(test: &str) -> String {
    static RUN: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let run = RUN.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
            % 1_000_000
    });
    format!("t_feed_{}_{run}_{test}", std::process::id())
}

/// How a test's feed reads PostgreSQL.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// Logical decoding, streamed over a replication connection (the default).
    Stream,
    /// Logical decoding, read with SQL (`ChangeFeed::streaming(false)`).
    Sql,
    /// Triggers and a change table.
    Triggers,
}

async fn feed_for(db: &Database, test: &str, mode: Mode) -> ChangeFeed {
    let c = sql(db).await;
    let level: String = c.query_one("SHOW wal_level", &[]).await.unwrap().get(0);
    assert_eq!(
        level, "logical",
        "the change feed's tests need wal_level = logical (.ci/run sets it: \
         ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL)"
    );
    let ours = feed_name("").replace('_', "\\_") + "%";
    c.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
         WHERE slot_name LIKE 't\\_feed\\_%' AND slot_name NOT LIKE $1 AND NOT active",
        &[&ours],
    )
    .await
    .unwrap();
    let old: Vec<String> = c
        .query(
            "SELECT pubname::text FROM pg_publication \
             WHERE pubname LIKE 't\\_feed\\_%' AND pubname NOT LIKE $1",
            &[&ours],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    for publication in old {
        let _ = c
            .batch_execute(&format!("DROP PUBLICATION IF EXISTS {publication}"))
            .await;
    }
    let name = feed_name(test);
    let feed = match mode {
        Mode::Triggers => ChangeFeed::postgres_triggers(),
        Mode::Stream => ChangeFeed::postgres(),
        Mode::Sql => ChangeFeed::postgres().streaming(false),
    };
    feed.slot(&name)
        .publication(&name)
        .poll_interval(Duration::from_millis(20))
        .standby_interval(Duration::from_millis(100))
}

async fn drop_slot(db: &Database, feed_name: &str) {
    let c = sql(db).await;
    let _ = c
        .batch_execute(&format!("DROP PUBLICATION IF EXISTS {feed_name}"))
        .await;
    drop_slot_when_free(&c, feed_name).await;
}

/// A host with its own cache, running the feed.
async fn feed_host(db: &Database, feed: &ChangeFeed) -> (Host, Items, Arc<Seen>) {
    watching_host(db, Some(feed)).await
}

/// A host with its own cache and the watches, running `feed` if one is given (without
/// one, the changes reach it only as operations of the log, which other hosts' feeds
/// write).
async fn watching_host(db: &Database, feed: Option<&ChangeFeed>) -> (Host, Items, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let feed = feed.cloned();
    let (host, items) = {
        let seen = seen.clone();
        let slot = Arc::new(Mutex::new(None::<Items>));
        let slot2 = slot.clone();
        let (host, items) = host(db, move |b| {
            // The watch needs the service the host builds: built with a stand-in
            // that forwards to it.
            let b = Forward(slot2).install(b, &seen);
            match feed {
                Some(feed) => b.change_feed(feed),
                None => b,
            }
        })
        .await;
        *slot.lock() = Some(items.clone());
        (host, items)
    };
    (host, items, seen)
}

/// Two hosts, each with its own cache, both running the feed (one reads it).
async fn pair(db: &Database, feed: &ChangeFeed) -> [(Host, Items, Arc<Seen>); 2] {
    let mut hosts = Vec::new();
    for _ in 0..2 {
        hosts.push(feed_host(db, feed).await);
    }
    let [a, b] = <[_; 2]>::try_from(hosts).ok().unwrap();
    // The feed is read once one of them leads and the slot exists.
    within("a host leads the feed", async {
        while !(a.0.feed_stats().unwrap().leading || b.0.feed_stats().unwrap().leading)
            || a.0.feed_stats().unwrap().reads + b.0.feed_stats().unwrap().reads == 0
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    // The flush the new slot owed is logged before its row goes (by the host that made
    // the slot, under the feed's lock): once the row is gone, a read of the log applies it
    // on each host, so that it does not land in the middle of a test.
    let psql = sql(db).await;
    within("the slot's flush paid", async {
        loop {
            let owed: i64 = psql
                .query_one("SELECT count(*) FROM coherent_feed_flushes", &[])
                .await
                .map_or(1, |r| r.get(0));
            if owed == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    for (host, _, _) in [&a, &b] {
        host.catch_up().await.unwrap();
    }
    [a, b]
}

/// The watches are declared before the host and its service exist: they reach the
/// service through this.
#[derive(Clone)]
struct Forward(Arc<Mutex<Option<Items>>>);

impl Forward {
    fn install(self, builder: HostBuilder, seen: &Arc<Seen>) -> HostBuilder {
        let (row, all) = (self.clone(), self);
        let (seen_row, seen_all) = (seen.clone(), seen.clone());
        builder.watch(
            watch_table("items")
                .on_change(move |change| {
                    for id in [change.key::<i64>("id"), change.old_key::<i64>("id")]
                        .into_iter()
                        .flatten()
                    {
                        *seen_row.rows.lock().entry(id).or_default() += 1;
                        if let Some(items) = &*row.0.lock() {
                            items.invalidate_value(id);
                        }
                    }
                })
                .on_every_row(move || {
                    seen_all.every_row.fetch_add(1, Ordering::Relaxed);
                    if let Some(items) = &*all.0.lock() {
                        for id in 1..=20 {
                            items.invalidate_value(id);
                        }
                    }
                }),
        )
    }
}

/// Waits until each of `computeds` is invalidated.
async fn invalidated(computeds: &[Computed<Result<i64, String>>], what: &str) {
    within(what, async {
        for c in computeds {
            c.when_invalidated().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_writes_from_outside_invalidate_exactly_the_rows_they_change() {
    writes_from_outside_invalidate_exactly_the_rows_they_change(Mode::Stream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sql_writes_from_outside_invalidate_exactly_the_rows_they_change() {
    writes_from_outside_invalidate_exactly_the_rows_they_change(Mode::Sql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_triggers_writes_from_outside_invalidate_exactly_the_rows_they_change() {
    writes_from_outside_invalidate_exactly_the_rows_they_change(Mode::Triggers).await;
}

async fn writes_from_outside_invalidate_exactly_the_rows_they_change(mode: Mode) {
    let Some(db) = postgres_db("feed_exact").await else {
        return;
    };
    let test = match mode {
        Mode::Stream => "exact",
        Mode::Sql => "exact_s",
        Mode::Triggers => "exact_t",
    };
    let feed = feed_for(&db, test, mode).await;
    let hosts = pair(&db, &feed).await;
    let psql = sql(&db).await;
    let computed = |id: i64| {
        let hosts = &hosts;
        async move {
            let mut v = Vec::new();
            for (_, items, _) in hosts {
                v.push(items.value_computed(id).await);
            }
            v
        }
    };

    // UPDATE of one row: that row, on both hosts, and nothing else.
    let (two, three) = (computed(2).await, computed(3).await);
    psql.execute("UPDATE items SET value = 7 WHERE id = 2", &[])
        .await
        .unwrap();
    invalidated(&two, "the UPDATE of item 2").await;
    for (c, (_, items, _)) in three.iter().zip(&hosts) {
        assert!(c.is_consistent(), "item 3 was not changed");
        assert_eq!(items.value(2).await, Ok(7));
    }
    if mode != Mode::Triggers {
        let leader = hosts
            .iter()
            .map(|h| h.0.feed_stats().unwrap())
            .find(|s| s.leading)
            .expect("a host leads the feed");
        assert_eq!(
            leader.streaming,
            mode == Mode::Stream,
            "the feed reads as asked: {leader:?}"
        );
    }

    // INSERT: a key read before it existed.
    let eleven = computed(11).await;
    assert!(hosts[0].1.value(11).await.is_err());
    psql.execute("INSERT INTO items VALUES (11, 5)", &[])
        .await
        .unwrap();
    invalidated(&eleven, "the INSERT of item 11").await;
    assert_eq!(hosts[1].1.value(11).await, Ok(5));

    // DELETE.
    let four = computed(4).await;
    psql.execute("DELETE FROM items WHERE id = 4", &[])
        .await
        .unwrap();
    invalidated(&four, "the DELETE of item 4").await;
    assert!(hosts[0].1.value(4).await.is_err());

    // One UPDATE of several rows.
    let (five, six, seven) = (computed(5).await, computed(6).await, computed(7).await);
    psql.execute("UPDATE items SET value = value + 1 WHERE id IN (5, 6)", &[])
        .await
        .unwrap();
    invalidated(&[five, six].concat(), "the UPDATE of items 5 and 6").await;
    assert!(
        seven.iter().all(|c| c.is_consistent()),
        "item 7 was not changed"
    );

    // An UPDATE that moves a key invalidates the old id and the new one.
    let (eight, twelve) = (computed(8).await, computed(12).await);
    psql.execute("UPDATE items SET id = 12 WHERE id = 8", &[])
        .await
        .unwrap();
    invalidated(&[eight, twelve].concat(), "the key moved from 8 to 12").await;

    // A transaction rolled back: no invalidation. Item 9's write after it is the
    // barrier: once it is applied, the rolled-back one would have been too.
    let (one, nine) = (computed(1).await, computed(9).await);
    psql.batch_execute("BEGIN; UPDATE items SET value = 100 WHERE id = 1; ROLLBACK;")
        .await
        .unwrap();
    psql.execute("UPDATE items SET value = 9 WHERE id = 9", &[])
        .await
        .unwrap();
    invalidated(&nine, "the UPDATE of item 9 after a rollback").await;
    assert!(
        one.iter().all(|c| c.is_consistent()),
        "a rollback invalidated item 1"
    );
    for (_, _, seen) in &hosts {
        assert_eq!(seen.of(1), 0);
        assert_eq!(seen.of(3), 0);
        assert_eq!(seen.of(2), 1, "one change, one invalidation per host");
    }

    // A command through the pipeline: its handler invalidates; the feed skips its
    // transaction (the barrier write after it shows the feed went past it).
    let ten = computed(10).await;
    let three = computed(3).await;
    hosts[0].0.run(SetValue { id: 10, value: 4 }).await.unwrap();
    invalidated(&ten, "the command on item 10").await;
    psql.execute("UPDATE items SET value = 33 WHERE id = 3", &[])
        .await
        .unwrap();
    invalidated(&three, "the UPDATE of item 3 after the command").await;
    for (_, _, seen) in &hosts {
        assert_eq!(seen.of(10), 0, "the command's write reached the watch too");
    }
    let stats = |h: &Host| h.feed_stats().unwrap();
    let skipped: u64 = hosts.iter().map(|h| stats(&h.0).skipped_commands).sum();
    assert!(skipped >= 1, "no command transaction was skipped");

    // TRUNCATE: every row.
    let one = computed(1).await;
    psql.execute("TRUNCATE items", &[]).await.unwrap();
    invalidated(&one, "the TRUNCATE").await;
    for (_, items, seen) in &hosts {
        assert_eq!(seen.every_row.load(Ordering::Relaxed), 1);
        assert!(items.value(1).await.is_err());
    }
    let feed_stats: Vec<_> = hosts.iter().map(|h| stats(&h.0)).collect();
    assert_eq!(
        feed_stats.iter().filter(|s| s.leading).count(),
        1,
        "one host reads the feed: {feed_stats:?}"
    );
    if mode != Mode::Triggers {
        // The leader sent each batch of changes to the other host ahead of its operation;
        // the other host applied whichever came first and skipped the other (item 2's
        // one invalidation per host, above, is the proof that it skipped).
        let leader = feed_stats.iter().find(|s| s.leading).unwrap();
        assert!(leader.hints >= 6, "hints sent: {leader:?}");
        let follower = &hosts.iter().find(|h| !stats(&h.0).leading).unwrap().0;
        within("the follower heard the hints and paired them", async {
            loop {
                let s = follower.stats();
                if s.change_hints >= 6 && s.change_hints_paired >= 6 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
    }
    for (host, _, _) in &hosts {
        host.stop().await;
    }
    drop_slot(&db, &feed_name(test)).await;
}

/// The feed's connection terminated (by an administrator, a failover, a restart): the
/// changes committed while it was down are read from the slot when it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_feed_that_lost_its_connection_loses_no_change() {
    a_feed_that_lost_its_connection_loses_no_change(Mode::Stream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sql_a_feed_that_lost_its_connection_loses_no_change() {
    a_feed_that_lost_its_connection_loses_no_change(Mode::Sql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_triggers_a_feed_that_lost_its_connection_loses_no_change() {
    a_feed_that_lost_its_connection_loses_no_change(Mode::Triggers).await;
}

async fn a_feed_that_lost_its_connection_loses_no_change(mode: Mode) {
    let Some(db) = postgres_db("feed_conn").await else {
        return;
    };
    let test = match mode {
        Mode::Stream => "conn",
        Mode::Sql => "conn_s",
        Mode::Triggers => "conn_t",
    };
    let feed = feed_for(&db, test, mode).await;
    let hosts = pair(&db, &feed).await;
    let psql = sql(&db).await;
    for round in 0..3i64 {
        let mut computeds = Vec::new();
        for (_, items, _) in &hosts {
            computeds.push(items.value_computed(round + 1).await);
        }
        // This cluster's feed connections are cut (only its own: other tests' feeds would
        // log a change twice, which is allowed, and which their counts would notice),
        // then the write commits while they are down.
        psql.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = left($1 || ':' || current_schema(), 63)",
            &[&coherent_ops::changes::FEED_APPLICATION],
        )
        .await
        .unwrap();
        psql.execute(
            "UPDATE items SET value = $1 WHERE id = $2",
            &[&(100 + round), &(round + 1)],
        )
        .await
        .unwrap();
        invalidated(&computeds, "a write made while the feed was cut off").await;
        for (_, items, _) in &hosts {
            assert_eq!(items.value(round + 1).await, Ok(100 + round));
        }
    }
    let errors: u64 = hosts.iter().map(|h| h.0.feed_stats().unwrap().errors).sum();
    assert!(errors >= 1, "the feed never saw its connection go");
    if mode == Mode::Triggers {
        for (host, _, _) in &hosts {
            host.stop().await;
        }
        return;
    }

    // The slot lost (dropped, as the server does past max_slot_wal_keep_size): a new one,
    // and every host flushes (what happened in between is not in it).
    let name = feed_name(test);
    let mut computeds = Vec::new();
    for (_, items, _) in &hosts {
        computeds.push(items.value_computed(7).await);
    }
    drop_slot(&db, &name).await;
    invalidated(&computeds, "the flush after the slot was lost").await;
    // The flush is owed before the new slot is made, and may be paid by the other host
    // (whose connection this test cut too) before the leader counts the slot it makes.
    let created = || -> u64 {
        hosts
            .iter()
            .map(|h| h.0.feed_stats().unwrap().slots_created)
            .sum()
    };
    until("the new slot", || created() >= 2).await;
    assert_eq!(created(), 2, "the first slot and its replacement");
    let mut computeds = Vec::new();
    for (_, items, _) in &hosts {
        computeds.push(items.value_computed(8).await);
    }
    psql.execute("UPDATE items SET value = 8 WHERE id = 8", &[])
        .await
        .unwrap();
    invalidated(&computeds, "a write after the new slot").await;
    for (host, _, _) in &hosts {
        host.stop().await;
    }
    drop_slot(&db, &name).await;
}

/// Writes to tables the feed does not watch move the slot too: a slot whose tables do not
/// change would otherwise hold the write-ahead log back for ever (and each read would decode
/// all of it again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_the_slot_moves_past_writes_to_tables_nobody_watches() {
    let Some(db) = postgres_db("feed_moves").await else {
        return;
    };
    let feed = feed_for(&db, "moves", Mode::Stream).await;
    let name = feed_name("moves");
    let hosts = pair(&db, &feed).await;
    let psql = sql(&db).await;
    psql.batch_execute("CREATE TABLE other (id BIGINT PRIMARY KEY, body TEXT)")
        .await
        .unwrap();
    psql.execute(
        "INSERT INTO other SELECT g, repeat('x', 100) FROM generate_series(1, 1000) g",
        &[],
    )
    .await
    .unwrap();
    let written: String = psql
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    within("the slot's move past the write", async {
        loop {
            let past: bool = psql
                .query_one(
                    "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots \
                     WHERE slot_name = $1",
                    &[&name, &written],
                )
                .await
                .unwrap()
                .get(0);
            if past {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let ops: u64 = hosts
        .iter()
        .map(|h| h.0.feed_stats().unwrap().operations)
        .sum();
    assert_eq!(ops, 0, "nothing watched changed");
    for (host, _, _) in &hosts {
        host.stop().await;
    }
    drop_slot(&db, &name).await;
}

/// The host reading the feed stops: another takes it over, and the changes committed in
/// between reach the hosts left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_when_the_leading_host_stops_another_reads_the_feed() {
    let Some(db) = postgres_db("feed_failover").await else {
        return;
    };
    let feed = feed_for(&db, "failover", Mode::Stream).await;
    let [a, b] = pair(&db, &feed).await;
    let (leader, other) = if a.0.feed_stats().unwrap().leading {
        (a, b)
    } else {
        (b, a)
    };
    leader.0.stop().await;
    drop(leader);
    let psql = sql(&db).await;
    let two = other.1.value_computed(2).await;
    psql.execute("UPDATE items SET value = 2 WHERE id = 2", &[])
        .await
        .unwrap();
    within("the other host's invalidation", two.when_invalidated()).await;
    assert!(other.0.feed_stats().unwrap().leading);
    assert_eq!(other.1.value(2).await, Ok(2));
    other.0.stop().await;
    drop_slot(&db, &feed_name("failover")).await;
}

/// A feed on a host with no watch, or on SQLite, is refused at the start with a reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_without_watches_or_on_sqlite_is_refused_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let db = sqlite_db(&dir).await;
    let err = Host::builder(db.clone())
        .change_feed(ChangeFeed::postgres())
        .start()
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("no watched table"), "{err}");
    let err = Host::builder(db)
        .watch(watch_table("items").on_any_change(|| {}))
        .change_feed(ChangeFeed::postgres())
        .start()
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("track the application's"), "{err}");
}

/// A slot or publication name PostgreSQL would fold or refuse, and the slot name the
/// trigger feed owes its flush under, are refused at the start with a reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_feed_with_a_bad_name_is_refused_with_a_reason() {
    let Some(db) = postgres_db("feed_names").await else {
        return;
    };
    for (feed, says) in [
        (ChangeFeed::postgres().slot("Upper"), "lowercase letters"),
        (
            ChangeFeed::postgres().publication("a-b"),
            "lowercase letters",
        ),
        (ChangeFeed::postgres().slot("triggers"), "trigger feed's"),
        (ChangeFeed::postgres().slot("install"), "trigger feed's"),
    ] {
        let err = Host::builder(db.clone())
            .watch(watch_table("items").on_any_change(|| {}))
            .change_feed(feed)
            .start()
            .await
            .err()
            .unwrap();
        assert!(err.to_string().contains(says), "{err}");
    }
}

/// SQLite: a write through a tracked connection of the process invalidates here before
/// the statement returns, and on the other host (its own cache over the same file)
/// through the log; a rollback invalidates nothing; a command's own write is skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_writes_through_a_tracked_connection_invalidate_here_at_once_and_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let db = sqlite_db(&dir).await;
    let mut hosts = Vec::new();
    for _ in 0..2 {
        let seen = Arc::new(Seen::default());
        let slot = Arc::new(Mutex::new(None::<Items>));
        let fwd = Forward(slot.clone());
        let s = seen.clone();
        let (host, items) = host(&db, move |b| fwd.install(b, &s)).await;
        *slot.lock() = Some(items.clone());
        hosts.push((host, items, seen));
    }
    let conn = open_sqlite(db.sqlite_path().unwrap());
    coherent_ops::changes::sqlite::track(&conn, &hosts[0].0).unwrap();

    let here = hosts[0].1.value_computed(2).await;
    let there = hosts[1].1.value_computed(2).await;
    let untouched = hosts[0].1.value_computed(3).await;
    conn.execute("UPDATE items SET value = 5 WHERE id = 2", [])
        .unwrap();
    // Before the statement returned: no wait.
    assert!(
        !here.is_consistent(),
        "the write did not invalidate here at once"
    );
    assert!(untouched.is_consistent());
    assert_eq!(hosts[0].1.value(2).await, Ok(5));
    within("the other host's invalidation", there.when_invalidated()).await;
    assert_eq!(hosts[1].1.value(2).await, Ok(5));

    // A rollback: nothing.
    let one = hosts[0].1.value_computed(1).await;
    conn.execute_batch("BEGIN; UPDATE items SET value = 9 WHERE id = 1; ROLLBACK;")
        .unwrap();
    assert!(one.is_consistent(), "a rollback invalidated item 1");
    assert_eq!(hosts[0].2.of(1), 0);

    // A transaction of several rows, one commit.
    let (four, five) = (
        hosts[0].1.value_computed(4).await,
        hosts[0].1.value_computed(5).await,
    );
    conn.execute_batch(
        "BEGIN; UPDATE items SET value = 4 WHERE id = 4; DELETE FROM items WHERE id = 5; COMMIT;",
    )
    .unwrap();
    assert!(!four.is_consistent() && !five.is_consistent());
    assert!(hosts[0].1.value(5).await.is_err());
    assert_eq!(hosts[0].2.of(2), 1, "one change, one invalidation");

    // A statement with RETURNING commits while it is reset, and SQLite runs no log hook
    // after it: the change waits for the thread's next write, or `settle`.
    let six = hosts[0].1.value_computed(6).await;
    let returned: i64 = conn
        .query_row(
            "UPDATE items SET value = 66 WHERE id = 6 RETURNING value",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(returned, 66);
    coherent_ops::changes::sqlite::settle();
    assert!(!six.is_consistent(), "the RETURNING write was not applied");

    // A DELETE without a WHERE (SQLite's truncate, which skips the update hook): every
    // row is reported.
    let (seven, eight) = (
        hosts[0].1.value_computed(7).await,
        hosts[1].1.value_computed(8).await,
    );
    conn.execute("DELETE FROM items", []).unwrap();
    assert!(
        !seven.is_consistent(),
        "the truncate did not invalidate item 7"
    );
    within(
        "the other host's invalidation of item 8",
        eight.when_invalidated(),
    )
    .await;
    for (host, _, _) in &hosts {
        host.stop().await;
    }
}

// From the adversarial review of the feed: each case failed before its fix.

/// Waits until `f` holds, polling.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    within(what, async {
        while !f() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
}

/// A watch that panics must not hold the feed: the host flushes once, and the next
/// change goes through (the feed used to read the same change again and again, each time
/// flushing every host).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_watch_that_panics_flushes_once_and_the_feed_goes_on() {
    let Some(db) = postgres_db("feed_panics").await else {
        return;
    };
    let feed = feed_for(&db, "panics", Mode::Stream).await;
    let slot = Arc::new(Mutex::new(None::<Items>));
    let fwd = slot.clone();
    let (host, items) = host(&db, move |b| {
        b.watch(watch_table("items").on_change(move |change| {
            let id = change.key::<i64>("id").unwrap();
            assert_ne!(id, 3, "a watch that panics (on purpose)");
            if let Some(items) = &*fwd.lock() {
                items.invalidate_value(id);
            }
        }))
        .change_feed(feed)
    })
    .await;
    *slot.lock() = Some(items.clone());
    until("the feed's first read", || {
        host.feed_stats().unwrap().reads > 0
    })
    .await;
    let flushes = host.stats().flushes;
    let four = items.value_computed(4).await;
    let psql = sql(&db).await;
    psql.execute("UPDATE items SET value = 3 WHERE id = 3", &[])
        .await
        .unwrap();
    psql.execute("UPDATE items SET value = 4 WHERE id = 4", &[])
        .await
        .unwrap();
    within(
        "item 4's invalidation after the panic",
        four.when_invalidated(),
    )
    .await;
    assert_eq!(items.value(4).await, Ok(4));
    // A barrier: once item 5's change is applied, the feed is past item 3's.
    let five = items.value_computed(5).await;
    psql.execute("UPDATE items SET value = 5 WHERE id = 5", &[])
        .await
        .unwrap();
    within("item 5's invalidation", five.when_invalidated()).await;
    assert_eq!(
        host.stats().flushes - flushes,
        1,
        "one flush for the panic, not one per read of the same change"
    );
    host.stop().await;
    drop_slot(&db, &feed_name("panics")).await;
}

/// The built-in command is the hosts' own: a caller (an RPC client) cannot run it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_cannot_run_the_built_in_changes_command() {
    let dir = tempfile::tempdir().unwrap();
    let db = sqlite_db(&dir).await;
    let (host, _items) = host(&db, |b| b.watch(watch_table("items").on_any_change(|| {}))).await;
    let err = host
        .run_json("coherent.db_changes", r#"{"flush":true}"#.to_owned())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("built-in"), "{err}");
    assert_eq!(host.stats().flushes, 0);
    host.stop().await;
}

/// A watched table without a primary key is refused by the feed with a reason; it is not
/// published (once published, PostgreSQL would refuse the application's UPDATEs of it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_table_without_a_key_is_refused_and_its_updates_still_work() {
    let Some(db) = postgres_db("feed_nopk").await else {
        return;
    };
    let psql = sql(&db).await;
    psql.batch_execute("CREATE TABLE nopk (n BIGINT); INSERT INTO nopk VALUES (1)")
        .await
        .unwrap();
    let feed = feed_for(&db, "nopk", Mode::Stream).await;
    let (host, _items) = host(&db, move |b| {
        b.watch(watch_table("nopk").on_any_change(|| {}))
            .change_feed(feed)
    })
    .await;
    until("the feed's refusal", || {
        host.feed_stats().unwrap().errors > 0
    })
    .await;
    psql.execute("UPDATE nopk SET n = 2", &[]).await.unwrap();
    psql.execute("DELETE FROM nopk", &[]).await.unwrap();
    host.stop().await;
}

/// Hosts of two releases watch different tables: a change to a table only the standby
/// host watches reaches its watch, whichever host reads the feed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_table_only_another_host_watches_reaches_that_host() {
    let Some(db) = postgres_db("feed_mixed").await else {
        return;
    };
    let psql = sql(&db).await;
    psql.batch_execute(
        "CREATE TABLE other (id BIGINT PRIMARY KEY, v BIGINT); INSERT INTO other VALUES (1, 0)",
    )
    .await
    .unwrap();
    let feed = feed_for(&db, "mixed", Mode::Stream).await;
    let seen = Arc::new(AtomicUsize::new(0));
    let (a, _) = host(&db, {
        let feed = feed.clone();
        move |b| {
            b.watch(watch_table("items").on_any_change(|| {}))
                .change_feed(feed)
        }
    })
    .await;
    // Its slot made and read: a change before the slot is in no slot (the hosts flush
    // for it; no watch runs).
    until("A reads the feed", || {
        let stats = a.feed_stats().unwrap();
        stats.leading && stats.reads > 0
    })
    .await;
    let (b, _) = host(&db, {
        let seen = seen.clone();
        move |b| {
            b.watch(watch_table("items").on_any_change(|| {}))
                .watch(watch_table("other").on_change(move |c| {
                    assert_eq!(c.key::<i64>("id"), Some(1));
                    seen.fetch_add(1, Ordering::Relaxed);
                }))
                .change_feed(feed)
        }
    })
    .await;
    // B published its table before standing by.
    until("B's feed set up", || {
        b.feed_stats().unwrap().reads == 0 && b.feed_stats().unwrap().errors == 0
    })
    .await;
    within("the publication of B's table", async {
        loop {
            let n: i64 = psql
                .query_one(
                    "SELECT count(*) FROM pg_publication_tables WHERE tablename = 'other' \
                     AND pubname = $1",
                    &[&feed_name("mixed")],
                )
                .await
                .unwrap()
                .get(0);
            if n == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    psql.execute("UPDATE other SET v = 1 WHERE id = 1", &[])
        .await
        .unwrap();
    let waited = tokio::time::timeout(Duration::from_secs(15), async {
        while seen.load(Ordering::Relaxed) != 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(
        waited.is_ok(),
        "B's watch of the other table: feeds {:?} {:?}; hosts {:?} {:?}",
        a.feed_stats(),
        b.feed_stats(),
        a.stats(),
        b.stats()
    );
    a.stop().await;
    b.stop().await;
    drop_slot(&db, &feed_name("mixed")).await;
}

/// A partitioned table: changes come from its partitions, and reach the watch of the
/// partitioned table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_changes_to_a_partition_reach_the_watch_of_its_table() {
    let Some(db) = postgres_db("feed_parted").await else {
        return;
    };
    let psql = sql(&db).await;
    psql.batch_execute(
        "CREATE TABLE parted (id BIGINT PRIMARY KEY, v BIGINT) PARTITION BY RANGE (id); \
         CREATE TABLE parted_a PARTITION OF parted FOR VALUES FROM (0) TO (100); \
         INSERT INTO parted VALUES (5, 0)",
    )
    .await
    .unwrap();
    let feed = feed_for(&db, "parted", Mode::Stream).await;
    let seen = Arc::new(AtomicUsize::new(0));
    let (host, _) = host(&db, {
        let seen = seen.clone();
        move |b| {
            b.watch(watch_table("parted").on_change(move |c| {
                assert_eq!(c.key::<i64>("id"), Some(5));
                seen.fetch_add(1, Ordering::Relaxed);
            }))
            .change_feed(feed)
        }
    })
    .await;
    until("the feed's first read", || {
        host.feed_stats().unwrap().reads > 0
    })
    .await;
    psql.execute("UPDATE parted SET v = 1 WHERE id = 5", &[])
        .await
        .unwrap();
    until("the watch of the partitioned table", || {
        seen.load(Ordering::Relaxed) == 1
    })
    .await;
    host.stop().await;
    drop_slot(&db, &feed_name("parted")).await;
}

/// Two clusters in two schemas of one database, each with the default names: each reads
/// its own feed (one lock, one slot and one publication per cluster).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_two_clusters_in_one_database_each_read_their_own_changes() {
    let (Some(one), Some(two)) = (postgres_db("feed_one").await, postgres_db("feed_two").await)
    else {
        return;
    };
    let mut hosts = Vec::new();
    for db in [&one, &two] {
        let slot = Arc::new(Mutex::new(None::<Items>));
        let fwd = Forward(slot.clone());
        let seen = Arc::new(Seen::default());
        let s = seen.clone();
        let (host, items) = host(db, move |b| {
            fwd.install(b, &s).change_feed(
                ChangeFeed::postgres()
                    .poll_interval(Duration::from_millis(20))
                    .standby_interval(Duration::from_millis(100)),
            )
        })
        .await;
        *slot.lock() = Some(items.clone());
        hosts.push((host, items, db));
    }
    for (host, items, db) in &hosts {
        until("the cluster's feed leads", || {
            host.feed_stats().unwrap().leading
        })
        .await;
        let two = items.value_computed(2).await;
        sql(db)
            .await
            .execute("UPDATE items SET value = 22 WHERE id = 2", &[])
            .await
            .unwrap();
        within("the cluster's own change", two.when_invalidated()).await;
    }
    let psql = sql(&one).await;
    for (host, _, db) in &hosts {
        host.stop().await;
        let schema: String = sql(db)
            .await
            .query_one("SELECT current_schema()", &[])
            .await
            .unwrap()
            .get(0);
        let name = format!("coherent_test_{schema}");
        drop_slot(&one, &name).await;
        let _ = psql
            .batch_execute(&format!("DROP PUBLICATION IF EXISTS {name}"))
            .await;
    }
}

/// A publication dropped under the feed: a single refusal is not the slot lost (the
/// feed makes the publication again), but the changes written while it did not exist
/// cannot be decoded (the server looks it up as of each change): after a few refusals the
/// slot is replaced and every host flushes, and the feed goes on. Either way, the change
/// made meanwhile is not served stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_dropped_publication_is_made_again_and_what_it_missed_flushed() {
    let Some(db) = postgres_db("feed_pub").await else {
        return;
    };
    let feed = feed_for(&db, "pub", Mode::Stream).await;
    let [a, b] = pair(&db, &feed).await;
    let name = feed_name("pub");
    let psql = sql(&db).await;
    psql.batch_execute(&format!("DROP PUBLICATION {name}"))
        .await
        .unwrap();
    let five = a.1.value_computed(5).await;
    psql.execute("UPDATE items SET value = 5 WHERE id = 5", &[])
        .await
        .unwrap();
    within(
        "the flush after the publication came back",
        five.when_invalidated(),
    )
    .await;
    assert_eq!(a.1.value(5).await, Ok(5));
    let six = b.1.value_computed(6).await;
    psql.execute("UPDATE items SET value = 6 WHERE id = 6", &[])
        .await
        .unwrap();
    if tokio::time::timeout(Duration::from_secs(60), six.when_invalidated())
        .await
        .is_err()
    {
        panic!(
            "a change after it did not end within 60 s: feed a {:?}, b {:?}; hosts a {:?}, b {:?}",
            a.0.feed_stats(),
            b.0.feed_stats(),
            a.0.stats(),
            b.0.stats()
        );
    }
    // Whether the slot had to be replaced depends on whether a change to a published
    // table (item 5's, or an operation of the log) was written before the feed made the
    // publication again: either way nothing stale is served, and the slot is replaced at
    // most once.
    let created: u64 = [&a, &b]
        .iter()
        .map(|h| h.0.feed_stats().unwrap().slots_created)
        .sum();
    assert!(created <= 2, "the slot was replaced {} times", created - 1);
    a.0.stop().await;
    b.0.stop().await;
    drop_slot(&db, &name).await;
}

/// Opens a transaction that holds a transaction id (answered: commit it to end the wait),
/// then has the feed of the pair in `db` lose its slot (the publication `name` dropped
/// under a change: three refusals, a new slot), and waits until the new slot waits for
/// that transaction.
async fn lose_the_slot_while_a_transaction_is_open(
    db: &Database,
    psql: &tokio_postgres::Client,
    name: &str,
) -> tokio_postgres::Client {
    let long = sql(db).await;
    long.batch_execute("BEGIN; SELECT pg_current_xact_id()")
        .await
        .unwrap();
    psql.batch_execute(&format!("DROP PUBLICATION {name}"))
        .await
        .unwrap();
    psql.execute("UPDATE items SET value = 5 WHERE id = 5", &[])
        .await
        .unwrap();
    within("the new slot waiting for the open transaction", async {
        loop {
            let waiting: i64 = psql
                .query_one(
                    // This schema's feed sessions only: other tests make slots too.
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE application_name = left($1 || ':' || current_schema(), 63) \
                       AND query LIKE '%pg_create_logical_replication_slot%' \
                       AND state = 'active'",
                    &[&coherent_ops::changes::FEED_APPLICATION],
                )
                .await
                .unwrap()
                .get(0);
            if waiting > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    long
}

/// A slot made anew waits for every transaction running when it is made: a long one
/// elsewhere holds it, and a change made meanwhile is in no slot, so the hosts flush once
/// it is made. A host whose feed starts in that wait must leave that flush to the leader:
/// paid before the slot, it would come before such a change, and the change would be
/// served stale until its row changed again. (Every host paid what it found owed before it
/// stood by, and this test's last read answered the old value.) It holds its cache, as
/// the others do, until the flush is paid: it finds the flush owed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_host_starting_while_a_new_slot_waits_leaves_its_flush_to_the_leader() {
    let Some(db) = postgres_db("feed_late").await else {
        return;
    };
    let feed = feed_for(&db, "late", Mode::Stream).await;
    let [a, b] = pair(&db, &feed).await;
    let name = feed_name("late");
    let psql = sql(&db).await;
    let long = lose_the_slot_while_a_transaction_is_open(&db, &psql, &name).await;
    // The feed's sessions of this schema (each host's feed connection) whose query is
    // `query`: running it with `active`, else its last; begun after `since`.
    let sessions = |query: &'static str, active: bool, since: std::time::SystemTime| {
        let psql = &psql;
        async move {
            psql.query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE application_name = left($1 || ':' || current_schema(), 63) \
                   AND query LIKE $2 AND (state = 'active' OR NOT $3) \
                   AND backend_start > $4",
                &[
                    &coherent_ops::changes::FEED_APPLICATION,
                    &query,
                    &active,
                    &since,
                ],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
        }
    };
    // A third host's feed starts, and stands by behind the leader (its feed's session
    // is the one begun after this).
    let started = std::time::SystemTime::now() - Duration::from_millis(1);
    let c = feed_host(&db, &feed).await;
    // Held from its start, before its feed's connection is up.
    assert_eq!(
        c.0.stats().change_holds,
        1,
        "C answers from its cache after its start while the new slot waits"
    );
    within("the third host standing by", async {
        while sessions("%pg_try_advisory_lock%", false, started).await == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    // Whatever the third host paid is applied on B before B caches the value (so that a
    // flush landing later could not empty B's cache and hide a stale read).
    within("B's read of the log", b.0.catch_up()).await.unwrap();
    let before = b.1.value(6).await.unwrap();
    psql.execute(
        "UPDATE items SET value = $1 WHERE id = 6",
        &[&(before + 1000)],
    )
    .await
    .unwrap();
    // Every host holds its cache while the slot waits: the third one, started after the
    // hold was logged, by the flush it found owed.
    for (host, what) in [(&a, "A"), (&b, "B"), (&c, "C")] {
        assert!(
            host.1.handle.registry().is_fenced(),
            "{what} answers from its cache while the new slot waits"
        );
        assert_eq!(host.1.value(6).await, Ok(before + 1000), "{what}");
    }
    long.batch_execute("COMMIT").await.unwrap();
    within("B's read of the change made while the slot waited", async {
        while b.1.value(6).await != Ok(before + 1000) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    answering_from_caches("the hosts answering from their caches again", &[&a, &b, &c]).await;
    assert_eq!(c.1.value(6).await, Ok(before + 1000));
    for h in [&a, &b, &c] {
        h.0.stop().await;
    }
    drop_slot(&db, &name).await;
}

/// A host that watches the tables but runs no feed hears the hold only in the log; one
/// that starts while a new slot waits reads past it, and must find the flush owed at its
/// start: it cached a value, a change in the wait (in no slot) came, and it answered the
/// old value until the slot's flush.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_host_without_a_feed_starting_while_a_new_slot_waits_holds_its_cache() {
    let Some(db) = postgres_db("feed_nofeed").await else {
        return;
    };
    let feed = feed_for(&db, "nofeed", Mode::Stream).await;
    let [a, b] = pair(&db, &feed).await;
    let name = feed_name("nofeed");
    let psql = sql(&db).await;
    let long = lose_the_slot_while_a_transaction_is_open(&db, &psql, &name).await;
    let d = watching_host(&db, None).await;
    assert_eq!(d.0.stats().change_holds, 1, "held from its start");
    let before = d.1.value(6).await.unwrap();
    psql.execute(
        "UPDATE items SET value = $1 WHERE id = 6",
        &[&(before + 1000)],
    )
    .await
    .unwrap();
    assert_eq!(
        d.1.value(6).await,
        Ok(before + 1000),
        "a host without a feed, started while the new slot waits, answered from its cache"
    );
    assert!(d.1.handle.registry().is_fenced());
    long.batch_execute("COMMIT").await.unwrap();
    // The payment, read from the log, ends its hold.
    answering_from_caches("D answering from its cache again", &[&d]).await;
    assert_eq!(d.1.value(6).await, Ok(before + 1000));
    assert!(d.1.value_computed(6).await.is_consistent());
    assert_eq!(d.0.stats().change_holds, 1);
    for h in [&a, &b, &d] {
        h.0.stop().await;
    }
    drop_slot(&db, &name).await;
}

/// Waits until none of `hosts` holds its cache (each answers from it again).
async fn answering_from_caches(what: &str, hosts: &[&(Host, Items, Arc<Seen>)]) {
    within(what, async {
        while hosts.iter().any(|h| h.1.handle.registry().is_fenced()) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// Records a flush owed under each of `names` in the test's schema, as a feed about to
/// make a slot does (the table made if missing).
async fn owe(psql: &tokio_postgres::Client, names: &[&str]) {
    psql.execute(
        "CREATE TABLE IF NOT EXISTS coherent_feed_flushes (name TEXT PRIMARY KEY)",
        &[],
    )
    .await
    .unwrap();
    for name in names {
        psql.execute(
            "INSERT INTO coherent_feed_flushes (name) VALUES ($1) ON CONFLICT DO NOTHING",
            &[name],
        )
        .await
        .unwrap();
    }
}

/// Takes the advisory lock a feed of the slot `name` leads under, as its leader would, on
/// a session of its own (answered: the lock is held until it is dropped).
async fn lead_as(db: &Database, name: &str) -> tokio_postgres::Client {
    let leader = sql(db).await;
    leader
        .execute(
            "SELECT pg_advisory_lock(hashtext('coherent.changes.' || $1::text))",
            &[&name],
        )
        .await
        .unwrap();
    leader
}

/// A flush owed when a host starts, under a slot whose feed someone leads, whose payment
/// the host cannot read (logged before its start): the host holds its cache until the
/// row is gone, and no longer; it looks every second while it holds, flushes, and answers
/// from its cache again. A row of a slot that nobody leads (left by a feed renamed, or
/// turned to triggers) holds no new host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_flush_owed_at_a_start_is_held_until_its_row_is_gone() {
    let Some(db) = postgres_db("feed_owed").await else {
        return;
    };
    let psql = sql(&db).await;
    owe(&psql, &[]).await;
    psql.execute("DELETE FROM coherent_feed_flushes", &[])
        .await
        .unwrap();
    owe(&psql, &["t_feed_gone", "t_feed_abandoned", "triggers"]).await;
    let leader = lead_as(&db, "t_feed_gone").await;
    let d = watching_host(&db, None).await;
    assert_eq!(
        d.0.stats().change_holds,
        1,
        "one hold: the triggers' flush and a slot nobody leads take none"
    );
    // Past a look or two at the rows: the row is there, the hold stands.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(d.1.handle.registry().is_fenced(), "lifted while still owed");
    let flushes = d.0.stats().flushes;
    psql.execute(
        "DELETE FROM coherent_feed_flushes WHERE name = 't_feed_gone'",
        &[],
    )
    .await
    .unwrap();
    answering_from_caches("the hold lifted once the row is gone", &[&d]).await;
    assert!(d.0.stats().flushes > flushes, "flushed as it lifted");
    d.1.value(6).await.unwrap();
    assert!(d.1.value_computed(6).await.is_consistent());
    d.0.stop().await;
    drop(leader);
    psql.batch_execute("DELETE FROM coherent_feed_flushes")
        .await
        .unwrap();
}

/// A flush owed under a host's own feed's slot holds that host from its start though no
/// one leads the feed yet (its leader, this host or another, pays it): the leader that
/// died in the slot's wait left the row, and the slot is still to be made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_flush_owed_under_its_own_slot_holds_a_host_until_its_leader_pays() {
    let Some(db) = postgres_db("feed_own").await else {
        return;
    };
    let feed = feed_for(&db, "own", Mode::Stream).await;
    let name = feed_name("own");
    let psql = sql(&db).await;
    owe(&psql, &[&name]).await;
    let a = feed_host(&db, &feed).await;
    assert!(
        a.0.stats().change_holds >= 1,
        "a flush owed under its own slot held no host at its start"
    );
    within("the slot made and its flush paid", async {
        while a.1.handle.registry().is_fenced() || a.0.feed_stats().unwrap().slots_created == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    a.1.value(6).await.unwrap();
    assert!(a.1.value_computed(6).await.is_consistent());
    a.0.stop().await;
    drop_slot(&db, &name).await;
}

/// Any role that can connect may `NOTIFY` on the channel of the feed's hints. A stranger's
/// hint (no seal, or a seal that does not check out) is refused: one that named an owed
/// flush paid lifted a host's hold while the slot still waited (a stale read), and with a
/// high number kept every later hold from being taken; one with a flush emptied every
/// host's cache. A hint never carries a hold or a payment, sealed or not: those come
/// only from the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_strangers_hint_is_refused_and_lifts_no_hold() {
    let Some(db) = postgres_db("feed_forged").await else {
        return;
    };
    let psql = sql(&db).await;
    owe(&psql, &["t_feed_forged"]).await;
    let leader = lead_as(&db, "t_feed_forged").await;
    let d = watching_host(&db, None).await;
    assert_eq!(d.0.stats().change_holds, 1);
    // The hints' channel is listened on with the notices' (a stranger's hint sent before
    // would reach no one).
    within("D's notifier listening", async {
        while !d.0.notifier_connected() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let channel = d.0.change_hint_channel().expect("PostgreSQL's notifier");
    let flushes = d.0.stats().flushes;
    let paid = r#"{"from":"stranger","changes":{"flush":true,"hint":3,
        "paid":{"name":"t_feed_forged","at":9223372036854775807}}}"#
        .replace(['\n', ' '], "");
    let flush = r#"{"from":"stranger","changes":{"flush":true,"hint":5}}"#;
    let bad_seal = r#"{"from":"stranger","changes":{"flush":true,"hint":7},"mac":"00000000000000000000000000000000"}"#;
    for payload in [paid.as_str(), flush, bad_seal] {
        psql.execute("SELECT pg_notify($1, $2)", &[&channel, &payload])
            .await
            .unwrap();
    }
    within("the hints heard", async {
        loop {
            let s = d.0.stats();
            if s.messages_refused + s.change_hints >= 3 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let s = d.0.stats();
    assert_eq!(s.change_hints, 0, "a stranger's hint was applied: {s:?}");
    assert!(
        d.1.handle.registry().is_fenced(),
        "a stranger's hint lifted the hold"
    );
    assert_eq!(s.flushes, flushes, "a stranger's hint flushed the cache");
    psql.batch_execute("DELETE FROM coherent_feed_flushes")
        .await
        .unwrap();
    answering_from_caches("the hold lifted once the row is gone", &[&d]).await;
    d.0.stop().await;
    drop(leader);
}

/// A role that may not make a replication slot: the feed says why and tries again, and
/// never owes a flush nor holds the hosts' caches for a slot it cannot make (it did: every
/// host read the database for every call, for as long as the role lacked the right, and
/// each try flushed every host).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_role_that_may_not_make_a_slot_holds_no_host() {
    let Some(url) = crate::support::database_url() else {
        return;
    };
    const ROLE: &str = "coherent_test_norepl";
    let admin = crate::support::connect_in_schema(&url, "public").await;
    let schema = crate::support::fresh_schema("norepl");
    admin
        .batch_execute(&format!(
            "DO $$ BEGIN CREATE ROLE {ROLE} LOGIN NOREPLICATION; \
             EXCEPTION WHEN duplicate_object THEN NULL; END $$; \
             DO $$ BEGIN EXECUTE format('GRANT CREATE ON DATABASE %I TO {ROLE}', \
                                        current_database()); END $$; \
             CREATE SCHEMA {schema} AUTHORIZATION {ROLE}"
        ))
        .await
        .unwrap();
    // The same server, as that role.
    let Some((_, rest)) = url.split_once("://") else {
        return;
    };
    let at_host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let as_role = format!("postgres://{ROLE}@{at_host}");
    let db = match Database::postgres_in_schema(&as_role, &schema).await {
        Ok(db) => db,
        Err(e) => {
            eprintln!("skipped: cannot connect as {ROLE} without a password: {e}");
            return;
        }
    };
    crate::support::create_items(&db, 10).await;
    let name = feed_name("norepl");
    let feed = ChangeFeed::postgres()
        .slot(&name)
        .publication(&name)
        .standby_interval(Duration::from_millis(50));
    let a = feed_host(&db, &feed).await;
    within("the feed's tries", async {
        while a.0.feed_stats().unwrap().errors < 3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let stats = a.0.stats();
    assert_eq!(stats.change_holds, 0, "held for a slot that cannot be made");
    assert_eq!(a.0.feed_stats().unwrap().slots_created, 0);
    assert!(!a.1.handle.registry().is_fenced());
    let owed: i64 = sql(&db)
        .await
        .query_one("SELECT count(*) FROM coherent_feed_flushes", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(owed, 0, "a flush owed for a slot that cannot be made");
    a.0.stop().await;
    let _ = admin
        .batch_execute(&format!(
            "DROP PUBLICATION IF EXISTS {name}; DROP SCHEMA {schema} CASCADE"
        ))
        .await;
}

/// A slot made anew waits for every transaction running when it is made, and a change
/// committed in that wait is in no slot: the hosts learn of it only from the flush paid
/// after the slot. Until then they must not answer from their caches (they did: a value
/// cached before the change was served for as long as the wait lasted). Each host holds
/// its cache (a fence: every call reads the database) from before the slot is made until
/// that flush, and answers from it again after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_change_while_a_new_slot_waits_is_not_served_stale() {
    let Some(db) = postgres_db("feed_wait").await else {
        return;
    };
    let feed = feed_for(&db, "wait", Mode::Stream).await;
    let [a, b] = pair(&db, &feed).await;
    let name = feed_name("wait");
    let psql = sql(&db).await;
    // Cached on both hosts before anything happens.
    let before = b.1.value(6).await.unwrap();
    assert_eq!(a.1.value(6).await, Ok(before));
    let long = lose_the_slot_while_a_transaction_is_open(&db, &psql, &name).await;
    // Committed while the slot waits: no slot will carry it.
    psql.execute(
        "UPDATE items SET value = $1 WHERE id = 6",
        &[&(before + 1000)],
    )
    .await
    .unwrap();
    for (host, what) in [(&a, "A"), (&b, "B")] {
        assert_eq!(
            host.1.value(6).await,
            Ok(before + 1000),
            "{what} answered from its cache a row changed while the new slot waited"
        );
    }
    long.batch_execute("COMMIT").await.unwrap();
    // The flush after the slot ends the hold: the hosts answer from their caches again.
    answering_from_caches("the hosts answering from their caches again", &[&a, &b]).await;
    for host in [&a, &b] {
        assert_eq!(host.1.value(6).await, Ok(before + 1000));
        let six = host.1.value_computed(6).await;
        assert!(six.is_consistent(), "a read after the hold is cached");
    }
    for h in [&a, &b] {
        h.0.stop().await;
    }
    drop_slot(&db, &name).await;
}

/// `PostgresOptions::tls`: every connection of the database speaks TLS (the pool's, each
/// host's listener, the feed's SQL connection and its replication stream, which this crate
/// opens by hand), the server's certificate checked against the roots given, and a change
/// made outside still reaches both hosts. A URL that requires TLS without a configuration,
/// and a server whose certificate the roots do not vouch for, fail to open with a reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tls_encrypts_every_connection_and_changes_still_arrive() {
    use coherent_ops::rustls::pki_types::{pem::PemObject, CertificateDer};
    use coherent_ops::rustls::{ClientConfig, RootCertStore};
    use coherent_ops::PostgresOptions;

    let Some(url) = crate::support::database_url() else {
        return;
    };
    let plain = crate::support::connect_in_schema(&url, "public").await;
    let ssl: String = plain.query_one("SHOW ssl", &[]).await.unwrap().get(0);
    let cert: String = plain
        .query_one("SHOW ssl_cert_file", &[])
        .await
        .unwrap()
        .get(0);
    // Debian's PostgreSQL serves its snakeoil certificate, for `localhost`: trusted here
    // as a root of its own.
    let pem = match std::fs::read(&cert) {
        Ok(pem) if ssl == "on" => pem,
        _ => {
            eprintln!("skipped: the server does not serve TLS with a certificate readable here");
            return;
        }
    };
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&pem) {
        roots.add(c.unwrap()).unwrap();
    }
    let trusted = ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let config: tokio_postgres::Config = url.parse().unwrap();
    let application = format!("coherent_tls_{}", std::process::id());
    let password = config
        .get_password()
        .map(|p| format!(":{}", String::from_utf8_lossy(p)))
        .unwrap_or_default();
    let url_for = |host: &str| {
        format!(
            "postgres://{}{password}@{host}:{}/{}?sslmode=require&application_name={application}",
            config.get_user().unwrap(),
            config.get_ports().first().copied().unwrap_or(5432),
            config.get_dbname().unwrap_or("postgres"),
        )
    };
    // The name the certificate is for: `localhost` here, the machine's name where Debian
    // made it at install.
    let machine = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
    let mut tls_url = None;
    for host in ["localhost", machine.trim()] {
        if host.is_empty() {
            continue;
        }
        let probe = Database::postgres_with(
            &url_for(host),
            PostgresOptions::default()
                .schema(&crate::support::fresh_schema("tls_probe"))
                .tls(trusted.clone()),
        )
        .await;
        match probe {
            Ok(_) => {
                tls_url = Some(url_for(host));
                break;
            }
            Err(e) => eprintln!("{host}: {e}"),
        }
    }
    let Some(tls_url) = tls_url else {
        eprintln!("skipped: the server's certificate is for neither localhost nor this machine");
        return;
    };

    // No configuration, TLS required: refused before anything is sent in the clear.
    let e = Database::postgres_with(&tls_url, PostgresOptions::default())
        .await
        .err()
        .expect("sslmode=require without a TLS configuration");
    assert!(e.message().contains("PostgresOptions::tls"), "{e}");
    // Roots that do not vouch for the server's certificate: refused.
    let e = Database::postgres_with(
        &tls_url,
        PostgresOptions::default().tls(
            ClientConfig::builder()
                .with_root_certificates(RootCertStore::empty())
                .with_no_client_auth(),
        ),
    )
    .await
    .err()
    .expect("an untrusted certificate");
    assert!(e.message().to_lowercase().contains("certificate"), "{e}");

    let schema = crate::support::fresh_schema("tls");
    let db = Database::postgres_with(
        &tls_url,
        PostgresOptions::default().schema(&schema).tls(trusted),
    )
    .await
    .unwrap();
    crate::support::create_items(&db, 10).await;
    let feed = feed_for(&db, "tls", Mode::Stream).await;
    let hosts = pair(&db, &feed).await;
    let two: Vec<_> = {
        let mut v = Vec::new();
        for (_, items, _) in &hosts {
            v.push(items.value_computed(2).await);
        }
        v
    };
    let outside = crate::support::connect_in_schema(&url, &schema).await;
    outside
        .execute("UPDATE items SET value = 70 WHERE id = 2", &[])
        .await
        .unwrap();
    invalidated(&two, "the UPDATE of item 2, over TLS").await;
    for (_, items, _) in &hosts {
        assert_eq!(items.value(2).await, Ok(70));
    }

    // Every connection of the database, by the names they go by: encrypted.
    let mut names = vec![
        application.clone(),
        format!("{}:{schema}", coherent_ops::changes::FEED_APPLICATION),
    ];
    for (host, _, _) in &hosts {
        names.push(format!("coherent-listener:{}", host.id()));
    }
    let rows = plain
        .query(
            "SELECT a.application_name, a.backend_type, s.ssl \
             FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.application_name = ANY($1)",
            &[&names],
        )
        .await
        .unwrap();
    let seen: Vec<(String, String, bool)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    for name in &names {
        assert!(
            seen.iter().any(|(n, _, _)| n == name),
            "no connection named {name}: {seen:?}"
        );
    }
    assert!(
        seen.iter().any(|(_, kind, _)| kind == "walsender"),
        "the feed streams over a replication connection: {seen:?}"
    );
    assert!(
        seen.iter().all(|(_, _, ssl)| *ssl),
        "a plain connection: {seen:?}"
    );

    for (host, _, _) in &hosts {
        host.stop().await;
    }
    drop_slot(&db, &feed_name("tls")).await;
}
