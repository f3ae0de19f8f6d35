//! Options of the Mongo store.

use std::time::Duration;

use crate::error::StoreError;

/// Options of a [`MongoStore`](super::MongoStore).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct MongoOptions {
    /// The database; `None` (the default) takes the URL's (`mongodb://h/db`),
    /// else `idemq`.
    pub database: Option<String>,
    /// Prefix of the collection names (default `idemq_`): letters, digits,
    /// `_`, `-` and `.`, at most 40 bytes.
    pub prefix: String,
    /// With `Some(retention)`, the migration creates a TTL index and each
    /// completion stamps the key's documents to expire `retention` later
    /// (MongoDB; FerretDB has no TTL indexes). `None` (the default): records
    /// stay until [`prune_batch`](crate::store::StoreAdmin::prune_batch).
    pub ttl: Option<Duration>,
    /// Timeout of one connection attempt (default 5 s), unless the URL sets
    /// `connectTimeoutMS`.
    pub connect_timeout: Duration,
    /// How long an operation waits for a usable server (default 5 s), unless
    /// the URL sets `serverSelectionTimeoutMS`.
    pub server_selection_timeout: Duration,
}

impl Default for MongoOptions {
    fn default() -> Self {
        Self {
            database: None,
            prefix: "idemq_".into(),
            ttl: None,
            connect_timeout: Duration::from_secs(5),
            server_selection_timeout: Duration::from_secs(5),
        }
    }
}

impl MongoOptions {
    /// Sets the database.
    pub fn database(mut self, database: impl Into<String>) -> Self {
        self.database = Some(database.into());
        self
    }

    /// Sets the collection prefix.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Expires completed keys `retention` after completion with a TTL index.
    pub fn ttl(mut self, retention: Duration) -> Self {
        self.ttl = Some(retention);
        self
    }

    /// Sets the connection and server selection timeouts.
    pub fn timeouts(mut self, connect: Duration, server_selection: Duration) -> Self {
        self.connect_timeout = connect;
        self.server_selection_timeout = server_selection;
        self
    }

    /// Takes the store's own query parameters out of `url` and applies
    /// them: `prefix=P` is [`prefix`](Self::prefix). Returns the options and
    /// the URL without it, for the driver (which takes the rest).
    ///
    /// ```
    /// use idemq::store::mongo::MongoOptions;
    ///
    /// let (options, url) = MongoOptions::default()
    ///     .with_url_params("mongodb://h:27017/db?prefix=billing_&maxPoolSize=20")
    ///     .unwrap();
    /// assert_eq!(options.prefix, "billing_");
    /// assert_eq!(url, "mongodb://h:27017/db?maxPoolSize=20");
    /// ```
    pub fn with_url_params(mut self, url: &str) -> Result<(Self, String), StoreError> {
        let (base, query) = match url.split_once('?') {
            Some((base, query)) => (base, query),
            None => return Ok((self, url.to_owned())),
        };
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("prefix", value)) => self.prefix = value.to_owned(),
                _ => kept.push(pair),
            }
        }
        let url = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        self.validate()?;
        Ok((self, url))
    }

    pub(super) fn validate(&self) -> Result<(), StoreError> {
        let p = &self.prefix;
        if p.is_empty()
            || p.len() > 40
            || !p
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
            || p.starts_with("system.")
        {
            return Err(StoreError::config(format!(
                "invalid MongoDB collection prefix {p:?}: 1 to 40 letters, digits, '_', '-' or '.', not starting with \"system.\""
            )));
        }
        if let Some(db) = &self.database {
            if db.is_empty() || db.len() > 63 || db.contains(['/', '\\', '.', ' ', '"', '$', '\0'])
            {
                return Err(StoreError::config(format!(
                    "invalid MongoDB database name {db:?}"
                )));
            }
        }
        if self.ttl.is_some_and(|t| t.is_zero()) {
            return Err(StoreError::config("the MongoDB TTL must be > 0"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_and_databases_are_checked() {
        assert!(MongoOptions::default().validate().is_ok());
        assert!(MongoOptions::default().prefix("").validate().is_err());
        assert!(MongoOptions::default().prefix("a$b").validate().is_err());
        assert!(MongoOptions::default()
            .prefix("system.x")
            .validate()
            .is_err());
        assert!(MongoOptions::default().database("a.b").validate().is_err());
        assert!(MongoOptions::default()
            .database("billing")
            .validate()
            .is_ok());
        let (o, url) = MongoOptions::default()
            .with_url_params("mongodb://h/db?prefix=p_")
            .unwrap();
        assert_eq!((o.prefix.as_str(), url.as_str()), ("p_", "mongodb://h/db"));
        assert!(MongoOptions::default()
            .with_url_params("mongodb://h/db?prefix=bad$")
            .is_err());
    }
}
