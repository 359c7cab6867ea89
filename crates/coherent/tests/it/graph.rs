//! Dependency chains, diamonds and cross-service dependencies: which bodies re-run after a change.

use std::sync::Arc;

use coherent::{compute_service, ComputeService, ConsistencyState, Registry, ServiceHandle};

use crate::support::{s, Log, Store};

#[tokio::test]
async fn a_second_call_is_answered_from_the_cache_without_running_the_body() {
    let log = Log::default();
    let store = Store::new(&Registry::new(), &log);
    store.set("a", 1);
    assert_eq!(store.get(s("a")).await, 1);
    assert_eq!(store.get(s("a")).await, 1);
    assert_eq!(log.take(), ["get(a)"]);
}

#[tokio::test]
async fn arguments_are_compared_by_value() {
    let log = Log::default();
    let store = Store::new(&Registry::new(), &log);
    store.get(s("a")).await;
    store.get(s("b")).await;
    store.get("a".to_string()).await;
    assert_eq!(log.take(), ["get(a)", "get(b)"]);
}

#[tokio::test]
async fn invalidating_a_leaf_recomputes_the_whole_chain_and_nothing_else() {
    let log = Log::default();
    let store = Store::new(&Registry::new(), &log);
    store.set("a", 1);
    store.set("b", 2);
    store.set("c", 3);
    assert_eq!(store.describe(s("a"), s("b")).await, "a+b=3");
    assert_eq!(store.sum(s("b"), s("c")).await, 5);
    log.take();

    store.set("a", 10);
    assert_eq!(store.describe(s("a"), s("b")).await, "a+b=12");
    assert_eq!(store.sum(s("b"), s("c")).await, 5);
    assert_eq!(log.take_sorted(), ["describe(a,b)", "get(a)", "sum(a,b)"]);
}

#[tokio::test]
async fn a_diamond_recomputes_its_top_once() {
    let log = Log::default();
    let store = Store::new(&Registry::new(), &log);
    store.set("a", 4);
    // sum(a, a) reads get(a) twice: both edges lead to the same computed.
    assert_eq!(store.sum(s("a"), s("a")).await, 8);
    let top = store.describe_computed(s("a"), s("a")).await;
    log.take();

    store.set("a", 5);
    assert_eq!(top.state(), ConsistencyState::Invalidated);
    assert_eq!(store.describe(s("a"), s("a")).await, "a+a=10");
    assert_eq!(log.take_sorted(), ["describe(a,a)", "get(a)", "sum(a,a)"]);
}

#[tokio::test]
async fn invalidation_cascades_synchronously_before_the_write_returns() {
    let log = Log::default();
    let store = Store::new(&Registry::new(), &log);
    let top = store.describe_computed(s("x"), s("y")).await;
    let middle = store.sum_computed(s("x"), s("y")).await;
    assert!(top.is_consistent() && middle.is_consistent());
    store.set("y", 1);
    assert!(!middle.is_consistent());
    assert!(!top.is_consistent());
}

#[tokio::test]
async fn each_computed_is_invalidated_exactly_once() {
    let registry = Registry::new();
    let log = Log::default();
    let store = Store::new(&registry, &log);
    store.sum(s("a"), s("a")).await;
    let before = registry.metrics();
    store.set("a", 1);
    store.set("a", 2); // get(a) is already invalidated and was not recomputed: a no-op
    let after = registry.metrics().since(&before);
    assert_eq!(after.invalidations, 2, "get(a) and sum(a,a), once each");
}

#[tokio::test]
async fn a_recomputed_dependant_is_not_invalidated_by_its_old_inputs() {
    let log = Log::default();
    let store = Store::new(&Registry::new(), &log);
    store.set("a", 1);
    let old_get = store.get_computed(s("a")).await;
    store.sum(s("a"), s("b")).await;
    store.set("b", 1);
    let fresh = store.sum_computed(s("a"), s("b")).await;
    assert!(fresh.is_consistent());
    // The old get(a) is still the current one; invalidating it reaches the fresh sum only.
    assert!(old_get.invalidate());
    assert!(!fresh.is_consistent());
}

/// A second service whose computed reads the first one's.
#[derive(Clone, ComputeService)]
struct Report {
    handle: ServiceHandle,
    store: Store,
    log: Log,
}

#[compute_service]
impl Report {
    #[compute]
    async fn line(&self, key: String) -> String {
        self.log.push(format!("line({key})"));
        format!("{key}: {}", self.store.get(key.clone()).await)
    }
}

#[tokio::test]
async fn dependencies_are_captured_across_services() {
    let registry = Registry::new();
    let log = Log::default();
    let store = Store::new(&registry, &log);
    let report = Report {
        handle: ServiceHandle::with_registry(&registry),
        store: store.clone(),
        log: log.clone(),
    };
    store.set("k", 7);
    assert_eq!(report.line(s("k")).await, "k: 7");
    log.take();
    store.set("k", 8);
    assert_eq!(report.line(s("k")).await, "k: 8");
    assert_eq!(log.take_sorted(), ["get(k)", "line(k)"]);
}

#[tokio::test]
async fn two_instances_of_one_service_cache_separately() {
    let registry = Registry::new();
    let log = Log::default();
    let first = Store::new(&registry, &log);
    let second = Store::new(&registry, &log);
    first.set("a", 1);
    second.set("a", 2);
    assert_eq!(first.get(s("a")).await, 1);
    assert_eq!(second.get(s("a")).await, 2);
    assert_eq!(log.take(), ["get(a)", "get(a)"]);
}

#[tokio::test]
async fn a_clone_of_a_service_shares_its_cache() {
    let log = Log::default();
    let store = Store::new(&Registry::new(), &log);
    let clone = store.clone();
    store.get(s("a")).await;
    clone.get(s("a")).await;
    assert_eq!(log.take(), ["get(a)"]);
}

#[tokio::test]
async fn update_returns_the_fresh_computed_after_an_invalidation() {
    let log = Log::default();
    let store = Store::new(&Registry::new(), &log);
    store.set("a", 1);
    let first = store.get_computed(s("a")).await;
    assert_eq!(*first.value(), 1);
    assert_eq!(first.update().await.version(), first.version());
    store.set("a", 2);
    let second = first.update().await;
    assert_eq!(*second.value(), 2);
    assert!(second.is_consistent());
    assert_ne!(second.version(), first.version());
}

#[tokio::test]
async fn when_invalidated_completes_on_invalidation() {
    let log = Log::default();
    let store = Store::new(&Registry::new(), &log);
    let computed = store.sum_computed(s("a"), s("b")).await;
    let waiter = tokio::spawn({
        let computed = computed.clone();
        async move { computed.when_invalidated().await }
    });
    tokio::task::yield_now().await;
    assert!(!waiter.is_finished());
    store.set("b", 3);
    waiter.await.unwrap();
}

#[tokio::test]
async fn invalidation_callbacks_run_once() {
    let log = Log::default();
    let store = Store::new(&Registry::new(), &log);
    let computed = store.get_computed(s("a")).await;
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = calls.clone();
    computed.on_invalidated(move || {
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    });
    store.set("a", 1);
    store.set("a", 2);
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn untracked_reads_are_not_dependencies() {
    #[derive(Clone, ComputeService)]
    struct Peek {
        handle: ServiceHandle,
        store: Store,
    }
    #[compute_service]
    impl Peek {
        #[compute]
        async fn peek(&self, key: String) -> i64 {
            coherent::untracked(self.store.get(key)).await
        }
    }
    let registry = Registry::new();
    let store = Store::new(&registry, &Log::default());
    let peek = Peek {
        handle: ServiceHandle::with_registry(&registry),
        store: store.clone(),
    };
    store.set("a", 1);
    let computed = peek.peek_computed(s("a")).await;
    assert_eq!(computed.dependency_count(), 0);
    store.set("a", 2);
    assert!(computed.is_consistent());
    assert_eq!(peek.peek(s("a")).await, 1);
}

#[test]
fn compute_methods_run_on_the_current_thread_runtime() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let log = Log::default();
    let store = Store::new(&Registry::new(), &log);
    runtime.block_on(async {
        store.set("a", 2);
        assert_eq!(store.sum(s("a"), s("a")).await, 4);
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compute_futures_are_send_and_run_on_spawned_tasks() {
    let log = Log::default();
    let store = Store::new(&Registry::new(), &log);
    store.set("a", 2);
    let task = tokio::spawn({
        let store = store.clone();
        async move { store.describe(s("a"), s("a")).await }
    });
    assert_eq!(task.await.unwrap(), "a+a=4");
}

#[tokio::test]
async fn invalidate_all_invalidates_every_entry_of_the_registry_and_nothing_elsewhere() {
    let log = Log::default();
    let registry = Registry::new();
    let other = Registry::new();
    let store = Store::new(&registry, &log);
    let elsewhere = Store::new(&other, &log);
    store.set("a", 1);
    store.set("b", 2);
    elsewhere.set("a", 7);
    assert_eq!(store.sum(s("a"), s("b")).await, 3);
    let held = store.get_computed(s("a")).await;
    assert_eq!(elsewhere.get(s("a")).await, 7);
    log.take();

    // The store's values change without invalidation: only a full flush can catch up.
    store.data.lock().insert(s("a"), 10);
    assert!(registry.invalidate_all() > 0);
    assert_eq!(registry.invalidate_all(), 0, "nothing left to invalidate");
    assert_eq!(held.state(), ConsistencyState::Invalidated);
    assert_eq!(store.sum(s("a"), s("b")).await, 12);
    assert_eq!(elsewhere.get(s("a")).await, 7);
    assert_eq!(log.take_sorted(), ["get(a)", "get(b)", "sum(a,b)"]);
    assert_eq!(Registry::new().invalidate_all(), 0);
}
