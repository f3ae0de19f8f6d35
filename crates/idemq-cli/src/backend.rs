//! The store URL → a connected backend, and the per-backend glue.
//!
//! Every subcommand is written once, generic over [`Backend`]; this module
//! implements it for the three SQL stores that were compiled in.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use anyhow::Result;
use idemq::store::sql::SqlOptions;
use idemq::store::{Store, StoreAdmin};
use idemq::template::Placeholder;
use idemq::StoreError;

use crate::exit;
use crate::sink::{BoxedHandler, SqlStatement};

/// The backends this binary can talk to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// SQLite (`sqlite:`).
    #[cfg(feature = "sqlite")]
    Sqlite,
    /// PostgreSQL (`postgres://`, `postgresql://`).
    #[cfg(feature = "postgres")]
    Postgres,
    /// MySQL or MariaDB (`mysql://`, `mariadb://`).
    #[cfg(feature = "mysql")]
    MySql,
}

/// A parsed `--store` URL.
#[derive(Debug, Clone)]
pub struct StoreUrl {
    /// The backend the scheme names.
    pub kind: Kind,
    /// The URL as sqlx wants it (`mariadb://` rewritten to `mysql://`).
    pub url: String,
    /// The URL as given, with any password masked, for messages.
    pub display: String,
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.display)
    }
}

/// The error for a backend that exists but was left out of this build.
#[allow(dead_code)] // unused when every backend feature is enabled
fn compiled_out(name: &str, feature: &str) -> String {
    format!("this idemq was built without {name} support (cargo feature `{feature}`)")
}

impl FromStr for StoreUrl {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        let (scheme, rest) = text.split_once(':').ok_or_else(|| {
            format!("{text:?} is not a store URL: expected sqlite:PATH, postgres://… or mysql://…")
        })?;
        let scheme = scheme.to_ascii_lowercase();
        let display = redact(text);
        let kind = match scheme.as_str() {
            "sqlite" => {
                #[cfg(feature = "sqlite")]
                {
                    Kind::Sqlite
                }
                #[cfg(not(feature = "sqlite"))]
                {
                    return Err(compiled_out("SQLite", "sqlite"));
                }
            }
            "postgres" | "postgresql" => {
                #[cfg(feature = "postgres")]
                {
                    Kind::Postgres
                }
                #[cfg(not(feature = "postgres"))]
                {
                    return Err(compiled_out("PostgreSQL", "postgres"));
                }
            }
            "mysql" | "mariadb" => {
                #[cfg(feature = "mysql")]
                {
                    Kind::MySql
                }
                #[cfg(not(feature = "mysql"))]
                {
                    return Err(compiled_out("MySQL/MariaDB", "mysql"));
                }
            }
            other => {
                return Err(format!(
                    "unknown store scheme {other:?} in {display}: expected sqlite:, postgres://, \
                     postgresql://, mysql:// or mariadb://"
                ))
            }
        };
        let url = if scheme == "mariadb" {
            format!("mysql:{rest}")
        } else {
            text.to_owned()
        };
        Ok(Self { kind, url, display })
    }
}

/// Masks the password of `scheme://user:password@host/…`.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some((userinfo, host)) = authority.rsplit_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***@{host}{tail}"),
        None => url.to_owned(),
    }
}

/// A store the CLI can drive: the library's traits plus what the SQL sink
/// and `--init-sql` need from the concrete database.
pub trait Backend: Store + StoreAdmin + Sized {
    /// How the database spells bind parameters.
    const PLACEHOLDER: Placeholder;

    /// Whether `--apply-sql` statements may be cached per connection. Not on
    /// PostgreSQL: sqlx caches a statement by its text with the parameter
    /// types of its first use, so a later message binding another type (an
    /// integer where the first had text or null) would fail.
    const CACHE_STATEMENTS: bool;

    /// Connects (without migrating).
    async fn connect(url: &str, options: SqlOptions) -> Result<Self, StoreError>;

    /// Runs one statement outside any transaction (`--init-sql`).
    async fn execute_raw(&self, sql: &str) -> Result<(), sqlx::Error>;

    /// Prepares a statement without running it, to validate it up front.
    async fn prepare(&self, sql: &str) -> Result<(), sqlx::Error>;

    /// The `--apply-sql` handler for this database's transactions.
    fn sql_handler(statement: Arc<SqlStatement>) -> BoxedHandler<Self::Tx>;
}

/// Implements [`Backend`] for one SQL store over its sqlx database; the
/// bodies are the generic functions of [`crate::sink`].
macro_rules! sql_backend {
    ($store:ty, $db:ty, $placeholder:expr, $cache:expr) => {
        impl Backend for $store {
            const PLACEHOLDER: Placeholder = $placeholder;
            const CACHE_STATEMENTS: bool = $cache;

            async fn connect(url: &str, options: SqlOptions) -> Result<Self, StoreError> {
                <$store>::connect_with(url, options).await
            }

            async fn execute_raw(&self, sql: &str) -> Result<(), sqlx::Error> {
                crate::sink::execute_raw(self.pool(), sql).await
            }

            async fn prepare(&self, sql: &str) -> Result<(), sqlx::Error> {
                crate::sink::prepare(self.pool(), sql).await
            }

            fn sql_handler(statement: Arc<SqlStatement>) -> BoxedHandler<Self::Tx> {
                Box::new(crate::sink::SqlHandler::<$db>::new(statement))
            }
        }
    };
}

#[cfg(feature = "sqlite")]
sql_backend!(
    idemq::store::sql::sqlite::SqliteStore,
    sqlx::Sqlite,
    Placeholder::Positional,
    true
);
#[cfg(feature = "postgres")]
sql_backend!(
    idemq::store::sql::postgres::PostgresStore,
    sqlx::Postgres,
    Placeholder::Numbered,
    false
);
#[cfg(feature = "mysql")]
sql_backend!(
    idemq::store::sql::mysql::MySqlStore,
    sqlx::MySql,
    Placeholder::Positional,
    true
);

/// Connects to `url` as backend `B`; a bad table prefix is a usage error.
pub async fn connect<B: Backend>(url: &StoreUrl, options: SqlOptions) -> Result<B> {
    B::connect(&url.url, options).await.map_err(|e| match e {
        StoreError::Config(_) => exit::usage(e),
        other => anyhow::Error::new(other).context(format!("cannot connect to {url}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes() {
        assert!("ftp://x".parse::<StoreUrl>().is_err());
        assert!("nothing".parse::<StoreUrl>().is_err());
        #[cfg(feature = "mysql")]
        {
            let u: StoreUrl = "mariadb://root:pw@127.0.0.1:3306/test".parse().unwrap();
            assert_eq!(u.kind, Kind::MySql);
            assert_eq!(u.url, "mysql://root:pw@127.0.0.1:3306/test");
            assert_eq!(u.display, "mariadb://root:***@127.0.0.1:3306/test");
        }
        #[cfg(feature = "postgres")]
        {
            let u: StoreUrl = "postgresql://u@h/db".parse().unwrap();
            assert_eq!(u.kind, Kind::Postgres);
            assert_eq!(u.display, "postgresql://u@h/db");
        }
        #[cfg(feature = "sqlite")]
        assert_eq!(
            "sqlite://idemq.db".parse::<StoreUrl>().unwrap().kind,
            Kind::Sqlite
        );
    }
}
