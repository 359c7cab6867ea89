//! Declarative sugar over `RemoteServer::expose` and `RemoteClient::replica`: a service's
//! methods exposed in one statement, and a typed client stub whose methods are compute
//! methods.

/// Exposes compute methods of one service under `"<Name>.<method>"`:
///
/// ```
/// # use coherent::{compute_service, ComputeService, ServiceHandle};
/// # #[derive(Clone, ComputeService)]
/// # struct Users { handle: ServiceHandle }
/// # #[compute_service]
/// # impl Users {
/// #     #[compute]
/// #     async fn name(&self, id: u64) -> String { format!("user {id}") }
/// #     #[compute]
/// #     async fn team(&self, id: u64, year: u16) -> u32 { 1 }
/// # }
/// # let users = Users { handle: ServiceHandle::new() };
/// let server = coherent_remote::expose!(
///     coherent_remote::RemoteServer::new(),
///     users as "Users" { name(id: u64), team(id: u64, year: u16) }
/// );
/// ```
///
/// Each method `m` is served through the generated `m_computed`.
#[macro_export]
macro_rules! expose {
    ($server:expr, $service:ident as $name:literal { $($method:ident($($arg:ident: $ty:ty),* $(,)?)),* $(,)? }) => {{
        let server = $server;
        $(
            let server = server.expose(
                ::core::concat!($name, ".", ::core::stringify!($method)),
                ::core::clone::Clone::clone(&$service),
                |service, ($($arg,)*): ($($ty,)*)| async move {
                    $crate::__private::paste! { service.[<$method _computed>]($($arg),*).await }
                },
            );
        )*
        server
    }};
}

/// A client stub for a service exposed under `$name`: a compute service whose methods are
/// replicas of the server's (see [`RemoteClient::replica`](crate::RemoteClient::replica)).
/// Each returns the server method's output wrapped in `Result<_, RpcError>`.
///
/// ```
/// coherent_remote::replica_service! {
///     /// Replicas of the server's `Users` methods.
///     pub struct UsersReplica = "Users" {
///         /// The user's name.
///         pub async fn name(&self, id: u64) -> String;
///     }
/// }
/// # async fn f(remote: coherent_remote::RemoteClient) {
/// let users = UsersReplica::new(remote);
/// let name: Result<String, coherent_rpc::RpcError> = users.name(7).await;
/// # }
/// ```
#[macro_export]
macro_rules! replica_service {
    (
        $(#[$meta:meta])*
        $vis:vis struct $stub:ident = $name:literal {
            $(
                $(#[$mmeta:meta])*
                $mvis:vis async fn $method:ident(&self $(, $arg:ident: $ty:ty)* $(,)?) -> $out:ty;
            )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone)]
        $vis struct $stub {
            handle: $crate::__private::coherent::ServiceHandle,
            remote: $crate::RemoteClient,
        }

        impl $crate::__private::coherent::ComputeService for $stub {
            fn compute_handle(&self) -> &$crate::__private::coherent::ServiceHandle {
                &self.handle
            }
        }

        impl $stub {
            /// A stub over `remote`, caching in the default registry.
            #[allow(dead_code)]
            $vis fn new(remote: $crate::RemoteClient) -> Self {
                Self { handle: $crate::__private::coherent::ServiceHandle::new(), remote }
            }

            /// A stub over `remote`, caching in `registry`.
            #[allow(dead_code)]
            $vis fn with_registry(
                remote: $crate::RemoteClient,
                registry: &$crate::__private::coherent::Registry,
            ) -> Self {
                Self { handle: $crate::__private::coherent::ServiceHandle::with_registry(registry), remote }
            }
        }

        #[$crate::__private::coherent::compute_service(crate = "::coherent_remote::__private::coherent")]
        impl $stub {
            $(
                $(#[$mmeta])*
                #[compute]
                $mvis async fn $method(&self $(, $arg: $ty)*)
                    -> ::core::result::Result<$out, $crate::__private::RpcError>
                {
                    self.remote
                        .replica(::core::concat!($name, ".", ::core::stringify!($method)), ($($arg,)*))
                        .await
                }
            )*
        }
    };
}
