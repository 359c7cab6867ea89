//! Server streams: order, end, flow control and cancellation.

use std::sync::atomic::Ordering;
use std::time::Duration;

use coherent_rpc::{Config, Endpoint};
use futures::StreamExt;

use crate::support::*;

#[tokio::test]
async fn a_stream_delivers_every_item_in_order_then_ends() {
    let (calc, _, _) = calc_pair().await;
    let mut stream = calc.items(1800, 100).await.unwrap();
    let mut n = 0i64;
    while let Some(item) = stream.next().await {
        let item = item.unwrap();
        assert_eq!(item.index, n);
        assert_eq!(item.data.len(), 100);
        n += 1;
    }
    assert_eq!(n, 1800);
}

#[tokio::test]
async fn items_of_every_size_arrive_whole_whether_batched_or_not() {
    // 0..300 bytes cross the one-byte length prefix; 40 KB items exceed a batch.
    let (calc, _, _) = calc_pair().await;
    for size in [0, 1, 126, 127, 128, 300, 40_000] {
        let items: Vec<_> = calc.items(200, size).await.unwrap().collect().await;
        assert_eq!(items.len(), 200, "size {size}");
        for (i, item) in items.into_iter().enumerate() {
            let item = item.unwrap();
            assert_eq!(item.index, i as i64, "size {size}");
            assert_eq!(
                item.data,
                vec![(i % 251) as u8; size as usize],
                "size {size}"
            );
        }
    }
}

#[tokio::test]
async fn items_whose_sizes_change_within_a_stream_arrive_whole() {
    // A batch leaves room for each length as long as the last one's: shorter and longer
    // lengths than that guess, in every order.
    let (calc, _, _) = calc_pair().await;
    let items: Vec<_> = calc.items(400, MIXED).await.unwrap().collect().await;
    assert_eq!(items.len(), 400);
    for (i, item) in items.into_iter().enumerate() {
        let item = item.unwrap();
        assert_eq!(item.index, i as i64);
        assert_eq!(
            item.data,
            vec![(i % 251) as u8; mixed_size(i as u32) as usize],
            "item {i}"
        );
    }
}

#[tokio::test]
async fn batches_stay_under_the_consumers_message_limit() {
    // Items of ~500 bytes against a 2 KiB limit: a batch of 64 KiB would be refused.
    let (server, _) = calc_server(Config::default());
    let client = Endpoint::builder()
        .config(Config::default().max_message_size(2048))
        .build();
    let (c, _s) = pair(&server, &client).await.unwrap();
    let calc = CalcClient::new(c);
    let items: Vec<_> = calc.items(500, 500).await.unwrap().collect().await;
    assert_eq!(items.len(), 500);
    assert!(items.into_iter().all(|i| i.unwrap().data.len() == 500));
}

#[tokio::test]
async fn items_sent_before_a_producer_fails_arrive_before_its_error() {
    let (calc, _, _) = calc_pair().await;
    let mut stream = calc.items_then_panic(10).await.unwrap();
    for i in 0..10 {
        assert_eq!(stream.next().await.unwrap().unwrap().index, i);
    }
    let err = stream.next().await.unwrap().unwrap_err();
    assert_eq!(err.code(), coherent_rpc::ErrorCode::Internal, "{err}");
    assert!(stream.next().await.is_none());
}

#[tokio::test]
async fn a_consumer_that_stops_reading_holds_the_producer_to_its_window() {
    let (server, probe) = calc_server(Config::default());
    let client = Endpoint::builder()
        .config(Config::default().stream_window(8))
        .build();
    let (c, _s) = pair(&server, &client).await.unwrap();
    let calc = CalcClient::new(c);
    let mut stream = calc.items(1000, 10).await.unwrap();
    eventually("the window filled", || {
        probe.produced.load(Ordering::SeqCst) >= 8
    })
    .await;
    // Give a runaway producer the chance to overrun (a settle, not a timing assertion).
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The producer pulls one item, then waits for the credit to send it.
    assert!(probe.produced.load(Ordering::SeqCst) <= 9);
    let mut n = 0;
    while let Some(item) = stream.next().await {
        item.unwrap();
        n += 1;
    }
    assert_eq!(n, 1000);
}

#[tokio::test]
async fn dropping_a_stream_cancels_its_producer() {
    let (server, probe) = calc_server(Config::default());
    let client = Endpoint::builder()
        .config(Config::default().stream_window(4))
        .build();
    let (c, s) = pair(&server, &client).await.unwrap();
    let calc = CalcClient::new(c);
    let mut stream = calc.items(1_000_000, 1).await.unwrap();
    stream.next().await.unwrap().unwrap();
    assert_eq!(s.stats().in_flight_in, 1);
    drop(stream);
    eventually("the producer stopped", || s.stats().in_flight_in == 0).await;
    assert!(probe.produced.load(Ordering::SeqCst) < 1000);
    assert_eq!(calc.sum(1, 2).await.unwrap(), 3);
}

#[tokio::test]
async fn several_streams_and_calls_interleave_on_one_connection() {
    let (calc, _, _) = calc_pair().await;
    let tasks: Vec<_> = (0..4)
        .map(|k| {
            let calc = calc.clone();
            tokio::spawn(async move {
                let items: Vec<_> = calc.items(300, k * 10).await.unwrap().collect().await;
                assert_eq!(items.len(), 300);
                assert!(items
                    .into_iter()
                    .all(|i| i.unwrap().data.len() == (k * 10) as usize));
                calc.sum(k as i32, 1).await.unwrap()
            })
        })
        .collect();
    for (k, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap(), k as i32 + 1);
    }
}

#[tokio::test]
async fn an_upload_arrives_whole_and_in_order_alongside_the_other_arguments() {
    let (calc, _, _) = calc_pair().await;
    let items = futures::stream::iter(0..10_000i64);
    assert_eq!(
        calc.sum_upload(7, items).await.unwrap(),
        7 + (0..10_000).sum::<i64>()
    );
    // An empty upload is a stream that ends at once.
    assert_eq!(
        calc.sum_upload(1, futures::stream::empty()).await.unwrap(),
        1
    );
}

#[tokio::test]
async fn a_handler_that_stops_reading_answers_and_the_rest_of_the_upload_is_dropped() {
    let (calc, _, _) = calc_pair().await;
    // An endless upload: the answer must end the call, not the stream.
    let endless = futures::stream::iter(0i64..);
    assert_eq!(calc.count_until(5, endless).await.unwrap(), 6);
    assert_eq!(calc.sum(1, 2).await.unwrap(), 3);
}

#[tokio::test]
async fn an_uploader_is_held_to_the_callees_window() {
    let (server, probe) = calc_server(Config::default().stream_window(8));
    let client = Endpoint::builder().build();
    let (c, _s) = pair(&server, &client).await.unwrap();
    let calc = CalcClient::new(c);
    let pulled = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = pulled.clone();
    let items = futures::stream::iter(0..1000i64).inspect(move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
    });
    let call = tokio::spawn(async move { calc.read_slowly(items).await });
    eventually("the handler read its first item", || {
        probe.started.load(Ordering::SeqCst) == 1
    })
    .await;
    // Give a runaway uploader the chance to overrun (a settle, not a timing assertion).
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The window (8), plus the item pulled while waiting for a credit.
    assert!(pulled.load(Ordering::SeqCst) <= 9, "{pulled:?}");
    probe.release.notify_one();
    assert_eq!(call.await.unwrap().unwrap(), 1000);
}
