//! What the calls and latency cases need from a peer: connect, then `Sum`, `GetUser`
//! and `SayHello`. Streams and payloads are peer-specific (not every peer has them).

use std::future::Future;
use std::net::SocketAddr;

use super::model::{Hello, User};

pub(crate) trait Peer: Clone + Send + Sync + 'static {
    /// The `<peer>` part of result names.
    const NAME: &'static str;

    fn connect(addr: SocketAddr) -> impl Future<Output = anyhow::Result<Self>> + Send;
    fn sum(&self, a: i32, b: i32) -> impl Future<Output = anyhow::Result<i32>> + Send;
    fn get_user(&self, id: i64) -> impl Future<Output = anyhow::Result<User>> + Send;
    fn say_hello(&self, hello: Hello) -> impl Future<Output = anyhow::Result<Hello>> + Send;
}
