//! Runnable examples of Coherent; each file in this folder is one, run with
//! `cargo run -p coherent-examples --example <name>`:
//!
//! - `sqlite_users`: a compute service over a SQLite file, a roster view computed from it that
//!   updates after a write, and a `ComputedState` that follows it.
