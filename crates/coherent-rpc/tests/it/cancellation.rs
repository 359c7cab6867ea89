//! Deadlines and cancellation: the caller stops waiting and the callee stops working.

use std::sync::atomic::Ordering;
use std::time::Duration;

use coherent_rpc::ErrorCode;

use crate::support::*;

#[tokio::test]
async fn a_deadline_fails_the_call_and_aborts_the_server_handler() {
    let (calc, probe, server_side) = calc_pair().await;
    let err = calc
        .clone()
        .with_timeout(Duration::from_millis(50))
        .sleep_forever()
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::DeadlineExceeded);
    eventually("the handler was dropped", || {
        probe.dropped.load(Ordering::SeqCst) == 1
    })
    .await;
    eventually("no call runs", || server_side.stats().in_flight_in == 0).await;
    assert_eq!(calc.sum(1, 2).await.unwrap(), 3);
}

#[tokio::test]
async fn dropping_the_call_future_cancels_the_server_handler() {
    let (calc, probe, server_side) = calc_pair().await;
    let call = tokio::spawn({
        let calc = calc.clone();
        async move { calc.sleep_forever().await }
    });
    eventually("the handler started", || {
        probe.started.load(Ordering::SeqCst) == 1
    })
    .await;
    assert_eq!(server_side.stats().in_flight_in, 1);
    call.abort();
    eventually("the handler was dropped", || {
        probe.dropped.load(Ordering::SeqCst) == 1
    })
    .await;
    eventually("no call runs", || server_side.stats().in_flight_in == 0).await;
}
