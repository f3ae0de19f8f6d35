//! The JSON-lines source through the engine into SQLite: envelopes and bare
//! lines, duplicates, a producer retry, a malformed line, checkpoints, and a
//! run killed halfway and restarted.
#![cfg(feature = "sqlite")]

use std::sync::Arc;
use std::time::Duration;

use idemq::source::jsonl::JsonLinesSource;
use idemq::store::sql::sqlite::SqliteStore;
use idemq::store::StoreAdmin;
use idemq::{handler_fn, Consumer, Context, HandlerError, KeySpec, OutcomeKind};
use tokio::sync::Semaphore;

const LINES: &str = r#"{"id":"m-1","payload":{"payment_id":"p-1","amount":10}}
{"id":"m-2","payload":{"payment_id":"p-2","amount":20}}
{"id":"m-1","payload":{"payment_id":"p-1","amount":10}}

{"id":"m-9","payload":{"payment_id":"p-1","amount":10}}
{"payment_id":"p-3","amount":30}
{"payment_id": broken
{"payment_id":"p-3","amount":30}
{"id":"m-4","payload":{"payment_id":"p-4","amount":40}}
"#;

async fn setup() -> (tempfile::TempDir, SqliteStore, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::connect(&format!("sqlite://{}", dir.path().join("t.db").display()))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE ledger (payment_id TEXT NOT NULL, amount INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let file = dir.path().join("payments.jsonl");
    std::fs::write(&file, LINES).unwrap();
    (dir, store, file)
}

/// Applies a payment; waits for a permit first when `gate` is given, so a
/// test can hold the run in the middle.
fn consumer(store: &SqliteStore, gate: Option<Arc<Semaphore>>) -> Consumer<SqliteStore> {
    Consumer::builder("payments", store.clone())
        .key(KeySpec::json("/payment_id"))
        .concurrency(1)
        .handler(handler_fn(
            move |ctx: &Context<'_>, tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>| {
                let gate = gate.clone();
                Box::pin(async move {
                    if let Some(gate) = gate {
                        gate.acquire()
                            .await
                            .map_err(HandlerError::retryable)?
                            .forget();
                    }
                    let p: serde_json::Value =
                        ctx.message.json().map_err(HandlerError::permanent)?;
                    sqlx::query("INSERT INTO ledger (payment_id, amount) VALUES (?, ?)")
                        .bind(ctx.key)
                        .bind(p["amount"].as_i64())
                        .execute(&mut **tx)
                        .await?;
                    Ok(None)
                })
            },
        ))
        .build()
        .unwrap()
}

async fn ledger(store: &SqliteStore) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT payment_id, amount FROM ledger ORDER BY payment_id")
        .fetch_all(store.pool())
        .await
        .unwrap()
}

fn expected() -> Vec<(String, i64)> {
    vec![
        ("p-1".into(), 10),
        ("p-2".into(), 20),
        ("p-3".into(), 30),
        ("p-4".into(), 40),
    ]
}

#[tokio::test]
async fn file_is_applied_once_and_malformed_line_dead_lettered() {
    let (_dir, store, file) = setup().await;
    let checkpoint = file.with_extension("payments.checkpoint");
    let source = JsonLinesSource::open_with_checkpoint(&file, Some(checkpoint.clone()))
        .await
        .unwrap();
    let summary = consumer(&store, None).run(source).await.unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 4);
    assert_eq!(
        summary.count(OutcomeKind::Duplicate),
        3,
        "redelivery, producer retry, bare duplicate"
    );
    assert_eq!(summary.count(OutcomeKind::DeadLettered), 1);
    assert_eq!(ledger(&store).await, expected());

    let letters = store.dead_letters(Some("payments"), 0, 10).await.unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].reason, "malformed_record");
    assert!(letters[0].error.contains("line 7"), "{}", letters[0].error);
    assert_eq!(letters[0].message.payload, br#"{"payment_id": broken"#);
    assert_eq!(letters[0].meta.offset, Some(7));

    // With the checkpoint, nothing is read again.
    let again = JsonLinesSource::open_with_checkpoint(&file, Some(checkpoint))
        .await
        .unwrap();
    assert_eq!(consumer(&store, None).run(again).await.unwrap().total(), 0);
    // Without it, everything is read and nothing applied twice.
    let rerun = consumer(&store, None)
        .run(JsonLinesSource::open(&file).await.unwrap())
        .await
        .unwrap();
    assert_eq!(rerun.count(OutcomeKind::Processed), 0);
    assert_eq!(rerun.count(OutcomeKind::Duplicate), 7);
    assert_eq!(ledger(&store).await, expected());
}

#[tokio::test]
async fn a_run_killed_halfway_continues_from_its_checkpoint() {
    let (_dir, store, file) = setup().await;
    let checkpoint = file.with_extension("payments.checkpoint");
    // Let two handler calls through, then hold the third forever and kill the run.
    let gate = Arc::new(Semaphore::new(2));
    let source = JsonLinesSource::open_with_checkpoint(&file, Some(checkpoint.clone()))
        .await
        .unwrap();
    let first = consumer(&store, Some(gate));
    let run = tokio::spawn(async move { first.run(source).await });
    // Wait (bounded) until both effects are in and a checkpoint is saved;
    // the gate keeps the third handler call from ever finishing. The ledger
    // is read on a connection of its own: the held third call keeps the
    // store's connection.
    let reader = SqliteStore::connect(&format!(
        "sqlite://{}",
        file.with_file_name("t.db").display()
    ))
    .await
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while ledger(&reader).await.len() < 2
        || !std::fs::read_to_string(&checkpoint).is_ok_and(|saved| saved.contains("\"line\""))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "two effects and a checkpoint within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    run.abort();
    let _ = run.await;
    assert_eq!(ledger(&store).await.len(), 2, "killed after two effects");
    let saved = std::fs::read_to_string(&checkpoint).unwrap();
    assert!(saved.contains("\"line\""), "{saved}");

    let resumed = JsonLinesSource::open_with_checkpoint(&file, Some(checkpoint))
        .await
        .unwrap();
    let summary = consumer(&store, None).run(resumed).await.unwrap();
    assert_eq!(
        summary.count(OutcomeKind::Processed),
        2,
        "only what the killed run had not applied"
    );
    assert!(
        summary.total() < 9,
        "resumed from the checkpoint, not from the top"
    );
    assert_eq!(ledger(&store).await, expected());
}
