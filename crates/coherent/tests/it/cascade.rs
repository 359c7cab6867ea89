//! When an invalidating call returns, its cascade is complete, whoever else invalidates the
//! same computeds at the same time: a call that loses the race to another invalidation, a write
//! that overtakes an earlier one, an invalidation of a key recomputed while the previous
//! version's cascade still runs. Each race is held open on purpose: the first cascade is stopped
//! inside an invalidation callback (callbacks run on the invalidating thread, inside the
//! cascade) while the second call runs and returns.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use coherent::{
    compute_service, ComputeService, ConsistencyState, MutableState, Registry, ServiceHandle,
};

use crate::support::{s, Log, Store};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// A callback that says it has started, then holds the cascade it runs in until released.
fn held(entered: mpsc::Sender<()>, release: mpsc::Receiver<()>) -> impl FnOnce() + Send {
    move || {
        entered.send(()).unwrap();
        release.recv().unwrap();
    }
}

/// A store with `sum(a, b)` computed over `get(a)`, and the computeds of both.
fn store_with_a_sum(
    rt: &tokio::runtime::Runtime,
) -> (Store, coherent::Computed<i64>, coherent::Computed<i64>, Log) {
    let log = Log::default();
    let store = Store::new(&Registry::new(), &log);
    store.set("a", 1);
    let (get, sum) = rt.block_on(async {
        let sum = store.sum_computed(s("a"), s("b")).await;
        (store.get_computed(s("a")).await, sum)
    });
    assert_eq!(*sum.value(), 1);
    (store, get, sum, log)
}

/// `store.set("a", 2)` on a thread of its own, held inside its cascade (by a callback on
/// `get`, the computed of `get(a)`) until the returned sender is told to let it go.
fn a_held_write_of_a(
    store: &Store,
    get: coherent::Computed<i64>,
) -> (thread::JoinHandle<()>, mpsc::Sender<()>) {
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel();
    get.on_invalidated(held(entered_tx, release_rx));
    drop(get);
    let first = thread::spawn({
        let store = store.clone();
        move || store.set("a", 2)
    });
    entered.recv().unwrap(); // the first cascade has begun and is held
    (first, release)
}

#[test]
fn a_call_that_loses_the_race_to_invalidate_returns_after_the_cascade() {
    let rt = runtime();
    let (store, get, sum, _) = store_with_a_sum(&rt);
    let (first, release) = a_held_write_of_a(&store, get);
    assert!(
        !store.invalidate_get(s("a")),
        "the first call invalidated get(a)"
    );
    assert_eq!(
        sum.state(),
        ConsistencyState::Invalidated,
        "returned while sum(a, b), computed from the old a, was still consistent"
    );
    release.send(()).unwrap();
    first.join().unwrap();
    assert_eq!(rt.block_on(store.sum(s("a"), s("b"))), 2);
}

#[derive(Clone, ComputeService)]
struct Doubler {
    handle: ServiceHandle,
    input: MutableState<i64>,
}

#[compute_service]
impl Doubler {
    #[compute]
    async fn doubled(&self) -> i64 {
        self.input.get() * 2
    }
}

#[test]
fn a_set_that_overtakes_another_returns_after_the_earlier_cascade() {
    let rt = runtime();
    let registry = Registry::new();
    let doubler = Doubler {
        handle: ServiceHandle::with_registry(&registry),
        input: MutableState::with_registry(&registry, "input", 1),
    };
    let doubled = rt.block_on(doubler.doubled_computed());
    assert_eq!(*doubled.value(), 2);
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel();
    doubler
        .input
        .computed()
        .on_invalidated(held(entered_tx, release_rx));

    let first = thread::spawn({
        let input = doubler.input.clone();
        move || input.set(2)
    });
    entered.recv().unwrap();
    doubler.input.set(3);
    assert_eq!(
        doubled.state(),
        ConsistencyState::Invalidated,
        "set(3) returned while doubled(), computed from 1, was still consistent"
    );
    release.send(()).unwrap();
    first.join().unwrap();
    assert_eq!(rt.block_on(doubler.doubled()), 6);
}

#[test]
fn an_invalidation_of_a_key_recomputed_meanwhile_returns_after_the_earlier_cascade() {
    let rt = runtime();
    let (store, get, sum, log) = store_with_a_sum(&rt);
    let (first, release) = a_held_write_of_a(&store, get);
    log.take();
    // get(a) is invalidated, so this computes a new version of it; the old one's cascade
    // is still held.
    assert_eq!(rt.block_on(store.get(s("a"))), 2);
    assert_eq!(log.take(), ["get(a)"]);
    store.data.lock().insert(s("a"), 3);
    assert!(store.invalidate_get(s("a")));
    assert_eq!(
        sum.state(),
        ConsistencyState::Invalidated,
        "returned while sum(a, b), computed from the first a, was still consistent"
    );
    release.send(()).unwrap();
    first.join().unwrap();
    assert_eq!(rt.block_on(store.sum(s("a"), s("b"))), 3);
}

#[test]
fn a_callback_that_invalidates_the_computed_whose_cascade_runs_it_completes() {
    let rt = runtime();
    let (store, _, sum, _) = store_with_a_sum(&rt);
    let describe = rt.block_on(store.describe_computed(s("a"), s("b")));
    // sum's callback runs inside the cascade of get(a), and invalidates get(a) again.
    let again = store.clone();
    sum.on_invalidated(move || {
        again.invalidate_get(s("a"));
    });
    let (done_tx, done) = mpsc::channel();
    thread::spawn({
        let store = store.clone();
        move || {
            store.set("a", 5);
            done_tx.send(()).unwrap();
        }
    });
    done.recv_timeout(Duration::from_secs(10))
        .expect("the cascade returned (no deadlock on its own computeds)");
    assert_eq!(describe.state(), ConsistencyState::Invalidated);
    assert_eq!(rt.block_on(store.describe(s("a"), s("b"))), "a+b=5");
}

#[test]
fn a_panicking_callback_does_not_stop_the_cascade() {
    let rt = runtime();
    let (store, get, sum, _) = store_with_a_sum(&rt);
    let describe = rt.block_on(store.describe_computed(s("a"), s("b")));
    get.on_invalidated(|| panic!("a callback failed"));
    let outcome = catch_unwind(AssertUnwindSafe(|| store.set("a", 4)));
    assert!(outcome.is_err(), "the callback's panic reaches the caller");
    assert_eq!(sum.state(), ConsistencyState::Invalidated);
    assert_eq!(describe.state(), ConsistencyState::Invalidated);
    assert_eq!(rt.block_on(store.describe(s("a"), s("b"))), "a+b=4");
}

#[derive(Clone, ComputeService)]
struct Expiring {
    handle: ServiceHandle,
}

#[compute_service]
impl Expiring {
    #[compute(auto_invalidate = "1h")]
    async fn ticket(&self, id: u64) -> u64 {
        id
    }
}

#[test]
fn a_time_to_live_whose_runtime_shut_down_invalidates_at_once() {
    let service = Expiring {
        handle: ServiceHandle::with_registry(&Registry::new()),
    };
    let rt = runtime();
    let ticket = rt.block_on(service.ticket_computed(1));
    assert!(ticket.is_consistent());
    drop(rt);
    assert_eq!(
        ticket.state(),
        ConsistencyState::Invalidated,
        "nothing will expire it any more: it must not stay consistent for good"
    );
}

#[test]
fn the_timer_of_a_time_to_live_ends_when_its_computed_is_invalidated_earlier() {
    let rt = runtime();
    let service = Expiring {
        handle: ServiceHandle::with_registry(&Registry::new()),
    };
    let alive = || rt.metrics().num_alive_tasks();
    let before = alive();
    let tickets: Vec<_> = (0..100)
        .map(|id| rt.block_on(service.ticket_computed(id)))
        .collect();
    assert_eq!(alive(), before + 100, "one timer per computed with a TTL");
    for id in 0..100 {
        assert!(service.invalidate_ticket(id));
    }
    rt.block_on(async {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    });
    assert_eq!(
        alive(),
        before,
        "the timers of invalidated computeds are gone"
    );
    drop(tickets);
}

#[test]
fn a_new_version_that_inherits_a_running_cascade_is_not_evicted_before_it_settles() {
    let rt = runtime();
    let log = Log::default();
    let registry = Registry::builder().capacity(1).build();
    let store = Store::new(&registry, &log);
    store.set("a", 1);
    let (get, sum) = rt.block_on(async {
        let sum = store.sum_computed(s("a"), s("b")).await;
        (store.get_computed(s("a")).await, sum)
    });
    let (first, release) = a_held_write_of_a(&store, get);
    // get(a) recomputed (its new version inherits the old one, whose cascade is held),
    // then pruned under capacity pressure: only the table holds the new version.
    assert_eq!(rt.block_on(store.get(s("a"))), 2);
    registry.prune();
    store.data.lock().insert(s("a"), 3);
    store.invalidate_get(s("a"));
    let state = sum.state();
    release.send(()).unwrap();
    first.join().unwrap();
    assert_eq!(
        state,
        ConsistencyState::Invalidated,
        "returned while sum(a, b), computed from the first a, was still consistent"
    );
}
