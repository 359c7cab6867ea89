//! The parent's side: host processes (spawned, driven, killed), the database of a test,
//! a private NATS server.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use coherent::prelude::*;
use coherent_ops::Database;
use coherent_remote::RemoteClient;
use coherent_rpc::RpcError;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use crate::node::HOST_MODE;
use crate::support::{create_items, database_url, fresh_schema};

/// A client-side compute service: a replica of a host's `Items.value`.
#[derive(Clone, ComputeService)]
pub(crate) struct Mirror {
    pub(crate) handle: ServiceHandle,
    pub(crate) remote: RemoteClient,
}

#[compute_service]
impl Mirror {
    #[compute]
    pub(crate) async fn value(&self, id: i64) -> Result<Result<i64, String>, RpcError> {
        self.remote.replica("Items.value", (id,)).await
    }
}

/// A failure guard for waits that must end: long, never a measurement.
pub(crate) const GUARD: Duration = Duration::from_secs(90);

/// Waits for `f`; fails the test instead of hanging.
pub(crate) async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(GUARD, f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen"))
}

/// Where the hosts of one test keep their data: a fresh PostgreSQL schema or a SQLite file.
pub(crate) enum Store {
    Postgres {
        url: String,
        schema: String,
    },
    Sqlite {
        _dir: tempfile::TempDir,
        path: PathBuf,
    },
}

impl Store {
    /// A fresh schema with 10 items, or `None` (and a line saying the test skipped) when
    /// `DATABASE_URL` is unset.
    pub(crate) async fn postgres(test: &str) -> Option<Store> {
        let url = database_url()?;
        let schema = fresh_schema(test);
        let db = Database::postgres_in_schema(&url, &schema)
            .await
            .unwrap_or_else(|e| panic!("DATABASE_URL is set but PostgreSQL fails: {e}"));
        create_items(&db, 10).await;
        Some(Store::Postgres { url, schema })
    }

    /// A SQLite file (WAL) in a temporary directory, with 10 items.
    pub(crate) async fn sqlite() -> Store {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.db");
        let db = Database::sqlite(&path).unwrap();
        create_items(&db, 10).await;
        Store::Sqlite { _dir: dir, path }
    }

    /// The database, opened in this process too.
    pub(crate) async fn open(&self) -> Database {
        match self {
            Store::Postgres { url, schema } => {
                Database::postgres_in_schema(url, schema).await.unwrap()
            }
            Store::Sqlite { path, .. } => Database::sqlite(path).unwrap(),
        }
    }

    /// A plain connection to the database (PostgreSQL only), for the test's own SQL.
    pub(crate) async fn sql(&self) -> tokio_postgres::Client {
        let Store::Postgres { url, schema } = self else {
            panic!("PostgreSQL only")
        };
        crate::support::connect_in_schema(url, schema).await
    }

    /// Settings for a host over this store.
    pub(crate) fn host(&self) -> HostConfig {
        let mut env = Vec::new();
        match self {
            Store::Postgres { url, schema } => {
                env.push(("CL_URL", url.clone()));
                env.push(("CL_SCHEMA", schema.clone()));
            }
            Store::Sqlite { path, .. } => env.push(("CL_SQLITE", path.display().to_string())),
        }
        HostConfig { env }
    }
}

/// A host process's settings (environment variables read by `node.rs`).
pub(crate) struct HostConfig {
    env: Vec<(&'static str, String)>,
}

impl HostConfig {
    pub(crate) fn notifier(mut self, notifier: &str) -> Self {
        self.env.push(("CL_NOTIFIER", notifier.to_owned()));
        self
    }

    pub(crate) fn poll_ms(mut self, ms: u64) -> Self {
        self.env.push(("CL_POLL_MS", ms.to_string()));
        self
    }

    /// Where it serves RPC (default `127.0.0.1:0`).
    pub(crate) fn bind(mut self, addr: &str) -> Self {
        self.env.push(("CL_BIND", addr.to_owned()));
        self
    }

    /// Runs the change feed (issue 34) on this slot and publication.
    pub(crate) fn feed(mut self, slot: &str) -> Self {
        self.env.push(("CL_FEED", slot.to_owned()));
        self
    }

    pub(crate) fn retention_ms(mut self, ms: u64) -> Self {
        self.env.push(("CL_RETENTION_MS", ms.to_string()));
        self
    }

    pub(crate) fn expiry_ms(mut self, ms: u64) -> Self {
        self.env.push(("CL_EXPIRY_MS", ms.to_string()));
        self
    }

    /// Starts the host process; returns once it serves.
    pub(crate) async fn spawn(&self) -> HostProc {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args(["cluster_host_process", "--exact", "--nocapture"])
            .arg("--test-threads=1")
            .env(HOST_MODE, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        for (k, v) in &self.env {
            command.env(k, v);
        }
        let mut child = command.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut host = HostProc {
            child,
            stdin,
            lines,
            id: String::new(),
            addr: "0.0.0.0:0".parse().unwrap(),
        };
        let ready = within("a host process start", host.answer()).await;
        let mut words = ready.split_whitespace();
        assert_eq!(words.next(), Some("ready"), "{ready}");
        host.id = words.next().unwrap().to_owned();
        host.addr = words.next().unwrap().parse().unwrap();
        host
    }
}

/// A host process, killed (SIGKILL) and reaped when dropped, on panic too.
pub(crate) struct HostProc {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    /// The host's id in the log.
    pub(crate) id: String,
    /// Where it serves RPC.
    pub(crate) addr: SocketAddr,
}

impl HostProc {
    /// The next `@@ ` line.
    async fn answer(&mut self) -> String {
        loop {
            match self.lines.next_line().await.unwrap() {
                // libtest may have written the start of the line ("test ... ").
                Some(line) => {
                    if let Some(at) = line.find("@@ ") {
                        return line[at + 3..].to_owned();
                    }
                }
                None => panic!("host process {} exited", self.id),
            }
        }
    }

    /// Sends one command line; its answer.
    pub(crate) async fn cmd(&mut self, line: &str) -> String {
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        self.stdin.flush().await.unwrap();
        let what = format!("host {}: answer to {line:?}", self.id);
        let answer = within(&what, self.answer()).await;
        assert!(!answer.starts_with("err"), "{what}: {answer}");
        answer
    }

    /// `read id`: the host's `Items.value(id)`.
    pub(crate) async fn read(&mut self, id: i64) -> i64 {
        let a = self.cmd(&format!("read {id}")).await;
        a.strip_prefix("value ").unwrap().parse().unwrap()
    }

    /// `Items.pair(a, b)` on the host.
    pub(crate) async fn pair(&mut self, a: i64, b: i64) -> i64 {
        let a = self.cmd(&format!("pair {a} {b}")).await;
        a.strip_prefix("value ").unwrap().parse().unwrap()
    }

    /// Runs `SetValue` on the host; answers the operation's id.
    pub(crate) async fn set(&mut self, id: i64, value: i64) -> i64 {
        let a = self.cmd(&format!("set {id} {value}")).await;
        let mut w = a.split_whitespace().skip(2);
        w.next().unwrap().parse().unwrap()
    }

    /// Waits until the host has applied `n` operations of other hosts.
    pub(crate) async fn wait_applied(&mut self, n: usize) {
        let a = self.cmd(&format!("wait_applied {n}")).await;
        assert!(a.starts_with("applied_count"), "host {}: {a}", self.id);
    }

    /// The operations of other hosts it applied: (id, via).
    pub(crate) async fn applied(&mut self) -> Vec<(i64, String)> {
        let a = self.cmd("applied").await;
        a.split_whitespace()
            .skip(1)
            .map(|e| {
                let mut p = e.split(':');
                (
                    p.next().unwrap().parse().unwrap(),
                    p.next().unwrap().to_owned(),
                )
            })
            .collect()
    }

    /// Its counters, by name.
    pub(crate) async fn stats(&mut self) -> HashMap<String, u64> {
        let a = self.cmd("stats").await;
        a.split_whitespace()
            .skip(1)
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                (k.to_owned(), v.parse().unwrap())
            })
            .collect()
    }

    /// Waits until `check` holds of its counters.
    pub(crate) async fn wait_stats(
        &mut self,
        what: &str,
        check: impl Fn(&HashMap<String, u64>) -> bool,
    ) -> HashMap<String, u64> {
        let deadline = tokio::time::Instant::now() + GUARD;
        loop {
            let stats = self.stats().await;
            if check(&stats) {
                return stats;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "host {}: {what} did not happen: {stats:?}",
                self.id
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// kill -9, and waits for the process to end.
    /// Stops the process (SIGSTOP) until [`resume`](Self::resume): its connections stay
    /// open, its locks held.
    pub(crate) fn pause(&self) {
        let pid = self.child.id().expect("running") as libc::pid_t;
        // SAFETY: a signal to a child process this guard owns.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    }

    pub(crate) fn resume(&self) {
        let pid = self.child.id().expect("running") as libc::pid_t;
        // SAFETY: as in `pause`.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    }

    pub(crate) async fn kill(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    /// Sends a command and waits for the line `expect`, without the error check.
    pub(crate) async fn cmd_expect(&mut self, line: &str, expect: &str) {
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        self.stdin.flush().await.unwrap();
        let what = format!("host {}: {expect:?} after {line:?}", self.id);
        let answer = within(&what, self.answer()).await;
        assert_eq!(answer, expect, "{what}");
    }
}

impl Drop for HostProc {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        // Reaped here, not left to the runtime: no process outlives its test.
        for _ in 0..500 {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => return,
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }
}

/// A free TCP port on 127.0.0.1 (bound, read, released).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A private `nats-server` on its own port; killed and reaped on drop.
pub(crate) struct Nats {
    pub(crate) port: u16,
    child: Option<std::process::Child>,
}

pub(crate) const NATS_SERVER: &str = "/usr/sbin/nats-server";

impl Nats {
    /// `None` (and a line saying so) when there is no `nats-server` to run.
    pub(crate) fn start() -> Option<Nats> {
        if !std::path::Path::new(NATS_SERVER).exists() {
            eprintln!("skipped: no {NATS_SERVER}");
            return None;
        }
        let mut nats = Nats {
            port: free_port(),
            child: None,
        };
        nats.restart();
        Some(nats)
    }

    pub(crate) fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on its port; returns once it accepts connections.
    pub(crate) fn restart(&mut self) {
        assert!(self.child.is_none());
        let child = std::process::Command::new(NATS_SERVER)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = std::time::Instant::now() + GUARD;
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("nats-server on port {} exited: {status}", self.port);
            }
            assert!(std::time::Instant::now() < deadline, "nats-server start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub(crate) fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.stop();
    }
}
