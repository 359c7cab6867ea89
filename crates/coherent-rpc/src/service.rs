//! What a served method looks like to the connection: the `Service` trait that
//! `#[service]` implements, the method-id hash, the registry that maps ids to handlers,
//! and the task-local `CallContext` through which a handler sees who called it.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::Stream;
use serde::Serialize;

use crate::codec::{Format, Message};
use crate::error::RpcError;
use crate::peer::Peer;

/// A boxed, sendable future, as produced by generated dispatchers.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// The stream a streaming method returns: items sent to the caller under flow control.
pub type ServerStream<T> = Pin<Box<dyn Stream<Item = T> + Send + 'static>>;

/// The stable id of `service.method` on the wire: 32-bit FNV-1a of the UTF-8 bytes of
/// `"<Service>.<method>"`. `#[service]` computes the same value at compile time.
pub const fn method_id(full_name: &str) -> u32 {
    let bytes = full_name.as_bytes();
    let mut hash: u32 = 0x811c_9dc5;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u32;
        hash = hash.wrapping_mul(0x0100_0193);
        i += 1;
    }
    hash
}

/// How a method answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MethodKind {
    /// One reply (`Ok` or `Error`).
    Unary,
    /// No reply at all.
    OneWay,
    /// Zero or more `StreamItem`s, then `StreamEnd` or `Error`.
    Stream,
    /// Reads the caller's upload (a stream argument), then one reply.
    Upload,
}

/// One method of a service, as listed by [`Service::methods`].
#[derive(Debug, Clone, Copy)]
pub struct MethodInfo {
    /// `method_id("<Service>.<method>")`.
    pub id: u32,
    /// The method's name (without the service).
    pub name: &'static str,
    /// How it answers.
    pub kind: MethodKind,
}

/// What a dispatcher hands back for one inbound call.
pub enum Response {
    /// A unary (or one-way) call: the encoded result (see [`Format::encode_message`]).
    Unary(BoxFuture<Result<Message, RpcError>>),
    /// A streaming call: its items, once the handler produced them.
    Stream(BoxFuture<Result<ItemStream, RpcError>>),
}

/// A streaming method's items as the connection pulls them: each item is encoded
/// straight into the batch that carries it, so a small item costs no buffer of its own.
pub type ItemStream = Pin<Box<dyn EncodeItems>>;

/// A stream whose items are encoded on demand; made from a [`ServerStream`] by
/// [`item_stream`]. Implement it by hand only for items that are already encoded.
pub trait EncodeItems: Send {
    /// Polls for the next item. On `Ready(Some(Ok(())))` its encoding in `format` has
    /// been appended to `out`; on any other answer `out` is left as it was.
    fn poll_encode(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        format: Format,
        out: &mut Vec<u8>,
    ) -> Poll<Option<Result<(), RpcError>>>;
}

/// Wraps a stream of serde items for [`Response::Stream`].
pub fn item_stream<T: Serialize + 'static>(items: ServerStream<T>) -> ItemStream {
    struct Encoded<T>(ServerStream<T>);

    impl<T: Serialize> EncodeItems for Encoded<T> {
        fn poll_encode(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            format: Format,
            out: &mut Vec<u8>,
        ) -> Poll<Option<Result<(), RpcError>>> {
            self.0.as_mut().poll_next(cx).map(|item| {
                item.map(|item| {
                    let start = out.len();
                    let written = format.encode_into(&item, out);
                    if written.is_err() {
                        out.truncate(start);
                    }
                    written
                })
            })
        }
    }

    Box::pin(Encoded(items))
}

/// A served service. Implemented by the `<Trait>Server` type that `#[service]` generates;
/// implement it by hand only to serve something without a trait.
pub trait Service: Send + Sync + 'static {
    /// The service's name, the prefix of its method ids.
    fn name(&self) -> &'static str;
    /// Its methods; `call`'s `index` indexes this slice.
    fn methods(&self) -> &'static [MethodInfo];
    /// Starts method `index` with encoded `args`.
    fn call(&self, index: usize, args: Bytes, format: Format) -> Response;
}

#[derive(Clone)]
pub(crate) struct Entry {
    pub(crate) service: Arc<dyn Service>,
    pub(crate) index: usize,
    pub(crate) kind: MethodKind,
}

/// Method id → handler, built once per endpoint and shared by its connections.
#[derive(Clone, Default)]
pub(crate) struct Registry {
    /// foldhash: the ids are hashes already, and looking up ids that the other side
    /// chooses cannot grow a table that only registration fills.
    methods: HashMap<u32, Entry, foldhash::fast::RandomState>,
}

impl Registry {
    /// Adds every method of `service`.
    ///
    /// # Panics
    /// When two registered methods hash to the same id: rename one of them.
    pub(crate) fn add(&mut self, service: Arc<dyn Service>) {
        for (index, m) in service.methods().iter().enumerate() {
            let full = format!("{}.{}", service.name(), m.name);
            assert_eq!(
                m.id,
                method_id(&full),
                "method id of {full} is not its hash"
            );
            if let Some(old) = self.methods.get(&m.id) {
                let other = &old.service.methods()[old.index];
                panic!(
                    "method id collision: {full} and {}.{} both hash to {:#010x}",
                    old.service.name(),
                    other.name,
                    m.id
                );
            }
            self.methods.insert(
                m.id,
                Entry {
                    service: service.clone(),
                    index,
                    kind: m.kind,
                },
            );
        }
    }

    pub(crate) fn get(&self, id: u32) -> Option<&Entry> {
        self.methods.get(&id)
    }
}

/// Who a connection authenticated as, from the endpoint's authentication hook: a name, and
/// optionally a typed principal of the application's own (its user record, its roles), which
/// handlers read back with [`Identity::principal`]. Two identities are equal when their
/// names are.
#[derive(Clone)]
pub struct Identity {
    name: Arc<str>,
    principal: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl Identity {
    /// An identity named `name`.
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        Self {
            name: name.into(),
            principal: None,
        }
    }

    /// This identity carrying `principal`, the application's own description of who it is.
    pub fn with_principal<P: std::any::Any + Send + Sync>(mut self, principal: P) -> Self {
        self.principal = Some(Arc::new(principal));
        self
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The principal it carries, if it carries one of type `P`.
    pub fn principal<P: std::any::Any + Send + Sync>(&self) -> Option<&P> {
        self.principal.as_deref()?.downcast_ref()
    }
}

impl PartialEq for Identity {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Eq for Identity {}

impl std::hash::Hash for Identity {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.name.hash(state);
    }
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Identity({})", self.name())
    }
}

/// What a connecting client presented, for the endpoint's authentication hook
/// ([`EndpointBuilder::authenticate_with`](crate::EndpointBuilder::authenticate_with)):
/// the bearer token of its `Hello`, and for a connection that came over WebSocket, the
/// headers of its HTTP upgrade request (where a browser's cookies are: a page's script
/// cannot set headers on a WebSocket, and its token would be readable by any script on the
/// page).
#[derive(Clone, Default)]
pub struct Credentials {
    pub(crate) token: String,
    /// Lowercase names; values that are not UTF-8 are left out.
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) over_http: bool,
}

impl Credentials {
    /// The bearer token of the `Hello` (empty when the client sent none).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Whether the connection came through an HTTP upgrade (WebSocket), so that
    /// [`header`](Self::header) and [`cookie`](Self::cookie) can say something.
    pub fn over_http(&self) -> bool {
        self.over_http
    }

    /// The first value of the upgrade request's header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Every value of the upgrade request's cookie `name`, in order (a browser may send
    /// several cookies of one name, for different paths).
    pub fn cookies<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.headers
            .iter()
            .filter(|(n, _)| n == "cookie")
            .flat_map(|(_, v)| v.split(';'))
            .filter_map(|c| c.trim().split_once('='))
            .filter(move |(k, _)| *k == name)
            .map(|(_, v)| v)
    }

    /// The first value of the upgrade request's cookie `name`.
    pub fn cookie<'a>(&'a self, name: &'a str) -> Option<&'a str> {
        self.cookies(name).next()
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Tokens and cookies are secrets: their presence only.
        f.debug_struct("Credentials")
            .field("token", &(!self.token.is_empty()))
            .field("over_http", &self.over_http)
            .field(
                "headers",
                &self.headers.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// What a running handler knows about its call. Read it with [`CallContext::current`].
#[derive(Clone)]
pub struct CallContext {
    pub(crate) peer: Peer,
    pub(crate) call_id: u64,
    pub(crate) method_id: u32,
    /// The receiving end of the call's upload, until the handler takes it (`None` for a
    /// method that takes no upload: most calls allocate nothing here).
    pub(crate) upload: Option<Arc<parking_lot::Mutex<Option<UploadParts>>>>,
}

pub(crate) type UploadParts = (
    tokio::sync::mpsc::UnboundedReceiver<crate::stream::Event>,
    Arc<std::sync::atomic::AtomicU32>,
);

tokio::task_local! {
    pub(crate) static CONTEXT: CallContext;
}

impl CallContext {
    /// The context of the call whose handler is running on this task, if any.
    pub fn current() -> Option<CallContext> {
        CONTEXT.try_with(Clone::clone).ok()
    }

    /// The connection the call came in on: call the caller's own services through it.
    pub fn peer(&self) -> &Peer {
        &self.peer
    }

    /// Who the caller authenticated as (`None` when the endpoint has no auth hook).
    pub fn identity(&self) -> Option<&Identity> {
        self.peer.identity()
    }

    /// The call's id on its connection.
    pub fn call_id(&self) -> u64 {
        self.call_id
    }

    /// The called method's id.
    pub fn method_id(&self) -> u32 {
        self.method_id
    }

    /// The caller's upload, once: what `#[service]` passes to a method that takes an
    /// [`Upload`](crate::Upload) argument.
    pub fn take_upload<T>(&self) -> Result<crate::Upload<T>, RpcError> {
        let taken = self.upload.as_ref().and_then(|u| u.lock().take());
        let (rx, buffered) = taken.ok_or_else(|| {
            RpcError::new(
                crate::ErrorCode::Internal,
                "this call has no upload, or it was taken already",
            )
        })?;
        Ok(crate::Upload::new(
            self.peer.shared.clone(),
            self.call_id,
            rx,
            buffered,
        ))
    }
}
