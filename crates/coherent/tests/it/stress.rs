//! Many readers, one mutator writing through the service: after a write returns, no read that
//! starts later may return the old version.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use coherent::{compute_service, ComputeService, Registry, ServiceHandle};
use parking_lot::RwLock;

const KEYS: usize = 16;

#[derive(Clone, ComputeService)]
struct Versions {
    handle: ServiceHandle,
    rows: Arc<Vec<RwLock<u64>>>,
}

#[compute_service]
impl Versions {
    #[compute]
    async fn get(&self, id: usize) -> u64 {
        let version = *self.rows[id].read();
        // Give writers a chance to land in the middle of a computation.
        tokio::task::yield_now().await;
        version
    }

    #[compute]
    async fn pair(&self, a: usize, b: usize) -> (u64, u64) {
        (self.get(a).await, self.get(b).await)
    }

    fn update(&self, id: usize, version: u64) {
        *self.rows[id].write() = version;
        self.invalidate_get(id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_never_see_a_version_older_than_the_last_committed_write() {
    let service = Versions {
        handle: ServiceHandle::with_registry(&Registry::new()),
        rows: Arc::new((0..KEYS).map(|_| RwLock::new(0)).collect()),
    };
    let committed: Arc<Vec<AtomicU64>> = Arc::new((0..KEYS).map(|_| AtomicU64::new(0)).collect());
    let done = Arc::new(AtomicBool::new(false));
    let violations = Arc::new(AtomicUsize::new(0));
    let reads = Arc::new(AtomicUsize::new(0));

    let readers: Vec<_> = (0..16)
        .map(|reader| {
            let (service, committed, done, violations, reads) = (
                service.clone(),
                committed.clone(),
                done.clone(),
                violations.clone(),
                reads.clone(),
            );
            tokio::spawn(async move {
                let mut i = reader;
                while !done.load(Ordering::SeqCst) {
                    i = (i * 31 + 7) % KEYS;
                    let j = (i + 1) % KEYS;
                    let floor_i = committed[i].load(Ordering::SeqCst);
                    let floor_j = committed[j].load(Ordering::SeqCst);
                    let direct = service.get(i).await;
                    let (pi, pj) = service.pair(i, j).await;
                    if direct < floor_i || pi < floor_i || pj < floor_j {
                        violations.fetch_add(1, Ordering::SeqCst);
                    }
                    reads.fetch_add(1, Ordering::Relaxed);
                    // Hits never wait: without a yield, readers would starve the mutator.
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();

    let mutator = {
        let (service, committed) = (service.clone(), committed.clone());
        tokio::spawn(async move {
            for write in 1..=3_000u64 {
                let id = (write as usize * 7) % KEYS;
                service.update(id, write);
                committed[id].store(write, Ordering::SeqCst);
                tokio::task::yield_now().await;
            }
        })
    };
    mutator.await.unwrap();
    done.store(true, Ordering::SeqCst);
    for reader in readers {
        reader.await.unwrap();
    }
    assert!(
        reads.load(Ordering::Relaxed) > 1_000,
        "the readers really ran"
    );
    assert_eq!(violations.load(Ordering::SeqCst), 0);
}
