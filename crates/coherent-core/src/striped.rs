//! A reader-writer lock for the tables' hit path, in which a reader makes one atomic
//! read-modify-write, on a cache line no other thread writes.
//!
//! Every thread that reads gets a small id of its own (`thread_slot`), and a lock has one
//! reader count per id (a *stripe*), each on its own cache line. Only the owning thread writes
//! its stripe, so a reader enters with one `swap` (which is also the full fence the protocol
//! needs) and leaves with a plain store: a shared read-write lock (parking_lot's, dashmap's)
//! costs two read-modify-writes of a line that every reader of the lock writes.
//!
//! The protocol is Dekker's: a reader raises its count, then checks `writing`; a writer sets
//! `writing`, then waits for every count to be zero. Both sides use sequentially consistent
//! operations (see `ANNOUNCE`), so at least one of them sees the other: a reader that sees `writing` lowers its
//! count again and waits on the writers' mutex; a writer that sees a count waits for it, for a
//! bounded spin: a count that stays up belongs to a descheduled thread (or a long read), and
//! the writer clears `writing`, gives its turn away and tries again rather than hold every
//! reader out meanwhile; each try spins twice as long as the one before, up to a cap, so
//! that a long read cannot starve it. Threads beyond the stripes of a lock (more reading
//! threads than stripes) share one more stripe, entered with a `fetch_add` and left with a
//! `fetch_sub`. A thread may read a lock it already reads, even while a writer waits: on its
//! own stripe at once; on the shared one the second read waits for the writer's next try
//! (std's and parking_lot's read-write locks would wait for ever). The tables never read one
//! lock twice.
//!
//! A table is read on every hit and written only on a miss or a prune, so the trade (a writer
//! scans every stripe) is the right one. Under `--cfg loom` the lock is model-checked on its
//! own (the tests at the end).

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};

use crossbeam_utils::CachePadded;

use crate::sync::{AtomicBool, AtomicU64, AtomicUsize, Mutex, MutexGuard, Ordering};

/// One stripe: a reader count, and the hits counted by the readers that use it, side by side,
/// so that counting a hit writes the cache line the reader has just written anyway.
pub(crate) struct Stripe {
    readers: AtomicUsize,
    hits: AtomicU64,
}

impl Stripe {
    fn new() -> Self {
        Self {
            readers: AtomicUsize::new(0),
            hits: AtomicU64::new(0),
        }
    }

    /// Counts one hit. A load and a store, not a read-modify-write: a thread's own stripe is
    /// written by that thread alone, so the count is exact there; on the shared stripe, two
    /// threads hitting at the same instant may count one hit. The lock-prefixed add this
    /// avoids would cost a tenth of a hit.
    #[inline]
    pub(crate) fn count_hit(&self) {
        self.hits
            .store(self.hits.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
}

pub(crate) struct StripedRwLock<T> {
    /// Indexed by the reading thread's slot.
    stripes: Box<[CachePadded<Stripe>]>,
    /// For threads whose slot is past `stripes`.
    shared: CachePadded<Stripe>,
    /// Set by the writer holding `writers` while it waits for readers and while it writes.
    writing: CachePadded<AtomicBool>,
    /// Writers take turns here; readers that found `writing` set wait here too.
    writers: Mutex<()>,
    value: UnsafeCell<T>,
    /// Tries a writer gave up (for the tests: a writer is waiting for a reader).
    #[cfg(all(test, not(loom)))]
    retries: AtomicUsize,
}

// SAFETY: `value` is only reached through the guards below, which follow the reader-writer
// discipline of std's `RwLock`: shared access while a stripe counts the reader and no writer
// writes, exclusive access while `writing` is set and every stripe is zero. The bounds are
// those of `RwLock`.
unsafe impl<T: Send> Send for StripedRwLock<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Sync for StripedRwLock<T> {}

/// How many stripes a lock has: twice the cores, rounded up to a power of two, 8 to 64.
#[cfg(not(loom))]
fn stripe_count() -> usize {
    static COUNT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *COUNT.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        (cores * 2).next_power_of_two().clamp(8, 64)
    })
}

#[cfg(loom)]
fn stripe_count() -> usize {
    2
}

/// This thread's slot: a small number no other live thread has, assigned on its first read and
/// given back when it exits. `usize::MAX` (the shared stripe) once the thread is exiting.
#[cfg(not(loom))]
#[inline]
fn thread_slot() -> usize {
    use std::cell::Cell;
    const UNASSIGNED: usize = usize::MAX - 1;
    thread_local! {
        static SLOT: Cell<usize> = const { Cell::new(UNASSIGNED) };
    }
    let slot = SLOT.with(Cell::get);
    if slot != UNASSIGNED {
        return slot;
    }
    return assign();

    #[cold]
    fn assign() -> usize {
        /// Gives the slot back when the thread exits. Other destructors of the thread may read
        /// a table after this one ran: the thread then uses the shared stripe, never a slot that
        /// another thread may have been given meanwhile.
        struct Release(usize);
        impl Drop for Release {
            fn drop(&mut self) {
                let _ = SLOT.try_with(|slot| slot.set(usize::MAX));
                free_slots().lock().push(self.0);
            }
        }
        thread_local! {
            static RELEASE: Cell<Option<Release>> = const { Cell::new(None) };
        }
        let slot = {
            let mut free = free_slots().lock();
            match free.pop() {
                Some(slot) => slot,
                None => {
                    static NEXT: std::sync::atomic::AtomicUsize =
                        std::sync::atomic::AtomicUsize::new(0);
                    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                }
            }
        };
        // A thread that is already exiting cannot register the release: it keeps the shared
        // stripe, and the slot goes back at once.
        if RELEASE.try_with(|r| r.set(Some(Release(slot)))).is_err() {
            free_slots().lock().push(slot);
            return usize::MAX;
        }
        SLOT.with(|s| s.set(slot));
        slot
    }

    fn free_slots() -> &'static parking_lot::Mutex<Vec<usize>> {
        static FREE: parking_lot::Mutex<Vec<usize>> = parking_lot::Mutex::new(Vec::new());
        &FREE
    }
}

impl<T> StripedRwLock<T> {
    pub(crate) fn new(value: T) -> Self {
        Self::with_stripes(value, stripe_count())
    }

    fn with_stripes(value: T, stripes: usize) -> Self {
        Self {
            stripes: (0..stripes)
                .map(|_| CachePadded::new(Stripe::new()))
                .collect(),
            shared: CachePadded::new(Stripe::new()),
            writing: CachePadded::new(AtomicBool::new(false)),
            writers: Mutex::new(()),
            value: UnsafeCell::new(value),
            #[cfg(all(test, not(loom)))]
            retries: AtomicUsize::new(0),
        }
    }

    /// The stripe this thread reads through.
    #[cfg(not(loom))]
    #[inline]
    pub(crate) fn local_stripe(&self) -> &Stripe {
        self.stripes.get(thread_slot()).unwrap_or(&self.shared)
    }

    /// Shared access, counted on this thread's stripe.
    #[cfg(not(loom))]
    #[inline]
    pub(crate) fn read(&self) -> ReadGuard<'_, T> {
        self.read_in(thread_slot())
    }

    /// Shared access for the thread whose slot is `slot`: no other live thread may use it.
    #[inline]
    pub(crate) fn read_in(&self, slot: usize) -> ReadGuard<'_, T> {
        match self.stripes.get(slot) {
            Some(stripe) => loop {
                // Only this thread writes its stripe, so load-then-swap is an increment. The
                // swap is sequentially consistent: the load of `writing` below cannot pass it.
                let before = stripe.readers.load(Ordering::Relaxed);
                stripe.readers.swap(before + 1, ANNOUNCE);
                dekker_fence();
                // A thread that already reads (`before > 0`) holds off every writer: reading
                // again cannot race one, and waiting here for one would wait for ourselves.
                if before > 0 || !self.writing.load(CHECK) {
                    return ReadGuard {
                        lock: self,
                        stripe,
                        exclusive: true,
                        _not_send: std::marker::PhantomData,
                    };
                }
                stripe.readers.store(before, Ordering::Release);
                self.wait_for_writer();
            },
            None => loop {
                let stripe = &*self.shared;
                stripe.readers.fetch_add(1, ANNOUNCE);
                dekker_fence();
                if !self.writing.load(CHECK) {
                    return ReadGuard {
                        lock: self,
                        stripe,
                        exclusive: false,
                        _not_send: std::marker::PhantomData,
                    };
                }
                stripe.readers.fetch_sub(1, Ordering::Release);
                self.wait_for_writer();
            },
        }
    }

    /// Waits until the writer that holds the lock has finished.
    #[cold]
    fn wait_for_writer(&self) {
        drop(self.writers.lock());
    }

    /// Exclusive access: turns new readers away, then waits for the readers inside to leave.
    ///
    /// Readers hold a stripe for a lookup and a clone, moments, unless the thread was
    /// descheduled inside; then it may not run again for milliseconds (on a loaded machine,
    /// or at a lower priority than the rest of the process). A writer that kept `writing`
    /// set all that time would hold every other reader out of the table with it, among them
    /// a thread that reads the table to invalidate an entry: an invalidation would wait for
    /// the least favoured reader thread of the process. So the writer waits a bounded spin
    /// for the readers inside, and when one is still there it lets new readers in again,
    /// hands its turn to whoever waits for it (a reader it turned away, another writer), and
    /// tries again.
    ///
    /// Each try spins twice as long as the one before, up to `WRITER_SPINS_MAX`: a read
    /// that takes longer than a try (a large value cloned, a walk over the whole table)
    /// cannot hold the writer off for ever, and a reader that waits for a try waits at most
    /// the longest spin.
    pub(crate) fn write(&self) -> WriteGuard<'_, T> {
        let mut spins = WRITER_SPINS;
        loop {
            let turn = self.writers.lock();
            self.writing.store(true, ANNOUNCE);
            dekker_fence();
            if self.readers_left(spins) {
                return WriteGuard {
                    lock: self,
                    _turn: turn,
                };
            }
            self.writing.store(false, Ordering::Release);
            #[cfg(all(test, not(loom)))]
            self.retries.fetch_add(1, Ordering::SeqCst);
            unlock_fair(turn);
            yield_now();
            spins = spins.saturating_mul(2).min(WRITER_SPINS_MAX);
        }
    }

    /// Whether every stripe fell to zero within `limit` spins each.
    fn readers_left(&self, limit: u32) -> bool {
        self.stripes
            .iter()
            .chain(std::iter::once(&self.shared))
            .all(|stripe| {
                let mut spins = 0u32;
                while stripe.readers.load(CHECK) != 0 {
                    spins += 1;
                    if spins > limit {
                        return false;
                    }
                    std::hint::spin_loop();
                }
                true
            })
    }

    /// Hits counted on every stripe.
    pub(crate) fn hits(&self) -> u64 {
        self.stripes
            .iter()
            .chain(std::iter::once(&self.shared))
            .map(|s| s.hits.load(Ordering::Relaxed))
            .sum()
    }

    /// Exclusive access without locking: `&mut self` proves no guard exists.
    pub(crate) fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }
}

// Each side announces itself, then checks the other. In production the announcement and the
// check are sequentially consistent accesses (on x86 the reader's is one `xchg`, its check a
// plain load). Loom models sequentially consistent fences but not accesses, so under loom the
// same protocol is written with a fence between the two.
#[cfg(not(loom))]
const ANNOUNCE: Ordering = Ordering::SeqCst;
#[cfg(not(loom))]
const CHECK: Ordering = Ordering::SeqCst;
#[cfg(not(loom))]
#[inline(always)]
fn dekker_fence() {}

#[cfg(loom)]
const ANNOUNCE: Ordering = Ordering::Relaxed;
#[cfg(loom)]
const CHECK: Ordering = Ordering::Acquire;
#[cfg(loom)]
fn dekker_fence() {
    loom::sync::atomic::fence(Ordering::SeqCst);
}

#[cfg(not(loom))]
fn yield_now() {
    std::thread::yield_now();
}

/// How long a writer spins on one stripe before it lets readers in again: a few
/// microseconds, many times a hit's lookup and clone.
#[cfg(not(loom))]
const WRITER_SPINS: u32 = 1 << 8;

/// The longest spin of a try: tens to hundreds of microseconds.
#[cfg(not(loom))]
const WRITER_SPINS_MAX: u32 = 1 << 16;

#[cfg(loom)]
const WRITER_SPINS: u32 = 1;

#[cfg(loom)]
const WRITER_SPINS_MAX: u32 = 2;

/// Gives the writers' turn back to the thread that waits longest for it, if any (a plain
/// unlock lets the releasing writer take it again at once, before the woken waiter runs).
#[cfg(not(loom))]
fn unlock_fair(turn: MutexGuard<'_, ()>) {
    parking_lot::MutexGuard::unlock_fair(turn);
}

#[cfg(loom)]
fn unlock_fair(turn: MutexGuard<'_, ()>) {
    drop(turn);
}

#[cfg(loom)]
fn yield_now() {
    loom::thread::yield_now();
}

pub(crate) struct ReadGuard<'a, T> {
    lock: &'a StripedRwLock<T>,
    stripe: &'a Stripe,
    /// Whether the stripe is the thread's own (left with a plain store) or the shared one.
    exclusive: bool,
    /// Not `Send`: a guard on a thread's own stripe must be dropped by that thread, the only
    /// one that writes the stripe.
    _not_send: std::marker::PhantomData<*const ()>,
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
        // SAFETY: this guard is counted on a stripe, and it entered while no writer wrote (see
        // `read_in`); a writer waits for every stripe to be zero, so none writes the value now.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> Drop for ReadGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        if self.exclusive {
            // Only this thread writes its stripe (the guard is not `Send`), so load-then-store
            // is a decrement, whatever order its guards are dropped in. Release: a writer that
            // sees the count fall sees our reads done.
            let count = self.stripe.readers.load(Ordering::Relaxed);
            self.stripe.readers.store(count - 1, Ordering::Release);
        } else {
            self.stripe.readers.fetch_sub(1, Ordering::Release);
        }
    }
}

pub(crate) struct WriteGuard<'a, T> {
    lock: &'a StripedRwLock<T>,
    _turn: MutexGuard<'a, ()>,
}

impl<T> Deref for WriteGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        // SAFETY: this guard set `writing` and saw every stripe at zero; readers that came later
        // saw `writing` and left.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for WriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as for `deref`, and `&mut self` makes this the only reference through it.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for WriteGuard<'_, T> {
    fn drop(&mut self) {
        // Release: readers that see `writing` clear see what was written. The turn is given
        // back after this (field order), so waiting readers find `writing` clear.
        self.lock.writing.store(false, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn writers_exclude_readers_on_every_thread() {
        let lock = Arc::new(StripedRwLock::new((0u64, 0u64)));
        // More threads than stripes: some read through the shared stripe.
        let threads: Vec<_> = (0..stripe_count() + 4)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..2_000 {
                        {
                            let mut pair = lock.write();
                            pair.0 += 1;
                            pair.1 += 1;
                        }
                        for _ in 0..10 {
                            let pair = lock.read();
                            assert_eq!(pair.0, pair.1, "a reader saw half a write");
                        }
                    }
                })
            })
            .collect();
        let expected = 2_000 * threads.len() as u64;
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*lock.read(), (expected, expected));
    }

    #[test]
    fn a_thread_may_read_again_while_a_writer_waits() {
        // Re-entry is promised on a thread's own stripe only (on the shared one it would wait
        // for the writer, which waits for it, as with std's and parking_lot's locks): enough
        // stripes that this thread has its own, whatever other tests run at once.
        let lock = Arc::new(StripedRwLock::with_stripes(1u32, 4096));
        assert!(thread_slot() < 4096);
        let outer = lock.read();
        let writer = {
            let lock = lock.clone();
            std::thread::spawn(move || *lock.write() += 1)
        };
        // Until the writer has found us inside at least once.
        while lock.retries.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        let inner = lock.read();
        assert_eq!((*outer, *inner), (1, 1));
        drop(inner);
        drop(outer);
        writer.join().unwrap();
        assert_eq!(*lock.read(), 2);
    }

    #[test]
    fn readers_get_in_while_a_writer_waits_for_a_reader_that_stays() {
        // A reader that stays inside (as a descheduled thread does) holds the writer off;
        // the writer must not hold every other reader off with it. An invalidation reads
        // the table: it would wait for the slowest reader thread of the process.
        let lock = Arc::new(StripedRwLock::with_stripes(0u32, 4096));
        let (stay, release) = std::sync::mpsc::channel::<()>();
        let (inside, entered) = std::sync::mpsc::channel::<()>();
        let stayer = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let guard = lock.read();
                inside.send(()).unwrap();
                release.recv().unwrap();
                drop(guard);
            })
        };
        entered.recv().unwrap();
        let writer = {
            let lock = lock.clone();
            std::thread::spawn(move || *lock.write() += 1)
        };
        // Until the writer has found the stayer inside at least once.
        while lock.retries.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        let (done, reads) = std::sync::mpsc::channel();
        {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let seen: u32 = (0..1_000).map(|_| *lock.read()).sum();
                done.send(seen).unwrap();
            });
        }
        // Liveness, not speed: under the old rule this never came.
        let seen = reads
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("readers waited for a writer that waits for a reader");
        assert_eq!(seen, 0, "the writer wrote while a reader was inside");
        stay.send(()).unwrap();
        stayer.join().unwrap();
        writer.join().unwrap();
        assert_eq!(*lock.read(), 1);
    }

    #[test]
    fn hits_are_summed_over_stripes() {
        let lock = Arc::new(StripedRwLock::new(()));
        for _ in 0..3 {
            let lock = lock.clone();
            std::thread::spawn(move || lock.read().stripe().count_hit())
                .join()
                .unwrap();
        }
        lock.local_stripe().count_hit();
        assert_eq!(lock.hits(), 4);
    }

    #[test]
    fn slots_of_exited_threads_are_given_again() {
        let first = std::thread::spawn(thread_slot).join().unwrap();
        let second = std::thread::spawn(thread_slot).join().unwrap();
        // Each thread exited before the next began, so the slot went back and came out again
        // (other tests' threads may take it meanwhile; then it is at least a small number).
        assert!(first < 1024 && second < 1024, "slots {first} and {second}");
    }
}

/// The protocol under the model checker: `RUSTFLAGS="--cfg loom" cargo test -p coherent-core
/// --lib --release striped`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// A reader with the given slot and a writer: the reader never sees half a write.
    fn reader_and_writer(slot: usize) {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(move || {
            let lock = Arc::new(StripedRwLock::new((
                loom::cell::UnsafeCell::new(0u8),
                loom::cell::UnsafeCell::new(0u8),
            )));
            let reader = {
                let lock = lock.clone();
                loom::thread::spawn(move || {
                    let pair = lock.read_in(slot);
                    // SAFETY: reads under the read guard; loom reports any overlap with a write.
                    let a = pair.0.with(|a| unsafe { *a });
                    // SAFETY: as above.
                    let b = pair.1.with(|b| unsafe { *b });
                    assert_eq!(a, b, "a reader saw half a write");
                })
            };
            {
                let pair = lock.write();
                // SAFETY: writes under the write guard; loom reports any overlap with a read.
                pair.0.with_mut(|a| unsafe { *a += 1 });
                // SAFETY: as above.
                pair.1.with_mut(|b| unsafe { *b += 1 });
            }
            reader.join().unwrap();
        });
    }

    #[test]
    fn a_reader_on_its_own_stripe_never_overlaps_a_writer() {
        reader_and_writer(0);
    }

    #[test]
    fn a_reader_on_the_shared_stripe_never_overlaps_a_writer() {
        reader_and_writer(usize::MAX);
    }
}
