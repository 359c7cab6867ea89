//! Replicas over other transports, diamonds across the wire, and a client that stops
//! reading.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use coherent::{compute_service, ComputeService, ServiceHandle};
use coherent_remote::RemoteClient;
use coherent_rpc::{Config, Endpoint, RpcError};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::support::*;

/// A client service with a diamond: `card` reads `greeting` and `shout`, both read `name`.
#[derive(Clone, ComputeService)]
struct Cards {
    handle: ServiceHandle,
    remote: RemoteClient,
    log: Arc<Mutex<Vec<String>>>,
}

#[compute_service]
impl Cards {
    #[compute]
    async fn name(&self, id: u64) -> Result<Option<String>, RpcError> {
        self.log.lock().push(format!("name({id})"));
        self.remote.replica("Users.name", (id,)).await
    }

    #[compute]
    async fn greeting(&self, id: u64) -> String {
        self.log.lock().push(format!("greeting({id})"));
        format!(
            "hello, {}",
            self.name(id).await.ok().flatten().unwrap_or_default()
        )
    }

    #[compute]
    async fn shout(&self, id: u64) -> String {
        self.log.lock().push(format!("shout({id})"));
        self.name(id)
            .await
            .ok()
            .flatten()
            .unwrap_or_default()
            .to_uppercase()
    }

    #[compute]
    async fn card(&self, id: u64) -> String {
        self.log.lock().push(format!("card({id})"));
        format!("{} / {}", self.greeting(id).await, self.shout(id).await)
    }
}

impl Cards {
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
        let mut log = std::mem::take(&mut *self.log.lock());
        log.sort();
        log
    }
}

#[tokio::test]
async fn a_diamond_over_a_replica_recomputes_each_node_once_per_server_write() {
    let users = Users::new();
    let cards = Cards::new(
        RemoteClient::connect_tcp(serve(&users).await)
            .await
            .unwrap(),
    );
    assert_eq!(cards.card(1).await, "hello, ann / ANN");
    assert_eq!(
        cards.take_log(),
        ["card(1)", "greeting(1)", "name(1)", "shout(1)"]
    );
    let card = cards.card_computed(1).await;
    users.rename(1, "anna");
    within("the pushed invalidation", card.when_invalidated()).await;
    assert_eq!(cards.card(1).await, "hello, anna / ANNA");
    // The shared replica was fetched once, and each node above it ran once.
    assert_eq!(
        cards.take_log(),
        ["card(1)", "greeting(1)", "name(1)", "shout(1)"]
    );
    assert_eq!(users.runs(), 2);
}

#[tokio::test]
async fn replicas_work_over_a_websocket_served_by_axum() {
    let users = Users::new();
    let endpoint = server_endpoint(&users);
    let app = axum::Router::new().route("/rpc", axum::routing::get(endpoint.websocket_handler()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let url = format!("ws://{addr}/rpc");
    let remote = RemoteClient::builder()
        .connect_with(move |e| {
            let url = url.clone();
            async move { e.connect_websocket(&url).await }
        })
        .await
        .unwrap();
    let cards = Cards::new(remote);
    assert_eq!(cards.greeting(2).await, "hello, bob");
    let greeting = cards.greeting_computed(2).await;
    users.rename(2, "bobby");
    within("the pushed invalidation", greeting.when_invalidated()).await;
    assert_eq!(cards.greeting(2).await, "hello, bobby");
}

/// A transport whose reading side can be stopped: the client then reads nothing more.
struct Stoppable<T> {
    inner: T,
    stopped: Arc<AtomicBool>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Stoppable<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.stopped.load(Ordering::SeqCst) {
            // Never woken again: this side has stopped reading for good.
            return Poll::Pending;
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Stoppable<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[tokio::test]
async fn a_client_that_stops_reading_is_cut_off_and_its_replicas_released_while_others_are_served()
{
    let users = Users::new();
    for id in 3..=1200 {
        users.rename(id, &format!("user {id}"));
    }
    let remote_server = remote_server(&users);
    let server = Endpoint::builder()
        .service(remote_server.service())
        .config(Config::default().write_stall_timeout(Duration::from_millis(300)))
        .build();

    // The slow client: a small pipe, so that a few KB of pushes fill it.
    let (a, b) = tokio::io::duplex(1024);
    let accepting = server.clone();
    tokio::spawn(async move { accepting.accept(a).await });
    let stopped = Arc::new(AtomicBool::new(false));
    // A registry of its own: a client that stops reading stops renewing its lease, which
    // fences its registry until the client takes the connection for dead.
    let registry = coherent::Registry::new();
    let slow = RemoteClient::builder()
        .registry(&registry)
        .connect(Stoppable {
            inner: b,
            stopped: stopped.clone(),
        })
        .await
        .unwrap();
    let slow_cards = Cards::in_registry(slow.clone(), &registry);
    for id in 1..=1200 {
        slow_cards.name(id).await.unwrap();
    }

    // A healthy client on another connection.
    let (a, b) = tokio::io::duplex(64 * 1024);
    let accepting = server.clone();
    tokio::spawn(async move { accepting.accept(a).await });
    let healthy = Cards::new(RemoteClient::builder().connect(b).await.unwrap());
    assert_eq!(healthy.greeting(2).await, "hello, bob");
    assert_eq!(remote_server.connections(), 2);
    assert_eq!(remote_server.replicas_held(), 1201);

    stopped.store(true, Ordering::SeqCst);
    // Every replica of the slow client goes stale: ~10 KB of pushes it never reads.
    for id in 1..=1200 {
        users.rename(id, "renamed");
    }
    within("the slow connection's end", async {
        while remote_server.connections() > 1 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    // Nothing of the slow client is held any more; the healthy one is served as before.
    assert_eq!(remote_server.replicas_held(), 0);
    assert_eq!(healthy.greeting(2).await, "hello, renamed");
    let greeting = healthy.greeting_computed(2).await;
    users.rename(2, "bob again");
    within("the healthy client's push", greeting.when_invalidated()).await;
    assert_eq!(healthy.greeting(2).await, "hello, bob again");
}

#[tokio::test]
async fn pushes_larger_than_the_clients_message_limit_arrive_in_several_messages() {
    let users = Users::new();
    for id in 3..=1000 {
        users.rename(id, &format!("user {id}"));
    }
    let remote = RemoteClient::builder()
        .config(Config::default().max_message_size(1024))
        .connect_tcp(serve(&users).await)
        .await
        .unwrap();
    let cards = Cards::new(remote.clone());
    let mut computed = Vec::new();
    for id in 1..=1000 {
        cards.name(id).await.unwrap();
        computed.push(cards.name_computed(id).await);
    }
    // One write path that invalidates all 1,000 at once: about 3 KB of ids.
    users.rename_all("x");
    for c in &computed {
        within("every pushed invalidation", c.when_invalidated()).await;
    }
    assert_eq!(remote.connections(), 1, "the connection was never dropped");
}
