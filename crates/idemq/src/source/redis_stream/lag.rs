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

use crate::source::lag::{self, LagGauge, Poller};

/// How often the lag is read unless the URL says otherwise (`lag_interval=`).
pub(super) const DEFAULT_LAG_INTERVAL: Duration = Duration::from_secs(5);

/// The background task that reads the group's lag every interval; it stops
/// when this is dropped (with the source).
pub(super) struct LagPoller {
    /// The task, aborted on drop.
    _task: Poller,
}

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
        Some(Self {
            _task: Poller::spawn(poll(conn, stream, group, every)),
        })
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

/// Reads the group's lag every `every` and sets the gauge; a failure
/// leaves the last value in place (logged as [`LagGauge::failed`] says),
/// and a lag Redis does not know is skipped (logged at `debug`).
async fn poll(mut conn: ConnectionManager, stream: String, group: String, every: Duration) {
    let mut gauge = LagGauge::new(super::source::SOURCE_NAME, group.as_str(), stream.as_str());
    let mut ticks = lag::ticks(every);
    loop {
        ticks.tick().await;
        // The connection's response timeout bounds the call.
        match read(&mut conn, &stream, &group).await {
            Ok(Reading::Lag(lag)) => {
                gauge.set("", lag);
                gauge.worked();
            }
            Ok(Reading::Unknown) => {
                // Not a failure: Redis before 7, or entries deleted.
                tracing::debug!(stream = %stream, group = %group, "XINFO GROUPS tells no lag for the group; skipped");
            }
            Err(e) => gauge.failed(&e),
        }
    }
}
