//! The multi-row form of an `INSERT … VALUES (…)` template: one statement
//! that writes the rows of many messages at once (`idemq consume --batch
//! --apply-sql`).
//!
//! A template merges when it is a single `INSERT` (or MySQL `REPLACE`)
//! whose parameters all sit in its one `VALUES` row:
//!
//! ```text
//! INSERT INTO ledger (id, amount) VALUES (:idemq_key, :amount) ON CONFLICT (id) DO NOTHING
//! └──────────── head ───────────┘        └────── row ───────┘ └──────── tail ─────────┘
//! ```
//!
//! becomes `head (row 1), (row 2), … tail`. Anything else (an `UPDATE`, an
//! `INSERT … SELECT`, a parameter in the `ON CONFLICT` part, a row list
//! already, several statements) does not merge and runs once per message.
//! Neither does MySQL's `ON DUPLICATE KEY UPDATE`, whose affected-row count
//! (0, 1 or 2 per row) cannot be split back per message.
//!
//! ```
//! use idemq::template::{Placeholder, SqlTemplate};
//! let t: SqlTemplate = "INSERT INTO ledger (id, amount) VALUES (:idemq_key, :amount) ON CONFLICT DO NOTHING"
//!     .parse()
//!     .unwrap();
//! let rows = t.rows().expect("merges");
//! assert_eq!(
//!     rows.render(Placeholder::Numbered, 2),
//!     "INSERT INTO ledger (id, amount) VALUES ($1, $2), ($3, $4) ON CONFLICT DO NOTHING"
//! );
//! assert_eq!(
//!     rows.render(Placeholder::Positional, 2),
//!     "INSERT INTO ledger (id, amount) VALUES (?, ?), (?, ?) ON CONFLICT DO NOTHING"
//! );
//! assert!("UPDATE t SET n = n + :amount WHERE id = :id".parse::<SqlTemplate>().unwrap().rows().is_none());
//! ```

use super::{Placeholder, Segment, SqlTemplate};

/// One piece of a template, at the grain the merge looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    /// A character of SQL code.
    Code(char),
    /// A literal, quoted identifier or comment.
    Quoted(String),
    /// A named parameter.
    Param(String),
}

/// An `INSERT … VALUES (row) …` template that renders for any number of
/// rows ([`SqlTemplate::rows`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowsTemplate {
    head: Vec<Piece>,
    row: Vec<Piece>,
    tail: Vec<Piece>,
}

impl SqlTemplate {
    /// The multi-row form of this template, if it has one (see
    /// [`RowsTemplate`]). Its rows bind the same values in the same order
    /// as [`render`](Self::render) binds for one message.
    pub fn rows(&self) -> Option<RowsTemplate> {
        let pieces = self.pieces();
        let code = |i: usize| match pieces.get(i) {
            Some(Piece::Code(c)) => Some(*c),
            _ => None,
        };
        if pieces.contains(&Piece::Code(';')) {
            return None;
        }
        let first = words(&pieces).next()?;
        if !["INSERT", "REPLACE"].contains(&first.1.as_str()) {
            return None;
        }
        let (values_end, _, _) =
            words(&pieces).find(|(_, w, depth)| w == "VALUES" && *depth == 0)?;
        let skip_space = |mut i: usize| {
            while code(i).is_some_and(char::is_whitespace)
                || matches!(pieces.get(i), Some(Piece::Quoted(q)) if is_comment(q))
            {
                i += 1;
            }
            i
        };
        let open = skip_space(values_end);
        if code(open) != Some('(') {
            return None;
        }
        let mut depth = 0usize;
        let mut close = None;
        for (i, piece) in pieces.iter().enumerate().skip(open) {
            match piece {
                Piece::Code('(') => depth += 1,
                Piece::Code(')') => {
                    depth -= 1;
                    if depth == 0 {
                        close = Some(i);
                        break;
                    }
                }
                _ => {}
            }
        }
        let close = close?;
        if code(skip_space(close + 1)) == Some(',') {
            return None; // already a row list
        }
        let head = pieces[..open].to_vec();
        let row = pieces[open..=close].to_vec();
        let tail = pieces[close + 1..].to_vec();
        let has_param = |p: &[Piece]| p.iter().any(|p| matches!(p, Piece::Param(_)));
        if has_param(&head) || has_param(&tail) || !has_param(&row) {
            return None;
        }
        if words(&tail).any(|(_, w, _)| w == "DUPLICATE") {
            return None;
        }
        Some(RowsTemplate { head, row, tail })
    }

    fn pieces(&self) -> Vec<Piece> {
        let mut pieces = Vec::new();
        for segment in &self.segments {
            match segment {
                Segment::Text(text) => pieces.extend(text.chars().map(Piece::Code)),
                Segment::Quoted(text) => pieces.push(Piece::Quoted(text.clone())),
                Segment::Param(name) => pieces.push(Piece::Param(name.clone())),
            }
        }
        pieces
    }
}

fn is_comment(quoted: &str) -> bool {
    quoted.starts_with("--") || quoted.starts_with("/*")
}

/// The words of the code, upper-cased: (index just past the word, word,
/// parenthesis depth at the word).
fn words(pieces: &[Piece]) -> impl Iterator<Item = (usize, String, usize)> + '_ {
    let mut i = 0;
    let mut depth = 0usize;
    std::iter::from_fn(move || {
        while i < pieces.len() {
            match &pieces[i] {
                Piece::Code(c) if c.is_ascii_alphabetic() || *c == '_' => {
                    let mut word = String::new();
                    while let Some(Piece::Code(c)) = pieces.get(i) {
                        if !(c.is_ascii_alphanumeric() || *c == '_') {
                            break;
                        }
                        word.push(c.to_ascii_uppercase());
                        i += 1;
                    }
                    return Some((i, word, depth));
                }
                Piece::Code('(') => depth += 1,
                Piece::Code(')') => depth = depth.saturating_sub(1),
                _ => {}
            }
            i += 1;
        }
        None
    })
}

impl RowsTemplate {
    /// The statement for `rows` rows, with the database's placeholders;
    /// bind each row's values in turn, in the order
    /// [`SqlTemplate::render`] gives for one message.
    pub fn render(&self, placeholder: Placeholder, rows: usize) -> String {
        let mut sql = String::new();
        push_fixed(&mut sql, &self.head);
        let mut names: Vec<&str> = Vec::new();
        for p in &self.row {
            if let Piece::Param(name) = p {
                if !names.contains(&name.as_str()) {
                    names.push(name);
                }
            }
        }
        for row in 0..rows {
            if row > 0 {
                sql.push_str(", ");
            }
            for p in &self.row {
                match p {
                    Piece::Code(c) => sql.push(*c),
                    Piece::Quoted(q) => sql.push_str(q),
                    Piece::Param(name) => match placeholder {
                        Placeholder::Positional => sql.push('?'),
                        Placeholder::Numbered => {
                            let index = names.iter().position(|n| n == name).unwrap_or(0);
                            sql.push('$');
                            sql.push_str(&(row * names.len() + index + 1).to_string());
                        }
                    },
                }
            }
        }
        push_fixed(&mut sql, &self.tail);
        sql
    }
}

/// Appends pieces without parameters.
fn push_fixed(sql: &mut String, pieces: &[Piece]) {
    for p in pieces {
        match p {
            Piece::Code(c) => sql.push(*c),
            Piece::Quoted(q) | Piece::Param(q) => sql.push_str(q),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(sql: &str) -> Option<RowsTemplate> {
        sql.parse::<SqlTemplate>().unwrap().rows()
    }

    #[test]
    fn inserts_with_one_row_of_parameters_merge() {
        let t = rows(
            "insert into t (a, b, c) values (:a, lower(:b), 'x(' || :a) on conflict (a) do update set c = excluded.c",
        )
        .unwrap();
        assert_eq!(
            t.render(Placeholder::Numbered, 3),
            "insert into t (a, b, c) values ($1, lower($2), 'x(' || $1), ($3, lower($4), 'x(' || $3), \
             ($5, lower($6), 'x(' || $5) on conflict (a) do update set c = excluded.c"
        );
        assert_eq!(
            t.render(Placeholder::Positional, 2),
            "insert into t (a, b, c) values (?, lower(?), 'x(' || ?), (?, lower(?), 'x(' || ?) \
             on conflict (a) do update set c = excluded.c"
        );
        // One row renders as the template does.
        let template: SqlTemplate = "INSERT OR IGNORE INTO t VALUES (:a, :b::int) -- (:c)"
            .parse()
            .unwrap();
        for placeholder in [Placeholder::Numbered, Placeholder::Positional] {
            assert_eq!(
                template.rows().unwrap().render(placeholder, 1),
                template.render(placeholder).0
            );
        }
        assert!(rows("REPLACE INTO t (a) VALUES (:a)").is_some());
    }

    #[test]
    fn other_statements_do_not_merge() {
        for sql in [
            "UPDATE t SET n = n + :amount WHERE id = :id",
            "INSERT INTO t (a) SELECT :a",
            "INSERT INTO t (a) VALUES (:a), (:b)",
            "INSERT INTO t (a) VALUES (:a) ON CONFLICT (a) DO UPDATE SET n = :n",
            "INSERT INTO t (a, n) VALUES (:a, 1) ON DUPLICATE KEY UPDATE n = n + 1",
            "INSERT INTO t (a) VALUES (:a); DELETE FROM u",
            "INSERT INTO t (a) VALUES (1)",
            "WITH x AS (SELECT :a AS a) INSERT INTO t SELECT a FROM x",
            "INSERT INTO t (a) VALUES (:a",
        ] {
            assert!(rows(sql).is_none(), "{sql}");
        }
        // Keywords inside literals and comments are not code.
        assert!(
            rows("INSERT INTO t (a, b) VALUES (:a, 'VALUES (x), (y); ON DUPLICATE')").is_some()
        );
        assert!(rows("INSERT INTO t (a) /* VALUES */ VALUES (:a)").is_some());
    }
}
