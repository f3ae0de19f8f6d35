//! Claim cost with 0 / small / large key counts already in the PostgreSQL
//! inbox, and prune rows/s.
//!
//! Three table sets are loaded at once (0 keys, the small and the large
//! preload) and measured in rotating order every round, so that drift hits
//! all three. The preload goes into the real inbox table with the real key
//! shape (`pay-` + 32 random hex digits, the consumer `bench`, a 64-hex
//! fingerprint) by `INSERT … SELECT generate_series`, with the primary key
//! and the `created_at` index rebuilt after the load (a sorted build is far
//! faster than 10 M random inserts; the resulting indexes are the same).
//! Preloaded rows are two days old; rows added by a measurement are deleted
//! after it, so each set keeps its size.

use std::time::{Duration, Instant};

use idemq::store::sql::postgres::PostgresStore;
use idemq::store::sql::SqlOptions;
use idemq::store::{now_ms, Claim, ClaimRequest, Store};

use crate::report::{keys, median, paired, Row};
use crate::sql::{postgres, prefix, CONSUMER};
use crate::{payment_key, progress, rate, Config};

/// Claim cost at the large preload ≤ this many times the cost at 0 keys.
pub const CLAIM_GROWTH_TARGET: f64 = 1.5;
/// Prune rows/s on PostgreSQL.
pub const PRUNE_TARGET: f64 = 100_000.0;

const DAY_MS: i64 = 86_400_000;

struct Set {
    keys: u64,
    store: PostgresStore,
    ledger: String,
}

async fn preload(store: &PostgresStore, n: u64) -> anyhow::Result<()> {
    if n == 0 {
        return Ok(());
    }
    let t = store.tables();
    let inbox = &t.inbox;
    let old = now_ms() - 2 * DAY_MS;
    let salt = uuid::Uuid::new_v4().simple().to_string();
    let mut conn = store.pool().acquire().await?;
    let steps = [
        "SET maintenance_work_mem = '1GB'".to_owned(),
        format!("ALTER TABLE {inbox} DROP CONSTRAINT {inbox}_pkey"),
        format!("DROP INDEX IF EXISTS {inbox}_created_at"),
        format!(
            "INSERT INTO {inbox} (consumer, msg_key, fingerprint, created_at) \
             SELECT '{CONSUMER}', 'pay-' || md5(g::text || '{salt}'), \
                    md5(g::text) || md5(g::text || 'f'), {old} - (g % 100000) \
             FROM generate_series(1, {n}) AS g"
        ),
        format!("ALTER TABLE {inbox} ADD PRIMARY KEY (consumer, msg_key)"),
        format!("CREATE INDEX {inbox}_created_at ON {inbox} (created_at)"),
        format!("VACUUM ANALYZE {inbox}"),
        "RESET maintenance_work_mem".to_owned(),
    ];
    for step in steps {
        sqlx::query(&step).execute(&mut *conn).await?;
    }
    Ok(())
}

/// Sequential claims of fresh keys, each rolled back: µs per claim.
pub(crate) async fn claim_cost(store: &PostgresStore, n: u64) -> anyhow::Result<f64> {
    let keys: Vec<String> = (0..n).map(|_| payment_key()).collect();
    let fingerprint = "f".repeat(64);
    let started = Instant::now();
    for key in &keys {
        let req = ClaimRequest {
            consumer: CONSUMER,
            key,
            fingerprint: &fingerprint,
            lease: Duration::from_secs(30),
        };
        match store.claim(&req).await? {
            Claim::New(tx) => store.rollback(tx).await?,
            other => anyhow::bail!("a fresh key was not new: {other:?}"),
        }
    }
    Ok(started.elapsed().as_secs_f64() * 1e6 / n as f64)
}

/// Deletes what measurements added (rows newer than the preload) and the ledger.
async fn reset(set: &Set, since_ms: i64) -> anyhow::Result<()> {
    let inbox = &set.store.tables().inbox;
    sqlx::query(&format!("DELETE FROM {inbox} WHERE created_at >= $1"))
        .bind(since_ms)
        .execute(set.store.pool())
        .await?;
    sqlx::query(&format!("TRUNCATE TABLE {}", set.ledger))
        .execute(set.store.pool())
        .await?;
    Ok(())
}

/// The claim-cost and prune rows.
pub async fn rows(cfg: &Config) -> anyhow::Result<Vec<Row>> {
    let section = "PostgreSQL claim cost";
    let sizes = [0, cfg.preload_small, cfg.preload_large];
    let mut sets = Vec::new();
    let result = async {
        for (i, &n) in sizes.iter().enumerate() {
            let store = PostgresStore::connect_with(
                &cfg.postgres,
                SqlOptions::default()
                    .table_prefix(prefix(&format!("k{i}")))
                    .max_connections(cfg.pool),
            )
            .await?;
            let ledger = postgres::setup(&store).await?;
            postgres::clear(&store, &ledger).await?;
            let started = Instant::now();
            progress!("claim cost: preloading {} keys", keys(n));
            preload(&store, n).await?;
            if n > 0 {
                progress!(
                    "claim cost: preloaded {} keys in {:.1} s",
                    keys(n),
                    started.elapsed().as_secs_f64()
                );
            }
            sets.push(Set {
                keys: n,
                store,
                ledger,
            });
        }
        let mut claim_us = vec![Vec::new(); sets.len()];
        let mut per_message = vec![Vec::new(); sets.len()];
        for (i, set) in sets.iter().enumerate() {
            // Warm-up: connections, plans, the index's upper levels.
            let since = now_ms();
            claim_cost(&set.store, cfg.claims.min(200)).await?;
            reset(set, since).await?;
            progress!("claim cost: warmed set {i}");
        }
        for r in 0..cfg.rounds {
            for k in 0..sets.len() {
                let i = (k + r) % sets.len();
                let set = &sets[i];
                let since = now_ms();
                let us = claim_cost(&set.store, cfg.claims).await?;
                let consumer = postgres::consumer(&set.store, &set.ledger, cfg.concurrency)?;
                let mps = postgres::idemq(&consumer, cfg.messages).await?;
                reset(set, since).await?;
                progress!(
                    "claim cost round {}: {} keys: {us:.1} µs/claim, {mps:.0} msg/s",
                    r + 1,
                    keys(set.keys)
                );
                claim_us[i].push(us);
                per_message[i].push(mps);
            }
        }
        let mut rows = Vec::new();
        let large = sets.len() - 1;
        for (i, set) in sets.iter().enumerate() {
            let us = median(&claim_us[i]);
            let growth = paired(&claim_us[i], &claim_us[0]);
            let mut row = Row::new(
                section,
                format!(
                    "claim + rollback of a new key, {} keys stored, sequential",
                    keys(set.keys)
                ),
                cfg.claims,
                us,
                "µs/claim",
            );
            if i > 0 {
                row = row.ratio_of(growth, "cost at 0");
            }
            if i == large {
                let stated = if set.keys >= 10_000_000 {
                    String::new()
                } else {
                    " (stated for 10 M: run --full)".into()
                };
                row = row.target(
                    format!("≤ {CLAIM_GROWTH_TARGET}× cost at 0 keys{stated}"),
                    growth <= CLAIM_GROWTH_TARGET,
                );
            }
            rows.push(row);
        }
        for (i, set) in sets.iter().enumerate() {
            let mut row = Row::new(
                section,
                format!("idemq per-message, {} keys stored", keys(set.keys)),
                cfg.messages,
                median(&per_message[i]),
                "msg/s",
            );
            if i > 0 {
                row = row.ratio_of(paired(&per_message[i], &per_message[0]), "at 0 keys");
            }
            rows.push(row);
        }

        // Prune every preloaded row of the large set.
        let set = &sets[large];
        progress!("prune: {} rows", keys(set.keys));
        let started = Instant::now();
        let deleted = idemq::retention::prune_before(
            &set.store,
            now_ms() - DAY_MS,
            cfg.prune_batch,
            Duration::ZERO,
        )
        .await?;
        let elapsed = started.elapsed();
        anyhow::ensure!(deleted == set.keys, "pruned {deleted} of {} rows", set.keys);
        let rows_per_s = rate(deleted, elapsed);
        progress!("prune: {rows_per_s:.0} rows/s");
        rows.push(
            Row::new(
                section,
                format!("prune (batches of {}, no pause)", cfg.prune_batch),
                deleted,
                rows_per_s,
                "rows/s",
            )
            .target("≥ 100 000 rows/s", rows_per_s >= PRUNE_TARGET),
        );
        Ok(rows)
    }
    .await;
    for set in &sets {
        postgres::teardown(&set.store, &set.ledger).await;
        set.store.pool().close().await;
    }
    result
}
