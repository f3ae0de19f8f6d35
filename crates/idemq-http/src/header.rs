//! The `Idempotency-Key` request header: an RFC 8941 Item Structured Field
//! whose bare item is a String (draft-ietf-httpapi-idempotency-key-header).

use http::header::GetAll;
use http::HeaderValue;

use crate::error::KeyError;

/// The header's name, lowercase as HTTP/2 and `http` spell it.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Reads the key from every `Idempotency-Key` field line of a request:
/// `Ok(None)` when there is none, the unquoted string when there is exactly
/// one valid Item, an error otherwise.
///
/// ```
/// use http::HeaderMap;
/// let mut headers = HeaderMap::new();
/// headers.insert("idempotency-key", r#""8e03978e-40d5-43e8-bc93-6894a57f9324""#.parse().unwrap());
/// let key = idemq_http::header::parse_key(headers.get_all("idempotency-key")).unwrap();
/// assert_eq!(key.as_deref(), Some("8e03978e-40d5-43e8-bc93-6894a57f9324"));
/// ```
pub fn parse_key(values: GetAll<'_, HeaderValue>) -> Result<Option<String>, KeyError> {
    let mut iter = values.iter();
    let Some(first) = iter.next() else {
        return Ok(None);
    };
    // Several field lines are combined with commas, which makes a List, not an Item.
    if iter.next().is_some() {
        return Err(KeyError::Repeated);
    }
    parse_item(first.as_bytes()).map(Some)
}

/// Parses one Item whose bare item is a String, ignoring its parameters
/// (which are checked for syntax): leading and trailing spaces are allowed,
/// as a field value's surrounding whitespace is.
pub fn parse_item(input: &[u8]) -> Result<String, KeyError> {
    let mut p = Parser { input, pos: 0 };
    p.skip_sp();
    let key = p.string()?;
    p.parameters()?;
    p.skip_sp();
    if p.pos != input.len() {
        return Err(KeyError::Syntax("unexpected characters after the item"));
    }
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    Ok(key)
}

/// Serializes `key` as an sf-string (quotes, with `\` and `"` escaped), the
/// way a client sends it. `None` if it has characters an sf-string cannot
/// carry (outside printable ASCII).
pub fn format_key(key: &str) -> Option<String> {
    let mut out = String::with_capacity(key.len() + 2);
    out.push('"');
    for c in key.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => return None,
        }
    }
    out.push('"');
    Some(out)
}

struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn skip_sp(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t')) {
            self.pos += 1;
        }
    }

    /// sf-string = DQUOTE *( unescaped / "%" / escaped ) DQUOTE
    fn string(&mut self) -> Result<String, KeyError> {
        if self.peek() != Some(b'"') {
            return Err(KeyError::NotAString);
        }
        self.pos += 1;
        let mut out = String::new();
        loop {
            let Some(c) = self.peek() else {
                return Err(KeyError::Syntax("unterminated string"));
            };
            self.pos += 1;
            match c {
                b'"' => return Ok(out),
                b'\\' => match self.peek() {
                    Some(e @ (b'"' | b'\\')) => {
                        self.pos += 1;
                        out.push(char::from(e));
                    }
                    _ => return Err(KeyError::Syntax("bad escape in string")),
                },
                0x20..=0x7e => out.push(char::from(c)),
                _ => return Err(KeyError::Syntax("non-printable character in string")),
            }
        }
    }

    /// parameters = *( ";" *SP key [ "=" bare-item ] )
    fn parameters(&mut self) -> Result<(), KeyError> {
        while self.peek() == Some(b';') {
            self.pos += 1;
            while self.peek() == Some(b' ') {
                self.pos += 1;
            }
            match self.peek() {
                Some(b'a'..=b'z' | b'*') => self.pos += 1,
                _ => return Err(KeyError::Syntax("bad parameter name")),
            }
            while matches!(
                self.peek(),
                Some(b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*')
            ) {
                self.pos += 1;
            }
            if self.peek() == Some(b'=') {
                self.pos += 1;
                self.bare_item()?;
            }
        }
        Ok(())
    }

    /// A parameter's value: string, token, number, byte sequence or boolean.
    fn bare_item(&mut self) -> Result<(), KeyError> {
        match self.peek() {
            Some(b'"') => self.string().map(|_| ()),
            Some(b'?') => {
                self.pos += 1;
                match self.peek() {
                    Some(b'0' | b'1') => {
                        self.pos += 1;
                        Ok(())
                    }
                    _ => Err(KeyError::Syntax("bad boolean")),
                }
            }
            Some(b':') => {
                self.pos += 1;
                while matches!(self.peek(), Some(c) if c.is_ascii_alphanumeric() || matches!(c, b'+' | b'/' | b'='))
                {
                    self.pos += 1;
                }
                if self.peek() != Some(b':') {
                    return Err(KeyError::Syntax("bad byte sequence"));
                }
                self.pos += 1;
                Ok(())
            }
            Some(b'-' | b'0'..=b'9') => {
                self.pos += 1;
                let start = self.pos;
                while matches!(self.peek(), Some(b'0'..=b'9' | b'.')) {
                    self.pos += 1;
                }
                if self.pos - start > 16 {
                    return Err(KeyError::Syntax("number too long"));
                }
                Ok(())
            }
            Some(c) if c.is_ascii_alphabetic() || c == b'*' => {
                self.pos += 1;
                while matches!(self.peek(), Some(c) if c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&c))
                {
                    self.pos += 1;
                }
                Ok(())
            }
            _ => Err(KeyError::Syntax("bad parameter value")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_strings_and_parameters() {
        assert_eq!(parse_item(br#""abc""#).unwrap(), "abc");
        assert_eq!(parse_item(br#"  "a\"b\\c"  "#).unwrap(), r#"a"b\c"#);
        assert_eq!(
            parse_item(br#""k";a=1;b;c="x";d=?1;e=:aGk=:"#).unwrap(),
            "k"
        );
    }

    #[test]
    fn refuses_what_is_not_one_string_item() {
        for bad in [
            &b"abc"[..],
            b"\"abc",
            b"\"\"",
            b"\"a\" \"b\"",
            b"\"a\", \"b\"",
            b"\"a\\n\"",
            b"42",
            b"\"a\";A=1",
            b"\"\xc3\xa9\"",
        ] {
            assert!(
                parse_item(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn two_field_lines_are_refused() {
        let mut headers = http::HeaderMap::new();
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("\"a\""));
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("\"b\""));
        assert!(matches!(
            parse_key(headers.get_all(IDEMPOTENCY_KEY)),
            Err(KeyError::Repeated)
        ));
    }

    #[test]
    fn format_round_trips() {
        let key = r#"x "y" \z"#;
        let text = format_key(key).unwrap();
        assert_eq!(parse_item(text.as_bytes()).unwrap(), key);
        assert_eq!(format_key("é"), None);
    }
}
