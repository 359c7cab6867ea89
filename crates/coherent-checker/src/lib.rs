//! A history checker for Coherent's promise across hosts: **a read that starts on any host
//! after a command returned sees that command's write**, and reads on one host never go
//! backwards.
//!
//! In the spirit of Jepsen: host processes ([`node`]) over one PostgreSQL schema, each
//! with writers (commands that add one to a register and answer its new version) and
//! readers (the register's computed, through the host's cache, through a tier's replicas
//! of it: a [`tier::Tier`] in the host process, connected through a proxy the run cuts and
//! turns half-open, and through a TypeScript reader's: a Node.js process beside the host,
//! `ts/reader.mjs`), and core-level writers and readers racing on shared dependants
//! ([`node::Pairs`], no database), record every write that
//! returned and every read, with the times they began and ended on the machine's
//! monotonic clock ([`history`]). Meanwhile the run ([`run`]) injects faults on a schedule
//! (bursts of more than a page of the log, long transactions, terminated connections,
//! paused and killed hosts, a rolling deploy of a release with a new command, a restarted
//! NATS server, a lossy link to NATS ([`netns`]), the database away for 2 s, a skewed
//! clock, a tier's or a TypeScript reader's connection cut or left half-open, a
//! TypeScript reader paused). At the end every host catches up and must answer what the database holds,
//! and the histories are checked ([`check`]); each violation is printed as the timeline
//! that shows it.
//!
//! It runs as a test (`cargo test -p coherent-checker`, a short run) and as the `checker`
//! phase of `coherent-bench cluster` (60 s).

pub mod check;
pub mod history;
pub mod netns;
pub mod node;
pub mod run;
pub mod tier;
