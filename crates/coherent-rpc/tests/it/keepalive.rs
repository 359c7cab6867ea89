//! Keep-alive: pings keep a quiet connection open; silence past the idle timeout closes it.
//! On tokio's paused clock, so that minutes pass in no time.

use std::time::Duration;

use coherent_rpc::frame::{Header, Kind};
use coherent_rpc::{Config, Endpoint, ErrorCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::hostile::{frame_bytes, hello};
use crate::support::*;

fn keepalive() -> Config {
    Config::default().keepalive(Some(Duration::from_secs(1)), Some(Duration::from_secs(3)))
}

#[tokio::test(start_paused = true)]
async fn pings_keep_a_quiet_connection_open() {
    let (server, _) = calc_server(keepalive());
    let client = Endpoint::builder().config(keepalive()).build();
    let (c, _s) = pair(&server, &client).await.unwrap();
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(c.close_reason().is_none());
    assert_eq!(CalcClient::new(c).sum(1, 2).await.unwrap(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_call_to_a_peer_that_went_silent_fails_with_disconnected_at_the_idle_timeout() {
    let (a, mut b) = tokio::io::duplex(64 * 1024);
    // The "server" answers the handshake, then reads (so writes never stall) and says nothing.
    tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
        let n = b.read(&mut buf).await.unwrap();
        assert!(Header::decode(&buf[..n], 4096).unwrap().is_some());
        b.write_all(&frame_bytes(Kind::HelloAck, 0, 0, &hello().encode()))
            .await
            .unwrap();
        while b.read(&mut buf).await.unwrap_or(0) > 0 {}
    });
    let peer = Endpoint::builder()
        .config(keepalive())
        .build()
        .connect(a)
        .await
        .unwrap();
    let err = CalcClient::new(peer.clone()).sum(1, 2).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Disconnected);
    assert!(peer.closed().await.message().contains("dead"));
}
