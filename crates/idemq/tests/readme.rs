//! The README's library example is `examples/ledger.rs`, verbatim, so the
//! example that CI compiles and runs is the one users read.

#[test]
fn readme_shows_the_ledger_example_verbatim() {
    let readme = include_str!("../../../README.md");
    let example = include_str!("../examples/ledger.rs");
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
