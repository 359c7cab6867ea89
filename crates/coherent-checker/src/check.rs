//! The check: every read that started after a write of its key returned saw that write's
//! version or a later one, and no host's reads of a key go backwards.
//!
//! Versions of one key grow in commit order (a write is `value = value + 1` under the
//! row's lock), so "sees the write" is "sees a version at least the write's". For a read
//! that began at `s`, the version it must see at least is the greatest version among the
//! writes of its key (on any host) that returned before `s`: one binary search in the
//! writes of the key sorted by their end, with a running maximum. Reads on one host are
//! checked against each other the same way: a read must see at least what any read of the
//! same key on the same host that ended before it began saw.

use std::collections::HashMap;
use std::fmt;

use crate::history::{History, Read, Write};

/// What went wrong, with the events that show it.
#[derive(Debug, Clone)]
pub enum Violation {
    /// A read that began after a write of its key returned saw an older version.
    Stale {
        /// The host that read.
        host: String,
        /// The read.
        read: Read,
        /// The host of the write.
        writer: String,
        /// The latest write of the key that returned before the read began.
        write: Write,
    },
    /// A host answered an older version of a key than it had answered before.
    Backwards {
        /// The host.
        host: String,
        /// The earlier read.
        before: Read,
        /// The later read, which saw less.
        after: Read,
    },
    /// After every fault and write ended and the host caught up, it still answered a
    /// version other than the database's.
    NotConverged {
        /// The host.
        host: String,
        /// The register.
        key: u32,
        /// What the host answered.
        seen: i64,
        /// What the database holds.
        stored: i64,
    },
}

/// Writes the events of a violation as a timeline, times in seconds from `origin`.
pub struct Explained<'a> {
    /// The violation.
    pub violation: &'a Violation,
    /// The start of the run (ns on the monotonic clock).
    pub origin: u64,
}

impl fmt::Display for Explained<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = |ns: u64| ns.saturating_sub(self.origin) as f64 / 1e9;
        match self.violation {
            Violation::Stale {
                host,
                read,
                writer,
                write,
            } => write!(
                f,
                "stale read of key {key}:\n  {ws:.6}s  {writer} begins a write of version {v}\n  \
                 {we:.6}s  it returns\n  {rs:.6}s  {host} (reader {r}) begins a read of key {key}, \
                 {after:.3} ms after the write returned\n  {re:.6}s  it answers version {seen} (< {v})",
                key = read.key,
                ws = t(write.start),
                we = t(write.end),
                v = write.version,
                rs = t(read.start),
                r = read.reader,
                after = read.start.saturating_sub(write.end) as f64 / 1e6,
                re = t(read.end),
                seen = read.seen,
            ),
            Violation::Backwards {
                host,
                before,
                after,
            } => write!(
                f,
                "reads of key {key} on {host} went backwards:\n  {bs:.6}s-{be:.6}s  reader {br} \
                 saw version {bv}\n  {as_:.6}s-{ae:.6}s  reader {ar} saw version {av}",
                key = after.key,
                bs = t(before.start),
                be = t(before.end),
                br = before.reader,
                bv = before.seen,
                as_ = t(after.start),
                ae = t(after.end),
                ar = after.reader,
                av = after.seen,
            ),
            Violation::NotConverged {
                host,
                key,
                seen,
                stored,
            } => write!(
                f,
                "{host} still answers version {seen} of key {key} after catching up; the \
                 database holds {stored}"
            ),
        }
    }
}

/// What the check found.
#[derive(Debug, Clone, Default)]
pub struct Checked {
    /// Reads checked (every recorded read).
    pub reads: u64,
    /// Writes that returned.
    pub writes: u64,
    /// Reads that began after some write of their key had returned (the ones the
    /// promise is about).
    pub reads_after_a_write: u64,
    /// Every violation found.
    pub violations: Vec<Violation>,
    /// The earliest time in the histories (ns on the monotonic clock).
    pub origin: u64,
}

/// Checks the histories of every host of a run.
pub fn check(histories: &[History]) -> Checked {
    let mut out = Checked {
        origin: u64::MAX,
        ..Checked::default()
    };
    // The writes of each key, by end, with the latest version returned so far and its write.
    let mut by_key: HashMap<u32, Vec<(Write, usize)>> = HashMap::new();
    for (h, history) in histories.iter().enumerate() {
        for w in &history.writes {
            by_key.entry(w.key).or_default().push((*w, h));
            out.origin = out.origin.min(w.start);
        }
        out.writes += history.writes.len() as u64;
    }
    // (end, the write of the greatest version that ended at or before it, its host)
    let mut latest: HashMap<u32, Vec<(u64, Write, usize)>> = HashMap::new();
    for (key, mut writes) in by_key {
        writes.sort_by_key(|(w, _)| w.end);
        let mut best: Option<(Write, usize)> = None;
        let mut line = Vec::with_capacity(writes.len());
        for (w, h) in writes {
            if best.is_none_or(|(b, _)| w.version > b.version) {
                best = Some((w, h));
            }
            let (b, bh) = best.unwrap();
            line.push((w.end, b, bh));
        }
        latest.insert(key, line);
    }
    for history in histories {
        for r in &history.reads {
            out.origin = out.origin.min(r.start);
            out.reads += 1;
            let Some(line) = latest.get(&r.key) else {
                continue;
            };
            let before = line.partition_point(|(end, _, _)| *end < r.start);
            if before == 0 {
                continue;
            }
            out.reads_after_a_write += 1;
            let (_, w, h) = line[before - 1];
            if r.seen < w.version {
                out.violations.push(Violation::Stale {
                    host: history.host.clone(),
                    read: *r,
                    writer: histories[h].host.clone(),
                    write: w,
                });
            }
        }
        out.violations.extend(backwards(history));
    }
    if out.origin == u64::MAX {
        out.origin = 0;
    }
    out
}

/// Reads of one host that saw less than a read of the same key that ended before they began.
fn backwards(history: &History) -> Vec<Violation> {
    let mut by_key: HashMap<u32, Vec<Read>> = HashMap::new();
    for r in &history.reads {
        by_key.entry(r.key).or_default().push(*r);
    }
    let mut found = Vec::new();
    for (_, mut by_start) in by_key {
        let mut by_end = by_start.clone();
        by_start.sort_by_key(|r| r.start);
        by_end.sort_by_key(|r| r.end);
        let mut i = 0;
        let mut best: Option<Read> = None;
        for r in by_start {
            while i < by_end.len() && by_end[i].end < r.start {
                if best.is_none_or(|b| by_end[i].seen > b.seen) {
                    best = Some(by_end[i]);
                }
                i += 1;
            }
            if let Some(b) = best {
                if r.seen < b.seen {
                    found.push(Violation::Backwards {
                        host: history.host.clone(),
                        before: b,
                        after: r,
                    });
                }
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(key: u32, version: i64, start: u64, end: u64) -> Write {
        Write {
            key,
            version,
            start,
            end,
        }
    }

    fn r(key: u32, seen: i64, start: u64, end: u64) -> Read {
        Read {
            key,
            seen,
            start,
            end,
            reader: 0,
        }
    }

    fn history(host: &str, writes: Vec<Write>, reads: Vec<Read>) -> History {
        History {
            host: host.into(),
            writes,
            reads,
        }
    }

    #[test]
    fn a_read_after_a_write_returned_must_see_it() {
        let a = history("a", vec![w(1, 1, 10, 20), w(1, 2, 30, 40)], vec![]);
        // Concurrent with the second write: either version will do.
        let ok = history("b", vec![], vec![r(1, 1, 35, 36), r(1, 2, 41, 42)]);
        let c = check(&[a.clone(), ok]);
        assert!(c.violations.is_empty(), "{:?}", c.violations);
        assert_eq!((c.reads, c.reads_after_a_write), (2, 2));

        let stale = history("b", vec![], vec![r(1, 1, 41, 42)]);
        let c = check(&[a, stale]);
        assert_eq!(c.violations.len(), 1);
        let text = Explained {
            violation: &c.violations[0],
            origin: 0,
        }
        .to_string();
        assert!(text.contains("answers version 1 (< 2)"), "{text}");
    }

    #[test]
    fn a_write_that_returns_late_with_an_older_version_does_not_lower_the_bar() {
        // Version 3 returned before version 2 (both concurrent): a read after both must
        // see 3.
        let a = history("a", vec![w(1, 2, 10, 50), w(1, 3, 12, 20)], vec![]);
        let b = history("b", vec![], vec![r(1, 2, 60, 61)]);
        assert_eq!(check(&[a, b]).violations.len(), 1);
    }

    #[test]
    fn reads_of_one_host_never_go_backwards() {
        let b = history("b", vec![], vec![r(1, 5, 10, 11), r(1, 4, 12, 13)]);
        let c = check(&[b]);
        assert!(matches!(c.violations[..], [Violation::Backwards { .. }]));
        // Overlapping reads may answer in either order.
        let b = history("b", vec![], vec![r(1, 5, 10, 15), r(1, 4, 12, 13)]);
        assert!(check(&[b]).violations.is_empty());
    }
}
