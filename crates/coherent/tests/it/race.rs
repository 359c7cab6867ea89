//! The race rule, provoked deterministically: a dependency is invalidated while the dependant's
//! body is suspended between reading it and returning.

use std::sync::Arc;

use coherent::{compute_service, ComputeService, ConsistencyState, Registry, ServiceHandle};
use tokio::sync::{oneshot, Mutex};

use crate::support::{s, Log, Store};

/// A service whose `slow` method reads `get(a)`, then waits for the test to let it finish.
#[derive(Clone, ComputeService)]
struct Gated {
    handle: ServiceHandle,
    store: Store,
    entered: Arc<Mutex<Option<oneshot::Sender<()>>>>,
    release: Arc<Mutex<Option<oneshot::Receiver<()>>>>,
    log: Log,
}

#[compute_service]
impl Gated {
    #[compute]
    async fn slow(&self) -> i64 {
        self.log.push("slow");
        let a = self.store.get(s("a")).await;
        if let Some(entered) = self.entered.lock().await.take() {
            let _ = entered.send(());
        }
        let release = self.release.lock().await.take();
        if let Some(release) = release {
            let _ = release.await;
        }
        a
    }
}

fn gated(registry: &Registry, log: &Log) -> (Gated, oneshot::Receiver<()>, oneshot::Sender<()>) {
    let (entered_tx, entered_rx) = oneshot::channel();
    let (release_tx, release_rx) = oneshot::channel();
    let store = Store::new(registry, log);
    store.set("a", 1);
    let service = Gated {
        handle: ServiceHandle::with_registry(registry),
        store,
        entered: Arc::new(Mutex::new(Some(entered_tx))),
        release: Arc::new(Mutex::new(Some(release_rx))),
        log: log.clone(),
    };
    (service, entered_rx, release_tx)
}

#[tokio::test]
async fn a_value_computed_while_its_input_was_invalidated_is_returned_but_stored_invalidated() {
    let log = Log::default();
    let (service, entered, release) = gated(&Registry::new(), &log);
    let call = tokio::spawn({
        let service = service.clone();
        async move { service.slow_computed().await }
    });
    entered.await.unwrap();
    service.store.set("a", 2); // invalidates get(a) while slow() awaits
    release.send(()).unwrap();

    let raced = call.await.unwrap();
    assert_eq!(
        *raced.value(),
        1,
        "the caller that started before the write gets its value"
    );
    assert_eq!(raced.state(), ConsistencyState::Invalidated);

    assert_eq!(service.slow().await, 2, "the next call recomputes");
    assert_eq!(log.take(), ["slow", "get(a)", "slow", "get(a)"]);
}

#[tokio::test]
async fn a_caller_that_joins_a_computation_after_the_write_never_gets_the_old_value() {
    let log = Log::default();
    let (service, entered, release) = gated(&Registry::new(), &log);
    let first = tokio::spawn({
        let service = service.clone();
        async move { service.slow().await }
    });
    entered.await.unwrap();
    service.store.set("a", 2);
    // Starts after the write returned and finds the computation still running.
    let second = tokio::spawn({
        let service = service.clone();
        async move { service.slow().await }
    });
    tokio::task::yield_now().await;
    release.send(()).unwrap();

    assert_eq!(first.await.unwrap(), 1);
    assert_eq!(second.await.unwrap(), 2);
}

#[tokio::test]
async fn a_dependant_that_captures_an_already_invalidated_input_is_born_invalidated() {
    let log = Log::default();
    let (service, entered, release) = gated(&Registry::new(), &log);
    #[derive(Clone, ComputeService)]
    struct Outer {
        handle: ServiceHandle,
        inner: Gated,
    }
    #[compute_service]
    impl Outer {
        #[compute]
        async fn wrap(&self) -> i64 {
            self.inner.slow().await * 10
        }
    }
    let outer = Outer {
        handle: ServiceHandle::new(),
        inner: service.clone(),
    };
    let call = tokio::spawn({
        let outer = outer.clone();
        async move { outer.wrap_computed().await }
    });
    entered.await.unwrap();
    service.store.set("a", 5);
    release.send(()).unwrap();
    let wrapped = call.await.unwrap();
    assert_eq!(*wrapped.value(), 10);
    assert!(!wrapped.is_consistent());
    assert_eq!(outer.wrap().await, 50);
}
