//! The time-partitioned PostgreSQL inbox (`SqlOptions::partitioned_inbox`,
//! daily partitions): claim cost with N keys spread over ten past (sealed)
//! days beside an empty partitioned inbox, the time sealing a day takes,
//! the time retention takes to drop one day, and the inbox's table + index size over a simulated week (three
//! days kept) beside the one-table layout pruned row by row.
//!
//! The preload goes into one table per past day by `INSERT … SELECT
//! generate_series` (real key shape, as in the claim-cost rows), gets its
//! primary key and a range check, and is attached as a partition (the check
//! spares the scan; the index is adopted, not rebuilt). The simulated week
//! writes its rows through the real claim statements, with the simulated
//! day's timestamps: the partitioned layout's claim function, and the
//! one-table layout's `INSERT … ON CONFLICT DO NOTHING`, followed by a
//! `VACUUM` per day (what autovacuum would have done in a day).

use std::time::{Duration, Instant};

use idemq::store::sql::postgres::PostgresStore;
use idemq::store::sql::{InboxPartitions, SqlOptions};
use idemq::store::{now_ms, StoreAdmin};

use crate::claim::{claim_cost, CLAIM_GROWTH_TARGET};
use crate::report::{keys, median, paired, Row};
use crate::sql::{prefix, CONSUMER};
use crate::{progress, Config};

const DAY_MS: i64 = 86_400_000;
/// Days the preloaded keys are spread over.
const PRELOAD_DAYS: i64 = 10;
/// Dropping a day of 10 M keys takes at most this long.
const DROP_DAY_TARGET: Duration = Duration::from_secs(1);
/// Days kept by the simulated week's retention.
const KEPT_DAYS: i64 = 3;
const SECTION: &str = "PostgreSQL partitioned inbox";
/// Claims per statement of the simulated week.
const CHUNK: u64 = 1_000;

async fn store(cfg: &Config, tag: &str, partitioned: bool) -> anyhow::Result<PostgresStore> {
    let mut options = SqlOptions::default()
        .table_prefix(prefix(tag))
        .max_connections(cfg.pool);
    if partitioned {
        options = options.partitioned_inbox(InboxPartitions::daily());
    }
    let store = PostgresStore::connect_with(&cfg.postgres, options).await?;
    store.migrate().await?;
    Ok(store)
}

async fn drop_store(store: &PostgresStore) {
    let t = store.tables();
    let drop_tables = format!(
        "DROP TABLE IF EXISTS {}, {}, {}, {}, {}, {}, {}",
        t.inbox,
        t.attempts,
        t.dead_letters,
        t.migrations,
        t.offsets,
        t.effects,
        t.partition_tables().join(", ")
    );
    let drop_functions = t
        .partition_functions()
        .map(|f| format!("DROP FUNCTION IF EXISTS {f}"));
    for sql in std::iter::once(drop_tables).chain(drop_functions) {
        let _ = sqlx::query(&sql).execute(store.pool()).await;
    }
    store.pool().close().await;
}

/// Runs `steps` in order on one connection.
async fn run_steps(store: &PostgresStore, steps: &[String]) -> anyhow::Result<()> {
    let mut conn = store.pool().acquire().await?;
    for step in steps {
        sqlx::query(step).execute(&mut *conn).await?;
    }
    Ok(())
}

/// A partition of `[start, start + DAY)` holding `rows` generated rows
/// (`rows` 0: empty), attached to the inbox.
async fn attach_day(store: &PostgresStore, start: i64, rows: u64) -> anyhow::Result<()> {
    let inbox = &store.tables().inbox;
    let end = start + DAY_MS;
    let name = format!("{inbox}_p{start}");
    let salt = uuid::Uuid::new_v4().simple().to_string();
    let mut steps = vec![
        "SET maintenance_work_mem = '1GB'".to_owned(),
        format!("CREATE TABLE {name} (LIKE {inbox} INCLUDING DEFAULTS)"),
    ];
    if rows > 0 {
        steps.push(format!(
            "INSERT INTO {name} (consumer, msg_key, fingerprint, created_at) \
             SELECT '{CONSUMER}', 'pay-' || md5(g::text || '{salt}'), \
                    md5(g::text) || md5(g::text || 'f'), {start} + (g % {DAY_MS}) \
             FROM generate_series(1, {rows}) AS g"
        ));
    }
    steps.extend([
        format!("ALTER TABLE {name} ADD PRIMARY KEY (consumer, msg_key, created_at)"),
        format!(
            "ALTER TABLE {name} ADD CONSTRAINT {name}_range \
             CHECK (created_at >= {start} AND created_at < {end})"
        ),
        format!("ALTER TABLE {inbox} ATTACH PARTITION {name} FOR VALUES FROM ({start}) TO ({end})"),
        format!("ALTER TABLE {name} DROP CONSTRAINT {name}_range"),
        format!("VACUUM ANALYZE {name}"),
        "RESET maintenance_work_mem".to_owned(),
    ]);
    run_steps(store, &steps).await
}

/// The first millisecond of the day `days` before today's.
fn day_start(days: i64) -> i64 {
    (now_ms().div_euclid(DAY_MS) - days) * DAY_MS
}

/// Claim cost at 0 and at `cfg.partitioned_keys` keys (both over the same
/// ten past days' partitions, plus today's and those ahead), beside a fresh
/// inbox (today's and those ahead only), and the drop of the oldest day.
async fn claim_and_drop_rows(cfg: &Config) -> anyhow::Result<Vec<Row>> {
    let fresh = store(cfg, "pn", true).await?;
    let empty = store(cfg, "pe", true).await?;
    let full = store(cfg, "pf", true).await?;
    let result = async {
        let per_day = cfg.partitioned_keys / PRELOAD_DAYS as u64;
        let oldest = day_start(PRELOAD_DAYS);
        let started = Instant::now();
        for d in 0..PRELOAD_DAYS {
            let start = oldest + d * DAY_MS;
            attach_day(&empty, start, 0).await?;
            attach_day(&full, start, per_day).await?;
            progress!(
                "partitioned: preloaded day {}/{PRELOAD_DAYS} ({} keys) at {:.0} s",
                d + 1,
                keys(per_day),
                started.elapsed().as_secs_f64()
            );
        }
        // Seal the past days (what the pruner does once a day has ended):
        // claims then probe a past day's partition only when its key filter
        // holds the key's bits.
        idemq::retention::prune_before(&empty, 0, cfg.prune_batch, Duration::ZERO).await?;
        let started = Instant::now();
        idemq::retention::prune_before(&full, 0, cfg.prune_batch, Duration::ZERO).await?;
        let seal_ms = started.elapsed().as_secs_f64() * 1e3 / PRELOAD_DAYS as f64;
        progress!("partitioned: sealed {PRELOAD_DAYS} days in {:.1} s", seal_ms * PRELOAD_DAYS as f64 / 1e3);
        let filter_bytes: Option<i64> =
            sqlx::query_scalar("SELECT pg_total_relation_size(to_regclass($1))::bigint")
                .bind(format!("{}_filter", full.tables().inbox))
                .fetch_one(full.pool())
                .await?;
        let filter_mib = mib(filter_bytes.unwrap_or(0));
        let sets = [&fresh, &empty, &full];
        for set in sets {
            claim_cost(set, cfg.claims.min(200)).await?;
        }
        let mut us = [Vec::new(), Vec::new(), Vec::new()];
        for r in 0..cfg.rounds {
            for k in 0..sets.len() {
                let i = (k + r) % sets.len();
                let cost = claim_cost(sets[i], cfg.claims).await?;
                progress!("partitioned round {}: set {i}: {cost:.1} µs/claim", r + 1);
                us[i].push(cost);
            }
        }
        let partitions = PRELOAD_DAYS + 1 + i64::from(InboxPartitions::daily().ahead);
        let growth = paired(&us[2], &us[1]);
        let mut rows = vec![
            Row::new(
                SECTION,
                format!(
                    "claim + rollback of a new key, fresh inbox ({} partitions), sequential",
                    1 + InboxPartitions::daily().ahead
                ),
                cfg.claims,
                median(&us[0]),
                "µs/claim",
            ),
            Row::new(
                SECTION,
                format!("claim + rollback of a new key, 0 keys in {partitions} partitions, sequential"),
                cfg.claims,
                median(&us[1]),
                "µs/claim",
            )
            .ratio_of(paired(&us[1], &us[0]), "fresh inbox"),
            Row::new(
                SECTION,
                format!(
                    "claim + rollback of a new key, {} keys in {partitions} partitions ({PRELOAD_DAYS} days of {}), sequential",
                    keys(cfg.partitioned_keys),
                    keys(per_day)
                ),
                cfg.claims,
                median(&us[2]),
                "µs/claim",
            )
            .ratio_of(growth, "0 keys in as many partitions")
            .target(
                format!(
                    "≤ {CLAIM_GROWTH_TARGET}× cost at 0 keys{}",
                    if cfg.partitioned_keys >= 100_000_000 {
                        ""
                    } else {
                        " (stated for 100 M: run --full)"
                    }
                ),
                growth <= CLAIM_GROWTH_TARGET,
            ),
        ];
        rows.push(Row::new(
            SECTION,
            format!("sealing one past day ({} keys): trigger, key filter build", keys(per_day)),
            per_day,
            seal_ms,
            "ms",
        ));
        rows.push(Row::new(
            SECTION,
            format!(
                "key filters of the {PRELOAD_DAYS} sealed days ({} keys), table + index",
                keys(cfg.partitioned_keys)
            ),
            cfg.partitioned_keys,
            filter_mib,
            "MiB",
        ));
        // Retention: the oldest day goes, whole.
        let cutoff = oldest + DAY_MS;
        let started = Instant::now();
        let dropped =
            idemq::retention::prune_before(&full, cutoff, cfg.prune_batch, Duration::ZERO).await?;
        let took = started.elapsed();
        progress!("partitioned: dropped {dropped} rows in {took:?}");
        anyhow::ensure!(
            dropped.abs_diff(per_day) <= per_day / 50,
            "dropped {dropped} rows, the day held {per_day}"
        );
        rows.push(
            Row::new(
                SECTION,
                format!("retention drops one day ({} keys)", keys(per_day)),
                dropped,
                took.as_secs_f64() * 1e3,
                "ms",
            )
            .target(
                format!(
                    "≤ {} ms for a day of 10 M keys{}",
                    DROP_DAY_TARGET.as_millis(),
                    if per_day >= 10_000_000 {
                        ""
                    } else {
                        " (stated for 10 M: run --full)"
                    }
                ),
                took <= DROP_DAY_TARGET,
            ),
        );
        Ok(rows)
    }
    .await;
    for set in [&fresh, &empty, &full] {
        drop_store(set).await;
    }
    result
}

/// Table + index bytes of the inbox, its partitions included.
async fn inbox_bytes(store: &PostgresStore) -> anyhow::Result<i64> {
    let inbox = &store.tables().inbox;
    let bytes: Option<i64> = sqlx::query_scalar(
        "SELECT SUM(pg_total_relation_size(c.oid))::bigint FROM pg_class c \
         WHERE c.oid = to_regclass($1) \
            OR c.oid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = to_regclass($1))",
    )
    .bind(inbox)
    .fetch_one(store.pool())
    .await?;
    Ok(bytes.unwrap_or(0))
}

/// Seven simulated days of `rows_per_day` claims each, `KEPT_DAYS` kept;
/// the inbox's size after day `KEPT_DAYS` and after day 7.
async fn simulate_week(
    store: &PostgresStore,
    partitioned: bool,
    rows_per_day: u64,
    batch: u32,
) -> anyhow::Result<(i64, i64)> {
    let inbox = &store.tables().inbox;
    // The simulated days lie ahead of today: retention seals partitions
    // that have ended in real time, which would seal days not yet written.
    let first = day_start(-(1 + i64::from(InboxPartitions::daily().ahead)));
    if partitioned {
        for d in 0..7 {
            attach_day(store, first + d * DAY_MS, 0).await?;
        }
    }
    let mut after_window = 0;
    for d in 0..7 {
        let start = first + d * DAY_MS;
        let salt = uuid::Uuid::new_v4().simple().to_string();
        // In statements of CHUNK claims: each claim of the partitioned
        // layout holds an advisory lock until its transaction ends.
        let mut from = 1;
        while from <= rows_per_day {
            let to = (from + CHUNK - 1).min(rows_per_day);
            let keys = format!(
                "SELECT 'pay-' || md5(g::text || '{salt}') AS k, md5(g::text) || md5(g::text || 'f') AS f, \
                 {start} + (g - 1) * ({DAY_MS} / {rows_per_day}) AS t FROM generate_series({from}, {to}) AS g"
            );
            let claim = if partitioned {
                format!("SELECT COUNT(*) FROM ({keys}) s WHERE {inbox}_claim('{CONSUMER}', s.k, s.f, s.t)")
            } else {
                format!(
                    "INSERT INTO {inbox} (consumer, msg_key, fingerprint, created_at) \
                     SELECT '{CONSUMER}', s.k, s.f, s.t FROM ({keys}) s ON CONFLICT DO NOTHING"
                )
            };
            sqlx::query(&claim).execute(store.pool()).await?;
            from = to + 1;
        }
        let cutoff = start + DAY_MS - KEPT_DAYS * DAY_MS;
        idemq::retention::prune_before(store, cutoff, batch, Duration::ZERO).await?;
        if !partitioned {
            sqlx::query(&format!("VACUUM {inbox}"))
                .execute(store.pool())
                .await?;
        }
        if d + 1 == KEPT_DAYS {
            after_window = inbox_bytes(store).await?;
        }
    }
    Ok((after_window, inbox_bytes(store).await?))
}

fn mib(bytes: i64) -> f64 {
    bytes as f64 / 1_048_576.0
}

/// The simulated-week rows: size after the window filled and after a week,
/// for both layouts.
async fn week_rows(cfg: &Config) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (tag, partitioned, label) in [
        ("pw", true, "partitioned, retention drops partitions"),
        (
            "ow",
            false,
            "one table, retention deletes rows (+ VACUUM daily)",
        ),
    ] {
        let store = store(cfg, tag, partitioned).await?;
        let outcome =
            simulate_week(&store, partitioned, cfg.week_rows_per_day, cfg.prune_batch).await;
        drop_store(&store).await;
        let (window, week) = outcome?;
        progress!(
            "partitioned: week of {label}: {:.1} MiB after day {KEPT_DAYS}, {:.1} MiB after day 7",
            mib(window),
            mib(week)
        );
        let growth = week as f64 / window.max(1) as f64;
        let mut row = Row::new(
            SECTION,
            format!(
                "inbox size after 7 simulated days ({} claims/day, {KEPT_DAYS} days kept), {label}; {:.1} MiB after day {KEPT_DAYS}",
                keys(cfg.week_rows_per_day),
                mib(window)
            ),
            cfg.week_rows_per_day * 7,
            mib(week),
            "MiB",
        )
        .ratio_of(growth, "size after day 3");
        if partitioned {
            row = row.target("no bloat: ≤ 1.05× the size after day 3", growth <= 1.05);
        }
        rows.push(row);
    }
    Ok(rows)
}

/// The partitioned-inbox rows.
pub async fn rows(cfg: &Config) -> anyhow::Result<Vec<Row>> {
    let mut rows = claim_and_drop_rows(cfg).await?;
    rows.extend(week_rows(cfg).await?);
    Ok(rows)
}
