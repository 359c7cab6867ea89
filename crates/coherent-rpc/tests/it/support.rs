//! Services and connection helpers shared by the tests.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use coherent_rpc::{service, Blob, CallContext, Endpoint, Peer, RpcError, ServerStream, Upload};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum DivError {
    ByZero,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct User {
    pub id: u64,
    pub version: u64,
    pub created_at: i64,
    pub modified_at: i64,
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Item {
    pub index: i64,
    pub data: Vec<u8>,
}

#[service]
pub trait Calc {
    async fn sum(&self, a: i32, b: i32) -> i32;
    async fn div(&self, a: i32, b: i32) -> Result<i32, DivError>;
    async fn get_user(&self, id: u64) -> User;
    async fn echo(&self, data: Vec<u8>) -> Vec<u8>;
    /// The blob's length and the blob itself, as received.
    async fn echo_blob(&self, data: Blob) -> (usize, Blob);
    async fn whoami(&self) -> Option<String>;
    async fn sleep_forever(&self) -> ();
    async fn wait_for_release(&self) -> ();
    async fn panics(&self) -> ();
    async fn ask_back(&self, x: i32) -> i32;
    #[oneway]
    async fn record(&self, v: u32);
    async fn recorded(&self) -> Vec<u32>;
    async fn items(&self, count: u32, size: u32) -> ServerStream<Item>;
    /// `offset` plus the sum of the uploaded numbers.
    async fn sum_upload(&self, offset: i64, items: Upload<i64>) -> i64;
    /// How many numbers arrive up to and including `stop_at`; stops reading there.
    async fn count_until(&self, stop_at: i64, items: Upload<i64>) -> u64;
    /// Reads one number, then waits for the probe's release before reading the rest.
    async fn read_slowly(&self, items: Upload<i64>) -> u64;
    /// `count` items, then a panic in the stream.
    async fn items_then_panic(&self, count: u32) -> ServerStream<Item>;
    /// Hangs on its first run, answers the run count afterwards.
    #[idempotent]
    async fn hang_first_time(&self) -> usize;
    /// How many units came: elements that take no bytes on the wire.
    async fn count_units(&self, units: Vec<()>) -> usize;
}

#[service]
pub trait Doubler {
    async fn double(&self, x: i32) -> i32;
}

/// An `items` size that asks for [`mixed_size`] instead: items whose lengths need one-, two-
/// and three-byte prefixes, in turns.
pub(crate) const MIXED: u32 = u32::MAX;

/// The size of item `i` of a `MIXED` stream.
pub(crate) fn mixed_size(i: u32) -> u32 {
    [0, 200, 20_000, 5, 130, 127, 16_384, 1, 300, 70_000][i as usize % 10]
}

/// What the tests observe of the server's handlers.
#[derive(Default)]
pub(crate) struct Probe {
    pub started: AtomicUsize,
    pub dropped: AtomicUsize,
    pub produced: AtomicUsize,
    pub release: Notify,
    pub recorded: parking_lot::Mutex<Vec<u32>>,
    pub recorded_changed: Notify,
}

struct DropCounter(Arc<Probe>);

impl Drop for DropCounter {
    fn drop(&mut self) {
        self.0.dropped.fetch_add(1, Ordering::SeqCst);
    }
}

#[derive(Clone, Default)]
pub(crate) struct CalcImpl {
    pub probe: Arc<Probe>,
}

impl Calc for CalcImpl {
    async fn sum(&self, a: i32, b: i32) -> i32 {
        a.wrapping_add(b)
    }

    async fn div(&self, a: i32, b: i32) -> Result<i32, DivError> {
        if b == 0 {
            Err(DivError::ByZero)
        } else {
            Ok(a / b)
        }
    }

    async fn get_user(&self, id: u64) -> User {
        User {
            id,
            version: 3,
            created_at: 1_700_000_000,
            modified_at: 1_700_000_100,
            name: format!("user {id}"),
        }
    }

    async fn echo(&self, data: Vec<u8>) -> Vec<u8> {
        data
    }

    async fn echo_blob(&self, data: Blob) -> (usize, Blob) {
        (data.len(), data)
    }

    async fn whoami(&self) -> Option<String> {
        CallContext::current().and_then(|c| c.identity().map(|i| i.name().to_owned()))
    }

    async fn sleep_forever(&self) {
        let _guard = DropCounter(self.probe.clone());
        self.probe.started.fetch_add(1, Ordering::SeqCst);
        std::future::pending::<()>().await;
    }

    async fn wait_for_release(&self) {
        // Registered before it counts as started, so that a release right after the
        // count is seen cannot be missed.
        let released = self.probe.release.notified();
        self.probe.started.fetch_add(1, Ordering::SeqCst);
        released.await;
    }

    async fn panics(&self) {
        panic!("this handler panics on purpose");
    }

    async fn count_units(&self, units: Vec<()>) -> usize {
        units.len()
    }

    async fn ask_back(&self, x: i32) -> i32 {
        let ctx = CallContext::current().expect("inside a call");
        let doubler = DoublerClient::new(ctx.peer().clone());
        doubler.double(x).await.unwrap_or(-1) + 1
    }

    async fn record(&self, v: u32) {
        self.probe.recorded.lock().push(v);
        self.probe.recorded_changed.notify_waiters();
    }

    async fn recorded(&self) -> Vec<u32> {
        self.probe.recorded.lock().clone()
    }

    async fn hang_first_time(&self) -> usize {
        let n = self.probe.started.fetch_add(1, Ordering::SeqCst) + 1;
        if n == 1 {
            std::future::pending::<()>().await;
        }
        n
    }

    async fn items(&self, count: u32, size: u32) -> ServerStream<Item> {
        let probe = self.probe.clone();
        Box::pin(futures::stream::iter(0..count).map(move |i| {
            probe.produced.fetch_add(1, Ordering::SeqCst);
            let size = if size == MIXED { mixed_size(i) } else { size };
            Item {
                index: i64::from(i),
                data: vec![(i % 251) as u8; size as usize],
            }
        }))
    }

    async fn sum_upload(&self, offset: i64, mut items: Upload<i64>) -> i64 {
        let mut sum = offset;
        while let Some(item) = items.next().await {
            sum += item.expect("an uploaded item");
        }
        sum
    }

    async fn count_until(&self, stop_at: i64, mut items: Upload<i64>) -> u64 {
        let mut n = 0;
        while let Some(item) = items.next().await {
            n += 1;
            if item.expect("an uploaded item") == stop_at {
                break;
            }
        }
        n
    }

    async fn read_slowly(&self, mut items: Upload<i64>) -> u64 {
        let mut n = 0;
        if items.next().await.is_some() {
            n += 1;
        }
        self.probe.started.fetch_add(1, Ordering::SeqCst);
        self.probe.release.notified().await;
        while let Some(item) = items.next().await {
            item.expect("an uploaded item");
            n += 1;
        }
        n
    }

    async fn items_then_panic(&self, count: u32) -> ServerStream<Item> {
        Box::pin(futures::stream::iter(0..=count).map(move |i| {
            assert!(i < count, "the stream's producer fails");
            Item {
                index: i64::from(i),
                data: Vec::new(),
            }
        }))
    }
}

use futures::StreamExt;

pub(crate) struct DoublerImpl;

impl Doubler for DoublerImpl {
    async fn double(&self, x: i32) -> i32 {
        x * 2
    }
}

/// A server endpoint serving `CalcImpl` (and its probe).
pub(crate) fn calc_server(config: coherent_rpc::Config) -> (Endpoint, Arc<Probe>) {
    let calc = CalcImpl::default();
    let probe = calc.probe.clone();
    let ep = Endpoint::builder()
        .service(CalcServer::new(calc))
        .config(config)
        .build();
    (ep, probe)
}

/// A Calc server whose auth hook accepts only `good` (as identity "ok") and refuses any
/// other token as "not known".
pub(crate) fn calc_server_accepting(good: &'static str) -> Endpoint {
    Endpoint::builder()
        .service(CalcServer::new(CalcImpl::default()))
        .authenticate(move |token| async move {
            if token == good {
                Ok(coherent_rpc::Identity::new("ok"))
            } else {
                Err(format!("token {token:?} is not known"))
            }
        })
        .build()
}

/// Connects `client` to `server` over an in-memory duplex; returns (client side, server side).
pub(crate) async fn pair(server: &Endpoint, client: &Endpoint) -> Result<(Peer, Peer), RpcError> {
    let (a, b) = tokio::io::duplex(256 * 1024);
    let server = server.clone();
    let accepted = tokio::spawn(async move { server.accept(a).await });
    let c = client.connect(b).await?;
    let s = accepted.await.expect("accept task")?;
    Ok((c, s))
}

/// A default client endpoint connected to a default Calc server.
pub(crate) async fn calc_pair() -> (CalcClient, Arc<Probe>, Peer) {
    let (server, probe) = calc_server(coherent_rpc::Config::default());
    let (c, s) = pair(&server, &Endpoint::builder().build())
        .await
        .expect("pair");
    (CalcClient::new(c), probe, s)
}

/// Polls `cond` until it holds, failing after a generous bound (not a timing assertion:
/// it only keeps a broken test from hanging).
pub(crate) async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..2000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("never happened: {what}");
}
