//! The transactional outbox: write the messages an application must publish
//! into a table **in the same database transaction** as its business
//! writes, and let a [`Relay`] publish them to a broker afterwards.
//!
//! Publishing straight from a business transaction is a dual write: the
//! transaction may roll back after the broker took the message, or the
//! process may die after the commit and before the publish. With the outbox
//! the message exists exactly when the business change does; the relay then
//! publishes it at least once, with the outbox row's id as the message id
//! (and header `event_id`), so that an idemq consumer keyed by
//! `header:event_id` applies every event exactly once.
//!
//! # The table
//!
//! `{prefix}outbox` (prefix as for the inbox, default `idemq_`), created by
//! [`Outbox::migrate`], uses the column layout of the Debezium outbox event
//! router, so that a team can replace the relay with Debezium without
//! changing producers:
//!
//! | column          | meaning                                                       | message              |
//! |-----------------|---------------------------------------------------------------|----------------------|
//! | `seq`           | auto-increment: the relay order                               | —                    |
//! | `id`            | event id (a UUID unless given), unique                        | [`Message::id`], header `event_id` |
//! | `aggregatetype` | the destination (Debezium routes by it)                       | picks the publisher  |
//! | `aggregateid`   | the key; order is kept per (destination, key)                 | [`Message::key`]     |
//! | `type`          | the event type (may be empty)                                 | header `event_type`  |
//! | `payload`       | the payload bytes                                             | [`Message::payload`] |
//! | `headers`       | JSON object of headers ([`Headers::to_json`]), or NULL        | headers              |
//! | `created_at`, `attempts`, `available_at`, `last_error` | the relay's bookkeeping (ms since the epoch) | — |
//!
//! Rows the relay gives up on move to `{prefix}outbox_dead`: the same
//! columns (but `available_at`, `last_error`) plus `reason` and `dead_at`.
//!
//! # Ordering
//!
//! A relay holds a (destination, key) by locking the key's *oldest* row:
//! it reads the oldest row of each key, locks those rows with
//! `FOR UPDATE SKIP LOCKED` (PostgreSQL, MariaDB ≥ 10.6), and publishes the
//! rows of the keys it got inside that transaction: one key's rows one
//! after another in `seq` order (the next once the broker confirmed the
//! previous), different keys concurrently, up to
//! [`RelayOptions::max_in_flight`] at once. Another
//! relay sees the same oldest row, cannot lock it, and skips the whole key
//! — it never takes a later row of a key whose earlier row is in flight.
//! Rows are deleted only after the broker confirmed them, and after a
//! failed publish the key's remaining rows wait (with backoff) behind it.
//! On SQLite, which has no row locks, the batch transaction starts with
//! `BEGIN IMMEDIATE`: relays take turns on the database's single write lock
//! (and application writes wait for a batch; keep batches small).
//!
//! `seq` order is insertion order. Two transactions that enqueue for the
//! same key concurrently without serializing on the aggregate can commit in
//! the other order; enqueue *after* the write that locks the aggregate
//! (e.g. the `UPDATE orders …`) and insertion order is commit order.
//!
//! # Failure windows
//!
//! - The business transaction rolls back: the row never existed.
//! - A publish fails or times out: the row stays, its `attempts` grows and
//!   it is retried after a backoff; later rows of its key wait, the batch's
//!   other keys go on.
//! - A row fails [`RelayOptions::max_attempts`] times, or with an error a
//!   retry cannot cure (a [`SourceErrorKind::Config`](crate::SourceErrorKind::Config)(crate::SourceError::config)
//!   from the publisher, a `headers` column that is not a JSON object): it
//!   moves to `{prefix}outbox_dead` with the reason, in the transaction that
//!   deletes it, and its key's later rows go on ([`Outbox::dead_letters`]
//!   lists them).
//! - The relay dies after the broker took a message and before the delete
//!   commits: its transaction rolls back, and the next relay publishes the
//!   same row again **with the same id** — at least once, never lost; the
//!   consumer's inbox (keyed by `event_id`) drops the copy.
//!
//! See `docs/outbox.md` for the whole chain.
//!
//! [`Message::id`]: crate::Message::id
//! [`Message::key`]: crate::Message::key
//! [`Message::payload`]: crate::Message::payload

mod db;
mod relay;
mod schema;

use std::marker::PhantomData;

pub use relay::{BatchReport, Relay, RelayOptions, RelayStats};
pub use schema::{OUTBOX_DEAD_SCHEMA_VERSION, OUTBOX_SCHEMA_VERSION};

use crate::error::ConfigError;
use crate::message::Headers;
use crate::store::sql::SqlDatabase;
use crate::store::sql::{Queries, Tables};
use db::Bind;
use schema::Statements;

/// The header that carries the outbox row's id (also [`Message::id`](crate::Message::id)).
pub const EVENT_ID_HEADER: &str = "event_id";
/// The header that carries the row's `type`, when it is not empty.
pub const EVENT_TYPE_HEADER: &str = "event_type";
/// The longest destination (`aggregatetype`), in characters.
pub const MAX_DESTINATION_CHARS: usize = 128;
/// The longest key (`aggregateid`), in characters.
pub const MAX_KEY_CHARS: usize = 512;

/// A failure of the outbox or its relay.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The database failed.
    #[error("outbox database: {0}")]
    Database(#[from] sqlx::Error),
    /// A bad table prefix or option.
    #[error("outbox configuration: {0}")]
    Config(String),
    /// An event that cannot be stored (empty or over-long destination or
    /// key, unusable id).
    #[error("invalid outbox event: {0}")]
    Invalid(String),
    /// The broker did not confirm what was published (a failed flush).
    #[error("outbox publish: {0}")]
    Publish(String),
}

impl From<ConfigError> for OutboxError {
    fn from(err: ConfigError) -> Self {
        OutboxError::Config(err.to_string())
    }
}

impl OutboxError {
    /// Whether the database says the outbox table does not exist (see
    /// [`is_missing_table`](crate::store::sql::is_missing_table)).
    pub fn is_missing_table(&self) -> bool {
        matches!(self, OutboxError::Database(e) if crate::store::sql::is_missing_table(e))
    }

    /// Whether retrying may help (lost connection, deadlock, busy database).
    pub fn is_transient(&self) -> bool {
        match self {
            OutboxError::Database(e) => crate::store::sql::is_transient(e),
            OutboxError::Publish(_) => true,
            OutboxError::Config(_) | OutboxError::Invalid(_) => false,
        }
    }
}

/// A database the outbox runs on: every [`SqlDatabase`] (PostgreSQL,
/// MySQL/MariaDB and SQLite, as far as their cargo features are on).
pub trait OutboxDatabase: SqlDatabase {}

impl<DB: SqlDatabase> OutboxDatabase for DB {}

/// One event to write: [`Outbox::enqueue`] takes its parts, [`Outbox::enqueue_event`] all of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutboxEvent {
    /// The event id; `None` makes a new UUID. Must be unique in the table.
    pub id: Option<String>,
    /// The destination (`aggregatetype`): which publisher of the relay takes it.
    pub destination: String,
    /// The key (`aggregateid`): the broker's message key and the unit of order.
    pub key: String,
    /// The event type (`type`), sent as header `event_type` if not empty.
    pub event_type: String,
    /// Headers, sent with the message.
    pub headers: Headers,
    /// The payload.
    pub payload: Vec<u8>,
}

impl OutboxEvent {
    /// An event for `destination` with `key` and `payload`.
    pub fn new(
        destination: impl Into<String>,
        key: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        Self {
            destination: destination.into(),
            key: key.into(),
            payload: payload.into(),
            ..Self::default()
        }
    }

    /// Sets the event id (default: a new UUID).
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// Sets the event type.
    pub fn with_type(mut self, event_type: impl Into<String>) -> Self {
        self.event_type = event_type.into();
        self
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.insert(name, value);
        self
    }

    fn validate(&self) -> Result<(), OutboxError> {
        let checks = [
            ("destination", &self.destination, MAX_DESTINATION_CHARS),
            ("key", &self.key, MAX_KEY_CHARS),
        ];
        for (what, value, max) in checks {
            if value.is_empty() {
                return Err(OutboxError::Invalid(format!("the {what} is empty")));
            }
            if value.chars().count() > max {
                return Err(OutboxError::Invalid(format!(
                    "the {what} is longer than {max} characters"
                )));
            }
        }
        if let Some(id) = &self.id {
            if id.is_empty() || id.chars().count() > 255 {
                return Err(OutboxError::Invalid(
                    "the id must be 1 to 255 characters".into(),
                ));
            }
        }
        if self.event_type.chars().count() > 255 {
            return Err(OutboxError::Invalid(
                "the event type is longer than 255 characters".into(),
            ));
        }
        Ok(())
    }
}

/// A row the relay gave up on, as [`Outbox::dead_letters`] reads it from
/// `{prefix}outbox_dead`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadEvent {
    /// The row's `seq` in the outbox.
    pub seq: i64,
    /// The event id.
    pub id: String,
    /// The destination (`aggregatetype`).
    pub destination: String,
    /// The key (`aggregateid`).
    pub key: String,
    /// The event type (may be empty).
    pub event_type: String,
    /// The `headers` column as it was (JSON text, or NULL).
    pub headers: Option<String>,
    /// The payload.
    pub payload: Vec<u8>,
    /// When it was enqueued (ms since the epoch).
    pub created_at: i64,
    /// Failed publishes, the last one included.
    pub attempts: i64,
    /// Why the relay gave up, with the last error.
    pub reason: String,
    /// When it was moved here (ms since the epoch).
    pub dead_at: i64,
}

/// The outbox table of one database and table prefix: creates it and
/// writes events into it inside the caller's transaction.
///
/// ```no_run
/// use idemq::outbox::Outbox;
/// use idemq::Headers;
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/test").await?;
/// let outbox = Outbox::<sqlx::Postgres>::new("idemq_")?;
/// outbox.migrate(&pool).await?;
///
/// let mut tx = pool.begin().await?;
/// sqlx::query("UPDATE orders SET status = 'paid' WHERE id = $1")
///     .bind("o-1")
///     .execute(&mut *tx)
///     .await?;
/// let event_id = outbox
///     .enqueue(&mut tx, "payments", "o-1", &Headers::new(), br#"{"order_id":"o-1","amount":120}"#)
///     .await?;
/// tx.commit().await?; // the event exists exactly when the update does
/// println!("enqueued {event_id}");
/// # Ok(()) }
/// ```
pub struct Outbox<DB: OutboxDatabase> {
    tables: Tables,
    statements: Statements,
    _db: PhantomData<fn() -> DB>,
}

impl<DB: OutboxDatabase> Clone for Outbox<DB> {
    fn clone(&self) -> Self {
        Self {
            tables: self.tables.clone(),
            statements: self.statements.clone(),
            _db: PhantomData,
        }
    }
}

impl<DB: OutboxDatabase> std::fmt::Debug for Outbox<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("table", &self.statements.table)
            .finish_non_exhaustive()
    }
}

impl<DB: OutboxDatabase> Outbox<DB> {
    /// The outbox table `{prefix}outbox`; the prefix is validated as for the
    /// inbox tables (letters, digits, `_`; at most 40 bytes).
    pub fn new(table_prefix: &str) -> Result<Self, OutboxError> {
        let tables = Tables::new(table_prefix)?;
        let statements = Statements::new(DB::DIALECT, &format!("{}outbox", tables.prefix));
        Ok(Self {
            tables,
            statements,
            _db: PhantomData,
        })
    }

    /// The table name.
    pub fn table(&self) -> &str {
        &self.statements.table
    }

    /// The dead-letter table's name, `{prefix}outbox_dead`.
    pub fn dead_table(&self) -> &str {
        &self.statements.dead_table
    }

    pub(crate) fn statements(&self) -> &Statements {
        &self.statements
    }

    /// Creates the outbox table (and on PostgreSQL the trigger that
    /// notifies relays) and the dead-letter table `{prefix}outbox_dead` if
    /// they do not exist, recording versions [`OUTBOX_SCHEMA_VERSION`] and
    /// [`OUTBOX_DEAD_SCHEMA_VERSION`] in `{prefix}schema_migrations`; a
    /// database migrated by an older version gets the missing step only.
    /// Safe to run concurrently and repeatedly; independent of the inbox's
    /// migrations.
    pub async fn migrate(&self, pool: &sqlx::Pool<DB>) -> Result<(), OutboxError> {
        let queries = Queries::new(DB::DIALECT, &self.tables);
        crate::store::sql::migrate::<DB>(pool, &queries, &self.statements.migrations, "outbox")
            .await?;
        Ok(())
    }

    /// Writes one event for `destination` with `key` (the aggregate id),
    /// `headers` and `payload` through `conn` — pass the business
    /// transaction (`&mut tx`), so that the event commits or rolls back with
    /// it. Returns the event id (a new UUID), which the relay sends as the
    /// message id and the `event_id` header.
    pub async fn enqueue(
        &self,
        conn: &mut DB::Connection,
        destination: &str,
        key: &str,
        headers: &Headers,
        payload: &[u8],
    ) -> Result<String, OutboxError> {
        let event = OutboxEvent {
            id: None,
            destination: destination.to_owned(),
            key: key.to_owned(),
            event_type: String::new(),
            headers: headers.clone(),
            payload: payload.to_vec(),
        };
        self.enqueue_event(conn, &event).await
    }

    /// [`enqueue`](Self::enqueue) with every field of [`OutboxEvent`]
    /// (a chosen id, an event type).
    pub async fn enqueue_event(
        &self,
        conn: &mut DB::Connection,
        event: &OutboxEvent,
    ) -> Result<String, OutboxError> {
        event.validate()?;
        let id = event
            .id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let headers = (!event.headers.is_empty()).then(|| event.headers.to_json().to_string());
        let binds = [
            Bind::Text(&id),
            Bind::Text(&event.destination),
            Bind::Text(&event.key),
            Bind::Text(&event.event_type),
            Bind::Bytes(&event.payload),
            Bind::OptText(headers.as_deref()),
            Bind::Int(crate::store::now_ms()),
        ];
        DB::execute(conn, &self.statements.insert, &binds).await?;
        metrics::counter!("idemq_outbox_enqueued_total", "destination" => event.destination.clone())
            .increment(1);
        tracing::debug!(table = %self.statements.table, %id, destination = %event.destination, key = %event.key, "enqueued an outbox event");
        Ok(id)
    }

    /// The oldest `limit` rows of the dead-letter table, oldest first.
    /// To publish one again, insert it into the outbox (it goes behind its
    /// key's rows) and delete it here, in one transaction; see
    /// `docs/outbox.md`.
    pub async fn dead_letters(
        &self,
        pool: &sqlx::Pool<DB>,
        limit: usize,
    ) -> Result<Vec<DeadEvent>, OutboxError> {
        let mut conn = pool.acquire().await?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        Ok(
            db::fetch_dead::<DB>(&mut conn, &self.statements.dead_rows, &[Bind::Int(limit)])
                .await?,
        )
    }

    /// How many rows wait in the outbox (unpublished, or published and not
    /// yet deleted).
    pub async fn pending(&self, pool: &sqlx::Pool<DB>) -> Result<u64, OutboxError> {
        let mut conn = pool.acquire().await?;
        let n = db::fetch_ints::<DB>(&mut conn, &self.statements.count, &[]).await?;
        Ok(n.first().map_or(0, |n| u64::try_from(*n).unwrap_or(0)))
    }

    /// What waits in the outbox and its dead-letter table, in three short
    /// queries; [`Backlog::record`] sets the relay's gauges from it.
    pub async fn backlog(&self, pool: &sqlx::Pool<DB>) -> Result<Backlog, OutboxError> {
        let mut conn = pool.acquire().await?;
        let first = |n: Vec<i64>| n.first().copied();
        let count = |n: Option<i64>| n.map_or(0, |n| u64::try_from(n).unwrap_or(0));
        let statements = &self.statements;
        let rows = count(first(
            db::fetch_ints::<DB>(&mut conn, &statements.count, &[]).await?,
        ));
        let oldest = first(db::fetch_ints::<DB>(&mut conn, &statements.oldest, &[]).await?);
        let dead_rows = count(first(
            db::fetch_ints::<DB>(&mut conn, &statements.dead_count, &[]).await?,
        ));
        Ok(Backlog {
            rows,
            // Rows written without `created_at` (0) tell no age.
            oldest_created_ms: oldest.filter(|ms| *ms > 0),
            dead_rows,
        })
    }
}

/// What waits in an outbox ([`Outbox::backlog`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Rows in the outbox: unpublished, or published and not yet deleted.
    pub rows: u64,
    /// When the oldest of them was written, ms since the epoch, if known.
    pub oldest_created_ms: Option<i64>,
    /// Rows in the dead-letter table.
    pub dead_rows: u64,
}

impl Backlog {
    /// How long the oldest row has waited (zero when the outbox is empty).
    pub fn lag(&self) -> std::time::Duration {
        let waited = self
            .oldest_created_ms
            .map_or(0, |ms| crate::store::now_ms().saturating_sub(ms));
        std::time::Duration::from_millis(u64::try_from(waited).unwrap_or(0))
    }

    /// Sets the gauges `idemq_outbox_backlog_rows`, `idemq_outbox_lag_seconds`
    /// and `idemq_outbox_dead_rows` (label `table`) through the `metrics` facade.
    pub fn record(&self, table: &str) {
        let table = table.to_owned();
        metrics::gauge!("idemq_outbox_backlog_rows", "table" => table.clone())
            .set(self.rows as f64);
        metrics::gauge!("idemq_outbox_lag_seconds", "table" => table.clone())
            .set(self.lag().as_secs_f64());
        metrics::gauge!("idemq_outbox_dead_rows", "table" => table).set(self.dead_rows as f64);
    }
}
