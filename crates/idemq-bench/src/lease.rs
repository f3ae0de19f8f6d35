//! The lease stores: Redis beside raw `SET NX PX` on the same single
//! connection, and the in-memory store beside a bare queue drain.
//!
//! The idemq rows run the real engine (`Consumer::run` over a `MemoryQueue`)
//! with a handler that does nothing, so they measure the store's
//! claim + commit and the engine around it. The Redis store's claim is one
//! Lua script (GET, SET NX PX, HINCRBY, HSETNX, HGET, PEXPIRE); its commit
//! is a second script (GET, SET PX, HDEL, DEL) plus three index round trips
//! (ZADD/PEXPIRE/ZREMRANGEBYSCORE pipelined, SREM, SADD): five round trips
//! per message against one for the raw `SET NX PX`.
//!
//! The batch row runs `Consumer::run_batched` over the Redis store: one Lua
//! script claims a whole batch, one script completes it and updates the
//! consumer's indexes, and one heartbeat task serves the batch.

use std::time::{Duration, Instant};

use idemq::engine::BatchOptions;
use idemq::store::memory::MemoryStore;
use idemq::store::redis::{RedisLease, RedisOptions, RedisStore};
use idemq::{handler_fn, Consumer, KeySpec, OutcomeKind};
use redis::aio::ConnectionManager;

use crate::report::{median, paired, Row};
use crate::{a_first, drain, progress, queue_of, rate, Config};

/// idemq batch mode ≥ this share of raw pipelined `SET NX` (issue 16).
pub const REDIS_TARGET: f64 = 0.25;

/// idemq per message, many in flight, ≥ this share of raw pipelined `SET
/// NX` (issue 16).
pub const REDIS_PER_MESSAGE_TARGET: f64 = 0.10;

const TTL_MS: u64 = 600_000;

fn raw_keys(prefix: &str, n: u64) -> Vec<String> {
    (0..n)
        .map(|_| {
            format!(
                "{prefix}:{{bench/pay-{}}}:rec",
                uuid::Uuid::new_v4().simple()
            )
        })
        .collect()
}

fn set_nx(key: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("SET");
    cmd.arg(key)
        .arg(format!("in-flight:{}", uuid::Uuid::nil().simple()))
        .arg("NX")
        .arg("PX")
        .arg(TTL_MS);
    cmd
}

/// One `SET NX PX` per round trip, `tasks` tasks sharing the connection.
async fn raw_tasks(
    conn: &ConnectionManager,
    prefix: &str,
    n: u64,
    tasks: usize,
) -> anyhow::Result<f64> {
    let keys = raw_keys(prefix, n);
    let per_task = keys.len().div_ceil(tasks);
    let chunks: Vec<Vec<redis::Cmd>> = keys
        .chunks(per_task)
        .map(|c| c.iter().map(|k| set_nx(k)).collect())
        .collect();
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for cmds in chunks {
        let mut conn = conn.clone();
        set.spawn(async move {
            let mut ok = 0u64;
            for cmd in cmds {
                let r: Option<String> = cmd.query_async(&mut conn).await?;
                ok += u64::from(r.is_some());
            }
            Ok::<u64, redis::RedisError>(ok)
        });
    }
    let mut ok = 0;
    while let Some(r) = set.join_next().await {
        ok += r??;
    }
    let elapsed = started.elapsed();
    anyhow::ensure!(ok == n, "raw SET NX stored {ok} of {n} fresh keys");
    Ok(rate(n, elapsed))
}

/// `SET NX PX` in pipelines of `depth` commands, one pipeline per round trip.
async fn raw_pipelined(
    conn: &ConnectionManager,
    prefix: &str,
    n: u64,
    depth: usize,
) -> anyhow::Result<f64> {
    let keys = raw_keys(prefix, n);
    let pipes: Vec<redis::Pipeline> = keys
        .chunks(depth)
        .map(|chunk| {
            let mut pipe = redis::pipe();
            for k in chunk {
                pipe.add_command(set_nx(k));
            }
            pipe
        })
        .collect();
    let mut conn = conn.clone();
    let started = Instant::now();
    let mut ok = 0u64;
    for pipe in pipes {
        let r: Vec<Option<String>> = pipe.query_async(&mut conn).await?;
        ok += r.iter().filter(|v| v.is_some()).count() as u64;
    }
    let elapsed = started.elapsed();
    anyhow::ensure!(
        ok == n,
        "raw pipelined SET NX stored {ok} of {n} fresh keys"
    );
    Ok(rate(n, elapsed))
}

async fn idemq_redis(store: &RedisStore, n: u64, concurrency: usize) -> anyhow::Result<f64> {
    let consumer = Consumer::builder("bench", store.clone())
        .key(KeySpec::json("/payment_id"))
        .concurrency(concurrency)
        .lease(Duration::from_secs(30))
        .handler(handler_fn(|_ctx, _lease: &mut RedisLease| {
            Box::pin(async { Ok(None) })
        }))
        .build()?;
    let queue = queue_of(n);
    let started = Instant::now();
    let summary = consumer.run(queue.source()).await?;
    let elapsed = started.elapsed();
    anyhow::ensure!(
        summary.count(OutcomeKind::Processed) == n,
        "idemq Redis processed {summary}, expected {n}"
    );
    Ok(rate(n, elapsed))
}

/// idemq batch mode over the Redis store: batches of `size`, `concurrency`
/// batches in flight.
async fn idemq_redis_batched(
    store: &RedisStore,
    n: u64,
    size: usize,
    concurrency: usize,
) -> anyhow::Result<f64> {
    let consumer = Consumer::builder("bench", store.clone())
        .key(KeySpec::json("/payment_id"))
        .concurrency(concurrency)
        .lease(Duration::from_secs(30))
        .handler(handler_fn(|_ctx, _lease: &mut RedisLease| {
            Box::pin(async { Ok(None) })
        }))
        .build()?;
    let queue = queue_of(n);
    let options = BatchOptions::new(size, Duration::from_millis(20));
    let started = Instant::now();
    let summary = consumer.run_batched(queue.source(), options).await?;
    let elapsed = started.elapsed();
    anyhow::ensure!(
        summary.count(OutcomeKind::Processed) == n,
        "idemq Redis batch processed {summary}, expected {n}"
    );
    Ok(rate(n, elapsed))
}

/// Deletes every key under `prefix:` (SCAN and UNLINK).
pub(crate) async fn cleanup(conn: &ConnectionManager, prefix: &str) -> anyhow::Result<()> {
    let mut conn = conn.clone();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}:*"))
            .arg("COUNT")
            .arg(5000)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            let _: i64 = redis::cmd("UNLINK")
                .arg(&keys)
                .query_async(&mut conn)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// The Redis rows and the version line.
pub async fn redis_rows(cfg: &Config) -> anyhow::Result<(Vec<Row>, (String, String))> {
    let section = "Redis lease store";
    progress!("Redis: idemq store vs raw SET NX");
    let prefix = format!("idemq-bench-{}", std::process::id());
    let raw = redis::Client::open(cfg.redis.as_str())?
        .get_connection_manager()
        .await?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut raw.clone())
        .await?;
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("unknown")
        .trim()
        .to_owned();
    let persistence: String = redis::cmd("INFO")
        .arg("persistence")
        .query_async(&mut raw.clone())
        .await?;
    let aof = persistence
        .lines()
        .find_map(|l| l.strip_prefix("aof_enabled:"))
        .map_or("?", |v| if v.trim() == "1" { "on" } else { "off" })
        .to_owned();
    let store = RedisStore::connect_with(
        &cfg.redis,
        RedisOptions::default()
            .prefix(prefix.clone())
            .retention(Duration::from_millis(TTL_MS)),
    )
    .await?;
    let (seq_n, many_n, depth) = (
        cfg.redis_sequential_messages,
        cfg.redis_messages,
        cfg.in_flight,
    );
    let batches = cfg.concurrency;
    let result = async {
        // Warm-up: connections and the script cache.
        raw_tasks(&raw, &prefix, 200, 1).await?;
        idemq_redis(&store, 200, 1).await?;
        idemq_redis_batched(&store, 1000, depth, batches).await?;
        let mut m: [Vec<f64>; 6] = Default::default();
        for r in 0..cfg.rounds {
            for which in crate::round_order(r, 6) {
                let v = match which {
                    0 => raw_tasks(&raw, &prefix, seq_n, 1).await?,
                    1 => idemq_redis(&store, seq_n, 1).await?,
                    2 => raw_tasks(&raw, &prefix, many_n, depth).await?,
                    3 => raw_pipelined(&raw, &prefix, many_n, depth).await?,
                    4 => idemq_redis(&store, many_n, depth).await?,
                    _ => idemq_redis_batched(&store, many_n, depth, batches).await?,
                };
                m[which].push(v);
            }
            progress!(
                "Redis round {}: raw seq {:.0}, idemq seq {:.0}, raw {depth} tasks {:.0}, raw pipelined {:.0}, idemq {depth} in flight {:.0}, idemq batches of {depth} ({batches} in flight) {:.0}",
                r + 1,
                m[0][r], m[1][r], m[2][r], m[3][r], m[4][r], m[5][r]
            );
        }
        Ok::<_, anyhow::Error>(m)
    }
    .await;
    let cleaned = cleanup(&raw, &prefix).await;
    let m = result?;
    cleaned?;
    let seq_ratio = paired(&m[1], &m[0]);
    let tasks_ratio = paired(&m[4], &m[2]);
    let pipe_ratio = paired(&m[4], &m[3]);
    let batch_ratio = paired(&m[5], &m[3]);
    let batch_vs_many = paired(&m[5], &m[4]);
    let [raw_seq, idemq_seq, raw_many, raw_pipe, idemq_many, idemq_batched] = m.map(|v| median(&v));
    let rows = vec![
        Row::new(section, "raw `SET NX PX`, 1 in flight (one command per round trip)", seq_n, raw_seq, "msg/s"),
        Row::new(section, "idemq RedisStore claim + commit, concurrency 1", seq_n, idemq_seq, "msg/s")
            .ratio_of(seq_ratio, "raw, 1 in flight"),
        Row::new(
            section,
            format!("raw `SET NX PX`, {depth} tasks on the one connection (one command per task round trip)"),
            many_n,
            raw_many,
            "msg/s",
        ),
        Row::new(
            section,
            format!("raw `SET NX PX`, pipelined {depth} per round trip"),
            many_n,
            raw_pipe,
            "msg/s",
        ),
        Row::new(
            section,
            format!(
                "idemq RedisStore claim + commit, {depth} in flight ({:.2}× raw {depth} tasks)",
                tasks_ratio
            ),
            many_n,
            idemq_many,
            "msg/s",
        )
        .ratio_of(pipe_ratio, "raw pipelined")
        .target(
            format!(
                "≥ {:.0} % of raw pipelined",
                REDIS_PER_MESSAGE_TARGET * 100.0
            ),
            pipe_ratio >= REDIS_PER_MESSAGE_TARGET,
        ),
        Row::new(
            section,
            format!(
                "idemq RedisStore batch mode, batches of {depth}, {batches} in flight (one claim pipeline and one completion script per batch; {:.2}× per-message {depth} in flight)",
                batch_vs_many
            ),
            many_n,
            idemq_batched,
            "msg/s",
        )
        .ratio_of(batch_ratio, "raw pipelined")
        .target(
            format!("≥ {:.0} % of raw pipelined", REDIS_TARGET * 100.0),
            batch_ratio >= REDIS_TARGET,
        ),
    ];
    Ok((
        rows,
        (
            "Redis".into(),
            format!("{version} (appendonly {aof}; one multiplexed connection per side)"),
        ),
    ))
}

/// The Redis Cluster rows (`--only cluster`, the cluster of
/// `scripts/redis-cluster.sh`): idemq's Redis store on the cluster's three
/// masters beside the same store on the single Redis, per message and in
/// batch mode, rounds alternating.
pub async fn cluster_rows(cfg: &Config) -> anyhow::Result<Vec<Row>> {
    let section = "Redis Cluster (3 masters, 3 replicas) vs one Redis";
    progress!("Redis Cluster: idemq store on 3 masters vs one Redis");
    let prefix = format!("idemq-bench-c{}", std::process::id());
    let options = || {
        RedisOptions::default()
            .prefix(prefix.clone())
            .retention(Duration::from_millis(TTL_MS))
    };
    let single = RedisStore::connect_with(&cfg.redis, options()).await?;
    let nodes: Vec<&str> = cfg.redis_cluster.split(',').collect();
    let cluster = RedisStore::connect_cluster(&nodes, options()).await?;
    let (n, depth, batches) = (cfg.redis_messages, cfg.in_flight, cfg.concurrency);
    idemq_redis(&single, 200, 1).await?;
    idemq_redis(&cluster, 200, 1).await?;
    let mut m: [Vec<f64>; 4] = Default::default();
    for r in 0..cfg.rounds {
        for which in crate::round_order(r, 4) {
            let v = match which {
                0 => idemq_redis(&single, n, depth).await?,
                1 => idemq_redis(&cluster, n, depth).await?,
                2 => idemq_redis_batched(&single, n, depth, batches).await?,
                _ => idemq_redis_batched(&cluster, n, depth, batches).await?,
            };
            m[which].push(v);
        }
        progress!(
            "Cluster round {}: one Redis {:.0}, cluster {:.0}; batches: one Redis {:.0}, cluster {:.0}",
            r + 1,
            m[0][r], m[1][r], m[2][r], m[3][r]
        );
    }
    let per_message = paired(&m[1], &m[0]);
    let batched = paired(&m[3], &m[2]);
    let [single_many, cluster_many, single_batched, cluster_batched] = m.map(|v| median(&v));
    Ok(vec![
        Row::new(
            section,
            format!("idemq RedisStore on one Redis, {depth} in flight"),
            n,
            single_many,
            "msg/s",
        ),
        Row::new(
            section,
            format!("idemq RedisStore on the Cluster, {depth} in flight"),
            n,
            cluster_many,
            "msg/s",
        )
        .ratio_of(per_message, "one Redis")
        .target("≥ 2× one Redis (issue 18)".to_owned(), per_message >= 2.0),
        Row::new(
            section,
            format!("idemq RedisStore batch mode on one Redis, batches of {depth}"),
            n,
            single_batched,
            "msg/s",
        ),
        Row::new(
            section,
            format!(
                "idemq RedisStore batch mode on the Cluster (a script per key), batches of {depth}"
            ),
            n,
            cluster_batched,
            "msg/s",
        )
        .ratio_of(batched, "one Redis"),
    ])
}

/// The in-memory rows: a bare queue drain beside idemq's `MemoryStore`.
pub async fn memory_rows(cfg: &Config) -> anyhow::Result<Vec<Row>> {
    let section = "In-memory store";
    progress!("memory: idemq MemoryStore vs bare queue drain");
    let n = cfg.memory_messages;
    let c = cfg.concurrency;
    let bare = |n: u64| async move {
        let queue = queue_of(n);
        let started = Instant::now();
        let done = drain(queue.source(), c, |_m| async { Ok(()) }).await?;
        let elapsed = started.elapsed();
        anyhow::ensure!(done == n, "drained {done} of {n}");
        Ok::<f64, anyhow::Error>(rate(n, elapsed))
    };
    let idemq = |n: u64| async move {
        let consumer = Consumer::builder("bench", MemoryStore::new())
            .key(KeySpec::json("/payment_id"))
            .concurrency(c)
            .handler(handler_fn(
                |_ctx, _lease: &mut idemq::store::memory::Lease| Box::pin(async { Ok(None) }),
            ))
            .build()?;
        let queue = queue_of(n);
        let started = Instant::now();
        let summary = consumer.run(queue.source()).await?;
        let elapsed = started.elapsed();
        anyhow::ensure!(
            summary.count(OutcomeKind::Processed) == n,
            "memory store: {summary}"
        );
        Ok::<f64, anyhow::Error>(rate(n, elapsed))
    };
    bare(n.min(1000)).await?;
    idemq(n.min(1000)).await?;
    let (mut b, mut i) = (Vec::new(), Vec::new());
    for r in 0..cfg.rounds {
        for bare_turn in if a_first(r) {
            [true, false]
        } else {
            [false, true]
        } {
            if bare_turn {
                b.push(bare(n).await?);
            } else {
                i.push(idemq(n).await?);
            }
        }
        progress!(
            "memory round {}: bare {:.0}, idemq {:.0}",
            r + 1,
            b[r],
            i[r]
        );
    }
    let ratio = paired(&i, &b);
    let (b, i) = (median(&b), median(&i));
    Ok(vec![
        Row::new(
            section,
            format!("bare MemoryQueue drain, no store, concurrency {c}"),
            n,
            b,
            "msg/s",
        ),
        Row::new(
            section,
            format!("idemq MemoryStore claim + commit, concurrency {c}"),
            n,
            i,
            "msg/s",
        )
        .ratio_of(ratio, "bare"),
    ])
}
