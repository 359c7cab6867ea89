//! `Caller`: what a generated client calls through. A plain [`Peer`] is one connection;
//! [`Reconnecting`](crate::Reconnecting) replaces its connection when it drops.

use std::future::Future;

use serde::{de::DeserializeOwned, Serialize};

use crate::error::RpcError;
use crate::peer::{CallOptions, Peer};
use crate::stream::ClientStream;

/// Makes calls for a generated `<Trait>Client`.
pub trait Caller: Clone + Send + Sync + 'static {
    /// A unary call: `args` is the tuple of arguments.
    fn call<A, R>(
        &self,
        method_id: u32,
        args: A,
        options: CallOptions,
    ) -> impl Future<Output = Result<R, RpcError>> + Send
    where
        A: Serialize + Send,
        R: DeserializeOwned + Send;

    /// A one-way call: done once queued.
    fn call_oneway<A>(
        &self,
        method_id: u32,
        args: A,
    ) -> impl Future<Output = Result<(), RpcError>> + Send
    where
        A: Serialize + Send;

    /// A streaming call.
    fn call_stream<A, T>(
        &self,
        method_id: u32,
        args: A,
    ) -> impl Future<Output = Result<ClientStream<T>, RpcError>> + Send
    where
        A: Serialize + Send,
        T: DeserializeOwned + Send;

    /// A call that uploads `items` as its stream argument.
    fn call_upload<A, T, R, S>(
        &self,
        method_id: u32,
        args: A,
        items: S,
        options: CallOptions,
    ) -> impl Future<Output = Result<R, RpcError>> + Send
    where
        A: Serialize + Send,
        T: Serialize + Send + 'static,
        R: DeserializeOwned + Send,
        S: futures::Stream<Item = T> + Send + 'static;
}

impl Caller for Peer {
    fn call_upload<A, T, R, S>(
        &self,
        method_id: u32,
        args: A,
        items: S,
        options: CallOptions,
    ) -> impl Future<Output = Result<R, RpcError>> + Send
    where
        A: Serialize + Send,
        T: Serialize + Send + 'static,
        R: DeserializeOwned + Send,
        S: futures::Stream<Item = T> + Send + 'static,
    {
        Peer::call_upload(self, method_id, args, items, options)
    }

    fn call<A, R>(
        &self,
        method_id: u32,
        args: A,
        options: CallOptions,
    ) -> impl Future<Output = Result<R, RpcError>> + Send
    where
        A: Serialize + Send,
        R: DeserializeOwned + Send,
    {
        Peer::call(self, method_id, args, options)
    }

    fn call_oneway<A>(
        &self,
        method_id: u32,
        args: A,
    ) -> impl Future<Output = Result<(), RpcError>> + Send
    where
        A: Serialize + Send,
    {
        std::future::ready(Peer::call_oneway(self, method_id, args))
    }

    fn call_stream<A, T>(
        &self,
        method_id: u32,
        args: A,
    ) -> impl Future<Output = Result<ClientStream<T>, RpcError>> + Send
    where
        A: Serialize + Send,
        T: DeserializeOwned + Send,
    {
        std::future::ready(Peer::call_stream(self, method_id, args))
    }
}
