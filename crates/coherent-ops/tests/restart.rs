//! The database restarted under a running change feed (issue 34): a change committed just
//! before the restart, which the feed had not read yet (read with SQL), or had received and
//! not yet confirmed (streamed), is read from the slot once the database is back (the slot
//! is on the server's disk), and reaches the watch.
//!
//! A test binary of its own: it restarts the local PostgreSQL (`pg_ctlcluster`, as
//! `.ci/run` does to set `wal_level`), which would cut every other test's connections. It
//! says it skipped where it cannot.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use coherent::prelude::*;
use coherent_ops::{watch_table, ChangeFeed, Database, Host};
use parking_lot::Mutex;

#[allow(dead_code)]
#[path = "it/support.rs"]
mod support;

use support::{create_items, fresh_schema, Items, Reader};

const GUARD: Duration = Duration::from_secs(120);

/// One restart at a time: each cuts every connection of the server.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Read with SQL: the change commits between two reads (the next is 5 s away), the
/// database restarts, and the next read after it finds the change in the slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_change_committed_before_a_restart_of_the_database_is_not_lost() {
    restarted_under_the_feed(false).await;
}

/// Streamed: the change arrives, and its watch is held (the feed has not confirmed it)
/// while the database restarts; the stream started again after the restart delivers it
/// again: the slot was not moved past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_streamed_change_not_yet_confirmed_is_streamed_again_after_a_restart() {
    restarted_under_the_feed(true).await;
}

async fn restarted_under_the_feed(streaming: bool) {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        eprintln!("skipped: DATABASE_URL is not set");
        return;
    };
    let cluster = std::fs::read_dir("/etc/postgresql")
        .ok()
        .and_then(|mut d| d.next())
        .and_then(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned());
    let Some(version) = cluster.filter(|_| std::path::Path::new("/usr/bin/pg_ctlcluster").exists())
    else {
        eprintln!("skipped: no pg_ctlcluster to restart the local PostgreSQL with");
        return;
    };
    let _serial = SERIAL.lock().await;
    // Streamed: a server that shuts down waits for each replication connection to confirm
    // all it was sent, and this test's feed is held in its watch: it waits out
    // `wal_sender_timeout` (60 s by default), 2 s here.
    let url = if streaming {
        let joined = if url.contains('?') { '&' } else { '?' };
        format!("{url}{joined}options=-c%20wal_sender_timeout%3D2s")
    } else {
        url
    };
    let schema = fresh_schema(if streaming { "restart_s" } else { "restart" });
    let db = Database::postgres_in_schema(&url, &schema).await.unwrap();
    create_items(&db, 10).await;
    let psql = support::connect_in_schema(&url, &schema).await;
    let level: String = psql.query_one("SHOW wal_level", &[]).await.unwrap().get(0);
    assert_eq!(
        level, "logical",
        "the change feed needs wal_level = logical (.ci/run sets it)"
    );
    let name = format!(
        "t_restart_{}{}",
        std::process::id(),
        if streaming { "_s" } else { "" }
    );

    let registry = Registry::new();
    let items = Items {
        handle: ServiceHandle::with_registry(&registry),
        reader: Reader::for_db(&db),
    };
    let seen: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    // Streamed: the first delivery of item 2 holds the feed's thread in the watch until
    // the database has restarted.
    let (entered_tx, entered_rx) = std::sync::mpsc::channel::<()>();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let gate = Mutex::new(Some((entered_tx, release_rx)));
    let (watching, counts) = (items.clone(), seen.clone());
    let host = Host::builder(db.clone())
        .registry(&registry)
        .watch(watch_table("items").on_change(move |change| {
            if let Some(id) = change.key::<i64>("id") {
                if id == 2 && streaming {
                    if let Some((entered, release)) = gate.lock().take() {
                        let _ = entered.send(());
                        let _ = release.recv();
                    }
                }
                *counts.lock().entry(id).or_default() += 1;
                watching.invalidate_value(id);
            }
        }))
        // Read with SQL, a long poll: the change below is committed, and the database
        // restarted, before the feed reads it.
        .change_feed(
            ChangeFeed::postgres()
                .slot(&name)
                .publication(&name)
                .streaming(streaming)
                .poll_interval(Duration::from_secs(5))
                .standby_interval(Duration::from_millis(100)),
        )
        .start()
        .await
        .unwrap();
    tokio::time::timeout(GUARD, async {
        while host.feed_stats().unwrap().reads == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the feed's first read");
    assert_eq!(host.feed_stats().unwrap().streaming, streaming);
    if !streaming {
        // Just after a read: the next is 5 s away.
        let reads = host.feed_stats().unwrap().reads;
        tokio::time::timeout(GUARD, async {
            while host.feed_stats().unwrap().reads == reads {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the feed's second read");
    }
    psql.execute("UPDATE items SET value = 7 WHERE id = 2", &[])
        .await
        .unwrap();
    if streaming {
        tokio::task::spawn_blocking(move || entered_rx.recv_timeout(GUARD))
            .await
            .unwrap()
            .expect("the stream delivered the change");
    }
    let restarted = tokio::task::spawn_blocking(move || {
        std::process::Command::new("pg_ctlcluster")
            .args(["--skip-systemctl-redirect", &version, "main", "restart"])
            .status()
    })
    .await
    .unwrap()
    .expect("pg_ctlcluster runs");
    assert!(
        restarted.success(),
        "PostgreSQL did not restart: {restarted}"
    );
    assert_eq!(
        seen.lock().get(&2),
        None,
        "the feed took the change before the restart"
    );
    let _ = release_tx.send(());

    // Streamed: once as the stream first delivered it, once more from the slot.
    let deliveries = if streaming { 2 } else { 1 };
    tokio::time::timeout(GUARD, async {
        while seen.lock().get(&2).copied().unwrap_or(0) < deliveries {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the change committed before the restart reached the watch");
    assert_eq!(items.value(2).await, Ok(7));
    let stats = host.feed_stats().unwrap();
    assert!(
        stats.errors >= 1,
        "the feed never saw the restart: {stats:?}"
    );
    assert_eq!(
        stats.slots_created, 1,
        "the slot outlived the restart: {stats:?}"
    );
    assert!(stats.streaming == streaming, "{stats:?}");
    host.stop().await;
    let psql = support::connect_in_schema(&url, &schema).await;
    support::drop_slot_when_free(&psql, &name).await;
    let _ = psql
        .batch_execute(&format!("DROP PUBLICATION IF EXISTS {name}"))
        .await;
}
