//! The database restarted under a running change feed (issue 34): a change committed just
//! before the restart, which the feed had not read yet, is read from the slot once the
//! database is back (the slot is on the server's disk), and reaches the watch once.
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

async fn connect(url: &str, schema: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
        .batch_execute(&format!("SET search_path TO {schema}"))
        .await
        .unwrap();
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_change_committed_before_a_restart_of_the_database_is_not_lost() {
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
    let schema = fresh_schema("restart");
    let db = Database::postgres_in_schema(&url, &schema).await.unwrap();
    create_items(&db, 10).await;
    let psql = connect(&url, &schema).await;
    let level: String = psql.query_one("SHOW wal_level", &[]).await.unwrap().get(0);
    assert_eq!(
        level, "logical",
        "the change feed needs wal_level = logical (.ci/run sets it)"
    );
    let name = format!("t_restart_{}", std::process::id());

    let registry = Registry::new();
    let items = Items {
        handle: ServiceHandle::with_registry(&registry),
        reader: Reader::for_db(&db),
    };
    let seen: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let (watching, counts) = (items.clone(), seen.clone());
    let host = Host::builder(db.clone())
        .registry(&registry)
        .watch(watch_table("items").on_change(move |change| {
            if let Some(id) = change.key::<i64>("id") {
                *counts.lock().entry(id).or_default() += 1;
                watching.invalidate_value(id);
            }
        }))
        // A long poll: the change below is committed, and the database restarted, before
        // the feed reads it.
        .change_feed(
            ChangeFeed::postgres()
                .slot(&name)
                .publication(&name)
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
    // Just after a read: the next is 5 s away.
    let reads = host.feed_stats().unwrap().reads;
    tokio::time::timeout(GUARD, async {
        while host.feed_stats().unwrap().reads == reads {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the feed's second read");
    psql.execute("UPDATE items SET value = 7 WHERE id = 2", &[])
        .await
        .unwrap();
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
        "the feed read the change before the restart"
    );

    tokio::time::timeout(GUARD, async {
        while seen.lock().get(&2).is_none() {
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
    host.stop().await;
    let psql = connect(&url, &schema).await;
    support::drop_slot_when_free(&psql, &name).await;
    let _ = psql
        .batch_execute(&format!("DROP PUBLICATION IF EXISTS {name}"))
        .await;
}
