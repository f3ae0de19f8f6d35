//! `idemq stats`.

use std::process::ExitCode;

use anyhow::Result;
use serde_json::json;

use crate::backend::Backend;
use crate::output::{time_or_dash, Table};
use crate::StatsArgs;

/// Prints per-consumer numbers as a table or JSON.
pub async fn run<B: Backend>(store: &B, args: &StatsArgs) -> Result<ExitCode> {
    let stats = store
        .stats()
        .await
        .map_err(|e| super::admin_error(e, "reading stats"))?;
    if args.json {
        let rows: Vec<_> = stats
            .iter()
            .map(|s| {
                json!({
                    "consumer": s.consumer,
                    "processed": s.processed,
                    "oldest": s.oldest_ms.map(crate::output::time),
                    "newest": s.newest_ms.map(crate::output::time),
                    "dead_letters": s.dead_letters,
                    "failing": s.failing,
                })
            })
            .collect();
        println!("{}", serde_json::Value::Array(rows));
        return Ok(ExitCode::SUCCESS);
    }
    if stats.is_empty() {
        println!("no consumers yet");
        return Ok(ExitCode::SUCCESS);
    }
    let mut table = Table::new(&[
        "CONSUMER",
        "PROCESSED",
        "OLDEST",
        "NEWEST",
        "DEAD_LETTERS",
        "FAILING",
    ]);
    for s in &stats {
        table.row(vec![
            crate::output::cell(&s.consumer, 60),
            s.processed.to_string(),
            time_or_dash(s.oldest_ms),
            time_or_dash(s.newest_ms),
            s.dead_letters.to_string(),
            s.failing.to_string(),
        ]);
    }
    print!("{table}");
    Ok(ExitCode::SUCCESS)
}
