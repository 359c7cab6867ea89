//! Runnable examples of Coherent; each file in this folder is one, run with
//! `cargo run -p coherent-examples --example <name>`:
//!
//! - `sqlite_users`: a compute service over a SQLite file, a roster view computed from it that
//!   updates after a write, and a `ComputedState` that follows it.
//! - `remote_server` and `remote_client`: the [`api::Users`] service defined once, as a trait
//!   (this library); the server implements it over SQLite and exposes it, the client reads it
//!   through the generated `UsersClient`, whose methods are replicas.
//! - `ts_server`: the server that clients in other languages (the TypeScript client) run
//!   their tests against, over WebSocket; [`test_server`] is its library half.

pub mod test_server;

/// What the server and its clients share: the definition of the `Users` compute service
/// and the types it hands out. In an application this is the crate both depend on.
pub mod api {
    use coherent::prelude::*;
    use serde::{Deserialize, Serialize};

    /// A row of the server's `users` table.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct User {
        /// Its key.
        pub id: i64,
        /// Its display name.
        pub name: String,
        /// The team it belongs to.
        pub team: i64,
    }

    /// Why a read failed. Errors are cached (briefly) like values, so it is `Clone`; they
    /// travel to clients, so it is a serde type; and a client's stub reports a lost
    /// connection through it, hence `From<RpcError>` (derived: the `#[rpc_error]` variant).
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, FromRpcError)]
    pub enum UsersError {
        /// The server's database failed.
        Database(String),
        /// The server could not be reached.
        #[rpc_error]
        Unavailable(String),
    }

    impl std::fmt::Display for UsersError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match self {
                Self::Database(e) => write!(f, "database error: {e}"),
                Self::Unavailable(e) => write!(f, "server unavailable: {e}"),
            }
        }
    }

    /// The `Users` compute service. `#[compute_service]` also generates `UsersServer` (add
    /// it to a `RemoteServer` to expose every method) and `UsersClient` (a stub that
    /// implements this trait with replicas of the server's results).
    #[compute_service]
    pub trait Users {
        /// One user, or `None`.
        async fn user(&self, id: i64) -> Result<Option<User>, UsersError>;
        /// The ids of a team's members.
        async fn team_members(&self, team: i64) -> Result<Vec<i64>, UsersError>;
    }
}
