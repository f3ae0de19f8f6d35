//! `--http-addr`: the operations endpoint of a running `consume` or `relay`.
//!
//! - `/metrics`: every `idemq_*` series in the Prometheus text format,
//!   rendered by `metrics-exporter-prometheus` (histograms with buckets);
//! - `/healthz`: 200 while the process answers;
//! - `/readyz`: 200 when every readiness check (the store answers a ping,
//!   the source's broker accepts a connection) passes within
//!   [`CHECK_TIMEOUT`], else 503 with the failing checks named.

use std::net::SocketAddr;
use std::sync::Arc;
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

/// What the endpoint serves.
#[derive(Clone, Default)]
pub struct Ops {
    /// Named readiness checks, all run (concurrently) for each `/readyz`.
    pub ready: Vec<(&'static str, Probe)>,
    /// Run before each `/metrics` render to set gauges read at scrape time
    /// (the outbox backlog); a failure is logged and the render goes on.
    pub on_scrape: Option<Probe>,
}

#[derive(Clone)]
struct Served {
    ops: Ops,
    prometheus: PrometheusHandle,
}

/// Installs the Prometheus recorder, binds `addr` and serves [`Ops`] on it
/// in a background task for the rest of the process; returns the bound
/// address (the port chosen, for `:0`).
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
        .with_state(Served { ops, prometheus });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the --http-addr server stopped");
        }
    });
    tracing::info!(addr = %bound, "serving /metrics, /healthz and /readyz");
    Ok(bound)
}

async fn metrics(State(served): State<Served>) -> impl IntoResponse {
    if let Some(refresh) = &served.ops.on_scrape {
        match tokio::time::timeout(CHECK_TIMEOUT, refresh()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "refreshing the scrape-time gauges failed"),
            Err(_) => tracing::warn!("refreshing the scrape-time gauges timed out"),
        }
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        served.prometheus.render(),
    )
}

async fn ready(State(served): State<Served>) -> impl IntoResponse {
    let checks = served.ops.ready.iter().map(|(name, probe)| async move {
        let verdict = match tokio::time::timeout(CHECK_TIMEOUT, probe()).await {
            Ok(verdict) => verdict,
            Err(_) => Err(format!("no answer within {CHECK_TIMEOUT:?}")),
        };
        (*name, verdict)
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
