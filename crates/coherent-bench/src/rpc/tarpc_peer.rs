//! The tarpc peer: tarpc's serde transport over TCP with bincode, its default client and
//! channel settings, each request spawned on the server (tarpc's documented way).

use std::net::SocketAddr;

use futures::{future, StreamExt};
use tarpc::server::{self, Channel};
use tarpc::tokio_serde::formats::Bincode;
use tarpc::{client, context};

use super::model::{self, Hello, User};
use super::peer::Peer;

#[tarpc::service]
pub(crate) trait TarpcBench {
    async fn sum(a: i32, b: i32) -> i32;
    async fn get_user(id: i64) -> User;
    async fn say_hello(hello: Hello) -> Hello;
}

#[derive(Clone)]
struct Impl;

impl TarpcBench for Impl {
    async fn sum(self, _: context::Context, a: i32, b: i32) -> i32 {
        a.wrapping_add(b)
    }

    async fn get_user(self, _: context::Context, id: i64) -> User {
        model::user(id)
    }

    async fn say_hello(self, _: context::Context, hello: Hello) -> Hello {
        hello
    }
}

pub(crate) async fn start() -> anyhow::Result<SocketAddr> {
    let mut listener = tarpc::serde_transport::tcp::listen("127.0.0.1:0", Bincode::default).await?;
    listener.config_mut().max_frame_length(16 << 20);
    let addr = listener.local_addr();
    tokio::spawn(
        listener
            .filter_map(|r| future::ready(r.ok()))
            .map(server::BaseChannel::with_defaults)
            .map(|channel| {
                channel.execute(Impl.serve()).for_each(|response| {
                    tokio::spawn(response);
                    future::ready(())
                })
            })
            .buffer_unordered(1024)
            .for_each(|_| future::ready(())),
    );
    Ok(addr)
}

#[derive(Clone)]
pub(crate) struct Tarpc(TarpcBenchClient);

impl Peer for Tarpc {
    const NAME: &'static str = "tarpc";

    async fn connect(addr: SocketAddr) -> anyhow::Result<Self> {
        let mut connect = tarpc::serde_transport::tcp::connect(addr, Bincode::default);
        connect.config_mut().max_frame_length(16 << 20);
        let transport = connect.await?;
        let mut config = client::Config::default();
        config.max_in_flight_requests = 100_000;
        Ok(Self(TarpcBenchClient::new(config, transport).spawn()))
    }

    async fn sum(&self, a: i32, b: i32) -> anyhow::Result<i32> {
        Ok(self.0.sum(context::current(), a, b).await?)
    }

    async fn get_user(&self, id: i64) -> anyhow::Result<User> {
        Ok(self.0.get_user(context::current(), id).await?)
    }

    async fn say_hello(&self, hello: Hello) -> anyhow::Result<Hello> {
        Ok(self.0.say_hello(context::current(), hello).await?)
    }
}
