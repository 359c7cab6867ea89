//! Integration tests of coherent-rpc: one binary, one module per concern.

mod calls;
mod cancellation;
mod hostile;
mod limits;
mod streams;
mod support;
mod transports;
mod vectors;
