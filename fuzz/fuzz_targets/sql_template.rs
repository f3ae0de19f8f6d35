//! The SQL-template parameter parser and rendering in both placeholder styles.
#![no_main]

use idemq::template::{Placeholder, SqlTemplate};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|sql: &str| {
    let Ok(template) = sql.parse::<SqlTemplate>() else {
        return;
    };
    let params: Vec<String> = template.params().into_iter().map(str::to_owned).collect();
    let (numbered, names) = template.render(Placeholder::Numbered);
    // Numbered: one number per distinct name, in order of first appearance.
    assert_eq!(names, params);
    let (positional, order) = template.render(Placeholder::Positional);
    // Positional: one `?` per occurrence, covering the same names.
    assert!(order.len() >= names.len());
    for name in &order {
        assert!(names.contains(name), "{name} not among {names:?}");
    }
    for name in &names {
        assert!(order.contains(name), "{name} not bound positionally");
        assert!(
            name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "bad parameter name {name:?}"
        );
    }
    // With no parameters the SQL is untouched.
    if names.is_empty() {
        assert_eq!(numbered, sql);
        assert_eq!(positional, sql);
    }
    // Rendering is deterministic and numbers every distinct name.
    assert_eq!(template.render(Placeholder::Numbered).0, numbered);
    for n in 1..=names.len() {
        assert!(numbered.contains(&format!("${n}")), "${n} missing: {numbered:?}");
    }
    // (The rendered text is not necessarily a template again: `$:a` renders
    // as `$$1`, which the parser reads as a dollar quote. That is the
    // database's SQL, not a template, so it is not checked.)
});
