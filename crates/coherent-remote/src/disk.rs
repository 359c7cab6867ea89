//! The persistent client cache (feature `persistent`): the last value of every replica in a
//! SQLite file, so that a restarted client answers from disk at once and revalidates
//! behind the answer. Writes go to one thread of their own, never to the caller's task.

use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;

use coherent_rpc::{Blob, Format, RpcError};
use parking_lot::Mutex;
use rusqlite::{params, Connection, OptionalExtension};

/// A stored value: the bytes in `format`, and their hash.
pub(crate) struct Stored {
    pub(crate) value: Blob,
    pub(crate) hash: u64,
    pub(crate) format: u8,
}

enum Write {
    Put {
        method: u32,
        args: Blob,
        stored: Stored,
    },
    Remove {
        method: u32,
        args: Blob,
    },
    Flush(mpsc::Sender<()>),
}

/// A handle to the file; clones share it.
#[derive(Clone)]
pub(crate) struct Disk {
    reads: Arc<Mutex<Connection>>,
    writes: mpsc::Sender<Write>,
}

fn sqlite_error(e: rusqlite::Error) -> RpcError {
    RpcError::new(
        coherent_rpc::ErrorCode::Internal,
        format!("persistent cache: {e}"),
    )
}

impl Disk {
    /// Opens (or creates) the cache file at `path`.
    pub(crate) fn open(path: &Path) -> Result<Self, RpcError> {
        let setup = |c: &Connection| -> rusqlite::Result<()> {
            c.pragma_update(None, "journal_mode", "WAL")?;
            c.pragma_update(None, "synchronous", "NORMAL")?;
            c.execute_batch(
                "CREATE TABLE IF NOT EXISTS replicas (
                     method INTEGER NOT NULL,
                     args BLOB NOT NULL,
                     format INTEGER NOT NULL,
                     value BLOB NOT NULL,
                     hash INTEGER NOT NULL,
                     PRIMARY KEY (method, args))",
            )
        };
        let reads = Connection::open(path).map_err(sqlite_error)?;
        setup(&reads).map_err(sqlite_error)?;
        let writer = Connection::open(path).map_err(sqlite_error)?;
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("coherent-remote-disk".to_owned())
            .spawn(move || write_loop(&writer, &rx))
            .map_err(|e| RpcError::new(coherent_rpc::ErrorCode::Internal, e.to_string()))?;
        Ok(Self {
            reads: Arc::new(Mutex::new(reads)),
            writes: tx,
        })
    }

    /// Every key the file holds now.
    pub(crate) fn keys(&self) -> std::collections::HashSet<(u32, Blob)> {
        let db = self.reads.lock();
        let keys = db
            .prepare("SELECT method, args FROM replicas")
            .and_then(|mut q| {
                q.query_map([], |row| {
                    Ok((row.get::<_, u32>(0)?, Blob::from(row.get::<_, Vec<u8>>(1)?)))
                })?
                .collect::<rusqlite::Result<_>>()
            });
        keys.unwrap_or_else(|e| {
            tracing::warn!(%e, "persistent cache keys could not be read");
            Default::default()
        })
    }

    /// The stored value of `method(args)` in `format`, if any.
    pub(crate) fn get(&self, method: u32, args: &[u8], format: Format) -> Option<Stored> {
        let db = self.reads.lock();
        let row = db
            .prepare_cached(
                "SELECT format, value, hash FROM replicas WHERE method = ?1 AND args = ?2",
            )
            .and_then(|mut q| {
                q.query_row(params![method, args], |row| {
                    Ok(Stored {
                        format: row.get(0)?,
                        value: Blob::from(row.get::<_, Vec<u8>>(1)?),
                        hash: row.get::<_, i64>(2)? as u64,
                    })
                })
                .optional()
            });
        match row {
            Ok(Some(s)) if s.format == format_code(format) => Some(s),
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(%e, "persistent cache read failed");
                None
            }
        }
    }

    pub(crate) fn put(&self, method: u32, args: Blob, value: Blob, hash: u64, format: Format) {
        let stored = Stored {
            value,
            hash,
            format: format_code(format),
        };
        let _ = self.writes.send(Write::Put {
            method,
            args,
            stored,
        });
    }

    pub(crate) fn remove(&self, method: u32, args: Blob) {
        let _ = self.writes.send(Write::Remove { method, args });
    }

    /// Waits until every write queued so far is in the file.
    pub(crate) async fn flush(&self) {
        let (tx, rx) = mpsc::channel();
        if self.writes.send(Write::Flush(tx)).is_ok() {
            let _ = tokio::task::spawn_blocking(move || rx.recv()).await;
        }
    }
}

fn format_code(format: Format) -> u8 {
    match format {
        Format::MessagePack => 1,
        _ => 0,
    }
}

fn write_loop(db: &Connection, rx: &mpsc::Receiver<Write>) {
    while let Ok(first) = rx.recv() {
        // Everything queued meanwhile goes in one transaction.
        let mut batch = vec![first];
        batch.extend(rx.try_iter());
        let mut flushed = Vec::new();
        let result = (|| -> rusqlite::Result<()> {
            let tx = db.unchecked_transaction()?;
            for w in batch {
                match w {
                    Write::Put {
                        method,
                        args,
                        stored,
                    } => {
                        tx.prepare_cached(
                            "INSERT OR REPLACE INTO replicas (method, args, format, value, hash)
                             VALUES (?1, ?2, ?3, ?4, ?5)",
                        )?
                        .execute(params![
                            method,
                            &args[..],
                            stored.format,
                            &stored.value[..],
                            stored.hash as i64
                        ])?;
                    }
                    Write::Remove { method, args } => {
                        tx.prepare_cached("DELETE FROM replicas WHERE method = ?1 AND args = ?2")?
                            .execute(params![method, &args[..]])?;
                    }
                    Write::Flush(done) => flushed.push(done),
                }
            }
            tx.commit()
        })();
        if let Err(e) = result {
            tracing::warn!(%e, "persistent cache write failed");
        }
        for done in flushed {
            let _ = done.send(());
        }
    }
}
