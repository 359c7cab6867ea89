//! `Tx::defer`: a write sent without waiting for its answer, answered at the commit. A
//! command of deferred writes costs one round trip; a deferred write that fails fails its
//! command, alone, and nothing of it is written.

use coherent_ops::{Database, ErrorKind};

use coherent_ops::Host;

use crate::support::{create_items, database_url, fresh_schema, host, Items};

use crate::batches::{queued_behind_a_held_transaction, two_hosts, Pending};
use crate::inproc::{postgres_db, sqlite_db};
use crate::support::{
    DeferredConflict, DeferredReturning, DeferredSet, FinishWrite, Finishing, FusedWrite, Fusing,
};

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

/// A last write whose answer is the output (`Tx::finish_sql`) commits alone with its
/// operation's row, which logs the statement's answer: applied on the other host like any
/// other. A write that matches no row answers `None` and writes nothing; one that matches
/// two, or answers two columns, fails with nothing written. After a read it runs in the
/// transaction; in a batch, too. What the handler does after it cannot undo it: the
/// logged output is answered. A connection that fails under it leaves the outcome unknown,
/// and the host flushes its cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_finishing_writes() {
    let Some(db) = postgres_db("finish").await else {
        return;
    };
    let (a, items_a, b, items_b, gate) = two_hosts(&db).await;
    // The mark of this test's statements (no other test's, or run's).
    let marker = fresh_schema("finishing");
    let finish = |how, id, value| FinishWrite {
        id,
        value,
        how,
        marker: marker.clone(),
    };
    for id in [1, 2] {
        assert_eq!(items_a.value(id).await, Ok(0));
        assert_eq!(items_b.value(id).await, Ok(0));
    }
    let before = db.log_len().await.unwrap();
    let fused = a.stats().fused;

    // Alone: one statement, logged with the statement's answer, applied on B.
    assert_eq!(a.run(finish(Finishing::Update, 1, 31)).await, Ok(31));
    assert_eq!(items_a.value(1).await, Ok(31));
    b.catch_up().await.unwrap();
    assert_eq!(items_b.value(1).await, Ok(31));
    assert_eq!(a.stats().fused, fused + 1, "{:?}", a.stats());
    assert_eq!(db.log_len().await.unwrap(), before + 1);

    // No such item: the handler's own error, nothing logged.
    let e = a.run(finish(Finishing::Update, 99, 1)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert_eq!(db.log_len().await.unwrap(), before + 1);

    // Two rows: refused by the server, nothing written or logged.
    let e = a.run(finish(Finishing::UpTo, 2, 77)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Database, "{e}");
    assert!(e.message().contains("more than one row"), "{e}");
    assert_eq!(db.log_len().await.unwrap(), before + 1);
    // Two columns: the handler's mistake, said before anything is sent.
    let e = a
        .run(finish(Finishing::TwoColumns, 2, 77))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::BadCommand, "{e}");
    assert!(e.message().contains("one column"), "{e}");
    items_a.invalidate_value(1);
    items_a.invalidate_value(2);
    assert_eq!(items_a.value(1).await, Ok(31));
    assert_eq!(items_a.value(2).await, Ok(0));

    // After a read: in the transaction, committed with its row as any command.
    assert_eq!(a.run(finish(Finishing::AfterRead, 2, 32)).await, Ok(32));
    assert_eq!(a.stats().fused, fused + 1);
    assert_eq!(db.log_len().await.unwrap(), before + 2);
    b.catch_up().await.unwrap();
    assert_eq!(items_b.value(2).await, Ok(32));

    // What the handler does after cannot undo it: the logged output is answered.
    assert_eq!(a.run(finish(Finishing::Changed, 1, 33)).await, Ok(33));
    assert_eq!(a.run(finish(Finishing::ThenDefer, 1, 34)).await, Ok(34));
    assert_eq!(items_a.value(1).await, Ok(34));
    assert_eq!(a.stats().fused, fused + 3);
    assert_eq!(db.log_len().await.unwrap(), before + 4);
    b.catch_up().await.unwrap();
    assert_eq!(items_b.value(1).await, Ok(34));

    // In a batch: in the batch's transaction, each logged with its handler's output.
    let set = |id: i64| -> Pending {
        let a = a.clone();
        Box::pin(async move {
            a.run(FinishWrite {
                id,
                value: 400 + id,
                how: Finishing::Update,
                marker: String::new(),
            })
            .await
        })
    };
    let results = queued_behind_a_held_transaction(&a, &gate, vec![set(3), set(4), set(5)]).await;
    assert_eq!(results, vec![Ok(403), Ok(404), Ok(405)]);
    assert_eq!(a.stats().fused, fused + 3);
    // The held command and the three.
    assert_eq!(db.log_len().await.unwrap(), before + 4 + 1 + 3);
    b.catch_up().await.unwrap();
    for id in [3, 4, 5] {
        assert_eq!(items_a.value(id).await, Ok(400 + id), "A, item {id}");
        assert_eq!(items_b.value(id).await, Ok(400 + id), "B, item {id}");
    }

    // Its backend terminated while it runs: the server said the session ended, so nothing
    // ran, and the host runs it again on another connection (where it does not wait).
    assert_eq!(items_a.value(6).await, Ok(0));
    let retried = a.stats().commits_retried;
    let sleeping = tokio::spawn({
        let (a, command) = (a.clone(), finish(Finishing::Sleeps, 6, 36));
        async move { a.run(command).await }
    });
    let admin = db.postgres_pool().unwrap().get().await.unwrap();
    let pid = waiting_backend(&admin, &marker, "PgSleep", &sleeping).await;
    admin
        .execute("UPDATE items SET value = 1 WHERE id = 10", &[])
        .await
        .unwrap();
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    assert_eq!(sleeping.await.unwrap(), Ok(36));
    assert_eq!(a.stats().commits_retried, retried + 1, "{:?}", a.stats());
    assert_eq!(items_a.value(6).await, Ok(36));
    b.catch_up().await.unwrap();
    assert_eq!(items_b.value(6).await, Ok(36));
    a.stop().await;
    b.stop().await;
}

/// The pid of the backend that runs the statement marked `marker`, once it waits on
/// `event` (`PgSleep`, `advisory`); fails if the command answers first, or after a minute.
async fn waiting_backend<T: std::fmt::Debug>(
    admin: &tokio_postgres::Client,
    marker: &str,
    event: &str,
    command: &tokio::task::JoinHandle<T>,
) -> i32 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let row = admin
            .query_opt(
                "SELECT pid FROM pg_stat_activity \
                 WHERE query LIKE '%-- ' || $1 || '%' AND wait_event = $2 \
                 AND pid <> pg_backend_pid()",
                &[&marker, &event],
            )
            .await
            .unwrap();
        if let Some(row) = row {
            return row.get(0);
        }
        assert!(
            !command.is_finished(),
            "the command answered before it waited"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "no backend waited on {event} within a minute"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// A host over a proxy that cuts the connections that carried `marker`; the database
/// without the proxy, in the same schema.
async fn behind_a_cutter(marker: &str) -> Option<(Database, Host, Items, Cutter)> {
    let url = database_url()?;
    let schema = fresh_schema("finish_cut");
    let direct = Database::postgres_in_schema(&url, &schema).await.unwrap();
    create_items(&direct, 10).await;
    let config: tokio_postgres::Config = url.parse().unwrap();
    let (Some(tokio_postgres::config::Host::Tcp(server)), Some(port)) =
        (config.get_hosts().first(), config.get_ports().first())
    else {
        eprintln!("skipped: DATABASE_URL names no TCP host");
        return None;
    };
    let target = tokio::net::lookup_host((server.as_str(), *port))
        .await
        .unwrap()
        .next()
        .unwrap();
    let cutter = Cutter::start(target, marker.as_bytes().to_vec()).await;
    let db = Database::postgres_in_schema(&through(&url, cutter.addr), &schema)
        .await
        .unwrap();
    let (a, items) = host(&db, |b| b).await;
    Some((direct, a, items, cutter))
}

/// The connection under a last write that commits alone (`Tx::finish_sql`) is cut with
/// no word from the server: the write may have committed, and its output is not known, so
/// the host cannot invalidate by it. The command fails (not run again), and the host
/// flushes its cache. (Here the backend is then ended: nothing committed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_finishing_write_cut_off_flushes_the_cache() {
    let marker = fresh_schema("cut");
    let Some((direct, a, items, cutter)) = behind_a_cutter(&marker).await else {
        return;
    };
    assert_eq!(items.value(6).await, Ok(0));
    let flushes = a.stats().flushes;
    let retried = a.stats().commits_retried;
    let sleeping = tokio::spawn({
        let a = a.clone();
        let command = FinishWrite {
            id: 6,
            value: 36,
            how: Finishing::Sleeps,
            marker: marker.clone(),
        };
        async move { a.run(command).await }
    });
    let admin = direct.postgres_pool().unwrap().get().await.unwrap();
    let pid = waiting_backend(&admin, &marker, "PgSleep", &sleeping).await;
    cutter.cut();
    let e = sleeping.await.unwrap().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Database, "{e}");
    assert_eq!(a.stats().flushes, flushes + 1, "{:?}", a.stats());
    assert_eq!(a.stats().commits_retried, retried, "not run again");
    // The backend still sleeps, and would commit when it wakes: ended here, unanswered.
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    assert_eq!(items.value(6).await, Ok(0));
    a.catch_up().await.unwrap();
    assert_eq!(a.stats().own_applied, 0, "{:?}", a.stats());
    a.stop().await;
}

/// The same cut, and the statement commits later, after the host flushed and read the
/// item again: the host applies its own operation when it reads it from the log, as it
/// would another host's, so its cache does not keep the value from before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_finishing_write_that_commits_after_its_cut_is_applied() {
    let marker = fresh_schema("late");
    let Some((direct, a, items, cutter)) = behind_a_cutter(&marker).await else {
        return;
    };
    assert_eq!(items.value(6).await, Ok(0));
    let admin = direct.postgres_pool().unwrap().get().await.unwrap();
    admin
        .execute("SELECT pg_advisory_lock(hashtext($1))", &[&marker])
        .await
        .unwrap();
    let waiting = tokio::spawn({
        let a = a.clone();
        let command = FinishWrite {
            id: 6,
            value: 36,
            how: Finishing::WaitsForLock,
            marker: marker.clone(),
        };
        async move { a.run(command).await }
    });
    let pid = waiting_backend(&admin, &marker, "advisory", &waiting).await;
    cutter.cut();
    waiting.await.unwrap().unwrap_err();
    // Read again after the flush, before the commit.
    assert_eq!(items.value(6).await, Ok(0));
    admin
        .execute("SELECT pg_advisory_unlock(hashtext($1))", &[&marker])
        .await
        .unwrap();
    // The backend commits, finds its client gone, and ends.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while admin
        .query_opt("SELECT 1 FROM pg_stat_activity WHERE pid = $1", &[&pid])
        .await
        .unwrap()
        .is_some()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the backend did not end"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let stored: i64 = admin
        .query_one("SELECT value FROM items WHERE id = 6", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored, 36, "the cut statement committed");
    a.catch_up().await.unwrap();
    assert_eq!(items.value(6).await, Ok(36));
    assert_eq!(a.stats().own_applied, 1, "{:?}", a.stats());
    a.stop().await;
}

/// `url` with its host and port replaced by `addr`.
fn through(url: &str, addr: std::net::SocketAddr) -> String {
    let start = url
        .find('@')
        .map_or_else(|| url.find("://").unwrap() + 3, |at| at + 1);
    let end = url[start..]
        .find(['/', '?'])
        .map_or(url.len(), |i| start + i);
    format!("{}{addr}{}", &url[..start], &url[end..])
}

/// A TCP proxy that cuts, on demand, the connections that carried `marker` (a statement's
/// text, in its `Parse` message): both sockets closed, the client hearing nothing from the
/// server.
struct Cutter {
    addr: std::net::SocketAddr,
    marked: std::sync::Arc<parking_lot::Mutex<Vec<tokio::sync::watch::Sender<bool>>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Cutter {
    async fn start(target: std::net::SocketAddr, marker: Vec<u8>) -> Cutter {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let marked = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
        let to_mark = marked.clone();
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = tokio::net::TcpStream::connect(target).await else {
                    continue;
                };
                let (mut ir, mut iw) = inbound.into_split();
                let (mut or, mut ow) = outbound.into_split();
                let (cut, mut cut_back) = tokio::sync::watch::channel(false);
                let mut cut_forth = cut.subscribe();
                // Each direction ends when cut, and drops its halves: both sockets close.
                tokio::spawn(async move {
                    tokio::select! {
                        _ = tokio::io::copy(&mut or, &mut iw) => {}
                        _ = cut_back.changed() => {}
                    }
                });
                let to_mark = to_mark.clone();
                let marker = marker.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    let mut cut = Some(cut);
                    loop {
                        let n = tokio::select! {
                            read = ir.read(&mut buf) => match read {
                                Ok(n) if n > 0 => n,
                                _ => break,
                            },
                            _ = cut_forth.changed() => break,
                        };
                        if buf[..n].windows(marker.len()).any(|w| *w == marker[..]) {
                            if let Some(cut) = cut.take() {
                                to_mark.lock().push(cut);
                            }
                        }
                        if ow.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        Cutter {
            addr,
            marked,
            accept,
        }
    }

    /// Cuts every connection that carried the marker.
    fn cut(&self) {
        for cut in self.marked.lock().drain(..) {
            let _ = cut.send(true);
        }
    }
}

impl Drop for Cutter {
    fn drop(&mut self) {
        self.accept.abort();
    }
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
