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
    /// This connection holds as many replicas as the server allows it, or it is untrusted
    /// and the untrusted connections hold as many as the server allows them together: the
    /// limit reached.
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
                format!("too many replicas held: the server's limit of {n} was reached"),
            ),
        }
    }
}

/// A replica the client holds, as it asks the server to confirm it after a reconnect.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Held {
    pub(crate) replica: u64,
    pub(crate) method: u32,
    pub(crate) args: Blob,
    /// [`value_hash`] of the encoded value the client holds.
    pub(crate) hash: u64,
}

/// A duration in nanoseconds, as leases count them (`u64::MAX` past 584 years).
pub(crate) fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// 64-bit FNV-1a of an encoded value: what a revalidation compares.
pub(crate) fn value_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Served by the server: compute calls, with or without a replica.
#[service]
pub(crate) trait ReplicaHost {
    /// Calls compute method `method` and keeps watching its result: when it is
    /// invalidated, the server calls `ReplicaSink::invalidated` with `replica` (an id the
    /// client chose, unique among its replicas).
    #[idempotent]
    async fn fetch(&self, method: u32, args: Blob, replica: u64) -> Result<Blob, Failure>;
    /// Calls compute method `method` once; nothing is watched.
    #[idempotent]
    async fn call(&self, method: u32, args: Blob) -> Result<Blob, Failure>;
    /// After a reconnect: for each replica, the server compares the hash of its current
    /// value with the client's. Those that match are watched again, as by `fetch`; the
    /// answer lists the others (changed, or failing now), which the client drops.
    #[idempotent]
    async fn revalidate(&self, replicas: Vec<Held>) -> Vec<u64>;
    /// The client no longer holds these replicas: stop watching them.
    #[oneway]
    async fn release(&self, replicas: Vec<u64>);
    /// How long, in nanoseconds from now, the server's caches may still answer (0 while
    /// they cannot tell whether they are current: a cluster host fenced, or past its
    /// lease; `u64::MAX`: unbounded, or an untrusted connection). Answered once the
    /// client acknowledged every push this connection had queued when the call came, so
    /// the client renews its replicas' lease with it (see `RemoteClient`'s liveness). A
    /// server of an older release answers `UnknownMethod`.
    async fn lease(&self) -> u64;
}

/// Served by the client: where the server pushes invalidations.
#[service]
pub(crate) trait ReplicaSink {
    /// These replicas are stale. Answered once the client has applied it (the replicas
    /// and what depends on them are invalidated), so that the server can tell a writer
    /// when its write has reached every client (`RemoteServer::invalidations_delivered`).
    async fn invalidated(&self, replicas: Vec<u64>);
}
