//! coherent-ops fault tests across processes: every host is an OS process of its own.
//!
//! ## How a host process starts
//!
//! The test binary re-executes itself (`std::env::current_exe()`) with the environment
//! variable [`node::HOST_MODE`] set and the arguments
//! `cluster_host_process --exact --nocapture --test-threads=1`, so that libtest runs only
//! the test [`cluster_host_process`]. That test does nothing when the variable is unset
//! (in an ordinary run it passes at once); when it is set, it runs a host (`node.rs`) and
//! never returns to libtest. The host's settings come in further environment variables
//! (see `harness::HostConfig::command`).
//!
//! A host process serves RPC on 127.0.0.1:0 (the compute methods `Items.value` and
//! `Items.pair` through a `RemoteServer`, and commands through a `CommandServer`), and is
//! driven by the parent over its stdin: one command a line (`read 3`, `set 3 7`,
//! `wait_applied 5`, ...); each answer is one stdout line holding `@@ ` and the answer
//! (libtest's own lines are skipped; its `test ... ` may start the first line). When its stdin closes (the parent died) the host exits, and
//! the parent's guard (`harness::HostProc`) kills and reaps it on drop, on panic too.

mod faults;
mod feed;
mod harness;
mod netns;
mod node;

#[allow(dead_code)]
#[path = "../it/support.rs"]
mod support;

/// The entry point of a host process (see the crate docs); a no-op in an ordinary run.
#[test]
fn cluster_host_process() {
    if std::env::var_os(node::HOST_MODE).is_none() {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let code = runtime.block_on(node::host_main());
    std::process::exit(code);
}
