//! `Tx::defer`: a write sent without waiting for its answer, answered at the commit. A
//! command of deferred writes costs one round trip; a deferred write that fails fails its
//! command, alone, and nothing of it is written.

use coherent_ops::{Database, ErrorKind};

use crate::batches::{queued_behind_a_held_transaction, two_hosts, Pending};
use crate::inproc::{postgres_db, sqlite_db};
use crate::support::{DeferredConflict, DeferredReturning, DeferredSet, FusedWrite, Fusing};

/// Deferred writes commit with their command, are seen by the handler's next statement,
/// and are applied on the other host; one that fails fails its command with the server's
/// error, nothing of that command is written or logged, and in a batch it fails alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_deferred_writes() {
    let Some(db) = postgres_db("deferred").await else {
        return;
    };
    let (a, items_a, b, items_b, gate) = two_hosts(&db).await;
    assert_eq!(items_a.value(1).await, Ok(0));
    assert_eq!(items_b.value(1).await, Ok(0));
    let before = db.log_len().await.unwrap();

    // Alone: committed, logged, read back inside, applied on B.
    let read = a
        .run(DeferredSet {
            id: 1,
            value: 11,
            read_back: true,
        })
        .await;
    assert_eq!(
        read,
        Ok(Some(11)),
        "the next statement sees the deferred write"
    );
    assert_eq!(items_a.value(1).await, Ok(11));
    b.catch_up().await.unwrap();
    assert_eq!(items_b.value(1).await, Ok(11));
    assert_eq!(db.log_len().await.unwrap(), before + 1);

    // Alone, failing at the server after the handler returned: the command fails with
    // the server's error (not "transaction aborted"), its first write is rolled back.
    let e = a.run(DeferredConflict { id: 1 }).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Database, "{e}");
    assert!(e.message().contains("duplicate key"), "{e}");
    items_a.invalidate_value(1);
    assert_eq!(
        items_a.value(1).await,
        Ok(11),
        "the deferred UPDATE rolled back"
    );
    assert_eq!(db.log_len().await.unwrap(), before + 1);

    // In a batch: four deferred commands and a failing one queue behind a held
    // transaction; the batch fails at its commit, splits, and the failing one fails alone.
    let set = |id: i64| -> Pending {
        let a = a.clone();
        Box::pin(async move {
            a.run(DeferredSet {
                id,
                value: 300 + id,
                read_back: false,
            })
            .await
            .map(|_| 0)
        })
    };
    let conflict: Pending = {
        let a = a.clone();
        Box::pin(async move { a.run(DeferredConflict { id: 5 }).await.map(|()| -1) })
    };
    let commands = vec![set(2), set(3), conflict, set(4), set(6)];
    let results = queued_behind_a_held_transaction(&a, &gate, commands).await;
    for (i, result) in results.iter().enumerate() {
        if i == 2 {
            let e = result.as_ref().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Database, "{e}");
        } else {
            assert_eq!(result, &Ok(0), "command {i}");
        }
    }
    assert_eq!(a.stats().batches_split, 1);
    // The held command, the two above, and four of the batch.
    assert_eq!(db.log_len().await.unwrap(), before + 1 + 1 + 4);
    b.catch_up().await.unwrap();
    for id in [2, 3, 4, 6] {
        assert_eq!(items_a.value(id).await, Ok(300 + id), "A, item {id}");
        assert_eq!(items_b.value(id).await, Ok(300 + id), "B, item {id}");
    }
    items_a.invalidate_value(5);
    assert_eq!(
        items_a.value(5).await,
        Ok(0),
        "nothing of the failed command"
    );

    // A statement that returns rows is refused (its rows would stall the connection).
    let e = a.run(DeferredReturning { id: 7 }).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::BadCommand, "{e}");
    items_a.invalidate_value(7);
    assert_eq!(items_a.value(7).await, Ok(0));
    a.stop().await;
    b.stop().await;
}

/// A command whose one write is deferred with its text goes as one statement with its
/// operation's row: committed, logged and applied on the other host like any other; when
/// the server refuses it, nothing is written or logged. A statement that cannot stand in a
/// `WITH` runs in a transaction instead, and a wrong number of parameters is the handler's
/// error at `defer_sql`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_fused_writes() {
    let Some(db) = postgres_db("fused").await else {
        return;
    };
    let (a, items_a, b, items_b, _gate) = two_hosts(&db).await;
    assert_eq!(items_a.value(1).await, Ok(0));
    assert_eq!(items_b.value(1).await, Ok(0));
    let before = db.log_len().await.unwrap();
    let fused = |how, id, value| FusedWrite { id, value, how };

    for value in [21, 22] {
        a.run(fused(Fusing::Update, 1, value)).await.unwrap();
        assert_eq!(items_a.value(1).await, Ok(value));
        b.catch_up().await.unwrap();
        assert_eq!(items_b.value(1).await, Ok(value));
    }
    assert_eq!(a.stats().fused, 2, "{:?}", a.stats());
    assert_eq!(db.log_len().await.unwrap(), before + 2);

    // Refused by the server: the command fails with its error, nothing is logged.
    let e = a.run(fused(Fusing::InsertTaken, 1, 99)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Database, "{e}");
    assert!(e.message().contains("duplicate key"), "{e}");
    assert_eq!(a.stats().fused, 3);
    assert_eq!(db.log_len().await.unwrap(), before + 2);
    items_a.invalidate_value(1);
    assert_eq!(items_a.value(1).await, Ok(22));

    // Not in a WITH: in a transaction, twice (the second time without trying).
    for _ in 0..2 {
        a.run(fused(Fusing::Lock, 1, 0)).await.unwrap();
    }
    assert_eq!(a.stats().fused, 3);
    assert_eq!(db.log_len().await.unwrap(), before + 4);

    let e = a
        .run(fused(Fusing::TooFewParameters, 1, 5))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::BadCommand, "{e}");
    assert!(e.message().contains("2 parameters, 1 given"), "{e}");
    assert_eq!(db.log_len().await.unwrap(), before + 4);
    items_a.invalidate_value(1);
    assert_eq!(items_a.value(1).await, Ok(22));
    a.stop().await;
    b.stop().await;
}

/// On SQLite there is no round trip to save: `defer` says the handler needs PostgreSQL,
/// and the command fails with nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_defer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db: Database = sqlite_db(&dir).await;
    let (a, items_a, b, _, _) = two_hosts(&db).await;
    let before = db.log_len().await.unwrap();
    let e = a
        .run(DeferredSet {
            id: 1,
            value: 1,
            read_back: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::WrongDatabase, "{e}");
    assert_eq!(db.log_len().await.unwrap(), before);
    assert_eq!(items_a.value(1).await, Ok(0));
    a.stop().await;
    b.stop().await;
}
