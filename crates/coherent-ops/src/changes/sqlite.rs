//! Changes made through the application's own SQLite connections ([`track`]): SQLite's
//! update hook names each changed row (by its table and `rowid`), the commit hook hands
//! the transaction's rows over, and the write-ahead-log hook, which SQLite runs after the
//! commit took place and the write lock was released, applies them here and logs them for
//! the other processes of the cluster.
//!
//! Limits, all SQLite's: only connections with the hooks are seen (not another process's,
//! nor the `sqlite3` shell's); a change carries the row's `rowid` only, under that name and
//! under the name of the table's `INTEGER PRIMARY KEY` column when it has one (that column
//! is the rowid), so `change.key::<i64>("id")`; `WITHOUT ROWID`
//! tables are not reported (their changes count as none); the database must be in WAL
//! mode. A `DELETE` without a `WHERE` on a watched table deletes row by row (the
//! connection's authorizer turns SQLite's truncate off for it), so that each row is
//! reported.
//!
//! The write-ahead-log hook is the one SQLite uses for its automatic checkpoints: a tracked
//! connection checkpoints itself past 1,000 pages of log, as SQLite's default does, and
//! `PRAGMA wal_autocheckpoint` on it afterwards takes the hook away (nothing is applied
//! after). Its authorizer is taken too (see [`track`]). A statement with `RETURNING`
//! commits while it is reset, after which SQLite runs no log hook: its changes are applied
//! at the thread's next write, or by [`settle`]. A row that `INSERT OR REPLACE` deletes
//! because it conflicts on another `UNIQUE` column than the rowid is not reported by
//! SQLite's update hook.

use std::cell::RefCell;
use std::collections::HashMap;
use std::os::raw::c_int;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use rusqlite::hooks::{Action, AuthAction, AuthContext, Authorization, Wal};
use rusqlite::Connection;

use super::{ApplyChanges, Batch, Change, ChangeKind, Row};
use crate::error::{CommandError, ErrorKind};
use crate::host::{Host, Inner};

/// SQLite's default automatic checkpoint, in pages of log.
const AUTOCHECKPOINT: c_int = 1_000;

/// A tracked connection's transaction in progress.
#[derive(Default)]
struct Pending {
    batch: Batch,
    /// It wrote an operation to the log: a command's, whose handler invalidates.
    command: bool,
}

struct Tracker {
    host: Weak<Inner>,
    apply: Arc<ApplyChanges>,
    max_rows: usize,
    pending: Mutex<Pending>,
}

thread_local! {
    /// Set by a commit hook, taken by the write-ahead-log hook that follows on this thread.
    static COMMITTED: RefCell<Vec<(Arc<Tracker>, Batch)>> = const { RefCell::new(Vec::new()) };
}

/// Has the changes committed through `conn` invalidate here and on every host, as
/// `host`'s watches ([`HostBuilder::watch`](crate::HostBuilder::watch)) say. Replaces the
/// connection's update, commit, rollback and write-ahead-log hooks and its authorizer.
///
/// The changes are applied here before the statement that committed them returns (a read
/// that starts after it sees them), and logged as a `coherent.db_changes` operation for the
/// other hosts, in the background. A transaction that wrote an operation to the log (a
/// command run through this connection) is skipped: its handler invalidates.
///
/// An error when the database is not in WAL mode (the hook that runs after a commit is the
/// log's) or the host has no watches.
pub fn track(conn: &Connection, host: &Host) -> Result<(), CommandError> {
    let sqlite = |e: rusqlite::Error| CommandError::new(ErrorKind::Database, e.to_string());
    let mode: String = conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .map_err(sqlite)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(CommandError::new(
            ErrorKind::Database,
            format!("change tracking needs a database in WAL mode (journal_mode is {mode})"),
        ));
    }
    let Some(apply) = host.inner.changes.clone() else {
        return Err(CommandError::new(
            ErrorKind::BadCommand,
            "change tracking: the host watches no table (HostBuilder::watch)",
        ));
    };
    // A watched table's `INTEGER PRIMARY KEY` is its rowid: changes carry it under both
    // names (read now: the hooks cannot use the connection).
    let mut aliases = HashMap::new();
    for w in &apply.watches.tables {
        let mut stmt = conn
            .prepare("SELECT name, type, pk FROM pragma_table_info(?1)")
            .map_err(sqlite)?;
        let keys: Vec<(String, String)> = stmt
            .query_map([&w.name], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })
            .map_err(sqlite)?
            .filter_map(Result::ok)
            .filter(|(_, _, pk)| *pk > 0)
            .map(|(name, ty, _)| (name, ty))
            .collect();
        if let [(name, ty)] = &keys[..] {
            if ty.eq_ignore_ascii_case("integer") {
                aliases.insert(w.name.clone(), name.clone());
            }
        }
    }
    let tracker = Arc::new(Tracker {
        host: Arc::downgrade(&host.inner),
        apply,
        max_rows: super::MAX_ROWS,
        pending: Mutex::new(Pending::default()),
    });
    // A `DELETE` without a `WHERE` is SQLite's truncate: it deletes without calling the
    // update hook, unless the authorizer answers `SQLITE_IGNORE` to it, which makes it
    // delete row by row (and nothing else).
    let watched = tracker.apply.clone();
    conn.authorizer(Some(move |ctx: AuthContext<'_>| match ctx.action {
        AuthAction::Delete { table_name } if watched.watches.watches("main", table_name) => {
            Authorization::Ignore
        }
        _ => Authorization::Allow,
    }))
    .map_err(sqlite)?;
    let t = tracker.clone();
    conn.update_hook(Some(
        move |action: Action, db: &str, table: &str, rowid: i64| {
            deliver_committed();
            let mut pending = t.pending.lock();
            if table == "coherent_operations" {
                pending.command = true;
                return;
            }
            if !t.apply.watches.watches(db, table) {
                return;
            }
            let kind = match action {
                Action::SQLITE_INSERT => ChangeKind::Insert,
                Action::SQLITE_UPDATE => ChangeKind::Update,
                _ => ChangeKind::Delete,
            };
            let mut row = vec![("rowid".to_owned(), Some(rowid.to_string()))];
            if let Some(alias) = aliases.get(table) {
                row.push((alias.clone(), Some(rowid.to_string())));
            }
            let row = Row(row);
            let (new, old) = match kind {
                ChangeKind::Delete => (None, Some(row)),
                _ => (Some(row), None),
            };
            let change = Change {
                schema: db.to_owned(),
                table: table.to_owned(),
                kind,
                new,
                old,
            };
            pending.batch.row(change, t.max_rows);
        },
    ))
    .map_err(sqlite)?;
    let t = tracker.clone();
    conn.commit_hook(Some(move || {
        deliver_committed();
        let pending = std::mem::take(&mut *t.pending.lock());
        if !pending.command && pending.batch.len() > 0 {
            COMMITTED.with(|c| c.borrow_mut().push((t.clone(), pending.batch)));
        }
        false
    }))
    .map_err(sqlite)?;
    let t = tracker;
    conn.rollback_hook(Some(move || {
        *t.pending.lock() = Pending::default();
    }))
    .map_err(sqlite)?;
    conn.wal_hook(Some(after_commit));
    Ok(())
}

/// SQLite's write-ahead-log hook: the commit took place and its lock is released.
fn after_commit(wal: &Wal, pages: c_int) -> rusqlite::Result<()> {
    deliver_committed();
    if pages >= AUTOCHECKPOINT {
        // Busy (a reader holds the log): the next commit tries again, as SQLite's does.
        let _ = wal.checkpoint();
    }
    Ok(())
}

/// Applies the changes of this thread's transactions whose commit hook ran, and logs them
/// for the other hosts. Run by the write-ahead-log hook after a commit; and at the next
/// write of the thread, for a commit whose log hook SQLite did not run (a statement with
/// `RETURNING` commits while it is reset, after which SQLite runs no log hook); and by
/// [`settle`].
fn deliver_committed() {
    let committed = COMMITTED.with(|c| std::mem::take(&mut *c.borrow_mut()));
    for (tracker, batch) in committed {
        let mut changes = batch.into_changes();
        // A watch that panics flushes instead (`apply` catches it).
        tracker.apply.apply(&changes);
        if let Some(inner) = tracker.host.upgrade() {
            changes.applied_by = Some(inner.id.clone());
            let host = Host { inner };
            let runtime = host.inner.runtime.clone();
            let weak = Arc::downgrade(&host.inner);
            drop(host);
            // Until it is logged or the host stops: the other hosts have no other way to
            // hear of it.
            runtime.spawn(async move {
                let mut wait = std::time::Duration::from_millis(20);
                loop {
                    let Some(inner) = weak.upgrade() else {
                        return;
                    };
                    if *inner.stop.borrow() {
                        return;
                    }
                    match (Host { inner }).run(changes.clone()).await {
                        Ok(()) => return,
                        Err(e) => {
                            tracing::warn!(%e, "database changes could not be logged for the \
                                other hosts yet: trying again");
                        }
                    }
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(std::time::Duration::from_secs(2));
                }
            });
        }
    }
}

/// Applies now the changes committed on this thread through tracked connections whose
/// write-ahead-log hook SQLite did not run: after a statement with `RETURNING` (it
/// commits while it is reset), call it, or they wait for the thread's next write.
pub fn settle() {
    deliver_committed();
}
