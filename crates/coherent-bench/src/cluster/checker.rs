//! The checker's phases of the cluster suite (`coherent-checker`): host processes (this
//! binary, `checker-host`) over one PostgreSQL schema, readers and writers recording their
//! history, faults on a schedule, then every history checked. The rows report how many
//! reads were checked, how many broke the promise, and how many faults of each kind ran.

use std::time::Duration;

use coherent_checker::run::{run, Config, Fault, Outcome, TsReaders};

use crate::report::Row;
use crate::Timing;

fn spawn() -> tokio::process::Command {
    let mut c = tokio::process::Command::new(std::env::current_exe().expect("own path"));
    c.arg("checker-host");
    c
}

/// How long one checked run lasts: 60 s, or 3 s in a smoke run.
fn duration(timing: Timing) -> Duration {
    if timing.runs == 1 {
        Duration::from_secs(3)
    } else {
        Duration::from_secs(60)
    }
}

fn row(name: &str, value: f64, outcome: &Outcome) -> Row {
    let c = &outcome.checked;
    let mut row = Row::new(name, value, "count")
        .with("reads_checked", c.reads)
        .with("reads_after_a_write", c.reads_after_a_write)
        .with("writes", c.writes)
        .with("violations", c.violations.len() as u64)
        .with("hosts_started", outcome.hosts_started)
        .with("read_errors", outcome.read_errors)
        .with("write_errors", outcome.write_errors)
        .with("unknown_operations", outcome.unknown)
        .with("ack_timeouts", outcome.ack_timeouts)
        .with("tier_hits", outcome.tier_hits)
        .with("tier_misses", outcome.tier_misses)
        .with("ts_hits", outcome.ts_hits)
        .with("ts_misses", outcome.ts_misses)
        .with("core_reads", outcome.core_reads);
    for (fault, n) in &outcome.faults {
        row = row.with(&format!("faults_injected.{fault}"), *n);
    }
    if !c.violations.is_empty() {
        eprintln!(
            "{name}: {} violations:\n{}",
            c.violations.len(),
            outcome.explain(5)
        );
    }
    row
}

/// `cluster.checker.pg` / `.nats`: every fault of the notifier, 3 hosts. The row's value
/// is the number of violations (0 is the promise); `reads_checked` beside it.
pub(crate) async fn checker_row(url: &str, nats: bool, timing: Timing) -> anyhow::Result<Row> {
    let mut config = Config::new(url, nats, duration(timing));
    // NATS behind a lossy link where network namespaces can be made (root).
    if nats {
        match coherent_checker::netns::Netns::create() {
            Ok(probe) => {
                drop(probe);
                config = config.with_lossy_nats();
            }
            Err(e) => eprintln!("cluster.checker.nats: no lossy link to NATS ({e:#})"),
        }
    }
    // TypeScript readers where the client is built (npm ci && npm run build -w
    // clients/typescript), with their faults.
    match TsReaders::of_this_repository() {
        Ok(ts) => config = config.with_ts(ts),
        Err(e) => eprintln!("cluster.checker: no TypeScript readers ({e:#})"),
    }
    let outcome = run(&config, &spawn).await?;
    let name = if nats {
        "cluster.checker.nats"
    } else {
        "cluster.checker.pg"
    };
    Ok(row(name, outcome.checked.violations.len() as f64, &outcome))
}

/// `cluster.checker.pause`: hosts paused (SIGSTOP) past the acknowledgement deadline, alone.
pub(crate) async fn pause_row(url: &str, timing: Timing) -> anyhow::Result<Row> {
    let mut config = Config::new(url, false, duration(timing) / 3);
    config.faults = vec![Fault::Pause];
    let outcome = run(&config, &spawn).await?;
    Ok(row(
        "cluster.checker.pause",
        outcome.checked.violations.len() as f64,
        &outcome,
    ))
}

/// `cluster.burst`: 10 writers per host at full speed, bursts, and transactions that hold
/// an xid across them; the value is the stale reads found.
pub(crate) async fn burst_row(url: &str, timing: Timing) -> anyhow::Result<Row> {
    let mut config = Config::new(url, false, duration(timing) / 2);
    config.faults = vec![Fault::LongTransaction, Fault::Burst];
    config.writers = 10;
    let outcome = run(&config, &spawn).await?;
    let stale = outcome.checked.violations.len() as f64;
    Ok(row("cluster.burst.stale_reads", stale, &outcome))
}

/// The `checker-host` subcommand: one host process of a checked run.
pub(crate) fn host_main() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    std::process::exit(runtime.block_on(coherent_checker::node::main()));
}
