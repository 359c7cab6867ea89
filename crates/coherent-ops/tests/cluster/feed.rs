//! Issue 34 across processes: a change committed by a connection outside the application
//! (a `psql` session) reaches every host process's cache and the replicas its clients
//! hold, through the change feed; the host reading the feed killed with SIGKILL, another
//! takes it over and the next change reaches the hosts left.

use coherent::prelude::*;
use coherent_remote::RemoteClient;

use crate::harness::{within, HostProc, Mirror, Store};

/// Held by each test of this file: the retention test sets a server-wide limit on every
/// slot's log (`max_slot_wal_keep_size`), which would invalidate the other test's slot too.
static SLOTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Drops the slot (and its publication) once no host reads it.
async fn drop_slot(sql: &tokio_postgres::Client, slot: &str) {
    crate::support::drop_slot_when_free(sql, slot).await;
    let _ = sql
        .batch_execute(&format!("DROP PUBLICATION IF EXISTS {slot}"))
        .await;
}

async fn leading(host: &mut HostProc) -> bool {
    host.cmd("feed").await.contains("leading=1")
}

/// Waits until `host` reads `value` for `id` from its cache (a host whose entry was not
/// invalidated reads the old value for ever).
async fn reads(host: &mut HostProc, id: i64, value: i64) {
    within("the host's read of the new value", async {
        while host.read(id).await != value {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_change_from_outside_reaches_every_host_process_and_outlives_the_readers_kill() {
    let Some(store) = Store::postgres("c_feed").await else {
        return;
    };
    let _alone = SLOTS.lock().await;
    let sql = store.sql().await;
    let pid = std::process::id();
    // Slots of earlier runs of this binary (a slot holds the log back for ever).
    sql.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
         WHERE slot_name LIKE 't\\_feed\\_%' AND slot_name NOT LIKE $1 AND NOT active",
        &[&format!("t\\_feed\\_{pid}\\_%")],
    )
    .await
    .unwrap();
    let slot = format!("t_feed_{pid}_cluster");
    let config = store.host().feed(&slot);
    let mut hosts = vec![
        config.spawn().await,
        config.spawn().await,
        config.spawn().await,
    ];
    within("a host reads the feed", async {
        loop {
            for h in hosts.iter_mut() {
                if leading(h).await {
                    return;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    for h in hosts.iter_mut() {
        assert_eq!(h.read(3).await, 0);
    }
    let mirror = Mirror {
        handle: ServiceHandle::with_registry(&Registry::new()),
        remote: RemoteClient::connect_tcp(hosts[2].addr).await.unwrap(),
    };
    let replica = mirror.value_computed(3).await;
    assert_eq!(replica.value(), &Ok(Ok(0)));

    sql.execute("UPDATE items SET value = 5 WHERE id = 3", &[])
        .await
        .unwrap();
    for h in hosts.iter_mut() {
        reads(h, 3, 5).await;
    }
    within("the replica's invalidation", replica.when_invalidated()).await;
    assert_eq!(mirror.value(3).await, Ok(Ok(5)));

    // The reader of the feed killed: another takes it over.
    let mut leader = None;
    for (i, h) in hosts.iter_mut().enumerate() {
        if leading(h).await {
            leader = Some(i);
        }
    }
    let mut dead = hosts.remove(leader.expect("one host leads"));
    for h in hosts.iter_mut() {
        assert_eq!(h.read(4).await, 0);
    }
    dead.kill().await;
    sql.execute("UPDATE items SET value = 6 WHERE id = 4", &[])
        .await
        .unwrap();
    for h in hosts.iter_mut() {
        reads(h, 4, 6).await;
    }
    let mut leaders = 0;
    for h in hosts.iter_mut() {
        leaders += usize::from(leading(h).await);
    }
    assert_eq!(leaders, 1, "one of the hosts left reads the feed");
    for h in hosts.iter_mut() {
        h.kill().await;
    }
    drop_slot(&sql, &slot).await;
}

/// Resets `max_slot_wal_keep_size` when dropped, a panic included (the setting outlives
/// the test: `ALTER SYSTEM` writes it to the server's configuration).
struct KeepSize(String);

impl Drop for KeepSize {
    fn drop(&mut self) {
        let url = self.0.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                    .await
                    .unwrap();
                tokio::spawn(conn);
                for sql in [
                    "ALTER SYSTEM RESET max_slot_wal_keep_size",
                    "SELECT pg_reload_conf()",
                ] {
                    c.batch_execute(sql).await.unwrap();
                }
            });
        })
        .join();
    }
}

/// Retention: while the host reading the feed is paused (SIGSTOP: it keeps the lock, so
/// no other host reads), writes push the slot past `max_slot_wal_keep_size` and the server
/// invalidates it, with a change to a watched row in the log it dropped. When the reader
/// resumes it finds the slot lost, makes a new one, and every host flushes: the lost
/// change is not served stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_slot_past_max_slot_wal_keep_size_is_replaced_and_every_host_flushes() {
    let Some(store) = Store::postgres("c_keep").await else {
        return;
    };
    let _alone = SLOTS.lock().await;
    let sql = store.sql().await;
    let slot = format!("t_feed_{}_keep", std::process::id());
    let _reset = KeepSize(std::env::var("DATABASE_URL").unwrap());
    for statement in [
        "ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'",
        "SELECT pg_reload_conf()",
    ] {
        sql.batch_execute(statement).await.unwrap();
    }
    let config = store.host().feed(&slot);
    let mut a = config.spawn().await;
    within("A reads the feed", async {
        while !leading(&mut a).await {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    let mut b = config.spawn().await;
    // The flush the new slot owed (logged by the host that made it, under the lock) applied
    // on both before the premise below: one that landed on B in the middle of the test
    // emptied its cache, and B then read the new value from the database (seen in CI).
    within("the slot's flush paid", async {
        loop {
            let owed: i64 = sql
                .query_one("SELECT count(*) FROM coherent_feed_flushes", &[])
                .await
                .map_or(1, |r| r.get(0));
            if owed == 0 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
    a.cmd("catchup").await;
    b.cmd("catchup").await;
    assert_eq!(b.read(3).await, 0);

    a.pause();
    sql.execute("UPDATE items SET value = 9 WHERE id = 3", &[])
        .await
        .unwrap();
    sql.batch_execute("CREATE TABLE junk (id BIGINT, body TEXT)")
        .await
        .unwrap();
    within("the server's invalidation of the slot", async {
        loop {
            let status: Option<String> = sql
                .query_one(
                    "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await
                .unwrap()
                .get(0);
            if status.as_deref() == Some("lost") {
                return;
            }
            // A few segments of log, then a checkpoint (which invalidates the slot).
            for statement in [
                "INSERT INTO junk SELECT g, repeat(md5(g::text), 30) \
                 FROM generate_series(1, 20000) g",
                "SELECT pg_switch_wal()",
                "CHECKPOINT",
            ] {
                sql.batch_execute(statement).await.unwrap();
            }
        }
    })
    .await;
    // B stood by: its entry for item 3 is the old one until the flush.
    let stale = b.read(3).await;
    if stale != 0 {
        let (stats, feed) = (b.cmd("stats").await, b.cmd("feed").await);
        panic!("nothing read the feed meanwhile, yet B reads {stale}: {stats}; {feed}");
    }
    a.resume();
    reads(&mut b, 3, 9).await;
    reads(&mut a, 3, 9).await;
    // One of them made the new slot (the one reading the feed when it found the slot lost).
    // The reads above may come before it: the hosts hold their caches (every call reads
    // the database) from before the new slot is made until its flush.
    let mut created = 0;
    within("the replacement slot made", async {
        loop {
            created = [a.cmd("feed").await, b.cmd("feed").await]
                .iter()
                .map(|f| {
                    f.split_whitespace()
                        .find_map(|kv| kv.strip_prefix("slots_created="))
                        .unwrap()
                        .parse::<u64>()
                        .unwrap()
                })
                .sum();
            if created >= 2 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(created, 2, "the first slot and its replacement");
    // And after its flush, from their caches again.
    reads(&mut b, 3, 9).await;
    reads(&mut a, 3, 9).await;
    a.kill().await;
    b.kill().await;
    drop_slot(&sql, &slot).await;
}
