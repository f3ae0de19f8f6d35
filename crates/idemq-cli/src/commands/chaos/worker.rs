//! What runs inside a chaos worker process: the named kill points (armed
//! from `IDEMQ_CHAOS_KILL`) and, for lease stores, the hidden `chaos-worker`
//! command that writes the ledger with the lease-store pattern.

use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use anyhow::Result;
use clap::Args;

use crate::endpoint::Endpoint;

/// The environment variable with the kill points: `POINT:P,POINT:P,…`.
pub const KILL_ENV: &str = "IDEMQ_CHAOS_KILL";
/// The environment variable naming the file a worker appends the name of
/// the point it kills itself at to, just before it does.
pub const KILL_LOG_ENV: &str = "IDEMQ_CHAOS_KILL_LOG";

/// Set by the first task that reaches an armed kill point in this process.
#[cfg(feature = "failpoints")]
static DYING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Parses `POINT:P,POINT:P,…` (P a probability in [0, 1]); the points are
/// those of [`idemq::failpoint::NAMES`].
pub fn parse_kill_points(text: &str) -> Result<Vec<(&'static str, f64)>, String> {
    let mut points = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, p) = part
            .split_once(':')
            .ok_or_else(|| format!("expected POINT:PROBABILITY, got {part:?}"))?;
        let name = idemq::failpoint::NAMES
            .iter()
            .find(|n| **n == name.trim())
            .ok_or_else(|| {
                format!(
                    "unknown kill point {name:?}: expected one of {}",
                    idemq::failpoint::NAMES.join(", ")
                )
            })?;
        let p: f64 = p
            .trim()
            .parse()
            .map_err(|e| format!("bad probability in {part:?}: {e}"))?;
        if !(0.0..=1.0).contains(&p) {
            return Err(format!(
                "probability {p} in {part:?} is not between 0 and 1"
            ));
        }
        points.push((*name, p));
    }
    Ok(points)
}

/// In a worker built with the `failpoints` feature: arms every point named
/// in `IDEMQ_CHAOS_KILL` with a callback that, with the given probability,
/// appends "POINT PID" to `IDEMQ_CHAOS_KILL_LOG` and sends SIGKILL to
/// this process. Does nothing when the variable is unset.
#[cfg(feature = "failpoints")]
pub fn arm_kill_points() {
    use std::io::Write;

    let Ok(spec) = std::env::var(KILL_ENV) else {
        return;
    };
    let points = match parse_kill_points(&spec) {
        Ok(points) => points,
        Err(e) => {
            eprintln!("idemq: ignoring {KILL_ENV}: {e}");
            return;
        }
    };
    let log = std::env::var_os(KILL_LOG_ENV).map(std::path::PathBuf::from);
    for (name, probability) in points {
        let log = log.clone();
        let armed = fail::cfg_callback(name, move || {
            if fastrand::f64() >= probability {
                return;
            }
            // One death, one line: a second task reaching a kill point while
            // the first is killing the process neither logs nor kills (the
            // runner counts one restart per death).
            if DYING.swap(true, std::sync::atomic::Ordering::SeqCst) {
                std::thread::sleep(Duration::from_secs(5));
                std::process::abort();
            }
            if let Some(path) = &log {
                // One short O_APPEND write: lines of concurrent workers do not mix.
                if let Ok(mut file) = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                {
                    let _ = file.write_all(format!("{name} {}\n", std::process::id()).as_bytes());
                }
            }
            // SAFETY: kill(2) and getpid(2) have no memory-safety preconditions.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            // SIGKILL cannot be caught; wait for it rather than run on.
            std::thread::sleep(Duration::from_secs(5));
            std::process::abort();
        });
        if let Err(e) = armed {
            eprintln!("idemq: cannot arm kill point {name}: {e}");
        }
    }
}

/// `idemq chaos-worker` (hidden): consumes SOURCE into a lease store. On
/// Redis each order is written to the ledger as an effect keyed by its
/// derived idempotency key and fenced by the lease's fencing number; on
/// MongoDB it is upserted once by its key, as `--apply-mongo` does.
#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// The source, as for `consume`.
    #[arg(value_name = "SOURCE", value_parser = Endpoint::from_str)]
    input: Endpoint,
    /// The consumer name.
    #[arg(long, value_name = "NAME")]
    consumer: String,
    /// The ledger's Redis key base, or MongoDB collection name.
    #[arg(long, value_name = "KEY")]
    ledger: String,
    /// Stop when no message has arrived for this long.
    #[arg(long, default_value = "3s", value_name = "DURATION", value_parser = humantime::parse_duration)]
    idle_exit: Duration,
    /// Messages in flight at once.
    #[arg(long, default_value_t = 8, value_name = "N")]
    concurrency: usize,
    /// The lease of a claim.
    #[arg(long, default_value = "2s", value_name = "DURATION", value_parser = humantime::parse_duration)]
    lease: Duration,
    /// Attempts of a retryable failure before a dead letter.
    #[arg(long, default_value_t = 50, value_name = "N")]
    max_attempts: u32,
    /// Do not keep a checkpoint next to a file source.
    #[arg(long)]
    no_checkpoint: bool,
}

/// Runs the lease-store worker on the store `--store` names.
pub async fn run(args: WorkerArgs, global: &crate::GlobalArgs) -> Result<ExitCode> {
    let url: crate::backend::StoreUrl = global.store.parse().map_err(crate::exit::usage)?;
    match url.kind {
        #[cfg(feature = "redis")]
        crate::backend::Kind::Redis => run_redis(args, global, &url).await,
        #[cfg(feature = "mongodb")]
        crate::backend::Kind::Mongo => run_mongo(args, global, &url).await,
        #[allow(unreachable_patterns)]
        _ => {
            drop(args);
            Err(crate::exit::usage(
                "chaos-worker is for lease stores (redis://, mongodb://); SQL stores use \
                 `consume --apply-sql`",
            ))
        }
    }
}

/// Consumes the worker's source into `store` with `handler` and prints the
/// summary.
#[cfg(any(feature = "redis", feature = "mongodb"))]
async fn consume<S, H>(args: WorkerArgs, store: S, handler: H) -> Result<ExitCode>
where
    S: idemq::store::Store + idemq::store::StoreAdmin,
    H: idemq::Handler<S::Tx> + 'static,
{
    use anyhow::Context as _;
    use idemq::{Consumer, KeySpec, RetryPolicy};

    store.migrate().await.context("migrating")?;
    let consumer = Consumer::builder(args.consumer.as_str(), store)
        .key(KeySpec::json("/order_id"))
        .handler(handler)
        .concurrency(args.concurrency.max(1))
        .lease(args.lease)
        .retry(RetryPolicy::default().with_max_attempts(args.max_attempts.max(1)))
        .build()
        .map_err(crate::exit::usage)?;
    let source = args
        .input
        .open_source(
            &args.consumer,
            args.no_checkpoint,
            idemq::source::jsonl::DEFAULT_MAX_LINE_BYTES,
        )
        .await?;
    let summary = consumer
        .run(idemq::source::idle::IdleExit::new(source, args.idle_exit))
        .await
        .context("reading the input")?;
    println!("consumer {}: {summary}", args.consumer);
    Ok(ExitCode::SUCCESS)
}

/// The Redis worker: a fenced, keyed effect per order.
#[cfg(feature = "redis")]
async fn run_redis(
    args: WorkerArgs,
    global: &crate::GlobalArgs,
    url: &crate::backend::StoreUrl,
) -> Result<ExitCode> {
    use idemq::store::redis::{RedisOptions, RedisStore};

    use super::ledger::{redis_ledger_keys, redis_prefix};

    let options = RedisOptions::default().prefix(redis_prefix(&global.table_prefix));
    let store = RedisStore::connect_with(&url.url, options)
        .await
        .map_err(|e| crate::backend::connect_error(url, e))?;
    let handler = FencedLedger {
        conn: store.connection().clone(),
        keys: redis_ledger_keys(&args.ledger),
        script: redis::Script::new(FENCED_WRITE),
    };
    consume(args, store, handler).await
}

/// The MongoDB worker: each order upserted once by its key
/// (`idemq::effect::mongo::upsert_once`, what `--apply-mongo` does), and
/// every re-execution that found its document already written recorded in
/// the ledger's rewrites collection.
#[cfg(feature = "mongodb")]
async fn run_mongo(
    args: WorkerArgs,
    global: &crate::GlobalArgs,
    url: &crate::backend::StoreUrl,
) -> Result<ExitCode> {
    use idemq::store::mongo::{MongoOptions, MongoStore};

    use super::ledger::mongo_ledger_names;

    let (options, url_text) = MongoOptions::default()
        .prefix(&global.table_prefix)
        .with_url_params(&url.url)
        .map_err(|e| crate::backend::connect_error(url, e))?;
    let store = MongoStore::connect_with(&url_text, options)
        .await
        .map_err(|e| crate::backend::connect_error(url, e))?;
    let [ledger, rewrites] = mongo_ledger_names(&args.ledger);
    let handler = UpsertLedger {
        ledger: store.database().collection(&ledger),
        rewrites: store.database().collection(&rewrites),
    };
    consume(args, store, handler).await
}

/// The MongoDB handler of the chaos ledger.
#[cfg(feature = "mongodb")]
struct UpsertLedger {
    ledger:
        idemq::effect::mongo::mongodb::Collection<idemq::effect::mongo::mongodb::bson::Document>,
    rewrites:
        idemq::effect::mongo::mongodb::Collection<idemq::effect::mongo::mongodb::bson::Document>,
}

#[cfg(feature = "mongodb")]
impl<Tx: Send + 'static> idemq::Handler<Tx> for UpsertLedger {
    fn handle<'a>(
        &'a self,
        ctx: &'a idemq::Context<'a>,
        _lease: &'a mut Tx,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = idemq::HandlerResult> + Send + 'a>>
    {
        use idemq::effect::mongo::{document_of, mongodb::bson::doc, upsert_once, Upserted};
        use idemq::HandlerError;
        Box::pin(async move {
            let document = document_of(ctx.message)?;
            if upsert_once(&self.ledger, ctx.key, document).await? == Upserted::AlreadyPresent {
                self.rewrites
                    .insert_one(doc! { "key": ctx.key })
                    .await
                    .map_err(|e| HandlerError::retryable(format!("rewrite count: {}", e.kind)))?;
            }
            Ok(None)
        })
    }
}

/// The fenced, keyed effect: KEYS = ledger, fence, writes; ARGV =
/// idempotency key, fencing number, business key, amount. Refuses a write
/// with a lower fencing number than the key's last accepted one; counts
/// accepted writes per business key.
#[cfg(feature = "redis")]
const FENCED_WRITE: &str = r"
local last = redis.call('HGET', KEYS[2], ARGV[1])
if last and tonumber(last) > tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3] .. ' ' .. ARGV[4])
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
return 1
";

/// The lease-store handler of the chaos ledger.
#[cfg(feature = "redis")]
struct FencedLedger {
    conn: idemq::store::redis::RedisConnection,
    keys: [String; 3],
    script: redis::Script,
}

#[cfg(feature = "redis")]
impl idemq::Handler<idemq::store::redis::RedisLease> for FencedLedger {
    fn handle<'a>(
        &'a self,
        ctx: &'a idemq::Context<'a>,
        lease: &'a mut idemq::store::redis::RedisLease,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = idemq::HandlerResult> + Send + 'a>>
    {
        use idemq::HandlerError;
        Box::pin(async move {
            let payload: serde_json::Value = ctx.message.json().map_err(HandlerError::permanent)?;
            let amount = payload["amount"]
                .as_i64()
                .ok_or_else(|| HandlerError::permanent("no integer amount"))?;
            let mut conn = self.conn.clone();
            let accepted: i64 = self
                .script
                .key(&self.keys[0])
                .key(&self.keys[1])
                .key(&self.keys[2])
                .arg(ctx.idempotency_key("ledger").to_string())
                .arg(lease.fencing_token())
                .arg(ctx.key)
                .arg(amount)
                .invoke_async(&mut conn)
                .await
                .map_err(|e| HandlerError::retryable(format!("ledger write failed: {e}")))?;
            if accepted == 0 {
                return Err(HandlerError::retryable(
                    "a newer lease holder already wrote this key (fenced)",
                ));
            }
            Ok(None)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kill_point_specs() {
        assert_eq!(
            parse_kill_points("after_claim:0.5, before_commit:0").unwrap(),
            vec![("after_claim", 0.5), ("before_commit", 0.0)]
        );
        assert!(parse_kill_points("nowhere:0.1").is_err());
        assert!(parse_kill_points("after_claim:2").is_err());
        assert!(parse_kill_points("after_claim").is_err());
        assert!(parse_kill_points("").unwrap().is_empty());
    }
}
