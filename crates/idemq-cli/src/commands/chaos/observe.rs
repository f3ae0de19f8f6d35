//! What the chaos runner reads from its SQL workers' `--http-addr`: their
//! outcome counters, checked against the summary line of each worker that
//! drains its source, and `/readyz` while the database restarts.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use anyhow::Result;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

/// The outcomes both the summary line and `idemq_messages_total` count.
pub(super) const OUTCOMES: [&str; 5] = [
    "processed",
    "duplicate",
    "conflict",
    "retry_later",
    "dead_lettered",
];

/// Counts by outcome.
pub(super) type Counts = BTreeMap<&'static str, u64>;

/// A port no one listens on right now, for a worker's `--http-addr`. Drawn
/// from 28000 up to the start of the kernel's ephemeral range
/// (`ip_local_port_range`): a port of that range (as `bind(0)` gives) can be
/// taken by any outgoing connection before the worker binds it — with cells
/// and workers running side by side it was — one below it only by another
/// such draw. Above the test services' ports (27017 is FerretDB's).
pub(super) fn free_port() -> Result<u16> {
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .filter(|low| *low > 28_100)
        .unwrap_or(32_768);
    for _ in 0..1000 {
        let port = fastrand::u16(28_000..ephemeral);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    anyhow::bail!("no free port in 28000..{ephemeral}")
}

/// How long a `/readyz` may take: longer than the worker's own 2 s bound
/// on each check, so that an unready worker's 503 arrives.
const READYZ_TIMEOUT: Duration = Duration::from_secs(4);

/// `GET path` on 127.0.0.1:`port` within `limit`: (status, body); `None`
/// when nothing answers (the worker is dead or not listening yet).
pub(super) async fn get(port: u16, path: &str, limit: Duration) -> Option<(u16, String)> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let request = format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await.ok()?;
        let status = response.split(' ').nth(1)?.parse().ok()?;
        let body = response.split_once("\r\n\r\n")?.1.to_owned();
        Some((status, body))
    };
    tokio::time::timeout(limit, exchange).await.ok().flatten()
}

/// `idemq_messages_total{consumer="…",outcome="…"}` of `consumer` in a
/// `/metrics` text, by outcome (absent series count 0).
pub(super) fn scraped(metrics: &str, consumer: &str) -> Counts {
    let totals = crate::ops::outcome_totals(metrics);
    OUTCOMES
        .iter()
        .map(|&outcome| {
            let n = totals
                .get(&(consumer.to_owned(), outcome.to_owned()))
                .copied()
                .unwrap_or(0.0);
            (outcome, n as u64)
        })
        .collect()
}

/// The counts of a summary line `consumer NAME: processed=1 duplicate=0 …`
/// in a worker's stdout; `None` when it printed none.
pub(super) fn summarized(stdout: &str, consumer: &str) -> Option<Counts> {
    let line = stdout
        .lines()
        .rev()
        .find_map(|line| line.strip_prefix(&format!("consumer {consumer}: ")))?;
    let words: BTreeMap<&str, u64> = line
        .split_whitespace()
        .filter_map(|word| {
            let (name, n) = word.split_once('=')?;
            Some((name, n.parse().ok()?))
        })
        .collect();
    Some(
        OUTCOMES
            .iter()
            .map(|&outcome| (outcome, words.get(outcome).copied().unwrap_or(0)))
            .collect(),
    )
}

/// What `/readyz` of the workers said while the database restarted.
#[derive(Debug, Default)]
pub(super) struct Readiness {
    /// Polls during the restart, and how many found a worker answering 503.
    pub(super) polls: u64,
    pub(super) unready: u64,
    /// After the restart: `Some(true)` a worker answered 200 within 30 s;
    /// `Some(false)` workers answered, never 200; `None` none was left to
    /// answer (they had drained their source, or died).
    pub(super) ready_again: Option<bool>,
}

/// Runs `restart` while polling `/readyz` of every port every 100 ms, then
/// waits (30 s at most) for one to answer 200 again, while any answers.
pub(super) async fn readiness_through(
    ports: &[u16],
    restart: impl Future<Output = Result<()>>,
) -> Result<Readiness> {
    let mut readiness = Readiness::default();
    tokio::pin!(restart);
    loop {
        tokio::select! {
            done = &mut restart => { done?; break }
            _ = tokio::time::sleep(Duration::from_millis(100)) => {
                readiness.polls += 1;
                for &port in ports {
                    if matches!(get(port, "/readyz", READYZ_TIMEOUT).await, Some((503, _))) {
                        readiness.unready += 1;
                        break;
                    }
                }
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let mut answered = false;
        for &port in ports {
            match get(port, "/readyz", READYZ_TIMEOUT).await {
                Some((200, _)) => {
                    readiness.ready_again = Some(true);
                    return Ok(readiness);
                }
                Some(_) => answered = true,
                None => {}
            }
        }
        if !answered {
            return Ok(readiness);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    readiness.ready_again = Some(false);
    Ok(readiness)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scraped_and_summarized_counts_read_the_same_outcomes() {
        let metrics = "# TYPE idemq_messages_total counter\n\
            idemq_messages_total{consumer=\"chaos\",outcome=\"processed\"} 40\n\
            idemq_messages_total{consumer=\"chaos\",outcome=\"duplicate\"} 3\n\
            idemq_messages_total{consumer=\"other\",outcome=\"duplicate\"} 9\n";
        let stdout = "consumer chaos: processed=40 duplicate=3 conflict=0 retry_later=0 \
            dead_lettered=0 abandoned=2\n";
        assert_eq!(
            scraped(metrics, "chaos"),
            summarized(stdout, "chaos").unwrap()
        );
        assert_eq!(scraped(metrics, "chaos")["duplicate"], 3);
        assert_eq!(summarized("nothing\n", "chaos"), None);
    }
}
