//! What the server keeps for the clients that hold replicas, and what a write waits for:
//! one callback per held replica, taken back on release, replacement and disconnect; writes
//! that wait for trusted holders and for the writer's own connection, never for an untrusted
//! client that stopped answering. The misbehaving clients speak the replica protocol by
//! hand, as a Node or browser client does.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use coherent::{compute_service, ComputeService, ServiceHandle};
use coherent_remote::{RemoteClient, RemoteServer};
use coherent_rpc::{method_id, service, Blob, Config, Endpoint, Peer, RpcError, Trust};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, Semaphore};

use crate::support::*;

/// The replica protocol as `coherent-remote` speaks it (`src/wire.rs`): same names, same
/// shapes, so the same method ids and encodings.
mod protocol {
    use super::*;

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub(crate) enum Failure {
        UnknownMethod(u32),
        BadArguments(String),
        BadValue(String),
        TooManyReplicas(usize),
    }

    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub(crate) struct Held {
        pub(crate) replica: u64,
        pub(crate) method: u32,
        pub(crate) args: Blob,
        pub(crate) hash: u64,
    }

    #[service]
    pub(crate) trait ReplicaHost {
        async fn fetch(&self, method: u32, args: Blob, replica: u64) -> Result<Blob, Failure>;
        async fn call(&self, method: u32, args: Blob) -> Result<Blob, Failure>;
        async fn revalidate(&self, replicas: Vec<Held>) -> Vec<u64>;
        #[oneway]
        async fn release(&self, replicas: Vec<u64>);
    }

    #[service]
    pub(crate) trait ReplicaSink {
        async fn invalidated(&self, replicas: Vec<u64>);
    }
}

use protocol::{Failure, Held, ReplicaHostClient, ReplicaSink, ReplicaSinkServer};

/// The server's value hash (FNV-1a of the encoded value), which a revalidation compares.
fn value_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// How a client answers its pushes.
#[derive(Clone)]
enum Answer {
    AtOnce,
    /// Never (a stopped process, a tab asleep).
    Never,
    /// Each once the test adds a permit.
    When(Arc<Semaphore>),
}

/// Records every push, and answers it as told.
struct Sink {
    pushed: mpsc::UnboundedSender<Vec<u64>>,
    answer: Answer,
}

impl ReplicaSink for Sink {
    async fn invalidated(&self, replicas: Vec<u64>) {
        let _ = self.pushed.send(replicas);
        match &self.answer {
            Answer::AtOnce => {}
            Answer::Never => std::future::pending::<()>().await,
            Answer::When(permits) => permits.acquire().await.unwrap().forget(),
        }
    }
}

/// A client of `Users.name` replicas speaking the protocol by hand.
struct RawClient {
    peer: Peer,
    host: ReplicaHostClient,
    pushed: mpsc::UnboundedReceiver<Vec<u64>>,
}

impl RawClient {
    async fn connect(addr: SocketAddr, stalled: bool) -> Self {
        let answer = if stalled {
            Answer::Never
        } else {
            Answer::AtOnce
        };
        Self::answering(addr, answer).await
    }

    async fn answering(addr: SocketAddr, answer: Answer) -> Self {
        let (tx, pushed) = mpsc::unbounded_channel();
        let peer = Endpoint::builder()
            .service(ReplicaSinkServer::new(Sink { pushed: tx, answer }))
            .config(Config::default().max_message_size(64 << 20))
            .build()
            .connect_tcp(addr)
            .await
            .unwrap();
        Self {
            host: ReplicaHostClient::new(peer.clone()),
            peer,
            pushed,
        }
    }

    fn args(&self, user: u64) -> Blob {
        Blob::from(self.peer.format().encode(&(user,)).unwrap())
    }

    /// Holds `Users.name(user)` as `replica`; answers the value's hash.
    async fn fetch(&self, replica: u64, user: u64) -> Result<u64, Failure> {
        self.fetch_value(replica, user)
            .await
            .map(|v| value_hash(&v))
    }

    /// The same, answering the value.
    async fn fetch_value(&self, replica: u64, user: u64) -> Result<Blob, Failure> {
        let method = method_id("Users.name");
        self.host
            .fetch(method, self.args(user), replica)
            .await
            .unwrap()
    }

    fn decode(&self, value: &Blob) -> Option<String> {
        self.peer.format().decode(value).unwrap()
    }

    fn held(&self, replica: u64, user: u64, hash: u64) -> Held {
        Held {
            replica,
            method: method_id("Users.name"),
            args: self.args(user),
            hash,
        }
    }

    async fn next_push(&mut self) -> Vec<u64> {
        within("a push", self.pushed.recv()).await.expect("pushes")
    }
}

/// A server of `Users.name` on 127.0.0.1 whose connections are `trust`ed, with `remote`'s
/// settings; `Writes` on the same endpoint.
async fn serve_with(users: &Users, remote: &RemoteServer, trust: Trust) -> SocketAddr {
    let endpoint = Endpoint::builder()
        .service(remote.service())
        .service(WritesServer::new(Writer {
            users: users.clone(),
            remote: remote.clone(),
        }))
        .config(Config::default().trust(trust).max_message_size(64 << 20))
        .build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { endpoint.serve_tcp(listener).await });
    addr
}

/// A command over RPC: the write, then what a command host's `after_invalidate` does.
#[service]
trait Writes {
    async fn rename(&self, id: u64, name: String);
}

struct Writer {
    users: Users,
    remote: RemoteServer,
}

impl Writes for Writer {
    async fn rename(&self, id: u64, name: String) {
        self.users.rename(id, &name);
        self.remote.invalidations_delivered().await;
    }
}

/// Long enough that a test finishing means nothing timed out.
const NEVER: Duration = Duration::from_secs(3600);

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    within(what, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
}

#[tokio::test]
async fn fetching_and_releasing_one_replica_a_hundred_thousand_times_leaves_no_callback_behind() {
    let users = Users::new();
    let remote = remote_server(&users);
    let client = RawClient::connect(serve_with(&users, &remote, Trust::Trusted).await, false).await;
    let watched = users.name_computed(1).await;
    // 100 at a time, each under a replica id of its own, then released together.
    for round in 0..1_000u64 {
        let ids: Vec<u64> = (round * 100..round * 100 + 100).collect();
        let fetches = ids.iter().map(|&id| client.fetch(id, 1));
        for hash in futures::future::join_all(fetches).await {
            hash.unwrap();
        }
        client.host.release(ids).await.unwrap();
    }
    until("every release handled", || remote.replicas_held() == 0).await;
    assert_eq!(watched.invalidation_callback_count(), 0);
    assert!(
        watched.is_consistent(),
        "a long-lived computed, never invalidated"
    );

    client.fetch(7, 1).await.unwrap();
    assert_eq!(watched.invalidation_callback_count(), 1);
    // The same id again is refused, as before, and leaves nothing behind either.
    let again = client.fetch(7, 1).await.unwrap_err();
    assert!(
        matches!(&again, Failure::BadArguments(e) if e.contains("already watched")),
        "{again:?}"
    );
    assert_eq!(watched.invalidation_callback_count(), 1);
    assert_eq!(users.runs(), 1);
}

#[tokio::test]
async fn revalidating_two_hundred_thousand_copies_of_one_replica_watches_it_once() {
    let users = Users::new();
    let remote = remote_server(&users);
    let client = RawClient::connect(serve_with(&users, &remote, Trust::Trusted).await, false).await;
    let watched = users.name_computed(1).await;
    let hash = client.fetch(3, 1).await.unwrap();
    let copies = vec![client.held(3, 1, hash); 200_000];
    for _ in 0..2 {
        let stale = client.host.revalidate(copies.clone()).await.unwrap();
        assert!(stale.is_empty(), "{} stale", stale.len());
        // An id held already is watched anew in place of the old watch.
        assert_eq!(watched.invalidation_callback_count(), 1);
        assert_eq!(remote.replicas_held(), 1);
    }
    client.host.release(vec![3]).await.unwrap();
    until("the release handled", || remote.replicas_held() == 0).await;
    assert_eq!(watched.invalidation_callback_count(), 0);
}

#[tokio::test]
async fn a_revalidation_beyond_the_connections_limit_watches_up_to_it_and_reports_the_rest_stale() {
    let users = Users::new();
    let remote = remote_server(&users).max_replicas_per_connection(4);
    let client = RawClient::connect(serve_with(&users, &remote, Trust::Trusted).await, false).await;
    let hash = client.fetch(100, 1).await.unwrap();
    client.host.release(vec![100]).await.unwrap();
    until("the release handled", || remote.replicas_held() == 0).await;
    let held: Vec<Held> = (0..10).map(|id| client.held(id, 1, hash)).collect();
    let mut stale = client.host.revalidate(held).await.unwrap();
    stale.sort_unstable();
    assert_eq!(stale, [4, 5, 6, 7, 8, 9]);
    assert_eq!(remote.replicas_held(), 4);
    assert_eq!(
        users.name_computed(1).await.invalidation_callback_count(),
        4
    );
}

#[tokio::test]
async fn a_closed_connection_takes_its_callbacks_back() {
    let users = Users::new();
    let remote = remote_server(&users);
    let client = RawClient::connect(serve_with(&users, &remote, Trust::Trusted).await, false).await;
    for id in 0..50 {
        client.fetch(id, 2).await.unwrap();
    }
    let watched = users.name_computed(2).await;
    assert_eq!(watched.invalidation_callback_count(), 50);
    client.peer.close();
    until("the connection's end on the server", || {
        remote.connections() == 0
    })
    .await;
    assert_eq!(watched.invalidation_callback_count(), 0);
    assert!(watched.is_consistent());
}

#[tokio::test]
async fn a_stalled_untrusted_client_does_not_hold_up_a_write_but_still_gets_its_push() {
    let users = Users::new();
    // No timeout can end the wait in this test: only not waiting can.
    let remote = remote_server(&users).delivery_timeout(NEVER);
    let mut stalled =
        RawClient::connect(serve_with(&users, &remote, Trust::Untrusted).await, true).await;
    stalled.fetch(1, 1).await.unwrap();

    users.rename(1, "anna");
    within("the write's delivery", remote.invalidations_delivered()).await;
    let stats = remote.stats();
    assert_eq!(stats.waits_skipped_untrusted, 1);
    assert_eq!(stats.clients_closed_unresponsive, 0);
    assert_eq!(stalled.next_push().await, [1], "pushed all the same");
    assert!(stalled.peer.close_reason().is_none(), "still connected");
    assert_eq!(remote.connections(), 1);
}

#[tokio::test]
async fn a_stalled_untrusted_client_is_closed_by_its_pusher_after_the_delivery_timeout() {
    let users = Users::new();
    let remote = remote_server(&users).delivery_timeout(Duration::from_millis(200));
    let mut stalled =
        RawClient::connect(serve_with(&users, &remote, Trust::Untrusted).await, true).await;
    stalled.fetch(1, 1).await.unwrap();
    users.rename(1, "anna");
    remote.invalidations_delivered().await;
    assert_eq!(stalled.next_push().await, [1]);
    within("the stalled client's disconnection", stalled.peer.closed()).await;
    until("the server's bookkeeping", || remote.connections() == 0).await;
    assert_eq!(remote.stats().clients_closed_unresponsive, 1);
    assert_eq!(remote.replicas_held(), 0);
}

#[tokio::test]
async fn a_stalled_trusted_client_is_waited_for_until_the_timeout_closes_it() {
    let users = Users::new();
    let remote = remote_server(&users).delivery_timeout(Duration::from_millis(300));
    let addr = serve_with(&users, &remote, Trust::Trusted).await;
    let stalled = RawClient::connect(addr, true).await;
    stalled.fetch(1, 1).await.unwrap();
    // A healthy tier beside it.
    let healthy = Page {
        handle: ServiceHandle::new(),
        remote: RemoteClient::connect_tcp(addr).await.unwrap(),
    };
    assert_eq!(healthy.name(1).await.unwrap().as_deref(), Some("ann"));
    let before = healthy.name_computed(1).await;
    assert_eq!(remote.replicas_held(), 2);

    users.rename(1, "anna");
    within("the write's delivery", remote.invalidations_delivered()).await;
    // It returned only once the stalled client was cut off, and once the healthy one had
    // applied the invalidation.
    assert_eq!(remote.stats().clients_closed_unresponsive, 1);
    assert_eq!(remote.stats().waits_skipped_untrusted, 0);
    assert!(!before.is_consistent());
    within("the stalled client's disconnection", stalled.peer.closed()).await;
}

#[tokio::test]
async fn a_client_that_leaves_too_many_pushes_unanswered_is_closed() {
    let users = Users::new();
    let remote = remote_server(&users)
        .delivery_timeout(NEVER)
        .max_unanswered_pushes(2);
    let stalled =
        RawClient::connect(serve_with(&users, &remote, Trust::Untrusted).await, true).await;
    for user in 1..=3 {
        stalled.fetch(user, user).await.unwrap();
    }
    for user in 1..=2 {
        users.rename(user, "x");
        until("the push", || remote.stats().pushes == user).await;
    }
    assert!(
        stalled.peer.close_reason().is_none(),
        "two unanswered are allowed"
    );
    users.rename(3, "x");
    within("the disconnection", stalled.peer.closed()).await;
    until("the server's bookkeeping", || remote.connections() == 0).await;
    assert_eq!(remote.stats().clients_closed_unresponsive, 1);
}

/// A client of the replica and of the command, through one connection.
#[derive(Clone, ComputeService)]
struct Page {
    handle: ServiceHandle,
    remote: RemoteClient,
}

#[compute_service]
impl Page {
    #[compute]
    async fn name(&self, id: u64) -> Result<Option<String>, RpcError> {
        self.remote.replica("Users.name", (id,)).await
    }
}

#[tokio::test]
async fn a_client_writing_through_its_own_untrusted_connection_sees_its_write_in_the_answer() {
    let users = Users::new();
    let remote = remote_server(&users).delivery_timeout(NEVER);
    let addr = serve_with(&users, &remote, Trust::Untrusted).await;
    // Another untrusted holder of the same replica that never answers: not waited for.
    let stalled = RawClient::connect(addr, true).await;
    stalled.fetch(1, 1).await.unwrap();

    let page = Page {
        handle: ServiceHandle::new(),
        remote: RemoteClient::connect_tcp(addr).await.unwrap(),
    };
    assert_eq!(page.name(1).await.unwrap().as_deref(), Some("ann"));
    let before = page.name_computed(1).await;
    let writes = WritesClient::new(page.remote.connection().unwrap());
    within("the command's answer", writes.rename(1, "anna".to_owned()))
        .await
        .unwrap();
    // The answer came after this client had applied the push: its own write is visible.
    assert!(!before.is_consistent());
    assert_eq!(page.name(1).await.unwrap().as_deref(), Some("anna"));
    assert_eq!(remote.stats().waits_skipped_untrusted, 1, "the stalled one");
    assert!(stalled.peer.close_reason().is_none());
}

/// Fetches `Users.name(user)` under each of `replicas`, 100 at a time.
async fn fetch_all(client: &RawClient, replicas: std::ops::Range<u64>, user: u64) {
    let ids: Vec<u64> = replicas.collect();
    for chunk in ids.chunks(100) {
        let fetches = chunk.iter().map(|&id| client.fetch(id, user));
        for hash in futures::future::join_all(fetches).await {
            hash.unwrap();
        }
    }
}

#[tokio::test]
async fn an_untrusted_connection_holds_a_thousand_replicas_by_default_and_a_trusted_one_more() {
    let users = Users::new();
    let remote = remote_server(&users);
    let browser =
        RawClient::connect(serve_with(&users, &remote, Trust::Untrusted).await, false).await;
    let tier = RawClient::connect(serve_with(&users, &remote, Trust::Trusted).await, false).await;
    // Each a computed of its own that the core keeps while it is held.
    fetch_all(&browser, 0..1_000, 1).await;
    assert_eq!(
        browser.fetch(1_000, 1).await,
        Err(Failure::TooManyReplicas(1_000))
    );
    fetch_all(&tier, 0..1_500, 1).await;
    let stats = remote.stats();
    assert_eq!(stats.replicas_held, 2_500);
    assert_eq!(stats.untrusted_replicas_held, 1_000);
    assert_eq!(stats.replicas_refused_per_connection, 1);
    assert_eq!(stats.replicas_refused_untrusted_total, 0);

    browser.peer.close();
    until("the browser's end on the server", || {
        remote.connections() == 1
    })
    .await;
    assert_eq!(remote.stats().untrusted_replicas_held, 0);
    assert_eq!(remote.replicas_held(), 1_500);
}

#[tokio::test]
async fn the_untrusted_connections_together_hold_at_most_their_limit_and_every_watch_gone_gives_its_place_back(
) {
    let users = Users::new();
    let remote = remote_server(&users)
        .max_untrusted_replicas(4)
        .delivery_timeout(NEVER);
    let addr = serve_with(&users, &remote, Trust::Untrusted).await;
    let (mut a, mut b) = (
        RawClient::connect(addr, false).await,
        RawClient::connect(addr, false).await,
    );
    let tier = RawClient::connect(serve_with(&users, &remote, Trust::Trusted).await, false).await;
    let untrusted = || remote.stats().untrusted_replicas_held;

    let bob = a.fetch(2, 2).await.unwrap();
    a.fetch(1, 1).await.unwrap();
    a.fetch(3, 2).await.unwrap();
    b.fetch(1, 1).await.unwrap();
    assert_eq!(untrusted(), 4);
    // A fifth is refused, whichever untrusted connection asks; a trusted one is not.
    assert_eq!(b.fetch(2, 2).await, Err(Failure::TooManyReplicas(4)));
    assert_eq!(a.fetch(4, 2).await, Err(Failure::TooManyReplicas(4)));
    fetch_all(&tier, 0..10, 2).await;
    assert_eq!(remote.stats().replicas_refused_untrusted_total, 2);
    assert_eq!(remote.stats().replicas_refused_per_connection, 0);
    assert_eq!(untrusted(), 4);

    // A push gives the pushed watches' places back.
    users.rename(1, "anna");
    assert_eq!(a.next_push().await, [1]);
    assert_eq!(b.next_push().await, [1]);
    until("the pushed watches dropped", || untrusted() == 2).await;
    b.fetch(2, 2).await.unwrap();
    assert_eq!(untrusted(), 3);

    // A revalidation watches an id held already anew in its own place, refuses a new one
    // beyond the limit, and gives back the place of one that changed.
    b.fetch(5, 2).await.unwrap();
    assert_eq!(untrusted(), 4);
    let stale = a
        .host
        .revalidate(vec![a.held(2, 2, bob), a.held(6, 2, bob)])
        .await
        .unwrap();
    assert_eq!(stale, [6]);
    assert_eq!(untrusted(), 4);
    assert_eq!(remote.stats().replicas_refused_untrusted_total, 3);
    let stale = a.host.revalidate(vec![a.held(3, 2, !bob)]).await.unwrap();
    assert_eq!(stale, [3]);
    assert_eq!(untrusted(), 3);

    // A release does too.
    b.host.release(vec![5]).await.unwrap();
    until("the release handled", || untrusted() == 2).await;

    // And a disconnection, for everything the connection held.
    a.peer.close();
    until("a's end on the server", || remote.connections() == 2).await;
    assert_eq!(untrusted(), 1);
    b.peer.close();
    until("b's end on the server", || remote.connections() == 1).await;
    assert_eq!(untrusted(), 0);
    assert_eq!(remote.replicas_held(), 10, "the tier's");
}

/// `Users.name` behind a gate: each call computes its value, says so, then waits for the
/// test to let it return, so that a fetch can be held between its value computed and its
/// watch registered.
#[derive(Clone)]
struct Gate {
    computed: Arc<Semaphore>,
    open: Arc<Semaphore>,
}

impl Gate {
    fn new() -> Self {
        Self {
            computed: Arc::new(Semaphore::new(0)),
            open: Arc::new(Semaphore::new(0)),
        }
    }

    fn expose(&self, remote: RemoteServer, users: &Users) -> RemoteServer {
        let gate = self.clone();
        remote.expose("Users.gated", users.clone(), move |u, (id,): (u64,)| {
            let gate = gate.clone();
            async move {
                let computed = u.name_computed(id).await;
                gate.computed.add_permits(1);
                gate.open.acquire().await.unwrap().forget();
                computed
            }
        })
    }

    async fn computed(&self) {
        let permit = within("the value computed", self.computed.acquire()).await;
        permit.unwrap().forget();
    }
}

#[tokio::test]
async fn a_write_waits_for_a_trusted_fetch_that_computed_the_old_value_before_it() {
    let users = Users::new();
    let gate = Gate::new();
    let remote = gate
        .expose(remote_server(&users), &users)
        .delivery_timeout(NEVER);
    let acks = Arc::new(Semaphore::new(0));
    let addr = serve_with(&users, &remote, Trust::Trusted).await;
    let mut tier = RawClient::answering(addr, Answer::When(acks.clone())).await;
    let fetch = tokio::spawn({
        let (host, args) = (tier.host.clone(), tier.args(1));
        async move { host.fetch(method_id("Users.gated"), args, 7).await }
    });
    gate.computed().await;

    // The write lands between the fetch's value and its watch: no callback yet to queue.
    users.rename(1, "anna");
    let delivered = remote.invalidations_delivered();
    tokio::pin!(delivered);
    assert!(
        futures::poll!(delivered.as_mut()).is_pending(),
        "a write must wait for the fetch in flight that computed the old value"
    );

    gate.open.add_permits(1);
    let value = within("the fetch", fetch).await.unwrap().unwrap().unwrap();
    assert_eq!(tier.decode(&value).as_deref(), Some("ann"), "the old value");
    // Its watch, registered on a computed invalidated already, pushed at once...
    assert_eq!(tier.next_push().await, [7]);
    // ...and the write waits for the tier to apply that push.
    assert!(
        futures::poll!(delivered.as_mut()).is_pending(),
        "a write must wait for the push its fetch queued to be applied"
    );
    acks.add_permits(1);
    within("the write's delivery", delivered).await;
    let stats = remote.stats();
    assert_eq!(stats.clients_closed_unresponsive, 0);
    assert_eq!(stats.pushes, 1);
    assert_eq!(remote.replicas_held(), 0, "pushed, so no longer watched");
}

#[tokio::test]
async fn a_write_waits_for_a_trusted_revalidation_that_confirmed_the_old_value_before_it() {
    let users = Users::new();
    let gate = Gate::new();
    let remote = gate
        .expose(remote_server(&users), &users)
        .delivery_timeout(NEVER);
    let acks = Arc::new(Semaphore::new(0));
    let addr = serve_with(&users, &remote, Trust::Trusted).await;
    let mut tier = RawClient::answering(addr, Answer::When(acks.clone())).await;
    // What the tier held before it reconnected: `Users.gated(1)`, "ann" (the same value as
    // `Users.name(1)`).
    let old = value_hash(&tier.fetch_value(1, 1).await.unwrap());
    tier.host.release(vec![1]).await.unwrap();
    until("the release handled", || remote.replicas_held() == 0).await;
    let held = Held {
        method: method_id("Users.gated"),
        ..tier.held(7, 1, old)
    };
    let revalidation = tokio::spawn({
        let host = tier.host.clone();
        async move { host.revalidate(vec![held]).await }
    });
    gate.computed().await;

    users.rename(1, "anna");
    let delivered = remote.invalidations_delivered();
    tokio::pin!(delivered);
    assert!(
        futures::poll!(delivered.as_mut()).is_pending(),
        "a write must wait for the revalidation in flight that confirmed the old value"
    );

    gate.open.add_permits(1);
    let stale = within("the revalidation", revalidation).await.unwrap();
    assert_eq!(
        stale.unwrap(),
        Vec::<u64>::new(),
        "confirmed: the old value"
    );
    assert_eq!(tier.next_push().await, [7]);
    assert!(
        futures::poll!(delivered.as_mut()).is_pending(),
        "a write must wait for the push its revalidation queued to be applied"
    );
    acks.add_permits(1);
    within("the write's delivery", delivered).await;
    assert_eq!(remote.stats().clients_closed_unresponsive, 0);
}
