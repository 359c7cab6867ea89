//! The database the commands write to, and the operation log in it: the pipeline's
//! transaction, the log's tables, appending, reading (`log`), heartbeats, trimming.
//!
//! ## Positions and cursors
//!
//! Every operation has a *position* in the log (PostgreSQL: the id of the transaction that
//! wrote it; SQLite: its id). A host reads what it has not read yet, from its cursor, and
//! moves the cursor past what can no longer appear: see [`log`] for the argument. Sequence
//! ids would not do on PostgreSQL: they are taken in insert order, not commit order, and a
//! reader that moved past id 11 while 10 was still uncommitted would skip 10 for good.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{params, Connection, OptionalExtension};

mod background;
mod log;
pub(crate) mod tls;

pub(crate) use background::Background;

pub(crate) use log::{Cursor, Reading};

use crate::command::BoxFuture;
use crate::error::{CommandError, ErrorKind};

/// Microseconds since the Unix epoch, by this machine's wall clock: what a host reports
/// (when it applied an operation), never what the cluster decides by (see [`PG_NOW`]).
pub(crate) fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// [`PG_NOW`]'s text, for `concat!`.
macro_rules! pg_now {
    () => {
        "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
    };
}

/// The database's clock, in µs since the Unix epoch, as PostgreSQL reads it: for
/// `logged_at` and `seen_at`, and the cutoffs they are compared with (which hosts are
/// alive, what trimming may delete). Hosts' clocks disagree (issue 30, hole 3: a host
/// whose clock was 5 s behind dropped out of the others' acknowledgement waits, and one an
/// hour off had its row, or the others' rows and operations, trimmed while alive); the one
/// database they share reads one clock, so every comparison is between readings of it.
const PG_NOW: &str = pg_now!();

/// [`SQLITE_NOW`]'s text, for `concat!`.
macro_rules! sqlite_now {
    () => {
        "CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)"
    };
}

/// The database's clock on SQLite, as [`PG_NOW`] (to the millisecond: `julianday('now')`;
/// `unixepoch('subsec')` needs SQLite 3.42). SQLite's clock is the machine's, which every
/// process sharing the file reads alike, so `now_micros()` in each host would do as well;
/// it is read in the statement all the same, so that both engines follow one rule and no
/// host's own idea of the time (such as the `HostBuilder::clock_skew` test hook) reaches
/// the liveness of hosts or trimming.
const SQLITE_NOW: &str = sqlite_now!();

/// Connections of a PostgreSQL `Database`'s pool: the host's transactions, its reads of
/// the log, and whatever the application reads through [`Database::postgres_pool`].
const POOL_SIZE: usize = 16;

/// How [`Database::postgres_with`] connects: the schema every connection works in (default
/// `public`) and how many connections the pool of commands and reads holds (default 16;
/// the log's listener, and a change feed, hold one more each). A host runs
/// [`HostBuilder::transactions`](crate::HostBuilder::transactions) commands at once (8 by
/// default): keep the pool larger, for the log's reads and the application's own.
///
/// Connections are plain unless [`tls`](Self::tls) is given (feature `tls`).
#[derive(Clone, Debug)]
pub struct PostgresOptions {
    schema: String,
    pool_size: usize,
    tls: tls::Tls,
}

impl Default for PostgresOptions {
    fn default() -> Self {
        Self {
            schema: "public".to_owned(),
            pool_size: POOL_SIZE,
            tls: tls::Tls::Plain,
        }
    }
}

impl PostgresOptions {
    /// The schema every connection works in, created if missing (letters, digits and
    /// `_`): one database can hold several independent clusters.
    pub fn schema(mut self, schema: &str) -> Self {
        self.schema = schema.to_owned();
        self
    }

    /// How many connections the pool holds at most (at least 1).
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// Speaks TLS to the server, with rustls and `config` (its trusted roots, a client
    /// certificate if the server asks for one): every connection of the `Database` (the
    /// pool's, the notifier's listener, the change feed's SQL connection and its
    /// replication stream). The URL's `sslmode` says how much is required: `prefer` (the
    /// default) goes on in the clear with a server that does not speak TLS, `require`
    /// refuses it; either way a server that speaks TLS must show a certificate that
    /// `config`'s roots vouch for, for the URL's host name. Without this, connections are
    /// plain, and a URL with `sslmode=require` fails to open.
    ///
    /// ```no_run
    /// # async fn open() -> Result<(), Box<dyn std::error::Error>> {
    /// use coherent_ops::rustls::{pki_types::pem::PemObject, pki_types::CertificateDer};
    /// use coherent_ops::rustls::{ClientConfig, RootCertStore};
    /// use coherent_ops::{Database, PostgresOptions};
    ///
    /// let mut roots = RootCertStore::empty();
    /// for cert in CertificateDer::pem_file_iter("/etc/ssl/certs/db-ca.pem")? {
    ///     roots.add(cert?)?;
    /// }
    /// let tls = ClientConfig::builder()
    ///     .with_root_certificates(roots)
    ///     .with_no_client_auth();
    /// let db = Database::postgres_with(
    ///     "postgres://app@db.internal/app?sslmode=require",
    ///     PostgresOptions::default().tls(tls),
    /// )
    /// .await?;
    /// # let _ = db; Ok(()) }
    /// ```
    #[cfg(feature = "tls")]
    pub fn tls(mut self, config: tokio_rustls::rustls::ClientConfig) -> Self {
        self.tls = tls::Tls::rustls(config);
        self
    }
}

/// Where commands write, and where the operation log lives: one SQLite file shared by the
/// processes of one machine, or one PostgreSQL database (and schema) shared by every host.
/// Cloning is cheap and shares the connections.
#[derive(Clone)]
pub struct Database {
    pub(crate) inner: Arc<Engine>,
}

pub(crate) enum Engine {
    Sqlite(Sqlite),
    Postgres(Postgres),
}

pub(crate) struct Sqlite {
    path: PathBuf,
    /// Commands run one at a time per process (SQLite has one writer at a time anyway).
    writer: tokio::sync::Mutex<Connection>,
    /// Log reads, heartbeats and trimming.
    reader: parking_lot::Mutex<Connection>,
    /// What the hosts seal their messages with: the key of `coherent_secrets` (see
    /// [`seal`](crate::seal)).
    seal: crate::seal::Seal,
}

pub(crate) struct Postgres {
    pub(crate) pool: deadpool_postgres::Pool,
    pub(crate) config: tokio_postgres::Config,
    /// How every connection to the server speaks TLS.
    pub(crate) tls: tls::Tls,
    pub(crate) schema: String,
    /// The `LISTEN`/`NOTIFY` channel: one per schema, so that clusters in other schemas of
    /// the same database never hear each other.
    pub(crate) channel: String,
    /// What the hosts seal their messages with: the key of `coherent_secrets` (see
    /// [`seal`](crate::seal)).
    seal: crate::seal::Seal,
    /// The fused statement built for each write of [`Tx::defer_sql`] and [`Tx::finish_sql`]
    /// (see [`Postgres::send_fused`]), by [`Fusion`] and the write's text; `None` for a
    /// write that cannot stand in a `WITH`, not tried again. Built once: the text is
    /// rewritten and formatted, which cost more per command than the rest of sending it.
    fused_texts: parking_lot::Mutex<[FusedTexts; 2]>,
    /// The threads that drive the pool's connections and run the hosts' own work (see
    /// [`background`]). Last: dropped after the pool.
    pub(crate) background: Background,
}

impl Postgres {
    /// Runs a command whose one write is `queued` (deferred with its text), and which
    /// awaited nothing, as one statement with its operation's row: `WITH` the write,
    /// `INSERT` the row. One statement commits alone: no `BEGIN`, no `COMMIT`, one answer.
    /// `None` when the write cannot stand in a `WITH` (the caller then runs the command
    /// in a transaction); otherwise the operation's id and position, or the error and
    /// whether the outcome is unknown.
    async fn fused(
        &self,
        client: &deadpool_postgres::ClientWrapper,
        sql: &str,
        queued: &Queued,
        row: &Append,
    ) -> Option<Result<(i64, u64), (CommandError, bool)>> {
        let result = match self
            .send_fused(
                client,
                sql,
                Fusion::Defer,
                queued.statement.params(),
                &queued.params,
                &[&row.host, &row.kind, &row.command, &row.output],
            )
            .await?
        {
            Sent::Answered(result) => result,
            Sent::NotSent(e) => return Some(Err((e, false))),
        };
        Some(match result {
            Ok(rows) => logged(&rows).map(|(_, id, position)| (id, position)),
            // The server refused it: nothing was written. A connection that failed may have
            // written it before it did: the outcome is unknown.
            Err(e) => {
                let unknown = e.as_db_error().is_none();
                Err((e.into(), unknown))
            }
        })
    }
}

/// The two ways a write is fused with its operation's row ([`Postgres::send_fused`]).
#[derive(Clone, Copy)]
enum Fusion {
    /// [`Tx::defer_sql`]'s: the row's output is given; answers the row's id and position.
    Defer,
    /// [`Tx::finish_sql`]'s: the row's output is the write's answer (`NULL` when it
    /// answered no row, which the column refuses); answers the row's id, position and
    /// output.
    Finish,
}

impl Fusion {
    /// The row's values: `{PG_NOW}` and `$n1`.. stand for the database's clock and the
    /// parameters after the write's.
    fn values(self) -> &'static str {
        match self {
            Self::Defer => "$n1, {PG_NOW}, $n2, $n3, $n4",
            Self::Finish => {
                "$n1, {PG_NOW}, $n2, $n3, \
                 (SELECT coalesce(w.o::json::text, 'null') FROM coherent_write AS w (o))"
            }
        }
    }

    /// What the statement answers.
    fn returning(self) -> &'static str {
        match self {
            Self::Defer => "id, xid::text",
            Self::Finish => "id, xid::text, output",
        }
    }

    /// The fused statement of a write `sql` whose parameters are `n`, and whose row's
    /// values after them are `extra`.
    fn text(self, sql: &str, n: usize, extra: usize) -> String {
        let mut values = self.values().replace("{PG_NOW}", PG_NOW);
        // From the last, so that `$n1` does not match the start of `$n10`.
        for k in (1..=extra).rev() {
            values = values.replace(&format!("$n{k}"), &format!("${}", n + k));
        }
        let body = sql.trim_end().trim_end_matches(';');
        // The write's text on lines of its own: a comment at its end ends there.
        format!(
            "WITH coherent_write AS (\n{body}\n) \
             INSERT INTO coherent_operations (host, logged_at, kind, command, output) \
             VALUES ({values}) RETURNING {}",
            self.returning()
        )
    }
}

/// The fused statements of one [`Fusion`], by the write's text (see
/// [`Postgres::fused_texts`]).
type FusedTexts = std::collections::HashMap<String, Option<Arc<str>>, foldhash::fast::RandomState>;

/// Writes whose fused statement is kept, per [`Fusion`]: a program with more distinct write
/// texts than that (text built per call) starts over.
const FUSED_TEXTS_MAX: usize = 1024;

impl Postgres {
    /// Sends a command's write `sql` (its parameters' types `types`, its values `params`)
    /// fused with its operation's row, as one statement: `WITH coherent_write AS (<sql>)
    /// INSERT INTO coherent_operations (host, logged_at, kind, command, output) VALUES
    /// (...) RETURNING ...` (see [`Fusion`]), the row's values after the write's in `row`.
    /// `None` when the write cannot stand in a `WITH` (remembered, and not tried again).
    async fn send_fused(
        &self,
        client: &deadpool_postgres::ClientWrapper,
        sql: &str,
        fusion: Fusion,
        types: &[tokio_postgres::types::Type],
        params: &[DeferredParam],
        row: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Option<Sent> {
        let n = types.len();
        let known = self.fused_texts.lock()[fusion as usize].get(sql).cloned();
        let text = match known {
            Some(None) => return None,
            Some(Some(text)) => text,
            None => {
                let text: Arc<str> = fusion.text(sql, n, row.len()).into();
                self.remember_fused(fusion, sql, Some(text.clone()));
                text
            }
        };
        let unfusable = || self.remember_fused(fusion, sql, None);
        let fused = match client.prepare_cached(&text).await {
            Ok(fused) => fused,
            // The session ended (a terminated backend): it says nothing of the statement.
            Err(e) if CommandError::from(&e).is_connection_lost() => {
                return Some(Sent::NotSent(e.into()));
            }
            Err(e) if e.as_db_error().is_some() => {
                tracing::debug!(%e, sql, "a write cannot stand in a WITH");
                unfusable();
                return None;
            }
            Err(e) => return Some(Sent::NotSent(e.into())),
        };
        if fused.params().get(..n) != Some(types) {
            // Its parameters would be taken for other types.
            unfusable();
            return None;
        }
        let mut all: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params
            .iter()
            .map(|p| &**p as &(dyn tokio_postgres::types::ToSql + Sync))
            .collect();
        all.extend_from_slice(row);
        let mut query = std::pin::pin!(client.query(&fused, &all));
        Some(match futures::FutureExt::now_or_never(query.as_mut()) {
            // Handed to a connection whose task had ended (its backend terminated while it
            // sat in the pool): nothing was sent, and the command can run on another.
            Some(Err(e)) if e.is_closed() => Sent::NotSent(e.into()),
            Some(result) => Sent::Answered(result),
            None => Sent::Answered(query.await),
        })
    }

    /// Remembers `sql`'s fused statement for `fusion` (`None`: it cannot be fused).
    fn remember_fused(&self, fusion: Fusion, sql: &str, text: Option<Arc<str>>) {
        let mut all = self.fused_texts.lock();
        let texts = &mut all[fusion as usize];
        if texts.len() >= FUSED_TEXTS_MAX && !texts.contains_key(sql) {
            texts.clear();
        }
        texts.insert(sql.to_owned(), text);
    }
}

/// The operation's row a fused statement answered (`RETURNING id, xid::text, ...`): the
/// row, its id and position. An error here comes after the commit: the outcome is unknown.
fn logged(
    rows: &[tokio_postgres::Row],
) -> Result<(&tokio_postgres::Row, i64, u64), (CommandError, bool)> {
    let Some(r) = rows.first() else {
        return Err((
            CommandError::new(ErrorKind::Database, "the operation's row was not answered"),
            true,
        ));
    };
    (|| Ok((r, r.try_get::<_, i64>(0)?, parse_xid(r.try_get(1)?)?)))()
        .map_err(|e: CommandError| (e, true))
}

/// A fused statement's fate ([`Postgres::send_fused`]).
enum Sent {
    /// Nothing reached the server: the command can run again.
    NotSent(CommandError),
    /// Sent: its rows, or its error (the caller tells whether anything may have committed).
    Answered(Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>),
}

/// One operation as the log holds it.
#[derive(Debug, Clone)]
pub(crate) struct Logged {
    pub(crate) id: i64,
    pub(crate) position: u64,
    pub(crate) host: String,
    pub(crate) logged_at: i64,
    pub(crate) kind: String,
    pub(crate) command: String,
    pub(crate) output: String,
}

fn sqlite_open(path: &Path) -> Result<Connection, CommandError> {
    let c = Connection::open(path)?;
    c.execute_batch(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA busy_timeout = 10000;",
    )?;
    Ok(c)
}

const SQLITE_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS coherent_operations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    host TEXT NOT NULL,
    logged_at INTEGER NOT NULL,
    kind TEXT NOT NULL,
    command TEXT NOT NULL,
    output TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS coherent_hosts (
    host TEXT PRIMARY KEY,
    horizon INTEGER NOT NULL,
    seen_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS coherent_secrets (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);";

const PG_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS coherent_operations (
    id BIGSERIAL PRIMARY KEY,
    xid xid8 NOT NULL DEFAULT pg_current_xact_id(),
    host TEXT NOT NULL,
    logged_at BIGINT NOT NULL,
    kind TEXT NOT NULL,
    command TEXT NOT NULL,
    output TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS coherent_operations_xid_id ON coherent_operations (xid, id);
CREATE TABLE IF NOT EXISTS coherent_hosts (
    host TEXT PRIMARY KEY,
    horizon BIGINT NOT NULL,
    seen_at BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS coherent_secrets (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);";

/// The row of `coherent_secrets` that holds the key of the hosts' seals, written once by
/// whichever host makes the tables (see [`crate::seal`]).
const SEAL_KEY_ROW: &str = "seal";

/// The key of the hosts' seals in `schema`, made if there is none yet. Read first: a
/// host whose role may read the table but not write it starts as well. The one host that
/// makes it (the others' inserts do nothing) takes `PUBLIC`'s access away (none by default
/// on a table; a role's default privileges may have given some).
async fn pg_seal_key(
    client: &tokio_postgres::Client,
    schema: &str,
) -> Result<String, CommandError> {
    let select = format!("SELECT value FROM {schema}.coherent_secrets WHERE name = $1");
    if let Some(row) = client.query_opt(&select, &[&SEAL_KEY_ROW]).await? {
        return Ok(row.try_get(0)?);
    }
    let made = client
        .execute(
            &format!(
                "INSERT INTO {schema}.coherent_secrets (name, value) VALUES ($1, $2) \
                 ON CONFLICT (name) DO NOTHING"
            ),
            &[&SEAL_KEY_ROW, &crate::seal::new_key()],
        )
        .await?;
    if made == 1 {
        client
            .batch_execute(&format!(
                "REVOKE ALL ON {schema}.coherent_secrets FROM PUBLIC"
            ))
            .await?;
    }
    Ok(client
        .query_one(&select, &[&SEAL_KEY_ROW])
        .await?
        .try_get(0)?)
}

/// An arbitrary constant: the advisory lock that makes concurrent schema creation safe.
const SCHEMA_LOCK: i64 = 0x636f_6865_7265_6e74;

impl Database {
    /// A SQLite file (created if missing), in WAL mode so that readers in every process
    /// sharing it see each commit at once. The log's tables are created if missing.
    pub fn sqlite(path: impl AsRef<Path>) -> Result<Self, CommandError> {
        let path = path.as_ref().to_owned();
        let writer = sqlite_open(&path)?;
        writer.execute_batch(SQLITE_SCHEMA)?;
        writer.execute(
            "INSERT INTO coherent_secrets (name, value) VALUES (?1, ?2) \
             ON CONFLICT (name) DO NOTHING",
            params![SEAL_KEY_ROW, crate::seal::new_key()],
        )?;
        let seal_key: String = writer.query_row(
            "SELECT value FROM coherent_secrets WHERE name = ?1",
            params![SEAL_KEY_ROW],
            |r| r.get(0),
        )?;
        let reader = sqlite_open(&path)?;
        Ok(Self {
            inner: Arc::new(Engine::Sqlite(Sqlite {
                path,
                writer: tokio::sync::Mutex::new(writer),
                reader: parking_lot::Mutex::new(reader),
                seal: crate::seal::Seal::new(seal_key.as_bytes()),
            })),
        })
    }

    /// PostgreSQL at `url` (e.g. `postgres://postgres@127.0.0.1:5432/test`), schema
    /// `public`, through a pool of 16 connections. The log's tables are created if missing.
    pub async fn postgres(url: &str) -> Result<Self, CommandError> {
        Self::postgres_in_schema(url, "public").await
    }

    /// PostgreSQL at `url`, every connection working in `schema` (created if missing): one
    /// database can hold several independent clusters, e.g. one per test.
    pub async fn postgres_in_schema(url: &str, schema: &str) -> Result<Self, CommandError> {
        Self::postgres_with(url, PostgresOptions::default().schema(schema)).await
    }

    /// PostgreSQL at `url`, with `options` (the schema, the pool's size).
    ///
    /// The `Database` starts two threads, which end when its last clone is dropped:
    /// `coherent-pg-io` drives every connection of the pool (whichever runtime asks for
    /// one), `coherent-ops` runs the work of its hosts (listener, notifier, reads of the
    /// log), so that a busy application runtime does not delay the cluster's
    /// invalidations. Open one `Database` per database and schema, not one per request; a
    /// connection taken from [`postgres_pool`](Self::postgres_pool) and kept after the
    /// last clone is dropped fails with "connection closed". Invalidations of other hosts'
    /// operations run on `coherent-ops`: a command's `invalidate` and a watch's
    /// `on_change` must not block (they never await; they must not wait on a lock held
    /// across a query either).
    ///
    /// ```no_run
    /// # async fn open() -> Result<(), coherent_ops::CommandError> {
    /// use coherent_ops::{Database, PostgresOptions};
    /// let db = Database::postgres_with(
    ///     "postgres://app@db.internal/app",
    ///     PostgresOptions::default().schema("orders").pool_size(32),
    /// )
    /// .await?;
    /// # let _ = db; Ok(()) }
    /// ```
    pub async fn postgres_with(url: &str, options: PostgresOptions) -> Result<Self, CommandError> {
        let PostgresOptions {
            schema,
            pool_size,
            tls,
        } = options;
        let schema = schema.as_str();
        if schema.is_empty()
            || !schema
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            return Err(CommandError::new(
                ErrorKind::Database,
                format!("schema name {schema:?}: use letters, digits and '_'"),
            ));
        }
        // The URL stays out of the message: it may hold a password.
        let mut config: tokio_postgres::Config = url
            .parse()
            .map_err(|e: tokio_postgres::Error| CommandError::from(&e))?;
        tls.settle(&mut config)?;
        let seal_key = {
            let (client, connection) = config.connect(tls.clone()).await?;
            let driver = tokio::spawn(connection);
            client
                .batch_execute(&format!(
                    // The lock is the transaction's: hosts starting together create the
                    // tables once, the others wait for that commit and find them.
                    "BEGIN; SELECT pg_advisory_xact_lock({SCHEMA_LOCK}); \
                     CREATE SCHEMA IF NOT EXISTS {schema}; SET LOCAL search_path TO {schema}; \
                     {PG_SCHEMA} COMMIT;"
                ))
                .await?;
            let seal_key = pg_seal_key(&client, schema).await?;
            drop(client);
            let _ = driver.await;
            seal_key
        };
        // After the URL's own options (a statement_timeout, say), which it keeps.
        let options = format!(
            "{} -c search_path={schema}",
            config.get_options().unwrap_or("")
        );
        config.options(options.trim_start());
        let background = Background::start().map_err(|e| {
            CommandError::new(
                ErrorKind::Unavailable,
                format!("the database's threads: {e}"),
            )
        })?;
        let manager = deadpool_postgres::Manager::from_connect(
            config.clone(),
            background::ConnectOnBackground {
                handle: background.io().clone(),
                tls: tls.clone(),
            },
            deadpool_postgres::ManagerConfig {
                recycling_method: deadpool_postgres::RecyclingMethod::Fast,
            },
        );
        let pool = deadpool_postgres::Pool::builder(manager)
            .max_size(pool_size)
            .build()
            .map_err(|e| CommandError::new(ErrorKind::Database, e.to_string()))?;
        let dbname = config.get_dbname().unwrap_or("postgres");
        let mut channel = format!("coherent_ops.{dbname}.{schema}");
        // Channel names are identifiers: 63 bytes at most (a database's name may hold
        // characters of several bytes).
        while channel.len() > PG_CHANNEL_MAX {
            channel.pop();
        }
        Ok(Self {
            inner: Arc::new(Engine::Postgres(Postgres {
                pool,
                config,
                tls,
                schema: schema.to_owned(),
                channel,
                seal: crate::seal::Seal::new(seal_key.as_bytes()),
                fused_texts: Default::default(),
                background,
            })),
        })
    }

    /// The PostgreSQL pool the commands use (with the schema set): read through it too.
    /// `None` for SQLite.
    pub fn postgres_pool(&self) -> Option<&deadpool_postgres::Pool> {
        match &*self.inner {
            Engine::Postgres(pg) => Some(&pg.pool),
            Engine::Sqlite(_) => None,
        }
    }

    /// What the hosts of this database seal their messages with: its key, from
    /// `coherent_secrets` (see [`crate::seal`]).
    pub(crate) fn seal(&self) -> crate::seal::Seal {
        match &*self.inner {
            Engine::Postgres(pg) => pg.seal.clone(),
            Engine::Sqlite(s) => s.seal.clone(),
        }
    }

    /// The SQLite file. `None` for PostgreSQL.
    pub fn sqlite_path(&self) -> Option<&Path> {
        match &*self.inner {
            Engine::Sqlite(s) => Some(&s.path),
            Engine::Postgres(_) => None,
        }
    }

    /// Where a host of this database runs its own work: the database's `coherent-ops`
    /// thread on PostgreSQL (see [`background`]), the current runtime on SQLite. Call in a
    /// runtime.
    pub(crate) fn background_handle(&self) -> tokio::runtime::Handle {
        match &*self.inner {
            Engine::Postgres(pg) => pg.background.work().clone(),
            Engine::Sqlite(_) => tokio::runtime::Handle::current(),
        }
    }

    /// A name for the log, the same on every host that shares it: the NATS subject is
    /// derived from it.
    #[cfg_attr(not(feature = "nats"), allow(dead_code))]
    pub(crate) fn log_name(&self) -> String {
        let raw = match &*self.inner {
            Engine::Sqlite(s) => std::fs::canonicalize(&s.path)
                .unwrap_or_else(|_| s.path.clone())
                .display()
                .to_string(),
            Engine::Postgres(pg) => format!(
                "{}.{}.{}",
                pg.config.get_dbname().unwrap_or("postgres"),
                pg.config.get_user().unwrap_or(""),
                pg.schema
            ),
        };
        raw.chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect()
    }

    /// Closes the pool's idle connections (PostgreSQL): after one was found lost, the
    /// others most likely are too.
    pub(crate) fn drop_idle_connections(&self) {
        if let Engine::Postgres(pg) = &*self.inner {
            pg.pool.retain(|_, _| false);
        }
    }

    /// Runs the handlers of `jobs` one after the other in one transaction, appends their
    /// operations in the same transaction, then commits: the commands of a batch commit
    /// together or not at all. On PostgreSQL, `BEGIN` goes out with the first handler's
    /// first statement, and the operations' rows with the commit (one round trip each).
    /// Answers each job's operation id and position, in the order of `jobs`. On failure,
    /// says whether the commit was attempted (then the outcome is unknown); a handler's
    /// error rolls back the whole batch.
    pub(crate) async fn transact<J: Execute + ?Sized>(
        &self,
        jobs: &mut [Box<J>],
        fused: &std::sync::atomic::AtomicU64,
    ) -> Result<Vec<(i64, u64)>, (CommandError, bool)> {
        match &*self.inner {
            Engine::Sqlite(s) => {
                let mut guard = SqliteTransaction(s.writer.lock().await);
                let conn = &mut *guard.0;
                conn.execute_batch("BEGIN IMMEDIATE")
                    .map_err(|e| (e.into(), false))?;
                let result = async {
                    let mut ids = Vec::with_capacity(jobs.len());
                    for job in jobs.iter_mut() {
                        let mut tx = Tx {
                            inner: TxInner::Sqlite(conn),
                            begin: None,
                            open: true,
                            deferred: Vec::new(),
                            queued: Vec::new(),
                            unsent: None,
                            dead: false,
                            caller: None,
                            logging: None,
                            pg: None,
                            alone: false,
                            finished: None,
                        };
                        let row = run_handler(job.execute(&mut tx)).await?;
                        drop(tx);
                        let id: i64 = conn.prepare_cached(SQLITE_APPEND_SQL)?.query_row(
                            params![row.host, row.kind, row.command, row.output],
                            |r| r.get(0),
                        )?;
                        ids.push((id, u64::try_from(id).unwrap_or(0)));
                    }
                    Ok::<_, CommandError>(ids)
                }
                .await;
                // On an error the guard rolls back.
                match result {
                    Ok(ids) => conn
                        .execute_batch("COMMIT")
                        .map(|()| ids)
                        .map_err(|e| (e.into(), true)),
                    Err(e) => Err((e, false)),
                }
            }
            Engine::Postgres(pg) => {
                let client = pg.pool.get().await.map_err(|e| (e.into(), false))?;
                let mut guard = PgTransaction {
                    client: Some(client),
                    open: false,
                };
                let client: &deadpool_postgres::ClientWrapper =
                    guard.client.as_ref().expect("present until dropped");
                // The first poll writes `BEGIN` to the connection (tokio-postgres sends a
                // request when its future is first polled); the handler's statements
                // follow it on the same connection, in order, without waiting for its
                // answer: one round trip fewer. `BEGIN` cannot fail while the statements
                // after it succeed (only a broken or aborted connection fails it, and
                // those fail them too); if it fails anyway, the connection is closed
                // and the outcome is unknown.
                //
                // A batch of several commands waits at most 100 ms for a lock
                // (`BATCH_BEGIN`): two batches that lock rows in opposite orders would otherwise wait
                // for PostgreSQL's deadlock check (a second by default). The batch then
                // fails, and its commands run again one at a time, without the limit.
                let begin_sql = if jobs.len() > 1 { BATCH_BEGIN } else { "BEGIN" };
                let begin: Begin<'_> = Box::pin(client.batch_execute(begin_sql));
                // Open from the moment `BEGIN` may have been sent, until it is known to be
                // over: a connection dropped in between is closed, not pooled.
                guard.open = true;
                // One `Tx` for the batch's handlers, one after the other. The transaction
                // opens when a handler asks for the connection, or else with the commit.
                let mut tx = Tx {
                    inner: TxInner::Postgres(client),
                    begin: Some(futures::future::maybe_done(begin)),
                    open: false,
                    deferred: Vec::new(),
                    queued: Vec::new(),
                    unsent: None,
                    dead: false,
                    caller: None,
                    logging: None,
                    pg: Some(pg),
                    alone: jobs.len() == 1,
                    finished: None,
                };
                let before_commit = async {
                    let mut rows = Vec::with_capacity(jobs.len());
                    for job in jobs.iter_mut() {
                        // What `Tx::finish_sql` finished was the command before's part of
                        // the batch's transaction (one alone commits it at once).
                        tx.finished = None;
                        let row = run_handler(job.execute(&mut tx)).await?;
                        for text in [&row.host, row.kind, &row.command, &row.output] {
                            if text.contains('\0') {
                                return Err(CommandError::new(
                                    ErrorKind::BadCommand,
                                    "text for the log holds a NUL character",
                                ));
                            }
                        }
                        rows.push(row);
                    }
                    if let Some(Finished::Committed { .. }) = tx.finished {
                        // Nothing to append (a prepare now could only fail a command that
                        // committed).
                        return Ok((rows, None));
                    }
                    let append = client
                        .prepare_cached(if rows.len() == 1 {
                            APPEND_SQL
                        } else {
                            APPEND_MANY_SQL
                        })
                        .await?;
                    Ok::<_, CommandError>((rows, Some(append)))
                }
                .await;
                // The handler's last write committed alone with its operation's row
                // (`Tx::finish_sql`): nothing is open, nothing is left to send.
                match tx.finished.take() {
                    Some(Finished::Committed { id, position, .. }) => {
                        fused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        guard.open = false;
                        return match before_commit {
                            Ok(_) => Ok(vec![(id, position)]),
                            // A panic after the commit, or an output that does not
                            // decode: the operation stands, and what it changed is not
                            // known here.
                            Err(e) => Err((e, true)),
                        };
                    }
                    // The connection failed under it: it may have committed. The
                    // connection is closed, not pooled.
                    Some(Finished::Unknown) => {
                        let e = before_commit.err().unwrap_or_else(|| {
                            CommandError::new(
                                ErrorKind::Database,
                                "the command's last write may have committed",
                            )
                        });
                        return Err((e, true));
                    }
                    Some(Finished::InTransaction) | None => {}
                }
                let mut rows_append = match before_commit {
                    Ok(done) => Ok(done),
                    Err(e) if !tx.open => {
                        // Nothing went to the server: nothing to roll back.
                        guard.open = false;
                        return Err((e, false));
                    }
                    Err(e) => Err(e),
                };
                // A command whose one write waits unsent, with its text: one statement.
                if let (Ok((rows, _)), false, [queued]) = (&rows_append, tx.open, &tx.queued[..]) {
                    if let ([row], Some(sql)) = (&rows[..], &queued.sql) {
                        if let Some(done) = pg.fused(client, sql, queued, row).await {
                            fused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if !matches!(done, Err((_, true))) {
                                // Nothing is open: the statement committed or failed alone.
                                guard.open = false;
                            }
                            return done.map(|id| vec![id]);
                        }
                    }
                }
                // `BEGIN`, the deferred statements, the operations' rows and `COMMIT` go
                // out together (those not sent yet); `BEGIN`'s answer is read with the
                // commit's.
                tx.open();
                if let (Ok(_), Some(e)) = (&rows_append, tx.unsent.take()) {
                    rows_append = Err(e.into());
                }
                let begin = tx.begin.take().expect("BEGIN is made above");
                let dead = tx.dead;
                let deferred = std::mem::take(&mut tx.deferred);
                let begun = answer(begin);
                let (rows, append) = match rows_append {
                    Ok(done) => done,
                    Err(e) => {
                        begun.await.map_err(|e| (e.into(), false))?;
                        // A deferred statement that failed aborted the transaction, and the
                        // handler's next statement failed for that: its error is the cause.
                        let cause = futures::future::join_all(deferred)
                            .await
                            .into_iter()
                            .find_map(Result::err)
                            .map_or(e, CommandError::from);
                        if client.batch_execute("ROLLBACK").await.is_ok() {
                            guard.open = false;
                        }
                        return Err((cause, false));
                    }
                };
                let append = append.expect("prepared unless the command finished alone (above)");
                // The operations' rows and the commit, pipelined behind the deferred
                // statements: one round trip. The statement is prepared once per
                // connection, so the server neither parses nor plans it again.
                let (begun, deferred, (inserted, committed)) = if let [row] = &rows[..] {
                    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
                        [&row.host, &row.kind, &row.command, &row.output];
                    futures::join!(begun, futures::future::join_all(deferred), async {
                        futures::join!(
                            client.query(&append, &params),
                            client.batch_execute("COMMIT"),
                        )
                    })
                } else {
                    let hosts: Vec<&str> = rows.iter().map(|r| r.host.as_str()).collect();
                    let kinds: Vec<&str> = rows.iter().map(|r| r.kind).collect();
                    let commands: Vec<&str> = rows.iter().map(|r| r.command.as_str()).collect();
                    let outputs: Vec<&str> = rows.iter().map(|r| r.output.as_str()).collect();
                    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
                        [&hosts, &kinds, &commands, &outputs];
                    futures::join!(begun, futures::future::join_all(deferred), async {
                        futures::join!(
                            client.query(&append, &params),
                            client.batch_execute("COMMIT"),
                        )
                    })
                };
                if let Err(e) = begun {
                    // Only a broken connection fails `BEGIN` (a pooled one is never inside
                    // a transaction), and the statements behind it then fail too; should
                    // they have run anyway, each on its own, the outcome is unknown. But
                    // a server that answered `BEGIN` by ending the session (a backend
                    // terminated while the connection sat in the pool) ran nothing after.
                    if committed.is_ok() {
                        guard.open = false;
                    }
                    let e = CommandError::from(e);
                    let ran_nothing = (e.is_connection_lost() && committed.is_err()) || dead;
                    return Err((e, !ran_nothing));
                }
                // The operations' INSERT decides: a deferred statement that failed made it fail
                // too (unless the handler recovered with a savepoint, and then the
                // transaction went on and committed).
                let inserted = match inserted {
                    Ok(r) => r,
                    Err(e) => {
                        // The first error is the cause (a deferred statement's, before the
                        // INSERT failed for the aborted transaction).
                        // The server refused the INSERT, or answered the COMMIT (with a
                        // rollback): nothing committed. A connection that failed instead
                        // may have committed before it did: the outcome is unknown. (Told
                        // by the INSERT's own error: a deferred statement's may be one the
                        // handler recovered from with a savepoint.)
                        let rolled_back = committed.is_ok() || e.as_db_error().is_some();
                        let cause = deferred.into_iter().find_map(Result::err).unwrap_or(e);
                        if committed.is_ok() {
                            guard.open = false;
                        }
                        return Err((cause.into(), !rolled_back));
                    }
                };
                committed.map_err(|e| (e.into(), true))?;
                guard.open = false;
                let mut ids = Vec::with_capacity(inserted.len());
                for row in &inserted {
                    let id: i64 = row.try_get(0).map_err(|e| (e.into(), true))?;
                    let position = parse_xid(row.try_get(1).map_err(|e| (e.into(), true))?)
                        .map_err(|e| (e, true))?;
                    ids.push((id, position));
                }
                if ids.len() != rows.len() {
                    return Err((
                        CommandError::new(
                            ErrorKind::Database,
                            format!("{} operations appended, {} answered", rows.len(), ids.len()),
                        ),
                        true,
                    ));
                }
                // One statement takes its ids from the sequence in the order of its rows
                // (`unnest` keeps the arrays' order); `RETURNING` need not.
                ids.sort_unstable_by_key(|&(id, _)| id);
                Ok(ids)
            }
        }
    }

    /// Records that `host` is alive (now, by the database's clock) and has applied
    /// everything before `horizon`.
    pub(crate) async fn heartbeat(&self, host: &str, horizon: u64) -> Result<(), CommandError> {
        let horizon = i64::try_from(horizon).unwrap_or(i64::MAX);
        match &*self.inner {
            Engine::Sqlite(s) => {
                s.reader
                    .lock()
                    .prepare_cached(&format!(
                        "INSERT INTO coherent_hosts (host, horizon, seen_at) \
                         VALUES (?1, ?2, {SQLITE_NOW}) ON CONFLICT (host) DO UPDATE \
                         SET horizon = excluded.horizon, seen_at = excluded.seen_at"
                    ))?
                    .execute(params![host, horizon])?;
            }
            Engine::Postgres(pg) => {
                let client = pg.pool.get().await?;
                let q = client
                    .prepare_cached(&format!(
                        "INSERT INTO coherent_hosts (host, horizon, seen_at) \
                         VALUES ($1, $2, {PG_NOW}) ON CONFLICT (host) DO UPDATE \
                         SET horizon = excluded.horizon, seen_at = excluded.seen_at"
                    ))
                    .await?;
                client.execute(&q, &[&host, &horizon]).await?;
            }
        }
        Ok(())
    }

    /// The hosts seen within `within` (by the database's clock), this one included.
    pub(crate) async fn live_hosts(&self, within: Duration) -> Result<Vec<String>, CommandError> {
        let within = micros(within);
        match &*self.inner {
            Engine::Sqlite(s) => {
                let reader = s.reader.lock();
                let mut q = reader.prepare_cached(&format!(
                    "SELECT host FROM coherent_hosts WHERE seen_at > {SQLITE_NOW} - ?1"
                ))?;
                let hosts = q
                    .query_map(params![within], |r| r.get(0))?
                    .collect::<Result<Vec<String>, _>>()?;
                Ok(hosts)
            }
            Engine::Postgres(pg) => {
                let client = pg.pool.get().await?;
                let q = client
                    .prepare_cached(&format!(
                        "SELECT host FROM coherent_hosts WHERE seen_at > {PG_NOW} - $1"
                    ))
                    .await?;
                let rows = client.query(&q, &[&within]).await?;
                rows.iter()
                    .map(|r| r.try_get(0).map_err(CommandError::from))
                    .collect()
            }
        }
    }

    /// The least horizon among the hosts seen within `within` (by the database's clock),
    /// `except` left out: every one of them has read the log below it. `u64::MAX` when
    /// there is none.
    pub(crate) async fn min_live_horizon(
        &self,
        within: Duration,
        except: &str,
    ) -> Result<u64, CommandError> {
        let within = micros(within);
        let floor: Option<i64> = match &*self.inner {
            Engine::Sqlite(s) => {
                let reader = s.reader.lock();
                let mut q = reader.prepare_cached(&format!(
                    "SELECT min(horizon) FROM coherent_hosts WHERE seen_at > {SQLITE_NOW} - ?1 \
                     AND host <> ?2"
                ))?;
                q.query_row(params![within, except], |r| r.get(0))?
            }
            Engine::Postgres(pg) => {
                let client = pg.pool.get().await?;
                let q = client
                    .prepare_cached(&format!(
                        "SELECT min(horizon) FROM coherent_hosts WHERE seen_at > {PG_NOW} - $1 \
                         AND host <> $2"
                    ))
                    .await?;
                client
                    .query_one(&q, &[&within, &except])
                    .await?
                    .try_get(0)?
            }
        };
        Ok(floor.map_or(u64::MAX, |f| u64::try_from(f).unwrap_or(0)))
    }

    /// The hosts seen within `within` (by the database's clock), `except` left out, whose
    /// last heartbeat said they had not read the log past `position` (their horizon is at
    /// or below it).
    pub(crate) async fn hosts_behind(
        &self,
        position: u64,
        within: Duration,
        except: &str,
    ) -> Result<Vec<String>, CommandError> {
        let within = micros(within);
        let position = i64::try_from(position).unwrap_or(i64::MAX);
        match &*self.inner {
            Engine::Sqlite(s) => {
                let reader = s.reader.lock();
                let mut q = reader.prepare_cached(&format!(
                    "SELECT host FROM coherent_hosts WHERE seen_at > {SQLITE_NOW} - ?1 \
                     AND host <> ?2 AND horizon <= ?3"
                ))?;
                let hosts = q
                    .query_map(params![within, except, position], |r| r.get(0))?
                    .collect::<Result<Vec<String>, _>>()?;
                Ok(hosts)
            }
            Engine::Postgres(pg) => {
                let client = pg.pool.get().await?;
                let q = client
                    .prepare_cached(&format!(
                        "SELECT host FROM coherent_hosts WHERE seen_at > {PG_NOW} - $1 \
                         AND host <> $2 AND horizon <= $3"
                    ))
                    .await?;
                let rows = client.query(&q, &[&within, &except, &position]).await?;
                rows.iter()
                    .map(|r| r.try_get(0).map_err(CommandError::from))
                    .collect()
            }
        }
    }

    /// Forgets `host` (it stopped): it no longer holds trimming back.
    pub(crate) async fn leave(&self, host: &str) -> Result<(), CommandError> {
        match &*self.inner {
            Engine::Sqlite(s) => {
                s.reader
                    .lock()
                    .execute("DELETE FROM coherent_hosts WHERE host = ?1", params![host])?;
            }
            Engine::Postgres(pg) => {
                let client = pg.pool.get().await?;
                client
                    .execute("DELETE FROM coherent_hosts WHERE host = $1", &[&host])
                    .await?;
            }
        }
        Ok(())
    }

    /// Deletes the operations older than `retention` that every live host has passed, and
    /// the hosts not seen for `host_expiry` (both by the database's clock). Returns how
    /// many operations were deleted.
    pub(crate) async fn trim(
        &self,
        retention: Duration,
        host_expiry: Duration,
    ) -> Result<u64, CommandError> {
        let (retention, host_expiry) = (micros(retention), micros(host_expiry));
        match &*self.inner {
            Engine::Sqlite(s) => {
                let c = s.reader.lock();
                c.execute(
                    &format!("DELETE FROM coherent_hosts WHERE seen_at < {SQLITE_NOW} - ?1"),
                    params![host_expiry],
                )?;
                let n = c.execute(
                    &format!(
                        "DELETE FROM coherent_operations WHERE logged_at < {SQLITE_NOW} - ?1 \
                         AND id < (SELECT min(horizon) FROM coherent_hosts)"
                    ),
                    params![retention],
                )?;
                Ok(n as u64)
            }
            Engine::Postgres(pg) => {
                let client = pg.pool.get().await?;
                client
                    .execute(
                        &format!("DELETE FROM coherent_hosts WHERE seen_at < {PG_NOW} - $1"),
                        &[&host_expiry],
                    )
                    .await?;
                Ok(client
                    .execute(
                        &format!(
                            "DELETE FROM coherent_operations WHERE logged_at < {PG_NOW} - $1 \
                             AND xid < (SELECT min(horizon) FROM coherent_hosts)::text::xid8"
                        ),
                        &[&retention],
                    )
                    .await?)
            }
        }
    }

    /// How many operations the log holds now.
    pub async fn log_len(&self) -> Result<u64, CommandError> {
        match &*self.inner {
            Engine::Sqlite(s) => {
                let n: i64 = s.reader.lock().query_row(
                    "SELECT count(*) FROM coherent_operations",
                    [],
                    |r| r.get(0),
                )?;
                Ok(u64::try_from(n).unwrap_or(0))
            }
            Engine::Postgres(pg) => {
                let client = pg.pool.get().await?;
                let n: i64 = client
                    .query_one("SELECT count(*) FROM coherent_operations", &[])
                    .await?
                    .get(0);
                Ok(u64::try_from(n).unwrap_or(0))
            }
        }
    }

    /// Whether an operation with this id is in the log (it committed).
    pub async fn is_logged(&self, id: i64) -> Result<bool, CommandError> {
        match &*self.inner {
            Engine::Sqlite(s) => Ok(s
                .reader
                .lock()
                .query_row(
                    "SELECT 1 FROM coherent_operations WHERE id = ?1",
                    params![id],
                    |_| Ok(()),
                )
                .optional()?
                .is_some()),
            Engine::Postgres(pg) => {
                let client = pg.pool.get().await?;
                Ok(client
                    .query_opt("SELECT 1 FROM coherent_operations WHERE id = $1", &[&id])
                    .await?
                    .is_some())
            }
        }
    }
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

fn parse_xid(text: &str) -> Result<u64, CommandError> {
    text.parse()
        .map_err(|e| CommandError::new(ErrorKind::Database, format!("xid {text:?}: {e}")))
}

/// The operation's row, answering its id and position (the writing transaction's id);
/// `logged_at` is the database's clock ([`PG_NOW`]).
const APPEND_SQL: &str = concat!(
    "INSERT INTO coherent_operations (host, logged_at, kind, command, output) VALUES ($1, ",
    pg_now!(),
    ", $2, $3, $4) RETURNING id, xid::text"
);

/// Several operations' rows in one statement, from arrays in the order of the batch.
const APPEND_MANY_SQL: &str = concat!(
    "INSERT INTO coherent_operations (host, logged_at, kind, command, output) SELECT h, ",
    pg_now!(),
    ", k, c, o FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) \
     AS batch (h, k, c, o) RETURNING id, xid::text"
);

/// The operation's row on SQLite, answering its id; `logged_at` is the database's clock
/// ([`SQLITE_NOW`]).
const SQLITE_APPEND_SQL: &str = concat!(
    "INSERT INTO coherent_operations (host, logged_at, kind, command, output) VALUES (?1, ",
    sqlite_now!(),
    ", ?2, ?3, ?4) RETURNING id"
);

/// How long a batch of several commands waits for a row lock before it gives up and its
/// commands run one at a time (see [`Database::transact`]).
const BATCH_BEGIN: &str = "BEGIN; SET LOCAL lock_timeout = '100ms'";

/// `pg_notify` for a batch of payloads (`$1`: the channels, `$2`: the payloads, in pairs),
/// as one prepared statement: one transaction, which the server neither parses nor plans
/// again (the four statements of a `BEGIN; SET LOCAL ...; SELECT pg_notify(...); COMMIT`
/// text cost it about 2.5 times as much, by pgbench). Its commit does not wait for the WAL
/// to reach the disk (`set_config(..., true)` lasts until the statement's own transaction
/// ends, after its commit record): a notification is only a wake-up (the log is the truth),
/// so losing one to a crash costs nothing. The `WHERE` makes the setting part of the plan.
pub(crate) const NOTIFY_SQL: &str = "SELECT count(pg_notify(n.c, n.p)) \
     FROM (SELECT set_config('synchronous_commit', 'off', true) AS sc) AS s \
     CROSS JOIN unnest($1::text[], $2::text[]) AS n (c, p) WHERE s.sc = 'off'";

/// Sends `payloads` (channel, payload) with [`NOTIFY_SQL`] on a connection of `pool`.
pub(crate) async fn pg_notify(
    pool: &deadpool_postgres::Pool,
    payloads: &[(&str, &str)],
) -> Result<(), CommandError> {
    if payloads
        .iter()
        .any(|(c, p)| c.contains('\0') || p.contains('\0'))
    {
        return Err(CommandError::new(
            ErrorKind::BadCommand,
            "a notification holds a NUL character",
        ));
    }
    let channels: Vec<&str> = payloads.iter().map(|(c, _)| *c).collect();
    let texts: Vec<&str> = payloads.iter().map(|(_, p)| *p).collect();
    let client = pool.get().await?;
    let statement = client.prepare_cached(NOTIFY_SQL).await?;
    client.execute(&statement, &[&channels, &texts]).await?;
    Ok(())
}

/// The most bytes PostgreSQL takes in one `NOTIFY` payload: it refuses 8,000 and more
/// (`NOTIFY_PAYLOAD_MAX_LENGTH`, with the default block size of 8 KiB), and with them the
/// whole transaction's notifications. The channel's name counts apart (at most 63 bytes:
/// see `PG_CHANNEL_MAX`). Operations whose notice does not fit are announced by id.
pub(crate) const PG_PAYLOAD_LIMIT: usize = 7_999;

/// The longest channel name PostgreSQL takes, in bytes (`NAMEDATALEN - 1`).
const PG_CHANNEL_MAX: usize = 63;

/// A connection inside `BEGIN`. If it is dropped still open (the command's future was
/// dropped mid-way, or a `ROLLBACK` failed), the connection is closed rather than returned
/// to the pool: closing it rolls the transaction back.
struct PgTransaction {
    client: Option<deadpool_postgres::Object>,
    open: bool,
}

impl Drop for PgTransaction {
    fn drop(&mut self) {
        if self.open {
            if let Some(client) = self.client.take() {
                drop(deadpool_postgres::Object::take(client));
            }
        }
    }
}

/// The answer of a request that may have been answered already.
async fn answer<T, F: Future<Output = T> + Unpin>(mut sent: futures::future::MaybeDone<F>) -> T {
    (&mut sent).await;
    std::pin::Pin::new(&mut sent)
        .take_output()
        .expect("taken once, after it is done")
}

/// Awaits a handler, answering a panic as the command's error (the batch is then split,
/// and the others commit without it).
async fn run_handler(
    handler: BoxFuture<'_, Result<Append, CommandError>>,
) -> Result<Append, CommandError> {
    use futures::FutureExt;
    match std::panic::AssertUnwindSafe(handler).catch_unwind().await {
        Ok(result) => result,
        Err(panic) => {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(CommandError::new(
                ErrorKind::Unavailable,
                format!("the command's handler panicked: {why}"),
            ))
        }
    }
}

/// The SQLite writer inside `BEGIN IMMEDIATE`: rolled back when dropped still open (a
/// handler failed, or panicked, or the commit failed), so that the write lock every process
/// shares is never left held.
struct SqliteTransaction<'c>(tokio::sync::MutexGuard<'c, Connection>);

impl Drop for SqliteTransaction<'_> {
    fn drop(&mut self) {
        if !self.0.is_autocommit() {
            if let Err(e) = self.0.execute_batch("ROLLBACK") {
                tracing::error!(%e, "rolling back a SQLite transaction failed");
            }
        }
    }
}

/// A command of a batch, its types erased: runs its handler in the batch's transaction and
/// answers the operation's row. It may run more than once (a batch that fails is run again
/// one command at a time), each time in a new transaction.
pub(crate) trait Execute: Send {
    fn execute<'a, 'b>(
        &'a mut self,
        tx: &'a mut Tx<'b>,
    ) -> BoxFuture<'a, Result<Append, CommandError>>
    where
        'b: 'a;
}

/// The operation row a command appends.
pub(crate) struct Append {
    pub(crate) host: String,
    pub(crate) kind: &'static str,
    pub(crate) command: String,
    pub(crate) output: String,
}

/// The transaction a command's handler writes in. The pipeline opened it and commits it,
/// with the command's operation, when the handler returns `Ok`; it rolls back otherwise.
pub struct Tx<'a> {
    inner: TxInner<'a>,
    /// `BEGIN` (PostgreSQL), sent when the transaction opens, answered at the commit.
    begin: Option<futures::future::MaybeDone<Begin<'a>>>,
    /// Whether the transaction is open: `BEGIN` went to the server, with the statements
    /// deferred before. Until then deferred statements wait here, so that `BEGIN`, they,
    /// the operation's row and `COMMIT` can go in one message.
    open: bool,
    /// Statements of [`Tx::defer`] sent, answered at the commit.
    deferred: Vec<Deferred<'a>>,
    /// Statements of [`Tx::defer`] not sent yet (the transaction is not open).
    queued: Vec<Queued>,
    /// A deferred statement that failed as it was sent: the commit rolls back with it.
    unsent: Option<tokio_postgres::Error>,
    /// `BEGIN` failed as it was handed to the connection's task, which had ended: nothing
    /// went to the server on this connection, then or after.
    dead: bool,
    /// Who sent the command whose handler runs now (set per command of a batch).
    pub(crate) caller: Option<coherent_rpc::Identity>,
    /// The operation's row of the command whose handler runs now, its output not known yet
    /// (set per command of a batch): what [`Tx::finish_sql`] writes with its statement.
    pub(crate) logging: Option<Append>,
    /// The pool's engine, for [`Tx::finish_sql`]'s statements that cannot be fused.
    pg: Option<&'a Postgres>,
    /// The batch is this one command: only then can its last write commit alone, with its
    /// operation's row ([`Tx::finish_sql`]).
    alone: bool,
    /// What [`Tx::finish_sql`] did, once it has run: the transaction takes no statement
    /// after it.
    pub(crate) finished: Option<Finished>,
}

/// What [`Tx::finish_sql`] did.
#[derive(Debug)]
pub(crate) enum Finished {
    /// Its statement ran inside the transaction, which commits as any other.
    InTransaction,
    /// Its statement committed alone, with the operation's row: the operation's id and
    /// position, and the output the log holds (the statement's answer).
    Committed {
        id: i64,
        position: u64,
        output: String,
    },
    /// Its statement was sent, alone, and the connection failed before the answer: it may
    /// have committed.
    Unknown,
}

/// A deferred statement waiting for its transaction to open.
struct Queued {
    statement: tokio_postgres::Statement,
    params: Vec<DeferredParam>,
    /// Its text, when the handler gave it ([`Tx::defer_sql`]): a command whose only
    /// statement it is can send it with its operation as one statement.
    sql: Option<String>,
}

/// `BEGIN`, sent without waiting for its answer.
type Begin<'a> =
    std::pin::Pin<Box<dyn Future<Output = Result<(), tokio_postgres::Error>> + Send + 'a>>;

/// A statement sent without waiting for its answer.
type Deferred<'a> =
    std::pin::Pin<Box<dyn Future<Output = Result<u64, tokio_postgres::Error>> + Send + 'a>>;

/// A parameter of a deferred statement, owned: the statement outlives the handler's borrows.
pub type DeferredParam = Box<dyn tokio_postgres::types::ToSql + Sync + Send>;

enum TxInner<'a> {
    Sqlite(&'a mut Connection),
    Postgres(&'a deadpool_postgres::ClientWrapper),
}

impl<'a> Tx<'a> {
    /// Who sent the command being run, when it came over RPC from a connection that the
    /// endpoint's authentication hook gave an identity (see `CommandServer`): a handler
    /// can refuse by it or record it. `None` for a command run in this process, or from a
    /// connection without one (a trusted tier that did not authenticate).
    pub fn caller(&self) -> Option<&coherent_rpc::Identity> {
        self.caller.as_ref()
    }

    /// The SQLite connection, inside `BEGIN IMMEDIATE`; `None` on PostgreSQL.
    pub fn sqlite(&self) -> Option<&Connection> {
        match &self.inner {
            TxInner::Sqlite(c) => Some(c),
            TxInner::Postgres(_) => None,
        }
    }

    /// The PostgreSQL connection, inside `BEGIN` (with `prepare_cached`); `None` on
    /// SQLite. The pipeline commits (or rolls back): do not end the transaction here.
    ///
    /// The transaction opens here, if it is not open yet: `BEGIN` and the statements
    /// deferred so far go to the server now, before anything the handler sends on the
    /// connection. A handler whose writes are all deferred need not call this (prepare its
    /// statements with [`Tx::prepare`]): its transaction then opens with the commit, in the
    /// same message.
    pub fn postgres(&mut self) -> Option<&'a deadpool_postgres::ClientWrapper> {
        match self.inner {
            // Statements after [`Tx::finish_sql`] would run outside the command's
            // transaction (or after its commit): the connection is not handed out.
            TxInner::Postgres(_) if self.finished.is_some() => None,
            TxInner::Postgres(client) => {
                self.open();
                Some(client)
            }
            TxInner::Sqlite(_) => None,
        }
    }

    /// The SQLite connection, or an error that says the handler needs SQLite.
    pub fn require_sqlite(&self) -> Result<&Connection, CommandError> {
        self.sqlite().ok_or_else(|| wrong("SQLite"))
    }

    /// The PostgreSQL connection, or an error that says the handler needs PostgreSQL.
    ///
    /// Opens the transaction, as [`Tx::postgres`] does.
    pub fn require_postgres(
        &mut self,
    ) -> Result<&'a deadpool_postgres::ClientWrapper, CommandError> {
        if self.finished.is_some() {
            return Err(finished());
        }
        self.postgres().ok_or_else(|| wrong("PostgreSQL"))
    }

    /// A prepared statement for `sql` on this transaction's connection, from the
    /// connection's cache after its first use (PostgreSQL). Unlike preparing through
    /// [`Tx::postgres`], this does not open the transaction.
    pub async fn prepare(&mut self, sql: &str) -> Result<tokio_postgres::Statement, CommandError> {
        match self.inner {
            TxInner::Postgres(client) => Ok(client.prepare_cached(sql).await?),
            TxInner::Sqlite(_) => Err(wrong("PostgreSQL")),
        }
    }

    /// Opens the transaction (PostgreSQL): sends `BEGIN`, then the statements deferred
    /// while it was not open, in order, without waiting for their answers.
    fn open(&mut self) {
        if self.open {
            return;
        }
        self.open = true;
        let mut cx = std::task::Context::from_waker(futures::task::noop_waker_ref());
        if let Some(begin) = &mut self.begin {
            // tokio-postgres writes a request to the connection when its future is first
            // polled: this poll sends it. It is answered at the commit. A connection whose
            // task already ended (its backend terminated while it sat in the pool, the
            // server's goodbye read after the pool checked it) fails it right here.
            let mut begin = std::pin::Pin::new(begin);
            if begin.as_mut().poll(&mut cx).is_ready() {
                if let Some(Err(e)) = begin.output_mut() {
                    self.dead = e.is_closed();
                }
            }
        }
        let TxInner::Postgres(client) = self.inner else {
            return;
        };
        for queued in std::mem::take(&mut self.queued) {
            if let Err(e) = self.send(client, queued.statement, queued.params) {
                self.unsent.get_or_insert(e);
            }
        }
    }

    /// Sends a deferred statement now; its answer is awaited at the commit.
    fn send(
        &mut self,
        client: &'a deadpool_postgres::ClientWrapper,
        statement: tokio_postgres::Statement,
        params: Vec<DeferredParam>,
    ) -> Result<(), tokio_postgres::Error> {
        let mut sent: Deferred<'a> = Box::pin(async move {
            client
                .execute_raw(
                    &statement,
                    params
                        .iter()
                        .map(|p| &**p as &(dyn tokio_postgres::types::ToSql + Sync)),
                )
                .await
        });
        // tokio-postgres writes a request to the connection when its future is first
        // polled, and a prepared statement needs nothing first: this poll sends it. Its
        // answer is awaited (with a real waker) at the commit.
        let mut cx = std::task::Context::from_waker(futures::task::noop_waker_ref());
        match sent.as_mut().poll(&mut cx) {
            std::task::Poll::Pending => self.deferred.push(sent),
            // Failed before it was sent (parameters that do not fit the statement).
            std::task::Poll::Ready(done) => {
                done?;
            }
        }
        Ok(())
    }

    /// Sends a write whose answer the handler does not need, without waiting for it
    /// (PostgreSQL). The statement goes to the server in order with the handler's other
    /// statements (a later one sees its effect): at once when the transaction is open,
    /// else when it opens ([`Tx::postgres`]) or with the commit. Its answer is read at the
    /// commit, which the pipeline sends right behind it with the operation's row. A
    /// command whose statements are all deferred costs one round trip: `BEGIN`, its
    /// writes, the operation and `COMMIT` in one message (see also [`Tx::defer_sql`]).
    ///
    /// If the statement fails, the command fails with its error and nothing is written:
    /// the failed statement aborts the transaction, and the `COMMIT` behind it rolls back.
    /// Its row count is not seen, so a write that must match a row (an `UPDATE` of a row
    /// that may be gone) is awaited instead, or made to fail in SQL. A statement that
    /// returns rows (`RETURNING`, a `SELECT`) is refused: await it.
    ///
    /// The statement is a prepared one ([`Tx::prepare`], answered from the connection's
    /// cache after its first use), so that nothing has to wait before it is sent. A wrong
    /// number of parameters, or one of the wrong type, is this call's error.
    ///
    /// ```no_run
    /// # async fn handler(tx: &mut coherent_ops::Tx<'_>, id: i64, name: String)
    /// # -> Result<(), coherent_ops::CommandError> {
    /// let update = tx
    ///     .prepare("UPDATE users SET name = $2 WHERE id = $1")
    ///     .await?;
    /// tx.defer(&update, vec![Box::new(id), Box::new(name)])?;
    /// # Ok(()) }
    /// ```
    pub fn defer(
        &mut self,
        statement: &tokio_postgres::Statement,
        params: Vec<DeferredParam>,
    ) -> Result<(), CommandError> {
        self.defer_statement(statement, params, None)
    }

    fn defer_statement(
        &mut self,
        statement: &tokio_postgres::Statement,
        params: Vec<DeferredParam>,
        sql: Option<&str>,
    ) -> Result<(), CommandError> {
        let TxInner::Postgres(client) = self.inner else {
            return Err(wrong("PostgreSQL"));
        };
        if self.finished.is_some() {
            return Err(finished());
        }
        if !statement.columns().is_empty() {
            // Its rows would wait unread until the commit, and the connection stops reading
            // for every statement while they wait: the handler's next statement would hang.
            return Err(CommandError::new(
                ErrorKind::BadCommand,
                "Tx::defer takes a statement that returns no rows; await one that does",
            ));
        }
        // Checked now, so that a mistake is the handler's error at this call whether the
        // statement goes now or with the commit.
        check_params("Tx::defer", statement, &params)?;
        if !self.open {
            // Sent when the transaction opens (at the latest with the commit).
            self.queued.push(Queued {
                statement: statement.clone(),
                params,
                sql: sql.map(str::to_owned),
            });
            return Ok(());
        }
        Ok(self.send(client, statement.clone(), params)?)
    }

    /// [`Tx::defer`] for the text of a statement, prepared (and cached) on this
    /// transaction's connection. Besides saving the `prepare_cached` call, this lets the
    /// pipeline send a command whose only write this is, and which awaits nothing else, as
    /// one statement with its operation's row: `WITH w AS (<this>) INSERT INTO
    /// coherent_operations ...`, without `BEGIN` and `COMMIT` (one statement commits
    /// alone). Statements that cannot stand in a `WITH` (one that is not an `INSERT`,
    /// `UPDATE` or `DELETE`, a table with rules) run as with [`Tx::defer`].
    ///
    /// ```no_run
    /// # async fn handler(tx: &mut coherent_ops::Tx<'_>, id: i64, name: String)
    /// # -> Result<(), coherent_ops::CommandError> {
    /// tx.defer_sql(
    ///     "UPDATE users SET name = $2 WHERE id = $1",
    ///     vec![Box::new(id), Box::new(name)],
    /// )
    /// .await?;
    /// # Ok(()) }
    /// ```
    pub async fn defer_sql(
        &mut self,
        sql: &str,
        params: Vec<DeferredParam>,
    ) -> Result<(), CommandError> {
        let statement = self.prepare(sql).await?;
        self.defer_statement(&statement, params, Some(sql))
    }
}

/// Checks that `params` fit `statement` (their number, and each one's type), as `what`'s
/// error.
fn check_params(
    what: &str,
    statement: &tokio_postgres::Statement,
    params: &[DeferredParam],
) -> Result<(), CommandError> {
    if params.len() != statement.params().len() {
        return Err(CommandError::new(
            ErrorKind::BadCommand,
            format!(
                "{what}: the statement takes {} parameters, {} given",
                statement.params().len(),
                params.len()
            ),
        ));
    }
    let mut scratch = bytes::BytesMut::new();
    for (i, (param, ty)) in params.iter().zip(statement.params()).enumerate() {
        scratch.clear();
        if let Err(e) = param.to_sql_checked(ty, &mut scratch) {
            return Err(CommandError::new(
                ErrorKind::BadCommand,
                format!("{what}: parameter {}: {e}", i + 1),
            ));
        }
    }
    Ok(())
}

/// A statement after [`Tx::finish_sql`].
fn finished() -> CommandError {
    CommandError::new(
        ErrorKind::BadCommand,
        "the command's transaction was finished by Tx::finish_sql: no statement goes after it",
    )
}

/// A command's output as JSON text, from a column of type `json`, `jsonb` or `text`.
struct JsonText(String);

impl<'a> tokio_postgres::types::FromSql<'a> for JsonText {
    fn from_sql(
        ty: &tokio_postgres::types::Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        let text = if *ty == tokio_postgres::types::Type::JSONB {
            // jsonb's binary form: a version byte (1), then the text.
            match raw.split_first() {
                Some((1, text)) => text,
                _ => return Err("jsonb in an unknown binary version".into()),
            }
        } else {
            raw
        };
        Ok(JsonText(std::str::from_utf8(text)?.to_owned()))
    }

    fn accepts(ty: &tokio_postgres::types::Type) -> bool {
        use tokio_postgres::types::Type;
        [Type::JSON, Type::JSONB, Type::TEXT, Type::VARCHAR].contains(ty)
    }
}

/// PostgreSQL's SQLSTATE for a `NOT NULL` column given none.
const NOT_NULL_VIOLATION: &str = "23502";

impl Postgres {
    /// [`Tx::finish_sql`]'s statement, `WITH` the write, `INSERT` the operation's row with
    /// the write's answer as its output, as one statement. `None` when the write cannot
    /// stand in a `WITH` (it then runs in the transaction); otherwise its answer: the
    /// operation's id, position and output; `None` inside when the write answered no row
    /// (then nothing was written); or the error, and whether the outcome is unknown.
    #[allow(clippy::type_complexity)]
    async fn finish_fused(
        &self,
        client: &deadpool_postgres::ClientWrapper,
        sql: &str,
        statement: &tokio_postgres::Statement,
        params: &[DeferredParam],
        row: &Append,
    ) -> Option<Result<Option<(i64, u64, String)>, (CommandError, bool)>> {
        // No row from the write leaves the output NULL, which its column refuses: the
        // statement fails and writes nothing. Two rows fail the scalar subquery. A JSON
        // `null` is the text 'null'. Text that is not JSON fails the cast: nothing that
        // cannot be read back commits.
        let result = match self
            .send_fused(
                client,
                sql,
                Fusion::Finish,
                statement.params(),
                params,
                &[&row.host, &row.kind, &row.command],
            )
            .await?
        {
            Sent::Answered(result) => result,
            Sent::NotSent(e) => return Some(Err((e, false))),
        };
        Some(match result {
            Ok(rows) => logged(&rows).and_then(|(r, id, position)| {
                let output = r.try_get::<_, String>(2).map_err(|e| (e.into(), true))?;
                Ok(Some((id, position, output)))
            }),
            Err(e) => match e.as_db_error() {
                Some(db)
                    if db.code().code() == NOT_NULL_VIOLATION
                        // Unquoted in `search_path`, the name is folded to lower case.
                        && db.schema().is_some_and(|s| s.eq_ignore_ascii_case(&self.schema))
                        && db.table() == Some("coherent_operations")
                        && db.column() == Some("output") =>
                {
                    Ok(None)
                }
                // The server refused it: nothing was written.
                Some(_) => Err((e.into(), false)),
                // The connection failed: it may have committed.
                None => Err((e.into(), true)),
            },
        })
    }
}

impl Tx<'_> {
    /// The command's last write, whose answer is the command's output: sent with the
    /// operation's row as one statement where it can be, which commits alone (no `BEGIN`,
    /// no `COMMIT`, one round trip where [`Tx::postgres`] and a commit take two). For a
    /// write whose result the output needs (an `UPDATE ... RETURNING`), which
    /// [`Tx::defer_sql`] cannot carry (PostgreSQL).
    ///
    /// `sql` answers at most one row of one column of type `json`, `jsonb` or `text`: the
    /// command's output as JSON, as `serde_json` reads it (`RETURNING json_build_object(...)`).
    /// The call answers it decoded, or `None` when the statement answered no row: then
    /// nothing was written, and the handler goes on (usually to answer its own not-found
    /// error). A statement that answers two rows fails, and writes nothing.
    ///
    /// Once it answered a row the transaction is finished: the connection is not handed
    /// out again ([`Tx::postgres`] answers `None`), and [`Tx::defer`] fails. The handler
    /// returns the output this call answered: where the statement committed alone, the log
    /// holds the statement's answer, and the pipeline answers that one (an output the
    /// handler changed after, or an error it returned, is not answered; an error is logged
    /// as a mistake, and so is a changed output in a debug build, where it is compared).
    ///
    /// It commits alone when this command's batch is the command alone, nothing was sent
    /// on the transaction before (no [`Tx::postgres`], no [`Tx::defer`]) and the statement
    /// can stand in a `WITH` (an `INSERT`, `UPDATE` or `DELETE` on a table without rules).
    /// Otherwise it runs inside the command's transaction, which then commits as usual.
    ///
    /// ```no_run
    /// # #[derive(serde::Deserialize)] struct User;
    /// # async fn handler(tx: &mut coherent_ops::Tx<'_>, id: i64, name: String)
    /// # -> Result<Option<User>, coherent_ops::CommandError> {
    /// let user: Option<User> = tx
    ///     .finish_sql(
    ///         "UPDATE users SET name = $2 WHERE id = $1 \
    ///          RETURNING json_build_object('id', id, 'name', name)",
    ///         vec![Box::new(id), Box::new(name)],
    ///     )
    ///     .await?;
    /// # Ok(user) }
    /// ```
    pub async fn finish_sql<O: serde::de::DeserializeOwned>(
        &mut self,
        sql: &str,
        params: Vec<DeferredParam>,
    ) -> Result<Option<O>, CommandError> {
        let TxInner::Postgres(client) = self.inner else {
            return Err(wrong("PostgreSQL"));
        };
        if self.finished.is_some() {
            return Err(finished());
        }
        let statement = client.prepare_cached(sql).await?;
        match statement.columns() {
            [column] if <JsonText as tokio_postgres::types::FromSql>::accepts(column.type_()) => {}
            columns => {
                return Err(CommandError::new(
                    ErrorKind::BadCommand,
                    format!(
                        "Tx::finish_sql takes a statement that answers one column of type \
                         json, jsonb or text (the command's output); this one answers {}",
                        columns
                            .iter()
                            .map(|c| format!("{} {}", c.name(), c.type_()))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ))
            }
        }
        check_params("Tx::finish_sql", &statement, &params)?;
        let decode = |text: &str| {
            serde_json::from_str::<O>(text).map_err(|e| {
                CommandError::new(
                    ErrorKind::BadCommand,
                    format!(
                        "Tx::finish_sql: the statement's answer does not decode as the output: {e}"
                    ),
                )
            })
        };
        if let (Some(pg), true, false, true, Some(row)) = (
            self.pg,
            self.alone,
            self.open,
            self.queued.is_empty(),
            &self.logging,
        ) {
            if let Some(done) = pg.finish_fused(client, sql, &statement, &params, row).await {
                return match done {
                    Ok(Some((id, position, output))) => {
                        let decoded = decode(&output).map_err(|e| {
                            CommandError::new(e.kind(), format!("committed, but {}", e.message()))
                        });
                        self.finished = Some(Finished::Committed {
                            id,
                            position,
                            output,
                        });
                        decoded.map(Some)
                    }
                    Ok(None) => Ok(None),
                    Err((e, unknown)) => {
                        if unknown {
                            self.finished = Some(Finished::Unknown);
                        }
                        Err(e)
                    }
                };
            }
        }
        // In the transaction.
        let client = self.require_postgres()?;
        let rows = client
            .query_raw(
                &statement,
                params
                    .iter()
                    .map(|p| &**p as &(dyn tokio_postgres::types::ToSql + Sync)),
            )
            .await?;
        let rows: Vec<tokio_postgres::Row> = futures::TryStreamExt::try_collect(rows).await?;
        match &rows[..] {
            [] => Ok(None),
            [row] => {
                self.finished = Some(Finished::InTransaction);
                let text = row
                    .try_get::<_, Option<JsonText>>(0)?
                    .map_or_else(|| "null".to_owned(), |t| t.0);
                decode(&text).map(Some)
            }
            rows => Err(CommandError::new(
                ErrorKind::BadCommand,
                format!(
                    "Tx::finish_sql: the statement answered {} rows; it may answer one",
                    rows.len()
                ),
            )),
        }
    }
}

fn wrong(needed: &str) -> CommandError {
    CommandError::new(
        ErrorKind::WrongDatabase,
        format!("this handler writes to {needed}, and the host's database is another"),
    )
}

#[cfg(test)]
mod tests {
    use super::NOTIFY_SQL;

    /// The statement notifies every pair, and its transaction commits without waiting for
    /// the WAL (seen inside an explicit transaction, where the setting outlives it).
    #[tokio::test]
    async fn notify_sql_sends_each_pair_without_a_synchronous_commit() {
        let Ok(url) = std::env::var("DATABASE_URL") else {
            eprintln!("skipped: DATABASE_URL is not set");
            return;
        };
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        client.batch_execute("BEGIN").await.unwrap();
        let channels = ["coherent_test_a", "coherent_test_b"];
        let payloads = ["{\"it's\":1}", "two\\three"];
        let row = client
            .query_one(NOTIFY_SQL, &[&&channels[..], &&payloads[..]])
            .await
            .unwrap();
        assert_eq!(row.get::<_, i64>(0), 2);
        let setting = client
            .query_one("SELECT current_setting('synchronous_commit')", &[])
            .await
            .unwrap();
        assert_eq!(setting.get::<_, String>(0), "off");
        client.batch_execute("ROLLBACK").await.unwrap();
    }
}
