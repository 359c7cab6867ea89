//! The guide, chapter 2 (docs/guide/src/replicas.md): a server exposes the `Users` service
//! over TCP; a client computes a roster from replicas of its results, which the server
//! invalidates when a user changes.
//!
//! ```sh
//! cargo run -p coherent-examples --example guide_replicas
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use coherent::prelude::*;
use coherent_examples::api::{Users, UsersClient, UsersError, UsersServer};
use coherent_examples::guide::Directory;

/// The client's own compute service, built on the stub: `UsersClient` implements `Users`,
/// and each of its methods answers from a replica held in the client.
#[derive(Clone, ComputeService)]
struct Roster {
    handle: ServiceHandle,
    users: UsersClient,
    /// How many times `names` ran (for the asserts below).
    runs: Arc<AtomicUsize>,
}

#[compute_service]
impl Roster {
    /// A team's names: recomputed only when a replica it read is invalidated.
    #[compute]
    async fn names(&self, team: i64) -> Result<Vec<String>, UsersError> {
        self.runs.fetch_add(1, Ordering::Relaxed);
        let mut names = Vec::new();
        for id in self.users.team_members(team).await? {
            if let Some(user) = self.users.user(id).await? {
                names.push(user.name);
            }
        }
        Ok(names)
    }
}

fn names(list: &[&str]) -> Result<Vec<String>, UsersError> {
    Ok(list.iter().map(|s| s.to_string()).collect())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // The server: the service, exposed over TCP on a port of the system's choice.
    let directory = Directory::new();
    let server = RemoteServer::new().expose_service(UsersServer::new(directory.clone()));
    let endpoint = Endpoint::builder().service(server.service()).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { endpoint.serve_tcp(listener).await });

    // The client: one connection, replicas of whatever it reads.
    let client = RemoteClient::connect_tcp(addr).await?;
    let roster = Roster {
        handle: ServiceHandle::new(),
        users: UsersClient::new(client.clone()),
        runs: Arc::default(),
    };
    let runs = || roster.runs.load(Ordering::Relaxed);

    assert_eq!(roster.names(1).await, names(&["Ada", "Grace"]));
    // Again: the client's own cache answers, with no call to the server.
    assert_eq!(roster.names(1).await, names(&["Ada", "Grace"]));
    assert_eq!(runs(), 1);
    println!("team 1: {:?} (computed once)", roster.names(1).await);

    // A write on the server. `invalidations_delivered` returns once every connected client
    // has been told; the roster, computed from the replica of user(2), recomputes.
    directory.rename(2, "Grace Hopper");
    server.invalidations_delivered().await;
    assert_eq!(roster.names(1).await, names(&["Ada", "Grace Hopper"]));
    assert_eq!(runs(), 2);
    println!("team 1: {:?} (after a rename)", roster.names(1).await);

    // Linus is in team 2: team 1's roster never read him, and stays cached.
    directory.rename(3, "Linus T.");
    server.invalidations_delivered().await;
    assert_eq!(roster.names(1).await, names(&["Ada", "Grace Hopper"]));
    assert_eq!(runs(), 2);

    // A `ComputedState` recomputes by itself when what it read is invalidated, and
    // publishes each new value: what a UI binds to.
    let state = {
        let roster = roster.clone();
        ComputedState::new(move || {
            let roster = roster.clone();
            async move { roster.names(1).await }
        })
        .await
    };
    let mut watch = state.watch();
    directory.rename(1, "Ada Lovelace");
    let want = names(&["Ada Lovelace", "Grace Hopper"]);
    tokio::time::timeout(Duration::from_secs(5), async {
        while *watch.borrow_and_update() != want {
            watch.changed().await.expect("the state lives");
        }
    })
    .await?;
    println!("team 1: {:?} (the state followed)", *watch.borrow());
    Ok(())
}
