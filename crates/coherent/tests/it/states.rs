//! `MutableState` as a dependency, and `ComputedState` keeping itself up to date.

use std::time::Duration;

use coherent::{
    compute_service, ComputeService, ComputedState, MutableState, Registry, ServiceHandle,
};

use crate::support::Log;

#[derive(Clone, ComputeService)]
struct Greeter {
    handle: ServiceHandle,
    name: MutableState<String>,
    log: Log,
}

#[compute_service]
impl Greeter {
    #[compute]
    async fn greeting(&self) -> String {
        self.log.push("greeting");
        format!("Hello, {}!", self.name.get())
    }
}

fn greeter(log: &Log) -> Greeter {
    let registry = Registry::new();
    Greeter {
        handle: ServiceHandle::with_registry(&registry),
        name: MutableState::with_registry(&registry, "name", "Ann".to_owned()),
        log: log.clone(),
    }
}

#[tokio::test]
async fn setting_a_mutable_state_invalidates_what_read_it() {
    let log = Log::default();
    let greeter = greeter(&log);
    assert_eq!(greeter.greeting().await, "Hello, Ann!");
    assert_eq!(greeter.greeting().await, "Hello, Ann!");
    greeter.name.set("Bob".to_owned());
    assert_eq!(greeter.greeting().await, "Hello, Bob!");
    assert_eq!(log.take(), ["greeting", "greeting"]);
}

#[tokio::test]
async fn mutable_state_update_applies_a_function_of_the_previous_value() {
    let counter = MutableState::new(1);
    let before = counter.computed();
    counter.update(|n| n + 41);
    assert_eq!(counter.get(), 42);
    assert!(!before.is_consistent());
    assert_eq!(*before.update().await.value(), 42);
}

#[tokio::test]
async fn a_computed_state_recomputes_after_its_inputs_change() {
    let log = Log::default();
    let greeter = greeter(&log);
    let state = {
        let greeter = greeter.clone();
        ComputedState::new(move || {
            let greeter = greeter.clone();
            async move { greeter.greeting().await.to_uppercase() }
        })
        .await
    };
    assert_eq!(state.latest(), "HELLO, ANN!");
    let mut changes = state.watch();
    greeter.name.set("Bob".to_owned());
    changes.changed().await.unwrap();
    assert_eq!(*changes.borrow_and_update(), "HELLO, BOB!");
    assert_eq!(state.latest(), "HELLO, BOB!");
    assert!(state.computed().is_consistent());
}

#[tokio::test(start_paused = true)]
async fn a_computed_state_waits_its_update_delay_and_coalesces_changes() {
    let log = Log::default();
    let greeter = greeter(&log);
    let state = {
        let greeter = greeter.clone();
        ComputedState::builder()
            .update_delay(Duration::from_secs(1))
            .build(move || {
                let greeter = greeter.clone();
                async move { greeter.greeting().await }
            })
            .await
    };
    log.take();
    greeter.name.set("Bob".to_owned());
    tokio::time::sleep(Duration::from_millis(500)).await;
    greeter.name.set("Cy".to_owned());
    assert_eq!(state.latest(), "Hello, Ann!", "still within the delay");
    let mut changes = state.watch();
    changes.changed().await.unwrap();
    assert_eq!(state.latest(), "Hello, Cy!");
    assert_eq!(log.take(), ["greeting"], "two changes, one recomputation");
}

#[tokio::test]
async fn update_on_a_computed_state_recomputes_without_waiting() {
    let state_input = MutableState::new(1);
    let state = {
        let input = state_input.clone();
        ComputedState::builder()
            .update_delay(Duration::from_secs(3600))
            .build(move || {
                let input = input.clone();
                async move { input.get() * 100 }
            })
            .await
    };
    state_input.set(2);
    assert_eq!(*state.update().await.value(), 200);
    assert_eq!(state.latest(), 200);
}

#[tokio::test]
async fn a_compute_method_can_depend_on_a_computed_state() {
    #[derive(Clone, ComputeService)]
    struct Reader {
        handle: ServiceHandle,
        state: ComputedState<i32>,
    }
    #[compute_service]
    impl Reader {
        #[compute]
        async fn doubled(&self) -> i32 {
            self.state.get() * 2
        }
    }
    let input = MutableState::new(1);
    let state = {
        let input = input.clone();
        ComputedState::new(move || {
            let input = input.clone();
            async move { input.get() }
        })
        .await
    };
    let reader = Reader {
        handle: ServiceHandle::new(),
        state: state.clone(),
    };
    let first = reader.doubled_computed().await;
    assert_eq!(*first.value(), 2);
    let mut changes = state.watch();
    input.set(5);
    assert!(
        !first.is_consistent(),
        "the state's invalidation reached the method"
    );
    changes.changed().await.unwrap();
    assert_eq!(reader.doubled().await, 10);
}
