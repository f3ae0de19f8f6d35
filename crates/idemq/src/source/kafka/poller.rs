//! The polling thread: fetches records into the partition buffers, pauses
//! and resumes partitions, and makes the seeks to stored watermarks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::Consumer;
use rdkafka::message::{BorrowedMessage, Headers as _, Message as _};
use rdkafka::{Offset, TopicPartitionList};

use super::partition::Record;
use super::source::{KafkaConsumer, Shared};
use super::MESSAGE_ID_HEADER;
use crate::error::InputError;
use crate::message::{Headers, Message};

/// The background thread: polls records into the partition buffers, serves
/// rebalances (through [`KafkaContext`]), pauses and resumes partitions.
///
/// [`KafkaContext`]: super::source::KafkaContext
pub(super) struct Poller {
    pub(super) consumer: Arc<KafkaConsumer>,
    pub(super) shared: Arc<Shared>,
    pub(super) stop: Arc<AtomicBool>,
}

impl Poller {
    pub(super) fn run(self) {
        while !self.stop.load(Ordering::SeqCst) {
            match self.consumer.poll(Duration::from_millis(100)) {
                None => {}
                Some(Ok(msg)) => {
                    let partition = msg.partition();
                    let record = record_of(&self.shared.topic, &msg);
                    drop(msg);
                    let mut state = self.shared.state();
                    match state.partitions.get_mut(&partition) {
                        Some(p) if p.floor.is_some_and(|floor| record.offset < floor) => {
                            self.shared.counters.fetched.fetch_add(1, Ordering::SeqCst);
                            self.shared
                                .counters
                                .dropped_below_watermark
                                .fetch_add(1, Ordering::SeqCst);
                        }
                        Some(p) => {
                            self.shared.counters.fetched.fetch_add(1, Ordering::SeqCst);
                            p.buffer.push_back(record);
                        }
                        None => {
                            tracing::debug!(partition, "record of an unassigned partition dropped")
                        }
                    }
                    drop(state);
                    self.shared.ready.notify_waiters();
                }
                Some(Err(e)) => {
                    tracing::warn!(topic = %self.shared.topic, error = %e, "kafka consumer error")
                }
            }
            self.flow_control();
            self.apply_seeks();
        }
        tracing::debug!(topic = %self.shared.topic, "kafka source stopped; closing the consumer");
        // Dropping the last strong reference closes the consumer: the
        // revocation commits what is settled. Ackers only hold weak references.
    }

    /// Makes the seeks [`KafkaSource::seek_assigned`] asked for. On this
    /// thread, between two polls, so every record polled afterwards comes
    /// from the new position: the buffer, fetched from the old one, is
    /// dropped (it is fetched again in order). If a seek fails, the buffer
    /// (all at or past the watermark) is kept and delivery goes on in order.
    ///
    /// [`KafkaSource::seek_assigned`]: super::KafkaSource::seek_assigned
    fn apply_seeks(&self) {
        let wanted: Vec<(i32, i64, u64)> = self
            .shared
            .state()
            .partitions
            .iter()
            .filter_map(|(id, p)| p.seek_to.map(|next| (*id, next, p.generation)))
            .collect();
        if wanted.is_empty() {
            return;
        }
        let mut sought = Vec::new();
        for (partition, next, generation) in wanted {
            let result = self.consumer.seek(
                &self.shared.topic,
                partition,
                Offset::Offset(next),
                Duration::from_secs(10),
            );
            let mut state = self.shared.state();
            let Some(p) = state.partitions.get_mut(&partition) else {
                continue;
            };
            if p.generation != generation {
                continue;
            }
            p.seek_to = None;
            match result {
                Ok(()) => {
                    p.buffer.clear();
                    sought.push((partition, next));
                }
                Err(e) => {
                    tracing::warn!(topic = %self.shared.topic, partition, error = %e, "seeking a partition to its watermark failed; records below it are dropped as they arrive")
                }
            }
        }
        self.shared
            .counters
            .sought
            .fetch_add(sought.len() as u64, Ordering::SeqCst);
        self.shared.ready.notify_waiters();
        if !sought.is_empty() {
            sought.sort_unstable();
            tracing::info!(topic = %self.shared.topic, ?sought, "assigned kafka partitions sought to their stored watermarks");
        }
    }

    fn flow_control(&self) {
        let (mut pause, mut resume) = (Vec::new(), Vec::new());
        {
            let mut state = self.shared.state();
            let max = self.shared.max_buffered;
            for (id, p) in state.partitions.iter_mut() {
                if !p.paused && p.buffer.len() >= max {
                    p.paused = true;
                    pause.push(*id);
                } else if p.paused && p.buffer.len() <= max / 2 {
                    p.paused = false;
                    resume.push(*id);
                }
            }
        }
        let apply = |list: &[i32], pause: bool| {
            if list.is_empty() {
                return;
            }
            let mut tpl = TopicPartitionList::new();
            for p in list {
                tpl.add_partition(&self.shared.topic, *p);
            }
            let result = if pause {
                self.consumer.pause(&tpl)
            } else {
                self.consumer.resume(&tpl)
            };
            if let Err(e) = result {
                tracing::warn!(error = %e, pause, "pausing/resuming kafka partitions failed");
            }
        };
        apply(&pause, true);
        apply(&resume, false);
    }
}

fn record_of(topic: &str, msg: &BorrowedMessage<'_>) -> Record {
    let partition = msg.partition();
    let offset = msg.offset();
    let mut defect = None;
    let mut headers = Headers::new();
    if let Some(h) = msg.headers() {
        for header in h.iter() {
            headers.insert(header.key, header.value.unwrap_or_default());
        }
    }
    let id = match headers.get(MESSAGE_ID_HEADER).map(std::str::from_utf8) {
        Some(Ok(id)) => id.to_owned(),
        Some(Err(_)) => {
            defect = Some(InputError::HeaderNotUtf8(MESSAGE_ID_HEADER.into()));
            format!("{topic}-{partition}@{offset}")
        }
        None => format!("{topic}-{partition}@{offset}"),
    };
    let key = match msg.key().map(std::str::from_utf8) {
        None => None,
        Some(Ok(k)) => Some(k.to_owned()),
        Some(Err(e)) => {
            defect = Some(InputError::Malformed(format!(
                "the record key is not valid UTF-8: {e}"
            )));
            None
        }
    };
    Record {
        offset,
        message: Message {
            id: Some(id),
            key,
            headers,
            payload: msg.payload().unwrap_or_default().to_vec(),
        },
        defect,
        count: 1,
    }
}
