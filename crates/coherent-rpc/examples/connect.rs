//! Quick connect-latency check: a new TCP connection, the handshake and one call, repeated;
//! prints the medians of the connect, the call and the total, in microseconds, then the
//! median of one caller's sequential calls on a connection kept open. Not the
//! benchmark suite (that is `coherent-bench rpc --only latency`); a smoke measure.
//!
//! `cargo run --release -p coherent-rpc --example connect -- [samples] [zero-rtt: 0 or 1] [kept calls]`

use std::time::Instant;

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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers"))
        .collect();
    let samples = args.first().copied().unwrap_or(3000);
    let zero_rtt = args.get(1).copied().unwrap_or(0) == 1;
    let kept_calls = args.get(2).copied().unwrap_or(samples * 10);

    let server = Endpoint::builder().service(CalcServer::new(Impl)).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { server.serve_tcp(listener).await });

    let client = Endpoint::builder()
        .config(coherent_rpc::Config::default().zero_rtt(zero_rtt))
        .build();
    let (mut connects, mut calls, mut totals) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..samples {
        let t0 = Instant::now();
        let calc = CalcClient::new(client.connect_tcp(addr).await?);
        let t1 = Instant::now();
        assert_eq!(calc.sum(1, 2).await?, 3);
        let t2 = Instant::now();
        drop(calc);
        connects.push((t1 - t0).as_secs_f64() * 1e6);
        calls.push((t2 - t1).as_secs_f64() * 1e6);
        totals.push((t2 - t0).as_secs_f64() * 1e6);
    }
    println!(
        "zero-RTT {zero_rtt}: connect {:.1} us, call {:.1} us, total {:.1} us (medians of {samples})",
        median(connects),
        median(calls),
        median(totals)
    );

    // One caller's sequential calls on a connection kept open (the suite's `rtt` case).
    let kept = CalcClient::new(client.connect_tcp(addr).await?);
    let mut rtts = Vec::with_capacity(kept_calls);
    for i in 0..kept_calls + 100 {
        let t0 = Instant::now();
        assert_eq!(kept.sum(1, 2).await?, 3);
        if i >= 100 {
            rtts.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    println!(
        "kept connection: call {:.1} us (median of {kept_calls})",
        median(rtts)
    );
    Ok(())
}
