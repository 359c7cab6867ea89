//! The PostgreSQL change feed: a publication of the watched tables and a logical
//! replication slot (pgoutput, protocol version 1), streamed over a replication connection
//! (`replication.rs`) and confirmed only after the operation carrying the changes committed;
//! or, where the server refuses replication connections, read with
//! `pg_logical_slot_peek_binary_changes` and moved with `pg_replication_slot_advance`.
//!
//! One host reads the slot at a time: the one holding a session advisory lock, on a
//! connection of the feed's own (the lock goes with the connection, so a host that dies
//! or loses it hands the feed over to the next host that tries). Transactions arrive
//! whole (a read with SQL stops only at a commit); the ones that also wrote an operation to
//! the log (commands: their handlers invalidate) are skipped, and one `coherent.db_changes`
//! command runs through the host's pipeline with what is left, once those transactions are
//! visible to other sessions. The slot moves to the end of the last transaction taken once
//! that command returned: a feed that fails before reads the same transactions again (at
//! least once, never lost).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use futures::{pin_mut, TryStreamExt};
use tokio::sync::watch;

use super::pgoutput::{self, Message, Tuple, Value};
use super::replication::{self, Frame, StreamError};
use super::{Batch, Change, ChangeFeed, ChangeKind, DbChanges, Owed, Row, Watches};
use crate::db::{Engine, PG_PAYLOAD_LIMIT};
use crate::error::{CommandError, ErrorKind};
use crate::host::{Host, Inner};
use crate::notify::Publisher;

/// The start of the `application_name` of the feed's connection (in `pg_stat_activity`):
/// `coherent_changes_feed:<schema>`, at most 63 bytes.
pub const FEED_APPLICATION: &str = "coherent_changes_feed";

/// Counters of a host's change feed, from its start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FeedStats {
    /// Whether this host holds the feed now (reads the slot).
    pub leading: bool,
    /// Whether the slot is streamed now (see [`ChangeFeed::streaming`]).
    pub streaming: bool,
    /// Reads of the slot (streamed: starts of the stream, and batches of transactions
    /// taken from it).
    pub reads: u64,
    /// Transactions read whose changes were logged (the trigger feed: change rows read).
    pub transactions: u64,
    /// Transactions skipped: they also wrote an operation (a command's).
    pub skipped_commands: u64,
    /// Rows logged as changed.
    pub rows: u64,
    /// Tables logged as changed as a whole (`TRUNCATE`, or more rows than the cap).
    pub tables: u64,
    /// `coherent.db_changes` operations this feed logged.
    pub operations: u64,
    /// Times the slot was created (the first start, or after it was lost), or the trigger
    /// feed found a watched table without its triggers: each had every host flush its
    /// cache.
    pub slots_created: u64,
    /// Reads or logs that failed (the same changes are read again).
    pub errors: u64,
    /// Messages of the stream that did not decode (each failed its read).
    pub undecodable: u64,
    /// Batches of changes sent to the other hosts ahead of their operation (PostgreSQL
    /// notifier only; see [`HostStats::change_hints`](crate::HostStats::change_hints)).
    pub hints: u64,
}

#[derive(Default)]
pub(crate) struct FeedCounters {
    leading: AtomicBool,
    streaming: AtomicBool,
    pub(super) reads: AtomicU64,
    pub(super) transactions: AtomicU64,
    pub(super) skipped_commands: AtomicU64,
    pub(super) rows: AtomicU64,
    pub(super) tables: AtomicU64,
    pub(super) operations: AtomicU64,
    pub(super) slots_created: AtomicU64,
    pub(super) errors: AtomicU64,
    pub(super) undecodable: AtomicU64,
    pub(super) hints: AtomicU64,
    /// Reads in a row that failed on a message that does not decode, or that the server
    /// refused.
    stuck: AtomicU64,
}

impl FeedCounters {
    pub(crate) fn snapshot(&self) -> FeedStats {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        FeedStats {
            leading: self.leading.load(Ordering::Relaxed),
            streaming: self.streaming.load(Ordering::Relaxed),
            reads: n(&self.reads),
            transactions: n(&self.transactions),
            skipped_commands: n(&self.skipped_commands),
            rows: n(&self.rows),
            tables: n(&self.tables),
            operations: n(&self.operations),
            slots_created: n(&self.slots_created),
            errors: n(&self.errors),
            undecodable: n(&self.undecodable),
            hints: n(&self.hints),
        }
    }
}

/// What the feed task needs.
pub(crate) struct PgFeed {
    pub(crate) feed: ChangeFeed,
    pub(crate) watches: Watches,
    pub(crate) config: tokio_postgres::Config,
    /// How the feed's connections speak TLS (the database's).
    pub(crate) tls: crate::db::tls::Tls,
    pub(crate) schema: String,
    pub(crate) counters: Arc<FeedCounters>,
}

/// A relation as the stream described it: which columns a change keeps.
struct Relation {
    schema: String,
    name: String,
    /// The operation log's table: a transaction that wrote it is a command's.
    log: bool,
    /// The columns a change keeps: the key (the primary key of a table this host watches,
    /// else the replica identity's columns) and the watches' columns.
    keep: Vec<(usize, String)>,
}

/// One read's state: relations and the transaction being read.
struct Read<'a> {
    feed: &'a PgFeed,
    keys: &'a Keys,
    /// Transactions that end at or before this were read before (their operations are
    /// being logged): skipped.
    skip_upto: u64,
    relations: HashMap<u32, Relation>,
    open: Option<Open>,
    batch: Batch,
    /// Where the slot may move once the batch is logged.
    end_lsn: Option<u64>,
    transactions: u64,
    skipped: u64,
    /// The transactions whose changes are in `batch`.
    xids: Vec<u32>,
}

struct Open {
    batch: Batch,
    command: bool,
    xid: u32,
}

impl<'a> Read<'a> {
    fn new(feed: &'a PgFeed, keys: &'a Keys, skip_upto: u64) -> Self {
        Read {
            feed,
            keys,
            skip_upto,
            relations: HashMap::new(),
            open: None,
            batch: Batch::default(),
            end_lsn: None,
            transactions: 0,
            skipped: 0,
            xids: Vec::new(),
        }
    }

    fn row(&self, relation: u32, tuple: &Tuple<'_>) -> Result<Option<(&Relation, Row)>, String> {
        let Some(rel) = self.relations.get(&relation) else {
            return Err(format!(
                "a change of relation {relation} before its description"
            ));
        };
        let mut row = Vec::with_capacity(rel.keep.len());
        for (i, name) in &rel.keep {
            match tuple.0.get(*i) {
                Some(Value::Text(t)) | Some(Value::Binary(t)) => {
                    row.push((name.clone(), Some(String::from_utf8_lossy(t).into_owned())))
                }
                Some(Value::Null) => row.push((name.clone(), None)),
                Some(Value::Unchanged) | None => {}
            }
        }
        Ok(Some((rel, Row(row))))
    }

    fn change(
        &mut self,
        relation: u32,
        kind: ChangeKind,
        new: Option<&Tuple<'_>>,
        old: Option<&Tuple<'_>>,
    ) -> Result<(), String> {
        let new = match new {
            Some(t) => self.row(relation, t)?,
            None => None,
        };
        let old = match old {
            Some(t) => self.row(relation, t)?,
            None => None,
        };
        let Some((rel, _)) = new.as_ref().or(old.as_ref()) else {
            return Ok(());
        };
        let (schema, table, log) = (rel.schema.clone(), rel.name.clone(), rel.log);
        let new = new.map(|(_, row)| row);
        // An old image equal to the new one adds nothing (REPLICA IDENTITY FULL sends both).
        let old = old
            .map(|(_, row)| row)
            .filter(|old| Some(old) != new.as_ref());
        let Some(open) = self.open.as_mut() else {
            return Err("a change outside a transaction".to_owned());
        };
        if log {
            open.command = true;
        } else {
            // Every published table: some host watches it, if not this one.
            open.batch.row(
                Change {
                    schema,
                    table,
                    kind,
                    new,
                    old,
                },
                self.feed.feed.max_rows,
            );
        }
        Ok(())
    }

    fn message(&mut self, message: Message<'_>) -> Result<(), String> {
        match message {
            Message::Begin { xid, .. } => {
                self.open = Some(Open {
                    batch: Batch::default(),
                    command: false,
                    xid,
                });
            }
            Message::Commit { end_lsn, .. } => {
                let Some(open) = self.open.take() else {
                    return Err("a commit outside a transaction".to_owned());
                };
                self.end_lsn = Some(end_lsn);
                if end_lsn <= self.skip_upto {
                    // Read before.
                } else if open.command && self.feed.feed.skip_commands {
                    self.skipped += 1;
                } else if open.batch.len() > 0 {
                    self.transactions += 1;
                    self.xids.push(open.xid);
                    self.batch.merge(open.batch, self.feed.feed.max_rows);
                }
            }
            Message::Relation {
                id,
                namespace,
                name,
                columns,
                ..
            } => {
                let extra = self
                    .feed
                    .watches
                    .columns(namespace, name)
                    .unwrap_or_default();
                let pk = self.keys.get(&(namespace.to_owned(), name.to_owned()));
                let keep = columns
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| {
                        extra.contains(c.name)
                            || match pk {
                                // With REPLICA IDENTITY FULL every column is flagged.
                                Some(pk) if !pk.is_empty() => pk.iter().any(|k| k == c.name),
                                _ => c.key,
                            }
                    })
                    .map(|(i, c)| (i, c.name.to_owned()))
                    .collect();
                self.relations.insert(
                    id,
                    Relation {
                        schema: namespace.to_owned(),
                        name: name.to_owned(),
                        log: namespace == self.feed.schema && name == "coherent_operations",
                        keep,
                    },
                );
            }
            Message::Insert { relation, new } => {
                self.change(relation, ChangeKind::Insert, Some(&new), None)?
            }
            Message::Update { relation, old, new } => {
                self.change(relation, ChangeKind::Update, Some(&new), old.as_ref())?
            }
            Message::Delete { relation, old } => {
                self.change(relation, ChangeKind::Delete, None, Some(&old))?
            }
            Message::Truncate { relations, .. } => {
                let Some(open) = self.open.as_mut() else {
                    return Err("a truncate outside a transaction".to_owned());
                };
                for id in relations {
                    match self.relations.get(&id) {
                        Some(rel) if !rel.log => open.batch.whole(&rel.schema, &rel.name),
                        Some(_) => {}
                        None => {
                            return Err(format!(
                                "a truncate of relation {id} before its description"
                            ))
                        }
                    }
                }
            }
            Message::Origin { .. } | Message::Type { .. } | Message::Message { .. } => {}
        }
        Ok(())
    }
}

/// An LSN as PostgreSQL writes it (`16/B374D848`).
fn parse_lsn(text: &str) -> Option<u64> {
    let (hi, lo) = text.split_once('/')?;
    let hi = u32::from_str_radix(hi, 16).ok()?;
    let lo = u32::from_str_radix(lo, 16).ok()?;
    Some((u64::from(hi) << 32) | u64::from(lo))
}

fn lsn_text(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xffff_ffff)
}

pub(super) fn feed_error(e: impl std::fmt::Display) -> CommandError {
    CommandError::new(ErrorKind::Database, format!("change feed: {e}"))
}

/// What a failed read means: the slot lost only when the server says so of the slot
/// itself (missing from this database, or its log invalidated); another error (a
/// publication missing, say) is not worth the slot, and the feed starts over.
async fn classify(
    client: &tokio_postgres::Client,
    feed: &PgFeed,
    e: tokio_postgres::Error,
) -> ReadError {
    let server = e.as_db_error().is_some();
    classify_failure(client, feed, feed_error(e), server).await
}

/// [`classify`] for any failure: `server` when the server answered it with an error.
async fn classify_failure(
    client: &tokio_postgres::Client,
    feed: &PgFeed,
    e: CommandError,
    server: bool,
) -> ReadError {
    let state = client
        .query_opt(
            "SELECT wal_status::text, database::text = current_database()::text \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&feed.feed.slot],
        )
        .await;
    match state {
        Ok(None) => ReadError::Lost(format!("{e} (the slot is gone)")),
        Ok(Some(row)) => {
            let (status, here): (Option<String>, Option<bool>) = (row.get(0), row.get(1));
            if status.as_deref() == Some("lost") && here == Some(true) {
                ReadError::Lost(format!("{e} (its log was removed)"))
            } else if server {
                ReadError::Refused(e)
            } else {
                ReadError::Other(e)
            }
        }
        Err(_) => ReadError::Other(e),
    }
}

/// The feed task of a host: stands by for the advisory lock, then reads the slot until the
/// host stops or the connection fails.
pub(crate) async fn run_postgres_feed(
    host: Weak<Inner>,
    feed: PgFeed,
    mut stop: watch::Receiver<bool>,
) {
    let lock_key = if feed.feed.triggers {
        format!("coherent.changes.triggers.{}", feed.schema)
    } else {
        format!("{SLOT_LOCK}{}", feed.feed.slot)
    };
    loop {
        if *stop.borrow() {
            return;
        }
        // The host's stop ends a leader wherever it waits (a connect, a visibility wait).
        let mut stopped = stop.clone();
        let result = tokio::select! {
            result = lead(&host, &feed, &lock_key, &mut stop) => result,
            _ = stopped.changed() => Ok(()),
        };
        feed.counters.leading.store(false, Ordering::Relaxed);
        feed.counters.streaming.store(false, Ordering::Relaxed);
        match result {
            Ok(()) => return,
            Err(e) => {
                feed.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%e, "change feed: will try again");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(feed.feed.standby) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Logs `changes` through the host's pipeline, if the host still runs: returns once the
/// operation committed and ran here (the other hosts apply it from their notifier or the
/// log; the feed does not wait for their acknowledgements, no caller reads after it).
pub(super) async fn log(host: &Weak<Inner>, changes: DbChanges) -> Result<bool, CommandError> {
    log_on_host(host, changes, false).await
}

/// Logs `changes` and waits, as a command's caller does, for every live host's
/// acknowledgement: for a hold ([`DbChanges::hold`]), which must stand on every host before
/// the slot that owes its flush is made. `false`: the host stopped.
async fn log_acknowledged(host: &Weak<Inner>, changes: DbChanges) -> Result<bool, CommandError> {
    log_on_host(host, changes, true).await
}

/// [`log`] or [`log_acknowledged`]. It runs where the host's other work runs
/// (`Inner::work`, the database's thread, which outlives the host), not on the feed
/// thread's runtime, which ends with the host.
async fn log_on_host(
    host: &Weak<Inner>,
    changes: DbChanges,
    acknowledged: bool,
) -> Result<bool, CommandError> {
    let Some(inner) = host.upgrade() else {
        return Ok(false);
    };
    let runtime = inner.work.clone();
    let host = Host { inner };
    runtime
        .spawn(async move {
            if acknowledged {
                host.run(changes).await
            } else {
                host.run_unacknowledged(changes).await
            }
        })
        .await
        .map_err(|e| feed_error(format!("the log of changes: {e}")))??;
    Ok(true)
}

/// This host's handler of database changes, which holds its cache for an owed flush.
fn applier(host: &Weak<Inner>) -> Option<Arc<super::ApplyChanges>> {
    host.upgrade().and_then(|inner| inner.changes.clone())
}

/// A table's key columns (its primary key), by `(schema, name)`: what a change carries
/// beside the watches' columns, whatever the table's replica identity sends.
pub(super) type Keys = HashMap<(String, String), Vec<String>>;

/// One connection's life: `Ok` when the host stopped.
async fn lead(
    host: &Weak<Inner>,
    feed: &PgFeed,
    lock_key: &str,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), CommandError> {
    let mut config = feed.config.clone();
    let mut application = format!("{FEED_APPLICATION}:{}", feed.schema);
    application.truncate(63);
    config.application_name(&application);
    // A leader whose machine died without a word (no FIN, no RST) must lose its lock in
    // seconds, not when the server's keepalives give up (two hours by default): the server
    // probes the connection after 5 s idle, and gives up on unacknowledged data in 10 s.
    let options = format!(
        "{} -c tcp_keepalives_idle=5 -c tcp_keepalives_interval=2 -c tcp_keepalives_count=3 \
         -c tcp_user_timeout=10000",
        config.get_options().unwrap_or("")
    );
    config.options(options.trim());
    config
        .keepalives(true)
        .keepalives_idle(std::time::Duration::from_secs(5));
    let (client, connection) = config.connect(feed.tls.clone()).await.map_err(feed_error)?;
    // The trigger feed's wake-ups come as notifications on this connection.
    let wake = Arc::new(tokio::sync::Notify::new());
    let woken = wake.clone();
    let mut connection = connection;
    // Dropped when the connection ends: a streaming leader whose lock went with it stops.
    let (closed_tx, closed) = watch::channel(());
    let driver = tokio::spawn(async move {
        let _open = closed_tx;
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = futures::StreamExt::next(&mut messages).await {
            match message {
                Ok(tokio_postgres::AsyncMessage::Notification(_)) => woken.notify_one(),
                Ok(_) => {}
                Err(_) => return,
            }
        }
    });
    let _driver = AbortOnDrop(driver);
    // Every host sets up what its own watches need before it stands by: the leader's
    // watches are not the only ones (hosts of two releases may watch different tables).
    let owed = if feed.feed.triggers {
        "triggers".to_owned()
    } else {
        feed.feed.slot.clone()
    };
    let keys = if feed.feed.triggers {
        super::triggers::install(&client, feed).await?;
        Keys::new()
    } else {
        let level: String = client
            .query_one("SHOW wal_level", &[])
            .await
            .map_err(feed_error)?
            .get(0);
        if level != "logical" {
            return Err(feed_error(format!(
                "wal_level is {level}: logical decoding needs wal_level = logical \
                 (ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL), or use \
                 ChangeFeed::postgres_triggers()"
            )));
        }
        publish(&client, feed).await?
    };
    // The triggers' flush, owed by this host's install, is paid here. A slot's is paid only
    // under the feed's lock, by the leader: a leader making a slot anew holds the lock from
    // the flush it owes until it pays it, and the slot waits for every transaction running
    // when it is made; paid by another host meanwhile, the flush would come before the
    // slot, and a change in between would be in neither (served stale until its row
    // changed again: `changes::postgres_a_host_starting_while_a_new_slot_waits_leaves_its_
    // flush_to_the_leader`).
    if feed.feed.triggers && !pay_flush(host, &client, feed, &owed).await? {
        return Ok(());
    }
    // Stand by until this host holds the feed.
    loop {
        let row = client
            .query_one("SELECT pg_try_advisory_lock(hashtext($1))", &[&lock_key])
            .await
            .map_err(feed_error)?;
        if row.get::<_, bool>(0) {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(feed.feed.standby) => {}
            _ = stop.changed() => return Ok(()),
        }
    }
    feed.counters.leading.store(true, Ordering::Relaxed);
    if feed.feed.triggers {
        tracing::info!(schema = %feed.schema, "change feed: this host reads the change table");
        return super::triggers::follow(host, feed, &client, &wake, stop).await;
    }
    tracing::info!(slot = %feed.feed.slot, "change feed: this host reads the slot");
    if !ensure_slot(host, &client, feed).await?
        || !pay_flush(host, &client, feed, &owed).await?
        || !settle_hold(host, &client, feed).await?
    {
        return Ok(());
    }
    // The hints' statement, prepared once: one round trip per hint, its transaction
    // committed without waiting for the WAL (a hint is only a head start).
    let hint_sql = client
        .prepare(crate::db::NOTIFY_SQL)
        .await
        .map_err(feed_error)?;
    // Streaming refused for a while (every WAL sender taken): tried again at this moment.
    let mut stream_again = None;
    if feed.feed.streaming {
        let mut closed = closed;
        let refused = stream_slot(
            host,
            feed,
            &client,
            &hint_sql,
            &keys,
            &owed,
            &config,
            stop,
            &mut closed,
        )
        .await?;
        let Some((why, passing)) = refused else {
            return Ok(());
        };
        tracing::warn!(%why, slot = %feed.feed.slot, passing,
            "change feed: the slot cannot be streamed here; it is read with SQL instead \
             (slower: see ChangeFeed::streaming)");
        if passing {
            stream_again = Some(std::time::Instant::now() + STREAM_AGAIN);
        }
    }
    feed.counters.streaming.store(false, Ordering::Relaxed);
    // Where this connection last moved the slot.
    let mut advanced = 0;
    // The reads whose operations are being logged, oldest first, each with where the slot
    // may move once it is (and every one before it) logged: the next read does not wait
    // for a log (a log waits for the host's runtime and the database's commit; a change
    // that came meanwhile waited for them too).
    let mut logging: VecDeque<(Option<tokio::task::JoinHandle<LogResult>>, Option<u64>)> =
        VecDeque::new();
    // Transactions that end at or before this were read (their operations are logged, or
    // being logged): a later read skips them.
    let mut read_upto = 0;
    // The insert position the last read saw (see `read`).
    let mut seen_insert = None;
    loop {
        if *stop.borrow() {
            return Ok(());
        }
        if stream_again.is_some_and(|at| std::time::Instant::now() >= at) && logging.is_empty() {
            return Err(feed_error("streaming is tried again"));
        }
        // Move the slot past the reads whose operations are logged, in order; with too
        // many logs under way, wait for the oldest.
        let mut lost = None;
        while let Some((task, _)) = logging.front() {
            let done = task.as_ref().is_none_or(|t| t.is_finished());
            if !done && logging.len() < MAX_LOGGING {
                break;
            }
            let (task, end_lsn) = logging.pop_front().expect("a front");
            if !logged(feed, task).await? {
                return Ok(());
            }
            if let Some(lsn) = end_lsn.filter(|&lsn| lsn > advanced) {
                advanced = lsn;
                let moved = client
                    .execute(
                        "SELECT pg_replication_slot_advance($1, $2::text::pg_lsn)",
                        &[&feed.feed.slot, &lsn_text(lsn)],
                    )
                    .await;
                if let Err(e) = moved {
                    match classify(&client, feed, e).await {
                        ReadError::Lost(why) => {
                            lost = Some(why);
                            break;
                        }
                        ReadError::Undecodable(e) | ReadError::Refused(e) | ReadError::Other(e) => {
                            return Err(e)
                        }
                    }
                }
            }
        }
        let read = match lost {
            Some(why) => Err(ReadError::Lost(why)),
            None => read(&client, feed, &keys, read_upto, &mut seen_insert).await,
        };
        match read {
            Ok(read) => {
                feed.counters.stuck.store(0, Ordering::Relaxed);
                let (changes, xids, end_lsn, any) = read;
                let task = if changes.is_empty() {
                    None
                } else {
                    wait_visible(&client, &xids).await?;
                    Some(apply_and_log(host, feed, &client, &hint_sql, changes).await)
                };
                if let Some(lsn) = end_lsn {
                    read_upto = read_upto.max(lsn);
                }
                logging.push_back((task, end_lsn));
                if !any {
                    tokio::select! {
                        _ = tokio::time::sleep(feed.feed.poll) => {}
                        _ = stop.changed() => return Ok(()),
                    }
                }
            }
            Err(failure) => {
                if !failed(host, &client, feed, &owed, failure).await? {
                    return Ok(());
                }
                // A new slot: nothing read from it yet.
                advanced = 0;
                read_upto = 0;
                seen_insert = None;
                logging.clear();
            }
        }
    }
}

/// Streams the slot over a replication connection until the host stops (`Ok(None)`) or
/// a connection fails (`Err`: the feed starts over); `Ok(Some((why, passing)))` when the
/// slot cannot be streamed here (the server refuses replication connections, or reaches
/// them elsewhere, or would make the stream a synchronous standby): the caller reads the
/// slot with SQL (and tries streaming again later when `passing`).
///
/// Transactions arrive whole, as they commit. Once no more of the stream is buffered (or
/// `max_messages` were taken), what the transactions since the last batch changed is
/// applied here and logged for the other hosts, as by a read with SQL; the server is told
/// the end of the last transaction of each batch once that batch is logged (and every one
/// before it), and the slot moves there. With nothing taken and nothing being logged, the
/// server's keepalives move it on past what it did not send (other tables' writes).
#[allow(clippy::too_many_arguments)]
async fn stream_slot(
    host: &Weak<Inner>,
    feed: &PgFeed,
    client: &tokio_postgres::Client,
    hint_sql: &tokio_postgres::Statement,
    keys: &Keys,
    owed: &str,
    config: &tokio_postgres::Config,
    stop: &mut watch::Receiver<bool>,
    closed: &mut watch::Receiver<()>,
) -> Result<Option<(String, bool)>, CommandError> {
    let application = config.get_application_name().unwrap_or(FEED_APPLICATION);
    let identity = simple_one(client, replication::IDENTITY).await?;
    // Starts refused because an earlier connection still holds the slot.
    let mut in_use = 0;
    'session: loop {
        let mut stream = match replication::connect(config, &feed.tls, application, &identity).await
        {
            Ok(stream) => stream,
            Err(e) if e.refused_connection() => return Ok(Some((e.to_string(), e.passing()))),
            Err(e) => return Err(feed_error(format!("the replication connection: {e}"))),
        };
        // Where the slot was confirmed: the stream starts there, and nothing confirmed
        // goes below it.
        let mut confirmed = client
            .query_opt(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots \
                 WHERE slot_name = $1 AND database = current_database()",
                &[&feed.feed.slot],
            )
            .await
            .map_err(feed_error)?
            .and_then(|row| row.get::<_, Option<String>>(0))
            .and_then(|lsn| parse_lsn(&lsn))
            .unwrap_or(0);
        if let Err(e) = stream.start(&feed.feed.slot, &feed.feed.publication).await {
            drop(stream);
            if e.slot_in_use() && in_use < IN_USE_TRIES {
                // This host holds the feed's lock: whoever streams the slot is a former
                // leader whose connection the server has not found dead yet.
                in_use += 1;
                release_slot(client, feed).await?;
                continue 'session;
            }
            let failure = stream_failure(client, feed, e).await;
            if !failed(host, client, feed, owed, failure).await? {
                return Ok(None);
            }
            continue 'session;
        }
        in_use = 0;
        // A stream the server counts as a synchronous standby would hold every writer's
        // commit until the feed confirms it, and the feed confirms a transaction only once
        // it is visible, which the commit waits for: a deadlock.
        let (state, standbys): (String, String) = {
            let row = client
                .query_one(
                    "SELECT coalesce((SELECT sync_state FROM pg_stat_replication \
                     WHERE pid = $1), 'async'), current_setting('synchronous_standby_names')",
                    &[&stream.pid().unwrap_or(0)],
                )
                .await
                .map_err(feed_error)?;
            (row.get(0), row.get(1))
        };
        if state != "async" || names_standby(&standbys, application) {
            return Ok(Some((
                format!(
                    "synchronous_standby_names ({standbys:?}) names the feed's connection \
                     ({application:?}, {state}): a synchronous standby that waits for its \
                     own writes"
                ),
                false,
            )));
        }
        feed.counters.streaming.store(true, Ordering::Relaxed);
        feed.counters.reads.fetch_add(1, Ordering::Relaxed);
        let mut read = Read::new(feed, keys, 0);
        // Batches being logged, oldest first, each with where the slot may move once it
        // (and every one before it) is logged.
        let mut logging: VecDeque<(Option<tokio::task::JoinHandle<LogResult>>, u64)> =
            VecDeque::new();
        // Messages taken since the last batch.
        let mut messages = 0usize;
        let mut status = tokio::time::interval(STATUS_INTERVAL);
        status.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let failure: ReadError = 'stream: loop {
            // A batch: once the stream has nothing more buffered, or enough was taken.
            if read.end_lsn.is_some()
                && (!stream.has_buffered() || messages >= feed.feed.max_messages)
            {
                messages = 0;
                feed.counters.stuck.store(0, Ordering::Relaxed);
                let end = read.end_lsn.take().expect("checked");
                feed.counters.reads.fetch_add(1, Ordering::Relaxed);
                feed.counters
                    .transactions
                    .fetch_add(std::mem::take(&mut read.transactions), Ordering::Relaxed);
                feed.counters
                    .skipped_commands
                    .fetch_add(std::mem::take(&mut read.skipped), Ordering::Relaxed);
                let changes = std::mem::take(&mut read.batch).into_changes();
                let xids = std::mem::take(&mut read.xids);
                let task = if changes.is_empty() {
                    None
                } else {
                    wait_visible(client, &xids).await?;
                    Some(apply_and_log(host, feed, client, hint_sql, changes).await)
                };
                if logging.len() >= MAX_LOGGING {
                    let (task, end) = logging.pop_front().expect("not empty");
                    if !logged(feed, task).await? {
                        return Ok(None);
                    }
                    if end > confirmed {
                        confirmed = end;
                        stream.confirm(confirmed).await.map_err(stream_failed)?;
                    }
                }
                logging.push_back((task, end));
            }
            let front = async {
                match logging.front_mut() {
                    Some((Some(task), _)) => Some(task.await),
                    Some((None, _)) => None,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                _ = stop.changed() => return Ok(None),
                _ = closed.changed() => {
                    return Err(feed_error("the feed's connection closed (with its lock)"));
                }
                done = front => {
                    let (_, end) = logging.pop_front().expect("the front finished");
                    let ok = match done {
                        None => true,
                        Some(joined) => finished(feed, joined)?,
                    };
                    if !ok {
                        return Ok(None);
                    }
                    if end > confirmed {
                        confirmed = end;
                        stream.confirm(confirmed).await.map_err(stream_failed)?;
                    }
                }
                frame = stream.next() => match frame {
                    Ok(Frame::Data { data }) => {
                        messages += 1;
                        let taken = match pgoutput::decode(&data) {
                            Ok(message) => read.message(message),
                            Err(e) => {
                                feed.counters.undecodable.fetch_add(1, Ordering::Relaxed);
                                Err(e.to_string())
                            }
                        };
                        if let Err(e) = taken {
                            break 'stream ReadError::Undecodable(feed_error(e));
                        }
                    }
                    Ok(Frame::Keepalive { end, reply }) => {
                        // Everything before `end` was sent: with nothing of it waiting to
                        // be logged, the slot may move there.
                        let idle = logging.is_empty() && read.open.is_none()
                            && read.end_lsn.is_none();
                        if idle && end > confirmed {
                            confirmed = end;
                            stream.confirm(confirmed).await.map_err(stream_failed)?;
                        } else if reply {
                            stream.confirm(confirmed).await.map_err(stream_failed)?;
                        }
                    }
                    Err(e) => break 'stream stream_failure(client, feed, e).await,
                },
                _ = status.tick() => {
                    stream.confirm(confirmed).await.map_err(stream_failed)?;
                    // The feed's own connection, which holds the lock, kept from idling out
                    // (`idle_session_timeout`) while the stream does the work.
                    client.simple_query("SELECT 1").await.map_err(feed_error)?;
                }
            }
        };
        // The stream goes first: a slot is dropped (when lost) only once no connection
        // streams it.
        drop(stream);
        if !failed(host, client, feed, owed, failure).await? {
            return Ok(None);
        }
    }
}

/// Starts in a row refused because the slot is in use, before the feed starts over.
const IN_USE_TRIES: u32 = 20;

/// How long a feed refused a replication connection for a reason that may pass reads
/// with SQL before it tries to stream again.
const STREAM_AGAIN: std::time::Duration = std::time::Duration::from_secs(60);

/// The first column of the first row of `sql`, run with the simple query protocol.
async fn simple_one(client: &tokio_postgres::Client, sql: &str) -> Result<String, CommandError> {
    client
        .simple_query(sql)
        .await
        .map_err(feed_error)?
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        })
        .ok_or_else(|| feed_error(format!("{sql} answered no row")))
}

/// Whether `synchronous_standby_names` can name the connection `application`: `*`, or
/// the name itself (case-insensitive, quoted or not), in any of its forms (`a, b`,
/// `FIRST n (...)`, `ANY n (...)`).
pub(super) fn names_standby(standbys: &str, application: &str) -> bool {
    let list = match (standbys.find('('), standbys.rfind(')')) {
        (Some(open), Some(close)) if open < close => &standbys[open + 1..close],
        _ => standbys,
    };
    list.split(',').any(|name| {
        let name = name.trim();
        let name = name
            .strip_prefix('"')
            .and_then(|n| n.strip_suffix('"'))
            .map(|n| n.replace("\"\"", "\""))
            .unwrap_or_else(|| name.to_owned());
        name == "*" || name.eq_ignore_ascii_case(application)
    })
}

/// Ends the connections that stream the slot (a former leader's) and waits until it is
/// free. The caller holds the feed's lock.
async fn release_slot(client: &tokio_postgres::Client, feed: &PgFeed) -> Result<(), CommandError> {
    for _ in 0..100 {
        let active = client
            .query_opt(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                 WHERE slot_name = $1 AND active_pid IS NOT NULL \
                 AND active_pid <> pg_backend_pid()",
                &[&feed.feed.slot],
            )
            .await
            .map_err(feed_error)?
            .is_some();
        if !active {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    Err(feed_error(format!(
        "the slot {} is still streamed by another connection",
        feed.feed.slot
    )))
}

/// How often a streaming feed tells the server where it is, whatever happened (the
/// server's `wal_sender_timeout` ends a connection that says nothing for 60 s by default).
const STATUS_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// What a failure of the stream means (see [`classify`]).
async fn stream_failure(
    client: &tokio_postgres::Client,
    feed: &PgFeed,
    e: StreamError,
) -> ReadError {
    let server = matches!(e, StreamError::Server { .. });
    classify_failure(client, feed, stream_failed(e), server).await
}

/// After a failed read: `Ok(true)` once a lost slot was made anew (read it again), `Err`
/// to start over on a new connection (after a pause). The same bytes failing to decode
/// on every read, or the server refusing every read at the slot's position: after a few
/// tries (each on a new connection, after the publication is made again) the slot is given
/// up as lost (a new one, and a flush) rather than held, with the log it keeps, for ever.
/// `Ok(false)`: the host stopped.
async fn failed(
    host: &Weak<Inner>,
    client: &tokio_postgres::Client,
    feed: &PgFeed,
    owed: &str,
    failure: ReadError,
) -> Result<bool, CommandError> {
    let why = match failure {
        ReadError::Lost(why) => why,
        ReadError::Undecodable(e) | ReadError::Refused(e) => {
            if feed.counters.stuck.fetch_add(1, Ordering::Relaxed) + 1 < STUCK_TRIES {
                return Err(e);
            }
            format!("{e}, {STUCK_TRIES} times in a row")
        }
        ReadError::Other(e) => return Err(e),
    };
    renew_slot(host, client, feed, owed, &why).await
}

fn stream_failed(e: StreamError) -> CommandError {
    feed_error(format!("the replication stream: {e}"))
}

/// Waits until the transactions `xids`, whose commits were decoded, are visible to a new
/// snapshot. A commit is written to the log (and decoded, and streamed) a moment before
/// the server shows it to other transactions: an entry invalidated in that moment and
/// recomputed at once would read the row as it was before the change, and keep it until
/// the row changes again. Most often the first look finds them visible (one round trip).
async fn wait_visible(client: &tokio_postgres::Client, xids: &[u32]) -> Result<(), CommandError> {
    if xids.is_empty() {
        return Ok(());
    }
    let started = std::time::Instant::now();
    loop {
        let snapshot = simple_one(client, "SELECT pg_current_snapshot()").await?;
        let visible = visible_in(&snapshot, xids)
            .ok_or_else(|| feed_error(format!("a snapshot of {snapshot:?}")))?;
        if visible {
            return Ok(());
        }
        if started.elapsed() > VISIBLE_WITHIN {
            return Err(feed_error(format!(
                "transactions {xids:?} committed but are not visible after {VISIBLE_WITHIN:?}"
            )));
        }
        tokio::time::sleep(std::time::Duration::from_micros(200)).await;
    }
}

/// How long [`wait_visible`] waits before it gives up (the feed starts over).
const VISIBLE_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether every transaction of `xids` (32-bit ids of committed transactions) is visible
/// in `snapshot` (`xmin:xmax:xip,...`, 64-bit ids): below `xmax` and not in progress.
/// `None` when the snapshot does not parse.
pub(super) fn visible_in(snapshot: &str, xids: &[u32]) -> Option<bool> {
    let mut parts = snapshot.split(':');
    let _xmin: u64 = parts.next()?.parse().ok()?;
    let xmax: u64 = parts.next()?.parse().ok()?;
    let mut in_progress = Vec::new();
    for x in parts.next()?.split(',').filter(|x| !x.is_empty()) {
        in_progress.push(x.parse::<u64>().ok()? as u32);
    }
    if parts.next().is_some() {
        return None;
    }
    // 32-bit ids compare modulo 2^32, as PostgreSQL compares them.
    let below_xmax = |x: u32| (xmax as u32).wrapping_sub(x) as i32 > 0;
    Some(
        xids.iter()
            .all(|&x| below_xmax(x) && !in_progress.contains(&x)),
    )
}

/// Applies `changes` here at once (they are committed: an early invalidation is never
/// wrong), then logs them for the other hosts, marked as applied here, and sends them to
/// the other hosts ahead of the log ([`super::HintOut`]) on `client`, the feed's own
/// connection. A log that fails is read again and applied here again: harmless.
async fn apply_and_log(
    host: &Weak<Inner>,
    feed: &PgFeed,
    client: &tokio_postgres::Client,
    hint_sql: &tokio_postgres::Statement,
    mut changes: DbChanges,
) -> tokio::task::JoinHandle<LogResult> {
    let mut hinted = None;
    if let Some(inner) = host.upgrade() {
        if let Some(apply) = &inner.changes {
            apply.apply(&changes);
        }
        changes.applied_by = Some(inner.id.clone());
        hinted = hint(&inner, &mut changes);
    }
    let (rows, tables) = (changes.rows.len() as u64, changes.tables.len() as u64);
    let logging = host.clone();
    let task =
        tokio::spawn(async move { log(&logging, changes).await.map(|ok| (ok, rows, tables)) });
    if let Some((channel, payload)) = hinted {
        // The hint is a shortcut: the operation, logged meanwhile, is the truth.
        match client
            .execute(hint_sql, &[&vec![channel], &vec![payload]])
            .await
        {
            Ok(_) => {
                feed.counters.hints.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::debug!(%e, "change feed: a hint not sent"),
        }
    }
    task
}

/// The hint of `changes` (numbering them), when the hosts hear PostgreSQL notifications
/// and it fits in one: its channel and payload.
fn hint(inner: &Inner, changes: &mut DbChanges) -> Option<(String, String)> {
    if !matches!(*inner.publisher.lock(), Publisher::Postgres { .. }) {
        return None;
    }
    let Engine::Postgres(pg) = &*inner.db.inner else {
        return None;
    };
    changes.hint = rand::random::<u64>() | 1;
    let payload = serde_json::to_string(&super::HintOut {
        from: &inner.id,
        changes,
    })
    .ok()
    .map(|mut p| {
        inner.seal.seal_string(&mut p);
        p
    })
    .filter(|p| p.len() <= PG_PAYLOAD_LIMIT);
    if payload.is_none() {
        changes.hint = 0;
    }
    Some((crate::notify::hint_channel(&pg.channel), payload?))
}

/// Waits for a log of changes and counts it: `false` when the host stopped.
async fn logged(
    feed: &PgFeed,
    task: Option<tokio::task::JoinHandle<LogResult>>,
) -> Result<bool, CommandError> {
    match task {
        None => Ok(true),
        Some(task) => finished(feed, task.await),
    }
}

/// Counts a finished log of changes: `false` when the host stopped.
fn finished(
    feed: &PgFeed,
    joined: Result<LogResult, tokio::task::JoinError>,
) -> Result<bool, CommandError> {
    match joined {
        Ok(Ok((true, rows, tables))) => {
            feed.counters.operations.fetch_add(1, Ordering::Relaxed);
            feed.counters.rows.fetch_add(rows, Ordering::Relaxed);
            feed.counters.tables.fetch_add(tables, Ordering::Relaxed);
            Ok(true)
        }
        Ok(Ok((false, _, _))) => Ok(false),
        Ok(Err(e)) => Err(e),
        Err(e) => Err(feed_error(format!("the log of changes: {e}"))),
    }
}

/// Gives up a lost slot: records the flush the hosts owe, drops the slot, makes it anew
/// and pays the flush. `false`: the host stopped.
async fn renew_slot(
    host: &Weak<Inner>,
    client: &tokio_postgres::Client,
    feed: &PgFeed,
    owed: &str,
    why: &str,
) -> Result<bool, CommandError> {
    tracing::warn!(%why, slot = %feed.feed.slot,
        "change feed: the slot is lost; a new one is made and every host flushes");
    feed.counters.stuck.store(0, Ordering::Relaxed);
    owe_flush(client, feed, owed).await?;
    release_slot(client, feed).await?;
    client
        .execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE slot_name = $1 AND database = current_database()",
            &[&feed.feed.slot],
        )
        .await
        .map_err(feed_error)?;
    Ok(ensure_slot(host, client, feed).await?
        && pay_flush(host, client, feed, owed).await?
        && settle_hold(host, client, feed).await?)
}

/// What a log of changes answers: whether the host still runs, and the rows and tables
/// it logged.
type LogResult = Result<(bool, u64, u64), CommandError>;

/// Logs of changes under way at most (see `lead`).
const MAX_LOGGING: usize = 16;

/// Reads in a row that fail on a message that does not decode, or that the server
/// refuses, before the slot is given up.
const STUCK_TRIES: u64 = 3;

/// The statement that makes the table of owed flushes in `schema` (an identifier, quoted
/// or not): a row per name.
pub(super) fn flushes_table_sql(schema: &str) -> String {
    format!("CREATE TABLE IF NOT EXISTS {schema}.coherent_feed_flushes (name TEXT PRIMARY KEY)")
}

/// The statement that records a flush owed under the name `name` (SQL: a parameter or a
/// literal) in `schema` (see [`owe_flush`]). Owed again, the row is written again: a new
/// version of it.
pub(super) fn owe_flush_sql(schema: &str, name: &str) -> String {
    format!(
        "INSERT INTO {schema}.coherent_feed_flushes (name) VALUES ({name}) \
         ON CONFLICT (name) DO UPDATE SET name = excluded.name"
    )
}

/// Records, in the cluster's schema, that the hosts owe a flush (a slot or triggers are
/// about to be made: what changed before them is in neither), so that a host that dies
/// before logging the flush leaves it to the next. Owed again while one is being paid,
/// it stays owed: the payment clears only the version of the row it read.
pub(super) async fn owe_flush(
    client: &tokio_postgres::Client,
    feed: &PgFeed,
    name: &str,
) -> Result<(), CommandError> {
    client
        .execute(&owe_flush_sql(&feed.schema, "$1"), &[&name])
        .await
        .map_err(feed_error)?;
    Ok(())
}

/// A flush owed, as [`debt`] reads it.
struct Debt {
    /// The row's version (`xmin`), as [`clear_flush`] takes it.
    version: String,
    /// The 64-bit id (`xid8`) of the transaction that last owed it: a hold of this debt
    /// is numbered by it.
    at: u64,
    /// Past every transaction id given out when it was read (the snapshot's `xmax`): a
    /// payment logged after this read is numbered by it, above the debt it pays and below
    /// any debt owed after.
    now: u64,
}

/// The owed rows of `schema` that `filter` (a condition on `name`) selects: the name, the
/// row's version, the 64-bit id of the transaction that owed it, and the snapshot's
/// `xmax`. The owe's id is made from the row's 32-bit `xmin` and the current epoch (a
/// row's `xmin` above the low half of the next id is of the epoch before).
fn debts_sql(schema: &str, filter: &str) -> String {
    format!(
        "SELECT name, version, (CASE WHEN x > (now & 4294967295) \
                                THEN (now >> 32) - 1 ELSE now >> 32 END) << 32 | x, now \
         FROM (SELECT name, xmin::text AS version, xmin::text::bigint AS x, \
                      pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS now \
               FROM {schema}.coherent_feed_flushes WHERE {filter}) AS owed"
    )
}

/// The flush owed under `name` with its numbers, or `None`.
async fn debt(
    client: &tokio_postgres::Client,
    schema: &str,
    name: &str,
) -> Result<Option<Debt>, CommandError> {
    let row = client
        .query_opt(&debts_sql(schema, "name = $1"), &[&name])
        .await
        .map_err(feed_error)?;
    Ok(row.map(|r| Debt {
        version: r.get(1),
        at: r.get::<_, i64>(2) as u64,
        now: r.get::<_, i64>(3) as u64,
    }))
}

/// The advisory lock a slot's feed leads under: this and the slot's name, hashed
/// (`hashtext`).
const SLOT_LOCK: &str = "coherent.changes.";

/// Holds `apply`'s cache for each slot's flush owed now whose slot may be being made: one
/// whose feed's lock someone holds (a leader making the slot, or about to pay), or `own`,
/// this host's own feed's slot (its leader, this host or another, pays it). The
/// triggers' flush takes no hold. For a host starting: it reads the log from past the
/// operations logged before its start, holds among them, and a slot's flush owed then is
/// still owed (its row committed before its hold was logged, cleared only after its
/// payment was). Read after the host set where it reads the log from (a hold logged after
/// this read is read there), before it answers anything: a host that read the row only
/// once its feed's connection was up answered from its cache until then, and one without
/// a feed never read it. A row of a name nobody leads (a feed renamed, or turned to
/// triggers, after a slot that could not be made) holds no new host: its next leader,
/// if one comes, owes the flush again and logs a hold this host reads. Nothing on SQLite.
pub(crate) async fn hold_owed(
    db: &crate::Database,
    apply: &super::ApplyChanges,
    own: Option<&str>,
) -> Result<(), CommandError> {
    let Engine::Postgres(pg) = &*db.inner else {
        return Ok(());
    };
    // Unquoted in the statements that made it: PostgreSQL folded it.
    let schema = &pg.schema.to_ascii_lowercase();
    let read = async {
        let client = pg.pool.get().await?;
        let table = format!("{schema}.coherent_feed_flushes");
        let made: bool = client
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
            .await?
            .get(0);
        if !made {
            return Ok(Vec::new());
        }
        // A lock taken with a `bigint` key is shown split in two 32-bit halves.
        let led = "name <> 'triggers' AND (name = $1 OR EXISTS (\
                   SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted \
                   AND l.objsubid = 1 \
                   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                   AND (l.classid::bigint << 32 | l.objid::bigint) = hashtext($2 || name)::bigint))";
        Ok::<_, CommandError>(
            client
                .query(&debts_sql(schema, led), &[&own.unwrap_or(""), &SLOT_LOCK])
                .await?
                .iter()
                .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(2) as u64))
                .collect(),
        )
    };
    let owed = read.await.map_err(|e| {
        feed_error(format!(
            "reading the flushes owed ({schema}.coherent_feed_flushes): {e}"
        ))
    })?;
    for (name, at) in owed {
        apply.hold(&name, at);
    }
    Ok(())
}

/// How often a host holding its cache for an owed flush looks whether it was paid out of
/// its sight ([`settle_holds`]).
const SETTLE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// While this host holds its cache for an owed flush, looks every [`SETTLE_EVERY`] whether
/// the flush was paid by an operation it does not read (logged before its start, the row
/// cleared after its start read it): once the row is gone, a hold numbered below the
/// oldest transaction then running is lifted, the cache flushed first
/// ([`settled_below`], [`ApplyChanges::settled`](super::ApplyChanges::settled)). Every
/// host with watches on PostgreSQL runs it, with a feed or not; it reads the database only
/// while a hold stands.
pub(crate) async fn settle_holds(host: Weak<Inner>, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(SETTLE_EVERY) => {}
            _ = stop.wait_for(|&s| s) => return,
        }
        let Some(inner) = host.upgrade() else { return };
        let (Some(apply), Engine::Postgres(pg)) = (&inner.changes, &*inner.db.inner) else {
            return;
        };
        let held = apply.held_names();
        if held.is_empty() {
            continue;
        }
        let schema = pg.schema.to_ascii_lowercase();
        let settled = async {
            let client = pg.pool.get().await?;
            for name in &held {
                if let Some(below) = settled_below(&client, &schema, name).await? {
                    apply.settled(name, below);
                }
            }
            Ok::<_, CommandError>(())
        };
        if let Err(e) = settled.await {
            tracing::debug!(%e, "database changes: the owed flushes could not be read");
        }
    }
}

/// When no flush is owed under `name`: the oldest transaction still running (the
/// snapshot's `xmin`), below which every debt owed was paid (an owe below it would be
/// seen). `None` while one is owed. A hold numbered at or above it may be of an owe still
/// being made, and stands.
async fn settled_below(
    client: &tokio_postgres::Client,
    schema: &str,
    name: &str,
) -> Result<Option<u64>, CommandError> {
    let row = client
        .query_one(
            &format!(
                "SELECT EXISTS (SELECT 1 FROM {schema}.coherent_feed_flushes WHERE name = $1), \
                        pg_snapshot_xmin(pg_current_snapshot())::text::bigint"
            ),
            &[&name],
        )
        .await
        .map_err(feed_error)?;
    Ok((!row.get::<_, bool>(0)).then(|| row.get::<_, i64>(1) as u64))
}

/// Past every transaction id given out now (the current snapshot's `xmax`).
async fn next_xid(client: &tokio_postgres::Client) -> Result<u64, CommandError> {
    let row = client
        .query_one(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint",
            &[],
        )
        .await
        .map_err(feed_error)?;
    Ok(row.get::<_, i64>(0) as u64)
}

/// Clears the flush owed under `name` if its row is still the version read before the
/// payment: one owed again meanwhile (triggers installed by a host starting then, whose
/// earlier changes the payment, logged before them, does not cover), by an update of the
/// row or by a new row after another payer's clear, stays owed. An owe not yet committed
/// holds the row: the clear waits for it, then finds another version. `true` when cleared.
async fn clear_flush(
    client: &tokio_postgres::Client,
    schema: &str,
    name: &str,
    version: &str,
) -> Result<bool, CommandError> {
    Ok(client
        .execute(
            &format!(
                "DELETE FROM {schema}.coherent_feed_flushes \
                 WHERE name = $1 AND xmin::text = $2"
            ),
            &[&name, &version],
        )
        .await
        .map_err(feed_error)?
        == 1)
}

/// Once the slot exists and its flush is paid: a hold of it still standing here (this
/// host took it from the owed row and then the lock, after another host cleared the row;
/// or a host of an earlier release paid before the slot existed, so no payment named it)
/// ends with one more flush that pays it, logged for every host. `false`: the host
/// stopped.
async fn settle_hold(
    host: &Weak<Inner>,
    client: &tokio_postgres::Client,
    feed: &PgFeed,
) -> Result<bool, CommandError> {
    let slot = &feed.feed.slot;
    if !applier(host).is_some_and(|a| a.holding(slot)) {
        return Ok(true);
    }
    let now = next_xid(client).await?;
    log(
        host,
        DbChanges {
            paid: Some(Owed::new(slot, now)),
            ..flush()
        },
    )
    .await
}

/// Logs the flush owed under `name`, as often as it is owed again while being paid, then
/// clears it. `false`: the host stopped.
async fn pay_flush(
    host: &Weak<Inner>,
    client: &tokio_postgres::Client,
    feed: &PgFeed,
    name: &str,
) -> Result<bool, CommandError> {
    while let Some(debt) = debt(client, &feed.schema, name).await? {
        let paid = DbChanges {
            paid: Some(Owed::new(name, debt.now)),
            ..flush()
        };
        if !log(host, paid).await? {
            return Ok(false);
        }
        if clear_flush(client, &feed.schema, name, &debt.version).await? {
            break;
        }
    }
    Ok(true)
}

struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub(super) fn flush() -> DbChanges {
    DbChanges {
        flush: true,
        ..DbChanges::default()
    }
}

/// Makes the publication hold every table this host watches and the log's table; answers
/// the primary key of each table this host watches. A table whose updates and deletes
/// logical decoding cannot carry (no primary key, no replica identity) is refused: once
/// published, PostgreSQL would refuse the application's updates and deletes of it.
async fn publish(client: &tokio_postgres::Client, feed: &PgFeed) -> Result<Keys, CommandError> {
    let publication = &feed.feed.publication;
    client
        .batch_execute(&flushes_table_sql(&feed.schema))
        .await
        .map_err(feed_error)?;
    let quoted = |t: &str| {
        let (s, n) = t.split_once('.').unwrap_or(("public", t));
        format!(
            "\"{}\".\"{}\"",
            s.replace('"', "\"\""),
            n.replace('"', "\"\"")
        )
    };
    let mut keys = Keys::new();
    let mut wanted: Vec<String> = Vec::new();
    for w in &feed.watches.tables {
        let table = w.qualified(&feed.schema);
        let row = client
            .query_opt(
                "SELECT c.relreplident::text, n.nspname::text, c.relname::text, \
                 ARRAY(SELECT a.attname::text FROM pg_index i JOIN pg_attribute a \
                       ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
                       WHERE i.indrelid = c.oid AND i.indisprimary) \
                 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE c.oid = to_regclass($1)",
                &[&quoted(&table)],
            )
            .await
            .map_err(feed_error)?
            .ok_or_else(|| feed_error(format!("the watched table {table} does not exist")))?;
        let (identity, schema, name, pk): (String, String, String, Vec<String>) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        if identity == "n" || (identity == "d" && pk.is_empty()) {
            return Err(feed_error(format!(
                "the watched table {table} has no primary key and no replica identity: \
                 logical decoding cannot carry its updates and deletes (and PostgreSQL \
                 would refuse them once it is published); give it a primary key or a \
                 REPLICA IDENTITY, or use ChangeFeed::postgres_triggers()"
            )));
        }
        keys.insert((schema.clone(), name.clone()), pk);
        wanted.push(format!("{schema}.{name}"));
    }
    wanted.push(format!("{}.coherent_operations", feed.schema));
    wanted.sort();
    wanted.dedup();
    let shape = client
        .query_opt(
            "SELECT pubinsert AND pubupdate AND pubdelete AND pubtruncate AND pubviaroot \
             FROM pg_publication WHERE pubname = $1",
            &[publication],
        )
        .await
        .map_err(feed_error)?
        .map(|r| r.get::<_, bool>(0));
    match shape {
        Some(true) => {}
        Some(false) => {
            return Err(feed_error(format!(
                "the publication {publication} exists but does not publish every insert, \
                 update, delete and truncate through the partition root: the feed would miss \
                 changes (drop it, or name another with ChangeFeed::publication)"
            )))
        }
        None => {
            let list: Vec<String> = wanted.iter().map(|t| quoted(t)).collect();
            let sql = format!(
                "CREATE PUBLICATION {publication} FOR TABLE {} \
                 WITH (publish_via_partition_root = true)",
                list.join(", ")
            );
            match client.batch_execute(&sql).await {
                Ok(()) => return Ok(keys),
                // Another host made it meanwhile: add what it lacks below.
                Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::DUPLICATE_OBJECT) => {}
                Err(e) => return Err(feed_error(format!("{sql}: {e}"))),
            }
        }
    }
    let have: Vec<String> = client
        .query(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1",
            &[publication],
        )
        .await
        .map_err(feed_error)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    for table in wanted.iter().filter(|t| !have.contains(t)) {
        let sql = format!(
            "ALTER PUBLICATION {publication} ADD TABLE {}",
            quoted(table)
        );
        match client.batch_execute(&sql).await {
            Ok(()) => {}
            // Another host added it meanwhile.
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::DUPLICATE_OBJECT) => {}
            Err(e) => return Err(feed_error(format!("{sql}: {e}"))),
        }
    }
    Ok(keys)
}

/// Creates the slot when it is missing, after recording that the hosts owe a flush
/// (changes before it are not in it) and holding every host's cache until it is paid:
/// the slot waits for every transaction running when it is made, and a change committed
/// in that wait is in no slot (see [`DbChanges::hold`]). A slot of that name in another
/// database, or of another plugin, is refused: it is not this cluster's. `false`: the
/// host stopped.
async fn ensure_slot(
    host: &Weak<Inner>,
    client: &tokio_postgres::Client,
    feed: &PgFeed,
) -> Result<bool, CommandError> {
    let found = client
        .query_opt(
            "SELECT database::text = current_database()::text, plugin::text, database::text \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&feed.feed.slot],
        )
        .await
        .map_err(feed_error)?;
    if let Some(row) = found {
        let (here, plugin, database): (Option<bool>, Option<String>, Option<String>) =
            (row.get(0), row.get(1), row.get(2));
        if here == Some(true) && plugin.as_deref() == Some("pgoutput") {
            return Ok(true);
        }
        return Err(feed_error(format!(
            "the replication slot {} belongs to database {database:?} with plugin \
             {plugin:?}: give this cluster's feed a slot of its own (ChangeFeed::slot)",
            feed.feed.slot
        )));
    }
    can_make_slot(client, &feed.feed.slot).await?;
    owe_flush(client, feed, &feed.feed.slot).await?;
    // After the owed row: a host starting now reads the row, or (started after this was
    // logged) reads this in the log.
    let at = match debt(client, &feed.schema, &feed.feed.slot).await? {
        Some(debt) => debt.at,
        // Paid already by a host of an earlier release (which pays before it stands by):
        // held all the same, until this host's own payment (`settle_hold`).
        None => next_xid(client).await?,
    };
    let hold = DbChanges {
        hold: Some(Owed::new(&feed.feed.slot, at)),
        ..flush()
    };
    if !log_acknowledged(host, hold).await? {
        return Ok(false);
    }
    client
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&feed.feed.slot],
        )
        .await
        .map_err(feed_error)?;
    feed.counters.slots_created.fetch_add(1, Ordering::Relaxed);
    tracing::info!(slot = %feed.feed.slot, "change feed: slot created");
    Ok(true)
}

/// Whether the slot `slot` can be made now: by a role allowed to replicate, with a slot
/// free. Checked before its flush is owed: a slot that cannot be made kept every host
/// holding its cache, and each try logged another hold, a flush of every host. The reason
/// goes to the feed's error (logged, `FeedStats::errors`), and the feed tries again.
async fn can_make_slot(client: &tokio_postgres::Client, slot: &str) -> Result<(), CommandError> {
    let row = client
        .query_one(
            "SELECT r.rolsuper OR r.rolreplication, current_user::text, \
                    (SELECT count(*) FROM pg_replication_slots), \
                    current_setting('max_replication_slots')::bigint \
             FROM pg_roles r WHERE r.rolname = current_user",
            &[],
        )
        .await
        .map_err(feed_error)?;
    let (allowed, role, used, max): (bool, String, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    if !allowed {
        return Err(feed_error(format!(
            "the role {role} may not make the replication slot {slot}: it needs the \
             REPLICATION attribute (ALTER ROLE {role} REPLICATION) or to be a superuser; \
             or use ChangeFeed::postgres_triggers()"
        )));
    }
    if used >= max {
        return Err(feed_error(format!(
            "no replication slot is free for {slot} ({used} of max_replication_slots = \
             {max}): drop one no longer used (pg_drop_replication_slot), raise \
             max_replication_slots, or use ChangeFeed::postgres_triggers()"
        )));
    }
    Ok(())
}

enum ReadError {
    /// The slot is gone or invalidated: why.
    Lost(String),
    /// A message did not decode.
    Undecodable(CommandError),
    /// The server refused the read (a publication missing when a change was written, say:
    /// it is looked up as of each change, so a publication made again does not help).
    Refused(CommandError),
    Other(CommandError),
}

/// One read of the slot: the changes to log, the transactions they come from, where the
/// slot may move after, and whether anything was read.
async fn read(
    client: &tokio_postgres::Client,
    feed: &PgFeed,
    keys: &Keys,
    skip_upto: u64,
    seen_insert: &mut Option<u64>,
) -> Result<(DbChanges, Vec<u32>, Option<u64>, bool), ReadError> {
    feed.counters.reads.fetch_add(1, Ordering::Relaxed);
    // The read goes up to what is flushed now, and notes the insert position: the slot
    // may then move (see the end) even if no transaction had a change to carry (without
    // it, a slot whose tables do not change would hold the log back, and each read would
    // decode it all again). One statement: the positions, then the messages (each row
    // repeats the positions; a read with no message is one row without data).
    let max = i32::try_from(feed.feed.max_messages).unwrap_or(i32::MAX);
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
        [&feed.feed.slot, &max, &feed.feed.publication];
    let rows = match client
        .query_raw(
            "WITH bound AS (SELECT pg_current_wal_flush_lsn() AS lsn, \
             pg_current_wal_insert_lsn() AS insert) \
             SELECT bound.lsn::text, bound.insert::text, c.data FROM bound LEFT JOIN LATERAL \
             pg_logical_slot_peek_binary_changes($1, bound.lsn, $2, \
             'proto_version', '1', 'publication_names', $3) c ON true",
            params,
        )
        .await
    {
        Ok(rows) => rows,
        Err(e) => return Err(classify(client, feed, e).await),
    };
    pin_mut!(rows);
    let mut read = Read::new(feed, keys, skip_upto);
    let mut messages = 0usize;
    let mut upto = None;
    loop {
        let row = match rows.try_next().await {
            Ok(Some(row)) => row,
            Ok(None) => break,
            Err(e) => return Err(classify(client, feed, e).await),
        };
        if upto.is_none() {
            let lsn = |i: usize| {
                let text: &str = row.get(i);
                parse_lsn(text)
                    .ok_or_else(|| ReadError::Other(feed_error(format!("an LSN of {text:?}"))))
            };
            upto = Some((lsn(0)?, lsn(1)?));
        }
        let Some(data) = row.get::<_, Option<&[u8]>>(2) else {
            continue;
        };
        messages += 1;
        let message = pgoutput::decode(data).map_err(|e| {
            feed.counters.undecodable.fetch_add(1, Ordering::Relaxed);
            ReadError::Undecodable(feed_error(e))
        })?;
        read.message(message)
            .map_err(|e| ReadError::Undecodable(feed_error(e)))?;
    }
    feed.counters
        .transactions
        .fetch_add(read.transactions, Ordering::Relaxed);
    feed.counters
        .skipped_commands
        .fetch_add(read.skipped, Ordering::Relaxed);
    // Where the slot may move without a transaction to show for it: the insert position
    // an earlier read saw (a record boundary: no record straddles it), once this read,
    // stopped by its bound and not by its limit (which the server checks only at a
    // commit), decoded up to a flushed position at or past it. Not to this read's flushed
    // position: the log is also flushed by whole pages, and a commit record cut by such a
    // position is not decoded by this read, yet starts before it: a slot moved there would
    // skip that transaction for good.
    let (flushed, inserted) = upto.unwrap_or((0, 0));
    let end_lsn = match *seen_insert {
        Some(earlier) if messages < feed.feed.max_messages && earlier <= flushed => {
            Some(read.end_lsn.unwrap_or(0).max(earlier))
        }
        _ => read.end_lsn,
    };
    *seen_insert = Some(inserted);
    Ok((read.batch.into_changes(), read.xids, end_lsn, messages > 0))
}

#[cfg(test)]
mod tests {
    use super::{clear_flush, debt, flushes_table_sql, names_standby, owe_flush_sql, visible_in};

    /// A flush owed again while one is being paid (between the payer's read and its clear:
    /// triggers installed meanwhile by a host starting, whose earlier changes the flush
    /// being logged does not cover) stays owed, whether the owe updated the row, is not
    /// committed yet when the payer clears (the clear waits for it), or made the row anew
    /// after another payer cleared it.
    #[tokio::test]
    async fn a_flush_owed_while_one_is_paid_stays_owed() {
        let Ok(url) = std::env::var("DATABASE_URL") else {
            eprintln!("skipped: DATABASE_URL is not set");
            return;
        };
        let connect = || async {
            let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(connection);
            client
        };
        let (payer, installer) = (connect().await, connect().await);
        let schema = format!("flush_owed_{}", rand::random::<u32>());
        payer
            .batch_execute(&format!(
                "CREATE SCHEMA {schema}; {}",
                flushes_table_sql(&schema)
            ))
            .await
            .unwrap();
        let owe = owe_flush_sql(&schema, "$1");
        let owed = || async {
            debt(&payer, &schema, "triggers")
                .await
                .map(|owed| owed.map(|owed| owed.version))
        };

        // Owed again by an update of the row.
        installer.execute(&owe, &[&"triggers"]).await.unwrap();
        let read = owed().await.unwrap().unwrap();
        installer.execute(&owe, &[&"triggers"]).await.unwrap();
        assert!(!clear_flush(&payer, &schema, "triggers", &read)
            .await
            .unwrap());
        let again = owed().await.unwrap().unwrap();
        assert!(clear_flush(&payer, &schema, "triggers", &again)
            .await
            .unwrap());
        assert_eq!(owed().await.unwrap(), None);

        // Owed again in a transaction still open when the payer clears.
        installer.execute(&owe, &[&"triggers"]).await.unwrap();
        let read = owed().await.unwrap().unwrap();
        installer.batch_execute("BEGIN").await.unwrap();
        installer.execute(&owe, &[&"triggers"]).await.unwrap();
        let clear = {
            let (schema, read) = (schema.clone(), read.clone());
            let payer = connect().await;
            tokio::spawn(async move { clear_flush(&payer, &schema, "triggers", &read).await })
        };
        // The clear waits for the owe's row lock.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let waiting = format!(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE 'DELETE FROM {schema}.coherent_feed_flushes%'"
        );
        while payer
            .query_one(&waiting, &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 0
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the clear never waited"
            );
            tokio::task::yield_now().await;
        }
        installer.batch_execute("COMMIT").await.unwrap();
        assert!(
            !clear.await.unwrap().unwrap(),
            "cleared an owe made after its read"
        );
        assert!(owed().await.unwrap().is_some());

        // Owed anew after another payer cleared what both read.
        let read = owed().await.unwrap().unwrap();
        assert!(clear_flush(&payer, &schema, "triggers", &read)
            .await
            .unwrap());
        installer.execute(&owe, &[&"triggers"]).await.unwrap();
        assert!(!clear_flush(&payer, &schema, "triggers", &read)
            .await
            .unwrap());
        assert!(owed().await.unwrap().is_some());

        payer
            .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
            .await
            .unwrap();
    }

    #[test]
    fn the_standby_names_that_would_make_the_feed_a_synchronous_standby() {
        let app = "coherent_changes_feed:app";
        for named in [
            "*",
            "FIRST 1 (*)",
            "ANY 2 (s1, *)",
            "\"coherent_changes_feed:app\"",
            "s1, \"COHERENT_CHANGES_FEED:APP\"",
            "2 (s1, \"coherent_changes_feed:app\")",
        ] {
            assert!(names_standby(named, app), "{named}");
        }
        for not in [
            "",
            "s1",
            "FIRST 1 (s1, s2)",
            "\"coherent_changes_feed:other\"",
        ] {
            assert!(!names_standby(not, app), "{not}");
        }
    }

    #[test]
    fn a_transaction_is_visible_below_xmax_and_out_of_progress() {
        assert_eq!(visible_in("100:105:", &[99, 104]), Some(true));
        assert_eq!(visible_in("100:105:", &[105]), Some(false));
        assert_eq!(visible_in("100:105:101,103", &[103]), Some(false));
        assert_eq!(visible_in("100:105:101,103", &[102, 104]), Some(true));
        // 64-bit ids of a later epoch against 32-bit ones.
        let epoch = 3u64 << 32;
        let snapshot = format!("{}:{}:{}", epoch + 10, epoch + 20, epoch + 12);
        assert_eq!(visible_in(&snapshot, &[15]), Some(true));
        assert_eq!(visible_in(&snapshot, &[12]), Some(false));
        // Across the wrap: xmax just past it, a transaction just before it.
        let snapshot = format!("{}:{}:", epoch - 5, epoch + 2);
        assert_eq!(visible_in(&snapshot, &[u32::MAX - 1]), Some(true));
        assert_eq!(visible_in(&snapshot, &[3]), Some(false));
        assert_eq!(visible_in("junk", &[1]), None);
        assert_eq!(visible_in("1:2:x", &[1]), None);
    }
}
