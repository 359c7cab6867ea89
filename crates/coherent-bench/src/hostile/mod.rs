//! The `hostile` suite (issue 31, "safe on the open internet"): the Tasks app's Coherent
//! backend with its HTTP router, as `tasks serve` runs it, in a child process (see
//! `server.rs`), under attack from this process.
//!
//! Rows (names are stable):
//!
//! - `hostile.baseline_p99_ms`: a well-behaved client's read p99 with no attackers: `GET
//!   /api/tasks/{id}` of one of 100 tasks, in a closed loop on one keep-alive connection (the
//!   headline; the client runs on a thread and runtime of its own), over the quiet slices;
//! - `hostile.victim_p99_ms`: the same client, over the attack slices: 50 hostile
//!   connections, from five addresses other than the victim's (see
//!   [`attacks::attacker_address`]), run every attack of `attacks.rs` in turn, a seventh
//!   of the run each, each attack slice right after a quiet slice as long (and 200 ms
//!   after it left out of both), so that the two are measured side by side under
//!   whatever else the shared machine does at the time. Acceptance: at most 2x the
//!   baseline;
//! - `hostile.server_rss_mb`: the server's peak RSS (`VmHWM`, reset before the attacks)
//!   over the attack run. Acceptance: at most the server's memory budget
//!   ([`BUDGET_MB`]) + 64 MB;
//! - `hostile.write_p99_no_clients_ms`, `hostile.write_p99_all_ack_ms`, `hostile.write_p99_ms`:
//!   `PATCH /api/tasks/{id}` (a new title) of the 48 tasks on one project's board, one every
//!   [`WRITE_PERIOD`], with no replica clients; with 1,000 WebSocket clients (`RemoteClient`
//!   on `/rpc`) each holding the board's four column replicas and reading them again when
//!   invalidated; and with 100 of them replaced by holders that never answer a push (and
//!   hold the board again when the server closes them). The last two alternate, two
//!   rounds of each as long as a row's run (the silent holders swapped out for boards and
//!   back between them, 300 ms of writes after each swap counted in neither), so that both
//!   are measured side by side. Acceptance: silent at most 1.2x all-ack.
//!
//! The server's CPU time (`/proc/PID/stat`) is taken around every run: on a 2-core machine
//! the attackers share the CPU with the server, so cost per victim request (server CPU ÷
//! victim requests) is reported beside the latencies.

pub(crate) mod attacks;
pub(crate) mod clients;
pub(crate) mod server;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use rand::rngs::SmallRng;
use rand::{RngExt as _, SeedableRng as _};
use tokio::time::Instant;

use crate::report::{percentile, progress, Report, Row};
use crate::Timing;
use attacks::{Tally, Target, ATTACKER_ADDRESSES, KINDS};
use clients::{columns, Board, Http};
pub(crate) use server::ServerArgs;
use server::{Proc, Server};

const PROJECTS: usize = 20;
const TASKS: usize = 10_000;
const QUICK_TASKS: usize = 1_000;
/// Hostile connections at any time.
const ATTACKERS: usize = 50;
/// Replica clients of the write rows (a `--quick` run: a tenth).
const CLIENTS: usize = 1_000;
const SILENT: usize = 100;
/// Writes are paced: one starts every this long (or when the previous ends, if later).
const WRITE_PERIOD: Duration = Duration::from_millis(50);
/// The memory budget the RSS row is held to: the server's budget for queued bytes,
/// `coherent_rpc::Config::queue_budget`, whose default (1 GiB) `tasks serve` keeps.
const BUDGET_MB: f64 = 1024.0;
/// An attack slice is stopped when the server's RSS grew by this much during it, and every
/// attack when it passes [`RSS_CAP_MB`]: the machine is shared.
const SLICE_GROWTH_CAP_MB: f64 = 1536.0;
const RSS_CAP_MB: f64 = 3072.0;

/// Runs the suite.
pub(crate) fn run(timing: Timing) -> anyhow::Result<Report> {
    raise_fd_limit();
    let panics = count_panics();
    let quick = timing.run < Duration::from_secs(1);
    // One continuous run per row, as long as the other suites' runs together.
    let run = if quick {
        Duration::from_millis(700)
    } else {
        timing.run * timing.runs as u32
    };
    let warmup = timing.warmup;
    let (tasks, clients, silent) = if quick {
        (QUICK_TASKS, CLIENTS / 10, SILENT / 10)
    } else {
        (TASKS, CLIENTS, SILENT)
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let dir = tempfile::tempdir()?;
    let mut report = Report::new("hostile");
    let bar = progress(5);

    // Baseline and attacks, on one server.
    let mut server = Server::start(PROJECTS, tasks, &dir.path().join("attacked.log"))?;
    let proc = Proc(server.pid());
    let ids = runtime.block_on(task_ids(server.http, server.project))?;
    let board = runtime.block_on(board_ids(server.http, server.project))?;
    bar.set_message("warm-up");
    victim(server.http, ids.clone(), warmup).join();
    bar.inc(1);

    // The victim runs throughout; quiet slices (the baseline) and attack slices alternate,
    // so that both are measured side by side, under whatever else the machine does then.
    bar.set_message("quiet and attacks, in turn");
    let rss_before = proc.rss_mb();
    let peak_reset = proc.reset_peak();
    let target = Arc::new(Target {
        http: server.http,
        rpc: server.rpc,
        project: server.project,
        board: board.clone(),
        tally: Tally::default(),
        pings_left: AtomicI64::new(attacks::PING_BUDGET),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = std::time::Instant::now();
    let victim_run = victim_until(server.http, ids.clone(), t0, stop.clone());
    let attacked = runtime.block_on(attack(target.clone(), proc, run, t0));
    stop.store(true, Ordering::Relaxed);
    let victim_samples = victim_run.join();
    let baseline = victim_samples.within(&attacked.quiet);
    let under_attack = victim_samples.within(&attacked.slices);
    report.push(victim_row(
        "hostile.baseline_p99_ms",
        &baseline,
        attacked.quiet_cpu,
    ));
    let attack_cpu = attacked.attack_cpu;
    let peak = if peak_reset {
        proc.peak_rss_mb().max(attacked.max_rss_mb)
    } else {
        attacked.max_rss_mb
    };
    let alive = server.alive();
    bar.inc(1);
    let mut row = victim_row("hostile.victim_p99_ms", &under_attack, attack_cpu)
        .compared_to("hostile.baseline_p99_ms");
    for (kind, (from, to)) in KINDS.iter().zip(&attacked.slices) {
        let mut during: Vec<f64> = under_attack
            .samples
            .iter()
            .filter(|(at, _)| at >= from && at < to)
            .map(|(_, ms)| *ms)
            .collect();
        during.sort_by(f64::total_cmp);
        row = row.with(&format!("p99_ms.{kind}"), round(percentile(&during, 0.99)));
    }
    report.push(row);
    report.push(
        Row::new("hostile.server_rss_mb", round(peak), "MB")
            .with("rss_before_attacks_mb", round(rss_before))
            .with("budget_mb", BUDGET_MB)
            .with("limit_mb", BUDGET_MB + 64.0),
    );
    if !peak_reset {
        report.note("server_rss_mb: /proc/PID/clear_refs refused a reset of VmHWM: the peak is the largest VmRSS sampled every 20 ms during the attacks");
    }
    for note in &attacked.notes {
        report.note(note.clone());
    }
    for kind in KINDS {
        let outcomes = target.tally.get(kind);
        let list = outcomes
            .iter()
            .map(|(o, n)| format!("{o}: {n}"))
            .collect::<Vec<_>>()
            .join("; ");
        report.note(format!("attack {kind}: {list}"));
    }
    if let Some(stats) = server.stats() {
        report.note(format!(
            "attacked server's counters after the attacks: {stats}"
        ));
    }
    if !alive {
        report.note(format!(
            "THE SERVER DIED during the attacks; its log ends: {}",
            server.log_tail()
        ));
    }
    for panic in server.panics().into_iter().take(5) {
        report.note(format!("server log: {panic}"));
    }
    drop(server);

    // Writes with replica clients, on a fresh server.
    bar.set_message("writes");
    let mut server = Server::start(PROJECTS, tasks, &dir.path().join("writes.log"))?;
    let proc = Proc(server.pid());
    let board = runtime.block_on(board_ids(server.http, server.project))?;
    writer(server.http, board.clone(), warmup).join();
    let cpu = proc.cpu_seconds();
    let alone = writer(server.http, board.clone(), run).join();
    report.push(write_row(
        "hostile.write_p99_no_clients_ms",
        &alone,
        proc.cpu_seconds() - cpu,
    ));
    bar.inc(1);

    // Rounds of an all-acknowledging phase and a phase with `silent` of the boards replaced
    // by silent holders, in turn, so that both are measured side by side.
    let refetches = Arc::new(AtomicU64::new(0));
    let rss_without_clients = proc.rss_mb();
    let mut boards = runtime.block_on(connect_boards(
        server.http,
        server.project,
        clients,
        refetches.clone(),
    ))?;
    // What a browser tab holding a board costs the server (issue 32's
    // `remote.server_bytes_per_client`: here, where the server is a process of its own).
    let rss_with_clients = proc.rss_mb();
    report.push(
        Row::new(
            "hostile.server_bytes_per_client",
            ((rss_with_clients - rss_without_clients) * 1024.0 * 1024.0 / clients as f64).round(),
            "B",
        )
        .with("clients", clients)
        .with("rss_without_clients_mb", round(rss_without_clients))
        .with("rss_with_clients_mb", round(rss_with_clients)),
    );
    writer(server.http, board.clone(), warmup).join();
    let silent_pushes = Arc::new(AtomicU64::new(0));
    let silent_closed = Arc::new(AtomicU64::new(0));
    let phase = run;
    let mut all_ack = Phase::default();
    let mut with_silent = Phase::default();
    let mut after = None;
    let http = server.http;
    for _ in 0..WRITE_ROUNDS {
        all_ack.measure(&mut server, proc, &refetches, || {
            writer(http, board.clone(), phase).join()
        });
        for b in boards.drain(..silent) {
            b.close();
        }
        let holders = runtime.block_on(start_silent(
            server.http,
            server.project,
            silent,
            silent_pushes.clone(),
            silent_closed.clone(),
        ))?;
        writer(server.http, board.clone(), SWAP_SETTLE).join();
        with_silent.measure(&mut server, proc, &refetches, || {
            writer(http, board.clone(), phase).join()
        });
        after = server.stats();
        // The silent holders go, and as many boards come back.
        for h in holders {
            h.abort();
        }
        boards.extend(runtime.block_on(connect_boards(
            server.http,
            server.project,
            silent,
            refetches.clone(),
        ))?);
        writer(server.http, board.clone(), SWAP_SETTLE).join();
    }
    report.push(
        all_ack
            .row("hostile.write_p99_all_ack_ms")
            .with("clients", clients as u64),
    );
    bar.inc(1);
    report.push(
        with_silent
            .row("hostile.write_p99_ms")
            .compared_to("hostile.write_p99_all_ack_ms")
            .with("clients", clients as u64)
            .with("silent", silent as u64)
            .with(
                "silent_pushes_unanswered",
                silent_pushes.load(Ordering::Relaxed),
            )
            .with(
                "silent_closed_by_server",
                silent_closed.load(Ordering::Relaxed),
            ),
    );
    bar.inc(1);
    bar.finish_and_clear();
    if let Some(after) = &after {
        report.note(format!("write server's counters at the end: {after}"));
    }
    for panic in server.panics().into_iter().take(5) {
        report.note(format!("write server log: {panic}"));
    }
    for b in &boards {
        b.close();
    }
    runtime.block_on(async { tokio::time::sleep(Duration::from_millis(100)).await });
    drop(boards);
    drop(server);

    let panics = panics.lock();
    if panics.0 > 0 {
        report.note(format!(
            "THE BENCH'S OWN PROCESS (the clients, coherent_rpc's connecting side) saw {} panics in its tasks; the first: {}",
            panics.0, panics.1
        ));
    }
    acceptance(&mut report);
    report.note(format!(
        "{run:?} per row (in slices, below) after a {warmup:?} warm-up; {tasks} tasks in {PROJECTS} projects on SQLite; the server is `LiveBackend` + `http_router` under `serve_http_counted` with the default HttpLimits (its per-address limits: 256 connections, 100 requests and /rpc calls a second (200 at once), 20 writes a second (40 at once), 100 calls a second per /rpc connection; 127.0.0.1, where the victim, the writers and the boards are, exempt by default), not behind `Auth::protect` (writes need no login), in a child process"
    ));
    report.note(format!(
        "victim: GET /api/tasks/{{id}} of 100 tasks, closed loop on one keep-alive connection from 127.0.0.1, on a thread of its own; attacks: {ATTACKERS} connections from {ATTACKER_ADDRESSES} addresses (127.0.0.2 on), each kind for a seventh of the run, right after a quiet slice as long (the baseline's samples), in this order: {}",
        KINDS.join(", ")
    ));
    report.note(format!(
        "writes: PATCH /api/tasks/{{id}} (title) of the board's 48 tasks, one every {WRITE_PERIOD:?}; {clients} RemoteClients on /rpc (WebSocket, untrusted) hold the board (4 x TasksService.page, limit 12) and read it again when invalidated; and in turn ({WRITE_ROUNDS} rounds of each phase, {phase:?} each) {silent} of them closed and replaced by raw clients whose ReplicaSink.invalidated never returns (they hold the board again when closed), then back"
    ));
    report.note(format!(
        "rpc_ping_flood sends at most {} pings of 41 bytes (1 MiB each decompressed) over all its connections, and any attack is stopped when the server's RSS grows {SLICE_GROWTH_CAP_MB:.0} MB during it (all attacks past {RSS_CAP_MB:.0} MB; the server's address space is capped at 6 GiB): the machine is shared. A server that queues every pong is held to that by the bench, not by itself",
        attacks::PING_BUDGET
    ));
    report.note("cpu_per_request_us: the server's CPU time (user + system) over the run ÷ the requests it served to the victim (or writes); the load generator shares the 2 cores");
    Ok(report)
}

fn round(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// The acceptance lines, as notes (and on stderr).
fn acceptance(report: &mut Report) {
    let line = |name: &str, ok: bool, what: String| {
        format!(
            "acceptance {name}: {} ({what})",
            if ok { "ok" } else { "MISSED" }
        )
    };
    let mut lines = Vec::new();
    if let (Some(v), Some(b)) = (
        report.value("hostile.victim_p99_ms"),
        report.value("hostile.baseline_p99_ms"),
    ) {
        let ratio = v / b.max(1e-9);
        lines.push(line(
            "victim p99 <= 2x baseline",
            ratio <= 2.0,
            format!("{ratio:.2}x: {v:.3} ms vs {b:.3} ms"),
        ));
    }
    if let Some(rss) = report.value("hostile.server_rss_mb") {
        let limit = BUDGET_MB + 64.0;
        lines.push(line(
            "server RSS <= budget + 64 MB",
            rss <= limit,
            format!(
                "{:.2}x: {rss:.0} MB vs {limit:.0} MB (budget {BUDGET_MB:.0} MB)",
                rss / limit
            ),
        ));
    }
    if let (Some(s), Some(a)) = (
        report.value("hostile.write_p99_ms"),
        report.value("hostile.write_p99_all_ack_ms"),
    ) {
        let ratio = s / a.max(1e-9);
        lines.push(line(
            "write p99 with silent clients <= 1.2x all-ack",
            ratio <= 1.2,
            format!("{ratio:.2}x: {s:.3} ms vs {a:.3} ms"),
        ));
    }
    for l in lines {
        eprintln!("{l}");
        report.note(l);
    }
}

/// Counts the panics of this process's threads and tasks (and keeps the first's message),
/// then reports each as the default hook does.
fn count_panics() -> Arc<parking_lot::Mutex<(u64, String)>> {
    let seen = Arc::new(parking_lot::Mutex::new((0u64, String::new())));
    let previous = std::panic::take_hook();
    let counted = seen.clone();
    std::panic::set_hook(Box::new(move |info| {
        let mut seen = counted.lock();
        seen.0 += 1;
        if seen.1.is_empty() {
            seen.1 = info.to_string().replace('\n', " ");
        }
        drop(seen);
        previous(info);
    }));
    seen
}

/// Raises the soft limit on open files to the hard one (1,000 WebSockets and the floods).
fn raise_fd_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain system calls on a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

fn ids_of(body: &[u8]) -> anyhow::Result<Vec<uuid::Uuid>> {
    let page: coherent_tasks::model::Page = serde_json::from_slice(body)?;
    Ok(page.items.iter().map(|t| t.id).collect())
}

/// 100 tasks of `project` (the victim's).
async fn task_ids(http: SocketAddr, project: uuid::Uuid) -> anyhow::Result<Vec<uuid::Uuid>> {
    let (status, body) = Http::new(http)
        .request(
            hyper::Method::GET,
            &format!("/api/tasks?project={project}&limit=100"),
            None,
        )
        .await?;
    anyhow::ensure!(status == 200, "listing tasks answered {status}");
    ids_of(&body)
}

/// The tasks on `project`'s board: the first 12 of each status.
async fn board_ids(http: SocketAddr, project: uuid::Uuid) -> anyhow::Result<Vec<uuid::Uuid>> {
    let mut c = Http::new(http);
    let mut ids = Vec::new();
    for q in columns(project) {
        let status = serde_json::to_value(q.status)?;
        let status = status.as_str().context("a status")?;
        let (code, body) = c
            .request(
                hyper::Method::GET,
                &format!("/api/tasks?project={project}&status={status}&limit=12"),
                None,
            )
            .await?;
        anyhow::ensure!(code == 200, "listing a column answered {code}");
        ids.extend(ids_of(&body)?);
    }
    anyhow::ensure!(!ids.is_empty(), "an empty board");
    Ok(ids)
}

/// Latencies of one client's run: (start, seconds from the run's start; latency, ms).
struct Samples {
    samples: Vec<(f64, f64)>,
    errors: u64,
    /// When each failed request was sent (seconds from the start, as in `samples`).
    failed_at: Vec<f64>,
    reconnects: u64,
    first_error: Option<String>,
}

impl Samples {
    /// The samples sent within one of `slices` (the failures among them counted).
    fn within(&self, slices: &[(f64, f64)]) -> Samples {
        let inside = |at: f64| slices.iter().any(|(from, to)| at >= *from && at < *to);
        let failed_at: Vec<f64> = self
            .failed_at
            .iter()
            .copied()
            .filter(|t| inside(*t))
            .collect();
        Samples {
            samples: self
                .samples
                .iter()
                .copied()
                .filter(|(at, _)| inside(*at))
                .collect(),
            errors: failed_at.len() as u64,
            failed_at,
            reconnects: self.reconnects,
            first_error: self.first_error.clone(),
        }
    }

    fn sorted_ms(&self) -> Vec<f64> {
        let mut ms: Vec<f64> = self.samples.iter().map(|(_, ms)| *ms).collect();
        ms.sort_by(f64::total_cmp);
        ms
    }
}

/// A client running on a thread of its own (its own current-thread runtime).
struct Client(std::thread::JoinHandle<Samples>);

impl Client {
    fn join(self) -> Samples {
        self.0.join().expect("a client thread panicked")
    }
}

fn on_thread<F, Fut>(f: F) -> Client
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Samples>,
{
    Client(std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
            .block_on(f())
    }))
}

/// The well-behaved client: GETs of random tasks of `ids` for `run`, closed loop.
fn victim(http: SocketAddr, ids: Vec<uuid::Uuid>, run: Duration) -> Client {
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = std::time::Instant::now();
    let timer = stop.clone();
    std::thread::spawn(move || {
        std::thread::sleep(run);
        timer.store(true, Ordering::Relaxed);
    });
    victim_until(http, ids, t0, stop)
}

/// [`victim`] until `stop` is set; its samples' times are counted from `t0`.
fn victim_until(
    http: SocketAddr,
    ids: Vec<uuid::Uuid>,
    t0: std::time::Instant,
    stop: Arc<AtomicBool>,
) -> Client {
    on_thread(move || async move {
        let mut rng = SmallRng::seed_from_u64(31);
        let mut c = Http::new(http);
        let start = Instant::from_std(t0);
        let mut s = Samples {
            samples: Vec::new(),
            errors: 0,
            failed_at: Vec::new(),
            reconnects: 0,
            first_error: None,
        };
        while !stop.load(Ordering::Relaxed) {
            let id = ids[rng.random_range(0..ids.len())];
            let sent = Instant::now();
            let answer = tokio::time::timeout(
                Duration::from_secs(10),
                c.request(hyper::Method::GET, &format!("/api/tasks/{id}"), None),
            )
            .await;
            let ms = sent.elapsed().as_secs_f64() * 1e3;
            match answer {
                Ok(Ok((200, _))) => s.samples.push(((sent - start).as_secs_f64(), ms)),
                other => {
                    s.errors += 1;
                    s.first_error.get_or_insert_with(|| match other {
                        Ok(Ok((status, _))) => format!("answered {status}"),
                        Ok(Err(e)) => e.to_string(),
                        Err(_) => "no answer in 10 s".to_owned(),
                    });
                    // A failed request counts at the time it took.
                    s.samples.push(((sent - start).as_secs_f64(), ms));
                    s.failed_at.push((sent - start).as_secs_f64());
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        s.reconnects = c.reconnects;
        s
    })
}

/// The writer: a PATCH of the next board task's title every [`WRITE_PERIOD`], for `run`.
fn writer(http: SocketAddr, board: Vec<uuid::Uuid>, run: Duration) -> Client {
    on_thread(move || async move {
        let mut c = Http::new(http);
        let start = Instant::now();
        let mut s = Samples {
            samples: Vec::new(),
            errors: 0,
            failed_at: Vec::new(),
            reconnects: 0,
            first_error: None,
        };
        let mut next = start;
        let mut n = 0u64;
        while start.elapsed() < run {
            tokio::time::sleep_until(next).await;
            next += WRITE_PERIOD;
            let id = board[n as usize % board.len()];
            n += 1;
            let body = format!(r#"{{"title":"Edited by the hostile bench {n}"}}"#);
            let sent = Instant::now();
            let answer = c
                .request(
                    hyper::Method::PATCH,
                    &format!("/api/tasks/{id}"),
                    Some(body),
                )
                .await;
            let ms = sent.elapsed().as_secs_f64() * 1e3;
            s.samples.push(((sent - start).as_secs_f64(), ms));
            match answer {
                Ok((200, _)) => {}
                other => {
                    s.errors += 1;
                    s.first_error.get_or_insert_with(|| match other {
                        Ok((status, body)) => {
                            format!("answered {status}: {}", String::from_utf8_lossy(&body))
                        }
                        Err(e) => e.to_string(),
                    });
                }
            }
        }
        s.reconnects = c.reconnects;
        s
    })
}

fn victim_row(name: &str, s: &Samples, cpu: f64) -> Row {
    let ms = s.sorted_ms();
    let requests = ms.len() as u64 - s.errors;
    let mut row = Row::new(name, round(percentile(&ms, 0.99)), "ms")
        .with("p50_ms", round(percentile(&ms, 0.5)))
        .with("max_ms", round(ms.last().copied().unwrap_or(0.0)))
        .with("requests", requests)
        .with("errors", s.errors)
        .with("reconnects", s.reconnects)
        .with("server_cpu_s", round(cpu))
        .with(
            "cpu_per_request_us",
            round(cpu * 1e6 / requests.max(1) as f64),
        );
    if let Some(e) = &s.first_error {
        row = row.with("first_error", e.clone());
    }
    row
}

fn write_row(name: &str, s: &Samples, cpu: f64) -> Row {
    let ms = s.sorted_ms();
    let mut row = Row::new(name, round(percentile(&ms, 0.99)), "ms")
        .with("p50_ms", round(percentile(&ms, 0.5)))
        .with("max_ms", round(ms.last().copied().unwrap_or(0.0)))
        .with("writes", ms.len() as u64)
        .with("errors", s.errors)
        .with("server_cpu_s", round(cpu))
        .with(
            "cpu_per_write_us",
            round(cpu * 1e6 / (ms.len() as f64).max(1.0)),
        );
    if let Some(e) = &s.first_error {
        row = row.with("first_error", e.clone());
    }
    row
}

fn pushes_between(before: &Option<serde_json::Value>, after: &Option<serde_json::Value>) -> u64 {
    let pushes =
        |s: &Option<serde_json::Value>| s.as_ref().and_then(|s| s["pushes"].as_u64()).unwrap_or(0);
    pushes(after).saturating_sub(pushes(before))
}

/// Connects `n` boards, 50 at a time.
async fn connect_boards(
    http: SocketAddr,
    project: uuid::Uuid,
    n: usize,
    refetches: Arc<AtomicU64>,
) -> anyhow::Result<Vec<Board>> {
    let mut boards = Vec::with_capacity(n);
    while boards.len() < n {
        let batch = (n - boards.len()).min(50);
        let connecting: Vec<_> = (0..batch)
            .map(|_| tokio::spawn(Board::connect(http, project, refetches.clone())))
            .collect();
        for c in connecting {
            boards.push(c.await?.context("connecting a board")?);
        }
    }
    Ok(boards)
}

/// Starts `n` silent holders; answers once each holds the board.
async fn start_silent(
    http: SocketAddr,
    project: uuid::Uuid,
    n: usize,
    pushes: Arc<AtomicU64>,
    closed: Arc<AtomicU64>,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let mut holders = Vec::with_capacity(n);
    let mut ready = Vec::with_capacity(n);
    for _ in 0..n {
        let (tx, rx) = tokio::sync::oneshot::channel();
        holders.push(tokio::spawn(clients::silent_holder(
            http,
            project,
            pushes.clone(),
            closed.clone(),
            Some(tx),
        )));
        ready.push(rx);
    }
    for r in ready {
        r.await.context("a silent holder")??;
    }
    Ok(holders)
}

/// All-acknowledging and silent phases of the write rows, in turn, this many times each,
/// each as long as a row's run: a silent phase of a full run outlasts the server's delivery
/// timeout (5 s), so it sees silent holders closed and coming back, as a longer one would.
const WRITE_ROUNDS: u32 = 2;
/// Writes after each swap of boards and silent holders, counted in neither phase.
const SWAP_SETTLE: Duration = Duration::from_millis(300);

/// The writes of one kind of phase, over its rounds.
#[derive(Default)]
struct Phase {
    samples: Vec<(f64, f64)>,
    errors: u64,
    first_error: Option<String>,
    cpu: f64,
    refreshes: u64,
    pushes: u64,
}

impl Phase {
    /// Runs `write` (a writer for one phase) and adds what it measured.
    fn measure(
        &mut self,
        server: &mut Server,
        proc: Proc,
        refetches: &AtomicU64,
        write: impl FnOnce() -> Samples,
    ) {
        let before = server.stats();
        let (cpu, refetched) = (proc.cpu_seconds(), refetches.load(Ordering::Relaxed));
        let s = write();
        self.cpu += proc.cpu_seconds() - cpu;
        self.refreshes += refetches.load(Ordering::Relaxed) - refetched;
        self.pushes += pushes_between(&before, &server.stats());
        self.samples.extend(s.samples);
        self.errors += s.errors;
        if self.first_error.is_none() {
            self.first_error = s.first_error;
        }
    }

    fn row(&self, name: &str) -> Row {
        let s = Samples {
            samples: self.samples.clone(),
            errors: self.errors,
            failed_at: Vec::new(),
            reconnects: 0,
            first_error: self.first_error.clone(),
        };
        write_row(name, &s, self.cpu)
            .with("board_refreshes", self.refreshes)
            .with("pushes", self.pushes)
            .with("rounds", u64::from(WRITE_ROUNDS))
    }
}

/// What the attack run saw besides the tallies.
struct Attacked {
    max_rss_mb: f64,
    /// When each attack ran: seconds from the victim's start.
    slices: Vec<(f64, f64)>,
    /// The quiet slice before each attack (the baseline).
    quiet: Vec<(f64, f64)>,
    /// The server's CPU time in the quiet slices, and in the attack slices.
    quiet_cpu: f64,
    attack_cpu: f64,
    notes: Vec<String>,
}

/// Time after each attack slice counted in neither kind of slice: the attack's
/// connections closing, its tasks ending.
const SETTLE: Duration = Duration::from_millis(200);

/// Runs every attack in turn, [`ATTACKERS`] connections each, a seventh of `run` each,
/// watching the server's RSS (see [`SLICE_GROWTH_CAP_MB`]).
async fn attack(
    target: Arc<Target>,
    proc: Proc,
    run: Duration,
    t0: std::time::Instant,
) -> Attacked {
    let slice = run / KINDS.len() as u32;
    let mut out = Attacked {
        max_rss_mb: proc.rss_mb(),
        slices: Vec::new(),
        quiet: Vec::new(),
        quiet_cpu: 0.0,
        attack_cpu: 0.0,
        notes: Vec::new(),
    };
    let mut stopped = false;
    for kind in KINDS {
        // A quiet slice, as long as the attack's, right before it.
        let (from, cpu) = (t0.elapsed().as_secs_f64(), proc.cpu_seconds());
        tokio::time::sleep(slice).await;
        out.quiet.push((from, t0.elapsed().as_secs_f64()));
        out.quiet_cpu += proc.cpu_seconds() - cpu;
        let cpu = proc.cpu_seconds();
        // Each attack gets its whole slice, however late the previous one ended.
        let from = t0.elapsed().as_secs_f64();
        let until = Instant::now() + slice;
        if stopped {
            out.notes.push(format!(
                "attack {kind} skipped: the bench stopped attacking (see above)"
            ));
            out.slices.push((from, from));
            continue;
        }
        let at_start = proc.rss_mb();
        let mut set = tokio::task::JoinSet::new();
        for index in 0..ATTACKERS {
            set.spawn(attacks::run(kind, target.clone(), index, until));
        }
        let mut watch = tokio::time::interval(Duration::from_millis(20));
        let mut slice_max = at_start;
        loop {
            tokio::select! {
                next = set.join_next() => {
                    if next.is_none() {
                        break;
                    }
                }
                _ = watch.tick() => {
                    let rss = proc.rss_mb();
                    slice_max = slice_max.max(rss);
                    if rss > RSS_CAP_MB || rss > at_start + SLICE_GROWTH_CAP_MB {
                        set.abort_all();
                        out.notes.push(format!(
                            "attack {kind}: STOPPED by the bench after {:.2} s: the server's RSS reached {rss:.0} MB (from {at_start:.0} MB at the attack's start)",
                            (Instant::now() - (until - slice)).as_secs_f64()
                        ));
                        stopped = rss > RSS_CAP_MB;
                        while set.join_next().await.is_some() {}
                        break;
                    }
                    if let Ok(false) = std::fs::exists(format!("/proc/{}", proc.0)) {
                        set.abort_all();
                        stopped = true;
                        break;
                    }
                }
            }
        }
        // Memory the server keeps after the attack's connections are gone.
        tokio::time::sleep_until(until).await;
        let to = t0.elapsed().as_secs_f64();
        out.slices.push((from, to));
        out.attack_cpu += proc.cpu_seconds() - cpu;
        tokio::time::sleep(SETTLE).await;
        if Instant::now() > until + Duration::from_secs(1) {
            out.notes.push(format!(
                "attack {kind}: its tasks ended {:.1} s after its deadline",
                (Instant::now() - until).as_secs_f64()
            ));
        }
        out.max_rss_mb = out.max_rss_mb.max(slice_max);
        out.notes.push(format!(
            "attack {kind}: server RSS {at_start:.0} MB at its start, at most {slice_max:.0} MB sampled during it, {:.0} MB after it",
            proc.rss_mb()
        ));
    }
    out
}
