//! Under churn of distinct keys the registry stays near its capacity.

use coherent::{compute_service, ComputeService, Registry, ServiceHandle};

#[derive(Clone, ComputeService)]
struct Squares {
    handle: ServiceHandle,
}

#[compute_service]
impl Squares {
    #[compute(keep_alive = "0ms")]
    async fn square(&self, n: u64) -> u64 {
        n.wrapping_mul(n)
    }
}

#[tokio::test]
async fn a_million_distinct_keys_never_grow_the_registry_past_its_high_water_mark() {
    const CAPACITY: usize = 1_000;
    // Pruning starts at capacity plus a quarter of it.
    const HIGH_WATER: usize = CAPACITY + CAPACITY / 4 + 1;
    let registry = Registry::builder().capacity(CAPACITY).build();
    let squares = Squares {
        handle: ServiceHandle::with_registry(&registry),
    };
    let mut peak = 0;
    for n in 0..1_000_000u64 {
        assert_eq!(squares.square(n).await, n.wrapping_mul(n));
        if n % 1_000 == 0 {
            peak = peak.max(registry.len());
        }
    }
    peak = peak.max(registry.len());
    assert!(peak <= HIGH_WATER, "peak {peak} entries");
    let metrics = registry.metrics();
    assert_eq!(metrics.misses, 1_000_000);
    assert!(metrics.evictions >= 1_000_000 - HIGH_WATER as u64);
}
