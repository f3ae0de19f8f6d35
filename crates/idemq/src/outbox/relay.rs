//! The relay: claims outbox rows, publishes them, deletes what the broker
//! confirmed.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::db::{Bind, RawRow};
use super::{Outbox, OutboxDatabase, OutboxError, EVENT_ID_HEADER, EVENT_TYPE_HEADER};
use crate::message::{Headers, Message};
use crate::source::Publisher;
use crate::SourceErrorKind;

/// At most this many seqs go into one `IN (…)` list of a delete.
const DELETE_CHUNK: usize = 500;

/// How a [`Relay`] claims, publishes and waits.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RelayOptions {
    /// Rows per batch (one transaction). Default 100.
    pub batch_size: usize,
    /// Most publishes of one batch awaiting the broker's confirmation at
    /// once. Only rows of different keys are in flight together: a key's
    /// next row is published after its previous one was confirmed, so the
    /// order per (destination, key) does not depend on this. `1` publishes
    /// one row at a time in `seq` order; `0` counts as `1`. Default 64.
    pub max_in_flight: usize,
    /// How long to wait between polls when the outbox is empty. PostgreSQL
    /// relays are also woken by `NOTIFY` at once. Default 1 s.
    pub poll_interval: Duration,
    /// How long one publish (or the flush) may take before it counts as
    /// failed. Default 30 s.
    pub publish_timeout: Duration,
    /// Backoff after the first failure of a row (and of the relay, after a
    /// database error); it doubles per attempt. Default 200 ms.
    pub initial_backoff: Duration,
    /// The longest backoff. Default 30 s.
    pub max_backoff: Duration,
    /// Failed publishes of one row after which it is moved to the
    /// dead-letter table `{prefix}outbox_dead` and its key's later rows go
    /// on; `None` or `Some(0)`: retry forever, the key waiting. Counted per
    /// row, across relays and restarts (the `attempts` column). Every
    /// failure counts, a broker outage too (with the default backoffs 10
    /// attempts span about 80 s), which is why the default is to wait:
    /// an outage must not empty the outbox into the dead table. Errors a
    /// retry cannot cure go to the dead table at the first attempt whatever
    /// this is (see [`Relay`]). Default `None`.
    pub max_attempts: Option<u32>,
    /// Stop [`Relay::run`] when nothing was published (or dead-lettered) for this long
    /// (`None`: run until the shutdown future completes). Default `None`.
    pub idle_exit: Option<Duration>,
    /// PostgreSQL: `LISTEN` for inserts besides polling. Default `true`.
    pub listen: bool,
    /// The relay's name in logs. Default `relay`.
    pub name: String,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            batch_size: 100,
            max_in_flight: 64,
            poll_interval: Duration::from_secs(1),
            publish_timeout: Duration::from_secs(30),
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(30),
            max_attempts: None,
            idle_exit: None,
            listen: true,
            name: "relay".to_owned(),
        }
    }
}

impl RelayOptions {
    /// The backoff before attempt `failures + 1`.
    fn backoff(&self, failures: u32) -> Duration {
        let factor = 2u32.saturating_pow(failures.saturating_sub(1).min(20));
        self.initial_backoff
            .saturating_mul(factor)
            .min(self.max_backoff)
    }

    /// Whether a row that has now failed `failures` times is given up.
    fn exhausted(&self, failures: i64) -> bool {
        self.max_attempts
            .filter(|max| *max > 0)
            .is_some_and(|max| failures >= i64::from(max))
    }
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Keys whose oldest row was ready.
    pub ready_keys: usize,
    /// Keys this relay locked (the others were held by other relays).
    pub locked_keys: usize,
    /// Rows read for the locked keys.
    pub rows: usize,
    /// Rows published, confirmed and deleted.
    pub published: usize,
    /// Rows moved to the dead-letter table (permanent error, or
    /// [`max_attempts`](RelayOptions::max_attempts) reached).
    pub dead: usize,
    /// Whether a publish failed (the row waits for its backoff).
    pub failed: bool,
    /// Failed publishes that left their row for a retry: at most one per
    /// key, whose later rows in the batch were not published.
    pub failures: usize,
}

/// What [`Relay::run`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Batches that published or failed something.
    pub batches: u64,
    /// Rows published and deleted.
    pub published: u64,
    /// Rows moved to the dead-letter table.
    pub dead: u64,
    /// Failed publishes that left the row for a retry (one per key and
    /// batch at most).
    pub failures: u64,
}

impl std::fmt::Display for RelayStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "published={} dead={} failures={} batches={}",
            self.published, self.dead, self.failures, self.batches
        )
    }
}

/// Publishes the rows of an [`Outbox`] table to brokers, in order per
/// (destination, key), at least once.
///
/// Each batch is one transaction: the oldest row of every key that is ready
/// is locked without waiting (`FOR UPDATE SKIP LOCKED`; SQLite: the write
/// lock), and the rows of the locked keys are published, each as a
/// [`Message`] with id = the row's `id`, key = `aggregateid`, headers
/// `event_id` (= id), `event_type` (if set) and the row's headers; each
/// [`Publisher::publish`] returns only when the broker accepted it. Rows of
/// different keys are published concurrently, up to
/// [`max_in_flight`](RelayOptions::max_in_flight) at once, oldest first;
/// the rows of one key go strictly one after another in `seq` order (the
/// next is published only once the broker confirmed the previous one).
/// After a [`Publisher::flush`] the published rows are deleted and the
/// transaction commits. A failed publish stops its key for the batch: that
/// row gets a backoff and the key's later rows wait behind it, while the
/// other keys of the batch go on. Any number of relays may run on one
/// table.
///
/// A row is given up — copied to `{prefix}outbox_dead` with the reason and
/// deleted from the outbox in the batch's transaction, logged at error —
/// when its publish has failed
/// [`max_attempts`](RelayOptions::max_attempts) times, or at once when the
/// failure is one a retry cannot cure: the publisher returned
/// [`SourceErrorKind::Config`](crate::SourceErrorKind::Config) (the way a [`Publisher`] says "never this
/// message"), or the row's `headers` column is not a JSON object. The batch
/// then goes on with the key's next row. Other publisher errors (broker,
/// I/O, timeouts) are retried.
///
/// ```no_run
/// use std::sync::Arc;
/// use idemq::outbox::{Outbox, Relay, RelayOptions};
/// use idemq::source::redis_stream::RedisStreamPublisher;
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/test").await?;
/// let outbox = Outbox::<sqlx::Postgres>::new("idemq_")?;
/// outbox.migrate(&pool).await?;
/// # #[cfg(feature = "redis-streams")]
/// # {
/// let publisher = RedisStreamPublisher::connect_to("redis://127.0.0.1:6379", "payments").await?;
/// let relay = Relay::new(pool, outbox, Arc::new(publisher), RelayOptions::default());
/// let stats = relay
///     .run(async {
///         let _ = tokio::signal::ctrl_c().await;
///     })
///     .await?;
/// println!("{stats}");
/// # }
/// # Ok(()) }
/// ```
pub struct Relay<DB: OutboxDatabase> {
    pool: sqlx::Pool<DB>,
    outbox: Outbox<DB>,
    default: Option<Arc<dyn Publisher>>,
    routes: BTreeMap<String, Arc<dyn Publisher>>,
    only: Vec<String>,
    options: RelayOptions,
}

impl<DB: OutboxDatabase> Clone for Relay<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            outbox: self.outbox.clone(),
            default: self.default.clone(),
            routes: self.routes.clone(),
            only: self.only.clone(),
            options: self.options.clone(),
        }
    }
}

impl<DB: OutboxDatabase> std::fmt::Debug for Relay<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("table", &self.outbox.table())
            .field("routes", &self.routes.keys().collect::<Vec<_>>())
            .field("only", &self.only)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<DB: OutboxDatabase> Relay<DB> {
    /// A relay that publishes the rows of every destination through `publisher`.
    pub fn new(
        pool: sqlx::Pool<DB>,
        outbox: Outbox<DB>,
        publisher: Arc<dyn Publisher>,
        options: RelayOptions,
    ) -> Self {
        Self {
            pool,
            outbox,
            default: Some(publisher),
            routes: BTreeMap::new(),
            only: Vec::new(),
            options,
        }
    }

    /// A relay without a default publisher: only destinations given a
    /// [`route`](Self::route) are claimed.
    pub fn routed(pool: sqlx::Pool<DB>, outbox: Outbox<DB>, options: RelayOptions) -> Self {
        Self {
            pool,
            outbox,
            default: None,
            routes: BTreeMap::new(),
            only: Vec::new(),
            options,
        }
    }

    /// Publishes the rows of `destination` through `publisher`.
    pub fn route(mut self, destination: impl Into<String>, publisher: Arc<dyn Publisher>) -> Self {
        self.routes.insert(destination.into(), publisher);
        self
    }

    /// Claims only rows of these destinations (besides routed ones); rows
    /// of other destinations are left to other relays.
    pub fn only(mut self, destinations: impl IntoIterator<Item = String>) -> Self {
        self.only.extend(destinations);
        self
    }

    /// The destinations this relay claims; empty = all.
    fn destinations(&self) -> Vec<String> {
        if self.default.is_some() && self.only.is_empty() {
            return Vec::new();
        }
        let mut all: Vec<String> = self.routes.keys().cloned().collect();
        all.extend(self.only.iter().cloned());
        all.sort();
        all.dedup();
        all
    }

    fn publisher(&self, destination: &str) -> Option<&Arc<dyn Publisher>> {
        self.routes.get(destination).or(self.default.as_ref())
    }

    /// Runs one batch: claim, publish, delete, commit.
    pub async fn relay_once(&self) -> Result<BatchReport, OutboxError> {
        if self.default.is_none() && self.routes.is_empty() {
            return Err(OutboxError::Config(
                "the relay has no publisher: give it a default or a route".into(),
            ));
        }
        let st = self.outbox.statements();
        let now = crate::store::now_ms();
        let batch = i64::try_from(self.options.batch_size.max(1)).unwrap_or(i64::MAX);
        let destinations = self.destinations();
        let mut report = BatchReport::default();

        let mut tx = DB::begin_write(&self.pool).await?;
        let mut binds: Vec<Bind<'_>> = destinations.iter().map(|d| Bind::Text(d)).collect();
        binds.extend([Bind::Int(now), Bind::Int(batch)]);
        let heads =
            super::db::fetch_ints::<DB>(&mut tx, &st.heads(destinations.len()), &binds).await?;
        report.ready_keys = heads.len();
        if heads.is_empty() {
            tx.rollback().await?;
            return Ok(report);
        }
        let mut binds: Vec<Bind<'_>> = heads.iter().map(|s| Bind::Int(*s)).collect();
        binds.push(Bind::Int(now));
        let locked = super::db::fetch_keys::<DB>(&mut tx, &st.lock(heads.len()), &binds).await?;
        report.locked_keys = locked.len();
        if locked.is_empty() {
            tx.rollback().await?;
            return Ok(report);
        }
        let mut binds: Vec<Bind<'_>> = Vec::with_capacity(locked.len() * 2 + 1);
        for (_, destination, key) in &locked {
            binds.push(Bind::Text(destination));
            binds.push(Bind::Text(key));
        }
        binds.push(Bind::Int(batch));
        let rows = super::db::fetch_rows::<DB>(&mut tx, &st.rows(locked.len()), &binds).await?;
        report.rows = rows.len();

        let Outcome {
            published,
            dead,
            failures,
        } = self.publish(&rows).await;
        let flushed = self.flush(&published).await;
        if let Err(e) = flushed {
            // Nothing is known to be stored: keep every row, publish again later.
            let _ = tx.rollback().await;
            return Err(e);
        }
        for gone in &dead {
            let binds = [
                Bind::Int(gone.attempts),
                Bind::Text(&gone.reason),
                Bind::Int(now),
                Bind::Int(gone.row.seq),
            ];
            DB::execute(&mut *tx, &st.dead_letter, &binds).await?;
        }
        let seqs: Vec<i64> = published
            .iter()
            .map(|r| r.seq)
            .chain(dead.iter().map(|d| d.row.seq))
            .collect();
        for chunk in seqs.chunks(DELETE_CHUNK) {
            let binds: Vec<Bind<'_>> = chunk.iter().map(|s| Bind::Int(*s)).collect();
            DB::execute(&mut *tx, &st.delete(chunk.len()), &binds).await?;
        }
        // The backoff runs from now, not from the batch's start: a batch
        // that publishes many keys may take a while.
        let failed_at = crate::store::now_ms();
        for (row, error) in &failures {
            let failed = u32::try_from(row.attempts.saturating_add(1)).unwrap_or(u32::MAX);
            let delay = self.options.backoff(failed);
            let retry_at =
                failed_at.saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
            let binds = [Bind::Int(retry_at), Bind::Text(error), Bind::Int(row.seq)];
            DB::execute(&mut *tx, &st.fail, &binds).await?;
        }
        tx.commit().await?;

        report.published = published.len();
        report.dead = dead.len();
        report.failed = !failures.is_empty();
        report.failures = failures.len();
        for row in &published {
            metrics::counter!("idemq_outbox_published_total", "destination" => row.aggregatetype.clone())
                .increment(1);
        }
        for gone in &dead {
            metrics::counter!("idemq_outbox_dead_total", "destination" => gone.row.aggregatetype.clone())
                .increment(1);
            tracing::error!(
                relay = %self.options.name,
                id = %gone.row.id,
                destination = %gone.row.aggregatetype,
                key = %gone.row.aggregateid,
                attempts = gone.attempts,
                table = %st.dead_table,
                reason = %gone.reason,
                "outbox row given up and moved to the dead-letter table; the later rows of its key go on"
            );
        }
        metrics::counter!("idemq_outbox_batches_total").increment(1);
        for (row, error) in &failures {
            metrics::counter!("idemq_outbox_publish_failures_total", "destination" => row.aggregatetype.clone())
                .increment(1);
            tracing::warn!(
                relay = %self.options.name,
                id = %row.id,
                destination = %row.aggregatetype,
                key = %row.aggregateid,
                attempts = row.attempts + 1,
                %error,
                "outbox publish failed; the row and the later rows of its key wait for a retry"
            );
        }
        tracing::debug!(relay = %self.options.name, published = report.published, dead = report.dead, failures = report.failures, locked_keys = report.locked_keys, "outbox batch committed");
        Ok(report)
    }

    /// Publishes `rows` (in `seq` order, as read): one lane per (destination,
    /// key), the lanes' rows one after another, up to
    /// [`max_in_flight`](RelayOptions::max_in_flight) lanes at once. A free
    /// slot goes to the lane whose next row is the oldest, so with one slot
    /// this is `seq` order. A failure that leaves its row for a retry ends
    /// its lane (the key's later rows stay, in order, behind it); rows
    /// given up on are set aside and their lane goes on.
    async fn publish<'r>(&self, rows: &'r [RawRow]) -> Outcome<'r> {
        let mut outcome = Outcome {
            published: Vec::with_capacity(rows.len()),
            dead: Vec::new(),
            failures: Vec::new(),
        };
        let mut lanes: Vec<VecDeque<&'r RawRow>> = Vec::new();
        let mut lane_of: HashMap<(&str, &str), usize> = HashMap::new();
        for row in rows {
            let key = (row.aggregatetype.as_str(), row.aggregateid.as_str());
            let lane = *lane_of.entry(key).or_insert_with(|| {
                lanes.push(VecDeque::new());
                lanes.len() - 1
            });
            lanes[lane].push_back(row);
        }
        // Lanes with a row to publish and none in flight, by that row's seq.
        let mut waiting: BTreeMap<i64, usize> = lanes
            .iter()
            .enumerate()
            .filter_map(|(lane, rows)| rows.front().map(|row| (row.seq, lane)))
            .collect();
        let limit = self.options.max_in_flight.max(1);
        let mut in_flight = FuturesUnordered::new();
        loop {
            while in_flight.len() < limit {
                let Some((_, lane)) = waiting.pop_first() else {
                    break;
                };
                let Some(row) = lanes[lane].pop_front() else {
                    continue;
                };
                in_flight.push(async move { (lane, row, self.publish_one(row).await) });
            }
            let Some((lane, row, result)) = in_flight.next().await else {
                break;
            };
            if let Err((error, permanent)) = result {
                let attempts = row.attempts.saturating_add(1);
                let reason = if permanent {
                    format!("permanent publish error: {error}")
                } else if self.options.exhausted(attempts) {
                    format!("gave up after {attempts} failed publishes: {error}")
                } else {
                    // The key stops here; its later rows stay for later.
                    outcome.failures.push((row, error));
                    lanes[lane].clear();
                    continue;
                };
                outcome.dead.push(Dead {
                    row,
                    attempts,
                    reason,
                });
            } else {
                outcome.published.push(row);
            }
            if let Some(next) = lanes[lane].front() {
                waiting.insert(next.seq, lane);
            }
        }
        outcome
    }

    /// Publishes one row; a failure comes with whether it is permanent.
    async fn publish_one(&self, row: &RawRow) -> Result<(), (String, bool)> {
        let Some(publisher) = self.publisher(&row.aggregatetype) else {
            // The relay's configuration, not the row: another relay may route it.
            return Err(("no publisher for the destination".into(), false));
        };
        let message = message(row).map_err(|e| (e, true))?;
        match tokio::time::timeout(self.options.publish_timeout, publisher.publish(&message)).await
        {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                let permanent = e.kind() == SourceErrorKind::Config;
                Err((e.to_string(), permanent))
            }
            Err(_) => Err((
                format!("not confirmed within {:?}", self.options.publish_timeout),
                false,
            )),
        }
    }

    /// Flushes every publisher that published one of `rows`.
    async fn flush(&self, rows: &[&RawRow]) -> Result<(), OutboxError> {
        let mut used: Vec<&Arc<dyn Publisher>> = Vec::new();
        for row in rows {
            if let Some(p) = self.publisher(&row.aggregatetype) {
                if !used.iter().any(|u| Arc::ptr_eq(u, p)) {
                    used.push(p);
                }
            }
        }
        for publisher in used {
            match tokio::time::timeout(self.options.publish_timeout, publisher.flush()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(OutboxError::Publish(format!("flush: {e}"))),
                Err(_) => {
                    return Err(OutboxError::Publish(format!(
                        "flush not confirmed within {:?}",
                        self.options.publish_timeout
                    )))
                }
            }
        }
        Ok(())
    }

    /// Runs batches until `shutdown` completes (checked between batches: a
    /// batch in flight is finished) or, with
    /// [`idle_exit`](RelayOptions::idle_exit), until nothing was published
    /// for that long. Waits [`poll_interval`](RelayOptions::poll_interval)
    /// when the outbox is empty (PostgreSQL: or until an insert's `NOTIFY`).
    /// Database and broker failures are logged and retried with backoff;
    /// only errors that a retry cannot cure (a missing table, a relay
    /// without publishers) end the run.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<RelayStats, OutboxError> {
        let notify = Arc::new(Notify::new());
        let _listener = if self.options.listen {
            let channel = self.outbox.statements().channel().to_owned();
            match DB::listen(&self.pool, channel, Arc::clone(&notify)).await {
                Ok(task) => AbortOnDrop(task),
                Err(e) => {
                    tracing::warn!(relay = %self.options.name, error = %e, "cannot LISTEN for outbox inserts; polling only");
                    AbortOnDrop(None)
                }
            }
        } else {
            AbortOnDrop(None)
        };
        tokio::pin!(shutdown);
        let mut stats = RelayStats::default();
        let mut last_published = Instant::now();
        let mut errors = 0u32;
        tracing::info!(relay = %self.options.name, table = %self.outbox.table(), "outbox relay started");
        loop {
            let wait = match self.relay_once().await {
                Ok(report) => {
                    errors = 0;
                    let progress = report.published > 0 || report.dead > 0;
                    if progress || report.failed {
                        stats.batches += 1;
                    }
                    stats.published += report.published as u64;
                    stats.dead += report.dead as u64;
                    if progress {
                        last_published = Instant::now();
                    }
                    stats.failures += report.failures as u64;
                    if progress {
                        // More may be ready; the failed keys wait for
                        // their own `available_at`.
                        Duration::ZERO
                    } else if report.failed {
                        self.options.initial_backoff
                    } else if report.ready_keys > report.locked_keys {
                        // Keys held by other relays: look again soon.
                        self.options.poll_interval.min(Duration::from_millis(50))
                    } else {
                        self.options.poll_interval
                    }
                }
                Err(e) if e.is_transient() => {
                    errors = errors.saturating_add(1);
                    let delay = self.options.backoff(errors);
                    tracing::warn!(relay = %self.options.name, error = %e, retry_in = ?delay, "outbox batch failed");
                    delay
                }
                Err(e) => {
                    tracing::error!(relay = %self.options.name, error = %e, "outbox relay stopped");
                    return Err(e);
                }
            };
            let mut wait = wait;
            if let Some(idle) = self.options.idle_exit {
                let idle_for = last_published.elapsed();
                if idle_for >= idle {
                    tracing::info!(relay = %self.options.name, %stats, "outbox relay idle; exiting");
                    break;
                }
                wait = wait.min(idle - idle_for);
            }
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                () = notify.notified(), if !wait.is_zero() => {}
                () = tokio::time::sleep(wait) => {}
            }
        }
        tracing::info!(relay = %self.options.name, %stats, "outbox relay stopped");
        Ok(stats)
    }
}

/// What the publishes of one batch did.
struct Outcome<'r> {
    /// Rows the broker accepted, in the order it confirmed them.
    published: Vec<&'r RawRow>,
    /// Rows given up on.
    dead: Vec<Dead<'r>>,
    /// The rows that failed and stay for a retry, with the error, at most
    /// one per key: each key's publishing stopped there.
    failures: Vec<(&'r RawRow, String)>,
}

/// A row given up on.
struct Dead<'r> {
    row: &'r RawRow,
    /// Failed publishes, this one included.
    attempts: i64,
    reason: String,
}

/// Aborts the listener task when the run ends (or is dropped).
struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// The message of one row: id = `id`, key = `aggregateid`, headers
/// `event_id`, `event_type` (if set), then the row's own headers.
fn message(row: &RawRow) -> Result<Message, String> {
    let mut headers = Headers::new().with(EVENT_ID_HEADER, row.id.as_bytes());
    if !row.event_type.is_empty() {
        headers.insert(EVENT_TYPE_HEADER, row.event_type.as_bytes());
    }
    if let Some(text) = row.headers.as_deref().filter(|t| !t.trim().is_empty()) {
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| format!("the headers column is not JSON: {e}"))?;
        if !value.is_object() {
            return Err("the headers column is not a JSON object".into());
        }
        for (name, value) in Headers::from_json(&value).iter() {
            if headers.get(name).is_none() {
                headers.insert(name, value);
            }
        }
    }
    Ok(Message {
        id: Some(row.id.clone()),
        key: Some(row.aggregateid.clone()),
        headers,
        payload: row.payload.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(headers: Option<&str>) -> RawRow {
        RawRow {
            seq: 1,
            id: "e-1".into(),
            aggregatetype: "orders".into(),
            aggregateid: "o-1".into(),
            event_type: "OrderPaid".into(),
            headers: headers.map(str::to_owned),
            payload: b"{}".to_vec(),
            attempts: 0,
        }
    }

    #[test]
    fn rows_become_messages() {
        let m = message(&row(Some(r#"{"trace":"t-1","event_id":"forged"}"#))).unwrap();
        assert_eq!(m.id.as_deref(), Some("e-1"));
        assert_eq!(m.key.as_deref(), Some("o-1"));
        assert_eq!(m.headers.get("event_id"), Some(&b"e-1"[..]));
        assert_eq!(m.headers.get("event_type"), Some(&b"OrderPaid"[..]));
        assert_eq!(m.headers.get("trace"), Some(&b"t-1"[..]));
        assert_eq!(
            m.headers.iter().count(),
            3,
            "the forged event_id is dropped"
        );
        assert!(message(&row(Some("[1]"))).is_err());
        assert!(message(&row(Some("{"))).is_err());
        assert_eq!(message(&row(None)).unwrap().headers.iter().count(), 2);
    }

    #[test]
    fn backoff_doubles_up_to_the_limit() {
        let o = RelayOptions::default();
        assert_eq!(o.backoff(1), Duration::from_millis(200));
        assert_eq!(o.backoff(2), Duration::from_millis(400));
        assert_eq!(o.backoff(100), Duration::from_secs(30));
    }

    #[test]
    fn attempts_run_out_only_with_a_limit() {
        let mut o = RelayOptions::default();
        assert!(!o.exhausted(i64::MAX), "the default waits forever");
        o.max_attempts = Some(10);
        assert!(!o.exhausted(9) && o.exhausted(10));
        o.max_attempts = Some(0);
        assert!(!o.exhausted(1_000));
    }
}
