//! Invalidation from the database itself: changes committed by anyone (a migration, an
//! admin console, a cron job, another service, a `psql` session) invalidate the computeds
//! that read the changed rows, on every host.
//!
//! A host declares what each watched table's changes invalidate ([`watch_table`],
//! [`HostBuilder::watch`](crate::HostBuilder::watch)); a feed turns committed changes into
//! an operation of the log (the built-in command `coherent.db_changes`), which every host
//! applies as it applies any other host's command: the watches run there, the command's
//! caller (the feed) waits for every live host's acknowledgement, and a host that may have
//! missed operations flushes its cache as it does for commands. Feeds:
//!
//! - PostgreSQL logical decoding ([`ChangeFeed::postgres`]): a publication of the watched
//!   tables and a logical replication slot (`pgoutput`), read by one host at a time (the
//!   others stand by on an advisory lock). The slot moves past a transaction only after the
//!   operation that carries its changes committed, so a feed that dies, loses its
//!   connection, or finds the database restarted reads the same changes again (a change is
//!   invalidated at least once, never lost).
//! - SQLite ([`sqlite::track`]): the update, commit and write-ahead-log hooks of the
//!   application's own connections: changes through those connections invalidate here
//!   after their commit, and the other processes of the cluster hear of them through the
//!   log. Changes by connections without the hooks (another process, the `sqlite3`
//!   shell) are not seen.
//!
//! Changes that a command of the pipeline made are its handler's to invalidate: a
//! transaction that also wrote an operation to the log is skipped by default
//! ([`ChangeFeed::skip_commands`]).

pub mod pgoutput;
mod postgres;
mod replication;
pub mod sqlite;
mod triggers;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use coherent_core::Registry;
use serde::{Deserialize, Serialize};

use crate::command::{Command, Handler};
use crate::db::Tx;
use crate::error::CommandError;

pub(crate) use postgres::{hold_owed, run_postgres_feed, settle_holds, FeedCounters, PgFeed};
pub use postgres::{FeedStats, FEED_APPLICATION};

/// What happened to a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChangeKind {
    /// A row inserted.
    Insert,
    /// A row updated.
    Update,
    /// A row deleted.
    Delete,
}

/// The columns of a row that a change carries: the table's key columns (its replica
/// identity on PostgreSQL; `rowid` on SQLite) and the columns its watches asked for
/// ([`TableWatch::columns`]), each in PostgreSQL's text format (`None`: SQL `NULL`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Row(pub Vec<(String, Option<String>)>);

impl Row {
    /// The text of `column`: `None` when the row does not carry it or it is `NULL`.
    pub fn text(&self, column: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(name, _)| name == column)
            .and_then(|(_, v)| v.as_deref())
    }
}

/// A committed change to one row of a watched table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    /// The table's schema (`main` on SQLite).
    pub schema: String,
    /// The table's name.
    pub table: String,
    /// What happened to the row.
    pub kind: ChangeKind,
    /// The row after the change (inserts and updates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new: Option<Row>,
    /// The row before it: deletes, and updates that changed the key (on PostgreSQL, the
    /// key columns only, unless the table has `REPLICA IDENTITY FULL`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old: Option<Row>,
}

impl Change {
    /// The value of `column` after the change, or before it for a delete, parsed from its
    /// text: e.g. `change.key::<i64>("id")`. `None` when the row does not carry the column,
    /// it is `NULL`, or its text does not parse as `T`.
    pub fn key<T: FromStr>(&self, column: &str) -> Option<T> {
        self.new
            .as_ref()
            .or(self.old.as_ref())
            .and_then(|row| row.text(column))
            .and_then(|text| text.parse().ok())
    }

    /// The value of `column` before the change, when the change carries the old row (a
    /// delete; an update that changed the key, or any update of a table with `REPLICA
    /// IDENTITY FULL`): invalidate by it too when a key moved.
    pub fn old_key<T: FromStr>(&self, column: &str) -> Option<T> {
        self.old
            .as_ref()
            .and_then(|row| row.text(column))
            .and_then(|text| text.parse().ok())
    }
}

type OnChange = Arc<dyn Fn(&Change) + Send + Sync>;
type OnTable = Arc<dyn Fn() + Send + Sync>;

/// What the changes of one table invalidate; see [`watch_table`].
#[derive(Clone)]
pub struct TableWatch {
    schema: Option<String>,
    pub(crate) name: String,
    columns: Vec<String>,
    on_change: Vec<OnChange>,
    on_any_change: Vec<OnTable>,
    on_every_row: Option<OnTable>,
}

impl fmt::Debug for TableWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TableWatch")
            .field("schema", &self.schema)
            .field("name", &self.name)
            .field("columns", &self.columns)
            .finish_non_exhaustive()
    }
}

/// Starts the declaration of what the changes of `table` (`"users"`, or
/// `"schema.users"`) invalidate:
///
/// ```
/// # use coherent_ops::watch_table;
/// # fn invalidate_user(_: i64) {} fn invalidate_user_list() {}
/// let users = watch_table("users")
///     // Each changed row: the computeds keyed by it.
///     .on_change(|change| {
///         if let Some(id) = change.key::<i64>("id") {
///             invalidate_user(id);
///         }
///     })
///     // Any change to the table: the computeds whose rows are not known (lists, counts).
///     .on_any_change(invalidate_user_list);
/// ```
///
/// Register it on every host with [`HostBuilder::watch`](crate::HostBuilder::watch), like a
/// command's handler: a host that does not know the built-in command flushes its cache for
/// each such operation.
pub fn watch_table(table: &str) -> TableWatch {
    let (schema, name) = match table.split_once('.') {
        Some((schema, name)) => (Some(schema.to_owned()), name.to_owned()),
        None => (None, table.to_owned()),
    };
    TableWatch {
        schema,
        name,
        columns: Vec::new(),
        on_change: Vec::new(),
        on_any_change: Vec::new(),
        on_every_row: None,
    }
}

impl TableWatch {
    /// Runs `f` for each changed row (after its transaction committed, on every host).
    pub fn on_change(mut self, f: impl Fn(&Change) + Send + Sync + 'static) -> Self {
        self.on_change.push(Arc::new(f));
        self
    }

    /// Runs `f` once per operation in which the table changed at all: the coarse fallback
    /// for computeds whose rows are not known (lists, aggregates).
    pub fn on_any_change(mut self, f: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_any_change.push(Arc::new(f));
        self
    }

    /// Runs `f` when every row may have changed: a `TRUNCATE`, or more rows in one
    /// operation than [`ChangeFeed::max_rows`] (their keys are not carried). It should
    /// invalidate what [`on_change`](Self::on_change) invalidates for any row. Without it,
    /// such a change flushes the host's registries when the table has `on_change`
    /// handlers.
    pub fn on_every_row(mut self, f: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_every_row = Some(Arc::new(f));
        self
    }

    /// Columns beyond the key that changes of this table carry (PostgreSQL): e.g. a task's
    /// `project_id`, to invalidate its project's list. The new row carries them; the old
    /// one only with `REPLICA IDENTITY FULL` on the table.
    pub fn columns<I, S>(mut self, columns: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.columns.extend(columns.into_iter().map(Into::into));
        self
    }

    fn matches(&self, schema: &str, name: &str) -> bool {
        self.name == name && self.schema.as_deref().is_none_or(|s| s == schema)
    }

    /// The name as the publication lists it.
    pub(crate) fn qualified(&self, default_schema: &str) -> String {
        format!(
            "{}.{}",
            self.schema.as_deref().unwrap_or(default_schema),
            self.name
        )
    }
}

/// The watches of a host, applied to each `coherent.db_changes` operation.
#[derive(Clone, Default)]
pub(crate) struct Watches {
    pub(crate) tables: Vec<TableWatch>,
}

impl Watches {
    /// Whether changes of `schema.name` are watched here (without building the column set:
    /// the SQLite hooks ask it for every row written).
    pub(crate) fn watches(&self, schema: &str, name: &str) -> bool {
        self.tables.iter().any(|w| w.matches(schema, name))
    }

    /// Whether changes of `schema.name` are watched here, and the columns they carry.
    pub(crate) fn columns(&self, schema: &str, name: &str) -> Option<BTreeSet<String>> {
        let mut found = false;
        let mut columns = BTreeSet::new();
        for w in self.tables.iter().filter(|w| w.matches(schema, name)) {
            found = true;
            columns.extend(w.columns.iter().cloned());
        }
        found.then_some(columns)
    }
}

/// The operation a feed logs: the rows changed by committed transactions, tables that
/// changed as a whole, or a flush (the feed may have missed changes).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DbChanges {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) rows: Vec<Change>,
    /// `schema.name` of tables whose every row may have changed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) tables: Vec<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) flush: bool,
    /// The host that applied the changes before it logged them (SQLite's tracked
    /// connections): it does not run the watches again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) applied_by: Option<String>,
    /// A number the change feed gave these changes when it also sent them to the other
    /// hosts ahead of their operation (a [`HintOut`]); 0 when it did not. A host applies
    /// whichever of the two reaches it first and skips the other (see [`SeenHints`]).
    #[serde(default, skip_serializing_if = "crate::host::is_zero")]
    pub(crate) hint: u64,
    /// With `flush`: a flush now owed (a slot about to be made, which waits for every
    /// transaction running then; a change committed in that wait reaches no slot). Each
    /// host holds its cache from here until a flush that pays it ([`paid`](Self::paid)):
    /// every call reads the database meanwhile (see [`ApplyChanges::hold`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) hold: Option<Owed>,
    /// With `flush`: the owed flush this one pays, which ends the holds of that name
    /// numbered below it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) paid: Option<Owed>,
}

/// An owed flush in a hold or a payment: its name (the slot's) and a number, a 64-bit
/// PostgreSQL transaction id. A hold is numbered by the transaction that owed the flush, a
/// payment by the next id when it read the debt: a payment is above the holds it pays and
/// not above any hold owed after it, whatever order a host hears them in (a notice can come
/// before an older operation that a rejoin reads from the log).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Owed {
    pub(crate) name: String,
    pub(crate) at: u64,
}

impl Owed {
    pub(crate) fn new(name: &str, at: u64) -> Self {
        Self {
            name: name.to_owned(),
            at,
        }
    }
}

/// A host's holds, by owed name: the number of the newest hold standing, and of the newest
/// payment heard.
#[derive(Default)]
pub(crate) struct Holds {
    held: BTreeMap<String, u64>,
    paid: BTreeMap<String, u64>,
}

/// Database changes, sent by the host that reads the change feed to the other hosts
/// (PostgreSQL `NOTIFY` on [`hint_channel`](crate::notify::hint_channel)) as soon as it
/// applied them itself, before their operation is logged: a host that hears it applies
/// them at once. The changes are committed (the feed reads only committed transactions),
/// so the early invalidation is never wrong; the operation, logged after, stays the
/// truth for a host that missed the hint. It saves the other hosts the log's commit and
/// its own `NOTIFY`, each a few wake-ups of other processes on a loaded machine.
#[derive(Serialize)]
pub(crate) struct HintOut<'a> {
    pub(crate) from: &'a str,
    pub(crate) changes: &'a DbChanges,
}

/// A [`HintOut`] as heard.
#[derive(Deserialize)]
pub(crate) struct HintIn {
    pub(crate) from: String,
    pub(crate) changes: DbChanges,
}

/// The hint numbers a host met once (in a hint or in the operation that carries the same
/// changes): the second of the pair is skipped, since the first was applied after the
/// changes committed and every entry computed since read them. Bounded: a number
/// forgotten early only means the pair is applied twice (an extra invalidation).
///
/// A number is remembered with a hash of the changes it came with ([`DbChanges::fingerprint`]):
/// anyone who may `NOTIFY` can send a hint, and a forged one that reused the number of a
/// real batch with other changes must not have that batch's operation skipped.
#[derive(Default)]
pub(crate) struct SeenHints {
    order: std::collections::VecDeque<(u64, u64)>,
    set: std::collections::HashSet<(u64, u64)>,
}

impl SeenHints {
    /// How many numbers are remembered.
    const MAX: usize = 4_096;

    /// `true` when `hint` was met before (and is forgotten now: the pair is complete);
    /// else it is remembered.
    fn second(&mut self, hint: (u64, u64)) -> bool {
        if self.set.remove(&hint) {
            return true;
        }
        self.set.insert(hint);
        self.order.push_back(hint);
        while self.order.len() > Self::MAX {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        false
    }
}

impl DbChanges {
    pub(crate) fn is_empty(&self) -> bool {
        self.rows.is_empty() && self.tables.is_empty() && !self.flush
    }

    /// A hash of what the changes say (rows, tables, flush), the same for a hint and for
    /// the operation that carries the same changes.
    pub(crate) fn fingerprint(&self) -> u64 {
        let body = serde_json::to_vec(&(&self.rows, &self.tables, self.flush)).unwrap_or_default();
        crate::notify::fnv1a(&body)
    }
}

impl Command for DbChanges {
    const NAME: &'static str = "coherent.db_changes";
    type Output = ();
}

/// The handler of the built-in command: no writes; the invalidation runs the watches.
pub(crate) struct ApplyChanges {
    /// This host's id.
    pub(crate) host: String,
    pub(crate) watches: Watches,
    pub(crate) registries: Vec<Registry>,
    /// Flushes done here (counted in `HostStats::flushes`).
    pub(crate) flushes: std::sync::atomic::AtomicU64,
    /// Hints heard here (`HostStats::change_hints`).
    pub(crate) hints: std::sync::atomic::AtomicU64,
    /// Hints and operations whose pair was applied already (`HostStats::change_hints_paired`).
    pub(crate) paired: std::sync::atomic::AtomicU64,
    pub(crate) seen: parking_lot::Mutex<SeenHints>,
    /// The owed flushes this host holds its cache for ([`DbChanges::hold`]), each with a
    /// fence on every registry; `None` once the host stopped (no hold goes up then).
    pub(crate) holds: parking_lot::Mutex<Option<Holds>>,
    /// Holds taken here (`HostStats::change_holds`).
    pub(crate) held: std::sync::atomic::AtomicU64,
}

impl ApplyChanges {
    /// Holds this host's cache until the flush owed under `name` (numbered `at`) is paid: a
    /// fence on every registry, so that no call answers from a result computed before a
    /// change that the feed cannot deliver (one committed while a new slot waits). One
    /// fence per name; a hold whose payment was heard first is not taken.
    pub(crate) fn hold(&self, name: &str, at: u64) {
        let mut holds = self.holds.lock();
        let Some(holds) = holds.as_mut() else {
            return;
        };
        if holds.paid.get(name).is_some_and(|&paid| paid > at) {
            return;
        }
        match holds.held.get_mut(name) {
            Some(held) => *held = (*held).max(at),
            None => {
                holds.held.insert(name.to_owned(), at);
                self.held.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                for r in &self.registries {
                    r.fence();
                }
                tracing::warn!(host = %self.host, owed = %name,
                    "database changes: a flush is owed (a new slot waits for the transactions \
                     running when it is made): every call reads the database until it is paid");
            }
        }
    }

    /// Whether this host holds its cache for the flush owed under `name`.
    pub(crate) fn holding(&self, name: &str) -> bool {
        self.holds
            .lock()
            .as_ref()
            .is_some_and(|h| h.held.contains_key(name))
    }

    /// The names of the owed flushes this host holds its cache for.
    pub(crate) fn held_names(&self) -> Vec<String> {
        self.holds
            .lock()
            .as_ref()
            .map_or_else(Vec::new, |h| h.held.keys().cloned().collect())
    }

    /// A payment of the flush owed under `name`, numbered `at`, just flushed here: ends a
    /// hold of that name numbered below it.
    fn paid(&self, name: &str, at: u64) {
        self.pay(name, at, true);
    }

    /// No flush owed under `name` in a snapshot whose oldest running transaction is
    /// `below` (the debt's row gone: every debt owed below that was paid by an operation
    /// logged before its row's clear, which this host may not read, having started after
    /// it): a hold numbered below it ends, the cache flushed first (what it held may be
    /// older than a change that no slot carries).
    pub(crate) fn settled(&self, name: &str, below: u64) {
        self.pay(name, below, false);
    }

    fn pay(&self, name: &str, at: u64, flushed: bool) {
        let mut holds = self.holds.lock();
        let Some(holds) = holds.as_mut() else {
            return;
        };
        let paid = holds.paid.entry(name.to_owned()).or_insert(0);
        *paid = (*paid).max(at);
        if holds.held.get(name).is_some_and(|&held| held < at) {
            holds.held.remove(name);
            if !flushed {
                self.flush("the flush owed for a new slot is paid");
            }
            for r in &self.registries {
                r.unfence();
            }
        }
    }

    /// Ends every hold, for good: the host stopped, and its registries are a local cache
    /// from now on.
    pub(crate) fn release_all(&self) {
        if let Some(holds) = self.holds.lock().take() {
            for _ in holds.held {
                for r in &self.registries {
                    r.unfence();
                }
            }
        }
    }

    fn flush(&self, why: &str) {
        self.flushes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let n: usize = self.registries.iter().map(Registry::invalidate_all).sum();
        tracing::info!(
            invalidated = n,
            "database changes: {why}: the cache was flushed"
        );
    }

    /// Runs the watches for `changes`; a watch that panics flushes the registries instead
    /// (what it would have invalidated is not known), so that the operation counts as
    /// applied: a feed whose own invalidation failed would read the same changes again
    /// and again.
    pub(crate) fn apply(&self, changes: &DbChanges) {
        if changes.applied_by.as_deref() == Some(&*self.host) {
            return;
        }
        if changes.hint != 0
            && self
                .seen
                .lock()
                .second((changes.hint, changes.fingerprint()))
        {
            self.paired
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return;
        }
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run(changes)));
        if ran.is_err() {
            tracing::error!("a watch of database changes panicked");
            self.flush("a watch panicked");
        }
    }

    /// Applies changes heard in a [`HintOut`] from the host that reads the feed (its seal
    /// checked). A hint never carries a hold or a payment (the feed logs those, and sends
    /// no hint of them): one that does is dropped, not remembered, so that its operation,
    /// if it has one, is applied from the log.
    pub(crate) fn apply_hint(&self, hint: &HintIn) {
        if hint.from == self.host
            || hint.changes.hint == 0
            || hint.changes.hold.is_some()
            || hint.changes.paid.is_some()
        {
            return;
        }
        self.hints
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.apply(&hint.changes);
    }

    fn run(&self, changes: &DbChanges) {
        if changes.flush {
            if let Some(owed) = &changes.hold {
                self.hold(&owed.name, owed.at);
            }
            self.flush("the change feed may have missed changes");
            if let Some(owed) = &changes.paid {
                self.paid(&owed.name, owed.at);
            }
            return;
        }
        // Tables touched, in a stable order, each with whether it changed as a whole.
        let mut touched: BTreeMap<(&str, &str), bool> = BTreeMap::new();
        for change in &changes.rows {
            let entry = touched
                .entry((&change.schema, &change.table))
                .or_insert(false);
            // A row without a column this host's watch asked for (the host that read the
            // feed did not know of it: another release) cannot be invalidated by it: the
            // whole table is.
            let row = change.new.as_ref().or(change.old.as_ref());
            let lacks = |w: &TableWatch| {
                w.columns
                    .iter()
                    .any(|c| !row.is_some_and(|r| r.0.iter().any(|(name, _)| name == c)))
            };
            if self
                .watches
                .tables
                .iter()
                .any(|w| w.matches(&change.schema, &change.table) && lacks(w))
            {
                *entry = true;
            }
            for w in &self.watches.tables {
                if w.matches(&change.schema, &change.table) {
                    for f in &w.on_change {
                        f(change);
                    }
                }
            }
        }
        for table in &changes.tables {
            let (schema, name) = table.split_once('.').unwrap_or(("", table));
            touched.insert((schema, name), true);
        }
        let mut flush = false;
        for ((schema, name), whole) in touched {
            for w in self
                .watches
                .tables
                .iter()
                .filter(|w| w.matches(schema, name))
            {
                for f in &w.on_any_change {
                    f();
                }
                if whole {
                    match &w.on_every_row {
                        Some(f) => f(),
                        None if !w.on_change.is_empty() => flush = true,
                        None => {}
                    }
                }
            }
        }
        if flush {
            self.flush(
                "every row of a table with per-row watches and no on_every_row may have changed",
            );
        }
    }
}

/// [`ApplyChanges`] as the host's handler of `coherent.db_changes`.
pub(crate) struct ChangesHandler(pub(crate) Arc<ApplyChanges>);

impl Handler<DbChanges> for ChangesHandler {
    async fn execute(&self, _: &DbChanges, _: &mut Tx<'_>) -> Result<(), CommandError> {
        Ok(())
    }

    fn invalidate(&self, changes: &DbChanges, _: &()) {
        self.0.apply(changes);
    }
}

/// How a host reads the database's changes; see [`HostBuilder::change_feed`](crate::HostBuilder::change_feed).
#[derive(Debug, Clone)]
pub struct ChangeFeed {
    pub(crate) slot: String,
    pub(crate) publication: String,
    pub(crate) poll: Duration,
    pub(crate) max_rows: usize,
    pub(crate) max_messages: usize,
    pub(crate) skip_commands: bool,
    pub(crate) standby: Duration,
    /// Triggers and a change table instead of logical decoding.
    pub(crate) triggers: bool,
    /// The slot streamed over a replication connection (else read with SQL).
    pub(crate) streaming: bool,
}

/// The default of [`ChangeFeed::max_rows`].
pub const MAX_ROWS: usize = 1_000;

impl ChangeFeed {
    /// PostgreSQL logical decoding: the publication and the replication slot are both
    /// named `coherent_<database>_<schema>` unless set (a slot is one per cluster: slots
    /// are the server's, publications the database's), created at the feed's first start (the slot
    /// starts at that moment: what committed before is not replayed, and the hosts flush
    /// their caches once). Needs `wal_level = logical` and a role allowed to replicate (a
    /// superuser or `REPLICATION`).
    ///
    /// PostgreSQL makes a slot only once every transaction running then has ended, and a
    /// change committed in that wait is in no slot: from just before the slot is made
    /// until the flush after it, every host that acknowledged the hold (and each host with
    /// watches that starts in the wait, from its start) answers each call from the
    /// database, not its cache ([`HostStats::change_holds`](crate::HostStats::change_holds)).
    /// A transaction left open elsewhere (an idle `psql` session) makes that last; bound it
    /// with PostgreSQL's `idle_in_transaction_session_timeout`. A role without the
    /// `REPLICATION` right, or no free slot, is found before any hold: the feed reports
    /// it (a warning, [`FeedStats::errors`](crate::changes::FeedStats::errors)) and tries
    /// again, and external changes are not seen meanwhile.
    ///
    /// A slot keeps the write-ahead log from its position on: while no host reads it (the
    /// whole cluster stopped), it grows with every write to the database. Bound it with
    /// PostgreSQL's `max_slot_wal_keep_size`; a slot that went past it is invalidated by
    /// the server, and the feed then starts a new one and has every host flush its cache.
    pub fn postgres() -> Self {
        Self {
            slot: String::new(),
            publication: String::new(),
            poll: Duration::from_millis(5),
            max_rows: MAX_ROWS,
            max_messages: 10_000,
            skip_commands: true,
            standby: Duration::from_secs(1),
            triggers: false,
            streaming: true,
        }
    }

    /// PostgreSQL triggers, where logical decoding is not available (`wal_level` cannot
    /// be changed, a managed database without replication rights): each watched table gets
    /// a row trigger that writes the key columns (the primary key, and the watch's
    /// [`columns`](TableWatch::columns)) of each changed row to the table
    /// `coherent_changes` of the cluster's schema, and a `TRUNCATE` trigger, each
    /// `NOTIFY`ing the feed. The change rows commit with the change, or roll back with
    /// it; the feed logs them and then deletes them, so a notification lost (the feed's
    /// connection dropped, no host running) costs latency, never a change: the table is
    /// the truth, read again after every reconnect and every poll interval. The triggers
    /// are made (or replaced) at each feed's start, and the hosts flush their caches when
    /// a table had none before (its changes until then were not captured).
    ///
    /// Costs the writer: an `INSERT` per changed row of a watched table, in its
    /// transaction. While no host runs the feed the change table grows with every write.
    pub fn postgres_triggers() -> Self {
        Self {
            triggers: true,
            ..Self::postgres()
        }
    }

    /// The replication slot's name (letters, digits and `_`; one per cluster).
    pub fn slot(mut self, name: impl Into<String>) -> Self {
        self.slot = name.into();
        self
    }

    /// The publication's name (letters, digits and `_`). The feed adds the watched tables
    /// that it lacks, and the operation log's table; it removes none.
    pub fn publication(mut self, name: impl Into<String>) -> Self {
        self.publication = name.into();
        self
    }

    /// How often the slot is read with SQL (see [`streaming`](Self::streaming)), or the
    /// trigger feed's table, when it was found empty: the latency of a change that arrives
    /// while the feed is idle. Default: 5 ms (an idle read is one short statement).
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll = every;
        self
    }

    /// At most this many rows of one table are carried by one operation; past it the
    /// table counts as changed as a whole ([`TableWatch::on_every_row`]). Default: 1,000.
    pub fn max_rows(mut self, rows: usize) -> Self {
        self.max_rows = rows.max(1);
        self
    }

    /// Whether a transaction that also wrote an operation to the log (a command of the
    /// pipeline, whose handler invalidates what it wrote) is skipped. Default: `true`.
    /// With `false`, the watches run for those changes too: harmless (an invalidation is
    /// idempotent) but a second recompute of what the command's handler invalidated.
    pub fn skip_commands(mut self, skip: bool) -> Self {
        self.skip_commands = skip;
        self
    }

    /// Whether the slot is streamed (`START_REPLICATION` on a replication connection: the
    /// server sends each transaction as it commits, decoded once) or read with SQL
    /// (`pg_logical_slot_peek_binary_changes` every [`poll_interval`](Self::poll_interval):
    /// each read decodes again from the slot's restart position, so it costs more and
    /// waits for the poll). Default: `true`. A replication connection of this kind names its
    /// database, so `pg_hba.conf` matches it like any connection to that database (not by
    /// the `replication` keyword, which is for physical replication), and it needs what
    /// the slot needs already (a superuser or `REPLICATION`). Where the server refuses it
    /// anyway (a role or `pg_hba.conf` line that refuses it, every WAL sender taken), where
    /// the configuration's hosts lead it to another server than the feed's SQL connection,
    /// or where `synchronous_standby_names` would make it a synchronous standby (`*`, or
    /// the feed's `application_name`: each writer's commit would wait for the feed, which
    /// waits for the commit), the feed reads with SQL instead, and says so in a warning and
    /// [`FeedStats::streaming`]; after a refusal that may pass (every WAL sender taken), it
    /// tries streaming again a minute later.
    pub fn streaming(mut self, stream: bool) -> Self {
        self.streaming = stream;
        self
    }

    /// How often a host that does not hold the feed tries to take it over. Default: 1 s.
    pub fn standby_interval(mut self, every: Duration) -> Self {
        self.standby = every;
        self
    }
}

/// The default slot and publication name of a cluster: `coherent_<database>_<schema>`,
/// with what is not a lowercase letter or digit as `_`, at most 63 bytes.
pub(crate) fn default_name(database: &str, schema: &str) -> String {
    let mut name: String = format!("coherent_{database}_{schema}")
        .chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() {
                c
            } else {
                '_'
            }
        })
        .collect();
    name.truncate(63);
    name
}

/// A name the feed puts in SQL text: letters, digits and `_` only.
pub(crate) fn check_identifier(what: &str, name: &str) -> Result<(), CommandError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(CommandError::new(
            crate::ErrorKind::BadCommand,
            format!("{what} {name:?}: use lowercase letters, digits and '_' (at most 63)"),
        ))
    }
}

/// The rows of one operation a feed is building, table by table, with the cap per table.
#[derive(Default)]
pub(crate) struct Batch {
    rows: BTreeMap<(String, String), (Vec<Change>, usize)>,
    whole: BTreeSet<(String, String)>,
}

/// At most this many bytes of values of one table in one operation; past it the table
/// counts as changed as a whole (a watch's wide columns, or a table whose replica
/// identity is the whole row, would make operations of megabytes).
pub(crate) const MAX_TABLE_BYTES: usize = 256 * 1024;

fn row_bytes(row: &Option<Row>) -> usize {
    row.as_ref().map_or(0, |r| {
        r.0.iter()
            .map(|(k, v)| k.len() + v.as_ref().map_or(0, String::len))
            .sum()
    })
}

impl Batch {
    pub(crate) fn row(&mut self, change: Change, max_rows: usize) {
        let key = (change.schema.clone(), change.table.clone());
        if self.whole.contains(&key) {
            return;
        }
        let size = row_bytes(&change.new) + row_bytes(&change.old);
        let (rows, bytes) = self.rows.entry(key.clone()).or_default();
        if rows.len() >= max_rows || *bytes + size > MAX_TABLE_BYTES {
            self.rows.remove(&key);
            self.whole.insert(key);
        } else {
            rows.push(change);
            *bytes += size;
        }
    }

    pub(crate) fn whole(&mut self, schema: &str, table: &str) {
        let key = (schema.to_owned(), table.to_owned());
        self.rows.remove(&key);
        self.whole.insert(key);
    }

    pub(crate) fn merge(&mut self, other: Batch, max_rows: usize) {
        for (schema, table) in other.whole {
            self.whole(&schema, &table);
        }
        for (_, (rows, _)) in other.rows {
            for row in rows {
                self.row(row, max_rows);
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.rows
            .values()
            .map(|(rows, _)| rows.len())
            .sum::<usize>()
            + self.whole.len()
    }

    pub(crate) fn into_changes(self) -> DbChanges {
        DbChanges {
            rows: self.rows.into_values().flat_map(|(rows, _)| rows).collect(),
            tables: self
                .whole
                .into_iter()
                .map(|(schema, table)| format!("{schema}.{table}"))
                .collect(),
            flush: false,
            applied_by: None,
            hint: 0,
            hold: None,
            paid: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    use super::{watch_table, ApplyChanges, Change, ChangeKind, DbChanges, HintIn, Row, Watches};

    fn row_change(id: i64) -> DbChanges {
        DbChanges {
            rows: vec![Change {
                schema: "public".to_owned(),
                table: "users".to_owned(),
                kind: ChangeKind::Update,
                new: Some(Row(vec![("id".to_owned(), Some(id.to_string()))])),
                old: None,
            }],
            applied_by: Some("leader".to_owned()),
            hint: 77,
            ..DbChanges::default()
        }
    }

    /// A host that counts the rows its watch saw.
    fn host() -> (ApplyChanges, Arc<AtomicU64>) {
        let seen = Arc::new(AtomicU64::new(0));
        let counted = seen.clone();
        let apply = ApplyChanges {
            host: "follower".to_owned(),
            watches: Watches {
                tables: vec![watch_table("users").on_change(move |_| {
                    counted.fetch_add(1, Ordering::Relaxed);
                })],
            },
            registries: Vec::new(),
            flushes: AtomicU64::new(0),
            hints: AtomicU64::new(0),
            paired: AtomicU64::new(0),
            seen: Default::default(),
            holds: parking_lot::Mutex::new(Some(Default::default())),
            held: AtomicU64::new(0),
        };
        (apply, seen)
    }

    fn hint(changes: DbChanges) -> HintIn {
        // Through JSON, as a hint travels.
        let json = serde_json::to_string(&super::HintOut {
            from: "leader",
            changes: &changes,
        })
        .unwrap();
        serde_json::from_str(&json).unwrap()
    }

    /// A hold fences the host's registry once per owed name, through JSON as the log
    /// carries it; the flush that pays that name (and only it) lifts it; a stopped host's
    /// holds are lifted for good and no new one goes up.
    #[test]
    fn a_hold_fences_until_its_flush_is_paid() {
        let registry = coherent_core::Registry::new();
        let (mut apply, _) = host();
        apply.registries = vec![registry.clone()];
        let through_json = |changes: DbChanges| -> DbChanges {
            serde_json::from_str(&serde_json::to_string(&changes).unwrap()).unwrap()
        };
        let hold = |name: &str, at: u64| {
            through_json(DbChanges {
                flush: true,
                hold: Some(super::Owed::new(name, at)),
                ..DbChanges::default()
            })
        };
        let paid = |name: &str, at: u64| {
            through_json(DbChanges {
                flush: true,
                paid: Some(super::Owed::new(name, at)),
                ..DbChanges::default()
            })
        };
        apply.apply(&hold("slot", 100));
        apply.apply(&hold("slot", 100));
        assert!(registry.is_fenced());
        assert_eq!(apply.held.load(Ordering::Relaxed), 1);
        // Another flush, another name's payment, or a payment of an earlier debt (heard
        // late), does not end it.
        apply.apply(&through_json(DbChanges {
            flush: true,
            ..DbChanges::default()
        }));
        apply.apply(&paid("triggers", 500));
        apply.apply(&paid("slot", 90));
        assert!(registry.is_fenced());
        apply.apply(&paid("slot", 101));
        assert!(!registry.is_fenced(), "the payment lifts the hold");
        // The hold of a debt whose payment came first (a notice before the log's older
        // operation) is not taken; a later debt's is.
        apply.apply(&hold("slot", 100));
        assert!(!registry.is_fenced(), "a hold already paid");
        apply.apply(&hold("slot", 200));
        assert!(registry.is_fenced());
        // A newer debt's hold heard while an older one stands: only a payment above both
        // lifts it.
        apply.apply(&hold("slot", 300));
        apply.apply(&paid("slot", 250));
        assert!(registry.is_fenced());
        apply.apply(&paid("slot", 301));
        assert!(!registry.is_fenced());
        // The row gone: lifted if numbered below the oldest transaction still running
        // then (not one whose owe may still be under way).
        apply.apply(&hold("slot", 400));
        apply.settled("slot", 400);
        assert!(registry.is_fenced(), "an owe maybe still under way");
        apply.settled("slot", 401);
        assert!(!registry.is_fenced());
        // A hint never carries a hold or a payment: one that does is dropped unapplied,
        // and not remembered (its operation, from the log, is the one applied).
        apply.apply(&hold("slot", 450));
        let mut forged = paid("slot", 470);
        forged.hint = 9;
        apply.apply_hint(&hint(forged.clone()));
        assert!(registry.is_fenced(), "a hint lifted a hold");
        let mut held = hold("slot", 460);
        held.hint = 11;
        apply.apply_hint(&hint(held));
        apply.apply(&paid("slot", 451));
        assert!(!registry.is_fenced(), "a hint put a hold up");
        // The operation of the same number is applied: the hint was not remembered.
        let flushes = apply.flushes.load(Ordering::Relaxed);
        apply.apply(&forged);
        assert_eq!(
            apply.flushes.load(Ordering::Relaxed),
            flushes + 1,
            "a hint carrying a payment was remembered"
        );
        apply.apply(&hold("slot", 500));
        assert!(registry.is_fenced());
        apply.release_all();
        assert!(!registry.is_fenced(), "a stopped host holds nothing");
        apply.apply(&hold("slot", 600));
        assert!(!registry.is_fenced(), "nor takes a hold after");
    }

    /// The hint and its operation: the first applies, the second is skipped, whichever
    /// order they come in.
    #[test]
    fn the_second_of_a_hint_and_its_operation_is_skipped() {
        for hint_first in [true, false] {
            let (apply, seen) = host();
            let logged: DbChanges =
                serde_json::from_str(&serde_json::to_string(&row_change(1)).unwrap()).unwrap();
            if hint_first {
                apply.apply_hint(&hint(row_change(1)));
                apply.apply(&logged);
            } else {
                apply.apply(&logged);
                apply.apply_hint(&hint(row_change(1)));
            }
            assert_eq!(seen.load(Ordering::Relaxed), 1, "hint first: {hint_first}");
            assert_eq!(apply.paired.load(Ordering::Relaxed), 1);
        }
    }

    /// Anyone who may `NOTIFY` can send a hint: one that reuses a real batch's number with
    /// other changes does not have the real operation skipped.
    #[test]
    fn a_forged_hint_with_a_real_number_does_not_suppress_the_operation() {
        let (apply, seen) = host();
        apply.apply_hint(&hint(row_change(2)));
        apply.apply(&row_change(1));
        assert_eq!(seen.load(Ordering::Relaxed), 2, "both ran");
        assert_eq!(apply.paired.load(Ordering::Relaxed), 0);
        // A host's own hint, and a hint without a number, are ignored.
        let mut own = hint(row_change(3));
        own.from = "follower".to_owned();
        apply.apply_hint(&own);
        let mut unnumbered = hint(row_change(3));
        unnumbered.changes.hint = 0;
        apply.apply_hint(&unnumbered);
        assert_eq!(seen.load(Ordering::Relaxed), 2);
    }
}
