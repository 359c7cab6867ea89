//! Several instances of one service type keep separate caches, whichever of them made its table
//! first, and however many came and went before (a method remembers one "home" handle to reach
//! its table faster; every other handle must still find its own).

use coherent::{compute_service, ComputeService, Registry, ServiceHandle};

#[derive(Clone, ComputeService)]
struct Tagged {
    handle: ServiceHandle,
    tag: u64,
}

impl Tagged {
    fn new(tag: u64) -> Self {
        Self {
            handle: ServiceHandle::with_registry(&Registry::new()),
            tag,
        }
    }
}

#[compute_service]
impl Tagged {
    #[compute]
    async fn value(&self, n: u64) -> u64 {
        self.tag * 1_000 + n
    }
}

#[tokio::test]
async fn each_instance_answers_from_its_own_cache_while_instances_come_and_go() {
    let first = Tagged::new(1);
    let second = Tagged::new(2);
    for n in 0..10 {
        assert_eq!(first.value(n).await, 1_000 + n);
        assert_eq!(second.value(n).await, 2_000 + n);
    }
    drop(first);
    // More instances than the home may move: each made after the one before was dropped.
    for tag in 3..40 {
        let next = Tagged::new(tag);
        for n in 0..10 {
            assert_eq!(next.value(n).await, tag * 1_000 + n);
            assert_eq!(next.value(n).await, tag * 1_000 + n, "a hit");
            assert_eq!(second.value(n).await, 2_000 + n);
        }
        assert!(next.invalidate_value(3));
        assert_eq!(next.value(3).await, tag * 1_000 + 3);
    }
    assert_eq!(second.value(7).await, 2_007);
}
