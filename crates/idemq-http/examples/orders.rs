//! An axum service whose `POST /orders` is idempotent: the order row is
//! written in the transaction that claimed the `Idempotency-Key`, so the
//! order and the stored response commit together.
//!
//! ```sh
//! cargo run -p idemq-http --features axum --example orders            # SQLite in ./orders.db, sends a demo
//! cargo run -p idemq-http --features axum --example orders -- serve  # and keeps serving on 127.0.0.1:3000
//! curl -i -X POST localhost:3000/orders -H 'x-api-key: k1' \
//!      -H 'Idempotency-Key: "order-42"' -H 'content-type: application/json' -d '{"item":"book"}'
//! ```

use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use idemq::sqlx;
use idemq::store::sql::sqlite::{SqliteStore, SqliteTx};
use idemq::store::StoreAdmin;
use idemq_http::{hashed_header_scope, Idempotency, InboxTx, TxError};

#[derive(serde::Deserialize)]
struct NewOrder {
    item: String,
}

/// Creates an order through the claim's transaction; the layer commits it
/// with the response it stores.
async fn create_order(
    inbox: InboxTx<SqliteTx>,
    Json(order): Json<NewOrder>,
) -> Result<impl IntoResponse, TxError> {
    let mut tx = inbox.lock().await?;
    let result = sqlx::query("INSERT INTO orders (item) VALUES (?) RETURNING id")
        .bind(&order.item)
        .fetch_one(&mut **tx)
        .await;
    drop(tx); // give the transaction back before answering
    match result {
        Ok(row) => {
            let id: i64 = sqlx::Row::get(&row, 0);
            let body = serde_json::json!({ "id": id, "item": order.item });
            Ok((
                StatusCode::CREATED,
                [(header::LOCATION, format!("/orders/{id}"))],
                Json(body),
            )
                .into_response())
        }
        // A 5xx releases the key and rolls the claim back with the insert.
        Err(e) => Ok((StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response()),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = SqliteStore::connect("sqlite://orders.db").await?;
    store.migrate().await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL)")
        .execute(store.pool())
        .await?;

    let idempotency = Idempotency::builder(store.clone())
        .name("orders-api")
        // Keys are per API key (hashed: the key itself is never stored).
        .scope_fn(hashed_header_scope(header::HeaderName::from_static(
            "x-api-key",
        )))
        .build()?;
    let app = Router::new()
        .route("/orders", post(create_order))
        .layer(idempotency.layer());

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    // The same request twice: one order, the same answer twice.
    let client = reqwest::Client::new();
    let key = format!("\"demo-{}\"", std::process::id());
    for attempt in 1..=2 {
        let response = client
            .post(format!("http://{addr}/orders"))
            .header("x-api-key", "k1")
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .body(r#"{"item":"book"}"#)
            .send()
            .await?;
        let status = response.status();
        let replayed = response.headers().contains_key("idempotent-replayed");
        println!(
            "attempt {attempt}: {status} replayed={replayed} {}",
            response.text().await?
        );
    }

    if std::env::args().nth(1).as_deref() == Some("serve") {
        println!("serving on http://{addr}");
        server.await??;
    }
    Ok(())
}
