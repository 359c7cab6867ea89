//! Logins and who may do what.
//!
//! A login is a cookie signed with the deployment's secret (HMAC-SHA-256): the user's name
//! and when the login expires, and the signature over both. Every process that has the
//! secret checks it alone (a tier, a backend), without a table or a call: a deployment of
//! several processes gives them all the same secret (`--session-secret`, or
//! `TASKS_SESSION_SECRET`). Logging out clears the cookie; a copy taken before stays valid
//! until it expires (12 hours by default), as with any signed cookie.
//!
//! [`Auth::protect`] puts a router behind the rules: writes (`POST`, `PATCH`, `DELETE`
//! under `/api`) need a login, reads (`/api`, `/rpc`, `/gateway`) need one unless anonymous
//! reads are allowed, and the page's files and `/api/openapi.json` are open. It also adds
//! `/api/session`: `POST {"name", "password"}` logs in (sets the cookie), `GET` says who
//! is logged in, `DELETE` logs out.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use coherent::rpc::pace::{Pacer, Rate};
use hmac::{KeyInit, Mac};
use serde::{Deserialize, Serialize};

use crate::api::ErrorBody;

/// The cookie that carries a login (without `secure_cookie`).
pub const COOKIE: &str = "tasks_session";

/// The cookie that carries a login with `secure_cookie`: a browser keeps a `__Host-` cookie
/// only if it came over HTTPS with `Secure`, `Path=/` and no `Domain`, so a page of a
/// sibling subdomain cannot set one for this host (cookie tossing: planting its own login,
/// which a plain name would let it do).
pub const SECURE_COOKIE: &str = "__Host-tasks_session";

type Hmac = hmac::Hmac<sha2::Sha256>;

/// Who a request is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct User {
    /// The name logged in with.
    pub name: String,
}

/// How the app authenticates, and what it lets anonymous clients do.
#[derive(Clone, Debug)]
pub struct AuthConfig {
    /// The secret logins are signed with (at least 16 bytes): the same for every process
    /// of a deployment, or a login made through one is refused by the others.
    pub secret: Vec<u8>,
    /// The users and their passwords.
    pub users: Vec<(String, String)>,
    /// Whether reads (the API's `GET`s, `/rpc`, `/gateway`) are open to clients that did
    /// not log in. Writes always need a login.
    pub anonymous_reads: bool,
    /// How long a login lasts.
    pub session_ttl: Duration,
    /// Whether the cookie is sent only over HTTPS (`Secure`), and named
    /// [`SECURE_COOKIE`] (a `__Host-` cookie) rather than [`COOKIE`]: on wherever the app
    /// is behind TLS.
    pub secure_cookie: bool,
    /// The rate at which one logged-in user's commands over `/rpc` run (its writes through
    /// `/api` are held to the address's `HttpLimits::writes_per_ip`); `None` for no limit.
    /// A command over the rate waits until it is due, or, if that is more than
    /// `max_command_wait` away, is refused (`ErrorKind::RateLimited`). A tier's commands
    /// (a trusted connection) are not held to it. Default: 20 a second, 40 at once.
    pub commands_per_user: Option<Rate>,
    /// The longest a command over its user's rate waits. Default: 1 s.
    pub max_command_wait: Duration,
}

impl AuthConfig {
    /// Anonymous reads, 12-hour logins, no `Secure` flag; no users.
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        Self {
            secret: secret.into(),
            users: Vec::new(),
            anonymous_reads: true,
            session_ttl: Duration::from_secs(12 * 3600),
            secure_cookie: false,
            commands_per_user: Some(Rate::per_second(20)),
            max_command_wait: Duration::from_secs(1),
        }
    }

    /// Adds a user.
    pub fn user(mut self, name: impl Into<String>, password: impl Into<String>) -> Self {
        self.users.push((name.into(), password.into()));
        self
    }
}

/// The rules and the keys, shared by the middleware and the session routes.
#[derive(Clone)]
pub struct Auth {
    inner: Arc<Inner>,
}

struct Inner {
    key: Vec<u8>,
    /// Each user's password, as its MAC under `key`: compared in constant time, and never
    /// kept as given.
    users: HashMap<String, Vec<u8>>,
    anonymous_reads: bool,
    ttl: Duration,
    secure: bool,
    /// Failed logins per configured user name, for [`Throttle`].
    throttle: parking_lot::Mutex<HashMap<String, Throttle>>,
    /// Failed logins per client address (any name, known or not), for [`Throttle`] past
    /// [`FREE_FAILURES_PER_ADDRESS`]: one address trying one password against many names
    /// is held up too.
    by_address: parking_lot::Mutex<HashMap<std::net::IpAddr, Throttle>>,
    /// Each configured user's rate of commands over `/rpc` (only they can log in); `None`
    /// for no limit.
    command_pacers: Option<HashMap<String, Pacer>>,
    max_command_wait: Duration,
}

/// Failed logins of one user: after [`FREE_FAILURES`] in a row, each further attempt must
/// wait, twice as long each time (1 s, 2 s, ... up to 15 min); a success forgets them.
/// An online guesser of a weak password gets a few dozen tries a day instead of thousands
/// a second; the user, locked out at worst for 15 minutes, logs in once it passes.
#[derive(Default, Clone, Copy)]
struct Throttle {
    failures: u32,
    until: u64,
}

impl Throttle {
    /// Counts a failure at `now`; past `free` of them, the next attempt waits 1 s, then
    /// twice as long each time, up to 15 minutes.
    fn failed(&mut self, now: u64, free: u32) {
        self.failures += 1;
        if self.failures > free {
            let wait = 1u64 << (self.failures - free - 1).min(10);
            self.until = now + wait.min(15 * 60);
        }
    }
}

/// Failed logins of a user allowed before [`Throttle`] makes them wait.
const FREE_FAILURES: u32 = 5;

/// Failed logins one client address may make (under any names) before its attempts wait,
/// as a user's do after [`FREE_FAILURES`].
const FREE_FAILURES_PER_ADDRESS: u32 = 20;

/// Addresses whose failed logins are remembered at most; past it, those not held up now
/// are forgotten (and, if every one is, a new address is not tracked until some are).
const MAX_ADDRESSES_TRACKED: usize = 100_000;

/// The shortest password a user may be given.
pub const MIN_PASSWORD: usize = 8;

/// Why an [`AuthConfig`] cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AuthConfigError {
    /// The secret is shorter than 16 bytes.
    #[error("the session secret must be at least 16 bytes")]
    ShortSecret,
    /// A user's name is empty, too long, or has characters other than letters, digits,
    /// `_`, `-` and `.`.
    #[error("user name {0:?}: 1 to 64 letters, digits, '_', '-' or '.'")]
    BadName(String),
    /// A password is shorter than [`MIN_PASSWORD`] characters.
    #[error("user {0}: the password must be at least 8 characters")]
    ShortPassword(String),
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

impl Auth {
    /// The rules of `config`.
    pub fn new(config: AuthConfig) -> Result<Self, AuthConfigError> {
        if config.secret.len() < 16 {
            return Err(AuthConfigError::ShortSecret);
        }
        let key = config.secret;
        let mut users = HashMap::new();
        for (name, password) in config.users {
            if !valid_name(&name) {
                return Err(AuthConfigError::BadName(name));
            }
            if password.chars().count() < MIN_PASSWORD {
                return Err(AuthConfigError::ShortPassword(name));
            }
            let mac = mac(&key, &[b"password", name.as_bytes(), password.as_bytes()]);
            users.insert(name, mac);
        }
        let command_pacers = config.commands_per_user.map(|rate| {
            users
                .keys()
                .map(|name| (name.clone(), Pacer::new(rate)))
                .collect()
        });
        Ok(Self {
            inner: Arc::new(Inner {
                key,
                users,
                anonymous_reads: config.anonymous_reads,
                ttl: config.session_ttl,
                secure: config.secure_cookie,
                throttle: parking_lot::Mutex::default(),
                by_address: parking_lot::Mutex::default(),
                command_pacers,
                max_command_wait: config.max_command_wait,
            }),
        })
    }

    /// Takes one of `user`'s commands from its rate ([`AuthConfig::commands_per_user`]):
    /// the wait before it may run, or, if that is longer than `max_command_wait`, an error
    /// with how long until it would not be (nothing taken).
    /// A name that is no configured user's (none can log in) is refused.
    pub fn pace_command(&self, user: &str) -> Result<Duration, Duration> {
        let Some(pacers) = &self.inner.command_pacers else {
            return Ok(Duration::ZERO);
        };
        match pacers.get(user) {
            Some(p) => p.take_within(self.inner.max_command_wait),
            None => Err(self.inner.max_command_wait.max(Duration::from_secs(1))),
        }
    }

    /// Whether clients that did not log in may read.
    pub fn anonymous_reads(&self) -> bool {
        self.inner.anonymous_reads
    }

    /// The cookie value of a login as `name`, if the password is right.
    pub fn login(&self, name: &str, password: &str) -> Option<String> {
        self.try_login(name, password, None).ok()
    }

    /// [`login`](Self::login), saying why not: a wrong name or password, or the user's or
    /// the client address's failed logins throttled (the seconds to wait).
    fn try_login(
        &self,
        name: &str,
        password: &str,
        from: Option<std::net::IpAddr>,
    ) -> Result<String, Refusal> {
        self.try_login_at(now_secs(), name, password, from)
    }

    /// [`try_login`](Self::try_login) at `now` (seconds since the epoch).
    fn try_login_at(
        &self,
        now: u64,
        name: &str,
        password: &str,
        from: Option<std::net::IpAddr>,
    ) -> Result<String, Refusal> {
        if let Some(t) = self.inner.throttle.lock().get(name) {
            if t.until > now {
                return Err(Refusal::Throttled(t.until - now));
            }
        }
        if let Some(t) = from.and_then(|ip| self.inner.by_address.lock().get(&ip).copied()) {
            if t.until > now {
                return Err(Refusal::Throttled(t.until - now));
            }
        }
        // An unknown name costs the same MAC as a known one: its answer comes no sooner.
        let unknown = Vec::new();
        let expected = self.inner.users.get(name);
        let right = signer(
            &self.inner.key,
            &[b"password", name.as_bytes(), password.as_bytes()],
        )
        .verify_slice(expected.unwrap_or(&unknown))
        .is_ok();
        let Some(stamp) = expected.filter(|_| right) else {
            if expected.is_some() {
                let mut throttle = self.inner.throttle.lock();
                throttle
                    .entry(name.to_owned())
                    .or_default()
                    .failed(now, FREE_FAILURES);
            }
            if let Some(ip) = from {
                let mut by_address = self.inner.by_address.lock();
                if by_address.len() >= MAX_ADDRESSES_TRACKED {
                    by_address.retain(|_, t| t.until > now);
                }
                if by_address.len() < MAX_ADDRESSES_TRACKED || by_address.contains_key(&ip) {
                    by_address
                        .entry(ip)
                        .or_default()
                        .failed(now, FREE_FAILURES_PER_ADDRESS);
                }
            }
            return Err(Refusal::Wrong);
        };
        // A user's success forgets the user's failures, not its address's: one who sprays
        // names from an address and logs into an account of their own in between is held
        // up all the same.
        self.inner.throttle.lock().remove(name);
        let expires = now.saturating_add(self.inner.ttl.as_secs());
        Ok(self.token(name, expires, stamp))
    }

    /// `name.expires.signature`, the name and the signature in hex. The signature covers the
    /// user's password MAC too (not in the cookie): a new password, or the user's removal,
    /// ends the logins made before.
    fn token(&self, name: &str, expires: u64, stamp: &[u8]) -> String {
        let signature = mac(
            &self.inner.key,
            &[b"session", name.as_bytes(), &expires.to_le_bytes(), stamp],
        );
        format!("{}.{expires}.{}", hex(name.as_bytes()), hex(&signature))
    }

    /// The user a cookie value stands for: signed with this secret and not expired.
    pub fn verify(&self, token: &str) -> Option<User> {
        let mut parts = token.split('.');
        let (name, expires, signature) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || token.len() > 512 {
            return None;
        }
        let name = String::from_utf8(unhex(name)?).ok()?;
        if expires.starts_with('+') {
            return None;
        }
        let expires: u64 = expires.parse().ok()?;
        // A user no longer configured has no stamp: its logins are over.
        let stamp = self.inner.users.get(&name)?;
        signer(
            &self.inner.key,
            &[b"session", name.as_bytes(), &expires.to_le_bytes(), stamp],
        )
        .verify_slice(&unhex(signature)?)
        .ok()?;
        (expires > now_secs()).then_some(User { name })
    }

    /// The name of the login cookie: [`SECURE_COOKIE`] with `secure_cookie`, else
    /// [`COOKIE`]. Only that one is read.
    pub fn cookie_name(&self) -> &'static str {
        if self.inner.secure {
            SECURE_COOKIE
        } else {
            COOKIE
        }
    }

    /// The user a request's cookie stands for, if any.
    pub fn user(&self, headers: &HeaderMap) -> Option<User> {
        let name = self.cookie_name();
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|c| c.trim().split_once('='))
            .filter(|(k, _)| *k == name)
            .find_map(|(_, v)| self.verify(v))
    }

    fn cookie(&self, value: &str, max_age: u64) -> HeaderValue {
        let secure = if self.inner.secure { "; Secure" } else { "" };
        let name = self.cookie_name();
        HeaderValue::from_str(&format!(
            "{name}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}"
        ))
        .expect("a cookie of hex and digits is a header value")
    }

    /// `router` behind the rules, with `/api/session` beside it (see the module's docs).
    pub fn protect(&self, router: Router) -> Router {
        Router::new()
            .route(
                "/api/session",
                post(login)
                    .get(whoami)
                    .delete(logout)
                    .layer(axum::extract::DefaultBodyLimit::max(MAX_LOGIN_BODY)),
            )
            .with_state(self.clone())
            .merge(router)
            .layer(axum::middleware::from_fn_with_state(self.clone(), guard))
    }
}

/// The MAC of `parts` under `key`, to finish or to check a signature with (`verify_slice`
/// compares in constant time).
fn signer(key: &[u8], parts: &[&[u8]]) -> Hmac {
    let mut mac = Hmac::new_from_slice(key).expect("HMAC takes any key");
    // Each part with its length: ("ab", "c") and ("a", "bc") sign differently.
    for part in parts {
        mac.update(&(part.len() as u64).to_le_bytes());
        mac.update(part);
    }
    mac
}

/// Whether two secrets are equal, in a time that depends on neither: their MACs (under a
/// key of no secret, only to bring both to one length) compared by `verify_slice`.
pub(crate) fn same_secret(a: &[u8], b: &[u8]) -> bool {
    const KEY: &[u8] = b"coherent-tasks: two secrets compared";
    signer(KEY, &[a]).verify_slice(&mac(KEY, &[b])).is_ok()
}

fn mac(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    signer(key, parts).finalize().into_bytes().to_vec()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn error(status: StatusCode, message: &str) -> Response {
    let body = ErrorBody {
        error: message.to_owned(),
        field: None,
    };
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        serde_json::to_vec(&body).unwrap_or_default(),
    )
        .into_response()
}

/// What the outer middleware tells the API's routes: logins are required by these rules,
/// and who (if anyone) the request's cookie stands for. The rules themselves run in
/// [`login_refusal`], from a layer of each API route (`api::router`), so that a method a
/// route does not have stays a 405 and an unknown path a 404, logged in or not.
#[derive(Clone, Debug)]
pub struct Logins {
    /// Whether clients that did not log in may read.
    pub anonymous_reads: bool,
    /// The request's user.
    pub user: Option<User>,
}

/// The rules, before any route runs: `/rpc` and `/gateway` (not the API's, whose routes
/// check [`Logins`] themselves).
async fn guard(State(auth): State<Auth>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let user = auth.user(req.headers());
    let reads = path == "/rpc" || path == "/rpc/" || path.starts_with("/gateway");
    if reads && !auth.inner.anonymous_reads && user.is_none() {
        return error(
            StatusCode::UNAUTHORIZED,
            "log in before reading: POST /api/session",
        );
    }
    let mut req = req;
    req.extensions_mut().insert(Logins {
        anonymous_reads: auth.inner.anonymous_reads,
        user,
    });
    next.run(req).await
}

/// The API's rule, on each of its routes (`api::router`): where [`Auth::protect`] put
/// [`Logins`] on the request, writes need a user, and reads too when anonymous reads are
/// off. Without `Logins` (no `protect`), anything goes. The refusal, or `None` to go on.
pub fn login_refusal(req: &Request) -> Option<Response> {
    let logins = req.extensions().get::<Logins>()?;
    let writes = !matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
    let open = matches!(req.uri().path(), "/api/session" | "/api/openapi.json");
    if !open && logins.user.is_none() && (writes || !logins.anonymous_reads) {
        let what = if writes { "writing" } else { "reading" };
        return Some(error(
            StatusCode::UNAUTHORIZED,
            &format!("log in before {what}: POST /api/session"),
        ));
    }
    None
}

/// The body of `POST /api/session`.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Login {
    /// The user's name.
    pub name: String,
    /// The user's password.
    pub password: String,
}

/// Why a login was refused.
enum Refusal {
    /// An unknown user or a wrong password (the answer does not say which).
    Wrong,
    /// The user's failed logins are throttled: try again in this many seconds.
    Throttled(u64),
}

/// The largest body of `POST /api/session` read, as for the API's other bodies (the name
/// is logged only when it is one, so a large body cannot flood the log).
const MAX_LOGIN_BODY: usize = crate::api::MAX_BODY;

async fn login(
    State(auth): State<Auth>,
    from: Option<axum::Extension<crate::app::ClientAddr>>,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    if !crate::api::is_json(&headers) {
        return error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "the body must be JSON, sent as `Content-Type: application/json`",
        );
    }
    let body = match body {
        Ok(body) => body,
        Err(r) => {
            return match crate::api::unread_body(&r) {
                Some(e) => e.into_response(),
                None => error(
                    StatusCode::BAD_REQUEST,
                    "the body must be {\"name\": ..., \"password\": ...}",
                ),
            }
        }
    };
    let Ok(login) = serde_json::from_slice::<Login>(&body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "the body must be {\"name\": ..., \"password\": ...}",
        );
    };
    let from = from.map(|axum::Extension(a)| a.0);
    match auth.try_login(&login.name, &login.password, from) {
        Ok(token) => (
            [(
                header::SET_COOKIE,
                auth.cookie(&token, auth.inner.ttl.as_secs()),
            )],
            axum::Json(User { name: login.name }),
        )
            .into_response(),
        Err(refusal) => {
            // The name as given only when it could be one: the log is not the attacker's.
            let name = if valid_name(&login.name) {
                login.name.as_str()
            } else {
                "(not a user name)"
            };
            match refusal {
                Refusal::Wrong => {
                    tracing::info!(name, "a login was refused");
                    error(StatusCode::UNAUTHORIZED, "unknown user or wrong password")
                }
                Refusal::Throttled(wait) => {
                    tracing::warn!(name, wait, "a login was refused: too many failures");
                    let mut r = error(
                        StatusCode::TOO_MANY_REQUESTS,
                        &format!("too many failed logins: try again in {wait} s"),
                    );
                    if let Ok(v) = HeaderValue::from_str(&wait.to_string()) {
                        r.headers_mut().insert(header::RETRY_AFTER, v);
                    }
                    r
                }
            }
        }
    }
}

async fn whoami(State(auth): State<Auth>, headers: HeaderMap) -> Response {
    match auth.user(&headers) {
        Some(user) => axum::Json(user).into_response(),
        None => error(StatusCode::UNAUTHORIZED, "not logged in"),
    }
}

async fn logout(State(auth): State<Auth>) -> Response {
    (
        StatusCode::NO_CONTENT,
        [(header::SET_COOKIE, auth.cookie("", 0))],
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth() -> Auth {
        Auth::new(AuthConfig::new(*b"0123456789abcdef").user("alice", "wonderland")).unwrap()
    }

    #[test]
    fn a_login_signs_a_cookie_that_verifies_and_nothing_else_does() {
        let a = auth();
        assert_eq!(a.login("alice", "wrong"), None);
        assert_eq!(a.login("bob", "wonderland"), None);
        let token = a.login("alice", "wonderland").unwrap();
        assert_eq!(a.verify(&token).map(|u| u.name), Some("alice".into()));

        // Another name under the same signature, a changed expiry, another secret.
        let (name, rest) = token.split_once('.').unwrap();
        assert_eq!(a.verify(&format!("{}.{rest}", hex(b"admin"))), None);
        let (expires, signature) = rest.split_once('.').unwrap();
        let later: u64 = expires.parse::<u64>().unwrap() + 1;
        assert_eq!(a.verify(&format!("{name}.{later}.{signature}")), None);
        let other =
            Auth::new(AuthConfig::new(*b"fedcba9876543210").user("alice", "wonderland")).unwrap();
        assert_eq!(other.verify(&token), None);
        for junk in [
            "",
            ".",
            "..",
            "zz.1.00",
            &"a".repeat(600),
            "616c696365.x.00",
        ] {
            assert_eq!(a.verify(junk), None, "{junk}");
        }
        // Expired.
        let stamp = a.inner.users["alice"].clone();
        let old = a.token("alice", now_secs() - 1, &stamp);
        assert_eq!(a.verify(&old), None);
        // A new password, or the user gone, under the same secret: the login is over.
        let key = *b"0123456789abcdef";
        let changed = Auth::new(AuthConfig::new(key).user("alice", "looking-glass")).unwrap();
        assert_eq!(changed.verify(&token), None);
        let gone = Auth::new(AuthConfig::new(key).user("bob", "builder!")).unwrap();
        assert_eq!(gone.verify(&token), None);
        let same = Auth::new(AuthConfig::new(key).user("alice", "wonderland")).unwrap();
        assert_eq!(same.verify(&token).map(|u| u.name), Some("alice".into()));
    }

    #[test]
    fn failed_logins_of_a_user_are_throttled_after_a_few() {
        let a = auth();
        // One instant for the whole test: a wait of 1 s must not run out between two lines.
        let now = now_secs();
        for _ in 0..FREE_FAILURES {
            assert!(matches!(
                a.try_login_at(now, "alice", "guess", None),
                Err(Refusal::Wrong)
            ));
        }
        // The next failure starts the wait; then even the right password waits.
        assert!(matches!(
            a.try_login_at(now, "alice", "guess", None),
            Err(Refusal::Wrong)
        ));
        assert!(matches!(
            a.try_login_at(now, "alice", "wonderland", None),
            Err(Refusal::Throttled(1))
        ));
        // Other users are not held up; unknown names are not tracked.
        for _ in 0..20 {
            assert!(matches!(
                a.try_login_at(now, "nobody", "x", None),
                Err(Refusal::Wrong)
            ));
        }
        assert!(a.inner.throttle.lock().get("nobody").is_none());
    }

    #[test]
    fn failed_logins_from_one_address_are_throttled_whatever_the_names() {
        let a = auth();
        let now = now_secs();
        let spray: std::net::IpAddr = [203, 0, 113, 7].into();
        let other: std::net::IpAddr = [198, 51, 100, 1].into();
        // One password tried against many names (none of them a user's: no user's own
        // count moves).
        for i in 0..FREE_FAILURES_PER_ADDRESS {
            let name = format!("user{i}");
            assert!(matches!(
                a.try_login_at(now, &name, "password1", Some(spray)),
                Err(Refusal::Wrong)
            ));
        }
        assert!(matches!(
            a.try_login_at(now, "user99", "password1", Some(spray)),
            Err(Refusal::Wrong)
        ));
        // Now the address waits, even with a right password; another address does not.
        assert!(matches!(
            a.try_login_at(now, "alice", "wonderland", Some(spray)),
            Err(Refusal::Throttled(1))
        ));
        assert!(a
            .try_login_at(now, "alice", "wonderland", Some(other))
            .is_ok());
        // Still held up after that success, and after one of its own.
        assert!(matches!(
            a.try_login_at(now, "alice", "wonderland", Some(spray)),
            Err(Refusal::Throttled(1))
        ));
    }

    #[test]
    fn the_cookie_is_found_among_others() {
        let a = auth();
        let token = a.login("alice", "wonderland").unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_str(&format!("theme=dark; {COOKIE}=junk; {COOKIE}={token}")).unwrap(),
        );
        assert_eq!(a.user(&headers).map(|u| u.name), Some("alice".into()));
    }

    #[test]
    fn a_secure_login_is_a_host_cookie_and_a_plain_one_is_not_read() {
        let mut config = AuthConfig::new(*b"0123456789abcdef").user("alice", "wonderland");
        config.secure_cookie = true;
        let a = Auth::new(config).unwrap();
        let token = a.login("alice", "wonderland").unwrap();
        let set = a.cookie(&token, 60);
        let set = set.to_str().unwrap();
        assert!(
            set.starts_with(&format!("{SECURE_COOKIE}={token}; Path=/;")),
            "{set}"
        );
        assert!(set.ends_with("; Secure"), "{set}");
        assert!(!set.contains("Domain"), "{set}");
        // A valid login under the plain name (as a sibling subdomain could plant it) is
        // not read; under the host name it is.
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_str(&format!("{COOKIE}={token}")).unwrap(),
        );
        assert_eq!(a.user(&headers), None);
        headers.insert(
            header::COOKIE,
            HeaderValue::from_str(&format!("{SECURE_COOKIE}={token}")).unwrap(),
        );
        assert_eq!(a.user(&headers).map(|u| u.name), Some("alice".into()));
    }

    #[test]
    fn bad_configs_are_refused() {
        assert!(Auth::new(AuthConfig::new(*b"short")).is_err());
        let key = *b"0123456789abcdef";
        assert!(Auth::new(AuthConfig::new(key).user("", "x")).is_err());
        assert!(Auth::new(AuthConfig::new(key).user("a b", "x")).is_err());
        assert!(Auth::new(AuthConfig::new(key).user("a", "")).is_err());
        assert!(Auth::new(AuthConfig::new(key).user("a", "1234567")).is_err());
    }
}
