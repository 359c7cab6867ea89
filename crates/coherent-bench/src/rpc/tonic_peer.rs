//! The tonic peer: gRPC over HTTP/2, one HTTP/2 connection per `Channel`, TCP_NODELAY,
//! 16 MB message limits, larger HTTP/2 windows (its best streaming settings), `bytes`
//! fields as `Bytes` (no copies), optional gzip.

// tonic's `Status` is large by design; its API returns it everywhere.
#![allow(clippy::result_large_err)]

use std::net::SocketAddr;
use std::pin::Pin;

use futures::{Stream, StreamExt};
use tonic::codec::CompressionEncoding;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use super::model::{self, Choice, Hello, Pet, User};
use super::peer::Peer;

#[allow(unreachable_pub, missing_docs, clippy::all)]
pub(crate) mod pb {
    tonic::include_proto!("rpcbench");
}

use pb::bench_client::BenchClient;
use pb::bench_server::{Bench, BenchServer};

const LIMIT: usize = 16 << 20;
const WINDOW: u32 = 8 << 20;

struct Impl;

#[tonic::async_trait]
impl Bench for Impl {
    async fn sum(&self, r: Request<pb::SumRequest>) -> Result<Response<pb::SumReply>, Status> {
        let r = r.into_inner();
        Ok(Response::new(pb::SumReply {
            sum: r.a.wrapping_add(r.b),
        }))
    }

    async fn get_user(&self, r: Request<pb::GetUserRequest>) -> Result<Response<pb::User>, Status> {
        let u = model::user(r.into_inner().id);
        Ok(Response::new(pb::User {
            id: u.id,
            version: u.version,
            created_at: u.created_at,
            modified_at: u.modified_at,
            name: u.name,
        }))
    }

    async fn say_hello(
        &self,
        r: Request<pb::HelloRequest>,
    ) -> Result<Response<pb::HelloReply>, Status> {
        Ok(Response::new(pb::HelloReply {
            response: r.into_inner().request,
        }))
    }

    type ItemsStream = Pin<Box<dyn Stream<Item = Result<pb::Item, Status>> + Send>>;

    async fn items(
        &self,
        r: Request<pb::ItemsRequest>,
    ) -> Result<Response<Self::ItemsStream>, Status> {
        let r = r.into_inner();
        let data = bytes::Bytes::from(vec![7u8; r.size as usize]);
        let stream = futures::stream::iter(0..r.count).map(move |i| {
            Ok(pb::Item {
                index: i64::from(i),
                data: data.clone(),
            })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn echo(&self, r: Request<pb::Payload>) -> Result<Response<pb::Payload>, Status> {
        Ok(Response::new(r.into_inner()))
    }
}

pub(crate) async fn start() -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let incoming = futures::stream::unfold(listener, |l| async move {
        let r = l.accept().await.map(|(s, _)| {
            let _ = s.set_nodelay(true);
            s
        });
        Some((r, l))
    });
    let service = BenchServer::new(Impl)
        .max_decoding_message_size(LIMIT)
        .max_encoding_message_size(LIMIT)
        .accept_compressed(CompressionEncoding::Gzip)
        .send_compressed(CompressionEncoding::Gzip);
    tokio::spawn(
        tonic::transport::Server::builder()
            .initial_stream_window_size(WINDOW)
            .initial_connection_window_size(WINDOW)
            .add_service(service)
            .serve_with_incoming(incoming),
    );
    Ok(addr)
}

pub(crate) async fn connect_with(
    addr: SocketAddr,
    gzip: bool,
) -> anyhow::Result<BenchClient<Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .tcp_nodelay(true)
        .initial_stream_window_size(WINDOW)
        .initial_connection_window_size(WINDOW)
        .connect()
        .await?;
    let mut client = BenchClient::new(channel)
        .max_decoding_message_size(LIMIT)
        .max_encoding_message_size(LIMIT);
    if gzip {
        client = client
            .send_compressed(CompressionEncoding::Gzip)
            .accept_compressed(CompressionEncoding::Gzip);
    }
    Ok(client)
}

fn to_pb(h: Hello) -> pb::Hello {
    pb::Hello {
        name: h.name,
        d: h.d,
        f: h.f,
        b: h.b,
        n32: h.n32,
        n64: h.n64,
        choice: h.choice.map(|c| match c {
            Choice::Text(s) => pb::hello::Choice::Text(s),
            Choice::Flag(b) => pb::hello::Choice::Flag(b),
        }),
        pets: h
            .pets
            .into_iter()
            .map(|p| pb::Pet {
                name: p.name,
                color: p.color,
            })
            .collect(),
    }
}

fn from_pb(h: pb::Hello) -> Hello {
    Hello {
        name: h.name,
        d: h.d,
        f: h.f,
        b: h.b,
        n32: h.n32,
        n64: h.n64,
        choice: h.choice.map(|c| match c {
            pb::hello::Choice::Text(s) => Choice::Text(s),
            pb::hello::Choice::Flag(b) => Choice::Flag(b),
        }),
        pets: h
            .pets
            .into_iter()
            .map(|p| Pet {
                name: p.name,
                color: p.color,
            })
            .collect(),
    }
}

#[derive(Clone)]
pub(crate) struct Tonic(pub(crate) BenchClient<Channel>);

impl Peer for Tonic {
    const NAME: &'static str = "tonic";

    async fn connect(addr: SocketAddr) -> anyhow::Result<Self> {
        Ok(Self(connect_with(addr, false).await?))
    }

    async fn sum(&self, a: i32, b: i32) -> anyhow::Result<i32> {
        let r = self.0.clone().sum(pb::SumRequest { a, b }).await?;
        Ok(r.into_inner().sum)
    }

    async fn get_user(&self, id: i64) -> anyhow::Result<User> {
        let u = self
            .0
            .clone()
            .get_user(pb::GetUserRequest { id })
            .await?
            .into_inner();
        Ok(User {
            id: u.id,
            version: u.version,
            created_at: u.created_at,
            modified_at: u.modified_at,
            name: u.name,
        })
    }

    async fn say_hello(&self, hello: Hello) -> anyhow::Result<Hello> {
        let r = self
            .0
            .clone()
            .say_hello(pb::HelloRequest {
                request: Some(to_pb(hello)),
            })
            .await?
            .into_inner();
        Ok(from_pb(
            r.response.ok_or_else(|| anyhow::anyhow!("empty reply"))?,
        ))
    }
}

impl Tonic {
    pub(crate) async fn items(&self, count: u32, size: u32) -> anyhow::Result<u64> {
        let mut stream = self
            .0
            .clone()
            .items(pb::ItemsRequest {
                count: count as i32,
                size: size as i32,
            })
            .await?
            .into_inner();
        let mut n = 0u64;
        while let Some(item) = stream.next().await {
            anyhow::ensure!(item?.data.len() == size as usize);
            n += 1;
        }
        anyhow::ensure!(n == u64::from(count), "stream ended after {n} items");
        Ok(n)
    }

    pub(crate) async fn echo(&self, data: bytes::Bytes) -> anyhow::Result<bytes::Bytes> {
        Ok(self
            .0
            .clone()
            .echo(pb::Payload { data })
            .await?
            .into_inner()
            .data)
    }
}
