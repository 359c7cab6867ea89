//! The HTTP JSON API, the same for every backend: routes, input parsing and validation, error
//! bodies, entity tags.

use std::future::Future;
use std::sync::Arc;

use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, RawQuery, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use coherent::typescript::TS;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::model::{
    Invalid, ListQuery, NewProject, NewTask, Project, Status, Task, TaskPatch, DEFAULT_LIMIT,
    MAX_LIMIT,
};
use crate::store::StoreError;

/// The largest request body the API reads; a larger one is answered 413.
pub const MAX_BODY: usize = 64 * 1024;

/// A JSON body ready to send, and its entity tag where the backend has one (the Coherent
/// backend keeps both with the cached value).
#[derive(Clone, Debug)]
pub struct Body {
    /// The JSON.
    pub json: Bytes,
    /// A strong entity tag, quoted, as sent in `ETag` (a `HeaderValue` made once: a
    /// response clones a reference to it).
    pub etag: Option<HeaderValue>,
}

impl Body {
    /// `value` as JSON, without an entity tag.
    pub fn json<T: Serialize>(value: &T) -> Result<Self, ApiError> {
        Ok(Self {
            json: to_json(value)?,
            etag: None,
        })
    }

    /// `value` as JSON, with an entity tag made from a hash of the JSON.
    pub fn tagged<T: Serialize>(value: &T) -> Result<Self, ApiError> {
        let json = to_json(value)?;
        let hash = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = foldhash::fast::FixedState::with_seed(0x7461_736b).build_hasher();
            h.write(&json);
            h.finish()
        };
        Ok(Self {
            json,
            etag: HeaderValue::from_str(&format!("\"{hash:016x}\"")).ok(),
        })
    }
}

fn to_json<T: Serialize>(value: &T) -> Result<Bytes, ApiError> {
    serde_json::to_vec(value)
        .map(Bytes::from)
        .map_err(|e| ApiError::internal(format_args!("encoding the answer: {e}")))
}

/// What a request can fail with; answered as `{"error": ..., "field": ...}` with the status
/// each variant names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error, TS)]
#[ts(crate = "coherent::typescript")]
pub enum ApiError {
    /// 400: an input breaks a rule; the body names the field.
    #[error("{}: {}", .0.field, .0.message)]
    Invalid(Invalid),
    /// 404: no such task or project.
    #[error("{0} not found")]
    NotFound(String),
    /// 404: a field of the request names something that does not exist (a new task's
    /// project); the body names the field.
    #[error("{}: {}", .0.field, .0.message)]
    Unknown(Invalid),
    /// 413: the body is over [`MAX_BODY`].
    #[error("the request body is over {MAX_BODY} bytes")]
    TooLarge,
    /// 503: the backend cannot be reached now. The text is a reference to the log line
    /// with the details (see [`ApiError::unavailable`]).
    #[error("backend unavailable, {0}")]
    Unavailable(String),
    /// 500: anything else. The text is a reference to the log line with the details (see
    /// [`ApiError::internal`]).
    #[error("internal error, {0}")]
    Internal(String),
    /// 408: the request's body stopped arriving for longer than the server waits between
    /// two of its pieces (`HttpLimits::body_read_timeout`). Made by the HTTP layer only,
    /// and last here: postcard numbers a variant by its place, and this enum is the error
    /// of the compute methods a tier and its backend exchange, so that hosts of the
    /// release before it still read every other variant as it was.
    #[error("the request body stopped arriving")]
    TimedOut,
}

impl ApiError {
    /// A 400 naming `field`.
    pub fn invalid(field: &str, message: impl Into<String>) -> Self {
        Self::Invalid(Invalid::new(field, message))
    }

    /// A 500 whose body says only a reference: `detail` (a database's message, a path, an
    /// address) goes to the log under that reference, never to the client.
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        let reference = reference();
        tracing::error!(%reference, %detail, "internal error");
        Self::Internal(format!("reference {reference}"))
    }

    /// A 503, with `detail` logged under the reference that the body says.
    pub fn unavailable(detail: impl std::fmt::Display) -> Self {
        let reference = reference();
        tracing::warn!(%reference, %detail, "backend unavailable");
        Self::Unavailable(format!("reference {reference}"))
    }

    /// The HTTP status it is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Invalid(_) => StatusCode::BAD_REQUEST,
            Self::NotFound(_) | Self::Unknown(_) => StatusCode::NOT_FOUND,
            Self::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::TimedOut => StatusCode::REQUEST_TIMEOUT,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// A correlation id for an error: in the body the client gets, and in the log line beside
/// the details.
pub(crate) fn reference() -> String {
    format!("{:016x}", rand::random::<u64>())
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Invalid(i) => Self::Invalid(i),
            StoreError::Unknown(i) => Self::Unknown(i),
            StoreError::Db(m) => Self::internal(format_args!("database: {m}")),
            StoreError::Unavailable(m) => Self::unavailable(format_args!("database: {m}")),
        }
    }
}

/// A failure that says nothing about the data (the backend or the database out of reach,
/// an internal error) is cached as a transient error (1 s by default, against 10 s for an
/// answer about the data, such as a 404): a blip is not served for seconds after it.
impl coherent::TransientError for ApiError {
    fn is_transient(&self) -> bool {
        matches!(self, Self::Unavailable(_) | Self::Internal(_))
    }
}

impl From<Invalid> for ApiError {
    fn from(e: Invalid) -> Self {
        Self::Invalid(e)
    }
}

impl From<coherent::rpc::RpcError> for ApiError {
    fn from(e: coherent::rpc::RpcError) -> Self {
        Self::unavailable(e)
    }
}

/// The error body.
#[derive(Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: String,
    /// The field at fault, for a 400 (and a 404 caused by a field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if matches!(self, Self::Internal(_) | Self::Unavailable(_)) {
            tracing::warn!(error = %self, "request failed");
        }
        let body = ErrorBody {
            field: match &self {
                Self::Invalid(i) | Self::Unknown(i) => Some(i.field.clone()),
                _ => None,
            },
            error: match &self {
                Self::Invalid(i) | Self::Unknown(i) => i.message.clone(),
                other => other.to_string(),
            },
        };
        let json = serde_json::to_vec(&body).unwrap_or_default();
        (
            self.status(),
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            json,
        )
            .into_response()
    }
}

/// What serves the API: a database directly, a gRPC service, or Coherent replicas.
pub trait Backend: Send + Sync + 'static {
    /// One page of tasks, newest first.
    fn list(&self, q: ListQuery) -> impl Future<Output = Result<Body, ApiError>> + Send;
    /// One task; [`ApiError::NotFound`] when there is none.
    fn task(&self, id: Uuid) -> impl Future<Output = Result<Body, ApiError>> + Send;
    /// A project's counts per status; [`ApiError::NotFound`] for an unknown project.
    fn summary(&self, project: Uuid) -> impl Future<Output = Result<Body, ApiError>> + Send;
    /// Every project.
    fn projects(&self) -> impl Future<Output = Result<Body, ApiError>> + Send;
    /// Creates a task: the backend validates it (where it runs, so that every way in gets
    /// the same answer) and chooses its id and times.
    fn create(&self, new: NewTask) -> impl Future<Output = Result<Task, ApiError>> + Send;
    /// Changes a task; the backend validates the patch.
    fn update(
        &self,
        id: Uuid,
        patch: TaskPatch,
    ) -> impl Future<Output = Result<Task, ApiError>> + Send;
    /// Deletes a task.
    fn delete(&self, id: Uuid) -> impl Future<Output = Result<(), ApiError>> + Send;
    /// Creates a project; the backend validates it.
    fn create_project(
        &self,
        new: NewProject,
    ) -> impl Future<Output = Result<Project, ApiError>> + Send;
}

/// The API's routes over `backend`, with the body limit and the OpenAPI document.
pub fn router<B: Backend>(backend: Arc<B>) -> Router {
    // Each route's methods behind the rules (`Rules`): layers of the route, so that they
    // run only for a method the route has (another stays a 405).
    fn rules<B: Backend>(
        methods: axum::routing::MethodRouter<Arc<B>>,
    ) -> axum::routing::MethodRouter<Arc<B>> {
        methods.route_layer(RulesLayer)
    }
    Router::new()
        .route("/api/tasks", rules(get(list::<B>).post(create::<B>)))
        .route(
            "/api/tasks/{id}",
            rules(get(one::<B>).patch(update::<B>).delete(remove::<B>)),
        )
        .route(
            "/api/projects",
            rules(get(projects::<B>).post(create_project::<B>)),
        )
        .route("/api/projects/{id}/summary", rules(get(summary::<B>)))
        .route("/api/openapi.json", get(crate::openapi::serve))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(backend)
}

/// The API's rules, before a route's handler: the login rule
/// ([`session::login_refusal`](crate::session::login_refusal)), then the JSON-only rule
/// ([`json_refusal`]). A layer of its own, not `axum::middleware::from_fn`: a request that
/// passes goes on to the route with no future boxed and no service cloned by this layer
/// (each `from_fn` layer did both; the two took about 5,500 instructions of every read,
/// `http-count` in BENCHMARKS.md).
#[derive(Clone, Copy)]
struct RulesLayer;

impl<S> tower::Layer<S> for RulesLayer {
    type Service = Rules<S>;

    fn layer(&self, inner: S) -> Rules<S> {
        Rules { inner }
    }
}

/// [`RulesLayer`]'s service.
#[derive(Clone)]
struct Rules<S> {
    inner: S,
}

impl<S> tower::Service<axum::extract::Request> for Rules<S>
where
    S: tower::Service<axum::extract::Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future =
        futures::future::Either<std::future::Ready<Result<Response, S::Error>>, S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: axum::extract::Request) -> Self::Future {
        use futures::future::Either;
        match crate::session::login_refusal(&req).or_else(|| json_refusal(&req)) {
            Some(refused) => Either::Left(std::future::ready(Ok(refused))),
            None => Either::Right(self.inner.call(req)),
        }
    }
}

/// Writes must say `Content-Type: application/json`, or they get a 415 before the body is
/// read: a page of another site can send a form or a `text/plain` POST here with the
/// user's cookies and without asking first (the browser's "simple" requests), but not a
/// JSON one, which the browser checks with this server first (CORS, which this API does
/// not grant).
fn json_refusal(req: &axum::extract::Request) -> Option<Response> {
    use axum::http::Method;
    let writes = matches!(*req.method(), Method::POST | Method::PATCH | Method::PUT);
    if !writes || is_json(req.headers()) {
        return None;
    }
    let body = ErrorBody {
        error: "the body must be JSON, sent as `Content-Type: application/json`".into(),
        field: Some("content-type".into()),
    };
    Some(
        (
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            serde_json::to_vec(&body).unwrap_or_default(),
        )
            .into_response(),
    )
}

/// Whether the request's media type is `application/json` (parameters such as `charset`
/// allowed, case ignored).
pub(crate) fn is_json(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
}

/// Parses a list request's query string: unknown parameters are ignored, known ones must
/// be valid.
pub fn parse_list_query(query: Option<&str>) -> Result<ListQuery, ApiError> {
    let mut q = ListQuery {
        project: None,
        status: None,
        limit: DEFAULT_LIMIT,
        after: None,
    };
    for (key, value) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        match &*key {
            "project" => q.project = Some(parse_id("project", &value)?),
            "after" => q.after = Some(parse_id("after", &value)?),
            "status" => {
                q.status = Some(Status::parse(&value).ok_or_else(|| {
                    ApiError::invalid("status", "must be todo, in_progress, done or cancelled")
                })?);
            }
            "limit" => {
                q.limit = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_LIMIT).contains(n))
                    .ok_or_else(|| {
                        ApiError::invalid("limit", format!("must be 1 to {MAX_LIMIT}"))
                    })?;
            }
            _ => {}
        }
    }
    Ok(q)
}

/// Parses a UUID named `field`.
pub fn parse_id(field: &str, value: &str) -> Result<Uuid, ApiError> {
    Uuid::try_parse(value).map_err(|_| ApiError::invalid(field, "must be a UUID"))
}

/// What a body that could not be read is answered when the fault is the request's size or
/// pace rather than its content: 413 over [`MAX_BODY`], 408 when it stopped arriving (the
/// server's `RequestBodyTimeoutLayer`, somewhere in the rejection's chain of causes).
pub(crate) fn unread_body(r: &BytesRejection) -> Option<ApiError> {
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return Some(ApiError::TooLarge);
    }
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(r);
    while let Some(e) = cause {
        if e.is::<tower_http::timeout::TimeoutError>() {
            return Some(ApiError::TimedOut);
        }
        cause = e.source();
    }
    None
}

/// Parses a JSON body into `T`, naming the field at fault.
pub fn parse_body<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body
        .map_err(|r| unread_body(&r).unwrap_or_else(|| ApiError::invalid("body", r.body_text())))?;
    // serde would also read a struct from an array of its fields: only objects are bodies.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::invalid("body", "must be a JSON object"));
    }
    let de = &mut serde_json::Deserializer::from_slice(&body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let message = inner.to_string();
        // A missing field is reported at its object, not at itself: name it.
        let missing = message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split('`').next());
        let malformed = inner.is_eof() || path.starts_with('[');
        let field = match (missing, path.as_str()) {
            _ if malformed => "body".to_owned(),
            (Some(name), ".") => name.to_owned(),
            (Some(name), _) => format!("{path}.{name}"),
            (None, ".") => "body".to_owned(),
            (None, _) => path,
        };
        ApiError::invalid(&field, message)
    })
}

/// The `If-None-Match` header of a request, if any: extracted alone (a `HeaderMap`
/// extractor would copy every header of every read).
pub struct IfNoneMatch(Option<HeaderValue>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for IfNoneMatch {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(Self(parts.headers.get(header::IF_NONE_MATCH).cloned()))
    }
}

impl IfNoneMatch {
    /// Whether the client holds the version tagged `tag`.
    fn matches(&self, tag: &HeaderValue) -> bool {
        let (Some(header), Ok(tag)) = (&self.0, tag.to_str()) else {
            return false;
        };
        header
            .to_str()
            .map(|v| {
                v.split(',').any(|t| {
                    let t = t.trim();
                    t == "*" || t.trim_start_matches("W/") == tag
                })
            })
            .unwrap_or(false)
    }
}

/// A read's answer: the body, or 304 when the client holds it already.
fn read_response(body: Body, inm: &IfNoneMatch) -> Response {
    let content_type = (
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    match body.etag {
        Some(etag) if inm.matches(&etag) => {
            (StatusCode::NOT_MODIFIED, [(header::ETAG, etag)]).into_response()
        }
        Some(etag) => ([content_type, (header::ETAG, etag)], body.json).into_response(),
        None => ([content_type], body.json).into_response(),
    }
}

fn created<T: Serialize>(value: &T) -> Result<Response, ApiError> {
    Ok((
        StatusCode::CREATED,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        to_json(value)?,
    )
        .into_response())
}

fn ok_json<T: Serialize>(value: &T) -> Result<Response, ApiError> {
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        to_json(value)?,
    )
        .into_response())
}

async fn list<B: Backend>(
    State(b): State<Arc<B>>,
    RawQuery(query): RawQuery,
    inm: IfNoneMatch,
) -> Result<Response, ApiError> {
    let q = parse_list_query(query.as_deref())?;
    Ok(read_response(b.list(q).await?, &inm))
}

async fn one<B: Backend>(
    State(b): State<Arc<B>>,
    Path(id): Path<String>,
    inm: IfNoneMatch,
) -> Result<Response, ApiError> {
    let id = parse_id("id", &id)?;
    Ok(read_response(b.task(id).await?, &inm))
}

async fn summary<B: Backend>(
    State(b): State<Arc<B>>,
    Path(id): Path<String>,
    inm: IfNoneMatch,
) -> Result<Response, ApiError> {
    let id = parse_id("id", &id)?;
    Ok(read_response(b.summary(id).await?, &inm))
}

async fn projects<B: Backend>(
    State(b): State<Arc<B>>,
    inm: IfNoneMatch,
) -> Result<Response, ApiError> {
    Ok(read_response(b.projects().await?, &inm))
}

async fn create<B: Backend>(
    State(b): State<Arc<B>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let new: NewTask = parse_body(body)?;
    created(&b.create(new).await?)
}

async fn update<B: Backend>(
    State(b): State<Arc<B>>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let id = parse_id("id", &id)?;
    let patch: TaskPatch = parse_body(body)?;
    ok_json(&b.update(id, patch).await?)
}

async fn remove<B: Backend>(
    State(b): State<Arc<B>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_id("id", &id)?;
    b.delete(id).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn create_project<B: Backend>(
    State(b): State<Arc<B>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let new: NewProject = parse_body(body)?;
    created(&b.create_project(new).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rules of `Rules`, through the app's routes behind `Auth::protect`: writes need a
    /// login, reads too when anonymous reads are off, writes must be JSON, a method a route
    /// lacks stays a 405, and what passes reaches the handler.
    #[tokio::test]
    async fn the_rules_refuse_before_the_handler_and_let_the_rest_through() {
        use crate::session::{Auth, AuthConfig};
        use axum::http::{Method, Request};
        use tower::ServiceExt as _;
        let dir = tempfile::tempdir().unwrap();
        let db = crate::app::DbConfig::Sqlite(dir.path().join("t.db"));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let backend = crate::app::LiveBackend::start(&db, listener, None)
            .await
            .unwrap();
        let send = |router: Router, method: Method, path: &str, json: bool| {
            let mut request = Request::builder().method(method).uri(path);
            if json {
                request = request.header(header::CONTENT_TYPE, "application/json");
            }
            let request = request.body(axum::body::Body::from("{}")).unwrap();
            async move { router.oneshot(request).await.unwrap().status() }
        };
        for anonymous_reads in [true, false] {
            let mut config = AuthConfig::new(*b"0123456789abcdef").user("alice", "wonderland");
            config.anonymous_reads = anonymous_reads;
            let router = Auth::new(config).unwrap().protect(backend.api_router());
            let task = format!("/api/tasks/{}", Uuid::nil());
            let reads = if anonymous_reads {
                StatusCode::NOT_FOUND
            } else {
                StatusCode::UNAUTHORIZED
            };
            assert_eq!(send(router.clone(), Method::GET, &task, false).await, reads);
            assert_eq!(
                send(router.clone(), Method::GET, "/api/projects", false).await,
                if anonymous_reads {
                    StatusCode::OK
                } else {
                    reads
                }
            );
            let summary = format!("/api/projects/{}/summary", Uuid::nil());
            for path in ["/api/tasks", summary.as_str()] {
                assert_eq!(
                    send(router.clone(), Method::GET, path, false).await,
                    if anonymous_reads {
                        send(backend.api_router(), Method::GET, path, false).await
                    } else {
                        reads
                    },
                    "{path}"
                );
            }
            // HEAD is a read.
            assert_eq!(
                send(router.clone(), Method::HEAD, &task, false).await,
                reads
            );
            for (method, path) in [
                (Method::PATCH, task.as_str()),
                (Method::DELETE, task.as_str()),
                (Method::POST, "/api/tasks"),
                (Method::POST, "/api/projects"),
            ] {
                for json in [true, false] {
                    assert_eq!(
                        send(router.clone(), method.clone(), path, json).await,
                        StatusCode::UNAUTHORIZED,
                        "{method} {path}"
                    );
                }
            }
            // A method the route lacks: not the rules' to answer.
            for method in [Method::PUT, Method::OPTIONS] {
                assert_eq!(
                    send(router.clone(), method, &task, true).await,
                    StatusCode::METHOD_NOT_ALLOWED
                );
            }
        }
        // Without `protect`: no login rule, the JSON rule still.
        let router = backend.api_router();
        assert_eq!(
            send(router.clone(), Method::POST, "/api/tasks", false).await,
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
        assert_eq!(
            send(router.clone(), Method::POST, "/api/tasks", true).await,
            // The handler's answer: the body lacks the task's fields.
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            send(
                router,
                Method::GET,
                &format!("/api/tasks/{}", Uuid::nil()),
                false
            )
            .await,
            StatusCode::NOT_FOUND
        );
        backend.stop().await;
    }

    #[tokio::test]
    async fn error_bodies_carry_a_reference_not_the_details() {
        use http_body_util::BodyExt;
        let secret = "password authentication failed for user \"admin\" (/var/lib/postgresql)";
        for e in [
            ApiError::from(StoreError::Db(secret.into())),
            ApiError::internal(secret),
            ApiError::unavailable(secret),
        ] {
            let status = e.status();
            let body = e.into_response().into_body().collect().await.unwrap();
            let body = String::from_utf8(body.to_bytes().to_vec()).unwrap();
            assert!(status.is_server_error(), "{status}");
            assert!(
                !body.contains("password") && !body.contains("/var"),
                "{body}"
            );
            assert!(body.contains("reference "), "{body}");
        }
    }

    /// Postcard numbers an enum's variants by their place, and `ApiError` crosses the wire
    /// between a tier and its backend, which may be of another release: a variant added
    /// anywhere but last would make one host read another's errors as different ones.
    #[test]
    fn the_errors_keep_their_numbers_on_the_wire() {
        let numbered = [
            (ApiError::invalid("f", "m"), 0u8),
            (ApiError::NotFound("t".into()), 1),
            (ApiError::Unknown(Invalid::new("f", "m")), 2),
            (ApiError::TooLarge, 3),
            (ApiError::Unavailable("r".into()), 4),
            (ApiError::Internal("r".into()), 5),
            (ApiError::TimedOut, 6),
        ];
        for (e, n) in numbered {
            let bytes = coherent::rpc::Format::Postcard.encode(&e).unwrap();
            assert_eq!(bytes[0], n, "{e:?}");
        }
    }

    #[test]
    fn list_queries_name_the_bad_field() {
        let q = parse_list_query(Some("status=done&limit=5&x=1")).unwrap();
        assert_eq!((q.status, q.limit), (Some(Status::Done), 5));
        for (query, field) in [
            ("limit=0", "limit"),
            ("limit=101", "limit"),
            ("limit=x", "limit"),
            ("status=open", "status"),
            ("project=12", "project"),
            ("after=%ZZ", "after"),
        ] {
            match parse_list_query(Some(query)) {
                Err(ApiError::Invalid(i)) => assert_eq!(i.field, field, "{query}"),
                other => panic!("{query}: {other:?}"),
            }
        }
    }

    #[test]
    fn bodies_name_the_bad_field() {
        let field = |json: &str| match parse_body::<NewTask>(Ok(Bytes::from(json.to_owned()))) {
            Err(ApiError::Invalid(i)) => i.field,
            other => panic!("{json}: {other:?}"),
        };
        assert_eq!(field(r#"{"project":"x","title":"a"}"#), "project");
        assert_eq!(field(r#"{"title":"a"}"#), "project");
        assert_eq!(
            field(
                r#"{"project":"0191e1e8-7d3a-7c3e-8000-000000000000","title":"a","priority":"big"}"#
            ),
            "priority"
        );
        assert_eq!(
            field(r#"{"project":"0191e1e8-7d3a-7c3e-8000-000000000000","title":"a","extra":1}"#),
            "extra"
        );
        assert_eq!(field("[1,2"), "body");
        assert_eq!(field(""), "body");
    }
}
