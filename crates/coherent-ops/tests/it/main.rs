//! coherent-ops tests. In-process: several hosts in one process (each with its own
//! registry, so each its own cache) over SQLite files and PostgreSQL schemas. The tests
//! that need real processes and faults are in `tests/cluster/`.

mod acks;
mod batches;
mod changes;
mod clocks;
mod deferred;
mod holes;
mod inproc;
mod support;
