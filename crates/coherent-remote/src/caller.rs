//! [`Caller`]: a compute method's argument that the server fills in with who is asking.

use std::cell::Cell;

use serde::{Deserialize, Deserializer, Serialize};

/// Who asked for a compute method's result: an argument that a `RemoteServer` fills in
/// from the connection the call came over, whatever the client sent, wherever it is in the
/// arguments (a field of a struct argument, a method exposed with `RemoteServer::expose` by
/// hand alike: it is filled in as the arguments are decoded; but an `Option<Caller>` the
/// client sent as `None` holds none to fill in: take a `Caller` where the method needs one). It
/// is part of the cache key like any argument, so a method that takes one computes, caches
/// and invalidates its result per caller, and can refuse a caller it does not serve:
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
///   what the client sent, which the tier took from its own caller's login. Mind what is
///   trusted: TCP, TLS and Unix connections by default, every connection of an endpoint
///   whose `Config::trust` says so (its WebSockets too), and the connections an endpoint
///   makes itself. Anyone who can open a trusted connection can ask as anyone;
/// - the HTTP gateway (`RemoteServer::gateway`): [`Caller::anonymous`].
///
/// The identity is the connection's, given by the authentication hook when it was
/// accepted: a connection that outlives the login it presented keeps asking as it until
/// it reconnects.
///
/// In process (a call on the service itself, not through a server) it is what the calling
/// code passes. A client passes its own name where it knows it (a browser's client, after
/// its login), so that its own cache keeps each user's results apart; a tier passes its
/// user's.
///
/// With the `typescript` feature it is `string | null` in TypeScript declarations.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "typescript", derive(ts_rs::TS))]
pub struct Caller(Option<String>);

/// As its name or none (`Option<String>`'s shape).
impl Serialize for Caller {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

thread_local! {
    /// Set while a server decodes a call's arguments: see [`filled_in`].
    static FILLING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `decode` (a server decoding a call's arguments, synchronously) with every
/// [`Caller`] it decodes filled in by [`Caller::on_server`].
pub(crate) fn filled_in<T>(decode: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            FILLING.with(|f| f.set(self.0));
        }
    }
    let _reset = Reset(FILLING.with(|f| f.replace(true)));
    decode()
}

impl<'de> Deserialize<'de> for Caller {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let sent = Self(Option::<String>::deserialize(d)?);
        Ok(if FILLING.with(Cell::get) {
            Self::on_server(sent)
        } else {
            sent
        })
    }
}

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
    /// served: see [`Caller`]. Outside an RPC call (the gateway), anonymous.
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
