//! `#[service]`: turns a trait of async methods into an RPC service of coherent-rpc.
//! For `trait Calc` it emits the trait (with `Send` futures), `CalcServer<T>` (the
//! dispatcher, a `coherent_rpc::Service`) and `CalcClient` (typed calls over a `Peer`).

use proc_macro::TokenStream;
use proc_macro2::TokenStream as TokenStream2;
use quote::{format_ident, quote};
use syn::{
    parse_macro_input, spanned::Spanned, FnArg, GenericArgument, Ident, ItemTrait, Pat,
    PathArguments, ReturnType, TraitItem, Type,
};

/// Marks a trait as an RPC service.
///
/// Every method is `async fn name(&self, arg: T, ...) -> R` with owned serde types.
/// A method returning `ServerStream<T>` streams `T`s to the caller; a method marked
/// `#[oneway]` returns `()` and gets no reply; one marked `#[idempotent]` is resent by a
/// reconnecting caller when its connection drops mid-call. Method ids are the 32-bit FNV-1a hash of
/// `"<Trait>.<method>"`.
///
/// The generated code names coherent-rpc as `::coherent_rpc`; `#[service(crate = "path")]`
/// names it otherwise (a crate that renamed the dependency, or reaches it through another
/// crate). Through the `coherent` facade (`#[coherent::rpc::service]`) it is
/// `::coherent::rpc`, so that the facade is the only dependency a user needs.
#[proc_macro_attribute]
pub fn service(attr: TokenStream, item: TokenStream) -> TokenStream {
    service_in(syn::parse_quote!(::coherent_rpc), attr, item)
}

/// `#[service]` as the `coherent` facade re-exports it: the generated code reaches the RPC
/// layer through `::coherent::rpc`.
#[doc(hidden)]
#[proc_macro_attribute]
pub fn facade_service(attr: TokenStream, item: TokenStream) -> TokenStream {
    service_in(syn::parse_quote!(::coherent::rpc), attr, item)
}

fn service_in(default_krate: syn::Path, attr: TokenStream, item: TokenStream) -> TokenStream {
    let krate = match crate_argument(attr.into(), default_krate) {
        Ok(krate) => krate,
        Err(e) => return e.to_compile_error().into(),
    };
    let item = parse_macro_input!(item as ItemTrait);
    match expand(item, &quote!(#krate)) {
        Ok(t) => t.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

/// The macro's one optional argument, `crate = "path"`.
fn crate_argument(attr: TokenStream2, default: syn::Path) -> syn::Result<syn::Path> {
    if attr.is_empty() {
        return Ok(default);
    }
    let mut krate = None;
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("crate") && krate.is_none() {
            let lit: syn::LitStr = meta.value()?.parse()?;
            krate = Some(lit.parse::<syn::Path>()?);
            Ok(())
        } else {
            Err(meta.error("#[service] takes one argument: `crate = \"path\"`"))
        }
    });
    syn::parse::Parser::parse2(parser, attr)?;
    Ok(krate.unwrap_or(default))
}

enum Kind {
    Unary,
    OneWay,
    Stream(Box<Type>),
    /// Takes the caller's stream: the argument's position and its item type.
    Upload(usize, Box<Type>),
}

struct Method {
    name: Ident,
    args: Vec<(Ident, Type)>,
    output: Type,
    kind: Kind,
    idempotent: bool,
    attrs: Vec<syn::Attribute>,
}

fn fnv1a(s: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in s.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

fn stream_item(ty: &Type) -> Option<Type> {
    generic_of(ty, "ServerStream")
}

/// `T` of `...::<wrapper><T>`.
fn generic_of(ty: &Type, wrapper: &str) -> Option<Type> {
    let Type::Path(p) = ty else { return None };
    let seg = p.path.segments.last()?;
    if seg.ident != wrapper {
        return None;
    }
    let PathArguments::AngleBracketed(a) = &seg.arguments else {
        return None;
    };
    match a.args.first()? {
        GenericArgument::Type(t) => Some(t.clone()),
        _ => None,
    }
}

fn parse_method(f: &syn::TraitItemFn) -> syn::Result<Method> {
    let sig = &f.sig;
    if sig.asyncness.is_none() {
        return Err(syn::Error::new(
            sig.span(),
            "service methods must be `async fn`",
        ));
    }
    if !sig.generics.params.is_empty() {
        return Err(syn::Error::new(
            sig.generics.span(),
            "service methods cannot be generic",
        ));
    }
    let mut inputs = sig.inputs.iter();
    match inputs.next() {
        Some(FnArg::Receiver(r)) if matches!(r.kind, syn::ReceiverKind::Reference(_, _, None)) => {}
        _ => {
            return Err(syn::Error::new(
                sig.span(),
                "service methods take `&self` first",
            ))
        }
    }
    let mut args = Vec::new();
    for a in inputs {
        let FnArg::Typed(pt) = a else {
            unreachable!("receiver only comes first")
        };
        let Pat::Ident(pi) = &*pt.pat else {
            return Err(syn::Error::new(
                pt.pat.span(),
                "arguments must be plain names",
            ));
        };
        if let Type::Reference(r) = &*pt.ty {
            return Err(syn::Error::new(r.span(), "arguments must be owned types"));
        }
        args.push((pi.ident.clone(), (*pt.ty).clone()));
    }
    let output: Type = match &sig.output {
        ReturnType::Default => syn::parse_quote!(()),
        ReturnType::Type(_, t) => (**t).clone(),
    };
    let oneway = f.attrs.iter().any(|a| a.path().is_ident("oneway"));
    let uploads: Vec<(usize, Type)> = args
        .iter()
        .enumerate()
        .filter_map(|(i, (_, t))| generic_of(t, "Upload").map(|item| (i, item)))
        .collect();
    if uploads.len() > 1 {
        return Err(syn::Error::new(
            sig.span(),
            "a method takes at most one `Upload` argument",
        ));
    }
    let kind = if let Some((i, item)) = uploads.into_iter().next() {
        if oneway || stream_item(&output).is_some() {
            return Err(syn::Error::new(
                sig.span(),
                "a method that takes an `Upload` answers with one value (not #[oneway], not a stream)",
            ));
        }
        Kind::Upload(i, Box::new(item))
    } else if oneway {
        let unit = matches!(&output, Type::Tuple(t) if t.elems.is_empty());
        if !unit {
            return Err(syn::Error::new(
                output.span(),
                "#[oneway] methods return ()",
            ));
        }
        Kind::OneWay
    } else if let Some(item) = stream_item(&output).map(Box::new) {
        Kind::Stream(item)
    } else {
        Kind::Unary
    };
    let idempotent = f.attrs.iter().any(|a| a.path().is_ident("idempotent"));
    let attrs = f
        .attrs
        .iter()
        .filter(|a| !a.path().is_ident("oneway") && !a.path().is_ident("idempotent"))
        .cloned()
        .collect();
    Ok(Method {
        name: sig.ident.clone(),
        args,
        output,
        kind,
        idempotent,
        attrs,
    })
}

fn expand(item: ItemTrait, krate: &TokenStream2) -> syn::Result<TokenStream2> {
    if !item.generics.params.is_empty() {
        return Err(syn::Error::new(
            item.generics.span(),
            "service traits cannot be generic",
        ));
    }
    let mut methods = Vec::new();
    for ti in &item.items {
        match ti {
            TraitItem::Fn(f) => methods.push(parse_method(f)?),
            other => {
                return Err(syn::Error::new(
                    other.span(),
                    "a service trait holds only methods",
                ))
            }
        }
    }
    let vis = &item.vis;
    let trait_name = &item.ident;
    let trait_attrs = &item.attrs;
    let service_name = trait_name.to_string();
    let server = format_ident!("{}Server", trait_name);
    let client = format_ident!("{}Client", trait_name);

    let trait_methods = methods.iter().map(|m| {
        let name = &m.name;
        let attrs = &m.attrs;
        let output = &m.output;
        let args = m.args.iter().map(|(n, t)| quote!(#n: #t));
        quote! {
            #(#attrs)*
            fn #name(&self, #(#args),*) -> impl ::core::future::Future<Output = #output> + ::core::marker::Send;
        }
    });

    let ids: Vec<u32> = methods
        .iter()
        .map(|m| fnv1a(&format!("{service_name}.{}", m.name)))
        .collect();
    let infos = methods.iter().zip(&ids).map(|(m, id)| {
        let name = m.name.to_string();
        let kind = match m.kind {
            Kind::Unary => quote!(Unary),
            Kind::OneWay => quote!(OneWay),
            Kind::Stream(_) => quote!(Stream),
            Kind::Upload(..) => quote!(Upload),
        };
        quote!(#krate::MethodInfo { id: #id, name: #name, kind: #krate::MethodKind::#kind })
    });

    let arms = methods.iter().enumerate().map(|(i, m)| {
        let name = &m.name;
        let arg_names: Vec<_> = m.args.iter().map(|(n, _)| n).collect();
        let arg_types: Vec<_> = m.args.iter().map(|(_, t)| t).collect();
        let decode = quote! {
            let (#(#arg_names,)*): (#(#arg_types,)*) = format.decode_bytes(args)?;
        };
        match &m.kind {
            Kind::Unary | Kind::OneWay => quote! {
                #i => #krate::Response::Unary(::std::boxed::Box::pin(async move {
                    #decode
                    let out = svc.#name(#(#arg_names),*).await;
                    format.encode_message(&out)
                })),
            },
            Kind::Stream(_) => quote! {
                #i => #krate::Response::Stream(::std::boxed::Box::pin(async move {
                    #decode
                    let stream = svc.#name(#(#arg_names),*).await;
                    Ok(#krate::item_stream(stream))
                })),
            },
            Kind::Upload(at, _) => {
                // The other arguments travel in the call; the upload comes from the context.
                let (upload_name, _) = &m.args[*at];
                let sent: Vec<_> = m.args.iter().enumerate().filter(|(j, _)| j != at).map(|(_, a)| a).collect();
                let sent_names: Vec<_> = sent.iter().map(|(n, _)| n).collect();
                let sent_types: Vec<_> = sent.iter().map(|(_, t)| t).collect();
                quote! {
                    #i => #krate::Response::Unary(::std::boxed::Box::pin(async move {
                        let (#(#sent_names,)*): (#(#sent_types,)*) = format.decode_bytes(args)?;
                        let #upload_name = #krate::CallContext::current()
                            .ok_or_else(|| #krate::RpcError::new(#krate::ErrorCode::Internal, "no call context"))?
                            .take_upload()?;
                        let out = svc.#name(#(#arg_names),*).await;
                        format.encode_message(&out)
                    })),
                }
            }
        }
    });

    let client_methods = methods.iter().zip(&ids).map(|(m, id)| {
        let name = &m.name;
        let args: Vec<_> = m.args.iter().map(|(n, t)| quote!(#n: #t)).collect();
        let arg_names: Vec<_> = m.args.iter().map(|(n, _)| n).collect();
        let output = &m.output;
        let doc = format!("Calls `{service_name}.{name}` on the other side.");
        let idempotent = m.idempotent;
        match &m.kind {
            Kind::Unary => quote! {
                #[doc = #doc]
                pub async fn #name(&self, #(#args),*) -> ::core::result::Result<#output, #krate::RpcError> {
                    let mut options = self.options;
                    options.idempotent |= #idempotent;
                    #krate::Caller::call(&self.caller, #id, (#(#arg_names,)*), options).await
                }
            },
            Kind::OneWay => quote! {
                #[doc = #doc]
                #[doc = ""]
                #[doc = "One-way: returns once the call is queued; no reply comes back."]
                pub async fn #name(&self, #(#args),*) -> ::core::result::Result<(), #krate::RpcError> {
                    #krate::Caller::call_oneway(&self.caller, #id, (#(#arg_names,)*)).await
                }
            },
            Kind::Stream(item) => quote! {
                #[doc = #doc]
                pub async fn #name(&self, #(#args),*) -> ::core::result::Result<#krate::ClientStream<#item>, #krate::RpcError> {
                    #krate::Caller::call_stream(&self.caller, #id, (#(#arg_names,)*)).await
                }
            },
            Kind::Upload(at, item) => {
                let (upload_name, _) = &m.args[*at];
                let params = m.args.iter().enumerate().map(|(j, (n, t))| {
                    if j == *at {
                        quote!(#n: impl #krate::__private::Stream<Item = #item> + ::core::marker::Send + 'static)
                    } else {
                        quote!(#n: #t)
                    }
                });
                let sent_names: Vec<_> = m.args.iter().enumerate().filter(|(j, _)| j != at).map(|(_, (n, _))| n).collect();
                quote! {
                    #[doc = #doc]
                    #[doc = ""]
                    #[doc = "The stream argument is uploaded alongside the call, under the callee's credits."]
                    pub async fn #name(&self, #(#params),*) -> ::core::result::Result<#output, #krate::RpcError> {
                        #krate::Caller::call_upload(&self.caller, #id, (#(#sent_names,)*), #upload_name, self.options).await
                    }
                }
            }
        }
    });
    let id_consts = methods.iter().zip(&ids).map(|(m, id)| {
        let c = format_ident!("{}", m.name.to_string().to_uppercase());
        let doc = format!("The method id of `{service_name}.{}`.", m.name);
        quote!(#[doc = #doc] pub const #c: u32 = #id;)
    });
    let server_doc =
        format!("Serves a [`{trait_name}`] implementation: pass it to `EndpointBuilder::service`.");
    let client_doc = format!("Calls a remote [`{trait_name}`] over a `Peer`.");
    let ids_mod = format_ident!("{}_method_ids", service_name.to_lowercase());
    let ids_doc = format!("Method ids of [`{trait_name}`].");

    Ok(quote! {
        #(#trait_attrs)*
        #vis trait #trait_name: ::core::marker::Send + ::core::marker::Sync + 'static {
            #(#trait_methods)*
        }

        #[doc = #ids_doc]
        #[allow(non_snake_case)]
        #vis mod #ids_mod {
            #(#id_consts)*
        }

        #[doc = #server_doc]
        #vis struct #server<T>(::std::sync::Arc<T>);

        impl<T: #trait_name> #server<T> {
            /// Serves `inner`.
            pub fn new(inner: T) -> Self {
                Self(::std::sync::Arc::new(inner))
            }

            /// Serves a shared implementation.
            pub fn from_arc(inner: ::std::sync::Arc<T>) -> Self {
                Self(inner)
            }
        }

        impl<T: #trait_name> #krate::Service for #server<T> {
            fn name(&self) -> &'static str {
                #service_name
            }

            fn methods(&self) -> &'static [#krate::MethodInfo] {
                const METHODS: &[#krate::MethodInfo] = &[#(#infos),*];
                METHODS
            }

            fn call(
                &self,
                index: usize,
                args: #krate::__private::Bytes,
                format: #krate::Format,
            ) -> #krate::Response {
                let svc = ::std::sync::Arc::clone(&self.0);
                match index {
                    #(#arms)*
                    _ => #krate::Response::Unary(::std::boxed::Box::pin(async move {
                        let _ = (svc, args, format);
                        Err(#krate::RpcError::new(#krate::ErrorCode::UnknownMethod, "no such method index"))
                    })),
                }
            }
        }

        #[doc = #client_doc]
        #[derive(Clone)]
        #vis struct #client<C = #krate::Peer> {
            caller: C,
            options: #krate::CallOptions,
        }

        impl<C: #krate::Caller> #client<C> {
            /// A client calling through `caller` (a `Peer`, or a `Reconnecting` caller).
            pub fn new(caller: C) -> Self {
                Self { caller, options: ::core::default::Default::default() }
            }

            /// The same client with these call options.
            pub fn with_options(mut self, options: #krate::CallOptions) -> Self {
                self.options = options;
                self
            }

            /// The same client with a per-call deadline.
            pub fn with_timeout(mut self, timeout: ::std::time::Duration) -> Self {
                self.options.timeout = Some(timeout);
                self
            }

            /// What this client calls through.
            pub fn caller(&self) -> &C {
                &self.caller
            }

            #(#client_methods)*
        }
    })
}
