//! `#[compute_service]`: rewrites each `#[compute]` method of an impl block into a memoized
//! front (hit path inline, slow path through the method's table), keeps the original body in a
//! hidden method, and adds `<name>_computed` and `invalidate_<name>`.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::{
    Attribute, FnArg, GenericArgument, Ident, ImplItem, ImplItemFn, ItemImpl, LitStr, Meta, Pat,
    Path, PathArguments, ReturnType, Token, Type,
};

use crate::duration;

pub(crate) fn expand(attr: TokenStream, item: TokenStream) -> syn::Result<TokenStream> {
    let krate = parse_crate_path(attr)?;
    let mut imp: ItemImpl = syn::parse2(item)?;
    if imp.trait_.is_some() {
        return Err(syn::Error::new_spanned(
            &imp.self_ty,
            "#[compute_service] goes on an inherent impl block, not a trait impl",
        ));
    }
    let type_name = type_label(&imp.self_ty);
    let mut generated = Vec::new();
    for item in &mut imp.items {
        let ImplItem::Fn(method) = item else { continue };
        let Some(position) = method.attrs.iter().position(is_compute_attr) else {
            continue;
        };
        let attr = method.attrs.remove(position);
        let options = parse_options(&attr, &krate)?;
        generated.push(expand_method(method, &options, &type_name, &krate)?);
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

fn parse_crate_path(attr: TokenStream) -> syn::Result<Path> {
    if attr.is_empty() {
        return Ok(syn::parse_quote!(::coherent));
    }
    let metas = Punctuated::<Meta, Token![,]>::parse_terminated.parse2(attr)?;
    let mut path = None;
    for meta in metas {
        match &meta {
            Meta::NameValue(nv) if nv.path.is_ident("crate") => {
                let lit: LitStr = syn::parse2(quote!(#nv.value)).or_else(|_| match &nv.value {
                    syn::Expr::Lit(syn::ExprLit {
                        lit: syn::Lit::Str(s),
                        ..
                    }) => Ok(s.clone()),
                    other => Err(syn::Error::new_spanned(other, "expected a string")),
                })?;
                path = Some(lit.parse::<Path>()?);
            }
            other => {
                return Err(syn::Error::new_spanned(
                    other,
                    "unknown argument: the only one is `crate = \"path\"`",
                ))
            }
        }
    }
    Ok(path.unwrap_or_else(|| syn::parse_quote!(::coherent)))
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

fn expand_method(
    method: &mut ImplItemFn,
    options: &TokenStream,
    type_name: &str,
    krate: &Path,
) -> syn::Result<Vec<ImplItem>> {
    let sig = &method.sig;
    if sig.asyncness.is_none() {
        return Err(syn::Error::new_spanned(
            sig.fn_token,
            "a #[compute] method must be `async`",
        ));
    }
    if !sig.generics.params.is_empty() {
        return Err(syn::Error::new_spanned(
            &sig.generics,
            "a #[compute] method cannot be generic: its arguments are the cache key",
        ));
    }
    let mut inputs = sig.inputs.iter();
    match inputs.next() {
        Some(FnArg::Receiver(r)) if r.reference.is_some() && r.mutability.is_none() => {}
        _ => {
            return Err(syn::Error::new_spanned(
                &sig.inputs,
                "a #[compute] method takes `&self` first",
            ))
        }
    }
    let mut arg_names = Vec::new();
    let mut arg_types = Vec::new();
    for input in inputs {
        let FnArg::Typed(typed) = input else {
            unreachable!("only the first input can be a receiver")
        };
        let Pat::Ident(pat) = &*typed.pat else {
            return Err(syn::Error::new_spanned(
                &typed.pat,
                "a #[compute] method's arguments must be plain names",
            ));
        };
        if let Type::Reference(r) = &*typed.ty {
            return Err(syn::Error::new_spanned(
                r,
                "a #[compute] method's arguments are its cache key and must be owned (use String, Arc<str>, ... instead of references)",
            ));
        }
        arg_names.push(pat.ident.clone());
        arg_types.push((*typed.ty).clone());
    }
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
    let label = format!("{type_name}::{name}");
    let computed_name = format_ident!("{}_computed", name);
    let invalidate_name = format_ident!("invalidate_{}", name);
    let body_name = format_ident!("__coherent_body_{}", name);
    let method_fn = format_ident!("__coherent_method_{}", name);
    let classify_fn = format_ident!("__coherent_classify_{}", name);
    let input_fn = format_ident!("__coherent_input_{}", name);
    let miss_fn = format_ident!("__coherent_miss_{}", name);
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
    let items: Vec<ImplItem> = vec![
        syn::parse_quote! {
            #(#attrs)*
            // Inline: a hit is a few dozen instructions, and a call (with the answer copied out
            // of it) would be a third of them.
            #[inline]
            #vis async fn #name(&self, #args) -> #output {
                let table = #table;
                let key = #key;
                if let ::core::option::Option::Some(value) = table.try_hit(&key) {
                    return value;
                }
                self.#miss_fn(key).await
            }
        },
        syn::parse_quote! {
            /// The miss path, out of line and boxed: its future (the body's included) can be
            /// kilobytes, and inline it would make every call's future that large, hits too,
            /// which then pay for moving it, and the front too big to inline into its callers.
            #[doc(hidden)]
            #[inline(never)]
            fn #miss_fn(
                &self,
                key: #key_ty,
            ) -> ::core::pin::Pin<::std::boxed::Box<impl ::core::future::Future<Output = #output> + '_>> {
                ::std::boxed::Box::pin(
                    #table.compute(key, |key| self.#input_fn(key), |#key| self.#body_name(#(#arg_names),*)),
                )
            }
        },
        syn::parse_quote! {
            #[doc = #computed_doc]
            #vis async fn #computed_name(&self, #args) -> #krate::Computed<#output> {
                #table
                    .computed(#key, |key| self.#input_fn(key), |#key| self.#body_name(#(#arg_names),*))
                    .await
            }
        },
        syn::parse_quote! {
            #[doc = #invalidate_doc]
            #vis fn #invalidate_name(&self, #args) -> bool {
                #table.invalidate(&#key)
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
            fn #input_fn(&self, key: &#key_ty) -> #plumbing::Recompute<#output> {
                let service = ::core::clone::Clone::clone(self);
                let key = ::core::clone::Clone::clone(key);
                #plumbing::recompute(move || {
                    let service = ::core::clone::Clone::clone(&service);
                    let #key = ::core::clone::Clone::clone(&key);
                    ::std::boxed::Box::pin(async move {
                        ::core::option::Option::Some(service.#computed_name(#(#arg_names),*).await)
                    })
                })
            }
        },
        ImplItem::Fn(body),
    ];
    Ok(items)
}
