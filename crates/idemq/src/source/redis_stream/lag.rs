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
//!
//! Each reading takes `XINFO STREAM` with `XINFO GROUPS` in one `MULTI`,
//! and looks in them for entries removed before the group read them
//! ([`super::limits`]): each new finding is logged at `error`.

use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::streams::{StreamInfoGroup, StreamInfoGroupsReply};
use redis::Value;

use super::conn::broker_error;
use super::limits::{GroupState, StreamState, Watch, REMEDY};
use crate::error::SourceError;
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
    /// `every`, looking for lost entries from `watch`; `None` when `every`
    /// is zero (turned off).
    pub(super) fn start(
        conn: ConnectionManager,
        stream: String,
        group: String,
        every: Duration,
        watch: Option<Watch>,
    ) -> Option<Self> {
        if every.is_zero() {
            return None;
        }
        Some(Self {
            _task: Poller::spawn(poll(conn, stream, group, every, watch)),
        })
    }
}

/// One reading of the stream and the group, taken together (`MULTI`).
pub(super) struct State {
    /// The stream's removed entries; `None` before Redis 7.
    pub(super) stream: Option<StreamState>,
    /// The group's row of `XINFO GROUPS`.
    pub(super) group: StreamInfoGroup,
}

/// `XINFO STREAM` and `XINFO GROUPS` of `stream` in one `MULTI`, and the
/// row of `group`.
pub(super) async fn read_state(
    conn: &mut ConnectionManager,
    stream: &str,
    group: &str,
) -> Result<State, SourceError> {
    let (info, groups): (Value, StreamInfoGroupsReply) = redis::pipe()
        .atomic()
        .cmd("XINFO")
        .arg("STREAM")
        .arg(stream)
        .cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(conn)
        .await
        .map_err(|e| broker_error(&format!("XINFO STREAM/GROUPS {stream}"), e))?;
    let group = groups
        .groups
        .into_iter()
        .find(|g| g.name == group)
        .ok_or_else(|| SourceError::broker(format!("the stream has no group {group:?}")))?;
    Ok(State {
        stream: StreamState::parse(info),
        group,
    })
}

/// The group's lag plus its pending entries; `None` when Redis does not
/// know the lag (nil or absent).
fn lag_of(group: &StreamInfoGroup) -> Option<u64> {
    group.lag.map(|lag| {
        u64::try_from(lag)
            .unwrap_or(u64::MAX)
            .saturating_add(u64::try_from(group.pending).unwrap_or(u64::MAX))
    })
}

/// Logs at `error` what `watch` finds new in `state` (started from `state`
/// when `None`).
fn watch_losses(watch: &mut Option<Watch>, state: &State, stream: &str, group: &str) {
    let (Some(s), Some(g)) = (state.stream, GroupState::from_info(&state.group)) else {
        return;
    };
    let Some(watching) = watch.as_mut() else {
        *watch = Some(Watch::new(&s, &g));
        return;
    };
    for loss in watching.observe(&s, &g) {
        tracing::error!(stream, group, "{loss}, and are lost; {REMEDY}");
    }
}

/// Reads the group's lag every `every` and sets the gauge; a failure
/// leaves the last value in place (logged as [`LagGauge::failed`] says),
/// and a lag Redis does not know is skipped (logged at `debug`). Each
/// reading also looks for entries removed before the group read them
/// (see [`Watch`]), from `watch` (what connecting found).
async fn poll(
    mut conn: ConnectionManager,
    stream: String,
    group: String,
    every: Duration,
    mut watch: Option<Watch>,
) {
    let mut gauge = LagGauge::new(super::source::SOURCE_NAME, group.as_str(), stream.as_str());
    let mut ticks = lag::ticks(every);
    loop {
        ticks.tick().await;
        // The connection's response timeout bounds the call.
        match read_state(&mut conn, &stream, &group).await {
            Ok(state) => {
                match lag_of(&state.group) {
                    Some(lag) => {
                        gauge.set("", lag);
                        gauge.worked();
                    }
                    None => {
                        // Not a failure: Redis before 7, or entries deleted.
                        tracing::debug!(stream = %stream, group = %group, "XINFO GROUPS tells no lag for the group; skipped");
                    }
                }
                watch_losses(&mut watch, &state, &stream, &group);
            }
            Err(e) => gauge.failed(&e),
        }
    }
}
