//! The service the tests run on every host: `items(id, value)` with a compute method per
//! item and one over two items (a diamond when both are the same), and the commands that
//! write it.

use std::path::Path;
use std::sync::Arc;

use coherent::prelude::*;
use coherent_ops::{Command, CommandError, Database, Handler, Host, Tx};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// `DATABASE_URL`, or `None` (and a line saying the test skipped).
pub(crate) fn database_url() -> Option<String> {
    match std::env::var("DATABASE_URL") {
        Ok(url) => Some(url),
        Err(_) => {
            eprintln!("skipped: DATABASE_URL is not set");
            None
        }
    }
}

/// A schema name no other test uses.
pub(crate) fn fresh_schema(test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("t_{test}_{}_{nanos}", std::process::id())
}

/// Where the service reads.
#[derive(Clone)]
pub(crate) enum Reader {
    Sqlite(Arc<Mutex<rusqlite::Connection>>),
    Postgres(deadpool_postgres::Pool),
}

impl Reader {
    pub(crate) fn for_db(db: &Database) -> Self {
        match (db.sqlite_path(), db.postgres_pool()) {
            (Some(path), _) => Reader::Sqlite(Arc::new(Mutex::new(open_sqlite(path)))),
            (None, Some(pool)) => Reader::Postgres(pool.clone()),
            (None, None) => unreachable!(),
        }
    }
}

pub(crate) fn open_sqlite(path: &Path) -> rusqlite::Connection {
    let c = rusqlite::Connection::open(path).unwrap();
    c.execute_batch("PRAGMA journal_mode = WAL; PRAGMA busy_timeout = 10000;")
        .unwrap();
    c
}

/// Creates the `items` table with `n` items of value 0.
pub(crate) async fn create_items(db: &Database, n: i64) {
    match (db.sqlite_path(), db.postgres_pool()) {
        (Some(path), _) => {
            let c = open_sqlite(path);
            c.execute_batch(
                "CREATE TABLE IF NOT EXISTS items (id INTEGER PRIMARY KEY, value INTEGER NOT NULL)",
            )
            .unwrap();
            for id in 1..=n {
                c.execute(
                    "INSERT OR IGNORE INTO items VALUES (?1, 0)",
                    rusqlite::params![id],
                )
                .unwrap();
            }
        }
        (None, Some(pool)) => {
            let c = pool.get().await.unwrap();
            c.batch_execute(
                "CREATE TABLE IF NOT EXISTS items (id BIGINT PRIMARY KEY, value BIGINT NOT NULL)",
            )
            .await
            .unwrap();
            for id in 1..=n {
                c.execute(
                    "INSERT INTO items VALUES ($1, 0) ON CONFLICT DO NOTHING",
                    &[&id],
                )
                .await
                .unwrap();
            }
        }
        (None, None) => unreachable!(),
    }
}

#[derive(Clone, ComputeService)]
pub(crate) struct Items {
    pub(crate) handle: ServiceHandle,
    pub(crate) reader: Reader,
}

#[compute_service]
impl Items {
    #[compute]
    pub(crate) async fn value(&self, id: i64) -> Result<i64, String> {
        match &self.reader {
            Reader::Sqlite(c) => c
                .lock()
                .query_row(
                    "SELECT value FROM items WHERE id = ?1",
                    rusqlite::params![id],
                    |r| r.get(0),
                )
                .map_err(|e| e.to_string()),
            Reader::Postgres(pool) => {
                let c = pool.get().await.map_err(|e| e.to_string())?;
                let row = c
                    .query_one("SELECT value FROM items WHERE id = $1", &[&id])
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(row.get(0))
            }
        }
    }

    /// A diamond over `value`: `pair(a, a)` reads one item twice.
    #[compute]
    pub(crate) async fn pair(&self, a: i64, b: i64) -> Result<i64, String> {
        Ok(self.value(a).await? * 1000 + self.value(b).await?)
    }
}

/// Sets an item's value; answers the previous one.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SetValue {
    pub(crate) id: i64,
    pub(crate) value: i64,
}

impl Command for SetValue {
    const NAME: &'static str = "test.set_value";
    type Output = i64;
}

/// Writes nothing; answers who sent it (`Tx::caller`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Whoami;

impl Command for Whoami {
    const NAME: &'static str = "test.whoami";
    type Output = Option<String>;
}

impl Handler<Whoami> for Items {
    async fn execute(&self, _: &Whoami, tx: &mut Tx<'_>) -> Result<Option<String>, CommandError> {
        Ok(tx.caller().map(|i| i.name().to_owned()))
    }

    fn invalidate(&self, _: &Whoami, _: &Option<String>) {}
}

/// Always fails after writing: nothing may be committed or logged.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FailAfterWrite {
    pub(crate) id: i64,
}

/// The application's own error for [`FailAfterWrite`]: the detail its refusal carries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum Refusal {
    AfterWrite { id: i64 },
}

impl Command for FailAfterWrite {
    const NAME: &'static str = "test.fail_after_write";
    type Output = ();
}

impl Handler<SetValue> for Items {
    async fn execute(&self, c: &SetValue, tx: &mut Tx<'_>) -> Result<i64, CommandError> {
        if let Some(conn) = tx.sqlite() {
            let old: i64 = conn.query_row(
                "SELECT value FROM items WHERE id = ?1",
                rusqlite::params![c.id],
                |r| r.get(0),
            )?;
            conn.execute(
                "UPDATE items SET value = ?2 WHERE id = ?1",
                rusqlite::params![c.id, c.value],
            )?;
            return Ok(old);
        }
        let t = tx.require_postgres()?;
        let row = t
            .query_opt("SELECT value FROM items WHERE id = $1 FOR UPDATE", &[&c.id])
            .await?
            .ok_or_else(|| CommandError::not_found(format!("item {}", c.id)))?;
        t.execute(
            "UPDATE items SET value = $2 WHERE id = $1",
            &[&c.id, &c.value],
        )
        .await?;
        Ok(row.get(0))
    }

    fn invalidate(&self, c: &SetValue, _old: &i64) {
        self.invalidate_value(c.id);
    }
}

impl Handler<FailAfterWrite> for Items {
    async fn execute(&self, c: &FailAfterWrite, tx: &mut Tx<'_>) -> Result<(), CommandError> {
        if let Some(conn) = tx.sqlite() {
            conn.execute(
                "UPDATE items SET value = -1 WHERE id = ?1",
                rusqlite::params![c.id],
            )?;
        } else {
            tx.require_postgres()?
                .execute("UPDATE items SET value = -1 WHERE id = $1", &[&c.id])
                .await?;
        }
        Err(CommandError::rejected("refused after writing")
            .with_detail(&Refusal::AfterWrite { id: c.id }))
    }

    fn invalidate(&self, c: &FailAfterWrite, _: &()) {
        self.invalidate_value(c.id);
    }
}

/// Sets an item's value with a deferred UPDATE, then (when `read_back`) reads it in the
/// same transaction, which must see it: a deferred statement is sent before the next one.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct DeferredSet {
    pub(crate) id: i64,
    pub(crate) value: i64,
    pub(crate) read_back: bool,
}

impl Command for DeferredSet {
    const NAME: &'static str = "test.deferred_set";
    type Output = Option<i64>;
}

/// Sets item `id` to -1 with a deferred UPDATE, then inserts `id` again with a deferred
/// INSERT: the primary key refuses it at the server, after the handler has returned.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct DeferredConflict {
    pub(crate) id: i64,
}

impl Command for DeferredConflict {
    const NAME: &'static str = "test.deferred_conflict";
    type Output = ();
}

impl Handler<DeferredSet> for Items {
    async fn execute(&self, c: &DeferredSet, tx: &mut Tx<'_>) -> Result<Option<i64>, CommandError> {
        // Prepared without opening the transaction: the UPDATE waits in the `Tx` until
        // the read below opens it (or the commit does), and goes before the read.
        let update = tx
            .prepare("UPDATE items SET value = $2 WHERE id = $1")
            .await?;
        tx.defer(&update, vec![Box::new(c.id), Box::new(c.value)])?;
        if !c.read_back {
            return Ok(None);
        }
        let row = tx
            .require_postgres()?
            .query_one("SELECT value FROM items WHERE id = $1", &[&c.id])
            .await?;
        Ok(Some(row.get(0)))
    }

    fn invalidate(&self, c: &DeferredSet, _: &Option<i64>) {
        self.invalidate_value(c.id);
    }
}

impl Handler<DeferredConflict> for Items {
    async fn execute(&self, c: &DeferredConflict, tx: &mut Tx<'_>) -> Result<(), CommandError> {
        let client = tx.require_postgres()?;
        let update = client
            .prepare_cached("UPDATE items SET value = -1 WHERE id = $1")
            .await?;
        let insert = client
            .prepare_cached("INSERT INTO items (id, value) VALUES ($1, 0)")
            .await?;
        tx.defer(&update, vec![Box::new(c.id)])?;
        tx.defer(&insert, vec![Box::new(c.id)])?;
        Ok(())
    }

    fn invalidate(&self, c: &DeferredConflict, _: &()) {
        self.invalidate_value(c.id);
    }
}

/// One write deferred with its text (`Tx::defer_sql`): the command can go as one
/// statement with its operation's row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FusedWrite {
    pub(crate) id: i64,
    pub(crate) value: i64,
    pub(crate) how: Fusing,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(crate) enum Fusing {
    /// `UPDATE items SET value`: fused.
    Update,
    /// `INSERT INTO items` of an id that is there: fused, and refused by the primary key.
    InsertTaken,
    /// `LOCK TABLE items`: cannot stand in a `WITH`, so it runs in a transaction.
    Lock,
    /// The UPDATE with one parameter of its two: refused at `defer_sql`.
    TooFewParameters,
}

impl Command for FusedWrite {
    const NAME: &'static str = "test.fused_write";
    type Output = ();
}

impl Handler<FusedWrite> for Items {
    async fn execute(&self, c: &FusedWrite, tx: &mut Tx<'_>) -> Result<(), CommandError> {
        match c.how {
            Fusing::Update => {
                tx.defer_sql(
                    "UPDATE items SET value = $2 WHERE id = $1 -- a comment at the end",
                    vec![Box::new(c.id), Box::new(c.value)],
                )
                .await
            }
            Fusing::InsertTaken => {
                tx.defer_sql(
                    "INSERT INTO items (id, value) VALUES ($1, $2);",
                    vec![Box::new(c.id), Box::new(c.value)],
                )
                .await
            }
            Fusing::Lock => {
                tx.defer_sql("LOCK TABLE items IN ROW EXCLUSIVE MODE", Vec::new())
                    .await
            }
            Fusing::TooFewParameters => {
                tx.defer_sql(
                    "UPDATE items SET value = $2 WHERE id = $1",
                    vec![Box::new(c.id)],
                )
                .await
            }
        }
    }

    fn invalidate(&self, c: &FusedWrite, _: &()) {
        self.invalidate_value(c.id);
    }
}

/// A last write whose answer is the output (`Tx::finish_sql`): the item's new value.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FinishWrite {
    pub(crate) id: i64,
    pub(crate) value: i64,
    pub(crate) how: Finishing,
    /// A comment in the statement's text, by which a test finds its backend.
    pub(crate) marker: String,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(crate) enum Finishing {
    /// `UPDATE ... RETURNING to_json(value)`; an id that is not there answers not found.
    Update,
    /// A read through `Tx::postgres` first: the write runs in the transaction.
    AfterRead,
    /// Every item up to `id`: two rows or more, refused.
    UpTo,
    /// The handler answers its value plus 1,000 after the write.
    Changed,
    /// The handler tries a deferred write after it, and fails with that error.
    ThenDefer,
    /// `RETURNING id, value`: two columns, refused.
    TwoColumns,
    /// Waits in the server while item 10's value is 0, up to a minute.
    Sleeps,
    /// Waits in the server for the advisory lock `hashtext(marker)`, while it is held
    /// elsewhere.
    WaitsForLock,
}

impl Command for FinishWrite {
    const NAME: &'static str = "test.finish_write";
    type Output = i64;
}

impl Handler<FinishWrite> for Items {
    async fn execute(&self, c: &FinishWrite, tx: &mut Tx<'_>) -> Result<i64, CommandError> {
        let params =
            || -> Vec<coherent_ops::DeferredParam> { vec![Box::new(c.id), Box::new(c.value)] };
        let update = "UPDATE items SET value = $2 WHERE id = $1 RETURNING to_json(value)";
        let written: Option<i64> = match c.how {
            Finishing::Update | Finishing::Changed | Finishing::ThenDefer => {
                tx.finish_sql(update, params()).await?
            }
            Finishing::AfterRead => {
                tx.require_postgres()?
                    .query_one("SELECT value FROM items WHERE id = $1", &[&c.id])
                    .await?;
                tx.finish_sql(update, params()).await?
            }
            Finishing::UpTo => {
                tx.finish_sql(
                    "UPDATE items SET value = $2 WHERE id <= $1 RETURNING to_json(value)",
                    params(),
                )
                .await?
            }
            Finishing::TwoColumns => {
                tx.finish_sql(
                    "UPDATE items SET value = $2 WHERE id = $1 RETURNING id, value",
                    params(),
                )
                .await?
            }
            Finishing::Sleeps | Finishing::WaitsForLock => {
                let wait = match c.how {
                    Finishing::Sleeps => {
                        "pg_sleep(CASE WHEN (SELECT value FROM items WHERE id = 10) = 0 \
                         THEN 60 ELSE 0 END)"
                    }
                    _ => &format!("pg_advisory_xact_lock(hashtext('{}'))", c.marker),
                };
                let sql = format!(
                    "UPDATE items SET value = $2 WHERE id = $1 \
                     AND (SELECT true FROM {wait}) -- {}\n\
                     RETURNING to_json(value)",
                    c.marker
                );
                tx.finish_sql(&sql, params()).await?
            }
        };
        let value = written.ok_or_else(|| CommandError::not_found(format!("item {}", c.id)))?;
        match c.how {
            Finishing::Changed => Ok(value + 1_000),
            Finishing::ThenDefer => {
                tx.defer_sql(
                    "UPDATE items SET value = 0 WHERE id = $1",
                    vec![Box::new(c.id)],
                )
                .await?;
                Ok(value)
            }
            _ => Ok(value),
        }
    }

    fn invalidate(&self, c: &FinishWrite, _: &i64) {
        self.invalidate_value(c.id);
    }
}

/// Defers a statement that returns rows: refused.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct DeferredReturning {
    pub(crate) id: i64,
}

impl Command for DeferredReturning {
    const NAME: &'static str = "test.deferred_returning";
    type Output = ();
}

impl Handler<DeferredReturning> for Items {
    async fn execute(&self, c: &DeferredReturning, tx: &mut Tx<'_>) -> Result<(), CommandError> {
        let update = tx
            .require_postgres()?
            .prepare_cached("UPDATE items SET value = 5 WHERE id = $1 RETURNING value")
            .await?;
        tx.defer(&update, vec![Box::new(c.id)])
    }

    fn invalidate(&self, c: &DeferredReturning, _: &()) {
        self.invalidate_value(c.id);
    }
}

/// A host with the `Items` service over `db`, its own registry (its own cache).
pub(crate) async fn host(
    db: &Database,
    configure: impl FnOnce(coherent_ops::HostBuilder) -> coherent_ops::HostBuilder,
) -> (Host, Items) {
    let registry = Registry::new();
    let items = Items {
        handle: ServiceHandle::with_registry(&registry),
        reader: Reader::for_db(db),
    };
    let builder = Host::builder(db.clone())
        .registry(&registry)
        .command::<SetValue>(items.clone())
        .command::<Whoami>(items.clone())
        .command::<FailAfterWrite>(items.clone())
        .command::<DeferredSet>(items.clone())
        .command::<DeferredConflict>(items.clone())
        .command::<DeferredReturning>(items.clone())
        .command::<FusedWrite>(items.clone())
        .command::<FinishWrite>(items.clone());
    let host = configure(builder).start().await.unwrap();
    (host, items)
}

/// A plain connection to `url` in `schema` (PostgreSQL): what a `psql` session or another
/// service would hold.
pub(crate) async fn connect_in_schema(url: &str, schema: &str) -> tokio_postgres::Client {
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

/// Drops the replication slot `name`, as the server does with a slot past
/// `max_slot_wal_keep_size`: the connection streaming it (a feed that still runs) is
/// terminated first, and the slot dropped before a feed takes it again (tried until it
/// is), failing after a generous bound.
pub(crate) async fn drop_slot_when_free(client: &tokio_postgres::Client, name: &str) {
    let drop = async {
        loop {
            let _ = client
                .execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                     WHERE slot_name = $1 AND active",
                    &[&name],
                )
                .await;
            let _ = client
                .execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                     WHERE slot_name = $1 AND NOT active",
                    &[&name],
                )
                .await;
            let gone = client
                .query_opt(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
                    &[&name],
                )
                .await
                .unwrap()
                .is_none();
            if gone {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(60), drop)
        .await
        .unwrap_or_else(|_| panic!("the slot {name} was not let go of within 60 s"));
}

/// A TCP proxy whose connections can be black-holed: from then on, whatever either side
/// sends is dropped and neither is told (a link that died without a word).
pub(crate) struct BlackHole {
    pub(crate) addr: std::net::SocketAddr,
    dead: std::sync::Arc<std::sync::atomic::AtomicBool>,
    accept: tokio::task::JoinHandle<()>,
}

impl BlackHole {
    pub(crate) async fn start(target: std::net::SocketAddr) -> BlackHole {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let dead = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let gate = dead.clone();
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = tokio::net::TcpStream::connect(target).await else {
                    continue;
                };
                let (ir, iw) = inbound.into_split();
                let (or, ow) = outbound.into_split();
                for (mut from, mut to) in [(ir, ow), (or, iw)].map(|(r, w)| {
                    (
                        Box::new(r) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                        w,
                    )
                }) {
                    let gate = gate.clone();
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 16 * 1024];
                        while let Ok(n) = from.read(&mut buf).await {
                            if n == 0 {
                                break;
                            }
                            if gate.load(Ordering::SeqCst) {
                                continue;
                            }
                            if to.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                        // Black-holed: the other side never hears of an end.
                        if gate.load(Ordering::SeqCst) {
                            std::future::pending::<()>().await;
                        }
                    });
                }
            }
        });
        BlackHole { addr, dead, accept }
    }

    /// Drops everything from now on, both ways, on every connection, old and new.
    pub(crate) fn black_hole(&self) {
        self.dead.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for BlackHole {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
