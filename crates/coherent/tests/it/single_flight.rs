//! Concurrent misses for one key run the body once; cancelled or panicking owners never leave
//! waiters hanging.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use coherent::{compute_service, ComputeService, Registry, ServiceHandle};
use tokio::sync::Notify;

#[derive(Clone, ComputeService)]
struct Slow {
    handle: ServiceHandle,
    runs: Arc<AtomicUsize>,
    gate: Arc<Notify>,
    panic_first: Arc<AtomicUsize>,
}

#[compute_service]
impl Slow {
    #[compute]
    async fn value(&self, id: u64) -> u64 {
        let run = self.runs.fetch_add(1, Ordering::SeqCst);
        if run == 0 && self.panic_first.load(Ordering::SeqCst) == 1 {
            panic!("the first run fails");
        }
        self.gate.notified().await;
        id * 2
    }
}

fn slow() -> Slow {
    Slow {
        handle: ServiceHandle::with_registry(&Registry::new()),
        runs: Arc::default(),
        gate: Arc::new(Notify::new()),
        panic_first: Arc::default(),
    }
}

async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_misses_for_one_key_run_the_body_once() {
    let service = slow();
    let calls: Vec<_> = (0..32)
        .map(|_| {
            let service = service.clone();
            tokio::spawn(async move { service.value(21).await })
        })
        .collect();
    while service.runs.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    settle().await;
    service.gate.notify_waiters();
    for call in calls {
        assert_eq!(call.await.unwrap(), 42);
    }
    assert_eq!(service.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_cancelled_owner_hands_the_computation_to_a_waiter() {
    let service = slow();
    let owner = tokio::spawn({
        let service = service.clone();
        async move { service.value(1).await }
    });
    settle().await;
    let waiter = tokio::spawn({
        let service = service.clone();
        async move { service.value(1).await }
    });
    settle().await;
    owner.abort();
    assert!(owner.await.unwrap_err().is_cancelled());
    settle().await;
    service.gate.notify_waiters();
    assert_eq!(waiter.await.unwrap(), 2);
    assert_eq!(service.runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_panicking_body_lets_waiters_retry() {
    let service = slow();
    service.panic_first.store(1, Ordering::SeqCst);
    let owner = tokio::spawn({
        let service = service.clone();
        async move { service.value(3).await }
    });
    let waiter = tokio::spawn({
        let service = service.clone();
        async move { service.value(3).await }
    });
    assert!(owner.await.unwrap_err().is_panic());
    settle().await;
    service.gate.notify_waiters();
    assert_eq!(waiter.await.unwrap(), 6);
}
