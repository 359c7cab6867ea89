//! The guide, chapter 5 (docs/guide/src/operating.md): the knobs and the gauges. A server
//! with its limits set where a deployment sets them, a host of the cluster, every counter
//! in Prometheus' text format, a hostile request refused with a reason, and what a host
//! says about its own health.
//!
//! ```sh
//! cargo run -p coherent-examples --example guide_operating
//! ```

use std::time::Duration;

use coherent::metrics::Observer;
use coherent::ops::{Database, Host};
use coherent::prelude::*;
use coherent::rpc::Config;
use coherent_examples::api::{Users, UsersClient, UsersServer};
use coherent_examples::guide::{get, Directory};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Limits: each is a named setting with a default; these are the ones a deployment
    // looks at first. A client that goes past one gets an error or a close with a reason,
    // is counted, and the other clients do not notice.
    let directory = Directory::new();
    let server = RemoteServer::new()
        .expose_service(UsersServer::new(directory.clone()))
        .max_replicas_per_connection(10_000) // replicas one client may hold
        .max_sse_feeds(1_000) // open Server-Sent Events feeds, all gateways together
        .max_gateway_args_len(256); // bytes of a gateway request's `args`
    let endpoint = Endpoint::builder()
        .config(
            Config::default()
                .max_connections(10_000) // connections open at once
                .max_inbound_calls(256) // calls in flight per connection
                .max_message_size(4 << 20) // bytes of one frame
                .max_queued_bytes(8 << 20), // bytes queued to one slow reader
        )
        .service(server.service())
        .build();

    // The cluster's side: a host over the operation log (SQLite here; PostgreSQL with
    // `Database::postgres`). Its health is in `stats()` and in the metrics below.
    let dir = std::env::temp_dir().join(format!("coherent-guide-ops-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let host = Host::builder(Database::sqlite(dir.join("log.db"))?)
        .id("guide")
        .start()
        .await?;

    // Every counter, in Prometheus' text format: the observer reads the cache, the
    // endpoint, the replicas' server and the host at each scrape.
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    let observer = Observer::new()
        .registry("default", Registry::global())
        .endpoint("rpc", &endpoint)
        .remote_server("users", &server)
        .host("guide", &host);
    let scrape = move || {
        observer.record();
        std::future::ready(prometheus.render())
    };
    let app = axum::Router::new()
        .nest("/api", server.gateway())
        .route("/metrics", axum::routing::get(scrape));
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let http_addr = http.local_addr()?;
    tokio::spawn(async move { axum::serve(http, app).await });
    let rpc = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let rpc_addr = rpc.local_addr()?;
    tokio::spawn(async move { endpoint.serve_tcp(rpc).await });

    // Some traffic: a client's replicas, one of them invalidated.
    let users = UsersClient::new(RemoteClient::connect_tcp(rpc_addr).await?);
    assert!(users.user(1).await.is_ok_and(|u| u.is_some()));
    directory.rename(1, "Ada Lovelace");
    server.invalidations_delivered().await;
    assert!(users
        .user(1)
        .await
        .is_ok_and(|u| u.is_some_and(|u| u.name == "Ada Lovelace")));

    // A hostile request: arguments longer than the limit. A reason, not a crash.
    let long = format!("/api/Users.user?args=%5B{}%5D", "1".repeat(300));
    let (status, _, body) = get(http_addr, &long, None).await?;
    assert_eq!(status, 414);
    println!("a request over max_gateway_args_len: {status} {body}");

    // The scrape.
    let (status, _, metrics) = get(http_addr, "/metrics", None).await?;
    assert_eq!(status, 200);
    for name in [
        "coherent_cache_hits_total",
        "coherent_cache_invalidations_total",
        "coherent_rpc_connections_open",
        "coherent_rpc_calls_in_total",
        "coherent_remote_replicas_held",
        "coherent_remote_pushes_total",
        "coherent_ops_commands_total",
        "coherent_ops_fences_total",
    ] {
        let line = metrics
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} is scraped"));
        println!("{line}");
    }

    // What a host says about itself: fenced (not answering from its cache) while it may
    // have missed other hosts' operations, its peers, how far it read the log.
    tokio::time::timeout(Duration::from_secs(5), async {
        while host.is_fenced() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await?;
    let stats = host.stats();
    println!(
        "host guide: fenced {}, {} fences, {} flushes, {} peers, log read up to {}",
        host.is_fenced(),
        stats.fences,
        stats.flushes,
        stats.peers,
        stats.horizon
    );
    host.stop().await;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
