//! `#[derive(ComputeService)]`.

use proc_macro2::TokenStream;
use quote::quote;
use syn::{Data, DeriveInput, Fields, Type};

pub(crate) fn expand(item: TokenStream) -> syn::Result<TokenStream> {
    let input: DeriveInput = syn::parse2(item)?;
    let Data::Struct(data) = &input.data else {
        return Err(syn::Error::new_spanned(
            &input.ident,
            "ComputeService can only be derived for a struct",
        ));
    };
    let fields: Vec<_> = match &data.fields {
        Fields::Named(named) => named.named.iter().collect(),
        Fields::Unnamed(unnamed) => unnamed.unnamed.iter().collect(),
        Fields::Unit => Vec::new(),
    };
    let marked = fields
        .iter()
        .position(|f| f.attrs.iter().any(|a| a.path().is_ident("compute_handle")));
    let by_type = || {
        fields.iter().position(|f| match &f.ty {
            Type::Path(p) => p
                .path
                .segments
                .last()
                .is_some_and(|s| s.ident == "ServiceHandle"),
            _ => false,
        })
    };
    let Some(index) = marked.or_else(by_type) else {
        return Err(syn::Error::new_spanned(
            &input.ident,
            "ComputeService needs a field of type `ServiceHandle`, or one marked #[compute_handle]",
        ));
    };
    let member = match &fields[index].ident {
        Some(ident) => quote!(#ident),
        None => {
            let index = syn::Index::from(index);
            quote!(#index)
        }
    };
    let ty = &fields[index].ty;
    let name = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    Ok(quote! {
        impl #impl_generics ::coherent::ComputeService for #name #ty_generics #where_clause {
            #[inline]
            fn compute_handle(&self) -> &::coherent::ServiceHandle {
                let handle: &#ty = &self.#member;
                handle
            }
        }
    })
}
