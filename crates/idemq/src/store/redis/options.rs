//! Options of the Redis store and the naming of its keys.

use std::time::Duration;

use crate::error::StoreError;

/// Options of a [`RedisStore`] (and of a [`RedisFilter`](crate::store::cache::RedisFilter)).
///
/// [`RedisStore`]: super::RedisStore
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RedisOptions {
    /// Prefix of every Redis key (default `idemq`; must not contain `{` or `}`).
    pub prefix: String,
    /// How long a done record (and attempt counters) live: the TTL set on
    /// completion. Keep it longer than duplicates can arrive. Default 7 days.
    pub retention: Duration,
    /// Timeout of one connection attempt (default 2 s).
    pub connection_timeout: Duration,
    /// Timeout of one command's response (default 2 s).
    pub response_timeout: Duration,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            prefix: "idemq".into(),
            retention: Duration::from_secs(7 * 24 * 3600),
            connection_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(2),
        }
    }
}

impl RedisOptions {
    /// Sets the key prefix.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets the retention TTL of done records.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Sets the connection and response timeouts.
    pub fn timeouts(mut self, connection: Duration, response: Duration) -> Self {
        self.connection_timeout = connection;
        self.response_timeout = response;
        self
    }

    pub(super) fn validate(&self) -> Result<(), StoreError> {
        if self.prefix.is_empty() || self.prefix.contains(['{', '}']) {
            return Err(StoreError::config(format!(
                "invalid Redis key prefix {:?}: non-empty, without '{{' or '}}'",
                self.prefix
            )));
        }
        if self.retention.is_zero() {
            return Err(StoreError::config("Redis retention must be > 0"));
        }
        Ok(())
    }
}

/// Escapes a name for use inside a hash tag: `%`, `{`, `}`, `/` percent-encoded.
pub(crate) fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            '/' => out.push_str("%2F"),
            c => out.push(c),
        }
    }
    out
}

/// Key names (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    prefix: String,
}

impl Keys {
    pub(crate) fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
        }
    }

    /// `P:{C/K}:suffix`.
    pub(crate) fn scoped(&self, consumer: &str, key: &str, suffix: &str) -> String {
        format!(
            "{}:{{{}/{}}}:{suffix}",
            self.prefix,
            escape(consumer),
            escape(key)
        )
    }

    pub(super) fn consumer(&self, consumer: &str, suffix: &str) -> String {
        format!("{}:{{c:{}}}:{suffix}", self.prefix, escape(consumer))
    }

    pub(super) fn consumers(&self) -> String {
        format!("{}:consumers", self.prefix)
    }

    pub(super) fn dlq(&self, suffix: &str) -> String {
        format!("{}:{{dlq}}:{suffix}", self.prefix)
    }

    pub(super) fn dlq_consumer(&self, consumer: &str) -> String {
        self.dlq(&format!("c:{}", escape(consumer)))
    }

    pub(super) fn dlq_key(&self, consumer: &str, key: &str) -> String {
        self.dlq(&format!("k:{}/{}", escape(consumer), escape(key)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_keeps_the_hash_tag_whole_and_is_reversible() {
        let keys = Keys::new("p");
        let k = keys.scoped("c", "a}b{c/d%7D", "rec");
        assert_eq!(k, "p:{c/a%7Db%7Bc%2Fd%257D}:rec");
        let tag = &k[k.find('{').unwrap() + 1..k.find('}').unwrap()];
        assert_eq!(tag, "c/a%7Db%7Bc%2Fd%257D");
        assert_ne!(
            keys.scoped("c/x", "y", "rec"),
            keys.scoped("c", "x/y", "rec")
        );
    }
}
