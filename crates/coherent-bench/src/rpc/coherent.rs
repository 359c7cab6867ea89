//! Our peer: coherent-rpc over TCP, postcard, one connection per client handle.

use std::net::SocketAddr;

use bytes::Bytes;
use coherent::rpc::{
    service, Blob, ClientStream, Compression, Config, Endpoint, Peer as RpcPeer, ServerStream,
};
use futures::StreamExt;

use super::model::{self, Hello, Item, User};
use super::peer::Peer;

/// The benchmark service.
#[service]
pub(crate) trait Bench {
    async fn sum(&self, a: i32, b: i32) -> i32;
    async fn get_user(&self, id: i64) -> User;
    async fn say_hello(&self, request: Hello) -> Hello;
    async fn items(&self, count: u32, size: u32) -> ServerStream<Item>;
    async fn echo(&self, data: Blob) -> Blob;
}

struct Impl;

impl Bench for Impl {
    async fn sum(&self, a: i32, b: i32) -> i32 {
        a.wrapping_add(b)
    }

    async fn get_user(&self, id: i64) -> User {
        model::user(id)
    }

    async fn say_hello(&self, request: Hello) -> Hello {
        request
    }

    async fn items(&self, count: u32, size: u32) -> ServerStream<Item> {
        let data = Blob::from(vec![7u8; size as usize]);
        Box::pin(futures::stream::iter(0..count).map(move |i| Item {
            index: i64::from(i),
            data: data.clone(),
        }))
    }

    async fn echo(&self, data: Blob) -> Blob {
        data
    }
}

fn config(compression: Compression) -> Config {
    Config::default()
        .max_message_size(16 << 20)
        .stream_window(1024)
        .compression(compression, 4096)
        // Calls travel right behind the Hello on a new connection.
        .zero_rtt(true)
}

/// Serves the benchmark service on a loopback port, with `compression` for answers.
pub(crate) async fn start(compression: Compression) -> anyhow::Result<SocketAddr> {
    let server = Endpoint::builder()
        .service(BenchServer::new(Impl))
        .config(config(compression))
        .build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { server.serve_tcp(listener).await });
    Ok(addr)
}

pub(crate) async fn connect_with(
    addr: SocketAddr,
    compression: Compression,
) -> anyhow::Result<BenchClient> {
    let peer: RpcPeer = Endpoint::builder()
        .config(config(compression))
        .build()
        .connect_tcp(addr)
        .await?;
    Ok(BenchClient::new(peer))
}

#[derive(Clone)]
pub(crate) struct Coherent(pub(crate) BenchClient);

impl Peer for Coherent {
    const NAME: &'static str = "coherent";

    async fn connect(addr: SocketAddr) -> anyhow::Result<Self> {
        Ok(Self(connect_with(addr, Compression::None).await?))
    }

    async fn sum(&self, a: i32, b: i32) -> anyhow::Result<i32> {
        Ok(self.0.sum(a, b).await?)
    }

    async fn get_user(&self, id: i64) -> anyhow::Result<User> {
        Ok(self.0.get_user(id).await?)
    }

    async fn say_hello(&self, hello: Hello) -> anyhow::Result<Hello> {
        Ok(self.0.say_hello(hello).await?)
    }
}

impl Coherent {
    /// One stream call: how many items arrived (checked against `count`).
    pub(crate) async fn items(&self, count: u32, size: u32) -> anyhow::Result<u64> {
        let mut stream: ClientStream<Item> = self.0.items(count, size).await?;
        let mut n = 0u64;
        while let Some(item) = stream.next().await {
            let item = item?;
            anyhow::ensure!(item.data.len() == size as usize);
            n += 1;
        }
        anyhow::ensure!(n == u64::from(count), "stream ended after {n} items");
        Ok(n)
    }

    pub(crate) async fn echo(&self, data: Bytes) -> anyhow::Result<Bytes> {
        Ok(self.0.echo(data.into()).await?.into_bytes())
    }
}
