//! The PostgreSQL change feed: a publication of the watched tables, a logical replication
//! slot read with `pg_logical_slot_peek_binary_changes` (pgoutput, protocol version 1) and
//! moved with `pg_replication_slot_advance` only after the operation carrying the changes
//! committed.
//!
//! One host reads the slot at a time: the one holding a session advisory lock, on a
//! connection of the feed's own (the lock goes with the connection, so a host that dies
//! or loses it hands the feed over to the next host that tries). Each read takes whole
//! transactions (the server stops only at a commit), skips the ones that also wrote an
//! operation to the log (commands: their handlers invalidate), and runs one
//! `coherent.db_changes` command through the host's pipeline with what is left. The slot
//! moves to the end of the last transaction read once that command returned: a feed that
//! fails before reads the same transactions again (at least once, never lost).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use futures::{pin_mut, TryStreamExt};
use tokio::sync::watch;

use super::pgoutput::{self, Message, Tuple, Value};
use super::{Batch, Change, ChangeFeed, ChangeKind, DbChanges, Row, Watches};
use crate::error::{CommandError, ErrorKind};
use crate::host::{Host, Inner};

/// The `application_name` of the feed's connection (in `pg_stat_activity`).
pub const FEED_APPLICATION: &str = "coherent_changes_feed";

/// Counters of a host's change feed, from its start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FeedStats {
    /// Whether this host holds the feed now (reads the slot).
    pub leading: bool,
    /// Reads of the slot.
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
}

#[derive(Default)]
pub(crate) struct FeedCounters {
    leading: AtomicBool,
    pub(super) reads: AtomicU64,
    pub(super) transactions: AtomicU64,
    pub(super) skipped_commands: AtomicU64,
    pub(super) rows: AtomicU64,
    pub(super) tables: AtomicU64,
    pub(super) operations: AtomicU64,
    pub(super) slots_created: AtomicU64,
    pub(super) errors: AtomicU64,
    pub(super) undecodable: AtomicU64,
}

impl FeedCounters {
    pub(crate) fn snapshot(&self) -> FeedStats {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        FeedStats {
            leading: self.leading.load(Ordering::Relaxed),
            reads: n(&self.reads),
            transactions: n(&self.transactions),
            skipped_commands: n(&self.skipped_commands),
            rows: n(&self.rows),
            tables: n(&self.tables),
            operations: n(&self.operations),
            slots_created: n(&self.slots_created),
            errors: n(&self.errors),
            undecodable: n(&self.undecodable),
        }
    }
}

/// What the feed task needs.
pub(crate) struct PgFeed {
    pub(crate) feed: ChangeFeed,
    pub(crate) watches: Watches,
    pub(crate) config: tokio_postgres::Config,
    pub(crate) schema: String,
    pub(crate) counters: Arc<FeedCounters>,
}

/// A relation as the stream described it: which columns a change keeps.
struct Relation {
    schema: String,
    name: String,
    /// The operation log's table: a transaction that wrote it is a command's.
    log: bool,
    /// `None`: not watched here (its changes are dropped).
    keep: Option<Vec<(usize, String)>>,
}

/// One read's state: relations and the transaction being read.
struct Read<'a> {
    feed: &'a PgFeed,
    relations: HashMap<u32, Relation>,
    open: Option<Open>,
    batch: Batch,
    /// Where the slot may move once the batch is logged.
    end_lsn: Option<u64>,
    transactions: u64,
    skipped: u64,
}

struct Open {
    batch: Batch,
    command: bool,
}

impl Read<'_> {
    fn row(&self, relation: u32, tuple: &Tuple<'_>) -> Result<Option<(&Relation, Row)>, String> {
        let Some(rel) = self.relations.get(&relation) else {
            return Err(format!(
                "a change of relation {relation} before its description"
            ));
        };
        let Some(keep) = &rel.keep else {
            return Ok(Some((rel, Row::default())));
        };
        let mut row = Vec::with_capacity(keep.len());
        for (i, name) in keep {
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
        let (schema, table, log, watched) = (
            rel.schema.clone(),
            rel.name.clone(),
            rel.log,
            rel.keep.is_some(),
        );
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
        }
        if watched {
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
            Message::Begin { .. } => {
                self.open = Some(Open {
                    batch: Batch::default(),
                    command: false,
                });
            }
            Message::Commit { end_lsn, .. } => {
                let Some(open) = self.open.take() else {
                    return Err("a commit outside a transaction".to_owned());
                };
                self.end_lsn = Some(end_lsn);
                if open.command && self.feed.feed.skip_commands {
                    self.skipped += 1;
                } else if open.batch.len() > 0 {
                    self.transactions += 1;
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
                let keep = self.feed.watches.columns(namespace, name).map(|extra| {
                    columns
                        .iter()
                        .enumerate()
                        .filter(|(_, c)| c.key || extra.contains(c.name))
                        .map(|(i, c)| (i, c.name.to_owned()))
                        .collect()
                });
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
                        Some(rel) if rel.keep.is_some() => open.batch.whole(&rel.schema, &rel.name),
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

/// Whether an error says the slot is gone or unusable (dropped, or invalidated by
/// `max_slot_wal_keep_size`): a new one is made, and every host flushes.
fn slot_lost(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    e.code().is_some_and(|c| {
        *c == SqlState::UNDEFINED_OBJECT || *c == SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE
    })
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
        format!("coherent.changes.{}", feed.feed.slot)
    };
    loop {
        if *stop.borrow() {
            return;
        }
        let result = lead(&host, &feed, &lock_key, &mut stop).await;
        feed.counters.leading.store(false, Ordering::Relaxed);
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

/// Runs `command` on the host, if it still runs.
pub(super) async fn log(host: &Weak<Inner>, changes: DbChanges) -> Result<bool, CommandError> {
    let Some(inner) = host.upgrade() else {
        return Ok(false);
    };
    Host { inner }.run(changes).await?;
    Ok(true)
}

/// One connection's life: `Ok` when the host stopped.
async fn lead(
    host: &Weak<Inner>,
    feed: &PgFeed,
    lock_key: &str,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), CommandError> {
    let mut config = feed.config.clone();
    config.application_name(FEED_APPLICATION);
    let (client, connection) = config
        .connect(tokio_postgres::NoTls)
        .await
        .map_err(feed_error)?;
    // The trigger feed's wake-ups come as notifications on this connection.
    let wake = Arc::new(tokio::sync::Notify::new());
    let woken = wake.clone();
    let mut connection = connection;
    let driver = tokio::spawn(async move {
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
    let level: String = client
        .query_one("SHOW wal_level", &[])
        .await
        .map_err(feed_error)?
        .get(0);
    if level != "logical" {
        return Err(feed_error(format!(
            "wal_level is {level}: logical decoding needs wal_level = logical \
             (ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL)"
        )));
    }
    publish(&client, feed).await?;
    if ensure_slot(&client, feed).await? && !log(host, flush()).await? {
        return Ok(());
    }
    // Where this connection last moved the slot.
    let mut advanced = 0;
    loop {
        if *stop.borrow() {
            return Ok(());
        }
        let (changes, end_lsn, any) = match read(&client, feed).await {
            Ok(read) => read,
            Err(ReadError::Lost(e)) => {
                tracing::warn!(%e, slot = %feed.feed.slot,
                    "change feed: the slot is lost; a new one is made and every host flushes");
                client
                    .execute(
                        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                         WHERE slot_name = $1",
                        &[&feed.feed.slot],
                    )
                    .await
                    .map_err(feed_error)?;
                if ensure_slot(&client, feed).await? && !log(host, flush()).await? {
                    return Ok(());
                }
                continue;
            }
            Err(ReadError::Other(e)) => return Err(e),
        };
        if !changes.is_empty() {
            let (rows, tables) = (changes.rows.len() as u64, changes.tables.len() as u64);
            if !log(host, changes).await? {
                return Ok(());
            }
            feed.counters.operations.fetch_add(1, Ordering::Relaxed);
            feed.counters.rows.fetch_add(rows, Ordering::Relaxed);
            feed.counters.tables.fetch_add(tables, Ordering::Relaxed);
        }
        if let Some(lsn) = end_lsn.filter(|&lsn| lsn > advanced) {
            advanced = lsn;
            client
                .execute(
                    "SELECT pg_replication_slot_advance($1, $2::text::pg_lsn)",
                    &[&feed.feed.slot, &lsn_text(lsn)],
                )
                .await
                .map_err(feed_error)?;
        }
        if !any {
            tokio::select! {
                _ = tokio::time::sleep(feed.feed.poll) => {}
                _ = stop.changed() => return Ok(()),
            }
        }
    }
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

/// Makes the publication hold every watched table and the log's table.
async fn publish(client: &tokio_postgres::Client, feed: &PgFeed) -> Result<(), CommandError> {
    let publication = &feed.feed.publication;
    let mut wanted: Vec<String> = feed
        .watches
        .tables
        .iter()
        .map(|w| w.qualified(&feed.schema))
        .collect();
    wanted.push(format!("{}.coherent_operations", feed.schema));
    wanted.sort();
    wanted.dedup();
    let exists = client
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = $1",
            &[publication],
        )
        .await
        .map_err(feed_error)?
        .is_some();
    let quoted = |t: &str| {
        let (s, n) = t.split_once('.').unwrap_or(("public", t));
        format!(
            "\"{}\".\"{}\"",
            s.replace('"', "\"\""),
            n.replace('"', "\"\"")
        )
    };
    if !exists {
        let list: Vec<String> = wanted.iter().map(|t| quoted(t)).collect();
        let sql = format!(
            "CREATE PUBLICATION {publication} FOR TABLE {}",
            list.join(", ")
        );
        match client.batch_execute(&sql).await {
            Ok(()) => return Ok(()),
            // Another host made it meanwhile: add what it lacks below.
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::DUPLICATE_OBJECT) => {}
            Err(e) => return Err(feed_error(format!("{sql}: {e}"))),
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
        client
            .batch_execute(&sql)
            .await
            .map_err(|e| feed_error(format!("{sql}: {e}")))?;
    }
    Ok(())
}

/// Creates the slot when it is missing: `true` when it did (the hosts must flush, since
/// changes before it are not in it).
async fn ensure_slot(client: &tokio_postgres::Client, feed: &PgFeed) -> Result<bool, CommandError> {
    let exists = client
        .query_opt(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
            &[&feed.feed.slot],
        )
        .await
        .map_err(feed_error)?
        .is_some();
    if exists {
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

enum ReadError {
    Lost(tokio_postgres::Error),
    Other(CommandError),
}

/// One read of the slot: the changes to log, where the slot may move after, and whether
/// anything was read.
async fn read(
    client: &tokio_postgres::Client,
    feed: &PgFeed,
) -> Result<(DbChanges, Option<u64>, bool), ReadError> {
    feed.counters.reads.fetch_add(1, Ordering::Relaxed);
    // The read goes up to what is flushed now: when it returns fewer messages than its
    // limit, it read every transaction that committed before that point, and the slot may
    // move there even if none had a change to carry (without it, a slot whose tables do not
    // change would hold the log back, and each read would decode it all again).
    let flushed: String = client
        .query_one("SELECT pg_current_wal_flush_lsn()::text", &[])
        .await
        .map_err(|e| ReadError::Other(feed_error(e)))?
        .get(0);
    let upto = parse_lsn(&flushed)
        .ok_or_else(|| ReadError::Other(feed_error(format!("an LSN of {flushed:?}"))))?;
    let max = i32::try_from(feed.feed.max_messages).unwrap_or(i32::MAX);
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
        [&feed.feed.slot, &flushed, &max, &feed.feed.publication];
    let rows = client
        .query_raw(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, $2::text::pg_lsn, $3, \
             'proto_version', '1', 'publication_names', $4)",
            params,
        )
        .await
        .map_err(|e| {
            if slot_lost(&e) {
                ReadError::Lost(e)
            } else {
                ReadError::Other(feed_error(e))
            }
        })?;
    pin_mut!(rows);
    let mut read = Read {
        feed,
        relations: HashMap::new(),
        open: None,
        batch: Batch::default(),
        end_lsn: None,
        transactions: 0,
        skipped: 0,
    };
    let mut messages = 0usize;
    while let Some(row) = rows.try_next().await.map_err(|e| {
        if slot_lost(&e) {
            ReadError::Lost(e)
        } else {
            ReadError::Other(feed_error(e))
        }
    })? {
        messages += 1;
        let data: &[u8] = row.get(0);
        let message = pgoutput::decode(data).map_err(|e| {
            feed.counters.undecodable.fetch_add(1, Ordering::Relaxed);
            ReadError::Other(feed_error(e))
        })?;
        read.message(message)
            .map_err(|e| ReadError::Other(feed_error(e)))?;
    }
    feed.counters
        .transactions
        .fetch_add(read.transactions, Ordering::Relaxed);
    feed.counters
        .skipped_commands
        .fetch_add(read.skipped, Ordering::Relaxed);
    // Fewer messages than the limit: the read stopped at `upto`, not at the limit (which
    // the server checks only at a commit, so a read that reached it ends on one).
    let end_lsn = if messages < feed.feed.max_messages {
        Some(read.end_lsn.unwrap_or(0).max(upto))
    } else {
        read.end_lsn
    };
    Ok((read.batch.into_changes(), end_lsn, messages > 0))
}
