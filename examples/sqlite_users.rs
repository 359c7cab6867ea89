//! A compute service over SQLite, and a view computed from it that updates after a write.
//!
//! ```sh
//! cargo run -p coherent-examples --example sqlite_users
//! ```
//!
//! `Users::user(id)` reads one row; `Users::team_roster(team)` reads the team's member ids and
//! then calls `user(id)` for each, so every user it shows becomes one of its dependencies.
//! `Users::rename` writes the row and invalidates `user(id)`; the invalidation cascades to the
//! rosters that showed that user, and a `ComputedState` watching one roster recomputes and
//! publishes the new value by itself. The log lines show exactly what ran.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use coherent::{compute_service, ComputeService, ComputedState, Registry, ServiceHandle};
use parking_lot::Mutex;
use rusqlite::{params, Connection, OptionalExtension};

/// A row of the `users` table. Cached results are shared, so they are returned as `Arc<User>`:
/// a cached hit then copies a pointer, not the strings.
#[derive(Debug)]
struct User {
    id: i64,
    name: String,
    team: i64,
}

/// Errors are cached too (briefly), so the error type must be `Clone`: a shared message is.
type DbResult<T> = Result<T, Arc<str>>;

fn db_error(e: rusqlite::Error) -> Arc<str> {
    e.to_string().into()
}

/// The compute service: a `ServiceHandle` (its cache tables) and whatever the methods need.
#[derive(Clone, ComputeService)]
struct Users {
    handle: ServiceHandle,
    /// rusqlite's `Connection` is `Send` but not `Sync`; these statements take microseconds,
    /// so one connection behind a mutex is enough for an example. A server would use a pool
    /// and `spawn_blocking` (see `crates/coherent-bench/src/local/store.rs`).
    db: Arc<Mutex<Connection>>,
}

#[compute_service]
impl Users {
    /// One user, or `None`. Memoized per `id`.
    #[compute]
    async fn user(&self, id: i64) -> DbResult<Option<Arc<User>>> {
        println!("  ran user({id})");
        let db = self.db.lock();
        let mut query = db
            .prepare_cached("SELECT id, name, team FROM users WHERE id = ?1")
            .map_err(db_error)?;
        query
            .query_row(params![id], |row| {
                Ok(Arc::new(User {
                    id: row.get(0)?,
                    name: row.get(1)?,
                    team: row.get(2)?,
                }))
            })
            .optional()
            .map_err(db_error)
    }

    /// The ids of a team's members. Cached for at most a minute (`auto_invalidate`), because
    /// this example only invalidates it explicitly on renames, not on membership changes.
    #[compute(auto_invalidate = "1m")]
    async fn member_ids(&self, team: i64) -> DbResult<Arc<[i64]>> {
        println!("  ran member_ids({team})");
        let db = self.db.lock();
        let mut query = db
            .prepare_cached("SELECT id FROM users WHERE team = ?1 ORDER BY id")
            .map_err(db_error)?;
        let ids = query
            .query_map(params![team], |row| row.get(0))
            .and_then(Iterator::collect::<Result<Vec<i64>, _>>)
            .map_err(db_error)?;
        Ok(ids.into())
    }

    /// A view built from other compute methods: each call below is recorded as a dependency,
    /// across the `.await`s, so renaming any member invalidates this roster.
    #[compute]
    async fn team_roster(&self, team: i64) -> DbResult<Arc<str>> {
        println!("  ran team_roster({team})");
        let mut names = Vec::new();
        for id in self.member_ids(team).await?.iter() {
            if let Some(user) = self.user(*id).await? {
                debug_assert_eq!(user.team, team);
                names.push(format!("{} (#{})", user.name, user.id));
            }
        }
        Ok(names.join(", ").into())
    }
}

impl Users {
    /// Creates the schema and a few rows in a WAL-mode database file.
    fn open(path: &Path, registry: &Registry) -> anyhow::Result<Self> {
        let db = Connection::open(path)?;
        db.pragma_update(None, "journal_mode", "WAL")?;
        db.execute_batch(
            "DROP TABLE IF EXISTS users;
             CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT NOT NULL, team INTEGER NOT NULL);
             INSERT INTO users VALUES (1, 'Ada', 1), (2, 'Grace', 1), (3, 'Linus', 2);",
        )?;
        Ok(Self {
            handle: ServiceHandle::with_registry(registry),
            db: Arc::new(Mutex::new(db)),
        })
    }

    /// A write: commit first, then invalidate what it changed. The order matters: a
    /// recomputation that starts after the invalidation must read the committed row.
    fn rename(&self, id: i64, name: &str) -> anyhow::Result<()> {
        self.db.lock().execute(
            "UPDATE users SET name = ?2 WHERE id = ?1",
            params![id, name],
        )?;
        self.invalidate_user(id);
        Ok(())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let path = std::env::temp_dir().join(format!("coherent-users-{}.db", std::process::id()));
    let registry = Registry::new();
    let users = Users::open(&path, &registry)?;
    println!("database: {}", path.display());

    println!("first read of team 1 computes it and everything it reads:");
    println!(
        "  = {}",
        users.team_roster(1).await.map_err(anyhow::Error::msg)?
    );

    println!("second read is a cached hit (nothing runs):");
    println!(
        "  = {}",
        users.team_roster(1).await.map_err(anyhow::Error::msg)?
    );

    // The computed behind a call: its state, and a future that completes on invalidation.
    let roster = users.team_roster_computed(1).await;
    println!(
        "the roster is {:?}, version {}",
        roster.state(),
        roster.version()
    );

    // A state that keeps itself up to date, as a UI or a background job would hold it.
    let watched = {
        let users = users.clone();
        ComputedState::builder()
            .registry(&registry)
            .name("roster_view")
            .build(move || {
                let users = users.clone();
                async move {
                    users
                        .team_roster(1)
                        .await
                        .unwrap_or_else(|e| format!("error: {e}").into())
                }
            })
            .await
    };
    let mut changes = watched.watch();

    println!("rename user 2 (team 1): the write invalidates user(2), which cascades:");
    users.rename(2, "Grace Hopper")?;
    roster.when_invalidated().await;
    println!("the captured roster is now {:?}", roster.state());

    // The state recomputes by itself; wait for it to publish.
    tokio::time::timeout(Duration::from_secs(5), changes.changed()).await??;
    println!(
        "the watched roster updated itself: {}",
        *changes.borrow_and_update()
    );

    println!("rename user 3 (team 2): team 1's roster does not depend on it:");
    users.rename(3, "Linus T.")?;
    println!(
        "  = {}",
        users.team_roster(1).await.map_err(anyhow::Error::msg)?
    );

    let metrics = registry.metrics();
    println!(
        "counters: {} hits, {} misses, {} invalidations",
        metrics.hits, metrics.misses, metrics.invalidations
    );
    drop(users);
    let _ = std::fs::remove_file(&path);
    Ok(())
}
