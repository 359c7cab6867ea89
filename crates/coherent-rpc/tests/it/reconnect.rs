//! Reconnection with backoff, resending idempotent calls, and the blocking client.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use coherent_rpc::blocking::BlockingClient;
use coherent_rpc::{Backoff, Config, Endpoint, ErrorCode, Peer, Reconnecting, RpcError};
use parking_lot::Mutex;

use crate::support::*;

/// A reconnecting Calc client over in-memory pipes; the server-side peers are kept so
/// that the test can cut connections.
fn reconnecting() -> (CalcClient<Reconnecting>, Arc<Probe>, Arc<Mutex<Vec<Peer>>>) {
    let (server, probe) = calc_server(Config::default());
    let accepted = Arc::new(Mutex::new(Vec::new()));
    let sides = accepted.clone();
    let caller = Reconnecting::new(
        move || {
            let server = server.clone();
            let sides = sides.clone();
            async move {
                let (c, s) = pair(&server, &Endpoint::builder().build()).await?;
                sides.lock().push(s);
                Ok(c)
            }
        },
        Backoff::default(),
    );
    (CalcClient::new(caller), probe, accepted)
}

#[tokio::test]
async fn a_reconnecting_client_connects_again_after_the_connection_drops() {
    let (calc, _, sides) = reconnecting();
    assert_eq!(calc.sum(1, 2).await.unwrap(), 3);
    sides.lock()[0].close();
    eventually("the client saw the close", || {
        calc.caller()
            .peer()
            .now_or_never()
            .and_then(Result::ok)
            .is_none_or(|p| p.close_reason().is_some())
    })
    .await;
    assert_eq!(calc.sum(2, 2).await.unwrap(), 4);
    assert_eq!(calc.caller().connections(), 2);
}

use futures::FutureExt;

#[tokio::test]
async fn an_idempotent_call_in_flight_during_a_disconnect_is_resent() {
    let (calc, probe, sides) = reconnecting();
    let call = tokio::spawn({
        let calc = calc.clone();
        async move { calc.hang_first_time().await }
    });
    eventually("the first run started", || {
        probe.started.load(Ordering::SeqCst) == 1
    })
    .await;
    sides.lock()[0].close();
    assert_eq!(call.await.unwrap().unwrap(), 2);
    assert_eq!(calc.caller().connections(), 2);
}

#[tokio::test]
async fn a_call_that_is_not_idempotent_fails_with_disconnected_and_the_next_one_reconnects() {
    let (calc, probe, sides) = reconnecting();
    let call = tokio::spawn({
        let calc = calc.clone();
        async move { calc.wait_for_release().await }
    });
    eventually("the handler started", || {
        probe.started.load(Ordering::SeqCst) == 1
    })
    .await;
    sides.lock()[0].close();
    assert_eq!(
        call.await.unwrap().unwrap_err().code(),
        ErrorCode::Disconnected
    );
    assert_eq!(calc.sum(5, 5).await.unwrap(), 10);
}

#[tokio::test(start_paused = true)]
async fn reconnection_gives_up_after_its_attempts_with_disconnected() {
    let caller = Reconnecting::new(
        || async { Err::<Peer, _>(RpcError::new(ErrorCode::Disconnected, "refused")) },
        Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(100),
            max_attempts: 4,
        },
    );
    let err = CalcClient::new(caller).sum(1, 1).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Disconnected);
    assert!(err.message().contains("after 4 attempts"), "{err}");
}

#[test]
fn backoff_doubles_up_to_its_cap_with_jitter_in_the_upper_half() {
    let b = Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_secs(1),
        max_attempts: 10,
    };
    for seed in 0..100u64 {
        let d0 = b.delay(0, seed);
        assert!(d0 >= Duration::from_millis(50) && d0 < Duration::from_millis(100));
        let d2 = b.delay(2, seed);
        assert!(d2 >= Duration::from_millis(200) && d2 < Duration::from_millis(400));
        let d9 = b.delay(40, seed);
        assert!(d9 >= Duration::from_millis(500) && d9 < Duration::from_secs(1));
    }
}

#[test]
fn the_blocking_client_calls_a_tcp_server_from_plain_threads() {
    let server_rt = tokio::runtime::Runtime::new().unwrap();
    let addr = server_rt.block_on(async {
        let (server, _) = calc_server(Config::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { server.serve_tcp(listener).await });
        addr
    });
    let calc =
        BlockingClient::connect_tcp(&Endpoint::builder().build(), addr, CalcClient::new).unwrap();
    assert_eq!(calc.block_on(calc.client().sum(20, 22)).unwrap(), 42);
    let user = calc.block_on(calc.client().get_user(9)).unwrap();
    assert_eq!(user.name, "user 9");
}
