//! The console's pages, rendered on the server with `maud` (every value
//! escaped). Plain HTML forms: no script is needed to read or act.

use idemq::store::{ConsumerStats, DeadLetterRecord, KeyReport};
use maud::{html, Markup, PreEscaped, DOCTYPE};

use super::history::Step;
use super::Settled;
use crate::backend::OutboxView;
use crate::output::{cell, origin, time, time_or_dash};

const CSS: &str = "
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2329;background:#f6f7f9}
header{background:#1d2329;color:#fff;padding:10px 24px;display:flex;gap:24px;align-items:baseline}
header a{color:#fff;text-decoration:none}header .mode{margin-left:auto;font-size:12px;opacity:.8}
main{padding:16px 24px;max-width:1200px}
h1{font-size:20px;margin:8px 0 12px}h2{font-size:16px;margin:24px 0 8px}
table{border-collapse:collapse;background:#fff;width:100%;margin:4px 0 12px}
th,td{border-bottom:1px solid #e3e6ea;padding:5px 8px;text-align:left;vertical-align:top}
th{background:#eef0f3;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
pre{background:#fff;border:1px solid #e3e6ea;padding:8px;white-space:pre-wrap;word-break:break-all;margin:4px 0 12px}
.note{background:#fff8e1;border:1px solid #f0d98c;padding:6px 10px;margin:8px 0}
.bad{color:#b3261e}.ok{color:#1e6b2f}.muted{color:#69727d}
form.inline{display:inline}button{margin:2px 4px 2px 0;padding:3px 10px;cursor:pointer}
button.danger{color:#b3261e}svg{background:#fff;border:1px solid #e3e6ea}
.legend span{margin-right:14px}.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
";

/// The series of a chart, in drawing order: name and colour.
const SERIES: [(&str, &str); 4] = [
    ("processed", "#2b6cb0"),
    ("duplicates", "#7b8794"),
    ("conflicts", "#c05621"),
    ("dead letters", "#b3261e"),
];

/// What every page shows around its body.
pub struct Chrome<'a> {
    /// Replay and delete allowed.
    pub allow_changes: bool,
    /// Warnings about the console's setup (a config job on another store…).
    pub notes: &'a [String],
}

/// Query-string link: `path?k=v&…`, percent-encoded.
pub fn link(path: &str, params: &[(&str, &str)]) -> String {
    let mut query = form_urlencoded::Serializer::new(String::new());
    for (k, v) in params {
        query.append_pair(k, v);
    }
    format!("{path}?{}", query.finish())
}

/// The page frame.
pub fn page(title: &str, chrome: &Chrome<'_>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · idemq console" }
                style { (PreEscaped(CSS)) }
            }
            body {
                header {
                    a href="/" { strong { "idemq console" } }
                    a href="/" { "Consumers" }
                    a href="/outbox" { "Outbox" }
                    a href="/lookup" { "Look up a key" }
                    span.mode {
                        @if chrome.allow_changes { "replay and delete allowed" }
                        @else { "read-only (start with --allow-changes to replay or delete)" }
                    }
                }
                main {
                    @for note in chrome.notes { div.note { (note) } }
                    (body)
                }
            }
        }
    }
}

/// One consumer's line on the overview.
pub struct ConsumerRow {
    /// The store's numbers.
    pub stats: ConsumerStats,
    /// The chart's points.
    pub steps: Vec<Step>,
}

/// `/`: every consumer with its chart, and the key lookup form.
pub fn overview(
    rows: &[ConsumerRow],
    samples: usize,
    every: &str,
    scrape: &ScrapeStatus,
) -> Markup {
    html! {
        h1 { "Consumers" }
        @if rows.is_empty() {
            p.muted { "No consumer has written to this store yet." }
        } @else {
            table {
                tr {
                    th { "Consumer" } th { "Processed keys" } th { "Dead letters" }
                    th { "Failing keys" } th { "Oldest" } th { "Newest" }
                }
                @for row in rows {
                    tr {
                        td { a.consumer href=(link("/consumer", &[("name", &row.stats.consumer)])) { (row.stats.consumer) } }
                        td.n { (row.stats.processed) }
                        td.n {
                            @if row.stats.dead_letters > 0 {
                                a.bad href=(link("/consumer", &[("name", &row.stats.consumer)])) { (row.stats.dead_letters) }
                            } @else { "0" }
                        }
                        td.n { (row.stats.failing) }
                        td { (time_or_dash(row.stats.oldest_ms)) }
                        td { (time_or_dash(row.stats.newest_ms)) }
                    }
                }
            }
            (scrape_line(scrape, samples, every))
            @for row in rows {
                h2 { (row.stats.consumer) }
                (chart(&row.steps))
            }
        }
        (lookup_form(rows.iter().map(|r| r.stats.consumer.as_str()), "", ""))
    }
}

/// Where duplicates and conflicts come from, and how many samples exist.
pub struct ScrapeStatus {
    /// The `/metrics` URLs sampled.
    pub targets: Vec<String>,
    /// Those that did not answer at the last sample.
    pub failing: Vec<String>,
}

fn scrape_line(scrape: &ScrapeStatus, samples: usize, every: &str) -> Markup {
    html! {
        p.muted {
            "Charts: changes per " (every) " over the console's last " (samples) " samples. "
            "Processed keys and dead letters come from the store"
            @if scrape.targets.is_empty() {
                "; duplicates and conflicts need a running consumer's /metrics (--scrape URL, or the http-addr of --config)."
            } @else {
                "; duplicates and conflicts from " (scrape.targets.join(", ")) "."
            }
            @for target in &scrape.failing { " " span.bad { (target) " did not answer." } }
        }
    }
}

/// A line chart of the steps (inline SVG).
pub fn chart(steps: &[Step]) -> Markup {
    const W: f64 = 720.0;
    const H: f64 = 140.0;
    if steps.is_empty() {
        return html! { p.muted { "No samples yet: the chart fills in as the console samples." } };
    }
    let series: [Vec<f64>; 4] = [
        steps.iter().map(|s| s.processed).collect(),
        steps.iter().map(|s| s.duplicates).collect(),
        steps.iter().map(|s| s.conflicts).collect(),
        steps.iter().map(|s| s.dead_letters).collect(),
    ];
    let max = series.iter().flatten().copied().fold(1.0_f64, f64::max);
    let x = |i: usize| {
        if steps.len() == 1 {
            W / 2.0
        } else {
            i as f64 * W / (steps.len() - 1) as f64
        }
    };
    let y = |v: f64| H - 4.0 - v / max * (H - 12.0);
    let first = steps.first().map_or(0, |s| s.at_ms);
    let last = steps.last().map_or(0, |s| s.at_ms);
    html! {
        svg width=(W) height=(H) viewBox=(format!("0 0 {W} {H}")) role="img" {
            text x="4" y="12" font-size="10" fill="#69727d" { "max " (max) }
            @for ((_, colour), values) in SERIES.iter().zip(&series) {
                polyline fill="none" stroke=(colour) stroke-width="1.5"
                    points=(values.iter().enumerate().map(|(i, v)| format!("{:.1},{:.1}", x(i), y(*v))).collect::<Vec<_>>().join(" ")) {}
            }
        }
        div.legend {
            @for ((name, colour), values) in SERIES.iter().zip(&series) {
                span { i style=(format!("background:{colour}")) {} (name) " " (values.iter().sum::<f64>()) }
            }
            span.muted { (time(first)) " – " (time(last)) }
        }
    }
}

/// A dead-letter reason of one consumer, summed up.
pub struct Group {
    /// The reason code.
    pub reason: String,
    /// Letters with it.
    pub count: usize,
    /// The oldest and newest letter's time.
    pub oldest_ms: i64,
    /// See `oldest_ms`.
    pub newest_ms: i64,
    /// The newest letter's error.
    pub last_error: String,
}

/// What the action forms need.
pub struct Actions<'a> {
    /// Replay and delete allowed.
    pub allow_changes: bool,
    /// This consumer's handler is known (replay possible).
    pub can_replay: bool,
    /// The form token.
    pub token: &'a str,
}

/// `/consumer`: the chart and the dead letters grouped by reason.
pub fn consumer(
    name: &str,
    steps: &[Step],
    groups: &[Group],
    scanned_all: bool,
    actions: &Actions<'_>,
) -> Markup {
    html! {
        h1 { "Consumer " (name) }
        (chart(steps))
        h2 { "Dead letters by reason" }
        @if groups.is_empty() {
            p.ok { "No dead letters." }
        } @else {
            @if !scanned_all { p.note { "Only the oldest letters were read; the counts are a lower bound." } }
            (replay_note(actions))
            table {
                tr { th { "Reason" } th { "Letters" } th { "Oldest" } th { "Newest" } th { "Last error" } th {} }
                @for g in groups {
                    tr {
                        td { a href=(link("/letters", &[("consumer", name), ("reason", &g.reason)])) { (g.reason) } }
                        td.n { (g.count) }
                        td { (time(g.oldest_ms)) }
                        td { (time(g.newest_ms)) }
                        td { (cell(&g.last_error, 160)) }
                        td {
                            @if actions.allow_changes {
                                @if actions.can_replay {
                                    (action_form("/replay", name, Some(&g.reason), &[], &format!("Replay all {}", g.count), actions.token, false))
                                }
                                (action_form("/delete", name, Some(&g.reason), &[], &format!("Delete all {}", g.count), actions.token, true))
                            }
                        }
                    }
                }
            }
        }
        (lookup_form([name].into_iter(), name, ""))
    }
}

fn replay_note(actions: &Actions<'_>) -> Markup {
    html! {
        @if actions.allow_changes && !actions.can_replay {
            p.note { "Replay needs this consumer's handler: start the console with --config naming the consumer (the file `idemq run` runs)." }
        }
    }
}

/// A one-button form posting the consumer, a reason or ids, and the token.
fn action_form(
    action: &str,
    consumer: &str,
    reason: Option<&str>,
    ids: &[i64],
    label: &str,
    token: &str,
    danger: bool,
) -> Markup {
    html! {
        form.inline method="post" action=(action) {
            input type="hidden" name="token" value=(token);
            input type="hidden" name="consumer" value=(consumer);
            @if let Some(reason) = reason { input type="hidden" name="reason" value=(reason); }
            @for id in ids { input type="hidden" name="id" value=(id); }
            @if danger { button.danger type="submit" { (label) } } @else { button type="submit" { (label) } }
        }
    }
}

/// `/letters`: one reason's letters, a page at a time, selectable.
pub fn letters(
    name: &str,
    reason: &str,
    letters: &[DeadLetterRecord],
    next_after: Option<i64>,
    actions: &Actions<'_>,
) -> Markup {
    let selectable = actions.allow_changes;
    html! {
        h1 { "Dead letters of " (name) ": " (reason) }
        p { a href=(link("/consumer", &[("name", name)])) { "← all reasons of " (name) } }
        (replay_note(actions))
        @if letters.is_empty() {
            p.ok { "None." }
        } @else {
            form method="post" action="/replay" id="selection" {
                input type="hidden" name="token" value=(actions.token);
                input type="hidden" name="consumer" value=(name);
                table {
                    tr {
                        @if selectable { th {} }
                        th { "Id" } th { "Key" } th { "Created" } th { "Attempts" } th { "Origin" } th { "Error" } th { "Payload" }
                    }
                    @for d in letters {
                        tr {
                            @if selectable { td { input type="checkbox" name="id" value=(d.id) aria-label=(format!("select #{}", d.id)); } }
                            td { a href=(link("/letter", &[("consumer", name), ("id", &d.id.to_string())])) { "#" (d.id) } }
                            td { (d.key.as_deref().unwrap_or("-")) }
                            td { (time(d.created_ms)) }
                            td.n { (d.attempts) }
                            td { (cell(&origin(d), 40)) }
                            td { (cell(&d.error, 120)) }
                            td { code { (cell(&String::from_utf8_lossy(&d.message.payload), 80)) } }
                        }
                    }
                }
                @if selectable {
                    @if actions.can_replay { button type="submit" id="replay-selected" { "Replay selected" } }
                    button.danger type="submit" formaction="/delete" id="delete-selected" { "Delete selected" }
                }
            }
            @if let Some(after) = next_after {
                p { a href=(link("/letters", &[("consumer", name), ("reason", reason), ("after", &after.to_string())])) { "Next page →" } }
            }
        }
    }
}

/// `/letter`: one dead letter whole.
pub fn letter(d: &DeadLetterRecord, actions: &Actions<'_>) -> Markup {
    let payload = &d.message.payload;
    html! {
        h1 { "Dead letter #" (d.id) }
        p { a href=(link("/letters", &[("consumer", &d.consumer), ("reason", &d.reason)])) { "← " (d.reason) " letters of " (d.consumer) } }
        table {
            tr { th { "Consumer" } td { (d.consumer) } }
            tr { th { "Key" } td {
                @if let Some(key) = &d.key { a href=(link("/lookup", &[("consumer", &d.consumer), ("key", key)])) { (key) } } @else { "-" }
            } }
            tr { th { "Reason" } td { (d.reason) } }
            tr { th { "Attempts" } td { (d.attempts) } }
            tr { th { "Created" } td { (time(d.created_ms)) } }
            tr { th { "Origin" } td { (origin(d)) } }
            tr { th { "Message id" } td { (d.message.id.as_deref().unwrap_or("-")) } }
            tr { th { "Transport key" } td { (d.message.key.as_deref().unwrap_or("-")) } }
        }
        h2 { "Error" }
        pre.error { (d.error) }
        h2 { "Headers" }
        @if d.message.headers.iter().next().is_none() { p.muted { "None." } } @else {
            table {
                @for (name, value) in d.message.headers.iter() {
                    tr { th { (name) } td { code { (String::from_utf8_lossy(value)) } } }
                }
            }
        }
        h2 { "Payload (" (payload.len()) " bytes)" }
        pre.payload { (show_payload(payload)) }
        @if actions.allow_changes {
            (replay_note(actions))
            @if actions.can_replay { (action_form("/replay", &d.consumer, None, &[d.id], "Replay", actions.token, false)) }
            (action_form("/delete", &d.consumer, None, &[d.id], "Delete", actions.token, true))
        }
    }
}

/// JSON pretty-printed, other UTF-8 as text, anything else as hex.
fn show_payload(payload: &[u8]) -> String {
    match std::str::from_utf8(payload) {
        Ok(text) => match serde_json::from_str::<serde_json::Value>(text) {
            Ok(json) => serde_json::to_string_pretty(&json).unwrap_or_else(|_| text.to_owned()),
            Err(_) => text.to_owned(),
        },
        Err(_) => payload
            .chunks(32)
            .map(|line| {
                line.iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect::<Vec<_>>()
            .join("\n"),
    }
}

/// The key lookup form.
fn lookup_form<'a>(consumers: impl Iterator<Item = &'a str>, consumer: &str, key: &str) -> Markup {
    let consumers: Vec<&str> = consumers.collect();
    html! {
        h2 { "Look up a key" }
        form method="get" action="/lookup" {
            select name="consumer" aria-label="consumer" {
                @for c in &consumers {
                    @if *c == consumer { option value=(c) selected { (c) } } @else { option value=(c) { (c) } }
                }
            }
            " "
            input type="text" name="key" value=(key) placeholder="business key" size="40" aria-label="key";
            " "
            button type="submit" { "Look up" }
        }
    }
}

/// `/lookup`: everything the store knows about a key.
pub fn lookup(
    consumers: &[String],
    consumer: &str,
    key: &str,
    found: Option<(&KeyReport, &[(String, serde_json::Value)])>,
) -> Markup {
    html! {
        (lookup_form(consumers.iter().map(String::as_str), consumer, key))
        @if let Some((report, effects)) = found {
            h1 { "Key " (key) " of " (consumer) }
            h2 { "Inbox" }
            @match &report.inbox {
                Some(r) => table {
                    tr { th { "Processed at" } td { (time(r.first_seen_ms)) } }
                    tr { th { "Fingerprint" } td { code { (r.fingerprint) } } }
                    tr { th { "Stored result" } td { code { (r.result.as_ref().map_or_else(|| "-".to_owned(), |v| v.to_string())) } } }
                },
                None => p.muted { "Not processed." },
            }
            @if report.in_flight { p.note { "In flight: a lease on this key is held now." } }
            h2 { "Failed attempts" }
            @match &report.attempts {
                Some(a) => table {
                    tr { th { "Attempts" } td { (a.attempts) } }
                    tr { th { "First failed" } td { (time(a.first_failed_ms)) } }
                    tr { th { "Last failed" } td { (time(a.last_failed_ms)) } }
                    tr { th { "Last error" } td { (a.last_error) } }
                },
                None => p.muted { "None." },
            }
            h2 { "Effect journal" }
            @if effects.is_empty() { p.muted { "No journaled external call." } } @else {
                table {
                    tr { th { "Step" } th { "Result" } }
                    @for (step, result) in effects { tr { td { (step) } td { code { (result.to_string()) } } } }
                }
            }
            h2 { "Dead letters" }
            @if report.dead_letters.is_empty() { p.muted { "None." } } @else {
                table {
                    tr { th { "Id" } th { "Reason" } th { "Created" } th { "Error" } }
                    @for d in &report.dead_letters {
                        tr {
                            td { a href=(link("/letter", &[("consumer", consumer), ("id", &d.id.to_string())])) { "#" (d.id) } }
                            td { (d.reason) } td { (time(d.created_ms)) } td { (cell(&d.error, 160)) }
                        }
                    }
                }
            }
        } @else if !key.is_empty() {
            p.bad { "The store knows nothing about key " (key) " of consumer " (consumer) "." }
        }
    }
}

/// `/outbox`: the backlog and the dead rows.
pub fn outbox(view: Option<&OutboxView>, sql: bool) -> Markup {
    html! {
        h1 { "Outbox" }
        @match view {
            None if !sql => p.muted { "This store is not a SQL database: it has no outbox." },
            None => p.muted { "No outbox tables in this database (`idemq relay --migrate` creates them)." },
            Some(v) => {
                table {
                    tr { th { "Table" } td { (v.table) } }
                    tr { th { "Rows waiting" } td.n { (v.backlog.rows) } }
                    tr { th { "Oldest waiting for" } td.n { (format!("{:.1} s", v.backlog.lag().as_secs_f64())) } }
                    tr { th { "Dead rows" } td.n { (v.backlog.dead_rows) } }
                }
                h2 { "Dead rows (oldest first)" }
                @if v.dead.is_empty() { p.ok { "None." } } @else {
                    table {
                        tr { th { "Seq" } th { "Event id" } th { "Destination" } th { "Key" } th { "Attempts" } th { "Dead since" } th { "Reason" } th { "Payload" } }
                        @for d in &v.dead {
                            tr {
                                td.n { (d.seq) } td { (d.id) } td { (d.destination) } td { (d.key) }
                                td.n { (d.attempts) } td { (time(d.dead_at)) } td { (cell(&d.reason, 160)) }
                                td { code { (cell(&String::from_utf8_lossy(&d.payload), 80)) } }
                            }
                        }
                    }
                    p.muted { "To publish a dead row again, insert it into the outbox and delete it here in one transaction (docs/outbox.md)." }
                }
            }
        }
    }
}

/// The result of a replay or delete.
pub fn results(consumer: &str, verb: &str, lines: &[Settled]) -> Markup {
    html! {
        h1 { (verb) ": " (lines.len()) " dead letters of " (consumer) }
        table #results {
            tr { th { "Id" } th { "Result" } }
            @for line in lines {
                tr { td { "#" (line.id) } td class=(if line.good { "ok" } else { "bad" }) { (line.text) } }
            }
        }
        p { a href=(link("/consumer", &[("name", consumer)])) { "← back to " (consumer) } }
    }
}

/// An error page body.
pub fn problem(text: &str) -> Markup {
    html! { h1 { "Not possible" } p.bad { (text) } p { a href="/" { "← consumers" } } }
}
