//! The README's library example is `examples/ledger.rs`, verbatim, so the
//! example that CI compiles and runs is the one users read.

#[test]
fn readme_shows_the_ledger_example_verbatim() {
    let readme = include_str!("../../../../README.md");
    let example = include_str!("../../examples/ledger.rs");
    let body: String = example
        .lines()
        .filter(|l| !l.starts_with("//!"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(
        readme.contains(&body),
        "README.md's library example differs from crates/idemq/examples/ledger.rs"
    );
}

/// Every series the code emits (`metrics::counter!("idemq_…"` and the like,
/// in this crate and the CLI) is plotted by `docs/grafana-dashboard.json`
/// and listed in `docs/operations.md`, and the dashboard plots nothing else.
#[test]
fn the_dashboard_and_the_docs_name_exactly_the_emitted_series() {
    fn sources(dir: &std::path::Path, into: &mut String) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                sources(&path, into);
            } else if path.extension().is_some_and(|e| e == "rs") {
                into.push_str(&std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    /// The `idemq_[a-z_]+` words after each `marker` in `text`.
    fn names_after(text: &str, marker: &str) -> std::collections::BTreeSet<String> {
        text.split(marker)
            .skip(1)
            .filter_map(|rest| {
                let rest = rest.trim_start().strip_prefix('"').unwrap_or(rest);
                let rest = rest.strip_prefix("idemq_")?;
                let end = rest
                    .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                    .unwrap_or(rest.len());
                Some(format!("idemq_{}", &rest[..end]))
            })
            .collect()
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut code = String::new();
    sources(&root.join("crates/idemq/src"), &mut code);
    sources(&root.join("crates/idemq-cli/src"), &mut code);
    let mut emitted = std::collections::BTreeSet::new();
    for macro_call in ["counter!(", "gauge!(", "histogram!("] {
        emitted.extend(names_after(&code, macro_call));
    }
    assert!(emitted.len() >= 15, "{emitted:?}");

    let dashboard = std::fs::read_to_string(root.join("docs/grafana-dashboard.json")).unwrap();
    let plotted: std::collections::BTreeSet<String> = names_after(&dashboard, "(")
        .into_iter()
        .map(|name| name.trim_end_matches("_bucket").to_owned())
        .collect();
    assert_eq!(plotted, emitted, "docs/grafana-dashboard.json vs the code");

    let operations = std::fs::read_to_string(root.join("docs/operations.md")).unwrap();
    let listed = names_after(&operations, "| `");
    for name in &emitted {
        assert!(
            listed.contains(name),
            "{name} is not in docs/operations.md's table"
        );
    }
}
