//! The user service under test: `get` is a compute method over the store; `update` writes
//! through the store and then invalidates `get(id)`.

use std::sync::Arc;

use coherent::{compute_service, ComputeService, Registry, ServiceHandle};

use super::store::{Store, StoreError, User};

#[derive(Clone, ComputeService)]
pub(crate) struct UserService {
    handle: ServiceHandle,
    store: Arc<Store>,
}

impl UserService {
    pub(crate) fn new(store: Arc<Store>, registry: &Registry) -> Self {
        Self {
            handle: ServiceHandle::with_registry(registry),
            store,
        }
    }

    /// The same service (the same cache) over another handle to the store.
    pub(crate) fn with_store(&self, store: Arc<Store>) -> Self {
        Self {
            handle: self.handle.clone(),
            store,
        }
    }

    /// The store behind the service.
    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    pub(crate) async fn update(&self, id: u64, version: u64) -> Result<(), StoreError> {
        self.store.update(id, version).await?;
        self.invalidate_get(id);
        Ok(())
    }
}

#[compute_service]
impl UserService {
    #[compute]
    pub(crate) async fn get(&self, id: u64) -> Result<User, StoreError> {
        self.store.get(id).await
    }
}
