//! Several hosts in one process, each with its own cache, over one database.

use std::time::Duration;

use coherent::ConsistencyState;
use coherent_ops::{Database, ErrorKind, Notifier, Via};

use crate::support::{create_items, database_url, fresh_schema, host, FailAfterWrite, SetValue};

async fn sqlite_db(dir: &tempfile::TempDir) -> Database {
    let db = Database::sqlite(dir.path().join("cluster.db")).unwrap();
    create_items(&db, 10).await;
    db
}

async fn postgres_db(test: &str) -> Option<Database> {
    let url = database_url()?;
    let db = Database::postgres_in_schema(&url, &fresh_schema(test))
        .await
        .unwrap_or_else(|e| panic!("DATABASE_URL is set but PostgreSQL fails: {e}"));
    create_items(&db, 10).await;
    Some(db)
}

/// A write on A invalidates B's computed (and the diamond above it); B then reads the new
/// value. Returns how B applied it.
async fn write_on_a_reaches_b(db: Database, notifier: Option<Notifier>) -> Via {
    let pick = |b: coherent_ops::HostBuilder| match notifier.clone() {
        Some(n) => b.notifier(n),
        None => b,
    };
    let (a, items_a) = host(&db, pick).await;
    let (b, items_b) = host(&db, pick).await;
    assert_eq!(items_b.pair(3, 3).await, Ok(0));
    let pair_b = items_b.pair_computed(3, 3).await;
    let value_a = items_a.value_computed(3).await;
    let mut applied_b = b.subscribe();

    assert_eq!(a.run(SetValue { id: 3, value: 7 }).await, Ok(0));
    // On A, before `run` returned.
    assert_eq!(value_a.state(), ConsistencyState::Invalidated);
    // On B, once it has applied the operation.
    let applied = tokio::time::timeout(Duration::from_secs(10), applied_b.recv())
        .await
        .expect("B applies A's operation")
        .unwrap();
    assert_eq!(&*applied.host, a.id());
    assert_eq!(&*applied.kind, "test.set_value");
    assert_eq!(pair_b.state(), ConsistencyState::Invalidated);
    assert_eq!(items_b.pair(3, 3).await, Ok(7007));
    assert_eq!(items_a.value(3).await, Ok(7));

    // Nothing twice: a read of the log now finds it applied.
    b.catch_up().await.unwrap();
    let stats = b.stats();
    assert_eq!(stats.applied_notified + stats.applied_from_log, 1);
    assert_eq!(a.stats().commands, 1);
    a.stop().await;
    b.stop().await;
    applied.via
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_write_on_one_host_reaches_the_other_by_polling() {
    let dir = tempfile::tempdir().unwrap();
    let via = write_on_a_reaches_b(sqlite_db(&dir).await, None).await;
    assert_eq!(via, Via::Log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_write_on_one_host_reaches_the_other_by_notify() {
    let Some(db) = postgres_db("notify").await else {
        return;
    };
    let via = write_on_a_reaches_b(db, None).await;
    assert_eq!(via, Via::Notification);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_write_on_one_host_reaches_the_other_by_nats() {
    let Some(url) = nats_url() else { return };
    let Some(db) = postgres_db("nats").await else {
        return;
    };
    let via = write_on_a_reaches_b(db, Some(Notifier::Nats(url))).await;
    assert_eq!(via, Via::Notification);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_polling_alone_carries_operations() {
    let Some(db) = postgres_db("poll").await else {
        return;
    };
    let via = write_on_a_reaches_b(db, Some(Notifier::Poll)).await;
    assert_eq!(via, Via::Log);
}

/// `NATS_URL` (default `nats://127.0.0.1:4222`), or `None` (saying so) when nothing
/// listens there.
pub(crate) fn nats_url() -> Option<String> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let addr = url.trim_start_matches("nats://").to_owned();
    match std::net::TcpStream::connect(&addr) {
        Ok(_) => Some(url),
        Err(e) => {
            eprintln!("skipped: NATS is not reachable at {addr}: {e}");
            None
        }
    }
}

async fn a_failing_handler_writes_nothing_and_logs_nothing(db: Database) {
    let (a, items) = host(&db, |b| b).await;
    assert_eq!(items.value(4).await, Ok(0));
    let before = db.log_len().await.unwrap();
    let err = a.run(FailAfterWrite { id: 4 }).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Rejected);
    assert_eq!(db.log_len().await.unwrap(), before);
    // The write was rolled back: a fresh read (no cache) sees 0.
    items.invalidate_value(4);
    assert_eq!(items.value(4).await, Ok(0));
    assert_eq!(a.stats().command_errors, 1);
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_failing_handler_rolls_back() {
    let dir = tempfile::tempdir().unwrap();
    a_failing_handler_writes_nothing_and_logs_nothing(sqlite_db(&dir).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_failing_handler_rolls_back() {
    let Some(db) = postgres_db("rollback").await else {
        return;
    };
    a_failing_handler_writes_nothing_and_logs_nothing(db).await;
}
