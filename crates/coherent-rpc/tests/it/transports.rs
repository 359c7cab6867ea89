//! Real transports: TCP on a loopback port and Unix domain sockets.

use coherent_rpc::Config;
use tokio::net::TcpListener;

use crate::support::*;

#[tokio::test]
async fn calls_work_over_tcp_and_the_server_serves_many_connections() {
    let (server, _) = calc_server(Config::default());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { server.serve_tcp(listener).await });
    let client = coherent_rpc::Endpoint::builder().build();
    let mut clients = Vec::new();
    for i in 0..3 {
        let calc = CalcClient::new(client.connect_tcp(addr).await.unwrap());
        assert_eq!(calc.sum(i, 1).await.unwrap(), i + 1);
        clients.push(calc);
    }
    let data = vec![9u8; 1 << 20];
    assert_eq!(clients[1].echo(data.clone()).await.unwrap(), data);
}

#[cfg(unix)]
#[tokio::test]
async fn calls_work_over_a_unix_socket() {
    let dir = std::env::temp_dir().join(format!("coherent-rpc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("calc.sock");
    let _ = std::fs::remove_file(&path);
    let (server, _) = calc_server(Config::default());
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    tokio::spawn(async move { server.serve_unix(listener).await });
    let peer = coherent_rpc::Endpoint::builder()
        .build()
        .connect_unix(&path)
        .await
        .unwrap();
    assert_eq!(CalcClient::new(peer).sum(20, 22).await.unwrap(), 42);
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn calls_work_over_two_one_way_pipes_joined_like_a_child_processes_stdio() {
    // A child's stdout is what we read, its stdin what we write: two one-way pipes.
    // `simplex` returns (read end, write end).
    let (server_in, client_out) = tokio::io::simplex(64 * 1024);
    let (client_in, server_out) = tokio::io::simplex(64 * 1024);
    let (server, _) = calc_server(Config::default());
    let accepted =
        tokio::spawn(async move { server.accept(tokio::io::join(server_in, server_out)).await });
    let peer = coherent_rpc::Endpoint::builder()
        .build()
        .connect(tokio::io::join(client_in, client_out))
        .await
        .unwrap();
    let _server_side = accepted.await.unwrap().unwrap();
    assert_eq!(CalcClient::new(peer).sum(2, 2).await.unwrap(), 4);
}

/// A new connection's first frames are written by their senders until the writer task
/// runs; over a pipe too narrow to take them at once, the writer task sends the rest, in
/// order, before what was queued for it meanwhile.
#[tokio::test]
async fn first_calls_that_the_transport_cannot_take_at_once_arrive_whole_and_in_order() {
    let (server, _) = calc_server(coherent_rpc::Config::default());
    let (a, b) = tokio::io::duplex(64);
    let accepted = tokio::spawn(async move { server.accept(a).await });
    let client = coherent_rpc::Endpoint::builder().build();
    let connect = client.connect(b);
    let c = connect.await.unwrap();
    let calc = CalcClient::new(c);
    let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
    let big = vec![9u8; 100_000];
    // Made before the writer task first runs (this test has one thread): the first is
    // written at once, as far as the pipe takes it; the rest follow through the queue.
    let (a, b, c, d) = tokio::join!(
        calc.echo(data.clone()),
        calc.sum(1, 2),
        calc.echo(big.clone()),
        calc.sum(3, 4)
    );
    assert_eq!(a.unwrap(), data);
    assert_eq!(b.unwrap(), 3);
    assert_eq!(c.unwrap(), big);
    assert_eq!(d.unwrap(), 7);
    let _server_side = accepted.await.unwrap().unwrap();
}

/// A transport that keeps what it is given until it is flushed, and every other flush of
/// which does not finish at once (as a TLS or WebSocket stream's may not).
struct HoldsUntilFlushed {
    inner: tokio::io::DuplexStream,
    held: Vec<u8>,
    flushes: usize,
}

impl tokio::io::AsyncRead for HoldsUntilFlushed {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for HoldsUntilFlushed {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.held.extend_from_slice(buf);
        std::task::Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.flushes += 1;
        if self.flushes % 2 == 1 {
            cx.waker().wake_by_ref();
            return std::task::Poll::Pending;
        }
        let this = &mut *self;
        while !this.held.is_empty() {
            let n =
                std::task::ready!(std::pin::Pin::new(&mut this.inner).poll_write(cx, &this.held))?;
            this.held.drain(..n);
        }
        std::pin::Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::ready!(self.as_mut().poll_flush(cx))?;
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[tokio::test]
async fn a_first_call_held_by_a_buffering_transport_is_flushed_by_the_writer() {
    let (server, _) = calc_server(Config::default().zero_rtt(false));
    let (a, b) = tokio::io::duplex(64 * 1024);
    let accepted = tokio::spawn(async move { server.accept(a).await });
    let client = coherent_rpc::Endpoint::builder()
        .config(Config::default().zero_rtt(true))
        .build();
    let io = HoldsUntilFlushed {
        inner: b,
        held: Vec::new(),
        flushes: 0,
    };
    let calc = CalcClient::new(client.connect(io).await.unwrap());
    // Written by the caller, whose flush does not finish: the writer task's first flush
    // must send it.
    let sum = tokio::time::timeout(std::time::Duration::from_secs(10), calc.sum(20, 22));
    assert_eq!(sum.await.expect("the call was never sent").unwrap(), 42);
    // Later lone calls are written by their callers too, whatever the flush answers.
    for i in 0..10 {
        let sum = tokio::time::timeout(std::time::Duration::from_secs(10), calc.sum(i, 1));
        assert_eq!(
            sum.await.expect("a later call was never sent").unwrap(),
            i + 1
        );
    }
    let _server_side = accepted.await.unwrap().unwrap();
}

/// On an open connection, a call made while no other waits (and the answer to it) is
/// written by its sender; over a pipe too narrow to take it at once, the writer task sends
/// the rest, and the frames queued meanwhile follow it, whole and in order.
#[tokio::test]
async fn lone_calls_that_the_transport_cannot_take_at_once_arrive_whole_and_in_order() {
    let (server, _) = calc_server(Config::default());
    let (a, b) = tokio::io::duplex(64);
    let accepted = tokio::spawn(async move { server.accept(a).await });
    let calc = CalcClient::new(
        coherent_rpc::Endpoint::builder()
            .build()
            .connect(b)
            .await
            .unwrap(),
    );
    let _server_side = accepted.await.unwrap().unwrap();
    for round in 0..20u32 {
        let data: Vec<u8> = (0..1000 + round).map(|i| i as u8).collect();
        assert_eq!(calc.echo(data.clone()).await.unwrap(), data);
        // The first of these goes alone, the others behind it through the queue.
        let (x, y, z) = tokio::join!(
            calc.echo(data.clone()),
            calc.sum(round as i32, 1),
            calc.echo(data.clone())
        );
        assert_eq!(x.unwrap(), data);
        assert_eq!(y.unwrap(), round as i32 + 1);
        assert_eq!(z.unwrap(), data);
    }
}

/// A connection whose frames all went out with their senders never started its writer
/// task; dropping the client still sends `Close`, with its reason.
#[tokio::test]
async fn a_client_dropped_after_lone_calls_tells_the_server_why() {
    let (server, _) = calc_server(Config::default());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        server.accept(stream).await
    });
    let client = coherent_rpc::Endpoint::builder().build();
    let calc = CalcClient::new(client.connect_tcp(addr).await.unwrap());
    let server_side = accepted.await.unwrap().unwrap();
    assert_eq!(calc.sum(1, 2).await.unwrap(), 3);
    assert_eq!(calc.sum(3, 4).await.unwrap(), 7);
    drop(calc);
    let reason = server_side.closed().await;
    assert!(reason.message().contains("dropped"), "{reason}");
}
