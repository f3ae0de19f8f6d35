//! `idemq proxy` in front of a small upstream (an axum server in this
//! test) that counts its side effects: 30 concurrent clients retrying one
//! key (on 409) cause one side effect and all get the same answer; the
//! same key with another body is 422, no key 400, other methods stream
//! through untouched; a 5xx releases the key; and after the proxy is
//! killed with SIGKILL and started again, a retry of a stored key is
//! replayed from the store without reaching the upstream.
#![cfg(all(feature = "proxy", feature = "sqlite"))]

use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;

use crate::common::{free_port, idemq, wait_listening};

/// What the upstream did: orders created, failures answered, reads served.
#[derive(Default)]
struct Upstream {
    orders: AtomicU32,
    flaky: AtomicU32,
    reads: AtomicU32,
}

async fn create_order(State(up): State<Arc<Upstream>>, body: String) -> impl IntoResponse {
    tokio::time::sleep(Duration::from_millis(200)).await;
    let n = up.orders.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        [("location", format!("/orders/{n}"))],
        format!("{{\"order\":{n},\"request\":{body}}}"),
    )
}

async fn flaky(State(up): State<Arc<Upstream>>) -> impl IntoResponse {
    if up.flaky.fetch_add(1, Ordering::SeqCst) == 0 {
        (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response()
    } else {
        (StatusCode::CREATED, "done").into_response()
    }
}

async fn read(State(up): State<Arc<Upstream>>, headers: HeaderMap) -> impl IntoResponse {
    up.reads.fetch_add(1, Ordering::SeqCst);
    let host = headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("")
        .to_owned();
    format!("read through, host {host}")
}

/// Starts the upstream on a free port.
async fn upstream() -> (Arc<Upstream>, u16) {
    let state = Arc::new(Upstream::default());
    let app = Router::new()
        .route("/orders", post(create_order))
        .route("/flaky", post(flaky))
        .route("/report", get(read))
        .with_state(Arc::clone(&state));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (state, port)
}

/// `idemq proxy` on a free port in front of `upstream`, over `store`.
fn proxy(store: &str, upstream: u16) -> (Child, u16) {
    let port = free_port();
    let child = idemq()
        .args(["--store", store, "proxy", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .args(["--upstream", &format!("http://127.0.0.1:{upstream}")])
        .args(["--scope-header", "x-api-key"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    wait_listening(port, "idemq proxy");
    (child, port)
}

/// POSTs `body` to `path` with `key`, retrying on 409 (the key in flight)
/// for up to 20 s; (status, replayed, body).
async fn post_retrying(
    client: &reqwest::Client,
    port: u16,
    path: &str,
    key: Option<&str>,
    body: &str,
) -> (u16, bool, String) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let mut request = client
            .post(format!("http://127.0.0.1:{port}{path}"))
            .header("x-api-key", "tenant-a")
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(key) = key {
            request = request.header("idempotency-key", format!("\"{key}\""));
        }
        let answer = request.send().await.unwrap();
        let status = answer.status().as_u16();
        if status == 409 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let replayed = answer.headers().contains_key("idempotent-replayed");
        return (status, replayed, answer.text().await.unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_proxy_makes_a_plain_api_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("proxy.db").display());
    let (up, upstream_port) = upstream().await;
    let (mut child, port) = proxy(&store, upstream_port);
    let client = reqwest::Client::new();

    // 30 clients, one key: one order, one answer for all.
    let body = "{\"item\":\"book\"}";
    let answers: Vec<_> = futures_util::future::join_all(
        (0..30).map(|_| post_retrying(&client, port, "/orders", Some("order-1"), body)),
    )
    .await;
    assert_eq!(up.orders.load(Ordering::SeqCst), 1, "one side effect");
    let first = &answers[0];
    assert_eq!(first.0, 201, "{answers:?}");
    assert!(
        answers.iter().all(|a| a.0 == 201 && a.2 == first.2),
        "{answers:?}"
    );
    assert_eq!(
        answers.iter().filter(|a| !a.1).count(),
        1,
        "one answer came from the upstream, the others were replayed"
    );

    // Another body under the same key; no key; another tenant's same key.
    let (status, _, problem) = post_retrying(&client, port, "/orders", Some("order-1"), "{}").await;
    assert_eq!(status, 422, "{problem}");
    let (status, _, _) = post_retrying(&client, port, "/orders", None, body).await;
    assert_eq!(status, 400);
    let other = client
        .post(format!("http://127.0.0.1:{port}/orders"))
        .header("x-api-key", "tenant-b")
        .header("idempotency-key", "\"order-1\"")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(other.status().as_u16(), 201);
    assert_eq!(
        up.orders.load(Ordering::SeqCst),
        2,
        "tenant-b's key is its own"
    );

    // GET streams through, every time, with the upstream's Host.
    for _ in 0..2 {
        let read = client
            .get(format!("http://127.0.0.1:{port}/report"))
            .send()
            .await
            .unwrap();
        assert_eq!(read.status().as_u16(), 200);
        let text = read.text().await.unwrap();
        assert!(
            text.contains(&format!("host 127.0.0.1:{upstream_port}")),
            "{text}"
        );
    }
    assert_eq!(up.reads.load(Ordering::SeqCst), 2);

    // A 5xx releases the key: the retry reaches the upstream again.
    let (status, _, _) = post_retrying(&client, port, "/flaky", Some("flaky-1"), "{}").await;
    assert_eq!(status, 503);
    let (status, replayed, _) = post_retrying(&client, port, "/flaky", Some("flaky-1"), "{}").await;
    assert_eq!((status, replayed), (201, false));
    assert_eq!(up.flaky.load(Ordering::SeqCst), 2);

    // SIGKILL, start again: the stored answer is replayed from the store.
    child.kill().unwrap();
    child.wait().unwrap();
    let (mut child, port) = proxy(&store, upstream_port);
    let (status, replayed, again) =
        post_retrying(&client, port, "/orders", Some("order-1"), body).await;
    assert_eq!((status, replayed), (201, true));
    assert_eq!(again, first.2, "the same answer, byte for byte");
    assert_eq!(up.orders.load(Ordering::SeqCst), 2, "no second side effect");
    child.kill().unwrap();
    child.wait().unwrap();
}
