//! The trigger feed ([`ChangeFeed::postgres_triggers`](super::ChangeFeed::postgres_triggers)):
//! row and `TRUNCATE` triggers on the watched tables write each change's key columns to
//! `coherent_changes` in the changing transaction and `NOTIFY` the feed; the feed (one host
//! at a time, under the same advisory lock as the logical feed) reads the table in id
//! order, logs what it read as one `coherent.db_changes` operation, then deletes those
//! rows. Rows of transactions still in flight become visible when they commit and are
//! read then (nothing is passed over: the feed deletes what it read instead of keeping a
//! cursor); a feed that fails between the log and the delete logs them again (at least
//! once).

use std::sync::atomic::Ordering;
use std::sync::Weak;

use tokio::sync::{watch, Notify};

use super::postgres::{feed_error, log, PgFeed};
use super::{Batch, Change, ChangeKind, Row};
use crate::error::CommandError;
use crate::host::Inner;

/// `"name"` with its quotes doubled: an identifier in SQL text.
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `'text'` with its quotes doubled: a literal in SQL text.
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// The `NOTIFY` channel of a schema's change table (an identifier: 63 bytes at most).
fn channel(schema: &str) -> String {
    let mut c = format!("coherent_changes_{schema}");
    c.truncate(63);
    c
}

/// Makes the change table, the trigger function and each table this host watches its
/// triggers, in one transaction; when some table had none before (its earlier changes
/// were not captured), the same transaction records that the hosts owe a flush.
pub(super) async fn install(
    client: &tokio_postgres::Client,
    feed: &PgFeed,
) -> Result<(), CommandError> {
    let schema = ident(&feed.schema);
    let notify = literal(&channel(&feed.schema));
    let flushes = super::postgres::flushes_table_sql(&schema);
    let mut sql = format!(
        "BEGIN; SELECT pg_advisory_xact_lock(hashtext('coherent.changes.install')); \
         {flushes}; \
         CREATE TABLE IF NOT EXISTS {schema}.coherent_changes ( \
             id BIGSERIAL PRIMARY KEY, \
             xid xid8 NOT NULL DEFAULT pg_current_xact_id(), \
             tbl TEXT NOT NULL, op TEXT NOT NULL, new JSONB, old JSONB); \
         CREATE OR REPLACE FUNCTION {schema}.coherent_capture() RETURNS trigger \
         LANGUAGE plpgsql AS $coherent$ \
         DECLARE n jsonb; o jsonb; \
         BEGIN \
           IF TG_OP = 'TRUNCATE' THEN \
             INSERT INTO {schema}.coherent_changes (tbl, op) \
             VALUES (TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, 'truncate'); \
           ELSE \
             IF TG_OP <> 'DELETE' THEN \
               SELECT jsonb_object_agg(key, value) INTO n FROM jsonb_each_text(to_jsonb(NEW)) \
               WHERE key = ANY(TG_ARGV); \
             END IF; \
             IF TG_OP <> 'INSERT' THEN \
               SELECT jsonb_object_agg(key, value) INTO o FROM jsonb_each_text(to_jsonb(OLD)) \
               WHERE key = ANY(TG_ARGV); \
             END IF; \
             IF TG_OP = 'UPDATE' AND n IS NOT DISTINCT FROM o THEN o := NULL; END IF; \
             INSERT INTO {schema}.coherent_changes (tbl, op, new, old) \
             VALUES (TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, lower(TG_OP), n, o); \
           END IF; \
           PERFORM pg_notify({notify}, ''); \
           RETURN NULL; \
         END $coherent$; "
    );
    let mut missing = false;
    for w in &feed.watches.tables {
        let qualified = w.qualified(&feed.schema);
        let (s, n) = qualified.split_once('.').unwrap_or(("public", &qualified));
        let table = format!("{}.{}", ident(s), ident(n));
        let had: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_trigger \
                 WHERE tgrelid = $1::text::regclass AND tgname = 'coherent_capture')",
                &[&table],
            )
            .await
            .map_err(|e| feed_error(format!("the watched table {qualified}: {e}")))?
            .get(0);
        missing |= !had;
        let mut columns: Vec<String> = client
            .query(
                "SELECT a.attname::text FROM pg_index i JOIN pg_attribute a \
                 ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
                 WHERE i.indrelid = $1::text::regclass AND i.indisprimary",
                &[&table],
            )
            .await
            .map_err(feed_error)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        if let Some(extra) = feed.watches.columns(s, n) {
            columns.extend(extra);
        }
        columns.sort();
        columns.dedup();
        let args: Vec<String> = columns.iter().map(|c| literal(c)).collect();
        sql.push_str(&format!(
            "CREATE OR REPLACE TRIGGER coherent_capture AFTER INSERT OR UPDATE OR DELETE \
             ON {table} FOR EACH ROW EXECUTE FUNCTION {schema}.coherent_capture({}); \
             CREATE OR REPLACE TRIGGER coherent_capture_truncate AFTER TRUNCATE \
             ON {table} FOR EACH STATEMENT EXECUTE FUNCTION {schema}.coherent_capture(); ",
            args.join(", ")
        ));
    }
    if missing {
        sql.push_str(&super::postgres::owe_flush_sql(&schema, "'triggers'"));
        sql.push_str("; ");
        feed.counters.slots_created.fetch_add(1, Ordering::Relaxed);
    }
    sql.push_str(&format!(
        "LISTEN {}; COMMIT;",
        ident(&channel(&feed.schema))
    ));
    client
        .batch_execute(&sql)
        .await
        .map_err(|e| feed_error(format!("installing the triggers: {e}")))?;
    Ok(())
}

/// A row of `coherent_changes` as JSON text (`{"id": "7"}`) into a [`Row`].
fn row(json: Option<String>) -> Result<Option<Row>, CommandError> {
    let Some(json) = json else {
        return Ok(None);
    };
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&json).map_err(feed_error)?;
    Ok(Some(Row(map
        .into_iter()
        .map(|(k, v)| {
            let text = match v {
                serde_json::Value::Null => None,
                serde_json::Value::String(s) => Some(s),
                other => Some(other.to_string()),
            };
            (k, text)
        })
        .collect())))
}

/// Reads the change table while this host holds the feed.
pub(super) async fn follow(
    host: &Weak<Inner>,
    feed: &PgFeed,
    client: &tokio_postgres::Client,
    wake: &Notify,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), CommandError> {
    let schema = ident(&feed.schema);
    let read = client
        .prepare(&format!(
            "SELECT c.id, c.tbl, c.op, c.new::text, c.old::text, \
             EXISTS (SELECT 1 FROM {schema}.coherent_operations o WHERE o.xid = c.xid) \
             FROM {schema}.coherent_changes c ORDER BY c.id LIMIT $1"
        ))
        .await
        .map_err(feed_error)?;
    let delete = client
        .prepare(&format!(
            "DELETE FROM {schema}.coherent_changes WHERE id = ANY($1)"
        ))
        .await
        .map_err(feed_error)?;
    let max = i64::try_from(feed.feed.max_messages).unwrap_or(i64::MAX);
    loop {
        if *stop.borrow() {
            return Ok(());
        }
        feed.counters.reads.fetch_add(1, Ordering::Relaxed);
        let rows = client.query(&read, &[&max]).await.map_err(feed_error)?;
        let mut batch = Batch::default();
        let mut ids = Vec::with_capacity(rows.len());
        for r in &rows {
            ids.push(r.get::<_, i64>(0));
            let command: bool = r.get(5);
            if command && feed.feed.skip_commands {
                feed.counters
                    .skipped_commands
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let tbl: String = r.get(1);
            let (schema, table) = tbl.split_once('.').unwrap_or(("public", &tbl));
            let kind = match r.get::<_, &str>(2) {
                "insert" => ChangeKind::Insert,
                "update" => ChangeKind::Update,
                "delete" => ChangeKind::Delete,
                _ => {
                    batch.whole(schema, table);
                    continue;
                }
            };
            batch.row(
                Change {
                    schema: schema.to_owned(),
                    table: table.to_owned(),
                    kind,
                    new: row(r.get(3))?,
                    old: row(r.get(4))?,
                },
                feed.feed.max_rows,
            );
        }
        if batch.len() > 0 {
            let changes = batch.into_changes();
            let (n_rows, n_tables) = (changes.rows.len() as u64, changes.tables.len() as u64);
            if !log(host, changes).await? {
                return Ok(());
            }
            feed.counters.operations.fetch_add(1, Ordering::Relaxed);
            feed.counters.rows.fetch_add(n_rows, Ordering::Relaxed);
            feed.counters.tables.fetch_add(n_tables, Ordering::Relaxed);
        }
        if !ids.is_empty() {
            feed.counters
                .transactions
                .fetch_add(ids.len() as u64, Ordering::Relaxed);
            client.execute(&delete, &[&ids]).await.map_err(feed_error)?;
        }
        if (rows.len() as i64) < max {
            tokio::select! {
                _ = wake.notified() => {}
                _ = tokio::time::sleep(feed.feed.poll) => {}
                _ = stop.changed() => return Ok(()),
            }
        }
    }
}
