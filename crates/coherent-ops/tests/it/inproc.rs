//! Several hosts in one process, each with its own cache, over one database.

use std::time::Duration;

use coherent::ConsistencyState;
use coherent_ops::{Database, ErrorKind, Notifier, Via};

use crate::support::{create_items, database_url, fresh_schema, host, FailAfterWrite, SetValue};

pub(crate) async fn sqlite_db(dir: &tempfile::TempDir) -> Database {
    let db = Database::sqlite(dir.path().join("cluster.db")).unwrap();
    create_items(&db, 10).await;
    db
}

pub(crate) async fn postgres_db(test: &str) -> Option<Database> {
    let url = database_url()?;
    let db = Database::postgres_in_schema(&url, &fresh_schema(test))
        .await
        .unwrap_or_else(|e| panic!("DATABASE_URL is set but PostgreSQL fails: {e}"));
    create_items(&db, 10).await;
    Some(db)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_options_set_the_schema_and_the_pool_size() {
    let Some(url) = database_url() else {
        return;
    };
    let schema = fresh_schema("options");
    let db = Database::postgres_with(
        &url,
        coherent_ops::PostgresOptions::default()
            .schema(&schema)
            .pool_size(3),
    )
    .await
    .unwrap();
    let pool = db.postgres_pool().unwrap();
    assert_eq!(pool.status().max_size, 3);
    let row = pool
        .get()
        .await
        .unwrap()
        .query_one("SELECT current_schema()", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), schema);
}

/// A write on A invalidates B's computed (and the diamond above it); B then reads the new
/// value. Returns how B applied it.
async fn write_on_a_reaches_b(db: Database, notifier: Option<Notifier>) -> Via {
    // Where a notifier carries operations, B reads the log only when woken: a poll that
    // came first would apply the operation from the log (correct, and what the polling
    // cases test, but on a loaded machine it would win the race now and then).
    let polls = notifier == Some(Notifier::Poll) || db.sqlite_path().is_some();
    let pick = |b: coherent_ops::HostBuilder| {
        let b = match notifier.clone() {
            Some(n) => b.notifier(n),
            None => b,
        };
        if polls {
            b
        } else {
            b.poll_interval(Duration::from_secs(3600))
        }
    };
    let (a, items_a) = host(&db, pick).await;
    let (b, items_b) = host(&db, pick).await;
    // Until B listens, A's operation would reach B through the log (correct, but not what
    // this test is about).
    wait_until(|| b.notifier_connected()).await;
    assert_eq!(items_b.pair(3, 3).await, Ok(0));
    let pair_b = items_b.pair_computed(3, 3).await;
    let value_a = items_a.value_computed(3).await;
    let mut applied_b = b.subscribe();

    assert_eq!(a.run(SetValue { id: 3, value: 7 }).await, Ok(0));
    // On A, before `run` returned.
    assert_eq!(value_a.state(), ConsistencyState::Invalidated);
    // On B, once it has applied the operation.
    let applied = tokio::time::timeout(Duration::from_secs(10), applied_b.recv())
        .await
        .expect("B applies A's operation")
        .unwrap();
    assert_eq!(&*applied.host, a.id());
    assert_eq!(&*applied.kind, "test.set_value");
    assert_eq!(pair_b.state(), ConsistencyState::Invalidated);
    assert_eq!(items_b.pair(3, 3).await, Ok(7007));
    assert_eq!(items_a.value(3).await, Ok(7));

    // A second write. B reads the log once after its listener connects (to catch what
    // it missed meanwhile); on a loaded machine that read may run late and apply the
    // first write before its notice comes. It runs once: of two writes (the second
    // commits after B applied the first: `run` waits for B's acknowledgement, or, when
    // hosts poll, for the test's wait), at least one arrives by the notifier.
    assert_eq!(a.run(SetValue { id: 3, value: 8 }).await, Ok(7));
    let second = tokio::time::timeout(Duration::from_secs(10), applied_b.recv())
        .await
        .expect("B applies A's second operation")
        .unwrap();
    assert_eq!(items_b.pair(3, 3).await, Ok(8008));

    // Nothing twice: a read of the log now finds both applied.
    b.catch_up().await.unwrap();
    let stats = b.stats();
    assert_eq!(stats.applied_notified + stats.applied_from_log, 2);
    assert_eq!(a.stats().commands, 2);
    a.stop().await;
    b.stop().await;
    if applied.via == Via::Notification {
        applied.via
    } else {
        second.via
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_write_on_one_host_reaches_the_other_by_polling() {
    let dir = tempfile::tempdir().unwrap();
    let via = write_on_a_reaches_b(sqlite_db(&dir).await, None).await;
    assert_eq!(via, Via::Log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_write_on_one_host_reaches_the_other_by_notify() {
    let Some(db) = postgres_db("notify").await else {
        return;
    };
    let via = write_on_a_reaches_b(db, None).await;
    assert_eq!(via, Via::Notification);
}

/// Two processes on one SQLite file, as two `Database`s: they read the same key of the
/// cluster (made once in the file), so each takes the other's sealed notices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_hosts_of_two_databases_on_one_file_hear_each_other_by_nats() {
    let Some(url) = nats_url() else { return };
    let dir = tempfile::tempdir().unwrap();
    let db_a = sqlite_db(&dir).await;
    let db_b = Database::sqlite(dir.path().join("cluster.db")).unwrap();
    let nats = |b: coherent_ops::HostBuilder| {
        b.notifier(Notifier::Nats(url.clone()))
            .poll_interval(Duration::from_secs(3600))
    };
    let (a, _) = host(&db_a, nats).await;
    let (b, items_b) = host(&db_b, nats).await;
    // Both past their rejoin (whose read of the log could apply A's write first).
    wait_until(|| {
        [&a, &b]
            .iter()
            .all(|h| h.notifier_connected() && !h.is_fenced())
            && a.stats().peers >= 1
    })
    .await;
    assert_eq!(items_b.value(4).await, Ok(0));
    // (One may reach B by a read of the log that a ping or a heartbeat owed; most by
    // their notices, none refused.)
    for value in 1..=5 {
        a.run(SetValue { id: 4, value }).await.unwrap();
    }
    wait_until(|| {
        let s = b.stats();
        s.applied_notified + s.applied_from_log >= 5
    })
    .await;
    assert_eq!(items_b.value(4).await, Ok(5));
    let (sa, sb) = (a.stats(), b.stats());
    assert!(sb.applied_notified >= 1, "{sb:?}");
    assert_eq!((sa.messages_refused, sb.messages_refused), (0, 0));
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_write_on_one_host_reaches_the_other_by_nats() {
    let Some(url) = nats_url() else { return };
    let Some(db) = postgres_db("nats").await else {
        return;
    };
    let via = write_on_a_reaches_b(db, Some(Notifier::Nats(url))).await;
    assert_eq!(via, Via::Notification);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_polling_alone_carries_operations() {
    let Some(db) = postgres_db("poll").await else {
        return;
    };
    let via = write_on_a_reaches_b(db, Some(Notifier::Poll)).await;
    assert_eq!(via, Via::Log);
}

/// `NATS_URL` (default `nats://127.0.0.1:4222`), or `None` (saying so) when nothing
/// listens there.
pub(crate) fn nats_url() -> Option<String> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let addr = url.trim_start_matches("nats://").to_owned();
    match std::net::TcpStream::connect(&addr) {
        Ok(_) => Some(url),
        Err(e) => {
            eprintln!("skipped: NATS is not reachable at {addr}: {e}");
            None
        }
    }
}

async fn a_failing_handler_writes_nothing_and_logs_nothing(db: Database) {
    let (a, items) = host(&db, |b| b).await;
    assert_eq!(items.value(4).await, Ok(0));
    let before = db.log_len().await.unwrap();
    let err = a.run(FailAfterWrite { id: 4 }).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Rejected);
    assert_eq!(db.log_len().await.unwrap(), before);
    // The write was rolled back: a fresh read (no cache) sees 0.
    items.invalidate_value(4);
    assert_eq!(items.value(4).await, Ok(0));
    assert_eq!(a.stats().command_errors, 1);
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_failing_handler_rolls_back() {
    let dir = tempfile::tempdir().unwrap();
    a_failing_handler_writes_nothing_and_logs_nothing(sqlite_db(&dir).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_failing_handler_rolls_back() {
    let Some(db) = postgres_db("rollback").await else {
        return;
    };
    a_failing_handler_writes_nothing_and_logs_nothing(db).await;
}

/// `Items.value` exposed on `remote`, and `host`'s commands, served on one endpoint on a
/// loopback port: its address.
async fn serve(
    remote: coherent::remote::RemoteServer,
    host: &coherent_ops::Host,
    items: &crate::support::Items,
) -> std::net::SocketAddr {
    let remote = remote.expose(
        "Items.value",
        items.clone(),
        |s, (id,): (i64,)| async move { s.value_computed(id).await },
    );
    let endpoint = coherent::rpc::Endpoint::builder()
        .service(remote.service())
        .service(coherent_ops::CommandServer::new(host.clone()))
        .build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { endpoint.serve_tcp(listener).await });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_client_runs_commands_and_its_replica_hears_of_them() {
    use coherent::prelude::*;
    use coherent_ops::CommandClient;

    let dir = tempfile::tempdir().unwrap();
    let db = sqlite_db(&dir).await;
    let (a, items) = host(&db, |b| b).await;
    let addr = serve(RemoteServer::new(), &a, &items).await;

    let client = RemoteClient::connect_tcp(addr).await.unwrap();
    let commands = CommandClient::new(client.caller());
    let replica: Result<i64, String> = client.replica("Items.value", (5i64,)).await.unwrap();
    assert_eq!(replica, Ok(0));

    // The answer is the handler's output (the previous value).
    assert_eq!(commands.run(&SetValue { id: 5, value: 9 }).await, Ok(0));
    assert_eq!(commands.run(&SetValue { id: 5, value: 10 }).await, Ok(9));
    let value: Result<i64, String> = client.call("Items.value", (5i64,)).await.unwrap();
    assert_eq!(value, Ok(10));

    // Errors travel as they are.
    let err = commands.run(&FailAfterWrite { id: 5 }).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Rejected);
    assert_eq!(err.message(), "refused after writing");
    // With the handler's own error, typed on this side of the wire too.
    assert_eq!(
        err.detail::<crate::support::Refusal>(),
        Some(crate::support::Refusal::AfterWrite { id: 5 })
    );
    assert_eq!(err.detail_json(), Some(r#"{"AfterWrite":{"id":5}}"#));
    assert_eq!(err.detail::<String>(), None, "not a String");
    let err = commands
        .run(&SetValue { id: 99, value: 1 })
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Database, "{err}");
    assert_eq!(a.stats().commands, 2);
    a.stop().await;
}

/// A client's cache of `Items.value`: answered from its replica, invalidated by the
/// server's push.
#[derive(Clone, coherent::ComputeService)]
struct Mirror {
    handle: coherent::ServiceHandle,
    client: coherent::remote::RemoteClient,
}

#[coherent::compute_service]
impl Mirror {
    #[compute]
    async fn value(&self, id: i64) -> Result<i64, String> {
        let answer: Result<i64, String> = self
            .client
            .replica("Items.value", (id,))
            .await
            .map_err(|e| e.to_string())?;
        answer
    }
}

/// `HostBuilder::serve_replicas`: a read on one client that starts after a command sent by
/// another client returned sees the command's write, every time. The reading client runs
/// on a runtime of its own, stalled while the command runs (a busy client: its connection
/// is not read meanwhile); the read it makes next comes before it reads the push off its
/// socket. Without the wait for delivery (the host built without `serve_replicas`), 23 of
/// the 40 reads answered an old value from the client's cache, some of them still after the
/// next stall; with it, none in 5 runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_on_another_client_after_a_command_returned_sees_its_write() {
    use coherent::prelude::*;
    use coherent_ops::CommandClient;

    let dir = tempfile::tempdir().unwrap();
    let db = sqlite_db(&dir).await;
    // The host's wait is for the connections of this server: its clones share them, so the
    // services may be exposed after the host is built.
    let remote = RemoteServer::new();
    let (a, items) = host(&db, |b| b.serve_replicas(&remote)).await;
    let addr = serve(remote, &a, &items).await;
    let writer = RemoteClient::connect_tcp(addr).await.unwrap();
    let commands = CommandClient::new(writer.caller());

    // The reader: a client on a one-thread runtime of its own.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let on_reader = runtime.handle().clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let driver = std::thread::spawn(move || runtime.block_on(stopped));
    let reader = on_reader
        .spawn(async move {
            let registry = Registry::new();
            Mirror {
                handle: ServiceHandle::with_registry(&registry),
                client: RemoteClient::builder()
                    .registry(&registry)
                    .connect_tcp(addr)
                    .await
                    .unwrap(),
            }
        })
        .await
        .unwrap();
    let read = |reader: Mirror| on_reader.spawn(async move { reader.value(7).await });

    let mut stale = Vec::new();
    for value in 1..=20i64 {
        let before = read(reader.clone()).await.unwrap();
        if before != Ok(value - 1) {
            stale.push((value - 1, before));
        }
        // The reader's thread busy for a while, from before the command is sent.
        let (busy, is_busy) = tokio::sync::oneshot::channel();
        let stall = on_reader.spawn(async move {
            let _ = busy.send(());
            std::thread::sleep(Duration::from_millis(30));
        });
        is_busy.await.unwrap();
        commands.run(&SetValue { id: 7, value }).await.unwrap();
        let after = read(reader.clone()).await.unwrap();
        stall.await.unwrap();
        if after != Ok(value) {
            stale.push((value, after));
        }
    }
    assert!(
        stale.is_empty(),
        "stale reads after a command returned: {stale:?}"
    );
    let _ = stop.send(());
    driver.join().unwrap().unwrap();
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_terminated_listener_flushes_the_cache_and_catches_up_from_the_log() {
    let Some(db) = postgres_db("listener").await else {
        return;
    };
    let (a, _items_a) = host(&db, |b| b).await;
    let (b, items_b) = host(&db, |b| b).await;
    wait_until(|| b.notifier_connected()).await;
    assert_eq!(items_b.value(1).await, Ok(0));
    assert_eq!(items_b.value(2).await, Ok(0));
    let cached_2 = items_b.value_computed(2).await;

    let pool = db.postgres_pool().unwrap().get().await.unwrap();
    let killed = pool
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            &[&format!("coherent-listener:{}", b.id())],
        )
        .await
        .unwrap();
    assert_eq!(killed, 1);
    // Whatever B cached is no longer trusted: item 2 did not change, yet it is recomputed.
    wait_until(|| b.stats().flushes >= 1).await;
    assert_eq!(cached_2.state(), ConsistencyState::Invalidated);

    // Writes while B's listener may still be down reach B through the log or, once it is
    // back, through notifications: either way B ends with the last value.
    for value in 1..=20 {
        a.run(SetValue { id: 1, value }).await.unwrap();
    }
    wait_until(|| b.notifier_connected()).await;
    b.catch_up().await.unwrap();
    assert_eq!(items_b.value(1).await, Ok(20));
    let s = b.stats();
    assert_eq!(s.applied_notified + s.applied_from_log, 20, "{s:?}");
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_started_later_reads_current_values_and_applies_only_later_operations() {
    let dir = tempfile::tempdir().unwrap();
    let db = sqlite_db(&dir).await;
    let (a, _) = host(&db, |b| b).await;
    for value in 1..=5 {
        a.run(SetValue { id: 6, value }).await.unwrap();
    }
    let (late, items) = host(&db, |b| b).await;
    assert_eq!(items.value(6).await, Ok(5));
    a.run(SetValue { id: 6, value: 6 }).await.unwrap();
    late.catch_up().await.unwrap();
    assert_eq!(items.value(6).await, Ok(6));
    let s = late.stats();
    assert_eq!(s.applied_notified + s.applied_from_log, 1, "{s:?}");
    a.stop().await;
    late.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_is_trimmed_once_every_live_host_has_passed_it() {
    let dir = tempfile::tempdir().unwrap();
    let db = sqlite_db(&dir).await;
    let short = |b: coherent_ops::HostBuilder| b.retention(Duration::from_millis(1));
    let (a, _) = host(&db, short).await;
    let (b, _) = host(&db, short).await;
    for value in 1..=10 {
        a.run(SetValue { id: 7, value }).await.unwrap();
    }
    assert_eq!(db.log_len().await.unwrap(), 10);
    // Both hosts pass the operations (and record it); then a trim deletes them.
    wait_until_async(|| async {
        a.catch_up().await.unwrap();
        b.catch_up().await.unwrap();
        a.trim().await.unwrap();
        db.log_len().await.unwrap() == 0
    })
    .await;
    a.stop().await;
    b.stop().await;
}

pub(crate) async fn wait_until(mut done: impl FnMut() -> bool) {
    wait_until_async(|| std::future::ready(done())).await;
}

/// Polls `done` until it holds; fails after a minute (a guard, not a timing assertion).
async fn wait_until_async<F: std::future::Future<Output = bool>>(mut done: impl FnMut() -> F) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !done().await {
        assert!(
            std::time::Instant::now() < deadline,
            "condition not reached in a minute"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whatever a stranger publishes on the hosts' subject is refused unread (it carries no
/// seal under the cluster's key), and the hosts go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_notifications_are_refused() {
    hostile_notifications(false).await;
}

/// With unsealed messages let in (a rolling upgrade from a release before seals), a
/// stranger's notices only wake the log reader: one that does not decode, or claims an
/// implausible position, is not applied, and one that claims a real operation's id with
/// other content does not keep the real one from being applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_unsealed_notifications_only_wake_the_log_reader() {
    hostile_notifications(true).await;
}

async fn hostile_notifications(accept_unsealed: bool) {
    let Some(url) = nats_url() else { return };
    let schema = if accept_unsealed {
        "hostile_unsealed"
    } else {
        "hostile"
    };
    let Some(db) = postgres_db(schema).await else {
        return;
    };
    let nats = |b: coherent_ops::HostBuilder| {
        b.notifier(Notifier::Nats(url.clone()))
            .accept_unsealed(accept_unsealed)
    };
    let (a, _) = host(&db, nats).await;
    let (b, items_b) = host(&db, nats).await;
    wait_until(|| b.notifier_connected()).await;
    assert_eq!(items_b.value(8).await, Ok(0));
    let subject = b.notification_channel().unwrap();
    assert_eq!(a.notification_channel(), Some(subject.clone()));

    let publisher = async_nats::connect(url.as_str()).await.unwrap();
    let next_id: i64 = db
        .postgres_pool()
        .unwrap()
        .get()
        .await
        .unwrap()
        .query_one(
            "SELECT coalesce(max(id), 0) + 1 FROM coherent_operations",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // Positions are PostgreSQL xids, shared by every test running against the server:
    // the forged notice claims one far enough ahead (but still plausible) that no
    // concurrent activity moves B's horizon past it before it arrives.
    let horizon = b.stats().horizon;
    let hostile = [
        b"not json".to_vec(),
        vec![0xff; 100_000],
        br#"{"id":1,"position":18446744073709551615,"host":"x","committed_at":0,"op":{"kind":"test.set_value","command":"{}","output":"0"}}"#.to_vec(),
        format!(r#"{{"id":{next_id},"position":{},"host":"x","committed_at":0,"op":{{"kind":"test.set_value","command":"{{}}","output":"0"}}}}"#, horizon + (1 << 30)).into_bytes(),
        br#"{"id":-5,"position":0,"host":"x","committed_at":0,"op":{"kind":"nope","command":"","output":""}}"#.to_vec(),
    ];
    for payload in hostile {
        publisher
            .publish(subject.clone(), payload.into())
            .await
            .unwrap();
    }
    publisher.flush().await.unwrap();
    if accept_unsealed {
        wait_until(|| b.stats().implausible >= 3).await;
    } else {
        // Not one sealed under the cluster's key: each refused unread.
        wait_until(|| b.stats().messages_refused >= 5).await;
    }

    // The operation whose id a notice claimed at another position is still applied.
    a.run(SetValue { id: 8, value: 42 }).await.unwrap();
    b.catch_up().await.unwrap();
    assert_eq!(items_b.value(8).await, Ok(42));
    let s = b.stats();
    if accept_unsealed {
        assert!(s.undecodable >= 1, "{s:?}");
    } else {
        assert_eq!((s.undecodable, s.implausible), (0, 0), "{s:?}");
    }
    assert!(b.notifier_connected());
    a.stop().await;
    b.stop().await;
}

/// Who may run commands over RPC: the application's own (trusted) connections, and
/// untrusted ones that authenticated; a policy of one's own decides per command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_trusted_or_authenticated_clients_run_commands_unless_a_policy_says_otherwise() {
    use coherent::prelude::*;
    use coherent_ops::{
        authenticated_or_trusted, CommandClient, CommandError, CommandServer, Guarded,
    };
    use coherent_rpc::{Config, Identity, Trust};

    let dir = tempfile::tempdir().unwrap();
    let db = sqlite_db(&dir).await;
    let (a, _items) = host(&db, |b| b).await;
    async fn serve(endpoint: Endpoint) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { endpoint.serve_tcp(listener).await });
        addr
    }
    async fn run(addr: std::net::SocketAddr, token: &str, value: i64) -> Result<i64, CommandError> {
        let client = Endpoint::builder().token(token).build();
        let peer = client.connect_tcp(addr).await.unwrap();
        CommandClient::new(peer)
            .run(&SetValue { id: 1, value })
            .await
    }
    let untrusted = || Config::default().trust(Trust::Untrusted);

    // Untrusted and anonymous: refused, and nothing ran.
    let open = serve(
        Endpoint::builder()
            .config(untrusted())
            .service(CommandServer::new(a.clone()))
            .build(),
    )
    .await;
    let e = run(open, "", 1).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unauthorized, "{e}");
    assert_eq!(a.stats().commands, 0);

    // Untrusted but authenticated: runs.
    let authenticated = serve(
        Endpoint::builder()
            .config(untrusted())
            .authenticate(|token: String| async move {
                match token.as_str() {
                    "alice-token" => Ok(Identity::new("alice")),
                    "bob-token" => Ok(Identity::new("bob")),
                    _ => Err("unknown token".to_owned()),
                }
            })
            .service(CommandServer::new(a.clone()))
            .build(),
    )
    .await;
    assert_eq!(run(authenticated, "alice-token", 2).await, Ok(0));
    // Its handler knows who sent it (`Tx::caller`), whichever task runs the batch.
    let peer = Endpoint::builder()
        .token("bob-token")
        .build()
        .connect_tcp(authenticated)
        .await
        .unwrap();
    let whoami = CommandClient::new(peer).run(&crate::support::Whoami).await;
    assert_eq!(whoami, Ok(Some("bob".to_owned())));

    // Trusted (a tier over TCP, the default): runs.
    let tiers = serve(
        Endpoint::builder()
            .service(CommandServer::new(a.clone()))
            .build(),
    )
    .await;
    assert_eq!(run(tiers, "", 3).await, Ok(2));
    let peer = Endpoint::builder()
        .build()
        .connect_tcp(tiers)
        .await
        .unwrap();
    let whoami = CommandClient::new(peer).run(&crate::support::Whoami).await;
    assert_eq!(whoami, Ok(None));

    // A policy of one's own: only alice.
    let guarded = serve(
        Endpoint::builder()
            .config(untrusted())
            .authenticate(|token: String| async move {
                Ok::<_, String>(Identity::new(token.trim_end_matches("-token").to_owned()))
            })
            .service(CommandServer::new(Guarded::new(a.clone(), |ctx, kind| {
                authenticated_or_trusted(ctx, kind)?;
                match ctx.identity().map(|i| i.name()) {
                    Some("alice") => Ok(()),
                    _ => Err(CommandError::unauthorized(format!("{kind}: alice only"))),
                }
            })))
            .build(),
    )
    .await;
    let e = run(guarded, "bob-token", 4).await.unwrap_err();
    assert_eq!(
        (e.kind(), e.message()),
        (ErrorKind::Unauthorized, "test.set_value: alice only")
    );
    assert_eq!(run(guarded, "alice-token", 5).await, Ok(3));
    assert_eq!(a.stats().commands, 5);
    a.stop().await;
}
