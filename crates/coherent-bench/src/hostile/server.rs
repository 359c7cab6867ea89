//! The server under attack, as `tasks serve` runs it: the Tasks app's Coherent backend
//! (`LiveBackend`: its RPC endpoint on TCP, trusted) and its HTTP router (`/api`, `/rpc` the
//! same endpoint over WebSocket, untrusted; `/gateway`; the page's files) served by
//! `serve_http_counted` with the default `HttpLimits` (127.0.0.1, where the bench's own
//! clients are, exempt from the per-address limits by default; the attackers come from
//! other addresses), over SQLite in a temporary directory. The
//! router is not wrapped in `session::Auth::protect`: writes through `/api` need no login.
//!
//! It runs in a child process of the bench (`coherent-bench hostile-server`), so that its
//! memory and CPU time are its own: it prints `READY <http> <rpc> <project>` on stdout once it
//! serves, answers a `stats` line on stdin with a `STATS {json}` line, and exits when its
//! stdin closes (the parent ended, however it ended).

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::Context as _;
use coherent_tasks::app::{self, DbConfig, LiveBackend};
use tokio::net::TcpListener;

/// The child's address space is capped at this (`RLIMIT_AS`): an attack that makes the
/// server allocate without bound ends in a failed allocation (an abort) of that process,
/// not in the machine's OOM killer picking some other process.
const ADDRESS_SPACE_CAP: u64 = 6 << 30;

/// The hidden `hostile-server` subcommand's arguments.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct ServerArgs {
    /// Projects to seed.
    #[arg(long)]
    projects: usize,
    /// Tasks to seed (spread over the projects).
    #[arg(long)]
    tasks: usize,
}

/// The child's `main`.
pub(crate) fn main(args: ServerArgs) -> anyhow::Result<()> {
    cap_address_space();
    std::panic::set_hook(Box::new(|info| {
        // One line, found by the parent in this process's log.
        eprintln!("PANIC in the hostile server: {info}");
    }));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(serve(args))
}

fn cap_address_space() {
    let limit = libc::rlimit {
        rlim_cur: ADDRESS_SPACE_CAP,
        rlim_max: ADDRESS_SPACE_CAP,
    };
    // SAFETY: a plain system call on a valid struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) } != 0 {
        eprintln!("hostile server: could not cap the address space");
    }
}

async fn serve(args: ServerArgs) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let db = DbConfig::Sqlite(dir.path().join("tasks.db"));
    let projects = {
        let store = db.open(4).await?;
        app::seed(&store, args.projects, args.tasks).await?
    };
    let live = LiveBackend::start(&db, TcpListener::bind("127.0.0.1:0").await?, None).await?;
    let web = dir.path().join("web");
    std::fs::create_dir_all(&web)?;
    std::fs::write(
        web.join("index.html"),
        "<!doctype html><title>Tasks</title>",
    )?;
    let router = live.http_router(web).await?;
    let http = TcpListener::bind("127.0.0.1:0").await?;
    let http_addr = http.local_addr()?;
    let http_stats = std::sync::Arc::new(app::HttpStats::default());
    let counted = http_stats.clone();
    tokio::spawn(async move {
        // Every limit is the default. The victim, the writers and the 1,000 boards come
        // from 127.0.0.1, which the defaults exempt from the per-address limits (a proxy
        // on the server's host); the attackers come from other loopback addresses.
        let limits = app::HttpLimits::default();
        if let Err(e) = app::serve_http_counted(http, router, limits, counted).await {
            eprintln!("hostile server: HTTP stopped: {e:#}");
        }
    });
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
        // The parent is gone (or closed our stdin): so are we.
        std::process::exit(0);
    });
    println!("READY {http_addr} {} {}", live.addr, projects[0]);
    std::io::stdout().flush()?;
    while let Some(line) = rx.recv().await {
        if line.trim() == "stats" {
            let s = live.remote.stats();
            let e = live.endpoint().stats();
            let stats = serde_json::json!({
                "replica_connections": s.connections,
                "replicas_held": s.replicas_held,
                "pushes": s.pushes,
                "clients_closed_unresponsive": s.clients_closed_unresponsive,
                "waits_skipped_untrusted": s.waits_skipped_untrusted,
                "calls_paced": e.calls_paced,
                "requests_paced": http_stats.requests_paced.load(std::sync::atomic::Ordering::Relaxed),
                "requests_refused": http_stats.requests_refused.load(std::sync::atomic::Ordering::Relaxed),
                "connections_refused_per_ip": http_stats
                    .connections_refused_per_ip
                    .load(std::sync::atomic::Ordering::Relaxed),
                "endpoint": format!("{e:?}"),
            });
            println!("STATS {stats}");
            std::io::stdout().flush()?;
        }
    }
    Ok(())
}

/// The parent's handle on a running server; killed when dropped.
pub(crate) struct Server {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    pub(crate) http: SocketAddr,
    pub(crate) rpc: SocketAddr,
    pub(crate) project: uuid::Uuid,
    log: std::path::PathBuf,
}

impl Server {
    /// Starts a server with `tasks` tasks in `projects` projects; its stderr goes to `log`.
    pub(crate) fn start(projects: usize, tasks: usize, log: &Path) -> anyhow::Result<Self> {
        let exe = std::env::current_exe()?;
        let mut child = std::process::Command::new(exe)
            .arg("hostile-server")
            .arg("--projects")
            .arg(projects.to_string())
            .arg("--tasks")
            .arg(tasks.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log)?)
            .spawn()?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let ready = lines
            .recv_timeout(Duration::from_secs(60))
            .map_err(|_| anyhow::anyhow!("the hostile server did not start (see {log:?})"))?;
        let mut words = ready
            .strip_prefix("READY ")
            .context("the hostile server's first line")?
            .split(' ');
        let mut next = || words.next().context("the hostile server's READY line");
        let http = next()?.parse()?;
        let rpc = next()?.parse()?;
        let project = next()?.parse()?;
        Ok(Self {
            child,
            stdin,
            lines,
            http,
            rpc,
            project,
            log: log.to_owned(),
        })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process still runs.
    pub(crate) fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The server's counters (`STATS` line), or `None` when it does not answer in 2 s.
    pub(crate) fn stats(&mut self) -> Option<serde_json::Value> {
        while self.lines.try_recv().is_ok() {}
        writeln!(self.stdin, "stats").ok()?;
        self.stdin.flush().ok()?;
        let line = self.lines.recv_timeout(Duration::from_secs(2)).ok()?;
        serde_json::from_str(line.strip_prefix("STATS ")?).ok()
    }

    /// Lines of its log that report a panic.
    pub(crate) fn panics(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("PANIC") || l.contains("panicked"))
            .map(str::to_owned)
            .collect()
    }

    /// Its log's last lines (after it died).
    pub(crate) fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(5)..].join(" | ")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What `/proc` says about a process.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Proc(pub(crate) u32);

impl Proc {
    fn status_kb(self, field: &str) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.0)).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()
    }

    /// Resident memory now, in MiB.
    pub(crate) fn rss_mb(self) -> f64 {
        self.status_kb("VmRSS:").unwrap_or(0) as f64 / 1024.0
    }

    /// Peak resident memory (`VmHWM`) since the start or the last [`reset_peak`](Self::reset_peak), in MiB.
    pub(crate) fn peak_rss_mb(self) -> f64 {
        self.status_kb("VmHWM:").unwrap_or(0) as f64 / 1024.0
    }

    /// Resets `VmHWM` to the current RSS (`echo 5 > /proc/PID/clear_refs`); false where the
    /// kernel refused.
    pub(crate) fn reset_peak(self) -> bool {
        std::fs::write(format!("/proc/{}/clear_refs", self.0), "5").is_ok()
    }

    /// User + system CPU time so far, in seconds (see [`crate::cpu::pid_cpu`]); 0 once the
    /// process is gone.
    pub(crate) fn cpu_seconds(self) -> f64 {
        crate::cpu::pid_cpu(self.0).map_or(0.0, |t| t.as_secs_f64())
    }
}
