//! Failover: a client given several hosts over the same data moves to the next when its
//! host dies, and revalidates its replicas there.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use coherent::{compute_service, ComputeService, ServiceHandle};
use coherent_remote::RemoteClient;
use coherent_rpc::{Backoff, ErrorCode, Peer, RpcError};
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::support::*;

/// The client's compute service: a replica of `Users.name`; `fetched` records which ids
/// the client method ran for.
#[derive(Clone, ComputeService)]
struct Names {
    handle: ServiceHandle,
    remote: RemoteClient,
    fetched: Arc<Mutex<Vec<u64>>>,
}

#[compute_service]
impl Names {
    #[compute]
    async fn name(&self, id: u64) -> Result<Option<String>, RpcError> {
        self.fetched.lock().push(id);
        self.remote.replica("Users.name", (id,)).await
    }
}

impl Names {
    fn new(remote: RemoteClient) -> Self {
        Self {
            handle: ServiceHandle::new(),
            remote,
            fetched: Arc::default(),
        }
    }

    async fn get(&self, id: u64) -> String {
        self.name(id).await.unwrap().unwrap_or_default()
    }

    fn take_fetched(&self) -> Vec<u64> {
        std::mem::take(&mut *self.fetched.lock())
    }
}

/// A server that can die: its listener closes and every connection it accepted is cut.
struct Host {
    addr: SocketAddr,
    /// `None` once the listener is closed.
    accepting: Option<JoinHandle<()>>,
    accepted: Arc<Mutex<Vec<Peer>>>,
}

impl Host {
    async fn start(users: &Users) -> Host {
        Self::start_at(users, "127.0.0.1:0".parse().unwrap()).await
    }

    /// A host on `addr`, which may be the address of a host that died.
    async fn start_at(users: &Users, addr: SocketAddr) -> Host {
        let endpoint = server_endpoint(users);
        let listener = TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(Mutex::new(Vec::new()));
        let peers = accepted.clone();
        let accepting = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                // Each accepted connection is kept until it completes the handshake (or
                // the task is aborted mid-way, which drops it): none escapes `cut`.
                if let Ok(peer) = endpoint.accept(stream).await {
                    peers.lock().push(peer);
                }
            }
        });
        Host {
            addr,
            accepting: Some(accepting),
            accepted,
        }
    }

    /// Cuts every connection, as a network blip would; the host stays up.
    fn cut(&self) {
        for peer in self.accepted.lock().drain(..) {
            peer.close();
        }
    }

    /// Closes the listener: once this returns, connecting to the host is refused.
    async fn stop_listening(&mut self) {
        if let Some(accepting) = self.accepting.take() {
            accepting.abort();
            // The task, and the listener it owns, are gone once it reports the abort.
            let _ = accepting.await;
        }
    }

    /// The host dies: its listener closes, then every connection to it is cut.
    async fn kill(mut self) {
        self.stop_listening().await;
        self.cut();
    }
}

/// An address nothing listens on: connecting to it is refused.
async fn dead_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap()
}

#[tokio::test]
async fn failover_to_the_next_host_revalidates_the_replicas_there() {
    let on_a = Users::new();
    let on_b = on_a.sharing_data();
    let mut a = Host::start(&on_a).await;
    let b = Host::start(&on_b).await;
    let remote = RemoteClient::builder()
        .keep_replicas_through_disconnects(true)
        .connect_tcp_any([a.addr, b.addr])
        .await
        .unwrap();
    assert_eq!(remote.connected_to(), Some(a.addr));
    let names = Names::new(remote.clone());
    assert_eq!(names.get(1).await, "ann");
    assert_eq!(names.get(2).await, "bob");
    let (one, two) = (names.name_computed(1).await, names.name_computed(2).await);
    assert_eq!(names.take_fetched(), [1, 2]);
    assert_eq!(on_a.runs(), 2);

    // A goes down; user 1 changes meanwhile, and A, going down, pushes nothing.
    a.stop_listening().await;
    on_b.rename(1, "anna");
    a.kill().await;

    within("the revalidation after the failover", remote.revalidated(1)).await;
    assert_eq!(remote.connected_to(), Some(b.addr));
    assert_eq!(remote.connections(), 2);
    within("the revalidation's invalidation", one.when_invalidated()).await;
    assert!(
        two.is_consistent(),
        "an unchanged replica survives the failover"
    );
    assert_eq!(names.get(1).await, "anna");
    assert_eq!(names.get(2).await, "bob");
    // Only the changed replica was fetched again (from B, which had user 1's new name).
    assert_eq!(names.take_fetched(), [1]);
    assert!(
        on_b.runs() >= 2,
        "B computed both replicas to revalidate them"
    );

    // B watches both replicas now: its writes are pushed.
    let one = names.name_computed(1).await;
    on_b.rename(2, "bobby");
    within("B's pushed invalidation", two.when_invalidated()).await;
    assert_eq!(names.get(2).await, "bobby");
    on_b.rename(1, "annabel");
    within("B's pushed invalidation", one.when_invalidated()).await;
    assert_eq!(names.get(1).await, "annabel");
    assert_eq!(names.take_fetched(), [2, 1]);
    assert_eq!(remote.connected_to(), Some(b.addr));
    assert_eq!(remote.connections(), 2);
}

#[tokio::test]
async fn failover_starts_with_the_host_last_connected_to_and_goes_round_the_list() {
    let on_a = Users::new();
    let on_b = on_a.sharing_data();
    let a = Host::start(&on_a).await;
    let b = Host::start(&on_b).await;
    let a_addr = a.addr;
    let remote = RemoteClient::builder()
        .keep_replicas_through_disconnects(true)
        .connect_tcp_any([a.addr, b.addr])
        .await
        .unwrap();
    let names = Names::new(remote.clone());
    assert_eq!(names.get(1).await, "ann");
    let one = names.name_computed(1).await;

    // A blip: A is still up, so the client returns to it.
    a.cut();
    within("the revalidation after the blip", remote.revalidated(1)).await;
    assert_eq!(remote.connected_to(), Some(a.addr));

    a.kill().await;
    within("the revalidation after the failover", remote.revalidated(2)).await;
    assert_eq!(remote.connected_to(), Some(b.addr));

    // A comes back, first in the list; a blip on B still returns to B.
    let on_a = on_a.sharing_data();
    let a = Host::start_at(&on_a, a_addr).await;
    b.cut();
    within("the revalidation after the blip", remote.revalidated(3)).await;
    assert_eq!(remote.connected_to(), Some(b.addr));

    // B dies: the client goes round to A again.
    b.kill().await;
    within("the revalidation after the failover", remote.revalidated(4)).await;
    assert_eq!(remote.connected_to(), Some(a.addr));
    assert_eq!(remote.connections(), 5);

    // The replica survived every move, and A watches it now.
    assert!(one.is_consistent());
    assert_eq!(names.take_fetched(), [1]);
    on_a.rename(1, "anna");
    within("A's pushed invalidation", one.when_invalidated()).await;
    assert_eq!(names.get(1).await, "anna");
}

#[tokio::test]
async fn a_dead_first_address_at_connect_time_connects_to_the_next() {
    let users = Users::new();
    let b = Host::start(&users).await;
    let remote = RemoteClient::connect_tcp_any([dead_addr().await, b.addr])
        .await
        .unwrap();
    assert_eq!(remote.connected_to(), Some(b.addr));
    assert_eq!(remote.connections(), 1);
    let names = Names::new(remote.clone());
    assert_eq!(names.get(2).await, "bob");
    let two = names.name_computed(2).await;
    users.rename(2, "bobby");
    within("the pushed invalidation", two.when_invalidated()).await;
    assert_eq!(names.get(2).await, "bobby");
}

#[tokio::test]
async fn with_every_address_dead_connecting_fails_with_disconnected_after_the_attempts() {
    let (x, y) = (dead_addr().await, dead_addr().await);
    let err = RemoteClient::builder()
        .backoff(Backoff {
            initial: Duration::from_millis(1),
            max: Duration::from_millis(5),
            max_attempts: 3,
        })
        .connect_tcp_any([x, y])
        .await
        .err()
        .expect("nothing answers");
    assert_eq!(err.code(), ErrorCode::Disconnected, "{err}");
    let message = err.message();
    assert!(message.contains("after 3 attempts"), "{err}");
    assert!(message.contains(&x.to_string()), "{err}");
    assert!(message.contains(&y.to_string()), "{err}");
}

#[tokio::test]
async fn an_empty_address_list_is_an_error() {
    let err = RemoteClient::connect_tcp_any([])
        .await
        .err()
        .expect("no address");
    assert_eq!(err.code(), ErrorCode::Disconnected, "{err}");
    assert!(err.message().contains("empty"), "{err}");
}
