//! The `coherent` backend.
//!
//! - [`TasksService`] is the compute service, defined once: [`TasksBackend`] implements it
//!   over the database (each result memoized and invalidated exactly), and
//!   `TasksServiceClient` implements it with replicas in an HTTP tier, kept coherent by the
//!   backend's pushed invalidations.
//! - Writes are commands ([`CreateTask`], [`UpdateTask`], [`DeleteTask`], [`CreateProject`])
//!   run by the backend's `coherent::ops::Host`: the handler's writes and the operation log
//!   commit together, and each command's `invalidate` (the one place that says what it
//!   changes) runs on this backend and on every other backend sharing the database.
//! - [`LiveTier`] serves HTTP from a local compute service over the replicas ([`Views`]):
//!   each answer's JSON and entity tag are computed once per value, so a read is a cache
//!   hit and a copy of a reference-counted buffer.

use std::sync::Arc;

use coherent::ops::{Command, CommandClient, CommandError, ErrorKind, Handler, Tx};
use coherent::prelude::*;
use coherent::remote::RemoteClient;
use coherent::rpc::{Caller, Reconnecting};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::api::{ApiError, Backend, Body};
use crate::model::{
    now_micros, Invalid, ListQuery, NewProject, NewTask, Page, Project, Status, Summary, Task,
    TaskPatch,
};
use crate::store::{lite, pg, Store, StoreError};

/// The Tasks API as a compute service: every read a client may hold a replica of.
///
/// `typescript`: `TasksServiceServer::typescript()` describes the methods for the TypeScript
/// client (see [`crate::typescript`]).
#[compute_service(typescript)]
pub trait TasksService {
    /// One task, or `None`.
    async fn task(&self, id: Uuid) -> Result<Option<Arc<Task>>, ApiError>;
    /// One page of a list, newest first.
    async fn page(&self, q: ListQuery) -> Result<Arc<Page>, ApiError>;
    /// A project's counts per status, or `None` for an unknown project.
    async fn summary(&self, project: Uuid) -> Result<Option<Summary>, ApiError>;
    /// Every project.
    async fn projects(&self) -> Result<Arc<Vec<Project>>, ApiError>;
}

/// The backend: the compute service over the database, and the handlers of the commands.
#[derive(Clone, ComputeService)]
pub struct TasksBackend {
    handle: ServiceHandle,
    store: Store,
}

impl TasksBackend {
    /// A backend over `store`, its cache in `registry`.
    pub fn new(store: Store, registry: &Registry) -> Self {
        Self {
            handle: ServiceHandle::with_registry(registry),
            store,
        }
    }

    /// The database.
    pub fn store(&self) -> &Store {
        &self.store
    }
}

#[compute_service]
impl TasksService for TasksBackend {
    async fn task(&self, id: Uuid) -> Result<Option<Arc<Task>>, ApiError> {
        Ok(self.store.get(id).await?.map(Arc::new))
    }

    /// The page's ids come from one query, its tasks from [`task`](TasksService::task): a
    /// change to a task invalidates the pages showing it, and only a change of membership
    /// (a task created, deleted, or moved to another status) invalidates the project's
    /// pages as a whole.
    async fn page(&self, q: ListQuery) -> Result<Arc<Page>, ApiError> {
        // Over RPC and the gateway the query is the client's: no page over `MAX_LIMIT`.
        q.validate()?;
        self.members(q.project).await;
        let (ids, next) = self.store.list_ids(q).await?;
        let mut items = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(task) = self.task(id).await? {
                items.push(Task::clone(&task));
            }
        }
        Ok(Arc::new(Page { items, next }))
    }

    /// Built on other computeds: the project, and one count per status.
    async fn summary(&self, project: Uuid) -> Result<Option<Summary>, ApiError> {
        if self.project(project).await?.is_none() {
            return Ok(None);
        }
        let mut counts = [0; 4];
        for (n, status) in counts.iter_mut().zip(Status::ALL) {
            *n = self.count(project, status).await?;
        }
        Ok(Some(Summary::from_counts(project, counts)))
    }

    async fn projects(&self) -> Result<Arc<Vec<Project>>, ApiError> {
        Ok(Arc::new(self.store.projects().await?))
    }
}

#[compute_service]
impl TasksBackend {
    /// Which tasks a project has (all projects for `None`): no value, only a dependency
    /// that the commands changing membership invalidate.
    #[compute]
    async fn members(&self, project: Option<Uuid>) {
        let _ = project;
    }

    /// How many of a project's tasks have `status`.
    #[compute]
    async fn count(&self, project: Uuid, status: Status) -> Result<u64, ApiError> {
        Ok(self.store.count(project, status).await?)
    }

    /// One project, or `None`.
    #[compute]
    async fn project(&self, id: Uuid) -> Result<Option<Project>, ApiError> {
        Ok(self.store.project(id).await?)
    }
}

impl TasksBackend {
    /// What a change of `project`'s membership invalidates.
    fn invalidate_membership(&self, project: Uuid, statuses: &[Status]) {
        self.invalidate_members(Some(project));
        self.invalidate_members(None);
        for s in statuses {
            self.invalidate_count(project, *s);
        }
    }
}

/// Creates a task. The host that runs it validates it and chooses its id and times: a
/// command carries what the client said and nothing the server owns, so that every way in
/// (the HTTP API, RPC from a browser, a future caller) gets the same answer.
#[derive(Serialize, Deserialize)]
pub struct CreateTask {
    /// The task as the client asked for it.
    pub new: NewTask,
}

/// Changes a task (its `updated_at` is the host's clock).
#[derive(Serialize, Deserialize)]
pub struct UpdateTask {
    /// The task.
    pub id: Uuid,
    /// What changes.
    pub patch: TaskPatch,
}

/// Deletes a task.
#[derive(Serialize, Deserialize)]
pub struct DeleteTask {
    /// The task.
    pub id: Uuid,
}

/// Creates a project (its id and time chosen by the host).
#[derive(Serialize, Deserialize)]
pub struct CreateProject {
    /// The project as the client asked for it.
    pub new: NewProject,
}

impl Command for CreateTask {
    const NAME: &'static str = "tasks.create";
    type Output = Task;
}

impl Command for UpdateTask {
    const NAME: &'static str = "tasks.update";
    type Output = Task;
}

impl Command for DeleteTask {
    const NAME: &'static str = "tasks.delete";
    type Output = Task;
}

impl Command for CreateProject {
    const NAME: &'static str = "tasks.create_project";
    type Output = Project;
}

/// Store errors as command errors; a field at fault travels as the error's detail, an
/// [`Invalid`] (read back by [`api_error`], here or in a remote tier).
fn command_error(e: StoreError) -> CommandError {
    match e {
        StoreError::Invalid(i) => {
            CommandError::rejected(format!("{}: {}", i.field, i.message)).with_detail(&i)
        }
        StoreError::Unknown(i) => {
            CommandError::not_found(format!("{}: {}", i.field, i.message)).with_detail(&i)
        }
        StoreError::Db(m) => CommandError::new(ErrorKind::Database, m),
        StoreError::Unavailable(m) => CommandError::new(ErrorKind::Unavailable, m),
    }
}

fn api_error(e: CommandError) -> ApiError {
    if e.sql_state() == Some(FOREIGN_KEY_VIOLATION) {
        // A task's only foreign key is its project (as `StoreError` reads it too).
        return ApiError::Unknown(Invalid::new("project", "no such project"));
    }
    match e.kind() {
        ErrorKind::Rejected => ApiError::Invalid(
            e.detail::<Invalid>()
                .unwrap_or_else(|| Invalid::new("body", e.message())),
        ),
        ErrorKind::NotFound => match e.detail::<Invalid>() {
            Some(field) => ApiError::Unknown(field),
            None => ApiError::NotFound(e.message().to_owned()),
        },
        ErrorKind::Unavailable => ApiError::unavailable(e),
        _ => ApiError::internal(e),
    }
}

/// A command's error as a stranger (an untrusted connection: a browser over `/rpc`) may see
/// it: what the command said of the caller's input (a refusal, a field not found, a bad
/// command, its rights or its rate) as it is; a failure of the server's own (the database,
/// a backend out of reach) as its kind and a reference only, the details logged under the
/// reference, as an HTTP error body has them. A project that does not exist (a foreign key
/// that found no row) is the caller's: said as such.
pub(crate) fn for_a_stranger(kind: &str, e: CommandError) -> CommandError {
    if e.sql_state() == Some(FOREIGN_KEY_VIOLATION) {
        let i = Invalid::new("project", "no such project");
        return CommandError::not_found(format!("{}: {}", i.field, i.message)).with_detail(&i);
    }
    // A command the caller sent that does not decode is its own fault; any other
    // `BadCommand` (an output that does not encode, a statement's parameters) is the
    // server's.
    let callers_own_bad_command = e.kind() == ErrorKind::BadCommand
        && e.message()
            .starts_with(&format!("{kind}: the command does not decode"));
    match e.kind() {
        ErrorKind::Rejected
        | ErrorKind::NotFound
        | ErrorKind::UnknownCommand
        | ErrorKind::Unauthorized
        | ErrorKind::RateLimited => e,
        ErrorKind::BadCommand if callers_own_bad_command => e,
        other => {
            let reference = crate::api::reference();
            tracing::error!(%reference, command = kind, error = %e, "a command failed");
            CommandError::new(
                other,
                format!("{kind}: internal error, reference {reference}"),
            )
        }
    }
}

/// PostgreSQL's SQLSTATE for a foreign key that finds no row.
const FOREIGN_KEY_VIOLATION: &str = "23503";

/// A field at fault, as the command's refusal, with the [`Invalid`] as its detail (read
/// back by [`api_error`]).
fn rejected(i: Invalid) -> CommandError {
    command_error(StoreError::Invalid(i))
}

fn not_found(id: Uuid) -> CommandError {
    CommandError::not_found(format!("task {id}"))
}

impl Handler<CreateTask> for TasksBackend {
    async fn execute(&self, c: &CreateTask, tx: &mut Tx<'_>) -> Result<Task, CommandError> {
        let t = c.new.clone().into_task(now_micros()).map_err(rejected)?;
        if let Some(db) = tx.sqlite() {
            lite::insert_task(db, &t).map_err(command_error)?;
            return Ok(t);
        }
        // The command's one write, deferred with its text: it goes with the operation's row
        // as one statement. A project that is not there fails it at the server (its
        // foreign key), which `api_error` answers as the unknown project.
        tx.defer_sql(
            &pg::insert_sql(),
            vec![
                Box::new(t.id),
                Box::new(t.project),
                Box::new(t.title.clone()),
                Box::new(t.description.clone()),
                Box::new(t.priority.code()),
                Box::new(t.status.code()),
                Box::new(t.assignee.clone()),
                Box::new(t.created_at),
                Box::new(t.updated_at),
            ],
        )
        .await?;
        Ok(t)
    }

    fn invalidate(&self, _: &CreateTask, task: &Task) {
        self.invalidate_task(task.id);
        self.invalidate_membership(task.project, &[task.status]);
    }
}

impl Handler<UpdateTask> for TasksBackend {
    async fn execute(&self, c: &UpdateTask, tx: &mut Tx<'_>) -> Result<Task, CommandError> {
        c.patch.validate().map_err(rejected)?;
        let now = now_micros();
        let updated = match tx.sqlite() {
            Some(db) => lite::update_task(db, c.id, &c.patch, now).map_err(command_error)?,
            // The write and the operation's row as one statement, its answer the output.
            None => {
                tx.finish_sql(
                    pg::update_json_sql(),
                    pg::update_params(c.id, &c.patch, now),
                )
                .await?
            }
        };
        updated.ok_or_else(|| not_found(c.id))
    }

    /// The task; and when its status may have changed, the lists and counts of its
    /// project (the old status is not known here: every count of the project).
    fn invalidate(&self, c: &UpdateTask, task: &Task) {
        self.invalidate_task(c.id);
        if c.patch.moves() {
            self.invalidate_membership(task.project, &Status::ALL);
        }
    }
}

impl Handler<DeleteTask> for TasksBackend {
    async fn execute(&self, c: &DeleteTask, tx: &mut Tx<'_>) -> Result<Task, CommandError> {
        let deleted = match tx.sqlite() {
            Some(db) => lite::delete_task(db, c.id).map_err(command_error)?,
            None => {
                tx.finish_sql(pg::delete_json_sql(), vec![Box::new(c.id)])
                    .await?
            }
        };
        deleted.ok_or_else(|| not_found(c.id))
    }

    fn invalidate(&self, c: &DeleteTask, task: &Task) {
        self.invalidate_task(c.id);
        self.invalidate_membership(task.project, &[task.status]);
    }
}

impl Handler<CreateProject> for TasksBackend {
    async fn execute(&self, c: &CreateProject, tx: &mut Tx<'_>) -> Result<Project, CommandError> {
        let p = c.new.clone().into_project(now_micros()).map_err(rejected)?;
        match tx.postgres() {
            Some(db) => pg::insert_project(db, &p).await,
            None => lite::insert_project(tx.require_sqlite()?, &p),
        }
        .map_err(command_error)?;
        Ok(p)
    }

    fn invalidate(&self, _: &CreateProject, project: &Project) {
        self.invalidate_projects();
        self.invalidate_project(project.id);
        self.invalidate_summary(project.id);
    }
}

/// Registers the handlers of every command of the Tasks API on a host.
pub fn commands(
    builder: coherent::ops::HostBuilder,
    backend: &TasksBackend,
) -> coherent::ops::HostBuilder {
    builder
        .command::<CreateTask>(backend.clone())
        .command::<UpdateTask>(backend.clone())
        .command::<DeleteTask>(backend.clone())
        .command::<CreateProject>(backend.clone())
}

/// The HTTP tier's cache: each answer's JSON and entity tag, computed from the replicas
/// (or, in the backend's process, from its results).
#[derive(Clone, ComputeService)]
pub struct Views {
    handle: ServiceHandle,
    api: Source,
}

/// What [`Views`] are computed from.
#[derive(Clone)]
enum Source {
    /// Replicas of a backend's results.
    Remote(TasksServiceClient),
    /// The backend's results, in this process.
    Local(TasksBackend),
}

impl Source {
    async fn task(&self, id: Uuid) -> Result<Option<Arc<Task>>, ApiError> {
        match self {
            Self::Remote(c) => c.task(id).await,
            Self::Local(b) => b.task(id).await,
        }
    }

    async fn page(&self, q: ListQuery) -> Result<Arc<Page>, ApiError> {
        match self {
            Self::Remote(c) => c.page(q).await,
            Self::Local(b) => b.page(q).await,
        }
    }

    async fn summary(&self, project: Uuid) -> Result<Option<Summary>, ApiError> {
        match self {
            Self::Remote(c) => c.summary(project).await,
            Self::Local(b) => b.summary(project).await,
        }
    }

    async fn projects(&self) -> Result<Arc<Vec<Project>>, ApiError> {
        match self {
            Self::Remote(c) => c.projects().await,
            Self::Local(b) => b.projects().await,
        }
    }
}

#[compute_service]
impl Views {
    /// A list page, as sent.
    #[compute]
    pub async fn page_body(&self, q: ListQuery) -> Result<Body, ApiError> {
        Body::tagged(&*self.api.page(q).await?)
    }

    /// A task, as sent.
    #[compute]
    pub async fn task_body(&self, id: Uuid) -> Result<Body, ApiError> {
        match self.api.task(id).await? {
            Some(task) => Body::tagged(&*task),
            None => Err(ApiError::NotFound(format!("task {id}"))),
        }
    }

    /// A summary, as sent.
    #[compute]
    pub async fn summary_body(&self, project: Uuid) -> Result<Body, ApiError> {
        match self.api.summary(project).await? {
            Some(summary) => Body::tagged(&summary),
            None => Err(ApiError::NotFound(format!("project {project}"))),
        }
    }

    /// The projects, as sent.
    #[compute]
    pub async fn projects_body(&self) -> Result<Body, ApiError> {
        Body::tagged(&*self.api.projects().await?)
    }
}

/// An HTTP tier of the `coherent` backend: reads from the backend's compute service, writes
/// as its commands. Over one connection to a backend in another process (replicas kept
/// coherent by its pushed invalidations, commands over RPC), or in the backend's own
/// process ([`LiveTier::in_process`]: the tier calls the compute service and runs commands
/// on the host directly, with no socket and no replica between).
pub struct LiveTier<C> {
    views: Views,
    commands: Commands<C>,
}

/// Where a tier's commands run.
enum Commands<C> {
    /// On a backend at the other end of a connection.
    Remote(CommandClient<C>),
    /// On the host of this process.
    Local(coherent::ops::Host),
}

impl<C: Caller> Commands<C> {
    async fn run<K: Command>(&self, command: K) -> Result<K::Output, ApiError> {
        match self {
            Self::Remote(client) => client.run(&command).await,
            Self::Local(host) => host.run(command).await,
        }
        .map_err(api_error)
    }
}

impl LiveTier<Reconnecting> {
    /// A tier over `client`'s connection, its cache in `registry`.
    pub fn new(client: RemoteClient, registry: &Registry) -> Self {
        let commands = Commands::Remote(CommandClient::new(client.caller()));
        Self {
            views: Views {
                handle: ServiceHandle::with_registry(registry),
                api: Source::Remote(TasksServiceClient::new(client)),
            },
            commands,
        }
    }

    /// A tier in the process of `backend`, whose commands `host` runs: its views are
    /// computed from `backend`'s results in the same registry, so a command's
    /// invalidation reaches them before `host.run` returns, as it reaches the backend's.
    pub fn in_process(backend: &TasksBackend, host: &coherent::ops::Host) -> Self {
        Self {
            views: Views {
                handle: ServiceHandle::with_registry(backend.handle.registry()),
                api: Source::Local(backend.clone()),
            },
            commands: Commands::Local(host.clone()),
        }
    }
}

impl<C: Caller + Send + Sync + 'static> Backend for LiveTier<C> {
    async fn list(&self, q: ListQuery) -> Result<Body, ApiError> {
        self.views.page_body(q).await
    }

    async fn task(&self, id: Uuid) -> Result<Body, ApiError> {
        self.views.task_body(id).await
    }

    async fn summary(&self, project: Uuid) -> Result<Body, ApiError> {
        self.views.summary_body(project).await
    }

    async fn projects(&self) -> Result<Body, ApiError> {
        self.views.projects_body().await
    }

    async fn create(&self, new: NewTask) -> Result<Task, ApiError> {
        self.commands.run(CreateTask { new }).await
    }

    async fn update(&self, id: Uuid, patch: TaskPatch) -> Result<Task, ApiError> {
        self.commands.run(UpdateTask { id, patch }).await
    }

    async fn delete(&self, id: Uuid) -> Result<(), ApiError> {
        self.commands.run(DeleteTask { id }).await?;
        Ok(())
    }

    async fn create_project(&self, new: NewProject) -> Result<Project, ApiError> {
        self.commands.run(CreateProject { new }).await
    }
}

#[cfg(test)]
mod tests {
    use super::{for_a_stranger, CommandError, ErrorKind};

    #[test]
    fn a_stranger_sees_its_own_faults_and_only_a_reference_to_the_servers() {
        let own = CommandError::rejected("title: too long");
        assert_eq!(for_a_stranger("tasks.create", own.clone()), own);
        let leak = CommandError::new(
            ErrorKind::Database,
            "relation \"tasks\" does not exist at /srv/tasks/data/tasks.db",
        );
        let seen = for_a_stranger("tasks.create", leak);
        assert_eq!(seen.kind(), ErrorKind::Database);
        assert!(seen.message().contains("reference"), "{seen}");
        assert!(!seen.message().contains("relation"), "{seen}");
        assert!(!seen.message().contains("/srv"), "{seen}");
    }
}
