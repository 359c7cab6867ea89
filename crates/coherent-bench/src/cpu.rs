//! What serving costs in processor time, whatever share of the machine the load generator
//! takes: the CPU time of the processes that serve a row (this process less the load
//! generator's threads, child processes named by pid, and every PostgreSQL process), measured
//! over the row's window and divided by the requests served in it (`cpu_us_per_req`).
//!
//! On a machine of two cores the generator and the servers share the processors, so a
//! throughput ratio partly measures the generator; the cost per request does not depend on it.
//!
//! Sources: `getrusage(RUSAGE_SELF)` for this process (threads that exited included),
//! `CLOCK_THREAD_CPUTIME_ID` read by each load thread for itself, `/proc/PID/stat` for child
//! processes (user and system ticks, threads that exited included), and
//! `/proc/PID/schedstat` (nanoseconds on a processor) for PostgreSQL's processes, which are
//! single-threaded and many: ticks of 10 ms would add an error per process. PostgreSQL's
//! processes are all of them, backends and the background ones (the WAL writer, the
//! checkpointer), which work for the writes too; a backend that exits inside the window loses
//! its time, one that starts inside it counts from zero.

use std::collections::HashMap;
use std::time::Duration;

/// This thread's processor time.
pub(crate) fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to write.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// This process's processor time, user and system, every thread it ever had.
pub(crate) fn process_cpu() -> Duration {
    // SAFETY: an all-zero rusage is valid; getrusage fills it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a valid rusage for the call to write.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Another process's processor time (user and system, threads that exited included), from
/// `/proc/PID/stat`; `None` once it is gone.
pub(crate) fn pid_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: the fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3 of the man page, utime 14 and stime 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(Duration::from_nanos((utime + stime) * 1_000_000_000 / hz))
}

/// Nanoseconds on a processor of a single-threaded process, from `/proc/PID/schedstat`.
fn schedstat_ns(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Every PostgreSQL process on this machine and its time on a processor so far.
fn postgres_processes() -> HashMap<u32, u64> {
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.trim_end() == "postgres" {
            if let Some(ns) = schedstat_ns(pid) {
                out.insert(pid, ns);
            }
        }
    }
    out
}

/// What the serving side had used at one instant.
#[derive(Clone, Debug)]
pub(crate) struct Snapshot {
    own: Duration,
    children: Vec<(u32, Duration)>,
    postgres: Option<HashMap<u32, u64>>,
}

/// Which processes serve a row besides this one.
#[derive(Clone, Debug, Default)]
pub(crate) struct Servers {
    /// Child processes (hosts, servers) by pid.
    pub(crate) children: Vec<u32>,
    /// Count PostgreSQL's processes.
    pub(crate) postgres: bool,
}

impl Servers {
    pub(crate) fn snapshot(&self) -> Snapshot {
        Snapshot {
            own: process_cpu(),
            children: self
                .children
                .iter()
                .map(|&pid| (pid, pid_cpu(pid).unwrap_or_default()))
                .collect(),
            postgres: self.postgres.then(postgres_processes),
        }
    }
}

/// Processor time spent between two snapshots, by whom.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Spent {
    /// This process, less what the caller says its load generator used.
    pub(crate) own: Duration,
    /// The child processes.
    pub(crate) children: Duration,
    /// PostgreSQL's processes.
    pub(crate) postgres: Duration,
}

impl Spent {
    /// From `before` to `after`, less `load` (the load generator's threads in this process).
    pub(crate) fn between(before: &Snapshot, after: &Snapshot, load: Duration) -> Self {
        let own = after.own.saturating_sub(before.own).saturating_sub(load);
        let children = after
            .children
            .iter()
            .map(|(pid, t)| {
                let was = before
                    .children
                    .iter()
                    .find(|(p, _)| p == pid)
                    .map_or(Duration::ZERO, |(_, t)| *t);
                t.saturating_sub(was)
            })
            .sum();
        let postgres = match (&before.postgres, &after.postgres) {
            (Some(was), Some(now)) => Duration::from_nanos(
                now.iter()
                    .map(|(pid, ns)| ns.saturating_sub(was.get(pid).copied().unwrap_or(0)))
                    .sum(),
            ),
            _ => Duration::ZERO,
        };
        Self {
            own,
            children,
            postgres,
        }
    }

    pub(crate) fn total(&self) -> Duration {
        self.own + self.children + self.postgres
    }

    /// Microseconds of serving per request; `None` with no requests.
    pub(crate) fn us_per(&self, requests: u64) -> Option<f64> {
        (requests > 0).then(|| self.total().as_secs_f64() * 1e6 / requests as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_thread_is_counted_in_this_process_and_by_itself() {
        let before = Servers::default().snapshot();
        let (thread_before, started) = (thread_cpu(), std::time::Instant::now());
        let mut x = 0u64;
        while started.elapsed() < Duration::from_millis(50) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let load = thread_cpu() - thread_before;
        assert!(load > Duration::ZERO);
        let after = Servers::default().snapshot();
        let spent = Spent::between(&before, &after, Duration::ZERO);
        assert!(spent.own >= load / 2, "{spent:?} against {load:?}");
        // Less the busy thread, little is left.
        assert!(Spent::between(&before, &after, load).own < spent.own);
    }

    #[test]
    fn a_child_process_is_read_from_proc() {
        assert!(pid_cpu(std::process::id()).is_some());
        assert!(pid_cpu(u32::MAX).is_none());
    }
}
