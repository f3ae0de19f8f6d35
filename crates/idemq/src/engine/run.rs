//! The run loop of every mode: pull deliveries from a source, order them
//! in key lanes, form units of work, keep N in flight, count outcomes.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;

use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::{JoinError, JoinSet};
use tokio::time::Instant;

use super::consumer::{lane_key, Consumer, Identity};
use super::lanes::{KeyLanes, LaneEnd, LaneRelease, LaneTicket};
use super::pipeline::Member;
use super::unit::single::PerMessage;
use super::unit::Mode;
use crate::error::{InputError, SourceError};
use crate::message::DeliveryMeta;
use crate::outcome::{Outcome, OutcomeKind, Summary};
use crate::source::{Delivery, Source};
use crate::store::Store;

/// Deliveries read ahead of those running, as a multiple of what runs at
/// once: room for other keys to run while copies of one key wait in its lane.
const READ_AHEAD: usize = 2;

/// How long closing the source may take after a stop whose grace period
/// is spent: closing is what commits a partitioned log's settled offsets.
const CLOSE_AT_LEAST: Duration = Duration::from_secs(1);

/// How the run loop forms units of work from the deliveries it reads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Units {
    /// At most this many deliveries per unit (1: a unit per delivery).
    pub(crate) max_size: usize,
    /// After the first delivery of a unit arrived, wait at most this long
    /// for more before running it.
    pub(crate) max_wait: Duration,
}

impl Units {
    /// A unit per delivery.
    pub(crate) const ONE: Self = Self {
        max_size: 1,
        max_wait: Duration::ZERO,
    };
}

/// What the run loop needs of a mode: whether a partitioned source may hand
/// out many records of a partition at once, what a delivery claims, and
/// how a unit is processed. Every [`Mode`] is one; batch mode dispatches to
/// its store's batch unit.
pub(crate) trait Runner<S: Store>: Clone + Send + Sync + 'static {
    /// See [`Mode::out_of_order`].
    fn out_of_order(&self) -> bool;

    /// See [`Mode::claim_identity`].
    fn claim_identity(
        &self,
        meta: &DeliveryMeta,
        identity: &Identity,
        defect: Option<&InputError>,
    ) -> Identity;

    /// Takes a unit through the pipeline; its outcomes in order.
    fn process<'a>(
        &'a self,
        consumer: &'a Consumer<S>,
        members: Vec<(Member, Identity)>,
    ) -> BoxFuture<'a, Vec<Outcome>>;
}

/// A [`Mode`] as the run loop runs it: each unit straight through the
/// pipeline.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Direct<M>(pub(crate) M);

impl<S: Store, M: Mode<S> + Clone + 'static> Runner<S> for Direct<M> {
    fn out_of_order(&self) -> bool {
        self.0.out_of_order()
    }

    fn claim_identity(
        &self,
        meta: &DeliveryMeta,
        identity: &Identity,
        defect: Option<&InputError>,
    ) -> Identity {
        self.0.claim_identity(meta, identity, defect)
    }

    fn process<'a>(
        &'a self,
        consumer: &'a Consumer<S>,
        members: Vec<(Member, Identity)>,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(consumer.process_unit(&self.0, members))
    }
}

/// A member ready for a unit, with the read-ahead room it holds.
type Ready = (Member, Identity, Admission);

/// A delivery's room in the read-ahead, held from its read until it is
/// settled; counted in the gauge `idemq_in_flight` meanwhile.
struct Admission {
    _permit: OwnedSemaphorePermit,
    _counted: Counted,
}

/// One unit of a gauge, from its creation until its drop (an aborted task
/// included).
struct Counted(metrics::Gauge);

impl Counted {
    fn new(gauge: &metrics::Gauge) -> Self {
        gauge.increment(1.0);
        Self(gauge.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

/// Waits for the earlier delivery of `ticket`'s key, counted in the gauge
/// `idemq_lane_waiting` while it does.
async fn wait_counted(ticket: &mut LaneTicket, waiting: &metrics::Gauge) -> Option<LaneEnd> {
    let _waiting = ticket.waits().then(|| Counted::new(waiting));
    ticket.wait().await
}

impl<S: Store> Consumer<S> {
    /// Runs `source` until it ends, with up to
    /// [`concurrency`](super::ConsumerBuilder::concurrency) messages handled
    /// at once, and returns the outcome counts. Deliveries of one business
    /// key are handled one after the other, in the source's order; different
    /// keys run concurrently, also within one partition of a partitioned log
    /// ([`Source::settle_out_of_order`]). Every delivery is settled before it
    /// returns.
    pub async fn run(&self, source: impl Source) -> Result<Summary, SourceError> {
        self.run_until(source, std::future::pending::<()>()).await
    }

    /// Like [`run`](Self::run), but stops taking new deliveries when
    /// `shutdown` completes, gives the ones in flight up to
    /// [`shutdown_grace`](super::ConsumerBuilder::shutdown_grace) to finish
    /// and settle (abandoning the rest to their source), and returns.
    pub async fn run_until(
        &self,
        source: impl Source,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Summary, SourceError> {
        self.run_units(source, shutdown, Direct(PerMessage), Units::ONE)
            .await
    }

    /// The loop of every mode: reads deliveries ahead, identifies each once
    /// (key and fingerprint), orders it in its key lane, forms units of
    /// `mode` of up to `units.max_size` members, and runs up to
    /// `concurrency` units at once through the pipeline, until the source
    /// ends or `shutdown` completes; then finishes what it read.
    ///
    /// Deliveries with the same business key go through one key lane
    /// (`super::lanes`): each waits until the previous one of its key ended
    /// (also across units), so the first copy in the source's order is the
    /// first to claim the key. When the previous copy was nacked to be
    /// retried, the next one is nacked with the same delay without claiming
    /// (a later copy never overtakes an earlier one that waits for its
    /// retry). Deliveries without a key (bad input) wait for nothing.
    ///
    /// Memory is bounded: at most `READ_AHEAD` × `concurrency` ×
    /// `max_size` deliveries are read and unsettled at a time, and a
    /// partitioned source is allowed `concurrency` × `max_size` unsettled
    /// records of one partition (unless the mode needs them one at a time),
    /// so that a flood of one key in one partition cannot take the room of
    /// the others.
    pub(crate) async fn run_units<R>(
        &self,
        mut source: impl Source,
        shutdown: impl Future<Output = ()>,
        mode: R,
        units: Units,
    ) -> Result<Summary, SourceError>
    where
        R: Runner<S>,
    {
        let concurrency = self.inner.concurrency;
        let max_size = units.max_size.max(1);
        let read_ahead = concurrency
            .saturating_mul(max_size)
            .saturating_mul(READ_AHEAD);
        if mode.out_of_order() {
            // One partition gets at most what runs at once: half the
            // read-ahead. Copies of a key waiting in its lane (a flood of one
            // key) then hold at most that half, and the other partitions
            // keep the rest to run in.
            source.settle_out_of_order(concurrency.saturating_mul(max_size));
        }
        let admitted = Arc::new(Semaphore::new(read_ahead));
        let running = Arc::new(Semaphore::new(concurrency));
        let lanes = Arc::new(KeyLanes::default());
        let in_flight = metrics::gauge!("idemq_in_flight", "consumer" => self.inner.name.clone());
        let lane_waiting =
            metrics::gauge!("idemq_lane_waiting", "consumer" => self.inner.name.clone());
        // Units of many are formed by one task from the members whose turn
        // in their lane has come; a unit of one runs in its member's task.
        // In a JoinSet, so that dropping this future (a cancelled run)
        // aborts the former and the units it runs, as it aborts the tasks.
        let mut former: JoinSet<Summary> = JoinSet::new();
        let ready = if max_size > 1 {
            let (ready, members) = mpsc::channel::<Ready>(read_ahead);
            former.spawn(self.clone().form_units(
                mode.clone(),
                members,
                Arc::clone(&running),
                Units { max_size, ..units },
            ));
            Some(ready)
        } else {
            None
        };
        let mut tasks: JoinSet<Option<OutcomeKind>> = JoinSet::new();
        let mut summary = Summary::default();
        let mut failure = None;
        let mut stopped = false;
        tokio::pin!(shutdown);
        loop {
            while let Some(done) = tasks.try_join_next() {
                count(&mut summary, done);
            }
            let permit = tokio::select! {
                permit = Arc::clone(&admitted).acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => break,
                },
                _ = &mut shutdown => { stopped = true; break },
            };
            let next = tokio::select! {
                next = source.next() => next,
                _ = &mut shutdown => { stopped = true; break },
            };
            let delivery = match next {
                Ok(Some(delivery)) => delivery,
                Ok(None) => break,
                Err(e) => {
                    tracing::error!(consumer = %self.inner.name, error = %e, "source failed");
                    failure = Some(e);
                    break;
                }
            };
            let admission = Admission {
                _permit: permit,
                _counted: Counted::new(&in_flight),
            };
            let identity = self.identify(&delivery.message, delivery.defect.as_ref());
            let ticket = lane_key(&identity).map(|key| lanes.admit(key.to_owned()));
            let consumer = self.clone();
            let mode = mode.clone();
            let running = Arc::clone(&running);
            let ready = ready.clone();
            let lane_waiting = lane_waiting.clone();
            tasks.spawn(async move {
                // The lane is released once the outcome is decided, before
                // the settle (see `LaneRelease`).
                let lane = match ticket {
                    None => LaneRelease::none(),
                    Some(mut ticket) => match wait_counted(&mut ticket, &lane_waiting).await {
                        Some(LaneEnd::RetryLater(delay)) => {
                            ticket.finish(LaneEnd::RetryLater(delay));
                            let key = lane_key(&identity).map(str::to_owned);
                            let outcome = consumer.defer(delivery, key, delay).await;
                            drop(admission);
                            return Some(outcome.kind());
                        }
                        _ => ticket.into(),
                    },
                };
                let (member, claim) = consumer.member(&mode, delivery, &identity, lane);
                match ready {
                    // Counted by the unit former; if it is gone, the member
                    // is dropped unsettled and its source redelivers it.
                    Some(ready) => {
                        let _ = ready.send((member, claim, admission)).await;
                        None
                    }
                    None => {
                        let _running = running.acquire_owned().await.ok();
                        let mut outcomes = mode.process(&consumer, vec![(member, claim)]).await;
                        drop(admission);
                        outcomes.pop().map(|outcome| outcome.kind())
                    }
                }
            });
        }
        // The tasks hold their own senders: the former ends once they have.
        drop(ready);
        let grace = self.inner.shutdown_grace;
        // Asked to stop: the grace period runs from now. The source may
        // also have ended by itself (end of input, idle exit, failure):
        // then the drain waits as long as it takes, unless a stop is asked
        // meanwhile, which starts the grace period at that moment.
        let mut deadline = stopped.then(|| Instant::now() + grace);
        let drained = {
            let finished = async {
                while let Some(done) = tasks.join_next().await {
                    count(&mut summary, done);
                }
                while let Some(formed) = former.join_next().await {
                    match formed {
                        Ok(formed) => summary.merge(&formed),
                        Err(e) => tracing::error!(error = %e, "the unit former failed"),
                    }
                }
            };
            tokio::pin!(finished);
            if deadline.is_none() {
                let stop_asked = tokio::select! {
                    () = &mut finished => false,
                    () = &mut shutdown => true,
                };
                if stop_asked {
                    stopped = true;
                    deadline = Some(Instant::now() + grace);
                }
            }
            match deadline {
                Some(deadline) if stopped => {
                    tokio::time::timeout_at(deadline, finished).await.is_ok()
                }
                _ => true,
            }
        };
        if let (false, Some(_)) = (drained, deadline) {
            // Read and not yet settled: what the aborts leave to the source.
            let in_flight = read_ahead.saturating_sub(admitted.available_permits());
            tracing::warn!(
                consumer = %self.inner.name,
                in_flight,
                grace_ms = grace.as_millis() as u64,
                "the shutdown grace period ended: abandoning the deliveries in flight to be redelivered"
            );
            tasks.abort_all();
            former.abort_all();
            while let Some(done) = tasks.join_next().await {
                count(&mut summary, done);
            }
            while let Some(formed) = former.join_next().await {
                if let Ok(formed) = formed {
                    summary.merge(&formed);
                }
            }
            summary.record_abandoned(in_flight as u64);
        }
        // Closing commits what settled (partitioned logs). After a stop, a
        // broker that no longer answers gets what is left of the grace, at
        // least 1 s; before one, as long as it takes unless a stop comes.
        let close = async {
            if let Some(deadline) = deadline {
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .max(CLOSE_AT_LEAST);
                return tokio::time::timeout(left, source.close()).await.is_ok();
            }
            let closing = source.close();
            tokio::pin!(closing);
            let stop_asked = tokio::select! {
                () = &mut closing => false,
                () = &mut shutdown => true,
            };
            !stop_asked
                || tokio::time::timeout(grace.max(CLOSE_AT_LEAST), closing)
                    .await
                    .is_ok()
        };
        if !close.await {
            tracing::warn!(consumer = %self.inner.name, "closing the source outlasted the shutdown grace period");
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(summary),
        }
    }

    /// Forms units of up to `units.max_size` members from `members` (the
    /// first waits as long as it takes, the rest at most `units.max_wait`),
    /// runs up to `running` of them at once, and counts their outcomes
    /// until `members` ends.
    async fn form_units<R>(
        self,
        mode: R,
        mut members: mpsc::Receiver<Ready>,
        running: Arc<Semaphore>,
        units: Units,
    ) -> Summary
    where
        R: Runner<S>,
    {
        let mut summary = Summary::default();
        let mut unit_tasks: JoinSet<Vec<OutcomeKind>> = JoinSet::new();
        let record = |summary: &mut Summary, done: Result<Vec<OutcomeKind>, JoinError>| match done {
            Ok(kinds) => kinds.into_iter().for_each(|k| summary.record(k)),
            // The unit's deliveries were dropped unsettled: the source redelivers them.
            Err(e) => tracing::error!(error = %e, "a unit task failed"),
        };
        while let Some(first) = members.recv().await {
            while let Some(done) = unit_tasks.try_join_next() {
                record(&mut summary, done);
            }
            let mut unit = Vec::with_capacity(units.max_size);
            unit.push(first);
            let deadline = tokio::time::Instant::now() + units.max_wait;
            while unit.len() < units.max_size {
                tokio::select! {
                    next = members.recv() => match next {
                        Some(member) => unit.push(member),
                        None => break,
                    },
                    _ = tokio::time::sleep_until(deadline) => break,
                }
            }
            let permit = Arc::clone(&running).acquire_owned().await.ok();
            let consumer = self.clone();
            let mode = mode.clone();
            unit_tasks.spawn(async move {
                let (members, room): (Vec<_>, Vec<_>) = unit
                    .into_iter()
                    .map(|(member, claim, admission)| ((member, claim), admission))
                    .unzip();
                let outcomes = mode.process(&consumer, members).await;
                drop(room);
                drop(permit);
                outcomes.iter().map(Outcome::kind).collect()
            });
        }
        while let Some(done) = unit_tasks.join_next().await {
            record(&mut summary, done);
        }
        summary
    }

    /// Nacks `delivery` (of `key`) with `delay` without claiming it: an
    /// earlier delivery of its key waits for a retry and must go first.
    async fn defer(&self, delivery: Delivery, key: Option<String>, delay: Duration) -> Outcome {
        let (_message, meta, _defect, acker) = delivery.into_parts();
        let outcome = Outcome::RetryLater {
            key,
            attempts: 0,
            delay,
            error: "an earlier delivery of this key waits for its retry".into(),
        };
        self.settle(&outcome, acker).await;
        self.report(&outcome, &meta);
        outcome
    }
}

fn count(summary: &mut Summary, done: Result<Option<OutcomeKind>, JoinError>) {
    match done {
        Ok(Some(kind)) => summary.record(kind),
        // Handed to a unit: counted there.
        Ok(None) => {}
        // The delivery was dropped unsettled: its source redelivers it.
        Err(e) => tracing::error!(error = %e, "a message task failed"),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use crate::source::queue::MemoryQueue;
    use crate::store::memory::MemoryStore;
    use crate::store::StoreAdmin;
    use crate::{Consumer, HandlerError, KeySpec, Message, OutcomeKind};

    /// A payload over `max_message_bytes` is dead-lettered as `too_large`
    /// without running the handler, and its letter keeps only the first
    /// `max_message_bytes` bytes; the messages around it are handled.
    #[tokio::test]
    async fn a_payload_over_the_limit_is_dead_lettered_with_its_head_only() {
        let calls = Arc::new(AtomicU32::new(0));
        let consumer = Consumer::builder("capped", MemoryStore::new())
            .key(KeySpec::json("/id"))
            .max_message_bytes(64)
            .handler_fn({
                let calls = Arc::clone(&calls);
                move |_ctx, _lease| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    Box::pin(async { Ok(None) })
                }
            })
            .build()
            .unwrap();
        let queue = MemoryQueue::new("q");
        let big = format!(r#"{{"id":2,"pad":"{}"}}"#, "x".repeat(200));
        for payload in [r#"{"id":1}"#.to_owned(), big, r#"{"id":3}"#.to_owned()] {
            queue.push(Message::new(payload));
        }
        queue.close();
        let summary = consumer.run(queue.source()).await.unwrap();
        assert_eq!(summary.count(OutcomeKind::Processed), 2, "{summary}");
        assert_eq!(summary.count(OutcomeKind::DeadLettered), 1, "{summary}");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        let letters = consumer.store().dead_letters(None, 0, 10).await.unwrap();
        assert_eq!(letters.len(), 1, "{letters:?}");
        assert_eq!(letters[0].reason, "too_large");
        assert_eq!(letters[0].message.payload.len(), 64);
        assert!(
            letters[0].error.contains("217 bytes"),
            "{}",
            letters[0].error
        );
    }

    /// Headers count against `max_message_bytes`: a small payload with a
    /// huge header is `too_large`, and its letter keeps the headers that
    /// fit and drops the one that does not, staying within the limit.
    #[tokio::test]
    async fn a_huge_header_makes_a_message_too_large_and_is_dropped_from_its_letter() {
        let consumer = Consumer::builder("capped-headers", MemoryStore::new())
            .key(KeySpec::json("/id"))
            .max_message_bytes(1024)
            .handler_fn(|_ctx, _lease| Box::pin(async { Ok(None) }))
            .build()
            .unwrap();
        let queue = MemoryQueue::new("q");
        queue.push(Message::new(r#"{"id":1}"#).with_header("trace", "t-1"));
        queue.push(
            Message::new(r#"{"id":2}"#)
                .with_header("trace", "t-2")
                .with_header("blob", vec![b'b'; 4096]),
        );
        queue.close();
        let summary = consumer.run(queue.source()).await.unwrap();
        assert_eq!(summary.count(OutcomeKind::Processed), 1, "{summary}");
        assert_eq!(summary.count(OutcomeKind::DeadLettered), 1, "{summary}");
        let letters = consumer.store().dead_letters(None, 0, 10).await.unwrap();
        assert_eq!(letters[0].reason, "too_large");
        let kept = &letters[0].message;
        assert_eq!(kept.headers.get("trace"), Some(&b"t-2"[..]));
        assert_eq!(kept.headers.get("blob"), None);
        assert_eq!(kept.payload, br#"{"id":2}"#);
        assert!(kept.size_bytes() <= 1024);
        assert!(
            letters[0].error.contains("4116 bytes"),
            "{}",
            letters[0].error
        );
    }

    /// A delivery nacked without a delay comes straight back. Its lane is
    /// released before the nack, so the redelivery runs at once (one retry
    /// in all) instead of queueing behind its own earlier attempt and being
    /// deferred as "an earlier delivery of this key waits for its retry".
    #[tokio::test]
    async fn a_redelivery_without_delay_is_not_deferred_behind_itself() {
        for _ in 0..20 {
            let calls = Arc::new(AtomicU32::new(0));
            let consumer = Consumer::builder("lanes", MemoryStore::new())
                .key(KeySpec::json("/id"))
                .handler_fn({
                    let calls = Arc::clone(&calls);
                    move |_ctx, _lease| {
                        let calls = Arc::clone(&calls);
                        Box::pin(async move {
                            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                                Err(HandlerError::retryable("once")
                                    .with_retry_after(Duration::ZERO))
                            } else {
                                Ok(None)
                            }
                        })
                    }
                })
                .build()
                .unwrap();
            let queue = MemoryQueue::new("q");
            queue.push(Message::new(r#"{"id":1}"#));
            queue.close();
            let summary = consumer.run(queue.source()).await.unwrap();
            assert_eq!(summary.count(OutcomeKind::RetryLater), 1, "{summary}");
            assert_eq!(summary.count(OutcomeKind::Processed), 1, "{summary}");
            assert_eq!(calls.load(Ordering::SeqCst), 2);
        }
    }
}
