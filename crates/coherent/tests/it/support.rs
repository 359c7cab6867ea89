//! A recompute log, and services that write to it, so that tests can assert exactly which
//! methods ran.

use std::collections::HashMap;
use std::sync::Arc;

use coherent::{compute_service, ComputeService, Registry, ServiceHandle};
use parking_lot::Mutex;

/// Which method bodies ran, in order.
#[derive(Clone, Default)]
pub(crate) struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    pub(crate) fn push(&self, entry: impl Into<String>) {
        self.0.lock().push(entry.into());
    }

    /// Takes what was logged so far, sorted (bodies of independent branches may run in any order).
    pub(crate) fn take_sorted(&self) -> Vec<String> {
        let mut entries = std::mem::take(&mut *self.0.lock());
        entries.sort();
        entries
    }

    /// Takes what was logged so far, in order.
    pub(crate) fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock())
    }
}

/// A key-value store with compute methods over it: `get` reads a key, `sum` adds two keys
/// (a diamond when both depend on one), `describe` formats `sum`.
#[derive(Clone, ComputeService)]
pub(crate) struct Store {
    pub(crate) handle: ServiceHandle,
    pub(crate) data: Arc<Mutex<HashMap<String, i64>>>,
    pub(crate) log: Log,
}

impl Store {
    pub(crate) fn new(registry: &Registry, log: &Log) -> Self {
        Self {
            handle: ServiceHandle::with_registry(registry),
            data: Arc::default(),
            log: log.clone(),
        }
    }

    /// Writes through the service: store, then invalidate.
    pub(crate) fn set(&self, key: &str, value: i64) {
        self.data.lock().insert(key.to_owned(), value);
        self.invalidate_get(key.to_owned());
    }
}

#[compute_service]
impl Store {
    #[compute]
    pub async fn get(&self, key: String) -> i64 {
        self.log.push(format!("get({key})"));
        self.data.lock().get(&key).copied().unwrap_or(0)
    }

    #[compute]
    pub async fn sum(&self, a: String, b: String) -> i64 {
        self.log.push(format!("sum({a},{b})"));
        let x = self.get(a).await;
        tokio::task::yield_now().await;
        let y = self.get(b).await;
        x + y
    }

    #[compute]
    pub async fn describe(&self, a: String, b: String) -> String {
        self.log.push(format!("describe({a},{b})"));
        format!("{a}+{b}={}", self.sum(a.clone(), b.clone()).await)
    }
}

pub(crate) fn s(text: &str) -> String {
    text.to_owned()
}
