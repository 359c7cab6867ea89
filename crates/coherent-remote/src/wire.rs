//! The two RPC services a replica connection speaks: `ReplicaHost`, served by the server,
//! and `ReplicaSink`, served by the client (the server calls it to push invalidations).
//! Method arguments and values travel as blobs in the connection's format.

use coherent_rpc::{service, Blob, ErrorCode, RpcError};
use serde::{Deserialize, Serialize};

/// Why the server could not answer a remote compute call. The method's own errors are not
/// failures: they travel inside its value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Failure {
    /// No compute method is exposed under this id.
    UnknownMethod(u32),
    /// The arguments do not decode as the method's argument tuple.
    BadArguments(String),
    /// The value does not encode.
    BadValue(String),
    /// This connection holds as many replicas as the server allows.
    TooManyReplicas(usize),
}

impl From<Failure> for RpcError {
    fn from(f: Failure) -> Self {
        match f {
            Failure::UnknownMethod(id) => RpcError::new(
                ErrorCode::UnknownMethod,
                format!("no compute method with id {id:#010x} is exposed"),
            ),
            Failure::BadArguments(e) => RpcError::new(ErrorCode::BadArguments, e),
            Failure::BadValue(e) => RpcError::new(ErrorCode::Internal, e),
            Failure::TooManyReplicas(n) => RpcError::new(
                ErrorCode::Overloaded,
                format!("this connection already holds {n} replicas"),
            ),
        }
    }
}

/// Served by the server: compute calls, with or without a replica.
#[service]
pub(crate) trait ReplicaHost {
    /// Calls compute method `method` and keeps watching its result: when it is
    /// invalidated, the server calls `ReplicaSink::invalidated` with `replica` (an id the
    /// client chose, unique on this connection).
    async fn fetch(&self, method: u32, args: Blob, replica: u64) -> Result<Blob, Failure>;
    /// Calls compute method `method` once; nothing is watched.
    async fn call(&self, method: u32, args: Blob) -> Result<Blob, Failure>;
    /// The client no longer holds these replicas: stop watching them.
    #[oneway]
    async fn release(&self, replicas: Vec<u64>);
}

/// Served by the client: where the server pushes invalidations.
#[service]
pub(crate) trait ReplicaSink {
    /// These replicas are stale.
    #[oneway]
    async fn invalidated(&self, replicas: Vec<u64>);
}
