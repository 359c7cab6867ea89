//! Integration tests of coherent-rpc: one binary, one module per concern.

mod calls;
mod cancellation;
mod hostile;
mod keepalive;
mod limits;
mod reconnect;
mod streams;
mod support;
#[cfg(feature = "tls")]
mod tls;
mod transports;
mod vectors;
mod websocket;
mod zero_rtt;
