//! A profiling aid for the hit path: `threads` tasks on as many tokio workers call a cached compute method over
//! 1,000 keys in a loop and print the rate. Not a benchmark (see `coherent-bench local`).
//!
//! ```sh
//! cargo run --release -p coherent --example hits -- [threads] [seconds]
//! perf record -g target/release/examples/hits 1 5
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use coherent::{compute_service, ComputeService, Registry, ServiceHandle};

/// A `Copy` value of about the size of the benchmark's user row.
#[derive(Clone, Copy, Debug)]
struct User {
    id: u64,
    _row: [u64; 13],
}

#[derive(Clone, ComputeService)]
struct Users {
    handle: ServiceHandle,
}

#[compute_service]
impl Users {
    #[compute(keep_alive = "1h")]
    async fn get(&self, id: u64) -> Result<User, Arc<str>> {
        Ok(User { id, _row: [0; 13] })
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1);
    let seconds: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(3.0);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let users = Users {
        handle: ServiceHandle::with_registry(&Registry::new()),
    };
    runtime.block_on(async {
        for id in 0..1000 {
            users.get(id).await.unwrap();
        }
    });
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let workers = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .build()
        .unwrap();
    let tasks: Vec<_> = (0..threads)
        .map(|t| {
            let (users, stop, calls) = (users.clone(), stop.clone(), calls.clone());
            workers.spawn(async move {
                let mut x = 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(t as u64 + 1);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..64 {
                        x ^= x >> 12;
                        x ^= x << 25;
                        x ^= x >> 27;
                        let id = (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) % 1000;
                        let user = users.get(id).await.unwrap();
                        std::hint::black_box(user.id);
                    }
                    n += 64;
                }
                calls.fetch_add(n, Ordering::Relaxed);
            })
        })
        .collect();
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        workers.block_on(task).unwrap();
    }
    let rate = calls.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    println!(
        "{threads} thread(s): {:.2}M calls/s, {:.1} ns/call per thread",
        rate / 1e6,
        threads as f64 * 1e9 / rate
    );
}
