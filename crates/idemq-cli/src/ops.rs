//! `--http-addr`: the operations endpoint of a running `consume` or `relay`.
//!
//! - `/metrics`: every `idemq_*` series in the Prometheus text format,
//!   rendered by `metrics-exporter-prometheus` (histograms with buckets);
//! - `/healthz`: 200 while the process answers;
//! - `/readyz`: 200 when every readiness check (the store answers a ping,
//!   the source's broker accepts a connection) passes within
//!   [`CHECK_TIMEOUT`], else 503 with the failing checks named.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::sync::lock;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use futures_util::future::BoxFuture;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// How long one readiness check may take before it counts as failed.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// Latency buckets of every `*_seconds` histogram: 0.5 ms to 10 s.
const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// An async check or refresh: `Err` carries what is wrong, without secrets.
pub type Probe = Arc<dyn Fn() -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// What the endpoint serves, filled in by the consumers and relays of the
/// process as they start (several share one endpoint under `idemq run`).
#[derive(Clone, Default)]
pub struct Ops {
    shared: Arc<Shared>,
    /// Put before the names of the checks this handle adds (`billing `).
    scope: String,
}

struct Shared {
    /// Named readiness checks, all run (concurrently) for each `/readyz`.
    ready: Mutex<Vec<(String, Probe)>>,
    /// Run before each `/metrics` render to set gauges read at scrape time
    /// (the outbox backlog); a failure is logged and the render goes on.
    on_scrape: Mutex<Vec<Probe>>,
    /// `/metrics` renders begun so far; the next one gets this number.
    renders_begun: AtomicU64,
    /// One more than the highest-numbered render that has finished.
    renders_done: tokio::sync::watch::Sender<u64>,
    /// The server [`serve`] started: how to stop it, and its task.
    server: Mutex<Option<Server>>,
}

impl Default for Shared {
    fn default() -> Self {
        Self {
            ready: Mutex::default(),
            on_scrape: Mutex::default(),
            renders_begun: AtomicU64::new(0),
            renders_done: tokio::sync::watch::Sender::new(0),
            server: Mutex::default(),
        }
    }
}

/// A running endpoint: a graceful stop lets the responses under way go out.
struct Server {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Ops {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ops")
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

impl Ops {
    /// A handle whose checks are named `scope NAME`.
    pub fn scoped(&self, scope: &str) -> Ops {
        Ops {
            shared: Arc::clone(&self.shared),
            scope: format!("{}{scope} ", self.scope),
        }
    }

    /// Adds a readiness check called `name` (within this handle's scope).
    pub fn ready(&self, name: &str, probe: Probe) {
        lock(&self.shared.ready).push((format!("{}{name}", self.scope), probe));
    }

    /// Adds a refresh to run before each `/metrics` render.
    pub fn on_scrape(&self, probe: Probe) {
        lock(&self.shared.on_scrape).push(probe);
    }

    /// `--http-linger`: keeps serving until a `/metrics` render begun after
    /// this call has finished (the scraper read the final counts), at most
    /// `grace`; then stops the server this handle's [`serve`] started,
    /// letting that last response go out.
    pub async fn linger(&self, grace: Duration) {
        let after = self.shared.renders_begun.load(Ordering::SeqCst);
        let mut done = self.shared.renders_done.subscribe();
        let scraped = tokio::time::timeout(grace, done.wait_for(|&n| n > after)).await;
        if scraped.is_err() {
            tracing::info!(
                ?grace,
                "no /metrics scrape within the linger time: stopping"
            );
        }
        let server = lock(&self.shared.server).take();
        if let Some(Server { stop, task }) = server {
            let _ = stop.send(());
            if tokio::time::timeout(CHECK_TIMEOUT, task).await.is_err() {
                tracing::warn!("the --http-addr server did not stop within {CHECK_TIMEOUT:?}");
            }
        }
    }
}

#[derive(Clone)]
struct Served {
    ops: Ops,
    prometheus: PrometheusHandle,
}

/// Installs the Prometheus recorder, binds `addr` and serves `ops` (and the
/// checks added to it later) in a background task for the rest of the
/// process; returns the bound address (the port chosen, for `:0`).
pub async fn serve(addr: SocketAddr, ops: Ops) -> Result<SocketAddr> {
    let prometheus = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
        .context("configuring the Prometheus recorder")?
        .install_recorder()
        .context("installing the Prometheus recorder")?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| crate::exit::usage(format!("--http-addr {addr}: {e}")))?;
    let bound = listener.local_addr().context("reading the bound address")?;
    let upkeep = prometheus.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(Served {
            ops: ops.clone(),
            prometheus,
        });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let graceful = axum::serve(listener, app).with_graceful_shutdown(async move {
            let _ = stopped.await;
        });
        if let Err(e) = graceful.await {
            tracing::error!(error = %e, "the --http-addr server stopped");
        }
    });
    *lock(&ops.shared.server) = Some(Server { stop, task });
    tracing::info!(addr = %bound, "serving /metrics, /healthz and /readyz");
    Ok(bound)
}

/// The endpoint a `consume` or `relay` adds its checks to: its own, served
/// on `addr` (`--http-addr`), else the process's `shared` one, else none.
pub async fn for_run(addr: Option<SocketAddr>, shared: Option<&Ops>) -> Result<Option<Ops>> {
    match (addr, shared) {
        (Some(addr), _) => {
            let ops = Ops::default();
            serve(addr, ops.clone()).await?;
            Ok(Some(ops))
        }
        (None, shared) => Ok(shared.cloned()),
    }
}

async fn metrics(State(served): State<Served>) -> impl IntoResponse {
    let shared = &served.ops.shared;
    let number = shared.renders_begun.fetch_add(1, Ordering::SeqCst);
    let refreshes: Vec<Probe> = lock(&served.ops.shared.on_scrape).clone();
    for refresh in refreshes {
        match tokio::time::timeout(CHECK_TIMEOUT, refresh()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "refreshing the scrape-time gauges failed"),
            Err(_) => tracing::warn!("refreshing the scrape-time gauges timed out"),
        }
    }
    let body = served.prometheus.render();
    shared
        .renders_done
        .send_modify(|done| *done = (*done).max(number + 1));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body)
}

async fn ready(State(served): State<Served>) -> impl IntoResponse {
    let ready: Vec<(String, Probe)> = lock(&served.ops.shared.ready).clone();
    let checks = ready.into_iter().map(|(name, probe)| async move {
        let verdict = match tokio::time::timeout(CHECK_TIMEOUT, probe()).await {
            Ok(verdict) => verdict,
            Err(_) => Err(format!("no answer within {CHECK_TIMEOUT:?}")),
        };
        (name, verdict)
    });
    let verdicts = futures_util::future::join_all(checks).await;
    let mut body = String::new();
    let mut ready = true;
    for (name, verdict) in verdicts {
        match verdict {
            Ok(()) => body.push_str(&format!("{name}: ok\n")),
            Err(e) => {
                ready = false;
                body.push_str(&format!("{name}: {e}\n"));
            }
        }
    }
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, body)
}

/// A readiness check that a TCP connection to one of `addresses` (`host:port`)
/// opens: the source's broker is reachable.
pub fn reachable(addresses: Vec<String>) -> Probe {
    Arc::new(move || {
        let addresses = addresses.clone();
        Box::pin(async move {
            let mut last = String::from("no address to try");
            for address in &addresses {
                match tokio::net::TcpStream::connect(address.as_str()).await {
                    Ok(_) => return Ok(()),
                    Err(e) => last = format!("{address}: {e}"),
                }
            }
            Err(last)
        })
    })
}

/// Sums `idemq_messages_total` by consumer and outcome in a Prometheus text
/// exposition; other series and malformed lines are skipped.
pub fn outcome_totals(text: &str) -> BTreeMap<(String, String), f64> {
    let mut totals = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("idemq_messages_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once('}') else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        let labels = parse_labels(labels);
        if let (Some(consumer), Some(outcome)) = (labels.get("consumer"), labels.get("outcome")) {
            *totals
                .entry((consumer.clone(), outcome.clone()))
                .or_insert(0.0) += value;
        }
    }
    totals
}

/// `a="x",b="y\"z"` → {a: x, b: y"z}.
fn parse_labels(text: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut rest = text;
    while let Some((name, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, other)) => value.push(other),
                    None => {}
                },
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        labels.insert(name.trim_start_matches(',').trim().to_owned(), value);
        rest = &after[end..];
    }
    labels
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_totals_sum_series_by_consumer_and_outcome() {
        let text = "# TYPE idemq_messages_total counter\n\
            idemq_messages_total{consumer=\"billing\",outcome=\"processed\"} 40\n\
            idemq_messages_total{outcome=\"duplicate\",consumer=\"billing\"} 10\n\
            idemq_messages_total{consumer=\"a \\\"quoted\\\" name\",outcome=\"conflict\"} 2\n\
            idemq_dead_letters_total{consumer=\"billing\",reason=\"bad_input\"} 1\n\
            idemq_messages_total{consumer=\"billing\",outcome=\"processed\"} nonsense\n";
        let totals = outcome_totals(text);
        assert_eq!(totals[&("billing".into(), "processed".into())], 40.0);
        assert_eq!(totals[&("billing".into(), "duplicate".into())], 10.0);
        assert_eq!(
            totals[&("a \"quoted\" name".into(), "conflict".into())],
            2.0
        );
        assert_eq!(totals.len(), 3);
    }
}
