//! Results of a suite: rows with stable names, a table with ratios on stdout, JSON and an SVG
//! chart (`chart.rs`) on request, and the progress bar on stderr.

use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Map, Value};

/// One measured result.
#[derive(Clone, Debug)]
pub(crate) struct Row {
    pub(crate) name: String,
    pub(crate) value: f64,
    pub(crate) unit: &'static str,
    /// Extra fields, e.g. `stale_reads` and `invalidations` on mutator rows.
    pub(crate) extra: Map<String, Value>,
    /// The row this one is compared with in the table (`name ÷ baseline`).
    pub(crate) baseline: Option<String>,
    /// The chart panel this row is drawn in, where its name's prefix is not it (see
    /// [`Row::group`]).
    group: Option<String>,
}

impl Row {
    pub(crate) fn new(name: impl Into<String>, value: f64, unit: &'static str) -> Self {
        Self {
            name: name.into(),
            value,
            unit,
            extra: Map::new(),
            baseline: None,
            group: None,
        }
    }

    pub(crate) fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.extra.insert(key.to_owned(), value.into());
        self
    }

    pub(crate) fn compared_to(mut self, baseline: &str) -> Self {
        self.baseline = Some(baseline.to_owned());
        self
    }

    /// Draws this row in the chart panel `group` instead of the one its name's prefix names.
    pub(crate) fn in_group(mut self, group: &str) -> Self {
        self.group = Some(group.to_owned());
        self
    }

    /// The row group that the chart draws this row in (`--chart`): the one given to
    /// [`Row::in_group`], or else the name without its last segment, which names the contender
    /// (`calls.sum.coherent` is in `calls.sum`).
    pub(crate) fn group(&self) -> &str {
        match &self.group {
            Some(group) => group,
            None => self
                .name
                .rsplit_once('.')
                .map_or(&self.name, |(prefix, _)| prefix),
        }
    }
}

/// A suite's results.
pub(crate) struct Report {
    suite: &'static str,
    rows: Vec<Row>,
    notes: Vec<String>,
}

impl Report {
    pub(crate) fn new(suite: &'static str) -> Self {
        Self {
            suite,
            rows: Vec::new(),
            notes: Vec::new(),
        }
    }

    pub(crate) fn suite(&self) -> &'static str {
        self.suite
    }

    pub(crate) fn rows(&self) -> &[Row] {
        &self.rows
    }

    pub(crate) fn push(&mut self, row: Row) {
        self.rows.push(row);
    }

    /// Puts `row` right after the row named `after` (at the end if there is none).
    pub(crate) fn insert_after(&mut self, after: &str, row: Row) {
        match self.rows.iter().position(|r| r.name == after) {
            Some(i) => self.rows.insert(i + 1, row),
            None => self.rows.push(row),
        }
    }

    /// A line printed under the table (a skipped store, the settings of a peer).
    pub(crate) fn note(&mut self, note: impl Into<String>) {
        self.notes.push(note.into());
    }

    pub(crate) fn value(&self, name: &str) -> Option<f64> {
        self.rows.iter().find(|r| r.name == name).map(|r| r.value)
    }

    pub(crate) fn print_table(&self) {
        let cores = cores();
        println!("\nsuite {} on {cores} cores\n", self.suite);
        let width = self
            .rows
            .iter()
            .map(|r| r.name.len())
            .max()
            .unwrap_or(4)
            .max(4);
        println!(
            "{:<width$}  {:>16}  {:<8}  {:<40}  extra",
            "name", "value", "unit", "ratio"
        );
        for row in &self.rows {
            let ratio = row
                .baseline
                .as_deref()
                .and_then(|b| self.value(b).map(|v| (b, v)))
                .filter(|(_, v)| *v > 0.0)
                .map(|(b, v)| format!("{:.2}x {b}", row.value / v))
                .unwrap_or_default();
            let extra = row
                .extra
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" ");
            println!(
                "{:<width$}  {:>16}  {:<8}  {:<40}  {extra}",
                row.name,
                format_value(row.value),
                row.unit,
                ratio
            );
        }
        for note in &self.notes {
            println!("note: {note}");
        }
    }

    pub(crate) fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        let results: Vec<Value> = self
            .rows
            .iter()
            .map(|r| {
                let mut object = Map::new();
                object.insert("name".into(), json!(r.name));
                object.insert("value".into(), json!(r.value));
                object.insert("unit".into(), json!(r.unit));
                for (k, v) in &r.extra {
                    object.insert(k.clone(), v.clone());
                }
                Value::Object(object)
            })
            .collect();
        let document = json!({
            "suite": self.suite,
            "cores": cores(),
            "results": results,
            "notes": self.notes,
        });
        std::fs::write(path, serde_json::to_string_pretty(&document)? + "\n")?;
        Ok(())
    }
}

/// `2.55M`, `94.78K`, `16.09`: how the table and the chart print a value.
pub(crate) fn format_value(value: f64) -> String {
    if value >= 1e6 {
        format!("{:.2}M", value / 1e6)
    } else if value >= 1e3 {
        format!("{:.2}K", value / 1e3)
    } else {
        format!("{value:.2}")
    }
}

/// `x` to two decimals, for a row's extra fields.
pub(crate) fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// The value at fraction `p` of `sorted` (nearest rank); 0 when empty.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// Puts the calling thread under SCHED_IDLE: it gets every cycle nothing else wants, and
/// any other thread that wakes takes the core from it at once. For the threads of a
/// suite's readers (busy loops that never wait), so that the threads they measure, and
/// PostgreSQL on the same machine, are not kept waiting for a time slice. A failure leaves
/// the thread at the normal policy.
pub(crate) fn sched_idle() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param that outlives the call; on Linux, pid 0 is the
    // calling thread.
    unsafe {
        libc::sched_setscheduler(0, libc::SCHED_IDLE, &param);
    }
}

/// The PostgreSQL the suites run against: `DATABASE_URL`, else the local server.
pub(crate) fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The progress bar: one step per case.
pub(crate) fn progress(cases: u64) -> ProgressBar {
    let bar = ProgressBar::new(cases);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .expect("a valid template"),
    );
    bar
}
