//! Message size and concurrency limits.

use std::sync::atomic::Ordering;

use coherent_rpc::{Config, Endpoint, ErrorCode};

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
