//! coherent-remote end to end: replicas over RPC and the HTTP gateway.

mod caller;
mod failover;
mod gateway;
mod holders;
mod persistent;
mod replicas;
mod support;
mod wire;
