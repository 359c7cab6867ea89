//! A reader-writer lock striped by thread, for the tables' hit path. A reader locks only the
//! stripe of its own thread, so readers on different cores never write the same cache line
//! (with one lock word, every hit would move that line between cores, and two cores would
//! read slower than one). A writer locks every stripe. A table is read on every hit and written
//! only on a miss, so the trade is the right one.

use std::cell::{Cell, UnsafeCell};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crossbeam_utils::CachePadded;
use parking_lot::lock_api::RawRwLock as _;
use parking_lot::RawRwLock;

/// One stripe: a lock word and the hits counted by the readers that use it, side by side, so
/// that counting a hit writes the cache line the reader has just written anyway.
pub(crate) struct Stripe {
    lock: RawRwLock,
    hits: AtomicU64,
}

impl Stripe {
    /// Counts one hit. A load and a store, not a read-modify-write: a stripe is written by
    /// the threads mapped to it, normally one, so the count is exact; when two threads share a
    /// stripe (more threads than stripes) and hit at the same instant, one hit may go uncounted.
    /// The lock-prefixed add this avoids would cost a tenth of a hit.
    #[inline]
    pub(crate) fn count_hit(&self) {
        self.hits
            .store(self.hits.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
}

pub(crate) struct StripedRwLock<T> {
    stripes: Box<[CachePadded<Stripe>]>,
    mask: usize,
    value: UnsafeCell<T>,
}

// SAFETY: `value` is only reached through the guards below, which follow the reader-writer
// discipline of std's `RwLock`: shared access under any stripe's shared lock, exclusive access
// under every stripe's exclusive lock. The bounds are those of `RwLock`.
unsafe impl<T: Send> Send for StripedRwLock<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Sync for StripedRwLock<T> {}

/// How many stripes a lock has: twice the cores, rounded up to a power of two, 4 to 32. Threads
/// get stripes in the order they first read, so a runtime's workers get distinct ones.
fn stripe_count() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        (cores * 2).next_power_of_two().clamp(4, 32)
    })
}

/// This thread's stripe number (before masking); assigned on first use.
#[inline]
fn thread_stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    STRIPE.with(|stripe| match stripe.get() {
        usize::MAX => {
            let assigned = NEXT.fetch_add(1, Ordering::Relaxed);
            stripe.set(assigned);
            assigned
        }
        assigned => assigned,
    })
}

impl<T> StripedRwLock<T> {
    pub(crate) fn new(value: T) -> Self {
        let count = stripe_count();
        Self {
            stripes: (0..count)
                .map(|_| {
                    CachePadded::new(Stripe {
                        lock: RawRwLock::INIT,
                        hits: AtomicU64::new(0),
                    })
                })
                .collect(),
            mask: count - 1,
            value: UnsafeCell::new(value),
        }
    }

    /// The stripe this thread reads through.
    #[inline]
    pub(crate) fn local_stripe(&self) -> &Stripe {
        &self.stripes[thread_stripe() & self.mask]
    }

    /// Shared access: locks this thread's stripe only.
    #[inline]
    pub(crate) fn read(&self) -> ReadGuard<'_, T> {
        let stripe = self.local_stripe();
        stripe.lock.lock_shared();
        ReadGuard { lock: self, stripe }
    }

    /// Exclusive access: locks every stripe, always in the same order.
    pub(crate) fn write(&self) -> WriteGuard<'_, T> {
        for stripe in self.stripes.iter() {
            stripe.lock.lock_exclusive();
        }
        WriteGuard { lock: self }
    }

    /// Hits counted on every stripe.
    pub(crate) fn hits(&self) -> u64 {
        self.stripes
            .iter()
            .map(|s| s.hits.load(Ordering::Relaxed))
            .sum()
    }

    /// Exclusive access without locking: `&mut self` proves no guard exists.
    pub(crate) fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }
}

pub(crate) struct ReadGuard<'a, T> {
    lock: &'a StripedRwLock<T>,
    stripe: &'a Stripe,
}

impl<T> ReadGuard<'_, T> {
    /// The stripe this guard holds, for counting a hit on it.
    #[inline]
    pub(crate) fn stripe(&self) -> &Stripe {
        self.stripe
    }
}

impl<T> Deref for ReadGuard<'_, T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard holds a shared lock on a stripe, so no writer (which needs every
        // stripe exclusively) can hold the value.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> Drop for ReadGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: the shared lock on this stripe was taken by `read` and is released once, here.
        unsafe { self.stripe.lock.unlock_shared() }
    }
}

pub(crate) struct WriteGuard<'a, T> {
    lock: &'a StripedRwLock<T>,
}

impl<T> Deref for WriteGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        // SAFETY: this guard holds every stripe exclusively.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for WriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard holds every stripe exclusively, and `&mut self` makes this the
        // only reference through it.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for WriteGuard<'_, T> {
    fn drop(&mut self) {
        for stripe in self.lock.stripes.iter().rev() {
            // SAFETY: `write` took every stripe exclusively; each is released once, here.
            unsafe { stripe.lock.unlock_exclusive() }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn writers_exclude_readers_on_every_thread() {
        let lock = Arc::new(StripedRwLock::new((0u64, 0u64)));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        {
                            let mut pair = lock.write();
                            pair.0 += 1;
                            pair.1 += 1;
                        }
                        let pair = lock.read();
                        assert_eq!(pair.0, pair.1, "a reader saw half a write");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*lock.read(), (40_000, 40_000));
    }

    #[test]
    fn hits_are_summed_over_stripes() {
        let lock = Arc::new(StripedRwLock::new(()));
        // One thread at a time: the count is exact when no two threads hit one stripe at once.
        for _ in 0..3 {
            let lock = lock.clone();
            std::thread::spawn(move || lock.read().stripe().count_hit())
                .join()
                .unwrap();
        }
        lock.local_stripe().count_hit();
        assert_eq!(lock.hits(), 4);
    }
}
