//! What `tasks serve --metrics` shows: the HTTP server's limits at work, and the backend's
//! cache, endpoint and operation host, in Prometheus' text format.

use std::sync::Arc;

use coherent_tasks::app::{HttpLimits, HttpStats, Metrics};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::{live_backend, Db};

/// `GET /metrics` of `metrics`, served on a loopback port of its own: the body.
async fn scrape(addr: std::net::SocketAddr) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).await.unwrap();
    let text = String::from_utf8(answer).unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.contains("content-type: text/plain; version=0.0.4"),
        "{text}"
    );
    text
}

/// `metrics` served on a loopback port, with the server's default limits.
async fn serve_metrics(metrics: &Metrics) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(coherent_tasks::app::serve_http_with(
        listener,
        metrics.router(),
        HttpLimits::default(),
    ));
    addr
}

/// The value of the sample `name{labels}` in a scrape, if there is one.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// A connection refused for its address's limit is counted; the connections open are a
/// gauge that falls again when one closes.
#[tokio::test]
async fn the_http_limits_show_in_the_metrics() {
    let db = Db::sqlite();
    let limits = HttpLimits {
        max_connections_per_ip: 1,
        // 127.0.0.1 is exempt by default (a proxy on this host): not here.
        exempt_ips: vec![],
        // The held connection sits idle while the test runs: a stalled machine must not
        // let the server close it as a slow request head.
        header_read_timeout: std::time::Duration::from_secs(600),
        ..Default::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stats = Arc::new(HttpStats::default());
    let router = coherent_tasks::app::direct_router(&db.config)
        .await
        .unwrap();
    let serving = tokio::spawn(coherent_tasks::app::serve_http_counted(
        listener,
        router,
        limits,
        stats.clone(),
    ));
    let metrics = Metrics::new(coherent::metrics::Observer::new(), [("api", stats)]);
    let at = serve_metrics(&metrics).await;
    let open = "coherent_tasks_http_connections_open{server=\"api\"}";
    let refused = "coherent_tasks_http_connections_refused_per_ip_total{server=\"api\"}";

    // One connection, answered (so accepted), kept open.
    let mut held = tokio::net::TcpStream::connect(addr).await.unwrap();
    held.write_all(b"GET /api/projects HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 12];
    held.read_exact(&mut first).await.unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    // A second from the same address: closed without an answer, and counted.
    let mut second = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _ = second
        .write_all(b"GET /api/projects HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let mut buf = Vec::new();
    let _ = second.read_to_end(&mut buf).await;
    assert!(buf.is_empty(), "{}", String::from_utf8_lossy(&buf));
    let text = scrape(at).await;
    assert_eq!(sample(&text, refused), Some(1.0), "{text}");
    assert_eq!(sample(&text, open), Some(1.0), "{text}");
    for counter in [
        "coherent_tasks_http_requests_paced_total",
        "coherent_tasks_http_requests_refused_total",
        "coherent_tasks_http_writes_stalled_total",
    ] {
        let series = format!("{counter}{{server=\"api\"}}");
        assert_eq!(sample(&text, &series), Some(0.0), "{series} in {text}");
    }

    // Closed: the gauge falls (the server sees the close a moment later).
    drop(held);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let text = scrape(at).await;
        if sample(&text, open) == Some(0.0) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the connection closed but the gauge did not fall: {text}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    serving.abort();
}

/// The backend's observer reports its cache, endpoint, replicas' server and operation host,
/// labelled `backend`, beside the HTTP server's counts: a command run through `/api` is
/// counted on the host, and a read answered twice is a hit of the cache. A WebSocket on
/// `/rpc` is an open connection of the HTTP server until it closes.
#[tokio::test]
async fn the_backends_counters_show_in_the_metrics() {
    let db = Db::sqlite();
    let backend = live_backend(&db.config).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stats = Arc::new(HttpStats::default());
    let web = tempfile::tempdir().unwrap();
    let serving = tokio::spawn(coherent_tasks::app::serve_http_counted(
        listener,
        backend.http_router(web.path().to_owned()).await.unwrap(),
        HttpLimits::default(),
        stats.clone(),
    ));
    let metrics = Metrics::new(backend.observer(), [("api", stats)]);
    let at = serve_metrics(&metrics).await;

    let send = |request: String| async move {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).await.unwrap();
        String::from_utf8(answer).unwrap()
    };
    let body = r#"{"name":"metrics"}"#;
    let created = send(format!(
        "POST /api/projects HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    ))
    .await;
    assert!(created.starts_with("HTTP/1.1 201"), "{created}");
    // Reads until one is a hit: the first computes the list; a later one is answered from
    // the cache, unless the machine stalled past the result's keep-alive in between.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    let text = loop {
        let read =
            send("GET /api/projects HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".into()).await;
        assert!(read.starts_with("HTTP/1.1 200"), "{read}");
        let text = scrape(at).await;
        let hits = sample(&text, "coherent_cache_hits_total{registry=\"backend\"}");
        if hits.is_some_and(|h| h >= 1.0) {
            break text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no read was a hit: {text}"
        );
    };
    assert_eq!(
        sample(&text, "coherent_ops_commands_total{host=\"backend\"}"),
        Some(1.0),
        "{text}"
    );
    for series in [
        "coherent_cache_entries{registry=\"backend\"}",
        "coherent_rpc_connections_open{endpoint=\"backend\"}",
        "coherent_remote_replicas_held{server=\"backend\"}",
        "coherent_tasks_http_connections_open{server=\"api\"}",
    ] {
        assert!(sample(&text, series).is_some(), "{series} in {text}");
    }

    // A WebSocket keeps its place in the gauge through the upgrade, and gives it back when
    // it closes (the closed HTTP connections above leave the gauge a moment after their
    // answers).
    let open = "coherent_tasks_http_connections_open{server=\"api\"}";
    let until = |want: f64| async move {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let text = scrape(at).await;
            if sample(&text, open) == Some(want) {
                return text;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{open} never read {want}: {text}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    };
    let client = coherent::rpc::Endpoint::builder().build();
    let socket = client
        .connect_websocket(&format!("ws://{addr}/rpc"))
        .await
        .unwrap();
    let text = until(1.0).await;
    assert!(
        sample(&text, "coherent_rpc_connections_open{endpoint=\"backend\"}") == Some(1.0),
        "{text}"
    );
    socket.close();
    until(0.0).await;
    serving.abort();
    backend.stop().await;
}
