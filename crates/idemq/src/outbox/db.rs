//! The rows the outbox reads, decoded from the generic
//! [`SqlDatabase::fetch`] of any database, so that [`Outbox`] and [`Relay`]
//! are written once.
//!
//! [`Outbox`]: super::Outbox
//! [`Relay`]: super::Relay

use super::DeadEvent;
pub use crate::store::sql::Bind;
use crate::store::sql::{Column, SqlDatabase};

/// A locked head: (seq, destination, key).
pub type KeyRow = (i64, String, String);

/// One outbox row as the relay reads it.
#[derive(Debug, Clone)]
pub struct RawRow {
    /// The relay order.
    pub seq: i64,
    /// The event id.
    pub id: String,
    /// The destination.
    pub aggregatetype: String,
    /// The key.
    pub aggregateid: String,
    /// The event type (may be empty).
    pub event_type: String,
    /// Headers as JSON text, if any.
    pub headers: Option<String>,
    /// The payload.
    pub payload: Vec<u8>,
    /// Failed publish attempts so far.
    pub attempts: i64,
}

/// Runs a query and returns its first column as integers.
pub async fn fetch_ints<DB: SqlDatabase>(
    conn: &mut DB::Connection,
    sql: &str,
    binds: &[Bind<'_>],
) -> Result<Vec<i64>, sqlx::Error> {
    DB::fetch(conn, sql, binds, &[Column::Int])
        .await?
        .iter()
        .map(|row| row.int(0))
        .collect()
}

/// Runs a query returning (seq, destination, key).
pub async fn fetch_keys<DB: SqlDatabase>(
    conn: &mut DB::Connection,
    sql: &str,
    binds: &[Bind<'_>],
) -> Result<Vec<KeyRow>, sqlx::Error> {
    DB::fetch(conn, sql, binds, &[Column::Int, Column::Text, Column::Text])
        .await?
        .iter()
        .map(|row| Ok((row.int(0)?, row.text(1)?, row.text(2)?)))
        .collect()
}

/// The shapes of `schema::ROW_COLUMNS`.
const ROW_SHAPE: [Column; 8] = [
    Column::Int,
    Column::Text,
    Column::Text,
    Column::Text,
    Column::Text,
    Column::OptText,
    Column::Bytes,
    Column::Int,
];

/// Runs a query returning rows in the order of `schema::ROW_COLUMNS`.
pub async fn fetch_rows<DB: SqlDatabase>(
    conn: &mut DB::Connection,
    sql: &str,
    binds: &[Bind<'_>],
) -> Result<Vec<RawRow>, sqlx::Error> {
    DB::fetch(conn, sql, binds, &ROW_SHAPE)
        .await?
        .iter()
        .map(|row| {
            Ok(RawRow {
                seq: row.int(0)?,
                id: row.text(1)?,
                aggregatetype: row.text(2)?,
                aggregateid: row.text(3)?,
                event_type: row.text(4)?,
                headers: row.opt_text(5)?,
                payload: row.bytes(6)?,
                attempts: row.int(7)?,
            })
        })
        .collect()
}

/// The shapes of `schema::DEAD_COLUMNS`.
const DEAD_SHAPE: [Column; 11] = [
    Column::Int,
    Column::Text,
    Column::Text,
    Column::Text,
    Column::Text,
    Column::OptText,
    Column::Bytes,
    Column::Int,
    Column::Int,
    Column::Text,
    Column::Int,
];

/// Runs a query returning dead rows in the order of `schema::DEAD_COLUMNS`.
pub async fn fetch_dead<DB: SqlDatabase>(
    conn: &mut DB::Connection,
    sql: &str,
    binds: &[Bind<'_>],
) -> Result<Vec<DeadEvent>, sqlx::Error> {
    DB::fetch(conn, sql, binds, &DEAD_SHAPE)
        .await?
        .iter()
        .map(|row| {
            Ok(DeadEvent {
                seq: row.int(0)?,
                id: row.text(1)?,
                destination: row.text(2)?,
                key: row.text(3)?,
                event_type: row.text(4)?,
                headers: row.opt_text(5)?,
                payload: row.bytes(6)?,
                created_at: row.int(7)?,
                attempts: row.int(8)?,
                reason: row.text(9)?,
                dead_at: row.int(10)?,
            })
        })
        .collect()
}
