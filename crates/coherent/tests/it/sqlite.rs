//! A compute service over a SQLite file: a write through the service invalidates the cached
//! rows it changed and every computed built from them.

use std::sync::Arc;

use coherent::{compute_service, ComputeService, Registry, ServiceHandle};
use parking_lot::Mutex;
use rusqlite::{params, Connection, OptionalExtension};

use crate::support::Log;

type DbResult<T> = Result<T, Arc<str>>;

fn db_error(e: rusqlite::Error) -> Arc<str> {
    e.to_string().into()
}

#[derive(Clone, ComputeService)]
struct Accounts {
    handle: ServiceHandle,
    /// rusqlite connections are `Send` but not `Sync`; calls are short, a mutex is enough here.
    db: Arc<Mutex<Connection>>,
    log: Log,
}

#[compute_service]
impl Accounts {
    #[compute]
    async fn balance(&self, id: i64) -> DbResult<Option<i64>> {
        self.log.push(format!("balance({id})"));
        let db = self.db.lock();
        db.prepare_cached("SELECT balance FROM accounts WHERE id = ?1")
            .and_then(|mut q| q.query_row(params![id], |row| row.get(0)).optional())
            .map_err(db_error)
    }

    #[compute]
    async fn total(&self, a: i64, b: i64) -> DbResult<i64> {
        self.log.push(format!("total({a},{b})"));
        let a = self.balance(a).await?.unwrap_or(0);
        let b = self.balance(b).await?.unwrap_or(0);
        Ok(a + b)
    }
}

impl Accounts {
    fn open(path: &std::path::Path, log: &Log) -> Self {
        let db = Connection::open(path).unwrap();
        db.pragma_update(None, "journal_mode", "WAL").unwrap();
        db.execute_batch(
            "CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL);
             INSERT INTO accounts VALUES (1, 100), (2, 50);",
        )
        .unwrap();
        Self {
            handle: ServiceHandle::with_registry(&Registry::new()),
            db: Arc::new(Mutex::new(db)),
            log: log.clone(),
        }
    }

    fn transfer(&self, from: i64, to: i64, amount: i64) -> rusqlite::Result<()> {
        {
            let mut db = self.db.lock();
            let tx = db.transaction()?;
            tx.execute(
                "UPDATE accounts SET balance = balance - ?2 WHERE id = ?1",
                params![from, amount],
            )?;
            tx.execute(
                "UPDATE accounts SET balance = balance + ?2 WHERE id = ?1",
                params![to, amount],
            )?;
            tx.commit()?;
        }
        // After the commit, so that a recomputation reads the new rows.
        self.invalidate_balance(from);
        self.invalidate_balance(to);
        Ok(())
    }
}

#[tokio::test]
async fn sqlite_rows_are_cached_and_refreshed_after_a_write_through_the_service() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let accounts = Accounts::open(&dir.path().join("accounts.db"), &log);

    assert_eq!(accounts.total(1, 2).await.unwrap(), 150);
    assert_eq!(accounts.balance(1).await.unwrap(), Some(100));
    assert_eq!(
        log.take_sorted(),
        ["balance(1)", "balance(2)", "total(1,2)"]
    );

    accounts.transfer(1, 2, 30).unwrap();
    assert_eq!(accounts.balance(1).await.unwrap(), Some(70));
    assert_eq!(accounts.balance(2).await.unwrap(), Some(80));
    assert_eq!(accounts.total(1, 2).await.unwrap(), 150);
    assert_eq!(
        log.take_sorted(),
        ["balance(1)", "balance(2)", "total(1,2)"]
    );
}

#[tokio::test]
async fn a_missing_row_is_cached_until_it_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let accounts = Accounts::open(&dir.path().join("accounts.db"), &log);
    assert_eq!(accounts.balance(3).await.unwrap(), None);
    assert_eq!(accounts.balance(3).await.unwrap(), None);
    accounts
        .db
        .lock()
        .execute("INSERT INTO accounts VALUES (3, 5)", [])
        .unwrap();
    accounts.invalidate_balance(3);
    assert_eq!(accounts.balance(3).await.unwrap(), Some(5));
    assert_eq!(log.take(), ["balance(3)", "balance(3)"]);
}

#[tokio::test]
async fn a_database_error_is_returned_and_cached_as_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let accounts = Accounts::open(&dir.path().join("accounts.db"), &log);
    accounts
        .db
        .lock()
        .execute_batch("DROP TABLE accounts")
        .unwrap();
    let error = accounts.balance(1).await.unwrap_err();
    assert!(error.contains("no such table"), "{error}");
    assert!(accounts.total(1, 2).await.is_err());
    assert_eq!(log.take_sorted(), ["balance(1)", "total(1,2)"]);
}
