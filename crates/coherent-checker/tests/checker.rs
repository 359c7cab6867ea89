//! The checker run as a test: three host processes (this test binary, re-executed as a
//! host: see `checker_node_process`) over PostgreSQL, every fault three times or more,
//! and no violation. Reads `DATABASE_URL` (skips without it); `CHECKER_SECONDS` sets the
//! length of each run (20 s by default).

use std::time::Duration;

use coherent_checker::node::NODE_MODE;
use coherent_checker::run::{run, Config, Outcome, TsReaders};

/// The entry point of a host process; a no-op in an ordinary run.
#[test]
fn checker_node_process() {
    if std::env::var_os(NODE_MODE).is_none() {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    std::process::exit(runtime.block_on(coherent_checker::node::main()));
}

fn spawn() -> tokio::process::Command {
    let mut c = tokio::process::Command::new(std::env::current_exe().unwrap());
    c.args([
        "checker_node_process",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ]);
    c
}

fn seconds() -> Duration {
    Duration::from_secs(
        std::env::var("CHECKER_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(20),
    )
}

fn report(what: &str, outcome: &Outcome) {
    let c = &outcome.checked;
    eprintln!(
        "{what}: reads_checked={} reads_after_a_write={} writes={} violations={} faults={:?} \
         hosts_started={} read_errors={} write_errors={} unknown={} ack_timeouts={} \
         tier_hits={} tier_misses={} ts_hits={} ts_misses={} core_reads={}",
        c.reads,
        c.reads_after_a_write,
        c.writes,
        c.violations.len(),
        outcome.faults,
        outcome.hosts_started,
        outcome.read_errors,
        outcome.write_errors,
        outcome.unknown,
        outcome.ack_timeouts,
        outcome.tier_hits,
        outcome.tier_misses,
        outcome.ts_hits,
        outcome.ts_misses,
        outcome.core_reads,
    );
}

async fn checked(nats: bool) {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        eprintln!("skipped: DATABASE_URL is not set");
        return;
    };
    let mut config = Config::new(url, nats, seconds());
    // TypeScript readers where the client is built (`npm ci && npm run build -w
    // clients/typescript`); CHECKER_TS=1 (as CI sets it) makes their absence a failure.
    match TsReaders::of_this_repository() {
        Ok(ts) => config = config.with_ts(ts),
        Err(e) if std::env::var_os("CHECKER_TS").is_some() => {
            panic!("CHECKER_TS is set, but the TypeScript readers cannot run: {e:#}")
        }
        Err(e) => eprintln!("no TypeScript readers in this run: {e:#}"),
    }
    // NATS behind a lossy link where network namespaces can be made (root);
    // CHECKER_NETNS=1 (as CI sets it) makes their absence a failure.
    if nats {
        match coherent_checker::netns::Netns::create() {
            Ok(probe) => {
                drop(probe);
                config = config.with_lossy_nats();
            }
            Err(e) if std::env::var_os("CHECKER_NETNS").is_some() => {
                panic!("CHECKER_NETNS is set, but no network namespace can be made: {e:#}")
            }
            Err(e) => eprintln!("no lossy link to NATS in this run: {e:#}"),
        }
    }
    // CHECKER_FAULTS=pause,kill: only these (by their report names).
    if let Ok(only) = std::env::var("CHECKER_FAULTS") {
        config
            .faults
            .retain(|f| only.split(',').any(|name| name == f.name()));
    }
    let outcome = run(&config, &spawn).await.unwrap();
    report(if nats { "nats" } else { "postgres" }, &outcome);
    assert!(
        outcome.checked.violations.is_empty(),
        "{} violations:\n{}",
        outcome.checked.violations.len(),
        outcome.explain(10)
    );
    assert!(outcome.checked.reads_after_a_write > 0);
    assert!(outcome.core_reads > 0, "no core-level reads");
    // The tiers answered mostly from their replicas: reads that all went through to the
    // hosts (a lease always out) could not be stale, and would show nothing.
    assert!(
        outcome.tier_hits > outcome.tier_misses,
        "tier hits {} against misses {}",
        outcome.tier_hits,
        outcome.tier_misses
    );
    if config.ts.is_some() {
        assert!(
            outcome.ts_hits > outcome.ts_misses,
            "TypeScript hits {} against misses {}",
            outcome.ts_hits,
            outcome.ts_misses
        );
    }
    for fault in &config.faults {
        assert!(
            outcome.faults.get(fault.name()).copied().unwrap_or(0) >= 3,
            "{} injected {:?} times",
            fault.name(),
            outcome.faults.get(fault.name())
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_stale_read_under_faults_postgres() {
    checked(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_stale_read_under_faults_nats() {
    if !std::path::Path::new("/usr/sbin/nats-server").exists() {
        eprintln!("skipped: no nats-server");
        return;
    }
    checked(true).await;
}
