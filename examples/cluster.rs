//! Two hosts, two processes, one SQLite file: a command run on host A reaches the cache of
//! host B, which runs in a child process (this example started again). No setup:
//!
//! ```sh
//! cargo run -p coherent-examples --example cluster
//! ```
//!
//! On PostgreSQL the same code runs with `Database::postgres(url)` (and `LISTEN`/`NOTIFY`
//! instead of polling); see crates/coherent-ops/README.md. The facade is the only dependency: feature `ops`
//! brings `coherent::ops`, and `coherent::rusqlite` is the rusqlite it links.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command as Process, Stdio};
use std::sync::Arc;
use std::time::Duration;

use coherent::ops::{Command, CommandError, Database, Handler, Host, Tx};
use coherent::prelude::*;
use coherent::rusqlite::{params, Connection};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// The service every host runs: a user's name, cached.
#[derive(Clone, ComputeService)]
struct Names {
    handle: ServiceHandle,
    db: Arc<Mutex<Connection>>,
}

#[compute_service]
impl Names {
    #[compute]
    async fn name(&self, id: i64) -> String {
        let db = self.db.lock();
        db.query_row("SELECT name FROM users WHERE id = ?1", params![id], |r| {
            r.get(0)
        })
        .unwrap_or_else(|e| format!("({e})"))
    }
}

/// The write, as a value: stored in the log, replayed by every host.
#[derive(Serialize, Deserialize)]
struct Rename {
    id: i64,
    name: String,
}

impl Command for Rename {
    const NAME: &'static str = "names.rename";
    type Output = ();
}

impl Handler<Rename> for Names {
    async fn execute(&self, c: &Rename, tx: &mut Tx<'_>) -> Result<(), CommandError> {
        let n = tx.require_sqlite()?.execute(
            "UPDATE users SET name = ?2 WHERE id = ?1",
            params![c.id, c.name],
        )?;
        if n == 0 {
            return Err(CommandError::not_found(format!("user {}", c.id)));
        }
        Ok(())
    }

    /// The one place that says what a rename changes; runs on every host.
    fn invalidate(&self, c: &Rename, _: &()) {
        self.invalidate_name(c.id);
    }
}

async fn start_host(path: &Path) -> anyhow::Result<(Host, Names)> {
    let db = Database::sqlite(path)?;
    let reader = Connection::open(path)?;
    reader.execute_batch("PRAGMA busy_timeout = 5000;")?;
    let names = Names {
        handle: ServiceHandle::new(),
        db: Arc::new(Mutex::new(reader)),
    };
    let host = Host::builder(db)
        .command::<Rename>(names.clone())
        .start()
        .await?;
    Ok((host, names))
}

/// Host B: prints user 1's name whenever it applies an operation, until it is killed.
async fn host_b(path: &Path) -> anyhow::Result<()> {
    let (host, names) = start_host(path).await?;
    let mut applied = host.subscribe();
    println!("B: user 1 is {:?}", names.name(1).await);
    loop {
        let op = applied.recv().await?;
        println!(
            "B: applied operation {} of {} ({:?}, {} µs after its commit); user 1 is now {:?}",
            op.id,
            op.host,
            op.via,
            op.applied_at - op.committed_at,
            names.name(1).await
        );
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("host-b") {
        return host_b(Path::new(&args[2])).await;
    }

    let dir = std::env::temp_dir().join(format!("coherent-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("cluster.db");
    Connection::open(&path)?.execute_batch(
        "PRAGMA journal_mode = WAL;
         CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT NOT NULL);
         INSERT INTO users VALUES (1, 'Ada');",
    )?;

    // Host B: this program again, in a process of its own.
    let mut b = Process::new(std::env::current_exe()?)
        .args(["host-b", &path.display().to_string()])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(b.stdout.take().expect("piped")).lines();
    println!("{}", lines.next().transpose()?.unwrap_or_default());

    let (a, names) = start_host(&path).await?;
    println!("A: user 1 is {:?}", names.name(1).await);
    for name in ["Ada Lovelace", "Countess of Lovelace"] {
        a.run(Rename {
            id: 1,
            name: name.to_owned(),
        })
        .await?;
        // A's own cache was invalidated before `run` returned.
        println!("A: renamed; user 1 is now {:?}", names.name(1).await);
        // B says when it has applied it.
        println!("{}", lines.next().transpose()?.unwrap_or_default());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    b.kill()?;
    b.wait()?;
    a.stop().await;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
