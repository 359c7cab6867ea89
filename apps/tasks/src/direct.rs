//! The `direct` backend: a query per request, on the pool, with prepared statements: what
//! a team writes first, and the baseline the others are measured against.

use uuid::Uuid;

use crate::api::{ApiError, Backend, Body};
use crate::model::Summary;
use crate::model::{now_micros, ListQuery, NewProject, NewTask, Project, Task, TaskPatch};
use crate::store::Store;

/// Serves the API straight from the database.
#[derive(Clone)]
pub struct Direct {
    store: Store,
}

impl Direct {
    /// A backend over `store`.
    pub fn new(store: Store) -> Self {
        Self { store }
    }
}

impl Backend for Direct {
    async fn list(&self, q: ListQuery) -> Result<Body, ApiError> {
        Body::json(&self.store.list(q).await?)
    }

    async fn task(&self, id: Uuid) -> Result<Body, ApiError> {
        match self.store.get(id).await? {
            Some(t) => Body::json(&t),
            None => Err(ApiError::NotFound(format!("task {id}"))),
        }
    }

    async fn summary(&self, project: Uuid) -> Result<Body, ApiError> {
        if self.store.project(project).await?.is_none() {
            return Err(ApiError::NotFound(format!("project {project}")));
        }
        let counts = self.store.counts(project).await?;
        Body::json(&Summary::from_counts(project, counts))
    }

    async fn projects(&self) -> Result<Body, ApiError> {
        Body::json(&self.store.projects().await?)
    }

    async fn create(&self, new: NewTask) -> Result<Task, ApiError> {
        Ok(self.store.insert_task(new.into_task(now_micros())?).await?)
    }

    async fn update(&self, id: Uuid, patch: TaskPatch) -> Result<Task, ApiError> {
        self.store
            .update_task(id, patch, now_micros())
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("task {id}")))
    }

    async fn delete(&self, id: Uuid) -> Result<(), ApiError> {
        match self.store.delete_task(id).await? {
            Some(_) => Ok(()),
            None => Err(ApiError::NotFound(format!("task {id}"))),
        }
    }

    async fn create_project(&self, new: NewProject) -> Result<Project, ApiError> {
        Ok(self
            .store
            .insert_project(new.into_project(now_micros())?)
            .await?)
    }
}
