//! Zero-RTT connects: calls travel right behind the `Hello`, before the answer.

use std::time::Duration;

use coherent_rpc::frame::{Compression, Kind};
use coherent_rpc::{Config, Endpoint, ErrorCode, Peer};
use tokio::io::AsyncReadExt;

use crate::hostile::{frame_bytes, hello};
use crate::support::*;

fn zero_rtt() -> Config {
    Config::default().zero_rtt(true)
}

/// Connects `client` to `server` over an in-memory duplex without waiting for the server:
/// on the test's single thread, the accepting side runs only once the test awaits, so
/// calls made right away go out before the answer.
fn early_pair(
    server: &Endpoint,
    client: &Endpoint,
) -> (
    Peer,
    tokio::task::JoinHandle<Result<Peer, coherent_rpc::RpcError>>,
) {
    let (a, b) = tokio::io::duplex(256 * 1024);
    let server = server.clone();
    let accepted = tokio::spawn(async move { server.accept(a).await });
    let connect = client.connect(b);
    let c = futures::FutureExt::now_or_never(connect)
        .expect("a zero-RTT connect over a duplex does not wait")
        .expect("connect");
    (c, accepted)
}

async fn tcp_server(config: Config) -> std::net::SocketAddr {
    let (server, _) = calc_server(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { server.serve_tcp(listener).await });
    addr
}

#[tokio::test]
async fn calls_made_before_the_answer_are_answered_and_the_answer_sets_the_limits() {
    let addr = tcp_server(Config::default().max_message_size(3 << 20)).await;
    let client = Endpoint::builder().config(zero_rtt()).build();
    let peer = client.connect_tcp(addr).await.unwrap();
    let calc = CalcClient::new(peer.clone());
    // Before the answer (the server has not even run yet on this single thread), the limit
    // is what every endpoint takes blind.
    assert_eq!(peer.remote_max_message_size(), 64 * 1024);
    let (a, b) = tokio::join!(calc.sum(1, 2), calc.get_user(7));
    assert_eq!(a.unwrap(), 3);
    assert_eq!(b.unwrap().id, 7);
    // The answer came before the replies, on the same connection.
    assert_eq!(peer.remote_max_message_size(), 3 << 20);
    assert_eq!(calc.sum(40, 2).await.unwrap(), 42);
}

#[tokio::test]
async fn a_refused_token_fails_the_calls_made_meanwhile_with_unauthenticated() {
    let server = calc_server_accepting("good");
    let client = Endpoint::builder().config(zero_rtt()).token("bad").build();
    // The connect itself succeeds: nothing has been refused yet.
    let (c, refused) = early_pair(&server, &client);
    let err = CalcClient::new(c.clone()).sum(1, 2).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Unauthenticated, "{err}");
    assert!(err.message().contains("not known"), "{err}");
    assert_eq!(c.closed().await.code(), ErrorCode::Unauthenticated);
    assert!(refused.await.unwrap().is_err());
}

#[tokio::test]
async fn a_large_message_waits_for_the_answer_and_one_over_the_limit_fails_alone() {
    let (server, _) = calc_server(Config::default().max_message_size(2 << 20));
    let client = Endpoint::builder().config(zero_rtt()).build();
    let (c, _s) = early_pair(&server, &client);
    let calc = CalcClient::new(c);
    let big = vec![5u8; 1 << 20];
    let too_big = vec![6u8; 3 << 20];
    // All made before the answer: the large one is held, and so is everything after it.
    let (r1, r2, r3, r4) = tokio::join!(
        calc.sum(1, 1),
        calc.echo(big.clone()),
        calc.echo(too_big),
        calc.sum(2, 2)
    );
    assert_eq!(r1.unwrap(), 2);
    assert_eq!(r2.unwrap(), big);
    assert_eq!(r3.unwrap_err().code(), ErrorCode::TooLarge);
    assert_eq!(r4.unwrap(), 4);
    assert_eq!(calc.sum(3, 3).await.unwrap(), 6);
}

#[tokio::test]
async fn an_upload_started_before_the_answer_is_granted_the_window_by_it() {
    let (server, _) = calc_server(Config::default().stream_window(4));
    let client = Endpoint::builder().config(zero_rtt()).build();
    let (c, _s) = early_pair(&server, &client);
    let calc = CalcClient::new(c);
    let items = futures::stream::iter(1..=1000i64);
    assert_eq!(calc.sum_upload(5, items).await.unwrap(), 5 + 500 * 1001);
    assert_eq!(
        calc.sum_upload(0, futures::stream::empty()).await.unwrap(),
        0
    );
}

#[tokio::test]
async fn compression_starts_once_the_answer_says_the_other_side_decodes_it() {
    let (server, _) = calc_server(Config::default());
    let client = Endpoint::builder()
        .config(zero_rtt().compression(Compression::Lz4, 1024))
        .build();
    let (c, _s) = early_pair(&server, &client);
    let calc = CalcClient::new(c.clone());
    let zeros = vec![0u8; 1 << 20];
    // Held for the answer (over 64 KiB), then sent compressed.
    assert_eq!(calc.echo(zeros.clone()).await.unwrap(), zeros);
    assert!(c.stats().bytes_out < 64 * 1024, "{:?}", c.stats());
}

#[tokio::test]
async fn a_side_that_never_answers_fails_the_calls_at_the_handshake_timeout() {
    let client = Endpoint::builder()
        .config(zero_rtt().handshake_timeout(Duration::from_millis(100)))
        .build();
    let (a, mut silent) = tokio::io::duplex(64 * 1024);
    let c = client.connect(a).await.unwrap();
    let err = CalcClient::new(c).sum(1, 2).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Disconnected, "{err}");
    assert!(err.message().contains("no handshake answer"), "{err}");
    // The Hello and the call were sent.
    let mut got = vec![0u8; 64];
    assert!(silent.read(&mut got).await.unwrap() > 0);
}

#[tokio::test]
async fn a_frame_other_than_the_answer_closes_the_connection_with_a_protocol_reason() {
    let client = Endpoint::builder().config(zero_rtt()).build();
    let (a, mut other) = tokio::io::duplex(64 * 1024);
    let c = client.connect(a).await.unwrap();
    let call = tokio::spawn({
        let c = c.clone();
        async move { CalcClient::new(c).sum(1, 2).await }
    });
    use tokio::io::AsyncWriteExt;
    other
        .write_all(&frame_bytes(Kind::Pong, 0, 0, &[]))
        .await
        .unwrap();
    let reason = c.closed().await;
    assert_eq!(reason.code(), ErrorCode::Protocol, "{reason}");
    assert!(reason.message().contains("expected HelloAck"), "{reason}");
    assert!(call.await.unwrap().is_err());
    // A well-formed answer in another format is refused the same way.
    let client = Endpoint::builder().config(zero_rtt()).build();
    let (a, mut other) = tokio::io::duplex(64 * 1024);
    let c = client.connect(a).await.unwrap();
    let mut ack = hello();
    ack.format = coherent_rpc::Format::MessagePack;
    other
        .write_all(&frame_bytes(Kind::HelloAck, 0, 0, &ack.encode()))
        .await
        .unwrap();
    let reason = c.closed().await;
    assert_eq!(reason.code(), ErrorCode::Protocol, "{reason}");
}

/// Over TCP on several threads the refusal may be read before, while or after the calls
/// are made: every call fails with the refusal's code all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_fails_every_call_with_its_code_however_the_calls_race_it() {
    let server = Endpoint::builder()
        .service(CalcServer::new(CalcImpl::default()))
        .authenticate(|_| async { Err("no entry".to_owned()) })
        .build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { server.serve_tcp(listener).await });
    let client = Endpoint::builder().config(zero_rtt()).token("t").build();
    for _ in 0..50 {
        let calc = CalcClient::new(client.connect_tcp(addr).await.unwrap());
        let (a, b) = tokio::join!(calc.echo(vec![1; 60_000]), async {
            tokio::task::yield_now().await;
            calc.sum(1, 2).await
        });
        for e in [a.unwrap_err(), b.unwrap_err()] {
            assert_eq!(e.code(), ErrorCode::Unauthenticated, "{e}");
        }
        // And so does a call made long after.
        calc.caller().closed().await;
        let e = calc.sum(1, 2).await.unwrap_err();
        assert_eq!(e.code(), ErrorCode::Unauthenticated, "{e}");
    }
}

#[tokio::test]
async fn an_early_upload_is_batched_for_the_limit_the_answer_brings() {
    // A window wide enough for batches far over the server's limit: 30,000 items of 7
    // bytes each would make 64 KiB batches under the provisional limit.
    let (server, _) = calc_server(
        Config::default()
            .max_message_size(16 * 1024)
            .stream_window(100_000),
    );
    let client = Endpoint::builder().config(zero_rtt()).build();
    let (c, _s) = early_pair(&server, &client);
    let calc = CalcClient::new(c);
    let items = futures::stream::iter(std::iter::repeat_n(1i64 << 40, 30_000));
    assert_eq!(calc.sum_upload(0, items).await.unwrap(), 30_000 << 40);
}

#[tokio::test]
async fn a_held_call_dropped_before_the_answer_never_reaches_the_other_side() {
    let (server, _) = calc_server(Config::default());
    let client = Endpoint::builder().config(zero_rtt()).build();
    let (c, accepted) = early_pair(&server, &client);
    let calc = CalcClient::new(c);
    // Held (over 64 KiB), then given up before the server has even run.
    let held = calc.echo(vec![0; 200_000]);
    assert!(futures::FutureExt::now_or_never(held).is_none());
    assert_eq!(calc.sum(1, 2).await.unwrap(), 3);
    let s = accepted.await.unwrap().unwrap();
    assert_eq!(s.stats().calls_in, 1, "only the sum arrived");
}

/// Calls sent right behind a `Hello` whose token the auth hook refuses never run: the
/// accepting side reads them only once it has accepted the connection, and a refused one
/// is closed with its frames unread.
#[tokio::test]
async fn calls_behind_a_refused_hello_never_run() {
    let calc = CalcImpl::default();
    let probe = calc.probe.clone();
    let server = Endpoint::builder()
        .service(CalcServer::new(calc))
        .authenticate(|token| async move {
            if token == "good" {
                Ok(coherent_rpc::Identity::new("ok"))
            } else {
                Err("not known".to_owned())
            }
        })
        .build();
    let client = Endpoint::builder().config(zero_rtt()).token("bad").build();
    let (c, refused) = early_pair(&server, &client);
    let calc = CalcClient::new(c.clone());
    calc.record(7).await.unwrap();
    let err = calc.sum(1, 2).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Unauthenticated, "{err}");
    assert!(refused.await.unwrap().is_err());
    assert!(probe.recorded.lock().is_empty());
    assert_eq!(probe.started.load(std::sync::atomic::Ordering::SeqCst), 0);
}
