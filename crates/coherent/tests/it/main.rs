//! Integration tests of the compute core through the facade and its macros. One binary, one
//! module per concern; the names of the tests say what they prove.

mod alloc;
mod cascade;
mod churn;
mod errors;
mod graph;
mod handles;
mod observe;
mod options;
mod postgres;
mod race;
mod remote;
mod single_flight;
mod sqlite;
mod states;
mod stress;
mod support;
