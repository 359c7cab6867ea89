//! Replicas end to end: a compute service behind an RPC server, client compute methods
//! reading it through `RemoteClient::replica`, and the server's invalidations arriving.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use coherent::{compute_service, ComputeService, ComputedState, ServiceHandle};
use coherent_remote::RemoteClient;
use coherent_rpc::{Endpoint, ErrorCode, RpcError};
use parking_lot::Mutex;

use crate::support::*;

/// The client's compute service: a replica of `Users.name`, and a greeting computed from
/// it; `log` records which client methods ran.
#[derive(Clone, ComputeService)]
struct View {
    handle: ServiceHandle,
    remote: RemoteClient,
    log: Arc<Mutex<Vec<String>>>,
}

#[compute_service]
impl View {
    #[compute]
    async fn name(&self, id: u64) -> Result<Option<String>, RpcError> {
        self.log.lock().push(format!("name({id})"));
        self.remote.replica("Users.name", (id,)).await
    }

    #[compute]
    async fn greeting(&self, id: u64) -> String {
        self.log.lock().push(format!("greeting({id})"));
        match self.name(id).await {
            Ok(Some(name)) => format!("hello, {name}"),
            Ok(None) => "hello, nobody".to_owned(),
            Err(e) => format!("no greeting: {e}"),
        }
    }
}

impl View {
    fn new(remote: RemoteClient) -> Self {
        Self::in_registry(remote, coherent::Registry::global())
    }

    fn in_registry(remote: RemoteClient, registry: &coherent::Registry) -> Self {
        Self {
            handle: ServiceHandle::with_registry(registry),
            remote,
            log: Arc::default(),
        }
    }

    fn take_log(&self) -> Vec<String> {
        std::mem::take(&mut *self.log.lock())
    }
}

#[tokio::test]
async fn a_replica_is_fetched_once_and_recomputed_only_after_the_server_invalidates_it() {
    let users = Users::new();
    let remote = RemoteClient::connect_tcp(serve(&users).await)
        .await
        .unwrap();
    let view = View::new(remote.clone());

    assert_eq!(view.greeting(1).await, "hello, ann");
    assert_eq!(view.take_log(), ["greeting(1)", "name(1)"]);
    assert_eq!(users.runs(), 1);
    let calls = remote.connection().unwrap().stats().calls_out;

    // Cached on the client: no method runs, no call goes out.
    assert_eq!(view.greeting(1).await, "hello, ann");
    assert!(view.take_log().is_empty());
    assert_eq!(remote.connection().unwrap().stats().calls_out, calls);

    let greeting = view.greeting_computed(1).await;
    users.rename(1, "anna");
    within("the pushed invalidation", greeting.when_invalidated()).await;
    assert_eq!(view.greeting(1).await, "hello, anna");
    assert_eq!(view.take_log(), ["greeting(1)", "name(1)"]);
    assert_eq!(users.runs(), 2);
}

#[tokio::test]
async fn a_write_invalidates_only_the_replicas_of_what_it_changed() {
    let users = Users::new();
    let remote = RemoteClient::connect_tcp(serve(&users).await)
        .await
        .unwrap();
    let view = View::new(remote);
    assert_eq!(view.greeting(1).await, "hello, ann");
    assert_eq!(view.greeting(2).await, "hello, bob");
    view.take_log();

    let one = view.greeting_computed(1).await;
    users.rename(1, "anna");
    within("the pushed invalidation", one.when_invalidated()).await;
    assert_eq!(view.greeting(2).await, "hello, bob");
    assert_eq!(view.greeting(1).await, "hello, anna");
    assert_eq!(view.take_log(), ["greeting(1)", "name(1)"]);
}

#[tokio::test]
async fn a_computed_state_on_the_client_follows_the_servers_data() {
    let users = Users::new();
    let remote = RemoteClient::connect_tcp(serve(&users).await)
        .await
        .unwrap();
    let view = View::new(remote);
    let state = {
        let view = view.clone();
        ComputedState::builder()
            .update_delay(Duration::ZERO)
            .build(move || {
                let view = view.clone();
                async move { view.greeting(1).await }
            })
            .await
    };
    let mut watch = state.watch();
    assert_eq!(*watch.borrow_and_update(), "hello, ann");
    users.rename(1, "anna");
    within("the state's update", watch.changed()).await.unwrap();
    assert_eq!(*watch.borrow(), "hello, anna");
}

#[tokio::test]
async fn one_write_invalidates_a_thousand_replicas_with_one_message_each() {
    let users = Users::new();
    let server = server_endpoint(&users);
    let mut views = Vec::new();
    let mut greetings = Vec::new();
    for _ in 0..1000 {
        let (a, b) = tokio::io::duplex(64 * 1024);
        let accepting = server.clone();
        tokio::spawn(async move { accepting.accept(a).await });
        let remote = RemoteClient::builder().connect(b).await.unwrap();
        let view = View::new(remote);
        assert_eq!(view.greeting(1).await, "hello, ann");
        greetings.push(view.greeting_computed(1).await);
        views.push(view);
    }
    // One server computation served every replica.
    assert_eq!(users.runs(), 1);
    let before: u64 = views
        .iter()
        .map(|v| v.remote.connection().unwrap().stats().calls_in)
        .sum();
    users.rename(1, "anna");
    for g in &greetings {
        within("every pushed invalidation", g.when_invalidated()).await;
    }
    let after: u64 = views
        .iter()
        .map(|v| v.remote.connection().unwrap().stats().calls_in)
        .sum();
    assert_eq!(after - before, 1000, "one invalidation message per replica");
    for view in &views {
        assert_eq!(view.greeting(1).await, "hello, anna");
    }
    assert_eq!(users.runs(), 2);
}

#[tokio::test]
async fn a_closed_client_invalidates_every_replica_and_serves_nothing_stale() {
    let users = Users::new();
    let remote = RemoteClient::connect_tcp(serve(&users).await)
        .await
        .unwrap();
    let view = View::new(remote.clone());
    assert_eq!(view.greeting(1).await, "hello, ann");
    assert_eq!(remote.replica_count(), 1);
    let greeting = view.greeting_computed(1).await;
    remote.close();
    within("the invalidation on close", greeting.when_invalidated()).await;
    assert_eq!(remote.replica_count(), 0);
    // Nothing stale is served: the next read asks again and reports the closed client.
    let err = view.name(1).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Disconnected, "{err}");
}

/// Where a test's client connects, and a gate that holds reconnections back.
struct Switch {
    addr: Mutex<SocketAddr>,
    gate: tokio::sync::Semaphore,
}

impl Switch {
    /// `keep`: [`keep_replicas_through_disconnects`], to see the revalidation.
    ///
    /// [`keep_replicas_through_disconnects`]: coherent_remote::RemoteClientBuilder::keep_replicas_through_disconnects
    async fn client(addr: SocketAddr, keep: bool) -> (Arc<Switch>, RemoteClient) {
        let switch = Arc::new(Switch {
            addr: Mutex::new(addr),
            gate: tokio::sync::Semaphore::new(1),
        });
        let s = switch.clone();
        let remote = RemoteClient::builder()
            .keep_replicas_through_disconnects(keep)
            .connect_with(move |endpoint| {
                let s = s.clone();
                async move {
                    s.gate.acquire().await.expect("open").forget();
                    let addr = *s.addr.lock();
                    endpoint.connect_tcp(addr).await
                }
            })
            .await
            .unwrap();
        (switch, remote)
    }

    /// Drops the connection; the client reconnects once `open` is called.
    fn cut(&self, remote: &RemoteClient) {
        remote.connection().expect("connected").close();
    }

    fn open(&self) {
        self.gate.add_permits(1);
    }
}

#[tokio::test]
async fn after_a_reconnect_only_the_replicas_that_changed_meanwhile_are_invalidated() {
    let users = Users::new();
    let (switch, remote) = Switch::client(serve(&users).await, true).await;
    let view = View::new(remote.clone());
    assert_eq!(view.greeting(1).await, "hello, ann");
    assert_eq!(view.greeting(2).await, "hello, bob");
    let (one, two) = (
        view.greeting_computed(1).await,
        view.greeting_computed(2).await,
    );
    view.take_log();

    switch.cut(&remote);
    // Written while the client is away: no push can reach it.
    users.rename(1, "anna");
    switch.open();
    remote.revalidated(1).await;
    assert_eq!(remote.connections(), 2);
    within("the revalidation's invalidation", one.when_invalidated()).await;
    assert!(
        two.is_consistent(),
        "an unchanged replica survives the reconnect"
    );
    assert_eq!(view.greeting(1).await, "hello, anna");
    assert_eq!(view.greeting(2).await, "hello, bob");
    assert_eq!(view.take_log(), ["greeting(1)", "name(1)"]);

    // Watched again on the new connection: a later write is pushed as usual.
    users.rename(2, "bobby");
    within("the pushed invalidation", two.when_invalidated()).await;
    assert_eq!(view.greeting(2).await, "hello, bobby");
}

#[tokio::test]
async fn a_server_restart_is_survived_and_what_it_answers_differently_is_invalidated() {
    let before = Users::new();
    let (switch, remote) = Switch::client(serve(&before).await, true).await;
    let view = View::new(remote.clone());
    assert_eq!(view.greeting(1).await, "hello, ann");
    assert_eq!(view.greeting(2).await, "hello, bob");
    let (one, two) = (
        view.greeting_computed(1).await,
        view.greeting_computed(2).await,
    );
    view.take_log();

    // A new server process: a fresh cache over data in which user 2 changed.
    let after = Users::new();
    after.rename(2, "robert");
    *switch.addr.lock() = serve(&after).await;
    switch.cut(&remote);
    switch.open();
    remote.revalidated(1).await;
    within("the revalidation's invalidation", two.when_invalidated()).await;
    assert!(one.is_consistent(), "user 1 is the same on the new server");
    assert_eq!(view.greeting(2).await, "hello, robert");
    assert_eq!(view.greeting(1).await, "hello, ann");
    assert_eq!(view.take_log(), ["greeting(2)", "name(2)"]);
}

#[tokio::test]
async fn a_disconnect_invalidates_the_replicas_at_once_so_that_reads_go_to_the_server() {
    let users = Users::new();
    let (switch, remote) = Switch::client(serve(&users).await, false).await;
    let view = View::new(remote.clone());
    assert_eq!(view.greeting(1).await, "hello, ann");
    let greeting = view.greeting_computed(1).await;

    switch.cut(&remote);
    within(
        "the invalidation on disconnect",
        greeting.when_invalidated(),
    )
    .await;
    assert_eq!(remote.replica_count(), 0);
    // Written while the client is away; the server does not wait for it.
    users.rename(1, "anna");
    let read = tokio::spawn({
        let view = view.clone();
        async move { view.greeting(1).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!read.is_finished(), "the read waits for the server");
    switch.open();
    assert_eq!(within("the read", read).await.unwrap(), "hello, anna");
}

/// A TCP proxy that can turn the connections it carries into black holes: they stay open
/// at both ends and carry nothing (a NAT or a firewall that forgot them, a host gone
/// without a word). Connections made afterwards go through.
struct Proxy {
    addr: SocketAddr,
    holed: Arc<std::sync::atomic::AtomicU64>,
}

impl Proxy {
    async fn to(upstream: SocketAddr) -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let holed = Arc::new(AtomicU64::new(0));
        let generation = holed.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                let born = generation.load(Ordering::SeqCst);
                let (holed_in, holed_out) = (generation.clone(), generation.clone());
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                let pipe = |mut from: tokio::net::tcp::OwnedReadHalf,
                            mut to: tokio::net::tcp::OwnedWriteHalf,
                            holed: Arc<AtomicU64>| async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        match from.read(&mut buf).await {
                            // Nor does a black hole pass an end on: the other side's
                            // connection stays open until it gives up on its own.
                            Ok(0) | Err(_) if holed.load(Ordering::SeqCst) != born => {
                                return std::future::pending::<()>().await;
                            }
                            Ok(0) | Err(_) => return,
                            Ok(n) if holed.load(Ordering::SeqCst) == born => {
                                if to.write_all(&buf[..n]).await.is_err() {
                                    return;
                                }
                            }
                            // A black hole: read and dropped, nothing closed.
                            Ok(_) => {}
                        }
                    }
                };
                tokio::spawn(pipe(cr, sw, holed_in));
                tokio::spawn(pipe(sr, cw, holed_out));
            }
        });
        Self { addr, holed }
    }

    /// Every connection open now carries nothing from here on.
    fn black_hole(&self) {
        self.holed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[tokio::test]
async fn a_connection_dead_without_a_word_is_dropped_before_a_write_stops_waiting_for_it() {
    let users = Users::new();
    let server = remote_server(&users);
    let endpoint = Endpoint::builder().service(server.service()).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    tokio::spawn(async move { endpoint.serve_tcp(listener).await });
    let proxy = Proxy::to(upstream).await;
    // A registry of its own: the client's lease on it runs out while the connection is a
    // black hole, and fences every cache of that registry until the client drops the
    // connection (the other tests' caches are in the global one).
    let registry = coherent::Registry::new();
    let remote = RemoteClient::builder()
        .registry(&registry)
        .connect_tcp(proxy.addr)
        .await
        .unwrap();
    let view = View::in_registry(remote.clone(), &registry);
    assert_eq!(view.greeting(1).await, "hello, ann");
    let greeting = view.greeting_computed(1).await;

    proxy.black_hole();
    users.rename(1, "anna");
    // The push cannot be answered: the write waits the server's delivery timeout (5 s),
    // then returns without this client.
    within("the write's delivery", server.invalidations_delivered()).await;
    assert!(
        !greeting.is_consistent(),
        "the write returned while the client still answered from the old name"
    );
    assert_eq!(within("a read", view.greeting(1)).await, "hello, anna");
    assert!(remote.connections() >= 2, "it reconnected");
    within("the lost lease counted", async {
        while remote.leases_lost() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
}

#[tokio::test]
async fn a_clients_replicas_answer_no_longer_than_its_servers_cache_could() {
    // The server's results live in a registry of their own, which bounds its clients'
    // lease (what a cluster host's server does with the host's registry).
    let server_registry = coherent::Registry::new();
    let users = Users::in_registry(&server_registry);
    let server = remote_server(&users);
    server.lease_from(&server_registry);
    let endpoint = Endpoint::builder().service(server.service()).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { endpoint.serve_tcp(listener).await });
    let client_registry = coherent::Registry::new();
    let remote = RemoteClient::builder()
        .registry(&client_registry)
        .connect_tcp(addr)
        .await
        .unwrap();
    let view = View::in_registry(remote.clone(), &client_registry);
    assert_eq!(view.greeting(1).await, "hello, ann");
    view.take_log();

    // A write the server did not hear of, and its cache fenced (a host whose notifier is
    // down, or that is past its lease): it cannot tell what is current, so neither can
    // its client. Reads go to the server from the next renewal of the client's lease on.
    users.rename_unheard(1, "anna");
    server_registry.fence();
    within("the client's replica to be read anew", async {
        while view.greeting(1).await != "hello, anna" {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(
        client_registry.is_fenced(),
        "the client's lease is out while the server's cache is fenced"
    );
    assert_eq!(
        remote.leases_lost(),
        0,
        "a server that answers its caches are fenced costs the client no lease"
    );

    // Lifted: the client renews its lease, and answers from its replicas again.
    server_registry.unfence();
    within("the client's lease to be renewed", async {
        while client_registry.is_fenced() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert_eq!(view.greeting(1).await, "hello, anna");
    view.take_log();
    assert_eq!(view.greeting(1).await, "hello, anna");
    assert!(
        view.take_log().is_empty(),
        "answered from the client's cache"
    );
}

/// While a client's lease is out, every read of a computed over a replica computes again
/// and fetches the replica under a new id; the replica fetched before for the same
/// arguments is read by nothing current any more. It is let go at once: kept until the
/// registry prunes (after 100,000 inserts by default), the server's watches on the
/// connection grew with every read while the lease was out, toward `TooManyReplicas`
/// (issue 30, a review finding). Here the lease is out because a fetch slower than the
/// lease call's wait (500 ms) is always in flight; the server's own cache is fine, so it
/// keeps every watch it is given.
#[tokio::test]
async fn reads_while_the_lease_is_out_do_not_pile_up_watches_on_the_server() {
    let users = Users::new();
    let slow = Slow {
        handle: ServiceHandle::with_registry(&coherent::Registry::new()),
    };
    let server = remote_server(&users).expose(
        "Slow.wait",
        slow.clone(),
        |s: Slow, (ms,): (u64,)| async move { s.wait_computed(ms).await },
    );
    let endpoint = Endpoint::builder().service(server.service()).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { endpoint.serve_tcp(listener).await });
    let client_registry = coherent::Registry::new();
    let remote = RemoteClient::builder()
        .registry(&client_registry)
        .connect_tcp(addr)
        .await
        .unwrap();
    let view = View::in_registry(remote.clone(), &client_registry);
    assert_eq!(view.greeting(1).await, "hello, ann");
    let in_flight = {
        let remote = remote.clone();
        tokio::spawn(async move { remote.replica::<_, u64>("Slow.wait", (60_000u64,)).await })
    };
    within("the client's lease to run out", async {
        while !client_registry.is_fenced() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let before = server.stats().replicas_held;
    for _ in 0..300 {
        assert_eq!(view.greeting(1).await, "hello, ann");
    }
    assert!(client_registry.is_fenced(), "the lease stayed out");
    // Each read fetched (the lease is out), and let the replica read before it go.
    within(
        "the server to stop watching the replicas read before",
        async {
            while server.stats().replicas_held > before + 1 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        },
    )
    .await;
    // Still kept current: a write reaches the replica read last.
    users.rename(1, "anna");
    within("the rename to reach the client", async {
        while view.greeting(1).await != "hello, anna" {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    in_flight.abort();
}

#[tokio::test]
async fn plain_calls_make_a_round_trip_every_time() {
    let users = Users::new();
    // Without liveness pings, whose lease renewals are calls too: the count below is the
    // test's calls alone.
    let remote = RemoteClient::builder()
        .liveness(None)
        .connect_tcp(serve(&users).await)
        .await
        .unwrap();
    let calls = remote.connection().unwrap().stats().calls_out;
    for _ in 0..3 {
        let name: Option<String> = remote.call("Users.name", (2u64,)).await.unwrap();
        assert_eq!(name.as_deref(), Some("bob"));
    }
    assert_eq!(remote.connection().unwrap().stats().calls_out, calls + 3);
    assert_eq!(remote.replica_count(), 0);
    // Served from the server's cache: the method ran once.
    assert_eq!(users.runs(), 1);
}

#[tokio::test]
async fn unknown_methods_and_bad_arguments_are_clear_errors() {
    let users = Users::new();
    let remote = RemoteClient::connect_tcp(serve(&users).await)
        .await
        .unwrap();
    let err = remote
        .call::<_, Option<String>>("Users.nope", (1u64,))
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::UnknownMethod, "{err}");
    let err = remote
        .call::<_, Option<String>>("Users.name", ())
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::BadArguments, "{err}");
}

/// A compute method that takes a while.
#[derive(Clone, ComputeService)]
struct Slow {
    handle: ServiceHandle,
}

#[compute_service]
impl Slow {
    #[compute]
    async fn wait(&self, ms: u64) -> u64 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        ms
    }
}

/// A lease renewal waits for the fetches in flight when it came, but not for a slow
/// computation: the client is answered in time, and its connection is not taken for dead.
#[tokio::test]
async fn a_slow_fetch_does_not_make_the_client_drop_a_live_connection() {
    let slow = Slow {
        handle: ServiceHandle::with_registry(&coherent::Registry::new()),
    };
    let server = coherent_remote::RemoteServer::new().expose(
        "Slow.wait",
        slow.clone(),
        |s: Slow, (ms,): (u64,)| async move { s.wait_computed(ms).await },
    );
    let endpoint = Endpoint::builder().service(server.service()).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { endpoint.serve_tcp(listener).await });
    let remote = RemoteClient::builder()
        .registry(&coherent::Registry::new())
        .connect_tcp(addr)
        .await
        .unwrap();
    // Longer than the liveness timeout (2 s), with renewals every half second meanwhile.
    let fetched: u64 = within("the slow fetch", remote.replica("Slow.wait", (3_000u64,)))
        .await
        .unwrap();
    assert_eq!(fetched, 3_000);
    assert_eq!(remote.connections(), 1, "the connection was kept");
}
