//! `idemq inspect`.

use std::process::ExitCode;

use anyhow::Result;
use idemq::store::KeyReport;
use idemq::StoreError;
use serde_json::json;

use crate::backend::Backend;
use crate::exit;
use crate::output::{attempts_json, cell, dead_letter_json, inbox_json, origin, time, Table};
use crate::InspectArgs;

/// Everything the store knows about one key: `idemq inspect` and the
/// console's key lookup.
pub(crate) struct KeyStory {
    /// The inbox row, lease, attempts and dead letters.
    pub report: KeyReport,
    /// The effect journal's steps: external calls made for the key (they
    /// may exist without an inbox row when the transaction after them did
    /// not commit).
    pub effects: Vec<(String, serde_json::Value)>,
    /// Whether the store knows anything about the key.
    pub found: bool,
}

/// Reads a [`KeyStory`]; the error says what was being read.
pub(crate) async fn story<B: Backend>(
    store: &B,
    consumer: &str,
    key: &str,
) -> Result<KeyStory, (StoreError, &'static str)> {
    let report = store
        .inspect(consumer, key)
        .await
        .map_err(|e| (e, "inspecting the key"))?;
    let effects = match store.journal() {
        Some(journal) => journal
            .steps(consumer, key)
            .await
            .map_err(|e| (e, "reading the effect journal"))?,
        None => Vec::new(),
    };
    let found = report.inbox.is_some()
        || report.in_flight
        || report.attempts.is_some()
        || !report.dead_letters.is_empty()
        || !effects.is_empty();
    Ok(KeyStory {
        report,
        effects,
        found,
    })
}

/// Prints what the store knows about one key; exits with 3 if nothing.
pub async fn run<B: Backend>(store: &B, args: &InspectArgs) -> Result<ExitCode> {
    let KeyStory {
        report,
        effects,
        found,
    } = story(store, &args.consumer, &args.key)
        .await
        .map_err(|(e, doing)| super::admin_error(e, doing))?;
    if args.json {
        println!(
            "{}",
            json!({
                "consumer": args.consumer,
                "key": args.key,
                "found": found,
                "in_flight": report.in_flight,
                "inbox": report.inbox.as_ref().map(inbox_json),
                "attempts": report.attempts.as_ref().map(attempts_json),
                "dead_letters": report.dead_letters.iter().map(dead_letter_json).collect::<Vec<_>>(),
                "effects": effects
                    .iter()
                    .map(|(step, result)| json!({ "step": step, "result": result }))
                    .collect::<Vec<_>>(),
            })
        );
    } else if found {
        print!("{}", render(args, &report, &effects));
    } else {
        eprintln!(
            "idemq: key {:?} is unknown to consumer {:?}",
            args.key, args.consumer
        );
    }
    Ok(if found {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(exit::NOT_FOUND)
    })
}

/// The text report.
fn render(
    args: &InspectArgs,
    report: &KeyReport,
    effects: &[(String, serde_json::Value)],
) -> String {
    let mut out = format!("consumer {:?}, key {:?}\n", args.consumer, args.key);
    match &report.inbox {
        Some(r) => {
            out.push_str(&format!("  processed at  {}\n", time(r.first_seen_ms)));
            out.push_str(&format!("  fingerprint   {}\n", r.fingerprint));
            let result = r
                .result
                .as_ref()
                .map_or_else(|| "-".to_owned(), |v| v.to_string());
            out.push_str(&format!("  result        {}\n", cell(&result, 200)));
        }
        None => out.push_str("  processed     no\n"),
    }
    if report.in_flight {
        out.push_str("  in flight     yes (a lease is held now)\n");
    }
    if let Some(a) = &report.attempts {
        out.push_str(&format!(
            "  attempts      {} failed (first {}, last {})\n  last error    {}\n",
            a.attempts,
            time(a.first_failed_ms),
            time(a.last_failed_ms),
            cell(&a.last_error, 200)
        ));
    }
    if !effects.is_empty() {
        out.push_str(&format!("  effects       {} journaled\n", effects.len()));
        let mut table = Table::new(&["STEP", "RESULT"]);
        for (step, result) in effects {
            table.row(vec![cell(step, 60), cell(&result.to_string(), 160)]);
        }
        push_indented(&mut out, &table);
    }
    if report.dead_letters.is_empty() {
        out.push_str("  dead letters  none\n");
    } else {
        out.push_str(&format!("  dead letters  {}\n", report.dead_letters.len()));
        let mut table = Table::new(&["ID", "CREATED", "REASON", "ORIGIN", "ERROR"]);
        for d in &report.dead_letters {
            table.row(vec![
                d.id.to_string(),
                time(d.created_ms),
                d.reason.clone(),
                cell(&origin(d), 60),
                cell(&d.error, 120),
            ]);
        }
        push_indented(&mut out, &table);
    }
    out
}

/// Appends `table` to `out`, each line indented under its heading.
fn push_indented(out: &mut String, table: &Table) {
    for line in table.to_string().lines() {
        out.push_str("    ");
        out.push_str(line);
        out.push('\n');
    }
}
