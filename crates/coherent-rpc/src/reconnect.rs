//! A caller that survives disconnects: it reconnects with exponential backoff and jitter,
//! one attempt sequence at a time however many callers notice the loss, and resends the
//! calls that were in flight when they are marked idempotent.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{de::DeserializeOwned, Serialize};

use crate::caller::Caller;
use crate::error::{ErrorCode, RpcError};
use crate::peer::{CallOptions, Peer};
use crate::service::BoxFuture;
use crate::stream::ClientStream;

/// How a [`Reconnecting`] caller spaces its connection attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The wait after the first failed attempt.
    pub initial: Duration,
    /// The longest wait between attempts.
    pub max: Duration,
    /// Attempts per reconnection before callers get `Disconnected`.
    pub max_attempts: u32,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(50),
            max: Duration::from_secs(5),
            max_attempts: 10,
        }
    }
}

impl Backoff {
    /// The wait before attempt `n + 1`: `initial * 2^n`, capped at `max`, then scaled by a
    /// random factor in [0.5, 1.0) so that clients cut off together do not return together.
    pub fn delay(&self, n: u32, seed: u64) -> Duration {
        let base = self
            .initial
            .saturating_mul(1u32.checked_shl(n.min(31)).unwrap_or(u32::MAX))
            .min(self.max);
        // splitmix64: cheap, good enough to spread retries.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let factor = 0.5 + (z >> 11) as f64 / (1u64 << 53) as f64 / 2.0;
        base.mul_f64(factor)
    }
}

type Connect = Arc<dyn Fn() -> BoxFuture<Result<Peer, RpcError>> + Send + Sync>;

/// A [`Caller`] that reconnects when its connection drops.
///
/// Calls made while disconnected wait for the reconnection (bounded by the backoff's
/// attempts and by the call's deadline). A call in flight when the connection drops is
/// resent on the new connection if it is idempotent, and fails with `Disconnected`
/// otherwise.
#[derive(Clone)]
pub struct Reconnecting {
    inner: Arc<Inner>,
}

struct Inner {
    connect: Connect,
    backoff: Backoff,
    // A std-style lock for the fast path (no `.await` while held); the tokio mutex makes
    // reconnection single-flight.
    current: parking_lot::Mutex<Option<Peer>>,
    reconnecting: tokio::sync::Mutex<()>,
    connects: AtomicU64,
}

impl Reconnecting {
    /// A caller that connects with `connect` on first use and after every disconnect.
    pub fn new<F, Fut>(connect: F, backoff: Backoff) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Peer, RpcError>> + Send + 'static,
    {
        Self {
            inner: Arc::new(Inner {
                connect: Arc::new(move || Box::pin(connect())),
                backoff,
                current: parking_lot::Mutex::new(None),
                reconnecting: tokio::sync::Mutex::new(()),
                connects: AtomicU64::new(0),
            }),
        }
    }

    /// How many connections were made so far.
    pub fn connections(&self) -> u64 {
        self.inner.connects.load(Ordering::Relaxed)
    }

    /// The open connection, if there is one now (without connecting).
    pub fn current(&self) -> Option<Peer> {
        self.open()
    }

    fn open(&self) -> Option<Peer> {
        self.inner
            .current
            .lock()
            .as_ref()
            .filter(|p| p.close_reason().is_none())
            .cloned()
    }

    /// The open connection, connecting first when there is none.
    pub async fn peer(&self) -> Result<Peer, RpcError> {
        if let Some(p) = self.open() {
            return Ok(p);
        }
        let _single_flight = self.inner.reconnecting.lock().await;
        if let Some(p) = self.open() {
            return Ok(p);
        }
        let b = self.inner.backoff;
        let mut last = None;
        for n in 0..b.max_attempts.max(1) {
            if n > 0 {
                let seed = self.inner.connects.load(Ordering::Relaxed)
                    ^ u64::from(n)
                    ^ std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.subsec_nanos().into());
                tokio::time::sleep(b.delay(n - 1, seed)).await;
            }
            match (self.inner.connect)().await {
                Ok(p) => {
                    self.inner.connects.fetch_add(1, Ordering::Relaxed);
                    *self.inner.current.lock() = Some(p.clone());
                    return Ok(p);
                }
                Err(e) if e.code() == ErrorCode::Unauthenticated => return Err(e),
                Err(e) => {
                    tracing::debug!(attempt = n + 1, %e, "reconnect failed");
                    last = Some(e);
                }
            }
        }
        Err(RpcError::disconnected(format!(
            "could not connect after {} attempts: {}",
            b.max_attempts.max(1),
            last.map_or_else(String::new, |e| e.to_string())
        )))
    }

    async fn call_inner<A, R>(
        &self,
        method_id: u32,
        args: A,
        opts: CallOptions,
    ) -> Result<R, RpcError>
    where
        A: Serialize + Send,
        R: DeserializeOwned + Send,
    {
        let mut peer = self.peer().await?;
        let format = peer.format();
        let payload = format.encode_message(&args)?;
        drop(args);
        let mut resends = 0;
        loop {
            match peer.call_message(method_id, payload.clone(), opts).await {
                Err(e)
                    if e.code() == ErrorCode::Disconnected
                        && opts.idempotent
                        && resends < self.inner.backoff.max_attempts =>
                {
                    resends += 1;
                    peer = self.peer().await?;
                }
                r => return format.decode_bytes(r?),
            }
        }
    }
}

impl Caller for Reconnecting {
    /// Over the open connection (connecting first if needed); an upload is never resent.
    async fn call_upload<A, T, R, S>(
        &self,
        method_id: u32,
        args: A,
        items: S,
        options: CallOptions,
    ) -> Result<R, RpcError>
    where
        A: Serialize + Send,
        T: Serialize + Send + 'static,
        R: DeserializeOwned + Send,
        S: futures::Stream<Item = T> + Send + 'static,
    {
        self.peer()
            .await?
            .call_upload(method_id, args, items, options)
            .await
    }

    async fn call<A, R>(&self, method_id: u32, args: A, options: CallOptions) -> Result<R, RpcError>
    where
        A: Serialize + Send,
        R: DeserializeOwned + Send,
    {
        match options.timeout {
            // The deadline covers the reconnection too: nothing waits forever.
            Some(d) => tokio::time::timeout(d, self.call_inner(method_id, args, options))
                .await
                .unwrap_or_else(|_| {
                    Err(RpcError::new(
                        ErrorCode::DeadlineExceeded,
                        format!("no reply within {d:?}"),
                    ))
                }),
            None => self.call_inner(method_id, args, options).await,
        }
    }

    async fn call_oneway<A>(&self, method_id: u32, args: A) -> Result<(), RpcError>
    where
        A: Serialize + Send,
    {
        self.peer().await?.call_oneway(method_id, args)
    }

    async fn call_stream<A, T>(&self, method_id: u32, args: A) -> Result<ClientStream<T>, RpcError>
    where
        A: Serialize + Send,
        T: DeserializeOwned + Send,
    {
        self.peer().await?.call_stream(method_id, args)
    }
}
