//! A coarse process-wide clock for keep-alive bookkeeping. A cache hit must not pay for
//! `Instant::now()`, so hits read one relaxed atomic that a background thread advances.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Length of one tick of the coarse clock.
pub(crate) const TICK: Duration = Duration::from_millis(10);

static NOW: AtomicU32 = AtomicU32::new(0);
static START: OnceLock<Instant> = OnceLock::new();

/// Starts the ticking thread once per process; later calls are free.
pub(crate) fn start() {
    START.get_or_init(|| {
        let start = Instant::now();
        std::thread::Builder::new()
            .name("coherent-clock".into())
            .spawn(move || loop {
                std::thread::sleep(TICK);
                NOW.store(ticks_between(start, Instant::now()), Ordering::Relaxed);
            })
            .expect("coherent: cannot spawn the clock thread");
        start
    });
}

fn ticks_between(start: Instant, now: Instant) -> u32 {
    let ticks = now.duration_since(start).as_millis() / TICK.as_millis();
    u32::try_from(ticks).unwrap_or(u32::MAX)
}

/// The coarse time, in ticks since the clock started. Cheap enough for the hit path.
#[inline]
pub(crate) fn now() -> u32 {
    NOW.load(Ordering::Relaxed)
}

/// The precise time in ticks, for pruning decisions that must not lag behind.
pub(crate) fn precise_now() -> u32 {
    match START.get() {
        Some(start) => ticks_between(*start, Instant::now()),
        None => 0,
    }
}

/// A duration in whole ticks, rounded up so that a keep-alive is never cut short.
pub(crate) fn to_ticks(d: Duration) -> u32 {
    let ticks = d.as_nanos().div_ceil(TICK.as_nanos());
    u32::try_from(ticks).unwrap_or(u32::MAX)
}
