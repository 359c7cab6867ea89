//! The Tasks API: a CRUD service of tasks in projects, behind HTTP JSON, on PostgreSQL or
//! SQLite, served by one of three backends behind the same routes:
//!
//! - `direct` ([`direct::Direct`]): a query per request;
//! - `grpc` ([`grpc::GrpcTier`], [`grpc::GrpcServer`]): the HTTP tier calls a tonic backend
//!   over loopback that queries the database;
//! - `coherent` ([`live`]): the HTTP tier answers from replicas of a Coherent backend's
//!   compute methods, and writes are commands through `coherent-ops`, so that any number of
//!   tiers and backends stay exact.
//!
//! The `coherent` backend also serves a live page ([`web`], `LiveBackend::web_router`):
//! the browser holds replicas of the backend's compute methods over WebSocket.
//! [`typescript`] declares the compute service's methods and types for the TypeScript client
//! (the page's `web/src/generated/tasks.ts`).
//!
//! See the README for the commands, and `coherent-bench tasks` for the measurements.

pub mod api;
pub mod app;
pub mod direct;
pub mod grpc;
pub mod live;
pub mod model;
pub mod openapi;
pub mod session;
pub mod store;
pub mod typescript;
pub mod web;
