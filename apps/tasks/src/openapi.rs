//! The OpenAPI 3.1 document of the API, served at `/api/openapi.json`.
//!
//! The routes' handlers are generic over the backend, so the operations are described on
//! the functions below, which exist only to carry the descriptions (utoipa reads their
//! attributes). `tests/api.rs` checks that every route of the router is in the document.

use std::sync::OnceLock;

use axum::http::{header, HeaderValue};
use axum::response::IntoResponse;
use utoipa::OpenApi;

use crate::api::ErrorBody;
use crate::model::{
    NewProject, NewTask, Page, Priority, Project, Status, Summary, Task, TaskPatch,
};
use crate::session::{Login, User};

/// The document.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Tasks API",
        description = "Tasks grouped in projects, served by Coherent (or directly, or through gRPC).",
        version = "0.1.0"
    ),
    paths(
        list_tasks,
        create_task,
        get_task,
        update_task,
        delete_task,
        list_projects,
        create_project,
        project_summary,
        log_in,
        who_am_i,
        log_out
    ),
    components(schemas(
        Task, Project, Summary, Page, NewTask, TaskPatch, NewProject, Priority, Status, ErrorBody,
        Login, User
    )),
    modifiers(&SessionCookie)
)]
pub struct ApiDoc;

/// The login cookie as a security scheme: what the writes require (`tasks serve`'s
/// default; with `--auth off` nothing is required).
struct SessionCookie;

impl utoipa::Modify for SessionCookie {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{ApiKey, ApiKeyValue, SecurityScheme};
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "session",
            SecurityScheme::ApiKey(ApiKey::Cookie(ApiKeyValue::with_description(
                crate::session::COOKIE,
                "Set by POST /api/session (named __Host-tasks_session when the server runs with --secure-cookie)",
            ))),
        );
    }
}

/// The document as JSON.
pub fn document() -> String {
    ApiDoc::openapi()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

pub(crate) async fn serve() -> impl IntoResponse {
    static DOC: OnceLock<String> = OnceLock::new();
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        DOC.get_or_init(document).as_str(),
    )
}

/// Lists tasks, newest first, a page at a time.
#[utoipa::path(
    get,
    path = "/api/tasks",
    params(
        ("project" = Option<uuid::Uuid>, Query, description = "Only this project's tasks"),
        ("status" = Option<Status>, Query, description = "Only tasks with this status"),
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 100, description = "Page size (default 20)"),
        ("after" = Option<uuid::Uuid>, Query, description = "The previous page's `next`"),
    ),
    responses(
        (status = 200, description = "A page", body = Page),
        (status = 304, description = "Not modified (If-None-Match)"),
        (status = 400, description = "A bad parameter", body = ErrorBody),
    )
)]
#[allow(dead_code)]
fn list_tasks() {}

/// Creates a task.
#[utoipa::path(
    post,
    path = "/api/tasks",
    request_body = NewTask,
    security(("session" = [])),
    responses(
        (status = 401, description = "Not logged in", body = ErrorBody),
        (status = 201, description = "Created", body = Task),
        (status = 400, description = "A bad field", body = ErrorBody),
        (status = 404, description = "No such project (`field` is `project`)", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 408, description = "The body stopped arriving (a JSON error), or the request outlasted its deadline (no body)", body = ErrorBody),
        (status = 415, description = "The body is not `application/json`", body = ErrorBody),
    )
)]
#[allow(dead_code)]
fn create_task() {}

/// One task.
#[utoipa::path(
    get,
    path = "/api/tasks/{id}",
    params(("id" = uuid::Uuid, Path, description = "The task's id")),
    responses(
        (status = 200, description = "The task", body = Task),
        (status = 304, description = "Not modified (If-None-Match)"),
        (status = 400, description = "Not a UUID", body = ErrorBody),
        (status = 404, description = "No such task", body = ErrorBody),
    )
)]
#[allow(dead_code)]
fn get_task() {}

/// Changes a task: the fields given change, the others stay.
#[utoipa::path(
    patch,
    path = "/api/tasks/{id}",
    params(("id" = uuid::Uuid, Path, description = "The task's id")),
    request_body = TaskPatch,
    security(("session" = [])),
    responses(
        (status = 401, description = "Not logged in", body = ErrorBody),
        (status = 200, description = "The task as changed", body = Task),
        (status = 400, description = "A bad field", body = ErrorBody),
        (status = 404, description = "No such task", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 408, description = "The body stopped arriving (a JSON error), or the request outlasted its deadline (no body)", body = ErrorBody),
        (status = 415, description = "The body is not `application/json`", body = ErrorBody),
    )
)]
#[allow(dead_code)]
fn update_task() {}

/// Deletes a task.
#[utoipa::path(
    delete,
    path = "/api/tasks/{id}",
    params(("id" = uuid::Uuid, Path, description = "The task's id")),
    security(("session" = [])),
    responses(
        (status = 401, description = "Not logged in", body = ErrorBody),
        (status = 204, description = "Deleted"),
        (status = 400, description = "Not a UUID", body = ErrorBody),
        (status = 404, description = "No such task", body = ErrorBody),
    )
)]
#[allow(dead_code)]
fn delete_task() {}

/// Every project.
#[utoipa::path(
    get,
    path = "/api/projects",
    responses(
        (status = 200, description = "The projects", body = Vec<Project>),
        (status = 304, description = "Not modified (If-None-Match)"),
    )
)]
#[allow(dead_code)]
fn list_projects() {}

/// Creates a project.
#[utoipa::path(
    post,
    path = "/api/projects",
    request_body = NewProject,
    security(("session" = [])),
    responses(
        (status = 401, description = "Not logged in", body = ErrorBody),
        (status = 201, description = "Created", body = Project),
        (status = 400, description = "A bad field", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB", body = ErrorBody),
        (status = 408, description = "The body stopped arriving (a JSON error), or the request outlasted its deadline (no body)", body = ErrorBody),
        (status = 415, description = "The body is not `application/json`", body = ErrorBody),
    )
)]
#[allow(dead_code)]
fn create_project() {}

/// How many of a project's tasks stand where.
#[utoipa::path(
    get,
    path = "/api/projects/{id}/summary",
    params(("id" = uuid::Uuid, Path, description = "The project's id")),
    responses(
        (status = 200, description = "Counts per status", body = Summary),
        (status = 304, description = "Not modified (If-None-Match)"),
        (status = 400, description = "Not a UUID", body = ErrorBody),
        (status = 404, description = "No such project", body = ErrorBody),
    )
)]
#[allow(dead_code)]
fn project_summary() {}

/// Logs in: the answer sets the login cookie.
#[utoipa::path(
    post,
    path = "/api/session",
    request_body = Login,
    responses(
        (status = 200, description = "Logged in (`Set-Cookie`)", body = User),
        (status = 400, description = "Not a login", body = ErrorBody),
        (status = 401, description = "Unknown user or wrong password", body = ErrorBody),
        (status = 413, description = "Body over 64 KiB"),
        (status = 408, description = "The body stopped arriving, or the request outlasted its deadline"),
        (status = 415, description = "The body is not `application/json`", body = ErrorBody),
        (status = 429, description = "Too many failed logins of this user: wait `Retry-After` seconds", body = ErrorBody),
    )
)]
#[allow(dead_code)]
fn log_in() {}

/// Who is logged in.
#[utoipa::path(
    get,
    path = "/api/session",
    responses(
        (status = 200, description = "The user", body = User),
        (status = 401, description = "Not logged in", body = ErrorBody),
    )
)]
#[allow(dead_code)]
fn who_am_i() {}

/// Logs out: the answer clears the login cookie.
#[utoipa::path(
    delete,
    path = "/api/session",
    responses((status = 204, description = "Logged out (`Set-Cookie`)"))
)]
#[allow(dead_code)]
fn log_out() {}
