//! Quick stream throughput check: concurrent server streams of small items over one TCP
//! connection on loopback. A smoke measure for profiling, not the benchmark suite.
//!
//! `cargo run --release -p coherent-rpc --example streams -- [streams] [item bytes] [seconds] [window]`

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use coherent_rpc::{service, Blob, Config, Endpoint, ServerStream};
use futures::StreamExt;

/// The measured service.
#[service]
pub trait Items {
    /// `count` items of `size` bytes.
    async fn items(&self, count: u32, size: u32) -> ServerStream<(i64, Blob)>;
}

struct Impl;

impl Items for Impl {
    async fn items(&self, count: u32, size: u32) -> ServerStream<(i64, Blob)> {
        let data = Blob::from(vec![7u8; size as usize]);
        Box::pin(futures::stream::iter(0..count).map(move |i| (i64::from(i), data.clone())))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers"))
        .collect();
    let streams = args.first().copied().unwrap_or(4) as usize;
    let size = args.get(1).copied().unwrap_or(1) as u32;
    let seconds = args.get(2).copied().unwrap_or(3);
    let window = args.get(3).copied().unwrap_or(1024) as u32;

    let config = Config::default().stream_window(window);
    let server = Endpoint::builder()
        .service(ItemsServer::new(Impl))
        .config(config.clone())
        .build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { server.serve_tcp(listener).await });
    let client = ItemsClient::new(
        Endpoint::builder()
            .config(config)
            .build()
            .connect_tcp(addr)
            .await?,
    );

    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..streams)
        .map(|_| {
            let (client, done, stop) = (client.clone(), done.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let mut s = client.items(1800, size).await.expect("call");
                    let mut n = 0;
                    while let Some(item) = s.next().await {
                        item.expect("item");
                        n += 1;
                    }
                    assert_eq!(n, 1800);
                    done.fetch_add(n, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await?;
    }
    let items = done.load(Ordering::Relaxed) as f64;
    println!(
        "{streams} streams of {size}-byte items: {items} items, {:.0} items/s",
        items / start.elapsed().as_secs_f64()
    );
    Ok(())
}
