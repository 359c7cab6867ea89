//! The client half of the replica example (start `remote_server` first). Its compute
//! methods read the server's `Users.user` through replicas; a `ComputedState` built from
//! them prints a new line the moment the server's data changes, and not otherwise.
//!
//! ```sh
//! cargo run -p coherent-examples --example remote_client [rpc address]
//! ```

use std::net::SocketAddr;

use coherent::{compute_service, ComputeService, ComputedState, ServiceHandle};
use coherent_remote::RemoteClient;
use serde::{Deserialize, Serialize};

/// The client's copy of the server's type: the same fields, the same order.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct User {
    id: i64,
    name: String,
    team: i64,
}

coherent_remote::replica_service! {
    /// The typed client stub of the server's `Users` service. Its methods are compute
    /// methods: a round trip the first time, a cache hit after that, until the server says
    /// the result changed. Each wraps the server's output in `Result<_, RpcError>`.
    struct UsersReplica = "Users" {
        async fn user(&self, id: i64) -> Result<Option<User>, String>;
    }
}

#[derive(Clone, ComputeService)]
struct Team {
    handle: ServiceHandle,
    users: UsersReplica,
}

#[compute_service]
impl Team {
    /// Built from replicas: recomputed only when one of them is invalidated.
    #[compute]
    async fn roster(&self) -> String {
        println!("  (recomputing the roster)");
        let mut names = Vec::new();
        for id in [1, 2] {
            match self.users.user(id).await {
                Ok(Ok(Some(u))) => names.push(format!("{} (#{})", u.name, u.id)),
                Ok(Ok(None)) => names.push(format!("nobody (#{id})")),
                Ok(Err(e)) => names.push(format!("database error: {e}")),
                Err(e) => names.push(format!("connection error: {e}")),
            }
        }
        names.join(", ")
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let addr: SocketAddr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:7878".to_owned())
        .parse()?;
    let remote = RemoteClient::connect_tcp(addr).await?;
    println!("connected to {addr}");
    let team = Team {
        handle: ServiceHandle::new(),
        users: UsersReplica::new(remote),
    };
    let state = {
        let team = team.clone();
        ComputedState::new(move || {
            let team = team.clone();
            async move { team.roster().await }
        })
        .await
    };
    let mut roster = state.watch();
    println!("team 1: {}", *roster.borrow_and_update());
    while roster.changed().await.is_ok() {
        println!("team 1: {}", *roster.borrow_and_update());
    }
    Ok(())
}
