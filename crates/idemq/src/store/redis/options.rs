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
    /// Wait for replicas to acknowledge each claim and each completion
    /// (`WAIT`) before answering; `None` (the default) answers as soon as
    /// the master has written.
    pub replica_ack: Option<ReplicaAck>,
}

/// How many replicas must acknowledge a write before the store answers
/// ([`RedisOptions::wait_for_replicas`]).
///
/// Redis replicates asynchronously: a master that fails over before a
/// replica received a write loses it. Losing a claim lets a second worker
/// take a key the first is still running; losing a completion lets a
/// redelivery run the handler again. `WAIT` makes that window short, not
/// empty: a replica that acknowledged can still lose the write if it is
/// not the one promoted, and `WAIT` itself rolls nothing back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaAck {
    /// Replicas that must acknowledge (on a Cluster: of the key's master).
    pub replicas: u32,
    /// How long to wait for them; fewer by then is a transient error.
    pub timeout: Duration,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            prefix: "idemq".into(),
            retention: Duration::from_secs(7 * 24 * 3600),
            connection_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(2),
            replica_ack: None,
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

    /// Answers a claim or a completion only once `replicas` replicas have
    /// acknowledged it (`WAIT replicas timeout`, one more round trip each).
    /// Fewer within `timeout` is a transient error: a claim releases its
    /// leases and the message is retried; a completion stays written on the
    /// master and the message is retried, its redelivery answered as a
    /// duplicate. See [`ReplicaAck`] for what this does not cover.
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.replica_ack = Some(ReplicaAck { replicas, timeout });
        self
    }

    /// Takes the store's own query parameters out of `url` and applies
    /// them: `wait_replicas=N` (with `wait_timeout_ms=M`, default 1000) is
    /// [`wait_for_replicas`](Self::wait_for_replicas). Returns the options
    /// and the URL without those parameters, for the connection.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idemq::store::redis::RedisOptions;
    ///
    /// let (options, url) = RedisOptions::default()
    ///     .with_url_params("redis://h:6379/0?wait_replicas=1&wait_timeout_ms=250")
    ///     .unwrap();
    /// assert_eq!(url, "redis://h:6379/0");
    /// let ack = options.replica_ack.unwrap();
    /// assert_eq!((ack.replicas, ack.timeout), (1, Duration::from_millis(250)));
    /// ```
    pub fn with_url_params(mut self, url: &str) -> Result<(Self, String), StoreError> {
        let (url, replicas) = crate::redis_client::take_param(url, "wait_replicas");
        let (url, timeout) = crate::redis_client::take_param(&url, "wait_timeout_ms");
        let number = |name: &str, value: &str| {
            value.parse::<u32>().map_err(|_| {
                StoreError::config(format!("{name}={value:?} in the Redis URL is not a number"))
            })
        };
        match (replicas, timeout) {
            (Some(replicas), timeout) => {
                let timeout = match timeout {
                    Some(ms) => number("wait_timeout_ms", &ms)?,
                    None => 1000,
                };
                self = self.wait_for_replicas(
                    number("wait_replicas", &replicas)?,
                    Duration::from_millis(u64::from(timeout)),
                );
            }
            (None, Some(_)) => {
                return Err(StoreError::config(
                    "wait_timeout_ms in the Redis URL needs wait_replicas",
                ))
            }
            (None, None) => {}
        }
        Ok((self, url))
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
