//! The server half of the replica example: the `Users` service of `examples/lib.rs`
//! implemented over SQLite, exposed to remote clients over Coherent RPC (and to curl over
//! HTTP), whose data changes every two seconds. Run it, then `remote_client` in a second
//! terminal:
//!
//! ```sh
//! cargo run -p coherent-examples --example remote_server
//! cargo run -p coherent-examples --example remote_client     # in a second terminal
//! curl 'http://127.0.0.1:7879/api/Users.user?args=%5B1%5D'   # the same value over HTTP
//! curl -N 'http://127.0.0.1:7879/api/Users.user/events?args=%5B1%5D'
//! curl http://127.0.0.1:7879/metrics                        # the counters, for Prometheus
//! ```
//!
//! Arguments: `[rpc address] [http address]`, by default `127.0.0.1:7878 127.0.0.1:7879`.

use std::sync::Arc;
use std::time::Duration;

use coherent::metrics::Observer;
use coherent::prelude::*;
use coherent_examples::api::{User, Users, UsersError, UsersServer};
use parking_lot::Mutex;
use rusqlite::{params, Connection, OptionalExtension};

#[derive(Clone, ComputeService)]
struct SqliteUsers {
    handle: ServiceHandle,
    db: Arc<Mutex<Connection>>,
}

fn db_error(e: rusqlite::Error) -> UsersError {
    UsersError::Database(e.to_string())
}

#[compute_service]
impl Users for SqliteUsers {
    async fn user(&self, id: i64) -> Result<Option<User>, UsersError> {
        println!("  ran user({id})");
        let db = self.db.lock();
        let mut q = db
            .prepare_cached("SELECT id, name, team FROM users WHERE id = ?1")
            .map_err(db_error)?;
        q.query_row(params![id], |row| {
            Ok(User {
                id: row.get(0)?,
                name: row.get(1)?,
                team: row.get(2)?,
            })
        })
        .optional()
        .map_err(db_error)
    }

    async fn team_members(&self, team: i64) -> Result<Vec<i64>, UsersError> {
        println!("  ran team_members({team})");
        let db = self.db.lock();
        let mut q = db
            .prepare_cached("SELECT id FROM users WHERE team = ?1 ORDER BY id")
            .map_err(db_error)?;
        let ids = q
            .query_map(params![team], |row| row.get(0))
            .map_err(db_error)?;
        ids.collect::<Result<_, _>>().map_err(db_error)
    }
}

impl SqliteUsers {
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
    let users = SqliteUsers::open()?;

    // The one line that exposes every method of `Users`; the rest is serving it.
    let remote = RemoteServer::new().expose_service(UsersServer::new(users.clone()));
    let endpoint = Endpoint::builder().service(remote.service()).build();
    let rpc = tokio::net::TcpListener::bind(&rpc_addr).await?;
    tokio::spawn({
        let endpoint = endpoint.clone();
        async move { endpoint.serve_tcp(rpc).await }
    });
    // The counters in Prometheus' text format: the exporter renders what the observer
    // recorded from the cache, the RPC endpoint and the replicas at each scrape.
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    let observer = Observer::new()
        .registry("default", Registry::global())
        .endpoint("rpc", &endpoint)
        .remote_server("users", &remote);
    let scrape = move || {
        observer.record();
        std::future::ready(prometheus.render())
    };
    let app = axum::Router::new()
        .nest("/api", remote.gateway())
        .route("/metrics", axum::routing::get(scrape));
    let http = tokio::net::TcpListener::bind(&http_addr).await?;
    tokio::spawn(async move { axum::serve(http, app).await });
    println!("serving Users on {rpc_addr} (rpc), http://{http_addr}/api (http) and http://{http_addr}/metrics");

    let names = ["Ada", "Ada Lovelace", "Countess of Lovelace"];
    for round in 1usize.. {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let name = names[round % names.len()];
        users.rename(1, name)?;
        println!("renamed user 1 to {name:?}");
    }
    Ok(())
}
