//! Every lock and atomic the computed state machine and the tables' lock use goes through this
//! module, so that a model checker (loom, under `--cfg loom`) can replace them and explore the
//! interleavings of completion, invalidation and edge registration, and of readers and writers.

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{
    AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};
// Reference counts stay std's even under loom: loom's `Arc` cannot be unsized to a trait object,
// and the interleavings worth checking are those of the state word and the edge lock.
pub(crate) use std::sync::{Arc, Weak};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{
    AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};

/// A mutex whose guard never outlives a `.await`: parking_lot's in production (no poisoning, one
/// byte), loom's under the model checker.
#[cfg(not(loom))]
pub(crate) struct Mutex<T>(parking_lot::Mutex<T>);

/// The guard of [`Mutex`].
#[cfg(not(loom))]
pub(crate) type MutexGuard<'a, T> = parking_lot::MutexGuard<'a, T>;

/// The guard of [`Mutex`].
#[cfg(loom)]
pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

#[cfg(not(loom))]
impl<T> Mutex<T> {
    pub(crate) const fn new(value: T) -> Self {
        Self(parking_lot::Mutex::new(value))
    }

    pub(crate) fn lock(&self) -> parking_lot::MutexGuard<'_, T> {
        self.0.lock()
    }
}

#[cfg(loom)]
pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

#[cfg(loom)]
impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(loom::sync::Mutex::new(value))
    }

    pub(crate) fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
        self.0.lock().unwrap()
    }
}
