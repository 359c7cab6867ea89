//! `--chart PATH`: a suite's results as one SVG, a bar panel per row group.
//!
//! Rows are grouped by [`Row::group`]: the name without its last segment (`calls.sum.coherent`
//! and `calls.sum.tonic` are in `calls.sum`), or the group a suite gave the row where its names
//! do not end in the contender (`local`'s `sqlite.cached.1reader` is in `sqlite.1reader`, beside
//! the peers measured with it). Each group is a panel of horizontal bars, one per row, in the
//! report's order, on an axis of its own unit; a group whose rows have different units is split
//! into one panel per unit. Panels are stacked, so the chart grows with the number of groups.
//!
//! A bar is ours when its row's name has a segment in [`OURS`], and is drawn in blue, a peer's
//! in grey. The first of ours in a panel (`calls.sum.coherent`; `payload.10mb.zero.none.coherent`
//! before the compressed `lz4.coherent`) is the panel's reference, in dark blue, and every other
//! bar is labelled `ours N.NNx`: the reference ÷ that bar, the way the table's ratio column
//! reads on our rows (`calls.sum.coherent 26.90x calls.sum.tonic`). Units of time are
//! lower-is-better (the panel title says so): there, a ratio under 1 is ours ahead.
//!
//! Nothing here fails on odd data: a row whose value is not a finite number of at least 0 is
//! left out, a ratio needing a division by 0 is left off, and a panel without ours has values
//! but no ratios. The SVG writes text as `<text>` elements: no font is read or needed.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::report::{cores, format_value, Report, Row};

/// Name segments that mark a row as ours: the RPC protocol in `rpc`, the compute cache in
/// `local` and `remote`, the client replicas in `remote`.
pub(crate) const OURS: [&str; 3] = ["coherent", "cached", "replica"];

/// One panel: a row group in one unit.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Group {
    /// The group's name, with the unit after it where the group has rows in several units.
    pub(crate) title: String,
    pub(crate) unit: &'static str,
    pub(crate) bars: Vec<Bar>,
}

/// One row of a group.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Bar {
    /// The row's name less the segments it shares with the group's name (`tonic`).
    pub(crate) label: String,
    pub(crate) value: f64,
    /// The row is ours.
    pub(crate) ours: bool,
    /// The first of ours in the group: the bar that the others' ratios are taken to.
    pub(crate) reference: bool,
    /// Reference ÷ this bar, when the group has ours and both values are above 0.
    pub(crate) ratio: Option<f64>,
}

impl Group {
    /// Units of time: less is better.
    pub(crate) fn lower_is_better(&self) -> bool {
        matches!(self.unit, "ns" | "us" | "µs" | "ms" | "s")
    }
}

/// The rows in panels, in the order of each group's first row.
pub(crate) fn groups(rows: &[Row]) -> Vec<Group> {
    // (the group's name, the panel), one per name and unit.
    let mut panels: Vec<(&str, Group)> = Vec::new();
    for row in rows {
        if !(row.value.is_finite() && row.value >= 0.0) {
            continue;
        }
        let name = row.group();
        let index = match panels
            .iter()
            .position(|(n, g)| *n == name && g.unit == row.unit)
        {
            Some(index) => index,
            None => {
                let group = Group {
                    title: name.to_owned(),
                    unit: row.unit,
                    bars: Vec::new(),
                };
                panels.push((name, group));
                panels.len() - 1
            }
        };
        panels[index].1.bars.push(Bar {
            label: label(&row.name, name),
            value: row.value,
            ours: row.name.split('.').any(|segment| OURS.contains(&segment)),
            reference: false,
            ratio: None,
        });
    }
    let units = |name: &str| panels.iter().filter(|(n, _)| *n == name).count();
    let split: Vec<bool> = panels.iter().map(|(n, _)| units(n) > 1).collect();
    let mut groups = Vec::with_capacity(panels.len());
    for ((_, mut group), split) in panels.into_iter().zip(split) {
        if split {
            group.title = format!("{} ({})", group.title, group.unit);
        }
        if let Some(reference) = group.bars.iter().position(|b| b.ours) {
            let value = group.bars[reference].value;
            for (i, bar) in group.bars.iter_mut().enumerate() {
                bar.reference = i == reference;
                if i != reference && value > 0.0 && bar.value > 0.0 {
                    bar.ratio = Some(value / bar.value);
                }
            }
        }
        groups.push(group);
    }
    groups
}

/// `name` less the dotted segments it shares with `group` at its start and at its end:
/// `sqlite.cached.1reader` in `sqlite.1reader` is `cached`; the whole name if nothing is left.
fn label(name: &str, group: &str) -> String {
    let segments: Vec<&str> = name.split('.').collect();
    let shared: Vec<&str> = group.split('.').collect();
    let lead = segments
        .iter()
        .zip(&shared)
        .take_while(|(a, b)| a == b)
        .count();
    let trail = segments[lead..]
        .iter()
        .rev()
        .zip(shared[lead.min(shared.len())..].iter().rev())
        .take_while(|(a, b)| a == b)
        .count();
    let rest = &segments[lead..segments.len() - trail];
    if rest.is_empty() {
        name.to_owned()
    } else {
        rest.join(".")
    }
}

// Layout, in pixels: the chart is WIDTH wide; under the HEADER (title and caption lines) each
// panel takes its title, a BAR per row, its axis and a GAP.
const WIDTH: u32 = 1000;
const HEADER: u32 = 100;
const PANEL_TITLE: u32 = 30;
const BAR: u32 = 26;
const AXIS: u32 = 40;
const GAP: u32 = 14;
/// Under the title: how to read the bars.
const CAPTION_LINES: [&str; 2] = [
    "Dark blue: ours, the reference; light blue: ours in another setting; grey: the peers.",
    "\"ours N.NNx\": the reference ÷ that bar, as the table's ratio reads on our rows; lower is better in time units.",
];
const FONT: &str = "sans-serif";
const REFERENCE_COLOR: RGBColor = RGBColor(33, 102, 172);
const OURS_COLOR: RGBColor = RGBColor(130, 175, 220);
const PEER_COLOR: RGBColor = RGBColor(170, 170, 170);

fn panel_height(group: &Group) -> u32 {
    PANEL_TITLE + BAR * group.bars.len() as u32 + AXIS + GAP
}

/// Writes `report`'s chart to `path`.
pub(crate) fn write(report: &Report, path: &Path) -> anyhow::Result<()> {
    let svg = render(report, &today()).context("drawing the chart")?;
    std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))
}

/// The chart of `report` as an SVG document, titled with `date`.
pub(crate) fn render(report: &Report, date: &str) -> anyhow::Result<String> {
    let groups = groups(report.rows());
    let panels: u32 = groups.iter().map(panel_height).sum();
    let height = HEADER + panels.max(PANEL_TITLE);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let title = format!(
            "coherent-bench {} on {} cores, {date}",
            report.suite(),
            cores()
        );
        root.draw_text(&title, &(FONT, 28).into_font().color(&BLACK), (16, 10))?;
        let caption = (FONT, 18).into_font().color(&BLACK.mix(0.75));
        for (i, line) in CAPTION_LINES.iter().enumerate() {
            root.draw_text(line, &caption, (16, 44 + 22 * i as i32))?;
        }
        let (_, mut rest) = root.split_vertically(HEADER);
        if groups.is_empty() {
            rest.draw_text(
                "no rows to chart",
                &(FONT, 20).into_font().color(&BLACK),
                (16, 8),
            )?;
        }
        for group in &groups {
            let (panel, below) = rest.split_vertically(panel_height(group));
            draw_panel(&panel, group)?;
            rest = below;
        }
        root.present()?;
    }
    Ok(svg)
}

/// One group's bars, the first at the top.
fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    group: &Group,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let n = group.bars.len();
    let max = group.bars.iter().map(|b| b.value).fold(0.0, f64::max);
    // Room right of the longest bar for its label.
    let x_end = if max > 0.0 { max * 1.4 } else { 1.0 };
    let widest = group.bars.iter().map(|b| b.label.chars().count()).max();
    let label_area = (widest.unwrap_or(4) as u32 * 10 + 20).clamp(60, 360);
    let mut title = format!("{}: {}", group.title, group.unit);
    if group.lower_is_better() {
        title.push_str(", lower is better");
    }
    // Bar i spans y from 2(n-1-i) to 2(n-i), its label at the odd y between: the first bar is
    // on top, and the row labels sit on integer key points.
    let n = n as i32;
    let bottom = |i: usize| 2 * (n - 1 - i as i32);
    let centers = (0..n as usize).map(|i| bottom(i) + 1).collect();
    let mut chart = ChartBuilder::on(area)
        .margin_left(16)
        .margin_right(24)
        .margin_bottom(GAP)
        .caption(title, (FONT, 20).into_font().style(FontStyle::Bold))
        .x_label_area_size(AXIS)
        .y_label_area_size(label_area)
        .build_cartesian_2d(0.0..x_end, (0..2 * n).with_key_points(centers))?;
    let label_of = |y: &i32| {
        let i = (n - 1 - y.div_euclid(2)).max(0) as usize;
        group
            .bars
            .get(i)
            .map(|b| b.label.clone())
            .unwrap_or_default()
    };
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_labels(8)
        .x_label_formatter(&|v| format_value(*v).replace(".00", ""))
        .y_label_formatter(&label_of)
        .x_desc(group.unit)
        .label_style((FONT, 17))
        .axis_desc_style((FONT, 16))
        .max_light_lines(0)
        .bold_line_style(BLACK.mix(0.12))
        .draw()?;
    chart.draw_series(group.bars.iter().enumerate().map(|(i, bar)| {
        let color = match (bar.reference, bar.ours) {
            (true, _) => REFERENCE_COLOR,
            (false, true) => OURS_COLOR,
            (false, false) => PEER_COLOR,
        };
        let mut rect = Rectangle::new(
            [(0.0, bottom(i)), (bar.value, bottom(i) + 2)],
            color.filled(),
        );
        rect.set_margin(4, 4, 0, 0);
        rect
    }))?;
    let text = (FONT, 17)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    chart.draw_series(group.bars.iter().enumerate().map(|(i, bar)| {
        let mut label = format!("{} {}", format_value(bar.value), group.unit);
        if bar.reference {
            label.push_str(" · ours");
        } else if let Some(ratio) = bar.ratio {
            label.push_str(&format!(" · ours {ratio:.2}x"));
        }
        EmptyElement::at((bar.value, bottom(i) + 1)) + Text::new(label, (6, 0), text.clone())
    }))?;
    Ok(())
}

/// Today's date in UTC, `YYYY-MM-DD`.
fn today() -> String {
    let days = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}")
}

/// The proleptic Gregorian date `days` after 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows() -> Vec<Row> {
        vec![
            Row::new("calls.sum.coherent", 2_550_000.0, "calls/s").compared_to("calls.sum.tonic"),
            Row::new("calls.sum.tonic", 94_780.0, "calls/s").compared_to("calls.sum.coherent"),
            Row::new("calls.sum.http", 0.0, "calls/s"),
            Row::new("latency.rtt_p50.coherent", 16.0, "us"),
            Row::new("latency.rtt_p50.tonic", 88.0, "us"),
            Row::new("sqlite.direct.1reader", 279_000.0, "calls/s").in_group("sqlite.1reader"),
            Row::new("sqlite.cached.1reader", 30e6, "calls/s").in_group("sqlite.1reader"),
            Row::new("peer.map.1reader", 53e6, "calls/s").in_group("sqlite.1reader"),
            Row::new("mixed.a", 1.0, "MB/s"),
            Row::new("mixed.b", 2.0, "us"),
            Row::new("lonely", f64::NAN, "calls/s"),
            Row::new("solo.tonic", 5.0, "items/s"),
            Row::new("payload.10mb.zero.none.coherent", 1600.0, "MB/s")
                .in_group("payload.10mb.zero"),
            Row::new("payload.10mb.zero.lz4.coherent", 40.0, "MB/s").in_group("payload.10mb.zero"),
        ]
    }

    #[test]
    fn rows_are_grouped_by_prefix_or_given_group_with_ratios_to_ours() {
        let groups = groups(&rows());
        let titles: Vec<&str> = groups.iter().map(|g| g.title.as_str()).collect();
        assert_eq!(
            titles,
            [
                "calls.sum",
                "latency.rtt_p50",
                "sqlite.1reader",
                "mixed (MB/s)",
                "mixed (us)",
                "solo",
                "payload.10mb.zero"
            ]
        );
        let calls = &groups[0];
        let labels: Vec<&str> = calls.bars.iter().map(|b| b.label.as_str()).collect();
        assert_eq!(labels, ["coherent", "tonic", "http"]);
        assert!(calls.bars[0].ours && calls.bars[0].reference);
        assert_eq!(calls.bars[0].ratio, None);
        assert!(!calls.bars[1].ours && !calls.bars[1].reference);
        let ratio = calls.bars[1].ratio.expect("ours ÷ tonic");
        assert!((ratio - 2_550_000.0 / 94_780.0).abs() < 1e-9);
        assert_eq!(calls.bars[2].ratio, None, "no ratio to a zero");
        assert!(!calls.lower_is_better());

        let latency = &groups[1];
        assert!(latency.lower_is_better());
        assert_eq!(latency.bars[1].ratio, Some(16.0 / 88.0));

        let local = &groups[2];
        let labels: Vec<&str> = local.bars.iter().map(|b| b.label.as_str()).collect();
        assert_eq!(labels, ["direct", "cached", "peer.map"]);
        assert!(local.bars[1].reference);
        assert!(!local.bars[0].ours, "direct is not ours");
        assert_eq!(local.bars[2].ratio, Some(30e6 / 53e6));

        // A group without ours: values, no ratios; the NaN row is left out.
        let solo = &groups[5];
        assert_eq!(solo.bars.len(), 1);
        assert!(!solo.bars[0].reference && solo.bars[0].ratio.is_none());
        assert!(groups
            .iter()
            .all(|g| g.bars.iter().all(|b| b.label != "lonely")));

        // Ours in another setting: ours, not the reference, with a ratio.
        let payload = &groups[6];
        let labels: Vec<&str> = payload.bars.iter().map(|b| b.label.as_str()).collect();
        assert_eq!(labels, ["none.coherent", "lz4.coherent"]);
        assert!(payload.bars[0].reference);
        assert!(payload.bars[1].ours && !payload.bars[1].reference);
        assert_eq!(payload.bars[1].ratio, Some(40.0));
    }

    #[test]
    fn labels_drop_the_segments_shared_with_the_group() {
        assert_eq!(label("calls.sum.coherent", "calls.sum"), "coherent");
        assert_eq!(label("sqlite.cached.1reader", "sqlite.1reader"), "cached");
        assert_eq!(label("peer.moka.1reader", "sqlite.1reader"), "peer.moka");
        assert_eq!(
            label("payload.10mb.zero.lz4.coherent", "payload.10mb.zero"),
            "lz4.coherent"
        );
        assert_eq!(label("remote", "remote"), "remote");
        assert_eq!(label("a.b", "x.y.z.a.b"), "a.b");
    }

    #[test]
    fn a_report_renders_to_an_svg_with_its_groups_and_labels() {
        let mut report = Report::new("rpc");
        for row in rows() {
            report.push(row);
        }
        let svg = render(&report, "2026-11-25").expect("renders");
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("chart.svg");
        std::fs::write(&path, &svg).expect("written");
        let svg = std::fs::read_to_string(&path).expect("read back");
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
        // Each `<text>` element's content is on a line of its own.
        let texts: Vec<&str> = svg.lines().filter(|l| !l.starts_with('<')).collect();
        for text in [
            "calls.sum: calls/s",
            "latency.rtt_p50: us, lower is better",
            "sqlite.1reader: calls/s",
            "mixed (us): us, lower is better",
            "coherent",
            "tonic",
            "peer.map",
            "2.55M calls/s · ours",
            "94.78K calls/s · ours 26.90x",
            "88.00 us · ours 0.18x",
        ] {
            assert!(texts.contains(&text), "no text {text:?} in {texts:?}");
        }
        let title = format!("coherent-bench rpc on {} cores, 2026-11-25", cores());
        assert!(texts.contains(&title.as_str()), "no title in {texts:?}");
    }

    #[test]
    fn an_empty_or_degenerate_report_still_renders() {
        let empty = Report::new("local");
        assert!(render(&empty, "2026-11-25")
            .expect("renders")
            .contains("\nno rows to chart\n"));
        let mut zeros = Report::new("remote");
        zeros.push(Row::new("remote.replica", 0.0, "calls/s"));
        zeros.push(Row::new("remote.http.cached", 0.0, "calls/s"));
        zeros.push(Row::new("x", f64::INFINITY, "us"));
        let svg = render(&zeros, "2026-11-25").expect("renders");
        assert!(svg.contains("\nremote.http: calls/s\n"));
    }

    #[test]
    fn dates_are_gregorian() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_782), (2026, 11, 25));
    }
}
