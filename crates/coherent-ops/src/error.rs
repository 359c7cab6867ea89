//! What a command answers when it does not succeed.

use std::fmt;

use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// Why a command failed. It travels to remote callers as it is, so it carries a kind a
/// program can match on, a message a person can read and, when the handler gave one, the
/// application's own error as a typed value ([`with_detail`](Self::with_detail),
/// [`detail`](Self::detail)).
///
/// ```
/// use coherent_ops::{CommandError, ErrorKind};
/// use serde::{Deserialize, Serialize};
///
/// /// Why the application refuses a rename.
/// #[derive(Debug, PartialEq, Serialize, Deserialize)]
/// enum RenameError {
///     TooLong { max: usize },
///     Taken,
/// }
///
/// // In the handler:
/// let e = CommandError::rejected("the name is too long")
///     .with_detail(&RenameError::TooLong { max: 40 });
/// // In the caller, here or remote (the detail travels with the error):
/// assert_eq!(e.kind(), ErrorKind::Rejected);
/// assert_eq!(e.detail::<RenameError>(), Some(RenameError::TooLong { max: 40 }));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandError {
    kind: ErrorKind,
    message: String,
    /// PostgreSQL's code for the error (SQLSTATE), when the server refused a statement.
    #[serde(default)]
    code: Option<String>,
    /// The application's own error, as JSON (see [`CommandError::with_detail`]).
    #[serde(default)]
    detail: Option<String>,
    /// The connection was lost under the statement (not sent to remote callers).
    #[serde(skip)]
    lost: bool,
}

/// The kinds of [`CommandError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The handler refused the command (a rule of the application): nothing was written.
    Rejected,
    /// The handler found nothing to act on: nothing was written.
    NotFound,
    /// The database failed. When the failure struck the commit itself the outcome is
    /// unknown: the command may have been applied (its operation is then in the log, and
    /// every host replays it).
    Database,
    /// No handler is registered for the command's name on the host that got it.
    UnknownCommand,
    /// The command, or its output, does not encode or decode.
    BadCommand,
    /// The host could not be reached (a remote caller's connection failed).
    Unavailable,
    /// The handler is written for another database than the host's.
    WrongDatabase,
    /// The caller may not run this command: it did not authenticate, or its identity is
    /// not allowed to (see [`Guarded`](crate::Guarded)). Nothing was run.
    Unauthorized,
    /// The caller ran commands faster than a policy of the application allows it: nothing
    /// was run; the message says when to try again.
    RateLimited,
}

impl CommandError {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            code: None,
            detail: None,
            lost: false,
        }
    }

    /// Attaches the application's own account of the failure: any serde value, typically
    /// an enum of the command's refusals. It travels with the error to remote callers (as
    /// JSON, in either RPC format), where [`detail`](Self::detail) decodes it; the kind and
    /// the message stay for the callers that do not know the type. A value that does not
    /// encode as JSON (a map with keys that are not strings) is left out.
    pub fn with_detail<D: Serialize + ?Sized>(mut self, detail: &D) -> Self {
        match serde_json::to_string(detail) {
            Ok(json) => self.detail = Some(json),
            Err(e) => tracing::warn!(%e, "a command error's detail does not encode; left out"),
        }
        self
    }

    /// The detail given with [`with_detail`](Self::with_detail), decoded as a `D`; `None`
    /// when there is none or it is not a `D` (see [`detail_json`](Self::detail_json)).
    pub fn detail<D: DeserializeOwned>(&self) -> Option<D> {
        match serde_json::from_str(self.detail.as_deref()?) {
            Ok(detail) => Some(detail),
            Err(e) => {
                tracing::debug!(%e, "a command error's detail is not of the type asked for");
                None
            }
        }
    }

    /// The detail as the JSON it travels as, whatever its type.
    pub fn detail_json(&self) -> Option<&str> {
        self.detail.as_deref()
    }

    /// The handler refuses the command.
    pub fn rejected(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Rejected, message)
    }

    /// The handler found nothing to act on.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }

    /// The caller may not run the command.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unauthorized, message)
    }

    /// The caller may not run a command yet: it ran too many lately.
    pub fn rate_limited(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::RateLimited, message)
    }

    /// The kind, for a program.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message, for a person.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The SQLSTATE of the PostgreSQL error behind it (`"23503"` for a foreign key), when
    /// the server refused a statement: how a caller tells a constraint from an outage,
    /// also for a write the pipeline sent after the handler returned ([`Tx::defer`]).
    ///
    /// [`Tx::defer`]: crate::Tx::defer
    pub fn sql_state(&self) -> Option<&str> {
        self.code.as_deref()
    }

    /// Whether PostgreSQL ended the session under the statement (SQLSTATE class 08, a
    /// connection exception, or 57P01-57P03 and 57P05: a terminated backend, a crash, a
    /// server starting, an idle session timed out): the server said so, and ran nothing
    /// after it. It says nothing about the command.
    pub fn is_connection_lost(&self) -> bool {
        self.code.as_deref().is_some_and(session_ended)
    }

    /// [`is_connection_lost`](Self::is_connection_lost), or the connection closed with no
    /// word from the server (a reset socket, a dropped session): whether the statement ran
    /// is then unknown.
    pub(crate) fn is_connection_gone(&self) -> bool {
        self.lost || self.is_connection_lost()
    }
}

impl fmt::Display for CommandError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}

impl std::error::Error for CommandError {}

impl From<rusqlite::Error> for CommandError {
    fn from(e: rusqlite::Error) -> Self {
        Self::new(ErrorKind::Database, format!("sqlite: {e}"))
    }
}

impl From<tokio_postgres::Error> for CommandError {
    fn from(e: tokio_postgres::Error) -> Self {
        Self::from(&e)
    }
}

impl From<&tokio_postgres::Error> for CommandError {
    fn from(e: &tokio_postgres::Error) -> Self {
        // The server's own message: `Display` of a server error says only "db error".
        match e.as_db_error() {
            Some(db) => Self {
                kind: ErrorKind::Database,
                message: format!("postgres: {} ({})", db.message(), db.code().code()),
                code: Some(db.code().code().to_owned()),
                detail: None,
                lost: false,
            },
            None => {
                // tokio-postgres says what failed ("error performing TLS handshake"), its
                // cause why ("invalid peer certificate: UnknownIssuer"): both.
                let mut message = format!("postgres: {e}");
                let mut cause = std::error::Error::source(e);
                while let Some(c) = cause {
                    message.push_str(&format!(": {c}"));
                    cause = c.source();
                }
                Self {
                    lost: connection_lost(e),
                    ..Self::new(ErrorKind::Database, message)
                }
            }
        }
    }
}

impl From<deadpool_postgres::PoolError> for CommandError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        match e {
            // The connection's own error, with its cause (a refused TLS handshake, say).
            deadpool_postgres::PoolError::Backend(e) => Self::from(&e),
            e => Self::new(ErrorKind::Database, format!("postgres pool: {e}")),
        }
    }
}

impl From<coherent_rpc::RpcError> for CommandError {
    fn from(e: coherent_rpc::RpcError) -> Self {
        Self::new(ErrorKind::Unavailable, e.to_string())
    }
}

impl From<serde_json::Error> for CommandError {
    fn from(e: serde_json::Error) -> Self {
        Self::new(ErrorKind::BadCommand, e.to_string())
    }
}

/// Whether an SQLSTATE says the server ended the session: class 08 (a connection
/// exception), or 57P01-57P03 and 57P05 (a terminated backend, a crash, a server starting,
/// an idle session timed out).
fn session_ended(code: &str) -> bool {
    code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03" | "57P05")
}

/// Whether an error of PostgreSQL's client says the connection is gone (the server ended
/// the session, the connection closed, the socket failed) rather than anything about the
/// statement or the data: what a caller may retry on a fresh connection when the statement
/// is a read, or when nothing was sent.
pub fn connection_lost(e: &tokio_postgres::Error) -> bool {
    match e.code() {
        Some(code) => session_ended(code.code()),
        None => {
            e.is_closed()
                || (e.as_db_error().is_none()
                    && std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>()))
        }
    }
}
