//! The server's clock, as the lease expiries are judged by it.
//!
//! Every [`REFRESH_EVERY`] the store asks the server for `hello`, whose
//! `localTime` is the server's wall clock, and keeps the offset to the
//! worker's clock, corrected by half the round trip. Between two refreshes
//! the server's time is the worker's clock plus that offset.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use mongodb::bson::doc;
use mongodb::Client;

use crate::store::now_ms;
use crate::sync::lock;

/// How old an offset may get before it is measured again.
pub(super) const REFRESH_EVERY: Duration = Duration::from_secs(30);

/// After a failed measurement, how long before the next try.
const RETRY_AFTER: Duration = Duration::from_secs(2);

/// The estimated offset of the server's clock from this worker's.
#[derive(Debug, Default)]
pub(super) struct ServerClock {
    /// Server time minus worker time, in milliseconds.
    offset_ms: AtomicI64,
    /// When the offset is due to be measured (`None`: now).
    due: Mutex<Option<Instant>>,
    /// Set while one task measures, so that the others do not pile on.
    measuring: AtomicBool,
    /// The server answered a `hello` at least once.
    answered: AtomicBool,
    /// The server answered `hello` without a `localTime` (warned once).
    no_local_time: AtomicBool,
}

impl ServerClock {
    /// The server's time now, in milliseconds since the epoch (estimated).
    ///
    /// Until the server has answered once, every caller asks it (rather
    /// than judge expiries by an offset of zero); afterwards one caller at a
    /// time refreshes the offset while the others use the last one.
    pub(super) async fn now(&self, client: &Client) -> i64 {
        if self.is_due() {
            if !self.answered.load(Ordering::SeqCst) {
                self.measure(client).await;
            } else if !self.measuring.swap(true, Ordering::SeqCst) {
                self.measure(client).await;
                self.measuring.store(false, Ordering::SeqCst);
            }
        }
        now_ms().saturating_add(self.offset_ms.load(Ordering::SeqCst))
    }

    fn is_due(&self) -> bool {
        let due = lock(&self.due);
        due.is_none_or(|at| Instant::now() >= at)
    }

    fn schedule(&self, after: Duration) {
        *lock(&self.due) = Some(Instant::now() + after);
    }

    async fn measure(&self, client: &Client) {
        let sent = now_ms();
        let started = Instant::now();
        let reply = client
            .database("admin")
            .run_command(doc! { "hello": 1 })
            .await;
        let round_trip = i64::try_from(started.elapsed().as_millis()).unwrap_or(i64::MAX);
        match reply {
            Ok(reply) => match reply.get_datetime("localTime") {
                Ok(server) => {
                    let offset = server
                        .timestamp_millis()
                        .saturating_sub(sent.saturating_add(round_trip / 2));
                    self.offset_ms.store(offset, Ordering::SeqCst);
                    self.answered.store(true, Ordering::SeqCst);
                    tracing::debug!(
                        offset_ms = offset,
                        round_trip_ms = round_trip,
                        "server clock measured"
                    );
                    self.schedule(REFRESH_EVERY);
                }
                Err(_) => {
                    if !self.no_local_time.swap(true, Ordering::SeqCst) {
                        tracing::warn!(
                            "the server's hello has no localTime: lease expiry is judged by each worker's own clock"
                        );
                    }
                    self.answered.store(true, Ordering::SeqCst);
                    self.schedule(REFRESH_EVERY);
                }
            },
            Err(e) => {
                tracing::warn!(error = %e.kind, "measuring the server's clock failed; keeping the last offset");
                self.schedule(RETRY_AFTER);
            }
        }
    }
}
