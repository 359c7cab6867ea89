//! The server half of the replica example: a compute service over SQLite, exposed to
//! remote clients over Coherent RPC (and to curl over HTTP), whose data changes every two
//! seconds. Run it, then `remote_client` in a second terminal:
//!
//! ```sh
//! cargo run -p coherent-examples --example remote_server
//! cargo run -p coherent-examples --example remote_client     # in a second terminal
//! curl 'http://127.0.0.1:7879/api/Users.user?args=%5B1%5D'   # the same value over HTTP
//! curl -N 'http://127.0.0.1:7879/api/Users.user/events?args=%5B1%5D'
//! ```
//!
//! Arguments: `[rpc address] [http address]`, by default `127.0.0.1:7878 127.0.0.1:7879`.

use std::sync::Arc;
use std::time::Duration;

use coherent::{compute_service, ComputeService, ServiceHandle};
use coherent_remote::RemoteServer;
use coherent_rpc::Endpoint;
use parking_lot::Mutex;
use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

/// What the server hands out. Clients decode it into their own copy of this type.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct User {
    id: i64,
    name: String,
    team: i64,
}

/// Errors are cached (briefly) like values, so they must be `Clone`; and they travel to
/// clients, so they must be serde types.
type DbResult<T> = Result<T, String>;

#[derive(Clone, ComputeService)]
struct Users {
    handle: ServiceHandle,
    db: Arc<Mutex<Connection>>,
}

#[compute_service]
impl Users {
    /// One user, or `None`. Clients hold replicas of it.
    #[compute]
    async fn user(&self, id: i64) -> DbResult<Option<User>> {
        println!("  ran user({id})");
        let db = self.db.lock();
        db.prepare_cached("SELECT id, name, team FROM users WHERE id = ?1")
            .and_then(|mut q| {
                q.query_row(params![id], |row| {
                    Ok(User {
                        id: row.get(0)?,
                        name: row.get(1)?,
                        team: row.get(2)?,
                    })
                })
                .optional()
            })
            .map_err(|e| e.to_string())
    }
}

impl Users {
    fn open() -> anyhow::Result<Self> {
        let db = Connection::open_in_memory()?;
        db.execute_batch(
            "CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT NOT NULL, team INTEGER NOT NULL);
             INSERT INTO users VALUES (1, 'Ada', 1), (2, 'Grace', 1), (3, 'Linus', 2);",
        )?;
        Ok(Self {
            handle: ServiceHandle::new(),
            db: Arc::new(Mutex::new(db)),
        })
    }

    /// Commit, then invalidate: every client's replica of `user(id)` hears of it.
    fn rename(&self, id: i64, name: &str) -> anyhow::Result<()> {
        self.db.lock().execute(
            "UPDATE users SET name = ?2 WHERE id = ?1",
            params![id, name],
        )?;
        self.invalidate_user(id);
        Ok(())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let rpc_addr = args.next().unwrap_or_else(|| "127.0.0.1:7878".to_owned());
    let http_addr = args.next().unwrap_or_else(|| "127.0.0.1:7879".to_owned());
    let users = Users::open()?;

    // The one line that exposes a compute method; the rest is serving it.
    let remote =
        RemoteServer::new().expose("Users.user", users.clone(), |u, (id,): (i64,)| async move {
            u.user_computed(id).await
        });
    let endpoint = Endpoint::builder().service(remote.service()).build();
    let rpc = tokio::net::TcpListener::bind(&rpc_addr).await?;
    tokio::spawn(async move { endpoint.serve_tcp(rpc).await });
    let app = axum::Router::new().nest("/api", remote.gateway());
    let http = tokio::net::TcpListener::bind(&http_addr).await?;
    tokio::spawn(async move { axum::serve(http, app).await });
    println!("serving Users.user on {rpc_addr} (rpc) and http://{http_addr}/api (http)");

    let names = ["Ada", "Ada Lovelace", "Countess of Lovelace"];
    for round in 1usize.. {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let name = names[round % names.len()];
        users.rename(1, name)?;
        println!("renamed user 1 to {name:?}");
    }
    Ok(())
}
