//! The `grpc` backend: the HTTP tier ([`GrpcTier`]) calls a tonic service ([`GrpcServer`])
//! over loopback, and that service queries the database, as the seed's design does at its
//! tuned settings: ids as 16 bytes, priority and status as enums, times as int64 µs,
//! `TCP_NODELAY`, an adaptive HTTP/2 window with a 1 MiB connection window, HTTP/2
//! keep-alive pings every 30 s, and one cloneable client (no lock) shared by every request.
//!
//! Errors travel as gRPC statuses: `INVALID_ARGUMENT` with the message `field: message`
//! and the field in the [`FIELD_METADATA`] entry, `NOT_FOUND`, `UNAVAILABLE`, `INTERNAL`.
//! The tier turns them back into the same [`ApiError`]s the `direct` backend answers.

// tonic's `Status` is large by design; its API returns it everywhere.
#![allow(clippy::result_large_err)]

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use tonic::metadata::MetadataValue;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Response};
use uuid::Uuid;

use crate::api::{ApiError, Backend, Body};
use crate::model::{
    now_micros, Invalid, ListQuery, NewProject, NewTask, Page, Priority, Project, Status, Summary,
    Task, TaskPatch, DEFAULT_LIMIT, MAX_LIMIT,
};
use crate::store::{Store, StoreError};

/// The code generated from `proto/tasks.proto`: the messages, the `Tasks` service's server
/// trait ([`pb::tasks_server::Tasks`]) and its client ([`pb::tasks_client::TasksClient`]).
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub mod pb {
    tonic::include_proto!("tasks");
}

use pb::tasks_client::TasksClient;
use pb::tasks_server::{Tasks, TasksServer};

/// The metadata entry of an `INVALID_ARGUMENT` status that names the field at fault.
pub const FIELD_METADATA: &str = "x-field";

/// The HTTP/2 connection window of the tier's channel and the backend's server.
const CONNECTION_WINDOW: u32 = 1 << 20;
/// How often an idle HTTP/2 connection is pinged.
const KEEP_ALIVE: Duration = Duration::from_secs(30);
/// The largest message either side accepts (a page of 100 tasks of 10,000-character
/// descriptions can pass tonic's default of 4 MiB).
const MAX_MESSAGE: usize = 16 << 20;

// ---------------------------------------------------------------------------------------
// Conversions between the model and the proto messages.

/// A UUID as its 16 bytes.
pub fn id_to_pb(id: Uuid) -> Bytes {
    Bytes::copy_from_slice(id.as_bytes())
}

/// A UUID from its 16 bytes; any other length is an error naming `field`.
pub fn id_from_pb(field: &str, bytes: &[u8]) -> Result<Uuid, Invalid> {
    Uuid::from_slice(bytes).map_err(|_| {
        Invalid::new(
            field,
            format!("must be 16 bytes (a UUID), not {}", bytes.len()),
        )
    })
}

/// A priority as its proto enum value.
pub fn priority_to_pb(p: Priority) -> i32 {
    let p = match p {
        Priority::Low => pb::Priority::Low,
        Priority::Medium => pb::Priority::Medium,
        Priority::High => pb::Priority::High,
        Priority::Urgent => pb::Priority::Urgent,
    };
    p as i32
}

/// A priority from its proto enum value; an unknown value is an error naming `field`.
pub fn priority_from_pb(field: &str, value: i32) -> Result<Priority, Invalid> {
    match pb::Priority::try_from(value) {
        Ok(pb::Priority::Low) => Ok(Priority::Low),
        Ok(pb::Priority::Medium) => Ok(Priority::Medium),
        Ok(pb::Priority::High) => Ok(Priority::High),
        Ok(pb::Priority::Urgent) => Ok(Priority::Urgent),
        Err(_) => Err(Invalid::new(
            field,
            format!("{value} is not a known priority"),
        )),
    }
}

/// A status as its proto enum value.
pub fn status_to_pb(s: Status) -> i32 {
    let s = match s {
        Status::Todo => pb::Status::Todo,
        Status::InProgress => pb::Status::InProgress,
        Status::Done => pb::Status::Done,
        Status::Cancelled => pb::Status::Cancelled,
    };
    s as i32
}

/// A status from its proto enum value; an unknown value is an error naming `field`.
pub fn status_from_pb(field: &str, value: i32) -> Result<Status, Invalid> {
    match pb::Status::try_from(value) {
        Ok(pb::Status::Todo) => Ok(Status::Todo),
        Ok(pb::Status::InProgress) => Ok(Status::InProgress),
        Ok(pb::Status::Done) => Ok(Status::Done),
        Ok(pb::Status::Cancelled) => Ok(Status::Cancelled),
        Err(_) => Err(Invalid::new(
            field,
            format!("{value} is not a known status"),
        )),
    }
}

fn opt_id_from_pb(field: &str, bytes: Option<&Bytes>) -> Result<Option<Uuid>, Invalid> {
    bytes.map(|b| id_from_pb(field, b)).transpose()
}

/// A task as its proto message.
pub fn task_to_pb(t: Task) -> pb::Task {
    pb::Task {
        id: id_to_pb(t.id),
        project: id_to_pb(t.project),
        title: t.title,
        description: t.description,
        priority: priority_to_pb(t.priority),
        status: status_to_pb(t.status),
        assignee: t.assignee,
        created_at: t.created_at,
        updated_at: t.updated_at,
    }
}

/// A task from its proto message; a bad id or enum value is an error naming the field.
pub fn task_from_pb(t: pb::Task) -> Result<Task, Invalid> {
    Ok(Task {
        id: id_from_pb("id", &t.id)?,
        project: id_from_pb("project", &t.project)?,
        title: t.title,
        description: t.description,
        priority: priority_from_pb("priority", t.priority)?,
        status: status_from_pb("status", t.status)?,
        assignee: t.assignee,
        created_at: t.created_at,
        updated_at: t.updated_at,
    })
}

/// A project as its proto message.
pub fn project_to_pb(p: Project) -> pb::Project {
    pb::Project {
        id: id_to_pb(p.id),
        name: p.name,
        created_at: p.created_at,
    }
}

/// A project from its proto message; a bad id is an error naming `id`.
pub fn project_from_pb(p: pb::Project) -> Result<Project, Invalid> {
    Ok(Project {
        id: id_from_pb("id", &p.id)?,
        name: p.name,
        created_at: p.created_at,
    })
}

/// A list query as its proto request.
pub fn query_to_pb(q: ListQuery) -> pb::ListTasksRequest {
    pb::ListTasksRequest {
        project: q.project.map(id_to_pb),
        status: q.status.map(status_to_pb),
        limit: q.limit,
        after: q.after.map(id_to_pb),
    }
}

/// A list query from its proto request: a limit of 0 (unset) is [`DEFAULT_LIMIT`], one over
/// [`MAX_LIMIT`] is an error naming `limit`.
pub fn query_from_pb(q: &pb::ListTasksRequest) -> Result<ListQuery, Invalid> {
    let limit = match q.limit {
        0 => DEFAULT_LIMIT,
        n if n <= MAX_LIMIT => n,
        _ => return Err(Invalid::new("limit", format!("must be 1 to {MAX_LIMIT}"))),
    };
    Ok(ListQuery {
        project: opt_id_from_pb("project", q.project.as_ref())?,
        status: q.status.map(|s| status_from_pb("status", s)).transpose()?,
        limit,
        after: opt_id_from_pb("after", q.after.as_ref())?,
    })
}

/// A page as its proto message.
pub fn page_to_pb(p: Page) -> pb::Page {
    pb::Page {
        items: p.items.into_iter().map(task_to_pb).collect(),
        next: p.next.map(id_to_pb),
    }
}

/// A page from its proto message.
pub fn page_from_pb(p: pb::Page) -> Result<Page, Invalid> {
    Ok(Page {
        items: p
            .items
            .into_iter()
            .map(task_from_pb)
            .collect::<Result<_, _>>()?,
        next: opt_id_from_pb("next", p.next.as_ref())?,
    })
}

/// A summary as its proto message.
pub fn summary_to_pb(s: Summary) -> pb::SummaryReply {
    pb::SummaryReply {
        project: id_to_pb(s.project),
        total: s.total,
        todo: s.todo,
        in_progress: s.in_progress,
        done: s.done,
        cancelled: s.cancelled,
    }
}

/// A summary from its proto message.
pub fn summary_from_pb(s: pb::SummaryReply) -> Result<Summary, Invalid> {
    Ok(Summary {
        project: id_from_pb("project", &s.project)?,
        total: s.total,
        todo: s.todo,
        in_progress: s.in_progress,
        done: s.done,
        cancelled: s.cancelled,
    })
}

/// A new task as its proto message.
pub fn new_task_to_pb(n: NewTask) -> pb::NewTask {
    pb::NewTask {
        project: id_to_pb(n.project),
        title: n.title,
        description: n.description,
        priority: n.priority.map(priority_to_pb),
        status: n.status.map(status_to_pb),
        assignee: n.assignee,
    }
}

/// A new task from its proto message.
pub fn new_task_from_pb(n: pb::NewTask) -> Result<NewTask, Invalid> {
    Ok(NewTask {
        project: id_from_pb("project", &n.project)?,
        title: n.title,
        description: n.description,
        priority: n
            .priority
            .map(|p| priority_from_pb("priority", p))
            .transpose()?,
        status: n.status.map(|s| status_from_pb("status", s)).transpose()?,
        assignee: n.assignee,
    })
}

/// A patch as its proto message: clearing the assignee is `clear_assignee`.
pub fn patch_to_pb(p: TaskPatch) -> pb::TaskPatch {
    let (assignee, clear_assignee) = match p.assignee {
        None => (None, false),
        Some(None) => (None, true),
        Some(Some(a)) => (Some(a), false),
    };
    pb::TaskPatch {
        title: p.title,
        description: p.description,
        priority: p.priority.map(priority_to_pb),
        status: p.status.map(status_to_pb),
        assignee,
        clear_assignee,
    }
}

/// A patch from its proto message: `clear_assignee` clears it, whatever `assignee` says.
pub fn patch_from_pb(p: pb::TaskPatch) -> Result<TaskPatch, Invalid> {
    Ok(TaskPatch {
        title: p.title,
        description: p.description,
        priority: p
            .priority
            .map(|v| priority_from_pb("priority", v))
            .transpose()?,
        status: p.status.map(|v| status_from_pb("status", v)).transpose()?,
        assignee: if p.clear_assignee {
            Some(None)
        } else {
            p.assignee.map(Some)
        },
    })
}

// ---------------------------------------------------------------------------------------
// Errors as statuses, and back.

/// `INVALID_ARGUMENT` with the message `field: message` and the field in
/// [`FIELD_METADATA`].
pub fn invalid_status(i: &Invalid) -> tonic::Status {
    let mut status = tonic::Status::invalid_argument(format!("{}: {}", i.field, i.message));
    if let Ok(v) = MetadataValue::try_from(i.field.as_str()) {
        status.metadata_mut().insert(FIELD_METADATA, v);
    }
    status
}

/// `NOT_FOUND` caused by a field (a new task's unknown project): the field in
/// [`FIELD_METADATA`], the message as is.
fn unknown_status(i: &Invalid) -> tonic::Status {
    let mut status = tonic::Status::not_found(i.message.clone());
    if let Ok(v) = MetadataValue::try_from(i.field.as_str()) {
        status.metadata_mut().insert(FIELD_METADATA, v);
    }
    status
}

fn store_status(e: StoreError) -> tonic::Status {
    match e {
        StoreError::Invalid(i) => invalid_status(&i),
        StoreError::Unknown(i) => unknown_status(&i),
        // The database's words stay in this process's log.
        StoreError::Db(m) => {
            tonic::Status::internal(ApiError::internal(format_args!("database: {m}")).to_string())
        }
        StoreError::Unavailable(m) => tonic::Status::unavailable(
            ApiError::unavailable(format_args!("database: {m}")).to_string(),
        ),
    }
}

/// The [`ApiError`] a status from the backend stands for: `INVALID_ARGUMENT` is a 400
/// naming the field, `NOT_FOUND` a 404 (naming the field when it says one), `UNAVAILABLE` a
/// 503, anything else a 500.
pub fn api_error(s: &tonic::Status) -> ApiError {
    match s.code() {
        Code::InvalidArgument => {
            let message = s.message();
            let field = s
                .metadata()
                .get(FIELD_METADATA)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let (field, message) = match field {
                Some(f) => {
                    let rest = message
                        .strip_prefix(f.as_str())
                        .and_then(|m| m.strip_prefix(": "))
                        .unwrap_or(message);
                    (f, rest.to_owned())
                }
                None => match message.split_once(": ") {
                    Some((f, m)) => (f.to_owned(), m.to_owned()),
                    None => ("body".to_owned(), message.to_owned()),
                },
            };
            ApiError::Invalid(Invalid::new(field, message))
        }
        Code::NotFound => match s.metadata().get(FIELD_METADATA).map(|v| v.to_str()) {
            Some(Ok(field)) => ApiError::Unknown(Invalid::new(field, s.message())),
            _ => ApiError::NotFound(s.message().to_owned()),
        },
        Code::Unavailable => ApiError::unavailable(s.message()),
        code => ApiError::internal(format_args!("gRPC backend: {code:?}: {}", s.message())),
    }
}

/// A reply the backend should not have sent (a bad id or enum): a 500, not the client's
/// fault.
fn bad_reply(i: Invalid) -> ApiError {
    ApiError::internal(format_args!(
        "the gRPC backend answered a bad {}: {}",
        i.field, i.message
    ))
}

// ---------------------------------------------------------------------------------------
// The service.

/// The `Tasks` gRPC service over a [`Store`]: the same queries the `direct` backend makes.
#[derive(Clone)]
pub struct GrpcServer {
    store: Store,
}

impl GrpcServer {
    /// A service over `store`.
    pub fn new(store: Store) -> Self {
        Self { store }
    }

    /// It as a tonic service, with the message limits the tier uses.
    pub fn into_service(self) -> TasksServer<Self> {
        TasksServer::new(self)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE)
    }
}

type Reply<T> = Result<Response<T>, tonic::Status>;

#[tonic::async_trait]
impl Tasks for GrpcServer {
    async fn list_tasks(&self, r: Request<pb::ListTasksRequest>) -> Reply<pb::Page> {
        let q = query_from_pb(r.get_ref()).map_err(|i| invalid_status(&i))?;
        let page = self.store.list(q).await.map_err(store_status)?;
        Ok(Response::new(page_to_pb(page)))
    }

    async fn get_task(&self, r: Request<pb::TaskId>) -> Reply<pb::Task> {
        let id = id_from_pb("id", &r.get_ref().id).map_err(|i| invalid_status(&i))?;
        match self.store.get(id).await.map_err(store_status)? {
            Some(t) => Ok(Response::new(task_to_pb(t))),
            None => Err(tonic::Status::not_found(format!("task {id}"))),
        }
    }

    async fn summary(&self, r: Request<pb::ProjectId>) -> Reply<pb::SummaryReply> {
        let project = id_from_pb("id", &r.get_ref().id).map_err(|i| invalid_status(&i))?;
        if self
            .store
            .project(project)
            .await
            .map_err(store_status)?
            .is_none()
        {
            return Err(tonic::Status::not_found(format!("project {project}")));
        }
        let counts = self.store.counts(project).await.map_err(store_status)?;
        Ok(Response::new(summary_to_pb(Summary::from_counts(
            project, counts,
        ))))
    }

    async fn list_projects(&self, _: Request<pb::ListProjectsRequest>) -> Reply<pb::ProjectList> {
        let projects = self.store.projects().await.map_err(store_status)?;
        Ok(Response::new(pb::ProjectList {
            items: projects.into_iter().map(project_to_pb).collect(),
        }))
    }

    async fn create_task(&self, r: Request<pb::NewTask>) -> Reply<pb::Task> {
        let new = new_task_from_pb(r.into_inner()).map_err(|i| invalid_status(&i))?;
        let task = new
            .into_task(now_micros())
            .map_err(|i| invalid_status(&i))?;
        let task = self.store.insert_task(task).await.map_err(store_status)?;
        Ok(Response::new(task_to_pb(task)))
    }

    async fn update_task(&self, r: Request<pb::UpdateTaskRequest>) -> Reply<pb::Task> {
        let r = r.into_inner();
        let id = id_from_pb("id", &r.id).map_err(|i| invalid_status(&i))?;
        let patch = patch_from_pb(r.patch.unwrap_or_default()).map_err(|i| invalid_status(&i))?;
        match self
            .store
            .update_task(id, patch, now_micros())
            .await
            .map_err(store_status)?
        {
            Some(t) => Ok(Response::new(task_to_pb(t))),
            None => Err(tonic::Status::not_found(format!("task {id}"))),
        }
    }

    async fn delete_task(&self, r: Request<pb::TaskId>) -> Reply<pb::Deleted> {
        let id = id_from_pb("id", &r.get_ref().id).map_err(|i| invalid_status(&i))?;
        match self.store.delete_task(id).await.map_err(store_status)? {
            Some(_) => Ok(Response::new(pb::Deleted {})),
            None => Err(tonic::Status::not_found(format!("task {id}"))),
        }
    }

    async fn create_project(&self, r: Request<pb::NewProject>) -> Reply<pb::Project> {
        let new = NewProject {
            name: r.into_inner().name,
        };
        let project = new
            .into_project(now_micros())
            .map_err(|i| invalid_status(&i))?;
        let project = self
            .store
            .insert_project(project)
            .await
            .map_err(store_status)?;
        Ok(Response::new(project_to_pb(project)))
    }
}

/// Serves the `Tasks` gRPC service over `store` on `listener` (accepted connections get
/// `TCP_NODELAY`) until the server fails.
pub async fn serve_grpc(store: Store, listener: tokio::net::TcpListener) -> anyhow::Result<()> {
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_adaptive_window(Some(true))
        .initial_connection_window_size(CONNECTION_WINDOW)
        .http2_keepalive_interval(Some(KEEP_ALIVE))
        .add_service(GrpcServer::new(store).into_service())
        .serve_with_incoming(incoming)
        .await
        .context("serving gRPC")
}

// ---------------------------------------------------------------------------------------
// The tier.

/// The HTTP tier of the `grpc` backend: each request is a call to the `Tasks` service on a
/// shared HTTP/2 channel (the client is cloned per call, never locked).
#[derive(Clone)]
pub struct GrpcTier {
    client: TasksClient<Channel>,
}

impl GrpcTier {
    /// Connects to the `Tasks` service at `addr` with the seed's tuning: `TCP_NODELAY`, an
    /// adaptive HTTP/2 window, a 1 MiB connection window, keep-alive pings every 30 s.
    pub async fn connect(addr: SocketAddr) -> anyhow::Result<Self> {
        let channel = Endpoint::from_shared(format!("http://{addr}"))?
            .tcp_nodelay(true)
            .http2_adaptive_window(true)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .http2_keep_alive_interval(KEEP_ALIVE)
            .connect()
            .await
            .with_context(|| format!("connecting to the gRPC backend at {addr}"))?;
        Ok(Self::new(channel))
    }

    /// A tier on an already made `channel`.
    pub fn new(channel: Channel) -> Self {
        Self {
            client: TasksClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        }
    }

    fn client(&self) -> TasksClient<Channel> {
        self.client.clone()
    }
}

impl Backend for GrpcTier {
    async fn list(&self, q: ListQuery) -> Result<Body, ApiError> {
        let page = self
            .client()
            .list_tasks(query_to_pb(q))
            .await
            .map_err(|s| api_error(&s))?
            .into_inner();
        Body::json(&page_from_pb(page).map_err(bad_reply)?)
    }

    async fn task(&self, id: Uuid) -> Result<Body, ApiError> {
        let task = self
            .client()
            .get_task(pb::TaskId { id: id_to_pb(id) })
            .await
            .map_err(|s| api_error(&s))?
            .into_inner();
        Body::json(&task_from_pb(task).map_err(bad_reply)?)
    }

    async fn summary(&self, project: Uuid) -> Result<Body, ApiError> {
        let summary = self
            .client()
            .summary(pb::ProjectId {
                id: id_to_pb(project),
            })
            .await
            .map_err(|s| api_error(&s))?
            .into_inner();
        Body::json(&summary_from_pb(summary).map_err(bad_reply)?)
    }

    async fn projects(&self) -> Result<Body, ApiError> {
        let list = self
            .client()
            .list_projects(pb::ListProjectsRequest {})
            .await
            .map_err(|s| api_error(&s))?
            .into_inner();
        let projects = list
            .items
            .into_iter()
            .map(project_from_pb)
            .collect::<Result<Vec<_>, _>>()
            .map_err(bad_reply)?;
        Body::json(&projects)
    }

    async fn create(&self, new: NewTask) -> Result<Task, ApiError> {
        let task = self
            .client()
            .create_task(new_task_to_pb(new))
            .await
            .map_err(|s| api_error(&s))?
            .into_inner();
        task_from_pb(task).map_err(bad_reply)
    }

    async fn update(&self, id: Uuid, patch: TaskPatch) -> Result<Task, ApiError> {
        let task = self
            .client()
            .update_task(pb::UpdateTaskRequest {
                id: id_to_pb(id),
                patch: Some(patch_to_pb(patch)),
            })
            .await
            .map_err(|s| api_error(&s))?
            .into_inner();
        task_from_pb(task).map_err(bad_reply)
    }

    async fn delete(&self, id: Uuid) -> Result<(), ApiError> {
        self.client()
            .delete_task(pb::TaskId { id: id_to_pb(id) })
            .await
            .map_err(|s| api_error(&s))?;
        Ok(())
    }

    async fn create_project(&self, new: NewProject) -> Result<Project, ApiError> {
        let project = self
            .client()
            .create_project(pb::NewProject { name: new.name })
            .await
            .map_err(|s| api_error(&s))?
            .into_inner();
        project_from_pb(project).map_err(bad_reply)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::new_id;

    fn task() -> Task {
        Task {
            id: new_id(1_700_000_000_000_000),
            project: new_id(1_600_000_000_000_000),
            title: "Write it".into(),
            description: "All of it.".into(),
            priority: Priority::High,
            status: Status::InProgress,
            assignee: Some("ana".into()),
            created_at: 1_700_000_000_000_000,
            updated_at: 1_700_000_000_000_123,
        }
    }

    #[test]
    fn enums_round_trip() {
        for p in Priority::ALL {
            assert_eq!(priority_from_pb("priority", priority_to_pb(p)), Ok(p));
            // The proto's values are the stored codes.
            assert_eq!(priority_to_pb(p), i32::from(p.code()));
        }
        for s in Status::ALL {
            assert_eq!(status_from_pb("status", status_to_pb(s)), Ok(s));
            assert_eq!(status_to_pb(s), i32::from(s.code()));
        }
        assert_eq!(
            priority_from_pb("priority", 4).unwrap_err().field,
            "priority"
        );
        assert_eq!(status_from_pb("status", -1).unwrap_err().field, "status");
    }

    #[test]
    fn ids_round_trip_and_bad_lengths_are_errors() {
        let id = new_id(now_micros());
        assert_eq!(id_to_pb(id).len(), 16);
        assert_eq!(id_from_pb("id", &id_to_pb(id)), Ok(id));
        assert_eq!(id_from_pb("id", &[0; 16]), Ok(Uuid::nil()));
        for len in [0, 15, 17, 36] {
            let e = id_from_pb("project", &vec![7; len]).unwrap_err();
            assert_eq!(e.field, "project");
        }
        let mut t = task_to_pb(task());
        t.id = Bytes::from_static(&[1; 15]);
        assert_eq!(task_from_pb(t).unwrap_err().field, "id");
    }

    #[test]
    fn messages_round_trip() {
        let t = task();
        assert_eq!(task_from_pb(task_to_pb(t.clone())), Ok(t.clone()));
        let unassigned = Task {
            assignee: None,
            ..t.clone()
        };
        assert_eq!(
            task_from_pb(task_to_pb(unassigned.clone())),
            Ok(unassigned.clone())
        );
        let page = Page {
            items: vec![t.clone(), unassigned],
            next: Some(t.id),
        };
        assert_eq!(page_from_pb(page_to_pb(page.clone())), Ok(page));
        let project = Project {
            id: t.project,
            name: "P".into(),
            created_at: 5,
        };
        assert_eq!(project_from_pb(project_to_pb(project.clone())), Ok(project));
        let summary = Summary::from_counts(t.project, [1, 2, 3, 4]);
        assert_eq!(summary_from_pb(summary_to_pb(summary.clone())), Ok(summary));
        for q in [
            ListQuery {
                project: Some(t.project),
                status: Some(Status::Done),
                limit: 7,
                after: Some(t.id),
            },
            ListQuery {
                project: None,
                status: None,
                limit: MAX_LIMIT,
                after: None,
            },
        ] {
            assert_eq!(query_from_pb(&query_to_pb(q)), Ok(q));
        }
        let mut q = query_to_pb(ListQuery {
            project: None,
            status: None,
            limit: 1,
            after: None,
        });
        q.limit = 0;
        assert_eq!(query_from_pb(&q).map(|q| q.limit), Ok(DEFAULT_LIMIT));
        q.limit = MAX_LIMIT + 1;
        assert_eq!(query_from_pb(&q).unwrap_err().field, "limit");
    }

    #[test]
    fn patches_tell_clear_from_keep() {
        for assignee in [None, Some(None), Some(Some("bo".to_owned()))] {
            let p = TaskPatch {
                title: Some("t".into()),
                description: None,
                priority: Some(Priority::Urgent),
                status: Some(Status::Cancelled),
                assignee,
            };
            assert_eq!(patch_from_pb(patch_to_pb(p.clone())), Ok(p));
        }
        assert!(
            patch_to_pb(TaskPatch {
                assignee: Some(None),
                ..TaskPatch::default()
            })
            .clear_assignee
        );
        let new = NewTask {
            project: Uuid::nil(),
            title: "x".into(),
            description: String::new(),
            priority: None,
            status: Some(Status::Todo),
            assignee: None,
        };
        let back = new_task_from_pb(new_task_to_pb(new)).unwrap();
        assert_eq!((back.priority, back.status), (None, Some(Status::Todo)));
    }

    #[test]
    fn statuses_map_to_api_errors() {
        let e = api_error(&invalid_status(&Invalid::new("title", "must not be blank")));
        assert_eq!(e, ApiError::invalid("title", "must not be blank"));
        // Without the metadata, the field is read from the message.
        let e = api_error(&tonic::Status::invalid_argument("limit: must be 1 to 100"));
        assert_eq!(e, ApiError::invalid("limit", "must be 1 to 100"));
        assert_eq!(
            api_error(&tonic::Status::not_found("task x")),
            ApiError::NotFound("task x".into())
        );
        assert!(matches!(
            api_error(&tonic::Status::unavailable("down")),
            ApiError::Unavailable(_)
        ));
        assert!(matches!(
            api_error(&tonic::Status::internal("boom")),
            ApiError::Internal(_)
        ));
        assert!(matches!(
            api_error(&store_status(StoreError::Db("gone".into()))),
            ApiError::Internal(_)
        ));
        assert_eq!(
            api_error(&store_status(StoreError::Invalid(Invalid::new(
                "project",
                "no such project"
            )))),
            ApiError::invalid("project", "no such project")
        );
    }
}
