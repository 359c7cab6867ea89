//! `#[derive(FromRpcError)]`.

use proc_macro2::TokenStream;
use quote::quote;
use syn::{Data, DeriveInput, Fields, Type};

pub(crate) fn expand(item: TokenStream) -> syn::Result<TokenStream> {
    let input: DeriveInput = syn::parse2(item)?;
    let Data::Enum(data) = &input.data else {
        return Err(syn::Error::new_spanned(
            &input.ident,
            "FromRpcError can only be derived for an enum: mark the variant that carries an RPC failure with #[rpc_error]",
        ));
    };
    let mut marked = data
        .variants
        .iter()
        .filter(|v| v.attrs.iter().any(|a| a.path().is_ident("rpc_error")));
    let (Some(variant), None) = (marked.next(), marked.next()) else {
        return Err(syn::Error::new_spanned(
            &input.ident,
            "mark exactly one variant with #[rpc_error]: the one a lost connection or a refused call becomes",
        ));
    };
    let name = &input.ident;
    let ident = &variant.ident;
    // `RpcError` itself is kept; anything else is made from its message (`String`,
    // `Arc<str>`, `Box<str>`: whatever implements `From<String>`).
    let value = |ty: &Type| {
        let is_rpc_error = matches!(ty, Type::Path(p)
            if p.path.segments.last().is_some_and(|s| s.ident == "RpcError"));
        if is_rpc_error {
            quote!(error)
        } else {
            quote!(::core::convert::From::from(
                ::std::string::ToString::to_string(&error)
            ))
        }
    };
    let construct = match &variant.fields {
        Fields::Unit => quote!(Self::#ident),
        Fields::Unnamed(f) if f.unnamed.len() == 1 => {
            let value = value(&f.unnamed[0].ty);
            quote!(Self::#ident(#value))
        }
        Fields::Named(f) if f.named.len() == 1 => {
            let field = f.named[0].ident.as_ref().expect("a named field");
            let value = value(&f.named[0].ty);
            quote!(Self::#ident { #field: #value })
        }
        _ => {
            return Err(syn::Error::new_spanned(
                variant,
                "the #[rpc_error] variant holds one field (the RpcError, or its message as a String) or none",
            ))
        }
    };
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    Ok(quote! {
        impl #impl_generics ::core::convert::From<::coherent::rpc::RpcError> for #name #ty_generics #where_clause {
            #[allow(unused_variables)]
            fn from(error: ::coherent::rpc::RpcError) -> Self {
                #construct
            }
        }
    })
}
