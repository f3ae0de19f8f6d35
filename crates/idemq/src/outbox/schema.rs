//! The outbox table and every statement on it, per dialect.
//!
//! Statements are written with `?` placeholders; PostgreSQL's are renumbered
//! to `$1, $2, …`. Statements whose shape depends on a count (IN lists) are
//! rendered per call.

use crate::store::sql::Dialect;

/// The schema version the outbox records in `{prefix}schema_migrations`
/// (outside the inbox's own range, so the two never collide).
pub const OUTBOX_SCHEMA_VERSION: i64 = 1001;

/// The schema version of the dead-letter table `{prefix}outbox_dead`, a
/// later step than [`OUTBOX_SCHEMA_VERSION`]: migrating a database that has
/// only the outbox table adds it and leaves the outbox as it is.
pub const OUTBOX_DEAD_SCHEMA_VERSION: i64 = 1002;

/// The columns the relay reads, in select order.
pub(crate) const ROW_COLUMNS: &str =
    "seq, id, aggregatetype, aggregateid, type, headers, payload, attempts";

/// The columns of the dead-letter table as [`Statements::dead_rows`] reads
/// them, in select order.
pub(crate) const DEAD_COLUMNS: &str =
    "seq, id, aggregatetype, aggregateid, type, headers, payload, created_at, attempts, reason, dead_at";

/// The rendered statements of one outbox table.
#[derive(Debug, Clone)]
pub(crate) struct Statements {
    pub dialect: Dialect,
    pub table: String,
    /// The dead-letter table, `{table}_dead`.
    pub dead_table: String,
    /// Binds: id, aggregatetype, aggregateid, type, payload, headers, created_at.
    pub insert: String,
    /// Binds: available_at, last_error, seq.
    pub fail: String,
    /// Copies a row into the dead-letter table. Binds: attempts, reason,
    /// dead_at, seq.
    pub dead_letter: String,
    /// The oldest dead rows. Binds: limit. Returns [`DEAD_COLUMNS`].
    pub dead_rows: String,
    /// Returns the row count.
    pub count: String,
    /// Returns the `created_at` of the oldest row (the lowest `seq`).
    pub oldest: String,
    /// Returns the dead-letter table's row count.
    pub dead_count: String,
    /// The versioned steps: the table, its index and (PostgreSQL) the
    /// NOTIFY trigger; then the dead-letter table.
    pub migrations: Vec<(i64, Vec<String>)>,
}

impl Statements {
    pub fn new(dialect: Dialect, table: &str) -> Self {
        let insert = format!(
            "INSERT INTO {table} (id, aggregatetype, aggregateid, type, payload, headers, created_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?)"
        );
        let fail = format!(
            "UPDATE {table} SET attempts = attempts + 1, available_at = ?, last_error = ? WHERE seq = ?"
        );
        let dead_table = format!("{table}_dead");
        let dead_letter = format!(
            "INSERT INTO {dead_table} (seq, id, aggregatetype, aggregateid, type, payload, headers, \
             created_at, attempts, reason, dead_at) SELECT seq, id, aggregatetype, aggregateid, type, \
             payload, headers, created_at, ?, ?, ? FROM {table} WHERE seq = ?"
        );
        let mut statements = Self {
            dialect,
            table: table.to_owned(),
            dead_table: dead_table.clone(),
            insert: finish(dialect, insert),
            fail: finish(dialect, fail),
            dead_letter: finish(dialect, dead_letter),
            dead_rows: String::new(),
            count: format!("SELECT COUNT(*) FROM {table}"),
            oldest: format!("SELECT created_at FROM {table} ORDER BY seq LIMIT 1"),
            dead_count: format!("SELECT COUNT(*) FROM {dead_table}"),
            migrations: vec![
                (OUTBOX_SCHEMA_VERSION, create(dialect, table)),
                (
                    OUTBOX_DEAD_SCHEMA_VERSION,
                    create_dead(dialect, &dead_table),
                ),
            ],
        };
        let columns = statements.columns(DEAD_COLUMNS);
        statements.dead_rows = finish(
            dialect,
            format!("SELECT {columns} FROM {dead_table} ORDER BY dead_seq LIMIT ?"),
        );
        statements
    }

    /// `columns` (comma-separated) as the relay reads them: the key columns
    /// through [`text`](Self::text).
    fn columns(&self, columns: &str) -> String {
        columns
            .split(", ")
            .map(|c| match c {
                "aggregatetype" | "aggregateid" => self.text(c),
                other => other.to_owned(),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// A text column as the relay reads it: MySQL reports binary-collated
    /// columns as bytes, so they are converted back to text there.
    fn text(&self, column: &str) -> String {
        match self.dialect {
            Dialect::MySql => format!("CONVERT({column} USING utf8mb4)"),
            _ => column.to_owned(),
        }
    }

    /// The oldest row of every (destination, key) whose retry time has come,
    /// oldest first: the candidates for the key locks. A plain read.
    /// Binds: the `destinations` names, now, limit. Returns seq.
    pub fn heads(&self, destinations: usize) -> String {
        let table = &self.table;
        let filter = if destinations == 0 {
            String::new()
        } else {
            format!("WHERE aggregatetype IN ({}) ", list(destinations))
        };
        finish(
            self.dialect,
            format!(
                "SELECT o.seq FROM {table} o JOIN (SELECT MIN(seq) AS seq FROM {table} {filter}\
                 GROUP BY aggregatetype, aggregateid) h ON o.seq = h.seq \
                 WHERE o.available_at <= ? ORDER BY o.seq LIMIT ?"
            ),
        )
    }

    /// Locks the head rows that are still there and not locked by another
    /// relay (PostgreSQL, MariaDB: `FOR UPDATE SKIP LOCKED`; SQLite holds the
    /// database's write lock already). Binds: `n` seqs, now. Returns seq,
    /// aggregatetype, aggregateid.
    pub fn lock(&self, n: usize) -> String {
        let table = &self.table;
        let skip = match self.dialect {
            Dialect::Sqlite => "",
            _ => " FOR UPDATE SKIP LOCKED",
        };
        finish(
            self.dialect,
            format!(
                "SELECT seq, {}, {} FROM {table} WHERE seq IN ({}) AND available_at <= ? ORDER BY seq{skip}",
                self.text("aggregatetype"),
                self.text("aggregateid"),
                list(n)
            ),
        )
    }

    /// The rows of `n` locked (destination, key) pairs, oldest first.
    /// Binds: per pair destination, key; then limit. Returns [`ROW_COLUMNS`].
    pub fn rows(&self, n: usize) -> String {
        let table = &self.table;
        let pairs = vec!["(aggregatetype = ? AND aggregateid = ?)"; n].join(" OR ");
        let columns = self.columns(ROW_COLUMNS);
        finish(
            self.dialect,
            format!("SELECT {columns} FROM {table} WHERE {pairs} ORDER BY seq LIMIT ?"),
        )
    }

    /// Deletes `n` rows by seq. Binds: the seqs.
    pub fn delete(&self, n: usize) -> String {
        finish(
            self.dialect,
            format!("DELETE FROM {} WHERE seq IN ({})", self.table, list(n)),
        )
    }

    /// The NOTIFY channel of PostgreSQL relays: the table name.
    pub fn channel(&self) -> &str {
        &self.table
    }
}

fn list(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// Numbers the placeholders for PostgreSQL.
fn finish(dialect: Dialect, sql: String) -> String {
    dialect.placeholders(sql)
}

/// The table in the Debezium outbox event router's layout (`id`,
/// `aggregatetype`, `aggregateid`, `type`, `payload`) plus the relay's own
/// columns; see the module docs.
fn create(dialect: Dialect, table: &str) -> Vec<String> {
    match dialect {
        Dialect::Postgres => vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {table} (seq BIGSERIAL PRIMARY KEY, \
                 id VARCHAR(255) NOT NULL UNIQUE, aggregatetype VARCHAR(128) NOT NULL, \
                 aggregateid VARCHAR(512) NOT NULL, type VARCHAR(255) NOT NULL DEFAULT '', \
                 payload BYTEA NOT NULL, headers TEXT NULL, created_at BIGINT NOT NULL DEFAULT 0, \
                 attempts BIGINT NOT NULL DEFAULT 0, available_at BIGINT NOT NULL DEFAULT 0, \
                 last_error TEXT NULL)"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {table}_key ON {table} (aggregatetype, aggregateid, seq)"
            ),
            // Wake the relays at the commit of any insert, whoever wrote it.
            format!(
                "CREATE OR REPLACE FUNCTION {table}_notify() RETURNS trigger LANGUAGE plpgsql AS \
                 $body$ BEGIN PERFORM pg_notify('{table}', ''); RETURN NULL; END $body$"
            ),
            format!("DROP TRIGGER IF EXISTS {table}_notify ON {table}"),
            format!(
                "CREATE TRIGGER {table}_notify AFTER INSERT ON {table} \
                 FOR EACH STATEMENT EXECUTE FUNCTION {table}_notify()"
            ),
        ],
        Dialect::MySql => vec![format!(
            "CREATE TABLE IF NOT EXISTS {table} (seq BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, \
             id VARCHAR(255) NOT NULL, \
             aggregatetype VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, \
             aggregateid VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, \
             type VARCHAR(255) NOT NULL DEFAULT '', payload LONGBLOB NOT NULL, headers TEXT NULL, \
             created_at BIGINT NOT NULL DEFAULT 0, attempts BIGINT NOT NULL DEFAULT 0, \
             available_at BIGINT NOT NULL DEFAULT 0, last_error TEXT NULL, \
             UNIQUE KEY {table}_id (id), INDEX {table}_key (aggregatetype, aggregateid, seq)) \
             ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
        )],
        Dialect::Sqlite => vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {table} (seq INTEGER PRIMARY KEY AUTOINCREMENT, \
                 id TEXT NOT NULL UNIQUE, aggregatetype TEXT NOT NULL, aggregateid TEXT NOT NULL, \
                 type TEXT NOT NULL DEFAULT '', payload BLOB NOT NULL, headers TEXT NULL, \
                 created_at INTEGER NOT NULL DEFAULT 0, attempts INTEGER NOT NULL DEFAULT 0, \
                 available_at INTEGER NOT NULL DEFAULT 0, last_error TEXT NULL)"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {table}_key ON {table} (aggregatetype, aggregateid, seq)"
            ),
        ],
    }
}

/// The dead-letter table: the outbox row's columns (`seq` now a plain
/// column, `id` no longer unique: an id may die twice), how many publishes
/// failed, why the row was given up and when.
fn create_dead(dialect: Dialect, dead: &str) -> Vec<String> {
    match dialect {
        Dialect::Postgres => vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {dead} (dead_seq BIGSERIAL PRIMARY KEY, \
                 seq BIGINT NOT NULL, id VARCHAR(255) NOT NULL, aggregatetype VARCHAR(128) NOT NULL, \
                 aggregateid VARCHAR(512) NOT NULL, type VARCHAR(255) NOT NULL DEFAULT '', \
                 payload BYTEA NOT NULL, headers TEXT NULL, created_at BIGINT NOT NULL DEFAULT 0, \
                 attempts BIGINT NOT NULL DEFAULT 0, reason TEXT NOT NULL, dead_at BIGINT NOT NULL)"
            ),
            format!("CREATE INDEX IF NOT EXISTS {dead}_id ON {dead} (id)"),
        ],
        Dialect::MySql => vec![format!(
            "CREATE TABLE IF NOT EXISTS {dead} (dead_seq BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, \
             seq BIGINT NOT NULL, id VARCHAR(255) NOT NULL, \
             aggregatetype VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, \
             aggregateid VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, \
             type VARCHAR(255) NOT NULL DEFAULT '', payload LONGBLOB NOT NULL, headers TEXT NULL, \
             created_at BIGINT NOT NULL DEFAULT 0, attempts BIGINT NOT NULL DEFAULT 0, \
             reason TEXT NOT NULL, dead_at BIGINT NOT NULL, INDEX {dead}_id (id)) \
             ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
        )],
        Dialect::Sqlite => vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {dead} (dead_seq INTEGER PRIMARY KEY AUTOINCREMENT, \
                 seq INTEGER NOT NULL, id TEXT NOT NULL, aggregatetype TEXT NOT NULL, \
                 aggregateid TEXT NOT NULL, type TEXT NOT NULL DEFAULT '', payload BLOB NOT NULL, \
                 headers TEXT NULL, created_at INTEGER NOT NULL DEFAULT 0, \
                 attempts INTEGER NOT NULL DEFAULT 0, reason TEXT NOT NULL, dead_at INTEGER NOT NULL)"
            ),
            format!("CREATE INDEX IF NOT EXISTS {dead}_id ON {dead} (id)"),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_statements_are_numbered() {
        let s = Statements::new(Dialect::Postgres, "x_outbox");
        assert!(
            s.insert.contains("($1, $2, $3, $4, $5, $6, $7)"),
            "{}",
            s.insert
        );
        assert!(s.heads(2).contains("IN ($1, $2)"));
        assert!(s.heads(2).ends_with("<= $3 ORDER BY o.seq LIMIT $4"));
        assert!(s.lock(2).ends_with("FOR UPDATE SKIP LOCKED"));
        assert!(s
            .rows(2)
            .ends_with("aggregateid = $4) ORDER BY seq LIMIT $5"));
        let m = Statements::new(Dialect::MySql, "x_outbox");
        assert!(m.lock(1).contains("CONVERT(aggregateid USING utf8mb4)"));
        let l = Statements::new(Dialect::Sqlite, "x_outbox");
        assert!(!l.lock(1).contains("FOR UPDATE"));
        assert!(!l.heads(0).contains("WHERE aggregatetype"));
        assert!(s
            .dead_letter
            .ends_with("$1, $2, $3 FROM x_outbox WHERE seq = $4"));
        assert!(s
            .dead_rows
            .ends_with("FROM x_outbox_dead ORDER BY dead_seq LIMIT $1"));
        assert!(m.dead_rows.contains("CONVERT(aggregatetype USING utf8mb4)"));
        let versions: Vec<i64> = s.migrations.iter().map(|(v, _)| *v).collect();
        assert_eq!(
            versions,
            [OUTBOX_SCHEMA_VERSION, OUTBOX_DEAD_SCHEMA_VERSION]
        );
    }
}
