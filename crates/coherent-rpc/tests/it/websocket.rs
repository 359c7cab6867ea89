//! The WebSocket transport, served from an axum app on a loopback port.

use axum::routing::get;
use axum::Router;
use coherent_rpc::{Config, Endpoint};
use tokio::net::{TcpListener, TcpStream};

use crate::support::*;

#[tokio::test]
async fn calls_and_streams_work_over_a_websocket_served_by_axum() {
    let (server, _) = calc_server(Config::default().max_message_size(8 << 20));
    let app = Router::new().route("/rpc", get(server.websocket_handler()));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let client = Endpoint::builder()
        .config(Config::default().max_message_size(8 << 20))
        .build();
    let peer = client
        .connect_websocket(&format!("ws://{addr}/rpc"))
        .await
        .unwrap();
    let calc = CalcClient::new(peer);
    assert_eq!(calc.sum(2, 3).await.unwrap(), 5);
    // Larger than one WebSocket message: the byte stream spans several.
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 253) as u8).collect();
    assert_eq!(calc.echo(data.clone()).await.unwrap(), data);
    use futures::StreamExt;
    let items: Vec<_> = calc.items(500, 100).await.unwrap().collect().await;
    assert_eq!(items.len(), 500);
}

#[tokio::test]
async fn a_websocket_connect_to_a_missing_route_fails_with_disconnected() {
    let app = Router::new();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let err = Endpoint::builder()
        .build()
        .connect_websocket(&format!("ws://{addr}/nope"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), coherent_rpc::ErrorCode::Disconnected);
}

#[tokio::test]
async fn websocket_connections_are_untrusted_and_tcp_ones_trusted_unless_configured() {
    use coherent_rpc::Trust;
    async fn accepted_over_websocket(server: Endpoint) -> Trust {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let app = Router::new().route(
            "/rpc",
            get(move |ws: axum::extract::WebSocketUpgrade| {
                let (server, tx) = (server.clone(), tx.clone());
                std::future::ready(ws.on_upgrade(move |socket| async move {
                    let peer = server.accept_websocket(socket).await.unwrap();
                    tx.send(peer.trust()).unwrap();
                    peer.when_closed().await;
                }))
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        let client = Endpoint::builder().build();
        let peer = client
            .connect_websocket(&format!("ws://{addr}/rpc"))
            .await
            .unwrap();
        // The side that connected trusts whom it chose to connect to.
        assert_eq!(peer.trust(), Trust::Trusted);
        rx.recv().await.unwrap()
    }
    let (server, _) = calc_server(Config::default());
    assert_eq!(accepted_over_websocket(server).await, Trust::Untrusted);
    let (server, _) = calc_server(Config::default().trust(Trust::Trusted));
    assert_eq!(accepted_over_websocket(server).await, Trust::Trusted);

    let (server, _) = calc_server(Config::default());
    let (_, s) = pair(&server, &Endpoint::builder().build()).await.unwrap();
    assert_eq!(s.trust(), Trust::Trusted);
    let (server, _) = calc_server(Config::default().trust(Trust::Untrusted));
    let (_, s) = pair(&server, &Endpoint::builder().build()).await.unwrap();
    assert_eq!(s.trust(), Trust::Untrusted);
}

/// Serves `server`'s WebSocket handler on a loopback port.
async fn serve_ws(server: &Endpoint) -> std::net::SocketAddr {
    let app = Router::new().route("/rpc", get(server.websocket_handler()));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Opens a WebSocket to `addr`'s `/rpc` as a browser on `origin` would (none: not a
/// browser); returns the HTTP status of the answer and the socket if it was upgraded.
async fn upgrade(
    addr: std::net::SocketAddr,
    origin: Option<&str>,
) -> (
    u16,
    Option<tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<TcpStream>>>,
) {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Error;
    let mut request = format!("ws://{addr}/rpc").into_client_request().unwrap();
    if let Some(origin) = origin {
        request
            .headers_mut()
            .insert("origin", origin.parse().unwrap());
    }
    match tokio_tungstenite::connect_async(request).await {
        Ok((ws, response)) => (response.status().as_u16(), Some(ws)),
        Err(Error::Http(response)) => {
            let body = response.body().as_deref().unwrap_or_default();
            let body = String::from_utf8_lossy(body);
            assert!(body.contains("origin"), "the reason: {body}");
            (response.status().as_u16(), None)
        }
        Err(e) => panic!("{e}"),
    }
}

#[tokio::test]
async fn a_cross_origin_upgrade_is_refused_and_same_origin_no_origin_and_listed_ones_are_not() {
    let (server, _) = calc_server(Config::default());
    let addr = serve_ws(&server).await;
    assert_eq!(upgrade(addr, Some("https://evil.example")).await.0, 403);
    assert_eq!(upgrade(addr, Some("null")).await.0, 403);
    assert_eq!(upgrade(addr, Some(&format!("http://{addr}"))).await.0, 101);
    assert_eq!(upgrade(addr, None).await.0, 101);
    assert_eq!(server.stats().origins_refused, 2);
    // The refusal comes before the RPC handshake: no connection was made.
    assert_eq!(server.stats().connections_refused, 0);

    let (listed, _) = calc_server(Config::default().allowed_origins(["https://app.example/"]));
    let addr = serve_ws(&listed).await;
    assert_eq!(upgrade(addr, Some("https://app.example")).await.0, 101);
    assert_eq!(upgrade(addr, Some(&format!("http://{addr}"))).await.0, 101);
    assert_eq!(upgrade(addr, Some("https://evil.example")).await.0, 403);

    let (any, _) = calc_server(Config::default().allowed_origins(["*"]));
    let addr = serve_ws(&any).await;
    assert_eq!(upgrade(addr, Some("https://evil.example")).await.0, 101);
}

/// axum's default let one WebSocket message be 64 MiB, all buffered before the protocol's
/// limit saw a byte of it.
#[tokio::test]
async fn a_websocket_message_over_the_limit_closes_the_connection_unread() {
    use coherent_rpc::frame::{Compression, Header, Kind, MAX_HEADER_LEN};
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    fn frame(kind: Kind, payload: &[u8]) -> Vec<u8> {
        let mut head = [0u8; MAX_HEADER_LEN];
        let n = Header {
            kind,
            compression: Compression::None,
            upload: false,
            call_id: 0,
            method_id: 0,
            len: payload.len() as u32,
        }
        .encode(&mut head);
        let mut out = head[..n].to_vec();
        out.extend_from_slice(payload);
        out
    }
    // The largest message the server takes is then 1 MiB (what this crate's side writes).
    let (server, _) = calc_server(Config::default().max_message_size(64 << 10));
    let addr = serve_ws(&server).await;
    let (_, ws) = upgrade(addr, None).await;
    let mut ws = ws.unwrap();
    ws.send(Message::binary(frame(
        Kind::Hello,
        &crate::hostile::hello().encode(),
    )))
    .await
    .unwrap();
    // Pings of 1 KiB, each well under the limit, 2 MiB of them in one message.
    let mut flood = Vec::new();
    while flood.len() < 2 << 20 {
        flood.extend_from_slice(&frame(Kind::Ping, &[0u8; 1024]));
    }
    let _ = ws.send(Message::binary(flood)).await;
    let mut got = Vec::new();
    let ended = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while let Some(Ok(m)) = ws.next().await {
            if let Message::Binary(b) = m {
                got.extend_from_slice(&b);
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the server kept the connection open");
    let mut kinds = Vec::new();
    let mut at = 0;
    while let Some((h, n)) = Header::decode(&got[at..], u32::MAX).unwrap() {
        kinds.push(h.kind);
        at += n + h.len as usize;
    }
    assert_eq!(kinds.first(), Some(&Kind::HelloAck));
    assert!(
        !kinds.contains(&Kind::Pong),
        "the message was read: {kinds:?}"
    );
}

/// The authentication hook sees a WebSocket's upgrade request (a browser's cookie), accepts
/// anonymous connections when it says so, and hands handlers a typed principal.
#[tokio::test]
async fn the_auth_hook_reads_cookies_of_the_upgrade_and_attaches_a_principal() {
    use coherent_rpc::Identity;

    #[derive(Debug, PartialEq)]
    struct User {
        id: u64,
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let server = Endpoint::builder()
        .authenticate_with(move |creds| {
            let tx = tx.clone();
            async move {
                assert!(creds.over_http());
                let identity = match creds.cookie("session") {
                    Some("alice-session") => {
                        Some(Identity::new("alice").with_principal(User { id: 7 }))
                    }
                    Some(_) => return Err("unknown session".to_owned()),
                    None => None,
                };
                tx.send(creds.header("x-probe").map(str::to_owned)).unwrap();
                Ok(identity)
            }
        })
        .build();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (peers_tx, mut peers) = tokio::sync::mpsc::unbounded_channel();
    let app = Router::new().route(
        "/rpc",
        get(
            move |headers: axum::http::HeaderMap, ws: axum::extract::WebSocketUpgrade| {
                let (server, peers_tx) = (server.clone(), peers_tx.clone());
                std::future::ready(ws.on_upgrade(move |socket| async move {
                    if let Ok(peer) = server.accept_websocket_from(socket, &headers).await {
                        let identity = peer.identity().cloned();
                        peers_tx.send(identity).unwrap();
                        peer.when_closed().await;
                    }
                }))
            },
        ),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    let url = format!("ws://{addr}/rpc");
    let client = Endpoint::builder().build();

    let _alice = client
        .connect_websocket_with_headers(
            &url,
            &[
                ("cookie", "theme=dark; session=alice-session"),
                ("x-probe", "1"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(rx.recv().await.unwrap().as_deref(), Some("1"));
    let identity = peers.recv().await.unwrap().unwrap();
    assert_eq!(identity.name(), "alice");
    assert_eq!(identity.principal::<User>(), Some(&User { id: 7 }));
    assert_eq!(identity.principal::<String>(), None);

    let _anonymous = client.connect_websocket(&url).await.unwrap();
    rx.recv().await.unwrap();
    assert!(peers.recv().await.unwrap().is_none());

    let e = client
        .connect_websocket_with_headers(&url, &[("cookie", "session=forged")])
        .await
        .unwrap_err();
    assert_eq!(e.code(), coherent_rpc::ErrorCode::Unauthenticated, "{e}");
}

/// Untrusted connections (browsers over WebSocket) cannot take the last places of the
/// endpoint's maximum: those are kept for trusted ones (its tiers over TCP).
#[tokio::test]
async fn untrusted_connections_leave_the_trusted_reserve_to_the_tiers() {
    let (server, _) = calc_server(Config::default().max_connections(3).trusted_reserve(1));
    let app = Router::new().route("/rpc", get(server.websocket_handler()));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tcp_addr = tcp.local_addr().unwrap();
    tokio::spawn({
        let server = server.clone();
        async move { server.serve_tcp(tcp).await }
    });
    let client = Endpoint::builder().build();
    let url = format!("ws://{http}/rpc");
    let _browser_1 = client.connect_websocket(&url).await.unwrap();
    let _browser_2 = client.connect_websocket(&url).await.unwrap();
    let e = client.connect_websocket(&url).await.unwrap_err();
    assert_eq!(e.code(), coherent_rpc::ErrorCode::Overloaded, "{e}");
    assert!(e.message().contains("kept for its tiers"), "{e}");
    // The tier gets the place kept for it.
    let tier = client.connect_tcp(tcp_addr).await.unwrap();
    assert_eq!(CalcClient::new(tier).sum(1, 2).await.unwrap(), 3);
    assert_eq!(server.stats().connections_refused, 1);
}

/// `n` sums in a closed loop on `peer`; how long they took.
async fn closed_loop(peer: coherent_rpc::Peer, n: u32) -> std::time::Duration {
    let calc = CalcClient::new(peer);
    let start = std::time::Instant::now();
    for i in 0..n {
        assert_eq!(calc.sum(i as i32, 1).await.unwrap(), i as i32 + 1);
    }
    start.elapsed()
}

#[tokio::test]
async fn an_untrusted_connection_calling_in_a_closed_loop_is_held_to_its_rate_and_a_trusted_one_is_not(
) {
    use coherent_rpc::pace::Rate;
    // 20 calls a second, 5 at once: 45 calls take at least (45 - 5) / 20 = 2 s.
    let rate = Rate::per_second(20).burst(5);
    let (server, _) = calc_server(Config::default().untrusted_call_rate(Some(rate)));
    let addr = serve_ws(&server).await;
    let peer = Endpoint::builder()
        .build()
        .connect_websocket(&format!("ws://{addr}/rpc"))
        .await
        .unwrap();
    let took = closed_loop(peer, 45).await;
    assert!(
        took >= std::time::Duration::from_secs(2),
        "45 calls at 20 a second after a burst of 5 took {took:?}"
    );
    // Some waited (how many depends on how fast the loop ran: a slow one earns places).
    let paced = server.stats().calls_paced;
    assert!(paced > 0, "no call of 45 was paced");

    // The same endpoint over TCP (trusted): as fast as it answers, nothing paced.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tcp = listener.local_addr().unwrap();
    let s = server.clone();
    tokio::spawn(async move { s.serve_tcp(listener).await });
    let peer = Endpoint::builder().build().connect_tcp(tcp).await.unwrap();
    closed_loop(peer, 45).await;
    assert_eq!(server.stats().calls_paced, paced);
}

#[tokio::test]
async fn the_connections_of_one_address_share_the_pacer_the_http_server_gives_them() {
    use coherent_rpc::pace::{Pacer, Rate};
    // No rate per connection; one of 20 a second, 4 at once, for the "address".
    let (server, _) = calc_server(Config::default().untrusted_call_rate(None));
    let pacer = Pacer::new(Rate::per_second(20).burst(4));
    let app = Router::new()
        .route("/rpc", get(server.websocket_handler()))
        .layer(axum::Extension(pacer.clone()));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let url = format!("ws://{addr}/rpc");
    let client = Endpoint::builder().build();
    let (a, b) = (
        client.connect_websocket(&url).await.unwrap(),
        client.connect_websocket(&url).await.unwrap(),
    );
    // 2 x 22 calls on two connections: 44 at 20 a second after 4 at once take at least 2 s,
    // where one connection's 22 alone would take 0.9 s.
    let start = std::time::Instant::now();
    let (ta, tb) = tokio::join!(closed_loop(a, 22), closed_loop(b, 22));
    let took = start.elapsed();
    assert!(
        took >= std::time::Duration::from_secs(2),
        "two connections' 44 calls took {took:?} ({ta:?} and {tb:?})"
    );
    // The address's pacer held them (the connections have no rate of their own).
    assert!(pacer.stats().delayed > 0, "{:?}", pacer.stats());
    assert!(server.stats().calls_paced > 0);
}
