//! The guide, chapter 4 (docs/guide/src/browser.md): one axum app serves the `Users`
//! service to browsers two ways: the RPC protocol over WebSocket at `/rpc`, for the
//! TypeScript client's replicas, and the HTTP gateway at `/api`, for any HTTP client: JSON
//! with an `ETag` (and `304 Not Modified` while it holds), and a Server-Sent Events feed
//! that says when a value was invalidated and sends the new one. The program then reads the
//! gateway the way a browser's `fetch` and `EventSource` do, over plain HTTP.
//!
//! ```sh
//! cargo run -p coherent-examples --example guide_browser            # checks, then exits
//! cargo run -p coherent-examples --example guide_browser -- --serve # keeps serving
//! ```

use std::time::Duration;

use coherent::prelude::*;
use coherent::rpc::Config;
use coherent_examples::api::UsersServer;
use coherent_examples::guide::{get, header, Directory};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let serve = std::env::args().any(|a| a == "--serve");
    let directory = Directory::new();
    let server = RemoteServer::new().expose_service(UsersServer::new(directory.clone()));
    // Browsers send an `Origin`: a WebSocket is accepted only from the origins allowed here
    // (the page's own origin, in production).
    let endpoint = Endpoint::builder()
        .config(Config::default().allowed_origins(["http://127.0.0.1:5173"]))
        .service(server.service())
        .build();
    let app = axum::Router::new()
        .route("/rpc", axum::routing::get(endpoint.websocket_handler()))
        .nest("/api", server.gateway());
    let port = if serve { 8080 } else { 0 };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    println!("serving ws://{addr}/rpc and http://{addr}/api");
    if serve {
        std::future::pending::<()>().await;
    }

    // `fetch("/api/Users.user?args=[2]")`: the value as JSON, from the server's cache (a
    // method's `Result` is `{"Ok": ...}` or `{"Err": ...}`, as serde writes it).
    let path = "/api/Users.user?args=%5B2%5D";
    let (status, headers, body) = get(addr, path, None).await?;
    assert_eq!(status, 200);
    assert_eq!(body, r#"{"Ok":{"id":2,"name":"Grace","team":1}}"#);
    let etag = header(&headers, "etag").expect("an ETag");
    println!("GET {path}: {status} {body} (ETag {etag})");

    // Asked again with the ETag: unchanged, so no body.
    let (status, _, body) = get(addr, path, Some(&etag)).await?;
    assert_eq!((status, body.as_str()), (304, ""));
    println!("GET with If-None-Match: {status}");

    // `new EventSource("/api/Users.user/events?args=[2]")`: the value, then, at each
    // invalidation, an `invalidated` event and the new value.
    let mut events = TcpStream::connect(addr).await?;
    events
        .write_all(b"GET /api/Users.user/events?args=%5B2%5D HTTP/1.0\r\nHost: x\r\n\r\n")
        .await?;
    let mut feed = String::new();
    read_until(&mut events, &mut feed, "\"Grace\"").await?;
    directory.rename(2, "Grace Hopper");
    read_until(&mut events, &mut feed, "\"Grace Hopper\"").await?;
    let invalidated = feed
        .find("event: invalidated")
        .expect("an invalidated event");
    assert!(invalidated < feed.find("Grace Hopper").expect("the new value"));
    println!(
        "the event feed:\n{}",
        feed.split("\r\n\r\n").nth(1).unwrap_or("")
    );

    // The old ETag no longer matches: the new value comes back.
    let (status, _, body) = get(addr, path, Some(&etag)).await?;
    assert_eq!(status, 200);
    assert!(body.contains("Grace Hopper"));
    println!("GET with the old ETag: {status} {body}");
    Ok(())
}

/// Reads the event stream until `pattern` has arrived (5 s at most).
async fn read_until(
    stream: &mut TcpStream,
    seen: &mut String,
    pattern: &str,
) -> anyhow::Result<()> {
    tokio::time::timeout(Duration::from_secs(5), async {
        let mut buf = [0u8; 4096];
        while !seen.contains(pattern) {
            let n = stream.read(&mut buf).await?;
            anyhow::ensure!(n > 0, "the feed closed");
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        Ok(())
    })
    .await?
}
