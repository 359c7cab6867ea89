//! Message size and concurrency limits.

use std::sync::atomic::Ordering;

use coherent_rpc::{Blob, Config, Endpoint, ErrorCode};

use crate::support::*;

#[tokio::test]
async fn a_message_over_the_default_limit_fails_with_too_large_before_it_is_sent() {
    let (calc, _, _) = calc_pair().await;
    let err = calc.echo(vec![1u8; 5 << 20]).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::TooLarge);
    assert_eq!(calc.sum(1, 1).await.unwrap(), 2);
}

#[tokio::test]
async fn ten_megabyte_payloads_work_when_the_limit_is_raised() {
    let cfg = Config::default().max_message_size(16 << 20);
    let (server, _) = calc_server(cfg.clone());
    let client = Endpoint::builder().config(cfg).build();
    let (c, _s) = pair(&server, &client).await.unwrap();
    let data: Vec<u8> = (0..10 << 20)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    assert_eq!(CalcClient::new(c).echo(data.clone()).await.unwrap(), data);
}

#[tokio::test]
async fn ten_megabyte_blobs_cross_tcp_whole_in_both_directions() {
    // Over TCP the blob goes out from its own buffer in vectored writes that the socket
    // takes in pieces; several calls at once interleave their frames with it.
    let cfg = Config::default().max_message_size(16 << 20);
    let (server, _) = calc_server(cfg.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { server.serve_tcp(listener).await });
    let client = Endpoint::builder().config(cfg).build();
    let calc = CalcClient::new(client.connect_tcp(addr).await.unwrap());
    let data: Vec<u8> = (0..10 << 20)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    let blob = Blob::from(data);
    let small = calc.clone();
    let (big, sums) = tokio::join!(calc.echo_blob(blob.clone()), async move {
        let mut sums = Vec::new();
        for i in 0..50 {
            sums.push(small.sum(i, 1).await.unwrap());
        }
        sums
    });
    let (n, back) = big.unwrap();
    assert_eq!(n, blob.len());
    assert!(back == blob, "the echoed blob differs");
    assert_eq!(sums, (1..=50).collect::<Vec<i32>>());
}

#[tokio::test]
async fn a_reply_over_the_callers_limit_becomes_a_too_large_error() {
    let (server, _) = calc_server(Config::default().max_message_size(16 << 20));
    let client = Endpoint::builder()
        .config(Config::default().max_message_size(1 << 20))
        .build();
    let (c, _s) = pair(&server, &client).await.unwrap();
    let calc = CalcClient::new(c);
    // 900 KB fits the caller's 1 MB limit going up, and also coming back.
    assert!(calc.echo(vec![7u8; 900_000]).await.is_ok());
    let err = calc.echo(vec![7u8; 2 << 20]).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::TooLarge);
}

#[tokio::test]
async fn calls_beyond_the_inbound_limit_are_refused_as_overloaded() {
    let (server, probe) = calc_server(Config::default().max_inbound_calls(2));
    let (c, _s) = pair(&server, &Endpoint::builder().build()).await.unwrap();
    let calc = CalcClient::new(c);
    let held: Vec<_> = (0..2)
        .map(|_| {
            let calc = calc.clone();
            tokio::spawn(async move { calc.wait_for_release().await })
        })
        .collect();
    eventually("both handlers started", || {
        probe.started.load(Ordering::SeqCst) == 2
    })
    .await;
    let err = calc.sum(1, 2).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Overloaded);
    probe.release.notify_waiters();
    for h in held {
        h.await.unwrap().unwrap();
    }
    assert_eq!(calc.sum(1, 2).await.unwrap(), 3);
}

#[tokio::test]
async fn streams_and_uploads_count_in_the_inbound_limit_and_refusals_are_counted() {
    use futures::StreamExt;
    let (server, _) = calc_server(Config::default().max_inbound_calls(2));
    let (c, s) = pair(&server, &Endpoint::builder().build()).await.unwrap();
    let calc = CalcClient::new(c);
    // A stream that is never read (its producer waits for credits) and an upload that
    // never ends (its handler waits for items): both keep running.
    let unread = calc.items(1_000_000, 0).await.unwrap();
    let upload = {
        let calc = calc.clone();
        tokio::spawn(async move { calc.sum_upload(0, futures::stream::pending()).await })
    };
    eventually("both calls run", || s.stats().in_flight_in == 2).await;

    let mut stream = calc.items(1, 0).await.unwrap();
    let err = stream.next().await.unwrap().unwrap_err();
    assert_eq!(err.code(), ErrorCode::Overloaded, "{err}");
    let err = calc
        .sum_upload(0, futures::stream::iter([1i64]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Overloaded, "{err}");
    let err = calc.sum(1, 2).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Overloaded, "{err}");
    assert_eq!(server.stats().calls_refused, 3);

    drop(unread);
    upload.abort();
    eventually("the held calls ended", || s.stats().in_flight_in == 0).await;
    assert_eq!(calc.sum(1, 2).await.unwrap(), 3);
}
