//! `idemq proxy`: a reverse proxy that applies the `Idempotency-Key` layer
//! of `idemq-http` in front of any HTTP API. Covered requests (the chosen
//! methods under the chosen path prefixes) are read whole (up to
//! `--max-body`), claimed in the store, forwarded, and their answer stored
//! and replayed to retries; everything else streams through untouched.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderName, HeaderValue, Method, Response, StatusCode, Uri};
use axum::serve::ListenerExt;
use axum::Router;
use bytes::Bytes;
use clap::Args;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemq::store::Store;
use idemq_http::config::HOP_BY_HOP;
use idemq_http::{hashed_header_scope, Idempotency};

use crate::interrupt::Interrupt;
use crate::ops;

/// `idemq proxy`.
#[derive(Debug, Args)]
pub struct ProxyArgs {
    /// Where the proxy listens, e.g. `127.0.0.1:8080`.
    #[arg(long, value_name = "ADDR")]
    listen: SocketAddr,

    /// The API behind it, `http://host:port` (plain HTTP: the proxy runs
    /// beside the API; TLS ends in front of the proxy).
    #[arg(long, value_name = "URL", value_parser = parse_upstream)]
    upstream: Uri,

    /// The methods made idempotent (comma-separated).
    #[arg(long, value_name = "METHODS", default_value = "POST,PATCH", value_delimiter = ',', value_parser = Method::from_str)]
    methods: Vec<Method>,

    /// Only paths under this prefix are made idempotent (repeatable; default: every path).
    #[arg(long = "path-prefix", value_name = "PREFIX")]
    path_prefixes: Vec<String>,

    /// The request header whose value scopes the keys (an API key, a
    /// tenant), stored hashed; a covered request without it gets 400.
    /// Without it every client shares one scope.
    #[arg(long, value_name = "HEADER")]
    scope_header: Option<HeaderName>,

    /// Pass covered requests without an `Idempotency-Key` through
    /// untouched instead of answering 400.
    #[arg(long)]
    optional_key: bool,

    /// The name the keys are stored under (the idemq consumer name).
    #[arg(long, default_value = "proxy", value_name = "NAME")]
    name: String,

    /// The largest covered request body and upstream answer kept, in bytes
    /// (larger: 413 for a request, 502 for an answer).
    #[arg(long, default_value_t = 1 << 20, value_name = "BYTES")]
    max_body: usize,

    /// How long a claimed key is held before another request may take it
    /// over (lease stores; renewed while the upstream works).
    #[arg(long, default_value = "30s", value_name = "DURATION", value_parser = humantime::parse_duration)]
    lease: Duration,

    /// How long one upstream call may take before the proxy answers 504.
    #[arg(long, default_value = "60s", value_name = "DURATION", value_parser = humantime::parse_duration)]
    upstream_timeout: Duration,

    /// Serve `/metrics`, `/healthz` and `/readyz` on this address.
    #[arg(long, value_name = "ADDR")]
    http_addr: Option<SocketAddr>,

    /// Do not create or upgrade the idemq tables before serving.
    #[arg(long)]
    no_migrate: bool,
}

/// `http://host[:port]`, with no path beyond `/`.
fn parse_upstream(text: &str) -> Result<Uri, String> {
    let uri: Uri = text
        .parse()
        .map_err(|e| format!("{text:?} is not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(
            "the upstream must be http://host:port (TLS ends in front of the proxy)".into(),
        );
    }
    if uri.authority().is_none() || !matches!(uri.path(), "" | "/") {
        return Err("the upstream is http://host:port, without a path".into());
    }
    Ok(uri)
}

/// What every request handler shares.
struct Proxy<S: Store> {
    idempotency: Idempotency<S>,
    client: Client<HttpConnector, Body>,
    upstream: Uri,
    prefixes: Vec<String>,
    timeout: Duration,
}

/// Serves until Ctrl-C or SIGTERM.
pub async fn run<B>(store: B, args: ProxyArgs) -> Result<ExitCode>
where
    B: crate::backend::Backend + Clone,
{
    if !args.no_migrate {
        store
            .migrate()
            .await
            .map_err(|e| super::admin_error(e, "creating the idemq tables"))?;
    }
    let mut builder = Idempotency::builder(store.clone())
        .name(&args.name)
        .methods(args.methods.clone())
        .require_key(!args.optional_key)
        .lease(args.lease)
        .max_request_body(args.max_body)
        .max_response_body(args.max_body);
    if let Some(name) = &args.scope_header {
        builder = builder.scope_fn(hashed_header_scope(name.clone()));
    }
    let idempotency = builder.build().map_err(crate::exit::usage)?;
    if let Some(ops) = ops::for_run(args.http_addr, None).await? {
        let probe = store.clone();
        ops.ready(
            "store",
            std::sync::Arc::new(move || {
                let probe = probe.clone();
                Box::pin(async move { probe.ping().await.map_err(|e| e.to_string()) })
            }),
        );
    }
    let proxy = std::sync::Arc::new(Proxy {
        idempotency,
        client: Client::builder(TokioExecutor::new()).build(upstream_connector()),
        upstream: args.upstream.clone(),
        prefixes: args.path_prefixes.clone(),
        timeout: args.upstream_timeout,
    });
    let app = Router::new().fallback(handle::<B>).with_state(proxy);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| crate::exit::usage(format!("--listen {}: {e}", args.listen)))?;
    let bound = listener.local_addr().context("reading the bound address")?;
    // Small writes (a header block, then a body) go out at once.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY on an accepted connection");
        }
    });
    eprintln!(
        "idemq proxy: listening on {bound}, forwarding to {}",
        args.upstream
    );
    let interrupt = Interrupt::listen();
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { interrupt.wait().await })
        .await
        .context("serving")?;
    Ok(ExitCode::SUCCESS)
}

/// The connector to the upstream: plain HTTP, `TCP_NODELAY` so that a
/// request's head and body are not held back by Nagle's algorithm.
fn upstream_connector() -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector
}

/// One request: through the layer when it is covered, else streamed.
async fn handle<S: Store>(
    State(proxy): State<std::sync::Arc<Proxy<S>>>,
    request: Request,
) -> Response<Body> {
    let started = Instant::now();
    let protected = proxy.idempotency.covers(&request)
        && (proxy.prefixes.is_empty()
            || proxy
                .prefixes
                .iter()
                .any(|p| request.uri().path().starts_with(p.as_str())));
    let response = if protected {
        let forwarded = proxy
            .idempotency
            .serve(request, |request: axum::http::Request<Bytes>| async {
                let (parts, body) = request.into_parts();
                let request = axum::http::Request::from_parts(parts, Body::from(body));
                Ok::<_, Infallible>(forward(&proxy, request).await)
            })
            .await;
        match forwarded {
            Ok(response) => response.map(Body::new),
            Err(never) => match never {},
        }
    } else {
        forward(&proxy, request).await
    };
    let replayed = response.headers().contains_key("idempotent-replayed");
    metrics::counter!(
        "idemq_proxy_requests_total",
        "protected" => protected.to_string(),
        "replayed" => replayed.to_string(),
        "status" => format!("{}xx", response.status().as_u16() / 100),
    )
    .increment(1);
    metrics::histogram!("idemq_proxy_request_seconds", "protected" => protected.to_string())
        .record(started.elapsed().as_secs_f64());
    response
}

/// Sends `request` to the upstream (hop-by-hop headers dropped, `Host` the
/// upstream's) and returns its answer streaming; 502 when it cannot be
/// reached, 504 past `--upstream-timeout`.
async fn forward<S: Store>(proxy: &Proxy<S>, request: Request) -> Response<Body> {
    let (mut parts, body) = request.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let mut target = proxy.upstream.clone().into_parts();
    target.path_and_query = path.parse().ok();
    let Ok(uri) = Uri::from_parts(target) else {
        return problem(
            StatusCode::BAD_REQUEST,
            "the request path cannot be forwarded",
        );
    };
    parts.uri = uri;
    strip_hop_by_hop(&mut parts.headers);
    if let Some(authority) = proxy.upstream.authority() {
        if let Ok(host) = HeaderValue::from_str(authority.as_str()) {
            parts.headers.insert(header::HOST, host);
        }
    }
    let request = axum::http::Request::from_parts(parts, body);
    match tokio::time::timeout(proxy.timeout, proxy.client.request(request)).await {
        Ok(Ok(response)) => {
            let (mut parts, body) = response.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            Response::from_parts(parts, Body::new(body))
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "the upstream did not answer");
            problem(StatusCode::BAD_GATEWAY, "the upstream did not answer")
        }
        Err(_) => problem(StatusCode::GATEWAY_TIMEOUT, "the upstream took too long"),
    }
}

fn strip_hop_by_hop(headers: &mut axum::http::HeaderMap) {
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

/// A problem-details answer of the proxy itself.
fn problem(status: StatusCode, detail: &str) -> Response<Body> {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_upstream_is_plain_http_without_a_path() {
        assert!(parse_upstream("http://127.0.0.1:8080").is_ok());
        assert!(parse_upstream("http://api.internal/").is_ok());
        assert!(parse_upstream("https://api.internal").is_err());
        assert!(parse_upstream("http://api.internal/v1").is_err());
        assert!(parse_upstream("nonsense").is_err());
    }
}
