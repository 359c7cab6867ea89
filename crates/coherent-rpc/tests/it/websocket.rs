//! The WebSocket transport, served from an axum app on a loopback port.

use axum::routing::get;
use axum::Router;
use coherent_rpc::{Config, Endpoint};
use tokio::net::TcpListener;

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
