//! A checked run: host processes over one PostgreSQL schema, their workload, faults on a
//! schedule, then the final reads, and the check of every history.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context as _};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::check::{check, Checked, Explained, Violation};
use crate::history::decode;
use crate::node::{create_registers, tier_history, Node};

/// A fault the run injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    /// A host runs 1,500 increments at once (64 in flight), beside its workload: more than a
    /// page of the log between two reads of every other host.
    Burst,
    /// A command's transaction takes its id, stays open 3 s (pinning every snapshot's
    /// `xmin`) while another host bursts, then writes and commits.
    LongTransaction,
    /// Every database connection of every host is terminated (`pg_terminate_backend`):
    /// listeners, pools, transactions in flight (a failover, a restarted pooler).
    Terminate,
    /// A host is stopped (SIGSTOP) past the acknowledgement deadline, then resumed.
    Pause,
    /// A host is killed (SIGKILL) and another started in its place.
    Kill,
    /// A host is stopped and replaced by one of the other release (a rolling deploy: the
    /// next release writes a command kind the old one does not know).
    Deploy,
    /// The NATS server is killed and started again (NATS runs only).
    NatsRestart,
    /// The link between the hosts and the NATS server (a network namespace of the run's,
    /// [`crate::netns`]) loses 15% of its packets each way and slows down for 3 s (NATS
    /// runs with [`Config::with_lossy_nats`]).
    NatsLossy,
    /// A host is replaced by one whose wall clock is an hour ahead or behind (in turn):
    /// its liveness, its heartbeats and the log's trimming must not depend on it.
    Skew,
    /// A host's tier loses its connection to the host at once (both ends closed): it
    /// reconnects and revalidates its replicas.
    TierCut,
    /// A host's tier is frozen for 800 ms (its thread sleeps: no task of it runs, no timer
    /// fires), past its host's acknowledgement deadline, as a paused tier process would be;
    /// its host runs on, and its host's peers stop waiting for it.
    TierPause,
    /// A host's tier's connection goes half-open: nothing passes either way and neither
    /// end is told (a NAT that forgot it). The host stops waiting for the tier after its
    /// delivery timeout; the tier must stop answering from its replicas before then.
    TierHalfOpen,
    /// A host's tier loses its connection and is frozen for 800 ms as soon as it has
    /// connected again (its replicas revalidated, its first renewal on the new
    /// connection just made).
    TierReconnectPause,
    /// The database goes away for 2 s: every connection of every host (pools, listeners,
    /// transactions in flight) is closed, and new ones are refused until it is back:
    /// what clients see of a restart or a failover (the hosts reach PostgreSQL through a
    /// proxy of the run's; the server itself keeps running, so its recovery is not
    /// what this tests).
    DbOutage,
    /// A host's TypeScript reader loses its WebSocket at once (both ends closed): it
    /// reconnects and revalidates its replicas.
    TsCut,
    /// A host's TypeScript reader's WebSocket goes half-open: nothing passes either way
    /// and neither end is told. The host stops waiting for it after its delivery timeout
    /// (5 s); the reader must stop answering from its replicas before then.
    TsHalfOpen,
    /// A host's TypeScript reader process is stopped (SIGSTOP) for 6 s, past its host's
    /// delivery timeout (the host disconnects it and its writes go on), then resumed: it
    /// must answer nothing from its replicas before it heard of what it missed.
    TsPause,
}

impl Fault {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Fault::Burst => "burst",
            Fault::LongTransaction => "long_transaction",
            Fault::Terminate => "terminate_connections",
            Fault::Pause => "pause",
            Fault::Kill => "kill",
            Fault::Deploy => "deploy",
            Fault::NatsRestart => "nats_restart",
            Fault::NatsLossy => "nats_lossy_link",
            Fault::Skew => "clock_skew",
            Fault::TierCut => "tier_cut",
            Fault::TierPause => "tier_pause",
            Fault::TierHalfOpen => "tier_half_open",
            Fault::TierReconnectPause => "tier_reconnect_pause",
            Fault::DbOutage => "db_outage",
            Fault::TsCut => "ts_cut",
            Fault::TsHalfOpen => "ts_half_open",
            Fault::TsPause => "ts_pause",
        }
    }
}

/// How a run goes.
#[derive(Debug, Clone)]
pub struct Config {
    /// PostgreSQL (e.g. `postgres://postgres@127.0.0.1:5432/test`).
    pub url: String,
    /// Use a private NATS server as the notifier (else PostgreSQL's LISTEN/NOTIFY).
    pub nats: bool,
    /// Host processes at a time.
    pub hosts: usize,
    /// How long the workload runs, faults included.
    pub duration: Duration,
    /// The faults, each injected in turn.
    pub faults: Vec<Fault>,
    /// Registers.
    pub keys: u32,
    /// Reader and writer tasks per host.
    pub readers: u32,
    /// Writer tasks per host.
    pub writers: u32,
    /// Reader tasks of each host's tier (replicas of the host's registers).
    pub tier_readers: u32,
    /// Reads between two 1 ms pauses of a reader.
    pub read_batch: u32,
    /// TypeScript readers beside each host (`None`: none).
    pub ts: Option<TsReaders>,
    /// The NATS server listens in a network namespace of the run's, behind a link the
    /// `NatsLossy` fault degrades (needs root: [`crate::netns`]).
    pub lossy_nats: bool,
}

/// TypeScript readers: a Node.js process beside each host, holding replicas of the host's
/// registers through `@coherent/client` over the host's WebSocket endpoint
/// (`crates/coherent-checker/ts/reader.mjs`), checked as a host of its own (`<id>/ts`).
#[derive(Debug, Clone)]
pub struct TsReaders {
    /// The repository: its `clients/typescript/dist` (built) and `node_modules` (`ws`).
    pub root: PathBuf,
    /// The `node` to run.
    pub node: PathBuf,
    /// Reader tasks in each process.
    pub readers: u32,
}

impl TsReaders {
    /// Readers from the repository this crate was built in (see [`at`](Self::at)).
    pub fn of_this_repository() -> anyhow::Result<TsReaders> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        Self::at(root.canonicalize().context("the repository's root")?)
    }

    /// Readers from the repository at `root` (where `npm ci` ran and the client was built:
    /// `npm run build -w clients/typescript`), or why they cannot run.
    pub fn at(root: impl Into<PathBuf>) -> anyhow::Result<TsReaders> {
        let root = root.into();
        let built = root.join("clients/typescript/dist/index.js");
        if !built.exists() {
            bail!(
                "{} is missing: build the TypeScript client (npm ci && npm run build -w \
                 clients/typescript)",
                built.display()
            );
        }
        if !root.join("node_modules/ws").exists() {
            bail!("no node_modules/ws under {}: run npm ci", root.display());
        }
        let node = std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .map(|d| d.join("node"))
            .find(|p| p.is_file())
            .context("no node on PATH")?;
        Ok(TsReaders {
            root,
            node,
            readers: 2,
        })
    }
}

impl Config {
    /// Every fault of the notifier, three hosts, the given duration.
    pub fn new(url: impl Into<String>, nats: bool, duration: Duration) -> Self {
        let mut faults = vec![
            Fault::Burst,
            Fault::LongTransaction,
            Fault::Terminate,
            Fault::DbOutage,
            Fault::Pause,
            Fault::Kill,
            Fault::Deploy,
            Fault::Skew,
            Fault::TierCut,
            Fault::TierPause,
            Fault::TierHalfOpen,
            Fault::TierReconnectPause,
        ];
        if nats {
            faults.push(Fault::NatsRestart);
        }
        Self {
            ts: None,
            lossy_nats: false,
            url: url.into(),
            nats,
            hosts: 3,
            duration,
            faults,
            keys: 32,
            readers: 2,
            writers: 2,
            tier_readers: 2,
            read_batch: 8,
        }
    }
}

impl Config {
    /// With the NATS server behind a link of a network namespace, and the fault that
    /// degrades it (NATS runs only).
    pub fn with_lossy_nats(mut self) -> Self {
        if self.nats {
            self.lossy_nats = true;
            self.faults.push(Fault::NatsLossy);
        }
        self
    }

    /// With TypeScript readers beside each host, and their faults.
    pub fn with_ts(mut self, ts: TsReaders) -> Self {
        self.ts = Some(ts);
        self.faults
            .extend([Fault::TsCut, Fault::TsHalfOpen, Fault::TsPause]);
        self
    }
}

/// What a run found.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The check of every history.
    pub checked: Checked,
    /// Faults injected, by kind.
    pub faults: BTreeMap<&'static str, u32>,
    /// Host processes started in all.
    pub hosts_started: u32,
    /// Reads that answered an error (a terminated connection, say): not checked.
    pub read_errors: u64,
    /// Commands that failed: not in the history.
    pub write_errors: u64,
    /// Operations hosts could not replay (another release's), summed over the hosts
    /// still up at the end.
    pub unknown: u64,
    /// Acknowledgement waits that ran out, summed likewise.
    pub ack_timeouts: u64,
    /// Tier reads answered from the tier's cache (replicas), and those that fetched from
    /// the host, summed over the hosts up at the end.
    pub tier_hits: u64,
    /// See `tier_hits`.
    pub tier_misses: u64,
    /// Reads of the TypeScript readers answered at once from a current replica, and
    /// those that waited for a fetch (or a lease), summed over the readers up at the end.
    pub ts_hits: u64,
    /// See `ts_hits`.
    pub ts_misses: u64,
    /// Reads of the core-level pairs (`node::Pairs`), summed over the hosts up at the end.
    pub core_reads: u64,
}

impl Outcome {
    /// The violations as timelines, at most `n` of them.
    pub fn explain(&self, n: usize) -> String {
        let mut out = String::new();
        for v in self.checked.violations.iter().take(n) {
            out.push_str(
                &Explained {
                    violation: v,
                    origin: self.checked.origin,
                }
                .to_string(),
            );
            out.push('\n');
        }
        if self.checked.violations.len() > n {
            out.push_str(&format!(
                "... and {} more\n",
                self.checked.violations.len() - n
            ));
        }
        out
    }
}

/// Starts a host process: the caller's command (its binary, in the mode that runs
/// [`crate::node::main`]), with the node's environment added.
pub type Spawn = dyn Fn() -> tokio::process::Command + Send + Sync;

/// A host process, killed when dropped.
struct Proc {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    id: String,
    history: PathBuf,
    /// The host's WebSocket endpoint for TypeScript readers.
    ws: String,
    /// Its TypeScript reader, if the run has them.
    ts: Option<Box<Proc>>,
}

impl Proc {
    async fn spawn(spawn: &Spawn, node: &Node) -> anyhow::Result<Proc> {
        let mut command = spawn();
        command
            .envs(node.env())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = command.spawn().context("starting a host process")?;
        let mut proc = Proc {
            stdin: child.stdin.take().expect("piped"),
            lines: BufReader::new(child.stdout.take().expect("piped")).lines(),
            child,
            id: String::new(),
            history: node.history.clone(),
            ws: String::new(),
            ts: None,
        };
        proc.ready().await?;
        Ok(proc)
    }

    /// Waits for `ready <id> [<ws url>]`.
    async fn ready(&mut self) -> anyhow::Result<()> {
        let ready = self.answer().await?;
        let mut words = ready.split_whitespace();
        match (words.next(), words.next()) {
            (Some("ready"), Some(id)) => self.id = id.to_owned(),
            _ => bail!("a process said {ready:?}"),
        }
        self.ws = words.next().unwrap_or_default().to_owned();
        Ok(())
    }

    /// Starts the TypeScript reader of host `host` (whose history goes beside the host's).
    async fn spawn_ts(ts: &TsReaders, host: &Proc, node: &Node) -> anyhow::Result<Proc> {
        let mut command = tokio::process::Command::new(&ts.node);
        command
            .arg(ts.root.join("crates/coherent-checker/ts/reader.mjs"))
            .env("CHK_TS_ROOT", &ts.root)
            .env("CHK_TS_URL", &host.ws)
            .env("CHK_KEYS", node.keys.to_string())
            .env("CHK_TS_READERS", ts.readers.to_string())
            .env("CHK_READ_BATCH", node.read_batch.to_string())
            .env("CHK_HISTORY", ts_history(&host.history))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = command
            .spawn()
            .context("starting a TypeScript reader (node)")?;
        let mut proc = Proc {
            stdin: child.stdin.take().expect("piped"),
            lines: BufReader::new(child.stdout.take().expect("piped")).lines(),
            child,
            id: ts_name(&host.id),
            history: ts_history(&host.history),
            ws: String::new(),
            ts: None,
        };
        proc.ready().await?;
        proc.id = ts_name(&host.id);
        Ok(proc)
    }

    async fn answer(&mut self) -> anyhow::Result<String> {
        let next = async {
            loop {
                match self.lines.next_line().await? {
                    Some(line) => {
                        if let Some(at) = line.find("@@ ") {
                            return Ok::<_, anyhow::Error>(line[at + 3..].to_owned());
                        }
                    }
                    None => bail!("host process {} exited", self.id),
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(120), next)
            .await
            .with_context(|| format!("host {} did not answer in 2 minutes", self.id))?
    }

    async fn cmd(&mut self, line: &str) -> anyhow::Result<String> {
        self.stdin.write_all(format!("{line}\n").as_bytes()).await?;
        self.stdin.flush().await?;
        let answer = self.answer().await?;
        if answer.starts_with("err") {
            bail!("host {}: {line:?}: {answer}", self.id);
        }
        Ok(answer)
    }

    fn signal(&self, signal: i32) {
        if let Some(pid) = self.child.id() {
            // SAFETY: a plain kill(2) of our own child's pid.
            unsafe { libc::kill(pid as i32, signal) };
        }
    }

    async fn kill(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }
}

/// Starts `new`'s workload, then stops the host it replaces (a rolling deploy: the new one
/// serves before the old one leaves); answers the old one's id and history.
async fn replace(
    slot: &mut Proc,
    mut new: Proc,
    ts_done: &mut Vec<(String, PathBuf)>,
) -> anyhow::Result<(String, PathBuf)> {
    start_workload(&mut new).await?;
    let mut old = std::mem::replace(slot, new);
    old.cmd("stop").await?;
    end_ts(&mut old, ts_done).await?;
    old.cmd("quit").await?;
    let _ = old.child.wait().await;
    Ok((old.id.clone(), old.history.clone()))
}

/// Starts a host process, and its TypeScript reader when the run has them. A host that
/// fails to start (the database away: `db_outage`) is started again, as a supervisor
/// would, for up to 30 s.
async fn launch(spawn: &Spawn, node: &Node, ts: Option<&TsReaders>) -> anyhow::Result<Proc> {
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut proc = loop {
        match Proc::spawn(spawn, node).await {
            Ok(proc) => break proc,
            Err(e) if tokio::time::Instant::now() < give_up => {
                eprintln!("a host process did not start ({e:#}): starting it again");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e),
        }
    };
    if let Some(ts) = ts {
        let reader = Proc::spawn_ts(ts, &proc, node).await?;
        proc.ts = Some(Box::new(reader));
    }
    Ok(proc)
}

/// Starts the workload of a host and of its TypeScript reader.
async fn start_workload(proc: &mut Proc) -> anyhow::Result<()> {
    proc.cmd("start").await?;
    if let Some(ts) = proc.ts.as_mut() {
        ts.cmd("start").await?;
    }
    Ok(())
}

/// Stops the TypeScript reader of a host leaving the run; notes its history in `done`.
async fn end_ts(proc: &mut Proc, done: &mut Vec<(String, PathBuf)>) -> anyhow::Result<()> {
    if let Some(mut ts) = proc.ts.take() {
        ts.cmd("stop").await?;
        ts.cmd("quit").await?;
        let _ = ts.child.wait().await;
        done.push((ts.id.clone(), ts.history.clone()));
    }
    Ok(())
}

/// A private `nats-server` on a port of its own, on loopback or inside a network
/// namespace of the run's.
struct Nats {
    ip: std::net::Ipv4Addr,
    port: u16,
    child: Option<std::process::Child>,
    netns: Option<crate::netns::Netns>,
}

impl Nats {
    fn start(netns: Option<crate::netns::Netns>) -> anyhow::Result<Nats> {
        let (ip, port) = match &netns {
            // A namespace of its own: nothing else listens there.
            Some(ns) => (ns.inner_ip, 4222),
            None => (
                std::net::Ipv4Addr::LOCALHOST,
                std::net::TcpListener::bind("127.0.0.1:0")?
                    .local_addr()?
                    .port(),
            ),
        };
        let mut nats = Nats {
            ip,
            port,
            child: None,
            netns,
        };
        nats.restart()?;
        Ok(nats)
    }

    fn url(&self) -> String {
        format!("nats://{}:{}", self.ip, self.port)
    }

    fn restart(&mut self) -> anyhow::Result<()> {
        let server = ["/usr/sbin/nats-server", "/usr/local/bin/nats-server"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .unwrap_or("nats-server");
        let mut command = match &self.netns {
            Some(ns) => ns.command(server),
            None => std::process::Command::new(server),
        };
        self.child = Some(
            command
                .args(["-a", &self.ip.to_string(), "-p", &self.port.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("starting nats-server")?,
        );
        for _ in 0..500 {
            if std::net::TcpStream::connect((self.ip, self.port)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        bail!("nats-server did not listen on {}:{}", self.ip, self.port)
    }

    fn stop(&mut self) {
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

/// Runs the workload on `config.hosts` host processes under the faults, then checks
/// every history. `spawn` makes the command that starts one host process.
pub async fn run(config: &Config, spawn: &Spawn) -> anyhow::Result<Outcome> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .subsec_nanos();
    let schema = format!("chk_{}_{nanos}", std::process::id());
    let dir = tempfile_dir(&schema)?;
    let app = schema.clone();
    // The hosts reach the database through a proxy of the run's (`DbOutage`).
    let (proxied, db_proxy) = match through_proxy(&config.url).await? {
        Some((url, proxy)) => (url, Some(proxy)),
        None => (config.url.clone(), None),
    };
    let url = with_application_name(&proxied, &app);
    let (admin, connection) = tokio_postgres::connect(&config.url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA {schema}; SET search_path TO {schema}"
        ))
        .await?;
    create_registers(&admin, config.keys).await?;
    let result = run_in(
        config,
        spawn,
        &schema,
        &url,
        &app,
        &dir,
        &admin,
        db_proxy.as_ref(),
    )
    .await;
    let _ = admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// How the tier of host `id` is named in the histories.
fn tier_name(id: &str) -> String {
    format!("{id}/tier")
}

/// How the TypeScript reader of host `id` is named in the histories.
fn ts_name(id: &str) -> String {
    format!("{id}/ts")
}

/// The history of the TypeScript reader of the host whose history is `host`.
fn ts_history(host: &std::path::Path) -> PathBuf {
    host.with_extension("ts.bin")
}

fn tempfile_dir(name: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("coherent-checker-{name}"));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// `url` with its host and port replaced by a proxy's to them, and the proxy; `None` for a
/// URL that names no single TCP host (a Unix socket, several hosts).
async fn through_proxy(url: &str) -> anyhow::Result<Option<(String, crate::tier::Proxy)>> {
    let Some(start) = url.find("://").map(|i| i + 3) else {
        return Ok(None);
    };
    let rest = &url[start..];
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let authority = &rest[..end];
    let (user, hostport) = match authority.rsplit_once('@') {
        Some((user, hostport)) => (&authority[..user.len() + 1], hostport),
        None => ("", authority),
    };
    // A host named in the query string (`?host=/run/postgresql`) wins over the authority.
    let query = &rest[end..];
    if hostport.is_empty()
        || hostport.contains(',')
        || hostport.starts_with('%')
        || query.contains("host=")
        || query.contains("hostaddr=")
    {
        return Ok(None);
    }
    let target = if hostport.contains(':') {
        hostport.to_owned()
    } else {
        format!("{hostport}:5432")
    };
    let Some(target) = tokio::net::lookup_host(&target).await?.next() else {
        return Ok(None);
    };
    let proxy = crate::tier::Proxy::start(target).await?;
    let url = format!("{}{user}{}{}", &url[..start], proxy.addr(), &rest[end..]);
    Ok(Some((url, proxy)))
}

fn with_application_name(url: &str, app: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={app}")
}

#[allow(clippy::too_many_arguments)]
async fn run_in(
    config: &Config,
    spawn: &Spawn,
    schema: &str,
    url: &str,
    app: &str,
    dir: &std::path::Path,
    admin: &tokio_postgres::Client,
    db_proxy: Option<&crate::tier::Proxy>,
) -> anyhow::Result<Outcome> {
    let mut nats = if config.nats {
        let netns = if config.lossy_nats {
            Some(crate::netns::Netns::create().context("the lossy link to NATS")?)
        } else {
            None
        };
        Some(Nats::start(netns)?)
    } else {
        None
    };
    let mut started = 0u32;
    let node_for = |n: u32, next_release: bool, nats: &Option<Nats>, clock_skew_ms: i64| Node {
        url: url.to_owned(),
        schema: schema.to_owned(),
        nats: nats.as_ref().map(Nats::url),
        history: dir.join(format!("host-{n}.bin")),
        keys: config.keys,
        readers: config.readers,
        writers: config.writers,
        tier_readers: config.tier_readers,
        read_batch: config.read_batch,
        next_release,
        clock_skew_ms,
        // Each process's pairs are its own: keys of their own, past the registers'.
        core_base: 1_000_000 + n * 1_000,
    };
    let ts = config.ts.as_ref();
    let mut hosts = Vec::new();
    for _ in 0..config.hosts {
        let proc = launch(spawn, &node_for(started, false, &nats, 0), ts).await?;
        started += 1;
        hosts.push(proc);
    }
    let mut finished: Vec<(String, PathBuf)> = Vec::new();
    // The TypeScript readers' histories.
    let mut ts_finished: Vec<(String, PathBuf)> = Vec::new();
    for h in &mut hosts {
        start_workload(h).await?;
    }
    let mut faults: BTreeMap<&'static str, u32> = BTreeMap::new();
    let begin = tokio::time::Instant::now();
    let slots = (config.faults.len() as u32 * 3 + 1).max(2);
    let every = config.duration / slots;
    let mut turn = 0usize;
    let mut next_release = false;
    let mut skew = 0i64;
    // Every fault in turn, each at least three times (the run goes on past its duration
    // if the faults take longer), then more while the duration lasts; a random pause
    // before each.
    let kinds = config.faults.len().max(1);
    while !config.faults.is_empty()
        && (turn < 3 * kinds || begin.elapsed() + every < config.duration)
    {
        tokio::time::sleep(every.mul_f64(rand::random_range(0.5..1.0))).await;
        let fault = config.faults[turn % kinds];
        turn += 1;
        let i = rand::random_range(0..hosts.len());
        match fault {
            Fault::Burst => {
                hosts[i].cmd("burst 1500").await?;
            }
            Fault::LongTransaction => {
                let key = rand::random_range(1..=config.keys);
                hosts[i].cmd(&format!("slow {key} 3000")).await?;
                tokio::time::sleep(Duration::from_millis(300)).await;
                let j = (i + 1) % hosts.len();
                hosts[j].cmd("burst 1500").await?;
            }
            Fault::Terminate => {
                // The pools' connections carry the run's application name, the listeners
                // their host's (`coherent-listener:<id>`).
                let listeners: Vec<String> = hosts
                    .iter()
                    .map(|h| format!("coherent-listener:{}", h.id))
                    .collect();
                admin
                    .execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                         WHERE (application_name = $1 OR application_name = ANY($2)) \
                           AND pid <> pg_backend_pid()",
                        &[&app, &listeners],
                    )
                    .await?;
            }
            Fault::Pause => {
                hosts[i].signal(libc::SIGSTOP);
                tokio::time::sleep(Duration::from_millis(800)).await;
                hosts[i].signal(libc::SIGCONT);
            }
            Fault::Kill => {
                hosts[i].kill().await;
                end_ts(&mut hosts[i], &mut ts_finished).await?;
                finished.push((hosts[i].id.clone(), hosts[i].history.clone()));
                let mut proc = launch(spawn, &node_for(started, false, &nats, 0), ts).await?;
                started += 1;
                start_workload(&mut proc).await?;
                hosts[i] = proc;
            }
            Fault::Deploy => {
                // Replace the hosts one by one with the other release.
                next_release = !next_release;
                let new = launch(spawn, &node_for(started, next_release, &nats, 0), ts).await?;
                started += 1;
                finished.push(replace(&mut hosts[i], new, &mut ts_finished).await?);
            }
            Fault::Skew => {
                skew = if skew > 0 { -3_600_000 } else { 3_600_000 };
                let new = launch(spawn, &node_for(started, next_release, &nats, skew), ts).await?;
                started += 1;
                finished.push(replace(&mut hosts[i], new, &mut ts_finished).await?);
            }
            Fault::DbOutage => match db_proxy {
                Some(proxy) => proxy.outage(Duration::from_secs(2)),
                None => bail!(
                    "db_outage needs a postgres:// URL naming one TCP host (a key=value \
                     string, a socket or several hosts cannot be proxied): leave it out \
                     with CHECKER_FAULTS"
                ),
            },
            Fault::TsCut => {
                hosts[i].cmd("ts_cut").await?;
            }
            Fault::TsHalfOpen => {
                hosts[i].cmd("ts_half_open").await?;
            }
            Fault::TsPause => {
                // Resumed by a task of its own: the faults go on meanwhile.
                if let Some(pid) = hosts[i].ts.as_ref().and_then(|t| t.child.id()) {
                    // SAFETY: kill(2) of our own child's pid.
                    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_secs(6)).await;
                        // SAFETY: as above (a pid that exited meanwhile is not reused
                        // within seconds).
                        unsafe { libc::kill(pid as i32, libc::SIGCONT) };
                    });
                }
            }
            Fault::TierCut => {
                hosts[i].cmd("tier_cut").await?;
            }
            Fault::TierPause => {
                hosts[i].cmd("tier_pause 800").await?;
            }
            Fault::TierHalfOpen => {
                hosts[i].cmd("tier_half_open").await?;
            }
            Fault::TierReconnectPause => {
                hosts[i].cmd("tier_reconnect_pause 800").await?;
            }
            Fault::NatsLossy => {
                let ns = nats.as_ref().and_then(|n| n.netns.as_ref());
                let ns = ns.context("nats_lossy_link needs Config::with_lossy_nats")?;
                ns.degrade()?;
                tokio::time::sleep(Duration::from_secs(3)).await;
                ns.restore()?;
            }
            Fault::NatsRestart => {
                if let Some(nats) = nats.as_mut() {
                    nats.stop();
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    nats.restart()?;
                }
            }
        }
        *faults.entry(fault.name()).or_default() += 1;
    }
    let rest = config.duration.saturating_sub(begin.elapsed());
    tokio::time::sleep(rest).await;
    for h in &mut hosts {
        h.cmd("stop").await?;
        if let Some(ts) = h.ts.as_mut() {
            // A reader paused last is resumed within 6 s; this waits for it.
            ts.cmd("stop").await?;
        }
    }
    // Converged: after catching up, every host answers what the database holds.
    let stored: Vec<i64> = admin
        .query("SELECT value FROM registers ORDER BY id", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut not_converged = Vec::new();
    let (mut read_errors, mut write_errors, mut unknown, mut ack_timeouts) = (0, 0, 0, 0);
    let (mut tier_hits, mut tier_misses, mut ts_hits, mut ts_misses) = (0, 0, 0, 0);
    let mut core_reads = 0;
    for h in &mut hosts {
        let finals = [
            (Some("final"), h.id.clone()),
            (Some("final_tier"), tier_name(&h.id)),
            (h.ts.is_some().then_some("final"), ts_name(&h.id)),
        ];
        for (line, who) in finals {
            let Some(line) = line else { continue };
            // The TypeScript reader's after its host's (which waited for its pushes to
            // be delivered to the trusted clients, the reader among them).
            let answer = if who == ts_name(&h.id) {
                h.ts.as_mut().expect("a reader").cmd(line).await?
            } else {
                h.cmd(line).await?
            };
            for (k, seen) in answer.split_whitespace().skip(1).enumerate() {
                let seen: i64 = seen.parse().unwrap_or(-1);
                if seen != stored[k] {
                    not_converged.push(Violation::NotConverged {
                        host: who.clone(),
                        key: k as u32 + 1,
                        seen,
                        stored: stored[k],
                    });
                }
            }
        }
        let mut stats = h.cmd("stats").await?;
        if let Some(ts) = h.ts.as_mut() {
            stats.push(' ');
            stats.push_str(&ts.cmd("stats").await?);
        }
        for kv in stats.split_whitespace() {
            let (k, v) = kv.split_once('=').unwrap_or((kv, "0"));
            let v: u64 = v.parse().unwrap_or(0);
            match k {
                "read_errors" | "tier_read_errors" | "ts_read_errors" => read_errors += v,
                "ts_hits" => ts_hits += v,
                "core_reads" => core_reads += v,
                "ts_misses" => ts_misses += v,
                "write_errors" => write_errors += v,
                "unknown" => unknown += v,
                "ack_timeouts" => ack_timeouts += v,
                "tier_hits" => tier_hits += v,
                "tier_misses" => tier_misses += v,
                _ => {}
            }
        }
        if let Some(mut t) = h.ts.take() {
            t.cmd("quit").await?;
            let _ = t.child.wait().await;
            ts_finished.push((t.id.clone(), t.history.clone()));
        }
        h.cmd("quit").await?;
        finished.push((h.id.clone(), h.history.clone()));
    }
    for h in &mut hosts {
        let _ = h.child.wait().await;
    }
    let mut histories = Vec::new();
    for (id, path) in &finished {
        let bytes = std::fs::read(path).with_context(|| format!("{}", path.display()))?;
        histories.push(decode(id, &bytes)?);
        // The tier's reads: a reader of its own (its reads never go backwards either).
        let tier = tier_history(path);
        let bytes = std::fs::read(&tier).with_context(|| format!("{}", tier.display()))?;
        histories.push(decode(&tier_name(id), &bytes)?);
    }
    for (id, path) in &ts_finished {
        let bytes = std::fs::read(path).with_context(|| format!("{}", path.display()))?;
        histories.push(decode(id, &bytes)?);
    }
    let mut checked = check(&histories);
    checked.violations.extend(not_converged);
    Ok(Outcome {
        checked,
        faults,
        hosts_started: started,
        read_errors,
        write_errors,
        unknown,
        ack_timeouts,
        tier_hits,
        tier_misses,
        ts_hits,
        ts_misses,
        core_reads,
    })
}
