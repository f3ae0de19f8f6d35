//! Document ids and the escaping of stored text.
//!
//! Ids are the JSON text of an array of their parts (`["consumer","key"]`),
//! which is injective for any strings and, JSON escaping control
//! characters, never holds a NUL. Text fields escape `%` and NUL (which
//! PostgreSQL cannot store under FerretDB) as `%25` and `%00`.

/// `s` with `%` and NUL escaped as `%25` and `%00`.
pub(super) fn esc(s: &str) -> String {
    if !s.contains(['%', '\0']) {
        return s.to_owned();
    }
    let mut out = String::with_capacity(s.len() + 4);
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            '\0' => out.push_str("%00"),
            c => out.push(c),
        }
    }
    out
}

/// Undoes [`esc`]; other `%` sequences are kept as they are.
pub(super) fn unesc(s: &str) -> String {
    if !s.contains('%') {
        return s.to_owned();
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if let Some(after) = tail.strip_prefix("%25") {
            out.push('%');
            rest = after;
        } else if let Some(after) = tail.strip_prefix("%00") {
            out.push('\0');
            rest = after;
        } else {
            out.push('%');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

/// The id of a key's head slot (generation 1).
pub(super) fn head(consumer: &str, key: &str) -> String {
    serde_json::json!([consumer, key]).to_string()
}

/// The id of generation `g` of `epoch` of a key (the head for `g == 1`).
pub(super) fn slot(consumer: &str, key: &str, epoch: &str, g: i64) -> String {
    if g == 1 {
        return head(consumer, key);
    }
    serde_json::json!([consumer, key, epoch, g]).to_string()
}

/// The id of failed attempt `n` of a key.
pub(super) fn attempt(consumer: &str, key: &str, n: i64) -> String {
    serde_json::json!([consumer, key, n]).to_string()
}

/// The id of an effect journal entry.
pub(super) fn effect(consumer: &str, key: &str, step: &str) -> String {
    serde_json::json!([consumer, key, step]).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_round_trips_and_leaves_plain_text_alone() {
        for s in ["plain", "50%", "a\0b", "%25", "%00%", "ключ-🔑", "%", ""] {
            assert_eq!(unesc(&esc(s)), s, "{s:?}");
            assert!(!esc(s).contains('\0'));
        }
        assert_eq!(esc("order/1"), "order/1");
        assert_eq!(unesc("100%zz"), "100%zz");
    }

    #[test]
    fn ids_are_unambiguous_and_free_of_nul() {
        assert_ne!(head("a/b", "c"), head("a", "b/c"));
        assert_ne!(slot("c", "k", "e", 2), slot("c", "k\",\"e", "", 2));
        assert_eq!(slot("c", "k", "e", 1), head("c", "k"));
        assert!(!head("c", "k\0").contains('\0'));
    }
}
