//! A host of the `cluster` suite: a child process of the bench (`coherent-bench cluster-host
//! ...`), serving the `Commands` service (the mutator's `UpdateUser`) and the `Control`
//! service (the parent starts and stops its readers and collects their counts) on an RPC
//! endpoint on 127.0.0.1; it prints `ADDR <address>` on stdout once it serves, and exits
//! when its stdin closes (the parent ended, however it ended).

use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use coherent::ops::{
    Command, CommandError, CommandServer, Commands, Database, ErrorKind, Handler, Host, Notifier,
    Tx, Via,
};
use coherent::rpc::Endpoint;
use coherent::Registry;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use super::board::{now_us, Board, Floors, GRACE_US};
use super::{Control, ControlServer, Counts, Propagation};
use crate::local::service::UserService;
use crate::local::store::{now_micros, to_i64, Store, StoreError, User, PG_UPDATE, USERS};
use crate::local::{Getter, Ids, BATCH};
use crate::report::cores;

/// Writes a new version of a user (the mutator's command).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct UpdateUser {
    pub(crate) id: u64,
    pub(crate) version: u64,
}

impl Command for UpdateUser {
    const NAME: &'static str = "bench.users.update";
    type Output = ();
}

/// `UpdateUser`'s handler: the `local` suite's UPDATE in the pipeline's transaction
/// (deferred: `BEGIN`, the UPDATE, the operation's row and `COMMIT` go in one flight); the
/// invalidation of `get(id)` on this host (when it caches), then this host's floor for the
/// user is raised (so a read that sees the floor started after the invalidation ran).
pub(crate) struct Users {
    pub(crate) service: Option<UserService>,
    pub(crate) floors: Arc<Floors>,
}

impl Handler<UpdateUser> for Users {
    async fn execute(&self, c: &UpdateUser, tx: &mut Tx<'_>) -> Result<(), CommandError> {
        let name = format!("User {} v{}", c.id, c.version);
        // Deferred, with its text: the command's only write, so it goes with the
        // operation's row as one statement (one round trip, no BEGIN or COMMIT).
        tx.defer_sql(
            PG_UPDATE,
            vec![
                Box::new(to_i64(c.id)),
                Box::new(to_i64(c.version)),
                Box::new(name),
                Box::new(now_micros()),
            ],
        )
        .await
    }

    fn invalidate(&self, c: &UpdateUser, _: &()) {
        if let Some(service) = &self.service {
            service.invalidate_get(c.id);
        }
        self.floors.raise(c.id, c.version);
    }
}

/// The `direct` and `ttl` hosts' `Commands`: what a team without coherent-ops runs, the
/// same UPDATE (autocommit, no log, no notification); the `ttl` host then drops the user
/// from its own cache (a team's TTL cache forgets its own host's writes; the other hosts'
/// copies live out their TTL).
struct Plain {
    store: Arc<Store>,
    ttl: Option<moka::sync::Cache<u64, User>>,
}

impl Commands for Plain {
    async fn run(&self, kind: String, command: String) -> Result<String, CommandError> {
        if kind != UpdateUser::NAME {
            return Err(CommandError::new(ErrorKind::UnknownCommand, kind));
        }
        let c: UpdateUser = serde_json::from_str(&command)?;
        self.store
            .update(c.id, c.version)
            .await
            .map_err(|e| CommandError::new(ErrorKind::Database, e.to_string()))?;
        if let Some(cache) = &self.ttl {
            cache.invalidate(&c.id);
        }
        Ok("null".to_owned())
    }
}

/// The `ttl` readers' getter: a moka cache with a 1 s TTL in front of the direct query.
pub(crate) struct TtlUsers {
    pub(crate) cache: moka::sync::Cache<u64, User>,
    pub(crate) store: Arc<Store>,
}

impl Getter for TtlUsers {
    async fn get(&self, id: u64) -> Result<User, StoreError> {
        if let Some(user) = self.cache.get(&id) {
            return Ok(user);
        }
        let user = self.store.get(id).await?;
        self.cache.insert(id, user);
        Ok(user)
    }
}

/// The hidden `cluster-host` subcommand's arguments (the parent sets them).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct HostArgs {
    /// The PostgreSQL schema holding the users table and the operation log.
    #[arg(long)]
    schema: String,
    /// `pg` or `nats`.
    #[arg(long)]
    notifier: String,
    /// `cached`, `direct` or `ttl`.
    #[arg(long)]
    mode: String,
    /// The board file.
    #[arg(long)]
    board: PathBuf,
    /// The run's time base, µs since the epoch.
    #[arg(long)]
    base_us: u64,
    /// The PostgreSQL URL.
    #[arg(long)]
    url: String,
    /// The NATS URL.
    #[arg(long)]
    nats: String,
}

impl HostArgs {
    /// The command line of a host with these settings.
    pub(crate) fn command_line(
        schema: &str,
        notifier: &str,
        mode: &str,
        board: &std::path::Path,
        base_us: u64,
        url: &str,
        nats: &str,
    ) -> Vec<String> {
        [
            ("--schema", schema.to_owned()),
            ("--notifier", notifier.to_owned()),
            ("--mode", mode.to_owned()),
            ("--board", board.display().to_string()),
            ("--base-us", base_us.to_string()),
            ("--url", url.to_owned()),
            ("--nats", nats.to_owned()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_owned(), v])
        .collect()
    }
}

/// What each read checks against.
struct Checks {
    board: Board,
    floors: Arc<Floors>,
    base_us: u64,
}

type Spawn = dyn Fn(usize, Arc<AtomicBool>) -> Vec<JoinHandle<Counts>> + Send + Sync;

fn spawner<G: Getter>(
    getter: Arc<G>,
    checks: Arc<Checks>,
    runtime: tokio::runtime::Handle,
) -> Box<Spawn> {
    Box::new(move |readers, stop| {
        (0..readers)
            .map(|i| {
                runtime.spawn(read_loop(
                    getter.clone(),
                    checks.clone(),
                    stop.clone(),
                    0x9E37_79B9_7F4A_7C15u64.wrapping_mul(i as u64 + 1)
                        ^ u64::from(std::process::id()),
                ))
            })
            .collect()
    })
}

/// Reads random users until `stop`, checking each read: `stale_reads` (it started at least
/// `GRACE_US` after the mutator got the answer of a newer version's command) and
/// `stale_after_apply` (it started after this host applied a newer version).
async fn read_loop<G: Getter>(
    getter: Arc<G>,
    checks: Arc<Checks>,
    stop: Arc<AtomicBool>,
    seed: u64,
) -> Counts {
    let mut ids = Ids(seed | 1);
    let mut counts = Counts::default();
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..BATCH {
            let id = ids.next();
            let started = now_us().saturating_sub(checks.base_us);
            let (returned, returned_at) = checks.board.read(id);
            let applied = checks.floors.get(id);
            let user = std::hint::black_box(getter.get(id).await.expect("the store answers"));
            if user.version < returned && started >= returned_at + GRACE_US {
                counts.stale_reads += 1;
            }
            if user.version < applied {
                counts.stale_after_apply += 1;
            }
            counts.calls += 1;
        }
        // Hits never wait: yield, so that the RPC services and the host's tasks run.
        tokio::task::yield_now().await;
    }
    counts
}

struct Running {
    stop: Arc<AtomicBool>,
    started: Instant,
    tasks: Vec<JoinHandle<Counts>>,
}

struct ControlImpl {
    spawn: Box<Spawn>,
    /// The cached host (its acknowledgement counters).
    host: Option<Host>,
    running: tokio::sync::Mutex<Option<Running>>,
    propagation: Arc<Mutex<Propagation>>,
}

impl Control for ControlImpl {
    async fn start(&self, readers: u32) -> bool {
        let mut running = self.running.lock().await;
        if running.is_some() {
            return false;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (self.spawn)(readers as usize, stop.clone());
        *running = Some(Running {
            stop,
            started: Instant::now(),
            tasks,
        });
        true
    }

    async fn stop(&self) -> Counts {
        let Some(running) = self.running.lock().await.take() else {
            return Counts::default();
        };
        running.stop.store(true, Ordering::Relaxed);
        let elapsed = running.started.elapsed();
        let mut total = Counts {
            elapsed_us: u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX),
            ack_timeouts: self.host.as_ref().map_or(0, |h| h.stats().ack_timeouts),
            ..Counts::default()
        };
        for task in running.tasks {
            let c = task.await.expect("a reader task");
            total.calls += c.calls;
            total.stale_reads += c.stale_reads;
            total.stale_after_apply += c.stale_after_apply;
        }
        total
    }

    async fn propagation(&self) -> Propagation {
        std::mem::take(&mut *self.propagation.lock())
    }
}

/// The child's `main`.
pub(crate) fn main(args: HostArgs) -> anyhow::Result<()> {
    // Ends with the parent, however it ends: its end of our stdin closes.
    std::thread::spawn(|| {
        let mut buf = [0u8; 64];
        let mut stdin = std::io::stdin();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => std::process::exit(0),
                Ok(_) => {}
            }
        }
    });
    // Two runtimes: the readers (the load: busy loops over hits that never wait) on
    // `cores()` workers under SCHED_IDLE, and the host's service side (the coherent-ops host
    // and its notifier, the RPC endpoint) on one thread of its own at the normal policy,
    // which sleeps in epoll until a notification or a call comes. With readers at the
    // normal policy, every hop of a notification (the NOTIFY's backend, the listeners'
    // backends, the host's thread) waited for a time slice on these oversubscribed cores
    // (three hosts' busy workers, PostgreSQL and the parent on 2 cores): a p99 of 12-15 ms
    // from commit to applied under readers (at nice 10: 3-4 ms, and still a tail past
    // 10 ms), an artefact of readers that never wait (a service's request handlers wait on
    // I/O), not of the pipeline. Under SCHED_IDLE the readers get every cycle nothing else
    // wants, and anything else that wakes up preempts them at once.
    let readers = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores())
        .thread_name("readers")
        .on_thread_start(crate::report::sched_idle)
        .enable_all()
        .build()?;
    let service = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("service")
        .enable_all()
        .build()?;
    let readers_handle = readers.handle().clone();
    service.block_on(async move {
        let endpoint = serve(&args, readers_handle).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "ADDR {addr}")?;
            out.flush()?;
        }
        endpoint.serve_tcp(listener).await?;
        anyhow::Ok(())
    })
}

/// Readers' connections per host (direct and ttl; cached misses use it too).
const READ_POOL: usize = 8;

async fn serve(args: &HostArgs, readers: tokio::runtime::Handle) -> anyhow::Result<Endpoint> {
    let board = Board::open(&args.board)?;
    let floors = Arc::new(Floors::new());
    let checks = Arc::new(Checks {
        board,
        floors: floors.clone(),
        base_us: args.base_us,
    });
    let mut config: tokio_postgres::Config = args.url.parse()?;
    config.options(format!("-c search_path={}", args.schema));
    let store = Arc::new(Store::postgres_with(config, READ_POOL)?);
    let propagation = Arc::new(Mutex::new(Propagation::default()));
    let builder = Endpoint::builder();
    let (builder, spawn, cached_host) = match args.mode.as_str() {
        "cached" => {
            let registry = Registry::new();
            let service = UserService::new(store.clone(), &registry);
            let notifier = match args.notifier.as_str() {
                "pg" => Notifier::Postgres,
                "nats" => Notifier::Nats(args.nats.clone()),
                other => anyhow::bail!("unknown notifier {other:?}"),
            };
            let db = Database::postgres_in_schema(&args.url, &args.schema).await?;
            let host = Host::builder(db)
                .registry(&registry)
                .notifier(notifier)
                // An A/B switch for measuring the lease's cost on the hit path (a coarse
                // clock read per hit): COHERENT_BENCH_NO_LEASE=1 turns it off.
                .lease(if std::env::var_os("COHERENT_BENCH_NO_LEASE").is_some() {
                    None
                } else {
                    Some(Duration::from_millis(250))
                })
                .command::<UpdateUser>(Users {
                    service: Some(service.clone()),
                    floors,
                })
                .start()
                .await?;
            // Wait for the notifier (a command committed before it listens would reach this
            // host by the log only).
            let deadline = Instant::now() + Duration::from_secs(10);
            while !host.notifier_connected() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            anyhow::ensure!(host.notifier_connected(), "the notifier did not connect");
            let mut applied = host.subscribe();
            let samples = propagation.clone();
            tokio::spawn(async move {
                use tokio::sync::broadcast::error::RecvError;
                loop {
                    match applied.recv().await {
                        Ok(a) if a.via == Via::Local => {}
                        Ok(a) => {
                            let mut s = samples.lock();
                            s.samples_us.push(a.applied_at - a.committed_at);
                            if a.via == Via::Log {
                                s.via_log += 1;
                            }
                        }
                        Err(RecvError::Lagged(n)) => samples.lock().lagged += n,
                        Err(RecvError::Closed) => return,
                    }
                }
            });
            (
                builder.service(CommandServer::new(host.clone())),
                spawner(Arc::new(service), checks, readers),
                Some(host),
            )
        }
        "direct" => (
            builder.service(CommandServer::new(Plain {
                store: store.clone(),
                ttl: None,
            })),
            spawner(store, checks, readers),
            None,
        ),
        "ttl" => {
            let cache = moka::sync::Cache::builder()
                .max_capacity(USERS * 2)
                .time_to_live(Duration::from_secs(1))
                .build();
            (
                builder.service(CommandServer::new(Plain {
                    store: store.clone(),
                    ttl: Some(cache.clone()),
                })),
                spawner(Arc::new(TtlUsers { cache, store }), checks, readers),
                None,
            )
        }
        other => anyhow::bail!("unknown mode {other:?}"),
    };
    Ok(builder
        .service(ControlServer::new(ControlImpl {
            spawn,
            host: cached_host,
            running: tokio::sync::Mutex::new(None),
            propagation,
        }))
        .build())
}
