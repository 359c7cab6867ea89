//! How every case is timed, whatever the peer: concurrent callers in a loop for a fixed
//! time (warm-up, then best of N), alone or taking turns with the cases it is compared to.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::Timing;

pub(crate) type BoxFut = Pin<Box<dyn Future<Output = anyhow::Result<u64>> + Send>>;

/// Makes one unit of work for caller `i`; the future returns how many units it did
/// (1 for a call, the item count for a stream call).
pub(crate) type Work = Arc<dyn Fn(usize) -> BoxFut + Send + Sync>;

async fn one_run(work: &Work, callers: usize, run: Duration) -> anyhow::Result<f64> {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..callers)
        .map(|i| {
            let (work, stop, done) = (work.clone(), stop.clone(), done.clone());
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    n += work(i).await?;
                }
                done.fetch_add(n, Ordering::Relaxed);
                anyhow::Ok(())
            })
        })
        .collect();
    tokio::time::sleep(run).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64())
}

/// Units per second: a warm-up, then the best of `timing.runs` runs.
pub(crate) async fn throughput(timing: Timing, callers: usize, work: Work) -> anyhow::Result<f64> {
    one_run(&work, callers, timing.warmup).await?;
    let mut best = 0f64;
    for _ in 0..timing.runs {
        best = best.max(one_run(&work, callers, timing.run).await?);
    }
    Ok(best)
}

/// Like [`throughput`] for several cases compared with each other: each is warmed up,
/// then the runs take turns (a, b, a, b, ...), so that a slow phase of the machine hits
/// every case alike. Returns each case's best, in order.
pub(crate) async fn interleaved(
    timing: Timing,
    cases: &[(usize, Work)],
) -> anyhow::Result<Vec<f64>> {
    for (callers, work) in cases {
        one_run(work, *callers, timing.warmup).await?;
    }
    let mut best = vec![0f64; cases.len()];
    for _ in 0..timing.runs {
        for (b, (callers, work)) in best.iter_mut().zip(cases) {
            *b = b.max(one_run(work, *callers, timing.run).await?);
        }
    }
    Ok(best)
}

pub(crate) fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
