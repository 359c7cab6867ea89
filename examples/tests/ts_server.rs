//! The test server of other languages' clients, checked with the Rust client over
//! WebSocket in MessagePack: what the TypeScript tests rely on works, and each hostile mode
//! breaks the protocol the way it says.

use std::net::SocketAddr;
use std::time::Duration;

use coherent::prelude::*;
use coherent::rpc::{Config, Format, Peer};
use coherent_examples::test_server::{CalcClient, Counters, CountersClient, Options, TestServer};
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn start(options: Options) -> (TestServer, SocketAddr) {
    let server = TestServer::new(options);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = server.router();
    tokio::spawn(async move { axum::serve(listener, router).await });
    (server, addr)
}

/// MessagePack, and a stream window of 16 items.
fn msgpack() -> Config {
    Config::default()
        .format(Format::MessagePack)
        .stream_window(16)
}

async fn connect(addr: SocketAddr, path: &str, token: &str) -> Result<Peer, RpcError> {
    Endpoint::builder()
        .config(msgpack())
        .token(token)
        .build()
        .connect_websocket(&format!("ws://{addr}{path}"))
        .await
}

async fn eventually(what: &str, mut cond: impl AsyncFnMut() -> bool) {
    for _ in 0..500 {
        if cond().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never happened: {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_errors_streams_and_cancellation() {
    let (_server, addr) = start(Options::default()).await;
    let refused = connect(addr, "/rpc", "wrong").await.unwrap_err();
    assert_eq!(refused.code(), ErrorCode::Unauthenticated);
    assert!(refused.message().contains("bad token"), "{refused}");

    let peer = connect(addr, "/rpc", "secret").await.unwrap();
    assert_eq!(peer.format(), Format::MessagePack);
    let calc = CalcClient::new(peer);
    assert_eq!(calc.add(2, 40).await.unwrap(), 42);
    assert_eq!(calc.echo("héllo".into()).await.unwrap(), "héllo");
    let blob = calc.blob(3 << 20).await.unwrap();
    assert_eq!(blob.len(), 3 << 20);
    assert!(blob.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
    assert_eq!(calc.div(7, 2).await.unwrap(), Ok(3));
    assert_eq!(
        calc.div(1, 0).await.unwrap(),
        Err("division by zero".to_owned())
    );
    let e = calc.fail(7, "too busy".into()).await.unwrap_err();
    assert_eq!((e.code(), e.message()), (ErrorCode::Overloaded, "too busy"));
    let e = calc.fail(4242, "odd".into()).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::Unknown);

    let items: Vec<u32> = calc
        .count(1000)
        .await
        .unwrap()
        .map(Result::unwrap)
        .collect()
        .await;
    assert_eq!(items, (0..1000).collect::<Vec<_>>());
    assert_eq!(calc.produced().await.unwrap(), 1000);

    // A consumer that stops reading holds the producer to what it read plus its window.
    let mut stream = calc.count(1_000_000).await.unwrap();
    for i in 0..10 {
        assert_eq!(stream.next().await.unwrap().unwrap(), i);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let produced = calc.produced().await.unwrap() - 1000;
    assert!((10..=10 + 16).contains(&produced), "{produced}");
    drop(stream);

    assert_eq!(calc.sleep(1).await.unwrap(), 1);
    let e = calc
        .clone()
        .with_timeout(Duration::from_millis(50))
        .sleep(60_000)
        .await
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::DeadlineExceeded);
    eventually("the aborted sleep is counted", async || {
        calc.cancelled().await.unwrap() == 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_are_invalidated_by_bump_and_the_gateway_answers() {
    // The Rust `RemoteClient` presents no token: this server accepts the empty one.
    let (server, addr) = start(Options {
        token: String::new(),
        initial: vec![("a".into(), 1), ("b".into(), 10)],
        ..Options::default()
    })
    .await;
    let url = format!("ws://{addr}/rpc");
    let remote = RemoteClient::builder()
        .config(msgpack())
        .registry(&Registry::new())
        .connect_with(move |e| {
            let url = url.clone();
            async move { e.connect_websocket(&url).await }
        })
        .await
        .unwrap();
    let counters = CountersClient::new(remote);
    assert_eq!(counters.get("a".into()).await, Ok(1));
    assert_eq!(counters.get("never".into()).await, Ok(0));
    let names = vec!["a".to_owned(), "b".to_owned()];
    assert_eq!(counters.sum(names.clone()).await, Ok(11));
    let get = counters.get_computed("a".into()).await;
    let sum = counters.sum_computed(names.clone()).await;
    assert!(get.is_consistent() && sum.is_consistent());

    let calc = CalcClient::new(connect(addr, "/rpc", "").await.unwrap());
    assert_eq!(calc.bump("a".into(), 5).await.unwrap(), 6);
    // `bump` answers once the holder of the replica applied the invalidation.
    assert!(!get.is_consistent() && !sum.is_consistent());
    assert_eq!(server.counter("a"), 6);
    assert_eq!(counters.get("a".into()).await, Ok(6));
    assert_eq!(counters.sum(names).await, Ok(16));

    // The HTTP gateway: the same value, as JSON.
    let mut http = tokio::net::TcpStream::connect(addr).await.unwrap();
    http.write_all(
        b"GET /gateway/Counters.get?args=%5B%22a%22%5D HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await
    .unwrap();
    let mut answer = String::new();
    http.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("{\"Ok\":6}"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_hostile_mode_makes_the_client_close() {
    let (_server, addr) = start(Options::default()).await;

    let e = connect(addr, "/hostile?mode=badack", "").await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::Protocol, "{e}");

    for (mode, code) in [
        ("kind15", ErrorCode::Protocol),
        ("toolarge", ErrorCode::TooLarge),
    ] {
        let peer = connect(addr, &format!("/hostile?mode={mode}"), "")
            .await
            .unwrap();
        let why = tokio::time::timeout(Duration::from_secs(5), peer.closed())
            .await
            .unwrap_or_else(|_| panic!("{mode}: the client did not close"));
        assert_eq!(why.code(), code, "{mode}: {why}");
    }

    for path in [
        "/hostile?mode=garbage-batch",
        "/hostile?mode=kind15&after=call",
    ] {
        let calc = CalcClient::new(connect(addr, path, "").await.unwrap());
        let failed = match calc.count(10).await {
            Ok(mut stream) => stream.next().await.unwrap().unwrap_err(),
            Err(e) => e,
        };
        assert!(
            matches!(failed.code(), ErrorCode::Disconnected | ErrorCode::Protocol),
            "{path}: {failed}"
        );
        let why = calc.caller().closed().await;
        assert_eq!(why.code(), ErrorCode::Protocol, "{path}: {why}");
    }
}
