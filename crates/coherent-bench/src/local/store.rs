//! The two stores of the user service, each with an honest direct repository method: a pooled
//! connection, a cached prepared statement, a row mapped to the struct.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::params;

/// Short text stored inline, so that `User` is `Copy`.
pub(crate) type Text = arrayvec::ArrayString<24>;

/// The value every peer caches and every call returns. `Copy` (its strings are inline): a
/// cached hit hands out a copy and touches no shared reference count. With `Arc<User>`,
/// every reader of a user would write that user's count, and no cache of any kind could
/// scale past one core on random reads (readers on two cores would trade its cache line).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct User {
    pub(crate) id: u64,
    pub(crate) version: u64,
    pub(crate) name: Text,
    pub(crate) created_at: i64,
    pub(crate) modified_at: i64,
}

pub(crate) const USERS: u64 = 1_000;

pub(crate) type StoreError = Arc<str>;

/// A store error as the service caches it: its message.
fn store_error(e: impl std::fmt::Display) -> StoreError {
    e.to_string().into()
}

pub(crate) fn now_micros() -> i64 {
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros();
    i64::try_from(micros).unwrap_or(i64::MAX)
}

pub(crate) fn seed_user(id: u64) -> User {
    User {
        id,
        version: 0,
        name: text(&format!("User {id}")),
        created_at: 1_700_000_000_000_000,
        modified_at: 1_700_000_000_000_000,
    }
}

/// Text that fits (or is cut at a character boundary to fit) in a [`Text`].
pub(crate) fn text(s: &str) -> Text {
    let mut end = s.len().min(Text::new().capacity());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Text::from(&s[..end]).expect("cut to fit")
}

fn postgres_pool(
    config: tokio_postgres::Config,
    size: usize,
) -> anyhow::Result<deadpool_postgres::Pool> {
    let manager = deadpool_postgres::Manager::from_config(
        config,
        tokio_postgres::NoTls,
        deadpool_postgres::ManagerConfig {
            recycling_method: deadpool_postgres::RecyclingMethod::Fast,
        },
    );
    Ok(deadpool_postgres::Pool::builder(manager)
        .max_size(size)
        .build()?)
}

pub(crate) fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

const PG_SELECT: &str =
    "SELECT id, version, name, created_at, modified_at FROM users WHERE id = $1";
pub(crate) const PG_UPDATE: &str =
    "UPDATE users SET version = $2, name = $3, modified_at = $4 WHERE id = $1";
const SQLITE_SELECT: &str =
    "SELECT id, version, name, created_at, modified_at FROM users WHERE id = ?1";
const SQLITE_UPDATE: &str =
    "UPDATE users SET version = ?2, name = ?3, modified_at = ?4 WHERE id = ?1";

/// Where the users live.
pub(crate) enum Store {
    Sqlite(r2d2::Pool<SqliteConnectionManager>),
    /// The pool, and its settings, to make another pool for another runtime.
    Postgres(deadpool_postgres::Pool, Box<tokio_postgres::Config>),
}

impl Store {
    /// A SQLite database file in WAL mode, created with 1,000 users.
    pub(crate) fn sqlite(path: &Path, pool_size: u32) -> anyhow::Result<Self> {
        let manager = SqliteConnectionManager::file(path).with_init(|c| {
            c.execute_batch(
                "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA busy_timeout = 5000;",
            )
        });
        let pool = r2d2::Pool::builder().max_size(pool_size).build(manager)?;
        let mut conn = pool.get()?;
        let tx = conn.transaction()?;
        tx.execute_batch(
            "CREATE TABLE users (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, name TEXT NOT NULL,
                                 created_at INTEGER NOT NULL, modified_at INTEGER NOT NULL);",
        )?;
        {
            let mut insert = tx.prepare("INSERT INTO users VALUES (?1, ?2, ?3, ?4, ?5)")?;
            for id in 1..=USERS {
                let u = seed_user(id);
                insert.execute(params![
                    to_i64(u.id),
                    to_i64(u.version),
                    u.name.as_str(),
                    u.created_at,
                    u.modified_at
                ])?;
            }
        }
        tx.commit()?;
        drop(conn);
        Ok(Store::Sqlite(pool))
    }

    /// The same database through connections of its own, for a task on another runtime: a
    /// tokio-postgres connection is driven by a task of the runtime that opened it, and a busy
    /// runtime would delay that task's writes.
    pub(crate) fn for_another_runtime(&self) -> anyhow::Result<Self> {
        Ok(match self {
            Store::Sqlite(pool) => Store::Sqlite(pool.clone()),
            Store::Postgres(_, config) => {
                Store::Postgres(postgres_pool((**config).clone(), 2)?, config.clone())
            }
        })
    }

    /// PostgreSQL at `url`, with a fresh table of 1,000 users; `None` when it is not reachable.
    pub(crate) async fn postgres(url: &str, pool_size: usize) -> anyhow::Result<Option<Self>> {
        let config: tokio_postgres::Config = url.parse().context("DATABASE_URL")?;
        let pool = postgres_pool(config.clone(), pool_size)?;
        let client = match tokio::time::timeout(Duration::from_secs(3), pool.get()).await {
            Ok(Ok(client)) => client,
            _ => return Ok(None),
        };
        create_users(&client).await?;
        drop(client);
        Ok(Some(Store::Postgres(pool, Box::new(config))))
    }

    /// PostgreSQL through `config` (which may set a `search_path`), a pool of `size`
    /// connections; no table is made.
    pub(crate) fn postgres_with(
        config: tokio_postgres::Config,
        size: usize,
    ) -> anyhow::Result<Self> {
        Ok(Store::Postgres(
            postgres_pool(config.clone(), size)?,
            Box::new(config),
        ))
    }

    /// The direct repository method: one query per call.
    pub(crate) async fn get(&self, id: u64) -> Result<User, StoreError> {
        match self {
            Store::Sqlite(pool) => {
                let conn = pool.get().map_err(store_error)?;
                let mut query = conn.prepare_cached(SQLITE_SELECT).map_err(store_error)?;
                query
                    .query_row(params![to_i64(id)], |row| {
                        Ok(User {
                            id: to_u64(row.get(0)?),
                            version: to_u64(row.get(1)?),
                            name: text(row.get_ref(2)?.as_str()?),
                            created_at: row.get(3)?,
                            modified_at: row.get(4)?,
                        })
                    })
                    .map_err(store_error)
            }
            Store::Postgres(pool, _) => {
                let client = pool.get().await.map_err(store_error)?;
                let query = client
                    .prepare_cached(PG_SELECT)
                    .await
                    .map_err(store_error)?;
                let row = client
                    .query_one(&query, &[&to_i64(id)])
                    .await
                    .map_err(store_error)?;
                Ok(User {
                    id: to_u64(row.get(0)),
                    version: to_u64(row.get(1)),
                    name: text(row.get(2)),
                    created_at: row.get(3),
                    modified_at: row.get(4),
                })
            }
        }
    }

    /// Writes a new version of a user.
    pub(crate) async fn update(&self, id: u64, version: u64) -> Result<(), StoreError> {
        let name = format!("User {id} v{version}");
        let modified_at = now_micros();
        match self {
            Store::Sqlite(pool) => {
                let conn = pool.get().map_err(store_error)?;
                let mut update = conn.prepare_cached(SQLITE_UPDATE).map_err(store_error)?;
                update
                    .execute(params![to_i64(id), to_i64(version), name, modified_at])
                    .map_err(store_error)?;
                Ok(())
            }
            Store::Postgres(pool, _) => {
                let client = pool.get().await.map_err(store_error)?;
                let update = client
                    .prepare_cached(PG_UPDATE)
                    .await
                    .map_err(store_error)?;
                client
                    .execute(
                        &update,
                        &[&to_i64(id), &to_i64(version), &name, &modified_at],
                    )
                    .await
                    .map_err(store_error)?;
                Ok(())
            }
        }
    }
}

/// Creates the `users` table (dropping an old one) with 1,000 users at version 0, in the
/// client's current schema.
pub(crate) async fn create_users(client: &tokio_postgres::Client) -> anyhow::Result<()> {
    client
        .batch_execute(
            "DROP TABLE IF EXISTS users;
             CREATE TABLE users (id BIGINT PRIMARY KEY, version BIGINT NOT NULL, name TEXT NOT NULL,
                                 created_at BIGINT NOT NULL, modified_at BIGINT NOT NULL);",
        )
        .await?;
    let insert = client
        .prepare("INSERT INTO users VALUES ($1, $2, $3, $4, $5)")
        .await?;
    for id in 1..=USERS {
        let u = seed_user(id);
        client
            .execute(
                &insert,
                &[
                    &to_i64(u.id),
                    &to_i64(u.version),
                    &u.name.as_str(),
                    &u.created_at,
                    &u.modified_at,
                ],
            )
            .await?;
    }
    Ok(())
}
