//! The group's lag: `XINFO GROUPS`, polled in the background into the gauge
//! `idemq_source_lag_messages`.
//!
//! The lag is what the group has not acknowledged yet: the group's `lag`
//! (entries not delivered to any of its consumers yet; Redis 7 and later)
//! plus its `pending` (delivered, not acknowledged yet), as Kafka's lag
//! counts from the committed offset. When Redis cannot tell the `lag` (it
//! answers nil after some deletions, and Redis 6 has no such field) the
//! reading is skipped. Labels: `source="redis-stream"`, `group` the group,
//! `topic` the stream, `partition` empty.

use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::streams::StreamInfoGroupsReply;
use tokio::task::JoinHandle;

/// How often the lag is read unless the URL says otherwise (`lag_interval=`).
pub(super) const DEFAULT_LAG_INTERVAL: Duration = Duration::from_secs(5);

/// The background task that reads the group's lag every interval; it stops
/// when this is dropped (with the source).
pub(super) struct LagPoller(JoinHandle<()>);

impl LagPoller {
    /// Starts polling the group `group` of `stream` over `conn` every
    /// `every`; `None` when `every` is zero (turned off).
    pub(super) fn start(
        conn: ConnectionManager,
        stream: String,
        group: String,
        every: Duration,
    ) -> Option<Self> {
        if every.is_zero() {
            return None;
        }
        Some(Self(tokio::spawn(poll(conn, stream, group, every))))
    }
}

impl Drop for LagPoller {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What one reading found.
enum Reading {
    /// The group's lag plus its pending entries.
    Lag(u64),
    /// Redis does not know the group's lag now (nil or absent).
    Unknown,
}

/// One `XINFO GROUPS` for `group` of `stream`.
async fn read(conn: &mut ConnectionManager, stream: &str, group: &str) -> Result<Reading, String> {
    let reply: StreamInfoGroupsReply = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(conn)
        .await
        .map_err(|e| e.to_string())?;
    let found = reply
        .groups
        .into_iter()
        .find(|g| g.name == group)
        .ok_or_else(|| format!("the stream has no group {group:?}"))?;
    Ok(match found.lag {
        Some(lag) => Reading::Lag(
            u64::try_from(lag)
                .unwrap_or(u64::MAX)
                .saturating_add(u64::try_from(found.pending).unwrap_or(u64::MAX)),
        ),
        None => Reading::Unknown,
    })
}

/// Reads the group's lag every `every` and sets the gauge. A failure is
/// logged at `warn` once, then at `debug` until a reading succeeds again,
/// and leaves the last value in place; a lag Redis does not know is
/// skipped (logged at `debug`).
async fn poll(mut conn: ConnectionManager, stream: String, group: String, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        ticks.tick().await;
        // The connection's response timeout bounds the call.
        let failure = match read(&mut conn, &stream, &group).await {
            Ok(Reading::Lag(lag)) => {
                // Looked up at each reading: a recorder installed after the
                // source connected still gets it.
                metrics::gauge!(
                    "idemq_source_lag_messages",
                    "source" => super::source::SOURCE_NAME,
                    "group" => group.clone(),
                    "topic" => stream.clone(),
                    "partition" => ""
                )
                .set(lag as f64);
                if failing {
                    tracing::debug!(stream = %stream, group = %group, "reading the Redis Streams group lag works again");
                }
                failing = false;
                continue;
            }
            Ok(Reading::Unknown) => {
                // Not a failure: Redis before 7, or entries deleted.
                tracing::debug!(stream = %stream, group = %group, "XINFO GROUPS tells no lag for the group; skipped");
                continue;
            }
            Err(e) => e,
        };
        if failing {
            tracing::debug!(stream = %stream, group = %group, error = %failure, "no Redis Streams group lag");
        } else {
            tracing::warn!(stream = %stream, group = %group, error = %failure, "no Redis Streams group lag; idemq_source_lag_messages keeps its last value");
        }
        failing = true;
    }
}
