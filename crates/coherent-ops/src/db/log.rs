//! Reading the operation log: where a host's reading stands ([`Cursor`]), and one read of
//! everything it has not read yet, in pages ([`Reading`]).
//!
//! ## The cursor
//!
//! A host has read every operation whose position is below the cursor's `horizon`, and
//! every one below its `next` except the positions `in_flight`. What is left to read is
//! exactly: positions in `in_flight`, and positions at or after `next`.
//!
//! - PostgreSQL: a position is the id of the transaction that wrote the operation. A read
//!   takes the snapshot of its first statement (`xmin:xmax:xip`): every transaction below
//!   `xmax` and not in `xip` had ended when it was taken, so each of its operations is
//!   visible to that snapshot, and was read, or never will exist. The read's new cursor is
//!   that snapshot: `horizon` its `xmin`, `next` its `xmax`, `in_flight` its `xip`. A
//!   transaction that took its id before a read and commits after it is in `xip` (or at or
//!   after `xmax`), however many operations that read returned: it is read next time. (A
//!   cursor that moved to the last row's position after a full page passed over such a
//!   transaction for good; issue 30, hole 1.)
//! - SQLite: one writer at a time holds the database from `BEGIN IMMEDIATE` to `COMMIT`, so
//!   ids are taken in commit order; the position is the id, and the new cursor is one past
//!   the last id read (`in_flight` is always empty).
//!
//! ## Pages
//!
//! A read returns its rows in pages of [`PAGE`] rows, in `(position, id)` order, each page
//! starting after the last row of the one before (so that one transaction of more rows than
//! a page is read through, not read again for ever). Later pages are later statements, with
//! later snapshots: they see every row the first one saw (the log is trimmed only below the
//! horizon of every host, this one's included). They stop at the first page's bound (its
//! snapshot's `xmax`; SQLite: the last id committed when the read began): what commits
//! meanwhile is the next read's, so that a read ends even while the log grows faster than
//! the host applies it (a read that chased the writers never ended: no heartbeat, no
//! `catch_up`). A later page may still return an operation of a transaction that was in
//! flight at the first: it is applied, and remembered by the host until a read passes it.

use rusqlite::params;

use super::{parse_xid, Database, Engine, Logged};
use crate::error::{CommandError, ErrorKind};

/// Rows in one page of a read.
pub(crate) const PAGE: usize = 1_000;

/// Where a host's reading of the log stands (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Cursor {
    /// Every operation before it has been read: what the host's heartbeat says, and what
    /// trimming may delete below.
    pub(crate) horizon: u64,
    /// Every operation at or after it is still to be read.
    pub(crate) next: u64,
    /// Positions between `horizon` and `next` still to be read (transactions that were in
    /// flight at the last read), sorted.
    pub(crate) in_flight: Vec<u64>,
}

impl Cursor {
    /// A cursor that has read everything before `position`.
    pub(crate) fn at(position: u64) -> Self {
        Self {
            horizon: position,
            next: position,
            in_flight: Vec::new(),
        }
    }

    /// Whether an operation at `position` has been read through this cursor.
    pub(crate) fn has_read(&self, position: u64) -> bool {
        position < self.horizon
            || (position < self.next && self.in_flight.binary_search(&position).is_err())
    }

    /// The cursor of a PostgreSQL snapshot as `pg_current_snapshot()::text` writes it:
    /// `xmin:xmax:xip,xip,...`.
    pub(crate) fn from_snapshot(text: &str) -> Result<Self, CommandError> {
        let bad = || CommandError::new(ErrorKind::Database, format!("snapshot {text:?}"));
        let mut parts = text.split(':');
        let (Some(xmin), Some(xmax), Some(xip), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let mut in_flight = xip
            .split(',')
            .filter(|s| !s.is_empty())
            .map(parse_xid)
            .collect::<Result<Vec<u64>, _>>()?;
        in_flight.sort_unstable();
        let cursor = Self {
            horizon: parse_xid(xmin)?,
            next: parse_xid(xmax)?,
            in_flight,
        };
        if cursor.horizon > cursor.next
            || cursor
                .in_flight
                .iter()
                .any(|&p| p < cursor.horizon || p >= cursor.next)
        {
            return Err(bad());
        }
        Ok(cursor)
    }
}

/// One read of the log from a cursor: [`next_page`](Self::next_page) until it answers
/// `None`, then [`finish`](Self::finish) for the new cursor.
pub(crate) struct Reading {
    from: Cursor,
    /// The last row read, `(position, id)`: the next page starts after it.
    after: Option<(u64, i64)>,
    /// The cursor the read moves to once every page is read (PostgreSQL: the first page's
    /// snapshot; SQLite: past the last row).
    to: Option<Cursor>,
    done: bool,
}

impl Reading {
    pub(crate) fn new(from: Cursor) -> Self {
        Self {
            from,
            after: None,
            to: None,
            done: false,
        }
    }

    /// The next page of operations still to be read, or `None` when the read is done.
    pub(crate) async fn next_page(
        &mut self,
        db: &Database,
    ) -> Result<Option<Vec<Logged>>, CommandError> {
        if self.done {
            return Ok(None);
        }
        let (rows, snapshot) = match &*db.inner {
            Engine::Sqlite(s) => {
                let after = self.after.map_or(-1, |(_, id)| id);
                let from = i64::try_from(self.from.next).unwrap_or(i64::MAX);
                let c = s.reader.lock();
                // The read ends at the last id committed when it began (ids are taken in
                // commit order): what commits meanwhile is the next read's, so that a read
                // ends even while the log grows faster than this host applies it.
                let upper = match &self.to {
                    Some(to) => i64::try_from(to.next).unwrap_or(i64::MAX) - 1,
                    None => c
                        .query_row("SELECT max(id) FROM coherent_operations", [], |r| {
                            r.get::<_, Option<i64>>(0)
                        })?
                        .unwrap_or(0)
                        .max(from - 1),
                };
                let mut q = c.prepare_cached(
                    "SELECT id, host, logged_at, kind, command, output FROM coherent_operations \
                     WHERE id >= ?1 AND id > ?2 AND id <= ?3 ORDER BY id LIMIT ?4",
                )?;
                let rows = q
                    .query_map(params![from, after, upper, PAGE as i64], |r| {
                        let id: i64 = r.get(0)?;
                        Ok(Logged {
                            id,
                            position: u64::try_from(id).unwrap_or(0),
                            host: r.get(1)?,
                            logged_at: r.get(2)?,
                            kind: r.get(3)?,
                            command: r.get(4)?,
                            output: r.get(5)?,
                        })
                    })?
                    .collect::<Result<Vec<_>, _>>()?;
                (
                    rows,
                    Some(Cursor::at(u64::try_from(upper + 1).unwrap_or(0))),
                )
            }
            Engine::Postgres(pg) => {
                let client = pg.pool.get().await?;
                // One statement, one snapshot: the rows and the snapshot agree. The outer
                // join answers the snapshot even when there is no row.
                let q = client
                    .prepare_cached(
                        "SELECT pg_current_snapshot()::text, o.id, o.xid::text, \
                                o.host, o.logged_at, o.kind, o.command, o.output \
                         FROM (SELECT 1) AS one LEFT JOIN (SELECT * FROM ( \
                              (SELECT * FROM coherent_operations \
                               WHERE (xid, id) > ($1::text::xid8, $2) AND xid < $3::text::xid8 \
                               ORDER BY xid, id LIMIT $4) \
                              UNION ALL \
                              (SELECT * FROM coherent_operations \
                               WHERE xid = ANY($5::text[]::xid8[]) \
                                 AND (xid, id) > ($6::text::xid8, $7) \
                               ORDER BY xid, id LIMIT $4)) AS u \
                              ORDER BY xid, id LIMIT $4) AS o ON true ORDER BY o.xid, o.id",
                    )
                    .await?;
                // Two index ranges, merged: the positions at or after the cursor's `next`
                // (from after the last row read), and those in flight at the last read.
                // The first bounds its start by itself, so that a caught-up host's read
                // touches a few index pages however long the log is. From the second page
                // on, the range stops at the first page's `xmax`: what is past it is the
                // next read's (the new cursor is the first page's snapshot), so that a
                // read ends even while the log grows faster than this host applies it.
                let in_flight: Vec<String> =
                    self.from.in_flight.iter().map(u64::to_string).collect();
                let after = self.after.unwrap_or((0, i64::MIN));
                let range = after.max((self.from.next.saturating_sub(1), i64::MAX));
                let upper = self.to.as_ref().map_or(i64::MAX as u64, |t| t.next);
                let rows = client
                    .query(
                        &q,
                        &[
                            &range.0.to_string(),
                            &range.1,
                            &upper.to_string(),
                            &(PAGE as i64),
                            &in_flight,
                            &after.0.to_string(),
                            &after.1,
                        ],
                    )
                    .await?;
                let snapshot = match rows.first() {
                    Some(r) => Some(Cursor::from_snapshot(r.get(0))?),
                    None => None,
                };
                let mut out = Vec::with_capacity(rows.len());
                for r in &rows {
                    let Some(id) = r.get::<_, Option<i64>>(1) else {
                        continue;
                    };
                    out.push(Logged {
                        id,
                        position: parse_xid(r.get(2))?,
                        host: r.get(3),
                        logged_at: r.get(4),
                        kind: r.get(5),
                        command: r.get(6),
                        output: r.get(7),
                    });
                }
                (out, snapshot)
            }
        };
        // PostgreSQL: the first page's snapshot; SQLite: the bound of the first page.
        if self.to.is_none() {
            self.to = snapshot;
        }
        if rows.len() < PAGE {
            self.done = true;
        }
        if let Some(last) = rows.last() {
            self.after = Some((last.position, last.id));
        }
        Ok(Some(rows))
    }

    /// The cursor after the read: never behind the one it started from.
    pub(crate) fn finish(self) -> Cursor {
        match self.to {
            Some(to) if to.horizon >= self.from.horizon && to.next >= self.from.next => to,
            _ => self.from,
        }
    }
}

impl Database {
    /// Where a host that starts now (its cache empty) begins to read: nothing that ended
    /// before concerns it.
    pub(crate) async fn start_cursor(&self) -> Result<Cursor, CommandError> {
        match &*self.inner {
            Engine::Sqlite(s) => {
                let c = s.reader.lock();
                let max: Option<i64> =
                    c.query_row("SELECT max(id) FROM coherent_operations", [], |r| r.get(0))?;
                Ok(Cursor::at(u64::try_from(max.unwrap_or(0)).unwrap_or(0) + 1))
            }
            Engine::Postgres(pg) => {
                let client = pg.pool.get().await?;
                let row = client
                    .query_one("SELECT pg_current_snapshot()::text", &[])
                    .await?;
                Cursor::from_snapshot(row.get(0))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Cursor;

    #[test]
    fn a_snapshot_is_a_cursor() {
        let c = Cursor::from_snapshot("10:20:12,15").unwrap();
        assert_eq!(
            c,
            Cursor {
                horizon: 10,
                next: 20,
                in_flight: vec![12, 15]
            }
        );
        assert!(c.has_read(9));
        assert!(c.has_read(10));
        assert!(!c.has_read(12));
        assert!(c.has_read(13));
        assert!(!c.has_read(15));
        assert!(!c.has_read(20));
        assert!(!c.has_read(21));
        assert_eq!(Cursor::from_snapshot("7:7:").unwrap(), Cursor::at(7));
        for bad in ["", "1:2", "3:2:", "1:5:7", "1:5:0", "a:b:", "1:2:3:4"] {
            assert!(Cursor::from_snapshot(bad).is_err(), "{bad:?}");
        }
    }
}
