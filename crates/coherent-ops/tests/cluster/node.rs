//! A host process: the `Items` service over the database the parent names, a `Host` with
//! its handlers, RPC on 127.0.0.1:0, and a line protocol on stdin/stdout for the parent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use coherent::prelude::*;
use coherent_ops::{
    Applied, CommandError, CommandServer, Database, Handler, Host, Notifier, Tx, Via,
};
use coherent_remote::RemoteServer;
use coherent_rpc::Endpoint;
use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::watch;

use crate::support::{Items, Reader, SetValue};

/// Set (to anything) in a host process's environment.
pub(crate) const HOST_MODE: &str = "COHERENT_OPS_CLUSTER_HOST";

/// The `Items` handler of `SetValue`, with the fault hook of the kill test: when `hang` is
/// set, the next invalidation that runs (after the commit of a command run here, before
/// its local invalidation) says so on stdout and hangs, for the parent to kill -9 it.
#[derive(Clone)]
struct Hooked {
    items: Items,
    hang: Arc<AtomicBool>,
}

impl Handler<SetValue> for Hooked {
    async fn execute(&self, c: &SetValue, tx: &mut Tx<'_>) -> Result<i64, CommandError> {
        Handler::<SetValue>::execute(&self.items, c, tx).await
    }

    fn invalidate(&self, c: &SetValue, old: &i64) {
        if self.hang.swap(false, Ordering::SeqCst) {
            say("committed, not invalidated");
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        Handler::<SetValue>::invalidate(&self.items, c, old);
    }
}

fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "@@ {line}");
    let _ = out.flush();
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|s| !s.is_empty())
}

fn env_ms(name: &str) -> Option<Duration> {
    env(name).map(|s| Duration::from_millis(s.parse().unwrap()))
}

/// What the host applied of other hosts' operations, in order of arrival.
#[derive(Default)]
struct Record {
    foreign: Mutex<Vec<Applied>>,
}

/// The concurrent readers of the stale-read test.
struct Readers {
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<(u64, u64)>>,
}

pub(crate) async fn host_main() -> i32 {
    let db = match env("CL_SQLITE") {
        Some(path) => Database::sqlite(path).unwrap(),
        None => Database::postgres_in_schema(
            &env("CL_URL").expect("CL_URL"),
            &env("CL_SCHEMA").expect("CL_SCHEMA"),
        )
        .await
        .unwrap(),
    };
    let registry = Registry::new();
    let items = Items {
        handle: ServiceHandle::with_registry(&registry),
        reader: Reader::for_db(&db),
    };
    let hang = Arc::new(AtomicBool::new(false));
    // A command returns once this host's replica clients applied its invalidation (and
    // this host acknowledges another host's operation only then): the services are exposed
    // on this server below, its clones sharing the connections.
    let remote = RemoteServer::new();
    let mut builder = Host::builder(db.clone())
        .registry(&registry)
        .serve_replicas(&remote)
        .command::<SetValue>(Hooked {
            items: items.clone(),
            hang: hang.clone(),
        });
    if let Some(id) = env("CL_ID") {
        builder = builder.id(id);
    }
    match env("CL_NOTIFIER").as_deref() {
        None => {}
        Some("poll") => builder = builder.notifier(Notifier::Poll),
        Some("postgres") => builder = builder.notifier(Notifier::Postgres),
        Some(url) => builder = builder.notifier(Notifier::Nats(url.to_owned())),
    }
    if let Some(d) = env_ms("CL_POLL_MS") {
        builder = builder.poll_interval(d);
    }
    if let Some(d) = env_ms("CL_RETENTION_MS") {
        builder = builder.retention(d);
    }
    if let Some(d) = env_ms("CL_EXPIRY_MS") {
        builder = builder.host_expiry(d);
    }

    if let Some(slot) = env("CL_FEED") {
        // Issue 34: changes from outside the application invalidate `value` by id.
        let (row, all) = (items.clone(), items.clone());
        builder = builder
            .watch(
                coherent_ops::watch_table("items")
                    .on_change(move |change| {
                        for id in [change.key::<i64>("id"), change.old_key::<i64>("id")]
                            .into_iter()
                            .flatten()
                        {
                            row.invalidate_value(id);
                        }
                    })
                    .on_every_row(move || {
                        for id in 1..=20 {
                            all.invalidate_value(id);
                        }
                    }),
            )
            .change_feed(
                coherent_ops::ChangeFeed::postgres()
                    .slot(&slot)
                    .publication(&slot)
                    .poll_interval(Duration::from_millis(20))
                    .standby_interval(Duration::from_millis(100)),
            );
    }
    let host = builder.start().await.unwrap();

    // Every operation of another host applied here, from now on.
    let record = Arc::new(Record::default());
    let (count_tx, count_rx) = watch::channel(0usize);
    let floor = Arc::new(AtomicI64::new(i64::MIN));
    {
        let mut rx = host.subscribe();
        let record = record.clone();
        let floor = floor.clone();
        let db = db.clone();
        tokio::spawn(async move {
            loop {
                let applied = match rx.recv().await {
                    Ok(a) => a,
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        panic!("the applied events lagged by {n}")
                    }
                    Err(_) => return,
                };
                if applied.via == Via::Local || &*applied.kind != "test.set_value" {
                    continue;
                }
                // The value the operation wrote: from here on no read may see an older
                // one (values only grow in the tests that look).
                if let Some(value) = logged_value(&db, applied.id).await {
                    floor.fetch_max(value, Ordering::SeqCst);
                }
                let n = {
                    let mut foreign = record.foreign.lock();
                    foreign.push(applied);
                    foreign.len()
                };
                count_tx.send_replace(n);
            }
        });
    }

    let remote = remote
        .expose(
            "Items.value",
            items.clone(),
            |i: Items, (id,): (i64,)| async move { i.value_computed(id).await },
        )
        .expose(
            "Items.pair",
            items.clone(),
            |i: Items, (a, b): (i64, i64)| async move { i.pair_computed(a, b).await },
        );
    let endpoint = Endpoint::builder()
        .service(remote.service())
        .service(CommandServer::new(host.clone()))
        .build();
    let bind = env("CL_BIND").unwrap_or_else(|| "127.0.0.1:0".to_owned());
    let listener = tokio::net::TcpListener::bind(bind).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { endpoint.serve_tcp(listener).await });
    say(&format!("ready {} {addr}", host.id()));

    let mut readers: Option<Readers> = None;
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> i64 { words[i].parse().unwrap() };
        let answer = match words.first().copied() {
            Some("read") => match items.value(num(1)).await {
                Ok(v) => format!("value {v}"),
                Err(e) => format!("err {e}"),
            },
            Some("pair") => match items.pair(num(1), num(2)).await {
                Ok(v) => format!("value {v}"),
                Err(e) => format!("err {e}"),
            },
            Some("set") => {
                let mut rx = host.subscribe();
                match host
                    .run(SetValue {
                        id: num(1),
                        value: num(2),
                    })
                    .await
                {
                    Ok(old) => {
                        // The local event is sent before `run` returns.
                        let mut op = None;
                        while let Ok(a) = rx.try_recv() {
                            if a.via == Via::Local {
                                op = Some(a.id);
                            }
                        }
                        format!("set {old} {}", op.expect("the local applied event"))
                    }
                    Err(e) => format!("err {e}"),
                }
            }
            Some("hang_next") => {
                hang.store(true, Ordering::SeqCst);
                "ok".to_owned()
            }
            Some("applied") => {
                let foreign = record.foreign.lock();
                let list: Vec<String> = foreign
                    .iter()
                    .map(|a| format!("{}:{:?}:{}", a.id, a.via, a.host))
                    .collect();
                format!("applied {}", list.join(" "))
            }
            Some("wait_applied") => {
                let n = usize::try_from(num(1)).unwrap();
                let mut rx = count_rx.clone();
                let reached =
                    tokio::time::timeout(Duration::from_secs(60), rx.wait_for(|&c| c >= n))
                        .await
                        .is_ok();
                let count = *rx.borrow();
                if reached {
                    format!("applied_count {count}")
                } else {
                    format!("timeout {count}")
                }
            }
            Some("stats") => {
                let s = host.stats();
                format!(
                    "stats commands={} notified={} from_log={} duplicates={} flushes={} \
                     trimmed={} horizon={} connected={} fences={} leases_lost={}",
                    s.commands,
                    s.applied_notified,
                    s.applied_from_log,
                    s.duplicates,
                    s.flushes,
                    s.trimmed,
                    s.horizon,
                    u8::from(host.notifier_connected()),
                    s.fences,
                    s.leases_lost
                )
            }
            Some("feed") => match host.feed_stats() {
                Some(f) => format!(
                    "feed leading={} operations={} slots_created={} errors={}",
                    u8::from(f.leading),
                    f.operations,
                    f.slots_created,
                    f.errors
                ),
                None => "feed none".to_owned(),
            },
            Some("catchup") => match host.catch_up().await {
                Ok(()) => "ok".to_owned(),
                Err(e) => format!("err {e}"),
            },
            Some("trim") => match host.trim().await {
                Ok(n) => format!("trimmed {n}"),
                Err(e) => format!("err {e}"),
            },
            Some("loglen") => format!("loglen {}", db.log_len().await.unwrap()),
            Some("readers_start") => {
                let id = num(1);
                let (stop, _) = watch::channel(false);
                let tasks = (0..2)
                    .map(|_| {
                        let (items, floor, mut stop) =
                            (items.clone(), floor.clone(), stop.subscribe());
                        tokio::spawn(async move {
                            let (mut reads, mut stale) = (0u64, 0u64);
                            while !*stop.borrow_and_update() {
                                // Every operation applied before the read starts.
                                let at_least = floor.load(Ordering::SeqCst);
                                let value = items.value(id).await.unwrap();
                                reads += 1;
                                if value < at_least {
                                    stale += 1;
                                }
                                tokio::task::yield_now().await;
                            }
                            (reads, stale)
                        })
                    })
                    .collect();
                readers = Some(Readers { stop, tasks });
                "ok".to_owned()
            }
            Some("readers_stop") => {
                let r = readers.take().expect("readers_start first");
                r.stop.send_replace(true);
                let (mut reads, mut stale) = (0, 0);
                for t in r.tasks {
                    let (n, s) = t.await.unwrap();
                    reads += n;
                    stale += s;
                }
                let mut windows: Vec<i64> = record
                    .foreign
                    .lock()
                    .iter()
                    .map(|a| a.applied_at - a.committed_at)
                    .collect();
                windows.sort_unstable();
                let pick = |q: f64| {
                    windows
                        .get(((windows.len() as f64 - 1.0) * q).round() as usize)
                        .copied()
                        .unwrap_or(0)
                };
                let vias: HashMap<String, usize> =
                    record
                        .foreign
                        .lock()
                        .iter()
                        .fold(HashMap::new(), |mut m, a| {
                            *m.entry(format!("{:?}", a.via)).or_default() += 1;
                            m
                        });
                format!(
                    "readers reads={reads} stale_after_apply={stale} floor={} \
                     window_us_p50={} window_us_p99={} window_us_max={} vias={vias:?}",
                    floor.load(Ordering::SeqCst),
                    pick(0.5),
                    pick(0.99),
                    pick(1.0),
                )
            }
            Some("stop") => {
                host.stop().await;
                say("stopped");
                return 0;
            }
            _ => format!("err unknown command {line:?}"),
        };
        say(&answer);
    }
    // The parent is gone.
    0
}

/// The value the logged `SetValue` operation `id` wrote (`None` once trimmed).
async fn logged_value(db: &Database, id: i64) -> Option<i64> {
    let command: Option<String> = match (db.sqlite_path(), db.postgres_pool()) {
        (Some(path), _) => crate::support::open_sqlite(path)
            .query_row(
                "SELECT command FROM coherent_operations WHERE id = ?1",
                rusqlite::params![id],
                |r| r.get(0),
            )
            .ok(),
        (None, Some(pool)) => pool
            .get()
            .await
            .unwrap()
            .query_opt(
                "SELECT command FROM coherent_operations WHERE id = $1",
                &[&id],
            )
            .await
            .unwrap()
            .map(|r| r.get(0)),
        (None, None) => unreachable!(),
    };
    let c: SetValue = serde_json::from_str(&command?).unwrap();
    Some(c.value)
}
