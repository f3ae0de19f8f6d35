//! All SQL of the SQL stores, per dialect, in one place.
//!
//! Statements are written once with `?` placeholders; PostgreSQL's are
//! renumbered to `$1, $2, …`. Every statement binds its parameters in the
//! same order on every dialect, so the store code is shared.

use crate::error::ConfigError;

/// The SQL dialects idemq speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// PostgreSQL.
    Postgres,
    /// MySQL 8 and MariaDB 10.5+.
    MySql,
    /// SQLite 3.35+.
    Sqlite,
}

impl Dialect {
    /// `sql`, written with `?` placeholders, in this dialect's placeholder
    /// syntax (PostgreSQL's `$1, $2, …`). The statements of idemq contain no
    /// `?` inside literals.
    pub fn placeholders(self, sql: String) -> String {
        match self {
            Dialect::Postgres => number_placeholders(&sql),
            Dialect::MySql | Dialect::Sqlite => sql,
        }
    }
}

/// Table names, derived from a validated prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tables {
    /// The prefix, e.g. `idemq_`.
    pub prefix: String,
    /// `{prefix}inbox`: one row per processed (consumer, key).
    pub inbox: String,
    /// `{prefix}attempts`: failed attempts, written outside business transactions.
    pub attempts: String,
    /// `{prefix}dead_letters`.
    pub dead_letters: String,
    /// `{prefix}schema_migrations`.
    pub migrations: String,
    /// `{prefix}offsets`: the offset watermark per (consumer, topic, partition).
    pub offsets: String,
    /// `{prefix}effects`: the effect journal, one row per (consumer, key, step).
    pub effects: String,
}

impl Tables {
    /// Table names with `prefix`, which must be a plain SQL identifier
    /// (letters, digits, `_`; not starting with a digit; at most 40 bytes).
    pub fn new(prefix: &str) -> Result<Self, ConfigError> {
        let valid = !prefix.is_empty()
            && prefix.len() <= 40
            && prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !prefix.starts_with(|c: char| c.is_ascii_digit());
        if !valid {
            return Err(ConfigError::TablePrefix(prefix.to_owned()));
        }
        Ok(Self {
            prefix: prefix.to_owned(),
            inbox: format!("{prefix}inbox"),
            attempts: format!("{prefix}attempts"),
            dead_letters: format!("{prefix}dead_letters"),
            migrations: format!("{prefix}schema_migrations"),
            offsets: format!("{prefix}offsets"),
            effects: format!("{prefix}effects"),
        })
    }

    /// The tables a partitioned inbox adds beside [`inbox`](Self::inbox)
    /// and [`effects`](Self::effects): its layout row, MariaDB's guard rows,
    /// PostgreSQL's sealed ranges and their key filters.
    ///
    /// ```
    /// let tables = idemq::store::sql::Tables::new("app_").unwrap();
    /// assert_eq!(tables.partition_tables()[0], "app_inbox_layout");
    /// ```
    pub fn partition_tables(&self) -> [String; 4] {
        let inbox = &self.inbox;
        [
            format!("{inbox}_layout"),
            format!("{inbox}_guard"),
            format!("{inbox}_sealed"),
            format!("{inbox}_filter"),
        ]
    }

    /// The functions a partitioned inbox adds: the claim, the journal
    /// write and the trigger function of sealed partitions (drop them after
    /// the tables).
    pub fn partition_functions(&self) -> [String; 3] {
        [
            format!("{}_claim", self.inbox),
            format!("{}_put", self.effects),
            format!("{}_refuse", self.inbox),
        ]
    }
}

impl Default for Tables {
    fn default() -> Self {
        Self {
            prefix: "idemq_".into(),
            inbox: "idemq_inbox".into(),
            attempts: "idemq_attempts".into(),
            dead_letters: "idemq_dead_letters".into(),
            migrations: "idemq_schema_migrations".into(),
            offsets: "idemq_offsets".into(),
            effects: "idemq_effects".into(),
        }
    }
}

/// The statements of one store, rendered for one dialect and table set.
#[derive(Debug, Clone)]
pub struct Queries {
    /// Binds: consumer, key, fingerprint, created_at. Affects 1 row if new, 0 if the key exists.
    pub claim: String,
    /// Binds: consumer, key. Returns fingerprint, result_json, created_at (locking read where needed).
    pub fetch: String,
    /// Binds: consumer, key. Plain read of the same columns.
    pub inspect_inbox: String,
    /// Binds: result_json, consumer, key.
    pub set_result: String,
    /// Binds: consumer, key.
    pub clear_attempts: String,
    /// Binds: consumer, key, last_error, first_failed_at, last_failed_at.
    pub attempt_upsert: String,
    /// Binds: consumer, key. Returns attempts, last_error, first_failed_at, last_failed_at.
    pub attempt_select: String,
    /// Binds the 15 dead-letter columns in [`DEAD_LETTER_COLUMNS`] order
    /// (without id), then `letter_id`; a letter whose `letter_id` is stored
    /// already is not written again.
    pub dead_letter_insert: String,
    /// Binds: cutoff_ms, limit.
    pub prune_inbox: String,
    /// Binds: cutoff_ms, limit.
    pub prune_attempts: String,
    /// Returns consumer, count, min(created_at), max(created_at).
    pub stats_inbox: String,
    /// Returns consumer, count.
    pub stats_dead_letters: String,
    /// Returns consumer, count of keys with failed attempts and not processed.
    pub stats_failing: String,
    /// Binds: after_id, limit.
    pub dead_letters_all: String,
    /// Binds: consumer, after_id, limit.
    pub dead_letters_of_consumer: String,
    /// Binds: consumer, key.
    pub dead_letters_of_key: String,
    /// Binds: id.
    pub dead_letter_delete: String,
    /// Creates the migrations table.
    pub create_migrations_table: String,
    /// Returns the applied versions.
    pub applied_versions: String,
    /// Binds: version, applied_at.
    pub record_version: String,
    /// Serialises concurrent migrators (run first, inside the migration transaction).
    pub migrate_lock: Option<String>,
    /// Releases [`migrate_lock`](Self::migrate_lock) where it outlives the transaction.
    pub migrate_unlock: Option<String>,
    /// Versioned schema steps, in order.
    pub migrations: Vec<(i64, Vec<String>)>,
    /// Binds: consumer, topic, partition, updated_at. Creates the watermark row at 0 if absent.
    pub offset_ensure: String,
    /// Binds: consumer, topic, partition. Returns next_offset (locking read where needed).
    pub offset_lock: String,
    /// Binds: consumer, topic, partition. Returns next_offset (plain read).
    pub offset_select: String,
    /// Binds: next_offset, next_offset, updated_at, consumer, topic, partition. Never moves back.
    pub offset_advance: String,
    /// Binds: consumer, key, step. Returns result_json.
    pub effect_get: String,
    /// Binds: consumer, key, step, result_json, created_at. Keeps the first row.
    pub effect_put: String,
    /// Binds: consumer, key. Every step of the key with its result, by step.
    pub effect_steps: String,
    /// Binds: cutoff_ms, limit.
    pub prune_effects: String,
    /// Creates the effect journal table (migration v3; on SQLite run in the
    /// journal's own database file instead, see [`sqlite`](super::sqlite)).
    pub effects_schema: Vec<String>,
}

/// Statements whose shape depends on the batch size (batch mode).
#[derive(Debug, Clone)]
pub struct BatchQueries {
    dialect: Dialect,
    inbox: String,
    attempts: String,
}

impl BatchQueries {
    /// For `dialect` over `tables`.
    pub fn new(dialect: Dialect, tables: &Tables) -> Self {
        Self {
            dialect,
            inbox: tables.inbox.clone(),
            attempts: tables.attempts.clone(),
        }
    }

    fn finish(&self, sql: String) -> String {
        self.dialect.placeholders(sql)
    }

    fn key_list(n: usize) -> String {
        vec!["?"; n].join(", ")
    }

    /// Claims `n` keys in one statement and returns the keys it inserted.
    /// Binds per row: consumer, key, fingerprint, created_at.
    pub fn claim(&self, n: usize) -> String {
        let rows = vec!["(?, ?, ?, ?)"; n].join(", ");
        let inbox = &self.inbox;
        self.finish(match self.dialect {
            // MariaDB 10.5+; ignored rows are not returned.
            Dialect::MySql => format!(
                "INSERT IGNORE INTO {inbox} (consumer, msg_key, fingerprint, created_at) VALUES {rows} \
                 RETURNING CONVERT(msg_key USING utf8mb4) AS msg_key"
            ),
            _ => format!(
                "INSERT INTO {inbox} (consumer, msg_key, fingerprint, created_at) VALUES {rows} \
                 ON CONFLICT DO NOTHING RETURNING msg_key"
            ),
        })
    }

    /// Reads the rows of `n` keys of one consumer. Binds: consumer, then the
    /// keys. Returns msg_key, fingerprint, result_json, created_at.
    pub fn fetch(&self, n: usize) -> String {
        let (inbox, keys) = (&self.inbox, Self::key_list(n));
        self.finish(match self.dialect {
            Dialect::MySql => format!(
                "SELECT CONVERT(msg_key USING utf8mb4) AS msg_key, fingerprint, result_json, created_at \
                 FROM {inbox} WHERE consumer = ? AND msg_key IN ({keys}) LOCK IN SHARE MODE"
            ),
            _ => format!(
                "SELECT msg_key, fingerprint, result_json, created_at FROM {inbox} \
                 WHERE consumer = ? AND msg_key IN ({keys})"
            ),
        })
    }

    /// Whether [`set_results`](Self::set_results) is used: not on
    /// MySQL/MariaDB, where the `IN` list's range locks made concurrent
    /// batches deadlock (measured: a third of a 600-message run retried);
    /// there each result is its own `UPDATE` by primary key.
    pub fn merges_results(&self) -> bool {
        !matches!(self.dialect, Dialect::MySql)
    }

    /// Stores the results of `n` keys of one consumer in one statement;
    /// bind [`results_binds`](Self::results_binds).
    pub fn set_results(&self, n: usize) -> String {
        let inbox = &self.inbox;
        self.finish(match self.dialect {
            // Joined from a VALUES list on the whole primary key, so that
            // no estimate of the consumer's row count is needed: with
            // `consumer = ? AND msg_key IN (…)` a fresh, not yet analysed
            // inbox was planned as a scan of all the consumer's rows, per
            // batch. Run after `pin_result_plan`.
            Dialect::Postgres => {
                let rows = vec!["(?, ?, ?)"; n].join(", ");
                format!(
                    "UPDATE {inbox} AS i SET result_json = v.r FROM (VALUES {rows}) AS v(c, k, r) \
                     WHERE i.consumer = v.c AND i.msg_key = v.k"
                )
            }
            _ => {
                let keys = Self::key_list(n);
                let cases = vec!["WHEN ? THEN ?"; n].join(" ");
                format!(
                    "UPDATE {inbox} SET result_json = CASE msg_key {cases} END \
                     WHERE consumer = ? AND msg_key IN ({keys})"
                )
            }
        })
    }

    /// Run in the batch's transaction before [`set_results`](Self::set_results)
    /// (PostgreSQL): until the inbox holds about 50 000 rows, or while it has
    /// no statistics yet, the planner joins the `VALUES` list by hashing a
    /// sequential scan of the whole inbox (measured: 4.3 ms per 100 keys at
    /// 20 000 rows, 9.6 ms at 50 000, against 0.7–1.2 ms by index). These
    /// settings leave it the primary-key probes only. `SET LOCAL`: they end
    /// with the transaction, and nothing of the handler's runs after them.
    pub fn pin_result_plan(&self) -> Option<&'static str> {
        match self.dialect {
            Dialect::Postgres => Some(
                "SELECT set_config('enable_hashjoin', 'off', true), \
                 set_config('enable_mergejoin', 'off', true), \
                 set_config('enable_seqscan', 'off', true), \
                 set_config('enable_bitmapscan', 'off', true)",
            ),
            _ => None,
        }
    }

    /// The binds of [`set_results`](Self::set_results) for `results`
    /// (key, result text) of `consumer`.
    pub fn results_binds<'a>(
        &self,
        consumer: &'a str,
        results: &'a [(&'a str, String)],
    ) -> Vec<super::Bind<'a>> {
        use super::Bind;
        match self.dialect {
            Dialect::Postgres => results
                .iter()
                .flat_map(|(key, text)| [Bind::Text(consumer), Bind::Text(key), Bind::Text(text)])
                .collect(),
            _ => results
                .iter()
                .flat_map(|(key, text)| [Bind::Text(key), Bind::Text(text)])
                .chain(std::iter::once(Bind::Text(consumer)))
                .chain(results.iter().map(|(key, _)| Bind::Text(key)))
                .collect(),
        }
    }

    /// Deletes the failed attempts of `n` keys. Binds: consumer, then the keys.
    pub fn clear_attempts(&self, n: usize) -> String {
        let (attempts, keys) = (&self.attempts, Self::key_list(n));
        self.finish(format!(
            "DELETE FROM {attempts} WHERE consumer = ? AND msg_key IN ({keys})"
        ))
    }

    /// Gives up one claim. Binds: consumer, key.
    pub fn unclaim(&self) -> String {
        let inbox = &self.inbox;
        self.finish(format!(
            "DELETE FROM {inbox} WHERE consumer = ? AND msg_key = ?"
        ))
    }
}

/// Dead-letter columns after `id`, in insert and select order.
pub const DEAD_LETTER_COLUMNS: [&str; 15] = [
    "consumer",
    "msg_key",
    "reason",
    "error",
    "message_id",
    "transport_key",
    "headers",
    "payload",
    "source",
    "topic",
    "source_partition",
    "source_offset",
    "delivery_count",
    "attempts",
    "created_at",
];

impl Queries {
    /// Renders every statement for `dialect` over `tables`.
    pub fn new(dialect: Dialect, tables: &Tables) -> Self {
        let Tables {
            inbox,
            attempts,
            dead_letters: dead,
            migrations,
            ..
        } = tables;
        // MySQL reports binary-collated columns as binary strings; convert them
        // back to text where they are read.
        let text = |col: &str| match dialect {
            Dialect::MySql => format!("CONVERT({col} USING utf8mb4) AS {col}"),
            _ => col.to_owned(),
        };
        let dl_cols = std::iter::once("id".to_owned())
            .chain(DEAD_LETTER_COLUMNS.iter().map(|c| match *c {
                "consumer" | "msg_key" => text(c),
                other => other.to_owned(),
            }))
            .collect::<Vec<_>>()
            .join(", ");
        let dl_placeholders = vec!["?"; DEAD_LETTER_COLUMNS.len() + 1].join(", ");

        let claim = match dialect {
            Dialect::MySql => format!(
                "INSERT IGNORE INTO {inbox} (consumer, msg_key, fingerprint, created_at) VALUES (?, ?, ?, ?)"
            ),
            _ => format!(
                "INSERT INTO {inbox} (consumer, msg_key, fingerprint, created_at) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING"
            ),
        };
        let inspect_inbox = format!(
            "SELECT fingerprint, result_json, created_at FROM {inbox} WHERE consumer = ? AND msg_key = ?"
        );
        let fetch = match dialect {
            // A locking read sees the latest committed row even under REPEATABLE READ.
            Dialect::MySql => format!("{inspect_inbox} LOCK IN SHARE MODE"),
            _ => inspect_inbox.clone(),
        };
        let attempt_upsert = match dialect {
            Dialect::MySql => format!(
                "INSERT INTO {attempts} (consumer, msg_key, attempts, last_error, first_failed_at, last_failed_at) \
                 VALUES (?, ?, 1, ?, ?, ?) ON DUPLICATE KEY UPDATE attempts = attempts + 1, \
                 last_error = VALUES(last_error), last_failed_at = VALUES(last_failed_at)"
            ),
            _ => format!(
                "INSERT INTO {attempts} (consumer, msg_key, attempts, last_error, first_failed_at, last_failed_at) \
                 VALUES (?, ?, 1, ?, ?, ?) ON CONFLICT (consumer, msg_key) DO UPDATE SET \
                 attempts = {attempts}.attempts + 1, last_error = excluded.last_error, \
                 last_failed_at = excluded.last_failed_at"
            ),
        };
        let prune = |table: &str, column: &str| {
            match dialect {
            Dialect::Postgres => format!(
                "DELETE FROM {table} WHERE ctid IN (SELECT ctid FROM {table} WHERE {column} < ? LIMIT ?)"
            ),
            Dialect::MySql => {
                format!("DELETE FROM {table} WHERE {column} < ? ORDER BY {column} LIMIT ?")
            }
            Dialect::Sqlite => format!(
                "DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} WHERE {column} < ? LIMIT ?)"
            ),
        }
        };
        let consumer_col = text("consumer");

        let q = Queries {
            claim,
            fetch,
            inspect_inbox,
            set_result: format!(
                "UPDATE {inbox} SET result_json = ? WHERE consumer = ? AND msg_key = ?"
            ),
            clear_attempts: format!("DELETE FROM {attempts} WHERE consumer = ? AND msg_key = ?"),
            attempt_upsert,
            attempt_select: format!(
                "SELECT attempts, last_error, first_failed_at, last_failed_at FROM {attempts} \
                 WHERE consumer = ? AND msg_key = ?"
            ),
            dead_letter_insert: match dialect {
                Dialect::MySql => format!(
                    "INSERT IGNORE INTO {dead} ({}, letter_id) VALUES ({dl_placeholders})",
                    DEAD_LETTER_COLUMNS.join(", ")
                ),
                _ => format!(
                    "INSERT INTO {dead} ({}, letter_id) VALUES ({dl_placeholders}) \
                     ON CONFLICT DO NOTHING",
                    DEAD_LETTER_COLUMNS.join(", ")
                ),
            },
            prune_inbox: prune(inbox, "created_at"),
            prune_attempts: prune(attempts, "last_failed_at"),
            stats_inbox: format!(
                "SELECT {consumer_col}, COUNT(*), MIN(created_at), MAX(created_at) FROM {inbox} GROUP BY consumer"
            ),
            stats_dead_letters: format!(
                "SELECT {consumer_col}, COUNT(*) FROM {dead} GROUP BY consumer"
            ),
            // Keys still failing: the attempts of a key processed since (its
            // failures counted by another process) are history, not failing.
            stats_failing: format!(
                "SELECT {consumer_col}, COUNT(*) FROM {attempts} a WHERE NOT EXISTS \
                 (SELECT 1 FROM {inbox} i WHERE i.consumer = a.consumer AND i.msg_key = a.msg_key) \
                 GROUP BY consumer"
            ),
            dead_letters_all: format!(
                "SELECT {dl_cols} FROM {dead} WHERE id > ? ORDER BY id LIMIT ?"
            ),
            dead_letters_of_consumer: format!(
                "SELECT {dl_cols} FROM {dead} WHERE consumer = ? AND id > ? ORDER BY id LIMIT ?"
            ),
            dead_letters_of_key: format!(
                "SELECT {dl_cols} FROM {dead} WHERE consumer = ? AND msg_key = ? ORDER BY id"
            ),
            dead_letter_delete: format!("DELETE FROM {dead} WHERE id = ?"),
            create_migrations_table: format!(
                "CREATE TABLE IF NOT EXISTS {migrations} (version BIGINT PRIMARY KEY, applied_at BIGINT NOT NULL)"
            ),
            applied_versions: format!("SELECT version FROM {migrations} ORDER BY version"),
            record_version: format!(
                "INSERT INTO {migrations} (version, applied_at) VALUES (?, ?)"
            ),
            migrate_lock: match dialect {
                Dialect::Postgres => Some("SELECT pg_advisory_xact_lock(7243219087)".to_owned()),
                Dialect::MySql => Some(format!("SELECT GET_LOCK('{migrations}', 60)")),
                Dialect::Sqlite => None,
            },
            migrate_unlock: match dialect {
                Dialect::MySql => Some(format!("SELECT RELEASE_LOCK('{migrations}')")),
                _ => None,
            },
            migrations: schema_versions(dialect, tables, None),
            offset_ensure: match dialect {
                Dialect::MySql => format!(
                    "INSERT IGNORE INTO {offsets} (consumer, topic, part, next_offset, updated_at) \
                     VALUES (?, ?, ?, 0, ?)",
                    offsets = tables.offsets
                ),
                _ => format!(
                    "INSERT INTO {offsets} (consumer, topic, part, next_offset, updated_at) \
                     VALUES (?, ?, ?, 0, ?) ON CONFLICT DO NOTHING",
                    offsets = tables.offsets
                ),
            },
            offset_lock: match dialect {
                Dialect::Sqlite => format!(
                    "SELECT next_offset FROM {} WHERE consumer = ? AND topic = ? AND part = ?",
                    tables.offsets
                ),
                _ => format!(
                    "SELECT next_offset FROM {} WHERE consumer = ? AND topic = ? AND part = ? FOR UPDATE",
                    tables.offsets
                ),
            },
            offset_select: format!(
                "SELECT next_offset FROM {} WHERE consumer = ? AND topic = ? AND part = ?",
                tables.offsets
            ),
            offset_advance: format!(
                "UPDATE {} SET next_offset = CASE WHEN next_offset > ? THEN next_offset ELSE ? END, \
                 updated_at = ? WHERE consumer = ? AND topic = ? AND part = ?",
                tables.offsets
            ),
            effect_get: format!(
                "SELECT result_json FROM {} WHERE consumer = ? AND msg_key = ? AND step = ?",
                tables.effects
            ),
            effect_steps: format!(
                "SELECT {}, result_json FROM {} WHERE consumer = ? AND msg_key = ? ORDER BY step",
                text("step"),
                tables.effects
            ),
            effect_put: match dialect {
                Dialect::MySql => format!(
                    "INSERT IGNORE INTO {} (consumer, msg_key, step, result_json, created_at) \
                     VALUES (?, ?, ?, ?, ?)",
                    tables.effects
                ),
                _ => format!(
                    "INSERT INTO {} (consumer, msg_key, step, result_json, created_at) \
                     VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    tables.effects
                ),
            },
            prune_effects: prune(&tables.effects, "created_at"),
            effects_schema: schema_v3(dialect, tables),
        };
        q.in_dialect(dialect)
    }

    /// Rewrites the `?` placeholders into `dialect`'s.
    fn in_dialect(mut self, dialect: Dialect) -> Self {
        for sql in [
            &mut self.claim,
            &mut self.fetch,
            &mut self.inspect_inbox,
            &mut self.set_result,
            &mut self.clear_attempts,
            &mut self.attempt_upsert,
            &mut self.attempt_select,
            &mut self.dead_letter_insert,
            &mut self.prune_inbox,
            &mut self.prune_attempts,
            &mut self.dead_letters_all,
            &mut self.dead_letters_of_consumer,
            &mut self.dead_letters_of_key,
            &mut self.dead_letter_delete,
            &mut self.record_version,
            &mut self.offset_ensure,
            &mut self.offset_lock,
            &mut self.offset_select,
            &mut self.offset_advance,
            &mut self.effect_get,
            &mut self.effect_put,
            &mut self.effect_steps,
            &mut self.prune_effects,
        ] {
            *sql = dialect.placeholders(std::mem::take(sql));
        }
        self
    }
}

/// Replaces each `?` with `$1`, `$2`, … in order. The statements above
/// contain no `?` inside literals.
fn number_placeholders(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 8);
    let mut n = 0;
    for c in sql.chars() {
        if c == '?' {
            n += 1;
            out.push('$');
            out.push_str(&n.to_string());
        } else {
            out.push(c);
        }
    }
    out
}

/// The versioned schema steps, in order. `partitioned` is the
/// `(interval_ms, ahead)` of a time-partitioned inbox (PostgreSQL, MariaDB): version
/// 1 then creates the inbox, and version 3 the effect journal, in that
/// layout (see [`partitions`](super::partitions)).
pub(super) fn schema_versions(
    dialect: Dialect,
    tables: &Tables,
    partitioned: Option<(i64, i64)>,
) -> Vec<(i64, Vec<String>)> {
    vec![
        (1, schema_v1(dialect, tables, partitioned)),
        (2, schema_v2(dialect, tables)),
        // SQLite has one writer per file and the handler's transaction
        // holds it: its journal lives in a file of its own (created
        // when first used), so v3 has nothing to do in the main file.
        (
            3,
            match (dialect, partitioned) {
                (Dialect::Sqlite, _) => Vec::new(),
                (_, Some((interval_ms, _))) => {
                    super::partitions::PartitionSql::new(dialect, tables)
                        .journal_schema(interval_ms)
                }
                _ => schema_v3(dialect, tables),
            },
        ),
        (4, schema_v4(dialect, tables)),
    ]
}

/// Version 4: one dead letter per dead-lettered message. `letter_id` is
/// [`DeadLetter::letter_id`](crate::store::DeadLetter::letter_id); rows
/// written before v4 have none (NULLs never collide in a unique index).
fn schema_v4(dialect: Dialect, tables: &Tables) -> Vec<String> {
    let dead = &tables.dead_letters;
    let index = format!("{dead}_letter_id");
    match dialect {
        // One statement: MySQL commits DDL at once, so a half-applied
        // version cannot be left behind.
        Dialect::MySql => vec![format!(
            "ALTER TABLE {dead} ADD COLUMN letter_id VARCHAR(64) NULL, \
             ADD UNIQUE INDEX {index} (letter_id)"
        )],
        _ => vec![
            format!("ALTER TABLE {dead} ADD COLUMN letter_id VARCHAR(64) NULL"),
            format!("CREATE UNIQUE INDEX IF NOT EXISTS {index} ON {dead} (letter_id)"),
        ],
    }
}

/// Version 3: the effect journal. Step names are at most 128 bytes, which
/// keeps MySQL's primary key (128 + 512 + 128 characters of utf8mb4) within
/// InnoDB's 3072-byte limit.
fn schema_v3(dialect: Dialect, tables: &Tables) -> Vec<String> {
    let effects = &tables.effects;
    let (consumer, key, step, opts) = match dialect {
        Dialect::MySql => (
            "consumer VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL",
            "msg_key VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL",
            "step VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL",
            " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4",
        ),
        Dialect::Postgres => (
            "consumer VARCHAR(128) NOT NULL",
            "msg_key VARCHAR(512) NOT NULL",
            "step VARCHAR(128) NOT NULL",
            "",
        ),
        Dialect::Sqlite => (
            "consumer TEXT NOT NULL",
            "msg_key TEXT NOT NULL",
            "step TEXT NOT NULL",
            "",
        ),
    };
    let index = format!("{effects}_created_at");
    let inline_index = match dialect {
        Dialect::MySql => format!(", INDEX {index} (created_at)"),
        _ => String::new(),
    };
    let mut steps = vec![format!(
        "CREATE TABLE IF NOT EXISTS {effects} ({consumer}, {key}, {step}, result_json TEXT NOT NULL, \
         created_at BIGINT NOT NULL, PRIMARY KEY (consumer, msg_key, step){inline_index}){opts}"
    )];
    if dialect != Dialect::MySql {
        steps.push(format!(
            "CREATE INDEX IF NOT EXISTS {index} ON {effects} (created_at)"
        ));
    }
    steps
}

/// Version 2: the offset watermarks of the offset-watermark mode.
fn schema_v2(dialect: Dialect, tables: &Tables) -> Vec<String> {
    let offsets = &tables.offsets;
    let (consumer, topic, opts) = match dialect {
        Dialect::MySql => (
            "consumer VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL",
            "topic VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL",
            " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4",
        ),
        Dialect::Postgres => (
            "consumer VARCHAR(128) NOT NULL",
            "topic VARCHAR(255) NOT NULL",
            "",
        ),
        Dialect::Sqlite => ("consumer TEXT NOT NULL", "topic TEXT NOT NULL", ""),
    };
    vec![format!(
        "CREATE TABLE IF NOT EXISTS {offsets} ({consumer}, {topic}, part INTEGER NOT NULL, \
         next_offset BIGINT NOT NULL, updated_at BIGINT NOT NULL, \
         PRIMARY KEY (consumer, topic, part)){opts}"
    )]
}

fn schema_v1(dialect: Dialect, tables: &Tables, partitioned: Option<(i64, i64)>) -> Vec<String> {
    let Tables {
        inbox,
        attempts,
        dead_letters: dead,
        ..
    } = tables;
    // Keys compare byte-for-byte: a case-insensitive collation would make
    // "Order-1" a duplicate of "order-1".
    let (id_col, consumer, key, key_null, bytes, table_opts) = match dialect {
        Dialect::Postgres => (
            "id BIGSERIAL PRIMARY KEY",
            "consumer VARCHAR(128) NOT NULL",
            "msg_key VARCHAR(512) NOT NULL",
            "msg_key VARCHAR(512) NULL",
            "BYTEA",
            "",
        ),
        Dialect::MySql => (
            "id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY",
            "consumer VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL",
            "msg_key VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL",
            "msg_key VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL",
            "LONGBLOB",
            " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4",
        ),
        Dialect::Sqlite => (
            "id INTEGER PRIMARY KEY AUTOINCREMENT",
            "consumer TEXT NOT NULL",
            "msg_key TEXT NOT NULL",
            "msg_key TEXT NULL",
            "BLOB",
            "",
        ),
    };
    // MySQL has no CREATE INDEX IF NOT EXISTS (MariaDB does): declare indexes inline there.
    let inline_index = |name: &str, cols: &str| match dialect {
        Dialect::MySql => format!(", INDEX {name} ({cols})"),
        _ => String::new(),
    };
    let separate_index = |table: &str, name: &str, cols: &str| match dialect {
        Dialect::MySql => None,
        _ => Some(format!(
            "CREATE INDEX IF NOT EXISTS {name} ON {table} ({cols})"
        )),
    };
    // A partitioned inbox needs no index on created_at: retention drops
    // partitions.
    let (mut steps, inbox_index) = match partitioned {
        Some((interval_ms, ahead)) => (
            super::partitions::PartitionSql::new(dialect, tables).schema(interval_ms, ahead),
            None,
        ),
        None => (
            vec![format!(
                "CREATE TABLE IF NOT EXISTS {inbox} ({consumer}, {key}, fingerprint VARCHAR(64) NOT NULL, \
                 result_json TEXT NULL, created_at BIGINT NOT NULL, PRIMARY KEY (consumer, msg_key){}){table_opts}",
                inline_index(&format!("{inbox}_created_at"), "created_at")
            )],
            separate_index(inbox, &format!("{inbox}_created_at"), "created_at"),
        ),
    };
    steps.extend([
        format!(
            "CREATE TABLE IF NOT EXISTS {attempts} ({consumer}, {key}, attempts BIGINT NOT NULL, \
             last_error TEXT NOT NULL, first_failed_at BIGINT NOT NULL, last_failed_at BIGINT NOT NULL, \
             PRIMARY KEY (consumer, msg_key){}){table_opts}",
            inline_index(&format!("{attempts}_last_failed_at"), "last_failed_at")
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {dead} ({id_col}, {consumer}, {key_null}, reason VARCHAR(64) NOT NULL, \
             error TEXT NOT NULL, message_id TEXT NULL, transport_key TEXT NULL, headers TEXT NOT NULL, \
             payload {bytes} NOT NULL, source VARCHAR(64) NOT NULL, topic TEXT NULL, source_partition BIGINT NULL, \
             source_offset BIGINT NULL, delivery_count BIGINT NOT NULL, attempts BIGINT NOT NULL, \
             created_at BIGINT NOT NULL{}){table_opts}",
            inline_index(&format!("{dead}_consumer_key"), "consumer, msg_key")
        ),
    ]);
    steps.extend(
        [
            inbox_index,
            separate_index(
                attempts,
                &format!("{attempts}_last_failed_at"),
                "last_failed_at",
            ),
            separate_index(dead, &format!("{dead}_consumer_key"), "consumer, msg_key"),
        ]
        .into_iter()
        .flatten(),
    );
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_validated() {
        assert!(Tables::new("idemq_").is_ok());
        assert!(Tables::new("app2_inbox_").is_ok());
        for bad in ["", "1x", "a-b", "a;drop table x;--", "a b", &"x".repeat(41)] {
            assert!(Tables::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn postgres_placeholders_are_numbered() {
        let q = Queries::new(Dialect::Postgres, &Tables::default());
        assert!(q.claim.contains("VALUES ($1, $2, $3, $4)"), "{}", q.claim);
        assert!(!q.dead_letter_insert.contains('?'));
        let m = Queries::new(Dialect::MySql, &Tables::default());
        assert!(m.claim.starts_with("INSERT IGNORE"));
    }
}
