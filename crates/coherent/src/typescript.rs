//! TypeScript declarations of compute services, for clients in TypeScript that call them over
//! MessagePack (feature `typescript`).
//!
//! The types are described by [ts-rs](https://docs.rs/ts-rs), re-exported here: derive
//! [`TS`] beside `Serialize` on every type a method takes or returns, with
//! `#[ts(crate = "coherent::typescript")]` so that `coherent` is the only dependency. With
//! serde's attributes respected, a type's declaration is its serde shape, which is what
//! MessagePack carries (structs as maps keyed by field name, unit variants as their name,
//! other variants as `{ Name: data }`, `Option` as `null` or the value).
//!
//! The methods are described by the trait: `#[compute_service(typescript)]` gives
//! `<Trait>Server::typescript()`, a [`Service`] listing every method with its wire name, id,
//! argument types and result type, so a method added to the trait is in the declarations
//! too. A [`Module`] renders services and the types they name into one `.ts` file:
//!
//! ```
//! use coherent::prelude::*;
//! use coherent::typescript::{Module, TS};
//! use serde::{Deserialize, Serialize};
//!
//! /// A point.
//! #[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize, TS)]
//! #[ts(crate = "coherent::typescript")]
//! pub struct Point {
//!     /// Across.
//!     pub x: i64,
//!     /// Down.
//!     pub y: i64,
//! }
//!
//! /// What a method of `Plane` fails with.
//! #[derive(Clone, Serialize, Deserialize, TS)]
//! #[ts(crate = "coherent::typescript")]
//! pub enum PlaneError {
//!     /// Off the plane.
//!     OutOfBounds,
//!     /// The connection to the server was lost.
//!     Unavailable(String),
//! }
//!
//! impl From<RpcError> for PlaneError {
//!     fn from(e: RpcError) -> Self {
//!         Self::Unavailable(e.to_string())
//!     }
//! }
//!
//! #[compute_service(typescript)]
//! pub trait Plane {
//!     /// The point `dx` to the right of `p`.
//!     async fn right(&self, p: Point, dx: i64) -> Result<Point, PlaneError>;
//! }
//!
//! let ts = Module::new()
//!     .comment("Generated from the Rust types. Do not edit.")
//!     .service(PlaneServer::typescript())
//!     .render();
//! assert!(ts.starts_with("// Generated from the Rust types. Do not edit.\n"));
//! assert!(ts.contains("export type Point = "));
//! assert!(ts.contains(r#"export type PlaneError = "OutOfBounds" | { "Unavailable": string };"#));
//! assert!(ts.contains(
//!     "args: [p: Point, dx: number]; result: { Ok : Point } | { Err : PlaneError } };"
//! ));
//! assert!(ts.contains(r#"export const PlaneIds = {"#));
//! ```

use std::collections::BTreeMap;
use std::fmt::Write as _;

#[doc(no_inline)]
pub use ts_rs::{Config, TypeVisitor, TS};
// Everything else of ts-rs, for the code `#[derive(TS)]` generates with
// `#[ts(crate = "coherent::typescript")]` (it names ts-rs's hidden helpers too).
#[doc(hidden)]
pub use ts_rs::*;

/// A Rust type as TypeScript sees it: its name (a reference to its declaration, or its
/// shape for types without one) and the declarations it needs.
#[derive(Clone, Copy)]
struct TypeRef {
    name: fn(&Config) -> String,
    collect: fn(&mut Collector<'_>),
}

impl TypeRef {
    fn of<T: TS + ?Sized + 'static>() -> Self {
        Self {
            name: <T as TS>::name,
            collect: collect::<T>,
        }
    }
}

/// The declarations a set of types needs, by TypeScript name.
struct Collector<'a> {
    config: &'a Config,
    /// Name: (declaration with its doc comment, the Rust type it came from).
    decls: BTreeMap<String, (String, &'static str)>,
}

impl TypeVisitor for Collector<'_> {
    fn visit<T: TS + 'static + ?Sized>(&mut self) {
        // Primitives, wrappers and built-in generics have no declaration of their own.
        if <T as TS>::output_path().is_none() {
            return;
        }
        let name = <T as TS>::ident(self.config);
        let mut decl = <T as TS>::docs().unwrap_or_default();
        decl.push_str("export ");
        decl.push_str(&one_field_a_line(&<T as TS>::decl(self.config)));
        let rust = std::any::type_name::<T>();
        if let Some((seen, other)) = self.decls.get(&name) {
            assert!(
                *seen == decl,
                "two types are named `{name}` in TypeScript ({other} and {rust}): rename one \
                 with #[ts(rename = \"...\")]"
            );
            return;
        }
        self.decls.insert(name, (decl, rust));
        <T as TS>::visit_dependencies(self);
        <T as TS>::visit_generics(self);
    }
}

/// A struct's declaration with one field a line, indented: ts-rs writes its fields on as few
/// lines as their doc comments allow (`type T = { \n/** A. */\na: A, b: B, };`). Anything
/// else, or anything it does not follow, is returned as it is.
fn one_field_a_line(decl: &str) -> String {
    let Some((head, rest)) = decl.split_once(" = {") else {
        return decl.to_owned();
    };
    let Some(body) = rest.strip_suffix("};") else {
        return decl.to_owned();
    };
    if !head.starts_with("type ") || head.contains(['{', '\n', '"']) {
        return decl.to_owned();
    }
    // The fields: the body split at commas outside brackets, strings and comments.
    let mut fields = Vec::new();
    let mut field = String::new();
    let mut depth = 0_usize;
    let mut chars = body.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                field.push(c);
                loop {
                    let Some(c) = chars.next() else {
                        return decl.to_owned();
                    };
                    field.push(c);
                    match c {
                        '\\' => field.extend(chars.next()),
                        '"' => break,
                        _ => {}
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                field.push(c);
                loop {
                    let Some(c) = chars.next() else {
                        return decl.to_owned();
                    };
                    field.push(c);
                    if field.ends_with("*/") {
                        break;
                    }
                }
            }
            '{' | '[' | '<' | '(' => {
                depth += 1;
                field.push(c);
            }
            '}' | ']' | '>' | ')' => {
                let Some(d) = depth.checked_sub(1) else {
                    return decl.to_owned();
                };
                depth = d;
                field.push(c);
            }
            ',' if depth == 0 => fields.push(std::mem::take(&mut field)),
            c => field.push(c),
        }
    }
    fields.push(field);
    fields.retain(|f| !f.trim().is_empty());
    if depth != 0 || fields.is_empty() {
        return decl.to_owned();
    }
    let mut out = format!("{head} = {{\n");
    for field in fields {
        for line in field.trim().lines() {
            let _ = writeln!(out, "  {}", line.trim_end());
        }
        out.pop();
        out.push_str(",\n");
    }
    out.push_str("};");
    out
}

/// Collects `T` (where it is declared) and every declared type it names.
fn collect<T: TS + ?Sized + 'static>(c: &mut Collector<'_>) {
    c.visit::<T>();
    <T as TS>::visit_generics(c);
    <T as TS>::visit_dependencies(c);
}

/// One exposed method of a compute service: its wire name, id, arguments and result.
pub struct Method {
    name: &'static str,
    id: u32,
    docs: Vec<String>,
    args: Vec<(&'static str, TypeRef)>,
    result: TypeRef,
}

impl Method {
    /// The method `name` (`"<Trait>.<method>"`), called by `id`; it takes no argument and
    /// returns `()` until [`arg`](Self::arg) and [`returns`](Self::returns) say otherwise.
    pub fn new(name: &'static str, id: u32) -> Self {
        Self {
            name,
            id,
            docs: Vec::new(),
            args: Vec::new(),
            result: TypeRef::of::<()>(),
        }
    }

    /// Adds a line of documentation (a `#[doc]` attribute's text).
    pub fn doc(mut self, line: &str) -> Self {
        self.docs
            .push(line.strip_prefix(' ').unwrap_or(line).to_owned());
        self
    }

    /// Adds an argument, after those added before: the argument tuple's next element.
    pub fn arg<T: TS + ?Sized + 'static>(mut self, name: &'static str) -> Self {
        self.args.push((name, TypeRef::of::<T>()));
        self
    }

    /// Sets the result type: the method's whole return type (a `Result<T, E>` is
    /// `{ Ok: T } | { Err: E }` on the wire, as serde writes it).
    pub fn returns<T: TS + ?Sized + 'static>(mut self) -> Self {
        self.result = TypeRef::of::<T>();
        self
    }

    /// `"<Trait>.<method>"`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The method id: the 32-bit FNV-1a of [`name`](Self::name).
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The documentation, a line per element.
    pub fn docs(&self) -> &[String] {
        &self.docs
    }

    /// Each argument's name and TypeScript type, in declaration order.
    pub fn arg_types(&self, config: &Config) -> Vec<(&'static str, String)> {
        self.args
            .iter()
            .map(|(name, ty)| (*name, (ty.name)(config)))
            .collect()
    }

    /// The result's TypeScript type.
    pub fn result_type(&self, config: &Config) -> String {
        (self.result.name)(config)
    }
}

/// The methods a compute service exposes; `#[compute_service(typescript)]` on a trait gives
/// `<Trait>Server::typescript()`, which returns it.
pub struct Service {
    name: &'static str,
    methods: Vec<Method>,
}

impl Service {
    /// The service `name` (the trait's), with no methods yet.
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            methods: Vec::new(),
        }
    }

    /// Adds a method.
    pub fn method(mut self, method: Method) -> Self {
        self.methods.push(method);
        self
    }

    /// The trait's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The methods, in the trait's order.
    pub fn methods(&self) -> &[Method] {
        &self.methods
    }
}

/// A TypeScript file: services and the declarations of every type they name.
///
/// For each service `S` it declares `interface S`, a member per method keyed by its wire
/// name, `{ id; args; result }` (the id as a literal type, the arguments as a labelled
/// tuple in declaration order, the result as the method returns it), and `const SIds`, the
/// ids by wire name. Types are declared once each, sorted by name, as ts-rs writes them.
///
/// Large integers (`i64`, `u64`, `i128`, `u128`) are `number` by default, as JavaScript's
/// MessagePack decoders return them; [`config`](Self::config) changes it.
pub struct Module {
    comment: Vec<String>,
    services: Vec<Service>,
    types: Vec<TypeRef>,
    config: Config,
}

impl Default for Module {
    fn default() -> Self {
        Self::new()
    }
}

impl Module {
    /// An empty file, large integers as `number`.
    pub fn new() -> Self {
        Self {
            comment: Vec::new(),
            services: Vec::new(),
            types: Vec::new(),
            config: Config::new().with_large_int("number"),
        }
    }

    /// Adds a line to the `//` comment at the top of the file.
    pub fn comment(mut self, line: &str) -> Self {
        self.comment.push(line.to_owned());
        self
    }

    /// Renders with `config` (ts-rs's options: what large integers are, ...).
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// Adds a service.
    pub fn service(mut self, service: Service) -> Self {
        self.services.push(service);
        self
    }

    /// Declares `T` (and what it names) too, though no method names it.
    pub fn declare<T: TS + ?Sized + 'static>(mut self) -> Self {
        self.types.push(TypeRef::of::<T>());
        self
    }

    /// The file's text.
    ///
    /// # Panics
    ///
    /// If two Rust types have one name in TypeScript, or a service's names (`S`, `SIds`) are
    /// those of a type.
    pub fn render(&self) -> String {
        let config = &self.config;
        let mut collector = Collector {
            config,
            decls: BTreeMap::new(),
        };
        let methods = self.services.iter().flat_map(|s| &s.methods);
        for ty in methods
            .flat_map(|m| m.args.iter().map(|(_, ty)| ty).chain([&m.result]))
            .chain(&self.types)
        {
            (ty.collect)(&mut collector);
        }
        for service in &self.services {
            for name in [service.name.to_owned(), format!("{}Ids", service.name)] {
                assert!(
                    !collector.decls.contains_key(&name),
                    "service {} declares `{name}`, which is also a type's name",
                    service.name
                );
            }
        }

        let mut out = String::new();
        for line in &self.comment {
            out.push_str("//");
            if !line.is_empty() {
                out.push(' ');
            }
            out.push_str(line);
            out.push('\n');
        }
        if !self.comment.is_empty() {
            out.push('\n');
        }
        for (decl, _) in collector.decls.values() {
            out.push_str(decl);
            out.push_str("\n\n");
        }
        for service in &self.services {
            render_service(service, config, &mut out);
        }
        // One newline at the end.
        while out.ends_with("\n\n") {
            out.pop();
        }
        out
    }
}

fn render_service(service: &Service, config: &Config, out: &mut String) {
    let name = service.name;
    let _ = writeln!(
        out,
        "/** The compute methods of {name} (what `client.replica(...)` and `client.compute(...)` \
         accept), by wire name: each one's id, arguments and result. */"
    );
    let _ = writeln!(out, "export interface {name} {{");
    for m in &service.methods {
        jsdoc(&m.docs, "  ", out);
        let args: Vec<String> = m
            .arg_types(config)
            .into_iter()
            .map(|(arg, ty)| format!("{arg}: {ty}"))
            .collect();
        let _ = writeln!(
            out,
            "  {:?}: {{ id: 0x{:08x}; args: [{}]; result: {} }};",
            m.name,
            m.id,
            args.join(", "),
            m.result_type(config),
        );
    }
    out.push_str("}\n\n");
    let _ = writeln!(out, "/** The method ids of {name}, by wire name. */");
    let _ = writeln!(out, "export const {name}Ids = {{");
    for m in &service.methods {
        let _ = writeln!(out, "  {:?}: 0x{:08x},", m.name, m.id);
    }
    out.push_str("} as const;\n\n");
}

/// `lines` as a JSDoc comment, each line indented by `indent`.
fn jsdoc(lines: &[String], indent: &str, out: &mut String) {
    match lines {
        [] => {}
        [line] if !line.contains('\n') => {
            let _ = writeln!(out, "{indent}/** {} */", line.replace("*/", "*\\/"));
        }
        lines => {
            let _ = writeln!(out, "{indent}/**");
            for line in lines.iter().flat_map(|l| l.split('\n')) {
                let line = line.trim_end().replace("*/", "*\\/");
                if line.is_empty() {
                    let _ = writeln!(out, "{indent} *");
                } else {
                    let _ = writeln!(out, "{indent} * {line}");
                }
            }
            let _ = writeln!(out, "{indent} */");
        }
    }
}
