//! The rows of one run and the Markdown table they print as.

use std::fmt::Write as _;

/// One measured number with what it is compared against.
#[derive(Debug, Clone)]
pub struct Row {
    /// The section heading (`PostgreSQL`, `Redis`, …).
    pub section: String,
    /// What was measured.
    pub name: String,
    /// Work items per measurement (messages, claims, rows).
    pub n: u64,
    /// The median over the rounds.
    pub value: f64,
    /// The unit of `value` (`msg/s`, `rows/s`, `µs/claim`).
    pub unit: &'static str,
    /// The ratio to a baseline row, and that row's short name.
    pub ratio: Option<(f64, String)>,
    /// The target, if the issue sets one for this row.
    pub target: Option<Target>,
}

/// A target and whether this run met it.
#[derive(Debug, Clone)]
pub struct Target {
    /// The target as the issue states it, e.g. `≥ 90 % of bare`.
    pub text: String,
    /// Whether the measured value meets it.
    pub pass: bool,
}

impl Row {
    /// A row without ratio or target.
    pub fn new(
        section: &str,
        name: impl Into<String>,
        n: u64,
        value: f64,
        unit: &'static str,
    ) -> Self {
        Self {
            section: section.to_owned(),
            name: name.into(),
            n,
            value,
            unit,
            ratio: None,
            target: None,
        }
    }

    /// Adds the ratio `value / base` to the row called `to`.
    pub fn ratio(mut self, base: f64, to: &str) -> Self {
        if base > 0.0 {
            self.ratio = Some((self.value / base, to.to_owned()));
        }
        self
    }

    /// Adds a ratio computed elsewhere (e.g. [`paired`]) to the row called `to`.
    pub fn ratio_of(mut self, ratio: f64, to: &str) -> Self {
        self.ratio = Some((ratio, to.to_owned()));
        self
    }

    /// Adds a target; `pass` says whether it is met.
    pub fn target(mut self, text: impl Into<String>, pass: bool) -> Self {
        self.target = Some(Target {
            text: text.into(),
            pass,
        });
        self
    }
}

/// The median of `values` (0 when empty).
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// The median of the per-round ratios `a[r] / b[r]`: A and B of one round
/// ran back to back, so their ratio cancels drift between rounds.
pub fn paired(a: &[f64], b: &[f64]) -> f64 {
    let ratios: Vec<f64> = a
        .iter()
        .zip(b)
        .filter(|(_, b)| **b > 0.0)
        .map(|(a, b)| a / b)
        .collect();
    median(&ratios)
}

fn number(value: f64, unit: &str) -> String {
    let digits = if value >= 100.0 {
        0
    } else if value >= 10.0 {
        1
    } else {
        2
    };
    let text = format!("{value:.digits$}");
    // Thousands separators on the integer part.
    let (int, frac) = match text.split_once('.') {
        Some((i, f)) => (i.to_owned(), format!(".{f}")),
        None => (text.clone(), String::new()),
    };
    let mut grouped = String::new();
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i) % 3 == 0 {
            grouped.push(' ');
        }
        grouped.push(c);
    }
    format!("{grouped}{frac} {unit}")
}

fn count(n: u64) -> String {
    if n >= 1_000_000 && n % 1_000_000 == 0 {
        format!("{} M", n / 1_000_000)
    } else if n >= 1_000 && n % 1_000 == 0 {
        format!("{} k", n / 1_000)
    } else {
        n.to_string()
    }
}

/// Short human form of a key count: `100 k`, `10 M`.
pub fn keys(n: u64) -> String {
    count(n)
}

/// The rows as one Markdown table, sections in order of first appearance.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    out.push_str("| Section | Measurement | n | Median | Ratio | Target | Result |\n");
    out.push_str("|---|---|---:|---:|---:|---|---|\n");
    let mut last_section = "";
    for row in rows {
        let section = if row.section == last_section {
            ""
        } else {
            row.section.as_str()
        };
        last_section = &row.section;
        let ratio = row
            .ratio
            .as_ref()
            .map(|(r, to)| format!("{:.2}× {to}", r))
            .unwrap_or_default();
        let (target, result) = match &row.target {
            Some(t) => (
                t.text.clone(),
                if t.pass { "pass" } else { "**miss**" }.to_owned(),
            ),
            None => (String::new(), String::new()),
        };
        let _ = writeln!(
            out,
            "| {section} | {} | {} | {} | {ratio} | {target} | {result} |",
            row.name,
            count(row.n),
            number(row.value, row.unit),
        );
    }
    out
}
