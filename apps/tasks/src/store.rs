//! The database: the same queries on PostgreSQL (a deadpool pool, cached prepared statements)
//! and SQLite (an r2d2 pool of WAL connections, cached statements, run on the blocking pool).
//!
//! The writes are also functions of a connection ([`pg`], [`lite`]), so that the command
//! handlers of the Coherent backend run them inside the operation pipeline's transaction.

use std::path::{Path, PathBuf};

use r2d2_sqlite::SqliteConnectionManager;
use uuid::Uuid;

use crate::model::{Invalid, ListQuery, Page, Priority, Project, Status, Task, TaskPatch};

/// What a database call can answer besides its value.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// A field is invalid.
    #[error("{}: {}", .0.field, .0.message)]
    Invalid(Invalid),
    /// A field names something that does not exist (a task's project).
    #[error("{}: {}", .0.field, .0.message)]
    Unknown(Invalid),
    /// The database failed.
    #[error("database: {0}")]
    Db(String),
    /// The connection was lost, or none could be had (the server restarting, a failover,
    /// a terminated connection): nothing about the data. Reads are tried again on a fresh
    /// connection before they answer it ([`READ_TRIES`]).
    #[error("database unavailable: {0}")]
    Unavailable(String),
}

/// How many times a PostgreSQL read runs before it answers a lost connection
/// ([`StoreError::Unavailable`]): a connection terminated under it, or a pooled one that
/// died while idle, costs the caller nothing.
pub const READ_TRIES: u32 = 3;

/// The most projects a database holds: every page lists them all (`projects()`), and an
/// answer has a size limit, so their number is bounded where they are made.
pub const MAX_PROJECTS: i64 = 1_000;

fn too_many_projects() -> StoreError {
    StoreError::Invalid(Invalid::new(
        "name",
        format!("there are {MAX_PROJECTS} projects already, the most there can be"),
    ))
}

impl From<Invalid> for StoreError {
    fn from(i: Invalid) -> Self {
        Self::Invalid(i)
    }
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        if e.code() == Some(&tokio_postgres::error::SqlState::FOREIGN_KEY_VIOLATION) {
            return Self::Unknown(Invalid::new("project", "no such project"));
        }
        if coherent::ops::connection_lost(&e) {
            return Self::Unavailable(match e.as_db_error() {
                Some(db) => format!("{} ({})", db.message(), db.code().code()),
                None => e.to_string(),
            });
        }
        // The server's own message: `Display` of a server error says only "db error".
        match e.as_db_error() {
            Some(db) => Self::Db(format!("{} ({})", db.message(), db.code().code())),
            None => Self::Db(e.to_string()),
        }
    }
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        if let rusqlite::Error::SqliteFailure(f, _) = &e {
            if f.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_FOREIGNKEY {
                return Self::Unknown(Invalid::new("project", "no such project"));
            }
        }
        Self::Db(e.to_string())
    }
}

impl From<deadpool_postgres::PoolError> for StoreError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        match e {
            deadpool_postgres::PoolError::Backend(e) => e.into(),
            e => Self::Unavailable(e.to_string()),
        }
    }
}

impl From<r2d2::Error> for StoreError {
    fn from(e: r2d2::Error) -> Self {
        Self::Db(e.to_string())
    }
}

type Result<T> = std::result::Result<T, StoreError>;

/// The database of the application: PostgreSQL or a SQLite file. Cloning shares the pool.
#[derive(Clone)]
pub enum Store {
    /// A SQLite file.
    Sqlite(Lite),
    /// A PostgreSQL database (and schema).
    Postgres(Pg),
}

/// A SQLite file and a pool of connections to it.
#[derive(Clone)]
pub struct Lite {
    pool: r2d2::Pool<SqliteConnectionManager>,
    path: PathBuf,
}

/// A PostgreSQL pool whose connections use one schema.
#[derive(Clone)]
pub struct Pg {
    pool: deadpool_postgres::Pool,
    url: String,
    schema: String,
}

const PG_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS projects (
    id UUID PRIMARY KEY,
    name TEXT NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS tasks (
    id UUID PRIMARY KEY,
    project UUID NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
    title TEXT NOT NULL,
    description TEXT NOT NULL,
    priority SMALLINT NOT NULL,
    status SMALLINT NOT NULL,
    assignee TEXT,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS tasks_project ON tasks (project, id DESC);
CREATE INDEX IF NOT EXISTS tasks_project_status ON tasks (project, status, id DESC);
CREATE INDEX IF NOT EXISTS tasks_status ON tasks (status, id DESC);";

const SQLITE_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS projects (
    id BLOB PRIMARY KEY,
    name TEXT NOT NULL,
    created_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tasks (
    id BLOB PRIMARY KEY,
    project BLOB NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
    title TEXT NOT NULL,
    description TEXT NOT NULL,
    priority INTEGER NOT NULL,
    status INTEGER NOT NULL,
    assignee TEXT,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tasks_project ON tasks (project, id DESC);
CREATE INDEX IF NOT EXISTS tasks_project_status ON tasks (project, status, id DESC);
CREATE INDEX IF NOT EXISTS tasks_status ON tasks (status, id DESC);";

/// An arbitrary constant: the advisory lock that makes concurrent schema creation safe.
const SCHEMA_LOCK: i64 = 0x7461_736b_7300;

/// The columns of a task, in the order every query selects them.
const TASK_COLUMNS: &str =
    "id, project, title, description, priority, status, assignee, created_at, updated_at";

/// The largest UUID: `after` when a list starts at the newest task.
const AFTER_ALL: Uuid = Uuid::max();

/// The list query for a combination of filters, with placeholders made by `p(n)`.
fn list_sql(q: &ListQuery, columns: &str, p: fn(usize) -> String) -> String {
    let mut conditions = Vec::new();
    let mut n = 0;
    let mut next = || {
        n += 1;
        p(n)
    };
    if q.project.is_some() {
        conditions.push(format!("project = {}", next()));
    }
    if q.status.is_some() {
        conditions.push(format!("status = {}", next()));
    }
    conditions.push(format!("id < {}", next()));
    format!(
        "SELECT {columns} FROM tasks WHERE {} ORDER BY id DESC LIMIT {}",
        conditions.join(" AND "),
        next()
    )
}

fn pg_placeholder(n: usize) -> String {
    format!("${n}")
}

fn lite_placeholder(n: usize) -> String {
    format!("?{n}")
}

/// A page from `limit + 1` rows: the extra one says whether there is a next page.
fn page_of(mut items: Vec<Task>, limit: u32) -> Page {
    let limit = limit as usize;
    let next = if items.len() > limit {
        items.truncate(limit);
        items.last().map(|t| t.id)
    } else {
        None
    };
    Page { items, next }
}

fn bad_code(what: &str, code: i16) -> StoreError {
    StoreError::Db(format!("a stored {what} code {code} is unknown"))
}

/// Runs a read (`$body`, with `$c` a pooled `&ClientWrapper`); when the connection turns
/// out lost (terminated under it, or dead while idle in the pool), drops it and runs the
/// read again on another, [`READ_TRIES`] times in all, 20 ms then 100 ms apart. A read may
/// run twice; a write must not go through here. (A macro: the compute services need the
/// read's future to be `Send` and `'static`-bounded, which an async closure borrowing its
/// arguments is not.)
macro_rules! pg_read {
    ($p:expr, $c:ident, $body:expr) => {{
        let mut tries = 0;
        loop {
            tries += 1;
            let result = async {
                let object = $p.pool.get().await?;
                let result = {
                    let $c: &deadpool_postgres::ClientWrapper = &object;
                    async { $body }.await
                };
                if matches!(result, Err(StoreError::Unavailable(_))) {
                    // Not back into the pool; and the idle ones most likely went the same
                    // way (a failover, a restart, every backend terminated).
                    drop(deadpool_postgres::Object::take(object));
                    $p.pool.retain(|_, _| false);
                }
                result
            }
            .await;
            match result {
                Err(StoreError::Unavailable(e)) if tries < READ_TRIES => {
                    tracing::debug!(%e, tries, "a read lost its connection: trying again");
                    let wait = if tries == 1 { 20 } else { 100 };
                    tokio::time::sleep(std::time::Duration::from_millis(wait)).await;
                }
                result => break result,
            }
        }
    }};
}

impl Store {
    /// A SQLite file, created (with its tables) if missing.
    pub fn sqlite(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_owned();
        let manager = SqliteConnectionManager::file(&path).with_init(|c| {
            c.execute_batch(
                "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;
                 PRAGMA busy_timeout = 10000; PRAGMA foreign_keys = ON;",
            )
        });
        let pool = r2d2::Pool::builder()
            .max_size(8)
            .build(manager)
            .map_err(|e| StoreError::Db(e.to_string()))?;
        pool.get()?.execute_batch(SQLITE_SCHEMA)?;
        Ok(Self::Sqlite(Lite { pool, path }))
    }

    /// A PostgreSQL database at `url`, its tables in `schema` (created if missing; `public`
    /// is the usual one).
    pub async fn postgres(url: &str, schema: &str, pool_size: usize) -> Result<Self> {
        if schema.is_empty()
            || !schema
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err(StoreError::Invalid(Invalid::new(
                "schema",
                "must be letters, digits and underscores",
            )));
        }
        let mut config: tokio_postgres::Config = url
            .parse()
            .map_err(|e: tokio_postgres::Error| StoreError::Db(e.to_string()))?;
        config.options(format!("-csearch_path={schema}"));
        let manager = deadpool_postgres::Manager::from_config(
            config,
            tokio_postgres::NoTls,
            deadpool_postgres::ManagerConfig {
                recycling_method: deadpool_postgres::RecyclingMethod::Fast,
            },
        );
        let pool = deadpool_postgres::Pool::builder(manager)
            .max_size(pool_size)
            .build()
            .map_err(|e| StoreError::Db(e.to_string()))?;
        let mut client = pool.get().await?;
        let tx = client.transaction().await?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK])
            .await?;
        tx.batch_execute(&format!(
            "CREATE SCHEMA IF NOT EXISTS {schema}; {PG_SCHEMA}"
        ))
        .await?;
        tx.commit().await?;
        Ok(Self::Postgres(Pg {
            pool,
            url: url.to_owned(),
            schema: schema.to_owned(),
        }))
    }

    /// The SQLite file, or `None` on PostgreSQL.
    pub fn sqlite_path(&self) -> Option<&Path> {
        match self {
            Self::Sqlite(l) => Some(&l.path),
            Self::Postgres(_) => None,
        }
    }

    /// The PostgreSQL URL and schema, or `None` on SQLite.
    pub fn postgres_url(&self) -> Option<(&str, &str)> {
        match self {
            Self::Sqlite(_) => None,
            Self::Postgres(p) => Some((&p.url, &p.schema)),
        }
    }

    /// One page of tasks, newest first.
    pub async fn list(&self, q: ListQuery) -> Result<Page> {
        q.validate()?;
        match self {
            Self::Postgres(p) => {
                let tasks = pg_read!(p, c, pg::list(c, &q, TASK_COLUMNS).await)?;
                Ok(page_of(tasks, q.limit))
            }
            Self::Sqlite(l) => {
                l.run(move |c| Ok(page_of(lite::list(c, &q)?, q.limit)))
                    .await
            }
        }
    }

    /// The ids of one page of tasks, newest first, and the next page's `after`.
    pub async fn list_ids(&self, q: ListQuery) -> Result<(Vec<Uuid>, Option<Uuid>)> {
        q.validate()?;
        let ids = match self {
            Self::Postgres(p) => pg_read!(p, c, pg::list_ids(c, &q).await)?,
            Self::Sqlite(l) => l.run(move |c| lite::list_ids(c, &q)).await?,
        };
        let mut ids = ids;
        let limit = q.limit as usize;
        let next = if ids.len() > limit {
            ids.truncate(limit);
            ids.last().copied()
        } else {
            None
        };
        Ok((ids, next))
    }

    /// One task.
    pub async fn get(&self, id: Uuid) -> Result<Option<Task>> {
        match self {
            Self::Postgres(p) => pg_read!(p, c, pg::get(c, id).await),
            Self::Sqlite(l) => l.run(move |c| lite::get(c, id)).await,
        }
    }

    /// One project.
    pub async fn project(&self, id: Uuid) -> Result<Option<Project>> {
        match self {
            Self::Postgres(p) => {
                pg_read!(p, c, {
                    let s = c
                        .prepare_cached("SELECT id, name, created_at FROM projects WHERE id = $1")
                        .await?;
                    Ok(c.query_opt(&s, &[&id]).await?.map(|r| Project {
                        id: r.get(0),
                        name: r.get(1),
                        created_at: r.get(2),
                    }))
                })
            }
            Self::Sqlite(l) => {
                l.run(move |c| {
                    use rusqlite::OptionalExtension;
                    let mut s = c.prepare_cached(
                        "SELECT id, name, created_at FROM projects WHERE id = ?1",
                    )?;
                    Ok(s.query_row([id.as_bytes()], lite::project_row).optional()?)
                })
                .await
            }
        }
    }

    /// Every project, oldest first.
    pub async fn projects(&self) -> Result<Vec<Project>> {
        const SQL: &str = "SELECT id, name, created_at FROM projects ORDER BY id";
        match self {
            Self::Postgres(p) => {
                pg_read!(p, c, {
                    let s = c.prepare_cached(SQL).await?;
                    Ok(c.query(&s, &[])
                        .await?
                        .iter()
                        .map(|r| Project {
                            id: r.get(0),
                            name: r.get(1),
                            created_at: r.get(2),
                        })
                        .collect())
                })
            }
            Self::Sqlite(l) => {
                l.run(|c| {
                    let mut s = c.prepare_cached(SQL)?;
                    let rows = s.query_map([], lite::project_row)?;
                    Ok(rows.collect::<std::result::Result<_, _>>()?)
                })
                .await
            }
        }
    }

    /// How many of a project's tasks have `status`.
    pub async fn count(&self, project: Uuid, status: Status) -> Result<u64> {
        const PG: &str = "SELECT count(*) FROM tasks WHERE project = $1 AND status = $2";
        const LITE: &str = "SELECT count(*) FROM tasks WHERE project = ?1 AND status = ?2";
        match self {
            Self::Postgres(p) => {
                pg_read!(p, c, {
                    let s = c.prepare_cached(PG).await?;
                    let n: i64 = c.query_one(&s, &[&project, &status.code()]).await?.get(0);
                    Ok(n.unsigned_abs())
                })
            }
            Self::Sqlite(l) => {
                l.run(move |c| {
                    let mut s = c.prepare_cached(LITE)?;
                    let n: i64 = s
                        .query_row(rusqlite::params![project.as_bytes(), status.code()], |r| {
                            r.get(0)
                        })?;
                    Ok(n.unsigned_abs())
                })
                .await
            }
        }
    }

    /// How many of a project's tasks have each status (in [`Status::ALL`] order), in one
    /// query.
    pub async fn counts(&self, project: Uuid) -> Result<[u64; 4]> {
        const PG: &str = "SELECT status, count(*) FROM tasks WHERE project = $1 GROUP BY status";
        const LITE: &str = "SELECT status, count(*) FROM tasks WHERE project = ?1 GROUP BY status";
        let rows: Vec<(i16, i64)> = match self {
            Self::Postgres(p) => pg_read!(p, c, {
                let s = c.prepare_cached(PG).await?;
                Ok(c.query(&s, &[&project])
                    .await?
                    .iter()
                    .map(|r| (r.get(0), r.get(1)))
                    .collect())
            })?,
            Self::Sqlite(l) => {
                l.run(move |c| {
                    let mut s = c.prepare_cached(LITE)?;
                    let rows = s.query_map([project.as_bytes()], |r| Ok((r.get(0)?, r.get(1)?)))?;
                    Ok(rows.collect::<std::result::Result<_, _>>()?)
                })
                .await?
            }
        };
        let mut counts = [0; 4];
        for (status, n) in rows {
            let s = Status::from_code(status).ok_or_else(|| bad_code("status", status))?;
            counts[s.code() as usize] = n.unsigned_abs();
        }
        Ok(counts)
    }

    /// Inserts a task (its project must exist).
    pub async fn insert_task(&self, task: Task) -> Result<Task> {
        match self {
            Self::Postgres(p) => {
                pg::insert_task(&*p.pool.get().await?, &task).await?;
                Ok(task)
            }
            Self::Sqlite(l) => {
                l.run(move |c| {
                    lite::insert_task(c, &task)?;
                    Ok(task)
                })
                .await
            }
        }
    }

    /// Applies `patch` to a task at `now`; `None` when there is no such task.
    pub async fn update_task(&self, id: Uuid, patch: TaskPatch, now: i64) -> Result<Option<Task>> {
        patch.validate()?;
        match self {
            Self::Postgres(p) => pg::update_task(&*p.pool.get().await?, id, &patch, now).await,
            Self::Sqlite(l) => l.run(move |c| lite::update_task(c, id, &patch, now)).await,
        }
    }

    /// Deletes a task; answers it, or `None` when there was no such task.
    pub async fn delete_task(&self, id: Uuid) -> Result<Option<Task>> {
        match self {
            Self::Postgres(p) => pg::delete_task(&*p.pool.get().await?, id).await,
            Self::Sqlite(l) => l.run(move |c| lite::delete_task(c, id)).await,
        }
    }

    /// Inserts a project.
    pub async fn insert_project(&self, project: Project) -> Result<Project> {
        match self {
            Self::Postgres(p) => {
                pg::insert_project(&*p.pool.get().await?, &project).await?;
                Ok(project)
            }
            Self::Sqlite(l) => {
                l.run(move |c| {
                    lite::insert_project(c, &project)?;
                    Ok(project)
                })
                .await
            }
        }
    }

    /// Inserts many tasks at once (seeding): one transaction per call.
    pub async fn insert_many(&self, tasks: Vec<Task>) -> Result<()> {
        match self {
            Self::Postgres(p) => {
                let mut c = p.pool.get().await?;
                let tx = c.transaction().await?;
                let s = tx.prepare(&pg::insert_sql()).await?;
                for t in &tasks {
                    tx.execute(&s, &pg::task_params(t)).await?;
                }
                tx.commit().await?;
                Ok(())
            }
            Self::Sqlite(l) => {
                l.run(move |c| {
                    let tx = c.unchecked_transaction()?;
                    for t in &tasks {
                        lite::insert_task(&tx, t)?;
                    }
                    tx.commit()?;
                    Ok(())
                })
                .await
            }
        }
    }
}

impl Lite {
    /// Runs `f` on a pooled connection, on the blocking pool.
    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&rusqlite::Connection) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let pool = self.pool.clone();
        tokio::task::spawn_blocking(move || f(&*pool.get()?))
            .await
            .map_err(|e| StoreError::Db(format!("a database task failed: {e}")))?
    }
}

/// The queries and writes on a PostgreSQL connection (pooled, or the pipeline's
/// transaction).
pub mod pg {
    use deadpool_postgres::ClientWrapper;
    use tokio_postgres::types::ToSql;
    use tokio_postgres::Row;

    use super::*;

    pub(crate) fn insert_sql() -> String {
        format!("INSERT INTO tasks ({TASK_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)")
    }

    /// A task's row as the JSON its [`Task`] serializes to: the `RETURNING` of a command's
    /// last write, whose answer is the command's output (`Tx::finish_sql`). A code with no
    /// name here (a row written by a later release) fails the statement, naming the code,
    /// so that nothing commits whose output this release could not read.
    fn task_json() -> String {
        fn names<T: serde::Serialize>(all: &[T]) -> String {
            all.iter()
                .map(|v| match serde_json::to_value(v) {
                    Ok(serde_json::Value::String(name)) => format!("'{name}'"),
                    other => unreachable!("a unit variant serializes to its name: {other:?}"),
                })
                .collect::<Vec<_>>()
                .join(", ")
        }
        format!(
            "json_build_object('id', id, 'project', project, 'title', title, \
             'description', description, \
             'priority', coalesce((ARRAY[{}])[priority + 1], \
                 ('no priority has the code ' || priority)::int::text), \
             'status', coalesce((ARRAY[{}])[status + 1], \
                 ('no status has the code ' || status)::int::text), \
             'assignee', assignee, \
             'created_at', created_at, 'updated_at', updated_at)",
            names(&Priority::ALL),
            names(&Status::ALL)
        )
    }

    /// [`update_task`]'s statement, answering the task as JSON (for `Tx::finish_sql`, with
    /// [`update_params`]).
    pub(crate) fn update_json_sql() -> &'static str {
        static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
            format!(
                "UPDATE tasks SET title = COALESCE($2, title),
                   description = COALESCE($3, description),
                   priority = COALESCE($4, priority), status = COALESCE($5, status),
                   assignee = CASE WHEN $6 THEN $7 ELSE assignee END, updated_at = $8
                 WHERE id = $1 RETURNING {}",
                task_json()
            )
        });
        &SQL
    }

    /// [`update_json_sql`]'s parameters.
    pub(crate) fn update_params(
        id: Uuid,
        p: &TaskPatch,
        now: i64,
    ) -> Vec<coherent::ops::DeferredParam> {
        vec![
            Box::new(id),
            Box::new(p.title.clone()),
            Box::new(p.description.clone()),
            Box::new(p.priority.map(Priority::code)),
            Box::new(p.status.map(Status::code)),
            Box::new(p.assignee.is_some()),
            Box::new(p.assignee.clone().flatten()),
            Box::new(now),
        ]
    }

    /// [`delete_task`]'s statement, answering the task as JSON (for `Tx::finish_sql`; its
    /// one parameter is the id).
    pub(crate) fn delete_json_sql() -> &'static str {
        static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
            format!("DELETE FROM tasks WHERE id = $1 RETURNING {}", task_json())
        });
        &SQL
    }

    pub(crate) fn task_params(t: &Task) -> [&(dyn ToSql + Sync); 9] {
        // Codes are computed by the caller's statement; these live as long as `t`.
        [
            &t.id,
            &t.project,
            &t.title,
            &t.description,
            priority_ref(t.priority),
            status_ref(t.status),
            &t.assignee,
            &t.created_at,
            &t.updated_at,
        ]
    }

    /// The stored codes as statics, so that parameters can borrow them.
    fn priority_ref(p: Priority) -> &'static i16 {
        const CODES: [i16; 4] = [0, 1, 2, 3];
        &CODES[p.code() as usize]
    }

    fn status_ref(s: Status) -> &'static i16 {
        const CODES: [i16; 4] = [0, 1, 2, 3];
        &CODES[s.code() as usize]
    }

    pub(crate) fn task(r: &Row) -> Result<Task> {
        let priority: i16 = r.get(4);
        let status: i16 = r.get(5);
        Ok(Task {
            id: r.get(0),
            project: r.get(1),
            title: r.get(2),
            description: r.get(3),
            priority: Priority::from_code(priority)
                .ok_or_else(|| bad_code("priority", priority))?,
            status: Status::from_code(status).ok_or_else(|| bad_code("status", status))?,
            assignee: r.get(6),
            created_at: r.get(7),
            updated_at: r.get(8),
        })
    }

    async fn query_list(c: &ClientWrapper, q: &ListQuery, columns: &str) -> Result<Vec<Row>> {
        let s = c
            .prepare_cached(&list_sql(q, columns, pg_placeholder))
            .await?;
        let after = q.after.unwrap_or(AFTER_ALL);
        let limit = i64::from(q.limit) + 1;
        let status = q.status.map(Status::code);
        let mut params: Vec<&(dyn ToSql + Sync)> = Vec::with_capacity(4);
        if let Some(p) = &q.project {
            params.push(p);
        }
        if let Some(s) = &status {
            params.push(s);
        }
        params.push(&after);
        params.push(&limit);
        Ok(c.query(&s, &params).await?)
    }

    /// `limit + 1` tasks of a list.
    pub async fn list(c: &ClientWrapper, q: &ListQuery, columns: &str) -> Result<Vec<Task>> {
        query_list(c, q, columns).await?.iter().map(task).collect()
    }

    /// `limit + 1` ids of a list.
    pub async fn list_ids(c: &ClientWrapper, q: &ListQuery) -> Result<Vec<Uuid>> {
        Ok(query_list(c, q, "id")
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect())
    }

    /// One task.
    pub async fn get(c: &ClientWrapper, id: Uuid) -> Result<Option<Task>> {
        let s = c
            .prepare_cached(&format!("SELECT {TASK_COLUMNS} FROM tasks WHERE id = $1"))
            .await?;
        c.query_opt(&s, &[&id])
            .await?
            .as_ref()
            .map(task)
            .transpose()
    }

    /// Inserts a task.
    pub async fn insert_task(c: &ClientWrapper, t: &Task) -> Result<()> {
        let s = c.prepare_cached(&insert_sql()).await?;
        c.execute(&s, &task_params(t)).await?;
        Ok(())
    }

    /// Updates a task in one statement; `None` when there is no such task.
    pub async fn update_task(
        c: &ClientWrapper,
        id: Uuid,
        p: &TaskPatch,
        now: i64,
    ) -> Result<Option<Task>> {
        let s = c
            .prepare_cached(&format!(
                "UPDATE tasks SET title = COALESCE($2, title),
                   description = COALESCE($3, description),
                   priority = COALESCE($4, priority), status = COALESCE($5, status),
                   assignee = CASE WHEN $6 THEN $7 ELSE assignee END, updated_at = $8
                 WHERE id = $1 RETURNING {TASK_COLUMNS}"
            ))
            .await?;
        let priority = p.priority.map(Priority::code);
        let status = p.status.map(Status::code);
        let set_assignee = p.assignee.is_some();
        let assignee = p.assignee.clone().flatten();
        c.query_opt(
            &s,
            &[
                &id,
                &p.title,
                &p.description,
                &priority,
                &status,
                &set_assignee,
                &assignee,
                &now,
            ],
        )
        .await?
        .as_ref()
        .map(task)
        .transpose()
    }

    /// Deletes a task; answers it.
    pub async fn delete_task(c: &ClientWrapper, id: Uuid) -> Result<Option<Task>> {
        let s = c
            .prepare_cached(&format!(
                "DELETE FROM tasks WHERE id = $1 RETURNING {TASK_COLUMNS}"
            ))
            .await?;
        c.query_opt(&s, &[&id])
            .await?
            .as_ref()
            .map(task)
            .transpose()
    }

    /// Inserts a project.
    pub async fn insert_project(c: &ClientWrapper, p: &Project) -> Result<()> {
        let s = c
            .prepare_cached(
                "INSERT INTO projects (id, name, created_at) SELECT $1, $2, $3 \
                 WHERE (SELECT count(*) FROM projects) < $4",
            )
            .await?;
        match c
            .execute(&s, &[&p.id, &p.name, &p.created_at, &MAX_PROJECTS])
            .await?
        {
            0 => Err(too_many_projects()),
            _ => Ok(()),
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// The JSON a statement answers for a task's row is what the task serializes to,
        /// for every priority and status, a missing assignee, and text that JSON escapes.
        #[tokio::test]
        async fn a_rows_json_decodes_to_the_task_it_holds() {
            let Ok(url) = std::env::var("DATABASE_URL") else {
                eprintln!("skipped: DATABASE_URL is not set");
                return;
            };
            let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(connection);
            let sql = format!(
                "SELECT ({})::text FROM (SELECT $1::uuid AS id, $2::uuid AS project, $3::text AS title, \
                 $4::text AS description, $5::smallint AS priority, $6::smallint AS status, \
                 $7::text AS assignee, $8::bigint AS created_at, $9::bigint AS updated_at) AS t",
                task_json()
            );
            for priority in Priority::ALL {
                for status in Status::ALL {
                    for assignee in [None, Some("ada \"the\" \\ café\n".to_owned())] {
                        let t = Task {
                            id: Uuid::now_v7(),
                            project: Uuid::now_v7(),
                            title: "a \"title\" \u{1}\u{1F600}".to_owned(),
                            description: String::new(),
                            priority,
                            status,
                            assignee,
                            created_at: 1_764_000_000_000_000,
                            updated_at: i64::MAX,
                        };
                        let row = client.query_one(&sql, &task_params(&t)).await.unwrap();
                        let json: String = row.get(0);
                        assert_eq!(serde_json::from_str::<Task>(&json).unwrap(), t, "{json}");
                    }
                }
            }
            // A code this release has no name for fails the statement.
            let t = Task {
                id: Uuid::now_v7(),
                project: Uuid::now_v7(),
                title: "t".to_owned(),
                description: String::new(),
                priority: Priority::Low,
                status: Status::Todo,
                assignee: None,
                created_at: 0,
                updated_at: 0,
            };
            let mut params = task_params(&t);
            params[5] = &7i16;
            let e = client.query_one(&sql, &params).await.unwrap_err();
            let message = e.as_db_error().unwrap().message().to_owned();
            assert!(message.contains("no status has the code 7"), "{message}");
        }
    }
}

/// The queries and writes on a SQLite connection (pooled, or the pipeline's transaction).
pub mod lite {
    use rusqlite::{params, Connection, OptionalExtension, Row};

    use super::*;

    fn uuid(r: &Row<'_>, i: usize) -> rusqlite::Result<Uuid> {
        let bytes: [u8; 16] = r.get(i)?;
        Ok(Uuid::from_bytes(bytes))
    }

    pub(crate) fn project_row(r: &Row<'_>) -> rusqlite::Result<Project> {
        Ok(Project {
            id: uuid(r, 0)?,
            name: r.get(1)?,
            created_at: r.get(2)?,
        })
    }

    fn task(r: &Row<'_>) -> rusqlite::Result<Task> {
        let priority: i16 = r.get(4)?;
        let status: i16 = r.get(5)?;
        let bad = |i, what: &str, code: i16| {
            rusqlite::Error::FromSqlConversionFailure(
                i,
                rusqlite::types::Type::Integer,
                format!("a stored {what} code {code} is unknown").into(),
            )
        };
        Ok(Task {
            id: uuid(r, 0)?,
            project: uuid(r, 1)?,
            title: r.get(2)?,
            description: r.get(3)?,
            priority: Priority::from_code(priority).ok_or_else(|| bad(4, "priority", priority))?,
            status: Status::from_code(status).ok_or_else(|| bad(5, "status", status))?,
            assignee: r.get(6)?,
            created_at: r.get(7)?,
            updated_at: r.get(8)?,
        })
    }

    fn query_list<T>(
        c: &Connection,
        q: &ListQuery,
        columns: &str,
        f: impl FnMut(&Row<'_>) -> rusqlite::Result<T>,
    ) -> Result<Vec<T>> {
        let mut s = c.prepare_cached(&list_sql(q, columns, lite_placeholder))?;
        let after = q.after.unwrap_or(AFTER_ALL);
        let limit = i64::from(q.limit) + 1;
        let status = q.status.map(Status::code);
        let mut values: Vec<&dyn rusqlite::ToSql> = Vec::with_capacity(4);
        let project = q.project.as_ref().map(Uuid::as_bytes);
        if let Some(p) = &project {
            values.push(p);
        }
        if let Some(s) = &status {
            values.push(s);
        }
        let after = after.as_bytes();
        values.push(&after);
        values.push(&limit);
        let rows = s.query_map(values.as_slice(), f)?;
        Ok(rows.collect::<std::result::Result<_, _>>()?)
    }

    /// `limit + 1` tasks of a list.
    pub fn list(c: &Connection, q: &ListQuery) -> Result<Vec<Task>> {
        query_list(c, q, TASK_COLUMNS, task)
    }

    /// `limit + 1` ids of a list.
    pub fn list_ids(c: &Connection, q: &ListQuery) -> Result<Vec<Uuid>> {
        query_list(c, q, "id", |r| uuid(r, 0))
    }

    /// One task.
    pub fn get(c: &Connection, id: Uuid) -> Result<Option<Task>> {
        let mut s = c.prepare_cached(&format!("SELECT {TASK_COLUMNS} FROM tasks WHERE id = ?1"))?;
        Ok(s.query_row([id.as_bytes()], task).optional()?)
    }

    /// Inserts a task.
    pub fn insert_task(c: &Connection, t: &Task) -> Result<()> {
        // The project is checked here, not by the foreign key: a connection that did not
        // turn `foreign_keys` on (the operation pipeline's) would not enforce it.
        let mut s = c.prepare_cached(&format!(
            "INSERT INTO tasks ({TASK_COLUMNS}) SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9
             WHERE EXISTS (SELECT 1 FROM projects WHERE id = ?2)"
        ))?;
        let n = s.execute(params![
            t.id.as_bytes(),
            t.project.as_bytes(),
            t.title,
            t.description,
            t.priority.code(),
            t.status.code(),
            t.assignee,
            t.created_at,
            t.updated_at
        ])?;
        if n == 0 {
            return Err(StoreError::Unknown(Invalid::new(
                "project",
                "no such project",
            )));
        }
        Ok(())
    }

    /// Updates a task in one statement; `None` when there is no such task.
    pub fn update_task(c: &Connection, id: Uuid, p: &TaskPatch, now: i64) -> Result<Option<Task>> {
        let mut s = c.prepare_cached(&format!(
            "UPDATE tasks SET title = COALESCE(?2, title),
               description = COALESCE(?3, description),
               priority = COALESCE(?4, priority), status = COALESCE(?5, status),
               assignee = CASE WHEN ?6 THEN ?7 ELSE assignee END, updated_at = ?8
             WHERE id = ?1 RETURNING {TASK_COLUMNS}"
        ))?;
        Ok(s.query_row(
            params![
                id.as_bytes(),
                p.title,
                p.description,
                p.priority.map(Priority::code),
                p.status.map(Status::code),
                p.assignee.is_some(),
                p.assignee.clone().flatten(),
                now
            ],
            task,
        )
        .optional()?)
    }

    /// Deletes a task; answers it.
    pub fn delete_task(c: &Connection, id: Uuid) -> Result<Option<Task>> {
        let mut s = c.prepare_cached(&format!(
            "DELETE FROM tasks WHERE id = ?1 RETURNING {TASK_COLUMNS}"
        ))?;
        Ok(s.query_row([id.as_bytes()], task).optional()?)
    }

    /// Inserts a project.
    pub fn insert_project(c: &Connection, p: &Project) -> Result<()> {
        let inserted = c
            .prepare_cached(
                "INSERT INTO projects (id, name, created_at) SELECT ?1, ?2, ?3 \
                 WHERE (SELECT count(*) FROM projects) < ?4",
            )?
            .execute(params![p.id.as_bytes(), p.name, p.created_at, MAX_PROJECTS])?;
        match inserted {
            0 => Err(super::too_many_projects()),
            _ => Ok(()),
        }
    }
}
