//! Requests per second through the layer beside the same service without
//! it, in one run:
//!
//! - the memory store, a trivial handler (the layer's own cost);
//! - Redis store, a trivial handler;
//! - PostgreSQL store, a handler that commits one transaction (one insert):
//!   without the layer it begins and commits its own; with it, it writes
//!   through the claim's transaction, which commits with the stored response.
//!
//! Every request has a new key (the first-request path: claim, run, store).
//!
//! ```sh
//! cargo run --release -p idemq-http --features axum,postgres,redis --example bench -- [SECONDS] [CLIENTS]
//! ```
//! `IDEMQ_TEST_POSTGRES` and `IDEMQ_TEST_REDIS` override the loopback URLs.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idemq::sqlx;
use idemq::store::redis::{RedisOptions, RedisStore};
use idemq::store::sql::postgres::{PostgresStore, PostgresTx};
use idemq::store::sql::SqlOptions;
use idemq::store::StoreAdmin;
use idemq_http::{Idempotency, InboxTx, TxError};

const TABLE: &str = "idemq_http_bench_orders";

async fn trivial() -> (StatusCode, &'static str) {
    (StatusCode::CREATED, r#"{"ok":true}"#)
}

async fn insert_own_tx(State(pool): State<sqlx::PgPool>) -> Result<StatusCode, String> {
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    sqlx::query(&format!("INSERT INTO {TABLE} (item) VALUES ('book')"))
        .execute(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    tx.commit().await.map_err(|e| e.to_string())?;
    Ok(StatusCode::CREATED)
}

/// The insert, on whatever connection it is given.
async fn insert(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    let sql = format!("INSERT INTO {TABLE} (item) VALUES ('book')");
    sqlx::query(&sql).execute(conn).await.map(|_| ())
}

async fn insert_in_claim(inbox: InboxTx<PostgresTx>) -> Result<StatusCode, TxError> {
    let mut tx = inbox.lock().await?;
    Ok(match insert(&mut tx).await {
        Ok(()) => StatusCode::CREATED,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE,
    })
}

async fn serve(router: Router) -> Result<SocketAddr, std::io::Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(addr)
}

/// Requests per second of `clients` keep-alive clients for `seconds`.
async fn load(addr: SocketAddr, seconds: u64, clients: usize) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let run = format!("{:x}", fastrand_u64());
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (done, failed, stop, run) = (done.clone(), failed.clone(), stop.clone(), run.clone());
        tasks.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let sent = client
                    .post(format!("http://{addr}/orders"))
                    .header("idempotency-key", format!("\"{run}-{c}-{n}\""))
                    .header("content-type", "application/json")
                    .body(r#"{"item":"book"}"#)
                    .send()
                    .await;
                match sent {
                    Ok(r) if r.status() == StatusCode::CREATED => {
                        let _ = r.bytes().await;
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    // A short warm-up, then the measured window.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let start_count = done.load(Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let count = done.load(Ordering::Relaxed) - start_count;
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    let failures = failed.load(Ordering::Relaxed);
    if failures > 0 {
        eprintln!("  ({failures} requests failed)");
    }
    count as f64 / elapsed
}

fn fastrand_u64() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let seconds: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(5);
    let clients: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(32);
    let pg_url = std::env::var("IDEMQ_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let redis_url =
        std::env::var("IDEMQ_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    println!("{clients} clients, {seconds} s per cell, a new key per request");

    // Memory store, trivial handler: the layer's own cost, without a
    // store round trip.
    let bare = serve(Router::new().route("/orders", post(trivial))).await?;
    let layered = serve(
        Router::new().route("/orders", post(trivial)).layer(
            Idempotency::builder(idemq::store::memory::MemoryStore::new())
                .build()?
                .layer(),
        ),
    )
    .await?;
    let without = load(bare, seconds, clients).await;
    let with = load(layered, seconds, clients).await;
    println!(
        "memory, trivial handler:       without {without:>8.0} req/s   with {with:>8.0} req/s   ratio {:.2}",
        with / without
    );

    // Redis, trivial handler.
    let redis = RedisStore::connect_with(
        &redis_url,
        RedisOptions::default().prefix("idemq_http_bench"),
    )
    .await?;
    let bare = serve(Router::new().route("/orders", post(trivial))).await?;
    let layered = serve(
        Router::new()
            .route("/orders", post(trivial))
            .layer(Idempotency::builder(redis.clone()).build()?.layer()),
    )
    .await?;
    let without = load(bare, seconds, clients).await;
    let with = load(layered, seconds, clients).await;
    println!(
        "redis, trivial handler:        without {without:>8.0} req/s   with {with:>8.0} req/s   ratio {:.2}",
        with / without
    );

    let mut expire = idemq::RetentionPolicy::default();
    expire.keep_for = Duration::ZERO;
    Idempotency::builder(redis).build()?.expire(&expire).await?;

    // PostgreSQL, a handler that commits one transaction.
    let options = SqlOptions::default()
        .table_prefix("idemq_http_bench_")
        .max_connections(16);
    let pg = PostgresStore::connect_with(&pg_url, options).await?;
    pg.migrate().await?;
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {TABLE} (id BIGSERIAL PRIMARY KEY, item TEXT NOT NULL)"
    ))
    .execute(pg.pool())
    .await?;
    let pool = pg.pool().clone();
    let bare = serve(
        Router::new()
            .route("/orders", post(insert_own_tx))
            .with_state(pool.clone()),
    )
    .await?;
    let layered = serve(
        Router::new()
            .route("/orders", post(insert_in_claim))
            .layer(Idempotency::builder(pg.clone()).build()?.layer()),
    )
    .await?;
    let without = load(bare, seconds, clients).await;
    let with = load(layered, seconds, clients).await;
    println!(
        "postgres, one-commit handler:  without {without:>8.0} req/s   with {with:>8.0} req/s   ratio {:.2}",
        with / without
    );
    Idempotency::builder(pg).build()?.expire(&expire).await?;
    sqlx::query(&format!("TRUNCATE {TABLE}"))
        .execute(&pool)
        .await?;
    Ok(())
}
