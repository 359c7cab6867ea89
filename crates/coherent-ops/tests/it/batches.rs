//! Commands that wait while a host's transactions are busy commit together, one batch per
//! transaction; a batch that fails runs its commands again one at a time.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use coherent_ops::{Command, CommandError, Database, ErrorKind, Handler, Host, Tx};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, Semaphore};

use crate::inproc::{postgres_db, sqlite_db};
use crate::support::{host, FailAfterWrite, SetValue};

/// Holds the host's one transaction until the test releases it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Hold;

impl Command for Hold {
    const NAME: &'static str = "test.hold";
    type Output = ();
}

/// Panics in its handler.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Panic;

impl Command for Panic {
    const NAME: &'static str = "test.panic";
    type Output = ();
}

#[derive(Clone)]
pub(crate) struct Gate {
    entered: Arc<Notify>,
    release: Arc<Semaphore>,
}

impl Handler<Hold> for Gate {
    async fn execute(&self, _: &Hold, _: &mut Tx<'_>) -> Result<(), CommandError> {
        self.entered.notify_one();
        self.release.acquire().await.expect("open").forget();
        Ok(())
    }

    fn invalidate(&self, _: &Hold, _: &()) {}
}

impl Handler<Panic> for Gate {
    async fn execute(&self, _: &Panic, _: &mut Tx<'_>) -> Result<(), CommandError> {
        panic!("a handler that panics (on purpose)");
    }

    fn invalidate(&self, _: &Panic, _: &()) {}
}

pub(crate) type Pending = Pin<Box<dyn Future<Output = Result<i64, CommandError>> + Send>>;

/// Starts `Hold` on `a` (one transaction) and waits until its handler runs; then hands
/// each of `commands` to `a` (a first poll queues it) while the transaction is held, and
/// releases it. Answers the commands' results in order.
pub(crate) async fn queued_behind_a_held_transaction(
    a: &Host,
    gate: &Gate,
    commands: Vec<Pending>,
) -> Vec<Result<i64, CommandError>> {
    let held = tokio::spawn({
        let a = a.clone();
        async move { a.run(Hold).await }
    });
    gate.entered.notified().await;
    let mut commands = commands;
    for c in &mut commands {
        assert!(
            futures::poll!(c.as_mut()).is_pending(),
            "a command answered while the only transaction was held"
        );
    }
    gate.release.add_permits(1);
    held.await.unwrap().unwrap();
    let mut results = Vec::new();
    for c in commands {
        results.push(c.await);
    }
    results
}

pub(crate) async fn two_hosts(
    db: &Database,
) -> (
    Host,
    crate::support::Items,
    Host,
    crate::support::Items,
    Gate,
) {
    let gate = Gate {
        entered: Arc::new(Notify::new()),
        release: Arc::new(Semaphore::new(0)),
    };
    let (a, items_a) = host(db, {
        let gate = gate.clone();
        |b| {
            b.transactions(1)
                .command::<Hold>(gate.clone())
                .command::<Panic>(gate)
        }
    })
    .await;
    let (b, items_b) = host(db, |b| b).await;
    (a, items_a, b, items_b, gate)
}

fn set(a: &Host, id: i64, value: i64) -> Pending {
    let a = a.clone();
    Box::pin(async move { a.run(SetValue { id, value }).await })
}

/// Ten commands queued behind a held transaction commit as one batch; each is logged,
/// invalidated here, and applied on the other host.
async fn waiting_commands_commit_as_one_batch(db: Database) {
    let (a, items_a, b, items_b, gate) = two_hosts(&db).await;
    for id in 1..=10 {
        assert_eq!(items_a.value(id).await, Ok(0));
        assert_eq!(items_b.value(id).await, Ok(0));
    }
    let before = db.log_len().await.unwrap();
    let commands = (1..=10).map(|id| set(&a, id, 100 + id)).collect();
    let results = queued_behind_a_held_transaction(&a, &gate, commands).await;
    assert!(results.iter().all(|r| r == &Ok(0)), "{results:?}");
    let stats = a.stats();
    assert_eq!(stats.commands, 11);
    assert_eq!(
        stats.batches, 2,
        "the held command's, then the ten together"
    );
    assert_eq!(stats.batches_split, 0);
    assert_eq!(db.log_len().await.unwrap(), before + 11);
    b.catch_up().await.unwrap();
    let applied = b.stats();
    // B has no handler for `Hold`: it counts it as unknown.
    assert_eq!(applied.applied_notified + applied.applied_from_log, 10);
    assert_eq!(applied.unknown, 1);
    for id in 1..=10 {
        assert_eq!(items_a.value(id).await, Ok(100 + id), "A, item {id}");
        assert_eq!(items_b.value(id).await, Ok(100 + id), "B, item {id}");
    }
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_waiting_commands_commit_as_one_batch() {
    let dir = tempfile::tempdir().unwrap();
    waiting_commands_commit_as_one_batch(sqlite_db(&dir).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_waiting_commands_commit_as_one_batch() {
    let Some(db) = postgres_db("batch").await else {
        return;
    };
    waiting_commands_commit_as_one_batch(db).await;
}

/// A failing command in a batch rolls the batch back; its commands run again one at a time:
/// the failing one fails alone (nothing of it written or logged), the others commit.
async fn a_failing_command_splits_its_batch(db: Database) {
    let (a, items_a, b, items_b, gate) = two_hosts(&db).await;
    assert_eq!(items_b.value(6).await, Ok(0));
    let before = db.log_len().await.unwrap();
    let mut commands: Vec<Pending> = (1..=5).map(|id| set(&a, id, 200 + id)).collect();
    commands.push({
        let a = a.clone();
        Box::pin(async move { a.run(FailAfterWrite { id: 6 }).await.map(|()| -1) })
    });
    commands.extend((7..=10).map(|id| set(&a, id, 200 + id)));
    let results = queued_behind_a_held_transaction(&a, &gate, commands).await;
    for (i, result) in results.iter().enumerate() {
        if i == 5 {
            assert_eq!(result.as_ref().unwrap_err().kind(), ErrorKind::Rejected);
        } else {
            assert_eq!(result, &Ok(0), "command {i}");
        }
    }
    let stats = a.stats();
    assert_eq!(stats.batches_split, 1);
    assert_eq!(stats.batches, 12, "held, the failed batch, then ten alone");
    assert_eq!((stats.commands, stats.command_errors), (10, 1));
    assert_eq!(db.log_len().await.unwrap(), before + 10);
    b.catch_up().await.unwrap();
    for id in (1..=5).chain(7..=10) {
        assert_eq!(items_b.value(id).await, Ok(200 + id), "B, item {id}");
        assert_eq!(items_a.value(id).await, Ok(200 + id), "A, item {id}");
    }
    // Nothing of the failed command: a fresh read sees 0.
    items_a.invalidate_value(6);
    assert_eq!(items_a.value(6).await, Ok(0));
    assert_eq!(items_b.value(6).await, Ok(0));
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_failing_command_splits_its_batch() {
    let dir = tempfile::tempdir().unwrap();
    a_failing_command_splits_its_batch(sqlite_db(&dir).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_failing_command_splits_its_batch() {
    let Some(db) = postgres_db("split").await else {
        return;
    };
    a_failing_command_splits_its_batch(db).await;
}

/// A handler that panics fails its command with `Unavailable`, alone or in a batch; the
/// others of its batch commit, the host's only transaction keeps running commands, and
/// nothing of the panicked one is committed.
async fn a_panicking_handler_fails_only_its_command(db: Database) {
    let (a, items_a, b, _, gate) = two_hosts(&db).await;
    let before = db.log_len().await.unwrap();
    let e = a.run(Panic).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.message().contains("on purpose"), "{e}");
    assert_eq!(a.run(SetValue { id: 2, value: 9 }).await, Ok(0));
    assert_eq!(items_a.value(2).await, Ok(9));
    let panics: Pending = {
        let a = a.clone();
        Box::pin(async move { a.run(Panic).await.map(|()| -1) })
    };
    let results =
        queued_behind_a_held_transaction(&a, &gate, vec![set(&a, 1, 5), panics, set(&a, 3, 5)])
            .await;
    assert_eq!(results[0], Ok(0));
    assert_eq!(
        results[1].as_ref().unwrap_err().kind(),
        ErrorKind::Unavailable
    );
    assert_eq!(results[2], Ok(0));
    assert_eq!(a.stats().batches_split, 1);
    assert_eq!(items_a.value(1).await, Ok(5));
    assert_eq!(db.log_len().await.unwrap(), before + 4);
    a.stop().await;
    b.stop().await;
    // A stopped host refuses commands.
    let e = a.run(SetValue { id: 2, value: 10 }).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_panicking_handler_fails_only_its_command() {
    let dir = tempfile::tempdir().unwrap();
    a_panicking_handler_fails_only_its_command(sqlite_db(&dir).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_panicking_handler_fails_only_its_command() {
    let Some(db) = postgres_db("panic").await else {
        return;
    };
    a_panicking_handler_fails_only_its_command(db).await;
}
