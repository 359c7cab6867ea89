//! Runnable examples of Coherent; each file in this folder is one, run with
//! `cargo run -p coherent-examples --example <name>`:
//!
//! - `sqlite_users`: a compute service over a SQLite file, a roster view computed from it that
//!   updates after a write, and a `ComputedState` that follows it.
//! - `remote_server` and `remote_client`: the [`api::Users`] service defined once, as a trait
//!   (this library); the server implements it over SQLite and exposes it, the client reads it
//!   through the generated `UsersClient`, whose methods are replicas.
//! - `guide_replicas`, `guide_browser`, `guide_operating`: the programs of the guide's
//!   chapters (docs/guide), with [`guide::Directory`].
//! - `ts_server`: the server that clients in other languages (the TypeScript client) run
//!   their tests against, over WebSocket; [`test_server`] is its library half.

pub mod test_server;

/// What the guide's chapters share (docs/guide): the `Users` service of [`api`] served from
/// memory, so that each chapter's program runs alone, with no file or database to set up.
pub mod guide {
    use std::collections::BTreeMap;
    use std::net::SocketAddr;
    use std::sync::Arc;

    use coherent::prelude::*;
    use parking_lot::Mutex;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use crate::api::{User, Users, UsersError};

    // ANCHOR: directory
    /// The server's side of `Users`: rows in memory (a database, in a real service).
    #[derive(Clone, ComputeService)]
    pub struct Directory {
        handle: ServiceHandle,
        rows: Arc<Mutex<BTreeMap<i64, User>>>,
    }

    #[compute_service]
    impl Users for Directory {
        async fn user(&self, id: i64) -> Result<Option<User>, UsersError> {
            Ok(self.rows.lock().get(&id).cloned())
        }

        async fn team_members(&self, team: i64) -> Result<Vec<i64>, UsersError> {
            let rows = self.rows.lock();
            Ok(rows
                .values()
                .filter(|u| u.team == team)
                .map(|u| u.id)
                .collect())
        }
    }

    impl Directory {
        /// Ada and Grace in team 1, Linus in team 2.
        pub fn new() -> Self {
            let rows = [(1, "Ada", 1), (2, "Grace", 1), (3, "Linus", 2)].map(|(id, name, team)| {
                let name = name.to_owned();
                (id, User { id, name, team })
            });
            Self {
                handle: ServiceHandle::new(),
                rows: Arc::new(Mutex::new(BTreeMap::from(rows))),
            }
        }

        /// A write: the data first, then the one call that says what it changed. Every
        /// result computed from `user(id)`, here and in every client's replica, goes with it.
        pub fn rename(&self, id: i64, name: &str) {
            if let Some(user) = self.rows.lock().get_mut(&id) {
                user.name = name.to_owned();
            }
            self.invalidate_user(id);
        }
    }
    // ANCHOR_END: directory

    /// A `GET` over HTTP/1.0, as the guide's programs read the gateway without an HTTP
    /// client crate (the server closes the connection after the answer): the status, the
    /// headers' text and the body.
    pub async fn get(
        addr: SocketAddr,
        path: &str,
        if_none_match: Option<&str>,
    ) -> anyhow::Result<(u16, String, String)> {
        let mut stream = TcpStream::connect(addr).await?;
        let condition = if_none_match
            .map(|tag| format!("If-None-Match: {tag}\r\n"))
            .unwrap_or_default();
        let request = format!("GET {path} HTTP/1.0\r\nHost: x\r\n{condition}\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await?;
        let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        Ok((status, head.to_owned(), body.to_owned()))
    }

    /// The value of header `name` in `head` (the headers' text [`get`] answers).
    pub fn header(head: &str, name: &str) -> Option<String> {
        head.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.eq_ignore_ascii_case(name)
                .then(|| value.trim().to_owned())
        })
    }

    impl Default for Directory {
        fn default() -> Self {
            Self::new()
        }
    }
}

// ANCHOR: api
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
// ANCHOR_END: api
