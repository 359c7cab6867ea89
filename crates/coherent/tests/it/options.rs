//! Per-method options: error caching by kind, time-to-live, keep-alive and eviction.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use coherent::{compute_service, ComputeService, Registry, ServiceHandle, TransientError};
use parking_lot::Mutex;

use crate::support::Log;

#[derive(Clone, Debug, PartialEq)]
enum FetchError {
    Timeout,
    NotFound,
}

impl TransientError for FetchError {
    fn is_transient(&self) -> bool {
        matches!(self, FetchError::Timeout)
    }
}

#[derive(Clone, ComputeService)]
struct Flaky {
    handle: ServiceHandle,
    outcomes: Arc<Mutex<VecDeque<Result<i64, FetchError>>>>,
    log: Log,
}

#[compute_service]
impl Flaky {
    #[compute(error_invalidate = "10s", transient_error_invalidate = "1s")]
    async fn fetch(&self, id: u64) -> Result<i64, FetchError> {
        self.log.push(format!("fetch({id})"));
        self.outcomes.lock().pop_front().unwrap_or(Ok(0))
    }

    #[compute(error_invalidate = "2s")]
    async fn parse(&self, text: String) -> Result<i64, String> {
        self.log.push(format!("parse({text})"));
        text.parse::<i64>().map_err(|e| e.to_string())
    }

    #[compute(auto_invalidate = "5s")]
    async fn ticket(&self) -> u64 {
        self.log.push("ticket");
        7
    }
}

fn flaky(outcomes: Vec<Result<i64, FetchError>>, log: &Log) -> Flaky {
    Flaky {
        handle: ServiceHandle::with_registry(&Registry::new()),
        outcomes: Arc::new(Mutex::new(outcomes.into())),
        log: log.clone(),
    }
}

async fn advance(by: Duration) {
    tokio::time::sleep(by).await;
    // Let the timer tasks that became due run.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn errors_are_cached_for_the_error_delay_then_recomputed() {
    let log = Log::default();
    let service = flaky(vec![Err(FetchError::NotFound), Ok(5)], &log);
    assert_eq!(service.fetch(1).await, Err(FetchError::NotFound));
    assert_eq!(service.fetch(1).await, Err(FetchError::NotFound));
    advance(Duration::from_secs(5)).await;
    assert_eq!(service.fetch(1).await, Err(FetchError::NotFound));
    assert_eq!(log.take(), ["fetch(1)"]);
    advance(Duration::from_secs(6)).await;
    assert_eq!(service.fetch(1).await, Ok(5));
    assert_eq!(log.take(), ["fetch(1)"]);
}

#[tokio::test(start_paused = true)]
async fn transient_errors_are_retried_sooner() {
    let log = Log::default();
    let service = flaky(vec![Err(FetchError::Timeout), Ok(5)], &log);
    assert_eq!(service.fetch(1).await, Err(FetchError::Timeout));
    advance(Duration::from_millis(500)).await;
    assert_eq!(service.fetch(1).await, Err(FetchError::Timeout));
    advance(Duration::from_millis(600)).await;
    assert_eq!(service.fetch(1).await, Ok(5));
    assert_eq!(log.take(), ["fetch(1)", "fetch(1)"]);
}

#[tokio::test(start_paused = true)]
async fn errors_of_types_without_a_transient_kind_use_the_error_delay() {
    let log = Log::default();
    let service = flaky(vec![], &log);
    assert!(service.parse("x".into()).await.is_err());
    advance(Duration::from_millis(1500)).await;
    assert!(service.parse("x".into()).await.is_err());
    advance(Duration::from_millis(600)).await;
    assert!(service.parse("x".into()).await.is_err());
    assert_eq!(log.take(), ["parse(x)", "parse(x)"]);
}

#[tokio::test(start_paused = true)]
async fn values_are_not_expired_without_a_time_to_live() {
    let log = Log::default();
    let service = flaky(vec![Ok(1)], &log);
    assert_eq!(service.fetch(1).await, Ok(1));
    advance(Duration::from_secs(3600)).await;
    assert_eq!(service.fetch(1).await, Ok(1));
    assert_eq!(log.take(), ["fetch(1)"]);
}

#[tokio::test(start_paused = true)]
async fn auto_invalidate_expires_a_value_after_its_time_to_live() {
    let log = Log::default();
    let service = flaky(vec![], &log);
    let first = service.ticket_computed().await;
    advance(Duration::from_secs(4)).await;
    assert!(first.is_consistent());
    advance(Duration::from_secs(2)).await;
    assert!(!first.is_consistent());
    service.ticket().await;
    assert_eq!(log.take(), ["ticket", "ticket"]);
}

#[derive(Clone, ComputeService)]
struct Kept {
    handle: ServiceHandle,
}

#[compute_service]
impl Kept {
    #[compute(keep_alive = "1h")]
    async fn long(&self, id: u64) -> u64 {
        id
    }

    #[compute(keep_alive = "10ms")]
    async fn short(&self, id: u64) -> u64 {
        id
    }

    #[compute(keep_alive = "1h")]
    async fn reads_short(&self, id: u64) -> u64 {
        self.short(id + 1000).await
    }
}

#[tokio::test]
async fn pruning_evicts_only_unused_results_past_their_keep_alive_with_no_live_dependant() {
    let registry = Registry::new();
    let kept = Kept {
        handle: ServiceHandle::with_registry(&registry),
    };
    for id in 0..10 {
        kept.long(id).await;
        kept.short(id).await;
    }
    let held = kept.short_computed(100).await;
    kept.reads_short(1).await; // short(1001) lives as long as reads_short(1)
    assert_eq!(registry.len(), 23);

    std::thread::sleep(Duration::from_millis(100));
    let removed = registry.prune();

    assert_eq!(removed, 10, "the ten unused short() results");
    assert_eq!(registry.len(), 13);
    assert_eq!(registry.metrics().evictions, 10);
    assert!(held.is_consistent());
    let log_free = kept.short_computed(100).await;
    assert_eq!(
        log_free.version(),
        held.version(),
        "a held result is not evicted"
    );
}

#[tokio::test]
async fn pruning_removes_invalidated_entries() {
    let registry = Registry::new();
    let kept = Kept {
        handle: ServiceHandle::with_registry(&registry),
    };
    kept.long(1).await;
    kept.long(2).await;
    assert!(kept.invalidate_long(1));
    assert!(!kept.invalidate_long(3), "nothing cached for 3");
    assert_eq!(registry.prune(), 1);
    assert_eq!(registry.len(), 1);
}
