//! Quick payload check: one caller echoing a large random blob over one TCP connection on
//! loopback. A smoke measure for profiling, not the benchmark suite.
//!
//! `cargo run --release -p coherent-rpc --example payload -- [megabytes] [seconds]`

use std::time::{Duration, Instant};

use coherent_rpc::{service, Blob, Config, Endpoint};

/// The measured service.
#[service]
pub trait Echo {
    /// Answers what it was given.
    async fn echo(&self, data: Blob) -> Blob;
}

struct Impl;

impl Echo for Impl {
    async fn echo(&self, data: Blob) -> Blob {
        data
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers"))
        .collect();
    let mb = args.first().copied().unwrap_or(10) as usize;
    let seconds = args.get(1).copied().unwrap_or(3);

    let config = Config::default().max_message_size(((mb + 1) << 20) as u32);
    let server = Endpoint::builder()
        .service(EchoServer::new(Impl))
        .config(config.clone())
        .build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { server.serve_tcp(listener).await });
    let client = EchoClient::new(
        Endpoint::builder()
            .config(config)
            .build()
            .connect_tcp(addr)
            .await?,
    );

    // Random bytes (xorshift), so that nothing along the way can shortcut them.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u8> = (0..mb << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let data = Blob::from(data);
    let start = Instant::now();
    let mut trips = 0u64;
    while start.elapsed() < Duration::from_secs(seconds) {
        let back = client.echo(data.clone()).await?;
        assert_eq!(back.len(), data.len());
        trips += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{trips} round trips of {mb} MiB in {secs:.2} s: {:.0} MB/s",
        trips as f64 * (mb << 20) as f64 / 1e6 / secs
    );
    Ok(())
}
