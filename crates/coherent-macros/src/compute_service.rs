//! `#[compute_service]`, on three kinds of item:
//!
//! - an inherent `impl` block: rewrites each `#[compute]` method into a memoized front (hit
//!   path inline, slow path through the method's table), keeps the original body in a hidden
//!   method, and adds `<name>_computed` and `invalidate_<name>`;
//! - a trait: the definition of a compute service. Each `async fn` becomes a method
//!   returning a `Send` future, with `<name>_computed` and `invalidate_<name>` beside it;
//!   where the `remote` feature of `coherent` is on, `<Trait>Client` (a stub implementing
//!   the trait with replicas) and `<Trait>Server` (its exposure to remote clients) come with it;
//! - an `impl Trait for Type` of such a trait: every method is memoized as in an inherent
//!   block, the hidden parts going to an inherent block of their own.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{
    Attribute, FnArg, GenericArgument, Ident, ImplItem, ImplItemFn, Item, ItemImpl, ItemTrait,
    LitStr, Meta, Pat, Path, PathArguments, ReturnType, Token, TraitItem, Type,
};

use crate::duration;

pub(crate) fn expand(attr: TokenStream, item: TokenStream) -> syn::Result<TokenStream> {
    let Args {
        krate,
        local,
        typescript,
    } = parse_args(attr)?;
    let item = syn::parse2::<Item>(item)?;
    if let (Some(local), Item::Impl(_)) = (&local, &item) {
        return Err(syn::Error::new_spanned(
            local,
            "`local` goes on the trait: it leaves out the trait's client stub and server",
        ));
    }
    if let (Some(typescript), Item::Impl(_)) = (&typescript, &item) {
        return Err(syn::Error::new_spanned(
            typescript,
            "`typescript` goes on the trait: it describes the methods its server exposes",
        ));
    }
    if let (Some(_), Some(typescript)) = (&local, &typescript) {
        return Err(syn::Error::new_spanned(
            typescript,
            "`typescript` describes the methods `<Trait>Server` exposes, and a `local` trait has none",
        ));
    }
    match item {
        Item::Trait(t) => expand_trait(t, &krate, local.is_some(), typescript.is_some()),
        Item::Impl(imp) if imp.trait_.is_some() => expand_trait_impl(imp, &krate, None),
        Item::Impl(imp) => expand_inherent(imp, &krate),
        other => Err(syn::Error::new_spanned(
            other,
            "#[compute_service] goes on a trait, an impl of such a trait, or an inherent impl block",
        )),
    }
}

/// Where a memoized method goes.
enum Mode<'a> {
    /// An inherent block: everything in it, with the method's visibility.
    Inherent,
    /// A trait's impl: the front, `_computed` and `invalidate_` in it; the rest in an
    /// inherent block.
    TraitImpl(&'a Path),
}

fn expand_inherent(mut imp: ItemImpl, krate: &Path) -> syn::Result<TokenStream> {
    let type_name = type_label(&imp.self_ty);
    let mut generated = Vec::new();
    for item in &mut imp.items {
        let ImplItem::Fn(method) = item else { continue };
        let Some(position) = method.attrs.iter().position(is_compute_attr) else {
            continue;
        };
        let attr = method.attrs.remove(position);
        let options = parse_options(&attr, krate)?;
        let (front, hidden) = expand_method(method, &options, &type_name, krate, &Mode::Inherent)?;
        generated.push(front);
        generated.push(hidden);
    }
    if generated.is_empty() {
        return Err(syn::Error::new(
            Span::call_site(),
            "#[compute_service] found no #[compute] method in this impl block",
        ));
    }
    // Each compute method is replaced by what `expand_method` generated.
    imp.items
        .retain(|item| !matches!(item, ImplItem::Fn(m) if is_placeholder(m)));
    for items in generated {
        imp.items.extend(items);
    }
    Ok(quote!(#imp))
}

/// `impl Trait for Type` of a compute service trait: every method is a compute method
/// (`#[compute(...)]` on one sets its options). `stub_options`: the options of a generated
/// client stub's methods, which have no attributes of their own.
fn expand_trait_impl(
    mut imp: ItemImpl,
    krate: &Path,
    stub_options: Option<&TokenStream>,
) -> syn::Result<TokenStream> {
    let trait_path = imp.trait_.as_ref().expect("a trait impl").0.clone();
    let type_name = type_label(&imp.self_ty);
    let mut fronts = Vec::new();
    let mut hidden = Vec::new();
    for item in &mut imp.items {
        let ImplItem::Fn(method) = item else {
            return Err(syn::Error::new_spanned(
                item,
                "an impl of a compute service trait holds only its methods",
            ));
        };
        let options = match method.attrs.iter().position(is_compute_attr) {
            Some(position) => {
                let attr = method.attrs.remove(position);
                parse_options(&attr, krate)?
            }
            None => stub_options
                .cloned()
                .unwrap_or_else(|| quote!(#krate::plumbing::ComputeOptions::DEFAULT)),
        };
        let (front, rest) = expand_method(
            method,
            &options,
            &type_name,
            krate,
            &Mode::TraitImpl(&trait_path),
        )?;
        fronts.extend(front);
        hidden.extend(rest);
    }
    if fronts.is_empty() {
        return Err(syn::Error::new(
            Span::call_site(),
            "#[compute_service] found no method in this impl block",
        ));
    }
    imp.items = fronts;
    let (impl_generics, _, where_clause) = imp.generics.split_for_impl();
    let self_ty = &imp.self_ty;
    Ok(quote! {
        #imp
        impl #impl_generics #self_ty #where_clause {
            #(#hidden)*
        }
    })
}

/// The macro's arguments: `crate = "path"` (where the generated code finds the facade) and,
/// on a trait, `local` (no client stub or server) or `typescript` (`<Trait>Server::typescript()`,
/// the methods described for TypeScript).
struct Args {
    krate: Path,
    local: Option<Path>,
    typescript: Option<Path>,
}

fn parse_args(attr: TokenStream) -> syn::Result<Args> {
    let mut args = Args {
        krate: syn::parse_quote!(::coherent),
        local: None,
        typescript: None,
    };
    let metas = Punctuated::<Meta, Token![,]>::parse_terminated.parse2(attr)?;
    for meta in metas {
        match &meta {
            Meta::NameValue(nv) if nv.path.is_ident("crate") => {
                let lit: LitStr = match &nv.value {
                    syn::Expr::Lit(syn::ExprLit {
                        lit: syn::Lit::Str(s),
                        ..
                    }) => s.clone(),
                    other => return Err(syn::Error::new_spanned(other, "expected a string")),
                };
                args.krate = lit.parse::<Path>()?;
            }
            Meta::Path(p) if p.is_ident("local") => args.local = Some(p.clone()),
            Meta::Path(p) if p.is_ident("typescript") => args.typescript = Some(p.clone()),
            other => {
                return Err(syn::Error::new_spanned(
                    other,
                    "unknown argument: expected `crate = \"path\"` or, on a trait, `local` or `typescript`",
                ))
            }
        }
    }
    Ok(args)
}

fn is_compute_attr(attr: &Attribute) -> bool {
    attr.path().is_ident("compute")
}

const PLACEHOLDER: &str = "__coherent_replaced";

fn is_placeholder(method: &ImplItemFn) -> bool {
    method.sig.ident == PLACEHOLDER
}

fn type_label(ty: &Type) -> String {
    match ty {
        Type::Path(p) => p
            .path
            .segments
            .last()
            .map_or_else(|| "service".to_owned(), |s| s.ident.to_string()),
        _ => "service".to_owned(),
    }
}

fn parse_options(attr: &Attribute, krate: &Path) -> syn::Result<TokenStream> {
    let mut options = quote!(#krate::plumbing::ComputeOptions::DEFAULT);
    if matches!(attr.meta, Meta::Path(_)) {
        return Ok(options);
    }
    attr.parse_nested_meta(|meta| {
        let setter = if meta.path.is_ident("keep_alive") || meta.path.is_ident("min_cache_duration")
        {
            "with_keep_alive"
        } else if meta.path.is_ident("auto_invalidate") || meta.path.is_ident("ttl") {
            "with_auto_invalidate"
        } else if meta.path.is_ident("error_invalidate") {
            "with_error_invalidate"
        } else if meta.path.is_ident("transient_error_invalidate") {
            "with_transient_error_invalidate"
        } else {
            return Err(meta.error(
                "unknown option: expected keep_alive, auto_invalidate, error_invalidate or transient_error_invalidate",
            ));
        };
        let lit: LitStr = meta.value()?.parse()?;
        let value = duration::parse(&lit)?;
        let setter = Ident::new(setter, Span::call_site());
        options = quote!(#options.#setter(#value));
        Ok(())
    })?;
    Ok(options)
}

/// Whether the return type is spelled `...::Result<..>`, and so gets errors cached by kind.
fn returns_result(ty: &Type) -> bool {
    match ty {
        Type::Path(p) => p.path.segments.last().is_some_and(|s| {
            s.ident == "Result"
                && matches!(&s.arguments, PathArguments::AngleBracketed(a)
                    if a.args.iter().any(|g| matches!(g, GenericArgument::Type(_))))
        }),
        _ => false,
    }
}

/// The items replacing one compute method: those that go where the method was, and the
/// hidden ones (which go beside them in an inherent block, apart in a trait impl).
fn expand_method(
    method: &mut ImplItemFn,
    options: &TokenStream,
    type_name: &str,
    krate: &Path,
    mode: &Mode<'_>,
) -> syn::Result<(Vec<ImplItem>, Vec<ImplItem>)> {
    let sig = &method.sig;
    if sig.asyncness.is_none() {
        return Err(syn::Error::new_spanned(
            sig.fn_token,
            match mode {
                Mode::Inherent => "a #[compute] method must be `async`",
                Mode::TraitImpl(_) => {
                    "every method of an impl of a compute service trait is a compute method and \
                     must be `async`; is the trait marked #[compute_service]?"
                }
            },
        ));
    }
    if !sig.generics.params.is_empty() {
        return Err(syn::Error::new_spanned(
            &sig.generics,
            "a #[compute] method cannot be generic: its arguments are the cache key",
        ));
    }
    let (arg_names, arg_types): (Vec<Ident>, Vec<Type>) =
        method_args(&sig.inputs)?.into_iter().unzip();
    let output: Type = match &sig.output {
        ReturnType::Default => syn::parse_quote!(()),
        ReturnType::Type(_, ty) => (**ty).clone(),
    };

    let name = sig.ident.clone();
    let vis = method.vis.clone();
    let attrs: Vec<Attribute> = method
        .attrs
        .iter()
        .filter(|a| a.path().is_ident("doc") || a.path().is_ident("allow"))
        .cloned()
        .collect();
    // A trait impl's hidden helpers share the type's inherent namespace with those of its
    // other traits and of its inherent compute methods: the trait's name keeps them apart.
    let (label, scope) = match mode {
        Mode::Inherent => (format!("{type_name}::{name}"), String::new()),
        Mode::TraitImpl(trait_path) => {
            let trait_name = trait_path
                .segments
                .last()
                .map_or_else(String::new, |s| s.ident.to_string());
            (
                format!("<{type_name} as {trait_name}>::{name}"),
                format!("{}_", trait_name.to_lowercase()),
            )
        }
    };
    let computed_name = format_ident!("{}_computed", name);
    let invalidate_name = format_ident!("invalidate_{}", name);
    let body_name = format_ident!("__coherent_{}body_{}", scope, name);
    let method_fn = format_ident!("__coherent_{}method_{}", scope, name);
    let classify_fn = format_ident!("__coherent_{}classify_{}", scope, name);
    let input_fn = format_ident!("__coherent_{}input_{}", scope, name);
    let miss_fn = format_ident!("__coherent_{}miss_{}", scope, name);
    let key_ty = quote!((#(#arg_types,)*));
    let key = quote!((#(#arg_names,)*));
    let args = quote!(#(#arg_names: #arg_types),*);
    let plumbing = quote!(#krate::plumbing);

    let classify_body = if returns_result(&output) {
        quote! {
            #[allow(unused_imports)]
            use #plumbing::{ProbePlain as _, ProbeTransient as _};
            match output {
                ::core::result::Result::Ok(_) => #plumbing::OutputKind::Value,
                ::core::result::Result::Err(error) => (&#plumbing::ErrorProbe(error)).kind(),
            }
        }
    } else {
        quote!(#plumbing::classify_value(output))
    };
    let table = quote! {
        #plumbing::table::<Self, #key_ty, #output>(self, Self::#method_fn(), Self::#classify_fn)
    };

    // The original method becomes the hidden body; its name is freed for the memoized front.
    let mut body = method.clone();
    body.sig.ident = body_name.clone();
    body.vis = syn::Visibility::Inherited;
    body.attrs.retain(|a| !a.path().is_ident("doc"));
    body.attrs.push(syn::parse_quote!(#[doc(hidden)]));
    method.sig.ident = Ident::new(PLACEHOLDER, Span::call_site());

    let computed_doc =
        format!("Like [`{name}`](Self::{name}), but answers with the computed behind the call.");
    let invalidate_doc = format!(
        "Invalidates the cached result of [`{name}`](Self::{name}) for these arguments, and \
         everything computed from it. Returns `false` if there was no such result."
    );
    // The computed behind a call, from a recompute closure that owns a clone of the service.
    let computed_of_service = match mode {
        Mode::Inherent => quote!(__coherent_service.#computed_name(#(#arg_names),*)),
        Mode::TraitImpl(trait_path) => {
            quote!(<Self as #trait_path>::#computed_name(&__coherent_service, #(#arg_names),*))
        }
    };
    let front: Vec<ImplItem> = vec![
        syn::parse_quote! {
            #(#attrs)*
            // Inline: a hit is a few dozen instructions, and a call (with the answer copied out
            // of it) would be a third of them.
            #[inline]
            #vis async fn #name(&self, #args) -> #output {
                let __coherent_table = #table;
                let __coherent_key = #key;
                if let ::core::option::Option::Some(__coherent_hit) =
                    __coherent_table.hit(&__coherent_key)
                {
                    // Cloned straight out of the table into the answer; the hit (a read
                    // lock) is dropped right after.
                    return ::core::clone::Clone::clone(&*__coherent_hit);
                }
                self.#miss_fn(__coherent_key).await
            }
        },
        syn::parse_quote! {
            #[doc = #computed_doc]
            #vis async fn #computed_name(&self, #args) -> #krate::Computed<#output> {
                #table
                    .computed(
                        #key,
                        |__coherent_key| self.#input_fn(__coherent_key),
                        |#key| self.#body_name(#(#arg_names),*),
                    )
                    .await
            }
        },
        syn::parse_quote! {
            #[doc = #invalidate_doc]
            #vis fn #invalidate_name(&self, #args) -> bool {
                #table.invalidate(&#key)
            }
        },
    ];
    let hidden: Vec<ImplItem> = vec![
        syn::parse_quote! {
            /// The miss path, out of line and boxed: its future (the body's included) can be
            /// kilobytes, and inline it would make every call's future that large, hits too,
            /// which then pay for moving it, and the front too big to inline into its callers.
            #[doc(hidden)]
            #[inline(never)]
            fn #miss_fn(
                &self,
                __coherent_key: #key_ty,
            ) -> #plumbing::Miss<impl ::core::future::Future<Output = #output> + '_> {
                #plumbing::Miss::new(#table.compute(
                    __coherent_key,
                    |#key| self.#body_name(#(#arg_names),*),
                ))
            }
        },
        syn::parse_quote! {
            #[doc(hidden)]
            fn #method_fn() -> &'static #plumbing::MethodDescriptor {
                static METHOD: #plumbing::MethodDescriptor =
                    #plumbing::MethodDescriptor::new(#label, #options);
                &METHOD
            }
        },
        syn::parse_quote! {
            #[doc(hidden)]
            fn #classify_fn(output: &#output) -> #plumbing::OutputKind {
                #classify_body
            }
        },
        syn::parse_quote! {
            #[doc(hidden)]
            fn #input_fn(&self, __coherent_key: &#key_ty) -> #plumbing::Recompute<#output> {
                let __coherent_service = ::core::clone::Clone::clone(self);
                let __coherent_key = ::core::clone::Clone::clone(__coherent_key);
                #plumbing::recompute(move || {
                    let __coherent_service = ::core::clone::Clone::clone(&__coherent_service);
                    let #key = ::core::clone::Clone::clone(&__coherent_key);
                    ::std::boxed::Box::pin(async move {
                        ::core::option::Option::Some(#computed_of_service.await)
                    })
                })
            }
        },
        ImplItem::Fn(body),
    ];
    Ok((front, hidden))
}

/// One method of a compute service trait.
struct TraitMethod {
    name: Ident,
    attrs: Vec<Attribute>,
    args: Vec<(Ident, Type)>,
    output: Type,
}

/// A trait that defines a compute service: the trait with `Send` futures and each
/// method's `_computed` and `invalidate_`; behind `__if_remote!`, its client stub and its
/// server-side exposure; with `typescript`, behind `__if_typescript!`, the description of its
/// methods for TypeScript.
fn expand_trait(
    mut t: ItemTrait,
    krate: &Path,
    local: bool,
    typescript: bool,
) -> syn::Result<TokenStream> {
    if !t.generics.params.is_empty() {
        return Err(syn::Error::new_spanned(
            &t.generics,
            "a compute service trait cannot be generic: its methods are named on the wire by the trait's name",
        ));
    }
    let mut methods = Vec::new();
    for item in &t.items {
        let TraitItem::Fn(f) = item else {
            return Err(syn::Error::new_spanned(
                item,
                "a compute service trait holds only `async fn` methods",
            ));
        };
        methods.push(parse_trait_method(f, local)?);
    }
    if methods.is_empty() {
        return Err(syn::Error::new_spanned(
            &t.ident,
            "a compute service trait needs at least one method",
        ));
    }
    let trait_name = &t.ident;
    let vis = &t.vis;
    let computed = quote!(#krate::Computed);
    t.items = methods
        .iter()
        .flat_map(|m| {
            let TraitMethod {
                name,
                attrs,
                args,
                output,
            } = m;
            let computed_name = format_ident!("{}_computed", name);
            let invalidate_name = format_ident!("invalidate_{}", name);
            let params: Vec<_> = args.iter().map(|(n, ty)| quote!(#n: #ty)).collect();
            let computed_doc = format!(
                "Like [`{name}`](Self::{name}), but answers with the computed behind the call."
            );
            let invalidate_doc = format!(
                "Invalidates the cached result of [`{name}`](Self::{name}) for these \
                 arguments, and everything computed from it. Returns `false` if there was no \
                 such result."
            );
            let items: [TraitItem; 3] = [
                syn::parse_quote! {
                    #(#attrs)*
                    fn #name(&self, #(#params),*)
                        -> impl ::core::future::Future<Output = #output> + ::core::marker::Send;
                },
                syn::parse_quote! {
                    #[doc = #computed_doc]
                    fn #computed_name(&self, #(#params),*)
                        -> impl ::core::future::Future<Output = #computed<#output>> + ::core::marker::Send;
                },
                syn::parse_quote! {
                    #[doc = #invalidate_doc]
                    fn #invalidate_name(&self, #(#params),*) -> bool;
                },
            ];
            items
        })
        .collect();
    if local {
        return Ok(quote!(#t));
    }
    let remote = expand_remote(trait_name, vis, &methods, krate)?;
    // Outside `__if_remote!`: without the `typescript` feature it is a compile error, not
    // nothing (the feature turns `remote` on, so the server is there where it is on).
    let typescript = typescript.then(|| {
        let ts = expand_typescript(trait_name, vis, &methods, krate);
        quote! {
            #krate::__if_typescript! {
                #ts
            }
        }
    });
    Ok(quote! {
        #t
        #krate::__if_remote! {
            #remote
        }
        #typescript
    })
}

/// `<Trait>Server::typescript()`: every method's wire name, id, documentation, argument
/// types and result type, for `coherent::typescript::Module`.
fn expand_typescript(
    trait_name: &Ident,
    vis: &syn::Visibility,
    methods: &[TraitMethod],
    krate: &Path,
) -> TokenStream {
    let server = format_ident!("{}Server", trait_name);
    let ts = quote!(#krate::typescript);
    let rpc = quote!(#krate::__private::rpc);
    let service = trait_name.to_string();
    let described = methods.iter().map(|m| {
        let wire = format!("{trait_name}.{}", m.name);
        let docs = m.attrs.iter().filter_map(|a| match &a.meta {
            Meta::NameValue(nv) if nv.path.is_ident("doc") => {
                let value = &nv.value;
                Some(quote!(.doc(#value)))
            }
            _ => None,
        });
        // Spanned so that a type without `TS` is pointed at in the trait.
        let args = m.args.iter().map(|(name, ty)| {
            let name = name.to_string();
            quote_spanned!(ty.span()=> .arg::<#ty>(#name))
        });
        let output = &m.output;
        let returns = quote_spanned!(output.span()=> .returns::<#output>());
        quote! {
            .method(
                #ts::Method::new(#wire, #rpc::method_id(#wire))
                    #(#docs)*
                    #(#args)*
                    #returns
            )
        }
    });
    let doc = format!(
        "The methods of [`{trait_name}`] as TypeScript sees them (wire name, id, argument and \
         result types), for `coherent::typescript::Module`."
    );
    quote! {
        impl #server<()> {
            #[doc = #doc]
            #[allow(dead_code)]
            #vis fn typescript() -> #ts::Service {
                #ts::Service::new(#service)
                    #(#described)*
            }
        }
    }
}

fn parse_trait_method(f: &syn::TraitItemFn, local: bool) -> syn::Result<TraitMethod> {
    let sig = &f.sig;
    if f.default.is_some() {
        return Err(syn::Error::new_spanned(
            &f.default,
            "a compute service trait's methods have no default body: the implementation and the client stub each give theirs",
        ));
    }
    if sig.asyncness.is_none() {
        return Err(syn::Error::new_spanned(
            sig.fn_token,
            "a compute service trait's methods are `async fn`",
        ));
    }
    if !sig.generics.params.is_empty() {
        return Err(syn::Error::new_spanned(
            &sig.generics,
            "a compute method cannot be generic: its arguments are the cache key",
        ));
    }
    let mut attrs = Vec::new();
    for a in &f.attrs {
        if is_compute_attr(a) {
            if !matches!(a.meta, Meta::Path(_)) {
                return Err(syn::Error::new_spanned(
                    a,
                    "caching options go on the implementation's methods, not the trait's",
                ));
            }
        } else {
            attrs.push(a.clone());
        }
    }
    let args = method_args(&sig.inputs)?;
    let output: Type = match &sig.output {
        ReturnType::Type(_, ty) if local || returns_result(ty) => (**ty).clone(),
        ReturnType::Default if local => syn::parse_quote!(()),
        other => return Err(syn::Error::new(
            match other {
                ReturnType::Default => sig.ident.span(),
                ReturnType::Type(_, ty) => ty.span(),
            },
            "a compute service trait's methods return `Result<T, E>` with `E: From<RpcError>`: \
                 its client stub reports a lost connection through `E` (`RpcError` itself will do; \
                 `#[compute_service(local)]` makes no stub)",
        )),
    };
    Ok(TraitMethod {
        name: sig.ident.clone(),
        attrs,
        args,
        output,
    })
}

/// `<Trait>Client` and `<Trait>Server`, with the `coherent-remote` paths of `krate`.
fn expand_remote(
    trait_name: &Ident,
    vis: &syn::Visibility,
    methods: &[TraitMethod],
    krate: &Path,
) -> syn::Result<TokenStream> {
    let client = format_ident!("{}Client", trait_name);
    let server = format_ident!("{}Server", trait_name);
    let remote = quote!(#krate::__private::remote);
    let rpc = quote!(#krate::__private::rpc);
    let wire_names: Vec<String> = methods
        .iter()
        .map(|m| format!("{trait_name}.{}", m.name))
        .collect();

    // The stub: every method asks for a replica by the method's id.
    let stub_methods = methods.iter().zip(&wire_names).map(|(m, wire)| {
        let TraitMethod {
            name, args, output, ..
        } = m;
        let names = args.iter().map(|(n, _)| n);
        let params = args.iter().map(|(n, ty)| quote!(#n: #ty));
        // The error points at the trait's return type when `E: From<RpcError>` is missing.
        let lost = quote_spanned!(output.span()=> ::core::convert::From::from(__coherent_error));
        quote! {
            // `From::from` of an `RpcError` into itself where that is the error type.
            #[allow(clippy::useless_conversion)]
            async fn #name(&self, #(#params),*) -> #output {
                const __COHERENT_ID: u32 = #rpc::method_id(#wire);
                match self.remote.replica_by_id::<_, #output>(__COHERENT_ID, (#(#names,)*)).await {
                    ::core::result::Result::Ok(__coherent_result) => __coherent_result,
                    ::core::result::Result::Err(__coherent_error) => {
                        ::core::result::Result::Err(#lost)
                    }
                }
            }
        }
    });
    let stub_impl: ItemImpl = syn::parse_quote! {
        impl #trait_name for #client {
            #(#stub_methods)*
        }
    };
    // A stub's errors are mostly the connection's (or the server's, cached there and
    // pushed when they pass): kept a second, not the default ten.
    let stub_options = quote! {
        #krate::plumbing::ComputeOptions::DEFAULT
            .with_error_invalidate(::core::time::Duration::from_secs(1))
    };
    let stub_impl = expand_trait_impl(stub_impl, krate, Some(&stub_options))?;

    let exposures = methods.iter().zip(&wire_names).map(|(m, wire)| {
        let TraitMethod { name, args, .. } = m;
        let computed_name = format_ident!("{}_computed", name);
        let names: Vec<_> = args.iter().map(|(n, _)| n).collect();
        let types = args.iter().map(|(_, ty)| ty);
        quote! {
            let __coherent_server = __coherent_server.expose(
                #wire,
                ::core::clone::Clone::clone(&self.0),
                |__coherent_service: __S, (#(#names,)*): (#(#types,)*)| async move {
                    <__S as #trait_name>::#computed_name(&__coherent_service, #(#names),*).await
                },
            );
        }
    });
    // Two methods whose names hash to one id would be told apart by nobody: refused at
    // compile time.
    let mut distinct = Vec::new();
    for (i, a) in wire_names.iter().enumerate() {
        for b in &wire_names[i + 1..] {
            let message = format!("methods {a} and {b} hash to the same method id: rename one");
            distinct.push(quote! {
                ::core::assert!(#rpc::method_id(#a) != #rpc::method_id(#b), #message);
            });
        }
    }
    let client_doc = format!(
        "A remote [`{trait_name}`]: a stub whose methods are replicas of a server's (exposed \
         with [`{server}`]). A call is a round trip the first time and a cache hit after that, \
         until the server says its result changed; code that reads a replica inside a compute \
         method or a `ComputedState` is invalidated with it."
    );
    let server_doc = format!(
        "Exposes an implementation of [`{trait_name}`] to remote clients: add it to a \
         `RemoteServer` with `RemoteServer::expose_service`. Its methods are served under \
         `\"{trait_name}.<method>\"`."
    );
    Ok(quote! {
        #[doc = #client_doc]
        #[derive(Clone)]
        #vis struct #client {
            handle: #krate::ServiceHandle,
            remote: #remote::RemoteClient,
        }

        impl #client {
            /// A stub over `remote`, caching in the default registry.
            #[allow(dead_code)]
            #vis fn new(remote: #remote::RemoteClient) -> Self {
                Self { handle: #krate::ServiceHandle::new(), remote }
            }

            /// A stub over `remote`, caching in `registry`.
            #[allow(dead_code)]
            #vis fn with_registry(remote: #remote::RemoteClient, registry: &#krate::Registry) -> Self {
                Self { handle: #krate::ServiceHandle::with_registry(registry), remote }
            }

            /// The client this stub calls through.
            #[allow(dead_code)]
            #vis fn remote(&self) -> &#remote::RemoteClient {
                &self.remote
            }
        }

        impl #krate::ComputeService for #client {
            fn compute_handle(&self) -> &#krate::ServiceHandle {
                &self.handle
            }
        }

        #stub_impl

        #[doc = #server_doc]
        #vis struct #server<S>(S);

        impl<S> #server<S> {
            /// Exposes `service`'s methods once added to a `RemoteServer`.
            #[allow(dead_code)]
            #vis fn new(service: S) -> Self {
                Self(service)
            }
        }

        impl<__S> #remote::Expose for #server<__S>
        where
            __S: #trait_name + ::core::clone::Clone + ::core::marker::Send + ::core::marker::Sync + 'static,
        {
            fn expose_on(self, __coherent_server: #remote::RemoteServer) -> #remote::RemoteServer {
                #(#exposures)*
                __coherent_server
            }
        }

        const _: () = {
            #(#distinct)*
        };
    })
}

/// A compute method's arguments after `&self`: plain names of owned types (the cache key).
fn method_args(inputs: &Punctuated<FnArg, Token![,]>) -> syn::Result<Vec<(Ident, Type)>> {
    let mut inputs_iter = inputs.iter();
    match inputs_iter.next() {
        Some(FnArg::Receiver(r)) if matches!(r.kind, syn::ReceiverKind::Reference(_, _, None)) => {}
        _ => {
            return Err(syn::Error::new_spanned(
                inputs,
                "a compute method takes `&self` first",
            ))
        }
    }
    let mut args = Vec::new();
    for input in inputs_iter {
        let FnArg::Typed(typed) = input else {
            unreachable!("only the first input can be a receiver")
        };
        let Pat::Ident(pat) = &*typed.pat else {
            return Err(syn::Error::new_spanned(
                &typed.pat,
                "a compute method's arguments must be plain names",
            ));
        };
        if let Type::Reference(r) = &*typed.ty {
            return Err(syn::Error::new_spanned(
                r,
                "a compute method's arguments are its cache key and must be owned (use String, Arc<str>, ... instead of references)",
            ));
        }
        args.push((pat.ident.clone(), (*typed.ty).clone()));
    }
    Ok(args)
}
