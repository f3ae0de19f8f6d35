//! The store of a chaos cell: the idemq tables (migrations, dead letters)
//! and the ledger the workers write.
//!
//! SQL stores: the ledger is a table *without* a unique constraint on the
//! business key, written by `consume --apply-sql` in the inbox transaction,
//! so a double effect is a second row. Redis (a lease store, no SQL): the
//! worker writes the documented lease-store pattern, an effect keyed by the
//! derived idempotency key and fenced by the lease's fencing number; every
//! accepted write is counted, so re-executions after a lost lease show up.
//! MongoDB (a lease store too): the worker upserts each order once by its
//! key (`$setOnInsert` on `_id`, what `--apply-mongo` does) and records
//! every re-execution that found the document already there.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use idemq::store::{DeadLetterRecord, StoreAdmin};

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
use idemq::store::sql::{Column, SqlDatabase, SqlStore};

use crate::backend::{Kind, StoreUrl};

/// What the ledger holds at the end of a cell.
#[derive(Debug, Default)]
pub struct LedgerState {
    /// Per business key: (rows, sum of amounts).
    pub per_key: BTreeMap<String, (u64, i64)>,
    /// Lease stores: accepted effect writes beyond the first per key (the
    /// handler ran again after a lost lease; the keyed write absorbed it).
    pub rewrites: Option<u64>,
}

/// A connected store of one cell.
pub enum CellStore {
    /// A SQL store (SQLite, PostgreSQL, MySQL/MariaDB): one generic side.
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    Sql(Box<dyn SqlCell>),
    /// The Redis lease store, and a connection for the ledger.
    #[cfg(feature = "redis")]
    Redis(idemq::store::redis::RedisStore),
    /// The MongoDB lease store; the ledger is collections of its database.
    #[cfg(feature = "mongodb")]
    Mongo(idemq::store::mongo::MongoStore),
}

/// What a cell needs of a SQL store: its admin side and plain statements
/// on its pool. Implemented once, for every [`SqlStore`].
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[async_trait::async_trait]
pub trait SqlCell: Send + Sync {
    /// The store's admin side (migrations, dead letters).
    fn admin(&self) -> &dyn StoreAdmin;
    /// Runs one statement.
    async fn execute(&self, sql: &str) -> Result<()>;
    /// Runs a query of two columns, text and integer.
    async fn pairs(&self, sql: &str) -> Result<Vec<(String, i64)>>;
    /// Runs a query of one integer.
    async fn count(&self, sql: &str) -> Result<i64>;
}

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[async_trait::async_trait]
impl<DB: SqlDatabase> SqlCell for SqlStore<DB> {
    fn admin(&self) -> &dyn StoreAdmin {
        self
    }

    async fn execute(&self, sql: &str) -> Result<()> {
        let mut conn = self.pool().acquire().await?;
        DB::execute(&mut conn, sql, &[]).await?;
        Ok(())
    }

    async fn pairs(&self, sql: &str) -> Result<Vec<(String, i64)>> {
        let mut conn = self.pool().acquire().await?;
        DB::fetch(&mut conn, sql, &[], &[Column::Text, Column::Int])
            .await?
            .iter()
            .map(|row| Ok((row.text(0)?, row.int(1)?)))
            .collect()
    }

    async fn count(&self, sql: &str) -> Result<i64> {
        let mut conn = self.pool().acquire().await?;
        let rows = DB::fetch(&mut conn, sql, &[], &[Column::Int]).await?;
        Ok(rows.first().map(|row| row.int(0)).transpose()?.unwrap_or(0))
    }
}

/// A SQL store of the cell, boxed.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
async fn sql_cell<DB: SqlDatabase>(
    url: &StoreUrl,
    prefix: &str,
    partitioned_inbox: Option<std::time::Duration>,
) -> Result<CellStore> {
    let mut options = idemq::store::sql::SqlOptions::default().table_prefix(prefix);
    if let Some(interval) = partitioned_inbox {
        options = options.partitioned_inbox(idemq::store::sql::InboxPartitions::every(interval));
    }
    let store = SqlStore::<DB>::connect_with(&url.url, options)
        .await
        .with_context(|| format!("connecting to {url}"))?;
    Ok(CellStore::Sql(Box::new(store)))
}

/// The Redis keys of a lease-store ledger named `base`: effects by
/// idempotency key, their fencing numbers, and accepted writes per key.
#[cfg(feature = "redis")]
pub fn redis_ledger_keys(base: &str) -> [String; 3] {
    [
        format!("{base}:ledger"),
        format!("{base}:fence"),
        format!("{base}:writes"),
    ]
}

/// The idemq key prefix of the Redis store for a table prefix (as `main` does).
#[cfg(feature = "redis")]
pub fn redis_prefix(table_prefix: &str) -> String {
    let prefix = table_prefix.trim_end_matches('_');
    if prefix.is_empty() {
        "idemq".to_owned()
    } else {
        prefix.to_owned()
    }
}

/// The MongoDB collections of a lease-store ledger named `base`: the
/// orders by key, and one document per re-execution that found its order
/// already written.
#[cfg(feature = "mongodb")]
pub fn mongo_ledger_names(base: &str) -> [String; 2] {
    [base.to_owned(), format!("{base}_rewrites")]
}

/// A collection of the Mongo store's database.
#[cfg(feature = "mongodb")]
fn mongo_collection(
    store: &idemq::store::mongo::MongoStore,
    name: &str,
) -> idemq::effect::mongo::mongodb::Collection<idemq::effect::mongo::mongodb::bson::Document> {
    store.database().collection(name)
}

impl CellStore {
    /// Connects to the store `url` names with the cell's table prefix.
    pub async fn connect(
        url: &StoreUrl,
        prefix: &str,
        partitioned_inbox: Option<std::time::Duration>,
    ) -> Result<Self> {
        if partitioned_inbox.is_some() {
            url.check_partitionable()?;
        }
        match url.kind {
            #[cfg(feature = "sqlite")]
            Kind::Sqlite => sql_cell::<sqlx::Sqlite>(url, prefix, None).await,
            #[cfg(feature = "postgres")]
            Kind::Postgres => sql_cell::<sqlx::Postgres>(url, prefix, partitioned_inbox).await,
            #[cfg(feature = "mysql")]
            Kind::MySql => sql_cell::<sqlx::MySql>(url, prefix, partitioned_inbox).await,
            #[cfg(feature = "redis")]
            Kind::Redis => {
                use idemq::store::redis::{RedisOptions, RedisStore};
                let options = RedisOptions::default().prefix(redis_prefix(prefix));
                Ok(CellStore::Redis(
                    RedisStore::connect_with(&url.url, options)
                        .await
                        .with_context(|| format!("connecting to {url}"))?,
                ))
            }
            #[cfg(feature = "mongodb")]
            Kind::Mongo => {
                use idemq::store::mongo::{MongoOptions, MongoStore};
                let (options, plain) = MongoOptions::default()
                    .prefix(prefix)
                    .with_url_params(&url.url)
                    .with_context(|| format!("the options of {url}"))?;
                Ok(CellStore::Mongo(
                    MongoStore::connect_with(&plain, options)
                        .await
                        .with_context(|| format!("connecting to {url}"))?,
                ))
            }
        }
    }

    /// The store's admin side (migrations, dead letters).
    fn admin(&self) -> &dyn StoreAdmin {
        match self {
            #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
            CellStore::Sql(s) => s.admin(),
            #[cfg(feature = "redis")]
            CellStore::Redis(s) => s,
            #[cfg(feature = "mongodb")]
            CellStore::Mongo(s) => s,
        }
    }

    /// Whether the store is a SQL database (`consume --apply-sql` works).
    pub fn is_sql(&self) -> bool {
        match self {
            #[cfg(feature = "redis")]
            CellStore::Redis(_) => false,
            #[cfg(feature = "mongodb")]
            CellStore::Mongo(_) => false,
            #[allow(unreachable_patterns)]
            _ => true,
        }
    }

    /// What the ledger of a lease store is (for the cell's notes).
    pub fn lease_ledger_note(&self) -> &'static str {
        match self {
            #[cfg(feature = "mongodb")]
            CellStore::Mongo(_) => {
                "lease store: the ledger is an upsert keyed by the order ($setOnInsert on _id, \
                 what --apply-mongo does), not a table in the inbox transaction; re-executions \
                 that found the order written are counted as rewrites"
            }
            #[allow(unreachable_patterns)]
            _ => {
                "lease store: the ledger is an effect keyed by the derived idempotency key and \
                 fenced by the lease's fencing number (the documented lease-store pattern), not a \
                 table in the inbox transaction"
            }
        }
    }

    /// Creates the idemq tables and an empty ledger `table` (no unique
    /// constraint on the business key).
    pub async fn prepare(&self, table: &str) -> Result<()> {
        self.admin()
            .migrate()
            .await
            .context("migrating the idemq tables")?;
        match self {
            #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
            CellStore::Sql(s) => {
                s.execute(&format!(
                    "CREATE TABLE {table} (order_id VARCHAR(100) NOT NULL, amount BIGINT NOT NULL, \
                     msg_id VARCHAR(200) NULL)"
                ))
                .await?
            }
            #[cfg(feature = "redis")]
            CellStore::Redis(s) => {
                let mut conn = s.connection().clone();
                let _: () = redis::cmd("DEL")
                    .arg(&redis_ledger_keys(table)[..])
                    .query_async(&mut conn)
                    .await?;
            }
            #[cfg(feature = "mongodb")]
            CellStore::Mongo(s) => {
                for name in mongo_ledger_names(table) {
                    mongo_collection(s, &name).drop().await?;
                }
            }
        }
        Ok(())
    }

    /// Runs the store's retention with a cutoff of 0: it drops nothing, and
    /// on a partitioned PostgreSQL inbox seals the partitions that have
    /// ended. Returns how many partitions are sealed (`None`: not a
    /// partitioned PostgreSQL inbox named `inbox`).
    pub async fn seal_partitions(&self, inbox: &str) -> Result<Option<i64>> {
        self.admin().prune_batch(0, 10_000).await?;
        Ok(match self {
            #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
            CellStore::Sql(s) => {
                let exists = s
                    .count(&format!(
                        "SELECT COUNT(*) FROM information_schema.tables \
                         WHERE table_name = '{inbox}_sealed'"
                    ))
                    .await?;
                if exists == 0 {
                    None
                } else {
                    Some(
                        s.count(&format!("SELECT COUNT(*) FROM {inbox}_sealed"))
                            .await?,
                    )
                }
            }
            #[allow(unreachable_patterns)]
            _ => None,
        })
    }

    /// How many effects the ledger holds (for pacing the kills).
    pub async fn applied(&self, table: &str) -> Result<u64> {
        Ok(match self {
            #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
            CellStore::Sql(s) => {
                u64::try_from(s.count(&format!("SELECT COUNT(*) FROM {table}")).await?).unwrap_or(0)
            }
            #[cfg(feature = "redis")]
            CellStore::Redis(s) => {
                let mut conn = s.connection().clone();
                let [ledger, _, _] = redis_ledger_keys(table);
                redis::cmd("HLEN")
                    .arg(ledger)
                    .query_async(&mut conn)
                    .await?
            }
            #[cfg(feature = "mongodb")]
            CellStore::Mongo(s) => {
                let [ledger, _] = mongo_ledger_names(table);
                mongo_collection(s, &ledger)
                    .count_documents(idemq::effect::mongo::mongodb::bson::doc! {})
                    .await?
            }
        })
    }

    /// The ledger, grouped by business key.
    pub async fn ledger(&self, table: &str) -> Result<LedgerState> {
        let mut state = LedgerState::default();
        let rows: Vec<(String, i64)> = match self {
            #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
            CellStore::Sql(s) => {
                s.pairs(&format!("SELECT order_id, amount FROM {table}"))
                    .await?
            }
            #[cfg(feature = "redis")]
            CellStore::Redis(s) => {
                let mut conn = s.connection().clone();
                let [ledger, _, writes] = redis_ledger_keys(table);
                let effects: BTreeMap<String, String> = redis::cmd("HGETALL")
                    .arg(&ledger)
                    .query_async(&mut conn)
                    .await?;
                let counts: BTreeMap<String, u64> = redis::cmd("HGETALL")
                    .arg(&writes)
                    .query_async(&mut conn)
                    .await?;
                state.rewrites = Some(counts.values().map(|n| n.saturating_sub(1)).sum());
                effects
                    .values()
                    .filter_map(|v| {
                        let (key, amount) = v.rsplit_once(' ')?;
                        Some((key.to_owned(), amount.parse().ok()?))
                    })
                    .collect()
            }
            #[cfg(feature = "mongodb")]
            CellStore::Mongo(s) => {
                use futures_util::TryStreamExt;
                use idemq::effect::mongo::mongodb::bson::doc;
                let [ledger, rewrites] = mongo_ledger_names(table);
                state.rewrites = Some(
                    mongo_collection(s, &rewrites)
                        .count_documents(doc! {})
                        .await?,
                );
                let documents: Vec<_> = mongo_collection(s, &ledger)
                    .find(doc! {})
                    .await?
                    .try_collect()
                    .await?;
                documents
                    .iter()
                    .map(|d| {
                        let key = d.get_str("_id").context("a ledger _id that is not a key")?;
                        let amount = match d.get("amount") {
                            Some(idemq::effect::mongo::mongodb::bson::Bson::Int32(n)) => {
                                i64::from(*n)
                            }
                            Some(idemq::effect::mongo::mongodb::bson::Bson::Int64(n)) => *n,
                            other => anyhow::bail!("ledger {key}: amount {other:?}"),
                        };
                        Ok((key.to_owned(), amount))
                    })
                    .collect::<Result<_>>()?
            }
        };
        for (key, amount) in rows {
            let entry = state.per_key.entry(key).or_insert((0, 0));
            entry.0 += 1;
            entry.1 += amount;
        }
        Ok(state)
    }

    /// Every dead letter of `consumer`.
    pub async fn dead_letters(&self, consumer: &str) -> Result<Vec<DeadLetterRecord>> {
        let mut all = Vec::new();
        let mut after = 0;
        loop {
            let page = self
                .admin()
                .dead_letters(Some(consumer), after, 500)
                .await
                .context("reading the dead letters")?;
            let Some(last) = page.last() else {
                return Ok(all);
            };
            after = last.id;
            all.extend(page);
        }
    }
}
