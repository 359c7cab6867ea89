//! Durations written as strings in attributes: `"250ms"`, `"5s"`, `"2m"`, `"1h"`.

use proc_macro2::TokenStream;
use quote::quote;
use syn::LitStr;

/// Parses `lit` into an expression of type `core::time::Duration`.
pub(crate) fn parse(lit: &LitStr) -> syn::Result<TokenStream> {
    let text = lit.value();
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().map_err(|_| {
        syn::Error::new(
            lit.span(),
            "expected a duration such as \"250ms\", \"5s\", \"2m\" or \"1h\"",
        )
    })?;
    let millis = match unit.trim() {
        "ms" => Some(number),
        "s" => number.checked_mul(1_000),
        "m" | "min" => number.checked_mul(60_000),
        "h" => number.checked_mul(3_600_000),
        _ => {
            return Err(syn::Error::new(
                lit.span(),
                "unknown duration unit: use ms, s, m or h",
            ))
        }
    }
    .ok_or_else(|| syn::Error::new(lit.span(), "duration too large"))?;
    Ok(quote!(::core::time::Duration::from_millis(#millis)))
}
