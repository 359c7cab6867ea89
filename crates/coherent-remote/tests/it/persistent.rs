//! The persistent client cache: a restarted client answers from its file at once, and the
//! server confirms (or overrules) the answer behind it.

use coherent::{compute_service, ComputeService, ServiceHandle};
use coherent_remote::RemoteClient;
use coherent_rpc::RpcError;

use crate::support::*;

#[derive(Clone, ComputeService)]
struct Names {
    handle: ServiceHandle,
    remote: RemoteClient,
}

#[compute_service]
impl Names {
    #[compute]
    async fn name(&self, id: u64) -> Result<Option<String>, RpcError> {
        self.remote.replica("Users.name", (id,)).await
    }
}

async fn client(addr: std::net::SocketAddr, file: &std::path::Path) -> (RemoteClient, Names) {
    let remote = RemoteClient::builder()
        .persist_to(file)
        .connect_tcp(addr)
        .await
        .unwrap();
    let names = Names {
        handle: ServiceHandle::new(),
        remote: remote.clone(),
    };
    (remote, names)
}

#[tokio::test]
async fn a_restarted_client_answers_from_disk_and_the_server_confirms_or_overrules_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("replicas.db");
    let users = Users::new();
    let addr = serve(&users).await;

    let (first, names) = client(addr, &file).await;
    assert_eq!(names.name(1).await.unwrap().as_deref(), Some("ann"));
    assert_eq!(names.name(2).await.unwrap().as_deref(), Some("bob"));
    first.flush_cache().await;
    first.close();
    drop((first, names));
    assert_eq!(users.runs(), 2);

    // While no client runs, user 2 changes.
    users.rename(2, "bobby");

    let (second, names) = client(addr, &file).await;
    // Both first reads come from the file: nothing is fetched for them.
    assert_eq!(names.name(1).await.unwrap().as_deref(), Some("ann"));
    let two = names.name_computed(2).await;
    let from_disk = two.value().clone().unwrap();
    assert_eq!(from_disk.as_deref(), Some("bob"), "unconfirmed, from disk");

    // The server confirms user 1 and overrules user 2.
    within("user 2's invalidation", two.when_invalidated()).await;
    assert_eq!(names.name(2).await.unwrap().as_deref(), Some("bobby"));
    let one = names.name_computed(1).await;
    within("user 1's confirmation", async {
        while second.unconfirmed_count() > 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(one.is_consistent());
    // Confirmed replicas are watched like fetched ones.
    users.rename(1, "anna");
    within("the pushed invalidation", one.when_invalidated()).await;
    assert_eq!(names.name(1).await.unwrap().as_deref(), Some("anna"));
}

/// A push is acknowledged (and the writer told it reached this client) only once the
/// file forgot the value too: a client that crashed right after would otherwise find it
/// there and answer it again at its next start.
#[tokio::test]
async fn a_push_is_acknowledged_only_once_the_file_forgot_the_value() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("replicas.db");
    let users = Users::new();
    let server = remote_server(&users);
    let endpoint = coherent_rpc::Endpoint::builder()
        .service(server.service())
        .build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { endpoint.serve_tcp(listener).await });
    let (remote, names) = client(addr, &file).await;
    let stored = || -> i64 {
        let db = rusqlite::Connection::open(&file).unwrap();
        db.query_row("SELECT count(*) FROM replicas", [], |r| r.get(0))
            .unwrap()
    };
    for round in 0..20 {
        assert!(names.name(1).await.unwrap().is_some());
        remote.flush_cache().await;
        assert_eq!(stored(), 1, "round {round}: the value is in the file");
        users.rename(1, &format!("ann {round}"));
        within(
            "the push's acknowledgement",
            server.invalidations_delivered(),
        )
        .await;
        assert_eq!(
            stored(),
            0,
            "round {round}: acknowledged, and still in the file"
        );
    }
}
