//! Quick payload check: one caller echoing a large random blob over one TCP connection on
//! loopback. A smoke measure for profiling, not the benchmark suite.
//!
//! `cargo run --release -p coherent-rpc --example payload -- [megabytes] [seconds] [none|lz4|zstd] [rand|zero]`

use std::time::{Duration, Instant};

use coherent_rpc::{service, Blob, Compression, Config, Endpoint};

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
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |i: usize, default: u64| {
        args.get(i)
            .map_or(default, |a| a.parse().expect("a number"))
    };
    let mb = number(0, 10) as usize;
    let seconds = number(1, 3);
    let compression = match args.get(2).map(String::as_str) {
        None | Some("none") => Compression::None,
        Some("lz4") => Compression::Lz4,
        Some("zstd") => Compression::Zstd,
        Some(other) => panic!("unknown compression {other}"),
    };
    let zeros = args.get(3).is_some_and(|k| k == "zero");

    let config = Config::default()
        .max_message_size(((mb + 1) << 20) as u32)
        .compression(compression, 4096);
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
            if zeros {
                0
            } else {
                x as u8
            }
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
