//! The client half of the replica example (start `remote_server` first). `UsersClient`,
//! generated from the `Users` trait of `examples/lib.rs`, implements that trait with
//! replicas of the server's results. The roster below is written against the trait; a
//! `ComputedState` built from it prints a new line the moment the server's data changes,
//! and not otherwise.
//!
//! ```sh
//! cargo run -p coherent-examples --example remote_client [rpc address]
//! ```

use std::net::SocketAddr;

use coherent::prelude::*;
use coherent_examples::api::{Users, UsersClient};

/// A view built on any implementation of `Users`: the service itself in the server's
/// process, or the remote stub here.
#[derive(Clone, ComputeService)]
struct Team<U: Users + Clone + Send + Sync + 'static> {
    handle: ServiceHandle,
    users: U,
}

#[compute_service]
impl<U: Users + Clone + Send + Sync + 'static> Team<U> {
    /// Built from replicas: recomputed only when one of them is invalidated.
    #[compute]
    async fn roster(&self, team: i64) -> String {
        println!("  (recomputing the roster)");
        let ids = match self.users.team_members(team).await {
            Ok(ids) => ids,
            Err(e) => return e.to_string(),
        };
        let mut names = Vec::new();
        for id in ids {
            match self.users.user(id).await {
                Ok(Some(u)) => names.push(format!("{} (#{})", u.name, u.id)),
                Ok(None) => names.push(format!("nobody (#{id})")),
                Err(e) => names.push(e.to_string()),
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
        users: UsersClient::new(remote),
    };
    let state = {
        let team = team.clone();
        ComputedState::new(move || {
            let team = team.clone();
            async move { team.roster(1).await }
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
