//! The Redis lease store: duplicates of a payment are applied once, and the
//! handler passes the key's fencing number to its (here: in-memory)
//! downstream, which refuses writes from stale lease holders.
//!
//! ```text
//! cargo run -p idemq --features redis --example redis [redis://127.0.0.1:6379]
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemq::source::queue::MemoryQueue;
use idemq::store::redis::{RedisLease, RedisOptions, RedisStore};
use idemq::{Consumer, HandlerError, KeySpec, Message, OutcomeKind};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "redis://127.0.0.1:6379".into());
    // A fresh prefix per run, so the example can be run again; short retention.
    let prefix = format!("idemq-example-{}", std::process::id());
    let store = RedisStore::connect_with(
        &url,
        RedisOptions::default()
            .prefix(prefix)
            .retention(Duration::from_secs(600)),
    )
    .await?;

    // The downstream: key -> (highest fencing number seen, amount).
    let downstream: Arc<Mutex<HashMap<String, (u64, i64)>>> = Arc::default();
    let sink = Arc::clone(&downstream);
    let consumer = Consumer::builder("payments", store)
        .key(KeySpec::json("/payment_id"))
        .lease(Duration::from_secs(5))
        .handler_fn(move |ctx, lease: &mut RedisLease| {
            let sink = Arc::clone(&sink);
            Box::pin(async move {
                let p: serde_json::Value = ctx.message.json().map_err(HandlerError::permanent)?;
                let amount = p["amount"].as_i64().unwrap_or(0);
                let fence = lease.fencing_token();
                let mut sink = sink
                    .lock()
                    .map_err(|_| HandlerError::permanent("poisoned"))?;
                if sink.get(ctx.key).is_some_and(|(seen, _)| *seen > fence) {
                    return Err(HandlerError::permanent("stale fencing token"));
                }
                sink.insert(ctx.key.to_owned(), (fence, amount));
                Ok(Some(
                    serde_json::json!({ "charged": amount, "fence": fence }),
                ))
            })
        })
        .build()?;

    let queue = MemoryQueue::new("payments");
    for (id, amount) in [("p-1", 5), ("p-2", 7), ("p-1", 5), ("p-2", 7), ("p-3", 1)] {
        queue.push(Message::new(
            serde_json::json!({ "payment_id": id, "amount": amount }).to_string(),
        ));
    }
    queue.close();
    let summary = consumer.run(queue.source()).await?;
    println!("{summary}");
    println!(
        "processed {} duplicates {}",
        summary.count(OutcomeKind::Processed),
        summary.count(OutcomeKind::Duplicate)
    );
    let mut applied: Vec<_> = downstream
        .lock()
        .map_err(|_| "poisoned")?
        .iter()
        .map(|(k, v)| (k.clone(), *v))
        .collect();
    applied.sort();
    println!("downstream (key, (fence, amount)): {applied:?}");
    Ok(())
}
