//! The counters of a registry, an endpoint and a remote server and client, reported through
//! the `metrics` facade by `coherent::metrics::Observer`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use coherent::metrics::Observer;
use coherent::prelude::*;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::MetricKind;

#[compute_service]
pub(crate) trait Meter {
    async fn reading(&self, id: u64) -> Result<u64, RpcError>;
}

#[derive(Clone, ComputeService)]
struct Counting {
    handle: ServiceHandle,
    base: Arc<AtomicU64>,
}

#[compute_service]
impl Meter for Counting {
    async fn reading(&self, id: u64) -> Result<u64, RpcError> {
        Ok(self.base.load(Ordering::SeqCst) + id)
    }
}

type Snapshot = Vec<(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
)>;

/// The value of one metric with one label in a snapshot (taking one resets the counters).
fn value(snapshot: &Snapshot, name: &str, label: (&str, &str)) -> f64 {
    let found = snapshot.iter().find(|(key, _, _, _)| {
        key.key().name() == name
            && key
                .key()
                .labels()
                .any(|l| l.key() == label.0 && l.value() == label.1)
    });
    match found {
        Some((key, _, _, DebugValue::Counter(v))) if key.kind() == MetricKind::Counter => *v as f64,
        Some((_, _, _, DebugValue::Gauge(v))) => v.into_inner(),
        other => panic!("{name} {label:?}: {other:?}"),
    }
}

#[tokio::test]
async fn an_observer_reports_cache_rpc_and_replica_counters() {
    let registry = Registry::new();
    let service = Counting {
        handle: ServiceHandle::with_registry(&registry),
        base: Arc::default(),
    };
    let server = RemoteServer::new().expose_service(MeterServer::new(service.clone()));
    let endpoint = Endpoint::builder().service(server.service()).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    {
        let endpoint = endpoint.clone();
        tokio::spawn(async move { endpoint.serve_tcp(listener).await });
    }
    // Without liveness pings, whose lease renewals are calls too: the call counts below
    // are the test's alone.
    let client = RemoteClient::builder()
        .liveness(None)
        .connect_tcp(addr)
        .await
        .unwrap();
    let meter = MeterClient::new(client.clone());
    for _ in 0..3 {
        for id in 1..=2 {
            assert_eq!(meter.reading(id).await, Ok(id));
        }
    }
    service.invalidate_reading(1);
    assert_eq!(service.reading(1).await, Ok(1));

    let observer = Observer::new()
        .registry("service", &registry)
        .endpoint("rpc", &endpoint)
        .remote_server("meter", &server)
        .remote_client("meter", &client);
    let recorder = DebuggingRecorder::new();
    metrics::with_local_recorder(&recorder, || observer.record());
    let recorded = recorder.snapshotter().snapshot().into_vec();

    // Two misses for the clients, one recompute after the invalidation, and at least the
    // server-side hit of that last call.
    assert_eq!(
        value(
            &recorded,
            "coherent_cache_misses_total",
            ("registry", "service")
        ),
        3.0
    );
    assert_eq!(
        value(
            &recorded,
            "coherent_cache_invalidations_total",
            ("registry", "service")
        ),
        1.0
    );
    assert_eq!(
        value(&recorded, "coherent_cache_entries", ("registry", "service")),
        2.0
    );
    assert_eq!(
        value(
            &recorded,
            "coherent_rpc_connections_open",
            ("endpoint", "rpc")
        ),
        1.0
    );
    assert_eq!(
        value(
            &recorded,
            "coherent_rpc_connections_total",
            ("endpoint", "rpc")
        ),
        1.0
    );
    // The client's replicas were fetched once each; the rest were hits on the client.
    assert_eq!(
        value(
            &recorded,
            "coherent_rpc_calls_in_total",
            ("endpoint", "rpc")
        ),
        2.0
    );
    assert!(
        value(
            &recorded,
            "coherent_rpc_bytes_in_total",
            ("endpoint", "rpc")
        ) > 0.0
    );
    assert_eq!(
        value(
            &recorded,
            "coherent_remote_connections",
            ("server", "meter")
        ),
        1.0
    );
    assert_eq!(
        value(
            &recorded,
            "coherent_remote_client_connections_total",
            ("client", "meter")
        ),
        1.0
    );
    assert_eq!(
        value(
            &recorded,
            "coherent_remote_client_leases_lost_total",
            ("client", "meter")
        ),
        0.0
    );
}

/// A command that writes nothing and invalidates nothing: enough to count one.
#[cfg(feature = "ops")]
#[derive(serde::Serialize, serde::Deserialize)]
struct Nothing;

#[cfg(feature = "ops")]
impl coherent::ops::Command for Nothing {
    const NAME: &'static str = "observe.nothing";
    type Output = ();
}

#[cfg(feature = "ops")]
#[derive(Clone)]
struct NothingHandler;

#[cfg(feature = "ops")]
impl coherent::ops::Handler<Nothing> for NothingHandler {
    async fn execute(
        &self,
        _: &Nothing,
        _: &mut coherent::ops::Tx<'_>,
    ) -> Result<(), coherent::ops::CommandError> {
        Ok(())
    }

    fn invalidate(&self, _: &Nothing, _: &()) {}
}

#[cfg(feature = "ops")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_reports_an_ops_host() {
    let dir = tempfile::tempdir().unwrap();
    let db = coherent::ops::Database::sqlite(dir.path().join("ops.db")).unwrap();
    let host = coherent::ops::Host::builder(db)
        .registry(&Registry::new())
        .command::<Nothing>(NothingHandler)
        .start()
        .await
        .unwrap();
    host.run(Nothing).await.unwrap();
    host.run(Nothing).await.unwrap();

    let observer = Observer::new().host("a", &host);
    let recorder = DebuggingRecorder::new();
    metrics::with_local_recorder(&recorder, || observer.record());
    let recorded = recorder.snapshotter().snapshot().into_vec();
    assert_eq!(
        value(&recorded, "coherent_ops_commands_total", ("host", "a")),
        2.0
    );
    assert_eq!(
        value(
            &recorded,
            "coherent_ops_command_errors_total",
            ("host", "a")
        ),
        0.0
    );
    assert_eq!(
        value(&recorded, "coherent_ops_fenced", ("host", "a")),
        if host.is_fenced() { 1.0 } else { 0.0 }
    );
    assert!(value(&recorded, "coherent_ops_horizon", ("host", "a")) >= 0.0);
    host.stop().await;
}
