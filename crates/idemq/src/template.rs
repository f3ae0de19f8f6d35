//! SQL templates with named parameters, for sinks that apply a message as a
//! SQL statement (`idemq consume --apply-sql`).
//!
//! A parameter is `:name`. Its value comes from a [`ValueSpec`]; by default
//! `:name` is the payload's top-level field `name` (`json:/name`). Values are
//! always **bound**, never interpolated. Colons inside string literals,
//! quoted identifiers, comments, PostgreSQL dollar-quoted strings and `::`
//! casts are not parameters.
//!
//! ```
//! use idemq::template::{Placeholder, SqlTemplate};
//! let t: SqlTemplate = "INSERT INTO ledger (id, amount) VALUES (:idemq_key, :amount::numeric)".parse().unwrap();
//! let (sql, order) = t.render(Placeholder::Numbered);
//! assert_eq!(sql, "INSERT INTO ledger (id, amount) VALUES ($1, $2::numeric)");
//! assert_eq!(order, ["idemq_key", "amount"]);
//! ```

use std::str::FromStr;

use crate::engine::Context;
use crate::error::{ConfigError, InputError};
use crate::key::validate_pointer;

mod rows;

pub use rows::RowsTemplate;

/// A piece of a parsed template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    /// SQL code.
    Text(String),
    /// A string literal, quoted identifier or comment: copied as it is,
    /// never looked into.
    Quoted(String),
    /// A named parameter.
    Param(String),
}

/// Ends the text collected so far as a segment of `kind`.
fn flush(segments: &mut Vec<Segment>, text: &mut String, kind: fn(String) -> Segment) {
    if !text.is_empty() {
        segments.push(kind(std::mem::take(text)));
    }
}

/// A parsed SQL template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqlTemplate {
    segments: Vec<Segment>,
}

/// How a database spells positional parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placeholder {
    /// `$1, $2, …`, one number per distinct name (PostgreSQL).
    Numbered,
    /// `?` per occurrence (MySQL, SQLite).
    Positional,
}

impl SqlTemplate {
    /// The distinct parameter names, in order of first appearance.
    pub fn params(&self) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for s in &self.segments {
            if let Segment::Param(name) = s {
                if !names.contains(&name.as_str()) {
                    names.push(name);
                }
            }
        }
        names
    }

    /// The SQL with placeholders, and the parameter name to bind for each
    /// placeholder, in binding order.
    pub fn render(&self, placeholder: Placeholder) -> (String, Vec<String>) {
        let mut sql = String::new();
        let mut order: Vec<String> = Vec::new();
        for s in &self.segments {
            match s {
                Segment::Text(t) | Segment::Quoted(t) => sql.push_str(t),
                Segment::Param(name) => match placeholder {
                    Placeholder::Positional => {
                        sql.push('?');
                        order.push(name.clone());
                    }
                    Placeholder::Numbered => {
                        let n = match order.iter().position(|o| o == name) {
                            Some(i) => i + 1,
                            None => {
                                order.push(name.clone());
                                order.len()
                            }
                        };
                        sql.push('$');
                        sql.push_str(&n.to_string());
                    }
                },
            }
        }
        (sql, order)
    }
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

impl FromStr for SqlTemplate {
    type Err = ConfigError;

    fn from_str(sql: &str) -> Result<Self, Self::Err> {
        let chars: Vec<char> = sql.chars().collect();
        let mut segments = Vec::new();
        let mut text = String::new();
        let mut i = 0;
        let unterminated = |what: &str| ConfigError::Spec {
            spec: sql.to_owned(),
            reason: format!("unterminated {what}"),
        };
        // Copies chars[i..] up to and including the closing `close`, honouring doubled quotes.
        let copy_quoted = |i: &mut usize, text: &mut String, close: char| -> bool {
            text.push(chars[*i]);
            *i += 1;
            while *i < chars.len() {
                let c = chars[*i];
                text.push(c);
                *i += 1;
                if c == close {
                    if *i < chars.len() && chars[*i] == close {
                        text.push(close);
                        *i += 1;
                        continue;
                    }
                    return true;
                }
                if c == '\\' && close == '\'' && *i < chars.len() {
                    // MySQL-style backslash escapes inside strings
                    text.push(chars[*i]);
                    *i += 1;
                }
            }
            false
        };
        while i < chars.len() {
            let c = chars[i];
            let next = chars.get(i + 1).copied();
            match c {
                '\'' | '"' | '`' => {
                    flush(&mut segments, &mut text, Segment::Text);
                    if !copy_quoted(&mut i, &mut text, c) {
                        return Err(unterminated("quoted text"));
                    }
                    flush(&mut segments, &mut text, Segment::Quoted);
                }
                '-' if next == Some('-') => {
                    flush(&mut segments, &mut text, Segment::Text);
                    while i < chars.len() && chars[i] != '\n' {
                        text.push(chars[i]);
                        i += 1;
                    }
                    flush(&mut segments, &mut text, Segment::Quoted);
                }
                '/' if next == Some('*') => {
                    let start = i;
                    i += 2;
                    while i < chars.len() && !(chars[i] == '*' && chars.get(i + 1) == Some(&'/')) {
                        i += 1;
                    }
                    if i >= chars.len() {
                        return Err(unterminated("comment"));
                    }
                    i += 2;
                    flush(&mut segments, &mut text, Segment::Text);
                    text.extend(&chars[start..i]);
                    flush(&mut segments, &mut text, Segment::Quoted);
                }
                '$' if next.is_some_and(|n| n == '$' || is_ident_start(n)) => {
                    // A dollar-quote tag $tag$ … $tag$ (PostgreSQL); `$1` is not a tag.
                    let mut j = i + 1;
                    while j < chars.len() && is_ident(chars[j]) {
                        j += 1;
                    }
                    if chars.get(j) == Some(&'$') {
                        let tag: String = chars[i..=j].iter().collect();
                        let rest: String = chars[j + 1..].iter().collect();
                        let Some(end) = rest.find(&tag) else {
                            return Err(unterminated("dollar-quoted string"));
                        };
                        let body_len = rest[..end].chars().count();
                        let stop = j + 1 + body_len + tag.chars().count();
                        flush(&mut segments, &mut text, Segment::Text);
                        text.extend(&chars[i..stop]);
                        flush(&mut segments, &mut text, Segment::Quoted);
                        i = stop;
                    } else {
                        text.push(c);
                        i += 1;
                    }
                }
                ':' if next == Some(':') => {
                    text.push_str("::");
                    i += 2;
                }
                ':' if next.is_some_and(is_ident_start) => {
                    let mut j = i + 1;
                    while j < chars.len() && is_ident(chars[j]) {
                        j += 1;
                    }
                    flush(&mut segments, &mut text, Segment::Text);
                    segments.push(Segment::Param(chars[i + 1..j].iter().collect()));
                    i = j;
                }
                _ => {
                    text.push(c);
                    i += 1;
                }
            }
        }
        flush(&mut segments, &mut text, Segment::Text);
        Ok(Self { segments })
    }
}

/// Where a parameter's value comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueSpec {
    /// The JSON value at a pointer of the payload.
    Json(String),
    /// A header's UTF-8 value.
    Header(String),
    /// The business key (`idemq_key` by default).
    BusinessKey,
    /// The consumer name (`idemq_consumer`).
    Consumer,
    /// The message id (`idemq_id`).
    MessageId,
    /// The whole payload as text (`idemq_payload`).
    Payload,
}

impl ValueSpec {
    /// The default source of parameter `name`: the built-ins `idemq_key`,
    /// `idemq_consumer`, `idemq_id`, `idemq_payload`, else the payload field `/name`.
    pub fn default_for(name: &str) -> Self {
        match name {
            "idemq_key" => ValueSpec::BusinessKey,
            "idemq_consumer" => ValueSpec::Consumer,
            "idemq_id" => ValueSpec::MessageId,
            "idemq_payload" => ValueSpec::Payload,
            _ => ValueSpec::Json(format!("/{}", name.replace('~', "~0").replace('/', "~1"))),
        }
    }

    /// The value for one message.
    pub fn resolve(
        &self,
        ctx: &Context<'_>,
        json: Option<&serde_json::Value>,
    ) -> Result<SqlValue, InputError> {
        match self {
            ValueSpec::Json(pointer) => {
                let json =
                    json.ok_or_else(|| InputError::MalformedJson("payload is not JSON".into()))?;
                let value = json
                    .pointer(pointer)
                    .ok_or_else(|| InputError::MissingField(format!("json:{pointer}")))?;
                Ok(SqlValue::from_json(value))
            }
            ValueSpec::Header(name) => {
                let raw = ctx
                    .message
                    .headers
                    .get(name)
                    .ok_or_else(|| InputError::MissingField(format!("header:{name}")))?;
                std::str::from_utf8(raw)
                    .map(|s| SqlValue::Text(s.to_owned()))
                    .map_err(|_| InputError::HeaderNotUtf8(name.clone()))
            }
            ValueSpec::BusinessKey => Ok(SqlValue::Text(ctx.key.to_owned())),
            ValueSpec::Consumer => Ok(SqlValue::Text(ctx.consumer.to_owned())),
            ValueSpec::MessageId => Ok(ctx
                .message
                .id
                .clone()
                .map_or(SqlValue::Null, SqlValue::Text)),
            ValueSpec::Payload => String::from_utf8(ctx.message.payload.clone())
                .map(SqlValue::Text)
                .map_err(|_| InputError::Malformed("payload is not UTF-8".into())),
        }
    }
}

impl FromStr for ValueSpec {
    type Err = ConfigError;

    /// `json:/pointer`, `header:NAME`, `key`, `consumer`, `id` or `payload`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = |reason: String| ConfigError::Spec {
            spec: s.to_owned(),
            reason,
        };
        match s {
            "key" => Ok(ValueSpec::BusinessKey),
            "consumer" => Ok(ValueSpec::Consumer),
            "id" => Ok(ValueSpec::MessageId),
            "payload" => Ok(ValueSpec::Payload),
            _ => {
                if let Some(p) = s.strip_prefix("json:") {
                    validate_pointer(p).map_err(invalid)?;
                    Ok(ValueSpec::Json(p.to_owned()))
                } else if let Some(h) = s.strip_prefix("header:").filter(|h| !h.is_empty()) {
                    Ok(ValueSpec::Header(h.to_owned()))
                } else {
                    Err(invalid(
                        "expected json:/pointer, header:NAME, key, consumer, id or payload".into(),
                    ))
                }
            }
        }
    }
}

/// A value to bind.
#[derive(Debug, Clone, PartialEq)]
pub enum SqlValue {
    /// SQL NULL (JSON null, or an absent message id).
    Null,
    /// A boolean.
    Bool(bool),
    /// An integer that fits in i64.
    Int(i64),
    /// Any other number.
    Float(f64),
    /// Text; JSON objects and arrays are bound as their JSON text.
    Text(String),
}

impl SqlValue {
    /// Maps a JSON value to a bindable value.
    pub fn from_json(value: &serde_json::Value) -> Self {
        use serde_json::Value;
        match value {
            Value::Null => SqlValue::Null,
            Value::Bool(b) => SqlValue::Bool(*b),
            Value::Number(n) => n
                .as_i64()
                .map(SqlValue::Int)
                .unwrap_or_else(|| SqlValue::Float(n.as_f64().unwrap_or(f64::NAN))),
            Value::String(s) => SqlValue::Text(s.clone()),
            other => SqlValue::Text(other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(sql: &str) -> Vec<String> {
        let t: SqlTemplate = sql.parse().unwrap();
        t.params().into_iter().map(str::to_owned).collect()
    }

    #[test]
    fn finds_parameters_outside_literals() {
        assert_eq!(
            names("SELECT :a, ':b', \":c\", `:d` -- :e\n, /* :f */ :g::int, $$ :h $$, $t$ :i $t$"),
            ["a", "g"]
        );
        assert_eq!(names("VALUES (:a, :a, :b)"), ["a", "b"]);
        assert_eq!(names("SELECT 'it''s :x', :y"), ["y"]);
        assert_eq!(names("SELECT $1, :y"), ["y"]);
    }

    #[test]
    fn renders_both_placeholder_styles() {
        let t: SqlTemplate = "VALUES (:a, :b, :a)".parse().unwrap();
        assert_eq!(
            t.render(Placeholder::Numbered),
            ("VALUES ($1, $2, $1)".into(), vec!["a".into(), "b".into()])
        );
        assert_eq!(
            t.render(Placeholder::Positional),
            (
                "VALUES (?, ?, ?)".into(),
                vec!["a".into(), "b".into(), "a".into()]
            )
        );
    }

    #[test]
    fn unterminated_literals_are_errors() {
        for bad in ["SELECT 'x", "SELECT /* x", "SELECT $a$ x"] {
            assert!(bad.parse::<SqlTemplate>().is_err(), "{bad}");
        }
    }

    #[test]
    fn value_specs() {
        assert_eq!(
            ValueSpec::default_for("amount"),
            ValueSpec::Json("/amount".into())
        );
        assert_eq!(ValueSpec::default_for("idemq_key"), ValueSpec::BusinessKey);
        assert_eq!(
            "header:x".parse::<ValueSpec>().unwrap(),
            ValueSpec::Header("x".into())
        );
        assert!("nope".parse::<ValueSpec>().is_err());
    }
}
