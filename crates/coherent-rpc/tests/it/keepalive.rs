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

/// The far end of a connection whose other side answers the handshake, sends `then`, and
/// from there on reads (so writes never stall) and says nothing.
fn silent_peer(then: Vec<u8>) -> tokio::io::DuplexStream {
    let (a, mut b) = tokio::io::duplex(64 * 1024);
    tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
        let n = b.read(&mut buf).await.unwrap();
        assert!(Header::decode(&buf[..n], 4096).unwrap().is_some());
        b.write_all(&frame_bytes(Kind::HelloAck, 0, 0, &hello().encode()))
            .await
            .unwrap();
        b.write_all(&then).await.unwrap();
        while b.read(&mut buf).await.unwrap_or(0) > 0 {}
    });
    a
}

#[tokio::test(start_paused = true)]
async fn a_call_to_a_peer_that_went_silent_fails_with_disconnected_at_the_idle_timeout() {
    let a = silent_peer(Vec::new());
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

/// A TCP stream whose writes go out at most `SLOW_CHUNK` bytes per `SLOW_PAUSE`: a slow link.
struct Slow {
    inner: tokio::net::TcpStream,
    pause: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

const SLOW_CHUNK: usize = 32 * 1024;
const SLOW_PAUSE: Duration = Duration::from_millis(25);

impl tokio::io::AsyncRead for Slow {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Slow {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        use std::future::Future;
        if let Some(pause) = self.pause.as_mut() {
            std::task::ready!(pause.as_mut().poll(cx));
            self.pause = None;
        }
        let n = buf.len().min(SLOW_CHUNK);
        let r = std::task::ready!(std::pin::Pin::new(&mut self.inner).poll_write(cx, &buf[..n]));
        self.pause = Some(Box::pin(tokio::time::sleep(SLOW_PAUSE)));
        std::task::Poll::Ready(r)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Over TCP, a reader of a large frame asks the kernel not to wake it before a good part of
/// the rest has come (`SO_RCVLOWAT`); a sender slower than that per idle timeout must still
/// not be taken for a dead peer. Real time: the link's pace is what is tested.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_message_trickling_in_over_tcp_keeps_the_connection_alive() {
    let config = Config::default()
        .keepalive(
            Some(Duration::from_millis(50)),
            Some(Duration::from_millis(250)),
        )
        .max_message_size(4 << 20);
    let (server, _) = calc_server(config.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { server.serve_tcp(listener).await });
    let slow = Slow {
        inner: tokio::net::TcpStream::connect(addr).await.unwrap(),
        pause: None,
    };
    let peer = Endpoint::builder()
        .config(config)
        .build()
        .connect(slow)
        .await
        .unwrap();
    // 1.25 MiB at 32 KiB per 25 ms: 400 ms between wake-ups at the reader's 512 KiB
    // low-water mark, against a 250 ms idle timeout checked every 50 ms.
    let data: Vec<u8> = (0..5 << 18).map(|i: u32| (i % 251) as u8).collect();
    let blob = coherent_rpc::Blob::from(data);
    let (n, back) = CalcClient::new(peer.clone())
        .echo_blob(blob.clone())
        .await
        .unwrap();
    assert_eq!(n, blob.len());
    assert!(back == blob, "the echo differs");
    assert!(peer.close_reason().is_none());
}

#[tokio::test]
async fn a_ping_completes_once_the_other_side_answers_and_fails_when_the_connection_closes() {
    let (server, _) = calc_server(Config::default());
    let client = Endpoint::builder().build();
    let (c, s) = pair(&server, &client).await.unwrap();
    for _ in 0..3 {
        c.ping().await.unwrap();
        s.ping().await.unwrap();
    }
    // Many at once: each waits for its own answer.
    let pings: Vec<_> = (0..50).map(|_| c.ping()).collect();
    for r in futures::future::join_all(pings).await {
        r.unwrap();
    }
    c.close_because("done with it");
    let err = c.ping().await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Disconnected);
    assert!(s.closed().await.message().contains("done with it"));
}

#[tokio::test]
async fn a_ping_to_a_peer_that_went_silent_never_completes() {
    // A pong for a ping not sent yet, then silence: it answers nothing ahead of time.
    let a = silent_peer(frame_bytes(Kind::Pong, 0, 0, &1000u64.to_le_bytes()));
    let peer = Endpoint::builder().build().connect(a).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let ping = tokio::time::timeout(Duration::from_millis(300), peer.ping()).await;
    assert!(ping.is_err(), "answered by nobody: {ping:?}");
    assert!(peer.close_reason().is_none());
}

/// A close with a reason goes out as a `Close` frame behind the writer's queue. Its bytes
/// were counted off the queue when written but never counted onto it: the queue's count
/// wrapped below zero (in a debug build, `attempt to add with overflow` at the next frame
/// queued on the endpoint; in a release build a count near 2^64, so `wait_for_room`
/// stalled). Seen in the `hostile` bench's own clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_with_a_reason_leaves_the_queue_counts_at_zero() {
    let (server, _) = calc_server(Config::default());
    let client = Endpoint::builder().build();
    let (c, s) = pair(&server, &client).await.unwrap();
    let calc = CalcClient::new(c.clone());
    // Enough at once that the writer task runs (lone frames are written by their sender).
    let calls: Vec<_> = (0..200).map(|i| calc.sum(i, 1)).collect();
    for r in futures::future::join_all(calls).await {
        r.unwrap();
    }
    c.close_because("done with it");
    assert!(s.closed().await.message().contains("done with it"));
    let _ = c.closed().await;
    // The writer counts off what it wrote once it is written: wait for it to end.
    for _ in 0..2000 {
        if client.stats().queued_bytes == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(c.stats().queued_bytes, 0);
    assert_eq!(client.stats().queued_bytes, 0);
    assert!(client.stats().totals.queued_bytes_peak < 1 << 40);
}
