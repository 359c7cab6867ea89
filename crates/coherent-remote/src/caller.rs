//! [`Caller`]: a compute method's argument that the server fills in with who is asking.

use serde::{Deserialize, Serialize};

/// Who asked for a compute method's result: an argument that a server exposing the method
/// fills in from the connection the call came over, whatever the client sent. It is part
/// of the cache key like any argument, so a method that takes one computes, caches and
/// invalidates its result per caller, and can refuse a caller it does not serve:
///
/// ```
/// use coherent::compute_service;
/// use coherent::remote::Caller;
/// use coherent::rpc::RpcError;
///
/// #[compute_service]
/// pub trait Inbox {
///     /// The caller's unread count; an anonymous caller is refused.
///     async fn unread(&self, caller: Caller) -> Result<u32, RpcError>;
/// }
/// ```
///
/// What the server puts there, by the connection (see `coherent_rpc::Trust`):
///
/// - an **untrusted** one (a browser over WebSocket): the name of the `Identity` the
///   endpoint's authentication hook gave the connection, or [`Caller::anonymous`] if it
///   gave none. What the client sent is ignored: a client cannot ask as someone else;
/// - a **trusted** one (the application's own tier, asking on behalf of its own users):
///   what the client sent, which the tier took from its own caller's login;
/// - the HTTP gateway (`RemoteServer::gateway`): [`Caller::anonymous`].
///
/// In process (a call on the service itself, not through a server) it is what the calling
/// code passes. A client stub passes anything, [`Caller::anonymous`] say, unless it is a
/// tier passing its user on. A parameter is recognised by its type's name, `Caller`: a
/// type of your own of that name in a `#[compute_service]` trait does not compile.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Caller(Option<String>);

impl Caller {
    /// No one: a connection that did not authenticate, or the gateway.
    pub fn anonymous() -> Self {
        Self(None)
    }

    /// The caller named `name` (an `Identity`'s name): for calls in process, for a tier
    /// passing its user on, and for tests.
    pub fn named(name: impl Into<String>) -> Self {
        Self(Some(name.into()))
    }

    /// Its name, if it is someone's.
    pub fn name(&self) -> Option<&str> {
        self.0.as_deref()
    }

    /// Whether it is no one's.
    pub fn is_anonymous(&self) -> bool {
        self.0.is_none()
    }

    /// What a server puts in a `Caller` argument that a client `sent`, by the call being
    /// served: see [`Caller`]. Used by the code `#[compute_service]` generates; outside an
    /// RPC call (the gateway), anonymous.
    #[doc(hidden)]
    pub fn on_server(sent: Caller) -> Self {
        match coherent_rpc::CallContext::current() {
            Some(ctx) if ctx.peer().trust() == coherent_rpc::Trust::Trusted => sent,
            Some(ctx) => ctx
                .identity()
                .map_or_else(Self::anonymous, |i| Self::named(i.name())),
            None => Self::anonymous(),
        }
    }
}

impl std::fmt::Display for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(name) => f.write_str(name),
            None => f.write_str("(anonymous)"),
        }
    }
}
