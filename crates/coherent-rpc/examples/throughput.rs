//! Quick throughput check: many concurrent callers of `sum` over a few TCP connections on
//! loopback. Not the benchmark suite (that is `coherent-bench rpc`); a smoke measure.
//!
//! `cargo run --release -p coherent-rpc --example throughput -- [callers] [connections] [seconds]`

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use coherent_rpc::{service, Endpoint};

/// The measured service.
#[service]
pub trait Calc {
    /// Adds two numbers.
    async fn sum(&self, a: i32, b: i32) -> i32;
}

struct Impl;

impl Calc for Impl {
    async fn sum(&self, a: i32, b: i32) -> i32 {
        a.wrapping_add(b)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers"))
        .collect();
    let callers = args.first().copied().unwrap_or(200);
    let connections = args.get(1).copied().unwrap_or(2);
    let seconds = args.get(2).copied().unwrap_or(3) as u64;

    let server = Endpoint::builder().service(CalcServer::new(Impl)).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { server.serve_tcp(listener).await });

    let client = Endpoint::builder().build();
    let mut clients = Vec::new();
    for _ in 0..connections {
        clients.push(CalcClient::new(client.connect_tcp(addr).await?));
    }
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..callers {
        let calc = clients[i % connections].clone();
        let (done, stop) = (done.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let r = calc.sum(i as i32, 1).await.expect("call");
                assert_eq!(r, i as i32 + 1);
                n += 1;
            }
            done.fetch_add(n, Ordering::Relaxed);
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await?;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let calls = done.load(Ordering::Relaxed);
    println!(
        "{callers} callers, {connections} connections: {calls} calls in {elapsed:.2} s = {:.0} calls/s",
        calls as f64 / elapsed
    );
    Ok(())
}
