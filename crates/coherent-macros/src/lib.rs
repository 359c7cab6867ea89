//! Procedural macros of Coherent. Use them through the `coherent` crate, which re-exports them.
//!
//! - `#[compute_service]` on an `impl` block turns its `#[compute]` async methods into memoized
//!   compute methods (see `compute_service.rs`);
//! - `#[derive(ComputeService)]` implements `ComputeService` for a struct holding a
//!   `ServiceHandle`.
//!
//! `#[compute_service]` on a trait defines a compute service (and, with the facade's `remote`
//! feature, its `<Trait>Client` stub and `<Trait>Server` exposure; `#[compute_service(local)]`
//! leaves them out, `#[compute_service(typescript)]` adds `<Trait>Server::typescript()`, the
//! methods described for TypeScript); on `impl Trait for Type` it memoizes every method of
//! such a trait.
//!
//! Generated code names only `::coherent` (its public types, `plumbing`, `__private` and
//! `__if_remote!`), so the crate path can be changed with
//! `#[compute_service(crate = "...")]`.

mod compute_service;
mod derive;
mod duration;
mod from_rpc_error;

use proc_macro::TokenStream;

/// Memoizes the `#[compute]` async methods of an `impl` block; on a trait, defines a compute
/// service; on `impl Trait for Type` of such a trait, memoizes every method.
///
/// On a trait, each `async fn` returns `Result<T, E>` with `E: From<RpcError>` and the trait
/// gets `<name>_computed` and `invalidate_<name>` beside each method; with the `remote`
/// feature of `coherent`, `<Trait>Server<S>` (for `RemoteServer::expose_service`) and
/// `<Trait>Client` (a stub implementing the trait with replicas) come with it, unless the
/// trait is marked `#[compute_service(local)]`, which also lifts the `Result` rule.
/// `#[compute_service(typescript)]` on a trait (with the facade's `typescript` feature) also
/// generates `<Trait>Server::typescript()`: each method's wire name, id, documentation,
/// argument types and result type, every type implementing `coherent::typescript::TS`.
///
/// For a method `async fn get(&self, id: u64) -> R` it generates, next to `get` itself (now
/// memoized): `get_computed(&self, id) -> Computed<R>`, which answers with the computed behind
/// the call, and `invalidate_get(&self, id) -> bool`, which invalidates that result and
/// everything computed from it.
///
/// Arguments must be owned values that are `Clone + Hash + Eq + Send + Sync + 'static` (they are
/// the cache key); `R` must be `Clone + Send + Sync + 'static`; the type must implement
/// `ComputeService`. Options: `#[compute(keep_alive = "5s", auto_invalidate = "1m",
/// error_invalidate = "10s", transient_error_invalidate = "500ms")]`.
#[proc_macro_attribute]
pub fn compute_service(attr: TokenStream, item: TokenStream) -> TokenStream {
    compute_service::expand(attr.into(), item.into())
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}

/// Implements `ComputeService` for a struct with a field of type `ServiceHandle` (or a field
/// marked `#[compute_handle]`).
#[proc_macro_derive(ComputeService, attributes(compute_handle))]
pub fn derive_compute_service(item: TokenStream) -> TokenStream {
    derive::expand(item.into())
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}

/// Implements `From<coherent::rpc::RpcError>` for an error enum, so that it can be the error
/// of a compute service's trait methods (a client's stub reports a lost connection or a
/// refused call through it). Mark the variant the RPC failure becomes with `#[rpc_error]`:
/// it holds the `RpcError` itself, its message (a `String`, or any type `From<String>`), or
/// nothing.
///
/// Not compiled here (this crate cannot depend on the facade it is used through); the
/// facade's `coherent::FromRpcError` documentation compiles and runs the same example.
///
/// ```ignore
/// #[derive(Debug, Clone, serde::Serialize, serde::Deserialize, coherent::FromRpcError)]
/// pub enum UsersError {
///     Database(String),
///     #[rpc_error]
///     Unavailable(String),
/// }
/// ```
#[proc_macro_derive(FromRpcError, attributes(rpc_error))]
pub fn derive_from_rpc_error(item: TokenStream) -> TokenStream {
    from_rpc_error::expand(item.into())
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}
