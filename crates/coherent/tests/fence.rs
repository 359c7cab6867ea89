//! A fenced registry (`Registry::fence`, a host of a cluster that may have missed writes)
//! answers a call only with a result whose computation began after the call did.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use coherent::{compute_service, ComputeService, Registry, ServiceHandle};

/// A method whose body reads "the database" first and then takes a while.
#[derive(Clone, ComputeService)]
struct Slow {
    handle: ServiceHandle,
    stored: Arc<AtomicI64>,
}

#[compute_service]
impl Slow {
    #[compute]
    async fn value(&self, id: u64) -> i64 {
        let _ = id;
        let v = self.stored.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(100)).await;
        v
    }
}

/// A call made while fenced does not join a computation that began before a write it must
/// see (no invalidation reaches a fenced host for a write whose writer did not wait for
/// it). Found by review: it answered 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_call_does_not_join_a_computation_begun_before_it() {
    let registry = Registry::new();
    let s = Slow {
        handle: ServiceHandle::with_registry(&registry),
        stored: Arc::new(AtomicI64::new(0)),
    };
    registry.fence();
    let first = tokio::spawn({
        let s = s.clone();
        async move { s.value(1).await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    // A write lands, and nothing invalidates this registry.
    s.stored.store(1, Ordering::SeqCst);
    let after = s.value(1).await;
    assert_eq!(first.await.unwrap(), 0, "the first call's own computation");
    assert_eq!(after, 1);
    // Two calls that begin together while fenced may share a computation (one began after
    // both): no call waits for ever, and each answers what the database held after it began.
    let (a, b) = tokio::join!(s.value(1), s.value(1));
    assert_eq!((a, b), (1, 1));
    registry.unfence();
    assert_eq!(s.value(1).await, 1);
}

/// Two holders of a lease on one registry (a cluster host's own, `set_lease`, and a replica
/// client's, `Registry::lease`): the cache answers only while both run, one renewing does
/// not lift the other's, and a dropped lease bounds nothing.
#[test]
fn a_registry_answers_only_while_every_holders_lease_runs() {
    let registry = Registry::new();
    let now = coherent::lease_clock();
    let hour = 3_600_000_000_000;
    assert_eq!(registry.lease_left(), None, "no lease, no fence");
    registry.set_lease(now + hour);
    let client = registry.lease();
    assert!(
        !registry.is_fenced(),
        "a lease not renewed yet bounds nothing"
    );
    client.renew(now.saturating_sub(1));
    assert!(registry.is_fenced(), "the client's lease ran out");
    assert_eq!(registry.lease_left(), Some(0));
    // The host renewing its own does not lift the client's.
    registry.set_lease(now + 2 * hour);
    assert!(registry.is_fenced());
    client.renew(now + hour);
    assert!(!registry.is_fenced());
    let left = registry.lease_left().unwrap();
    assert!(
        left <= hour && left > hour / 2,
        "the earliest lease: {left}"
    );
    // A lease never moves back.
    client.renew(now);
    assert!(!registry.is_fenced());
    // The host's lease runs out: fenced whatever the client's says.
    registry.clear_lease();
    registry.set_lease(now.saturating_sub(1));
    assert!(registry.is_fenced());
    registry.clear_lease();
    assert!(!registry.is_fenced());
    // Dropped: bounds nothing. A fence still counts.
    drop(client);
    assert_eq!(registry.lease_left(), None);
    registry.fence();
    assert_eq!(registry.lease_left(), Some(0));
    registry.unfence();
    let gone = registry.lease();
    gone.renew(now.saturating_sub(1));
    assert!(registry.is_fenced());
    gone.clear();
    assert!(!registry.is_fenced());
}
