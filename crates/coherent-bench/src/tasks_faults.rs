//! `tasks.faults.*`: the Tasks app through an operator's bad day for its database (issue 30,
//! hole 6). Two Coherent backends over one PostgreSQL, an HTTP tier on each; writers PATCH a
//! task's status through tier A and read it back through tier B as soon as the write
//! returned (each writer owns its tasks: no other write to them is in flight); readers ask
//! both tiers for project summaries and the project list; and every 5 s every client
//! connection of the database is terminated (`pg_terminate_backend`: what a failover or a
//! restarted pooler does to the pools, the listeners and the transactions in flight).
//!
//! Counted: reads right after a returned write that show another status (`stale_reads`,
//! must be 0), and 5xx answers, split by whether the request was in flight while a
//! termination ran (`errors_5xx_at_kills`: allowed) or not (`errors_5xx_outside_kills`:
//! must be 0: a lost connection is retried on a fresh one, and a failure that says nothing
//! about the data is not cached for long).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use coherent_tasks::app::{self, DbConfig, LiveBackend};
use coherent_tasks::model::Status;
use http_body_util::{BodyExt as _, Full};
use hyper::Method;
use parking_lot::Mutex;
use tokio::net::TcpListener;

/// What a run found.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    pub(crate) writes: u64,
    pub(crate) reads_checked: u64,
    pub(crate) reads: u64,
    pub(crate) stale_reads: u64,
    pub(crate) kills: u64,
    pub(crate) errors_5xx_at_kills: u64,
    pub(crate) errors_5xx_outside_kills: u64,
    /// Requests that got no answer at all (the tier's connection failed).
    pub(crate) transport_errors: u64,
    /// Answers neither 2xx nor 5xx.
    pub(crate) other_failures: u64,
    /// The first few failures outside the kills, for the note.
    pub(crate) first_outside: Vec<String>,
    pub(crate) first_stale: Vec<String>,
}

const PROJECTS: usize = 4;
const TASKS: usize = 400;
pub(crate) const WRITERS: usize = 8;
pub(crate) const READERS: usize = 4;
const KILL_EVERY: Duration = Duration::from_secs(5);

/// One request's span and answer (status 0: no answer).
struct Failure {
    start: Instant,
    end: Instant,
    status: u16,
    what: String,
}

type Client = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
>;

async fn request(
    client: &Client,
    addr: SocketAddr,
    method: Method,
    path: &str,
    body: Option<String>,
) -> Result<(u16, Bytes), String> {
    let mut builder = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    if body.is_some() {
        builder = builder.header("content-type", "application/json");
    }
    let request = builder
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .map_err(|e| e.to_string())?;
    let response = client.request(request).await.map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, body))
}

struct Shared {
    stop: AtomicBool,
    failures: Mutex<Vec<Failure>>,
    stale: Mutex<Vec<String>>,
    writes: AtomicU64,
    reads: AtomicU64,
    checked: AtomicU64,
}

impl Shared {
    fn failed(&self, start: Instant, status: u16, what: String) {
        self.failures.lock().push(Failure {
            start,
            end: Instant::now(),
            status,
            what,
        });
    }
}

/// Runs the faults for `length` against a fresh schema of the database at `url`.
pub(crate) async fn run(url: &str, length: Duration) -> anyhow::Result<Outcome> {
    let schema = format!("bench_faults_{}", std::process::id());
    let db = DbConfig::Postgres {
        url: url.to_owned(),
        schema: schema.clone(),
    };
    let result = run_in(&db, url, length).await;
    crate::tasks::drop_schema(url, &schema).await;
    result
}

async fn run_in(db: &DbConfig, url: &str, length: Duration) -> anyhow::Result<Outcome> {
    let store = db.open(2).await?;
    let projects = app::seed(&store, PROJECTS, TASKS).await?;
    let tasks = crate::tasks::all_tasks(&store).await?;
    drop(store);
    let a = LiveBackend::start(db, TcpListener::bind("127.0.0.1:0").await?, None).await?;
    let b = LiveBackend::start(db, TcpListener::bind("127.0.0.1:0").await?, None).await?;
    let tier_a = crate::tasks::serve(app::live_router(&[a.addr]).await?).await?;
    let tier_b = crate::tasks::serve(app::live_router(&[b.addr]).await?).await?;
    let client: Client =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let shared = Arc::new(Shared {
        stop: AtomicBool::new(false),
        failures: Mutex::new(Vec::new()),
        stale: Mutex::new(Vec::new()),
        writes: AtomicU64::new(0),
        reads: AtomicU64::new(0),
        checked: AtomicU64::new(0),
    });
    let mut workers = Vec::new();
    for w in 0..WRITERS {
        let own: Vec<uuid::Uuid> = tasks.iter().skip(w).step_by(WRITERS).copied().collect();
        let (client, shared) = (client.clone(), shared.clone());
        workers.push(tokio::spawn(async move {
            let mut i = 0usize;
            while !shared.stop.load(Ordering::Relaxed) {
                let id = own[i % own.len()];
                let status = Status::ALL[(i / own.len() + w) % Status::ALL.len()];
                i += 1;
                let path = format!("/api/tasks/{id}");
                let body = format!(r#"{{"status":"{}"}}"#, status.name());
                let start = Instant::now();
                match request(&client, tier_a, Method::PATCH, &path, Some(body)).await {
                    Ok((200, _)) => {
                        shared.writes.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok((code, body)) => {
                        shared.failed(
                            start,
                            code,
                            format!("PATCH {code} {}", String::from_utf8_lossy(&body)),
                        );
                        // The write may or may not have happened: this task's next read
                        // is not checked against it.
                        continue;
                    }
                    Err(e) => {
                        shared.failed(start, 0, format!("PATCH: {e}"));
                        continue;
                    }
                }
                // The write returned: a read that starts now, on the other tier, sees it.
                let start = Instant::now();
                match request(&client, tier_b, Method::GET, &path, None).await {
                    Ok((200, body)) => {
                        shared.checked.fetch_add(1, Ordering::Relaxed);
                        let seen = crate::tasks::status_of(&body);
                        if seen != Some(status) {
                            shared.stale.lock().push(format!(
                                "task {id}: wrote {}, read {:?} at +{:?}",
                                status.name(),
                                seen.map(Status::name),
                                start.elapsed()
                            ));
                        }
                    }
                    Ok((code, body)) => shared.failed(
                        start,
                        code,
                        format!("GET task {code} {}", String::from_utf8_lossy(&body)),
                    ),
                    Err(e) => shared.failed(start, 0, format!("GET task: {e}")),
                }
            }
        }));
    }
    for r in 0..READERS {
        let (client, shared, projects) = (client.clone(), shared.clone(), projects.clone());
        workers.push(tokio::spawn(async move {
            let mut i = r;
            while !shared.stop.load(Ordering::Relaxed) {
                i += 1;
                let tier = if i % 2 == 0 { tier_a } else { tier_b };
                let path = if i % 3 == 0 {
                    "/api/projects".to_owned()
                } else {
                    format!("/api/projects/{}/summary", projects[i % projects.len()])
                };
                let start = Instant::now();
                match request(&client, tier, Method::GET, &path, None).await {
                    Ok((200, _)) => {
                        shared.reads.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok((code, body)) => shared.failed(
                        start,
                        code,
                        format!("GET {path} {code} {}", String::from_utf8_lossy(&body)),
                    ),
                    Err(e) => shared.failed(start, 0, format!("GET {path}: {e}")),
                }
                // Readers pace themselves: they are there to hit the caches through the
                // kills, not to take the CPU from the writers.
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }));
    }
    // The kills: every client connection of the database but the killer's.
    let (killer, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    let began = Instant::now();
    let mut kills: Vec<(Instant, Instant)> = Vec::new();
    while began.elapsed() + KILL_EVERY <= length {
        tokio::time::sleep(KILL_EVERY).await;
        let start = Instant::now();
        killer
            .execute(
                // With a timeout, each call returns once its backend has exited (or after
                // 5 s): the kill lasts until the last backend is gone.
                "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid() \
                   AND backend_type = 'client backend'",
                &[],
            )
            .await?;
        kills.push((start, Instant::now()));
    }
    tokio::time::sleep(length.saturating_sub(began.elapsed())).await;
    shared.stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    a.stop().await;
    b.stop().await;
    let mut outcome = Outcome {
        writes: shared.writes.load(Ordering::Relaxed),
        reads: shared.reads.load(Ordering::Relaxed),
        reads_checked: shared.checked.load(Ordering::Relaxed),
        kills: kills.len() as u64,
        ..Outcome::default()
    };
    let stale = std::mem::take(&mut *shared.stale.lock());
    outcome.stale_reads = stale.len() as u64;
    outcome.first_stale = stale.into_iter().take(5).collect();
    for f in shared.failures.lock().iter() {
        let at_kill = kills
            .iter()
            .any(|(start, end)| f.start <= *end && f.end >= *start);
        if f.status == 0 {
            outcome.transport_errors += 1;
        }
        if f.status >= 500 || f.status == 0 {
            if at_kill {
                outcome.errors_5xx_at_kills += 1;
            } else {
                outcome.errors_5xx_outside_kills += 1;
                if outcome.first_outside.len() < 5 {
                    let since = kills
                        .iter()
                        .filter(|(_, end)| *end <= f.start)
                        .map(|(_, end)| f.start - *end)
                        .min();
                    outcome
                        .first_outside
                        .push(format!("{} ({:?} after a kill)", f.what, since));
                }
            }
        } else {
            outcome.other_failures += 1;
            if outcome.first_outside.len() < 5 {
                outcome.first_outside.push(f.what.clone());
            }
        }
    }
    Ok(outcome)
}
